"""Processes that end while an async save is in flight, for tests/test_async_exit.py.

``python tests/helpers/exit_workers.py PATH HOW [key=value ...]`` saves :func:`state`
(step 2) to the store at PATH with ``blocking=False``, prints a marker line
on stdout, then ends as HOW says. Options: ``rate`` (the writer's bytes per
second), ``exit_wait`` (``exit_wait_s``), ``staging`` (``staging_bytes``),
``mib`` (the state's size), ``api`` (``store`` or ``dist``).

Chunks are 256 KiB, above ``hashpool.INLINE_BYTES``: the writer hashes them on
castore's shared pool, which interpreter exit shuts down.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
from types import FrameType
from typing import Any

import numpy as np

import castore

CHUNK = 256 << 10
RUN = "run"


def state(seed: int, mib: int = 3) -> dict[str, np.ndarray]:
    """``mib`` MiB of float32 in two tensors, from ``seed``."""
    rng = np.random.default_rng(seed)
    floats = (mib << 20) // 4
    return {
        "w": rng.standard_normal(floats - floats // 3, dtype=np.float32),
        "b": rng.standard_normal(floats // 3, dtype=np.float32),
    }


def _options(opts: dict[str, str]) -> castore.AsyncOptions:
    return castore.AsyncOptions(
        max_write_bytes_per_s=float(opts["rate"]) if "rate" in opts else None,
        exit_wait_s=float(opts.get("exit_wait", 600)),
        staging_bytes=int(opts["staging"]) if "staging" in opts else None,
    )


def _save(path: str, opts: dict[str, str], *, marker: str = "") -> Any:
    """Save step 2 with ``blocking=False``; print ``marker`` just before the call."""
    data = state(2, int(opts.get("mib", 3)))
    store = castore.open(path, chunk_size=CHUNK)  # never closed: exit finds the save in flight
    options = _options(opts)
    if opts.get("api") == "dist":
        from castore import dist  # imports torch: only the worker that needs it pays

        if marker:
            print(marker, flush=True)
        return dist.save(store, data, run=RUN, step=2, blocking=False, async_options=options)
    if marker:
        print(marker, flush=True)
    return store.save(data, run=RUN, step=2, blocking=False, async_options=options)


def _user_handler(signum: int, frame: FrameType | None) -> None:
    print("user handler ran", flush=True)
    sys.exit(7)


def _spawned(path: str) -> None:
    """A multiprocessing child: its target returns with the save in flight."""
    _save(path, {"rate": str(4 << 20)})


def _nothing() -> None:
    """A forked child's target (a data loader's worker, say): it ends at once."""


def main(path: str, how: str, opts: dict[str, str]) -> None:
    if how == "user-sigterm":
        signal.signal(signal.SIGTERM, _user_handler)
    if how in ("spawn", "fork"):
        context = multiprocessing.get_context(how)
        child = context.Process(target=_spawned, args=(path,))
        child.start()
        child.join()
        print(f"child exit {child.exitcode}", flush=True)
        return
    if how == "fork-during-save":
        _save(path, opts)  # in flight while the child is forked, runs and ends
        started = time.monotonic()
        child = multiprocessing.get_context("fork").Process(target=_nothing)
        child.start()
        child.join(timeout=60)
        print(f"child exit {child.exitcode} after {time.monotonic() - started:.0f}s", flush=True)
        return
    pending = _save(path, opts, marker="staging" if how == "staging" else "")
    if how == "published":
        pending.result()
    print("returned", flush=True)
    if how == "user-sigterm":
        print(f"user handler in place: {signal.getsignal(signal.SIGTERM) is _user_handler}")
    sys.stdout.flush()
    if how == "sys.exit":
        sys.exit(0)
    if how == "raise":
        raise RuntimeError("training failed after the save returned")
    if how in ("wait", "user-sigterm", "published"):
        # Until the test's signal, in short sleeps as a training loop would step: a
        # signal landing between CPython's last check and a sleep's system call is
        # handled only once that sleep ends.
        for _ in range(1200):
            time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], dict(arg.split("=", 1) for arg in sys.argv[3:]))
