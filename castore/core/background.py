"""Async saves: the caller snapshots, a background thread writes and publishes.

``Store.save(..., blocking=False)``, ``castore.dist.save(..., blocking=False)``
and ``TrainState.save(..., blocking=False)`` return a :class:`PendingSave` once
the state's bytes are staged (:mod:`castore.core.staging`); the caller may then
change every tensor. One writer thread per store handle then hashes, writes,
commits and publishes, exactly as a blocking save would: a failed async save
publishes nothing and the previous generation stays latest.

- **One in flight.** A store handle runs at most one save at a time. A save
  asked for while one is in flight waits for it (``if_busy="wait"``) or is
  skipped (``"skip"``): its handle says ``skipped`` and the store counts it.
- **Errors never vanish.** A background failure is raised by the handle's
  ``result()``; if nobody asked it, by the next save call and by
  ``Store.close()`` (once: whichever comes first).
- **What follows a publish runs on the writer.** ``on_publish(generation)``
  (``Store.save``'s) runs on the writer thread right after the ref advanced,
  before the handle is done: a pointer or tag it writes is there however the
  process ends later. Its error is the handle's error, the generation still
  published (``result()`` raises it; the note on it says so).
- **At exit** (the main thread ending, ``sys.exit``, an exception, Ctrl-C,
  or SIGTERM while castore's handler is in place) a save in flight is waited
  for, at most ``exit_wait_s``, before the hashing pools stop
  (:mod:`castore.core.shutdown`). One that did not publish by then, or failed
  with nobody told, is named on stderr as NOT published and the process
  exits non-zero; what it wrote is only unreferenced chunks (the publish is
  the ref's atomic advance), which GC collects.
- **Pressure.** ``max_write_bytes_per_s`` paces the writer (a token bucket
  over the bytes it hashes and hands to storage), ``hash_threads=1`` keeps it
  on one core, and ``stagger_s`` starts rank ``r`` of ``n`` writing
  ``stagger_s * r / n`` seconds late, so ranks saving at the same step do not
  hit storage in one burst. A rank writes one pack request at a time, so
  write requests in flight are already one per rank.

One idea, about 770 lines because the async writer's parts (the pending save,
the throttle, the staged write, the writer thread that runs them) share that
thread's lifecycle, its lock and its counters.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from castore.chunkstore.base import ChunkBackend, Namespace
from castore.core import chunkio, hashpool, shutdown
from castore.core.chunkio import (
    WriteStats,
    entry_of,
    hashed_in_order,
    put_counted,
)
from castore.core.commit import (
    PublishFaults,
    build_shard,
    claim_writer,
    publish_single,
)
from castore.core.encoding import EncodeStage, leaf_encoders
from castore.core.history import Generation
from castore.core.staging import (
    STAGING_MODES,
    Piece,
    Snapshot,
    StagedChunk,
    StagingPool,
    leaf_nbytes,
    piece_bytes,
    stage_leaves,
    state_bytes,
)
from castore.errors import CastoreWarning, ChunkMissingError, CommitUnknownError, SaveAborted
from castore.format.grid import cut_at
from castore.format.objects import TensorEntry
from castore.format.tree import EncodedTree, TensorLeaf, encode_local_state, layouts_of
from castore.support.faults import fault_point

IF_BUSY = ("wait", "skip")
OnPublish = Callable[[Generation], None]
# Changed-chunk staging stages whole when more than this fraction of the chunks of
# the handle's last save differed from the save before: hashing on the caller's
# thread then costs more than the copy it saves (under AdamW every chunk changes).
CHANGED_FALLBACK = 0.5
# The single-process save's publish points, reached on the writer thread while
# the caller trains on.
ASYNC_FAULTS = PublishFaults(
    "save.before_objects", "async.before_ref_advance", "save.after_ref_advance"
)
_END = object()  # the caller handed its last piece


@dataclass(frozen=True)
class AsyncOptions:
    """How an async save stages and writes (every field optional).

    ``staging``: ``"full"`` copies every tensor byte; ``"changed"`` hashes in
    place and copies only chunks the previous save of this handle did not
    store. ``staging_bytes``: the most host memory staging may hold (default:
    the state's tensor bytes this rank writes). ``max_write_bytes_per_s``: pace
    of the background writer, per rank. ``hash_threads``: 1 hashes on the
    writer thread alone; None uses castore's shared hashing pool.
    ``stagger_s``: rank ``r`` of ``n`` starts writing ``stagger_s * r / n`` s
    late. ``exit_wait_s``: how long interpreter exit waits for a save in flight.
    """

    staging: str = "full"
    staging_bytes: int | None = None
    max_write_bytes_per_s: float | None = None
    hash_threads: int | None = None
    stagger_s: float = 0.0
    exit_wait_s: float = 600.0

    def __post_init__(self) -> None:
        if self.staging not in STAGING_MODES:
            raise ValueError(f"staging must be one of {STAGING_MODES}, got {self.staging!r}")
        if self.staging_bytes is not None and self.staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {self.staging_bytes}")
        rate = self.max_write_bytes_per_s
        if rate is not None and not rate > 0:
            raise ValueError(f"max_write_bytes_per_s must be positive, got {rate}")
        if self.hash_threads not in (None, 1):
            raise ValueError(f"hash_threads must be None or 1, got {self.hash_threads}")
        if not self.stagger_s >= 0 or not self.exit_wait_s >= 0:
            raise ValueError("stagger_s and exit_wait_s must be non-negative")


@dataclass(frozen=True)
class SaveBytes:
    """Bytes of one rank's save: its tensors, what it staged, new chunk bytes, all written.

    ``written`` is the new chunk bytes plus the manifest objects this rank stored.
    """

    logical: int
    staged: int
    new: int
    written: int


class PendingSave:
    """A save running in the background; see the module text."""

    def __init__(
        self,
        run: str,
        step: int,
        *,
        skipped: bool = False,
        started: float | None = None,
        on_publish: OnPublish | None = None,
    ) -> None:
        self.run = run
        self.step = step
        self.skipped = skipped
        self.on_publish = on_publish  # run by the writer once published, before done()
        # Seconds per phase: "held" (the caller, in all), "busy_wait" (for the save
        # before), "snapshot" (copying), "staging_wait" (for free buffers), "write"
        # (chunks), "publish" (manifests, commit, ref), "total" (call to publish).
        self.timings: dict[str, float] = {}
        self.bytes: SaveBytes | None = None
        self.peak_staging_bytes = 0
        # (time.monotonic(), bytes) as each chunk was handed to storage: write rates.
        self.timeline: list[tuple[float, int]] = []
        self.staged_bytes = 0
        self.staging = "full"  # how this save staged: "changed" unless it fell back
        # When the save began (perf_counter); castore.dist times its staging from it too.
        self.started = time.perf_counter() if started is None else started
        self._finished = threading.Event()
        self._generation: Generation | None = None
        self._error: BaseException | None = None
        self._observed = False
        if skipped:
            self._finished.set()

    def __repr__(self) -> str:
        state = (
            "skipped"
            if self.skipped
            else "published, then on_publish failed"
            if self._error and self._generation
            else "failed"
            if self._error
            else "published"
            if self._generation
            else "in flight"
        )
        return f"<castore.PendingSave {self.run} step {self.step}: {state}>"

    def done(self) -> bool:
        """Whether the save has finished: published, failed or skipped."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the save finishes (or ``timeout`` s); never raises its error."""
        return self._finished.wait(timeout)

    def result(self, timeout: float | None = None) -> Generation | None:
        """The published generation (None if skipped); raises the save's error if it failed,
        or ``on_publish``'s if that failed (the generation is then published all the same).

        Raises TimeoutError if it has not finished within ``timeout`` seconds.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(
                f"the save of {self.run} step {self.step} is still in flight after {timeout}s"
            )
        if self._error is not None:
            self._observed = True
            raise self._error
        return self._generation

    # -- the writer's side ---------------------------------------------------

    def _finish(self, generation: Generation | None, error: BaseException | None) -> None:
        self._generation, self._error = generation, error
        self.timings["total"] = time.perf_counter() - self.started
        self._finished.set()

    @property
    def _unobserved_error(self) -> BaseException | None:
        return None if self._observed else self._error


class Job:
    """One async save between the caller, who hands pieces, and the writer thread."""

    def __init__(
        self, pending: PendingSave, pool: StagingPool, options: AsyncOptions, *, fits: bool
    ) -> None:
        self.pending = pending
        self.pool = pool
        self.options = options
        self.fits = fits  # the whole state fits the bound: writing waits for the snapshot
        self.pieces: queue.Queue[Any] = queue.Queue()
        self.failed = threading.Event()
        self.snapshot: Snapshot | None = None  # set once the caller has staged everything
        self.input_ended = False  # the writer has taken the caller's end marker
        # The chunks the writer hashed from staging buffers, in order (a tiered store's
        # promotion sends them from memory while their buffers are not reused).
        self.staged: list[StagedChunk] = []

    def hand(self, piece: Piece) -> None:
        self.pieces.put(piece)

    def end_input(self, snapshot: Snapshot | None) -> None:
        self.snapshot = snapshot
        self.pieces.put(_END)

    def drain(self) -> None:
        """Give back every buffer still queued, up to the caller's last piece."""
        while not self.input_ended:
            item = self.pieces.get()
            if item is _END:
                self.input_ended = True
            elif item.buffer is not None:
                self.pool.give(item.buffer)


class Throttle:
    """A token bucket: ``take(n)`` returns once ``n`` more bytes fit the rate."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.burst = max(1.0, (rate or 0.0) * 0.05)  # at most 50 ms of bytes at once
        self._tokens = self.burst
        self._last = time.monotonic()

    def take(self, nbytes: int) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= nbytes
        if self._tokens < 0:
            time.sleep(-self._tokens / self.rate)


@dataclass
class StagedWrite:
    """What the writer made of a job's pieces: an entry per leaf, stats, timeline."""

    entries: list[TensorEntry]
    stats: WriteStats
    seen: set[bytes]
    timeline: list[tuple[float, int]]  # (monotonic time, bytes) per chunk handed


def write_staged(
    backend: ChunkBackend,
    job: Job,
    leaves: list[TensorLeaf],
    chunk_size: int,
    *,
    rank: int = 0,
    world: int = 1,
    midway_fault: str = "save.mid_chunks",
    codec: str = "none",
) -> StagedWrite:
    """Write the job's pieces as the caller hands them; return each leaf's entry.

    Chunks the caller did not copy (changed-chunk staging) must still be
    present: they are checked under the save lock the caller of this holds.
    New chunks are encoded by ``codec`` (castore.core.encoding) on the shared
    pool, off the caller's thread.
    """
    if job.options.stagger_s and world > 1:
        time.sleep(job.options.stagger_s * rank / world)
    started = time.perf_counter()
    batch = _Batch(job, chunk_size, [[] for _ in leaves], [leaf.dtype for leaf in leaves])
    stats = WriteStats(logical_bytes=sum(leaf_nbytes(leaf) for leaf in leaves))
    # hash_threads=1 keeps the save to its own thread: encoding too.
    pool = None if job.options.hash_threads == 1 else hashpool.shared_pool()
    stage = None if codec == "none" else EncodeStage(backend, pool)
    encoders = leaf_encoders(codec, (leaf.dtype for leaf in leaves)) if stage else []
    while not batch.ended:
        try:
            result = put_counted(backend, stage, batch.items(), lambda: encoders[batch.leaf], stats)
        finally:
            batch.give_back()  # durable now (or failed): the buffers may take the next pieces
        stats.new_chunks += result.written
        stats.reused_chunks += batch.chunks - result.written
        fault_point(midway_fault)
        fault_point("async.mid_write")
    if job.snapshot is None:
        raise SaveAborted("the caller stopped staging: nothing of this save is published")
    if batch.unstaged:
        _check_unstaged(backend, batch.unstaged)
        stats.reused_chunks += len(batch.unstaged)
    entries = [
        entry_of(
            leaf, chunk_size, tuple(batch.digests[index]), leaf_nbytes(leaf), batch.pieces(index)
        )
        for index, leaf in enumerate(leaves)
    ]
    seen = {digest for chunks in batch.digests for digest in chunks}
    job.pending.timings["write"] = time.perf_counter() - started
    job.pending.timeline = batch.timeline
    return StagedWrite(entries, stats, seen, batch.timeline)


class _Batch:
    """The writer's side of the pieces queue, one ``put_many`` batch at a time."""

    def __init__(
        self, job: Job, chunk_size: int, digests: list[list[bytes]], dtypes: list[str]
    ) -> None:
        self.job = job
        self.chunk_size = chunk_size
        self.digests = digests  # per leaf, every chunk so far
        # Per leaf, every chunk's pieces' values so far (castore.format.pieces); None for a
        # chunk whose values are not known.
        self.cvs: list[list[bytes | None]] = [[] for _ in digests]
        self.dtypes = dtypes  # per leaf
        self.unstaged: list[bytes] = []  # chunks the caller did not copy
        # Read at each save (not imported): crash tests shrink it to get several batches.
        self.limit = max(1, min(chunkio.WRITE_BATCH_BYTES, job.pool.limit // 2))
        self.throttle = Throttle(job.options.max_write_bytes_per_s)
        self.inline = job.options.hash_threads == 1
        self.ended = False
        self.held: list[Piece] = []
        self.chunks = self.bytes = 0
        self.timeline: list[tuple[float, int]] = []
        self.leaf = 0  # the leaf of the chunk items() yielded last

    def items(self) -> Iterator[tuple[bytes, memoryview]]:
        """(digest, bytes) of staged chunks, piece by piece, until ``limit`` bytes or the end.

        At most ``limit`` (half the staging bound), so the caller can stage
        into the other half while the backend makes these durable.
        """
        self.chunks = self.bytes = 0
        while self.bytes < self.limit:
            piece = self.job.pieces.get()
            if piece is _END:
                self.ended = self.job.input_ended = True
                return
            self.held.append(piece)
            if piece.buffer is None:
                self.digests[piece.leaf] += piece.digests or []
                self.cvs[piece.leaf] += piece.cvs or [None] * len(piece.digests or [])
                self.unstaged += piece.digests or []
                continue
            if piece.ready is not None:
                piece.ready.synchronize()  # the device-to-host copy has landed
            flat = memoryview(piece.buffer.array).cast("B")
            views = cut_at(flat, np.asarray(piece.cuts or [0], dtype=np.int64))
            named: Iterable[tuple[bytes, bytes | None]] = (
                zip(piece.digests, piece.cvs or [None] * len(piece.digests), strict=True)
                if piece.digests
                else hashed_in_order(views, inline=self.inline)
            )
            self.leaf = piece.leaf
            buffer, epoch, dtype = piece.buffer, piece.buffer.epoch, self.dtypes[piece.leaf]
            for view, (digest, cvs) in zip(views, named, strict=True):
                self.job.staged.append(StagedChunk(digest, buffer, epoch, view, dtype))
                self.digests[piece.leaf].append(digest)
                self.cvs[piece.leaf].append(cvs)
                self.throttle.take(view.nbytes)
                self.chunks += 1
                self.bytes += view.nbytes
                self.timeline.append((time.monotonic(), view.nbytes))
                yield digest, view

    def pieces(self, leaf: int) -> bytes:
        """Leaf ``leaf``'s chunks' piece values, or none unless every chunk's are known."""
        cvs = self.cvs[leaf]
        return b"" if None in cvs else b"".join(cvs)  # type: ignore[arg-type]

    def give_back(self) -> None:
        for piece in self.held:
            if piece.buffer is not None:
                self.job.pool.give(piece.buffer)
        self.held.clear()


def _check_unstaged(backend: ChunkBackend, digests: list[bytes]) -> None:
    distinct = list(dict.fromkeys(digests))
    for digest, found in zip(distinct, backend.has_many(Namespace.CHUNKS, distinct), strict=True):
        if not found:
            raise ChunkMissingError(
                f"chunk {digest.hex()[:16]}, unchanged since the previous save and so not "
                "staged, is no longer in the store (collected since?); the next save stages "
                "every chunk"
            )


# -- the per-store writer ----------------------------------------------------------


class Background:
    """A store handle's async saves: one writer thread, one save in flight, reused staging."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pool = StagingPool()
        self.known: set[bytes] = set()  # chunks this handle's last save stored
        # Of the last save's chunks, the fraction not in the save before it (None: no
        # save before it): above CHANGED_FALLBACK, changed-chunk staging would hash for
        # nothing, so the next save stages whole.
        self.change_rate: float | None = None
        self.counters = {"started": 0, "published": 0, "failed": 0, "skipped": 0}
        self._current: PendingSave | None = None
        self._last: PendingSave | None = None
        self._lock = threading.Lock()
        self._turn = threading.Lock()  # held by the thread whose save is being set up
        self._jobs: queue.Queue[tuple[Job, Callable[[Job], Generation]] | None] = queue.Queue()
        self._writer: tuple[int, threading.Thread] | None = None
        # The writer thread ends when the handle closes, or is dropped unclosed.
        self.stop_writer = weakref.finalize(self, self._jobs.put, None)
        self.exit_wait_s = AsyncOptions.exit_wait_s
        # The job the writer thread runs now (its thread id and the job), and what is
        # told of each finished job: (job, its generation or None) (castore.tiers).
        self.running: tuple[int, Job] | None = None
        self.staging_now = 0  # callers copying a snapshot now (background work holds off)
        self.after_job: list[Callable[[Job, Generation | None], None]] = []
        shutdown.track(self)

    def remember(self, digests: set[bytes]) -> None:
        """The chunks this handle's last save stored, for the next changed-chunk save."""
        before, self.known = self.known, digests
        self.change_rate = len(digests - before) / len(digests) if before and digests else None

    def staging_for(self, requested: str) -> str:
        """How the next save stages: ``"changed"`` only when it can skip copying something."""
        if requested == "changed" and self.known:
            if self.change_rate is None or self.change_rate <= CHANGED_FALLBACK:
                return "changed"
        return "full"

    def in_flight(self) -> PendingSave | None:
        current = self._current
        return current if current is not None and not current.done() else None

    def raise_unobserved(self) -> None:
        """Raise the error of the last save if nobody has seen it yet (once)."""
        last = self._last
        if last is None or (error := last._unobserved_error) is None:
            return
        last._observed = True  # after reading it: observed, the property says None
        raise error

    @contextmanager
    def turn(self, if_busy: str, agree: Callable[[bool], bool] = bool) -> Iterator[bool]:
        """This thread's turn to save on this handle; yields False when the save is skipped.

        One async save at a time, from any thread: the turn is held from
        before the check for a save in flight until the caller's save has
        started (see :meth:`before_blocking_save` for blocking ones).
        ``"wait"`` waits for the save in flight; ``"skip"`` skips if this
        handle is busy, or if ``agree`` (the ranks' decision, given this
        one's) says so. The turn then raises an error nobody has seen.
        """
        if if_busy not in IF_BUSY:
            raise ValueError(f"if_busy must be one of {IF_BUSY}, got {if_busy!r}")
        if if_busy == "skip":
            taken = self._turn.acquire(blocking=False)
            if agree(not taken or self.in_flight() is not None):
                if taken:
                    self._turn.release()
                yield False
                return
        else:
            self._turn.acquire()
        try:
            if (current := self.in_flight()) is not None:
                current.wait()
            self.raise_unobserved()
            yield True
        finally:
            self._turn.release()

    def before_blocking_save(self) -> None:
        """A blocking save waits for the async save in flight and raises its unseen error.

        It does not keep the turn: blocking saves on one handle may run at once
        from several threads, as before async saves, their ref advances racing
        by compare-and-swap.
        """
        with self.turn("wait"):
            pass

    def skip(self, run: str, step: int) -> PendingSave:
        self.counters["skipped"] += 1
        return PendingSave(run, step, skipped=True)

    def start(self, job: Job, body: Callable[[Job], Generation]) -> None:
        """Run ``body(job)`` on this handle's writer thread; the job's handle gets its outcome."""
        pending = job.pending
        shutdown.guard_sigterm()
        with self._lock:
            self._current = self._last = pending
            self.counters["started"] += 1
            self.exit_wait_s = job.options.exit_wait_s
            if (
                self._writer is None
                or self._writer[0] != os.getpid()
                or not self._writer[1].is_alive()
            ):
                # One long-lived thread: starting one per save cost milliseconds of stall.
                thread = threading.Thread(
                    target=_writer_loop,
                    args=(weakref.ref(self), self._jobs),
                    name="castore-writer",
                    daemon=True,
                )
                thread.start()
                self._writer = (os.getpid(), thread)
        self._jobs.put((job, body))

    def _run(self, job: Job, body: Callable[[Job], Generation]) -> None:
        generation: Generation | None = None
        error: BaseException | None = None
        self.running = (threading.get_ident(), job)
        try:
            generation = body(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the handle, never lost
            error = exc
            job.failed.set()
            self.remember(set())  # what the failed save wrote may be incomplete
        finally:
            self.running = None
            job.drain()  # a failed writer leaves pieces queued; their buffers go back
            job.pending.peak_staging_bytes = self.pool.peak
            self.pool.trim()
        for hook in list(self.after_job):
            try:
                hook(job, generation)
            except Exception as exc:  # noqa: BLE001 - the save's outcome stands
                warnings.warn(f"castore: after an async save: {exc}", CastoreWarning, stacklevel=1)
        job.staged = []  # the buffers are the pool's again
        self.counters["published" if error is None else "failed"] += 1
        if generation is not None and job.pending.on_publish is not None:
            error = follow_publish(job.pending.on_publish, generation, job.pending.run)
        job.pending._finish(generation, error)

    def in_flight_here(self) -> shutdown.InFlight | None:
        """The save in flight on this process's writer (a forked child has none)."""
        current = self.in_flight() if self._writes_here() else None
        if current is None:
            return None
        return shutdown.InFlight(current.run, current.step, self.exit_wait_s)

    def wait_for_exit(self) -> str | None:
        """Wait at exit for the save in flight; the line to print if a save was not published.

        A save that failed before exit with nobody told is named too: at exit
        nobody is left to tell, and the failure must not pass for success.
        """
        if not self._writes_here():
            return None  # a forked child's copy of its parent's handle: nothing runs here
        if (current := self.in_flight()) is not None:
            try:
                finished = current.wait(self.exit_wait_s)
            except KeyboardInterrupt:  # Ctrl-C again: stop waiting, but say so
                return self._lost(current, "interrupted (Ctrl-C) while exit waited for it")
            if not finished:
                return self._lost(
                    current, f"still in flight after exit_wait_s={self.exit_wait_s:g}s at exit"
                )
        last = self._last
        if last is None or (error := last._unobserved_error) is None:
            return None
        if isinstance(error, CommitUnknownError):
            return (
                f"castore: the save of {last.run} step {last.step} to {self.name} may or "
                f"may not be published: {error}"
            )
        if last._generation is not None:
            return (
                f"castore: the save of {last.run} step {last.step} to {self.name} published "
                f"generation {last._generation.id}, but what was to follow it failed: {error}"
            )
        return self._lost(last, f"it failed in the background: {error}")

    def _writes_here(self) -> bool:
        writer = self._writer
        return writer is not None and writer[0] == os.getpid()

    def _lost(self, pending: PendingSave, why: str) -> str:
        return (
            f"castore: the save of {pending.run} step {pending.step} to {self.name} was NOT "
            f"published: {why}; nothing of it is published and the previous generation of "
            f"{pending.run} is intact"
        )


def run_async(
    background: Background,
    pending: PendingSave,
    leaves: list[TensorLeaf],
    *,
    chunk_size: int,
    options: AsyncOptions,
    body: Callable[[Job], Generation],
) -> PendingSave:
    """Stage ``leaves`` on this thread while ``body`` writes and publishes them on another.

    Returns once every byte is staged. A failure while staging is raised here
    (the writer's own error when it failed first) and publishes nothing.
    """
    total = state_bytes(leaves)
    limit = options.staging_bytes or max(1, total)
    _check_bound(leaves, chunk_size, limit)
    background.pool.configure(limit)
    background.pool.reset_peak()
    job = Job(pending, background.pool, options, fits=total <= limit)
    pending.staging = background.staging_for(options.staging)
    # A state that fits is staged before the writer starts, so the writer takes
    # neither the GIL nor a core from the copy; one that does not fit is written
    # as it is staged, the writer freeing the buffers the copy waits for.
    staged: list[Piece] = []
    if not job.fits:
        background.start(job, body)
    background.staging_now += 1
    try:
        snapshot = stage_leaves(
            leaves,
            chunk_size=chunk_size,
            pool=background.pool,
            mode=pending.staging,
            known=background.known,
            hand=staged.append if job.fits else job.hand,
            aborted=job.failed.is_set,
        )
    except BaseException as exc:
        if job.fits:
            for piece in staged:
                if piece.buffer is not None:
                    background.pool.give(piece.buffer)
            raise
        job.end_input(None)
        pending.wait()
        pending._observed = True  # raised here, so never again by the next save or close
        if isinstance(exc, SaveAborted) and pending._error is not None:
            raise pending._error from None
        raise
    finally:
        background.staging_now -= 1
    for piece in staged:
        job.hand(piece)
    pending.timings["snapshot"] = snapshot.seconds
    pending.timings["staging_wait"] = background.pool.waited
    pending.timings["held"] = time.perf_counter() - pending.started
    pending.staged_bytes = snapshot.staged_bytes
    job.end_input(snapshot)
    if job.fits:
        background.start(job, body)
    return pending


def save_async(
    store: Any,
    encoded: EncodedTree,
    pending: PendingSave,
    metadata: bytes,
    data_order: dict[str, Any],
    options: AsyncOptions,
    codec: str,
) -> PendingSave:
    """``Store.save(..., blocking=False)``: stage here, write and publish on the writer
    (new chunks stored by ``codec``, castore.format.codec)."""
    local_state, local_leaves = encode_local_state(encoded.rank_local, defer_device=True)
    leaves = encoded.leaves + local_leaves
    background: Background = store.background

    def body(job: Job) -> Generation:
        with store.save_lock():
            parent = store.refs.read(pending.run)
            generation = parent.generation + 1 if parent else 1
            writer = claim_writer(store, pending.run, parent, pending.step)
            written = write_staged(store.backend, job, leaves, store.chunk_size, codec=codec)
            clock = time.perf_counter()
            shard = build_shard(
                run=pending.run,
                generation=generation,
                rank=0,
                tensors=written.entries[: len(encoded.leaves)],
                local_state=local_state,
                local_tensors=written.entries[len(encoded.leaves) :],
                stats=written.stats,
            )
            digest, root = publish_single(
                store,
                shard,
                step=pending.step,
                parent=parent,
                skeleton=encoded.skeleton,
                metadata=metadata,
                data_order=data_order,
                seconds=time.perf_counter() - pending.started,
                held_seconds=pending.timings.get("held", 0.0),
                faults=ASYNC_FAULTS,
                writer=writer,
                layouts=layouts_of(encoded),
            )
        pending.timings["publish"] = time.perf_counter() - clock
        background.remember(written.seen)
        pending.bytes = SaveBytes(
            logical=written.stats.logical_bytes,
            staged=pending.staged_bytes,
            new=written.stats.new_bytes,
            written=written.stats.stored + len(shard.data),
        )
        return Generation.from_root(digest, root)

    return run_async(
        background, pending, leaves, chunk_size=store.chunk_size, options=options, body=body
    )


def follow_publish(on_publish: OnPublish, generation: Generation, run: str) -> BaseException | None:
    """Run ``on_publish(generation)``; its error, noted as following a publish, or None."""
    try:
        on_publish(generation)
    except BaseException as exc:  # noqa: BLE001 - handed to the handle, never lost
        note = getattr(exc, "add_note", None)  # Python 3.11+
        if note is not None:
            note(
                f"castore: generation {generation.id} of run {run!r} is published; "
                "this failed in what was to follow its publish (on_publish)"
            )
        return exc
    return None


def report_failure(
    background: Background,
    pending: PendingSave,
    options: AsyncOptions,
    body: Callable[[Job], Generation],
) -> None:
    """Run ``body`` with nothing staged, so a collective writer tells the other ranks
    of this rank's failure; wait for it (the caller raises the failure itself)."""
    job = Job(pending, background.pool, options, fits=True)
    background.start(job, body)
    job.end_input(None)
    pending.wait()
    pending._observed = True


def _check_bound(leaves: list[TensorLeaf], chunk_size: int, limit: int) -> None:
    step = piece_bytes(chunk_size, limit)
    largest = max((min(leaf_nbytes(leaf), step) for leaf in leaves), default=0)
    if largest > limit:
        raise ValueError(
            f"staging_bytes={limit} cannot hold one piece of {largest} bytes (a chunk is "
            f"{chunk_size}): raise staging_bytes to at least {largest}"
        )


def _writer_loop(
    owner: weakref.ref[Background],
    jobs: queue.Queue[tuple[Job, Callable[[Job], Generation]] | None],
) -> None:
    """Run each job handed to a store handle's writer, until the handle is gone."""
    while (item := jobs.get()) is not None:
        background = owner()
        if background is None:
            return
        background._run(*item)
        # Hold nothing between jobs: a dropped handle may go, and a finished job's
        # closure holds castore's process groups (kept past destroy_process_group,
        # a gloo group made the process abort at exit).
        del background, item
