"""Moving tensor bytes: chunk, hash and write on save; read and verify on load.

Save: a tensor's flat buffer is cut into ``chunk_size`` slices (memoryviews,
no copies), hashed on a thread pool (blake3 releases the GIL) while the main
thread hands each hashed chunk to the backend, which writes it unless it has
it already; one commit per batch. Load: the chunks of a whole request (every
tensor of a state, or every box a rank needs) are fetched inside one read
transaction; each distinct chunk is verified against its name once, then
copied to every place that wants it, on the pool.

Both directions give the pool tasks of about ``TASK_BYTES``: one large chunk,
or a run of small ones. Submitting and collecting a pool task costs tens of
microseconds, as much as hashing a few KiB: with one task per chunk, a state
of many small tensors paid more for the pool than for its bytes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from castore.chunkstore.base import ChunkBackend, Namespace
from castore.errors import ChecksumMismatchError, ChunkMissingError
from castore.faults import fault_point
from castore.hashing import digest_bytes
from castore.objects import TensorEntry
from castore.tree import TensorLeaf

DEFAULT_CHUNK_SIZE = 4 << 20
WRITE_BATCH_BYTES = 256 << 20
# A pool task's share of the bytes: one chunk at least this large, or a run of
# smaller chunks that adds up to it. Large chunks still get a task each, so
# they hash in parallel and overlap with I/O as before.
TASK_BYTES = 1 << 20
_WORKERS = max(2, min(8, os.cpu_count() or 2))


@dataclass
class WriteStats:
    logical_bytes: int = 0
    new_bytes: int = 0
    new_chunks: int = 0
    reused_chunks: int = 0

    def __add__(self, other: WriteStats) -> WriteStats:
        return WriteStats(
            self.logical_bytes + other.logical_bytes,
            self.new_bytes + other.new_bytes,
            self.new_chunks + other.new_chunks,
            self.reused_chunks + other.reused_chunks,
        )


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


def task_runs(items: Sequence[Any], size_of: Callable[[Any], int]) -> Iterator[list[Any]]:
    """Consecutive runs of ``items`` of about ``TASK_BYTES`` each, in order."""
    run: list[Any] = []
    size = 0
    for item in items:
        run.append(item)
        size += size_of(item)
        if size >= TASK_BYTES:
            yield run
            run, size = [], 0
    if run:
        yield run


# -- save ---------------------------------------------------------------------


def _hash_run(pieces: list[memoryview]) -> list[bytes]:
    return [digest_bytes(piece, threads=1) for piece in pieces]


def _cut(leaves: Sequence[TensorLeaf], chunk_size: int) -> list[tuple[int, memoryview]]:
    """(leaf index, chunk) for every chunk of every leaf: views of the leaves' buffers."""
    pieces: list[tuple[int, memoryview]] = []
    for index, leaf in enumerate(leaves):
        flat = memoryview(leaf.data)  # type: ignore[arg-type]  # ndarray exports a buffer
        if 0 < flat.nbytes <= chunk_size:
            pieces.append((index, flat))
        else:
            pieces += [
                (index, flat[at : at + chunk_size]) for at in range(0, flat.nbytes, chunk_size)
            ]
    return pieces


def write_leaves(
    backend: ChunkBackend,
    leaves: Sequence[TensorLeaf],
    chunk_size: int,
    *,
    midway_fault: str = "save.mid_chunks",
) -> tuple[list[TensorEntry], WriteStats]:
    """Store every leaf's chunks (new ones only) and return their tensor entries.

    ``midway_fault`` names the fault point passed after each committed batch,
    when some of the leaves' chunks are durable and no manifest yet names them.
    """
    pieces = _cut(leaves, chunk_size)
    digests: list[list[bytes]] = [[] for _ in leaves]
    stats = WriteStats(logical_bytes=sum(leaf.data.nbytes for leaf in leaves))
    pool = shared_pool()
    runs = task_runs([piece for _, piece in pieces], _view_size)
    hashing: list[Future[list[bytes]]] = [pool.submit(_hash_run, run) for run in runs]
    try:
        in_order = chain.from_iterable(future.result() for future in hashing)
        hashed = zip(pieces, in_order, strict=True)
        handed = 0  # chunks given to the backend so far
        while handed < len(pieces):
            # The backend takes each chunk as its digest arrives, so writing
            # overlaps the hashing of the chunks after it.
            result = backend.put_many(Namespace.CHUNKS, _batch(hashed, digests))
            taken = sum(map(len, digests)) - handed
            if not taken:
                raise RuntimeError("chunk backend returned without taking any chunk")
            handed += taken
            stats.new_chunks += result.written
            stats.new_bytes += result.written_bytes
            stats.reused_chunks += taken - result.written
            fault_point(midway_fault)
    finally:
        for future in hashing:
            future.cancel()  # a failed save stops hashing what it will not write
    entries = [
        TensorEntry(
            name=leaf.name,
            dtype=leaf.dtype,
            shape=leaf.shape,
            offsets=leaf.offsets,
            local_shape=leaf.local_shape,
            nbytes=leaf.data.nbytes,
            chunk_size=chunk_size,
            chunks=tuple(digests[index]),
            framework=leaf.framework,
        )
        for index, leaf in enumerate(leaves)
    ]
    return entries, stats


def _view_size(piece: memoryview) -> int:
    return piece.nbytes


def _batch(
    hashed: Iterator[tuple[tuple[int, memoryview], bytes]], digests: list[list[bytes]]
) -> Iterator[tuple[bytes, memoryview]]:
    """Yield (digest, piece) until ``WRITE_BATCH_BYTES`` are out, recording each digest."""
    size = 0
    for (index, piece), digest in hashed:
        digests[index].append(digest)
        size += piece.nbytes
        yield digest, piece
        if size >= WRITE_BATCH_BYTES:
            return


# -- load ---------------------------------------------------------------------

# Called with (chunk index, verified chunk bytes) for each chunk read.
ChunkConsumer = Callable[[int, np.ndarray], None]


@dataclass
class ReadCounters:
    """What reads fetched from the backend, for reports and tests."""

    chunks: int = 0
    bytes: int = 0


def expected_length(entry: TensorEntry, index: int) -> int:
    """The length chunk ``index`` of ``entry`` must have (the last one may be short)."""
    return min(entry.chunk_size, entry.nbytes - index * entry.chunk_size)


def verify_chunk(
    entry: TensorEntry, index: int, value: memoryview | None, where: dict[str, object]
) -> np.ndarray:
    """Chunk ``index`` of ``entry`` as a uint8 array, if it is present and intact.

    Invariant 3: the bytes must hash to the digest that named them (and have
    the length the entry implies); a name that exists is not evidence. Errors
    name ``where`` and the tensor.
    """
    key = entry.chunks[index]
    if value is None:
        raise ChunkMissingError(
            f"chunk {index} of tensor {entry.name!r} is missing from the store",
            chunk=key.hex()[:16],
            **{**where, "tensor": entry.name},
        )
    actual = digest_bytes(value, threads=1)
    if actual != key or len(value) != expected_length(entry, index):
        raise ChecksumMismatchError(
            f"chunk {index} of tensor {entry.name!r} is damaged",
            expected=key.hex(),
            actual=actual.hex(),
            **{**where, "tensor": entry.name},
        )
    return np.frombuffer(value, dtype=np.uint8)


@dataclass(frozen=True)
class ChunkRequest:
    """One chunk of one saved box, and where its verified bytes go."""

    entry: TensorEntry
    index: int
    deliver: ChunkConsumer


Fetched = tuple[bytes, "memoryview | None"]


class _Plan:
    """The distinct chunks of some requests, in first-request order, and who wants each."""

    def __init__(self, requests: Sequence[ChunkRequest], where: dict[str, object]) -> None:
        self.wanted: dict[bytes, list[ChunkRequest]] = {}
        for request in requests:
            self.wanted.setdefault(request.entry.chunks[request.index], []).append(request)
        self.keys = list(self.wanted)
        self.where = where

    def verify(self, key: bytes, value: memoryview | None) -> np.ndarray:
        """Check one fetched chunk against its name, and its length for every request."""
        first, *others = self.wanted[key]
        chunk = verify_chunk(first.entry, first.index, value, self.where)
        for request in others:
            # Same digest, so same bytes; a manifest may still disagree on the length.
            if chunk.size != expected_length(request.entry, request.index):
                verify_chunk(request.entry, request.index, value, self.where)  # raises
        return chunk

    def verify_run(self, run: list[Fetched]) -> None:
        for key, value in run:
            self.verify(key, value)

    def verify_and_deliver_run(self, run: list[Fetched]) -> None:
        for key, value in run:
            chunk = self.verify(key, value)
            for request in self.wanted[key]:
                request.deliver(request.index, chunk)

    def deliver_run(self, run: list[Fetched]) -> None:
        """Copy chunks that ``verify_run`` accepted to where they go."""
        for key, value in run:
            chunk = np.frombuffer(value, dtype=np.uint8)  # type: ignore[arg-type]
            for request in self.wanted[key]:
                request.deliver(request.index, chunk)


def _run_in_order(
    pool: ThreadPoolExecutor, work: Callable[[list[Fetched]], None], runs: Iterator[list[Fetched]]
) -> BaseException | None:
    """Run ``work`` on each run on the pool; wait for all; the first failure in order."""
    futures = []
    try:
        for run in runs:
            futures.append(pool.submit(work, run))
    finally:
        wait(futures)  # no worker may touch a buffer after the transaction ends
    for future in futures:
        error = future.exception()
        if error is not None:
            return error
    return None


def read_requests(
    backend: ChunkBackend,
    requests: Sequence[ChunkRequest],
    counters: ReadCounters,
    where: dict[str, object],
) -> None:
    """Fetch, verify and deliver every requested chunk, in one read transaction.

    Each distinct chunk is fetched and verified once, then handed to every
    request for it: no request sees bytes before they are verified. A missing
    or damaged chunk raises (the first in request order), naming the tensor
    and chunk index; the destinations may then hold some chunks, so callers
    must discard them.
    """
    plan = _Plan(requests, where)
    if not plan.keys:
        return
    pool = shared_pool()

    def visit(values: Iterator[memoryview | None]) -> None:
        error = _run_in_order(pool, plan.verify_and_deliver_run, _runs(plan, values, counters))
        if error is not None:
            raise error

    backend.read_many(Namespace.CHUNKS, plan.keys, visit)


def read_agree_deliver(
    backend: ChunkBackend,
    requests: Sequence[ChunkRequest],
    counters: ReadCounters,
    where: dict[str, object],
    agree: Callable[[BaseException | None], None],
) -> None:
    """Verify every requested chunk in place, let ``agree`` decide, then deliver.

    All chunks are fetched and verified inside one read transaction, so their
    buffers stay valid (zero-copy, no staging memory) while ``agree(error)``
    runs: it must raise unless every party succeeded. Only then are the
    verified bytes copied to their destinations.
    """
    plan = _Plan(requests, where)
    pool = shared_pool()

    def visit(values: Iterator[memoryview | None]) -> None:
        runs: list[list[Fetched]] = []

        def kept(fetched: Iterator[list[Fetched]]) -> Iterator[list[Fetched]]:
            for run in fetched:
                runs.append(run)
                yield run

        agree(_run_in_order(pool, plan.verify_run, kept(_runs(plan, values, counters))))
        # `agree` raises on every party unless all verified everything.
        error = _run_in_order(pool, plan.deliver_run, iter(runs))
        if error is not None:
            raise error

    backend.read_many(Namespace.CHUNKS, plan.keys, visit)


def _runs(
    plan: _Plan, values: Iterator[memoryview | None], counters: ReadCounters
) -> Iterator[list[Fetched]]:
    """Fetched chunks in runs of about ``TASK_BYTES``, each yielded once complete.

    The caller hands each run to the pool while the next one is fetched, so
    index lookups and page faults overlap the hashing of the chunks before.
    """
    run: list[Fetched] = []
    size = 0
    for key, value in zip(plan.keys, values, strict=True):
        if value is not None:
            counters.chunks += 1
            counters.bytes += len(value)
            size += len(value)
        run.append((key, value))
        if size >= TASK_BYTES:
            yield run
            run, size = [], 0
    if run:
        yield run
