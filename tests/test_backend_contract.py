"""The chunk backend contract (castore.testing.chunks) over every backend, and LMDB's own.

Format 3's BlobPackBackend runs it on memory blobs, a shared directory and S3
(moto on the loopback), with packs of a few hundred bytes so that one
``put_many`` cuts several; a variant reads every chunk through a new handle
on the same blobs (an empty index cache), as another process would.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from castore.blob import MemoryBlobStore, PosixBlobStore
from castore.blob.base import BlobStore
from castore.chunkstore import ChunkBackend, LmdbBackend, MemoryBackend, Namespace
from castore.chunkstore.blobcache import IndexCache
from castore.chunkstore.blobpacks import BlobPackBackend
from castore.errors import StoreError
from castore.format.hashing import digest_bytes
from castore.testing.chunks import ChunkBackendTests, items


class TestLmdbBackend(ChunkBackendTests):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[ChunkBackend]:
        made = LmdbBackend(tmp_path / "env")
        yield made
        made.close()


class TestMemoryBackend(ChunkBackendTests):
    @pytest.fixture
    def backend(self) -> Iterator[ChunkBackend]:
        made = MemoryBackend()
        yield made
        made.close()


try:
    import s3_server
except pytest.skip.Exception:  # boto3 or moto is not installed: the S3 cases skip
    s3_server = None

SMALL_PACK = 256  # bytes: items(10) of about 100 bytes each fill four packs


@pytest.fixture(params=["memory", "posix", "s3"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "memory":
        return MemoryBlobStore(list_page_size=7)
    if request.param == "posix":
        return PosixBlobStore(tmp_path / "shared")
    if s3_server is None:
        pytest.skip("boto3 and moto are needed for the S3 cases")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    from castore.blob.s3 import S3BlobStore

    return S3BlobStore(bucket, "store", **s3_server.store_arguments(endpoint))


class TestBlobPackBackend(ChunkBackendTests):
    @pytest.fixture
    def backend(self, blobs: BlobStore, tmp_path: Path) -> Iterator[ChunkBackend]:
        cache = IndexCache(tmp_path / "cache", "contract")
        made = BlobPackBackend(blobs, cache=cache, pack_bytes=SMALL_PACK)
        yield made
        made.close()


class _ReadsThroughANewHandle(BlobPackBackend):
    """Every presence check and read by a new backend on the same blobs, with no cache."""

    def _fresh(self) -> BlobPackBackend:
        return BlobPackBackend(self.blobs, pack_bytes=self.pack_bytes)

    def has_many(self, namespace, keys):  # type: ignore[no-untyped-def]
        fresh = self._fresh()
        try:
            return fresh.has_many(namespace, keys)
        finally:
            fresh.close()

    def read_many(self, namespace, keys, sink):  # type: ignore[no-untyped-def]
        fresh = self._fresh()
        try:
            fresh.read_many(namespace, keys, sink)
        finally:
            fresh.close()


class TestBlobPackBackendReadByANewHandle(ChunkBackendTests):
    @pytest.fixture
    def backend(self) -> Iterator[ChunkBackend]:
        made = _ReadsThroughANewHandle(MemoryBlobStore(), pack_bytes=SMALL_PACK)
        yield made
        made.close()


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
