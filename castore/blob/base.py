"""The blob interface: the few primitives a store beyond one node stands on.

Format 3 (docs/FORMAT_BLOBS.md) lays a store out
as named blobs. Almost all are immutable and content-named (packs, their
index blobs, manifests, roots, reflog records); refs are the only mutable
ones. Every backend implements exactly these primitives, each chosen so that
S3 implements it with one request (or one multipart upload) and a shared POSIX
directory with a few system calls:

=====================  =========================================  =================================
primitive              S3                                         shared directory
=====================  =========================================  =================================
``create``             PutObject / CompleteMultipartUpload        temp file, fsync, ``link``
                       with ``If-None-Match: *``
``swap``               PutObject with ``If-Match: <etag>``        lock file, re-read, ``rename``
                       (``If-None-Match: *`` when creating)
``get``                GetObject with ``Range``                   ``pread``
``head``               HeadObject                                 ``fstatat``
``read_versioned``     GetObject (body and ETag)                  read, blake3 of the bytes
``list``               ListObjectsV2, prefix, pages               ordered ``scandir`` walk
``delete``             DeleteObject                               lock file, ``unlink``
=====================  =========================================  =================================

A :class:`Version` is opaque: only equality means anything. Every write of
different bytes yields a different version; writes of identical bytes may
yield equal versions (an S3 ETag and the shared directory's blake3 do, the
in-memory counter does not), so a version tells "is it still what I read",
never "was it rewritten".

Names are keys, not paths: ``/``-separated segments of safe characters
(:func:`validate_blob_name`), so no name escapes a directory root and every
name is a valid S3 key. A name may not be both a blob and a segment prefix of
another blob (``a`` and ``a/b``): a directory cannot be both, so the shared
directory and the in-memory store refuse the second one with
InvalidNameError, and a layout never uses such pairs.

Every implementation passes :class:`castore.testing.blobs.BlobStoreTests`.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from castore.errors import BlobConflictError, BlobRangeError, InvalidNameError
from castore.format.hashing import Buffer

# Refs, tags and leases are a few hundred bytes; the bound keeps a hostile blob
# from making read_versioned (and a shared directory's re-check) allocate at will.
MAX_MUTABLE_BLOB = 1 << 20
MAX_NAME_LENGTH = 512
MAX_SEGMENT_LENGTH = 128

_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_PREFIX_CHARS = re.compile(r"[A-Za-z0-9._/-]*")
_NAME_RULES = (
    "use '/'-separated segments of 1-128 characters from A-Z a-z 0-9 . _ -, "
    f"each starting with a letter or digit, at most {MAX_NAME_LENGTH} characters "
    "in all, without '..'"
)


@dataclass(frozen=True)
class Version:
    """An opaque token naming one written content of a blob; compare with ``==`` only.

    S3: the ETag. Shared directory: ``blake3:`` and the hex digest of the
    bytes. Memory: a counter.
    """

    token: str

    def __str__(self) -> str:
        return self.token


@dataclass(frozen=True)
class ByteRange:
    """The bytes ``start`` up to (not including) ``end`` of a blob."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def validate_blob_name(name: str) -> str:
    """Return ``name`` if it is a safe blob name, else raise InvalidNameError."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH or ".." in name:
        raise _invalid(name, "name")
    for segment in name.split("/"):
        if len(segment) > MAX_SEGMENT_LENGTH or not _SEGMENT.fullmatch(segment):
            raise _invalid(name, "name")
    return name


def validate_blob_prefix(prefix: str) -> str:
    """Return ``prefix`` if some valid name could start with it, else raise InvalidNameError.

    A prefix may end mid-segment (``packs/ab``) or with ``/``; it may be empty.
    """
    if (
        not isinstance(prefix, str)
        or len(prefix) > MAX_NAME_LENGTH
        or ".." in prefix
        or not _PREFIX_CHARS.fullmatch(prefix)
    ):
        raise _invalid(prefix, "prefix")
    if prefix:
        *whole, last = prefix.split("/")
        for segment in whole:
            if not _SEGMENT.fullmatch(segment) or len(segment) > MAX_SEGMENT_LENGTH:
                raise _invalid(prefix, "prefix")
        if last and (not _SEGMENT.fullmatch(last) or len(last) > MAX_SEGMENT_LENGTH):
            raise _invalid(prefix, "prefix")
    return prefix


def _invalid(name: object, what: str) -> InvalidNameError:
    shown = name if isinstance(name, str) else repr(name)
    return InvalidNameError(f"invalid blob {what} {name!r:.200}: {_NAME_RULES}", name=shown)


def check_range(name: str, size: int, start: int, end: int | None) -> ByteRange:
    """The range ``start``..``end`` (None: the end) of a blob of ``size`` bytes, checked.

    Raises BlobRangeError when it is negative, inverted or reaches past the end:
    a short read is never silently returned.
    """
    stop = size if end is None else end
    if not (isinstance(start, int) and isinstance(stop, int)) or not 0 <= start <= stop <= size:
        raise BlobRangeError(
            f"byte range {start}..{end} is outside blob {name!r} of {size} bytes",
            name=name,
            start=start,
            end=end,
            size=size,
        )
    return ByteRange(start, stop)


def check_expected(name: str, current: Version | None, expected: Version | None) -> None:
    """Raise BlobConflictError unless ``current`` is ``expected`` (None: absent)."""
    if current == expected:
        return
    if expected is None:
        found = "it exists"
    elif current is None:
        found = "it does not exist"
    else:
        found = f"it is at version {current}"
    wanted = "no blob" if expected is None else f"version {expected}"
    raise BlobConflictError(
        f"compare-and-swap of blob {name!r} expected {wanted}, but {found}: "
        "read it again and retry, or give up",
        name=name,
    )


def check_mutable_size(name: str, size: int) -> None:
    """Refuse to swap in more than MAX_MUTABLE_BLOB bytes (a caller's mistake)."""
    if size > MAX_MUTABLE_BLOB:
        raise ValueError(
            f"blob {name!r}: a compare-and-swap writes at most {MAX_MUTABLE_BLOB} bytes, "
            f"got {size}; large content belongs in an immutable blob made by create"
        )


def pieces_of(data: Buffer | Iterable[Buffer]) -> Iterator[memoryview]:
    """``data`` as byte views: one for a buffer, one per item (lazily) for an iterable."""
    candidate: Any = data  # a buffer, or else an iterable of them
    try:
        view = memoryview(candidate)
    except TypeError:
        for piece in data:
            yield memoryview(piece).cast("B")
        return
    yield view.cast("B")


class BlobStore(abc.ABC):
    """Named blobs under validated keys: the primitives of module :mod:`castore.blob.base`.

    Thread-safe, and safe between processes where the backend is shared (S3,
    a shared directory).
    """

    @abc.abstractmethod
    def create(self, name: str, data: Buffer | Iterable[Buffer]) -> Version:
        """Write a new blob, atomically and only if ``name`` is absent; return its version.

        ``data`` is one buffer, or an iterable of buffers consumed one at a
        time so that a large blob never sits whole in memory. Readers see the
        whole blob or none of it. Raises BlobExistsError (the blob keeps its
        first content) when ``name`` exists, and whatever the iterable raises,
        leaving no blob.
        """

    @abc.abstractmethod
    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        """The bytes ``start`` up to ``end`` (None: the end) of the blob.

        Raises BlobNotFoundError when it is absent and BlobRangeError when the
        range is negative, inverted or past the end (:func:`check_range`).
        """

    @abc.abstractmethod
    def head(self, name: str) -> int | None:
        """The blob's size in bytes, or None when it is absent.

        Costs one request whatever the size (the version is not computed:
        on a shared directory that would mean reading the blob).
        """

    @abc.abstractmethod
    def read_versioned(self, name: str) -> tuple[bytes, Version] | None:
        """A mutable blob's bytes and their version (one read: they always agree).

        None when absent; BlobTooLargeError when it is over MAX_MUTABLE_BLOB.
        """

    @abc.abstractmethod
    def swap(self, name: str, data: Buffer, expected: Version | None) -> Version:
        """Compare-and-swap: replace the blob with ``data`` if it is at ``expected``.

        ``expected`` None means create-if-absent. Atomic against every other
        swap, create and delete of the name; raises BlobConflictError (nothing
        written) when the blob is at another version, or exists, or is absent
        against a version. Returns the new version. ``data`` holds at most
        MAX_MUTABLE_BLOB bytes (ValueError).
        """

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """The names that start with ``prefix`` (a plain string prefix), sorted.

        Sorted as S3 lists keys (by bytes; names are ASCII). Backends fetch
        pages internally; the caller sees one iterator.
        """

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """Each listed blob's name and size in bytes, sorted as :meth:`list`.

        By default a ``head`` per name (a blob deleted meanwhile is left out);
        S3 reads the sizes off the listing's pages.
        """
        for name in self.list(prefix):
            size = self.head(name)
            if size is not None:
                yield name, size

    @abc.abstractmethod
    def delete(self, name: str) -> bool:
        """Remove the blob; return whether it existed (deleting an absent one is no error)."""
