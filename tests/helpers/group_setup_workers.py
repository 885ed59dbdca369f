"""Per-rank functions for tests/test_group_setup.py, run by tests/helpers/dist_harness.py.

A rank is SIGKILLed right before its first castore collective, so the others
meet the dead peer inside castore's own set-up (``own_groups``: gloo's
``new_group``) or its first exchange. Each survivor reports what it raised and
how long after its call.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np


def save_with_a_peer_killed(
    rank: int, world_size: int, store_path: str, victim: int, timeout: float, blocking: bool
) -> dict[str, Any]:
    import castore
    import castore.dist

    store = castore.open(store_path)
    block = np.full((4,), rank, dtype=np.float32)
    state = {"w": castore.Shard(block, (4 * world_size,), (4 * rank,))}
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)  # before its first castore collective
    started = time.monotonic()
    try:
        if blocking:
            castore.dist.save(store, state, run="r", step=1, timeout=timeout)
        else:
            pending = castore.dist.save(
                store, state, run="r", step=1, timeout=timeout, blocking=False
            )
            pending.result(timeout=timeout * 10)
    except BaseException as exc:  # the test inspects which error
        return {
            "error": type(exc).__name__,
            "mro": tuple(c.__name__ for c in type(exc).__mro__),
            "message": str(exc),
            "seconds": time.monotonic() - started,
        }
    return {"error": None, "seconds": time.monotonic() - started}
