"""Chunks on the tensor's grid (issue 38): dedup across layouts, the format, mixed stores.

- Property tests cut random tensors by random N -> M layouts (rows, columns,
  2-D blocks, empty blocks) exactly as a save cuts them (``cut_leaf``) and check
  that a cell held whole by both layouts is the same chunk, that a re-save along
  the cell dimension writes at most the cells the two layouts cut, and that the
  chunks of every box tile its buffer. The broken control cuts on a grid
  derived from the box instead of the tensor: the same checks fail.
- Real saves through ``write_leaves`` into a real LMDB store count new bytes.
- Real gloo groups (3 ranks, then 2, then 1 process) save the same bytes into
  one store: the re-saves write at most 5% new, and every restore, at every
  rank count and by columns, is bitwise.
- A store holding pre-grid (format 2) and grid (format 3) generations of one
  run loads, verifies, slices, copies and collects both; an older castore
  refuses format 3 with its "upgrade castore" error; forged grids are refused.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import pytest
from dist_harness import describe, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from pregrid import pre_grid_saves

import castore
from castore.chunkstore.base import Namespace
from castore.core import chunkio
from castore.core.chunkio import cut_leaf, write_leaves
from castore.errors import CorruptObjectError, FormatVersionError
from castore.format import objects
from castore.format.grid import box_chunk_starts, cell_shape_of, writer_cell
from castore.format.hashing import digest_bytes
from castore.format.layout import Box
from castore.format.tree import TensorLeaf
from castore.gc import RetentionPolicy, collect_garbage
from castore.verify import verify_store

CHUNK = 4096
DTYPES = {"float32": np.float32, "uint16": np.uint16, "int64": np.int64, "uint8": np.uint8}


# -- layouts ----------------------------------------------------------------------------


def split_points(size: int, parts: list[float]) -> list[int]:
    """Cut points of ``size`` at the given fractions (sorted, may repeat: empty blocks)."""
    return sorted(int(size * f) for f in parts)


def layout(shape: tuple[int, ...], axes: dict[int, list[int]]) -> list[Box]:
    """The boxes of a block layout: each axis in ``axes`` cut at its points."""
    ranges = []
    for dim, size in enumerate(shape):
        points = [0, *axes.get(dim, []), size]
        ranges.append([(a, b - a) for a, b in zip(points, points[1:], strict=False)])
    boxes = [Box((), ())]
    for per_dim in ranges:
        boxes = [Box((*b.offsets, o), (*b.shape, s)) for b in boxes for o, s in per_dim]
    return boxes


def leaf_of(array: np.ndarray, box: Box, name: str = "t") -> TensorLeaf:
    index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.shape, strict=True))
    block = np.ascontiguousarray(array[index])
    data = block.reshape(-1).view(np.uint8)
    dtype = {np.dtype(v).name: k for k, v in DTYPES.items()}[array.dtype.name]
    return TensorLeaf(name, dtype, array.shape, data, "numpy", box.offsets, box.shape)


def chunks_of(array: np.ndarray, boxes: list[Box]) -> dict[bytes, int]:
    """Digest -> length of every chunk the boxes store, cut as a save cuts them."""
    found = {}
    for box in boxes:
        for view in cut_leaf(leaf_of(array, box), CHUNK):
            found[digest_bytes(view)] = view.nbytes
    return found


def new_bytes(array: np.ndarray, before: list[Box], after: list[Box]) -> int:
    old = chunks_of(array, before)
    return sum(n for d, n in chunks_of(array, after).items() if d not in old)


def whole_cells(shape: tuple[int, ...], boxes: list[Box]) -> set[Box]:
    """The cells of the writer's grid that some box holds whole."""
    itemsize = 4
    cell = cell_shape_of(shape, writer_cell(shape, itemsize, CHUNK))
    held = set()
    for box in boxes:
        if box.numel == 0:
            continue
        lo = [o // c for o, c in zip(box.offsets, cell, strict=True)]
        hi = [-(-s // c) for s, c in zip(box.stops, cell, strict=True)]
        for pos in np.ndindex(*[b - a for a, b in zip(lo, hi, strict=True)]):
            off = tuple((a + p) * c for a, p, c in zip(lo, pos, cell, strict=True))
            cb = Box(off, tuple(min(c, g - o) for c, g, o in zip(cell, shape, off, strict=True)))
            if cb.intersect(box) == cb:
                held.add(cb)
    return held


shapes = st.one_of(
    st.tuples(st.integers(1, 3000)),
    st.tuples(st.integers(1, 300), st.integers(1, 90)),
    st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(1, 30)),
)
fractions = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, a=fractions, b=fractions, a2=fractions, b2=fractions, dim=st.integers(0, 2))
def test_a_cell_held_whole_by_both_layouts_is_one_chunk(shape, a, b, a2, b2, dim) -> None:
    """N -> M over rows, columns and 2-D blocks, empty blocks included."""
    rng = np.random.default_rng(len(a) + 10 * len(b))
    array = rng.standard_normal(shape).astype(np.float32)
    dim = min(dim, len(shape) - 1)
    other = (dim + 1) % len(shape)
    before = layout(
        shape, {dim: split_points(shape[dim], a), other: split_points(shape[other], a2)}
    )
    after = layout(shape, {dim: split_points(shape[dim], b), other: split_points(shape[other], b2)})
    old = chunks_of(array, before)
    index = lambda box: tuple(slice(o, o + s) for o, s in zip(box.offsets, box.shape, strict=True))  # noqa: E731
    for cell in whole_cells(shape, before) & whole_cells(shape, after):
        digest = digest_bytes(np.ascontiguousarray(array[index(cell)]).reshape(-1).view(np.uint8))
        assert digest in old
        assert digest in chunks_of(array, after)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, a=fractions, b=fractions)
def test_a_resave_along_the_cells_writes_at_most_the_cut_cells(shape, a, b) -> None:
    array = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    k, extent = writer_cell(shape, 4, CHUNK)
    cell_bytes = extent * math.prod(shape[k + 1 :]) * 4
    lead = math.prod(shape[:k])
    before, after = (
        layout(shape, {k: split_points(shape[k], a)}),
        layout(shape, {k: split_points(shape[k], b)}),
    )
    # Every cut of either layout costs at most one cell under each leading index.
    bound = (len(a) + len(b)) * lead * cell_bytes
    assert new_bytes(array, before, after) <= bound


@settings(max_examples=80, deadline=None)
@given(shape=shapes, a=fractions, a2=fractions, dtype=st.sampled_from(sorted(DTYPES)))
def test_every_box_is_tiled_by_its_chunks_and_each_cell_fits_a_chunk(shape, a, a2, dtype) -> None:
    array = (np.arange(math.prod(shape)) % 251).astype(DTYPES[dtype]).reshape(shape)
    for box in layout(
        shape, {0: split_points(shape[0], a), len(shape) - 1: split_points(shape[-1], a2)}
    ):
        leaf = leaf_of(array, box)
        views = cut_leaf(leaf, CHUNK)
        assert b"".join(bytes(v) for v in views) == leaf.data.tobytes()
        assert all(0 < v.nbytes <= CHUNK for v in views)
        entry = chunkio.entry_of(leaf, CHUNK, tuple(digest_bytes(v) for v in views))
        entry.check()  # the count and the grid agree with what a reader derives
        assert [entry.chunk_length(i) for i in range(len(views))] == [v.nbytes for v in views]


def test_the_broken_control_a_grid_from_the_box_fails_the_dedup_checks(monkeypatch) -> None:
    """Cut on a grid derived from each box (its own shape, at offset 0): 4 -> 3 rows of
    the same bytes share nothing, so the bound of the test above fails."""
    shape = (1200, 64)
    array = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    before = layout(shape, {0: [300, 600, 900]})
    after = layout(shape, {0: [400, 800]})
    k, extent = writer_cell(shape, 4, CHUNK)
    bound = 5 * extent * math.prod(shape[k + 1 :]) * 4
    assert new_bytes(array, before, after) <= bound  # the tensor's grid

    def box_grid(leaf: TensorLeaf, chunk_size: int) -> Any:
        cell = writer_cell(leaf.local_shape, 4, chunk_size)
        return box_chunk_starts((0,) * len(leaf.local_shape), leaf.local_shape, 4, cell)

    monkeypatch.setattr(chunkio, "leaf_chunk_starts", box_grid)
    broken = new_bytes(array, before, after)
    assert broken > bound
    assert broken >= 0.5 * array.nbytes  # all but the first box: new


# -- real stores -------------------------------------------------------------------------


def _write(store: castore.Store, array: np.ndarray, boxes: list[Box]) -> chunkio.WriteStats:
    leaves = [leaf_of(array, box) for box in boxes if box.numel]
    _, stats = write_leaves(store.backend, leaves, store.chunk_size)
    return stats


def test_saves_into_a_real_lmdb_store_share_the_cells_across_rank_counts(tmp_path) -> None:
    shape = (4096, 64)  # 1 MiB of fp32, in 256 cells of 16 rows (4 KiB chunks)
    array = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    with castore.open(tmp_path / "s", chunk_size=CHUNK) as store:
        first = _write(store, array, layout(shape, {0: [1024, 2048, 3072]}))
        assert first.new_bytes == array.nbytes
        for cuts in ([1365, 2730], [2048], [], [1000, 1500, 2600, 3900]):
            stats = _write(store, array, layout(shape, {0: cuts}))
            assert stats.logical_bytes == array.nbytes
            assert stats.new_bytes <= 0.05 * array.nbytes, (cuts, stats)


# -- real ranks --------------------------------------------------------------------------


@pytest.mark.slow
def test_the_same_bytes_saved_by_3_then_2_ranks_then_1_process_write_little_new(tmp_path) -> None:
    import grid_workers as gw

    path = str(tmp_path / "s")
    castore.open(path, chunk_size=CHUNK).close()
    seed = 11
    saves = []
    for world, axis, step in ((3, 0, 1), (2, 0, 2)):
        outcomes = run_ranks(world, gw.save, path, seed, axis, step, timeout=120)
        assert all(o.ok for o in outcomes), describe(outcomes)
        results = [o.value for o in outcomes]
        assert all(r["bitwise"] for r in results), results
        saves.append(results[0])
    with castore.open(path) as store:
        whole = gw.whole_state(seed)
        gen = store.save(whole, run=gw.RUN, step=3)
        saves.append({"new_bytes": gen.stats.new_bytes, "logical_bytes": gen.stats.logical_bytes})
        for generation in (1, 2, 3):
            loaded = store.load(run=gw.RUN, generation=generation)
            for name, array in whole.items():
                assert np.array_equal(np.asarray(loaded[name]), array)
        assert verify_store(store).ok
    assert saves[0]["new_bytes"] == saves[0]["logical_bytes"]
    for later in saves[1:]:
        assert later["new_bytes"] <= 0.05 * later["logical_bytes"], saves
    # Resharding restores: generation 1 (3 ranks, rows) into 2 ranks by columns, and
    # generation 3 (one process) into 3 ranks by rows.
    for world, axis, generation in ((2, 1, 1), (3, 0, 3)):
        outcomes = run_ranks(world, gw.restore, path, seed, axis, generation, timeout=120)
        assert all(o.ok and o.value is True for o in outcomes), describe(outcomes)


# -- mixed stores, the format ------------------------------------------------------------


def _shard_formats(store: castore.Store, run: str, generation: int) -> set[int]:
    _, root = store.resolve_root(run, generation)
    formats = set()
    for digest in root.shards:
        raw = store.backend.get(Namespace.OBJECTS, digest)
        assert raw is not None
        formats.add(msgpack.unpackb(bytes(raw), raw=False)["format"])
    return formats


def test_a_store_holding_pre_grid_and_grid_generations_reads_both(tmp_path) -> None:
    rng = np.random.default_rng(5)
    first = {"w": rng.standard_normal((900, 40)).astype(np.float32), "b": np.arange(7.0)}
    second = {**first, "w": first["w"] + 1}
    with castore.open(tmp_path / "s", chunk_size=CHUNK) as store:
        with pre_grid_saves():
            store.save(first, run="r", step=1)
        store.save(second, run="r", step=2)
        store.save(first, run="r", step=3)  # the same bytes again, on the grid now
        assert _shard_formats(store, "r", 1) == {2}
        assert _shard_formats(store, "r", 2) == {4}
        for generation, state in ((1, first), (2, second), (3, first)):
            loaded = store.load(run="r", generation=generation)
            assert np.array_equal(loaded["w"], state["w"])
            part = store.read_slice("r", generation, "w", (slice(100, 333), 5))
            assert np.array_equal(part, state["w"][100:333, 5])
        assert verify_store(store, deep=True).ok
        report = collect_garbage(store, RetentionPolicy(keep_last=2))
        assert report.chunks_freed > 0  # generation 1's own chunks: cut every CHUNK bytes
        with pytest.raises(castore.errors.GenerationNotFoundError):
            store.load(run="r", generation=1)
        for generation, state in ((2, second), (3, first)):
            assert np.array_equal(store.load(run="r", generation=generation)["w"], state["w"])
        assert verify_store(store, deep=True).ok
    with pre_grid_saves(), castore.open(tmp_path / "old", chunk_size=CHUNK) as old:
        old.save(first, run="r", step=1)
    with castore.open(tmp_path / "old") as old:
        old.save(second, run="r", step=2)
        castore.copy(old, str(tmp_path / "copy"), run="r", all_generations=True)
    with castore.open(tmp_path / "copy") as copy:
        assert np.array_equal(copy.load(run="r", generation=1)["w"], first["w"])
        assert np.array_equal(copy.load(run="r", generation=2)["w"], second["w"])
        assert verify_store(copy, deep=True).ok


def test_an_older_castore_refuses_a_grid_shard_and_reads_a_pre_grid_one(
    tmp_path, monkeypatch
) -> None:
    state = {"w": np.arange(5000, dtype=np.float32).reshape(100, 50)}
    with castore.open(tmp_path / "s", chunk_size=CHUNK) as store:
        with pre_grid_saves():
            store.save(state, run="old", step=1)
        store.save(state, run="new", step=1)
    monkeypatch.setattr(objects, "FORMAT_VERSION", 2)  # what castore before the grid read
    with castore.open(tmp_path / "s") as store:
        assert np.array_equal(store.load(run="old")["w"], state["w"])
        with pytest.raises(FormatVersionError, match="upgrade castore"):
            store.load(run="new")


def test_a_format_3_shard_still_reads_and_an_older_reader_refuses_format_4(
    tmp_path, monkeypatch
) -> None:
    """Shards written as format 3 (the grid's first table, before the compact one) read
    unchanged; a castore that reads up to 3 refuses a format-4 shard, never misreads it."""
    state = {"w": np.arange(5000, dtype=np.float32).reshape(100, 50), "b": np.arange(3.0)}
    with castore.open(tmp_path / "s", chunk_size=CHUNK) as store:
        store.save(state, run="new", step=1)
        with monkeypatch.context() as patch:  # what castore before the compact table wrote
            patch.setattr(objects, "encode_compact", lambda e: objects.encode_table(e, grid=True))
            patch.setattr(objects, "COMPACT_SHARD_FORMAT", objects.GRID_SHARD_FORMAT)
            store.save(state, run="three", step=1)
        assert _shard_formats(store, "three", 1) == {3}
        assert _shard_formats(store, "new", 1) == {4}
        loaded = store.load(run="three")
        assert all(np.array_equal(loaded[k], v) for k, v in state.items())
        assert verify_store(store, deep=True).ok
    monkeypatch.setattr(objects, "FORMAT_VERSION", 3)  # castore before the compact table
    with castore.open(tmp_path / "s") as store:
        assert np.array_equal(store.load(run="three")["w"], state["w"])
        with pytest.raises(FormatVersionError, match="reads up to 3: upgrade castore"):
            store.load(run="new")


def _grid_table(entries: list[objects.TensorEntry], **override: Any) -> dict[str, Any]:
    table = objects.encode_table(entries, grid=True)
    table.update(override)
    return table


@pytest.mark.parametrize(
    ("column", "value", "says"),
    [
        ("cell_dim", bytes([2]), "cell dimension 2"),
        ("cell_extent", np.asarray([0], "<i8").tobytes(), "cell extent 0"),
        ("cell_extent", np.asarray([101], "<i8").tobytes(), "cell extent 101"),
        ("cell_extent", np.asarray([1], "<i8").tobytes(), "digests"),
        ("cell_dim", b"", "grid columns disagree"),
    ],
)
def test_a_forged_grid_is_refused_before_anything_is_read(column, value, says) -> None:
    array = np.arange(100 * 50, dtype=np.float32).reshape(100, 50)
    leaf = leaf_of(array, Box((0, 0), (100, 50)))
    views = cut_leaf(leaf, CHUNK)
    entry = chunkio.entry_of(leaf, CHUNK, tuple(digest_bytes(v) for v in views))
    assert entry.cell is not None and len(views) > 1
    good = _grid_table([entry])
    assert objects.EntryTable(good, grid=True).entries()[0] == entry
    with pytest.raises(CorruptObjectError, match=says):
        objects.EntryTable(_grid_table([entry], **{column: value}), grid=True)
    with pytest.raises(CorruptObjectError, match="table's fields"):
        objects.EntryTable(good, grid=False)  # grid columns in a format-2 table
