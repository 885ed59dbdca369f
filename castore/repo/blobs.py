"""The repository parts of format 3 over the blob interface.

Refs, reflog records and tags as
named blobs of a :class:`castore.blob.base.BlobStore` (memory, a shared
directory, S3); docs/FORMAT_BLOBS.md, "Refs, reflog records and tags as blobs"::

    refs/RUN                    mutable: the ref encoding of castore.repo.reffile
    logs/RUN/...                the reflog's records and their index (castore.repo.blobreflog)
    tags/RUN/NAME               mutable: the ref encoding, naming the tagged generation
    locks/runs/RUN              mutable: the run's lease (a holder record, or free)
    locks/store/...             the store leases (castore.repo.leases)

A ref advance is one compare-and-swap on ``refs/RUN``: read it with its
version, run the checks every ref table runs (``check_advance``), then swap
from that version. A writer that lost the swap re-reads the ref and raises
RefConflictError as a local store does; it never writes a reflog record (the
record is appended in ``around`` after the swap succeeds). So two writers on
two nodes racing from one root give one winner and one record.

**Locks.** The run lock is a lease blob ``locks/runs/RUN`` (:class:`RunLeases`)
as well as an in-process lock, so the advances and reflog records of one run
are ordered across processes and nodes; a lease left by a killed holder is
taken over after ``stale_after`` seconds of no change. The store lock is a
store lease (:mod:`castore.repo.leases`): garbage collection is kept apart from
saves on every node. The ref's compare-and-swap holds regardless: of advances from one
root, at most one wins, even when a stalled holder's lease was taken over
(then only the reflog's order is no longer guaranteed).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from castore.blob.base import BlobStore, Version
from castore.errors import (
    BlobConflictError,
    BlobTooLargeError,
    CastoreError,
    CommitUnknownError,
    CorruptRefError,
    LeaseLostWarning,
    RefConflictError,
    StoreLockedError,
    StoreUnavailableError,
)
from castore.format.hashing import Digest
from castore.repo.base import AroundSwap, RefTable, TagTable
from castore.repo.blobreflog import BlobReflog, runs_under
from castore.repo.leases import DEFAULT_STORE_LEASE, StoreLeases
from castore.repo.memory import MemoryLocks
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
from castore.repo.reffile import decode_ref, encode_ref
from castore.repo.refstore import ComposedRefStore, RepoParts

# A run's lease blob when nobody holds it.
LEASE_FREE = b'{"free":true}'
# Seconds a waiter watches an unchanged run lease before taking it over: a run lock
# is held for one ref swap and one record create, far less than this.
DEFAULT_STALE_LEASE = 20.0
_POLL_FIRST, _POLL_MOST = 0.002, 0.1


def ref_blob(run: str) -> str:
    return f"refs/{validate_run_name(run)}"


def tag_blob(run: str, name: str) -> str:
    return f"tags/{validate_run_name(run)}/{validate_stored_tag_name(name, run=run)}"


def _read_ref_blob(blobs: BlobStore, name: str, run: str) -> tuple[RefValue, Version] | None:
    try:
        found = blobs.read_versioned(name)
    except BlobTooLargeError as exc:
        raise CorruptRefError(f"blob {name!r} is larger than any ref", run=run) from exc
    if found is None:
        return None
    data, version = found
    return decode_ref(data, run=run), version


def _landed(blobs: BlobStore, name: str, data: bytes) -> Version | None:
    """After a swap whose answer was lost: the blob's version if it holds ``data`` (the
    write landed), else None. A failed read raises."""
    found = blobs.read_versioned(name)
    return found[1] if found is not None and found[0] == data else None


# -- locks ------------------------------------------------------------------------


@dataclass(frozen=True)
class _HeldLease:
    name: str
    version: Version


class RunLeases:
    """Per run, a lease blob ``locks/runs/RUN`` that excludes other processes and nodes.

    The blob holds a record unique to each acquisition (holder and token) or
    the free record. Taking it is a compare-and-swap from the free record (or
    from absent); releasing it, a swap back to free from the version taken.
    A waiter takes over a lease only after watching the *same* version for
    ``stale_after`` seconds on its own monotonic clock, so nodes' clocks need
    not agree and a killed holder blocks its run for ``stale_after`` at most.
    A holder that stalls longer than that loses the lease (its release warns,
    LeaseLostWarning): its advance is still refused by the ref's
    compare-and-swap if another moved the ref, but the run's reflog order is
    then no longer guaranteed.
    """

    def __init__(self, blobs: BlobStore, *, stale_after: float = DEFAULT_STALE_LEASE) -> None:
        if stale_after <= 0:
            raise ValueError(f"stale_after must be positive, got {stale_after}")
        self.blobs = blobs
        self.stale_after = stale_after

    def acquire(self, run: str, *, timeout: float, busy: str) -> _HeldLease:
        name = f"locks/runs/{validate_run_name(run)}"
        record = json.dumps(
            {
                "holder": f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}",
                "token": secrets.token_hex(16),
            },
            sort_keys=True,
        ).encode()
        deadline = time.monotonic() + timeout
        watched: tuple[Version, float] | None = None
        pause = _POLL_FIRST
        while True:
            found = self.blobs.read_versioned(name)
            version = None if found is None else found[1]
            now = time.monotonic()
            takeover = watched is not None and watched[0] == version
            if (
                found is None
                or found[0] == LEASE_FREE
                or (takeover and watched is not None and now - watched[1] >= self.stale_after)
            ):
                try:
                    return _HeldLease(name, self.blobs.swap(name, record, version))
                except BlobConflictError:
                    watched = None  # someone else took it or let it go: look again
                    continue
                except StoreUnavailableError:
                    # Its answer was lost: if it landed the lease is ours (its token is
                    # unique); walking away would leave it held until stale_after.
                    taken = _landed(self.blobs, name, record)
                    if taken is None:
                        raise
                    return _HeldLease(name, taken)
            if not takeover:
                watched = (version, now) if version is not None else None
            if now >= deadline:
                raise StoreLockedError(busy)
            time.sleep(min(pause * (0.5 + random.random()), max(0.0, deadline - now)))
            pause = min(2 * pause, _POLL_MOST)

    def release(self, held: _HeldLease) -> None:
        try:
            self.blobs.swap(held.name, LEASE_FREE, held.version)
        except BlobConflictError:
            warnings.warn(
                f"the lease {held.name!r} was taken over while held (held longer than "
                f"{self.stale_after:.0f}s); the reflog of its run may be out of order",
                LeaseLostWarning,
                stacklevel=4,
            )
        except StoreUnavailableError as lost:
            # Released after the work it guarded (a published advance): its failure
            # must not make that work raise. Unreleased, it is taken over after stale_after.
            try:
                freed = _landed(self.blobs, held.name, LEASE_FREE) is not None
            except CastoreError:
                freed = False
            if not freed:
                warnings.warn(
                    f"the lease {held.name!r} could not be released ({lost.message}); other "
                    f"writers of its run take it over after {self.stale_after:.0f}s",
                    LeaseLostWarning,
                    stacklevel=4,
                )


class BlobStoreLocks(MemoryLocks):
    """The store, run and open locks of a blob store.

    With ``blobs``, the run lock is also a lease blob (:class:`RunLeases`), so
    ref advances and their reflog records of one run are ordered across
    processes and nodes, and the store lock is also a store lease
    (:class:`castore.repo.leases.StoreLeases`), so garbage collection on one
    node is kept apart from saves on every other. The open lock is held in
    this process only (compaction, its one exclusive holder, does not apply
    to blob stores).
    """

    def __init__(
        self,
        blobs: BlobStore | None = None,
        *,
        stale_after: float = DEFAULT_STALE_LEASE,
        store_lease: float = DEFAULT_STORE_LEASE,
    ) -> None:
        super().__init__()
        self.leases = None if blobs is None else RunLeases(blobs, stale_after=stale_after)
        self.store_leases = None if blobs is None else StoreLeases(blobs, stale_after=store_lease)

    def store_lock(
        self, *, exclusive: bool, timeout: float, busy: str
    ) -> AbstractContextManager[None]:
        if self.store_leases is None:
            return super().store_lock(exclusive=exclusive, timeout=timeout, busy=busy)
        return self._store_leased(exclusive, timeout, busy)

    @contextmanager
    def _store_leased(self, exclusive: bool, timeout: float, busy: str) -> Iterator[None]:
        assert self.store_leases is not None
        deadline = time.monotonic() + timeout
        with super().store_lock(exclusive=exclusive, timeout=timeout, busy=busy):
            left = max(0.0, deadline - time.monotonic())
            with self.store_leases.held(exclusive=exclusive, timeout=left, busy=busy):
                yield

    def check_held(self) -> None:
        if self.store_leases is not None:
            self.store_leases.check_held()

    def run_lock(self, run: str, *, timeout: float, busy: str) -> AbstractContextManager[None]:
        if self.leases is None:
            return super().run_lock(run, timeout=timeout, busy=busy)
        return self._leased(run, timeout, busy)

    @contextmanager
    def _leased(self, run: str, timeout: float, busy: str) -> Iterator[None]:
        assert self.leases is not None
        deadline = time.monotonic() + timeout
        # This process's threads queue in memory first, so only one of them polls the blob.
        with super().run_lock(run, timeout=timeout, busy=busy):
            left = max(0.0, deadline - time.monotonic())
            held = self.leases.acquire(run, timeout=left, busy=busy)
            try:
                yield
            finally:
                self.leases.release(held)


# -- refs -------------------------------------------------------------------------


class BlobRefTable(RefTable):
    """``refs/RUN`` blobs, advanced by compare-and-swap on the blob's version."""

    def __init__(self, blobs: BlobStore, locks: BlobStoreLocks | None = None) -> None:
        self.blobs = blobs
        self.locks = locks or BlobStoreLocks()

    def read(self, run: str) -> RefValue | None:
        found = _read_ref_blob(self.blobs, ref_blob(run), run)
        return None if found is None else found[0]

    def runs(self) -> list[str]:
        return runs_under(self.blobs, "refs/", nested=False)

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
        name = ref_blob(run)
        # The run lock orders this process's threads (and their reflog appends);
        # other processes are kept out of a stale swap by the blob's version alone.
        with self.locks.run_lock(run, timeout=timeout, busy=run_lock_busy(run, timeout)):
            found = _read_ref_blob(self.blobs, name, run)
            current, version = (None, None) if found is None else found
            check_advance(run, current, expected=expected, new=new)
            if around is None:
                self._swap_checked(run, name, new, version, expected)
            else:
                with around(current):
                    self._swap_checked(run, name, new, version, expected)
            return current

    def _swap_checked(
        self,
        run: str,
        name: str,
        new: RefValue,
        version: Version | None,
        expected: Digest | None,
    ) -> None:
        try:
            self._swap(name, encode_ref(new), version)
        except BlobConflictError:
            # Another node moved the ref between our read and our swap: say so as
            # the checks would have, had they seen its value. Unless the value is
            # ours: a retried swap whose first attempt had landed.
            moved = self.read(run)
            if _names(moved, new):
                return
            check_advance(run, moved, expected=expected, new=new)
            raise RefConflictError(
                f"ref of run {run!r} changed while advancing to generation "
                f"{new.generation}; reload and retry",
                run=run,
            ) from None
        except StoreUnavailableError as lost:
            self._settle(run, new, expected, lost)

    def _settle(
        self, run: str, new: RefValue, expected: Digest | None, lost: StoreUnavailableError
    ) -> None:
        """After a swap whose answer never came (a broken connection, a timeout, 5xx past
        the retries), learn from the ref itself whether it landed: return if the ref
        names ``new`` (published: the caller must hear success, and logs it once), raise
        if it does not (RefConflictError when another root is there). The ref still
        naming the parent proves nothing lasting unless the store proves the swap was
        never sent (``lost.unsent``: StoreUnavailableError, not published): otherwise,
        as when the ref cannot be read either, CommitUnknownError."""
        try:
            current = self.read(run)
        except CastoreError as unreadable:
            raise CommitUnknownError(
                f"generation {new.generation} of run {run!r} may or may not be published: "
                f"the answer to its ref's compare-and-swap was lost ({lost.message}) and "
                f"reading the ref again failed ({unreadable.message}); check `castore log "
                f"STORE --run {run}` (STORE: {self.blobs!r}) before saving again",
                run=run,
                generation=new.generation,
            ) from lost
        if _names(current, new):
            return
        if (current.root if current else None) != expected:
            check_advance(run, current, expected=expected, new=new)  # names the other root
            raise RefConflictError(
                f"ref of run {run!r} moved to another root while advancing to generation "
                f"{new.generation}; reload and retry",
                run=run,
            ) from lost
        if lost.unsent:
            raise StoreUnavailableError(
                f"generation {new.generation} of run {run!r} was not published: its ref's "
                f"compare-and-swap never reached the store ({lost.message}) and the ref "
                "still names the previous generation; save again when the store answers",
                run=run,
            ) from lost
        # The swap may have reached a server that has not applied it yet: a read
        # timeout proves nothing, and the write can still land after this re-read.
        raise CommitUnknownError(
            f"generation {new.generation} of run {run!r} may or may not be published: the "
            f"answer to its ref's compare-and-swap was lost ({lost.message}); the ref still "
            "names the previous generation, but the store may apply the swap later. Check "
            f"`castore log STORE --run {run}` (STORE: {self.blobs!r}) before saving again",
            run=run,
            generation=new.generation,
        ) from lost

    def _swap(self, name: str, data: bytes, version: Version | None) -> None:
        """The commit point: replace ``name`` only if it is still at ``version``."""
        self.blobs.swap(name, data, version)


def _names(current: RefValue | None, new: RefValue) -> bool:
    """Whether the ref's value is the one an advance was writing (the same root and id)."""
    return current is not None and (current.root, current.generation) == (new.root, new.generation)


# -- tags -------------------------------------------------------------------------


class BlobTagTable(TagTable):
    """``tags/RUN/NAME`` blobs in the ref encoding; a write replaces whatever is there."""

    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs

    def get(self, run: str, name: str) -> RefValue | None:
        validate_run_name(run)
        if not is_valid_name(name):
            return None
        found = _read_ref_blob(self.blobs, tag_blob(run, name), run)
        return None if found is None else found[0]

    def all(self, run: str) -> dict[str, RefValue]:
        prefix = f"tags/{validate_run_name(run)}/"
        found = {}
        for blob in self.blobs.list(prefix):
            name = blob[len(prefix) :]
            if is_valid_name(name):
                value = self.get(run, name)
                if value is not None:  # deleted since the listing
                    found[name] = value
        return dict(sorted(found.items()))

    def write(self, run: str, name: str, value: RefValue) -> None:
        blob = tag_blob(run, validate_tag_name(name, run=run))
        data = encode_ref(value)
        while True:  # last writer wins, as a rename over a local tag file does
            found = self.blobs.read_versioned(blob)
            try:
                self.blobs.swap(blob, data, None if found is None else found[1])
                return
            except BlobConflictError:
                continue
            except StoreUnavailableError:
                if _landed(self.blobs, blob, data) is None:  # its answer lost, not its write
                    raise
                return

    def delete(self, run: str, name: str) -> bool:
        return self.blobs.delete(tag_blob(run, name))

    def runs(self) -> list[str]:
        return runs_under(self.blobs, "tags/", nested=True)


# -- the composition --------------------------------------------------------------


class BlobRefStore(ComposedRefStore):
    """Refs, reflog records and tags as blobs; run leases and store leases."""

    backend_name = "blob"

    def __init__(
        self,
        blobs: BlobStore,
        *,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        store_lease: float = DEFAULT_STORE_LEASE,
    ) -> None:
        locks = BlobStoreLocks(blobs, store_lease=store_lease)
        self.blobs = blobs
        parts = RepoParts(BlobRefTable(blobs, locks), BlobReflog(blobs), BlobTagTable(blobs), locks)
        super().__init__(parts, lock_timeout=lock_timeout)


def blob_refs(
    blobs: BlobStore,
    *,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    store_lease: float = DEFAULT_STORE_LEASE,
) -> BlobRefStore:
    """The refs, reflog, tags and locks (see BlobStoreLocks) of a store laid out on ``blobs``."""
    return BlobRefStore(blobs, lock_timeout=lock_timeout, store_lease=store_lease)
