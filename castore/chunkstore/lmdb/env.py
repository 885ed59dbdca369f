"""One LMDB environment per data file per process, shared by every handle on it.

LMDB forbids opening one environment twice in a process: its locks are POSIX
``fcntl`` locks, which belong to the (process, file) pair, so a second open
would share the first one's locks and closing either would drop both; py-lmdb
refuses the second open. A process still has good reasons to open one store
twice: a notebook cell run again, a DCP writer given a path while a ``Store``
on it is open. So every backend handle on one ``data.mdb`` shares one
:class:`SharedEnv`, counted; the last handle to go closes the environment.

The registry is keyed by the data file's ``(st_dev, st_ino)``, as py-lmdb's own
guard is: ``./ckpt`` and ``/abs/ckpt`` reach the same file; a store deleted and
created again at the same path, or a compacted file renamed over the old one,
is a new file and gets a new environment. A file that does not exist yet
cannot be open.

Read-only: a store opened read-only gets an environment opened with
``readonly=True``, which creates nothing and never pads the data file. Its
reader slot lives in ``lock.mdb`` as usual when that file can be written, so a
writer (another user's, or this user's through a read-write handle) never
reuses pages it is reading. Where ``lock.mdb`` cannot be opened for writing (a
read-only mount, a directory of another user) it is opened with ``lock=False``:
LMDB then keeps no reader table, which is safe only while no writer exists. On
a read-only mount none can; in another user's directory its owner could still
write, and pages a writer frees may then be reused under the reader. Nothing
better is possible there (LMDB coordinates only through that file), and every
chunk and object read is blake3-verified (invariant 3), so such a race
surfaces as an integrity error, never as wrong bytes.

Fork: an environment is never used across ``fork()`` (handles compare pids
and refuse). A forked child starts with an empty registry, but it cannot open
an environment its parent had open when it forked: py-lmdb's guard is
inherited, and closing the inherited environment in the child would clear the
parent's reader slots (``mdb_env_close`` frees every slot of the pid that
opened it), letting a writer reuse pages a parent transaction is still
reading. Such an open is refused with an error that says what to do instead.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from castore.chunkstore.base import Namespace
from castore.chunkstore.lmdb.file import DATA_FILE, check_data_file, pad_data_file, translate
from castore.errors import StoreError, StoreLockedError

DEFAULT_MAP_SIZE = 1 << 30
INDEX_DB = b"chunk_index"
MAX_READERS = 1024
LOCK_FILE = "lock.mdb"
Key = tuple[int, int]


@dataclass(eq=False)
class SharedEnv:
    """One open environment and the state every handle on it shares."""

    env: Any
    objects: Any
    index: Any
    key: Key
    pid: int = field(default_factory=os.getpid)
    # Every transaction of the environment runs under this lock, whichever handle
    # starts it, as it did when each handle had its own environment: a map resize
    # must find no transaction of this process open.
    lock: threading.RLock = field(default_factory=threading.RLock)
    handles: int = 0
    readonly: bool = False


_registry: dict[Key, SharedEnv] = {}
_inherited: set[Key] = set()  # open in an ancestor when this process forked
# Reentrant: a dropped handle's finalizer may run (garbage collection) inside acquire.
_registry_lock = threading.RLock()


def data_file_key(directory: Path) -> Key | None:
    """The identity of ``directory``'s data file; None while there is none."""
    try:
        found = os.stat(directory / DATA_FILE)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


def acquire(
    directory: Path, *, map_size: int | None, existing: int, readonly: bool = False
) -> SharedEnv:
    """A share of the environment in ``directory``, opened if this process has none open.

    ``existing`` is the data file's size (0 if none): a fresh open maps twice
    that, so a store keeps room to grow without a resize on every open.
    A ``map_size`` larger than the open environment's grows it; a smaller one
    keeps it (the map only grows). Give the share back with :func:`release`.
    ``readonly`` opens it read-only (see the module text); a read-write handle
    may share an environment a read-only one opened only once that one is closed.
    """
    with _registry_lock:
        key = data_file_key(directory)
        shared = _registry.get(key) if key is not None else None
        fresh = shared is None
        if shared is None:
            if key in _inherited:
                raise StoreError(
                    f"the LMDB environment in {directory} was open in the parent process "
                    "when this one was forked, and LMDB cannot open it again here: close "
                    "the store before forking, or start workers with the 'spawn' or "
                    "'forkserver' method",
                    path=str(directory),
                )
            if readonly:
                env, objects, index = _open_readonly(directory)
            else:
                env, objects, index = _open_environment(directory, map_size, existing)
            key = data_file_key(directory)  # LMDB has created it by now
            if key is None:
                env.close()
                raise StoreError(
                    f"LMDB opened {directory} without its data file", path=str(directory)
                )
            shared = SharedEnv(env, objects, index, key, readonly=readonly)
            _registry[key] = shared
        elif shared.readonly and not readonly:
            raise StoreError(
                f"the LMDB environment in {directory} is open read-only in this process: "
                "close the read-only Store on it before opening it read-write",
                path=str(directory),
            )
        shared.handles += 1
    if not fresh and map_size is not None and not shared.readonly:
        try:
            _grow_to(shared, map_size)
        except BaseException:
            release(shared)
            raise
    return shared


def _open_environment(path: Path, map_size: int | None, existing: int) -> tuple[Any, Any, Any]:
    """Open the environment in ``path``: (environment, objects db, chunk index db)."""
    data_file = path / DATA_FILE
    check_data_file(data_file)  # a truncated file would be mapped, then SIGBUS
    initial = map_size if map_size is not None else max(DEFAULT_MAP_SIZE, 2 * existing)
    try:
        env = lmdb.open(
            str(path),
            map_size=initial,
            subdir=True,
            max_dbs=4,
            max_readers=MAX_READERS,
            sync=True,
            metasync=True,
            writemap=False,
            lock=True,
        )
    except lmdb.Error as exc:
        raise translate(exc, path, "open the LMDB environment") from exc
    try:
        objects = _open_db(env, Namespace.OBJECTS.value.encode())
        index = _open_db(env, INDEX_DB)
    except BaseException:
        env.close()
        raise
    pad_data_file(data_file)  # after open: LMDB creates the file
    return env, objects, index


def _open_readonly(path: Path) -> tuple[Any, Any, Any]:
    """Open the environment in ``path`` read-only, creating and changing nothing."""
    data_file = path / DATA_FILE
    check_data_file(data_file)
    if not data_file.exists():  # LMDB would try to create it
        raise StoreError(
            f"{path} has no LMDB file {DATA_FILE}: the store was never opened for writing",
            path=str(path),
        )
    try:
        env = lmdb.open(
            str(path),
            map_size=max(DEFAULT_MAP_SIZE, data_file.stat().st_size),
            subdir=True,
            max_dbs=4,
            max_readers=MAX_READERS,
            readonly=True,
            lock=lock_file_writable(path),
        )
    except lmdb.Error as exc:
        raise translate(exc, path, "open the LMDB environment read-only") from exc
    try:
        # Both databases exist in every store (its first open creates them).
        objects = env.open_db(Namespace.OBJECTS.value.encode(), create=False)
        index = env.open_db(INDEX_DB, create=False)
    except BaseException:
        env.close()
        raise
    return env, objects, index


def lock_file_writable(path: Path) -> bool:
    """Whether a read-only environment in ``path`` can keep its reader slot in ``lock.mdb``.

    False only where the file cannot be opened for writing, or created when
    absent (see the module text for why that alone may go without it).
    """
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return os.access(path, os.W_OK)  # LMDB creates it: every store's first open did
    except OSError:
        return False
    os.close(fd)
    return True


def _open_db(env: Any, name: bytes) -> Any:
    try:
        return env.open_db(name, create=True)
    except lmdb.MapResizedError:
        # Another process grew the map since our open: adopt its size, then retry once.
        env.set_mapsize(0)
        return env.open_db(name, create=True)


def _grow_to(shared: SharedEnv, map_size: int) -> None:
    with shared.lock:  # no transaction of this process is open while the map changes
        if map_size > int(shared.env.info()["map_size"]):
            shared.env.set_mapsize(map_size)


def release(shared: SharedEnv) -> None:
    """Give one share back; the last one closes the environment (in the process that opened it)."""
    with _registry_lock:
        shared.handles -= 1
        if shared.handles > 0:
            return
        if _registry.get(shared.key) is shared:
            del _registry[shared.key]
        if shared.pid == os.getpid():  # never in a forked child: see the module doc
            with shared.lock:
                shared.env.close()


def is_open(directory: Path) -> bool:
    """Whether this process has the environment in ``directory`` open."""
    with _registry_lock:
        key = data_file_key(directory)
        return key is not None and key in _registry


def refuse_if_open(directory: Path, *, store: Path, doing: str) -> None:
    """Raise ``StoreLockedError`` if this process has the environment in ``directory`` open.

    For the offline operations that replace the data file (compact, rebuild). The
    open lock already refuses them while a ``Store`` is open anywhere; a bare
    backend takes no open lock, and its environment would go on writing to the
    file they replace (and py-lmdb refuses their own open of it).
    """
    if is_open(directory):
        raise StoreLockedError(
            f"store {store} is open in this process: close every Store and backend on it "
            f"before {doing}",
            path=str(store),
        )


def _forget_after_fork() -> None:
    """In a forked child: nothing is open here; what the parent had open stays unusable."""
    global _registry_lock
    _registry_lock = threading.RLock()  # another thread may have held it at the fork
    _inherited.update(_registry)
    _registry.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
