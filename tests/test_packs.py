"""Chunk packs: crash windows, damage to the files, space reclaim, a full disk.

Chunk bytes live in append-only pack files beside the LMDB index. Real
processes and a real SIGKILL for the two crash windows the packs add: after a
pack is durable but before the index names it, and after a reclaim re-pointed
the index but before it deleted the old packs.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _helpers import assert_state_equal

import castore
import castore.chunkstore.lmdb.backend as lmdb_backend
import castore.chunkstore.lmdb.packwriter as packwriter
from castore import Store
from castore.chunkstore.base import Namespace
from castore.chunkstore.packfile import scan_pack
from castore.errors import ChecksumMismatchError, ChunkMissingError, IntegrityError, StoreError
from castore.format.hashing import digest_bytes
from castore.gc import RetentionPolicy, collect_garbage
from castore.verify import verify_store

CHUNK = 4096
RUN = "p"


def state(seed: int, *, x_seed: int | None = None) -> dict[str, np.ndarray]:
    """``x`` is 4 chunks and changes with ``x_seed``; ``y`` is 1 chunk and never changes."""
    rng = np.random.default_rng(seed if x_seed is None else x_seed)
    return {
        "x": rng.standard_normal(4 * CHUNK // 8),
        "y": np.arange(CHUNK // 8, dtype=np.float64),
    }


def packs(path: Path) -> set[str]:
    return {p.name for p in (path / "chunks" / "packs").glob("*.pack")}


def named_packs(store: Store) -> set[str]:
    backend = store.backend
    assert isinstance(backend, lmdb_backend.LmdbBackend)
    found = set()
    for key in backend.iter_keys(Namespace.CHUNKS):
        where = backend.locate(key)
        assert where is not None
        found.add(packwriter.pack_name(where.pack))
    return found


def run_killed(path: Path, code: str, point: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    env["CASTORE_FAULTS"] = f"{point}=kill"
    result = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr


SAVE_SECOND = """
import sys, numpy as np, castore
rng = np.random.default_rng(2)
with castore.open(sys.argv[1]) as store:
    store.save({"x": rng.standard_normal(2048), "y": np.arange(512, dtype=np.float64)},
               run="p", step=2)
"""


def test_save_killed_between_pack_and_index_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(state(1), run=RUN, step=1)
    before = packs(path)

    run_killed(path, SAVE_SECOND, "save.pack_unindexed")

    orphans = packs(path) - before
    assert len(orphans) == 1  # the kill landed after the new pack was written
    (orphan,) = orphans
    scan = scan_pack(path / "chunks" / "packs" / orphan, 0)
    assert [r.length for r in scan.records] == [CHUNK] * 4 and not scan.notes  # all of it
    with castore.open(path) as store:
        assert orphans.isdisjoint(named_packs(store))  # ...and before the index named it
        assert [g.id for g in store.generations(RUN)] == [1]
        assert_state_equal(store.load(RUN), state(1))
        assert verify_store(store, deep=True).ok
        report = collect_garbage(store, RetentionPolicy(keep_last=1))
        assert report.file_bytes_freed > 0
        assert packs(path) == before == named_packs(store)
        # The same save again writes the 4 chunks of x again: the index never had them.
        again = store.save(state(0, x_seed=2), run=RUN, step=2)
        assert again.new_bytes == 4 * CHUNK
        assert_state_equal(store.load(RUN, 2), state(0, x_seed=2))


COLLECT = """
import sys, castore
from castore.gc import RetentionPolicy, collect_garbage
with castore.open(sys.argv[1]) as store:
    collect_garbage(store, RetentionPolicy(keep_last=1))
"""


def test_gc_killed_after_rewriting_a_pack_keeps_every_chunk(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(state(1), run=RUN, step=1)  # pack A: x1 (4 chunks) and y
        store.save(state(0, x_seed=2), run=RUN, step=2)  # pack B: x2 only (y deduplicated)
        first = named_packs(store)
    assert len(first) == 2

    run_killed(path, COLLECT, "gc.reclaim_rewritten")

    with castore.open(path) as store:
        now = named_packs(store)
        # Pack A was 1/5 live (y): its copy is named, A itself is still on disk, unnamed.
        assert len(now - first) == 1 and len(first - now) == 1
        assert packs(path) == first | now
        assert [g.id for g in store.generations(RUN)] == [2]
        assert_state_equal(store.load(RUN), state(0, x_seed=2))
        assert verify_store(store, deep=True).ok
        collect_garbage(store, RetentionPolicy(keep_last=1))
        # A is deleted; A's copy and B, both small, are merged into one pack.
        assert packs(path) == named_packs(store)
        assert len(packs(path)) == 1 and packs(path).isdisjoint(first | now)
        assert_state_equal(store.load(RUN), state(0, x_seed=2))


def _read_across_a_reclaim(path: Path, monkeypatch: pytest.MonkeyPatch, *, control: bool) -> list:
    """Read two chunks; between them a reclaim moves the second one to a new pack."""
    backend = lmdb_backend.LmdbBackend(path)
    try:
        kept, dropped, other = bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32
        backend.put_many(Namespace.CHUNKS, [(kept, b"a" * 100), (dropped, b"b" * 1000)])
        backend.put_many(Namespace.CHUNKS, [(other, b"c" * 100)])
        backend.delete_many(Namespace.CHUNKS, [dropped])  # the first pack is under half live
        if control:  # broken control: no second look-up of a moved chunk
            monkeypatch.setattr(backend, "locate", lambda key: None)
        got: list[bytes | None] = []

        def sink(values: Iterator[memoryview | None]) -> None:
            got.append(bytes(next(values) or b""))  # the other pack is mapped now
            assert backend.reclaim(min_live=0.5).packs_rewritten == 1  # kept moves
            got.extend(None if v is None else bytes(v) for v in values)

        backend.read_many(Namespace.CHUNKS, [other, kept], sink)
        return got
    finally:
        backend.close()


def test_read_follows_a_chunk_moved_by_a_reclaim_during_the_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _read_across_a_reclaim(tmp_path / "a", monkeypatch, control=False) == [
        b"c" * 100,
        b"a" * 100,
    ]
    # Without the second look-up the moved chunk would read as missing.
    assert _read_across_a_reclaim(tmp_path / "b", monkeypatch, control=True) == [b"c" * 100, None]


def _damaged_store(path: Path) -> tuple[Path, packwriter.PackLocation]:
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(state(0, x_seed=5), run=RUN, step=1)
        backend = store.backend
        assert isinstance(backend, lmdb_backend.LmdbBackend)
        _, root = store.resolve_root(RUN, "latest")
        [shard] = store.read_shards(root)
        x = next(e for e in shard.tensors if e.name == "x")
        where = backend.locate(x.chunks[2])
        assert where is not None
        return backend.pack_path(where.pack), where


def test_a_missing_pack_file_is_a_missing_chunk(tmp_path: Path) -> None:
    pack, _ = _damaged_store(tmp_path / "store")
    pack.unlink()
    with castore.open(tmp_path / "store") as store:
        with pytest.raises(ChunkMissingError) as info:
            store.load(RUN)
        assert info.value.tensor in ("x", "y")
        report = verify_store(store, deep=True)
        assert not report.ok and report.damaged_generations == [(RUN, 1)]


def test_a_truncated_pack_fails_the_chunks_past_the_cut_only(tmp_path: Path) -> None:
    pack, where = _damaged_store(tmp_path / "store")
    os.truncate(pack, where.offset + 10)  # x's chunk 2 cut short; chunks after it gone
    with castore.open(tmp_path / "store") as store:
        with pytest.raises(IntegrityError) as info:
            store.load(RUN)
        assert isinstance(info.value, (ChecksumMismatchError, ChunkMissingError))
        assert info.value.tensor == "x"
        # x's first two chunks were before the cut: a partial read of them still works.
        expected = state(0, x_seed=5)["x"]
        got = store.read_slice(RUN, "latest", "x", slice(0, CHUNK // 8 * 2))
        np.testing.assert_array_equal(got, expected[: CHUNK // 8 * 2])
        assert not verify_store(store, deep=True).ok


def test_a_full_disk_while_writing_a_pack_raises_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(state(1), run=RUN, step=1)
        before = packs(path)
        real_writev = os.writev
        calls = [0]

        def writev(fd: int, buffers: list[memoryview]) -> int:
            calls[0] += 1
            if calls[0] > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            # The four new records go out in one writev: a short write, the first
            # record and half of the second, then the disk is full.
            return real_writev(fd, [*buffers[:3], buffers[3][: CHUNK // 2]])

        monkeypatch.setattr(packwriter.os, "writev", writev)
        with pytest.raises(StoreError, match="cannot write a chunk pack: No space left"):
            store.save(state(0, x_seed=9), run=RUN, step=2)
        monkeypatch.undo()
        assert calls[0] == 2
        assert packs(path) == before  # the partial pack was removed
        assert [g.id for g in store.generations(RUN)] == [1]
        assert_state_equal(store.load(RUN), state(1))
        assert verify_store(store, deep=True).ok
        gen = store.save(state(0, x_seed=9), run=RUN, step=2)  # space came back
        assert gen.id == 2 and gen.new_bytes == 4 * CHUNK


def small_chunks(count: int, size: int = 100) -> list[tuple[bytes, bytes]]:
    values = [bytes([i % 251]) * size + i.to_bytes(4, "little") for i in range(count)]
    return [(digest_bytes(v), v) for v in values]


def _index_matches_pack(
    backend: lmdb_backend.LmdbBackend, items: list[tuple[bytes, bytes]]
) -> None:
    """Every item reads back intact, from where a scan of its one pack finds its record."""
    got: list[bytes | None] = []
    backend.read_many(
        Namespace.CHUNKS,
        [k for k, _ in items],
        lambda values: got.extend(None if v is None else bytes(v) for v in values),
    )
    assert got == [v for _, v in items]
    places = [backend.locate(key) for key, _ in items]
    (pack,) = {where.pack for where in places if where is not None}
    scan = scan_pack(backend.pack_path(pack), pack)
    assert not scan.notes
    indexed = {(k, w.offset, w.length) for (k, _), w in zip(items, places, strict=True) if w}
    assert {(r.digest, r.offset, r.length) for r in scan.records} == indexed
    assert [w.length if w else None for w in places] == [len(v) for _, v in items]


def test_small_chunks_go_to_the_pack_together_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_writev = os.writev
    calls: list[int] = []

    def writev(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        return real_writev(fd, buffers)

    monkeypatch.setattr(packwriter.os, "writev", writev)
    backend = lmdb_backend.LmdbBackend(tmp_path / "chunks")
    try:
        items = small_chunks(300)
        result = backend.put_many(Namespace.CHUNKS, iter(items))
        assert (result.written, result.written_bytes) == (300, 300 * 104)
        # 600 pieces (a header and a chunk each): two writev calls of at most 512 pieces.
        assert calls == [512, 88]
        _index_matches_pack(backend, items)
    finally:
        backend.close()


def test_a_short_writev_is_resumed_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_writev = os.writev
    calls = [0]

    def writev(fd: int, buffers: list[memoryview]) -> int:
        calls[0] += 1
        assert calls[0] < 1000, "the pack writer does not advance past what was written"
        first = memoryview(buffers[0]).cast("B")
        return real_writev(fd, [first[: max(1, first.nbytes // 3)]])  # a third of one piece

    monkeypatch.setattr(packwriter.os, "writev", writev)
    backend = lmdb_backend.LmdbBackend(tmp_path / "chunks")
    try:
        items = small_chunks(5) + [(digest_bytes(b"x" * 5000), b"x" * 5000)]
        assert backend.put_many(Namespace.CHUNKS, items).written == 6
        _index_matches_pack(backend, items)
    finally:
        backend.close()


def test_a_pack_is_written_and_synced_before_the_index_names_its_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_writev, real_datasync = os.writev, packwriter._datasync
    real_fsync_dir, real_txn = packwriter.fsync_dir, lmdb_backend.LmdbBackend._write_txn

    def writev(fd: int, buffers: list[memoryview]) -> int:
        events.append("write")
        return real_writev(fd, buffers)

    def datasync(fd: int) -> None:
        events.append("datasync")
        real_datasync(fd)

    def fsync_dir(path: Path) -> None:
        events.append("fsync dir")
        real_fsync_dir(path)

    def write_txn(self: lmdb_backend.LmdbBackend, work: object) -> object:
        events.append("index commit")
        return real_txn(self, work)

    monkeypatch.setattr(packwriter.os, "writev", writev)
    monkeypatch.setattr(packwriter, "_datasync", datasync)
    monkeypatch.setattr(packwriter, "fsync_dir", fsync_dir)
    monkeypatch.setattr(lmdb_backend.LmdbBackend, "_write_txn", write_txn)
    backend = lmdb_backend.LmdbBackend(tmp_path / "chunks")
    try:
        big = b"y" * (2 << 20)
        items = [(digest_bytes(big), big), *small_chunks(3)]
        backend.put_many(Namespace.CHUNKS, items)
    finally:
        backend.close()
    # The big chunk goes out at once, the small ones queued after it when the
    # pack is finished: both before the sync.
    assert events == ["write", "write", "datasync", "fsync dir", "index commit"]


PUT_ONE = """
import sys
from castore.chunkstore.base import Namespace
from castore.chunkstore.lmdb.backend import LmdbBackend
from castore.format.hashing import digest_bytes
value = bytes.fromhex(sys.argv[2])
backend = LmdbBackend(sys.argv[1])
assert backend.put_many(Namespace.CHUNKS, [(digest_bytes(value), value)]).written == 1
backend.close()
"""


def test_a_chunk_another_process_indexes_first_keeps_its_copy(tmp_path: Path) -> None:
    items = small_chunks(4)
    contested_key, contested = items[2]

    def racing() -> Iterator[tuple[bytes, bytes]]:
        for key, value in items:
            if key == contested_key:  # after this put's snapshot, before its commit
                subprocess.run(
                    [sys.executable, "-c", PUT_ONE, str(tmp_path / "chunks"), contested.hex()],
                    check=True,
                    timeout=120,
                )
            yield key, value

    backend = lmdb_backend.LmdbBackend(tmp_path / "chunks")
    try:
        result = backend.put_many(Namespace.CHUNKS, racing())
        assert (result.written, result.written_bytes, result.already_present) == (3, 3 * 104, 1)
        theirs, ours = backend.locate(contested_key), backend.locate(items[0][0])
        assert theirs is not None and ours is not None and theirs.pack != ours.pack
        got: list[bytes | None] = []
        backend.read_many(
            Namespace.CHUNKS,
            [k for k, _ in items],
            lambda values: got.extend(None if v is None else bytes(v) for v in values),
        )
        assert got == [v for _, v in items]
    finally:
        backend.close()


def test_one_batchs_index_entries_grow_a_full_map(tmp_path: Path) -> None:
    backend = lmdb_backend.LmdbBackend(tmp_path / "chunks", map_size=1 << 20)
    try:
        values = [i.to_bytes(8, "little") * 4 for i in range(20_000)]  # ~2 MB of index
        items = [(digest_bytes(v), v) for v in values]
        assert backend.put_many(Namespace.CHUNKS, items).written == len(items)
        assert backend.map_size > 1 << 20
        assert all(backend.has_many(Namespace.CHUNKS, [k for k, _ in items]))
    finally:
        backend.close()
