"""The interfaces of a repository's mutable parts: refs, reflog, tags, locks.

Chunks and objects sit behind :class:`castore.chunkstore.base.ChunkBackend`;
everything else a store keeps is one of these four. Each is small, names
records rather than files, and is what a new backend implements:

* :class:`RefTable`: per run, the newest published root, moved only by a
  compare-and-swap (the commit point, invariant 2).
* :class:`Reflog`: per run, an append-only sequence of records (one per
  advance and per generation garbage collection dropped), read forwards,
  incrementally (:class:`~castore.repo.records.ReflogView`) or backwards.
* :class:`TagTable`: named pointers to generations, replaced or deleted whole.
* :class:`StoreLocks`: the store-wide shared/exclusive lock (saves and tags
  shared, garbage collection exclusive), the per-run lock that orders ref
  advances with reflog appends, and the "open" lock compaction needs
  exclusively.

Implementations: :mod:`castore.repo.local` (a store directory; the embedded
default) and :mod:`castore.repo.memory` (one process, for tests). Every
implementation passes the contract suites in :mod:`castore.testing`.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from castore.errors import UnsupportedOperationError
from castore.format.hashing import Digest
from castore.repo.records import (
    DEFAULT_LOCK_TIMEOUT,
    PUBLISH_ACTIONS,
    PublishedStream,
    Record,
    ReflogView,
    RefValue,
)

# Entered with the ref's current value once an advance's checks pass, exited once
# the new value is written; see RefTable.advance.
AroundSwap = Callable[[RefValue | None], AbstractContextManager[None]]


class RefTable(abc.ABC):
    """Per run, the newest published root; moved only by compare-and-swap."""

    @abc.abstractmethod
    def read(self, run: str) -> RefValue | None:
        """The ref of ``run``, or None when it has none. Damage raises CorruptRefError."""

    @abc.abstractmethod
    def runs(self) -> list[str]:
        """The runs that have a ref (any order)."""

    @abc.abstractmethod
    def advance(
        self,
        run: str,
        *,
        expected: Digest | None,
        new: RefValue,
        around: AroundSwap | None = None,
        timeout: float = DEFAULT_LOCK_TIMEOUT,
    ) -> RefValue | None:
        """Compare-and-swap: make the ref of ``run`` name ``new``; return what it named.

        Atomic against every other advance of the run: refused with
        RefConflictError unless the ref names the root ``expected`` (None: the
        run has no ref) and ``new.generation`` is higher than its generation
        (:func:`castore.repo.records.check_advance`). ``around(current)``, when
        given, is entered after the checks pass and exited after ``new`` is
        written, while no other advance of the run can proceed: the reflog
        appends that must stay in ref order happen there. An error inside it
        before the write leaves the ref unchanged. ``timeout`` bounds the wait
        for other advances (StoreLockedError). Raises InvalidNameError for an
        unsafe run name and ValueError when ``new`` names another run.
        """


class Reflog(abc.ABC):
    """Per run, the records of every ref advance and collection, in append order.

    Records are dicts of the shape :func:`castore.repo.records.make_reflog_record`
    builds. Appends to one run are ordered by the caller (under the run lock of
    :class:`StoreLocks`, which ref advances also hold), so a reflog reads in
    the order the ref moved: increasing generation ids, a collection after the
    publish it cancels (docs/FORMAT.md, "Reflog").
    """

    @abc.abstractmethod
    def append(self, run: str, record: Record) -> None:
        """Add ``record`` durably after every record of ``run``."""

    @abc.abstractmethod
    def view(self, run: str, *, fresh: bool = False) -> ReflogView:
        """Every intact record of ``run`` and what they say, up to date.

        May be kept and extended between calls, so that reading a long reflog
        again costs only what was appended; ``fresh`` reads every record again
        (integrity tools). The view is shared with later calls: do not modify it.
        """

    @abc.abstractmethod
    def records_backwards(self, run: str) -> Iterator[Record]:
        """Intact records of ``run``, newest first, costing what the caller consumes."""

    @abc.abstractmethod
    def runs(self) -> list[str]:
        """The runs that have a reflog (any order)."""

    def location(self, run: str) -> str:
        """Where the reflog of ``run`` lives, for messages."""
        return f"the reflog of run {run!r}"

    def cached_view(self, run: str) -> ReflogView | None:
        """The view of ``run`` brought up to date when one is kept cheaply, else None."""
        return None

    def listed_with_id(self, run: str, generation: int) -> list[str]:
        """The roots (hex) the reflog lists under id ``generation``, in listing order.

        Listed: named by a publish record, not collected (:class:`ReflogView`'s
        ``listed``). An implementation may answer from a derived index (a new
        handle then reads a few records, not the whole log), as long as it
        answers what the view would.
        """
        return [root for root, listed in self.view(run).listed.items() if listed == generation]

    def index_problem(self, run: str) -> str | None:
        """Why the run's derived index (if it keeps one) disagrees with the records, or None.

        An index that is absent or damaged is not used, so it is no problem; one
        that passes its checks but summarises other records than the log holds
        (a log edited in place, a crafted index) would be trusted by lookups.
        """
        return None

    def rebuild_index(self, run: str) -> None:
        """Write the run's derived index afresh from every record (under the run lock)."""
        return None

    def read(self, run: str) -> tuple[list[Record], list[int]]:
        """Intact records and the positions of damaged ones, read afresh."""
        view = self.view(run, fresh=True)
        return list(view.records), list(view.damaged)

    def last_published(self, run: str) -> Record | None:
        """The newest intact publish record of ``run``, at a cost that does not grow with it."""
        for record in self.records_backwards(run):
            if record["action"] in PUBLISH_ACTIONS:
                return record
        return None

    def published_newest_first(self, run: str) -> PublishedStream:
        """The published, uncollected generations of ``run``, newest first.

        From the kept view when there is one, else read backwards, so a new
        handle listing the newest few generations reads only the end of a long log.
        """
        view = self.cached_view(run)
        if view is not None:
            return PublishedStream.from_view(view)
        return PublishedStream.from_records(self.records_backwards(run))


class TagTable(abc.ABC):
    """Per run, names that pin a generation (retention keeps what a tag names)."""

    @abc.abstractmethod
    def get(self, run: str, name: str) -> RefValue | None:
        """What tag ``name`` of ``run`` names; None when absent or ``name`` is no tag name."""

    @abc.abstractmethod
    def all(self, run: str) -> dict[str, RefValue]:
        """Every tag of ``run``, by name in sorted order. Damage raises."""

    @abc.abstractmethod
    def write(self, run: str, name: str, value: RefValue) -> None:
        """Point tag ``name`` at ``value``, replacing what it named (InvalidNameError)."""

    @abc.abstractmethod
    def delete(self, run: str, name: str) -> bool:
        """Remove a tag; False when there was none."""

    @abc.abstractmethod
    def runs(self) -> list[str]:
        """The runs with at least one tag (any order)."""


class LockHold:
    """A lock taken without a scope: released by :meth:`release` (once; later calls do nothing)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release
        self._guard = threading.Lock()

    def release(self) -> None:
        with self._guard:
            release, self._release = self._release, None
        if release is not None:
            release()

    @property
    def held(self) -> bool:
        return self._release is not None

    def __enter__(self) -> LockHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class StoreLocks(abc.ABC):
    """The locks of one store. Each excludes holders in other processes and threads alike.

    A lock that cannot be had within ``timeout`` seconds raises
    StoreLockedError with the message ``busy``.
    """

    @abc.abstractmethod
    def store_lock(
        self, *, exclusive: bool, timeout: float, busy: str
    ) -> AbstractContextManager[None]:
        """The store-wide lock: saves and tags hold it shared, garbage collection exclusive."""

    @abc.abstractmethod
    def run_lock(self, run: str, *, timeout: float, busy: str) -> AbstractContextManager[None]:
        """The exclusive lock of one run: ref advances and reflog appends take it."""

    @abc.abstractmethod
    def hold_open(self, *, exclusive: bool = False, busy: str = "") -> LockHold:
        """The open lock, without waiting: every open store shared, compaction exclusive."""

    def check_held(self) -> None:
        """Raise LockLostError if a store lock this process holds may have been broken.

        Kernel and in-process locks cannot be broken: nothing to check. Leases
        (castore.repo.leases) are checked before each step that acts on them.
        """
        return None


def unsupported(what: str, backend: str) -> UnsupportedOperationError:
    """The one-line error of an operation a backend cannot do."""
    return UnsupportedOperationError(f"{what} is not supported by the {backend} backend")
