"""A process that saves through a tiered store, for the crash tests (tests/test_tiers_crash.py).

``python tests/helpers/tier_workers.py FAST DURABLE FIRST LAST UPLOADER``: opens
``castore.open_tiered(FAST, DURABLE, durable_every=2, fast_keep=2, chunk_size=1024,
uploader=UPLOADER)``,
saves ``state(step)`` for steps FIRST..LAST (generation ids follow the run's), waits
for the promotions and closes. ``CASTORE_FAULTS`` kills it where the test says.
"""

from __future__ import annotations

import sys

import numpy as np

import castore


def state(step: int) -> dict[str, np.ndarray]:
    """About 48 KiB a step: each step rewrites a quarter of ``weight``."""
    weight = np.arange(8192, dtype=np.float32) + 0.25
    weight[:2048] = step
    return {"weight": weight, "frozen": np.arange(4096, dtype=np.float32)}


def main(fast: str, durable: str, first: int, last: int, uploader: str) -> int:
    options = {"durable_every": 2, "fast_keep": 2, "chunk_size": 1024, "uploader": uploader}
    with castore.open_tiered(fast, durable, **options) as store:
        for step in range(first, last + 1):
            store.save(state(step), run="r", step=step)
        store.wait_promotions()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
