"""Child processes for ``test_gc_concurrency.py``, and the states both sides build.

Run as a script::

    python gc_workers.py saver STORE RECORDS STOP_FILE MIN_SAVES MAX_SAVES SEED
    python gc_workers.py holder STORE

``saver`` saves generations of run ``RUN`` built from a shared pool of arrays
(so chunks are reused across generations), sleeping a random moment between
saves, and appends one JSON line per published generation to ``RECORDS``. It
stops once it has saved ``MIN_SAVES`` generations and ``STOP_FILE`` exists (or
at ``MAX_SAVES``). Any failed save ends it with a traceback and exit status 1.

``holder`` opens the store, prints ``open`` and keeps it open until its stdin
is closed, then closes it and prints ``closed``.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RUN = "train"
CHUNK_SIZE = 1024
POOL_SIZE = 8
POOL_ELEMENTS = 1024  # float32: 4 KiB, 4 chunks of 1 KiB
FRESH_ELEMENTS = 256  # float32: 1 KiB, 1 chunk, new in every generation
SLOTS = 3  # pool arrays per state
POOL_CHUNKS = POOL_ELEMENTS * 4 // CHUNK_SIZE
FRESH_CHUNKS = FRESH_ELEMENTS * 4 // CHUNK_SIZE


def pool_array(index: int) -> np.ndarray:
    """Pool array ``index``: the same bytes in every process."""
    return np.random.default_rng(1000 + index).standard_normal(POOL_ELEMENTS, dtype=np.float32)


def fresh_array(seed: int) -> np.ndarray:
    return np.random.default_rng(50_000 + seed).standard_normal(FRESH_ELEMENTS, dtype=np.float32)


def build_state(pool: list[int], fresh: int, step: int) -> dict[str, Any]:
    """A state of ``SLOTS`` pool arrays, one array of its own and a plain value."""
    state: dict[str, Any] = {f"slot{i}": pool_array(p) for i, p in enumerate(pool)}
    state["fresh"] = fresh_array(fresh)
    state["step"] = step
    return state


def saver(
    store_path: str, records: str, stop_file: str, min_saves: int, max_saves: int, seed: int
) -> int:
    import castore

    rng = random.Random(seed)
    stop = Path(stop_file)
    with castore.open(store_path) as store, open(records, "a") as out:
        for step in range(max_saves):
            if step >= min_saves and stop.exists():
                break
            pool = rng.sample(range(POOL_SIZE), SLOTS)
            gen = store.save(build_state(pool, step, step), run=RUN, step=step)
            record = {
                "gen": gen.id,
                "step": step,
                "pool": pool,
                "fresh": step,
                "new_chunks": gen.stats.new_chunks,
                "reused_chunks": gen.stats.reused_chunks,
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
            time.sleep(rng.uniform(0.0, 0.012))
    return 0


def holder(store_path: str) -> int:
    import castore

    store = castore.open(store_path, create=False)
    try:
        print("open", flush=True)
        sys.stdin.read()  # until the parent closes our stdin
    finally:
        store.close()
    print("closed", flush=True)
    return 0


def main(argv: list[str]) -> int:
    mode, *args = argv
    if mode == "saver":
        path, records, stop_file, min_saves, max_saves, seed = args
        return saver(path, records, stop_file, int(min_saves), int(max_saves), int(seed))
    if mode == "holder":
        (path,) = args
        return holder(path)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
