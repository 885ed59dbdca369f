"""Unit tests of castore.format.layout: boxes, copy plans and the chunks a region touches.

The reference for every check is plain numpy slicing on a whole array: a region
copied chunk by chunk must land exactly where ``dst[dst_box] = src[src_box]``
puts it, and the chunks a plan names must be exactly those holding a byte of
the region.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from castore.errors import InvalidIndexError
from castore.format.layout import Box, CopyPlan, normalize_index, plan_copy

# -- helpers -------------------------------------------------------------------


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.shape, strict=True))


def region_byte_chunks(shape: tuple[int, ...], region: Box, itemsize: int, chunk: int) -> set[int]:
    """Chunks of a row-major buffer of ``shape`` that hold any byte of ``region`` (brute force)."""
    elements = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)[box_slices(region)]
    found: set[int] = set()
    for element in elements.reshape(-1).tolist():
        first, last = element * itemsize, element * itemsize + itemsize - 1
        found.update(range(first // chunk, last // chunk + 1))
    return found


def copy_via_chunks(
    plan: CopyPlan, src_bytes: np.ndarray, dst_bytes: np.ndarray, chunk: int
) -> tuple[list[int], int]:
    """Feed the plan the source chunks it names, as a reader would; return them and bytes copied."""
    indices = [int(i) for i in plan.chunk_indices(chunk)]
    copied = 0
    for index in indices:
        start = index * chunk
        copied += plan.copy_from_chunk(start, src_bytes[start : start + chunk], dst_bytes)
    return indices, copied


def random_bytes_array(shape: tuple[int, ...], itemsize: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=math.prod(shape) * itemsize, dtype=np.uint8)
    return raw.view(np.dtype(f"V{itemsize}")).reshape(shape)


def check_copy(
    src_shape: tuple[int, ...],
    src_region: Box,
    dst_shape: tuple[int, ...],
    dst_offsets: tuple[int, ...],
    itemsize: int,
    chunk: int,
) -> None:
    """Assemble a region from chunks via plan_copy and compare with numpy slicing."""
    src = random_bytes_array(src_shape, itemsize, seed=1)
    dst_region = Box(dst_offsets, src_region.shape)
    expected = random_bytes_array(dst_shape, itemsize, seed=2)
    actual = expected.copy()
    expected[box_slices(dst_region)] = src[box_slices(src_region)]

    plan = plan_copy(src_shape, src_region, dst_shape, dst_region, itemsize)
    src_flat = src.reshape(-1).view(np.uint8)
    dst_flat = actual.reshape(-1).view(np.uint8)
    indices, copied = copy_via_chunks(plan, src_flat, dst_flat, chunk)

    assert actual.tobytes() == expected.tobytes()
    assert copied == plan.nbytes == src_region.numel * itemsize
    assert indices == sorted(region_byte_chunks(src_shape, src_region, itemsize, chunk))


# -- Box -----------------------------------------------------------------------


def test_box_whole_stops_numel() -> None:
    box = Box.whole((3, 4, 5))
    assert box == Box((0, 0, 0), (3, 4, 5))
    assert box.stops == (3, 4, 5)
    assert box.numel == 60
    assert Box((1, 2), (3, 0)).numel == 0
    assert Box.whole(()).numel == 1  # a 0-d tensor holds one element


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (Box((0, 0), (4, 4)), Box((2, 1), (4, 2)), Box((2, 1), (2, 2))),
        (Box((0, 0), (4, 4)), Box((1, 1), (2, 2)), Box((1, 1), (2, 2))),  # contained
        (Box((5,), (3,)), Box((0,), (10,)), Box((5,), (3,))),
        (Box((0, 0), (4, 4)), Box((4, 0), (2, 4)), None),  # touching rows: no shared element
        (Box((0, 0), (4, 4)), Box((0, 4), (4, 1)), None),  # touching columns
        (Box((0, 0), (4, 4)), Box((6, 6), (1, 1)), None),  # far apart
        (Box((0, 0), (4, 4)), Box((1, 1), (0, 2)), None),  # zero-size box
        (Box((0, 0, 0), (2, 3, 4)), Box((1, 2, 3), (5, 5, 5)), Box((1, 2, 3), (1, 1, 1))),
        (Box((), ()), Box((), ()), Box((), ())),  # 0-d boxes share their one element
    ],
)
def test_box_intersect(a: Box, b: Box, expected: Box | None) -> None:
    assert a.intersect(b) == expected
    assert b.intersect(a) == expected


def test_box_relative_to() -> None:
    assert Box((5, 7), (2, 3)).relative_to(Box((4, 2), (10, 10))) == Box((1, 5), (2, 3))


boxes_1d = st.tuples(st.integers(0, 12), st.integers(0, 8))


@given(st.lists(st.tuples(boxes_1d, boxes_1d), min_size=1, max_size=3))
def test_box_intersect_matches_element_sets(dims: list[tuple[tuple[int, int], ...]]) -> None:
    """Property: the intersection holds exactly the elements both boxes hold."""
    a = Box(tuple(d[0][0] for d in dims), tuple(d[0][1] for d in dims))
    b = Box(tuple(d[1][0] for d in dims), tuple(d[1][1] for d in dims))
    space = tuple(20 for _ in dims)
    mask_a = np.zeros(space, dtype=bool)
    mask_b = np.zeros(space, dtype=bool)
    mask_a[box_slices(a)] = True
    mask_b[box_slices(b)] = True
    common = mask_a & mask_b
    result = a.intersect(b)
    if not common.any():
        assert result is None
    else:
        assert result is not None
        expected = np.zeros(space, dtype=bool)
        expected[box_slices(result)] = True
        assert np.array_equal(expected, common)


# -- plan_copy and copy_from_chunk ----------------------------------------------


def test_plan_copy_rejects_mismatched_regions() -> None:
    with pytest.raises(ValueError, match="region shapes differ"):
        plan_copy((4, 4), Box((0, 0), (2, 2)), (4, 4), Box((0, 0), (2, 3)), 4)


def test_plan_copy_empty_region_touches_no_chunk() -> None:
    plan = plan_copy((4, 4), Box((1, 1), (0, 3)), (0, 3), Box((0, 0), (0, 3)), 4)
    assert plan.nbytes == 0
    assert plan.chunk_indices(16).size == 0


def test_plan_copy_whole_buffer_is_one_run() -> None:
    plan = plan_copy((3, 5), Box.whole((3, 5)), (3, 5), Box.whole((3, 5)), 4)
    assert plan.src_starts.tolist() == [0]
    assert plan.run_bytes == 60


def test_plan_copy_merges_whole_trailing_dimensions() -> None:
    # Rows 1..2 of a (4, 6) int32 buffer: one contiguous run of 2 rows.
    plan = plan_copy((4, 6), Box((1, 0), (2, 6)), (2, 6), Box.whole((2, 6)), 4)
    assert plan.src_starts.tolist() == [24]
    assert plan.dst_starts.tolist() == [0]
    assert plan.run_bytes == 48
    # Columns 2..4: one run per row.
    plan = plan_copy((4, 6), Box((0, 2), (4, 3)), (4, 3), Box.whole((4, 3)), 4)
    assert plan.src_starts.tolist() == [8, 32, 56, 80]
    assert plan.dst_starts.tolist() == [0, 12, 24, 36]
    assert plan.run_bytes == 12


def test_copy_from_chunk_outside_region_copies_nothing() -> None:
    plan = plan_copy((8, 8), Box((2, 0), (1, 8)), (1, 8), Box.whole((1, 8)), 1)  # bytes 16..24
    dst = np.zeros(8, dtype=np.uint8)
    assert plan.chunk_indices(8).tolist() == [2]
    assert plan.copy_from_chunk(0, np.full(8, 7, dtype=np.uint8), dst) == 0
    assert plan.copy_from_chunk(24, np.full(8, 7, dtype=np.uint8), dst) == 0
    assert not dst.any()
    assert plan.copy_from_chunk(16, np.full(8, 9, dtype=np.uint8), dst) == 8
    assert dst.tolist() == [9] * 8


@pytest.mark.parametrize(
    ("src_shape", "region", "dst_shape", "dst_offsets", "itemsize", "chunk"),
    [
        # Row range of a matrix whose rows are exactly one chunk.
        ((8, 4), Box((2, 0), (3, 4)), (3, 4), (0, 0), 4, 16),
        # Column range: one short run per row, many runs inside one chunk (vectorized path).
        ((64, 4), Box((0, 1), (64, 2)), (64, 2), (0, 0), 1, 256),
        # Runs longer than a chunk: every run spans several chunks.
        ((6, 50), Box((1, 3), (4, 40)), (4, 40), (0, 0), 2, 16),
        # Into the middle of a larger destination.
        ((5, 6, 7), Box((1, 2, 3), (3, 2, 4)), (6, 6, 6), (2, 1, 0), 8, 24),
        # Chunk size not a multiple of the item size: items straddle chunk boundaries.
        ((7, 9), Box((1, 2), (5, 6)), (5, 6), (0, 0), 4, 10),
        # A single element, and a 0-d buffer.
        ((4, 4), Box((3, 3), (1, 1)), (1, 1), (0, 0), 2, 5),
        ((), Box((), ()), (), (), 8, 3),
    ],
)
def test_plan_copy_reassembles_region_from_chunks(
    src_shape: tuple[int, ...],
    region: Box,
    dst_shape: tuple[int, ...],
    dst_offsets: tuple[int, ...],
    itemsize: int,
    chunk: int,
) -> None:
    check_copy(src_shape, region, dst_shape, dst_offsets, itemsize, chunk)


def test_check_copy_detects_a_wrong_plan() -> None:
    """Broken control: a plan shifted by one item fails the numpy comparison."""
    src_shape, region = (8, 4), Box((2, 0), (3, 4))
    good = plan_copy(src_shape, region, (3, 4), Box.whole((3, 4)), 4)
    shifted = CopyPlan(good.src_starts + 4, good.dst_starts, good.run_bytes)
    src = random_bytes_array(src_shape, 4, seed=1)
    expected = src[box_slices(region)].tobytes()
    for plan, ok in ((good, True), (shifted, False)):
        dst = np.zeros(3 * 4 * 4, dtype=np.uint8)
        copy_via_chunks(plan, src.reshape(-1).view(np.uint8), dst, 16)
        assert (dst.tobytes() == expected) is ok


@st.composite
def copy_cases(draw: Any) -> tuple[Any, ...]:
    ndim = draw(st.integers(0, 4))
    src_shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    offsets, sizes = [], []
    for size in src_shape:
        lo = draw(st.integers(0, size))
        offsets.append(lo)
        sizes.append(draw(st.integers(0, size - lo)))
    region = Box(tuple(offsets), tuple(sizes))
    pads = draw(st.lists(st.integers(0, 2), min_size=ndim, max_size=ndim))
    dst_offsets = tuple(draw(st.integers(0, pad)) for pad in pads)
    dst_shape = tuple(s + pad for s, pad in zip(sizes, pads, strict=True))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    chunk = draw(st.integers(1, 64))
    return src_shape, region, dst_shape, dst_offsets, itemsize, chunk


@settings(max_examples=300, deadline=None)
@given(copy_cases())
def test_plan_copy_property(case: tuple[Any, ...]) -> None:
    """Property: chunk-wise copying equals numpy slicing, and reads exactly the needed chunks."""
    check_copy(*case)


# -- normalize_index -----------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_normalize_index_box_then_selector_equals_numpy(data: st.DataObject) -> None:
    """Property: ``arr[box][selector] == arr[index]``, and the box is the tightest cover."""
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
    index = data.draw(hnp.basic_indices(shape, min_dims=0, allow_newaxis=False))
    arr = np.arange(math.prod(shape)).reshape(shape)
    box, selector = normalize_index(index, shape)
    assert len(box.shape) == len(shape)
    assert all(0 <= o and o + s <= n for o, s, n in zip(box.offsets, box.shape, shape, strict=True))
    expected = arr[index]
    np.testing.assert_array_equal(arr[box_slices(box)][selector], expected)
    picked = np.asarray(expected).reshape(-1)
    if picked.size == 0:
        assert box.numel == 0
    elif shape:  # the box is the bounding box of the picked elements
        coords = np.stack(np.unravel_index(picked, shape), axis=-1)
        assert box.offsets == tuple(coords.min(axis=0).tolist())
        assert box.stops == tuple((coords.max(axis=0) + 1).tolist())


@pytest.mark.parametrize(
    "index",
    [
        (0, 0, 0),
        (slice(None), slice(None), 1),
        (..., ...),
        5,
        -6,
        (0, 7),
        1.0,
        None,
        [0, 1],
        True,
        slice(0, 4, 0),
        slice(0.5, 3),
        "0",
    ],
)
def test_normalize_index_rejects_bad_indices(index: Any) -> None:
    with pytest.raises(InvalidIndexError):
        normalize_index(index, (5, 7))
