"""Reading tensor bytes: fetch, verify against their names, deliver.

The chunks of a whole request (a slice, or every box a rank restores into
live tensors) are fetched inside one read transaction; each distinct chunk is
verified against its name once, then copied to every place that wants it
(invariant 3: no destination sees a byte before it is verified). A load into
new tensors reads through :mod:`castore.core.readplan`, which reads chunks in
place and falls back to these functions. Chunks of at least ``INLINE_BYTES``
are verified on the shared pool (:mod:`castore.core.hashpool`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from castore.chunkstore.base import Again, ChunkBackend, Namespace
from castore.core.hashpool import INLINE_BYTES, TASK_BYTES, shared_pool
from castore.errors import ChecksumMismatchError, ChunkMissingError
from castore.format.codec import CodecError, frame_codec
from castore.format.codec import decode as decode_frame
from castore.format.hashing import digest_here
from castore.format.objects import TensorEntry
from castore.format.pieces import chunk_cvs, names_chunk, piece_span, pieces_match
from castore.support.progress import NO_BAR, Bar

# Called with (chunk index, verified chunk bytes) for each chunk read.
ChunkConsumer = Callable[[int, np.ndarray], None]


@dataclass
class ReadCounters:
    """What reads fetched from the backend, for reports and tests."""

    chunks: int = 0
    bytes: int = 0


def expected_length(entry: TensorEntry, index: int) -> int:
    """The length chunk ``index`` of ``entry`` must have (the last one may be short)."""
    return entry.chunk_length(index)


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
    """One chunk of one saved box, and where its verified bytes go.

    ``span``: the bytes [lo, hi) of the chunk that ``deliver`` reads, where it reads
    only part of it; None where it may read any.
    """

    entry: TensorEntry
    index: int
    deliver: ChunkConsumer
    span: tuple[int, int] | None = None


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

    def __init__(
        self, requests: Sequence[ChunkRequest], where: dict[str, object], in_place: bool = False
    ) -> None:
        self.wanted: dict[bytes, list[ChunkRequest]] = {}
        for request in requests:
            self.wanted.setdefault(request.entry.chunks[request.index], []).append(request)
        self.keys = list(self.wanted)
        self.where = where
        # Chunks that were stored as frames, decoded by verify, for deliver.
        self.decoded: dict[bytes, np.ndarray] = {}
        # Chunks of which every request reads part, with recorded pieces: the piece-aligned
        # bytes [lo, hi) to verify, and the pieces' chaining values (castore.format.pieces).
        self.partial: dict[bytes, tuple[int, int, bytes]] = {}
        for key, wanted in self.wanted.items():
            if any(request.span is None for request in wanted):
                continue
            first = wanted[0]
            cvs = chunk_cvs(first.entry, first.index)
            if cvs is None or not names_chunk(cvs, key):
                continue  # none recorded, or values that are not this chunk's: read it whole
            length = expected_length(first.entry, first.index)
            lo = min(request.span[0] for request in wanted)  # type: ignore[index]
            hi = max(request.span[1] for request in wanted)  # type: ignore[index]
            start, end = piece_span(lo, hi, length)
            if end - start < length:
                self.partial[key] = (start, end, cvs)
        # Whether the backend's values are views of mapped files (only what is touched is
        # read): then a partly verified chunk counts only its pieces' bytes as read.
        self.in_place = in_place

    def fetched(self, key: bytes, value: memoryview) -> int:
        """The bytes a fetched value counts as read (ReadCounters)."""
        part = self.partial.get(key) if self.in_place else None
        return len(value) if part is None else part[1] - part[0]

    def verify(self, key: bytes, value: memoryview | None) -> np.ndarray:
        """Check one fetched chunk against its name, and its length for every request."""
        first, *others = self.wanted[key]
        part = self.partial.get(key)
        if part is not None and value is not None and len(value) == expected_length(
            first.entry, first.index
        ):
            chunk = self._verify_pieces(first, key, value, part)
        else:
            chunk = verify_chunk(first.entry, first.index, value, self.where)
        if value is not None and chunk.size != len(value):
            self.decoded[key] = chunk
        for request in others:
            # Same digest, so same bytes; a manifest may still disagree on the length.
            if chunk.size != expected_length(request.entry, request.index):
                verify_chunk(request.entry, request.index, value, self.where)  # raises
        return chunk

    def _verify_pieces(
        self, request: ChunkRequest, key: bytes, value: memoryview, part: tuple[int, int, bytes]
    ) -> np.ndarray:
        """The chunk as a uint8 array, of which only the pieces in ``part`` are verified
        (every byte the requests read lies in them; their values merge to its name)."""
        start, end, cvs = part
        if not pieces_match(cvs, value[start:end], start):
            entry = request.entry
            raise ChecksumMismatchError(
                f"chunk {request.index} of tensor {entry.name!r} is damaged "
                f"(in its bytes {start} to {end})",
                expected=key.hex(),
                actual="",
                **{**self.where, "tensor": entry.name},
            )
        return np.frombuffer(value, dtype=np.uint8)

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
            if run and not futures and size < TASK_BYTES:
                # All of it is one small run (a slice's few chunks): handing it to the
                # pool would cost a thread's wake-up, more than its hashing.
                try:
                    _work_run(work, run)
                except Exception as exc:
                    failure = exc
            elif run:
                futures.append(pool.submit(_work_run, work, run))
    finally:
        wait(futures)
    for future in futures:
        error = future.exception()
        if error is not None:
            return error
    return failure


def verify_fetched(
    pool: ThreadPoolExecutor,
    items: Iterable[tuple[Tag, memoryview | None]],
    work: Callable[[Tag, memoryview | None], object],
    key_of: Callable[[Tag], bytes],
    again: Again,
) -> tuple[BaseException | None, dict[Tag, memoryview]]:
    """:func:`apply_fetched` of a verifying ``work``, a damaged chunk read once more.

    A chunk whose ``work`` raises ChecksumMismatchError or CodecError (its
    bytes are not its name's) is asked ``again`` of its backend
    (ChunkBackend.read_to_verify: another source's copy), on this thread once
    every first try is done, and ``work`` runs on that copy; with no other
    copy, its first error stands. Returns the first failure in chunk order
    (a chunk that failed for another reason stops there) and the copies
    ``again`` gave and ``work`` accepted, by tag, for delivering them.
    """
    damaged: list[tuple[int, Tag, BaseException]] = []  # appended from pool threads
    stopped: list[int] = []  # where chunks failed for another reason

    def first_try(at_tag: tuple[int, Tag], value: memoryview | None) -> None:
        at, tag = at_tag
        try:
            work(tag, value)
        except (ChecksumMismatchError, CodecError) as exc:
            if value is not None:
                damaged.append((at, tag, exc))
                return
            stopped.append(at)
            raise
        except Exception:
            stopped.append(at)
            raise

    numbered = (((at, tag), value) for at, (tag, value) in enumerate(items))
    failure = apply_fetched(pool, numbered, first_try)
    copies: dict[Tag, memoryview] = {}
    stop = min(stopped, default=None)
    first: BaseException | None = None
    for at, tag, error in sorted(damaged, key=lambda item: item[0]):
        if stop is not None and at > stop:
            break  # the failure before it comes first
        # Every damaged chunk is asked again, so that its backend counts each.
        value = again(key_of(tag))
        if value is None:
            first = first or error
            continue
        try:
            work(tag, value)
        except Exception as exc:  # noqa: BLE001 - handed back, as apply_fetched does
            first = first or exc
            continue
        copies[tag] = value
    return first or failure, copies


def count_fetched(
    tags: Sequence[Tag],
    values: Iterator[memoryview | None],
    counters: ReadCounters,
    size: Callable[[Tag, memoryview], int] | None = None,
) -> Iterator[tuple[Tag, memoryview | None]]:
    """Each value fetched, with its tag (one per key asked for), counted as it goes by
    (``size``: the bytes a value counts, default all of it)."""
    for tag, value in zip(tags, values, strict=True):
        if value is not None:
            counters.chunks += 1
            counters.bytes += len(value) if size is None else size(tag, value)
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
    request for it: no request sees bytes before they are verified. A damaged
    chunk is read again from another source where the backend has one
    (:func:`verify_fetched`). A missing or damaged chunk raises (the first in
    request order), naming the tensor and chunk index; the destinations may
    then hold some chunks, so callers must discard them. ``bar`` advances by
    ``request_bytes`` as chunks are delivered.
    """
    plan = _Plan(requests, where, backend.reads_in_place)
    if not plan.keys:
        return
    pool = shared_pool()
    work = plan.counting(plan.verify_and_deliver, bar) if bar else plan.verify_and_deliver

    def visit(values: Iterator[memoryview | None], again: Again) -> None:
        fetched = count_fetched(plan.keys, values, counters, plan.fetched)
        error, _ = verify_fetched(pool, fetched, work, bytes, again)
        if error is not None:
            raise error

    backend.read_to_verify(Namespace.CHUNKS, plan.keys, visit)


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
    plan = _Plan(requests, where, backend.reads_in_place)
    pool = shared_pool()

    def visit(values: Iterator[memoryview | None], again: Again) -> None:
        held: list[Fetched] = []

        def holding(items: Iterator[Fetched]) -> Iterator[Fetched]:
            for item in items:
                held.append(item)
                yield item

        fetched = holding(count_fetched(plan.keys, values, counters, plan.fetched))
        error, copies = verify_fetched(pool, fetched, plan.verify, bytes, again)
        agree(error)
        # `agree` raised on every party unless all verified everything.
        if copies:  # the damaged chunks' verified copies from another source
            held = [(key, copies.get(key, value)) for key, value in held]
        error = apply_fetched(pool, held, plan.deliver)
        if error is not None:
            raise error

    backend.read_to_verify(Namespace.CHUNKS, plan.keys, visit)
