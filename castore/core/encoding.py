"""Compressing a save's new chunks, between hashing and the backend.

A save hands the backend ``(digest, chunk)`` pairs in order. With a codec on
(castore.format.codec), :class:`EncodeStage` sits between: it asks the
backend which of a window of chunks it knows it has (one ``known_chunks``
per window, on the calling thread, which holds the backend's locks; no
listing of a store on blobs), sends each new chunk of
at least ``MIN_CHUNK`` bytes to the shared pool to be encoded (zstd releases
the GIL), and yields the pairs in their order with each new chunk's stored
record: its frame, or the chunk itself when a frame would not save enough.
Chunks the store has already are handed on raw, uncompressed: the backend
skips them. So a re-save compresses only what changed, and correctness never
depends on the presence check (a raw chunk is always a valid record).

Memory: at most ``AHEAD_BYTES`` of chunks are in flight (their frames are no
larger), whatever the save's size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from castore.chunkstore.base import ChunkBackend
from castore.format.codec import MIN_CHUNK, Encoder, encoder_for
from castore.format.hashing import Buffer

# Chunks read ahead of the backend: enough to keep every pool worker busy
# while the backend writes, small next to the 256 MiB write batches.
AHEAD_BYTES = 64 << 20
# Chunks asked about in one has_many.
WINDOW_CHUNKS = 64
WINDOW_BYTES = 16 << 20


@dataclass
class EncodeCounts:
    """What a stage handed on, as the presence check saw it."""

    new_chunks: int = 0
    new_bytes: int = 0  # raw bytes of the new chunks
    stored_bytes: int = 0  # their stored records' bytes


Item = tuple[bytes, memoryview, "Encoder | None"]
# A chunk handed on, and where its stored record comes from: a run being encoded
# and the chunk's place in it, or None (the chunk itself).
Queued = tuple[bytes, memoryview, "tuple[Future[list[Buffer]], int] | None"]
# A pool task encodes chunks until they add up to this (one task per big chunk;
# small ones share a task, as hashing does: a task costs tens of microseconds).
TASK_BYTES = 1 << 20


def _encode_run(run: list[tuple[memoryview, Encoder]]) -> list[Buffer]:
    return [encoder(view) for view, encoder in run]


class EncodeStage:
    """One save's encoding stage; ``counts`` add up over every batch it passed."""

    def __init__(self, backend: ChunkBackend, pool: ThreadPoolExecutor | None) -> None:
        """``pool``: where chunks are encoded; None encodes them on the calling thread."""
        self.backend = backend
        self.pool = pool
        self.counts = EncodeCounts()
        self._queued: set[bytes] = set()  # new chunks handed on already (a chunk twice)

    def run(self, items: Iterable[Item]) -> Iterator[tuple[bytes, Buffer]]:
        """``items`` as (digest, stored record), in order; see the module text."""
        ahead: deque[Queued] = deque()
        ahead_bytes = 0
        window: list[Item] = []
        window_bytes = 0
        try:
            for item in items:
                window.append(item)
                window_bytes += item[1].nbytes
                if len(window) < WINDOW_CHUNKS and window_bytes < WINDOW_BYTES:
                    continue
                ahead_bytes += self._start(window, ahead)
                window, window_bytes = [], 0
                while ahead and ahead_bytes > AHEAD_BYTES:
                    ahead_bytes -= ahead[0][1].nbytes
                    yield self._finish(ahead.popleft())
            self._start(window, ahead)
            while ahead:
                yield self._finish(ahead.popleft())
        finally:
            # A failed or abandoned batch stops encoding what it will not write.
            for _, _, job in ahead:
                if job is not None:
                    job[0].cancel()

    def _start(self, window: list[Item], ahead: deque[Queued]) -> int:
        """Queue a window's chunks, the new ones being encoded in runs; return their bytes."""
        if not window:
            return 0
        # No listing per window on a store on blobs: its put_many listed as it began.
        present = self.backend.known_chunks([digest for digest, _, _ in window])
        size = 0
        counts = self.counts
        run: list[tuple[memoryview, Encoder]] = []
        places: list[int] = []  # the ahead positions of the run's chunks
        run_bytes = 0
        for (digest, view, encoder), found in zip(window, present, strict=True):
            size += view.nbytes
            if found or digest in self._queued:
                ahead.append((digest, view, None))
                continue
            self._queued.add(digest)
            counts.new_chunks += 1
            counts.new_bytes += view.nbytes
            if encoder is None or view.nbytes < MIN_CHUNK:
                counts.stored_bytes += view.nbytes
                ahead.append((digest, view, None))
                continue
            places.append(len(ahead))
            ahead.append((digest, view, None))  # its job is set when the run is sent
            run.append((view, encoder))
            run_bytes += view.nbytes
            if run_bytes >= TASK_BYTES:
                self._send(run, places, ahead)
                run, places, run_bytes = [], [], 0
        self._send(run, places, ahead)
        return size

    def _send(
        self, run: list[tuple[memoryview, Encoder]], places: list[int], ahead: deque[Queued]
    ) -> None:
        if not run:
            return
        if self.pool is None:
            job: Future[list[Buffer]] = Future()
            job.set_result(_encode_run(run))
        else:
            job = self.pool.submit(_encode_run, run)
        for index, place in enumerate(places):
            digest, view, _ = ahead[place]
            ahead[place] = (digest, view, (job, index))

    def _finish(self, queued: Queued) -> tuple[bytes, Buffer]:
        digest, view, job = queued
        if job is None:
            return digest, view
        stored = job[0].result()[job[1]]
        self.counts.stored_bytes += memoryview(stored).nbytes
        return digest, stored


def leaf_encoders(setting: str, dtypes: Iterable[str]) -> list[Encoder | None]:
    """Each tensor's encoder under ``setting`` (castore.format.codec.encoder_for)."""
    cache: dict[str, Encoder | None] = {}
    found = []
    for dtype in dtypes:
        if dtype not in cache:
            cache[dtype] = encoder_for(setting, dtype)
        found.append(cache[dtype])
    return found
