"""The chunk backend contract.

A backend maps 32-byte digests to immutable byte strings in two namespaces:
``chunks`` (tensor bytes) and ``objects`` (encoded manifests). It knows
nothing of digests' meaning: verifying that bytes match their name is the
caller's job (see :mod:`castore.store`), so a backend can be tested on the raw
bytes underneath it, corrupt ones included. Every backend passes the contract
suite :class:`castore.testing.chunks.ChunkBackendTests`; refs, the reflog, tags
and locks are the repository's other parts (:mod:`castore.repo`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

from castore.format.hashing import Buffer


class Namespace(str, Enum):
    """The two key spaces a backend keeps apart."""

    CHUNKS = "chunks"
    OBJECTS = "objects"


@dataclass(frozen=True)
class PutResult:
    """What one ``put_many`` call did."""

    written: int = 0
    written_bytes: int = 0
    already_present: int = 0


@dataclass(frozen=True)
class ReclaimStats:
    """What one ``reclaim`` call did to the space behind deleted chunks."""

    packs_deleted: int = 0
    packs_rewritten: int = 0
    packs_merged: int = 0  # of those rewritten, small whole packs merged into one
    chunks_moved: int = 0
    bytes_freed: int = 0


@dataclass(frozen=True)
class IndexCheck:
    """What a cross-check of a backend's chunk index against its stored bytes found.

    ``problems`` are inconsistencies a collection must not act on (an entry
    that names the wrong bytes, an entry the index lists by lookup but not by
    iteration, a damaged LMDB file); ``notes`` are damage that loses nothing
    the index names (a garbage pack cut short).
    """

    entries: int = 0  # index entries listed by iteration
    records: int = 0  # pack records found by scanning
    packs: int = 0
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


# Called once, inside the read transaction, with an iterator that yields one
# value per key in key order (None for a missing key), fetching each lazily. The
# buffers are valid only during the call: copy what you keep. The callback may
# hand buffers to threads as it goes (overlapping I/O with hashing), as long as
# it waits for them before it returns.
ReadSink = Callable[[Iterator["memoryview | None"]], None]

# Another copy of a key whose value the caller found damaged, from a source that did
# not give that value; None where there is none (ChunkBackend.read_to_verify).
Again = Callable[[bytes], "memoryview | None"]
# A ReadSink that also gets ``again``: called once, inside the read transaction.
VerifyingSink = Callable[[Iterator["memoryview | None"], Again], None]


def no_other_copy(key: bytes) -> memoryview | None:
    """The ``again`` of a backend with one source: there is no other copy."""
    return None


class ChunkReader(abc.ABC):
    """Chunks copied straight into the caller's buffers (``pread``): no map, no staging copy.

    Made by :meth:`ChunkBackend.chunk_reader` for a list of chunk keys, from one
    snapshot of the index; ``position`` is a key's place in that list. Nothing
    here verifies: the caller hashes what lands in its buffer, and must let
    nothing else read the buffer before it has. ``readinto`` may be called from
    several threads at once.
    """

    # Each key's stored length as the index names it; None where the key is absent.
    lengths: list[int | None]

    @abc.abstractmethod
    def readinto(self, position: int, buffer: memoryview, offset: int = 0) -> int:
        """Copy key ``position``'s bytes from ``offset`` on into ``buffer``; return how many.

        Fewer than ``buffer`` holds where the stored value (or the file under
        it) ends first; never more than its stored length from ``offset``.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the reader holds open (files); it may not be used after."""

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ChunkBackend(abc.ABC):
    """Abstract key/value storage for chunks and objects."""

    supports_writes: bool = True
    supports_deletes: bool = True
    supports_listing: bool = True
    # Reads cross a network or a shared filesystem (each byte costs every reader a
    # request): a multi-rank restore then reads a chunk several ranks need once and
    # shares it over the process group (castore.dist.coopread). False: a local store,
    # whose readers on one node share the page cache.
    remote_reads: bool = False
    # read_many's chunk values are views of mapped files, so only the bytes a reader
    # touches are read from them: a read of part of a chunk counts only those
    # (castore.core.chunkread, ReadCounters).
    reads_in_place: bool = False

    @abc.abstractmethod
    def has_many(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bool]:
        """Return, for each key, whether it is present (without reading values)."""

    def known_chunks(self, keys: Sequence[bytes]) -> list[bool]:
        """Which chunks this handle knows to be present, without a round trip where it can.

        For decisions that only save work (a save's encoder skips compressing a
        chunk the backend will skip anyway): a chunk present but not known yet
        may read as absent; a True must be as true as ``has_many``'s. Backends
        whose ``has_many`` is a local lookup need not override it.
        """
        return self.has_many(Namespace.CHUNKS, keys)

    @abc.abstractmethod
    def read_many(self, namespace: Namespace, keys: Sequence[bytes], sink: ReadSink) -> None:
        """Call ``sink(values)`` once; ``values`` yields each key's value (None if absent).

        Buffers may be zero-copy views that die when ``sink`` returns.
        """

    def read_to_verify(
        self, namespace: Namespace, keys: Sequence[bytes], sink: VerifyingSink
    ) -> None:
        """``read_many`` for a caller that verifies every value against its key itself.

        ``sink(values, again)``: for a value that fails the caller's check,
        ``again(key)`` (called on ``sink``'s thread, before it returns) gives
        another copy from a source that did not give that one, or None. A backend
        of several sources (castore.chunkstore.tiered) may then hand on its first
        source's values unchecked instead of hashing them twice; one source has
        no other copy, so by default this is ``read_many``.
        """
        self.read_many(namespace, keys, lambda values: sink(values, no_other_copy))

    @abc.abstractmethod
    def put_many(self, namespace: Namespace, items: Iterable[tuple[bytes, Buffer]]) -> PutResult:
        """Store each (key, value) durably unless the key is present; one commit.

        ``items`` may be lazy; a value's buffer must stay valid and unchanged
        until this returns (backends may write several values together).
        """

    @abc.abstractmethod
    def delete_many(self, namespace: Namespace, keys: Iterable[bytes]) -> int:
        """Delete the keys that are present; return how many were deleted."""

    @abc.abstractmethod
    def iter_keys(self, namespace: Namespace) -> Iterator[bytes]:
        """Yield every key of the namespace (a snapshot)."""

    @abc.abstractmethod
    def value_sizes(self, namespace: Namespace) -> Iterator[tuple[bytes, int]]:
        """Yield (key, stored length) for every key of the namespace.

        Backends may answer from an index without reading the values.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend's resources; further use is an error."""

    def reclaim(self, *, min_live: float = 0.5, merge_below: int = 0) -> ReclaimStats:
        """Give back the space of deleted chunks, where the backend keeps it after a delete.

        Backends that free space on delete do nothing. ``min_live`` is the
        live fraction below which a container of chunks is rewritten;
        containers smaller than ``merge_below`` bytes are merged into one.
        """
        return ReclaimStats()

    def check_index(self, *, hash_bytes: bool = False) -> IndexCheck:
        """Cross-check the chunk index against the stored bytes (``hash_bytes``: re-hash them).

        Backends without a separate index have nothing to disagree: no problems.
        """
        return IndexCheck()

    def truncated_chunks(self, keys: Sequence[bytes]) -> dict[bytes, str]:
        """The chunks among ``keys`` (all present) whose bytes the index places past the
        end of their pack, or in a pack that is gone: key -> what is wrong, naming the pack.

        A structural check (no chunk byte is read): one size lookup per pack. Backends
        that keep no packs have nothing to cut short.
        """
        return {}

    def file_bytes(self) -> int:
        """Bytes the backend occupies on disk (0 for one that uses no files)."""
        return 0

    def chunk_reader(self, keys: Sequence[bytes]) -> ChunkReader | None:
        """A reader of these chunks straight into buffers, or None: read them with ``read_many``.

        For backends whose chunks lie in local files; the default has none.
        """
        return None

    def get(self, namespace: Namespace, key: bytes) -> bytes | None:
        """Return a copy of one value, or None when the key is absent."""
        found: list[bytes | None] = [None]

        def keep(values: Iterator[memoryview | None]) -> None:
            value = next(values)
            found[0] = None if value is None else bytes(value)

        self.read_many(namespace, [key], keep)
        return found[0]
