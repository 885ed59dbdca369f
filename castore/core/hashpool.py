"""The process's hash and verify pool, and which chunks go to it.

Who hashes: chunks of at least ``INLINE_BYTES`` go to a thread pool (blake3
releases the GIL) in tasks of about ``TASK_BYTES``, so they hash in parallel
and overlap with writing or fetching. Smaller chunks are hashed by the
calling thread as it reaches them. A pool task costs tens of microseconds to
submit and collect, as much as hashing a few KiB; and blake3 releases the
GIL even for a few bytes, so a worker hashing tiny chunks waits for the GIL
after each one while the main thread runs Python. On 20,000 chunks of about
2 KiB, verifying on the pool took 2.4x as long as verifying inline.

Saves (:mod:`castore.core.chunkio`) and loads (:mod:`castore.core.chunkread`,
:mod:`castore.core.readplan`) share the one pool.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

# Chunks smaller than this are hashed on the calling thread (see above).
INLINE_BYTES = 64 << 10
# A pool task's share of the bytes: one chunk at least this large, or a run of
# smaller ones that adds up to it.
TASK_BYTES = 1 << 20
_WORKERS = max(2, min(8, os.cpu_count() or 2))

_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def shared_pool() -> ThreadPoolExecutor:
    """One long-lived hash/verify pool per process (re-made after a fork).

    Tasks on it never wait for other tasks, so savers and readers may share it.
    """
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(_WORKERS, thread_name_prefix="castore-io"))
        return _POOL[1]
