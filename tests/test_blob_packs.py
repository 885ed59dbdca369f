"""Format 3's chunk layout, pinned: packs, index blobs, the per-node cache, the marker.

Each test builds the damage or the race it names from the blobs themselves
(crafted index blobs, flipped bytes, a cut pack, a second writer whose
listing came first) and checks what a reader on a *fresh* handle sees: an
empty cache, as another node or process. Stores are in memory blobs with
1 KiB chunks and packs of a few KiB, except where a shared directory is the
point (``castore.open(path, shared=True)``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import castore
from castore import Store
from castore.blob import MemoryBlobStore
from castore.blob.base import BlobStore
from castore.chunkstore import blobpacks
from castore.chunkstore.base import Namespace
from castore.chunkstore.blobcache import CacheWarning, IndexCache
from castore.chunkstore.bloblayout import (
    INDEX_PREFIX,
    PACK_PREFIX,
    encode_index,
    index_blob_name,
    pack_blob,
    pack_name,
    parse_index,
)
from castore.chunkstore.blobpacks import BlobPackBackend
from castore.chunkstore.packfile import PACK_HEADER, RECORD_HEADER
from castore.errors import (
    FormatVersionError,
    IntegrityError,
    NotAStoreError,
    StoreNotFoundError,
    UnsupportedBackendError,
)
from castore.gc import GcAbortedError, collect_garbage
from castore.opening.blobs import MARKER, open_blob_store
from castore.retention import RetentionPolicy
from castore.store import FallbackWarning
from castore.testing.chunks import items
from castore.verify import verify_store

CHUNK = 1024
PACK = 4096
SMALL_PACK = 256  # bytes: items() of 104 bytes go three to a pack


class CountingBlobs(MemoryBlobStore):
    """Memory blobs that count the gets of each prefix (``index/``, ``packs/``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.gets: Counter[str] = Counter()

    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        self.gets[name.split("/", 1)[0] + "/"] += 1
        return super().get(name, start, end)


def fresh(blobs: BlobStore, **options: Any) -> BlobPackBackend:
    """A backend on ``blobs`` that has seen nothing: no cache, as on another node."""
    return BlobPackBackend(blobs, pack_bytes=options.pop("pack_bytes", SMALL_PACK), **options)


def present(blobs: BlobStore, keys: list[bytes]) -> list[bool]:
    reader = fresh(blobs)
    try:
        return reader.has_many(Namespace.CHUNKS, keys)
    finally:
        reader.close()


def listed(blobs: BlobStore, prefix: str) -> list[str]:
    return sorted(blobs.list(prefix))


def replace_blob(blobs: BlobStore, name: str, data: bytes) -> None:
    """Put other bytes under an immutable blob's name (damage from outside castore)."""
    blobs.delete(name)
    blobs.create(name, data)


def memory_store(blobs: BlobStore, cache: Path, **options: Any) -> Store:
    options.setdefault("pack_bytes", PACK)
    return open_blob_store(blobs, "memory://t", chunk_size=CHUNK, cache_dir=cache, **options)


@pytest.fixture
def backend() -> Iterator[BlobPackBackend]:
    made = BlobPackBackend(MemoryBlobStore(), pack_bytes=SMALL_PACK)
    yield made
    made.close()


# -- packs and index blobs ---------------------------------------------------------


def test_packs_are_cut_at_pack_bytes_and_named_by_their_records(
    backend: BlobPackBackend,
) -> None:
    pairs = items(10)  # 104 bytes each: a pack is cut at the third (312 >= 256)
    assert backend.put_many(Namespace.CHUNKS, pairs).written == 10
    blobs = backend.blobs
    packs, indexes = listed(blobs, PACK_PREFIX), listed(blobs, INDEX_PREFIX)
    assert (len(packs), len(indexes)) == (4, 4)
    by_value = dict(pairs)
    counts = []
    for name in indexes:
        parsed = parse_index(name, blobs.get(name))
        raw = blobs.get(pack_blob(parsed.pack))
        assert len(raw) == parsed.pack_size
        assert parsed.pack == pack_name([(d, n) for d, _, n in parsed.entries])
        for digest, offset, length in parsed.entries:
            header = raw[offset - RECORD_HEADER.size : offset]
            assert RECORD_HEADER.unpack(header) == (digest, length)
            assert raw[offset : offset + length] == by_value[digest]
        counts.append(len(parsed.entries))
    assert sorted(counts) == [1, 3, 3, 3]
    assert len(raw) >= PACK_HEADER.size


def test_two_writers_of_the_same_chunks_make_one_pack(backend: BlobPackBackend) -> None:
    pairs = items(3)
    late = fresh(backend.blobs)
    late.refresh()  # its listing came before the first writer's pack
    late.refresh = lambda: None  # type: ignore[method-assign]
    backend.put_many(Namespace.CHUNKS, pairs)
    result = late.put_many(Namespace.CHUNKS, pairs)  # the pack and index blob exist: tolerated
    late.close()
    assert result.written == 3
    assert (len(listed(backend.blobs, PACK_PREFIX)), len(listed(backend.blobs, INDEX_PREFIX))) == (
        1,
        1,
    )
    assert present(backend.blobs, [k for k, _ in pairs]) == [True] * 3


def test_a_chunk_two_writers_packed_differently_is_deleted_from_both_packs(
    backend: BlobPackBackend,
) -> None:
    """Fix: a delete dropped one copy and left the chunk present through the other pack."""
    pairs = items(4)
    keys = [k for k, _ in pairs]
    late = fresh(backend.blobs, pack_bytes=1 << 20)
    late.refresh()
    late.refresh = lambda: None  # type: ignore[method-assign]
    first = fresh(backend.blobs, pack_bytes=1 << 20)
    first.put_many(Namespace.CHUNKS, pairs[:3])  # packs [0, 1, 2] and [1, 2, 3]
    late.put_many(Namespace.CHUNKS, pairs[1:])
    first.close()
    late.close()
    assert len(listed(backend.blobs, PACK_PREFIX)) == 2
    assert backend.delete_many(Namespace.CHUNKS, [keys[1], keys[1]]) == 1
    assert present(backend.blobs, keys) == [True, False, True, True]
    assert backend.get(Namespace.CHUNKS, keys[1]) is None
    assert backend.delete_many(Namespace.CHUNKS, keys) == 3
    assert listed(backend.blobs, PACK_PREFIX) == listed(backend.blobs, INDEX_PREFIX) == []


def test_a_pack_without_its_index_blob_is_invisible_and_reclaim_deletes_it(
    backend: BlobPackBackend,
) -> None:
    pairs = items(3)
    backend.put_many(Namespace.CHUNKS, pairs)
    (index,) = listed(backend.blobs, INDEX_PREFIX)
    backend.blobs.delete(index)  # a save killed between its pack and its index blob
    (pack,) = listed(backend.blobs, PACK_PREFIX)
    assert present(backend.blobs, [k for k, _ in pairs]) == [False] * 3
    reader = fresh(backend.blobs)
    try:
        check = reader.check_index()
        assert check.ok and len(check.notes) == 1 and "no index blob" in check.notes[0]
        stats = reader.reclaim()
    finally:
        reader.close()
    assert stats.packs_deleted == 1 and stats.bytes_freed > 0
    assert pack.startswith(PACK_PREFIX) and listed(backend.blobs, PACK_PREFIX) == []


def test_deleting_one_chunk_writes_a_smaller_index_and_deleting_all_deletes_the_pack(
    backend: BlobPackBackend,
) -> None:
    pairs = items(3)
    keys = [k for k, _ in pairs]
    backend.put_many(Namespace.CHUNKS, pairs)
    (old_index,) = listed(backend.blobs, INDEX_PREFIX)
    (pack,) = listed(backend.blobs, PACK_PREFIX)
    size = backend.blobs.head(pack)
    assert backend.delete_many(Namespace.CHUNKS, [keys[1]]) == 1
    (new_index,) = listed(backend.blobs, INDEX_PREFIX)
    assert new_index != old_index
    assert len(parse_index(new_index, backend.blobs.get(new_index)).entries) == 2
    assert listed(backend.blobs, PACK_PREFIX) == [pack] and backend.blobs.head(pack) == size
    assert present(backend.blobs, keys) == [True, False, True]
    assert backend.has_many(Namespace.CHUNKS, keys) == [True, False, True]
    assert backend.delete_many(Namespace.CHUNKS, keys) == 2
    assert listed(backend.blobs, PACK_PREFIX) == listed(backend.blobs, INDEX_PREFIX) == []
    assert present(backend.blobs, keys) == [False] * 3


def test_a_chunk_is_present_only_where_every_index_blob_of_its_pack_lists_it(
    backend: BlobPackBackend,
) -> None:
    pairs = items(3)
    keys = [k for k, _ in pairs]
    backend.put_many(Namespace.CHUNKS, pairs)
    (index,) = listed(backend.blobs, INDEX_PREFIX)
    parsed = parse_index(index, backend.blobs.get(index))
    # A collection that wrote the smaller index blob and died before deleting the larger.
    smaller = encode_index(parsed.pack_size, [parsed.entries[0], parsed.entries[2]])
    backend.blobs.create(index_blob_name(parsed.pack, smaller), smaller)
    assert len(listed(backend.blobs, INDEX_PREFIX)) == 2
    assert present(backend.blobs, keys) == [True, False, True]
    backend.refresh()
    got = [backend.get(Namespace.CHUNKS, k) for k in keys]
    assert got == [pairs[0][1], None, pairs[2][1]]
    # Two collections, each deleting another chunk: neither smaller blob alone is the answer.
    other = encode_index(parsed.pack_size, [parsed.entries[1], parsed.entries[2]])
    backend.blobs.create(index_blob_name(parsed.pack, other), other)
    assert present(backend.blobs, keys) == [False, False, True]


def test_a_merge_that_recreates_a_pack_keeps_its_chunks(backend: BlobPackBackend) -> None:
    """Fix: reclaim deleted the pack it had just rewritten under the same (content) name."""
    pairs = items(6)  # two packs of three, each smaller than merge_below
    backend.put_many(Namespace.CHUNKS, pairs)
    packs = listed(backend.blobs, PACK_PREFIX)
    stats = backend.reclaim(merge_below=1 << 20)
    assert stats.chunks_moved == 6
    assert listed(backend.blobs, PACK_PREFIX) == packs  # batches of a pack's worth: the same packs
    reader = fresh(backend.blobs)
    try:
        assert [reader.get(Namespace.CHUNKS, k) for k, _ in pairs] == [v for _, v in pairs]
        assert reader.check_index(hash_bytes=True).ok
    finally:
        reader.close()


# -- damage ----------------------------------------------------------------------


def flip_byte(blobs: BlobStore, name: str, at: int) -> None:
    data = bytearray(blobs.get(name))
    data[at] ^= 0xFF
    replace_blob(blobs, name, bytes(data))


def test_a_garbled_index_blob_is_a_problem_its_chunks_are_absent_and_saves_go_on(
    tmp_path: Path,
) -> None:
    blobs = MemoryBlobStore()
    state = {"w": np.arange(2048, dtype=np.float32)}
    with memory_store(blobs, tmp_path / "node-a") as store:
        store.save(state, run="r", step=1)
    index = listed(blobs, INDEX_PREFIX)[0]
    flip_byte(blobs, index, 20)
    reader = fresh(blobs)
    try:
        reader.refresh()  # one damaged index blob does not stop the store
        assert "does not hash to its name" in reader.damaged[index]
        assert reader.orphan_packs() == []  # its pack is not garbage to delete
        check = reader.check_index()
        assert not check.ok and any(index in p and "\n" not in p for p in check.problems)
    finally:
        reader.close()
    with memory_store(blobs, tmp_path / "node-b") as other:  # an empty cache
        report = verify_store(other, deep=True)
        assert not report.ok
        assert any(index in p.what for p in report.problems)
        with pytest.raises(GcAbortedError, match="unreadable"):  # gc acts on no guess
            collect_garbage(other, RetentionPolicy(keep_last=1))
        # The chunks it listed count as absent: the next save writes them again.
        again = other.save(state, run="r", step=2)
        assert again.stats.new_chunks > 0
        assert other.load("r")["w"].tobytes() == state["w"].tobytes()


def test_a_cached_copy_of_an_index_blob_is_used_only_if_it_hashes_to_the_name(
    tmp_path: Path,
) -> None:
    blobs = MemoryBlobStore()
    with memory_store(blobs, tmp_path / "node") as store:
        store.save({"w": np.arange(2048, dtype=np.float32)}, run="r", step=1)
    index = listed(blobs, INDEX_PREFIX)[0]
    flip_byte(blobs, index, 20)  # the store's copy garbled; this node's cached copy is sound
    with memory_store(blobs, tmp_path / "node") as again:
        assert again.load("r")["w"].tobytes() == np.arange(2048, dtype=np.float32).tobytes()


def swap_first_two_entries(blobs: BlobStore, index: str) -> None:
    """Rewrite ``index`` (a sound, newly named blob) so two equal-length chunks trade places."""
    parsed = parse_index(index, blobs.get(index))
    (d0, o0, n0), (d1, o1, n1) = parsed.entries[:2]
    assert n0 == n1
    entries = [(d1, o0, n0), (d0, o1, n1), *parsed.entries[2:]]
    data = encode_index(parsed.pack_size, entries)
    blobs.create(index_blob_name(parsed.pack, data), data)
    blobs.delete(index)


def test_an_index_blob_that_disagrees_with_its_pack_fails_the_load_and_the_check(
    tmp_path: Path,
) -> None:
    blobs = MemoryBlobStore()
    saved = np.arange(512, dtype=np.float32)  # two 1 KiB chunks, one pack
    with memory_store(blobs, tmp_path / "node-a") as store:
        store.save({"w": saved}, run="r", step=1)
    (index,) = listed(blobs, INDEX_PREFIX)
    swap_first_two_entries(blobs, index)
    with memory_store(blobs, tmp_path / "node-b") as other:
        with pytest.raises(IntegrityError) as caught:
            other.load("r")
        assert "\n" not in str(caught.value)
        check = other.backend.check_index(hash_bytes=True)
        assert other.backend.check_index().ok  # the sizes agree: only the record headers differ
    assert len(check.problems) == 2
    assert all("lists chunk" in p and "where pack" in p for p in check.problems)


def test_a_cut_pack_reads_as_missing_and_a_fallback_loads_the_generation_before(
    tmp_path: Path,
) -> None:
    blobs = MemoryBlobStore()
    first = {"w": np.arange(512, dtype=np.float32)}  # two 1 KiB chunks, one pack
    second = {"w": np.arange(512, dtype=np.float32) + 1}
    with memory_store(blobs, tmp_path / "node-a") as store:
        store.save(first, run="r", step=1)
        before = set(listed(blobs, PACK_PREFIX))
        store.save(second, run="r", step=2)
    (new_pack,) = set(listed(blobs, PACK_PREFIX)) - before
    replace_blob(blobs, new_pack, blobs.get(new_pack)[:-100])
    with memory_store(blobs, tmp_path / "node-b") as other:
        with pytest.raises(IntegrityError):
            other.load("r")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = other.load("r", fallback="previous")
        assert loaded["w"].tobytes() == first["w"].tobytes()
        assert any(issubclass(w.category, FallbackWarning) for w in caught)
        check = other.backend.check_index()
    assert any("bytes; its index blob" in p for p in check.problems)


# -- the per-node cache -----------------------------------------------------------


def test_a_second_backend_with_the_same_cache_fetches_no_index_blob(tmp_path: Path) -> None:
    blobs = CountingBlobs()
    writer = BlobPackBackend(blobs, cache=IndexCache(tmp_path, "store1"), pack_bytes=SMALL_PACK)
    writer.put_many(Namespace.CHUNKS, items(9))
    writer.close()
    assert len(listed(blobs, INDEX_PREFIX)) == 3
    reader = BlobPackBackend(blobs, cache=IndexCache(tmp_path, "store1"))
    try:
        assert all(reader.has_many(Namespace.CHUNKS, [k for k, _ in items(9)]))
        assert blobs.gets[INDEX_PREFIX] == 0
    finally:
        reader.close()
    without = fresh(blobs)  # the control: no cache, one get per index blob
    without.refresh()
    without.close()
    assert blobs.gets[INDEX_PREFIX] == 3


def test_a_cache_entry_of_a_deleted_index_blob_is_not_used(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    pairs = items(3)
    keys = [k for k, _ in pairs]
    writer = BlobPackBackend(blobs, cache=IndexCache(tmp_path, "s"), pack_bytes=SMALL_PACK)
    writer.put_many(Namespace.CHUNKS, pairs)
    writer.close()
    # Another node deletes every chunk: the pack and its (cached) index blob go.
    elsewhere = fresh(blobs)
    elsewhere.delete_many(Namespace.CHUNKS, keys)
    elsewhere.close()
    assert list(blobs.list()) == []
    reader = BlobPackBackend(blobs, cache=IndexCache(tmp_path, "s"))
    try:
        assert reader.has_many(Namespace.CHUNKS, keys) == [False] * 3
    finally:
        reader.close()


def test_the_cache_forgets_index_blobs_the_store_deleted(tmp_path: Path) -> None:
    """Fix: entries of deleted index blobs stayed, and the cache grew with every collection."""
    blobs = MemoryBlobStore()
    pairs = items(3)
    keys = [k for k, _ in pairs]
    writer = BlobPackBackend(blobs, cache=IndexCache(tmp_path, "s"), pack_bytes=SMALL_PACK)
    writer.put_many(Namespace.CHUNKS, pairs)
    writer.close()
    (first,) = listed(blobs, INDEX_PREFIX)
    elsewhere = fresh(blobs)  # another node: a smaller index blob, the cached one deleted
    elsewhere.delete_many(Namespace.CHUNKS, [keys[0]])
    elsewhere.close()
    (second,) = listed(blobs, INDEX_PREFIX)
    cache = IndexCache(tmp_path, "s")
    reader = BlobPackBackend(blobs, cache=cache)
    try:
        assert reader.has_many(Namespace.CHUNKS, keys) == [False, True, True]
        assert cache.names() == [second]  # the first listing pruned what the store lacks
        reader.delete_many(Namespace.CHUNKS, [keys[1]])  # its own delete forgets at once
        assert cache.names() == listed(blobs, INDEX_PREFIX) != [second]
    finally:
        reader.close()
    assert first != second


def test_a_corrupt_cache_entry_is_ignored(tmp_path: Path) -> None:
    blobs = CountingBlobs()
    pairs = items(3)
    fresh(blobs).put_many(Namespace.CHUNKS, pairs)
    (index,) = listed(blobs, INDEX_PREFIX)
    cache = IndexCache(tmp_path, "s")
    cache.put(index, b"garbage under a listed name")
    reader = BlobPackBackend(blobs, cache=cache)
    try:
        assert reader.get(Namespace.CHUNKS, pairs[1][0]) == pairs[1][1]
        assert blobs.gets[INDEX_PREFIX] == 1  # fetched from the store instead
        assert cache.get(index) == blobs.get(index)  # and the entry put right
    finally:
        reader.close()


def test_an_unusable_cache_dir_warns_once_and_the_store_works(tmp_path: Path) -> None:
    in_the_way = tmp_path / "a-file"
    in_the_way.write_bytes(b"not a directory")
    blobs = MemoryBlobStore()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memory_store(blobs, in_the_way / "cache") as store:
            store.save({"w": np.arange(300.0)}, run="r", step=1)
            assert store.load("r")["w"].tobytes() == np.arange(300.0).tobytes()
    cache_warnings = [w for w in caught if issubclass(w.category, CacheWarning)]
    assert len(cache_warnings) == 1
    assert "going on without it" in str(cache_warnings[0].message)
    assert in_the_way.read_bytes() == b"not a directory"


# -- reads ------------------------------------------------------------------------


def test_a_slice_read_fetches_little_more_than_its_chunks_in_few_requests(
    tmp_path: Path,
) -> None:
    chunk = 8192  # a record header (40 bytes) is 0.5% of a chunk
    weights = np.arange(256 * 2048, dtype=np.float32).reshape(256, 2048)  # a row is a chunk
    blobs = MemoryBlobStore()
    # Stored raw: the bytes fetched are the rows' own (tests/test_compression.py reads frames).
    with open_blob_store(
        blobs,
        "memory://t",
        chunk_size=chunk,
        pack_bytes=32 * chunk,
        cache_dir=tmp_path,
        codec="none",
    ) as store:
        store.save({"w": weights}, run="r", step=1)
    assert len(listed(blobs, PACK_PREFIX)) == 8
    with open_blob_store(blobs, "memory://t", pack_bytes=32 * chunk, cache_dir=tmp_path) as store:
        backend = store.backend
        assert isinstance(backend, BlobPackBackend)
        part = store.read_slice("r", "latest", "w", (slice(40, 120), slice(None)))
        fetched = backend.fetches
    assert part.tobytes() == weights[40:120].tobytes()
    needed = 80 * chunk
    assert fetched.chunk_bytes == needed
    assert needed <= fetched.bytes <= 1.01 * needed
    assert fetched.requests <= 4  # rows 40..119 lie in packs 1..3: one request each


# -- opening ----------------------------------------------------------------------


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def test_an_lmdb_store_opened_shared_is_refused_in_one_line_and_left_untouched(
    tmp_path: Path,
) -> None:
    root = tmp_path / "local"
    with castore.open(root, chunk_size=CHUNK) as local:
        local.save({"w": np.arange(300.0)}, run="r", step=1)
    before = tree(root)
    with pytest.raises(UnsupportedBackendError, match="single-node store") as caught:
        castore.open(root, shared=True)
    assert "\n" not in str(caught.value)
    assert tree(root) == before
    with castore.open(root) as again:
        assert again.load("r")["w"].tobytes() == np.arange(300.0).tobytes()


def test_a_shared_store_reopens_as_blobs_without_the_flag(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    with castore.open(root, shared=True, chunk_size=CHUNK, pack_bytes=PACK) as store:
        store.save({"w": np.arange(3000.0)}, run="r", step=1)
    marker = json.loads((root / MARKER).read_bytes())
    assert (marker["format_version"], marker["backend"], marker["codec"]) == (4, "blobs", "auto")
    assert not (root / "chunks").exists()  # no LMDB environment
    with castore.open(root) as again:
        assert isinstance(again.backend, BlobPackBackend)
        assert again.load("r")["w"].tobytes() == np.arange(3000.0).tobytes()
    assert sorted(p.name for p in root.iterdir()) == [
        MARKER,
        "index",
        "locks",
        "logs",
        "objects",
        "packs",
        "refs",
    ]


def marker(**changes: Any) -> bytes:
    config = {
        "format": "castore-store",
        "format_version": 3,
        "backend": "blobs",
        "chunk_size": CHUNK,
        "store_id": "0123456789abcdef",
    }
    config.update(changes)
    return json.dumps(config).encode()


@pytest.mark.parametrize(
    ("blob", "error", "words"),
    [
        (marker(format_version=5), FormatVersionError, "format version 5"),
        (marker(format_version=4), FormatVersionError, "codec None"),
        (marker(format_version=4, codec="lz9"), FormatVersionError, "codec 'lz9'"),
        (b"{not json", NotAStoreError, "unreadable"),
        (marker(format="other"), NotAStoreError, "not a castore store marker"),
        (marker(store_id="../escape"), NotAStoreError, "store_id"),
        (marker(store_id="caf\u00e9"), NotAStoreError, "store_id"),
        (marker(chunk_size=0), NotAStoreError, "chunk_size"),
    ],
)
def test_a_bad_marker_is_refused_in_one_line(
    tmp_path: Path, blob: bytes, error: type[Exception], words: str
) -> None:
    blobs = MemoryBlobStore()
    blobs.create(MARKER, blob)
    with pytest.raises(error, match=words) as caught:
        memory_store(blobs, tmp_path)
    assert "\n" not in str(caught.value)
    assert list(blobs.list()) == [MARKER]


def test_a_format_4_marker_in_a_shared_directory_asks_for_an_upgrade(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    (root / MARKER).write_bytes(marker(format_version=4))
    with pytest.raises(FormatVersionError, match="upgrade castore"):
        castore.open(root)
    assert os.listdir(root) == [MARKER]


def test_objects_without_a_marker_are_not_a_store_and_nothing_is_not_one_either(
    tmp_path: Path,
) -> None:
    blobs = MemoryBlobStore()
    with pytest.raises(StoreNotFoundError, match="no castore store"):
        memory_store(blobs, tmp_path, create=False)
    assert list(blobs.list()) == []
    blobs.create("objects/ab/somebody-elses", b"x")
    with pytest.raises(NotAStoreError, match="no castore.json"):
        memory_store(blobs, tmp_path)
    assert list(blobs.list()) == ["objects/ab/somebody-elses"]


def test_an_index_blob_over_the_bound_is_damage_and_is_never_fetched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs = MemoryBlobStore()
    with memory_store(blobs, tmp_path / "node-a") as store:
        store.save({"w": np.arange(2048, dtype=np.float32)}, run="r", step=1)
    index = listed(blobs, INDEX_PREFIX)[0]
    monkeypatch.setattr(blobpacks, "MAX_INDEX_BLOB", (blobs.head(index) or 0) - 1)
    fetched: list[str] = []
    get = blobs.get
    monkeypatch.setattr(blobs, "get", lambda name, *a: fetched.append(name) or get(name, *a))
    reader = fresh(blobs)
    try:
        reader.refresh()
        assert "over the" in reader.damaged[index]
        assert index not in fetched
        assert not reader.check_index().ok
    finally:
        reader.close()
