"""A blob store that counts the calls made to it: the requests a store costs.

Every store on blobs is opened through this view (castore.opening.blobs),
so ``Store.blob_requests()`` says what a save, a promotion or a restore asked
of the shared directory or the bucket, whichever the backend. The counts are
of primitives (castore.blob.base's table). On S3 each is one request, except
a ``list`` (one ListObjectsV2 per 1,000 names: ``listed`` says how many came
back), a ``delete`` (HeadObject, then DeleteObject) and a ``create`` of a
large blob (a multipart upload). A primitive that raised is counted too: the
request was made.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from castore.blob.base import BlobStore, Version, pieces_of
from castore.format.hashing import Buffer

_Listed = TypeVar("_Listed")


@dataclass(frozen=True)
class BlobRequests:
    """Calls of each primitive and the bytes they moved (a snapshot; subtract two for a span).

    ``requests``: by primitive and the first segment of the name or prefix it
    named, ``"get objects"``, ``"list index"`` (``list_sizes`` is a ``list``),
    so that what a layout's parts cost can be told apart; ``listed``: the
    names lists returned; ``sent``: the bytes creates and swaps wrote;
    ``fetched``: the bytes gets and versioned reads returned.
    """

    requests: Mapping[str, int] = field(default_factory=dict)
    listed: int = 0
    sent: int = 0
    fetched: int = 0

    @property
    def calls(self) -> dict[str, int]:
        """The requests by primitive alone."""
        found: Counter[str] = Counter()
        for key, count in self.requests.items():
            found[key.split(" ", 1)[0]] += count
        return dict(found)

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    def __sub__(self, earlier: BlobRequests) -> BlobRequests:
        keys = set(self.requests) | set(earlier.requests)
        moved = {k: self.requests.get(k, 0) - earlier.requests.get(k, 0) for k in sorted(keys)}
        return BlobRequests(
            {k: v for k, v in moved.items() if v},
            self.listed - earlier.listed,
            self.sent - earlier.sent,
            self.fetched - earlier.fetched,
        )


class CountingBlobStore(BlobStore):
    """``inner``'s blobs, each primitive counted on its way through (thread-safe)."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        self._listed = self._sent = self._fetched = 0

    def __repr__(self) -> str:
        return repr(self.inner)

    def __str__(self) -> str:
        return str(self.inner)

    def requests(self) -> BlobRequests:
        """Every call made through this view since it was made."""
        with self._lock:
            return BlobRequests(dict(self._calls), self._listed, self._sent, self._fetched)

    def _count(
        self,
        primitive: str | None,
        name: str = "",
        *,
        listed: int = 0,
        sent: int = 0,
        fetched: int = 0,
    ) -> None:
        with self._lock:
            if primitive is not None:
                self._calls[f"{primitive} {name.split('/', 1)[0] or '/'}"] += 1
            self._listed += listed
            self._sent += sent
            self._fetched += fetched

    def create(self, name: str, data: Buffer | Iterable[Buffer]) -> Version:
        self._count("create", name)
        return self.inner.create(name, self._measured(data))

    def _measured(self, data: Buffer | Iterable[Buffer]) -> Iterator[memoryview]:
        # Counted piece by piece as the backend consumes them: a large blob is never whole.
        for piece in pieces_of(data):
            self._count(None, sent=piece.nbytes)
            yield piece

    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        self._count("get", name)
        data = self.inner.get(name, start, end)
        self._count(None, fetched=len(data))
        return data

    def head(self, name: str) -> int | None:
        self._count("head", name)
        return self.inner.head(name)

    def read_versioned(self, name: str) -> tuple[bytes, Version] | None:
        self._count("read_versioned", name)
        found = self.inner.read_versioned(name)
        if found is not None:
            self._count(None, fetched=len(found[0]))
        return found

    def swap(self, name: str, data: Buffer, expected: Version | None) -> Version:
        self._count("swap", name, sent=memoryview(data).nbytes)
        return self.inner.swap(name, data, expected)

    def list(self, prefix: str = "") -> Iterator[str]:
        self._count("list", prefix)
        return self._names(self.inner.list(prefix))

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        self._count("list", prefix)
        return self._names(self.inner.list_sizes(prefix))

    def _names(self, listing: Iterator[_Listed]) -> Iterator[_Listed]:
        for item in listing:
            self._count(None, listed=1)
            yield item

    def delete(self, name: str) -> bool:
        self._count("delete", name)
        return self.inner.delete(name)
