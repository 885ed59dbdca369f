"""Per-rank functions for tests/test_async_dist.py, run by tests/helpers/dist_harness.py.

Each is called as ``fn(rank, world_size, *args)`` inside a joined gloo group and
returns plain, picklable values. The state of a seed is built here and in the
parent alike (:func:`global_arrays`), so the parent knows every expected byte.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

# 1 KiB chunks and 4 KiB write batches: every shard is written in several batches.
CHUNK_SIZE = 1024
BATCH_BYTES = 4096
ROWS, COLS = 64, 256  # "model/w": 64 KiB of float32, rows split between the ranks
RUN = "run"
SKEW_S = 1.0


def global_arrays(seed: int) -> dict[str, np.ndarray]:
    """The whole tensors of the state of ``seed``: one sharded, one replicated."""
    rng = np.random.default_rng(seed)
    return {
        "model/w": rng.standard_normal((ROWS, COLS), dtype=np.float32),
        "model/b": rng.standard_normal((16, COLS), dtype=np.float32),
    }


def rank_local(seed: int, rank: int) -> np.ndarray:
    return np.random.default_rng([seed, rank]).integers(0, 2**31, size=64, dtype=np.int64)


def make_state(seed: int, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's state: its rows of ``model/w`` as a torch Shard, ``model/b`` whole."""
    import torch

    import castore

    arrays = global_arrays(seed)
    rows = ROWS // world_size
    block = torch.from_numpy(arrays["model/w"][rank * rows : (rank + 1) * rows].copy())
    return {
        "model": {
            "w": castore.Shard(block, (ROWS, COLS), (rank * rows, 0)),
            "b": torch.from_numpy(arrays["model/b"].copy()),
        },
        "rng": castore.RankLocal(rank_local(seed, rank)),
        "step": seed,
    }


def mutate(state: dict[str, Any]) -> None:
    """Change every tensor of a :func:`make_state` state in place."""
    state["model"]["w"].local.add_(1.0)
    state["model"]["b"].mul_(-2.0)
    state["rng"].value += 1


def _open(path: str) -> Any:
    import castore
    import castore.core.chunkio

    castore.core.chunkio.WRITE_BATCH_BYTES = BATCH_BYTES
    return castore.open(path, chunk_size=CHUNK_SIZE)


def _error(exc: BaseException, started: float) -> dict[str, Any]:
    return {
        "error": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "seconds": time.monotonic() - started,
    }


def _latest(store: Any) -> int | None:
    generations = store.generations(RUN)
    return generations[-1].id if generations else None


def save_and_mutate(rank: int, world_size: int, path: str, seed: int) -> dict[str, Any]:
    """Async-save the state of ``seed``, change every tensor at once, wait for the save."""
    import castore
    import castore.dist

    state = make_state(seed, rank, world_size)
    with _open(path) as store:
        pending = castore.dist.save(
            store,
            state,
            run=RUN,
            step=seed,
            blocking=False,
            async_options=castore.AsyncOptions(staging_bytes=8192),
        )
        mutate(state)
        generation = pending.result(timeout=60)
        return {
            "id": generation.id,
            "root": generation.root,
            "stats": generation.stats,
            "timings": dict(pending.timings),
            "bytes": pending.bytes,
        }


def killed_mid_write(
    rank: int, world_size: int, path: str, killed: int, timeout: float
) -> dict[str, Any]:
    """Publish seed 1; then, while saving seed 2, rank ``killed`` SIGKILLs itself mid-write."""
    import castore
    import castore.dist
    import castore.support.faults

    with _open(path) as store:
        castore.dist.save(store, make_state(1, rank, world_size), run=RUN, step=1)
        if rank == killed:
            castore.support.faults.arm("dist.worker_mid_shard", "kill")
        started = time.monotonic()
        pending = castore.dist.save(
            store,
            make_state(2, rank, world_size),
            run=RUN,
            step=2,
            timeout=timeout,
            blocking=False,
            async_options=castore.AsyncOptions(staging_bytes=8192),
        )
        try:
            pending.result(timeout=timeout + 30)
        except Exception as exc:
            return {**_error(exc, started), "latest": _latest(store)}
        return {"error": None, "latest": _latest(store)}


def skip_when_any_rank_is_busy(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Rank 0 alone has a slow save of its own in flight; then every rank asks to skip."""
    import castore
    import castore.dist

    with _open(path) as store:
        solo = None
        if rank == 0:  # busy on rank 0 only: ~1 s at 64 KiB/s
            slow = castore.AsyncOptions(max_write_bytes_per_s=64 << 10)
            solo = store.save(
                {"x": np.ones(16 << 10, dtype=np.float32)},
                run="solo",
                step=1,
                blocking=False,
                async_options=slow,
            )
        state = make_state(3, rank, world_size)
        asked = castore.dist.save(store, state, run=RUN, step=3, blocking=False, if_busy="skip")
        skipped = {"skipped": asked.skipped, "result": asked.result(timeout=60)}
        if solo is not None:
            solo.result(timeout=60)
        # Nobody busy now: every rank saves.
        after = castore.dist.save(store, state, run=RUN, step=4, blocking=False, if_busy="skip")
        generation = after.result(timeout=60)
        return {
            **skipped,
            "counters": dict(store.background.counters),
            "after_skipped": after.skipped,
            "after_id": generation.id if generation else None,
            "ids": [g.id for g in store.generations(RUN)],
        }


def staggered(rank: int, world_size: int, path: str, stagger_s: float) -> dict[str, Any]:
    """An async save with ``stagger_s``: when this rank started, and its write timeline."""
    import torch.distributed as dist

    import castore
    import castore.dist
    from castore.dist.comm import DEFAULT_TIMEOUT, own_groups

    own_groups(None, DEFAULT_TIMEOUT)  # made before the clocks start: its creation is collective
    with _open(path) as store:
        dist.barrier()
        started = time.monotonic()
        pending = castore.dist.save(
            store,
            make_state(4, rank, world_size),
            run=RUN,
            step=4,
            blocking=False,
            async_options=castore.AsyncOptions(stagger_s=stagger_s),
        )
        pending.result(timeout=60)
        return {"started": started, "timeline": pending.timeline}


def skewed(rank: int, world_size: int, path: str, skew_s: float) -> dict[str, Any]:
    """Rank 0 (the coordinator) calls an async save ``skew_s`` after rank 1 does."""
    import torch.distributed as dist

    import castore
    import castore.dist
    from castore.dist.comm import DEFAULT_TIMEOUT, own_groups

    own_groups(None, DEFAULT_TIMEOUT)
    with _open(path) as store:
        dist.barrier()
        if rank == 0:
            time.sleep(skew_s)  # the ranks' skew, not a slow save
        pending = castore.dist.save(
            store, make_state(6, rank, world_size), run=RUN, step=6, blocking=False, if_busy="skip"
        )
        generation = pending.result(timeout=60)
        return {"stats": generation.stats, "timings": dict(pending.timings)}


def scenarios(rank: int, world_size: int, root: str, stagger_s: float) -> dict[str, Any]:
    """Several scenarios in one launch (each launch costs seconds), each on its own store."""
    return {
        "mutate": save_and_mutate(rank, world_size, f"{root}/mutate", 5),
        "skip": skip_when_any_rank_is_busy(rank, world_size, f"{root}/skip"),
        "stagger": staggered(rank, world_size, f"{root}/stagger", stagger_s),
        "skewed": skewed(rank, world_size, f"{root}/skewed", SKEW_S),
    }
