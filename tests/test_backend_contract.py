"""The chunk backend contract, run against every backend (real LMDB on disk)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from castore.chunkstore import ChunkBackend, LmdbBackend, MemoryBackend, Namespace
from castore.errors import StoreError
from castore.hashing import digest_bytes


@pytest.fixture(params=["lmdb", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ChunkBackend]:
    made: ChunkBackend = (
        LmdbBackend(tmp_path / "env") if request.param == "lmdb" else MemoryBackend()
    )
    yield made
    made.close()


def items(count: int, size: int = 100) -> list[tuple[bytes, bytes]]:
    values = [bytes([i % 256]) * size + i.to_bytes(4, "little") for i in range(count)]
    return [(digest_bytes(v), v) for v in values]


def test_put_then_read_returns_the_same_bytes(backend: ChunkBackend) -> None:
    pairs = items(10)
    result = backend.put_many(Namespace.CHUNKS, pairs)
    assert (result.written, result.already_present) == (10, 0)
    assert result.written_bytes == sum(len(v) for _, v in pairs)
    got: list[bytes | None] = []
    backend.read_many(
        Namespace.CHUNKS,
        [k for k, _ in pairs],
        lambda values: got.extend(None if v is None else bytes(v) for v in values),
    )
    assert got == [v for _, v in pairs]


def test_put_of_present_key_writes_nothing_and_keeps_the_first_value(
    backend: ChunkBackend,
) -> None:
    key, value = items(1)[0]
    backend.put_many(Namespace.CHUNKS, [(key, value)])
    again = backend.put_many(Namespace.CHUNKS, [(key, b"something else")])
    assert (again.written, again.already_present, again.written_bytes) == (0, 1, 0)
    assert backend.get(Namespace.CHUNKS, key) == value


def test_namespaces_are_separate(backend: ChunkBackend) -> None:
    key, value = items(1)[0]
    backend.put_many(Namespace.OBJECTS, [(key, value)])
    assert backend.has_many(Namespace.OBJECTS, [key]) == [True]
    assert backend.has_many(Namespace.CHUNKS, [key]) == [False]
    assert backend.get(Namespace.CHUNKS, key) is None


def test_missing_keys_read_as_none_in_order(backend: ChunkBackend) -> None:
    pairs = items(3)
    backend.put_many(Namespace.CHUNKS, pairs[:1] + pairs[2:])
    seen: list[bool] = []
    backend.read_many(
        Namespace.CHUNKS, [k for k, _ in pairs], lambda vs: seen.extend(v is not None for v in vs)
    )
    assert seen == [True, False, True]
    assert backend.has_many(Namespace.CHUNKS, [k for k, _ in pairs]) == [True, False, True]


def test_delete_listing_and_sizes(backend: ChunkBackend) -> None:
    pairs = items(5, size=10)
    backend.put_many(Namespace.CHUNKS, pairs)
    assert sorted(backend.iter_keys(Namespace.CHUNKS)) == sorted(k for k, _ in pairs)
    assert dict(backend.value_sizes(Namespace.CHUNKS)) == {k: len(v) for k, v in pairs}
    assert backend.delete_many(Namespace.CHUNKS, [pairs[0][0], pairs[0][0], b"\0" * 32]) == 1
    assert len(list(backend.iter_keys(Namespace.CHUNKS))) == 4


def test_values_can_be_memoryviews_of_larger_buffers(backend: ChunkBackend) -> None:
    buffer = bytearray(range(256)) * 4
    view = memoryview(buffer)[100:300]
    key = digest_bytes(view)
    backend.put_many(Namespace.CHUNKS, [(key, view)])
    assert backend.get(Namespace.CHUNKS, key) == bytes(buffer[100:300])


def test_lmdb_values_persist_across_reopen(tmp_path: Path) -> None:
    pairs = items(4)
    first = LmdbBackend(tmp_path / "env")
    first.put_many(Namespace.CHUNKS, pairs)
    first.close()
    second = LmdbBackend(tmp_path / "env")
    try:
        assert [second.get(Namespace.CHUNKS, k) for k, _ in pairs] == [v for _, v in pairs]
    finally:
        second.close()


def test_lmdb_map_grows_when_full(tmp_path: Path) -> None:
    backend = LmdbBackend(tmp_path / "env", map_size=1 << 20)
    try:
        big = [(digest_bytes(v), v) for v in (os.urandom(1 << 20) for _ in range(4))]
        # Objects live in the map itself (chunk bytes go to packs).
        result = backend.put_many(Namespace.OBJECTS, big)
        assert result.written == 4
        assert backend.map_size > 1 << 20
        assert all(backend.get(Namespace.OBJECTS, k) == v for k, v in big)
    finally:
        backend.close()


def test_lmdb_refuses_use_after_fork(tmp_path: Path) -> None:
    backend = LmdbBackend(tmp_path / "env")
    backend.put_many(Namespace.CHUNKS, items(1))
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must refuse the parent's environment
        try:
            backend.has_many(Namespace.CHUNKS, [items(1)[0][0]])
            os.write(write_fd, b"used")
        except StoreError:
            os.write(write_fd, b"refused")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read_fd, 16) == b"refused"
    assert backend.has_many(Namespace.CHUNKS, [items(1)[0][0]]) == [True]
    backend.close()


def test_lmdb_chunk_index_names_pack_records_exactly(tmp_path: Path) -> None:
    """Read the files with plain I/O: each index entry names a pack record of its own digest."""
    import struct

    import lmdb

    backend = LmdbBackend(tmp_path / "env")
    pairs = items(6, size=50)
    backend.put_many(Namespace.CHUNKS, pairs)
    backend.put_many(Namespace.CHUNKS, pairs[:2])  # already present: no index change, no pack
    backend.delete_many(Namespace.CHUNKS, [pairs[0][0]])
    backend.close()
    packs = sorted((tmp_path / "env" / "packs").iterdir())
    assert len(packs) == 1
    env = lmdb.open(str(tmp_path / "env"), max_dbs=4, readonly=True, lock=False)
    try:
        index_db = env.open_db(b"chunk_index", create=False)
        with env.begin() as txn:
            indexed = {bytes(k): struct.unpack("<QQQ", v) for k, v in txn.cursor(db=index_db)}
    finally:
        env.close()
    raw = packs[0].read_bytes()
    assert raw[:8] == b"CASTPACK"
    found = {}
    for key, (length, pack, offset) in indexed.items():
        assert packs[0].name == f"{pack:016x}.pack"
        digest, size = struct.unpack("<32sQ", raw[offset - 40 : offset])
        assert (digest, size) == (key, length)
        found[key] = raw[offset : offset + length]
    assert found == dict(pairs[1:])
