"""Child processes for ``test_gc_leases.py``: other "nodes" of a shared-directory store.

Run as a script (each process opens the store with its own index cache, so it
shares nothing with the test's process but the directory)::

    python gc_lease_workers.py saver STORE CACHE LEASE NODE STOP_FILE MAX_SAVES ROUND_FILE
    python gc_lease_workers.py collector STORE CACHE LEASE

``saver`` saves generations of run ``node<NODE>`` built by :func:`state`
(each shares chunks with earlier generations of both nodes), a random
moment apart, and prints one line ``saved <run> <generation> <new chunks>``
per published generation. It saves while a collection runs: it starts a
save once ``ROUND_FILE`` names a round it has not seen (the test writes it as
a collection starts), and goes on saving while ``ROUND_FILE.collecting``
exists; otherwise it waits. It stops once ``STOP_FILE`` exists, or after
``MAX_SAVES``. A failed save ends it with a traceback and exit status 1.

``collector`` starts a collection (keep the last generation) and, once it
holds the store lease and is about to delete its first batch, prints
``sweeping`` and sleeps: the test kills it there.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import castore
from castore.gc import RetentionPolicy, collect_garbage

CHUNK_SIZE = 1024
POOL = 3  # shared arrays: generation i of every node uses pool array i % POOL
POOL_ELEMENTS = 1024  # float32: 4 KiB, 4 chunks of 1 KiB
OWN_ELEMENTS = 256  # float32: 1 KiB, 1 chunk new in every generation


def pool_array(index: int) -> np.ndarray:
    return np.random.default_rng(1000 + index).standard_normal(POOL_ELEMENTS, dtype=np.float32)


def state(node: int, generation: int) -> dict[str, Any]:
    """Generation ``generation`` of ``node``: one pool array (shared) and one of its own."""
    own = np.random.default_rng([node, generation]).standard_normal(OWN_ELEMENTS, dtype=np.float32)
    return {"pool": pool_array(generation % POOL), "own": own}


def open_node(store: str, cache: str, lease: float) -> castore.Store:
    return castore.open(
        store, shared=True, store_lease=lease, chunk_size=CHUNK_SIZE, cache_dir=cache
    )


def saver(
    store: str, cache: str, lease: float, node: int, stop_file: str, most: int, round_file: str
) -> None:
    rng = random.Random(node)
    run = f"node{node}"
    rounds = RoundWatch(Path(round_file))
    with open_node(store, cache, lease) as handle:
        for generation in range(1, most + 1):
            while not (Path(stop_file).exists() or rounds.save_now()):
                time.sleep(0.001)
            if Path(stop_file).exists():
                break
            saved = handle.save(state(node, generation), run=run, step=generation)
            print(f"saved {run} {saved.id} {saved.stats.new_chunks}", flush=True)
            time.sleep(rng.uniform(0, 0.01))


class RoundWatch:
    """When a saver saves: once per new round, and all along while a collection runs.

    Saves between collections would overlap none: they only lengthen the
    reflogs that every collection and verify reads whole (their cost grows with
    every generation ever saved).
    """

    def __init__(self, round_file: Path) -> None:
        self.round_file = round_file
        self.collecting = round_file.with_name(round_file.name + ".collecting")
        self.seen: str | None = None

    def save_now(self) -> bool:
        try:
            current = self.round_file.read_text()
        except FileNotFoundError:
            current = ""  # before the first round: the first save
        if current != self.seen:
            self.seen = current
            return True
        return self.collecting.exists()


def collector(store: str, cache: str, lease: float) -> None:
    with open_node(store, cache, lease) as handle:
        delete_many = handle.backend.delete_many

        def stalled(*args: Any, **kwargs: Any) -> int:
            print("sweeping", flush=True)
            time.sleep(3600)
            return delete_many(*args, **kwargs)

        handle.backend.delete_many = stalled  # type: ignore[method-assign]
        collect_garbage(handle, RetentionPolicy(keep_last=1), lock_timeout=30)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "saver":
        path, cache, lease, node, stop, most, round_file = args
        saver(path, cache, float(lease), int(node), stop, int(most), round_file)
    elif command == "collector":
        path, cache, lease = args
        collector(path, cache, float(lease))
    else:
        raise SystemExit(f"unknown command {command!r}")
