"""Store files, opened without following symlinks or blocking on pipes.

A store may come from somewhere untrusted (a copy, an archive, another
user's directory). castore then must never write outside it, read outside it,
or hang, whatever its entries are. So every file or directory *inside* the
store is checked before use:

* a file is opened with ``O_NOFOLLOW`` (a symlink fails to open) and
  ``O_NONBLOCK`` (opening a named pipe returns at once instead of waiting for
  a writer), then ``fstat`` must say it is a regular file;
* a directory is ``lstat``-ed: a symlink in place of ``refs/`` would redirect
  every ``O_NOFOLLOW`` open below it, since that flag covers only the last
  component of a path.

The store's root directory itself may be a symlink: the user chose that path.

These checks defend against a store's *contents*, not against a process that
swaps entries while castore runs: such a process can already write the store.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from castore.errors import CastoreError, StoreError, StoreFullError, UnsafeStoreFileError

# errno values that mean "no room": the disk, the user's quota, the file size limit.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_READ_PIECE = 1 << 20


def kind_of(mode: int) -> str:
    """What an ``st_mode`` is, in the words an error message uses."""
    if stat.S_ISREG(mode):
        return "regular file"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "named pipe"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def _unsafe(path: Path, kind: str, expected: str) -> UnsafeStoreFileError:
    return UnsafeStoreFileError(
        f"{path} is a {kind}, not a {expected}: castore does not follow or open it; "
        "remove it (or copy the store without it)",
        path=str(path),
    )


def open_store_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` a store file that must be a regular file; the caller closes the fd.

    Raises UnsafeStoreFileError for a symlink, pipe, socket, device or
    directory, and FileNotFoundError (as ``os.open`` does) when it is absent.
    """
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    else:
        # Refuse before opening: opening a device or socket can itself do harm.
        if not stat.S_ISREG(before.st_mode):
            raise _unsafe(path, kind_of(before.st_mode), "regular file")
    safe = flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, safe, mode)
    except OSError as exc:
        # ELOOP: a symlink appeared since the lstat; ENXIO: a pipe with no reader or a socket.
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            kind = "symlink" if exc.errno == errno.ELOOP else "named pipe or socket"
            raise _unsafe(path, kind, "regular file") from exc
        raise
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise _unsafe(path, kind_of(found.st_mode), "regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def regular_file_size(path: Path) -> int | None:
    """The size of store file ``path`` (None if absent), checked with ``lstat``.

    For files another library opens (LMDB follows symlinks): refuse anything
    but a regular file before handing it the path.
    """
    found = _lstat_as(path, stat.S_ISREG, "regular file")
    return None if found is None else found.st_size


def read_store_file(path: Path, *, limit: int | None = None) -> bytes:
    """The bytes of a regular store file, at most ``limit + 1`` of them.

    A result longer than ``limit`` means the file is larger than any the
    caller accepts: the file cannot make castore allocate what it likes.
    """
    fd = open_store_file(path, os.O_RDONLY)
    try:
        return _read_up_to(fd, limit)
    finally:
        os.close(fd)


def _read_up_to(fd: int, limit: int | None) -> bytes:
    pieces = []
    left = None if limit is None else limit + 1
    while left is None or left > 0:
        piece = os.read(fd, _READ_PIECE if left is None else min(left, _READ_PIECE))
        if not piece:
            break
        pieces.append(piece)
        if left is not None:
            left -= len(piece)
    return b"".join(pieces)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` (``os.write`` may write fewer than asked)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        done = os.write(fd, view)
        if done <= 0:
            raise OSError(errno.EIO, "write wrote nothing")
        view = view[done:]


def is_store_dir(path: Path) -> bool:
    """True if ``path`` is a real directory, False if absent; refuse anything else.

    ``lstat``, not ``stat``: a symlinked directory is refused, never followed.
    """
    return _lstat_as(path, stat.S_ISDIR, "directory") is not None


def _lstat_as(path: Path, is_kind: Any, expected: str) -> os.stat_result | None:
    """``lstat`` of ``path`` (None if absent), refusing any kind but the expected one."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    if not is_kind(found.st_mode):
        raise _unsafe(path, kind_of(found.st_mode), expected)
    return found


def make_store_dir(path: Path) -> Path:
    """Create directory ``path`` (its parent must exist) unless it exists; refuse a symlink."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    is_store_dir(path)
    return path


def write_error(phase: str, path: Path, exc: OSError) -> StoreError:
    """The typed error for an OSError while ``phase`` (e.g. "appending to the reflog")."""
    reason = exc.strerror or str(exc)
    error: StoreError
    if exc.errno in DISK_FULL:
        error = StoreFullError(f"disk full while {phase}: {reason}", phase=phase, path=str(path))
        error.errno = exc.errno  # still an OSError a caller can test for ENOSPC
    else:
        error = StoreError(f"failed while {phase}: {reason}", phase=phase, path=str(path))
    return error


@contextmanager
def writing(phase: str, path: Path) -> Iterator[None]:
    """Turn an OSError raised inside into the typed error of :func:`write_error`."""
    try:
        yield
    except CastoreError:
        raise
    except OSError as exc:
        raise write_error(phase, path, exc) from exc


def fsync_dir(path: Path) -> None:
    """Make a rename, link or unlink in the directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
