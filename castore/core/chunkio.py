"""Moving tensor bytes: chunk, hash and write on save; read and verify on load.

Save: a tensor's flat buffer is cut into ``chunk_size`` slices (memoryviews,
no copies) and hashed while the main thread hands each hashed chunk to the
backend, which writes it unless it has it already; one commit per batch.
Load: the chunks of a whole request (a slice, or every box a rank restores
into live tensors) are fetched inside one read transaction; each distinct
chunk is verified against its name once, then copied to every place that
wants it. A load into new tensors reads through :mod:`castore.core.readplan`.

Who hashes: chunks of at least ``INLINE_BYTES`` go to a thread pool (blake3
releases the GIL) in tasks of about ``TASK_BYTES``, so they hash in parallel
and overlap with writing or fetching. Smaller chunks are hashed by the
calling thread as it reaches them. A pool task costs tens of microseconds to
submit and collect, as much as hashing a few KiB; and blake3 releases the
GIL even for a few bytes, so a worker hashing tiny chunks waits for the GIL
after each one while the main thread runs Python. On 20,000 chunks of about
2 KiB, verifying on the pool took 2.4x as long as verifying inline.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any, TypeVar

import numpy as np

from castore.chunkstore.base import ChunkBackend, Namespace, PutResult
from castore.core.encoding import EncodeStage, leaf_encoders
from castore.errors import ChecksumMismatchError, ChunkMissingError
from castore.format.codec import CodecError, Encoder, frame_codec
from castore.format.codec import decode as decode_frame
from castore.format.hashing import Buffer, digest_bytes, digest_here
from castore.format.objects import TensorEntry
from castore.format.tree import TensorLeaf
from castore.support.faults import fault_point
from castore.support.progress import NO_BAR, Bar

DEFAULT_CHUNK_SIZE = 4 << 20
WRITE_BATCH_BYTES = 256 << 20
# Chunks smaller than this are hashed on the calling thread (see above).
INLINE_BYTES = 64 << 10
# A pool task's share of the bytes: one chunk at least this large, or a run of
# smaller ones that adds up to it.
TASK_BYTES = 1 << 20
_WORKERS = max(2, min(8, os.cpu_count() or 2))


@dataclass
class WriteStats:
    """What a save's chunks cost: ``new_bytes`` of them were new (raw bytes), stored as
    ``stored_bytes`` (less where a codec compressed them; None: as many as new)."""

    logical_bytes: int = 0
    new_bytes: int = 0
    new_chunks: int = 0
    reused_chunks: int = 0
    stored_bytes: int | None = None

    @property
    def stored(self) -> int:
        return self.new_bytes if self.stored_bytes is None else self.stored_bytes

    def __add__(self, other: WriteStats) -> WriteStats:
        return WriteStats(
            self.logical_bytes + other.logical_bytes,
            self.new_bytes + other.new_bytes,
            self.new_chunks + other.new_chunks,
            self.reused_chunks + other.reused_chunks,
            self.stored + other.stored,
        )

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> WriteStats:
        """The stats a rank sent (``vars`` of its WriteStats)."""
        return cls(
            wire["logical_bytes"],
            wire["new_bytes"],
            wire["new_chunks"],
            wire["reused_chunks"],
            wire.get("stored_bytes"),
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


# -- save ---------------------------------------------------------------------


def _cut(leaves: Sequence[TensorLeaf], chunk_size: int) -> tuple[list[memoryview], list[int]]:
    """Every chunk of every leaf in order (views of the leaves' buffers), and for each
    leaf the index after its last chunk."""
    views: list[memoryview] = []
    ends: list[int] = []
    for leaf in leaves:
        flat = memoryview(leaf.data)  # type: ignore[arg-type]  # ndarray exports a buffer
        size = flat.nbytes
        if 0 < size <= chunk_size:
            views.append(flat)
        elif size:
            views += [flat[at : at + chunk_size] for at in range(0, size, chunk_size)]
        ends.append(len(views))
    return views, ends


def _hash_run(pieces: list[memoryview]) -> list[bytes]:
    return [digest_bytes(piece, threads=1) for piece in pieces]


def _pool_runs(pieces: Sequence[memoryview]) -> Iterator[list[memoryview]]:
    """The pieces the pool hashes, in order, in runs of about ``TASK_BYTES``."""
    for run in _index_runs(pieces):
        yield [pieces[index] for index in run]


def _in_order(pieces: Sequence[memoryview], hashing: list[Future[list[bytes]]]) -> Iterator[bytes]:
    """Every piece's digest, in order: small ones hashed here, the others by ``hashing``."""
    from_pool = chain.from_iterable(future.result() for future in hashing)
    for piece in pieces:
        yield next(from_pool) if piece.nbytes >= INLINE_BYTES else digest_bytes(piece, threads=1)


def digests_in_order(views: Sequence[memoryview], *, inline: bool = False) -> Iterator[bytes]:
    """Every view's blake3 digest, in order: the big ones on the shared pool, unless ``inline``.

    The pool starts on the big ones at the call, so a caller may do other work
    (write another rank's chunks) before it reads the digests. ``inline``
    hashes on the calling thread only: a background save that must not take
    more than one core from training.
    """
    if inline:
        return (digest_bytes(view, threads=1) for view in views)
    pool = shared_pool()
    hashing = [pool.submit(_hash_run, run) for run in _pool_runs(views)]
    return _collected(views, hashing)


def _collected(views: Sequence[memoryview], hashing: list[Future[list[bytes]]]) -> Iterator[bytes]:
    try:
        yield from _in_order(views, hashing)
    finally:
        for future in hashing:
            future.cancel()


def cut_chunks(data: Buffer, chunk_size: int) -> list[memoryview]:
    """``data`` cut into ``chunk_size`` views (the last may be short; none when empty)."""
    flat = memoryview(data).cast("B")
    return [flat[at : at + chunk_size] for at in range(0, flat.nbytes, chunk_size)]


def write_leaves(
    backend: ChunkBackend,
    leaves: Sequence[TensorLeaf],
    chunk_size: int,
    *,
    midway_fault: str = "save.mid_chunks",
    bar: Bar = NO_BAR,
    known: dict[int, tuple[bytes, ...]] | None = None,
    codec: str = "none",
) -> tuple[list[TensorEntry], WriteStats]:
    """Store every leaf's chunks (new ones only) and return their tensor entries.

    ``midway_fault`` names the fault point passed after each committed batch,
    when some of the leaves' chunks are durable and no manifest yet names them.
    ``bar`` counts each chunk's bytes as the backend takes it. ``known``: leaf
    index -> chunk digests the store holds already for it, neither hashed nor
    written (castore.core.unchanged: a save that trusts version counters).
    ``codec``: the setting new chunks are encoded by (castore.format.codec;
    "none" stores them raw).
    """
    if known:
        return _write_unknown(backend, leaves, chunk_size, midway_fault, bar, known, codec)
    views, ends = _cut(leaves, chunk_size)
    stats = WriteStats(logical_bytes=sum(leaf.data.nbytes for leaf in leaves))
    chunks = _HashedChunks(views, shared_pool(), bar)
    stage = None if codec == "none" else EncodeStage(backend, shared_pool())
    encoders = _view_encoders(codec, leaves, ends) if stage is not None else []
    try:
        while chunks.handed < len(views):
            # The backend takes each chunk as its digest arrives, so writing
            # overlaps the hashing of the chunks after it.
            before = chunks.handed
            batch = chunks.batch(WRITE_BATCH_BYTES)
            result = put_counted(backend, stage, batch, lambda: encoders[chunks.handed - 1], stats)
            taken = chunks.handed - before
            if not taken:
                raise RuntimeError("chunk backend returned without taking any chunk")
            stats.new_chunks += result.written
            stats.reused_chunks += taken - result.written
            fault_point(midway_fault)
    finally:
        chunks.cancel()  # a failed save stops hashing what it will not write
    digests = chunks.digests
    entries = [
        entry_of(leaf, chunk_size, tuple(digests[start:end]))
        for leaf, (start, end) in zip(leaves, pairwise([0, *ends]), strict=True)
    ]
    return entries, stats


def entry_of(
    leaf: TensorLeaf, chunk_size: int, chunks: tuple[bytes, ...], nbytes: int | None = None
) -> TensorEntry:
    """The tensor entry of ``leaf`` cut into ``chunks`` of ``chunk_size``; ``nbytes``
    for a leaf whose bytes are not in ``leaf.data`` (an async save's, still on its GPU)."""
    return TensorEntry(
        name=leaf.name,
        dtype=leaf.dtype,
        shape=leaf.shape,
        offsets=leaf.offsets,
        local_shape=leaf.local_shape,
        nbytes=leaf.data.nbytes if nbytes is None else nbytes,
        chunk_size=chunk_size,
        chunks=chunks,
        framework=leaf.framework,
    )


def put_counted(
    backend: ChunkBackend,
    stage: EncodeStage | None,
    pairs: Iterator[tuple[bytes, memoryview]],
    encoder_now: Callable[[], Encoder | None],
    stats: WriteStats,
) -> PutResult:
    """One ``put_many`` of ``pairs`` (through ``stage`` when a codec is on; ``encoder_now``
    names the encoder of the pair just taken), its new and stored bytes added to ``stats``."""
    if stage is None:
        result = backend.put_many(Namespace.CHUNKS, pairs)
        stats.new_bytes += result.written_bytes
        return result
    raw_before = stage.counts.new_bytes
    items = ((digest, view, encoder_now()) for digest, view in pairs)
    result = backend.put_many(Namespace.CHUNKS, stage.run(items))
    stats.new_bytes += stage.counts.new_bytes - raw_before
    stats.stored_bytes = (stats.stored_bytes or 0) + result.written_bytes
    return result


def _view_encoders(codec: str, leaves: Sequence[TensorLeaf], ends: list[int]) -> list[Any]:
    """The encoder of every chunk _cut made (its leaf's, by dtype)."""
    found: list[Any] = []
    for encoder, end in zip(
        leaf_encoders(codec, (leaf.dtype for leaf in leaves)), ends, strict=True
    ):
        found += [encoder] * (end - len(found))
    return found


def _write_unknown(
    backend: ChunkBackend,
    leaves: Sequence[TensorLeaf],
    chunk_size: int,
    midway_fault: str,
    bar: Bar,
    known: dict[int, tuple[bytes, ...]],
    codec: str,
) -> tuple[list[TensorEntry], WriteStats]:
    """write_leaves for the leaves not in ``known``; the others' entries name their chunks."""
    rest = [i for i in range(len(leaves)) if i not in known]
    written, stats = write_leaves(
        backend,
        [leaves[i] for i in rest],
        chunk_size,
        midway_fault=midway_fault,
        bar=bar,
        codec=codec,
    )
    entries: list[TensorEntry | None] = [None] * len(leaves)
    for i, entry in zip(rest, written, strict=True):
        entries[i] = entry
    for i, chunks in known.items():
        leaf = leaves[i]
        entries[i] = entry_of(leaf, chunk_size, chunks)
        stats.logical_bytes += leaf.data.nbytes
        stats.reused_chunks += len(chunks)
        if bar:
            bar.update(leaf.data.nbytes)
    return [e for e in entries if e is not None], stats


def _index_runs(views: Sequence[memoryview]) -> Iterator[list[int]]:
    """The indices of the views the pool hashes, in order, in runs of about ``TASK_BYTES``."""
    run: list[int] = []
    size = 0
    for index, view in enumerate(views):
        if view.nbytes < INLINE_BYTES:
            continue
        run.append(index)
        size += view.nbytes
        if size >= TASK_BYTES:
            yield run
            run, size = [], 0
    if run:
        yield run


def _hash_into(views: Sequence[memoryview], run: list[int], digests: list[bytes]) -> None:
    for index in run:
        digests[index] = digest_bytes(views[index], threads=1)


class _HashedChunks:
    """A save's chunks in order with their digests, handed to the backend batch by batch.

    ``digests`` has one slot per chunk, filled in place: the pool fills the
    big chunks' slots ahead, in runs (one task and one wait per run, not per
    chunk); the small chunks' are hashed here as they are reached. ``handed``
    counts the chunks given to the backend so far.
    """

    def __init__(self, views: list[memoryview], pool: ThreadPoolExecutor, bar: Bar) -> None:
        self.views = views
        self.digests: list[bytes] = [b""] * len(views)
        self.handed = 0
        self.bar = bar
        self.hashing: deque[Future[None]] = deque(
            pool.submit(_hash_into, views, run, self.digests) for run in _index_runs(views)
        )

    def batch(self, limit: int) -> Iterator[tuple[bytes, memoryview]]:
        """(digest, chunk) from the first chunk not handed yet until ``limit`` bytes are out."""
        views, digests, bar = self.views, self.digests, self.bar
        size = 0
        for index in range(self.handed, len(views)):
            view = views[index]
            if view.nbytes < INLINE_BYTES:
                digests[index] = digest_bytes(view, threads=1)
            while not digests[index]:  # its run is not done: wait for the runs up to it
                self.hashing.popleft().result()
            self.handed = index + 1
            size += view.nbytes
            if bar:
                bar.update(view.nbytes)
            yield digests[index], view
            if size >= limit:
                return

    def cancel(self) -> None:
        for future in self.hashing:
            future.cancel()


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
    the length the entry implies); a name that exists is not evidence. A
    stored record of another length that starts as a frame does
    (castore.format.codec) is decoded first, within that length; one that
    does not is damaged. Errors name ``where`` and the tensor.
    """
    key = entry.chunks[index]
    if value is None:
        raise ChunkMissingError(
            f"chunk {index} of tensor {entry.name!r} is missing from the store",
            chunk=key.hex()[:16],
            **{**where, "tensor": entry.name},
        )
    length = expected_length(entry, index)
    if len(value) != length and frame_codec(value) is not None:
        try:
            value = memoryview(decode_frame(value, length))
        except CodecError as exc:
            raise type(exc)(
                f"chunk {index} of tensor {entry.name!r} cannot be decoded: {exc.message}",
                chunk=key.hex()[:16],
                **{**where, "tensor": entry.name},
            ) from None
    actual = digest_here(value)
    if actual != key or len(value) != length:
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


def request_bytes(requests: Iterable[ChunkRequest]) -> int:
    """The bytes of the chunks ``requests`` name, a chunk counted once per request.

    For requests that read whole tensors, their tensor bytes: what a load's bar counts.
    """
    return sum(expected_length(request.entry, request.index) for request in requests)


Fetched = tuple[bytes, "memoryview | None"]
ChunkWork = Callable[[bytes, "memoryview | None"], object]
# What a fetched chunk is known by: its digest, or its place in a plan.
Tag = TypeVar("Tag")


class _Plan:
    """The distinct chunks of some requests, in first-request order, and who wants each."""

    def __init__(self, requests: Sequence[ChunkRequest], where: dict[str, object]) -> None:
        self.wanted: dict[bytes, list[ChunkRequest]] = {}
        for request in requests:
            self.wanted.setdefault(request.entry.chunks[request.index], []).append(request)
        self.keys = list(self.wanted)
        self.where = where
        # Chunks that were stored as frames, decoded by verify, for deliver.
        self.decoded: dict[bytes, np.ndarray] = {}

    def verify(self, key: bytes, value: memoryview | None) -> np.ndarray:
        """Check one fetched chunk against its name, and its length for every request."""
        first, *others = self.wanted[key]
        chunk = verify_chunk(first.entry, first.index, value, self.where)
        if value is not None and chunk.size != len(value):
            self.decoded[key] = chunk
        for request in others:
            # Same digest, so same bytes; a manifest may still disagree on the length.
            if chunk.size != expected_length(request.entry, request.index):
                verify_chunk(request.entry, request.index, value, self.where)  # raises
        return chunk

    def verify_and_deliver(self, key: bytes, value: memoryview | None) -> None:
        chunk = self.verify(key, value)
        for request in self.wanted[key]:
            request.deliver(request.index, chunk)

    def counting(self, work: ChunkWork, bar: Bar) -> ChunkWork:
        """``work``, then ``bar`` advanced by what the chunk's requests take (request_bytes)."""
        weights = {key: request_bytes(wanted) for key, wanted in self.wanted.items()}

        def counted(key: bytes, value: memoryview | None) -> None:
            work(key, value)
            bar.update(weights[key])

        return counted

    def deliver(self, key: bytes, value: memoryview | None) -> None:
        """Copy a chunk that ``verify`` accepted to where it goes."""
        chunk = self.decoded.get(key)
        if chunk is None:
            chunk = np.frombuffer(value, dtype=np.uint8)  # type: ignore[arg-type]
        for request in self.wanted[key]:
            request.deliver(request.index, chunk)


def _work_run(
    work: Callable[[Tag, memoryview | None], object], run: list[tuple[Tag, memoryview | None]]
) -> None:
    for tag, value in run:
        work(tag, value)


def apply_fetched(
    pool: ThreadPoolExecutor,
    items: Iterable[tuple[Tag, memoryview | None]],
    work: Callable[[Tag, memoryview | None], object],
) -> BaseException | None:
    """``work(tag, value)`` on every fetched chunk: small ones here, larger ones in pool runs.

    Returns the first failure in chunk order once every pool task is done (no
    worker may touch a buffer after the read transaction ends); a failure
    here stops the iteration. Each run goes to the pool as soon as it is
    complete, so fetching (index lookups, page faults) overlaps its hashing.
    """
    futures: list[Future[None]] = []
    run: list[tuple[Tag, memoryview | None]] = []
    size = 0
    failure: BaseException | None = None
    try:
        for tag, value in items:
            length = 0 if value is None else len(value)
            if length >= INLINE_BYTES:
                run.append((tag, value))
                size += length
                if size >= TASK_BYTES:
                    futures.append(pool.submit(_work_run, work, run))
                    run, size = [], 0
                continue
            if run:  # the chunks before this one go first, so failures stay in order
                futures.append(pool.submit(_work_run, work, run))
                run, size = [], 0
            try:
                work(tag, value)
            except Exception as exc:
                failure = exc
                break
        else:
            if run:
                futures.append(pool.submit(_work_run, work, run))
    finally:
        wait(futures)
    for future in futures:
        error = future.exception()
        if error is not None:
            return error
    return failure


def count_fetched(
    tags: Sequence[Tag], values: Iterator[memoryview | None], counters: ReadCounters
) -> Iterator[tuple[Tag, memoryview | None]]:
    """Each value fetched, with its tag (one per key asked for), counted as it goes by."""
    for tag, value in zip(tags, values, strict=True):
        if value is not None:
            counters.chunks += 1
            counters.bytes += len(value)
        yield tag, value


def read_requests(
    backend: ChunkBackend,
    requests: Sequence[ChunkRequest],
    counters: ReadCounters,
    where: dict[str, object],
    bar: Bar = NO_BAR,
) -> None:
    """Fetch, verify and deliver every requested chunk, in one read transaction.

    Each distinct chunk is fetched and verified once, then handed to every
    request for it: no request sees bytes before they are verified. A missing
    or damaged chunk raises (the first in request order), naming the tensor
    and chunk index; the destinations may then hold some chunks, so callers
    must discard them. ``bar`` advances by ``request_bytes`` as chunks are delivered.
    """
    plan = _Plan(requests, where)
    if not plan.keys:
        return
    pool = shared_pool()
    work = plan.counting(plan.verify_and_deliver, bar) if bar else plan.verify_and_deliver

    def visit(values: Iterator[memoryview | None]) -> None:
        error = apply_fetched(pool, count_fetched(plan.keys, values, counters), work)
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
        held: list[Fetched] = []

        def holding(items: Iterator[Fetched]) -> Iterator[Fetched]:
            for item in items:
                held.append(item)
                yield item

        agree(apply_fetched(pool, holding(count_fetched(plan.keys, values, counters)), plan.verify))
        # `agree` raised on every party unless all verified everything.
        error = apply_fetched(pool, held, plan.deliver)
        if error is not None:
            raise error

    backend.read_many(Namespace.CHUNKS, plan.keys, visit)
