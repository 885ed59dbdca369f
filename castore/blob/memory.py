"""Blobs in one process's memory, for tests: thread-safe, strict about names.

It keeps what the interface promises and nothing more: a list comes in pages
(``list_page_size``, small in tests) read under the lock one at a time, as an
object store's does, and a name that is both a blob and a prefix of another
blob is refused, as on a shared directory, so that a layout that would break
there breaks here first.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Iterable, Iterator

from castore.blob.base import (
    MAX_MUTABLE_BLOB,
    BlobStore,
    Version,
    check_expected,
    check_mutable_size,
    check_range,
    pieces_of,
    validate_blob_name,
    validate_blob_prefix,
)
from castore.errors import (
    BlobExistsError,
    BlobNotFoundError,
    BlobTooLargeError,
    InvalidNameError,
)
from castore.format.hashing import Buffer


class MemoryBlobStore(BlobStore):
    """Blobs in a dict under one lock; versions are a counter."""

    def __init__(self, *, list_page_size: int = 1000) -> None:
        if list_page_size < 1:
            raise ValueError(f"list_page_size must be at least 1, got {list_page_size}")
        self.list_page_size = list_page_size
        self._lock = threading.Lock()
        self._blobs: dict[str, tuple[bytes, Version]] = {}
        self._names: list[str] = []  # sorted, for prefix pages
        self._versions = itertools.count(1)

    def create(self, name: str, data: Buffer | Iterable[Buffer]) -> Version:
        validate_blob_name(name)
        content = b"".join(bytes(piece) for piece in pieces_of(data))
        with self._lock:
            if name in self._blobs:
                raise BlobExistsError(f"blob {name!r} exists; it keeps its content", name=name)
            return self._put(name, content)

    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        validate_blob_name(name)
        with self._lock:
            found = self._blobs.get(name)
        if found is None:
            raise BlobNotFoundError(f"no blob {name!r}", name=name)
        content = found[0]
        span = check_range(name, len(content), start, end)
        return content[span.start : span.end]

    def head(self, name: str) -> int | None:
        validate_blob_name(name)
        with self._lock:
            found = self._blobs.get(name)
        return None if found is None else len(found[0])

    def read_versioned(self, name: str) -> tuple[bytes, Version] | None:
        validate_blob_name(name)
        with self._lock:
            found = self._blobs.get(name)
        if found is not None and len(found[0]) > MAX_MUTABLE_BLOB:
            raise BlobTooLargeError(
                f"blob {name!r} is {len(found[0])} bytes, more than any swap writes", name=name
            )
        return found

    def swap(self, name: str, data: Buffer, expected: Version | None) -> Version:
        validate_blob_name(name)
        content = bytes(memoryview(data).cast("B"))
        check_mutable_size(name, len(content))
        with self._lock:
            found = self._blobs.get(name)
            check_expected(name, None if found is None else found[1], expected)
            return self._put(name, content)

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_blob_prefix(prefix)
        after: str | None = None
        while True:
            with self._lock:
                at = (
                    bisect.bisect_left(self._names, prefix)
                    if after is None
                    else bisect.bisect_right(self._names, after)
                )
                page = self._names[at : at + self.list_page_size]
            page = [name for name in page if name.startswith(prefix)]
            yield from page
            if len(page) < self.list_page_size:
                return
            after = page[-1]

    def delete(self, name: str) -> bool:
        validate_blob_name(name)
        with self._lock:
            if self._blobs.pop(name, None) is None:
                return False
            del self._names[bisect.bisect_left(self._names, name)]
            return True

    def _put(self, name: str, content: bytes) -> Version:
        """Store ``content`` under ``name`` with a new version; the caller holds the lock."""
        if name not in self._blobs:
            self._refuse_tree_conflict(name)
            bisect.insort(self._names, name)
        version = Version(f"mem:{next(self._versions)}")
        self._blobs[name] = (content, version)
        return version

    def _refuse_tree_conflict(self, name: str) -> None:
        segments = name.split("/")
        above = ["/".join(segments[:i]) for i in range(1, len(segments))]
        at = bisect.bisect_left(self._names, name + "/")
        below = at < len(self._names) and self._names[at].startswith(name + "/")
        if below or any(parent in self._blobs for parent in above):
            raise InvalidNameError(
                f"blob name {name!r} conflicts with an existing blob: a name cannot be both "
                "a blob and a prefix of other blobs ('a' and 'a/b')",
                name=name,
            )
