"""The compact tensor table of a format-4 shard manifest (docs/FORMAT.md).

A 1,024-rank job saving 1,024 tensors writes a million boxes, and the format-3
table spends about 106 bytes on each beyond its chunk digests: the dtype and
framework names, the chunk size and the grid in full, eight bytes for every
dimension value and a byte count that the box's shape already says. The
compact table keeps per entry only its name, an index into the shard's list
of distinct *kinds* (dtype, framework, chunk size, cell dimension, cell
extent), its number of dimensions, and its shape, offsets and box sizes in
the narrowest of 1, 2, 4 or 8 bytes that holds every value of the shard: 32
bytes for a 2-D box named ``layers.123.weight``.

Decoding expands the compact columns into the format-3 columns, so one set
of checks (castore.format.objects.EntryTable) judges both; what only this
table can get wrong (a kind index past the list, a malformed kind, a width
that is no width, columns that are no whole number of values) is refused
here with CorruptObjectError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from castore.errors import CorruptObjectError
from castore.format.dtypes import SUPPORTED_DTYPES, numpy_dtype
from castore.format.grid import RUNS

COMPACT_KEYS = ("chunks", "kind", "kinds", "local_shape", "name", "ndim", "offsets", "shape",
                "width")  # fmt: skip
_WIDTHS = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<i8"}
_I64 = np.dtype("<i8")
# A box may hold at most this many bytes (castore.format.objects.MAX_BOX_BYTES).
_MAX_BOX_BYTES = 1 << 61


def encode_compact(entries: Sequence[Any]) -> dict[str, Any]:
    """The compact columns of ``entries`` (tensor entries), keys in sorted order."""
    kinds: dict[tuple[str, str, int, int, int], int] = {}
    index = []
    values: list[list[int]] = [[], [], []]
    for e in entries:
        cell = (RUNS, 0) if e.cell is None else e.cell
        kind = (e.dtype, e.framework, e.chunk_size, *cell)
        index.append(kinds.setdefault(kind, len(kinds)))
        values[0] += e.shape
        values[1] += e.offsets
        values[2] += e.local_shape
    largest = max((max(v) for v in values if v), default=0)
    width = next(w for w in (1, 2, 4) if largest < 1 << (8 * w)) if largest < 1 << 32 else 8
    kind_type = "<u1" if len(kinds) <= 1 << 8 else "<u2" if len(kinds) <= 1 << 16 else "<u4"
    columns = {
        "chunks": b"".join(c for e in entries for c in e.chunks),
        "kind": np.asarray(index, dtype=kind_type).tobytes(),
        "kinds": [list(kind) for kind in kinds],
        "local_shape": np.asarray(values[2], dtype=_WIDTHS[width]).tobytes(),
        "name": [e.name for e in entries],
        "ndim": bytes(len(e.shape) for e in entries),
        "offsets": np.asarray(values[1], dtype=_WIDTHS[width]).tobytes(),
        "shape": np.asarray(values[0], dtype=_WIDTHS[width]).tobytes(),
        "width": width,
    }
    return columns


def expand_compact(wire: Any) -> dict[str, Any]:
    """The format-3 columns (castore.format.objects.GRID_TABLE_KEYS) of a compact table,
    for the table's own checks; CorruptObjectError where the compact form is malformed."""
    if not isinstance(wire, dict) or sorted(wire) != list(COMPACT_KEYS):
        raise CorruptObjectError("tensor table does not have the compact table's fields")
    names, kinds, width = wire["name"], wire["kinds"], wire["width"]
    if not isinstance(names, list):
        raise CorruptObjectError("tensor table column 'name' is not a list")
    n = len(names)
    if type(width) is not int or width not in _WIDTHS:
        raise CorruptObjectError(f"tensor table has value width {width!r} (1, 2, 4 or 8)")
    if not isinstance(kinds, list) or not all(_is_kind(k) for k in kinds):
        raise CorruptObjectError(
            "tensor table kinds must be [dtype, framework, chunk size, cell dim, cell extent]"
        )
    kind = _column(wire, "kind", _kind_type(len(kinds)), n)
    if n and (not kinds or int(kind.max()) >= len(kinds)):
        raise CorruptObjectError(f"tensor table names kind {int(kind.max())} of {len(kinds)}")
    ndim = wire["ndim"]
    if not isinstance(ndim, bytes) or len(ndim) != n:
        raise CorruptObjectError(f"tensor table has {n} entries and a bad 'ndim' column")
    dims = [_column(wire, key, _WIDTHS[width]) for key in ("shape", "offsets", "local_shape")]
    if not isinstance(wire["chunks"], bytes):
        raise CorruptObjectError("tensor table column 'chunks' is not bytes")
    by_kind = list(zip(*kinds, strict=True)) if kinds else [(), (), (), (), ()]
    which = kind.tolist()
    dtypes = [by_kind[0][k] for k in which]
    numbers = np.asarray([k[2:] for k in kinds] or [[0, 0, 0]], dtype=_I64)[kind]
    return {
        "cell_dim": numbers[:, 1].astype(np.uint8).tobytes(),
        "cell_extent": numbers[:, 2].tobytes(),
        "chunk_size": numbers[:, 0].tobytes(),
        "chunks": wire["chunks"],
        "dtype": dtypes,
        "framework": [by_kind[1][k] for k in which],
        "local_shape": dims[2].astype(_I64).tobytes(),
        "name": names,
        "nbytes": _box_bytes(names, dtypes, np.frombuffer(ndim, np.uint8), dims[2]),
        "ndim": ndim,
        "offsets": dims[1].astype(_I64).tobytes(),
        "shape": dims[0].astype(_I64).tobytes(),
    }


def _is_kind(kind: Any) -> bool:
    return (
        isinstance(kind, list)
        and len(kind) == 5
        and isinstance(kind[0], str)
        and isinstance(kind[1], str)
        and all(type(v) is int for v in kind[2:])
        and 0 <= kind[3] <= RUNS
        and -(1 << 63) <= kind[2] < 1 << 63
        and -(1 << 63) <= kind[4] < 1 << 63
    )


def _kind_type(count: int) -> str:
    return "<u1" if count <= 1 << 8 else "<u2" if count <= 1 << 16 else "<u4"


def _column(wire: dict[str, Any], key: str, dtype: str, count: int | None = None) -> Any:
    data = wire[key]
    size = np.dtype(dtype).itemsize
    if not isinstance(data, bytes) or len(data) % size:
        raise CorruptObjectError(f"tensor table column {key!r} is not whole values of {size} bytes")
    column = np.frombuffer(data, dtype=dtype)
    if count is not None and len(column) != count:
        raise CorruptObjectError(f"tensor table has {len(column)} {key}s for {count} entries")
    return column


def _box_bytes(names: list[Any], dtypes: list[str], ndim: Any, local: Any) -> bytes:
    """Each entry's byte count, from its box sizes and dtype (not stored: the table's
    check then finds it consistent, and refuses a box past 2^61 bytes here)."""
    n = len(names)
    if int(ndim.sum(dtype=np.int64)) != len(local):
        return np.full(n, -1, dtype=_I64).tobytes()  # the table's check names the mismatch
    if set(dtypes) - SUPPORTED_DTYPES:
        return np.zeros(n, dtype=_I64).tobytes()  # the table's check names the dtype
    sizes = {d: numpy_dtype(d).itemsize for d in set(dtypes)}
    itemsize = np.fromiter(map(sizes.__getitem__, dtypes), np.int64, n)
    out = np.ones(n, dtype=np.int64)
    has_dims = ndim > 0
    starts = (np.cumsum(ndim, dtype=np.int64) - ndim)[has_dims]
    if len(starts):
        rough = np.multiply.reduceat(local.astype(np.float64), starts) * itemsize[has_dims]
        bad = np.flatnonzero(rough >= _MAX_BOX_BYTES)
        if len(bad):
            name = names[int(np.flatnonzero(has_dims)[bad[0]])]
            raise CorruptObjectError(
                "tensor entry has a box of 2^61 bytes or more",
                tensor=str(name),
            )
        out[has_dims] = np.multiply.reduceat(local.astype(np.int64), starts)
    return (out * itemsize).tobytes()
