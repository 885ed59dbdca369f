"""Writing tensor bytes: cut into chunks, hash, and store the new ones on save.

A tensor's flat buffer is cut where its tensor's grid cuts it
(:func:`leaf_cell`, castore.format.grid: slices of at most ``chunk_size``,
memoryviews, no copies) and hashed while the main thread hands each hashed chunk to the
backend, which writes it unless it has it already; one commit per batch.
Chunks of at least ``INLINE_BYTES`` are hashed on the shared pool
(:mod:`castore.core.hashpool`), the smaller ones by the calling thread.
Reading them back, verified, is :mod:`castore.core.chunkread`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

import numpy as np

from castore.chunkstore.base import ChunkBackend, Namespace, PutResult
from castore.core.encoding import EncodeStage, leaf_encoders
from castore.core.hashpool import INLINE_BYTES, TASK_BYTES, shared_pool
from castore.format.codec import Encoder
from castore.format.dtypes import numpy_dtype
from castore.format.grid import box_chunk_starts, cut_at, writer_cell
from castore.format.hashing import Buffer
from castore.format.objects import TensorEntry
from castore.format.pieces import hash_chunk
from castore.format.tree import TensorLeaf
from castore.support.faults import fault_point
from castore.support.progress import NO_BAR, Bar

DEFAULT_CHUNK_SIZE = 4 << 20
WRITE_BATCH_BYTES = 256 << 20


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


@dataclass
class _Cuts:
    """Every chunk of a save's leaves in order (views of their buffers), where each
    leaf's chunks end in that list, and each leaf's grid (as :func:`leaf_cell` says)."""

    views: list[memoryview]
    ends: list[int]
    cells: list[tuple[int, int] | None]


def _cut(leaves: Sequence[TensorLeaf], chunk_size: int) -> _Cuts:
    """Every leaf cut on its grid; each distinct geometry's grid and chunk starts are
    worked out once (a model repeats its block's shapes: 2,004 tensors, 22 geometries)."""
    cuts = _Cuts([], [], [])
    views, ends, cells = cuts.views, cuts.ends, cuts.cells
    grids: dict[tuple[Any, ...], tuple[tuple[int, int] | None, Any]] = {}
    for leaf in leaves:
        geometry = (leaf.dtype, leaf.shape, leaf.offsets, leaf.local_shape)
        grid = grids.get(geometry)
        if grid is None:
            grid = grids[geometry] = (
                leaf_cell(leaf, chunk_size),
                leaf_chunk_starts(leaf, chunk_size),
            )
        cell, starts = grid
        flat = memoryview(leaf.data).cast("B")  # type: ignore[arg-type]
        if len(starts) == 1 and flat.nbytes:  # most tensors are one chunk: no slicing
            views.append(flat)
        elif flat.nbytes:
            views += cut_at(flat, starts)
        ends.append(len(views))
        cells.append(cell)
    return cuts


def leaf_cell(leaf: TensorLeaf, chunk_size: int) -> tuple[int, int] | None:
    """The grid ``leaf``'s tensor is cut on (castore.format.grid.writer_cell); None
    only where a test writes as castore did before the grid (tests/helpers/pregrid.py)."""
    return writer_cell(leaf.shape, numpy_dtype(leaf.dtype).itemsize, chunk_size)


def leaf_chunk_starts(leaf: TensorLeaf, chunk_size: int) -> Any:
    """Where each of ``leaf``'s chunks starts in its box's buffer (int64 array)."""
    itemsize = numpy_dtype(leaf.dtype).itemsize
    cell = leaf_cell(leaf, chunk_size)
    if cell is None:
        return np.arange(0, math.prod(leaf.local_shape) * itemsize, chunk_size, dtype=np.int64)
    return box_chunk_starts(leaf.offsets, leaf.local_shape, itemsize, cell)


def cut_leaf(leaf: TensorLeaf, chunk_size: int, data: Buffer | None = None) -> list[memoryview]:
    """``leaf``'s bytes (or ``data``, the same bytes elsewhere) cut into its grid chunks."""
    flat = memoryview(leaf.data if data is None else data).cast("B")  # type: ignore[arg-type]
    if not flat.nbytes:
        return []
    return cut_at(flat, leaf_chunk_starts(leaf, chunk_size))


def _hash_run(pieces: list[memoryview]) -> list[tuple[bytes, bytes]]:
    return [hash_chunk(piece) for piece in pieces]


def _pool_runs(pieces: Sequence[memoryview]) -> Iterator[list[memoryview]]:
    """The pieces the pool hashes, in order, in runs of about ``TASK_BYTES``."""
    for run in _index_runs(pieces):
        yield [pieces[index] for index in run]


def _in_order(
    pieces: Sequence[memoryview], hashing: list[Future[list[tuple[bytes, bytes]]]]
) -> Iterator[tuple[bytes, bytes]]:
    """Every piece's hash_chunk, in order: small ones hashed here, the others by ``hashing``."""
    from_pool = chain.from_iterable(future.result() for future in hashing)
    for piece in pieces:
        yield next(from_pool) if piece.nbytes >= INLINE_BYTES else hash_chunk(piece)


def digests_in_order(views: Sequence[memoryview], *, inline: bool = False) -> Iterator[bytes]:
    """Every view's blake3 digest, in order (:func:`hashed_in_order` without the pieces)."""
    return (digest for digest, _cvs in hashed_in_order(views, inline=inline))


def hashed_in_order(
    views: Sequence[memoryview], *, inline: bool = False
) -> Iterator[tuple[bytes, bytes]]:
    """Every view's blake3 digest and its pieces' chaining values (castore.format.pieces),
    in order: the big ones on the shared pool, unless ``inline``.

    The pool starts on the big ones at the call, so a caller may do other work
    (write another rank's chunks) before it reads the digests. ``inline``
    hashes on the calling thread only: a background save that must not take
    more than one core from training.
    """
    if inline:
        return (hash_chunk(view) for view in views)
    pool = shared_pool()
    hashing = [pool.submit(_hash_run, run) for run in _pool_runs(views)]
    return _collected(views, hashing)


def _collected(
    views: Sequence[memoryview], hashing: list[Future[list[tuple[bytes, bytes]]]]
) -> Iterator[tuple[bytes, bytes]]:
    try:
        yield from _in_order(views, hashing)
    finally:
        for future in hashing:
            future.cancel()


def write_leaves(
    backend: ChunkBackend,
    leaves: Sequence[TensorLeaf],
    chunk_size: int,
    *,
    midway_fault: str = "save.mid_chunks",
    bar: Bar = NO_BAR,
    known: dict[int, TensorEntry] | None = None,
    codec: str = "none",
) -> tuple[list[TensorEntry], WriteStats]:
    """Store every leaf's chunks (new ones only) and return their tensor entries.

    ``midway_fault`` names the fault point passed after each committed batch,
    when some of the leaves' chunks are durable and no manifest yet names them.
    ``bar`` counts each chunk's bytes as the backend takes it. ``known``: leaf
    index -> the entry it was last saved as, whose chunks the store holds
    already, neither hashed nor written (castore.core.unchanged: a save that
    trusts version counters).
    ``codec``: the setting new chunks are encoded by (castore.format.codec;
    "none" stores them raw).
    """
    if known:
        return _write_unknown(backend, leaves, chunk_size, midway_fault, bar, known, codec)
    cuts = _cut(leaves, chunk_size)
    views = cuts.views
    stats = WriteStats(logical_bytes=sum(leaf.data.nbytes for leaf in leaves))
    chunks = _HashedChunks(views, shared_pool(), bar)
    stage = None if codec == "none" else EncodeStage(backend, shared_pool())
    encoders = _view_encoders(codec, leaves, cuts.ends) if stage is not None else []
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
    digests, cvs = chunks.digests, chunks.cvs
    entries = [
        _entry(
            leaf,
            chunk_size,
            tuple(digests[start:end]),
            leaf.data.nbytes,
            cell,
            b"".join(cvs[start:end]),
        )
        for leaf, (start, end), cell in zip(
            leaves, pairwise([0, *cuts.ends]), cuts.cells, strict=True
        )
    ]
    return entries, stats


def entry_of(
    leaf: TensorLeaf,
    chunk_size: int,
    chunks: tuple[bytes, ...],
    nbytes: int | None = None,
    pieces: bytes = b"",
) -> TensorEntry:
    """The tensor entry of ``leaf`` cut on its grid into ``chunks``; ``nbytes``
    for a leaf whose bytes are not in ``leaf.data`` (an async save's, still on its GPU);
    ``pieces``: the chunks' piece chaining values (castore.format.pieces)."""
    size = leaf.data.nbytes if nbytes is None else nbytes
    return _entry(leaf, chunk_size, chunks, size, leaf_cell(leaf, chunk_size), pieces)


def _entry(
    leaf: TensorLeaf,
    chunk_size: int,
    chunks: tuple[bytes, ...],
    nbytes: int,
    cell: tuple[int, int] | None,
    pieces: bytes = b"",
) -> TensorEntry:
    # Consistent by construction (the chunks are this leaf's, cut on ``cell``): built
    # without the frozen dataclass's per-field setattr, as a decoded table's entries are.
    return TensorEntry.trusted(
        leaf.name,
        leaf.dtype,
        leaf.shape,
        leaf.offsets,
        leaf.local_shape,
        nbytes,
        chunk_size,
        chunks,
        leaf.framework,
        cell,
        pieces,
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
    known: dict[int, TensorEntry],
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
    for i, seen in known.items():
        leaf = leaves[i]
        entries[i] = entry_of(leaf, chunk_size, seen.chunks, pieces=seen.pieces)
        stats.logical_bytes += leaf.data.nbytes
        stats.reused_chunks += len(seen.chunks)
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


def _hash_into(
    views: Sequence[memoryview], run: list[int], digests: list[bytes], cvs: list[bytes]
) -> None:
    for index in run:
        # The piece values first: a filled digest slot says the chunk is done.
        digest, cvs[index] = hash_chunk(views[index])
        digests[index] = digest


class _HashedChunks:
    """A save's chunks in order with their digests, handed to the backend batch by batch.

    ``digests`` has one slot per chunk, filled in place (and ``cvs``, the chunk's
    pieces' chaining values, castore.format.pieces): the pool fills the
    big chunks' slots ahead, in runs (one task and one wait per run, not per
    chunk); the small chunks' are hashed here as they are reached. ``handed``
    counts the chunks given to the backend so far.
    """

    def __init__(self, views: list[memoryview], pool: ThreadPoolExecutor, bar: Bar) -> None:
        self.views = views
        self.digests: list[bytes] = [b""] * len(views)
        self.cvs: list[bytes] = [b""] * len(views)
        self.handed = 0
        self.bar = bar
        self.hashing: deque[Future[None]] = deque(
            pool.submit(_hash_into, views, run, self.digests, self.cvs)
            for run in _index_runs(views)
        )

    def batch(self, limit: int) -> Iterator[tuple[bytes, memoryview]]:
        """(digest, chunk) from the first chunk not handed yet until ``limit`` bytes are out."""
        views, digests, bar = self.views, self.digests, self.bar
        size = 0
        for index in range(self.handed, len(views)):
            view = views[index]
            if view.nbytes < INLINE_BYTES:
                digests[index], self.cvs[index] = hash_chunk(view)
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
