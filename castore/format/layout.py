"""Global coordinates: boxes, their overlaps, and the byte runs and chunk
indices a box touches in a row-major buffer.

A tensor is saved as one or more boxes of its global shape. Reading a region
means intersecting it with each saved box, turning the intersection into
contiguous byte runs of that box's buffer, and from those into the chunk
indices to fetch: arithmetic only, no reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from castore.errors import InvalidIndexError

# Above this many runs in one chunk, copy with one vectorized gather.
_VECTORIZE_RUNS = 8


@dataclass(frozen=True)
class Box:
    """An axis-aligned block of a tensor: ``offsets`` and ``shape`` per dimension."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def stops(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The common block, or None when the boxes share no element."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.stops, other.stops, strict=True))
        if any(h <= low for low, h in zip(lo, hi, strict=True)) and lo:
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def relative_to(self, origin: Box) -> Box:
        """This box in the coordinates of ``origin``'s own buffer."""
        return Box(
            tuple(a - b for a, b in zip(self.offsets, origin.offsets, strict=True)), self.shape
        )


def spanned(first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Sorted indices covered by any of the ranges ``first[i] .. last[i]`` (inclusive)."""
    if np.all(first == last):
        return np.unique(first)
    marks = np.zeros(int(last.max()) + 2, dtype=np.int64)
    np.add.at(marks, first, 1)
    np.add.at(marks, last + 1, -1)
    return np.flatnonzero(np.cumsum(marks)[:-1] > 0)


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return strides[::-1]


@dataclass(frozen=True)
class CopyPlan:
    """Copy one region from a source buffer to a destination buffer.

    The region is cut into runs of ``run_bytes`` bytes that are contiguous in
    both buffers; ``src_starts``/``dst_starts`` give each run's byte offset,
    sorted by source offset.
    """

    src_starts: np.ndarray
    dst_starts: np.ndarray
    run_bytes: int

    @property
    def nbytes(self) -> int:
        return int(self.src_starts.size) * self.run_bytes

    def chunk_indices(self, chunk_size: int) -> np.ndarray:
        """Sorted indices of the source chunks that hold any byte of the region."""
        if self.src_starts.size == 0 or self.run_bytes == 0:
            return np.empty(0, dtype=np.int64)
        first = self.src_starts // chunk_size
        last = (self.src_starts + self.run_bytes - 1) // chunk_size
        return spanned(first, last)

    def copy_from_chunk(self, chunk_start: int, chunk: np.ndarray, dst: np.ndarray) -> int:
        """Copy the region's bytes held by one source chunk into ``dst``; return bytes copied."""
        chunk_stop = chunk_start + chunk.size
        ends = self.src_starts + self.run_bytes
        lo = int(np.searchsorted(ends, chunk_start, side="right"))
        hi = int(np.searchsorted(self.src_starts, chunk_stop, side="left"))
        if hi <= lo:
            return 0
        src, dst_at = self.src_starts[lo:hi], self.dst_starts[lo:hi]
        inside = (src >= chunk_start) & (src + self.run_bytes <= chunk_stop)
        copied = 0
        if int(inside.sum()) > _VECTORIZE_RUNS:
            span = np.arange(self.run_bytes, dtype=np.int64)
            gather = (src[inside] - chunk_start)[:, None] + span
            dst[(dst_at[inside])[:, None] + span] = chunk[gather]
            copied += int(inside.sum()) * self.run_bytes
            src, dst_at = src[~inside], dst_at[~inside]
        for s, d in zip(src.tolist(), dst_at.tolist(), strict=True):
            begin, end = max(s, chunk_start), min(s + self.run_bytes, chunk_stop)
            out = d + (begin - s)
            dst[out : out + (end - begin)] = chunk[begin - chunk_start : end - chunk_start]
            copied += end - begin
        return copied


def plan_copy(
    src_shape: tuple[int, ...],
    src_region: Box,
    dst_shape: tuple[int, ...],
    dst_region: Box,
    itemsize: int,
) -> CopyPlan:
    """Plan copying ``src_region`` of a row-major source into ``dst_region`` of a destination.

    Both regions have the same shape and are given in their own buffer's
    coordinates.
    """
    shape = src_region.shape
    if shape != dst_region.shape:
        raise ValueError(f"region shapes differ: {shape} vs {dst_region.shape}")
    empty = np.empty(0, dtype=np.int64)
    if math.prod(shape) == 0:
        return CopyPlan(empty, empty, 0)
    n_dims = len(shape)
    # Trailing dimensions that are whole in both buffers merge into each run.
    merged_from = n_dims
    while (
        merged_from > 0
        and shape[merged_from - 1] == src_shape[merged_from - 1] == dst_shape[merged_from - 1]
    ):
        merged_from -= 1
    outer = max(merged_from - 1, 0)
    src_strides, dst_strides = _strides(src_shape), _strides(dst_shape)
    run_elems = math.prod(shape[outer:])
    src_base = sum(o * s for o, s in zip(src_region.offsets, src_strides, strict=True))
    dst_base = sum(o * s for o, s in zip(dst_region.offsets, dst_strides, strict=True))
    src_starts = np.array([src_base], dtype=np.int64)
    dst_starts = np.array([dst_base], dtype=np.int64)
    for dim in range(outer):
        steps = np.arange(shape[dim], dtype=np.int64)
        src_starts = (src_starts[:, None] + steps * src_strides[dim]).ravel()
        dst_starts = (dst_starts[:, None] + steps * dst_strides[dim]).ravel()
    return CopyPlan(src_starts * itemsize, dst_starts * itemsize, run_elems * itemsize)


def normalize_index(index: Any, shape: tuple[int, ...]) -> tuple[Box, tuple[Any, ...]]:
    """Turn a basic numpy index into the covering box and the index to apply to it.

    Supports ints, slices (any step) and one Ellipsis; the second value selects
    the exact elements (steps, dropped dimensions) from the box's array.
    """
    items = list(index) if isinstance(index, tuple) else [index]
    # `is`, not `in`/`index`: those compare with ==, which arrays answer elementwise.
    ellipses = [at for at, item in enumerate(items) if item is Ellipsis]
    if len(ellipses) > 1:
        raise InvalidIndexError("an index can have only one Ellipsis")
    if ellipses:
        at = ellipses[0]
        items[at : at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if len(items) > len(shape):
        raise InvalidIndexError(f"{len(items)} indices for a tensor of {len(shape)} dimensions")
    items += [slice(None)] * (len(shape) - len(items))
    offsets, sizes, post = [], [], []
    for dim, (item, size) in enumerate(zip(items, shape, strict=True)):
        lo, count, selector = _normalize_one(item, size, dim)
        offsets.append(lo)
        sizes.append(count)
        post.append(selector)
    if ellipses:
        post.append(Ellipsis)  # like numpy: `a[3, ...]` is a 0-d array, `a[3]` a scalar
    return Box(tuple(offsets), tuple(sizes)), tuple(post)


def _normalize_one(item: Any, size: int, dim: int) -> tuple[int, int, Any]:
    if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
        position = int(item) + size if item < 0 else int(item)
        if not 0 <= position < size:
            raise InvalidIndexError(
                f"index {item} is out of bounds for dimension {dim} of size {size}"
            )
        return position, 1, 0
    if isinstance(item, slice):
        try:
            start, stop, step = item.indices(size)
        except (TypeError, ValueError) as exc:
            raise InvalidIndexError(f"bad slice {item} for dimension {dim}: {exc}") from exc
        picked = range(start, stop, step)
        if len(picked) == 0:
            return 0, 0, slice(None)
        lo, hi = min(picked[0], picked[-1]), max(picked[0], picked[-1])
        selector = slice(None) if step == 1 else slice(picked[0] - lo, None, step)
        return lo, hi - lo + 1, selector
    raise InvalidIndexError(
        f"index item {item!r} for dimension {dim}: only ints, slices and ... are supported"
    )
