"""The repository parts of a store directory (the embedded default), and ``RefStore``.

Layout (docs/FORMAT.md)::

    refs/RUN            one self-checking ref file per run (castore.repo.reffile)
    logs/RUN.reflog     the reflog: one checksummed JSON line per record (localreflog)
    logs/RUN.idx        derived: where the reflog lists each generation id (localreflog)
    tags/RUN/NAME       one ref-format file per tag
    locks/RUN.lock      flock target of the run lock (ref advances, reflog appends)
    locks/store.lock    flock: saves and tags shared, garbage collection exclusive
    locks/open.lock     flock: every open Store shared, compaction exclusive

A ref advance is a compare-and-swap under the run's exclusive ``flock``:
re-read the current value while holding the lock, refuse if it is not what the
writer based its generation on, then replace the file (temp, fsync, rename,
fsync of the directory). Every file is opened without following symlinks
(castore.support.safefs): a store from an untrusted source cannot redirect a write.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from castore.errors import StoreLockedError
from castore.format.hashing import Digest
from castore.repo.base import AroundSwap, LockHold, RefTable, StoreLocks, TagTable
from castore.repo.localreflog import LocalReflog, names_in
from castore.repo.records import (
    DEFAULT_LOCK_TIMEOUT,
    RefValue,
    check_advance,
    check_new_value,
    is_valid_name,
    run_lock_busy,
    validate_run_name,
    validate_stored_tag_name,
    validate_tag_name,
)
from castore.repo.reffile import encode_ref, read_ref_file, replace_file
from castore.repo.refstore import ComposedRefStore, RepoParts
from castore.support.safefs import (
    fsync_dir,
    is_store_dir,
    make_store_dir,
    open_store_file,
    regular_file_size,
    write_error,
    writing,
)

STORE_LOCK = "store.lock"  # saves and tags: shared; garbage collection: exclusive
OPEN_LOCK = "open.lock"  # every open Store: shared; compaction: exclusive


def ensure_store_dirs(root: Path) -> None:
    """Create ``refs/``, ``locks/`` and ``logs/`` (refusing a symlink in their place)."""
    for name in ("refs", "locks", "logs"):
        directory = root / name
        with writing(f"creating {name}/", directory):
            make_store_dir(directory)


# -- locks ------------------------------------------------------------------------


def _flock(fd: int, operation: int, timeout: float, busy: str) -> None:
    """``flock`` with a deadline, polling (flock itself cannot time out)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            if time.monotonic() >= deadline:
                raise StoreLockedError(busy) from None
            time.sleep(0.01)


class LocalLocks(StoreLocks):
    """``flock`` on files under ``locks/``: one open file description per holder.

    flock excludes by open file description, so two threads (or two Stores)
    of one process exclude each other as two processes do.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.locks_dir = root / "locks"

    def _open_lock_file(self, name: str) -> int:
        """Open (creating) ``locks/NAME`` for ``flock``; never through a symlink."""
        if not is_store_dir(self.locks_dir):  # one lstat, on every open of a store
            ensure_store_dirs(self.root)
        path = self.locks_dir / name
        try:
            return open_store_file(path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise write_error(f"creating the lock file {name}", path, exc) from exc

    @contextmanager
    def _held(self, name: str, operation: int, timeout: float, busy: str) -> Iterator[None]:
        fd = self._open_lock_file(name)
        try:
            _flock(fd, operation, timeout, busy)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def store_lock(
        self, *, exclusive: bool, timeout: float, busy: str
    ) -> AbstractContextManager[None]:
        return self._held(STORE_LOCK, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, timeout, busy)

    def run_lock(self, run: str, *, timeout: float, busy: str) -> AbstractContextManager[None]:
        validate_run_name(run)
        return self._held(f"{run}.lock", fcntl.LOCK_EX, timeout, busy)

    def hold_open(self, *, exclusive: bool = False, busy: str = "") -> LockHold:
        fd = self._open_lock_file(OPEN_LOCK)
        try:
            _flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, 0.0, busy)
        except BaseException:
            os.close(fd)
            raise
        return LockHold(lambda: os.close(fd))


# -- refs -------------------------------------------------------------------------


class LocalRefTable(RefTable):
    """``refs/RUN`` files, advanced under the run lock of ``locks``."""

    def __init__(self, root: Path, locks: LocalLocks) -> None:
        self.root = root
        self.refs_dir = root / "refs"
        self.locks = locks

    def read(self, run: str) -> RefValue | None:
        validate_run_name(run)
        if not is_store_dir(self.refs_dir):
            return None
        return read_ref_file(self.refs_dir / run, run=run)

    def runs(self) -> list[str]:
        return names_in(self.refs_dir, lambda name: name)

    def advance(
        self,
        run: str,
        *,
        expected: Digest | None,
        new: RefValue,
        around: AroundSwap | None = None,
        timeout: float = DEFAULT_LOCK_TIMEOUT,
    ) -> RefValue | None:
        check_new_value(run, new)
        with self.locks.run_lock(run, timeout=timeout, busy=run_lock_busy(run, timeout)):
            current = self.read(run)
            check_advance(run, current, expected=expected, new=new)
            if around is None:
                self._write(run, new)
            else:
                with around(current):
                    self._write(run, new)
            return current

    def _write(self, run: str, value: RefValue) -> None:
        ensure_store_dirs(self.root)
        replace_file(
            self.refs_dir / run, encode_ref(value), phase=f"writing the ref of run {run!r}"
        )


# -- tags -------------------------------------------------------------------------


class LocalTagTable(TagTable):
    """``tags/RUN/NAME`` files in the ref format, replaced whole."""

    def __init__(self, root: Path) -> None:
        self.tags_dir = root / "tags"

    def _path(self, run: str, name: str) -> Path:
        validate_run_name(run)
        validate_stored_tag_name(name, run=run)
        return self.tags_dir / run / name

    def write(self, run: str, name: str, value: RefValue) -> None:
        validate_tag_name(name, run=run)
        path = self._path(run, name)
        with writing(f"creating the tag directory of run {run!r}", path.parent):
            make_store_dir(self.tags_dir)
            make_store_dir(path.parent)
        replace_file(path, encode_ref(value), phase=f"writing tag {name!r} of run {run!r}")

    def delete(self, run: str, name: str) -> bool:
        path = self._path(run, name)
        # Checked, or a symlinked tags/RUN/ would have us delete a file outside the store.
        if not (is_store_dir(self.tags_dir) and is_store_dir(path.parent)):
            return False
        if regular_file_size(path) is None:  # refuses a directory or a device in its place
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        fsync_dir(path.parent)
        return True

    def get(self, run: str, name: str) -> RefValue | None:
        validate_run_name(run)
        if not is_valid_name(name):
            return None
        directory = self.tags_dir / run
        if not (is_store_dir(self.tags_dir) and is_store_dir(directory)):
            return None
        return read_ref_file(directory / name, run=run)

    def all(self, run: str) -> dict[str, RefValue]:
        validate_run_name(run)
        directory = self.tags_dir / run
        if not (is_store_dir(self.tags_dir) and is_store_dir(directory)):
            return {}
        found = {}
        for name in sorted(os.listdir(directory)):
            if is_valid_name(name):
                value = read_ref_file(directory / name, run=run)
                if value is not None:  # deleted since the listing
                    found[name] = value
        return found

    def runs(self) -> list[str]:
        # An untagged run leaves its empty directory behind: that names nothing.
        def tagged(name: str) -> str | None:
            directory = self.tags_dir / name
            return name if is_store_dir(directory) and os.listdir(directory) else None

        return names_in(self.tags_dir, tagged)


# -- the composition --------------------------------------------------------------


class RefStore(ComposedRefStore):
    """The ref files, locks, tags and reflogs of one store directory."""

    backend_name = "local directory"

    def __init__(self, root: Path, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        locks = LocalLocks(root)
        self.root = root
        self._reflog = LocalReflog(root)
        super().__init__(
            RepoParts(LocalRefTable(root, locks), self._reflog, LocalTagTable(root), locks),
            lock_timeout=lock_timeout,
        )
        self.identity = f"dir:{os.path.realpath(root)}"

    def ensure_dirs(self) -> None:
        ensure_store_dirs(self.root)

    def reflog_path(self, run: str) -> Path:
        return self._reflog.path(run)
