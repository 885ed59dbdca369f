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
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb

from castore.chunkstore.base import ChunkBackend, Namespace, PutResult, ReadSink
from castore.errors import StoreError
from castore.hashing import Buffer

DEFAULT_MAP_SIZE = 4 << 30
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

    def has_many(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bool]:
        db = self._dbs[Namespace(namespace)]
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
                sink([txn.get(bytes(key), db=db) for key in keys])
            finally:
                txn.abort()

    def put_many(self, namespace: Namespace, items: Iterable[tuple[bytes, Buffer]]) -> PutResult:
        db = self._dbs[Namespace(namespace)]
        batch = list(items)
        with self._lock:
            for _ in range(_MAX_GROW_ATTEMPTS):
                txn = self._begin(write=True)
                try:
                    result = self._put_batch(txn, db, batch)
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
    def _put_batch(txn: Any, db: Any, batch: list[tuple[bytes, Buffer]]) -> PutResult:
        written = written_bytes = present = 0
        for key, value in batch:
            if txn.put(bytes(key), value, db=db, overwrite=False):
                written += 1
                written_bytes += memoryview(value).nbytes
            else:
                present += 1
        return PutResult(written, written_bytes, present)

    def delete_many(self, namespace: Namespace, keys: Iterable[bytes]) -> int:
        db = self._dbs[Namespace(namespace)]
        with self._lock:
            txn = self._begin(write=True)
            try:
                deleted = sum(bool(txn.delete(bytes(k), db=db)) for k in keys)
                txn.commit()
                return deleted
            except BaseException:
                txn.abort()
                raise

    def iter_keys(self, namespace: Namespace) -> Iterator[bytes]:
        for key, _size in self.value_sizes(namespace):
            yield key

    def value_sizes(self, namespace: Namespace) -> Iterator[tuple[bytes, int]]:
        db = self._dbs[Namespace(namespace)]
        with self._lock:
            txn = self._begin(write=False, buffers=True)
            try:
                snapshot = [(bytes(k), len(v)) for k, v in txn.cursor(db=db)]
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
