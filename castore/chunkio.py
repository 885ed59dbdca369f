"""Moving tensor bytes: chunk, hash and write on save; read and verify on load.

Save: a tensor's flat buffer is cut into ``chunk_size`` slices (memoryviews,
no copies), hashed on a thread pool (blake3 releases the GIL) while the main
thread hands each hashed chunk to the backend, which writes it unless it has
it already; one commit per batch. Load: chunks are fetched inside one read
transaction and each is verified against its name, then copied into place, on
the pool.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from castore.chunkstore.base import ChunkBackend, Namespace
from castore.errors import ChecksumMismatchError, ChunkMissingError
from castore.faults import fault_point
from castore.hashing import digest_bytes
from castore.objects import TensorEntry
from castore.tree import TensorLeaf

DEFAULT_CHUNK_SIZE = 4 << 20
WRITE_BATCH_BYTES = 256 << 20
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


def _hash_one(piece: memoryview) -> bytes:
    return digest_bytes(piece, threads=1)


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
    pieces: list[tuple[int, memoryview]] = []
    for index, leaf in enumerate(leaves):
        flat = memoryview(leaf.data)  # type: ignore[arg-type]  # ndarray exports a buffer
        pieces += [(index, flat[at : at + chunk_size]) for at in range(0, flat.nbytes, chunk_size)]
    digests: list[list[bytes]] = [[] for _ in leaves]
    stats = WriteStats(logical_bytes=sum(leaf.data.nbytes for leaf in leaves))
    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="castore-hash") as pool:
        hashed = zip(pieces, pool.map(_hash_one, [p for _, p in pieces]), strict=True)
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


_POOL: tuple[int, ThreadPoolExecutor] | None = None


def shared_pool() -> ThreadPoolExecutor:
    """One long-lived verify pool per process (re-made after a fork)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(_WORKERS, thread_name_prefix="castore-read"))
    return _POOL[1]


# Called with (chunk index, verified chunk bytes) for each chunk read.
ChunkConsumer = Callable[[int, np.ndarray], None]


@dataclass
class ReadCounters:
    """What reads fetched from the backend, for reports and tests."""

    chunks: int = 0
    bytes: int = 0


def verify_chunk(
    entry: TensorEntry, index: int, value: memoryview | None, context: dict[str, object]
) -> np.ndarray:
    """Chunk ``index`` of ``entry`` as a uint8 array, if it is present and intact.

    Invariant 3: the bytes must hash to the digest that named them (and have
    the length the entry implies); a name that exists is not evidence.
    """
    key = entry.chunks[index]
    if value is None:
        raise ChunkMissingError(
            f"chunk {index} of tensor {entry.name!r} is missing from the store",
            chunk=key.hex()[:16],
            **context,
        )
    actual = digest_bytes(value, threads=1)
    expected_len = min(entry.chunk_size, entry.nbytes - index * entry.chunk_size)
    if actual != key or len(value) != expected_len:
        raise ChecksumMismatchError(
            f"chunk {index} of tensor {entry.name!r} is damaged",
            expected=key.hex(),
            actual=actual.hex(),
            **context,
        )
    return np.frombuffer(value, dtype=np.uint8)


def read_chunks(
    backend: ChunkBackend,
    entry: TensorEntry,
    indices: Sequence[int] | np.ndarray,
    consume: ChunkConsumer,
    counters: ReadCounters,
    where: dict[str, object],
) -> None:
    """Fetch, verify and hand over chunks ``indices`` of ``entry``.

    Every chunk is checked against its digest before ``consume`` sees it; a
    missing or damaged chunk raises, naming the tensor and chunk index.
    """
    indices = [int(i) for i in indices]
    if not indices:
        return
    pool = shared_pool()
    context = {**where, "tensor": entry.name}
    keys = [entry.chunks[i] for i in indices]

    def verify_and_consume(position: int, value: memoryview | None) -> None:
        index = indices[position]
        consume(index, verify_chunk(entry, index, value, context))

    def visit(values: Iterator[memoryview | None]) -> None:
        # Hand each chunk to the pool as soon as it is fetched, so the next
        # fetch (page faults) overlaps the hashing of this one.
        futures = []
        try:
            for position, value in enumerate(values):
                if value is not None:
                    counters.chunks += 1
                    counters.bytes += len(value)
                futures.append(pool.submit(verify_and_consume, position, value))
            for future in futures:
                future.result()  # the first failure, in chunk order
        finally:
            wait(futures)  # no worker may touch a buffer after the transaction ends

    backend.read_many(Namespace.CHUNKS, keys, visit)


@dataclass(frozen=True)
class ChunkRequest:
    """One chunk of one saved box, and where its verified bytes go."""

    entry: TensorEntry
    index: int
    deliver: ChunkConsumer


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
    keys = list(dict.fromkeys(request.entry.chunks[request.index] for request in requests))
    first: dict[bytes, ChunkRequest] = {}
    for request in requests:
        first.setdefault(request.entry.chunks[request.index], request)
    pool = shared_pool()

    def verify(key: bytes, value: memoryview | None) -> None:
        request = first[key]
        context = {**where, "tensor": request.entry.name}
        verify_chunk(request.entry, request.index, value, context)

    def visit(values: Iterator[memoryview | None]) -> None:
        held: dict[bytes, memoryview] = {}
        futures = []
        error: BaseException | None = None
        try:
            for key, value in zip(keys, values, strict=True):
                if value is not None:
                    held[key] = value
                    counters.chunks += 1
                    counters.bytes += len(value)
                futures.append(pool.submit(verify, key, value))
            for future in futures:
                error = error or future.exception()
        finally:
            wait(futures)
        agree(error)  # raises on every party unless all verified everything
        jobs = [
            pool.submit(r.deliver, r.index, np.frombuffer(held[r.entry.chunks[r.index]], np.uint8))
            for r in requests
        ]
        try:
            for job in jobs:
                job.result()
        finally:
            wait(jobs)

    backend.read_many(Namespace.CHUNKS, keys, visit)
