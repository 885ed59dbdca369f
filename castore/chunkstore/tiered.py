"""Reads from the fastest place that holds an intact copy: a chunk is a chunk wherever it is.

A :class:`TieredChunkBackend` puts a *primary* backend (a node's fast tier)
in front of *fallbacks* in order (peers, the durable tier). Writes, deletes,
presence and listings are the primary's alone: a save deduplicates against
what the fast tier holds and writes the rest there, and a collection of the
fast tier never touches another tier. A read takes each value from the
primary when it holds it and its bytes hash to their name (every key in both
namespaces is the blake3 digest of its value), else from the first fallback
whose copy does. A value no source holds intact is handed on as the last
source's answer (None when absent), so the caller's own verification names
it as missing or damaged, as it would on one store.

Verification here does not replace the caller's: it only chooses the source.
A caller that verifies every chunk anyway and can ask for another copy reads
through :meth:`TieredChunkBackend.read_to_verify`: the primary's chunks are
then handed on unhashed (each chunk hashed once, by the caller, on its pool),
and one the caller finds damaged is counted so and read from the fallbacks.
``served_*`` count the values and bytes each source gave, by the names the
fallbacks were given and, for the primary, "fast" (what it is in castore.tiers:
one vocabulary, fast, peer and durable, in every report).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from castore.chunkstore.base import (
    ChunkBackend,
    IndexCheck,
    Namespace,
    PutResult,
    ReadSink,
    ReclaimStats,
    VerifyingSink,
)
from castore.format.codec import stored_matches
from castore.format.hashing import Buffer

PRIMARY = "fast"  # the primary's name in the counters: a node's fast tier


class TieredChunkBackend(ChunkBackend):
    """``primary`` for everything, ``fallbacks`` (name, backend) for reads it cannot serve.

    ``distrust``: keys read from the fallbacks only (their primary copy was
    found damaged by an earlier read).

    The backends are not owned: :meth:`close` leaves them open.
    """

    def __init__(
        self,
        primary: ChunkBackend,
        fallbacks: Sequence[tuple[str, ChunkBackend]],
        *,
        distrust: set[bytes] | None = None,
    ) -> None:
        self.primary = primary
        self.distrust = set(distrust or ())  # keys whose primary copy was found damaged
        self.fallbacks = list(fallbacks)
        self.supports_writes = primary.supports_writes
        self.supports_deletes = primary.supports_deletes
        self.supports_listing = primary.supports_listing
        self._lock = threading.Lock()
        self.served_values: Counter[str] = Counter()
        self.served_bytes: Counter[str] = Counter()  # chunks and objects
        self.served_chunk_bytes: Counter[str] = Counter()  # chunks alone
        self.damaged: Counter[str] = Counter()  # values a source held that did not verify
        self.damaged_keys: dict[str, set[bytes]] = {}  # which, per source

    # -- reads: the fastest intact copy --------------------------------------

    def read_many(self, namespace: Namespace, keys: Sequence[bytes], sink: ReadSink) -> None:
        self._read(namespace, keys, lambda values, again: sink(values), check=True)

    def read_to_verify(
        self, namespace: Namespace, keys: Sequence[bytes], sink: VerifyingSink
    ) -> None:
        """The primary's chunks handed on unchecked: the caller hashes them anyway, and
        ``again(key)`` of one that fails counts it damaged and reads the fallbacks' copy.

        Objects are checked here as by ``read_many`` (small, and read by callers
        that do not ask again).
        """
        check = Namespace(namespace) is not Namespace.CHUNKS
        self._read(namespace, keys, sink, check=check)

    def _read(
        self, namespace: Namespace, keys: Sequence[bytes], sink: VerifyingSink, *, check: bool
    ) -> None:
        """``read_many`` (``check``: each primary value hashed here) or ``read_to_verify``."""
        keys = [bytes(key) for key in keys]
        held = self.primary.has_many(namespace, keys) if keys else []
        if self.distrust:
            held = [here and key not in self.distrust for key, here in zip(keys, held, strict=True)]
        local = [key for key, here in zip(keys, held, strict=True) if here]
        elsewhere = [key for key, here in zip(keys, held, strict=True) if not here]
        unchecked: dict[bytes, int] = {}  # primary values handed on unchecked: their sizes

        def again(key: bytes) -> memoryview | None:
            return self._again(namespace, bytes(key), unchecked)

        def with_local(local_values: Iterator[memoryview | None]) -> None:
            found = self._from_fallbacks(namespace, elsewhere)

            def merged() -> Iterator[memoryview | None]:
                for key, here in zip(keys, held, strict=True):
                    if here:
                        value = next(local_values)
                        if value is not None and (not check or _intact(key, value)):
                            self._count(PRIMARY, value, namespace)
                            if not check:
                                unchecked[key] = memoryview(value).nbytes
                            yield value
                            continue
                        if value is not None:
                            self._damaged(PRIMARY, key)
                        yield self._fallback_one(namespace, key, value)
                    else:
                        yield found.get(key)

            sink(merged(), again)

        self.primary.read_many(namespace, local, with_local)

    def _again(
        self, namespace: Namespace, key: bytes, unchecked: dict[bytes, int]
    ) -> memoryview | None:
        """The fallbacks' copy of a primary value the caller found damaged
        (``read_to_verify``'s ``again``); None for a key it did not hand on unchecked."""
        size = unchecked.pop(key, None)
        if size is None:
            return None  # a fallback's copy already, or never read: nothing else to try
        with self._lock:  # the primary did not serve it after all
            self._uncount(PRIMARY, size, namespace)
        self._damaged(PRIMARY, key)
        return self._from_fallbacks(namespace, [key]).get(key)

    def _from_fallbacks(
        self, namespace: Namespace, keys: list[bytes]
    ) -> dict[bytes, memoryview | None]:
        """Intact copies of ``keys`` from the fallbacks, in order; copied out of their reads.

        A key no fallback holds intact maps to the last damaged copy seen, or is absent.
        """
        found: dict[bytes, memoryview | None] = {}
        wanted = list(keys)
        for name, backend in self.fallbacks:
            if not wanted:
                break
            present = backend.has_many(namespace, wanted)
            asked = [key for key, here in zip(wanted, present, strict=True) if here]
            got: dict[bytes, bytes] = {}

            def keep(
                values: Iterator[memoryview | None],
                asked: list[bytes] = asked,
                got: dict[bytes, bytes] = got,
            ) -> None:
                for key, value in zip(asked, values, strict=True):
                    if value is not None:
                        got[key] = bytes(value)

            if asked:
                backend.read_many(namespace, asked, keep)
            left = []
            for key in wanted:
                data = got.get(key)
                if data is not None and _intact(key, data):
                    self._count(name, data, namespace)
                    found[key] = memoryview(data)
                    continue
                if data is not None:
                    self._damaged(name, key)
                    found[key] = memoryview(data)  # handed on if nothing better turns up
                left.append(key)
            wanted = left
        return found

    def _fallback_one(
        self, namespace: Namespace, key: bytes, damaged: memoryview | None
    ) -> memoryview | None:
        """A key the primary listed but could not give intact: the fallbacks' copy, if any."""
        value = self._from_fallbacks(namespace, [key]).get(key)
        if value is not None:
            return value
        return damaged  # the caller's verification names the damage

    def _count(self, source: str, value: Buffer, namespace: Namespace) -> None:
        with self._lock:
            self.served_values[source] += 1
            self.served_bytes[source] += memoryview(value).nbytes
            if namespace == Namespace.CHUNKS:
                self.served_chunk_bytes[source] += memoryview(value).nbytes

    def _uncount(self, source: str, nbytes: int, namespace: Namespace) -> None:
        """Take back a ``_count`` (the caller holds ``_lock``)."""
        counters = [(self.served_values, 1), (self.served_bytes, nbytes)]
        if namespace == Namespace.CHUNKS:
            counters.append((self.served_chunk_bytes, nbytes))
        for counter, amount in counters:
            counter[source] -= amount
            if not counter[source]:
                del counter[source]  # as if it had never served any

    def _damaged(self, source: str, key: bytes) -> None:
        with self._lock:
            self.damaged[source] += 1
            self.damaged_keys.setdefault(source, set()).add(key)

    # -- everything else: the primary's ---------------------------------------

    def has_many(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bool]:
        return self.primary.has_many(namespace, keys)

    def known_chunks(self, keys: Sequence[bytes]) -> list[bool]:
        return self.primary.known_chunks(keys)

    def put_many(self, namespace: Namespace, items: Iterable[tuple[bytes, Buffer]]) -> PutResult:
        return self.primary.put_many(namespace, items)

    def delete_many(self, namespace: Namespace, keys: Iterable[bytes]) -> int:
        return self.primary.delete_many(namespace, keys)

    def iter_keys(self, namespace: Namespace) -> Iterator[bytes]:
        return self.primary.iter_keys(namespace)

    def value_sizes(self, namespace: Namespace) -> Iterator[tuple[bytes, int]]:
        return self.primary.value_sizes(namespace)

    def reclaim(self, *, min_live: float = 0.5, merge_below: int = 0) -> ReclaimStats:
        return self.primary.reclaim(min_live=min_live, merge_below=merge_below)

    def check_index(self, *, hash_bytes: bool = False) -> IndexCheck:
        return self.primary.check_index(hash_bytes=hash_bytes)

    def file_bytes(self) -> int:
        return self.primary.file_bytes()

    def close(self) -> None:
        """Nothing to release: the tiers' backends belong to their stores."""


def _intact(key: bytes, value: Buffer) -> bool:
    """Whether ``value`` holds chunk ``key``: its raw bytes, or a frame of them."""
    return stored_matches(key, value)
