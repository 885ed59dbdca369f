"""The store lock across nodes: lease blobs that saves hold shared and collection exclusive.

On object storage and across nodes there is no kernel lock, yet garbage
collection must never delete a chunk that a save on another node has found
present and decided to reuse (invariant 6). Two kinds of lease blob do it:

* ``locks/store/saves/<token>`` -- one per shared holder (a save from its
  first presence check to its publish, a tag write), created by the holder.
* ``locks/store/gc`` -- the exclusive holder's (garbage collection, repair),
  a mutable blob taken by compare-and-swap from absent or free.

**Mutual exclusion.** A save first creates its lease, then reads ``gc``;
if ``gc`` is held, it deletes its lease and waits. A collection first takes
``gc``, then lists the save leases and waits until there are none. The store
orders every request (S3 is strongly consistent for writes, reads and
listings; a shared directory must be too -- see docs/STORAGE.md): if the save's
read of ``gc`` came before the collection took it, the save's lease was
created before that, so the collection's listing, which comes after, shows
it; otherwise the save sees ``gc`` held. Never both go on.

**Dead holders.** Every held lease is renewed (a compare-and-swap to a new
counter) every ``stale_after / 4`` seconds by a thread of its process. A
waiter breaks a lease only after watching the *same* version of it for
``stale_after`` seconds on its own monotonic clock (clocks of nodes need not
agree): a collection deletes a dead save's lease, a save frees a dead
collection's ``gc``.

**Stalled holders fail closed.** A holder that stalls (a frozen process, a
network partition) can find its lease broken. So before each step that
acts on what the lease protects -- a rank's shard ack, the ref
compare-and-swap that publishes, each delete of a collection -- the holder
checks its own leases (:meth:`StoreLeases.check_held`): each must have been
renewed successfully less than ``stale_after / 2`` ago, by this process's
clock. A waiter cannot break it before ``stale_after`` has passed since that
renewal, so the step has ``stale_after / 2`` to land. A lease that is lost or
too old raises LockLostError and nothing is published or deleted. What is
left is the request that is already on the wire when it passes the check and
is delayed in flight for more than ``stale_after / 2``; docs/STORAGE.md says so.

**What a stall longer than ``stale_after`` does** (tests/test_gc_leases.py):

* a save: a collection breaks its lease and collects, possibly the chunks
  the save found present and skipped. The save fails its check before its
  rank acks and before the ref's compare-and-swap (LockLostError): nothing
  is published, the previous generation is intact, and a later save writes
  those chunks again. What it wrote before the check is garbage to the next
  collection. (Its index blobs are the exception: one created after the
  collection deleted its pack as an orphan would name a gone pack, so the
  chunk backend must check before it creates one -- castore.chunkstore.blobpacks.)
* a collection: a save frees ``gc`` and goes on. The collection fails its
  check before it logs what it drops, before each delete batch (castore.gc)
  and before each blob it deletes (the chunk backend's ``check_lease``);
  what it deleted before the stall was garbage when it marked, and the save,
  listing after, does not reuse it. (A pack's smaller index blob hides
  chunks too, so the backend must check before it writes one as well.)
* a killed holder blocks the others for ``stale_after`` at most.
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
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from castore.blob.base import BlobStore, Version
from castore.errors import (
    BlobConflictError,
    CastoreError,
    LeaseWarning,
    LockLostError,
    StoreLockedError,
)

GC_LEASE = "locks/store/gc"
SAVE_LEASES = "locks/store/saves/"
FREE = b'{"free":true}'
# Seconds a waiter watches an unchanged store lease before breaking it. A save
# renews its lease every quarter of this, so only a dead or stalled holder is broken.
DEFAULT_STORE_LEASE = 60.0
_POLL_FIRST, _POLL_MOST = 0.005, 0.5


@dataclass(eq=False)
class _Lease:
    """One lease this process holds: its blob, its version, when it was last confirmed."""

    name: str
    record: dict[str, object]
    version: Version
    confirmed: float  # monotonic time the last successful write was sent
    exclusive: bool
    lost: str = ""  # why, once the lease is known lost
    lock: threading.Lock = field(default_factory=threading.Lock)


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


class StoreLeases:
    """The store-wide lease protocol of the module text, for one BlobStore."""

    def __init__(self, blobs: BlobStore, *, stale_after: float = DEFAULT_STORE_LEASE) -> None:
        if stale_after <= 0:
            raise ValueError(f"stale_after must be positive, got {stale_after}")
        self.blobs = blobs
        self.stale_after = stale_after
        self._held: set[_Lease] = set()
        self._guard = threading.Lock()
        self._wake = threading.Event()
        self._keeper: threading.Thread | None = None

    # -- taking and letting go ------------------------------------------------

    @contextmanager
    def held(self, *, exclusive: bool, timeout: float, busy: str) -> Iterator[None]:
        take = self._acquire_exclusive if exclusive else self._acquire_shared
        lease = take(timeout, busy)
        try:
            yield
        finally:
            self._release(lease)

    def _acquire_shared(self, timeout: float, busy: str) -> _Lease:
        deadline = time.monotonic() + timeout
        watched: tuple[Version, float] | None = None
        pause = _POLL_FIRST
        while True:
            lease = self._create_save_lease()
            try:
                found = self.blobs.read_versioned(GC_LEASE)
            except BaseException:
                # Not kept, so never renewed: a collection would wait stale_after for it.
                self._forget_save_lease(lease)
                raise
            if found is None or found[0] == FREE:
                self._keep(lease)
                return lease
            # A collection holds the store: step aside so it can go on, then look again.
            self.blobs.delete(lease.name)
            now = time.monotonic()
            version = found[1]
            if watched is not None and watched[0] == version:
                if now - watched[1] >= self.stale_after:
                    self._break_gc(version)
                    watched = None
                    continue
            else:
                watched = (version, now)
            if now >= deadline:
                raise StoreLockedError(busy)
            time.sleep(min(pause * (0.5 + random.random()), max(0.0, deadline - now)))
            pause = min(2 * pause, _POLL_MOST)

    def _create_save_lease(self) -> _Lease:
        token = secrets.token_hex(16)
        record: dict[str, object] = {"holder": _holder(), "token": token, "renewals": 0}
        name = f"{SAVE_LEASES}{token}"
        sent = time.monotonic()
        version = self.blobs.swap(name, _encode(record), None)
        return _Lease(name, record, version, sent, exclusive=False)

    def _forget_save_lease(self, lease: _Lease) -> None:
        try:
            self.blobs.delete(lease.name)
        except CastoreError:
            pass  # unreachable storage: a collection breaks it after stale_after

    def _break_gc(self, version: Version) -> None:
        try:
            self.blobs.swap(GC_LEASE, FREE, version)
        except BlobConflictError:
            pass  # it moved: alive after all, or freed by another

    def _acquire_exclusive(self, timeout: float, busy: str) -> _Lease:
        deadline = time.monotonic() + timeout
        lease = self._take_gc(deadline, busy)
        self._keep(lease)
        try:
            self._wait_for_saves(deadline, busy)
        except BaseException:
            self._release(lease)
            raise
        return lease

    def _take_gc(self, deadline: float, busy: str) -> _Lease:
        record: dict[str, object] = {
            "holder": _holder(),
            "token": secrets.token_hex(16),
            "renewals": 0,
        }
        watched: tuple[Version, float] | None = None
        pause = _POLL_FIRST
        while True:
            found = self.blobs.read_versioned(GC_LEASE)
            version = None if found is None else found[1]
            now = time.monotonic()
            stale = (
                watched is not None
                and watched[0] == version
                and now - watched[1] >= self.stale_after
            )
            if found is None or found[0] == FREE or stale:
                sent = time.monotonic()
                try:
                    new = self.blobs.swap(GC_LEASE, _encode(record), version)
                except BlobConflictError:
                    watched = None
                    continue
                return _Lease(GC_LEASE, record, new, sent, exclusive=True)
            if watched is None or watched[0] != version:
                watched = (version, now) if version is not None else None
            if now >= deadline:
                raise StoreLockedError(busy)
            time.sleep(min(pause * (0.5 + random.random()), max(0.0, deadline - now)))
            pause = min(2 * pause, _POLL_MOST)

    def _wait_for_saves(self, deadline: float, busy: str) -> None:
        """Until no live save lease is left; break those unchanged for ``stale_after``."""
        watched: dict[str, tuple[Version, float]] = {}
        pause = _POLL_FIRST
        while True:
            self.check_held()
            names = list(self.blobs.list(SAVE_LEASES))
            if not names:
                return
            now = time.monotonic()
            seen: dict[str, tuple[Version, float]] = {}
            for name in names:
                found = self.blobs.read_versioned(name)
                if found is None:
                    continue
                before = watched.get(name)
                if before is not None and before[0] == found[1]:
                    if now - before[1] >= self.stale_after:
                        self._break_save(name, found[1])
                        continue
                    seen[name] = before
                else:
                    seen[name] = (found[1], now)
            watched = seen
            if not watched:
                # All gone or broken: list again to be sure, after a breath (saves that
                # step aside come and go, and a listing of them must not spin).
                time.sleep(_POLL_FIRST)
                continue
            if now >= deadline:
                raise StoreLockedError(busy)
            time.sleep(min(pause * (0.5 + random.random()), max(0.0, deadline - now)))
            pause = min(2 * pause, _POLL_MOST)

    def _break_save(self, name: str, version: Version) -> None:
        # Deleting by version: a swap to a tombstone first, so a save that renews
        # at this moment either wins (and its lease lives) or finds it gone.
        try:
            self.blobs.swap(name, b'{"broken":true}', version)
        except BlobConflictError:
            return
        self.blobs.delete(name)

    def _release(self, lease: _Lease) -> None:
        with self._guard:
            self._held.discard(lease)
        with lease.lock:
            lost, lease.lost = lease.lost, lease.lost or "released"
        if lost:
            if lost != "released":
                warnings.warn(
                    f"store lease {lease.name!r} was lost while held: {lost}", LeaseWarning, 3
                )
            return
        try:
            if lease.exclusive:
                self.blobs.swap(lease.name, FREE, lease.version)
            else:
                # A broken lease was swapped to a tombstone: deleting it is still right.
                self.blobs.delete(lease.name)
        except BlobConflictError:
            warnings.warn(f"store lease {lease.name!r} was broken while held", LeaseWarning, 3)
        except CastoreError:
            pass  # unreachable storage: the lease expires by itself

    # -- renewal and the check ------------------------------------------------

    def _keep(self, lease: _Lease) -> None:
        with self._guard:
            self._held.add(lease)
            if self._keeper is None or not self._keeper.is_alive():
                self._keeper = threading.Thread(
                    target=_renew_forever,
                    args=(weakref.ref(self), self._wake),
                    name="castore-store-lease",
                    daemon=True,
                )
                self._keeper.start()

    def renew(self) -> None:
        """Renew every lease this process holds (the keeper thread calls this)."""
        with self._guard:
            held = list(self._held)
        for lease in held:
            with lease.lock:
                if lease.lost:
                    continue
                record = dict(lease.record, renewals=int(lease.record["renewals"]) + 1)  # type: ignore[call-overload]
                sent = time.monotonic()
                try:
                    lease.version = self.blobs.swap(lease.name, _encode(record), lease.version)
                except BlobConflictError:
                    lease.lost = "another process broke it (it looked dead)"
                    continue
                except CastoreError:
                    # Its answer may be what was lost: a renewal that landed moved the
                    # version, and renewing from the old one would call the lease broken.
                    landed = self._landed(lease.name, _encode(record))
                    if landed is None:
                        continue  # try again next round; the check fails closed meanwhile
                    lease.version = landed
                lease.record, lease.confirmed = record, sent

    def _landed(self, name: str, data: bytes) -> Version | None:
        """The blob's version if it holds ``data`` (a write whose answer was lost), else None."""
        try:
            found = self.blobs.read_versioned(name)
        except CastoreError:
            return None
        return found[1] if found is not None and found[0] == data else None

    def check_held(self) -> None:
        """Raise LockLostError unless every lease held here was confirmed recently enough."""
        with self._guard:
            held = list(self._held)
        for lease in held:
            with lease.lock:
                # The clock is read once the lock is ours: a renewal in flight holds it,
                # maybe for long, and a time read before the wait would make a lease
                # that it failed to renew look younger than it is.
                age = time.monotonic() - lease.confirmed
                if lease.lost or age >= self.stale_after / 2:
                    why = lease.lost or f"not renewed for {age:.1f}s"
                    raise LockLostError(
                        f"the store lease {lease.name!r} of this process is not safe to act on "
                        f"({why}; others may break it after {self.stale_after:g}s): stopped "
                        "before publishing or deleting anything"
                    )

    @property
    def renew_every(self) -> float:
        return self.stale_after / 4


def _renew_forever(owner: weakref.ref[StoreLeases], wake: threading.Event) -> None:
    while True:
        leases = owner()
        if leases is None:
            return
        with leases._guard:
            if not leases._held:
                leases._keeper = None
                return
        period = leases.renew_every
        try:
            leases.renew()
        except Exception:  # noqa: BLE001 - e.g. an OSError of a shared directory
            # This thread must outlive one bad round: were it gone, no lease of this
            # process would be renewed again, and every save would fail its check.
            pass
        del leases
        wake.wait(period)


def _encode(record: dict[str, object]) -> bytes:
    return json.dumps(record, sort_keys=True).encode()
