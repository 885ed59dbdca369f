"""In-memory repository parts (refs, reflog, tags, locks), for tests.

Thread-safe, lost when the process ends, shared by nothing outside it. The
locks honour the same shared/exclusive semantics and timeouts as the local
``flock`` ones, between threads. Records and values are copied in and out,
so a caller never shares a mutable object with the store.

What a store in memory cannot do, it refuses in one line
(UnsupportedOperationError): it has no reflog file to name, and the
offline tools that take a path (``compact``, ``repair --rebuild-index``)
never see it. A whole ``Store`` in memory is built by
:func:`castore.opening.memory.memory_store`, which this module still answers
for under its documented name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from castore.errors import StoreLockedError
from castore.format.hashing import Digest
from castore.repo.base import AroundSwap, LockHold, Reflog, RefTable, StoreLocks, TagTable
from castore.repo.records import (
    DEFAULT_LOCK_TIMEOUT,
    Record,
    ReflogView,
    RefValue,
    check_advance,
    check_new_value,
    is_reflog_record,
    is_valid_name,
    run_lock_busy,
    validate_run_name,
    validate_stored_tag_name,
    validate_tag_name,
)
from castore.repo.refstore import ComposedRefStore, RepoParts

if TYPE_CHECKING:
    from castore.opening.memory import memory_store as memory_store


class SharedExclusiveLock:
    """Many shared holders or one exclusive holder, waited for with a deadline.

    Not reentrant and not owned by a thread: like ``flock`` on a new open file
    description, a thread that holds it shared and asks for it exclusively waits
    (and times out). Waiting exclusive holders do not block new shared ones.
    """

    def __init__(self) -> None:
        self._state = threading.Condition()
        self._shared = 0
        self._exclusive = False

    def acquire(self, *, exclusive: bool, timeout: float, busy: str) -> None:
        deadline = time.monotonic() + timeout
        with self._state:
            while self._exclusive or (exclusive and self._shared):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreLockedError(busy)
                self._state.wait(left)
            if exclusive:
                self._exclusive = True
            else:
                self._shared += 1

    def release(self, *, exclusive: bool) -> None:
        with self._state:
            if exclusive:
                self._exclusive = False
            else:
                self._shared -= 1
            self._state.notify_all()

    @contextmanager
    def held(self, *, exclusive: bool, timeout: float, busy: str) -> Iterator[None]:
        self.acquire(exclusive=exclusive, timeout=timeout, busy=busy)
        try:
            yield
        finally:
            self.release(exclusive=exclusive)


class MemoryLocks(StoreLocks):
    """The store, run and open locks of one in-memory store."""

    def __init__(self) -> None:
        self._store = SharedExclusiveLock()
        self._open = SharedExclusiveLock()
        self._runs: dict[str, SharedExclusiveLock] = {}
        self._runs_guard = threading.Lock()

    def store_lock(
        self, *, exclusive: bool, timeout: float, busy: str
    ) -> AbstractContextManager[None]:
        return self._store.held(exclusive=exclusive, timeout=timeout, busy=busy)

    def run_lock(self, run: str, *, timeout: float, busy: str) -> AbstractContextManager[None]:
        validate_run_name(run)
        with self._runs_guard:
            lock = self._runs.setdefault(run, SharedExclusiveLock())
        return lock.held(exclusive=True, timeout=timeout, busy=busy)

    def hold_open(self, *, exclusive: bool = False, busy: str = "") -> LockHold:
        self._open.acquire(exclusive=exclusive, timeout=0.0, busy=busy)
        return LockHold(lambda: self._open.release(exclusive=exclusive))


class MemoryRefTable(RefTable):
    """A dict of refs, advanced under the run lock of ``locks`` (shared with the reflog)."""

    def __init__(self, locks: MemoryLocks | None = None) -> None:
        self.locks = locks or MemoryLocks()
        self._refs: dict[str, RefValue] = {}

    def read(self, run: str) -> RefValue | None:
        validate_run_name(run)
        return self._refs.get(run)  # RefValue is frozen: nothing to copy

    def runs(self) -> list[str]:
        return list(self._refs)

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
            current = self._refs.get(run)
            check_advance(run, current, expected=expected, new=new)
            if around is None:
                self._refs[run] = new
            else:
                with around(current):
                    self._refs[run] = new
            return current


class MemoryReflog(Reflog):
    """A list of records per run; every view is kept and extended in place."""

    def __init__(self) -> None:
        self._records: dict[str, list[Record]] = {}
        self._views: dict[str, ReflogView] = {}
        self._guard = threading.Lock()

    def append(self, run: str, record: Record) -> None:
        validate_run_name(run)
        if not is_reflog_record(record, run):
            raise ValueError(f"not a reflog record of run {run!r}: {record!r}")
        with self._guard:
            self._records.setdefault(run, []).append(dict(record))

    def view(self, run: str, *, fresh: bool = False) -> ReflogView:
        validate_run_name(run)
        with self._guard:
            records = self._records.get(run, [])
            view = None if fresh else self._views.get(run)
            if view is None:
                view = ReflogView()
            for record in records[len(view.records) :]:
                view.add(dict(record))
            self._views[run] = view
            return view

    def cached_view(self, run: str) -> ReflogView | None:
        return self.view(run)

    def records_backwards(self, run: str) -> Iterator[Record]:
        validate_run_name(run)
        with self._guard:
            records = list(self._records.get(run, []))
        return (dict(record) for record in reversed(records))

    def runs(self) -> list[str]:
        with self._guard:
            return [run for run, records in self._records.items() if records]

    def location(self, run: str) -> str:
        return f"the in-memory reflog of run {run!r}"


class MemoryTagTable(TagTable):
    """A dict of tags per run."""

    def __init__(self) -> None:
        self._tags: dict[str, dict[str, RefValue]] = {}
        self._guard = threading.Lock()

    def get(self, run: str, name: str) -> RefValue | None:
        validate_run_name(run)
        if not is_valid_name(name):
            return None
        with self._guard:
            return self._tags.get(run, {}).get(name)

    def all(self, run: str) -> dict[str, RefValue]:
        validate_run_name(run)
        with self._guard:
            return dict(sorted(self._tags.get(run, {}).items()))

    def write(self, run: str, name: str, value: RefValue) -> None:
        validate_run_name(run)
        validate_tag_name(name, run=run)
        with self._guard:
            self._tags.setdefault(run, {})[name] = value

    def delete(self, run: str, name: str) -> bool:
        validate_run_name(run)
        validate_stored_tag_name(name, run=run)
        with self._guard:
            return self._tags.get(run, {}).pop(name, None) is not None

    def runs(self) -> list[str]:
        with self._guard:
            return [run for run, tags in self._tags.items() if tags]


class MemoryRefStore(ComposedRefStore):
    """Refs, reflog, tags and locks of a store in memory."""

    backend_name = "in-memory"

    def __init__(self, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        locks = MemoryLocks()
        parts = RepoParts(MemoryRefTable(locks), MemoryReflog(), MemoryTagTable(), locks)
        super().__init__(parts, lock_timeout=lock_timeout)


def __getattr__(name: str) -> Any:
    """``castore.repo.memory.memory_store``, the documented path (docs/DEVELOPMENT.md).

    A whole store is built on the opening floor, above the repository parts
    (castore.opening.memory); a module-level import of it here would be a
    cycle, so it is found on first use.
    """
    if name == "memory_store":
        from castore.opening.memory import memory_store

        return memory_store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
