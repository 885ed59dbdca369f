"""A read-only view of a blob store: reads pass through, every write is refused.

A store opened read-only over blobs (a shared directory it may not write, or
``castore.open("s3://...", readonly=True)``) reads through this view. A write
(``create``, ``swap``, ``delete``) raises ReadOnlyStoreError before any request
or system call, so whatever path reaches it, nothing in the store changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from castore.blob.base import BlobStore, Version
from castore.format.hashing import Buffer
from castore.support.readonly import ReadOnly


class ReadOnlyBlobStore(BlobStore):
    """``inner``'s blobs, readable; writes raise ReadOnlyStoreError naming ``reason``."""

    def __init__(self, inner: BlobStore, reason: ReadOnly) -> None:
        self.inner = inner
        self.reason = reason

    def __repr__(self) -> str:
        return f"<read-only {self.inner!r}>"

    def __str__(self) -> str:
        return str(self.inner)

    def create(self, name: str, data: Buffer | Iterable[Buffer]) -> Version:
        raise self.reason.refuse(f"writing blob {name!r}")

    def swap(self, name: str, data: Buffer, expected: Version | None) -> Version:
        raise self.reason.refuse(f"replacing blob {name!r}")

    def delete(self, name: str) -> bool:
        raise self.reason.refuse(f"deleting blob {name!r}")

    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        return self.inner.get(name, start, end)

    def head(self, name: str) -> int | None:
        return self.inner.head(name)

    def read_versioned(self, name: str) -> tuple[bytes, Version] | None:
        return self.inner.read_versioned(name)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return self.inner.list_sizes(prefix)
