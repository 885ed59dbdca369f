"""Format 3's chunks and objects: packs, index blobs and objects laid out on a BlobStore.

The layout of packs, index blobs and objects, and the index blob's bytes, are
:mod:`castore.chunkstore.bloblayout` (docs/FORMAT_BLOBS.md).

Nothing here is ever overwritten. A writer creates its pack, then the pack's
index blob: a crash in between leaves a pack no index names, garbage that a
collection deletes. A collection deletes index blobs before their pack.

The chunk index lives in memory, built from the index blobs (fetched with
one listing and a get per index blob not seen before). A per-node cache
(:class:`castore.chunkstore.blobcache.IndexCache`) keeps index blobs across
processes so a new process fetches only those written since. Correctness
never depends on the cache: an index blob is used only while the listing
shows it, and the bytes are checked against the name's blake3.

Reads fetch byte ranges of packs, a window ahead of the reader
(:mod:`castore.chunkstore.blobreader`); chunk bytes are verified by the caller.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from castore.blob.base import BlobStore
from castore.chunkstore.base import (
    ChunkBackend,
    IndexCheck,
    Namespace,
    PutResult,
    ReadSink,
    ReclaimStats,
)
from castore.chunkstore.blobcache import IndexCache
from castore.chunkstore.bloblayout import (
    INDEX_PREFIX,
    OBJECT_PREFIX,
    PACK_PREFIX,
    PACK_SUFFIX,
    BlobLocation,
    IndexBlob,
    encode_index,
    index_blob_name,
    is_index_name,
    is_object_name,
    object_blob,
    pack_blob,
    pack_name,
    pack_of,
    parse_index,
)
from castore.chunkstore.blobreader import FetchCounters, WindowedReader
from castore.chunkstore.packfile import PACK_HEADER, PACK_MAGIC, PACK_VERSION, RECORD_HEADER
from castore.errors import (
    BlobExistsError,
    BlobNotFoundError,
    IndexCorruptError,
    StoreError,
)
from castore.format.hashing import Buffer
from castore.support.faults import fault_point

DEFAULT_PACK_BYTES = 128 << 20  # a pack is cut when its chunks reach this many bytes
DEFAULT_THREADS = 8  # requests in flight
MAX_INDEX_BLOB = 256 << 20  # 5.5 million entries: far past any pack's


class BlobPackBackend(ChunkBackend):
    """Chunks in packs and objects as blobs of ``blobs`` (format 3); see the module text."""

    remote_reads = True  # S3 or a shared directory: every read is a request

    def __init__(
        self,
        blobs: BlobStore,
        *,
        cache: IndexCache | None = None,
        pack_bytes: int = DEFAULT_PACK_BYTES,
        threads: int = DEFAULT_THREADS,
    ) -> None:
        if pack_bytes <= 0:
            raise ValueError(f"pack_bytes must be positive, got {pack_bytes}")
        self.blobs = blobs
        self.cache = cache
        self.pack_bytes = pack_bytes
        self.fetches = FetchCounters()
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="castore-blob")
        self._lock = threading.RLock()
        self._indexes: dict[str, IndexBlob] = {}  # by index blob name, as last listed
        # Index blobs listed but unreadable (garbled, cut short), with what is wrong:
        # their chunks count as absent (a save writes them again), and their pack is
        # never taken for an orphan (a collection must not delete what it cannot read).
        self.damaged: dict[str, str] = {}
        self._where: dict[bytes, BlobLocation] = {}
        self._present: dict[str, list[tuple[bytes, int, int]]] = {}  # by pack
        self._closed = False
        self._cache_pruned = False
        # Called before each write that changes what is present (an index blob
        # created, any blob deleted): the store's lease check (castore.repo.leases),
        # so a save or a collection that lost its lease stops before it acts.
        self.check_lease: Callable[[], None] = lambda: None
        self._packs: set[str] = set()  # the packs the last listing showed

    def __repr__(self) -> str:
        return f"<BlobPackBackend on {self.blobs}>"

    # -- the chunk index ------------------------------------------------------

    def refresh(self) -> None:
        """List the index blobs; fetch those not seen before; drop those gone."""
        self._check_open()
        with self._lock:
            sizes = dict(self.blobs.list_sizes(INDEX_PREFIX))
            listed = [name for name in sizes if is_index_name(name)]
            # Listed after the index blobs: an index blob counts only while its pack
            # is there too (a pack goes after its index blobs, so a pack missing here
            # means damage, or a writer that lost its lease; its chunks are absent).
            packs = {
                name[len(PACK_PREFIX) : -len(PACK_SUFFIX)]
                for name in self.blobs.list(PACK_PREFIX)
                if name.endswith(PACK_SUFFIX)
            }
            packs_changed = packs != self._packs
            self._packs = packs
            known = set(self._indexes) | set(self.damaged)
            new = [name for name in listed if name not in known]
            gone = known - set(listed)
            if self.cache is not None:
                # The first listing also forgets what other processes cached and the
                # store has deleted since; later ones, what this handle saw go.
                stale = gone if self._cache_pruned else set(self.cache.names()) - set(listed)
                self._cache_pruned = True
                self.cache.discard(sorted(stale))
            if not new and not gone and not packs_changed:
                return
            for name in gone:
                self._indexes.pop(name, None)
                self.damaged.pop(name, None)
            # A hostile store's index blob is not fetched whatever its size: one over
            # the bound is damage (a 128 MiB pack of 1 KiB chunks lists 6 MiB).
            too_big = [name for name in new if sizes[name] > MAX_INDEX_BLOB]
            for name in too_big:
                self.damaged[name] = (
                    f"index blob {name!r} is {sizes[name]} bytes, over the "
                    f"{MAX_INDEX_BLOB} an index blob may have"
                )
            new = [name for name in new if sizes[name] <= MAX_INDEX_BLOB]
            for name, parsed in zip(new, self.pool.map(self._load_index, new), strict=True):
                if isinstance(parsed, IndexBlob):
                    self._indexes[name] = parsed
                elif parsed is not None:
                    self.damaged[name] = parsed
            self._rebuild()

    def _load_index(self, name: str) -> IndexBlob | str | None:
        """The parsed index blob; what is wrong with it (str); None when it is gone."""
        data = self.cache.get(name) if self.cache is not None else None
        if data is not None:
            try:
                return parse_index(name, data)
            except IndexCorruptError:
                data = None  # a damaged cache entry: fetch the blob
        try:
            data = self.blobs.get(name)
        except BlobNotFoundError:
            return None  # deleted since the listing
        try:
            parsed = parse_index(name, data)
        except IndexCorruptError as exc:
            return str(exc)
        if self.cache is not None:
            self.cache.put(name, data)
        return parsed

    def _rebuild(self) -> None:
        """The chunk map: a chunk is present where every index blob of its pack lists it."""
        by_pack: dict[str, list[IndexBlob]] = defaultdict(list)
        for parsed in self._indexes.values():
            if parsed.pack in self._packs:
                by_pack[parsed.pack].append(parsed)
        where: dict[bytes, BlobLocation] = {}
        present: dict[str, list[tuple[bytes, int, int]]] = {}
        for pack in sorted(by_pack):
            blobs = by_pack[pack]
            listed = {(d, o, n) for d, o, n in min(blobs, key=lambda b: len(b.entries)).entries}
            for other in blobs:
                listed.intersection_update(other.entries)
            present[pack] = sorted(listed, key=lambda e: e[1])
            for digest, offset, length in present[pack]:
                where.setdefault(digest, BlobLocation(pack, offset, length))
        self._where = where
        self._present = present

    def _live(self) -> dict[str, list[tuple[bytes, int, int]]]:
        """Each pack's present chunks (digest, offset, length), by pack.

        A chunk may be present in two packs (two writers that raced to store
        it): each pack lists its own copy.
        """
        return defaultdict(list, {pack: list(entries) for pack, entries in self._present.items()})

    def _pack_sizes(self) -> dict[str, int]:
        return {parsed.pack: parsed.pack_size for parsed in self._indexes.values()}

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self!r} is closed")

    # -- the contract ---------------------------------------------------------

    def has_many(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bool]:
        if Namespace(namespace) is Namespace.OBJECTS:
            self._check_open()
            names = [object_blob(k) for k in keys]
            return [size is not None for size in self.pool.map(self.blobs.head, names)]
        self.refresh()
        return [bytes(k) in self._where for k in keys]

    def known_chunks(self, keys: Sequence[bytes]) -> list[bool]:
        """As the index last listed says, with no listing (``has_many`` lists every time)."""
        self._check_open()
        with self._lock:
            where = self._where
        return [bytes(k) in where for k in keys]

    def read_many(self, namespace: Namespace, keys: Sequence[bytes], sink: ReadSink) -> None:
        self._check_open()
        if Namespace(namespace) is Namespace.OBJECTS:
            sink(self._objects(keys))
            return
        keys = [bytes(k) for k in keys]
        if any(k not in self._where for k in keys):
            self.refresh()
        values = WindowedReader(self, self.locate(keys), keys=keys)
        try:
            sink(values)
        finally:
            values.close()

    def locate(self, keys: Sequence[bytes]) -> list[BlobLocation | None]:
        """Where each chunk lies, as the index last read says (None: not known)."""
        with self._lock:
            where = self._where
        return [where.get(k) for k in keys]

    def truncated_chunks(self, keys: Sequence[bytes]) -> dict[bytes, str]:
        """:meth:`ChunkBackend.truncated_chunks`: each chunk's place in its index blob against
        the size of its pack (one head request per pack)."""
        self._check_open()
        located = [(bytes(k), where) for k, where in zip(keys, self.locate(keys), strict=True)]
        sizes: dict[str, int | None] = {}
        cut = {}
        for key, where in located:
            if where is None:
                continue
            if where.pack not in sizes:
                sizes[where.pack] = self.blobs.head(pack_blob(where.pack))
            size = sizes[where.pack]
            if size is None:
                cut[key] = f"missing: its pack {pack_blob(where.pack)} is gone"
            elif where.offset + where.length > size:
                cut[key] = (
                    f"truncated: its pack {pack_blob(where.pack)} is {size} bytes, and the "
                    f"chunk ends at byte {where.offset + where.length}"
                )
        return cut

    def _objects(self, keys: Sequence[bytes]) -> Iterator[memoryview | None]:
        def fetch(key: bytes) -> bytes | None:
            try:
                return self.blobs.get(object_blob(key))
            except BlobNotFoundError:
                return None

        for value in self.pool.map(fetch, keys):
            yield None if value is None else memoryview(value)

    def put_many(self, namespace: Namespace, items: Iterable[tuple[bytes, Buffer]]) -> PutResult:
        if Namespace(namespace) is Namespace.OBJECTS:
            self._check_open()
            return self._put_objects(list(items))
        self.refresh()
        present = written = written_bytes = 0
        pending: list[tuple[bytes, memoryview]] = []
        pending_bytes = 0
        taken: set[bytes] = set()
        for key, value in items:
            key = bytes(key)
            if key in taken or key in self._where:
                present += 1
                continue
            taken.add(key)
            view = memoryview(value).cast("B")
            pending.append((key, view))
            pending_bytes += view.nbytes
            if pending_bytes >= self.pack_bytes:
                count, nbytes = self._write_pack(pending)
                written, written_bytes = written + count, written_bytes + nbytes
                pending, pending_bytes = [], 0
        if pending:
            count, nbytes = self._write_pack(pending)
            written, written_bytes = written + count, written_bytes + nbytes
        return PutResult(written, written_bytes, present + len(taken) - written)

    def _put_objects(self, items: list[tuple[bytes, Buffer]]) -> PutResult:
        def create(item: tuple[bytes, Buffer]) -> int:
            key, value = item
            try:
                self.blobs.create(object_blob(bytes(key)), value)
            except BlobExistsError:
                return 0  # content-named: what is there is the same object
            return memoryview(value).nbytes

        sizes = list(self.pool.map(create, items))
        written = sum(1 for size in sizes if size)
        return PutResult(written, sum(sizes), len(items) - written)

    def _write_pack(self, chunks: list[tuple[bytes, memoryview]]) -> tuple[int, int]:
        """Create one pack of ``chunks`` and then its index blob; return (chunks, bytes)."""
        records = [(key, view.nbytes) for key, view in chunks]
        pack = pack_name(records)
        entries: list[tuple[bytes, int, int]] = []
        position = PACK_HEADER.size
        for key, length in records:
            position += RECORD_HEADER.size
            entries.append((key, position, length))
            position += length
        size = position

        def body() -> Iterator[Buffer]:
            yield PACK_HEADER.pack(PACK_MAGIC, PACK_VERSION, 0)
            for key, view in chunks:
                yield RECORD_HEADER.pack(key, view.nbytes)
                yield view

        try:
            self.blobs.create(pack_blob(pack), body())
        except BlobExistsError:
            # Same name, same records: another writer made this very pack. A
            # squatter of another size is not it.
            if self.blobs.head(pack_blob(pack)) != size:
                raise StoreError(
                    f"pack {pack_blob(pack)!r} exists with another size than its name fixes "
                    f"({size} bytes): the store is damaged; run castore verify"
                ) from None
        fault_point("save.pack_unindexed")  # durable bytes that nothing names yet
        # A writer whose lease was broken meanwhile may have had this pack deleted
        # as an orphan: it must not name it now.
        self.check_lease()
        self._create_index(pack, size, entries)
        return len(entries), sum(length for _, _, length in entries)

    def _create_index(self, pack: str, size: int, entries: Sequence[tuple[bytes, int, int]]) -> str:
        data = encode_index(size, entries)
        name = index_blob_name(pack, data)
        try:
            self.blobs.create(name, data)
        except BlobExistsError:
            pass  # content-named: the same index
        if self.cache is not None:
            self.cache.put(name, data)
        with self._lock:
            self._indexes[name] = IndexBlob(name, pack, size, tuple(entries))
            self._packs.add(pack)  # written just before its index blob
            self._rebuild()
        return name

    def delete_many(self, namespace: Namespace, keys: Iterable[bytes]) -> int:
        if Namespace(namespace) is Namespace.OBJECTS:
            self._check_open()
            names = [object_blob(bytes(k)) for k in keys]
            self.check_lease()
            return sum(self.pool.map(self.blobs.delete, names))
        self.refresh()
        with self._lock:
            dead = {bytes(key) for key in keys if bytes(key) in self._where}
            live = self._live()
            sizes = self._pack_sizes()
            for pack, entries in live.items():
                keep = [entry for entry in entries if entry[0] not in dead]
                if len(keep) < len(entries):  # every copy goes, in whichever pack it lies
                    self._reindex(pack, sizes[pack], keep)
            return len(dead)

    def _reindex(self, pack: str, size: int, keep: list[tuple[bytes, int, int]]) -> None:
        """Let ``pack`` list only ``keep``: a smaller index blob first, then the old ones go.

        With nothing to keep, the index blobs go and then the pack.
        """
        self.check_lease()  # the smaller index blob already hides the dropped chunks
        old = [name for name, parsed in self._indexes.items() if parsed.pack == pack]
        if keep:
            new = self._create_index(pack, size, sorted(keep, key=lambda e: e[1]))
            old = [name for name in old if name != new]
        for name in old:
            self.check_lease()
            self.blobs.delete(name)
            self._indexes.pop(name, None)
        if self.cache is not None:
            self.cache.discard(old)
        if not keep:
            self.check_lease()
            self.blobs.delete(pack_blob(pack))
        self._rebuild()

    def iter_keys(self, namespace: Namespace) -> Iterator[bytes]:
        if Namespace(namespace) is Namespace.OBJECTS:
            self._check_open()
            yield from [bytes.fromhex(n.rsplit("/", 1)[1]) for n in self._object_names()]
            return
        self.refresh()
        yield from list(self._where)

    def value_sizes(self, namespace: Namespace) -> Iterator[tuple[bytes, int]]:
        if Namespace(namespace) is Namespace.OBJECTS:
            self._check_open()
            found = [
                (bytes.fromhex(name.rsplit("/", 1)[1]), size)
                for name, size in self.blobs.list_sizes(OBJECT_PREFIX)
                if is_object_name(name)
            ]
            yield from found
            return
        self.refresh()
        yield from [(k, where.length) for k, where in self._where.items()]

    def _object_names(self) -> list[str]:
        return [name for name in self.blobs.list(OBJECT_PREFIX) if is_object_name(name)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pool.shutdown(wait=True)
        if self.cache is not None:
            self.cache.close()

    # -- space ----------------------------------------------------------------

    def file_bytes(self) -> int:
        """Bytes of every pack, index blob and object (one listing plus a head each)."""
        return sum(
            size
            for prefix in (PACK_PREFIX, INDEX_PREFIX, OBJECT_PREFIX)
            for _, size in self.blobs.list_sizes(prefix)
        )

    def orphan_packs(self) -> list[str]:
        """Packs no index blob names: what a save cut short between its pack and its index left."""
        self.refresh()
        indexed = {parsed.pack for parsed in self._indexes.values()}
        indexed.update(pack_of(name) for name in self.damaged)
        orphans = []
        for name in self.blobs.list(PACK_PREFIX):
            stem = name[len(PACK_PREFIX) : -len(PACK_SUFFIX)] if name.endswith(PACK_SUFFIX) else ""
            if len(stem) == 64 and stem not in indexed:
                orphans.append(stem)
        return orphans

    def reclaim(self, *, min_live: float = 0.5, merge_below: int = 0) -> ReclaimStats:
        """Delete orphan packs; copy the live chunks of sparse or small packs into new ones.

        Runs under the store's exclusive lock (garbage collection): no save is
        writing a pack that has no index blob yet.
        """
        freed = deleted = rewritten = merged = moved = 0
        for pack in self.orphan_packs():
            size = self.blobs.head(pack_blob(pack)) or 0
            self.check_lease()
            if self.blobs.delete(pack_blob(pack)):
                freed += size
                deleted += 1
        with self._lock:
            live = self._live()
            sizes = self._pack_sizes()
            sparse, small = [], []
            for pack, size in sorted(sizes.items()):
                live_bytes = sum(length for _, _, length in live.get(pack, ()))
                if size < merge_below:
                    small.append(pack)
                elif live_bytes < min_live * size:
                    sparse.append(pack)
            if len(small) < 2:
                small = []  # one small pack has nothing to merge with
            for group, is_merge in ((sparse, False), (small, True)):
                if not group:
                    continue
                entries, copied_once = [], set()  # a chunk present in two packs: one copy
                for pack in group:
                    for entry in live.get(pack, ()):
                        if entry[0] not in copied_once:
                            copied_once.add(entry[0])
                            entries.append((pack, entry))
                copied, written = self._copy_chunks(entries)
                moved += copied
                fault_point("gc.reclaim_rewritten")
                for pack in group:
                    if pack in written:
                        continue  # the copy is this very pack (the name is the content): keep it
                    self._reindex(pack, sizes[pack], [])
                    freed += sizes[pack]
                    rewritten += 1
                    merged += is_merge
        return ReclaimStats(
            packs_deleted=deleted,
            packs_rewritten=rewritten,
            packs_merged=merged,
            chunks_moved=moved,
            bytes_freed=freed,
        )

    def _copy_chunks(
        self, entries: list[tuple[str, tuple[bytes, int, int]]]
    ) -> tuple[int, set[str]]:
        """Write the chunks of ``entries`` into new packs (in batches of one pack's worth).

        Returns how many chunks were copied and the packs written, which may
        include one of the packs copied from: the same records make the same pack.
        """
        batch: list[tuple[str, tuple[bytes, int, int]]] = []
        written: set[str] = set()
        batch_bytes = moved = 0
        for item in [*entries, None]:
            if item is not None:
                batch.append(item)
                batch_bytes += item[1][2]
            if batch and (item is None or batch_bytes >= self.pack_bytes):
                locations = [BlobLocation(pack, off, n) for pack, (_, off, n) in batch]
                reader = WindowedReader(self, locations)
                try:
                    chunks = [
                        (digest, memoryview(bytes(value)))
                        for (_, (digest, _, _)), value in zip(batch, reader, strict=True)
                        if value is not None
                    ]
                finally:
                    reader.close()
                if chunks:
                    self._write_pack(chunks)
                    written.add(pack_name([(key, view.nbytes) for key, view in chunks]))
                moved += len(chunks)
                batch, batch_bytes = [], 0
        return moved, written

    # -- checks ---------------------------------------------------------------

    def check_index(self, *, hash_bytes: bool = False) -> IndexCheck:
        """Every index blob hashes to its name and its pack is there at the size it says.

        One listing of the index blobs (each read once per process, see
        :meth:`refresh`) and one of the packs, with their sizes.
        ``hash_bytes``: also compare each chunk's record header in its pack
        with the index (a ranged read per chunk).
        """
        self.refresh()
        with self._lock:
            parsed = list(self._indexes.values())
            problems = [
                f"index blob {name!r} is unreadable: {why}" for name, why in self.damaged.items()
            ]
        sizes = {
            name[len(PACK_PREFIX) : -len(PACK_SUFFIX)]: size
            for name, size in self.blobs.list_sizes(PACK_PREFIX)
        }
        for blob in parsed:
            size = sizes.get(blob.pack)
            if size is None:
                problems.append(f"index blob {blob.name!r} names pack {blob.pack}, which is gone")
            elif size != blob.pack_size:
                problems.append(
                    f"pack {blob.pack} is {size} bytes; its index blob {blob.name!r} says "
                    f"{blob.pack_size}"
                )
            elif hash_bytes:
                problems.extend(self._check_records(blob))
        notes = [
            f"pack {pack} has no index blob (garbage of a save cut short; gc deletes it)"
            for pack in self.orphan_packs()
        ]
        entries = sum(len(p.entries) for p in parsed)
        return IndexCheck(
            entries=entries,
            records=entries,
            packs=len({p.pack for p in parsed}),
            problems=tuple(problems),
            notes=tuple(notes),
        )

    def _check_records(self, blob: IndexBlob) -> list[str]:
        """Each listed chunk's record header in the pack names the same digest and length."""
        problems = []
        for digest, offset, length in blob.entries:
            header = self.blobs.get(pack_blob(blob.pack), offset - RECORD_HEADER.size, offset)
            found, found_length = RECORD_HEADER.unpack(header)
            if (found, found_length) != (digest, length):
                problems.append(
                    f"index blob {blob.name!r} lists chunk {digest.hex()[:16]} at offset "
                    f"{offset}, where pack {blob.pack} records {found.hex()[:16]} "
                    f"({found_length} bytes)"
                )
        return problems
