"""The coverage check in O(n log n) (castore/format/coverage.py, issue 40 item 1).

``check_coverage`` must refuse exactly what the quadratic check before it
refused (kept as ``castore.testing.coverage.quadratic_check_coverage``), with
the same error and message; an overlap may be named at another pair's
offsets, but always at a real overlap of two boxes. Properties over random box
sets (overlaps, gaps, duplicates, empty boxes, boxes sticking out, 0-d to 5-d
tensors, coordinates past int64) and over random tilings, valid or damaged
once, through each of the fast check's paths (intervals, grid, sweep); then
valid and once-broken layouts at scale, and the broken controls: sweeps that
skip boxes with equal starts miss an overlap these tests catch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from castore.core.reading import check_coverage, group_entries
from castore.errors import CoverageError
from castore.format import coverage
from castore.format.objects import ShardManifest, TensorEntry
from castore.testing.coverage import quadratic_check_coverage

WHERE = {"run": "r", "generation": 7}
OVERLAP = re.compile(r"boxes of tensor 't' overlap at offsets \[([-\d, ]*)\] \(")
PATHS = ("auto", "sweep", "sweep, one question per group")

Spec = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, extents)


def entry(
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    extents: tuple[int, ...],
    dtype: str = "float32",
    chunks: tuple[bytes, ...] = (),
) -> TensorEntry:
    # trusted: boxes that stick out or are huge reach the check as they are
    return TensorEntry.trusted("t", dtype, shape, offsets, extents, 0, 1, chunks, "numpy")


@contextmanager
def path(name: str) -> Iterator[None]:
    """The fast check with its grid switched off (``sweep``), and with every open
    box compared through the recursion (``one question per group``)."""
    if name == "auto":
        yield
        return
    with (
        mock.patch.object(coverage, "GRID_FLOOR", 0),
        mock.patch.object(coverage, "GRID_CELLS_PER_BOX", 0),
        mock.patch.object(coverage, "PAIR_BLOCK", 0 if "one question" in name else 1 << 18),
    ):
        yield


def verdict(check: Callable[..., None], boxes: list[TensorEntry]) -> str | None:
    try:
        check(boxes, WHERE)
    except CoverageError as error:
        assert error.tensor == "t" and error.run == "r" and error.generation == 7
        return str(error)
    return None


def real_overlaps(boxes: list[TensorEntry]) -> set[tuple[int, ...]]:
    """The offsets at which some two boxes (by position) share an element."""
    found = set()
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            lo = [max(p, q) for p, q in zip(a.offsets, b.offsets, strict=True)]
            hi = [
                min(p + s, q + t)
                for p, s, q, t in zip(
                    a.offsets, a.local_shape, b.offsets, b.local_shape, strict=True
                )
            ]
            if all(h > low for low, h in zip(lo, hi, strict=True)):
                found.add(tuple(lo))
    return found


def assert_same_verdict(boxes: list[TensorEntry]) -> None:
    expected = verdict(quadratic_check_coverage, boxes)
    got = verdict(check_coverage, boxes)
    named = OVERLAP.match(got or "")
    if named and expected and OVERLAP.match(expected):
        offsets = tuple(int(x) for x in named.group(1).split(",") if x.strip())
        assert offsets in real_overlaps(boxes), (got, expected)
        assert got.endswith("(run=r, generation=7, tensor=t)")
    else:
        assert got == expected


# -- strategies ------------------------------------------------------------------


@st.composite
def loose_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Spec]]:
    """A shape (0 to 5 dims) and 1 to 12 boxes anywhere near it: inside, empty,
    overlapping, sticking out; some listed twice."""
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=5)))
    specs: list[Spec] = []
    for _ in range(draw(st.integers(1, 12))):
        offsets = tuple(draw(st.integers(0, g + 1)) for g in shape)
        extents = tuple(
            draw(st.integers(0, g + 1 - o)) for g, o in zip(shape, offsets, strict=True)
        )
        specs.append((offsets, extents))
    repeats = draw(st.lists(st.integers(0, len(specs) - 1), max_size=3))
    return shape, specs + [specs[i] for i in repeats]


def cuts(draw: st.DrawFn, size: int, pieces: int) -> list[tuple[int, int]]:
    """At most ``pieces`` contiguous ranges tiling [0, size), some possibly empty."""
    marks = sorted(draw(st.lists(st.integers(0, size), max_size=pieces - 1)))
    bounds = [0, *marks, size]
    return list(
        zip(bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)], strict=True)
    )


@st.composite
def grid_tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Spec]]:
    """A random grid of blocks (FSDP rows, TP columns, 2-D blocks and beyond): valid."""
    shape = tuple(draw(st.lists(st.integers(0, 9), max_size=5)))
    specs: list[Spec] = [((), ())]
    pieces = 5 if len(shape) <= 3 else 3  # at most 243 boxes: the reference is quadratic
    for size in shape:
        specs = [(o + (a,), e + (n,)) for o, e in specs for a, n in cuts(draw, size, pieces)]
    return shape, specs


@st.composite
def split_tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Spec]]:
    """Blocks cut again and again along random dimensions: valid, and seldom a grid."""
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=2, max_size=4)))
    specs: list[Spec] = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 12))):
        which = draw(st.integers(0, len(specs) - 1))
        offsets, extents = specs.pop(which)
        dim = draw(st.integers(0, len(shape) - 1))
        at = draw(st.integers(0, extents[dim]))
        low = extents[:dim] + (at,) + extents[dim + 1 :]
        high_offsets = offsets[:dim] + (offsets[dim] + at,) + offsets[dim + 1 :]
        high = extents[:dim] + (extents[dim] - at,) + extents[dim + 1 :]
        specs += [(offsets, low), (high_offsets, high)]
    return shape, specs


@st.composite
def damaged(draw: st.DrawFn, tilings: st.SearchStrategy[Any]) -> tuple[tuple[int, ...], list[Spec]]:
    """A tiling as it is, or with one box dropped, doubled, moved, grown or added."""
    shape, specs = draw(tilings)
    specs = draw(st.permutations(specs))
    damage = draw(st.sampled_from(["none", "drop", "double", "move", "grow", "add"]))
    i = draw(st.integers(0, len(specs) - 1))
    offsets, extents = specs[i]
    if damage == "drop" and len(specs) > 1:  # a tensor has a box at least
        specs = specs[:i] + specs[i + 1 :]
    elif damage == "double":
        specs = [*specs, specs[i]]
    elif damage in ("move", "grow") and shape:
        dim = draw(st.integers(0, len(shape) - 1))
        step = draw(st.sampled_from([-1, 1]))
        if damage == "move":
            offsets = offsets[:dim] + (max(0, offsets[dim] + step),) + offsets[dim + 1 :]
        else:
            extents = extents[:dim] + (max(0, extents[dim] + step),) + extents[dim + 1 :]
        specs = specs[:i] + [(offsets, extents)] + specs[i + 1 :]
    elif damage == "add":
        offsets = tuple(draw(st.integers(0, g)) for g in shape)
        extents = tuple(draw(st.integers(0, g - o)) for g, o in zip(shape, offsets, strict=True))
        specs = [*specs, (offsets, extents)]
    return shape, specs


def entries(shape: tuple[int, ...], specs: list[Spec], scale: int = 1) -> list[TensorEntry]:
    big = tuple(g * scale for g in shape)
    return [
        entry(big, tuple(o * scale for o in offs), tuple(e * scale for e in ext))
        for offs, ext in specs
    ]


# -- the same verdicts as the quadratic check ----------------------------------------


@pytest.mark.parametrize("through", PATHS)
@settings(max_examples=300, deadline=None)
@given(case=loose_boxes(), scale=st.sampled_from([1, 1, 1, 2**61]))
def test_random_boxes_get_the_quadratic_checks_verdict(
    through: str, case: tuple[tuple[int, ...], list[Spec]], scale: int
) -> None:
    """Overlaps, gaps, duplicates, empty boxes, 0-d and 5-d; scaled past int64 too."""
    with path(through):
        assert_same_verdict(entries(*case, scale=scale))


@pytest.mark.parametrize("through", PATHS)
@settings(max_examples=300, deadline=None)
@given(case=damaged(grid_tilings()))
def test_grid_tilings_damaged_or_not_get_the_quadratic_checks_verdict(
    through: str, case: tuple[tuple[int, ...], list[Spec]]
) -> None:
    with path(through):
        assert_same_verdict(entries(*case))


@pytest.mark.parametrize("through", PATHS)
@settings(max_examples=300, deadline=None)
@given(case=damaged(split_tilings()))
def test_split_tilings_damaged_or_not_get_the_quadratic_checks_verdict(
    through: str, case: tuple[tuple[int, ...], list[Spec]]
) -> None:
    with path(through):
        assert_same_verdict(entries(*case))


@settings(max_examples=100, deadline=None)
@given(case=grid_tilings())
def test_every_grid_tiling_is_accepted(case: tuple[tuple[int, ...], list[Spec]]) -> None:
    check_coverage(entries(*case), WHERE)


@settings(max_examples=100, deadline=None)
@given(case=loose_boxes(), which=st.integers(0, 11), dtype=st.booleans())
def test_a_box_of_another_shape_or_dtype_is_named_first(
    case: tuple[tuple[int, ...], list[Spec]], which: int, dtype: bool
) -> None:
    boxes = entries(*case)
    odd = boxes[which % len(boxes)]
    boxes[which % len(boxes)] = (
        entry(odd.shape, odd.offsets, odd.local_shape, dtype="int8")
        if dtype
        else entry((*odd.shape, 1), (*odd.offsets, 0), (*odd.local_shape, 1))
    )
    assert_same_verdict(boxes)


def test_disagreeing_and_overlapping_and_gap_messages_are_the_quadratic_checks() -> None:
    assert verdict(check_coverage, [entry((4,), (0,), (4,)), entry((5,), (0,), (1,))]) == (
        "boxes of tensor 't' disagree: float32[4] vs float32[5] (run=r, generation=7, tensor=t)"
    )
    assert verdict(
        check_coverage, [entry((4, 2), (0, 0), (3, 2)), entry((4, 2), (1, 0), (3, 2))]
    ) == ("boxes of tensor 't' overlap at offsets [1, 0] (run=r, generation=7, tensor=t)")
    assert verdict(check_coverage, [entry((4, 2), (0, 0), (3, 2))]) == (
        "boxes of tensor 't' cover 6 of its 8 elements (run=r, generation=7, tensor=t)"
    )


def test_a_0d_tensor_has_one_box() -> None:
    one = entry((), (), ())
    check_coverage([one], WHERE)
    assert verdict(check_coverage, [one, one]) == (
        "boxes of tensor 't' overlap at offsets [] (run=r, generation=7, tensor=t)"
    )


def test_empty_boxes_overlap_nothing() -> None:
    rows = [entry((4, 3), (i, 0), (1, 3)) for i in range(4)]
    empties = [
        entry((4, 3), (1, 1), (0, 3)),
        entry((4, 3), (1, 1), (2, 0)),
        entry((4, 3), (4, 0), (0, 3)),
    ]
    check_coverage(rows + empties + empties, WHERE)


def test_replicas_count_once_through_group_entries_and_alike_boxes_overlap_without() -> None:
    """Callers pass each box once (identical boxes with identical chunks are replicas);
    the same box listed twice to the check itself is an overlap, as before."""
    half = [
        entry((4,), (0,), (2,), chunks=(bytes(32),)),
        entry((4,), (2,), (2,), chunks=(bytes(32),)),
    ]
    shards = [ShardManifest("r", 7, rank, tuple(half)) for rank in range(3)]
    grouped = group_entries(shards, WHERE)
    assert len(grouped["t"]) == 2
    check_coverage(grouped["t"], WHERE)
    assert verdict(check_coverage, [half[0], half[0]]) == (
        "boxes of tensor 't' overlap at offsets [0] (run=r, generation=7, tensor=t)"
    )


# -- at scale --------------------------------------------------------------------


def row_boxes(rows: int) -> list[TensorEntry]:
    return [entry((2 * rows, 8), (2 * i, 0), (2, 8)) for i in range(rows)]


def block_boxes(side: int) -> list[TensorEntry]:
    shape = (3 * side, 5 * side)
    return [entry(shape, (3 * i, 5 * j), (3, 5)) for i in range(side) for j in range(side)]


def test_4096_row_boxes_tile_and_one_overlap_among_them_is_named() -> None:
    boxes = row_boxes(4096)
    check_coverage(boxes, WHERE)
    boxes[2817] = entry((8192, 8), (2 * 2817, 0), (3, 8))  # reaches into the next box
    assert verdict(check_coverage, boxes) == (
        "boxes of tensor 't' overlap at offsets [5636, 0] (run=r, generation=7, tensor=t)"
    )
    boxes[2817] = entry((8192, 8), (2 * 2817, 0), (1, 8))
    assert verdict(check_coverage, boxes) == (
        "boxes of tensor 't' cover 65528 of its 65536 elements (run=r, generation=7, tensor=t)"
    )


@pytest.mark.parametrize("through", PATHS)
def test_a_64x64_block_grid_tiles_and_one_overlap_among_them_is_named(through: str) -> None:
    boxes = block_boxes(64)
    shuffled = [boxes[i] for i in np.random.default_rng(0).permutation(len(boxes))]
    with path(through):
        check_coverage(shuffled, WHERE)
        grown = entry((192, 320), (3 * 40, 5 * 17), (3, 6))  # one column into its neighbour
        broken = [grown if b.offsets == grown.offsets else b for b in shuffled]
        assert verdict(check_coverage, broken) == (
            "boxes of tensor 't' overlap at offsets [120, 90] (run=r, generation=7, tensor=t)"
        )


def test_a_tiling_that_is_no_grid_takes_the_sweep_and_is_checked_exactly() -> None:
    """Rows of bricks, each row cut at other columns: the grid of cuts has far more
    cells than boxes, so the sweep answers."""
    bricks = [
        entry((64, 512), (row, start), (1, stop - start))
        for row in range(64)
        for start, stop in zip(*_brick_cuts(row), strict=True)
    ]
    columns = {b.offsets[1] for b in bricks} | {512}
    assert (len(columns) - 1) * 64 > coverage.GRID_CELLS_PER_BOX * len(bricks)
    check_coverage(bricks, WHERE)
    bricks.append(entry((64, 512), (50, 300), (2, 2)))
    assert verdict(check_coverage, bricks) == verdict(quadratic_check_coverage, bricks)


def _brick_cuts(row: int) -> tuple[list[int], list[int]]:
    marks = [0, *range(row + 1, 512, 61), 512]
    return marks[:-1], marks[1:]


# -- broken controls: sweeps that skip equal starts ------------------------------


def skips_equal_starts(lo: np.ndarray, hi: np.ndarray) -> tuple[int, int] | None:
    """The interval sweep, seeing only the first interval at each start."""
    _, first = np.unique(lo, return_index=True)
    pair = real_interval_overlap(lo[first], hi[first])
    return None if pair is None else (int(first[pair[0]]), int(first[pair[1]]))


real_interval_overlap = coverage.interval_overlap


def test_broken_control_an_interval_sweep_that_skips_equal_starts_misses_an_overlap() -> None:
    boxes = [entry((5, 3), (0, 0), (2, 3)), entry((5, 3), (0, 0), (3, 3))]  # 5 rows' worth
    assert verdict(check_coverage, boxes) == (
        "boxes of tensor 't' overlap at offsets [0, 0] (run=r, generation=7, tensor=t)"
    )
    with mock.patch.object(coverage, "interval_overlap", skips_equal_starts):
        assert verdict(check_coverage, boxes) is None  # the broken sweep accepts it
        with pytest.raises(AssertionError):
            assert_same_verdict(boxes)


def test_broken_control_a_sweep_that_skips_boxes_entering_together_misses_an_overlap() -> None:
    boxes = [  # whichever dimension is swept, the first two enter together
        entry((3, 3), (0, 0), (2, 2)),
        entry((3, 3), (0, 0), (1, 3)),
        entry((3, 3), (2, 0), (1, 2)),  # 4 + 3 + 2: as many elements as the tensor
    ]
    with path("sweep"):
        assert verdict(check_coverage, boxes) == verdict(quadratic_check_coverage, boxes)
        assert "overlap at offsets [0, 0]" in (verdict(check_coverage, boxes) or "")
        with mock.patch.object(coverage, "_among", lambda lo, hi, boxes: None):
            assert verdict(check_coverage, boxes) is None


# -- the parts -------------------------------------------------------------------


def test_coordinates_past_int64_are_ranked_and_sizes_counted_exactly() -> None:
    huge = 2**70
    halves = [entry((huge,), (0,), (huge // 2,)), entry((huge,), (huge // 2,), (huge // 2,))]
    corners = coverage.box_corners([b.offsets for b in halves], [b.local_shape for b in halves], 1)
    assert corners.ranked and corners.lo.tolist() == [[0, 1]]
    assert coverage.element_count(corners, [b.local_shape for b in halves]) == huge
    check_coverage(halves, WHERE)
    halves[1] = entry((huge,), (huge // 2 - 1,), (huge // 2,))
    assert verdict(check_coverage, halves) == (
        f"boxes of tensor 't' overlap at offsets [{huge // 2 - 1}] (run=r, generation=7, tensor=t)"
    )


def test_element_count_falls_back_to_exact_integers_where_int64_would_overflow() -> None:
    extents = [(2**31, 2**31), (2**31, 2**31), (2**31, 2**31)]
    corners = coverage.box_corners([(0, 0)] * 3, extents, 2)
    assert not corners.ranked
    assert (
        coverage.element_count(corners, extents) == 3 * 2**62 == sum(math.prod(e) for e in extents)
    )
