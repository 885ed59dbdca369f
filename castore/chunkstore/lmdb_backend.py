"""LMDB, the embedded default backend.

Choices that matter for correctness:

* ``sync=True``/``metasync=True`` and no ``writemap``: a commit is durable when
  it returns, and a full disk raises instead of killing the process (SIGBUS).
* The map grows when full, by aborting the transaction, enlarging the map
  outside any transaction and retrying; a map grown by another process is
  adopted (``MapResizedError``).
* Reads use zero-copy buffers that never outlive their transaction: values are
  handed to a callback inside it.
* An environment is never used across ``fork()``: it records the pid that
  opened it and refuses use from another process.
* Chunk presence is answered from ``chunk_index`` (digest -> u64 length),
  written in the same transaction as the chunk. Looking a key up in ``chunks``
  itself faults in the whole value, so a re-save of a store that is not in the
  page cache would otherwise read back every chunk it skips.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb

from castore.chunkstore.base import ChunkBackend, Namespace, PutResult, ReadSink
from castore.errors import StoreError
from castore.hashing import Buffer

DEFAULT_MAP_SIZE = 4 << 30
_INDEX_DB = b"chunk_index"
_LENGTH = struct.Struct("<Q")
MAX_READERS = 1024
_MAX_GROW_ATTEMPTS = 32


class LmdbBackend(ChunkBackend):
    """Chunks and objects in two named databases of one LMDB environment."""

    def __init__(self, path: str | os.PathLike[str], *, map_size: int | None = None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        data_file = self.path / "data.mdb"
        existing = data_file.stat().st_size if data_file.exists() else 0
        initial = map_size if map_size is not None else max(DEFAULT_MAP_SIZE, 2 * existing)
        self._pid = os.getpid()
        self._lock = threading.RLock()
        try:
            self._env = lmdb.open(
                str(self.path),
                map_size=initial,
                subdir=True,
                max_dbs=4,
                max_readers=MAX_READERS,
                sync=True,
                metasync=True,
                writemap=False,
                readahead=True,  # chunks are large sequential values
                lock=True,
            )
        except lmdb.Error as exc:
            raise StoreError(f"cannot open LMDB environment: {exc}", path=str(self.path)) from exc
        self._dbs = {ns: self._env.open_db(ns.value.encode(), create=True) for ns in Namespace}
        self._index = self._env.open_db(_INDEX_DB, create=True)
        self._closed = False

    # -- plumbing ---------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise StoreError("store is closed", path=str(self.path))
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

    @property
    def map_size(self) -> int:
        return int(self._env.info()["map_size"])

    # -- contract ---------------------------------------------------------

    def _key_db(self, namespace: Namespace) -> Any:
        """The database that answers presence and sizes without touching values."""
        return self._index if Namespace(namespace) is Namespace.CHUNKS else self._dbs[namespace]

    def has_many(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bool]:
        db = self._key_db(namespace)
        with self._lock:
            txn = self._begin(write=False, buffers=True)
            try:
                cursor = txn.cursor(db=db)
                return [cursor.set_key(bytes(k)) for k in keys]
            finally:
                txn.abort()

    def read_many(self, namespace: Namespace, keys: Sequence[bytes], sink: ReadSink) -> None:
        db = self._dbs[Namespace(namespace)]
        with self._lock:
            txn = self._begin(write=False, buffers=True)
            try:
                sink(txn.get(bytes(key), db=db) for key in keys)
            finally:
                txn.abort()

    def put_many(self, namespace: Namespace, items: Iterable[tuple[bytes, Buffer]]) -> PutResult:
        db = self._dbs[Namespace(namespace)]
        index = self._index if Namespace(namespace) is Namespace.CHUNKS else None
        batch = list(items)
        with self._lock:
            for _ in range(_MAX_GROW_ATTEMPTS):
                txn = self._begin(write=True)
                try:
                    result = self._put_batch(txn, db, index, batch)
                    txn.commit()
                    return result
                except lmdb.MapFullError:
                    txn.abort()
                    self._grow()
                except BaseException:
                    txn.abort()
                    raise
        raise StoreError("LMDB map could not grow enough for one batch", path=str(self.path))

    @staticmethod
    def _put_batch(txn: Any, db: Any, index: Any, batch: list[tuple[bytes, Buffer]]) -> PutResult:
        written = written_bytes = present = 0
        for key, value in batch:
            if txn.put(bytes(key), value, db=db, overwrite=False):
                size = memoryview(value).nbytes
                if index is not None:
                    txn.put(bytes(key), _LENGTH.pack(size), db=index)
                written += 1
                written_bytes += size
            else:
                present += 1
        return PutResult(written, written_bytes, present)

    def delete_many(self, namespace: Namespace, keys: Iterable[bytes]) -> int:
        db = self._dbs[Namespace(namespace)]
        index = self._index if Namespace(namespace) is Namespace.CHUNKS else None
        with self._lock:
            txn = self._begin(write=True)
            try:
                deleted = 0
                for key in keys:
                    if index is not None:
                        txn.delete(bytes(key), db=index)
                    deleted += bool(txn.delete(bytes(key), db=db))
                txn.commit()
                return deleted
            except BaseException:
                txn.abort()
                raise

    def iter_keys(self, namespace: Namespace) -> Iterator[bytes]:
        for key, _size in self.value_sizes(namespace):
            yield key

    def value_sizes(self, namespace: Namespace) -> Iterator[tuple[bytes, int]]:
        chunks = Namespace(namespace) is Namespace.CHUNKS
        db = self._key_db(namespace)
        with self._lock:
            txn = self._begin(write=False, buffers=True)
            try:
                snapshot = [
                    (bytes(k), _LENGTH.unpack(v)[0] if chunks else len(v))
                    for k, v in txn.cursor(db=db)
                ]
            finally:
                txn.abort()
        yield from snapshot

    def raw_put(self, namespace: Namespace, key: bytes, value: bytes) -> None:
        """Overwrite one value unconditionally: for tests that damage a store."""
        with self._lock:
            with self._begin(write=True) as txn:
                txn.put(bytes(key), value, db=self._dbs[Namespace(namespace)])

    def close(self) -> None:
        if not self._closed and os.getpid() == self._pid:
            self._env.close()
        self._closed = True
