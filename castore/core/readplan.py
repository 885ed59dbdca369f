"""Filling new tensors: a load's chunk reads as flat lists, read into place and verified there.

A load allocates the tensors it returns, so nothing else can see their memory
until it returns them, and on any failure it drops them. That allows what a
restore into live tensors may not do (see :func:`castore.core.chunkread.read_agree_deliver`):
each chunk is read straight into its place in the new tensor (``pread``, where
the backend offers a :class:`~castore.chunkstore.base.ChunkReader`) and hashed
there; no map of the pack, no second pass over the bytes to copy them. A chunk
that does not verify in place is read again the ordinary way (``read_many``
and :func:`~castore.core.chunkread.verify_chunk`), which either raises the error
naming it or, if the index moved it meanwhile, gives its verified bytes.
Backends without a reader (blob stores, tiers, memory) fetch, verify, then copy.

Invariant 3 holds on both paths: no tensor is returned holding a byte that
was not hashed against its chunk's name, with the length its entry implies.

A plan holds one digest and one destination view per chunk in flat lists,
and each saved box once: no object, closure or dataclass per chunk. Boxes
that do not land as one contiguous byte range of their tensor (a column
shard) are planned as :class:`~castore.core.chunkread.ChunkRequest` s and read
by :func:`~castore.core.chunkread.read_requests` after the whole chunks.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections.abc import Iterator
from concurrent.futures import Future, wait

from castore.chunkstore.base import Again, ChunkBackend, ChunkReader, Namespace
from castore.core.chunkread import (
    ChunkRequest,
    ReadCounters,
    count_fetched,
    read_requests,
    request_bytes,
    verify_chunk,
    verify_fetched,
)
from castore.core.hashpool import INLINE_BYTES, TASK_BYTES, shared_pool
from castore.errors import CorruptObjectError
from castore.format.codec import CodecError
from castore.format.codec import decode as decode_frame
from castore.format.grid import cut_at
from castore.format.hashing import digest_here, hasher_here
from castore.format.objects import TensorEntry
from castore.support.progress import NO_BAR, Bar

# A chunk read into its place is read and hashed in pieces of at most this many
# bytes: the hash reads each piece while the copy has just left it in cache.
READ_PIECE = 1 << 20


class ReadPlan:
    """The chunk reads that fill new buffers: whole chunks in flat lists, the rest as requests.

    Only for buffers nobody else reads before :func:`read_plan` returns (it may
    write a chunk into its place before verifying it, and a failure leaves any
    bytes there): tensors the load itself allocated.
    """

    def __init__(self) -> None:
        self.keys: list[bytes] = []  # per chunk: its digest
        self.views: list[memoryview] = []  # per chunk: its place, as long as its entry implies
        self.entries: list[TensorEntry] = []  # per box with chunks: its entry ...
        self.starts: list[int] = []  # ... and the plan position of its chunk 0
        self.requests: list[ChunkRequest] = []  # boxes scattered in their destination

    def add_whole(
        self, entry: TensorEntry, flat: memoryview, where: dict[str, object] | None = None
    ) -> None:
        """Every chunk of ``entry``'s box into ``flat``, its bytes: each chunk where it starts.

        ``where`` (run, generation) goes into the error if the entry disagrees with ``flat``.
        """
        size, chunk_size, chunks = entry.nbytes, entry.chunk_size, entry.chunks
        # TensorEntry.check refuses both of these before anything is allocated;
        # checked again here, where a disagreement would leave bytes unwritten.
        if flat.nbytes != size:
            raise CorruptObjectError(
                f"tensor entry says {size} bytes, its box holds {flat.nbytes}",
                **{**(where or {}), "tensor": entry.name},
            )
        if not size:
            views = []
        elif (size <= chunk_size) if entry.cell is None else len(chunks) == 1:
            views = [flat]
        elif entry.cell is None:
            views = [flat[at : at + chunk_size] for at in range(0, size, chunk_size)]
        else:
            views = cut_at(flat, entry.chunk_starts)
        if len(views) != len(chunks):
            raise CorruptObjectError(
                f"tensor entry lists {len(chunks)} chunks, its size needs {len(views)}",
                **{**(where or {}), "tensor": entry.name},
            )
        if views:
            self.entries.append(entry)
            self.starts.append(len(self.keys))
            self.keys += chunks
            self.views += views

    def nbytes(self) -> int:
        """The bytes the plan fills: what a load's progress bar counts."""
        return sum(view.nbytes for view in self.views) + request_bytes(self.requests)

    def chunk_at(self, position: int) -> tuple[TensorEntry, int]:
        """The entry and chunk index of plan position ``position`` (to name it in an error)."""
        box = bisect_right(self.starts, position) - 1
        return self.entries[box], position - self.starts[box]


def read_plan(
    backend: ChunkBackend,
    plan: ReadPlan,
    counters: ReadCounters,
    where: dict[str, object],
    bar: Bar = NO_BAR,
) -> None:
    """Fill every place ``plan`` names, each chunk verified against its name and length.

    Each distinct chunk is read and verified once, then copied to its other
    places. A missing or damaged chunk raises (the first in plan order, whole
    chunks before requests), naming the tensor and chunk index; the buffers
    then hold anything, so callers drop them. ``bar`` advances by each place's bytes.
    """
    if plan.keys:
        first: dict[bytes, int] = {}
        copies: list[tuple[int, int]] = []
        for position, key in enumerate(plan.keys):
            at = first.setdefault(key, position)
            if at != position:
                copies.append((position, at))
        positions = list(first.values())  # ascending: first places in plan order
        keys = list(first)
        reader = backend.chunk_reader(keys)
        if reader is None:
            _fetch_and_copy(backend, plan, keys, positions, counters, where, bar)
        else:
            with reader:
                _read_in_place(backend, reader, plan, positions, counters, where, bar)
        _copy_repeats(plan, copies, where, bar)
    if plan.requests:
        read_requests(backend, plan.requests, counters, where, bar)


def _read_in_place(
    backend: ChunkBackend,
    reader: ChunkReader,
    plan: ReadPlan,
    positions: list[int],
    counters: ReadCounters,
    where: dict[str, object],
    bar: Bar,
) -> None:
    """Read each chunk into its first place and hash it there: small ones here, larger
    ones in pool runs (``pread`` and blake3 release the GIL)."""
    pool = shared_pool()
    keys, views, lengths = plan.keys, plan.views, reader.lengths
    futures: list[Future[list[int]]] = []
    run: list[tuple[int, int]] = []  # (reader position, plan position)
    size = 0
    done = len(positions)
    failure: tuple[int, Exception] | None = None
    try:
        for i, position in enumerate(positions):
            view = views[position]
            length = view.nbytes
            if length >= INLINE_BYTES:
                run.append((i, position))
                size += length
                if size >= TASK_BYTES:
                    futures.append(pool.submit(_fill_run, reader, keys, views, run, bar))
                    run, size = [], 0
                continue
            if _fill(reader, i, view, keys[position]):
                if bar:
                    bar.update(length)
                continue
            try:
                _read_again(backend, plan, position, where, bar)
            except Exception as exc:
                failure, done = (position, exc), i + 1
                break
        if run:  # before a failure too: these chunks come first in plan order
            futures.append(pool.submit(_fill_run, reader, keys, views, run, bar))
    finally:
        wait(futures)  # no task may read into a buffer, or use the reader, after this
    found = [length for length in lengths[:done] if length is not None]
    counters.chunks += len(found)
    counters.bytes += sum(found)
    limit = len(keys) if failure is None else failure[0]
    for future in futures:
        for position in future.result():
            if position < limit:  # a failure earlier in plan order is the one to raise
                _read_again(backend, plan, position, where, bar)
    if failure is not None:
        raise failure[1]


def _fill_run(
    reader: ChunkReader,
    keys: list[bytes],
    views: list[memoryview],
    run: list[tuple[int, int]],
    bar: Bar,
) -> list[int]:
    """Read and verify a run of chunks in place; return the plan positions that failed."""
    failed = []
    for i, position in run:
        view = views[position]
        if _fill(reader, i, view, keys[position]):
            if bar:
                bar.update(view.nbytes)
        else:
            failed.append(position)
    return failed


def _fill(reader: ChunkReader, i: int, view: memoryview, key: bytes) -> bool:
    """Read chunk ``i`` into ``view`` in pieces, hashing each as it lands; True if intact."""
    size = view.nbytes
    stored = reader.lengths[i]
    if stored != size:
        return stored is not None and _fill_frame(reader, i, view, key, stored)
    if size <= READ_PIECE:
        return reader.readinto(i, view) == size and digest_here(view) == key
    hasher = hasher_here()
    for at in range(0, size, READ_PIECE):
        piece = view[at : at + READ_PIECE]
        if reader.readinto(i, piece, at) != piece.nbytes:
            return False
        hasher.update(piece)
    return bool(hasher.digest() == key)


def _fill_frame(reader: ChunkReader, i: int, view: memoryview, key: bytes, stored: int) -> bool:
    """Read chunk ``i``'s frame (castore.format.codec), decode and verify it, then copy it
    into ``view``; False for anything wrong (the ordinary read then names the error)."""
    if stored > view.nbytes:
        return False  # a frame is always shorter than its chunk
    frame = _scratch(stored)
    if reader.readinto(i, frame) != stored:
        return False
    try:
        # Straight into its place: a new tensor nobody reads before the load returns.
        decode_frame(frame, view.nbytes, out=view)
    except CodecError:
        return False
    return digest_here(view) == key


_local = threading.local()


def _scratch(size: int) -> memoryview:
    """A buffer of ``size`` bytes for this thread's frames, reused (no page faults per
    chunk); grown to the largest frame read so far, at most a chunk."""
    buffer: bytearray | None = getattr(_local, "scratch", None)
    if buffer is None or len(buffer) < size:
        buffer = _local.scratch = bytearray(size)
    return memoryview(buffer)[:size]


def _read_again(
    backend: ChunkBackend, plan: ReadPlan, position: int, where: dict[str, object], bar: Bar
) -> None:
    """Read one chunk that did not verify in place the ordinary way: raise the error that
    names it, or put its verified bytes in place (the index moved it meanwhile)."""
    entry, index = plan.chunk_at(position)
    view = plan.views[position]

    def keep(values: Iterator[memoryview | None]) -> None:
        view[:] = verify_chunk(entry, index, next(values), where).data

    backend.read_many(Namespace.CHUNKS, [plan.keys[position]], keep)
    if bar:
        bar.update(view.nbytes)


def _fetch_and_copy(
    backend: ChunkBackend,
    plan: ReadPlan,
    keys: list[bytes],
    positions: list[int],
    counters: ReadCounters,
    where: dict[str, object],
    bar: Bar,
) -> None:
    """Fetch each chunk (``read_to_verify``), verify it, then copy it to its first place
    (a damaged one from another source where the backend has one)."""
    views, digests = plan.views, plan.keys

    def verify_and_copy(position: int, value: memoryview | None) -> None:
        view = views[position]
        if value is None or len(value) != view.nbytes or digest_here(value) != digests[position]:
            entry, index = plan.chunk_at(position)
            view[:] = verify_chunk(entry, index, value, where).data  # raises: missing or damaged
        else:
            view[:] = value
        if bar:
            bar.update(view.nbytes)

    pool = shared_pool()

    def visit(values: Iterator[memoryview | None], again: Again) -> None:
        fetched = count_fetched(positions, values, counters)
        error, _ = verify_fetched(pool, fetched, verify_and_copy, digests.__getitem__, again)
        if error is not None:
            raise error

    backend.read_to_verify(Namespace.CHUNKS, keys, visit)


def _copy_repeats(
    plan: ReadPlan, copies: list[tuple[int, int]], where: dict[str, object], bar: Bar
) -> None:
    """Copy each verified chunk to its later places (the same digest: the same bytes)."""
    for position, at in copies:
        source, target = plan.views[at], plan.views[position]
        if target.nbytes != source.nbytes:
            # The same digest, so the same bytes; this entry implies another length.
            entry, index = plan.chunk_at(position)
            verify_chunk(entry, index, source, where)  # raises
        target[:] = source
        if bar:
            bar.update(target.nbytes)
