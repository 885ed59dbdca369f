"""Cooperative reads: a chunk that several ranks restore is read from the store once.

When the ranks of a ``castore.dist.load`` need the same chunk (a replicated
tensor every rank loads whole, HSDP replicas, boxes of a reshard that share a
grid cell), each would read it from the store itself: on S3 or a shared
directory, R requests and R times the bytes. With cooperation on, after
planning and before verification:

1. The ranks all_gather the distinct chunks each needs (32-byte digest and
   4-byte length each; in ``"node"`` mode also the host name): one collective.
2. Every rank computes the same assignment from that: each chunk needed by
   more than one rank (of one node, in ``"node"`` mode) gets one *reader*
   among the ranks that need it, chosen greedily, largest chunks first, to
   balance the bytes each rank reads from the store (its unshared chunks
   counted first). A chunk one rank needs is read by that rank, as before.
3. Each reader reads the chunks it serves, as stored (a compressed frame
   travels compressed), and one ``exchange`` sends every rank its chunks.
   Nothing is verified by the sender.
4. Each rank reads through :class:`SharedReads`: the chunks that arrived from
   memory, the rest from the store, in one pass of
   ``castore.core.chunkread.read_agree_deliver``. So every chunk is verified
   where it lands, against its digest, before the ranks agree and before any
   live tensor is written, whichever source gave it (invariants 3 and 4): a
   peer's damaged copy is a ChecksumMismatchError at the receiver, as a
   damaged chunk read from the store is. A chunk a reader could not send
   (its read failed) is read from the store by the rank that needs it.

Every rank takes part in both collectives whatever its planning gave (a rank
whose planning failed needs nothing), so their order never depends on a
failure. The bytes received are held in memory until the ranks agree, as a
read from a store on blobs holds what it fetched.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from castore.chunkstore.base import ChunkBackend, Namespace, PutResult, ReadSink
from castore.core.chunkread import ChunkRequest, ReadCounters, expected_length
from castore.dist.comm import Group, attempt
from castore.errors import UnsupportedOperationError
from castore.format.hashing import Buffer
from castore.support.framing import frame, unframe

_KEY = 32


def cooperation(setting: Any, backend: ChunkBackend, comm: Group) -> str | None:
    """What ``load(cooperative=setting)`` does here: ``"job"`` (one reader a chunk in
    the job), ``"node"`` (one a node) or None (every rank reads what it needs).

    ``"auto"``: ``"job"`` on a store whose reads are remote (``backend.remote_reads``:
    S3, a shared directory) when the ranks may span hosts, else None: where torchrun
    says every rank is on this host (``LOCAL_WORLD_SIZE`` equal to the group's size),
    the page cache serves repeated reads faster than an exchange over the group. A
    group of one never cooperates.
    """
    check_setting(setting)
    if comm.world_size < 2 or setting is False:
        return None
    if setting == "auto":
        one_host = os.environ.get("LOCAL_WORLD_SIZE") == str(comm.world_size)
        return "job" if backend.remote_reads and not one_host else None
    return "node" if setting == "node" else "job"


def check_setting(setting: Any) -> None:
    """Raise ValueError unless ``setting`` is one of ``cooperative``'s values."""
    if setting is True or setting is False or setting in ("auto", "node"):
        return
    raise ValueError(f"cooperative must be 'auto', 'node', True or False, got {setting!r}")


def node_name() -> str:
    """This process's node, for ``cooperative="node"``: its host name."""
    return socket.gethostname()


# -- who reads what ---------------------------------------------------------------


@dataclass
class Assignment:
    """This rank's part of the job's assignment (the same computation on every rank)."""

    serve: list[bytes] = field(default_factory=list)  # chunks it reads for other ranks too
    sends: dict[int, list[bytes]] = field(default_factory=dict)  # rank -> chunks, in order
    receives: dict[int, list[bytes]] = field(default_factory=dict)  # reader -> chunks


def needed_chunks(requests: Sequence[ChunkRequest]) -> dict[bytes, int]:
    """The distinct chunks ``requests`` read, with each one's length, in request order."""
    needs: dict[bytes, int] = {}
    for request in requests:
        key = bytes(request.entry.chunks[request.index])
        if key not in needs:
            needs[key] = expected_length(request.entry, request.index)
    return needs


def needs_message(needs: dict[bytes, int], node: str) -> dict[str, Any]:
    lengths = np.fromiter(needs.values(), dtype="<u4", count=len(needs))
    return {"keys": b"".join(needs), "lengths": lengths.tobytes(), "node": node}


def assign(messages: list[dict[str, Any]], rank: int) -> Assignment:
    """Who reads each chunk that several ranks (of one node) need, and what ``rank``
    serves, sends and receives; ``messages`` are every rank's :func:`needs_message`."""
    counts = [len(m["keys"]) // _KEY for m in messages]
    if sum(counts) == 0:
        return Assignment()
    keys = b"".join(bytes(m["keys"]) for m in messages)
    lengths = np.concatenate(
        [np.frombuffer(bytes(m["lengths"]), dtype="<u4") for m in messages]
    ).astype(np.int64)
    owner = np.repeat(np.arange(len(messages)), counts)
    node_of_rank = np.unique([str(m["node"]) for m in messages], return_inverse=True)[1]
    chunk_of_row = _chunk_ids(keys, len(owner))
    # A unit: one chunk on one node ("job" mode: one node); each gets one reader.
    nodes = int(node_of_rank.max()) + 1
    if nodes == 1:
        unit_of_row, needers = chunk_of_row, np.bincount(chunk_of_row)
    else:
        unit_key = chunk_of_row * nodes + node_of_rank[owner]
        _, unit_of_row, needers = np.unique(unit_key, return_inverse=True, return_counts=True)
    shared = needers[unit_of_row] > 1
    load = np.bincount(owner[~shared], weights=lengths[~shared], minlength=len(messages))
    reader_of_unit = _readers(unit_of_row, owner, lengths, shared, load, len(needers))
    reader = np.where(shared, reader_of_unit[unit_of_row], owner)
    return _part_of(rank, keys, unit_of_row, owner, reader)


def _chunk_ids(keys: bytes, rows: int) -> np.ndarray:
    """Each row's chunk as a number: equal digests, equal numbers; numbered by the
    digests' sorted order, which every rank computes alike. Sorted by their first 64
    bits (several times faster than as 32-byte strings); by all of them where two
    digests share those."""
    words = np.frombuffer(keys, dtype="<u8").reshape(rows, _KEY // 8)
    order = np.argsort(words[:, 0], kind="stable")
    ordered = words[order]
    same_first = ordered[1:, 0] == ordered[:-1, 0]
    if (same_first & (ordered[1:, 1:] != ordered[:-1, 1:]).any(axis=1)).any():
        order = np.lexsort(words.T)
        ordered = words[order]
    starts = np.ones(rows, dtype=bool)
    starts[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    ids = np.empty(rows, dtype=np.int64)
    ids[order] = np.cumsum(starts) - 1
    return ids


def _readers(
    unit_of_row: np.ndarray,
    owner: np.ndarray,
    lengths: np.ndarray,
    shared: np.ndarray,
    load: np.ndarray,
    units: int,
) -> np.ndarray:
    """Each shared unit's reader: the rank needing it that has read the fewest bytes so
    far (the lowest such rank on a tie), units taken largest first, then in unit order."""
    rows = np.flatnonzero(shared)
    rows = rows[np.lexsort((owner[rows], unit_of_row[rows]))]  # by unit, ranks ascending
    unit_ids, starts = np.unique(unit_of_row[rows], return_index=True)
    ends = np.append(starts[1:], len(rows))
    sizes = lengths[rows[starts]]
    reader_of_unit = np.full(units, -1, dtype=np.int64)
    for i in np.lexsort((unit_ids, -sizes)):
        ranks = owner[rows[starts[i] : ends[i]]]
        chosen = ranks[int(np.argmin(load[ranks]))]
        load[chosen] += sizes[i]
        reader_of_unit[unit_ids[i]] = chosen
    return reader_of_unit


def _part_of(
    rank: int,
    keys: bytes,
    unit_of_row: np.ndarray,
    owner: np.ndarray,
    reader: np.ndarray,
) -> Assignment:
    """``rank``'s sends and receives, each list in unit order on both ends."""
    part = Assignment()
    mine = np.flatnonzero((reader == rank) | (owner == rank))
    for row in mine[np.argsort(unit_of_row[mine], kind="stable")]:
        key = keys[row * _KEY : (row + 1) * _KEY]
        if reader[row] == rank and owner[row] != rank:
            part.sends.setdefault(int(owner[row]), []).append(key)
        elif owner[row] == rank and reader[row] != rank:
            part.receives.setdefault(int(reader[row]), []).append(key)
    served = {key for keys in part.sends.values() for key in keys}
    part.serve = sorted(served)
    return part


# -- moving the bytes ---------------------------------------------------------------


def share_chunks(
    backend: ChunkBackend,
    requests: Sequence[ChunkRequest],
    comm: Group,
    counters: ReadCounters,
    mode: str,
) -> tuple[SharedReads, BaseException | None]:
    """Steps 1-3 of the module text (a collective call on every rank, whatever its
    ``requests``): the backend this rank's reads go through, and this rank's failure
    (reading what it serves), to be agreed on with the others'. ``counters`` count
    what is read from the store, here and through the backend returned."""
    needs = needed_chunks(requests)
    node = node_name() if mode == "node" else ""
    messages = comm.all_gather(needs_message(needs, node), "load: chunks needed")
    part, failure = attempt(lambda: assign(messages, comm.rank))
    part = part or Assignment()
    held: dict[bytes, bytes | memoryview] = {}
    if part.serve:
        _, unread = attempt(lambda: held.update(_read(backend, part.serve, counters)))
        failure = failure or unread
    outgoing = {peer: frame([held.get(key) for key in keys]) for peer, keys in part.sends.items()}
    arrived = comm.exchange(outgoing, "load: chunks from peers")
    shared = SharedReads(backend, held, counters)
    for reader, keys in part.receives.items():
        for key, value in zip(keys, unframe(arrived.get(reader, b""), len(keys)), strict=True):
            if value is not None:
                shared.receive(key, value)
    return shared, failure


def _read(backend: ChunkBackend, keys: list[bytes], counters: ReadCounters) -> dict[bytes, bytes]:
    """``keys`` from the store as stored, copied out of the read; absent ones left out."""
    found: dict[bytes, bytes] = {}

    def keep(values: Iterator[memoryview | None]) -> None:
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                counters.chunks += 1
                counters.bytes += len(value)
                found[key] = bytes(value)

    backend.read_many(Namespace.CHUNKS, keys, keep)
    return found


class SharedReads(ChunkBackend):
    """Reads of ``inner`` with the chunks held in memory (read for peers or received
    from them) served from there; read-only. Verification is the caller's, as for any
    backend. ``counters`` count what ``inner`` served; ``received_*`` what peers sent."""

    supports_writes = False
    supports_deletes = False

    def __init__(
        self, inner: ChunkBackend, held: dict[bytes, bytes | memoryview], counters: ReadCounters
    ) -> None:
        self.inner = inner
        self.held = held
        self.counters = counters
        self.supports_listing = inner.supports_listing
        self.remote_reads = inner.remote_reads
        self.received_chunks = 0
        self.received_bytes = 0

    def receive(self, key: bytes, value: bytes | memoryview) -> None:
        self.held[key] = value
        self.received_chunks += 1
        self.received_bytes += len(value)

    def read_many(self, namespace: Namespace, keys: Sequence[bytes], sink: ReadSink) -> None:
        if Namespace(namespace) is Namespace.OBJECTS:
            self.inner.read_many(namespace, keys, sink)
            return
        keys = [bytes(key) for key in keys]
        elsewhere = [key for key in keys if key not in self.held]

        def merged(stored: Iterator[memoryview | None]) -> Iterator[memoryview | None]:
            for key in keys:
                held = self.held.get(key)
                if held is not None:
                    yield memoryview(held)
                    continue
                value = next(stored)
                if value is not None:
                    self.counters.chunks += 1
                    self.counters.bytes += len(value)
                yield value

        if not elsewhere:
            sink(merged(iter(())))
            return
        self.inner.read_many(namespace, elsewhere, lambda stored: sink(merged(stored)))

    def has_many(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bool]:
        if Namespace(namespace) is Namespace.OBJECTS:
            return self.inner.has_many(namespace, keys)
        present = self.inner.has_many(namespace, keys)
        return [here or bytes(key) in self.held for key, here in zip(keys, present, strict=True)]

    def put_many(self, namespace: Namespace, items: Iterable[tuple[bytes, Buffer]]) -> PutResult:
        raise UnsupportedOperationError("a restore's shared reads are read-only")

    def delete_many(self, namespace: Namespace, keys: Iterable[bytes]) -> int:
        raise UnsupportedOperationError("a restore's shared reads are read-only")

    def iter_keys(self, namespace: Namespace) -> Iterator[bytes]:
        return self.inner.iter_keys(namespace)

    def value_sizes(self, namespace: Namespace) -> Iterator[tuple[bytes, int]]:
        return self.inner.value_sizes(namespace)

    def close(self) -> None:
        """Nothing to release: ``inner`` belongs to its store."""
