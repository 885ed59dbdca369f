"""The per-node cache of a format-3 store's index blobs.

A process that opens a store on object storage needs the chunk index, which
is the union of the store's index blobs. Fetching every one of them each
time is a request per pack; the cache keeps their bytes in a small LMDB
environment on local disk, one per store (``<cache dir>/<store id>/``), so a
new process fetches only the index blobs written since.

The cache is never trusted for correctness: an index blob is used only while
the store's listing shows it, and its bytes are checked against the blake3
in its name wherever they come from. Any error opening or writing the cache
turns it off for this process (with one warning); the store works without it.

Where: ``cache_dir`` given to :func:`castore.open`, else ``$CASTORE_CACHE_DIR``,
else ``$XDG_CACHE_HOME/castore``, else ``~/.cache/castore``.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from pathlib import Path
from typing import Any

import lmdb

from castore.errors import CacheWarning

# One environment per cache directory per process (LMDB forbids a second open):
# handles share it, counted, and the last to close closes it.
_OPEN: dict[str, list[Any]] = {}  # resolved path -> [environment, handles, pid]
_OPEN_LOCK = threading.Lock()

_STORE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MAP_SIZE = 1 << 30  # sparse; about 7 million chunks' entries


def default_cache_dir() -> Path:
    configured = os.environ.get("CASTORE_CACHE_DIR")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "castore"


class IndexCache:
    """Index blobs by name, in an LMDB environment under ``directory/store_id``."""

    def __init__(self, directory: str | os.PathLike[str], store_id: str) -> None:
        if not _STORE_ID.fullmatch(store_id):
            raise ValueError(f"store id {store_id!r} is not a safe directory name")
        self.path = Path(directory) / store_id
        self._env: Any = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._key = ""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._key = str(self.path.resolve())
            with _OPEN_LOCK:
                entry = _OPEN.get(self._key)
                if entry is None or entry[2] != self._pid:
                    env = lmdb.open(
                        self._key, map_size=_MAP_SIZE, subdir=True, sync=False, metasync=False
                    )
                    entry = _OPEN[self._key] = [env, 0, self._pid]
                entry[1] += 1
                self._env = entry[0]
        except (OSError, lmdb.Error) as exc:
            self._off(f"cannot open the index cache at {self.path}: {exc}")

    def _off(self, why: str) -> None:
        warnings.warn(f"castore: {why}; going on without it", CacheWarning, stacklevel=3)
        self.close()

    def _usable(self) -> bool:
        return self._env is not None and os.getpid() == self._pid

    def get(self, name: str) -> bytes | None:
        if not self._usable():
            return None
        try:
            with self._env.begin(buffers=False) as txn:
                value = txn.get(name.encode())
        except lmdb.Error as exc:
            with self._lock:
                self._off(f"the index cache at {self.path} failed a read: {exc}")
            return None
        return None if value is None else bytes(value)

    def put(self, name: str, data: bytes) -> None:
        if not self._usable():
            return
        try:
            with self._lock, self._env.begin(write=True) as txn:
                txn.put(name.encode(), data)
        except lmdb.Error as exc:
            with self._lock:
                self._off(f"the index cache at {self.path} failed a write: {exc}")

    def names(self) -> list[str]:
        """The names of the index blobs cached (all of this store's)."""
        if not self._usable():
            return []
        try:
            with self._env.begin() as txn:
                return [bytes(key).decode() for key in txn.cursor().iternext(values=False)]
        except (lmdb.Error, UnicodeDecodeError) as exc:
            with self._lock:
                self._off(f"the index cache at {self.path} failed a read: {exc}")
            return []

    def discard(self, names: list[str]) -> None:
        """Forget index blobs the store no longer lists (else the cache only ever grows)."""
        if not names or not self._usable():
            return
        try:
            with self._lock, self._env.begin(write=True) as txn:
                for name in names:
                    txn.delete(name.encode())
        except lmdb.Error as exc:
            with self._lock:
                self._off(f"the index cache at {self.path} failed a write: {exc}")

    def close(self) -> None:
        env, self._env = self._env, None
        if env is None or os.getpid() != self._pid:
            return
        with _OPEN_LOCK:
            entry = _OPEN.get(self._key)
            if entry is not None and entry[0] is env:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _OPEN[self._key]
        env.close()
