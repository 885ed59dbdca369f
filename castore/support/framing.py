"""Values sent together in one message: each one's length (-1: not sent), then its bytes.

The tiers' node-to-node chunk exchange (castore.tiers.wire) and cooperative reads
(castore.dist.coopread) send chunks to a peer this way over castore's process
group. A frame cut short, or a length that runs past its end, reads as values
not sent: the receiver then treats those chunks as missing.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

_LENGTH = struct.Struct("<q")


def frame(values: Sequence[bytes | memoryview | None]) -> bytearray:
    """Each value's length (-1: not sent), then its bytes; built in place (one copy)."""
    size = sum(_LENGTH.size + (0 if value is None else len(value)) for value in values)
    framed = bytearray(size)
    at = 0
    for value in values:
        _LENGTH.pack_into(framed, at, -1 if value is None else len(value))
        at += _LENGTH.size
        if value is not None:
            framed[at : at + len(value)] = value
            at += len(value)
    return framed


def unframe(data: bytes | bytearray, count: int) -> list[memoryview | None]:
    """The ``count`` values of a frame, as views of ``data``; one cut short or not sent
    is None."""
    values: list[memoryview | None] = []
    at = 0
    view = memoryview(data)
    for _ in range(count):
        if at + _LENGTH.size > len(data):
            values.append(None)
            continue
        (length,) = _LENGTH.unpack_from(data, at)
        at += _LENGTH.size
        if length < 0 or at + length > len(data):
            values.append(None)
            continue
        values.append(view[at : at + length])
        at += length
    return values
