"""Blobs in a POSIX directory that several nodes share (NFS, Lustre).

Nothing here relies on what a network filesystem may not give: no LMDB, no
``mmap``, no ``flock``, no ``O_EXCL`` on the final name. The protocol
(docs/FORMAT_BLOBS.md, "The shared directory"):

* **create** writes a hidden temp file ``.LEAF.NONCE.tmp`` beside the blob,
  fsyncs it, and ``link``\\s it to the blob's name: ``link`` fails with
  ``EEXIST`` when the name exists, atomically, on NFS too. A lost NFS reply
  can make a ``link`` that succeeded report an error, so success is judged by
  the temp file's link count reaching 2 (open(2), "O_EXCL"). The temp file is
  then unlinked and the directory fsynced.
* **swap** writes the temp file first, then takes the blob's lock file
  ``.LEAF.lock`` (created by the same write-then-``link``, so its owner
  record is whole whenever it is visible), re-reads the blob's version under
  the lock, checks it still holds the lock, ``rename``\\s the temp file over
  the blob (``link`` when creating), fsyncs the directory and unlinks the lock.
* **lock expiry** needs no agreement between the nodes' clocks: a waiter
  breaks a lock only after watching the *same* lock record, unchanged, for
  ``stale_lock_after`` seconds on its own monotonic clock. It breaks it by
  renaming it aside and checking that what it moved is what it watched (if
  not, it links the fresh lock back). A holder checks, just before its
  rename, that its record is still the lock and that it has held it for less
  than half of ``stale_lock_after``; otherwise it writes nothing and raises
  LockLostError. What is left open: a holder that stalls for over half the
  timeout *between* that check and its rename.
* **reads** use ``pread`` on a descriptor: a blob is only ever replaced by a
  rename, never written in place, so an open descriptor sees one version.
* **list** walks with ``scandir`` in key order and skips hidden entries (temp
  and lock files), anything not named like a blob, and anything not a regular
  file or directory.

Every path is resolved one directory at a time from the root with
``O_NOFOLLOW | O_DIRECTORY`` descriptors (``openat``), so a symlink planted
in the shared directory is refused, never followed, and no name escapes it.
A process killed mid-write leaves only hidden temp files, which are garbage.
"""

from __future__ import annotations

import errno
import json
import os
import random
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import blake3

from castore.blob.base import (
    MAX_MUTABLE_BLOB,
    MAX_NAME_LENGTH,
    BlobStore,
    Version,
    check_expected,
    check_mutable_size,
    check_range,
    pieces_of,
    validate_blob_name,
    validate_blob_prefix,
)
from castore.errors import (
    BlobConflictError,
    BlobExistsError,
    BlobNotFoundError,
    BlobTooLargeError,
    InvalidNameError,
    LockLostError,
    StoreError,
    StoreLockedError,
    UnsafeStoreFileError,
    UnsupportedBackendError,
)
from castore.format.hashing import Buffer
from castore.support.faults import fault_point
from castore.support.safefs import kind_of, write_all, writing

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What link(2) answers on a filesystem without hard links (vfat, many FUSE mounts).
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_MAX_LOCK_RECORD = 4096
_POLL_FIRST, _POLL_MOST = 0.001, 0.05
DEFAULT_STALE_LOCK_AFTER = 60.0


class PosixBlobStore(BlobStore):
    """Blobs as files under ``root``, safe for processes on several nodes at once.

    ``stale_lock_after``: how long a waiter watches an unchanged lock before
    breaking it as abandoned (a holder stops trusting its lock after half of
    that). ``lock_wait``: how long a swap or delete waits for the lock before
    StoreLockedError; by default twice ``stale_lock_after``, so that a dead
    holder's lock is broken before a waiter gives up.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        stale_lock_after: float = DEFAULT_STALE_LOCK_AFTER,
        lock_wait: float | None = None,
    ) -> None:
        if stale_lock_after <= 0:
            raise ValueError(f"stale_lock_after must be positive, got {stale_lock_after}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.stale_lock_after = stale_lock_after
        self.lock_wait = 2 * stale_lock_after if lock_wait is None else lock_wait

    # -- the primitives --------------------------------------------------------------

    def create(self, name: str, data: Buffer | Iterable[Buffer]) -> Version:
        validate_blob_name(name)
        with self._made_parent(name) as (dir_fd, leaf):
            temp, version = self._write_temp(dir_fd, leaf, name, pieces_of(data))
            try:
                fault_point("blob.create_before_link")
                if not self._link(dir_fd, temp, leaf, name):
                    raise BlobExistsError(f"blob {name!r} exists; it keeps its content", name=name)
                self._sync_dir(dir_fd, name)
            finally:
                _unlink_quietly(dir_fd, temp)
        return version

    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        validate_blob_name(name)
        with self._existing(name) as fd:
            span = check_range(name, os.fstat(fd).st_size, start, end)
            return _pread_exactly(fd, span.start, span.length, name)

    def head(self, name: str) -> int | None:
        validate_blob_name(name)
        with self._parent(name) as parent:
            found = None if parent is None else _stat_blob(*parent)
        return None if found is None else found.st_size

    def read_versioned(self, name: str) -> tuple[bytes, Version] | None:
        validate_blob_name(name)
        try:
            with self._existing(name) as fd:
                content = _read_mutable(fd, name)
        except BlobNotFoundError:
            return None
        return content, _version_of(content)

    def swap(self, name: str, data: Buffer, expected: Version | None) -> Version:
        validate_blob_name(name)
        view = memoryview(data).cast("B")
        check_mutable_size(name, view.nbytes)
        with self._made_parent(name) as (dir_fd, leaf):
            # Written before the lock is taken, so the lock is held only to check and rename.
            temp, version = self._write_temp(dir_fd, leaf, name, [view])
            try:
                with self._locked(dir_fd, leaf, name) as lock:
                    self._recheck(dir_fd, leaf, name, expected)
                    fault_point("blob.swap_before_rename")
                    lock.confirm()
                    self._replace(dir_fd, temp, leaf, name, creating=expected is None)
            finally:
                _unlink_quietly(dir_fd, temp)
        return version

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_blob_prefix(prefix)
        folder, _, partial = prefix.rpartition("/")
        with self._directory(folder) as fd:
            if fd is not None:
                yield from _walk(fd, folder + "/" if folder else "", partial)

    def delete(self, name: str) -> bool:
        validate_blob_name(name)
        with self._parent(name) as parent:
            if parent is None or _stat_blob(*parent) is None:
                return False
            dir_fd, leaf = parent
            # Under the lock, so that a delete never lands between a swap's check and rename.
            with self._locked(dir_fd, leaf, name):
                try:
                    os.unlink(leaf, dir_fd=dir_fd)
                except FileNotFoundError:
                    return False
                self._sync_dir(dir_fd, name)
        return True

    # -- the swap under its lock -----------------------------------------------------

    def _recheck(self, dir_fd: int, leaf: str, name: str, expected: Version | None) -> None:
        """Refuse unless the blob is at ``expected`` now: the compare of compare-and-swap."""
        check_expected(name, self._current_version(dir_fd, leaf, name), expected)

    def _current_version(self, dir_fd: int, leaf: str, name: str) -> Version | None:
        fd = _open_blob(dir_fd, leaf)
        if fd is None:
            return None
        try:
            return _version_of(_read_mutable(fd, name))
        finally:
            os.close(fd)

    def _replace(self, dir_fd: int, temp: str, leaf: str, name: str, *, creating: bool) -> None:
        with writing(f"replacing blob {name!r}", self.root / name):
            if creating:
                # link, not rename: a create() that slipped in since the check is kept.
                if not self._link(dir_fd, temp, leaf, name):
                    raise BlobConflictError(
                        f"compare-and-swap of blob {name!r} expected no blob, but it exists",
                        name=name,
                    )
            else:
                os.rename(temp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)

    @contextmanager
    def _locked(self, dir_fd: int, leaf: str, name: str) -> Iterator[_HeldLock]:
        lock_leaf = f".{leaf}.lock"
        record = json.dumps(
            {
                "owner": f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}",
                "token": secrets.token_hex(16),
                "acquired": time.time(),
                "stale_lock_after": self.stale_lock_after,
            }
        ).encode()
        self._acquire(dir_fd, lock_leaf, record, name)
        held = _HeldLock(dir_fd, lock_leaf, record, time.monotonic() + self.stale_lock_after / 2)
        try:
            yield held
        finally:
            # Unlink only our own record: a lock broken as stale may be someone else's now.
            if _read_lock(dir_fd, lock_leaf) == record:
                _unlink_quietly(dir_fd, lock_leaf)

    def _acquire(self, dir_fd: int, lock_leaf: str, record: bytes, name: str) -> None:
        # The record goes in a temp file once; each attempt links it to the lock's name.
        temp, _ = self._write_temp(dir_fd, lock_leaf, name, [memoryview(record)], sync=False)
        try:
            self._wait_for_lock(dir_fd, temp, lock_leaf, name)
        finally:
            _unlink_quietly(dir_fd, temp)

    def _wait_for_lock(self, dir_fd: int, temp: str, lock_leaf: str, name: str) -> None:
        deadline = time.monotonic() + self.lock_wait
        watched, since, delay = None, 0.0, _POLL_FIRST
        while not self._link(dir_fd, temp, lock_leaf, name):
            seen, now = _read_lock(dir_fd, lock_leaf), time.monotonic()
            if seen is None:
                continue  # released since: try again at once
            if seen != watched:
                watched, since = seen, now  # a new holder: its timeout starts now
            elif now - since >= self.stale_lock_after:
                _break_lock(dir_fd, lock_leaf, seen)
                watched = None
                continue
            if now >= deadline:
                raise StoreLockedError(
                    f"blob {name!r} is locked by {_describe(seen)}; waited {self.lock_wait:g}s. "
                    f"A lock left by a dead process is broken after {self.stale_lock_after:g}s "
                    "unchanged: retry later",
                    name=name,
                )
            time.sleep(min(delay * random.uniform(0.5, 1.0), max(deadline - now, 0.0)))
            delay = min(delay * 2, _POLL_MOST)

    # -- files and directories -------------------------------------------------------

    def _write_temp(
        self, dir_fd: int, leaf: str, name: str, pieces: Iterable[memoryview], *, sync: bool = True
    ) -> tuple[str, Version]:
        """A hidden temp file beside ``leaf`` holding ``pieces`` (synced); its name and version."""
        temp = f".{leaf}.{secrets.token_hex(8)}.tmp"
        hasher = blake3.blake3()
        phase = f"writing blob {name!r}"
        with writing(phase, self.root / name):
            fd = os.open(
                temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, 0o644, dir_fd=dir_fd
            )
        try:
            with writing(phase, self.root / name):
                try:
                    for piece in pieces:
                        hasher.update(piece)
                        write_all(fd, piece)
                    if sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException:
            _unlink_quietly(dir_fd, temp)
            raise
        return temp, Version("blake3:" + hasher.hexdigest())

    def _link(self, dir_fd: int, temp: str, leaf: str, name: str) -> bool:
        """Link ``temp`` to ``leaf`` if ``leaf`` is absent; False if it exists."""
        try:
            os.link(temp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            return True
        except OSError as exc:
            # On NFS a retried link whose first reply was lost says EEXIST: the link
            # count of our own temp file says whether it was made.
            if os.stat(temp, dir_fd=dir_fd, follow_symlinks=False).st_nlink == 2:
                return True
            if exc.errno in _NO_HARD_LINKS:
                raise UnsupportedBackendError(
                    f"the filesystem of {self.root} cannot make hard links "
                    f"({exc.strerror}): a shared blob directory needs link(2) for "
                    "create-if-absent; use NFS, Lustre or a local filesystem",
                    path=str(self.root),
                ) from exc
            if exc.errno != errno.EEXIST:
                raise
        try:
            mode = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return False  # deleted since: it existed when the link was refused
        if stat.S_ISDIR(mode):
            raise _tree_conflict(name)  # the name is a prefix of other blobs
        if not stat.S_ISREG(mode):
            raise _unsafe(leaf, name, kind_of(mode), "regular file")
        return False

    def _sync_dir(self, dir_fd: int, name: str) -> None:
        with writing(f"syncing the directory of blob {name!r}", self.root / name):
            os.fsync(dir_fd)

    @contextmanager
    def _parent(self, name: str) -> Iterator[tuple[int, str] | None]:
        """The directory holding ``name`` (a descriptor) and the leaf; None if it is absent."""
        folder, _, leaf = name.rpartition("/")
        with self._directory(folder, name=name) as fd:
            yield None if fd is None else (fd, leaf)

    @contextmanager
    def _made_parent(self, name: str) -> Iterator[tuple[int, str]]:
        """The directory holding ``name`` (made if absent) and the leaf."""
        folder, _, leaf = name.rpartition("/")
        with self._directory(folder, make=True, name=name) as fd:
            assert fd is not None  # made
            yield fd, leaf

    @contextmanager
    def _directory(
        self, folder: str, *, make: bool = False, name: str | None = None
    ) -> Iterator[int | None]:
        fd: int | None = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for segment in folder.split("/") if folder else []:
                assert fd is not None
                inner = _enter(fd, segment, make=make, name=name or folder)
                os.close(fd)
                fd = inner
                if fd is None:
                    break
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    @contextmanager
    def _existing(self, name: str) -> Iterator[int]:
        """A read descriptor of blob ``name``; BlobNotFoundError when it is absent."""
        with self._parent(name) as parent:
            fd = None if parent is None else _open_blob(*parent)
        if fd is None:
            raise BlobNotFoundError(f"no blob {name!r} in {self.root}", name=name)
        try:
            yield fd
        finally:
            os.close(fd)


@dataclass(frozen=True)
class _HeldLock:
    """A lock this process took: its record, and when to stop trusting it."""

    dir_fd: int
    lock_leaf: str
    record: bytes
    trust_until: float  # time.monotonic()

    def confirm(self) -> None:
        """Raise LockLostError unless the lock is still ours and well inside its timeout."""
        if time.monotonic() > self.trust_until:
            why = "was held past half of its stale timeout (a waiter may break it)"
        elif _read_lock(self.dir_fd, self.lock_leaf) != self.record:
            why = "was broken as stale by another process"
        else:
            return
        raise LockLostError(
            f"the lock {self.lock_leaf} {why}; nothing was written: retry", lock=self.lock_leaf
        )


def _enter(fd: int, segment: str, *, make: bool, name: str) -> int | None:
    """Open directory ``segment`` inside ``fd`` without following a symlink."""
    if make:
        try:
            os.mkdir(segment, 0o755, dir_fd=fd)
            os.fsync(fd)  # the new entry survives a crash before the blob's own sync
        except FileExistsError:
            pass
    try:
        return os.open(segment, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        if make:
            raise
        return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    mode = os.stat(segment, dir_fd=fd, follow_symlinks=False).st_mode
    if not stat.S_ISREG(mode):
        raise _unsafe(segment, name, kind_of(mode), "directory")
    if make:
        raise _tree_conflict(name)
    return None  # a blob where a directory would be: nothing lies under it


def _stat_blob(dir_fd: int, leaf: str) -> os.stat_result | None:
    """The stat of blob file ``leaf`` (None: absent, or a directory of other blobs)."""
    try:
        found = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(found.st_mode):
        return None
    if not stat.S_ISREG(found.st_mode):
        raise _unsafe(leaf, leaf, kind_of(found.st_mode), "regular file")
    return found


def _open_blob(dir_fd: int, leaf: str) -> int | None:
    """A read descriptor of regular file ``leaf``, None when absent; refuses anything else."""
    if _stat_blob(dir_fd, leaf) is None:  # checked first: opening a device can do harm
        return None
    try:
        fd = os.open(leaf, os.O_RDONLY | _FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None  # deleted since
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise _unsafe(leaf, leaf, "replaced entry", "regular file") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _unsafe(leaf, leaf, "non-regular file", "regular file")
    return fd


def _pread_exactly(fd: int, offset: int, length: int, name: str) -> bytes:
    pieces = []
    while length > 0:
        piece = os.pread(fd, min(length, 1 << 30), offset)
        if not piece:
            raise StoreError(f"blob {name!r} ended early while read: truncated on disk", name=name)
        pieces.append(piece)
        offset += len(piece)
        length -= len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _read_mutable(fd: int, name: str) -> bytes:
    size = os.fstat(fd).st_size
    if size > MAX_MUTABLE_BLOB:
        raise BlobTooLargeError(
            f"blob {name!r} is {size} bytes, more than any swap writes ({MAX_MUTABLE_BLOB})",
            name=name,
        )
    return _pread_exactly(fd, 0, size, name)


def _version_of(content: bytes) -> Version:
    return Version("blake3:" + blake3.blake3(content).hexdigest())


def _read_lock(dir_fd: int, lock_leaf: str) -> bytes | None:
    fd = _open_blob(dir_fd, lock_leaf)
    if fd is None:
        return None
    try:
        return os.pread(fd, _MAX_LOCK_RECORD, 0)
    finally:
        os.close(fd)


def _break_lock(dir_fd: int, lock_leaf: str, watched: bytes) -> None:
    """Remove the lock record ``watched``, and only it, as abandoned."""
    aside = f"{lock_leaf}.{secrets.token_hex(8)}.broken"
    try:
        os.rename(lock_leaf, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileNotFoundError:
        return  # released, or broken by another waiter
    try:
        if _read_lock(dir_fd, aside) != watched:
            # Another waiter broke it first and a new holder took it: put theirs back.
            try:
                os.link(
                    aside, lock_leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False
                )
            except FileExistsError:
                pass  # a third took it meanwhile; the one we moved fails its confirm()
    finally:
        _unlink_quietly(dir_fd, aside)


def _describe(record: bytes) -> str:
    try:
        fields = json.loads(record)
        return f"{fields['owner']} since {time.ctime(fields['acquired'])}"
    except (ValueError, KeyError, TypeError):
        return f"an unreadable lock record {record[:80]!r}"


def _walk(fd: int, above: str, partial: str) -> Iterator[str]:
    """Blob names under directory ``fd`` (named ``above``) whose leaf starts with ``partial``.

    In key order: a directory ``d`` sorts as ``d/``, which is where its keys sort.
    """
    entries = []
    with os.scandir(fd) as scan:
        for entry in scan:
            if entry.name.startswith(partial) and not entry.name.startswith("."):
                if entry.is_dir(follow_symlinks=False):
                    entries.append((entry.name + "/", entry.name, True))
                elif entry.is_file(follow_symlinks=False):
                    entries.append((entry.name, entry.name, False))
    for _, leaf, is_dir in sorted(entries):
        key = above + leaf
        if len(key) > MAX_NAME_LENGTH or not _is_valid(key):
            continue  # not written through this interface: not a blob
        if not is_dir:
            yield key
            continue
        try:
            inner = os.open(leaf, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            continue  # removed or replaced since the scan
        try:
            yield from _walk(inner, key + "/", "")
        finally:
            os.close(inner)


def _is_valid(key: str) -> bool:
    try:
        validate_blob_name(key)
    except InvalidNameError:
        return False
    return True


def _unlink_quietly(dir_fd: int, leaf: str) -> None:
    try:
        os.unlink(leaf, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _tree_conflict(name: str) -> InvalidNameError:
    return InvalidNameError(
        f"blob name {name!r} conflicts with an existing blob: a name cannot be both "
        "a blob and a prefix of other blobs ('a' and 'a/b')",
        name=name,
    )


def _unsafe(entry: str, name: str, kind: str, expected: str) -> UnsafeStoreFileError:
    return UnsafeStoreFileError(
        f"{entry!r} (on the way to blob {name!r}) is a {kind}, not a {expected}: castore "
        "does not follow or open it; remove it from the shared directory",
        path=entry,
    )
