"""A load reads each chunk into its new tensor and verifies it there (castore.core.readplan).

Real LMDB stores on disk: sharded boxes land where they belong, a reader that
delivers wrong bytes never reaches a tensor, the first damaged chunk in plan
order is the one raised, and the LMDB reader refuses what the map refused
(a chunk past the end of its pack, a symlinked pack) and follows a chunk a
reclaim moved.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from hostile import forge_entry
from pregrid import pre_grid_saves

import castore
from castore import Shard, Store
from castore.chunkstore.base import ChunkReader
from castore.chunkstore.lmdb import backend as lmdb_backend
from castore.chunkstore.lmdb import packreader, packwriter
from castore.core import readplan
from castore.core.commit import commit_objects, publish_writes, write_shard
from castore.core.reading import contiguous_start
from castore.errors import ChecksumMismatchError, UnsafeStoreFileError
from castore.format.objects import TensorEntry
from castore.format.tree import encode_state

RUN = "plan"
RANKS = 4


def _entry(shape: tuple[int, ...], offsets: tuple[int, ...], local: tuple[int, ...]) -> Any:
    nbytes = int(np.prod(local)) * 4
    chunks = tuple(bytes(32) for _ in range(-(-nbytes // 64)))
    return TensorEntry("t", "float32", shape, offsets, local, nbytes, 64, chunks, "numpy")


@pytest.mark.parametrize(
    ("shape", "offsets", "local", "start"),
    [
        ((10, 6), (0, 0), (10, 6), 0),  # the whole tensor
        ((10, 6), (3, 0), (4, 6), 3 * 6 * 4),  # whole rows
        ((10, 6), (3, 2), (1, 3), (3 * 6 + 2) * 4),  # part of one row
        ((10, 6), (3, 2), (2, 3), None),  # parts of two rows
        ((4, 5, 6), (2, 1, 0), (1, 3, 6), (2 * 30 + 6) * 4),  # rows of one plane
        ((4, 5, 6), (2, 1, 0), (2, 3, 6), None),  # rows of two planes
        ((4, 5, 6), (0, 0, 2), (4, 5, 2), None),  # a column block
    ],
)
def test_a_box_is_one_run_of_bytes_only_when_its_rows_are_consecutive(
    shape: tuple[int, ...], offsets: tuple[int, ...], local: tuple[int, ...], start: int | None
) -> None:
    assert contiguous_start(_entry(shape, offsets, local)) == start


# Each tensor in RANKS boxes along some dimensions: (global array, box slices per rank).
def _sharded_state() -> dict[str, tuple[np.ndarray, list[tuple[slice, ...]]]]:
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((40, 40), dtype=np.float32)  # 160-byte rows, 1 KiB chunks
    cols = rng.standard_normal((8, 40), dtype=np.float32)
    cube = rng.standard_normal((2, 4, 50))
    mixed = rng.standard_normal((6, 6, 10), dtype=np.float32)
    whole = slice(None)
    return {
        "rows": (rows, [np.s_[0:5], np.s_[5:17], np.s_[17:30], np.s_[30:40]]),
        "cols": (cols, [np.s_[:, 0:10], np.s_[:, 10:20], np.s_[:, 20:25], np.s_[:, 25:40]]),
        "cube": (cube, [np.s_[0:1], np.s_[1:2, 0:1], np.s_[1:2, 1:3], np.s_[1:2, 3:4]]),
        "mixed": (mixed, [np.s_[0:1], np.s_[1:3], np.s_[3:6, whole, 0:5], np.s_[3:6, whole, 5:]]),
    }


def _offsets(array: np.ndarray, box: slice | tuple[slice, ...]) -> tuple[int, ...]:
    box = box if isinstance(box, tuple) else (box,)
    box = box + (slice(None),) * (array.ndim - len(box))
    return tuple(s.indices(n)[0] for s, n in zip(box, array.shape, strict=True))


def _save_sharded(store: Store, state: dict[str, tuple[np.ndarray, list[Any]]]) -> None:
    """Publish a RANKS-rank generation from this process, each rank saving one box of each."""
    writes, skeleton = [], b""
    for rank in range(RANKS):
        mine = {
            name: Shard(
                np.ascontiguousarray(array[boxes[rank]]), array.shape, _offsets(array, boxes[rank])
            )
            for name, (array, boxes) in state.items()
        }
        encoded = encode_state(mine)
        skeleton = skeleton or encoded.skeleton
        own = {leaf.name for leaf in encoded.leaves}
        shard = write_shard(store, encoded, run=RUN, generation=1, rank=rank, own=own)
        commit_objects(store, [(shard.digest, shard.data)])
        writes.append(shard)
    publish_writes(
        store, run=RUN, generation=1, step=1, parent=None, writes=writes, skeleton=skeleton
    )


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_boxes_of_every_shape_load_bitwise(store: Store, framework: str) -> None:
    state = _sharded_state()
    _save_sharded(store, state)
    loaded = store.load(RUN, framework=framework)
    for name, (array, _) in state.items():
        got = loaded[name] if framework == "numpy" else loaded[name].numpy()
        assert got.dtype == array.dtype and got.tobytes() == array.tobytes(), name
    expected = sum(array.nbytes for array, _ in state.values())
    assert store.read_counters.bytes == expected  # every chunk read once


def _two_tensor_store(store: Store) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    state = {
        "big": rng.standard_normal(40_000, dtype=np.float32),  # 160 KB: pool runs of 1 KiB
        "small": rng.standard_normal(100, dtype=np.float32),
    }
    store.save(state, run=RUN, step=1)
    return state


class _LyingReader(ChunkReader):
    """Reads as the real reader does, then flips one byte of what it read."""

    def __init__(self, real: ChunkReader) -> None:
        self.real, self.lengths = real, real.lengths

    def readinto(self, position: int, buffer: memoryview, offset: int = 0) -> int:
        done = self.real.readinto(position, buffer, offset)
        if done:
            buffer[0] ^= 0xFF
        return done

    def close(self) -> None:
        self.real.close()


def test_bytes_a_reader_garbles_never_reach_a_tensor(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _two_tensor_store(store)
    real = store.backend.chunk_reader

    def lying(keys: Any) -> ChunkReader | None:
        reader = real(keys)
        assert reader is not None
        return _LyingReader(reader)

    monkeypatch.setattr(store.backend, "chunk_reader", lying)
    loaded = store.load(RUN)  # each chunk fails in place, then is read again and verified
    for name, array in state.items():
        assert loaded[name].tobytes() == array.tobytes(), name


def test_broken_control_without_the_hash_in_place_garbled_bytes_are_returned(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _two_tensor_store(store)
    real = store.backend.chunk_reader
    monkeypatch.setattr(store.backend, "chunk_reader", lambda keys: _LyingReader(real(keys)))  # type: ignore[arg-type]
    monkeypatch.setattr(
        readplan, "_fill", lambda reader, i, view, key: reader.readinto(i, view) == view.nbytes
    )
    loaded = store.load(RUN)
    assert loaded["small"].tobytes() != state["small"].tobytes()


def _damage(store: Store, name: str) -> None:
    _, root = store.resolve_root(RUN)
    [entry] = store.tensor_entries(root)[name]
    backend = store.backend
    assert isinstance(backend, lmdb_backend.LmdbBackend)
    where = backend.locate(entry.chunks[0])
    assert where is not None
    value = backend.get(lmdb_backend.Namespace.CHUNKS, entry.chunks[0])
    assert value is not None
    backend.raw_put(lmdb_backend.Namespace.CHUNKS, entry.chunks[0], b"\0" + value[1:])


@pytest.mark.parametrize("damaged", [("a_big", "b_small"), ("b_small", "c_big")])
def test_the_first_damaged_chunk_in_plan_order_is_the_one_raised(
    store_path: Path, damaged: tuple[str, str]
) -> None:
    rng = np.random.default_rng(5)
    state = {
        "a_big": rng.standard_normal(20_000, dtype=np.float32),  # read on the pool
        "b_small": rng.standard_normal(10, dtype=np.float32),  # read inline
        "c_big": rng.standard_normal(20_000, dtype=np.float32),
    }
    with castore.open(store_path, chunk_size=128 << 10) as store:
        store.save(state, run=RUN, step=1)
        _, root = store.resolve_root(RUN)
        assert list(store.tensor_entries(root)) == list(state)  # the plan's order
        for name in damaged:
            _damage(store, name)
        with pytest.raises(ChecksumMismatchError) as info:
            store.load(RUN)
        assert info.value.tensor == damaged[0]


@pytest.mark.parametrize("grid", [False, True], ids=["pre-grid", "grid"])
def test_a_chunk_reused_with_another_length_is_damaged_for_that_tensor(
    store: Store, grid: bool
) -> None:
    with contextlib.nullcontext() if grid else pre_grid_saves():
        store.save(
            {"a": np.arange(256, dtype=np.float32), "b": np.zeros(128, dtype=np.float32)},
            run=RUN,
            step=1,
        )
    _, root = store.resolve_root(RUN)
    [a] = store.tensor_entries(root)["a"]
    [b] = store.tensor_entries(root)["b"]
    assert (a.cell is not None, b.cell is not None) == (grid, grid)  # format 3, or format 2
    # One chunk each, of different lengths: a's named as b's is the wrong length there.
    assert (len(a.chunks), len(b.chunks)) == (1, 1)
    assert (a.chunk_length(0), b.chunk_length(0)) == (a.nbytes, b.nbytes) == (1024, 512)

    def reuse(entry: dict[str, Any]) -> None:
        entry["chunks"] = [a.chunks[0]]  # 512 bytes said, 1024 stored

    forged = forge_entry(store, RUN, "b", reuse)
    with pytest.raises(ChecksumMismatchError, match="chunk 0 of tensor 'b' is damaged") as info:
        store.load(RUN, forged)
    assert info.value.tensor == "b"


# -- the LMDB backend's reader --------------------------------------------------


def _raw_index_put(store: Path, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(store / "chunks"), max_dbs=4)
    try:
        index = env.open_db(b"chunk_index")  # before the write txn: it takes one of its own
        with env.begin(write=True) as txn:
            txn.put(key, value, db=index)
    finally:
        env.close()


@pytest.mark.parametrize("control", [False, True])
def test_an_index_offset_past_every_file_is_a_damaged_chunk(
    store_path: Path, monkeypatch: pytest.MonkeyPatch, control: bool
) -> None:
    with castore.open(store_path) as store:
        store.save({"w": np.arange(64, dtype=np.float32)}, run=RUN, step=1)
        _, root = store.resolve_root(RUN)
        [entry] = store.tensor_entries(root)["w"]
        where = store.backend.locate(entry.chunks[0])  # type: ignore[attr-defined]
    huge = packwriter.PackLocation(where.length, where.pack, (1 << 64) - 1000)
    _raw_index_put(store_path, entry.chunks[0], huge.encode())
    if control:  # broken control: the reader reads whatever the index names
        monkeypatch.setattr(
            packreader.PackReader,
            "_pack",
            lambda self, pack: (
                os.open(self.pack_dir / packwriter.pack_name(pack), os.O_RDONLY),
                1 << 65,
            ),
        )
    with castore.open(store_path) as store:
        if control:
            with pytest.raises(OverflowError):
                store.load(RUN)
            return
        with pytest.raises(ChecksumMismatchError) as info:  # as read through a map
            store.load(RUN)
        assert info.value.tensor == "w"


def test_a_symlinked_pack_fails_a_load_with_a_typed_error(store: Store, tmp_path: Path) -> None:
    store.save({"w": np.arange(64, dtype=np.float32)}, run=RUN, step=1)
    backend = store.backend
    assert isinstance(backend, lmdb_backend.LmdbBackend)
    [pack] = backend.pack_files()
    path = backend.pack_path(pack)
    outside = tmp_path / "outside.pack"
    os.replace(path, outside)
    path.symlink_to(outside)
    with pytest.raises(UnsafeStoreFileError, match="symlink"):
        store.load(RUN)


@pytest.mark.parametrize("control", [False, True])
def test_a_reader_follows_a_chunk_moved_by_a_reclaim_after_its_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, control: bool
) -> None:
    backend = lmdb_backend.LmdbBackend(tmp_path / "env")
    try:
        kept, dropped = bytes([1]) * 32, bytes([2]) * 32
        backend.put_many(
            lmdb_backend.Namespace.CHUNKS, [(kept, b"a" * 100), (dropped, b"b" * 1000)]
        )
        backend.delete_many(lmdb_backend.Namespace.CHUNKS, [dropped])  # its pack: under half live
        opened = packreader.PackReader.open.__func__  # type: ignore[attr-defined]

        def after_a_reclaim(cls: Any, owner: Any, keys: Any, locations: Any) -> Any:
            # The snapshot is taken; a reclaim now moves `kept` and deletes its old pack.
            assert owner.reclaim(min_live=0.5).packs_rewritten == 1
            return opened(cls, owner, keys, locations)

        monkeypatch.setattr(packreader.PackReader, "open", classmethod(after_a_reclaim))
        if control:  # broken control: no second look-up of a moved chunk
            monkeypatch.setattr(backend, "locate", lambda key: None)
        reader = backend.chunk_reader([kept])
        assert reader is not None
        with reader:
            if control:
                assert reader.lengths == [None]
                return
            got = bytearray(100)
            assert reader.lengths == [100]
            assert reader.readinto(0, memoryview(got)) == 100 and bytes(got) == b"a" * 100
    finally:
        backend.close()


def test_a_process_out_of_descriptors_loads_through_maps_and_leaks_none(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = np.arange(300, dtype=np.float32), np.arange(500, dtype=np.int64)
    store.save({"first": first}, run=RUN, step=1)
    store.save({"first": first, "second": second}, run=RUN, step=2)  # a second pack
    real, opens = packreader.open_store_file, []

    def second_open_fails(path: Path, flags: int, mode: int = 0o644) -> int:
        opens.append(path)
        if len(opens) == 2:  # the reader's second pack
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, flags, mode)

    monkeypatch.setattr(packreader, "open_store_file", second_open_fails)
    before = len(os.listdir("/proc/self/fd"))
    loaded = store.load(RUN)
    assert len(os.listdir("/proc/self/fd")) == before  # the reader closed its first pack
    assert len(opens) == 4  # two for the reader, then both packs mapped
    assert loaded["first"].tobytes() == first.tobytes()
    assert loaded["second"].tobytes() == second.tobytes()
