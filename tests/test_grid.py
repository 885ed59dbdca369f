"""The chunk grid (castore/format/grid.py, docs/design/grid.md): cells that belong
to the tensor, not to the box a rank holds.

Properties over random shapes (0-4 dims, zero-size dims included), itemsizes
and chunk sizes: the cells tile the tensor, the cells a box overlaps are
found by arithmetic and match a brute-force scan, the parts of cells a split
holds cover each box exactly, and two different splits name the same whole
cells. Then the chunk count against today's per-box cutting.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from castore.format.grid import (
    ChunkGrid,
    cell_box,
    cell_count,
    cell_index,
    cell_nbytes,
    cell_part,
    cell_parts,
    cell_position,
    cells_overlapping,
    chunk_grid,
    span_cells,
)
from castore.format.layout import Box

MIB = 1 << 20
shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)
itemsizes = st.sampled_from([1, 2, 4, 8])
chunk_sizes = st.integers(1, 600)


def _grid(shape: tuple[int, ...], itemsize: int, chunk_size: int) -> ChunkGrid:
    return chunk_grid(shape, itemsize, chunk_size)


@st.composite
def boxes_in(draw: st.DrawFn, shape: tuple[int, ...]) -> Box:
    offsets, sizes = [], []
    for size in shape:
        lo = draw(st.integers(0, size))
        offsets.append(lo)
        sizes.append(draw(st.integers(0, size - lo)))
    return Box(tuple(offsets), tuple(sizes))


def _cuts(draw: st.DrawFn, size: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` contiguous ranges covering [0, size), some possibly empty."""
    marks = sorted(draw(st.lists(st.integers(0, size), min_size=pieces - 1, max_size=pieces - 1)))
    bounds = [0, *marks, size]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]


@st.composite
def splits_of(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """An N-way split of the tensor: along one dimension (rows, columns) or a 2-D grid."""
    if not shape:
        return [Box((), ())]
    dims = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=2, unique=True))
    per_dim = {d: _cuts(draw, shape[d], draw(st.integers(1, 4))) for d in dims}
    boxes = [Box((0,) * len(shape), shape)]
    for d, cuts in per_dim.items():
        boxes = [
            Box(b.offsets[:d] + (lo,) + b.offsets[d + 1 :], b.shape[:d] + (n,) + b.shape[d + 1 :])
            for b in boxes
            for lo, n in cuts
        ]
    return boxes


def _owner_map(grid: ChunkGrid) -> np.ndarray:
    """How many cells claim each element: exactly one everywhere for a tiling."""
    claims = np.zeros(grid.shape, dtype=np.int64)
    for index in range(cell_count(grid)):
        box = cell_box(grid, index)
        claims[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.shape, strict=True))] += 1
    return claims


@settings(max_examples=150, deadline=None)
@given(shape=shapes, itemsize=itemsizes, chunk_size=chunk_sizes)
def test_cells_tile_the_tensor_exactly_and_each_fits_a_chunk(
    shape: tuple[int, ...], itemsize: int, chunk_size: int
) -> None:
    grid = _grid(shape, itemsize, chunk_size)
    if math.prod(shape) == 0 and shape:
        assert cell_count(grid) == 1
        assert cell_box(grid, 0) == Box.whole(shape)
        return
    assert (_owner_map(grid) == 1).all()
    for index in range(cell_count(grid)):
        assert cell_index(grid, cell_position(grid, index)) == index
        assert cell_nbytes(grid, index) <= max(chunk_size, itemsize)
    # Row-major order: cell offsets ascend lexicographically.
    offsets = [cell_box(grid, i).offsets for i in range(cell_count(grid))]
    assert offsets == sorted(offsets)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), shape=shapes, itemsize=itemsizes, chunk_size=chunk_sizes)
def test_cells_a_box_overlaps_are_exactly_those_that_intersect_it(
    data: st.DataObject, shape: tuple[int, ...], itemsize: int, chunk_size: int
) -> None:
    grid = _grid(shape, itemsize, chunk_size)
    box = data.draw(boxes_in(shape))
    found = list(span_cells(grid, cells_overlapping(grid, box)))
    scanned = [
        i
        for i in range(cell_count(grid))
        if box.numel and cell_box(grid, i).numel and cell_box(grid, i).intersect(box) is not None
    ]
    assert found == scanned
    assert cells_overlapping(grid, box).count == len(found)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), shape=shapes, itemsize=itemsizes, chunk_size=chunk_sizes)
def test_the_parts_a_split_holds_cover_each_box_exactly(
    data: st.DataObject, shape: tuple[int, ...], itemsize: int, chunk_size: int
) -> None:
    grid = _grid(shape, itemsize, chunk_size)
    for box in data.draw(splits_of(shape)):
        parts = cell_parts(grid, box)
        claims = np.zeros(box.shape, dtype=np.int64)
        for part in parts:
            assert part.whole == (part.box == cell_box(grid, part.cell))
            assert part.box.intersect(box) == part.box  # inside the box
            local = part.box.relative_to(box)
            at = tuple(slice(o, o + s) for o, s in zip(local.offsets, local.shape, strict=True))
            claims[at] += 1
        assert (claims == 1).all()
        assert [p.cell for p in parts] == sorted({p.cell for p in parts})


@settings(max_examples=150, deadline=None)
@given(data=st.data(), shape=shapes, itemsize=itemsizes, chunk_size=chunk_sizes)
def test_two_splits_of_one_tensor_name_the_same_whole_cells(
    data: st.DataObject, shape: tuple[int, ...], itemsize: int, chunk_size: int
) -> None:
    """The dedup promise: a cell held whole is the same chunk whatever the split."""
    grid = _grid(shape, itemsize, chunk_size)

    def whole_cells(boxes: list[Box]) -> dict[int, Box]:
        return {p.cell: p.box for b in boxes for p in cell_parts(grid, b) if p.whole}

    first = whole_cells(data.draw(splits_of(shape)))
    second = whole_cells(data.draw(splits_of(shape)))
    for cell in first.keys() & second.keys():
        assert first[cell] == second[cell] == cell_box(grid, cell)
    # The whole tensor, held by one process, holds every non-empty cell whole.
    alone = whole_cells([Box.whole(shape)])
    assert set(first) <= set(alone) and set(second) <= set(alone)
    assert len(alone) == (cell_count(grid) if math.prod(shape) else 0)
    # Rebuilding the grid from the same three numbers gives the same grid.
    assert chunk_grid(shape, itemsize, chunk_size) == grid


def test_the_grid_does_not_follow_the_box() -> None:
    """The broken control's contrast: per-box cutting moves with the box, the grid does not."""
    grid = chunk_grid((2000, 1000), 4, 4 * MIB)
    four = [Box((500 * r, 0), (500, 1000)) for r in range(4)]
    three = [Box((667 * r, 0), (min(667, 2000 - 667 * r), 1000)) for r in range(3)]
    whole4 = {p.cell for b in four for p in cell_parts(grid, b) if p.whole}
    whole3 = {p.cell for b in three for p in cell_parts(grid, b) if p.whole}
    assert grid.cell_shape == (1048, 1000)
    assert whole3 == set()  # bands of 1048 rows: neither split holds one whole
    assert whole4 == set()
    assert {p.cell for p in cell_parts(grid, Box.whole((2000, 1000)))} == {0, 1}


def test_special_shapes() -> None:
    scalar = chunk_grid((), 4, 8)
    assert cell_count(scalar) == 1 and cell_box(scalar, 0) == Box((), ())
    assert cell_parts(scalar, Box((), ())) == (cell_part(scalar, 0, Box((), ())),)
    empty = chunk_grid((0, 5), 4, 8)
    assert cell_count(empty) == 1 and cell_parts(empty, Box.whole((0, 5))) == ()
    huge_items = chunk_grid((3, 2), 8, 4)  # one element larger than a chunk
    assert huge_items.cell_shape == (1, 1) and cell_count(huge_items) == 6
    wide = chunk_grid((4, 10, 100), 4, 1000)  # a row of 4000 bytes: tiles of 2 x 100
    assert wide.cell_shape == (1, 2, 100) and wide.counts == (4, 5, 1)
    with pytest.raises(ValueError):
        chunk_grid((2,), 4, 0)
    with pytest.raises(IndexError):
        cell_box(wide, cell_count(wide))


def _today_chunks(boxes: list[Box], itemsize: int, chunk_size: int) -> int:
    """Today's chunk count: each box's buffer cut every chunk_size bytes (docs/FORMAT.md)."""
    return sum(-(-b.numel * itemsize // chunk_size) for b in boxes)


def _row_split(shape: tuple[int, ...], n: int) -> list[Box]:
    step = -(-shape[0] // n)  # as torch.chunk splits
    return [
        Box((lo,) + (0,) * (len(shape) - 1), (min(step, shape[0] - lo),) + shape[1:])
        for lo in range(0, shape[0], step)
    ]


TYPICAL = [
    ((2000, 1000), 4),
    ((50257, 768), 2),
    ((4096,), 4),
    ((8, 3, 3, 64), 4),
    ((4096, 4096), 2),
    ((11008, 4096), 2),
    ((768, 3072), 4),
]


@pytest.mark.parametrize(("shape", "itemsize"), TYPICAL)
@pytest.mark.parametrize("ranks", [1, 4])
def test_chunk_count_stays_within_one_and_a_half_times_todays(
    shape: tuple[int, ...], itemsize: int, ranks: int
) -> None:
    chunk_size = 4 * MIB
    grid = chunk_grid(shape, itemsize, chunk_size)
    boxes = _row_split(shape, ranks)
    on_grid = sum(len(cell_parts(grid, b)) for b in boxes)
    today = _today_chunks(boxes, itemsize, chunk_size)
    assert on_grid <= 1.5 * today, (shape, ranks, on_grid, today)
