"""Promotion from memory: a save's staged chunks sent to the durable tier, paced by steps.

An async save copies the state into staging buffers and hashes each chunk
there (castore.core.staging, castore.core.background); those bytes are the
chunk, verified once, at the save. A tiered store whose training loop reports
its steps (``store.report_step()``, every rank) sends the chunks of a
generation it promotes to the durable tier from those buffers, on a thread of
each rank's process, so the durable tier gets them without a re-read or a
re-hash of the fast tier:

- **Ownership, not a second hash.** A buffer's bytes are read only under its
  lock and only while its epoch is the one noted at hashing; the next save
  that takes the buffer from the pool changes the epoch first (under the same
  lock, so it waits for a copy in progress). A chunk whose buffer was taken
  again is *gone*: it is not sent from memory, and the promotion reads it from
  the fast tier and verifies it there, as every promotion did before. Nothing
  but a save that took the buffer writes into it, so no byte sent from memory
  differs from the bytes hashed to its name.
- **Memory.** The sender keeps views of the buffers, not copies: the pool
  keeps the buffers for the next save anyway, so the cost is nothing while
  they are in the pool, and at most one save's staged bytes where the pool
  drops some (``trim``, ``close``) before the sender is done with them.
- **Pace.** Each reported step grants the sender ``durable_step_budget`` of
  that step's time; a slice costs ``COST_WEIGHT`` times the CPU seconds of
  the sender's thread (what it takes from training: the core, and the GIL it
  hands back and forth). It sends a slice of chunks while its balance is
  positive and pays for it after, so over any number of steps it has used at
  most what the steps granted plus one slice. It sends nothing while this
  process's next save is copying its snapshot (the stall stays the save's
  own). ``durable_rate`` still caps its bytes per second. The balance carries
  over at most ``CARRY_STEPS`` steps' grants.
- **Then the promotion.** On the coordinator the promotion of the generation
  starts once its own chunks are sent (or gone); with several ranks it first
  waits while the other ranks' chunks keep arriving, then copies what the
  durable tier still lacks from the fast tier, verified, and publishes, as
  before (castore.tiers.promotion): the crash semantics are the copy's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from castore.chunkstore.base import ChunkBackend, Namespace
from castore.core.background import Throttle
from castore.core.staging import StagedChunk
from castore.format.codec import encoder_for
from castore.format.hashing import Buffer, digest_bytes

CARRY_STEPS = 4.0  # the most unspent budget carried over, in steps' grants
# What a second of the sender's CPU time costs the training thread of its process:
# measured on one core, a Python thread beside a loop of small torch ops slowed the
# loop by about twice its own CPU time (the GIL handed back and forth, not only the core).
COST_WEIGHT = 2.0
SLICE_BYTES = 4 << 20  # chunk bytes sent in one slice (one put_many)


class StepPacer:
    """A budget of work per reported step: ``fraction`` of each step's seconds.

    ``clock`` measures what the sender spends (default: its thread's CPU time).
    The sender calls :meth:`acquire` before a slice and :meth:`charge` after it.
    """

    def __init__(
        self,
        fraction: float,
        clock: Callable[[], float] = time.thread_time,
        weight: float = COST_WEIGHT,
        hold: Callable[[], bool] = lambda: False,
    ) -> None:
        self.fraction = fraction
        self.clock = clock
        self.weight = weight  # each second the clock measures costs this much budget
        self.hold = hold  # True while the sender must wait (this process's save is staging)
        self.balance = 0.0
        self.granted = 0.0  # totals since the pacer was made
        self.spent = 0.0
        self.steps = 0
        self.step_seconds: float | None = None  # the last reported step's seconds
        self.urgent = 0  # > 0: no pacing (close, wait_promotions)
        self._cond = threading.Condition()
        self._last: float | None = None

    def report(self, seconds: float | None = None) -> None:
        """A step finished that took ``seconds`` (None: the time since the last report;
        the first such report only starts the clock)."""
        now = time.perf_counter()
        if seconds is None:
            last, self._last = self._last, now
            if last is None:
                return
            seconds = now - last
        self._last = now
        with self._cond:
            grant = self.fraction * max(0.0, seconds)
            self.balance = min(self.balance + grant, CARRY_STEPS * grant)
            self.granted += grant
            self.steps += 1
            self.step_seconds = seconds
            self._cond.notify_all()

    def acquire(self, stopping: Callable[[], bool]) -> None:
        """Wait until the balance is positive and nothing holds the sender back (or
        pacing is off, or ``stopping()``)."""
        with self._cond:
            while not self.urgent and not stopping():
                if self.hold():
                    self._cond.wait(timeout=0.005)
                elif self.balance <= 0:
                    self._cond.wait(timeout=0.5)
                else:
                    return

    def charge(self, seconds: float) -> None:
        """A slice took ``seconds`` of the clock: it costs ``weight`` times that."""
        cost = seconds * self.weight
        with self._cond:
            if not self.urgent:
                self.balance -= cost
            self.spent += cost

    def hurry(self, on: bool) -> None:
        with self._cond:
            self.urgent += 1 if on else -1
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


@dataclass
class _Owed:
    run: str
    generation: int
    chunks: list[StagedChunk] | None = None  # None: expected, not offered yet
    then: Callable[[], None] | None = None  # the coordinator: start the promotion
    done: threading.Event = field(default_factory=threading.Event)


class StagedSender:
    """The staged chunks this process owes the durable tier, sent on a thread of its own.

    ``counters``: chunks and bytes sent from memory (``sent_``), chunks found
    already in the durable tier, chunks gone (their buffer taken by a later
    save), and of those the chunks and bytes read from the fast tier, verified,
    and sent (``fast_``; paced like the rest).
    """

    def __init__(
        self,
        put_many: Callable[[list[tuple[bytes, Buffer]]], object],
        has_many: Callable[[list[bytes]], list[bool]],
        pacer: StepPacer,
        rate: float | None = None,
        slice_bytes: int = SLICE_BYTES,
        read_fast: Callable[[list[bytes]], list[bytes | None]] | None = None,
        codec: str = "none",
    ) -> None:
        self.put_many = put_many
        self.has_many = has_many
        self.read_fast = read_fast
        self.codec = codec  # the durable tier's: chunks are encoded by it before they go
        self.pacer = pacer
        self.throttle = Throttle(rate)
        self.slice_bytes = slice_bytes
        self.counters = {"sent_chunks": 0, "sent_bytes": 0, "present_chunks": 0,
                         "gone_chunks": 0, "fast_chunks": 0, "fast_bytes": 0,
                         "slices": 0}  # fmt: skip
        # (steps reported before it, bytes sent, cost) of each recent slice
        self.slices: deque[tuple[int, int, float]] = deque(maxlen=4096)
        self._owed: dict[tuple[str, int], _Owed] = {}
        self._queue: deque[_Owed] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @staticmethod
    def for_stores(
        fast: ChunkBackend,
        durable: ChunkBackend,
        pacer: StepPacer,
        rate: float | None,
        codec: str = "none",
    ) -> StagedSender:
        return StagedSender(
            lambda items: durable.put_many(Namespace.CHUNKS, items),
            lambda keys: durable.has_many(Namespace.CHUNKS, keys),
            pacer,
            rate,
            read_fast=lambda keys: read_verified(fast, keys),
            codec=codec,
        )

    # -- what is owed -----------------------------------------------------------

    def expect(self, run: str, generation: int, then: Callable[[], None]) -> None:
        """The coordinator: ``then()`` once ``run@generation``'s staged chunks are sent,
        or at once if the save offers none (:meth:`release`)."""
        with self._cond:
            owed = self._owed.setdefault((run, generation), _Owed(run, generation))
            owed.then = then

    def offer(self, run: str, generation: int, chunks: list[StagedChunk]) -> None:
        """Owe ``chunks`` (a save's staged chunks of ``run@generation``) to the durable tier."""
        with self._cond:
            owed = self._owed.setdefault((run, generation), _Owed(run, generation))
            owed.chunks = list(chunks)
            self._queue.append(owed)
            self._start()
            self._cond.notify_all()

    def release(self, run: str) -> None:
        """A save of ``run`` will offer nothing (it failed, or is not sent from memory):
        every expected entry of ``run`` with no chunks is done now."""
        with self._cond:
            waiting = [o for o in self._owed.values() if o.run == run and o.chunks is None]
        for owed in waiting:
            self._finish(owed)

    def pending(self) -> int:
        with self._cond:
            return len(self._owed)

    def drain(self, timeout: float | None = None) -> bool:
        """Send everything owed now, unpaced; True once nothing is owed."""
        self.pacer.hurry(True)
        try:
            with self._cond:
                return self._cond.wait_for(
                    lambda: not any(o.chunks is not None for o in self._owed.values()), timeout
                )
        finally:
            self.pacer.hurry(False)

    def stop(self) -> None:
        """Send what is owed (unpaced), then end the thread; expected entries are released."""
        self.drain()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            waiting = list(self._owed.values())
        self.pacer.wake()
        if self._thread is not None:
            self._thread.join()
        for owed in waiting:
            self._finish(owed)

    # -- the thread ----------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="castore-staged", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                owed = self._queue.popleft()
            try:
                self._send(owed.chunks or [])
            finally:
                self._finish(owed)

    def _finish(self, owed: _Owed) -> None:
        with self._cond:
            if self._owed.get((owed.run, owed.generation)) is not owed:
                return
            del self._owed[(owed.run, owed.generation)]
            self._cond.notify_all()
        owed.done.set()
        if owed.then is not None:
            owed.then()

    def _send(self, chunks: list[StagedChunk]) -> None:
        """Send the distinct chunks the durable tier lacks, a slice at a time: from their
        staging buffers, then the ones whose buffers are gone from the fast tier."""
        distinct = list({chunk.digest: chunk for chunk in chunks}.values())
        gone: list[StagedChunk] = []
        for taken in self._slices(distinct):
            self._paced(self._send_staged, taken, gone)
        if self.read_fast is None:
            return
        for taken in self._slices(gone):
            self._paced(self._send_from_fast, taken)

    def _slices(self, chunks: list[StagedChunk]) -> Iterator[list[StagedChunk]]:
        taken: list[StagedChunk] = []
        size = 0
        for chunk in chunks:
            taken.append(chunk)
            size += chunk.view.nbytes
            if size >= self.slice_bytes:
                yield taken
                taken, size = [], 0
        if taken:
            yield taken

    def _paced(self, send: Callable[..., int], *args: Any) -> None:
        """One slice, once the pacer allows it; its cost is charged after."""
        self.pacer.acquire(lambda: self._stopping)
        started = self.pacer.clock()
        sent = send(*args)
        cost = self.pacer.clock() - started
        self.pacer.charge(cost)
        self.counters["slices"] += 1
        self.slices.append((self.pacer.steps, sent, cost))

    def _send_staged(self, taken: list[StagedChunk], gone: list[StagedChunk]) -> int:
        present = self.has_many([chunk.digest for chunk in taken])
        items: list[tuple[StagedChunk, bytes]] = []
        for chunk, here in zip(taken, present, strict=True):
            if here:
                self.counters["present_chunks"] += 1
                continue
            data = chunk.copy_if_intact()
            if data is None:
                self.counters["gone_chunks"] += 1
                gone.append(chunk)
                continue
            items.append((chunk, data))
        return self._put(items, "sent")

    def _send_from_fast(self, taken: list[StagedChunk]) -> int:
        """Chunks whose buffers are gone: read from the fast tier, each verified against its
        name; one that is not there raw and intact is left to the promotion's copy."""
        assert self.read_fast is not None
        present = self.has_many([chunk.digest for chunk in taken])
        wanted = [chunk for chunk, here in zip(taken, present, strict=True) if not here]
        values = self.read_fast([chunk.digest for chunk in wanted]) if wanted else []
        items = [(c, data) for c, data in zip(wanted, values, strict=True) if data is not None]
        return self._put(items, "fast")

    def _put(self, items: list[tuple[StagedChunk, bytes]], counter: str) -> int:
        """Write ``items`` to the durable tier (encoded by its codec); their raw bytes."""
        raw = sum(len(data) for _, data in items)
        if items:
            self.throttle.take(raw)
            self.put_many([(chunk.digest, self._encoded(chunk, data)) for chunk, data in items])
            self.counters[f"{counter}_chunks"] += len(items)
            self.counters[f"{counter}_bytes"] += raw
        return raw

    def _encoded(self, chunk: StagedChunk, data: bytes) -> Buffer:
        encoder = encoder_for(self.codec, chunk.dtype) if self.codec != "none" else None
        return data if encoder is None else encoder(data)


def read_verified(fast: ChunkBackend, keys: list[bytes]) -> list[bytes | None]:
    """Each chunk's raw bytes from ``fast`` if they hash to its name, else None (a frame,
    absent or damaged: the promotion's copy reads those and says what is wrong)."""
    out: list[bytes | None] = []

    def keep(values: Iterator[memoryview | None]) -> None:
        for key, value in zip(keys, values, strict=True):
            intact = value is not None and digest_bytes(value, threads=1) == key
            out.append(bytes(value) if intact and value is not None else None)

    fast.read_many(Namespace.CHUNKS, keys, keep)
    return out
