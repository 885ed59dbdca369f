"""Reading chunk bytes from blob packs: ranged requests, a window ahead of the reader.

A window of requested chunks is grouped by pack, neighbouring chunks merged
into one ranged request (their record headers, 40 bytes each, come along), and
several requests are in flight on the backend's threads. Chunk bytes are not
verified here: the caller hashes every chunk (:mod:`castore.core.chunkread`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from castore.blob.base import BlobStore
from castore.chunkstore.bloblayout import BlobLocation, pack_blob
from castore.errors import BlobNotFoundError, BlobRangeError

READ_WINDOW_BYTES = 128 << 20  # chunk bytes fetched ahead of the reader, per window
MAX_SPAN_BYTES = 32 << 20  # the most one ranged request fetches
# Requested chunks this close in one pack share a request: the 40-byte record
# header between neighbours, or a small chunk nobody asked for.
MERGE_GAP = 4 << 10


@dataclass
class FetchCounters:
    """What reads of chunk bytes cost: ranged requests and the bytes they fetched."""

    requests: int = 0
    bytes: int = 0
    chunk_bytes: int = 0  # the chunks' own bytes among them
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, requests: int, nbytes: int, chunk_bytes: int) -> None:
        with self._lock:
            self.requests += requests
            self.bytes += nbytes
            self.chunk_bytes += chunk_bytes


class PackSource(Protocol):
    """What a reader needs of its backend: blobs, threads, counters, a fresh look-up."""

    blobs: BlobStore
    pool: ThreadPoolExecutor
    fetches: FetchCounters

    def refresh(self) -> None: ...

    def locate(self, keys: Sequence[bytes]) -> list[BlobLocation | None]: ...


@dataclass(frozen=True)
class _Span:
    """One ranged request: ``[start, end)`` of ``pack``."""

    pack: str
    start: int
    end: int


class WindowedReader:
    """Each location's bytes in order (None where missing), fetched a window ahead.

    A window is about READ_WINDOW_BYTES of chunks: grouped by pack, merged into
    ranged requests, fetched on the backend's threads while the caller
    consumes the window before it. At most two windows are in memory.

    With ``keys`` (the chunks the locations were looked up for), a known chunk
    whose pack is gone or cut short makes the reader refresh the backend's
    index once and look every chunk not yet delivered up again: another
    handle's collection may have moved it into a new pack (reclaim deletes
    the old one), so the index this handle read before can name a pack that
    no longer exists while the chunk is intact. Only what is still missing
    after that one refresh reads as missing (None); there is no second one.
    """

    def __init__(
        self,
        backend: PackSource,
        locations: Sequence[BlobLocation | None],
        *,
        keys: Sequence[bytes] | None = None,
    ) -> None:
        self.backend = backend
        self.locations = list(locations)
        self.keys = keys
        self._refreshed = False
        self._windows = self._cut()
        self._ahead: list[tuple[range, dict[int, Future[Any]]]] = []
        self._values = self._in_order()

    def _cut(self) -> Iterator[range]:
        start = size = 0
        for index, where in enumerate(self.locations):
            size += where.length if where is not None else 0
            if size >= READ_WINDOW_BYTES:
                yield range(start, index + 1)
                start, size = index + 1, 0
        if start < len(self.locations):
            yield range(start, len(self.locations))

    def _submit(self, window: range) -> tuple[range, dict[int, Future[Any]]]:
        """Start the window's requests; map each position to its span's future and start."""
        by_pack: dict[str, list[tuple[int, BlobLocation]]] = defaultdict(list)
        for index in window:
            where = self.locations[index]
            if where is not None:
                by_pack[where.pack].append((index, where))
        futures: dict[int, Future[Any]] = {}
        for pack, placed in by_pack.items():
            placed.sort(key=lambda item: item[1].offset)
            group: list[tuple[int, BlobLocation]] = []
            for item in [*placed, None]:
                if group:
                    first, end = group[0][1].offset, max(w.offset + w.length for _, w in group)
                    joins = (
                        item is not None
                        and item[1].offset - end <= MERGE_GAP
                        and item[1].offset + item[1].length - first <= MAX_SPAN_BYTES
                    )
                    if not joins:
                        chunk_bytes = sum(w.length for _, w in group)
                        span = _Span(pack, first, end)
                        future = self.backend.pool.submit(self._fetch, span, chunk_bytes)
                        for member, _ in group:
                            futures[member] = future
                        group = []
                if item is not None:
                    group.append(item)
        return window, futures

    def _fetch(self, span: _Span, chunk_bytes: int) -> tuple[int, memoryview] | None:
        try:
            data = self.backend.blobs.get(pack_blob(span.pack), span.start, span.end)
        except (BlobNotFoundError, BlobRangeError):
            return None  # deleted or cut short: its chunks read as missing
        self.backend.fetches.add(1, len(data), chunk_bytes)
        return span.start, memoryview(data)

    def __iter__(self) -> WindowedReader:
        return self

    def __next__(self) -> memoryview | None:
        return next(self._values)

    def _in_order(self) -> Iterator[memoryview | None]:
        self._ahead.append(self._submit(next(self._windows, range(0))))
        while self._ahead:
            window, futures = self._ahead.pop(0)
            following = next(self._windows, None)
            if following is not None:
                self._ahead.append(self._submit(following))
            for index in window:
                got = self._result(index, futures)
                if got is None and self._may_refresh(index):
                    futures = self._relocate(range(index, window.stop))
                    got = self._result(index, futures)
                where = self.locations[index]
                if where is None or got is None:
                    yield None
                    continue
                start, data = got
                yield data[where.offset - start : where.offset - start + where.length]

    @staticmethod
    def _result(index: int, futures: dict[int, Future[Any]]) -> tuple[int, memoryview] | None:
        future = futures.get(index)
        return None if future is None else future.result()

    def _may_refresh(self, index: int) -> bool:
        """A chunk the index placed could not be read, and this reader has not refreshed yet."""
        return self.keys is not None and not self._refreshed and self.locations[index] is not None

    def _relocate(self, rest: range) -> dict[int, Future[Any]]:
        """Refresh the index, look the chunks up again and refetch ``rest`` and what is ahead.

        Runs on the consumer's thread, never on the backend's pool: a refresh
        fetches index blobs on that pool, which fetches of ours may fill.
        """
        assert self.keys is not None
        self._refreshed = True
        self.backend.refresh()
        self.locations = self.backend.locate(self.keys)
        ahead = [window for window, _ in self._ahead]
        self.close()
        self._ahead = [self._submit(window) for window in ahead]
        return self._submit(rest)[1]

    def close(self) -> None:
        for _, futures in self._ahead:
            for future in futures.values():
                future.cancel()
        self._ahead = []
