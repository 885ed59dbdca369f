"""chunkio.write_leaves on a real LMDB store: each chunk's digest lands in its leaf's entry.

Chunks are hashed in two places (big ones on the pool, ahead, in runs; small
ones on the calling thread as they are reached) into one list of digests,
and handed to the backend in batches: every digest must end up in its own
leaf's entry, in order, whichever place hashed it and whichever batch took it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import castore
from castore.chunkstore.base import Namespace
from castore.core import chunkio
from castore.core.chunkio import write_leaves
from castore.core.hashpool import INLINE_BYTES
from castore.format.grid import writer_cell
from castore.format.hashing import digest_bytes
from castore.format.pieces import hash_chunk
from castore.format.tree import TensorLeaf

# A big leaf's cells are at least MIN_CELL (= INLINE_BYTES) and at most CHUNK: its chunks
# go to the pool, a small leaf's (and a big leaf's short last one) stay here.
CHUNK = 4 * INLINE_BYTES


def leaf(name: str, nbytes: int, seed: int) -> TensorLeaf:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return TensorLeaf(name, "uint8", (nbytes,), data, "numpy")


def mixed_leaves() -> list[TensorLeaf]:
    sizes = [100, 0, 3 * CHUNK + 5, 1, INLINE_BYTES - 1, INLINE_BYTES, 2 * CHUNK, 7]
    return [leaf(f"t{i}", size, seed=i) for i, size in enumerate(sizes)]


def expected_pieces(item: TensorLeaf) -> list[bytes]:
    """A 1-d uint8 leaf cut on its grid: a cell is ``extent`` bytes (the last one short)."""
    raw = item.data.tobytes()
    dim, extent = writer_cell(item.shape, 1, CHUNK)
    assert dim == 0
    return [raw[at : at + extent] for at in range(0, len(raw), extent)]


def expected_chunks(item: TensorLeaf) -> tuple[bytes, ...]:
    return tuple(digest_bytes(piece) for piece in expected_pieces(item))


def test_the_leaves_are_hashed_in_both_places() -> None:
    """The premise of the test below: some chunks go to the pool, some stay inline."""
    sizes = [len(piece) for item in mixed_leaves() for piece in expected_pieces(item)]
    assert any(n >= INLINE_BYTES for n in sizes) and any(0 < n < INLINE_BYTES for n in sizes)
    assert sum(n >= INLINE_BYTES for n in sizes) > 1  # several pool chunks: runs, not one


def slow_on_the_pool(data: object) -> tuple[bytes, bytes]:
    """hash_chunk, late on the pool's threads: the saver reaches those chunks first."""
    if threading.current_thread() is not threading.main_thread():
        time.sleep(0.01)
    return hash_chunk(data)


@pytest.mark.parametrize("slow_pool", [False, True], ids=["pool", "slow-pool"])
@pytest.mark.parametrize("batch_bytes", [chunkio.WRITE_BATCH_BYTES, CHUNK + 1, 1])
def test_every_chunk_digest_lands_in_its_leafs_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch_bytes: int, slow_pool: bool
) -> None:
    monkeypatch.setattr(chunkio, "WRITE_BATCH_BYTES", batch_bytes)  # one batch, or several
    if slow_pool:
        monkeypatch.setattr(chunkio, "hash_chunk", slow_on_the_pool)
    leaves = mixed_leaves()
    with castore.open(tmp_path / "store", chunk_size=CHUNK) as store:
        entries, stats = write_leaves(store.backend, leaves, CHUNK)
        assert [e.name for e in entries] == [item.name for item in leaves]
        for entry, item in zip(entries, leaves, strict=True):
            assert entry.chunks == expected_chunks(item), item.name
            assert (entry.nbytes, entry.chunk_size, entry.shape) == (
                item.data.nbytes,
                CHUNK,
                item.shape,
            )
        count = sum(len(e.chunks) for e in entries)
        assert (stats.new_chunks, stats.reused_chunks) == (count, 0)
        assert stats.new_bytes == stats.logical_bytes == sum(item.data.nbytes for item in leaves)
        keys = [key for e in entries for key in e.chunks]
        assert all(store.backend.has_many(Namespace.CHUNKS, keys))

        again, stats = write_leaves(store.backend, leaves, CHUNK)  # every chunk present
        assert again == entries
        assert (stats.new_chunks, stats.new_bytes, stats.reused_chunks) == (0, 0, count)


def test_a_failure_midway_stops_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    leaves = mixed_leaves()
    calls = [0]

    def failing_digest(data: object) -> tuple[bytes, bytes]:
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("hashing failed")
        return hash_chunk(data)

    monkeypatch.setattr(chunkio, "hash_chunk", failing_digest)
    with castore.open(tmp_path / "store", chunk_size=CHUNK) as store:
        with pytest.raises(RuntimeError, match="hashing failed"):
            write_leaves(store.backend, leaves, CHUNK)
        assert list(store.backend.iter_keys(Namespace.CHUNKS)) == []  # one batch: none indexed


# -- a save's cuts and digests, unchanged by the per-geometry shortcuts --------------------


def box_leaf(array: np.ndarray, row: int, rows: int) -> TensorLeaf:
    """Rows ``row:row + rows`` of ``array`` as a block (a Shard's leaf) of the whole."""
    block = np.ascontiguousarray(array[row : row + rows])
    return TensorLeaf(
        f"w@{row}",
        "uint8",
        array.shape,
        block.reshape(-1),
        "numpy",
        offsets=(row, 0),
        local_shape=block.shape,
        sharded=True,
    )


def test_blocks_of_one_shape_at_other_offsets_are_cut_each_on_its_own_place(
    tmp_path: Path,
) -> None:
    """write_leaves works a grid out once per geometry (dtype, shape, offsets, box): two
    blocks of one shape whose offsets fall differently on the cells are cut differently,
    each as cut_leaf cuts it alone."""
    array = np.random.default_rng(7).integers(0, 256, (64, 16 << 10), dtype=np.uint8)
    dim, extent = writer_cell(array.shape, 1, CHUNK)
    assert (dim, extent) == (0, 16)  # 16 rows of 16 KiB: one 256 KiB cell
    leaves = [box_leaf(array, 0, 24), box_leaf(array, 24, 20), box_leaf(array, 36, 20)]
    own_cuts = [[v.nbytes for v in chunkio.cut_leaf(item, CHUNK)] for item in leaves]
    # The control: the blocks at 24 and 36 have one shape and are cut unlike each other,
    # so a grid kept by shape alone would have cut one of them wrongly.
    assert own_cuts[1] != own_cuts[2]
    with castore.open(tmp_path / "store", chunk_size=CHUNK) as store:
        entries, _ = write_leaves(store.backend, leaves, CHUNK)
    for entry, item in zip(entries, leaves, strict=True):
        pieces = chunkio.cut_leaf(item, CHUNK)
        assert entry.chunks == tuple(digest_bytes(v) for v in pieces), item.name
        assert entry == chunkio.entry_of(item, CHUNK, entry.chunks)
        entry.check()  # what a reader derives from the entry agrees with the cut
        assert [entry.chunk_length(i) for i in range(len(pieces))] == [v.nbytes for v in pieces]


def counting_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every byte chunkio hashes from now on, on the pool or inline: [bytes]."""
    hashed = [0]
    lock = threading.Lock()

    def counted(data: object) -> tuple[bytes, bytes]:
        with lock:
            hashed[0] += memoryview(data).nbytes  # type: ignore[arg-type]
        return hash_chunk(data)

    monkeypatch.setattr(chunkio, "hash_chunk", counted)
    return hashed


def test_a_default_resave_hashes_every_byte_and_finds_one_changed_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-save on a new handle (no trust_versions) hashes every byte of the state,
    and a byte changed in the middle of a large tensor makes exactly its chunk new."""
    rng = np.random.default_rng(11)
    state = {
        "big": rng.standard_normal((512, 1024)).astype(np.float32),  # 2 MiB, 8 chunks
        "small": rng.standard_normal(100).astype(np.float32),
        "step": 3,
    }
    total = state["big"].nbytes + state["small"].nbytes
    path = tmp_path / "store"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(state, run="r", step=1)
    changed = dict(state, big=state["big"].copy())
    changed["big"].view(np.uint8).reshape(-1)[total // 2 + 3] ^= 0x40
    hashed = counting_hashes(monkeypatch)
    with castore.open(path, create=False) as store:
        generation = store.save(changed, run="r", step=2)
        assert hashed[0] == total  # every byte, the unchanged ones included
        assert generation.new_bytes == CHUNK  # the one chunk holding the changed byte
        loaded = store.load("r")["big"].view(np.uint8)  # as bytes: the flip may make a NaN
        assert np.array_equal(loaded, changed["big"].view(np.uint8))
        assert not np.array_equal(loaded, state["big"].view(np.uint8))

        # The control: a save that trusts version counters skips what did not move,
        # and the count shows it (torch tensors saved twice by this handle, unchanged).
        torch = pytest.importorskip("torch")
        arrays = (changed["big"], changed["small"])
        tensors = {f"t{i}": torch.from_numpy(a).clone().add_(0) for i, a in enumerate(arrays)}
        store.save(tensors, run="t", step=1, trust_versions=True)
        hashed[0] = 0
        store.save(tensors, run="t", step=2, trust_versions=True)
        assert hashed[0] == 0 < total
