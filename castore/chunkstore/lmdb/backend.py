"""LMDB plus pack files, the embedded default backend.

Chunk bytes live in append-only **pack files** under ``packs/``; LMDB holds
the objects (manifests) and ``chunk_index``, which names where each chunk
lies. Why packs: a chunk written into LMDB is copied into freshly allocated
pages and written out by a commit that holds the environment's one writer
lock, so ranks on a node save one after another. A pack is written straight
from the tensor's buffer by each rank in parallel, like any per-rank file.
Writing a pack is :mod:`castore.chunkstore.lmdb.packwriter` (with the index's
value, a :class:`~castore.chunkstore.lmdb.packwriter.PackLocation`), reading
from packs :mod:`castore.chunkstore.lmdb.packreader`; this module is the
``ChunkBackend`` over both: one idea, about 680 lines because the backend's
contract, its reclaim of pack space and its index checks all work inside the
one environment's transactions and lock, which no other module should reach.

Choices that matter for correctness:

* A pack is complete and ``fdatasync``'d, and its directory entry synced,
  before the index transaction that names its chunks commits. A crash in
  between leaves a pack the index does not name: garbage, reclaimed later.
* ``sync=True``/``metasync=True`` and no ``writemap``: a commit is durable when
  it returns, and a full disk raises instead of killing the process (SIGBUS).
* The map grows when full, by aborting the transaction, enlarging the map
  outside any transaction and retrying; a map grown by another process is
  adopted (``MapResizedError``).
* Reads hand out zero-copy views (LMDB buffers, memory maps of packs) that
  never outlive the call: values are handed to a callback.
* One environment per data file per process, shared and counted by every
  handle on it (:mod:`castore.chunkstore.lmdb.env`): LMDB forbids a second open in one process. It
  is never used across ``fork()``: it records the pid that opened it and
  refuses use from another process.
* Pack space is reclaimed only by :meth:`LmdbBackend.reclaim`, which deletes
  packs the index no longer names, so it must not run while another process
  may be writing a pack it has not indexed yet: garbage collection holds the
  store lock exclusively, ``compact`` holds the open lock exclusively.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb

from castore.chunkstore.base import (
    ChunkBackend,
    ChunkReader,
    IndexCheck,
    Namespace,
    PutResult,
    ReadSink,
    ReclaimStats,
)
from castore.chunkstore.lmdb import env as lmdb_env
from castore.chunkstore.lmdb.file import (
    REPAIR_HINT,
    audit_pages,
    lmdb_guarded,
    read_committed_meta,
)
from castore.chunkstore.lmdb.index_check import LOCATION_SIZE, IndexEntry, cross_check
from castore.chunkstore.lmdb.packreader import PackMaps, PackReader
from castore.chunkstore.lmdb.packwriter import (
    PackLocation,
    PackWriter,
    pack_name,
    unpack_location,
)
from castore.chunkstore.packfile import PACK_DIR, PACK_HEADER, RECORD_HEADER, pack_id, scan_pack
from castore.errors import IndexCorruptError, StoreError, StoreFullError
from castore.format.hashing import Buffer
from castore.support.faults import fault_point
from castore.support.readonly import ReadOnly
from castore.support.safefs import (
    DISK_FULL,
    fsync_dir,
    is_store_dir,
    kind_of,
    make_store_dir,
    regular_file_size,
)

_MAX_GROW_ATTEMPTS = 32
# A chunk reader holds one descriptor per pack it reads. A read that needs more packs,
# or finds the process out of descriptors, maps them instead (a map holds none).
_READER_PACKS = 256
_preadv = getattr(os, "preadv", None)  # Linux, the BSDs, macOS 11+


class LmdbBackend(ChunkBackend):
    """Objects and the chunk index in LMDB; chunk bytes in pack files beside it."""

    reads_in_place = True  # chunk values are views of the mapped packs

    @lmdb_guarded("open the LMDB environment")
    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int | None = None,
        readonly: ReadOnly | None = None,
    ) -> None:
        """``readonly``: open the environment read-only (creating nothing) and refuse
        every write with ReadOnlyStoreError before it touches a file."""
        self.path = Path(path)
        self.pack_dir = self.path / PACK_DIR
        self.readonly = readonly
        existing = _check_environment_files(self.path, create=readonly is None)
        # One environment per data file per process, whatever the handles (see lmdb.env).
        shared = lmdb_env.acquire(
            self.path, map_size=map_size, existing=existing, readonly=readonly is not None
        )
        self._env, self._objects, self._index = shared.env, shared.objects, shared.index
        self._lock, self._pid = shared.lock, shared.pid
        self._closed = False
        # A handle dropped without close() gives its share back too (a notebook cell
        # run again rebinds its store); the finalizer runs at most once.
        self._release = weakref.finalize(self, lmdb_env.release, shared)
        self._release.atexit = False

    # -- plumbing ---------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise StoreError(
                "this store handle is closed: open the store again (castore.open)",
                path=str(self.path),
            )
        if os.getpid() != self._pid:
            raise StoreError(
                "an LMDB environment cannot be used across fork(); open the store again "
                "in the child process",
                path=str(self.path),
            )

    def _begin(self, *, write: bool, buffers: bool = False) -> Any:
        self._check_usable()
        env: Any = self._env  # lmdb's stubs type `buffers` as a Literal overload
        try:
            return env.begin(write=write, buffers=buffers)
        except lmdb.MapResizedError:
            # Another process grew the map: adopt its size, then retry once.
            env.set_mapsize(0)
            return env.begin(write=write, buffers=buffers)

    def _grow(self) -> None:
        new_size = self._env.info()["map_size"] * 2
        self._env.set_mapsize(new_size)

    def _refuse_if_readonly(self, what: str) -> None:
        if self.readonly is not None:
            raise self.readonly.refuse(what)

    def _write_txn(self, work: Any) -> Any:
        """Run ``work(txn)`` in a write transaction and commit, growing the map if full."""
        self._refuse_if_readonly("an LMDB write")
        with self._lock:
            for _ in range(_MAX_GROW_ATTEMPTS):
                txn = self._begin(write=True)
                try:
                    result = work(txn)
                    txn.commit()
                    return result
                except lmdb.MapFullError:
                    txn.abort()
                    self._grow()
                except BaseException:
                    txn.abort()
                    raise
        raise StoreFullError(
            f"the LMDB map could not grow enough for one batch ({self.map_size} bytes after "
            f"{_MAX_GROW_ATTEMPTS} doublings)",
            phase="index",
            path=str(self.path),
        )

    @property
    @lmdb_guarded("read the map size")
    def map_size(self) -> int:
        return int(self._env.info()["map_size"])

    def _db(self, namespace: Namespace) -> Any:
        """The database that holds a namespace's keys (chunks: the index)."""
        return self._index if Namespace(namespace) is Namespace.CHUNKS else self._objects

    # -- contract ---------------------------------------------------------

    @lmdb_guarded("look up keys")
    def has_many(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bool]:
        db = self._db(namespace)
        with self._lock:
            txn = self._begin(write=False, buffers=True)
            try:
                cursor = txn.cursor(db=db)
                return [cursor.set_key(bytes(k)) for k in keys]
            finally:
                txn.abort()

    @lmdb_guarded("read values")
    def read_many(self, namespace: Namespace, keys: Sequence[bytes], sink: ReadSink) -> None:
        if Namespace(namespace) is Namespace.CHUNKS:
            self._read_chunks(keys, sink)
            return
        with self._lock:
            txn = self._begin(write=False, buffers=True)
            try:
                limit = (self.path / "data.mdb").stat().st_size
                sink(self._object_value(txn, bytes(key), limit) for key in keys)
            finally:
                txn.abort()

    def _object_value(self, txn: Any, key: bytes, limit: int) -> memoryview | None:
        """An object's value; one longer than the whole file is a damaged node (reading it
        would run off the map: SIGSEGV)."""
        value: memoryview | None = txn.get(key, db=self._objects)
        if value is not None and len(value) > limit:
            raise IndexCorruptError(
                f"object {key.hex()[:16]} claims {len(value)} bytes, more than the whole LMDB "
                f"file ({limit}): the file is damaged; {REPAIR_HINT}",
                path=str(self.path),
            )
        return value

    def _read_chunks(self, keys: Sequence[bytes], sink: ReadSink) -> None:
        maps = PackMaps(self.pack_dir)
        with self._lock:
            txn = self._begin(write=False, buffers=True)
            try:

                def values() -> Iterator[memoryview | None]:
                    get, index = txn.get, self._index
                    for key in keys:
                        found = get(bytes(key), db=index)
                        if found is None:
                            yield None
                            continue
                        length, pack, offset = unpack_location(found)
                        view = maps.get(pack)
                        if view is None:
                            # Moved by a reclaim since this snapshot began? Look again.
                            moved = self.locate(key)
                            if moved is not None and moved.pack != pack:
                                length, pack, offset = moved.length, moved.pack, moved.offset
                                view = maps.get(pack)
                        yield None if view is None else view[offset : offset + length]

                sink(values())
            finally:
                txn.abort()
                maps.close()

    @lmdb_guarded("look up chunks")
    def chunk_reader(self, keys: Sequence[bytes]) -> ChunkReader | None:
        """Chunks read with ``pread`` from their packs: each pack opened once, no map.

        The index is read in one snapshot; a pack is opened (never through a
        symlink, never a pipe) while the snapshot is held, and a descriptor keeps
        its bytes readable even if a reclaim deletes it afterwards.
        """
        if _preadv is None:
            return None
        with self._lock:
            txn = self._begin(write=False, buffers=True)
            try:
                get, index = txn.get, self._index
                found = [get(key, db=index) for key in keys]
                locations = [None if v is None else unpack_location(v) for v in found]
                if len({where[1] for where in locations if where is not None}) > _READER_PACKS:
                    return None
                try:
                    return PackReader.open(self, keys, locations)
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE):
                        return None  # every descriptor it took is closed again
                    raise
            finally:
                txn.abort()

    @lmdb_guarded("write values")
    def put_many(self, namespace: Namespace, items: Iterable[tuple[bytes, Buffer]]) -> PutResult:
        self._refuse_if_readonly(f"writing {Namespace(namespace).value}")  # before any pack
        if Namespace(namespace) is Namespace.CHUNKS:
            return self._put_chunks(items)
        batch = list(items)

        def work(txn: Any) -> PutResult:
            written = written_bytes = present = 0
            for key, value in batch:
                if txn.put(bytes(key), value, db=self._objects, overwrite=False):
                    written += 1
                    written_bytes += memoryview(value).nbytes
                else:
                    present += 1
            return PutResult(written, written_bytes, present)

        result: PutResult = self._write_txn(work)
        return result

    def _put_chunks(self, items: Iterable[tuple[bytes, Buffer]]) -> PutResult:
        """Append the absent chunks to a new pack, sync it, then index them in one commit.

        ``items`` may be lazy (a hashing pipeline): each chunk is queued for the
        pack as it comes, and written with the ones before it once they add up
        (see PackWriter); a value's buffer must stay unchanged until this returns.
        """
        with self._lock:
            present = 0
            located: dict[bytes, bytes] = {}  # each new chunk's chunk_index value
            writer: PackWriter | None = None
            # One read transaction answers the presence of every chunk of the batch.
            snapshot = self._begin(write=False, buffers=True)
            try:
                index = snapshot.cursor(db=self._index)
                for key, value in items:
                    key = bytes(key)
                    if key in located or index.set_key(key):
                        present += 1
                        continue
                    if writer is None:
                        writer = PackWriter.create(self.pack_dir)
                    located[key] = writer.append(key, value)
                if writer is not None:
                    writer.finish()
            except OSError as exc:
                if writer is not None:
                    writer.discard()
                error = StoreFullError if exc.errno in DISK_FULL else StoreError
                raise error(
                    f"cannot write a chunk pack: {exc.strerror or exc}",
                    phase="writing a chunk pack",
                    path=str(self.pack_dir),
                ) from exc
            except BaseException:
                if writer is not None:
                    writer.discard()
                raise
            finally:
                snapshot.abort()
            if writer is None:
                return PutResult(0, 0, present)
            fault_point("save.pack_unindexed")  # durable bytes that nothing names yet
            chunk_bytes = writer.chunk_bytes

            def work(txn: Any) -> PutResult:
                return self._index_new(txn, located, chunk_bytes, present)

            result: PutResult = self._write_txn(work)
            return result

    def _index_new(
        self, txn: Any, located: dict[bytes, bytes], chunk_bytes: int, present: int
    ) -> PutResult:
        """Index the chunks of a new pack (``chunk_bytes`` in all), keeping entries that exist."""
        cursor = txn.cursor(db=self._index)
        _, added = cursor.putmulti(located.items(), overwrite=False)
        if added == len(located):
            return PutResult(added, chunk_bytes, present)
        # Another process indexed some of these chunks first: its copies stay
        # named, ours are garbage. Ours are the entries that hold our values.
        ours = [value for key, value in located.items() if txn.get(key, db=self._index) == value]
        nbytes = sum(unpack_location(value)[0] for value in ours)
        return PutResult(len(ours), nbytes, present + len(located) - len(ours))

    @lmdb_guarded("delete keys")
    def delete_many(self, namespace: Namespace, keys: Iterable[bytes]) -> int:
        db = self._db(namespace)

        def work(txn: Any) -> int:
            return sum(bool(txn.delete(bytes(key), db=db)) for key in keys)

        deleted: int = self._write_txn(work)
        return deleted

    def iter_keys(self, namespace: Namespace) -> Iterator[bytes]:
        for key, _size in self.value_sizes(namespace):
            yield key

    def value_sizes(self, namespace: Namespace) -> Iterator[tuple[bytes, int]]:
        yield from self._value_sizes(namespace)

    @lmdb_guarded("list keys")
    def _value_sizes(self, namespace: Namespace) -> list[tuple[bytes, int]]:
        chunks = Namespace(namespace) is Namespace.CHUNKS
        with self._lock:
            txn = self._begin(write=False, buffers=True)
            try:
                return [
                    (bytes(k), PackLocation.decode(v).length if chunks else len(v))
                    for k, v in txn.cursor(db=self._db(namespace))
                ]
            finally:
                txn.abort()

    def close(self) -> None:
        """Give this handle's share of the environment back; closing twice is harmless."""
        self._closed = True
        self._release()

    # -- packs ------------------------------------------------------------

    @lmdb_guarded("look up a chunk")
    def locate(self, key: bytes) -> PackLocation | None:
        """Where the index says a chunk lies (None when it is not indexed)."""
        with self._lock:
            txn = self._begin(write=False)
            try:
                found = txn.get(bytes(key), db=self._index)
            finally:
                txn.abort()
        return None if found is None else PackLocation.decode(found)

    def pack_path(self, pack: int) -> Path:
        return self.pack_dir / pack_name(pack)

    def pack_files(self) -> dict[int, int]:
        """Every pack file: id -> size in bytes (temp files and strangers excluded)."""
        sizes = {}
        for entry in os.scandir(self.pack_dir):
            pack = pack_id(entry.name)
            if pack is None:
                continue
            try:
                found = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            # A symlink or pipe named like a pack is not one of ours: never followed,
            # never counted, never deleted (a reader that needs it refuses it).
            if stat.S_ISREG(found.st_mode):
                sizes[pack] = found.st_size
        return sizes

    def file_bytes(self) -> int:
        data_file = self.path / "data.mdb"
        size = data_file.stat().st_size if data_file.exists() else 0
        return size + sum(self.pack_files().values())

    @lmdb_guarded("reclaim pack space")
    def reclaim(self, *, min_live: float = 0.5, merge_below: int = 0) -> ReclaimStats:
        """Delete packs the index no longer names; rewrite those less than ``min_live`` live.

        A rewrite copies the live chunks into a new synced pack, re-points
        their index entries in one commit, then deletes the old packs. Packs
        smaller than ``merge_below`` bytes are rewritten too, when there are two
        or more of them: each save writes its own pack, so a run of small saves
        would otherwise leave one file per save. A pack whose indexed chunks
        run past its end (damaged) is left alone. The caller guarantees no
        other process is writing packs (see module doc).
        """
        self._refuse_if_readonly("reclaiming pack space")
        with self._lock:
            self._check_usable()
            live: dict[int, list[tuple[bytes, PackLocation]]] = defaultdict(list)
            for key, found in self._index_entries():
                where = PackLocation.decode(found)
                live[where.pack].append((key, where))
            files = self.pack_files()
            dead = [pack for pack in files if pack not in live]
            sparse, small = [], []
            for pack, size in sorted(files.items()):
                entries = live.get(pack)
                if not entries:
                    continue
                live_bytes = sum(w.length + RECORD_HEADER.size for _, w in entries)
                if not all(w.offset + w.length <= size for _, w in entries):
                    continue  # damaged: left for verify and repair to name
                if live_bytes < min_live * (size - PACK_HEADER.size):
                    sparse.append(pack)
                elif size < merge_below:
                    small.append(pack)
            merged = small if len(small) > 1 else []
            rewrite = sparse + merged
            moved = 0
            if rewrite:
                moved = self._rewrite(rewrite, live)
                fault_point("gc.reclaim_rewritten")  # the old packs are unnamed, not yet deleted
            self._refuse_named(dead + rewrite)
            for pack in dead + rewrite:
                self.pack_path(pack).unlink(missing_ok=True)
            if dead or rewrite:
                fsync_dir(self.pack_dir)
            after = sum(self.pack_files().values())
            return ReclaimStats(
                packs_deleted=len(dead),
                packs_rewritten=len(rewrite),
                packs_merged=len(merged),
                chunks_moved=moved,
                bytes_freed=sum(files.values()) - after,  # net: rewritten copies count against
            )

    def _refuse_named(self, packs: list[int]) -> None:
        """Raise, deleting nothing, if a lookup still places a chunk in one of ``packs``.

        ``packs`` were chosen by iterating the index; a damaged B-tree can hide
        entries from iteration that lookups (loads) still follow.
        """
        txn = self._begin(write=False)
        try:
            for pack in packs:
                try:
                    records = scan_pack(self.pack_path(pack), pack).records
                except FileNotFoundError:
                    continue
                for record in records:
                    value = txn.get(record.digest, db=self._index)
                    if value is not None and PackLocation.decode(value).pack == pack:
                        raise IndexCorruptError(
                            f"reclaim refused, no pack deleted: chunk {record.digest.hex()[:16]} "
                            f"is indexed in pack {pack:016x}, but iterating the index does not "
                            f"list it: the index is damaged; {REPAIR_HINT}",
                            path=str(self.path),
                        )
        finally:
            txn.abort()

    @lmdb_guarded("look up chunks")
    def truncated_chunks(self, keys: Sequence[bytes]) -> dict[bytes, str]:
        """:meth:`ChunkBackend.truncated_chunks`: each key's index entry against one stat
        of its pack (a pack cut short by a full disk or a bad copy still has its entries)."""
        with self._lock:
            txn = self._begin(write=False)
            try:
                found = [(bytes(k), txn.get(bytes(k), db=self._index)) for k in keys]
            finally:
                txn.abort()
        sizes: dict[int, int | str | None] = {}
        cut = {}
        for key, value in found:
            if value is None:
                continue  # not indexed: missing, which has_many says
            length, pack, offset = unpack_location(value)
            if pack not in sizes:
                sizes[pack] = self._pack_size(pack)
            size = sizes[pack]
            if size is None:
                cut[key] = f"missing: its pack {pack_name(pack)} is gone"
            elif isinstance(size, str):
                cut[key] = (
                    f"unreadable: its pack {pack_name(pack)} is a {size}, not a regular "
                    "file, and castore never follows or reads one"
                )
            elif offset + length > size:
                cut[key] = (
                    f"truncated: its pack {pack_name(pack)} is {size} bytes, and the chunk "
                    f"ends at byte {offset + length}"
                )
        return cut

    def _pack_size(self, pack: int) -> int | str | None:
        """A pack file's size; None: absent; what it is where it is not a regular file
        (a symlink, a named pipe: castore never reads one)."""
        try:
            found = os.stat(self.pack_path(pack), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return found.st_size if stat.S_ISREG(found.st_mode) else kind_of(found.st_mode)

    @lmdb_guarded("cross-check the chunk index")
    def check_index(self, *, hash_bytes: bool = False) -> IndexCheck:
        """Cross-check the index against the packs (see index_check) and audit the LMDB file.

        Reads record headers with pread; chunk bytes only with ``hash_bytes``. The
        audit comes first: iterating a tree with damaged pages can trip LMDB's own
        assertions (abort), so a file that fails it is not iterated.
        """
        audit, unsure = self._audit_file()
        if audit:
            return IndexCheck(problems=tuple(audit), notes=tuple(unsure))
        with self._lock:
            txn = self._begin(write=False)
            try:
                entries, damaged = self._iterated_entries(txn)

                def lookup(key: bytes) -> tuple[int, int, int] | None:
                    value = txn.get(key, db=self._index)
                    if value is None or len(value) != LOCATION_SIZE:
                        return None if value is None else (-1, -1, -1)
                    return unpack_location(value)

                packs = {pack: self.pack_path(pack) for pack in self.pack_files()}
                stat = int(txn.stat(self._index)["entries"])
                found = cross_check(entries, stat, lookup, packs, hash_bytes=hash_bytes)
            finally:
                txn.abort()
        return dataclasses.replace(
            found, problems=tuple(damaged) + found.problems, notes=found.notes + tuple(unsure)
        )

    def _iterated_entries(self, txn: Any) -> tuple[list[IndexEntry], list[str]]:
        entries, damaged = [], []
        for key, value in txn.cursor(db=self._index):
            if len(value) != LOCATION_SIZE:
                damaged.append(f"entry {bytes(key).hex()[:16]}: value is {len(value)} bytes")
                continue
            where = PackLocation.decode(value)
            entries.append(IndexEntry(bytes(key), where.length, where.pack, where.offset))
        return entries, damaged

    def _audit_file(self) -> tuple[list[str], list[str]]:
        """The LMDB page audit's problems; a note instead if writers kept changing the file."""
        data_file = self.path / "data.mdb"
        for _ in range(3):
            before = read_committed_meta(data_file)
            problems = audit_pages(self.path)
            if read_committed_meta(data_file) == before:
                return [f"the LMDB file ({data_file.name}): {p}" for p in problems], []
        return [], ["the LMDB page audit was skipped: the file changed under it three times"]

    def _index_entries(self) -> list[tuple[bytes, bytes]]:
        txn = self._begin(write=False)
        try:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._index)]
        finally:
            txn.abort()

    def _rewrite(self, packs: list[int], live: dict[int, list[tuple[bytes, PackLocation]]]) -> int:
        maps = PackMaps(self.pack_dir)
        writer = PackWriter.create(self.pack_dir)
        moves: list[tuple[bytes, PackLocation, PackLocation]] = []
        try:
            for pack in packs:
                view = maps.get(pack)
                if view is None:
                    continue
                for key, where in live[pack]:
                    piece = view[where.offset : where.offset + where.length]
                    moves.append((key, where, writer.add(key, piece)))
            writer.finish()
        except BaseException:
            writer.discard()
            raise
        finally:
            maps.close()

        def work(txn: Any) -> int:
            for key, old, new in moves:
                if txn.get(key, db=self._index) == old.encode():
                    txn.put(key, new.encode(), db=self._index)
            return len(moves)

        moved: int = self._write_txn(work)
        return moved

    @lmdb_guarded("overwrite a value")
    def raw_put(self, namespace: Namespace, key: bytes, value: bytes) -> None:
        """Overwrite one value unconditionally: for tests that damage a store.

        A chunk of the same length is overwritten in place in its pack (as a
        bit flip on disk would); any other length is indexed from a new pack.
        """
        self._refuse_if_readonly("overwriting a value")
        key = bytes(key)
        if Namespace(namespace) is Namespace.OBJECTS:
            self._write_txn(lambda txn: txn.put(key, value, db=self._objects))
            return
        where = self.locate(key)
        if where is not None and where.length == len(value):
            fd = os.open(self.pack_path(where.pack), os.O_WRONLY)
            try:
                os.pwrite(fd, value, where.offset)
                os.fsync(fd)
            finally:
                os.close(fd)
            return
        writer = PackWriter.create(self.pack_dir)
        new = writer.add(key, value)
        writer.finish()
        self._write_txn(lambda txn: txn.put(key, new.encode(), db=self._index))


def _check_environment_files(path: Path, *, create: bool = True) -> int:
    """Refuse a symlinked ``chunks/`` or LMDB file; return data.mdb's size (0 if none).

    LMDB follows symlinks when it opens (and writes its lock table into
    ``lock.mdb``), so the files are checked before it sees them. ``create``
    (False: a read-only open) makes the directories first.
    """
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)  # above the store: the caller's choice
        make_store_dir(path)
        make_store_dir(path / PACK_DIR)
    elif not is_store_dir(path):
        raise StoreError(f"{path} is missing: not a whole castore store", path=str(path))
    regular_file_size(path / "lock.mdb")
    return regular_file_size(path / "data.mdb") or 0
