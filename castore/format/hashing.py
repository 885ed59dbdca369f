"""Digests: blake3-256 names for chunks and objects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import blake3

DIGEST_SIZE = 32

Buffer = Any  # bytes, bytearray, memoryview or any object exposing the buffer protocol

# Hash large buffers with blake3's own thread pool; small ones single-threaded
# (spawning work for a few KiB costs more than it saves).
_PARALLEL_THRESHOLD = 1 << 20


@dataclass(frozen=True, order=True)
class Digest:
    """A blake3-256 digest: the name of a chunk or object."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != DIGEST_SIZE:
            raise ValueError(f"a digest is {DIGEST_SIZE} bytes, got {self.raw!r:.80}")

    @classmethod
    def from_hex(cls, text: str) -> Digest:
        try:
            return cls(bytes.fromhex(text))
        except ValueError as exc:
            raise ValueError(f"not a {DIGEST_SIZE}-byte hex digest: {text!r:.80}") from exc

    @property
    def hex(self) -> str:
        return self.raw.hex()

    @property
    def short(self) -> str:
        return self.raw.hex()[:12]

    def __str__(self) -> str:
        return self.hex

    def __repr__(self) -> str:
        return f"Digest({self.short}…)"


def digest_of(data: Buffer) -> Digest:
    """Return the blake3-256 digest of ``data`` without copying it."""
    return Digest(digest_bytes(data))


def digest_bytes(data: Buffer, *, threads: int | None = None) -> bytes:
    """Return the raw 32-byte blake3 digest of ``data`` (releases the GIL).

    ``threads`` defaults to blake3's own pool for large buffers; pass 1 when the
    caller already hashes on several threads.
    """
    view = memoryview(data)
    if threads is None:
        threads = blake3.blake3.AUTO if view.nbytes >= _PARALLEL_THRESHOLD else 1
    return blake3.blake3(view, max_threads=threads).digest()


def digest_here(data: Buffer) -> bytes:
    """The raw blake3 digest of ``data``, on the calling thread alone (releases the GIL).

    For callers that hash many buffers on several threads of their own.
    """
    return blake3.blake3(data, max_threads=1).digest()


def hasher_here() -> Any:
    """An incremental blake3 hasher (``update``, ``digest``) on the calling thread alone."""
    return blake3.blake3(max_threads=1)
