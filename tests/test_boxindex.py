"""castore.core.boxindex: a restoring rank finds the saved boxes its targets overlap.

Property tests against a scan of every box: on random tilings (row, column
and 2-D block shards, uneven, with empty boxes) and on random box sets that
overlap or leave gaps, ``BoxIndex.overlapping`` finds exactly the boxes the
scan finds, and ``covered_once`` refuses a region exactly when the scan says
the region is not covered exactly once. The broken control is an index whose
window ignores how far a box reaches back: it misses a box that starts before
the region.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from castore.core import boxindex
from castore.core.boxindex import BoxIndex, covered_once
from castore.core.reading import check_coverage
from castore.errors import CoverageError
from castore.format.layout import Box
from castore.format.objects import TensorEntry

WHERE = {"run": "r", "generation": 1, "tensor": "t"}


def entry(shape: tuple[int, ...], box: Box, dtype: str = "float32") -> TensorEntry:
    return TensorEntry.trusted("t", dtype, shape, box.offsets, box.shape, 0, 1, (), "numpy")


def cuts(draw: Any, size: int, pieces: int) -> list[int]:
    inner = sorted(draw(st.lists(st.integers(0, size), min_size=pieces - 1, max_size=pieces - 1)))
    return [0, *inner, size]


@st.composite
def tilings(draw: Any) -> tuple[tuple[int, ...], list[Box]]:
    """A tensor of 1-3 dims cut into a grid of boxes (some empty), in a random order."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 12)) for _ in range(ndim))
    per_dim = [cuts(draw, size, draw(st.integers(1, 6))) for size in shape]
    boxes = [
        Box(tuple(c[i] for c, i in zip(per_dim, at, strict=True)),
            tuple(c[i + 1] - c[i] for c, i in zip(per_dim, at, strict=True)))
        for at in itertools.product(*(range(len(c) - 1) for c in per_dim))
    ]  # fmt: skip
    return shape, draw(st.permutations(boxes))


@st.composite
def regions(draw: Any, shape: tuple[int, ...]) -> Box:
    lo = [draw(st.integers(0, size)) for size in shape]
    hi = [draw(st.integers(a, size)) for a, size in zip(lo, shape, strict=True)]
    return Box(tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True)))


def scanned(boxes: list[Box], region: Box) -> list[Box]:
    found = []
    for box in boxes:
        part = region.intersect(box)
        if part is not None and part.numel:
            found.append(box)
    return found


def exactly_once(boxes: list[Box], region: Box) -> bool:
    count = np.zeros(region.shape, dtype=np.int64)
    for box in boxes:
        part = region.intersect(box)
        if part is not None and part.numel:
            rel = part.relative_to(region)
            count[tuple(slice(o, o + s) for o, s in zip(rel.offsets, rel.shape, strict=True))] += 1
    return bool((count == 1).all())


def key(entries: list[TensorEntry]) -> list[tuple[Any, ...]]:
    return sorted((e.offsets, e.local_shape) for e in entries)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_index_finds_what_a_scan_finds_on_tilings(data: Any) -> None:
    shape, boxes = data.draw(tilings())
    entries = [entry(shape, b) for b in boxes]
    index = BoxIndex(entries)
    for _ in range(4):
        region = data.draw(regions(shape))
        found = index.overlapping(region)
        assert key(found) == sorted((b.offsets, b.shape) for b in scanned(boxes, region))
        covered_once(found, region, WHERE, check_coverage)  # a tiling covers every region


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_covered_once_refuses_exactly_the_regions_a_scan_refuses(data: Any) -> None:
    """Random boxes (overlaps, gaps, duplicates) in a tensor of 1-3 dims."""
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.integers(1, 8)) for _ in range(ndim))
    boxes = [data.draw(regions(shape)) for _ in range(data.draw(st.integers(1, 40)))]
    index = BoxIndex([entry(shape, b) for b in boxes])
    region = data.draw(regions(shape))
    found = index.overlapping(region)
    assert key(found) == sorted((b.offsets, b.shape) for b in scanned(boxes, region))
    if exactly_once(boxes, region):
        covered_once(found, region, WHERE, check_coverage)
    else:
        with pytest.raises(CoverageError):
            covered_once(found, region, WHERE, check_coverage)


def test_a_region_outside_every_box_and_disagreeing_boxes_are_refused() -> None:
    boxes = [entry((8, 4), Box((0, 0), (4, 4)))]
    with pytest.raises(CoverageError, match="no saved box holds the region at offsets"):
        covered_once([], Box((4, 0), (4, 4)), WHERE, check_coverage)
    odd = [boxes[0], entry((8, 4), Box((4, 0), (4, 4)), dtype="float16")]
    with pytest.raises(CoverageError, match="disagree"):
        covered_once(odd, Box((0, 0), (8, 4)), WHERE, check_coverage)


def test_a_gap_inside_the_region_names_the_region() -> None:
    shape = (64, 4)
    boxes = [entry(shape, Box((r, 0), (1, 4))) for r in range(64) if r != 40]
    index = BoxIndex(boxes)
    region = Box((32, 0), (16, 4))
    with pytest.raises(CoverageError, match=r"within the region at offsets \[32, 0\]"):
        covered_once(index.overlapping(region), region, WHERE, check_coverage)


def test_broken_control_a_window_that_ignores_how_far_boxes_reach_misses_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Boxes of 1 row and one of 30 rows starting at row 0: a region at row 20 lies in
    the long box. An index whose window starts at the region's own row misses it."""
    shape = (64, 4)
    boxes = [entry(shape, Box((0, 0), (30, 4)))]
    boxes += [entry(shape, Box((r, 0), (1, 4))) for r in range(30, 64)]
    region = Box((20, 0), (2, 4))
    assert key(BoxIndex(boxes).overlapping(region)) == [((0, 0), (30, 4))]
    broken = BoxIndex(boxes)
    broken.sorted.longest = 0  # the window ignores how far a box reaches back
    assert broken.overlapping(region) == []
    with pytest.raises(CoverageError):
        covered_once(broken.overlapping(region), region, WHERE, check_coverage)
    assert boxindex._SCAN < len(boxes)  # the index (not the scan) answered


def test_a_0d_tensors_one_box_is_found_for_its_one_element() -> None:
    """A scalar (a replicated step counter): its box has no coordinates."""
    scalar = TensorEntry.trusted("s", "int64", (), (), (), 8, 8, (bytes(32),), "numpy")
    assert BoxIndex([scalar]).overlapping(Box((), ())) == [scalar]
    assert BoxIndex([]).overlapping(Box((), ())) == []
