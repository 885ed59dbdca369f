"""Deduplication: unchanged bytes are never written twice, changed bytes always are.

Expected chunk counts are worked out independently, by cutting each tensor's
bytes here where its chunk grid puts the cells (only the grid's (dimension,
extent) comes from ``castore.format.grid.writer_cell``, the rule docs/FORMAT.md
states), and checked both against ``SaveStats`` and against the keys physically
present in the LMDB ``chunks`` database.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from castore import Store
from castore.chunkstore.base import Namespace
from castore.format.grid import writer_cell

CHUNK = 1024


def tensor_leaves(state: Any) -> list[np.ndarray]:
    """Every numpy array in a (nested) state."""
    if isinstance(state, np.ndarray):
        return [state]
    if isinstance(state, dict):
        return [leaf for value in state.values() for leaf in tensor_leaves(value)]
    if isinstance(state, (list, tuple)):
        return [leaf for value in state for leaf in tensor_leaves(value)]
    return []


def grid_cuts(array: np.ndarray, chunk_size: int) -> list[bytes]:
    """A whole tensor's chunks, in order: its row-major bytes cut where its grid's cells lie.

    Cells are 1 along the dimensions before the cell dimension, ``extent`` along it
    and whole after it, so for each index of the leading dimensions the run of bytes
    along the cell dimension is cut every ``extent`` slabs (the last band may be short).
    """
    data = np.ascontiguousarray(array).tobytes()
    if not data:
        return []
    if array.ndim == 0:
        return [data]
    dim, extent = writer_cell(array.shape, array.itemsize, chunk_size)
    slab = math.prod(array.shape[dim + 1 :]) * array.itemsize
    run, step = array.shape[dim] * slab, extent * slab
    return [
        data[lead + at : lead + min(at + step, run)]
        for lead in range(0, len(data), run)
        for at in range(0, run, step)
    ]


def pieces(state: Any, chunk_size: int) -> set[bytes]:
    """The distinct chunk contents a state cuts into (little-endian, row-major bytes)."""
    found: set[bytes] = set()
    for array in tensor_leaves(state):
        found.update(grid_cuts(array, chunk_size))
    return found


def physical_chunks(store: Store) -> tuple[int, int]:
    """(keys, bytes) in the backend's chunk namespace, as stored on disk."""
    sizes = [size for _key, size in store.backend.value_sizes(Namespace.CHUNKS)]
    return len(sizes), sum(sizes)


def test_physical_chunks_match_independent_chunking(store: Store, make_state: Any) -> None:
    state = make_state(seed=0)
    expected = pieces(state, CHUNK)
    gen = store.save(state, run="a", step=0)
    assert physical_chunks(store) == (len(expected), sum(map(len, expected)))
    assert gen.stats.new_chunks == len(expected)
    assert gen.stats.new_bytes == sum(map(len, expected))
    assert gen.stats.logical_bytes == sum(a.nbytes for a in tensor_leaves(state))


def test_saving_same_state_twice_writes_nothing(store: Store, make_state: Any) -> None:
    state = make_state(seed=0)
    first = store.save(state, run="a", step=0)
    before = physical_chunks(store)
    second = store.save(make_state(seed=0), run="a", step=1)  # equal content, new objects
    assert second.stats.new_bytes == 0
    assert second.stats.new_chunks == 0
    assert second.stats.reused_chunks == first.stats.new_chunks + first.stats.reused_chunks
    assert second.stats.logical_bytes == first.stats.logical_bytes
    assert second.stats.dedup_ratio == 1.0
    assert physical_chunks(store) == before
    assert second.root != first.root  # still a new generation
    assert store.generations("a")[-1].id == 2


def test_dedup_check_catches_a_store_that_rewrites_everything(
    store_path: Path, open_store: Any, make_state: Any
) -> None:
    """Broken control: with another chunk size every chunk differs, and the checks notice.

    The zero-new-bytes and no-growth assertions above would fail for a store
    that rewrote its chunks; a handle with a different chunk size is such a store.
    """
    state = make_state(seed=0)
    store = open_store(store_path, chunk_size=CHUNK)
    store.save(state, run="a", step=0)
    before = physical_chunks(store)
    store.close()

    rechunked = open_store(store_path, chunk_size=CHUNK // 2)
    gen = rechunked.save(state, run="a", step=1)
    fresh = pieces(state, CHUNK // 2) - pieces(state, CHUNK)
    # embed.weight 4 halves + fc.weight, exp_avg, exp_avg_sq 2 halves each.
    assert len(fresh) == 10
    assert gen.stats.new_chunks == len(fresh)
    assert gen.stats.new_bytes == sum(map(len, fresh))
    after = physical_chunks(rechunked)
    assert after[0] == before[0] + len(fresh) and after[1] == before[1] + gen.stats.new_bytes
    # Bytes that are identical in both chunkings (small tensors) are still shared.
    assert gen.stats.reused_chunks == len(pieces(state, CHUNK // 2) & pieces(state, CHUNK))


ROWS, COLS = 64, 48  # float32: 192-byte rows, 12288 bytes; cells of whole rows under 1 KiB


# Before the grid, rows 5, 10 and 21 straddled a 1 KiB boundary (two chunks); row 63
# lies in the short last cell.
@pytest.mark.parametrize("row", [0, 5, 10, 21, 63])
def test_changing_one_row_writes_only_its_chunks(store: Store, row: int) -> None:
    rng = np.random.default_rng(1)
    state = {
        "big": rng.standard_normal((ROWS, COLS), dtype=np.float32),
        "other": rng.standard_normal((40, 40), dtype=np.float32),
    }
    store.save(state, run="rows", step=0)
    before = physical_chunks(store)
    old_cuts = grid_cuts(state["big"], CHUNK)

    state["big"][row] += 1.0  # in place
    gen = store.save(state, run="rows", step=1)

    new_cuts = grid_cuts(state["big"], CHUNK)
    dim, band = writer_cell((ROWS, COLS), 4, CHUNK)
    assert dim == 0 and 1 < band and band * COLS * 4 <= CHUNK  # bands of whole rows
    changed = [i for i, (a, b) in enumerate(zip(old_cuts, new_cuts, strict=True)) if a != b]
    # A row lies in one cell: exactly its chunk changes, wherever the row sits.
    assert changed == [row // band]
    changed_bytes = len(new_cuts[row // band])
    assert changed_bytes == (min(ROWS, (row // band + 1) * band) - row // band * band) * COLS * 4
    other_chunks = len(grid_cuts(state["other"], CHUNK))
    assert gen.stats.new_chunks == 1
    assert gen.stats.new_bytes == changed_bytes
    assert gen.stats.reused_chunks == len(new_cuts) + other_chunks - 1
    after = physical_chunks(store)
    assert after == (before[0] + 1, before[1] + changed_bytes)
    # The changed chunk digests are exactly the ones at those positions.
    old, new = (
        store.tensor_entries(store.resolve_root("rows", g)[1])["big"][0].chunks for g in (1, 2)
    )
    assert [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b] == changed
    np.testing.assert_array_equal(store.load("rows")["big"], state["big"])


def test_changing_last_partial_chunk_writes_only_its_bytes(store: Store) -> None:
    array = np.random.default_rng(2).standard_normal((11, 100), dtype=np.float32)  # 4400 bytes
    cuts = grid_cuts(array, CHUNK)
    assert len(cuts[-1]) < len(cuts[0])  # the last cell is short: 11 rows in bands
    store.save({"a": array}, run="tail", step=0)
    array[-1, -1] = 0.5
    gen = store.save({"a": array}, run="tail", step=1)
    assert gen.stats.new_chunks == 1
    assert gen.stats.new_bytes == len(cuts[-1]) == array.nbytes - sum(map(len, cuts[:-1]))
    assert gen.stats.reused_chunks == len(cuts) - 1


def test_identical_content_across_runs_is_stored_once(store: Store, make_state: Any) -> None:
    first = store.save(make_state(seed=4), run="run-a", step=0)
    before = physical_chunks(store)
    second = store.save(make_state(seed=4), run="run-b", step=0)
    assert first.stats.new_chunks > 0
    assert (second.stats.new_chunks, second.stats.new_bytes) == (0, 0)
    assert physical_chunks(store) == before
    assert second.id == 1 and second.parent is None
    for run in ("run-a", "run-b"):
        np.testing.assert_array_equal(
            store.load(run)["model"]["embed.weight"], make_state(seed=4)["model"]["embed.weight"]
        )


def test_different_content_is_not_deduplicated(store: Store, make_state: Any) -> None:
    store.save(make_state(seed=0), run="a", step=0)
    gen = store.save(make_state(seed=1), run="a", step=1)
    expected = pieces(make_state(seed=1), CHUNK) - pieces(make_state(seed=0), CHUNK)
    assert gen.stats.new_chunks == len(expected) > 0
    assert gen.stats.new_bytes == sum(map(len, expected))


def test_in_place_numpy_modification_is_detected(store: Store, make_state: Any) -> None:
    state = make_state(seed=0)
    weight = state["model"]["fc.weight"]  # 16x16 float32: exactly one chunk
    original = weight.copy()
    store.save(state, run="inplace", step=0)
    weight[3, 5] += 1.0
    gen = store.save(state, run="inplace", step=1)
    assert (gen.stats.new_chunks, gen.stats.new_bytes) == (1, CHUNK)
    np.testing.assert_array_equal(store.load("inplace", 1)["model"]["fc.weight"], original)
    np.testing.assert_array_equal(store.load("inplace", 2)["model"]["fc.weight"], weight)


def test_in_place_torch_modification_is_detected(store: Store) -> None:
    weight = torch.randn(4, 256)  # four rows of exactly one chunk each
    store.save({"w": weight}, run="torch", step=0)
    with torch.no_grad():
        weight[2].mul_(2.0)
    gen = store.save({"w": weight}, run="torch", step=1)
    assert (gen.stats.new_chunks, gen.stats.reused_chunks) == (1, 3)
    assert torch.equal(store.load("torch", framework="torch")["w"], weight)
    assert not torch.equal(store.load("torch", 1, framework="torch")["w"], weight)


def test_repeated_chunks_within_one_save_are_stored_once(store: Store) -> None:
    zeros = np.zeros(4 * CHUNK, dtype=np.uint8)  # four identical chunks
    gen = store.save({"z": zeros}, run="zeros", step=0)
    assert (gen.stats.new_chunks, gen.stats.reused_chunks, gen.stats.new_bytes) == (1, 3, CHUNK)
    assert physical_chunks(store) == (1, CHUNK)
    np.testing.assert_array_equal(store.load("zeros")["z"], zeros)


def test_torch_and_numpy_copies_share_chunks(store: Store) -> None:
    array = np.random.default_rng(3).standard_normal((8, 256), dtype=np.float32)
    store.save({"w": array}, run="np", step=0)
    gen = store.save({"w": torch.from_numpy(array.copy())}, run="pt", step=0)
    assert (gen.stats.new_chunks, gen.stats.reused_chunks) == (0, 8)
