"""The parts of a repository composed under the names a ``Store`` calls (``store.refs``).

:class:`ComposedRefStore` holds one implementation of each interface of
:mod:`castore.repo.base` and adds what is the same on every backend: a ref
advance logs itself (and first logs an earlier advance whose record a crash
lost), a collection is logged before anything is deleted, and the run list
is every run any durable record names. :class:`castore.repo.local.RefStore`
(a store directory) and :class:`castore.repo.memory.MemoryRefStore` are the two
compositions.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from castore.errors import CastoreError, ReflogWarning
from castore.format.hashing import Digest
from castore.repo.base import (
    AroundSwap,
    LockHold,
    Reflog,
    RefTable,
    StoreLocks,
    TagTable,
    unsupported,
)
from castore.repo.records import (
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_SAVE_WAIT,
    PublishedStream,
    Record,
    ReflogView,
    RefValue,
    is_valid_name,
    make_reflog_record,
    run_lock_busy,
    validate_run_name,
)
from castore.support.readonly import ReadOnly


@dataclass(frozen=True)
class RepoParts:
    """One implementation of each mutable part of a repository."""

    refs: RefTable
    reflog: Reflog
    tags: TagTable
    locks: StoreLocks


class ComposedRefStore:
    """Refs, reflog, tags and locks of one store, behind the methods ``Store`` calls."""

    backend_name = "composed"  # what unsupported-operation messages call this backend

    def __init__(self, parts: RepoParts, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        self.parts = parts
        self.lock_timeout = lock_timeout
        self.save_wait = DEFAULT_SAVE_WAIT
        # Names the store for what a process knows of its runs (castore.core.fencing):
        # handles on one store must agree, so a store on disk or blobs sets it.
        self.identity = f"{type(self).__name__}:{id(self)}"
        # Set by a read-only open: every lock and write below is refused before it acts.
        self.readonly: ReadOnly | None = None

    def refuse_if_readonly(self, what: str) -> None:
        """Raise ReadOnlyStoreError naming ``what`` if the store is open read-only."""
        if self.readonly is not None:
            raise self.readonly.refuse(what)

    # -- locks --------------------------------------------------------------

    def store_lock(
        self, *, exclusive: bool, timeout: float, busy: str
    ) -> AbstractContextManager[None]:
        """The store-wide lock: shared by saves and tags, exclusive for GC.

        Only writers take it (reads take no lock), so a read-only store refuses it:
        on a store on blobs it is a lease, itself a write.
        """
        self.refuse_if_readonly("taking the store lock")
        return self.parts.locks.store_lock(exclusive=exclusive, timeout=timeout, busy=busy)

    def check_store_lock(self) -> None:
        """Raise LockLostError if this process's store lock may have been broken (leases)."""
        self.parts.locks.check_held()

    def hold_open(self, *, exclusive: bool = False, busy: str = "") -> LockHold:
        """The open lock, without waiting: every open store shared, compaction exclusive."""
        self.refuse_if_readonly("taking the open lock")  # a read-only open takes its own
        return self.parts.locks.hold_open(exclusive=exclusive, busy=busy)

    def locked(self, run: str) -> AbstractContextManager[None]:
        """Hold the run's exclusive ref lock, waiting at most ``lock_timeout``."""
        validate_run_name(run)
        self.refuse_if_readonly(f"locking the ref of run {run!r}")
        return self.parts.locks.run_lock(
            run, timeout=self.lock_timeout, busy=run_lock_busy(run, self.lock_timeout)
        )

    # -- refs ---------------------------------------------------------------

    def runs(self) -> list[str]:
        """Every run any durable record names: a ref, a reflog or a tag.

        A run whose ref was lost still has history that garbage collection must
        see (and refuse to collect), so refs alone are not enough.
        """
        named = set(self.ref_runs()) | set(self.parts.reflog.runs()) | set(self.parts.tags.runs())
        return sorted(run for run in named if is_valid_name(run))

    def ref_runs(self) -> list[str]:
        """The runs that have a ref."""
        return sorted(self.parts.refs.runs())

    def read(self, run: str) -> RefValue | None:
        """The current ref of ``run``, or None if the run has none."""
        validate_run_name(run)
        return self.parts.refs.read(run)

    def advance(
        self,
        run: str,
        *,
        expected: Digest | None,
        new: RefValue,
        wrote: dict[str, int] | None = None,
    ) -> None:
        """Compare-and-swap the ref of ``run`` from ``expected`` to ``new``, and log it
        (with ``wrote``, what a copy publishing here wrote: make_reflog_record)."""
        self.refuse_if_readonly(f"advancing the ref of run {run!r}")
        self.parts.refs.advance(
            run,
            expected=expected,
            new=new,
            around=self._logged_advance(run, new, wrote),
            timeout=self.lock_timeout,
        )

    def _logged_advance(
        self, run: str, new: RefValue, wrote: dict[str, int] | None = None
    ) -> AroundSwap:
        @contextmanager
        def around(current: RefValue | None) -> Iterator[None]:
            self._reconcile_reflog(run, current)
            # Last: right before the swap that publishes, a store lease must still be safe.
            self.parts.locks.check_held()
            yield
            # Published: readers see the new root now, so the caller must hear success.
            # A missing record is appended by the next advance (_reconcile_reflog).
            try:
                parent = current.root if current else None
                self.append_reflog(run, new, parent=parent, action="advance", wrote=wrote)
            except CastoreError as exc:
                warnings.warn(
                    f"generation {new.generation} of run {run!r} is published, but its reflog "
                    f"record was not written ({exc}); the next save of the run records it",
                    ReflogWarning,
                    stacklevel=5,  # past contextlib and the ref table: the advance's caller
                )

        return around

    def _reconcile_reflog(self, run: str, current: RefValue | None) -> None:
        # A writer killed between the ref write and its reflog append leaves the
        # ref ahead of the log; record that advance before adding the next one.
        if current is None:
            return
        last = self.last_published(run)
        if last is None or last["root"] != current.root.hex:
            parent = Digest.from_hex(last["root"]) if last else None
            self.append_reflog(run, current, parent=parent, action="recovered")

    # -- tags ---------------------------------------------------------------

    def write_tag(self, run: str, name: str, value: RefValue) -> None:
        """Point tag ``name`` of ``run`` at a generation (replacing what it named)."""
        self.refuse_if_readonly("tag")
        self.parts.tags.write(run, name, value)

    def delete_tag(self, run: str, name: str) -> bool:
        """Remove a tag; False when there was none."""
        self.refuse_if_readonly("untag")
        return self.parts.tags.delete(run, name)

    def tag(self, run: str, name: str) -> RefValue | None:
        """The generation tag ``name`` of ``run`` names; None when there is no such tag."""
        return self.parts.tags.get(run, name)

    def tags(self, run: str) -> dict[str, RefValue]:
        """Every tag of ``run``: name -> the generation it names (damage raises)."""
        return self.parts.tags.all(run)

    # -- reflog -------------------------------------------------------------

    def reflog_path(self, run: str) -> Path:
        """The reflog file of ``run``: only a store directory has one."""
        raise unsupported("a reflog file path", self.backend_name)

    def reflog_location(self, run: str) -> str:
        """Where the reflog of ``run`` lives, for messages."""
        return self.parts.reflog.location(run)

    def append_reflog(
        self,
        run: str,
        value: RefValue,
        *,
        parent: Digest | None,
        action: str,
        wrote: dict[str, int] | None = None,
    ) -> None:
        self.refuse_if_readonly(f"appending to the reflog of run {run!r}")
        record = make_reflog_record(run, value, parent=parent, action=action, wrote=wrote)
        self.parts.reflog.append(run, record)

    def reflog(self, run: str) -> list[Record]:
        """Every intact reflog record of ``run``, oldest first (torn lines skipped)."""
        return self.read_reflog(run)[0]

    def read_reflog(self, run: str) -> tuple[list[Record], list[int]]:
        """Intact records, and the positions (1-based lines) of damaged ones, read afresh.

        ``verify`` and ``gc`` call this: they read every record again.
        """
        return self.parts.reflog.read(run)

    def reflog_view(self, run: str, *, fresh: bool = False) -> ReflogView:
        """What the reflog of ``run`` says, reading only what was appended since last time."""
        return self.parts.reflog.view(run, fresh=fresh)

    def listed_with_id(self, run: str, generation: int) -> list[str]:
        """The roots (hex) the reflog lists, published and not collected, under id
        ``generation``, in listing order: what a lookup by id reads first."""
        return self.parts.reflog.listed_with_id(run, generation)

    def reflog_index_problem(self, run: str) -> str | None:
        """Why the reflog's derived index disagrees with the reflog (None: it does not)."""
        validate_run_name(run)
        return self.parts.reflog.index_problem(run)

    def rebuild_reflog_index(self, run: str) -> None:
        """Write the reflog's derived index afresh from the reflog; hold the run lock."""
        self.refuse_if_readonly(f"rebuilding the reflog index of run {run!r}")
        validate_run_name(run)
        self.parts.reflog.rebuild_index(run)

    def last_published(self, run: str) -> Record | None:
        """The newest intact publish record of ``run``'s reflog, reading from the end."""
        return self.parts.reflog.last_published(run)

    def records_backwards(self, run: str) -> Iterator[Record]:
        """Intact reflog records of ``run``, newest first."""
        return self.parts.reflog.records_backwards(run)

    def published_newest_first(self, run: str) -> PublishedStream:
        """The published, uncollected generations the reflog names, newest first."""
        return self.parts.reflog.published_newest_first(run)

    def record_collected(self, run: str, generation: int, root: Digest) -> None:
        """Log that garbage collection dropped a generation (before deleting it)."""
        value = RefValue(run, generation, root, time.time())
        self.append_reflog(run, value, parent=None, action="collect")
