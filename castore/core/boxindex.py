"""The saved boxes of one tensor, found by the region a reader needs.

A restoring rank needs, for each of its targets, the saved boxes that overlap
it. Scanning every box of the tensor costs O(R) per target, so O(R x T) per
rank and per restore, growing with the job's size rather than with what the
rank reads. :class:`BoxIndex` sorts a tensor's boxes once along the
dimension where their starts differ most (rows for FSDP, columns for tensor
parallelism) and answers a region with a binary search and a window of the
boxes that can reach it: O(log R + k) for k boxes found in the usual layouts.

:func:`covered_once` then checks that those boxes cover the region exactly
once, which is what the rank's bytes depend on: a reader validates what it
reads (the coordinator checked the whole tensor before the publish,
castore.core.commit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from castore.errors import CoverageError
from castore.format.layout import Box
from castore.format.objects import TensorEntry

# Below this many boxes a scan is as fast as the index.
_SCAN = 16


class SortedBoxes:
    """Boxes given as ``(n, dims)`` offsets and sizes, the non-empty ones sorted along
    the dimension where their starts differ most (when there are more than a few):
    :meth:`overlapping` answers a region with a binary search and a window."""

    def __init__(self, lo: np.ndarray, size: np.ndarray) -> None:
        kept = np.flatnonzero((size > 0).all(axis=1))
        lo, size = lo[kept], size[kept]
        self.dim: int | None = None
        if len(kept) > _SCAN and lo.shape[1]:
            distinct = [len(np.unique(lo[:, d])) for d in range(lo.shape[1])]
            dim = int(np.argmax(distinct))
            order = np.argsort(lo[:, dim], kind="stable")
            kept, lo, size = kept[order], lo[order], size[order]
            self.dim = dim
            self.starts = lo[:, dim]
            self.longest = int(size[:, dim].max())
        self.positions, self.lo, self.hi = kept, lo, lo + size

    def overlapping(self, region: Box) -> np.ndarray:
        """The positions (in the arrays given) of the boxes that share at least one
        element with ``region``."""
        if not region.numel:
            return self.positions[:0]
        first, last = 0, len(self.positions)
        if self.dim is not None:
            lo, hi = region.offsets[self.dim], region.stops[self.dim]
            # A box reaching past lo starts after lo - longest; one reaching into it, before hi.
            first = int(np.searchsorted(self.starts, lo - self.longest, side="right"))
            last = int(np.searchsorted(self.starts, hi, side="left"))
        window = self.positions[first:last]
        if not self.lo.shape[1]:
            return window  # 0-d: every box holds the one element
        meets = (self.lo[first:last] < np.asarray(region.stops, dtype=np.int64)).all(axis=1)
        meets &= (self.hi[first:last] > np.asarray(region.offsets, dtype=np.int64)).all(axis=1)
        return window[meets]


class BoxIndex:
    """A tensor's saved boxes (entries), searchable by the region they overlap."""

    def __init__(self, boxes: Sequence[TensorEntry]) -> None:
        self.boxes = list(boxes)
        dims = len(self.boxes[0].shape) if self.boxes else 0
        lo = np.zeros((len(self.boxes), dims), dtype=np.int64)
        size = np.zeros((len(self.boxes), dims), dtype=np.int64)
        if dims:  # a 0-d tensor's boxes have no coordinates
            lo[:] = [b.offsets for b in self.boxes]
            size[:] = [b.local_shape for b in self.boxes]
        self.sorted = SortedBoxes(lo, size)

    def overlapping(self, region: Box) -> list[TensorEntry]:
        """The boxes that share at least one element with ``region``."""
        return [self.boxes[i] for i in self.sorted.overlapping(region).tolist()]


@dataclass(frozen=True)
class _Part:
    """A saved box clipped to a region, placed in the region's coordinates: what
    castore.core.reading.check_coverage reads of an entry."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]


def covered_once(
    boxes: Sequence[TensorEntry],
    region: Box,
    where: dict[str, Any],
    check: Callable[..., None],
) -> None:
    """``boxes`` (those overlapping ``region``) cover it exactly once and agree on the
    tensor's dtype and shape; else CoverageError. ``check`` is the whole-tensor check
    (castore.core.reading.check_coverage), run here on the boxes clipped to the region."""
    if not region.numel:
        return
    if len(boxes) == 1 and boxes[0].offsets == region.offsets:
        if boxes[0].local_shape == region.shape:
            return  # the region is a saved box: covered once, by it alone
    if not boxes:
        raise CoverageError(
            f"no saved box holds the region at offsets {list(region.offsets)} "
            f"(shape {list(region.shape)}) of the tensor",
            **where,
        )
    first = boxes[0]
    if any(b.shape != first.shape or b.dtype != first.dtype for b in boxes):
        check(boxes, where)  # raises: the boxes disagree
    if region == Box.whole(first.shape):
        check(boxes, where)
        return
    parts = []
    for box in boxes:
        part = region.intersect(Box(box.offsets, box.local_shape))
        assert part is not None  # BoxIndex.overlapping found it
        relative = part.relative_to(region)
        parts.append(_Part(box.name, box.dtype, region.shape, relative.offsets, relative.shape))
    try:
        check(parts, where)
    except CoverageError as exc:
        raise CoverageError(
            f"{exc}, within the region at offsets {list(region.offsets)} (shape "
            f"{list(region.shape)}) that this rank reads",
            **where,
        ) from exc
