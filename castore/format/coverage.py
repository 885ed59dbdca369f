"""Whether any two boxes of a tensor share an element, in O(n log n) for the usual layouts.

Every publish and every restore checks that a tensor's boxes overlap nowhere
(``castore.core.reading.check_coverage``). Comparing every pair is quadratic:
a million boxes (1,024 ranks x 1,024 tensors) would take most of an hour.
Here the boxes are the columns of two ``(dims, n)`` int64 arrays, ``lo``
(offsets) and ``hi`` (stops): one row per dimension, so that what numpy
computes per box runs along contiguous rows. :func:`overlapping_pair` names
two boxes that meet, or None:

- empty boxes (an extent of 0) share no element with anything;
- a dimension in which every box has the same extent is left out: every pair
  meets there;
- boxes that differ in one dimension only (row shards, column shards) are
  intervals: sorted by start, the first start before the furthest stop so far
  is an overlap (:func:`interval_overlap`);
- otherwise the distinct cut coordinates of each dimension form a grid; where
  it has at most :data:`GRID_CELLS_PER_BOX` cells per box (2-D blocks, FSDP
  over tensor parallelism) every cell's occupancy is counted at once from a
  difference array (:func:`grid_overlap`);
- otherwise a sweep along one dimension (:func:`sweep_overlap`): boxes that
  start at the same coordinate, and those still open there, all meet in that
  dimension, so they must be apart in the others (the same question, one
  dimension fewer). Its cost grows with how many boxes are open at each start;
  it picks the dimension where that is least.

Pure numpy on coordinates; nothing here knows a tensor entry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np

# A grid of cut coordinates is counted only while it has at most this many
# cells per box (and GRID_FLOOR cells in any case): its cost is its cell count.
GRID_CELLS_PER_BOX = 16
GRID_FLOOR = 1 << 12
# A difference array has 2**d corners per box: beyond this many dimensions that
# vary, the sweep takes one dimension off first.
GRID_MAX_DIMS = 6
# Entering x open boxes compared pairwise (one numpy block) up to this many pairs.
PAIR_BLOCK = 1 << 18
# Coordinates of this magnitude or more are ranked first, so that stops fit int64.
SAFE_COORDINATE = 1 << 62

Pair = tuple[int, int]


class Corners(NamedTuple):
    """The boxes as ``(dims, n)`` int64 arrays: ``lo[d, i]`` is box ``i``'s offset in
    dimension ``d``, ``hi[d, i]`` its stop.

    ``ranked``: the coordinates were too large for int64 and are each
    coordinate's rank among those of its dimension instead, which keeps every
    comparison (and so every overlap) as it was, but not the boxes' sizes.
    """

    lo: np.ndarray
    hi: np.ndarray
    ranked: bool


def box_corners(
    offsets: Sequence[tuple[int, ...]], extents: Sequence[tuple[int, ...]], dims: int
) -> Corners:
    """The boxes at ``offsets`` with ``extents`` (one tuple of ``dims`` each) as arrays."""
    count = len(offsets) * dims
    try:
        lo = np.fromiter(chain.from_iterable(offsets), np.int64, count)
        extent = np.fromiter(chain.from_iterable(extents), np.int64, count)
    except OverflowError:
        return _ranked_corners(offsets, extents, dims)
    if count and not (
        -SAFE_COORDINATE < min(lo.min(), extent.min())
        and max(lo.max(), extent.max()) < SAFE_COORDINATE
    ):
        return _ranked_corners(offsets, extents, dims)
    lo = np.ascontiguousarray(lo.reshape(len(offsets), dims).T)
    hi = lo + extent.reshape(len(offsets), dims).T
    return Corners(lo, hi, ranked=False)


def _ranked_corners(
    offsets: Sequence[tuple[int, ...]], extents: Sequence[tuple[int, ...]], dims: int
) -> Corners:
    lo = np.empty((dims, len(offsets)), dtype=np.int64)
    hi = np.empty_like(lo)
    for dim in range(dims):
        starts = [o[dim] for o in offsets]
        stops = [o[dim] + e[dim] for o, e in zip(offsets, extents, strict=True)]
        rank = {value: i for i, value in enumerate(sorted({*starts, *stops}))}
        lo[dim] = [rank[v] for v in starts]
        hi[dim] = [rank[v] for v in stops]
    return Corners(lo, hi, ranked=True)


def element_count(corners: Corners, extents: Sequence[tuple[int, ...]]) -> int:
    """The elements of all the boxes together (each box's product of extents, summed)."""
    extent = corners.hi - corners.lo
    if not corners.ranked and extent.size:
        largest = np.abs(extent).max(axis=1).astype(np.float64)
        if extent.shape[1] * float(np.prod(largest)) < SAFE_COORDINATE:
            return int(extent.prod(axis=0).sum())  # no int64 product or sum overflows
    return sum(math.prod(e) for e in extents)


def overlapping_pair(lo: np.ndarray, hi: np.ndarray) -> Pair | None:
    """Two boxes (column numbers) that share an element, or None when no two do."""
    count = lo.shape[1]
    nonempty = (hi > lo).all(axis=0)  # 0-d boxes are never empty
    if nonempty.all():
        return _nonempty_overlap(lo, hi) if count > 1 else None
    kept = np.flatnonzero(nonempty)
    if kept.size < 2:
        return None
    pair = _nonempty_overlap(lo[:, kept], hi[:, kept])
    return None if pair is None else (int(kept[pair[0]]), int(kept[pair[1]]))


def _nonempty_overlap(lo: np.ndarray, hi: np.ndarray) -> Pair | None:
    count = lo.shape[1]
    if count < 2:
        return None
    varying = np.flatnonzero((lo != lo[:, :1]).any(axis=1) | (hi != hi[:, :1]).any(axis=1))
    if varying.size == 0:
        return 0, 1  # two boxes alike, each holding an element
    if varying.size == 1:
        dim = int(varying[0])
        return interval_overlap(lo[dim], hi[dim])
    lo, hi = lo[varying], hi[varying]
    if varying.size <= GRID_MAX_DIMS:
        cuts = [distinct(np.concatenate((lo[d], hi[d]))) for d in range(varying.size)]
        if math.prod(len(c) for c in cuts) <= max(GRID_FLOOR, GRID_CELLS_PER_BOX * count):
            return grid_overlap(lo, hi, cuts)
    return sweep_overlap(lo, hi)


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted (np.unique, without its overhead on small arrays)."""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]


def interval_overlap(lo: np.ndarray, hi: np.ndarray) -> Pair | None:
    """Two of the non-empty intervals ``[lo, hi)`` that meet, or None.

    Sorted by start, an interval meets an earlier one exactly when it starts
    before the furthest stop so far; intervals with equal starts are kept
    apart by the sort, and the second of them starts before the first's stop.
    """
    if (lo[1:] >= lo[:-1]).all():  # boxes listed in order (rank order, usually)
        order, starts, stops = np.arange(len(lo)), lo, hi
    else:
        order = np.argsort(lo, kind="stable")
        starts, stops = lo[order], hi[order]
    reach = np.maximum.accumulate(stops)
    hits = np.flatnonzero(reach[:-1] > starts[1:])
    if not hits.size:
        return None
    later = int(hits[0]) + 1
    earlier = int(np.argmax(stops[:later]))  # the interval that reached furthest
    return int(order[earlier]), int(order[later])


def grid_overlap(lo: np.ndarray, hi: np.ndarray, cuts: list[np.ndarray]) -> Pair | None:
    """Two of the non-empty boxes that meet, or None, from each cell's occupancy.

    ``cuts`` holds each dimension's distinct coordinates (sorted): every box is
    a block of the cells they cut. Each box adds +1 and -1 at the corners of
    its block in a difference array; running sums along every dimension give
    how many boxes hold each cell.
    """
    first = np.stack([np.searchsorted(c, lo[d]) for d, c in enumerate(cuts)])
    last = np.stack([np.searchsorted(c, hi[d]) for d, c in enumerate(cuts)])
    sizes = tuple(len(c) for c in cuts)
    plus: list[np.ndarray] = []
    minus: list[np.ndarray] = []
    for corner in np.ndindex(*(2,) * len(cuts)):
        at = np.ravel_multi_index(
            tuple(last[d] if up else first[d] for d, up in enumerate(corner)), sizes
        )
        (minus if sum(corner) % 2 else plus).append(at)
    cells = math.prod(sizes)
    held = np.bincount(np.concatenate(plus), minlength=cells) - np.bincount(
        np.concatenate(minus), minlength=cells
    )
    held = held.reshape(sizes)
    for dim in range(len(sizes)):
        np.cumsum(held, axis=dim, out=held)
    crowded = np.flatnonzero(held.reshape(-1) > 1)
    if not crowded.size:
        return None
    cell = np.array(np.unravel_index(int(crowded[0]), sizes)).reshape(-1, 1)
    holders = np.flatnonzero(((first <= cell) & (last > cell)).all(axis=0))
    return int(holders[0]), int(holders[1])


def sweep_overlap(lo: np.ndarray, hi: np.ndarray) -> Pair | None:
    """Two of the non-empty boxes that meet, or None, sweeping along one dimension.

    At each distinct start, the boxes starting there and those still open all
    hold that coordinate, so they must be apart in the other dimensions: the
    entering boxes among themselves (the same question, one dimension fewer)
    and against the open ones. The dimension swept is the one where the
    entering x open comparisons are fewest.
    """
    dim = _cheapest_sweep(lo, hi)
    rest = [d for d in range(lo.shape[0]) if d != dim]
    lo_rest, hi_rest = lo[rest], hi[rest]
    order = np.argsort(lo[dim], kind="stable")
    starts = lo[dim, order]
    bounds = [0, *(np.flatnonzero(starts[1:] != starts[:-1]) + 1).tolist(), len(order)]
    open_ = np.empty(0, dtype=np.int64)
    for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
        open_ = open_[hi[dim, open_] > starts[begin]]
        entering = order[begin:end]
        pair = _among(lo_rest, hi_rest, entering)
        if pair is None:
            pair = _across(lo_rest, hi_rest, entering, open_)
        if pair is not None:
            return pair
        open_ = np.concatenate((open_, entering))
    return None


def _cheapest_sweep(lo: np.ndarray, hi: np.ndarray) -> int:
    """The dimension whose sweep compares fewest entering x open pairs."""
    costs = []
    for dim in range(lo.shape[0]):
        starts, counts = np.unique(lo[dim], return_counts=True)
        started_before = np.searchsorted(np.sort(lo[dim]), starts, side="left")
        stopped_by = np.searchsorted(np.sort(hi[dim]), starts, side="right")
        costs.append(int((counts * (started_before - stopped_by)).sum()))
    return int(np.argmin(costs))


def _among(lo: np.ndarray, hi: np.ndarray, boxes: np.ndarray) -> Pair | None:
    """Two of ``boxes`` that meet in the dimensions of ``lo``/``hi``, or None."""
    if boxes.size < 2:
        return None
    pair = _nonempty_overlap(lo[:, boxes], hi[:, boxes])
    return None if pair is None else (int(boxes[pair[0]]), int(boxes[pair[1]]))


def _across(lo: np.ndarray, hi: np.ndarray, entering: np.ndarray, open_: np.ndarray) -> Pair | None:
    """An entering box and an open one that meet, or None (``open_`` are apart already)."""
    if not open_.size:
        return None
    if entering.size * open_.size > PAIR_BLOCK:
        # As many comparisons as boxes: ask the question of them all together.
        return _among(lo, hi, np.concatenate((open_, entering)))
    meet = (
        np.maximum(lo[:, entering, None], lo[:, None, open_])
        < np.minimum(hi[:, entering, None], hi[:, None, open_])
    ).all(axis=0)
    hit = np.argwhere(meet)
    if not hit.size:
        return None
    return int(open_[hit[0, 1]]), int(entering[hit[0, 0]])
