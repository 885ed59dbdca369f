"""Racers for ``test_blob_repo.py``: ref advances on one blob store from separate "nodes".

Each racer builds its own ref store (its own in-process locks, as another node
would have) whose ref table waits at a barrier just before its swap, so every
racer has read the ref and passed the checks before any of them writes.
``broken`` builds :class:`Overwrites`, the broken control: an advance that
ignores the version it read and overwrites whatever is there.

``race(root, index, barrier, results, broken)`` runs in a spawned process on a
shared directory and puts ``(index, outcome)`` on ``results``: ``"won"`` or the
name of the exception the advance raised. ``race_leased`` races ref stores as
``blob_refs`` builds them (run leases on), released together at the barrier.

The paused racers have in-process locks only, so that the ref's swap alone
keeps them apart (as when a stalled holder's run lease was taken over).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from castore.blob.base import BlobStore, Version
from castore.blob.posix import PosixBlobStore
from castore.errors import BlobConflictError
from castore.repo.blobs import BlobRefTable, BlobStoreLocks, blob_refs
from castore.repo.refstore import ComposedRefStore
from castore.testing._values import value

BARRIER_TIMEOUT = 120.0
RUN = "r"


class PausedRefTable(BlobRefTable):
    """Waits at ``barrier`` between its checks and its swap."""

    def __init__(self, blobs: BlobStore, locks: BlobStoreLocks, barrier: Any) -> None:
        super().__init__(blobs, locks)
        self.barrier = barrier

    def _swap(self, name: str, data: bytes, version: Version | None) -> None:
        self.barrier.wait(BARRIER_TIMEOUT)
        super()._swap(name, data, version)


class Overwrites(PausedRefTable):
    """Broken on purpose: swaps from whatever version is there now, not the one it checked."""

    def _swap(self, name: str, data: bytes, version: Version | None) -> None:
        self.barrier.wait(BARRIER_TIMEOUT)
        while True:
            found = self.blobs.read_versioned(name)
            try:
                self.blobs.swap(name, data, None if found is None else found[1])
                return
            except BlobConflictError:
                continue


def racing_refs(blobs: BlobStore, barrier: Any, *, broken: bool) -> ComposedRefStore:
    """A ref store of its own over ``blobs`` whose advances pause at ``barrier``."""
    refs = blob_refs(blobs)
    locks = BlobStoreLocks()
    table = (Overwrites if broken else PausedRefTable)(blobs, locks, barrier)
    return ComposedRefStore(dataclasses.replace(refs.parts, refs=table, locks=locks))


def advance_once(refs: ComposedRefStore, index: int) -> str:
    """Advance the run from generation 1 to a generation 2 of racer ``index``'s own."""
    try:
        refs.advance(RUN, expected=value(RUN, 1).root, new=racer_value(index))
        return "won"
    except Exception as exc:  # the test inspects which error
        return type(exc).__name__


def racer_value(index: int) -> Any:
    return value(RUN, 2, f"racer {index}")


def race(root: str, index: int, barrier: Any, results: Any, broken: bool) -> None:
    refs = racing_refs(PosixBlobStore(root, stale_lock_after=60.0), barrier, broken=broken)
    results.put((index, advance_once(refs, index)))


def race_leased(root: str, index: int, barrier: Any, results: Any, broken: bool) -> None:
    """Racers as a store builds them (run leases on), released together, no pause inside."""
    refs = blob_refs(PosixBlobStore(root, stale_lock_after=60.0))
    barrier.wait(BARRIER_TIMEOUT)
    results.put((index, advance_once(refs, index)))
