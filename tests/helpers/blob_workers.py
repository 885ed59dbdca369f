"""Child processes for ``test_blob_contract.py``: racers on one shared blob directory.

``race(root, index, rounds, barrier, results, broken)`` runs in a spawned
process. Each round, every racer (1) creates ``race/create-ROUND`` with its own
bytes, (2) reads the version of ``race/ref``, waits until every racer has read
it, and swaps its own bytes in from that version. It puts one tuple per round
on ``results``: (round, index, won the create, won the swap, version read).
``broken`` uses :class:`SkipsRecheck`, the broken control.

Run as a script, ``python blob_workers.py swap ROOT NAME DATA`` swaps ``DATA``
into blob ``NAME`` from the version it reads first (crash tests arm a fault
point through ``CASTORE_FAULTS``).
"""

from __future__ import annotations

import sys
from typing import Any

from castore.blob.base import Version
from castore.blob.posix import PosixBlobStore
from castore.errors import BlobConflictError, BlobExistsError

BARRIER_TIMEOUT = 120.0


class SkipsRecheck(PosixBlobStore):
    """Broken on purpose: a swap that takes the lock but never re-reads the version."""

    def _recheck(self, dir_fd: int, leaf: str, name: str, expected: Version | None) -> None:
        pass


def race(root: str, index: int, rounds: int, barrier: Any, results: Any, broken: bool) -> None:
    store = (SkipsRecheck if broken else PosixBlobStore)(root, stale_lock_after=60.0)
    for round_ in range(rounds):
        barrier.wait(BARRIER_TIMEOUT)
        try:
            store.create(f"race/create-{round_}", f"{index}".encode())
            created = True
        except BlobExistsError:
            created = False
        found = store.read_versioned("race/ref")
        assert found is not None
        barrier.wait(BARRIER_TIMEOUT)  # every racer holds the same version now
        try:
            store.swap("race/ref", f"{round_}:{index}".encode(), found[1])
            swapped = True
        except BlobConflictError:
            swapped = False
        results.put((round_, index, created, swapped, found[1].token))


def swap_once(root: str, name: str, data: str) -> None:
    store = PosixBlobStore(root)
    found = store.read_versioned(name)
    store.swap(name, data.encode(), None if found is None else found[1])


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "swap":
        swap_once(*args)
    elif command == "create":
        PosixBlobStore(args[0]).create(args[1], args[2].encode())
    else:
        raise SystemExit(f"unknown command {command!r}")
