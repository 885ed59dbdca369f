"""Replicated values compared across ranks before a publish.

A tensor passed to ``castore.dist.save`` without :class:`~castore.Shard`, and
every plain value, is saved once, as replicated: one rank writes it and a
restore gives it to every rank. Each rank digests its own copy and the ranks
compare before the coordinator publishes. Replicas that differ are a user
error (a rank's block passed as a whole tensor) or silent data corruption;
either way nothing is published, and every rank raises
:class:`~castore.errors.ReplicaMismatchError` naming the values and the ranks.

What it costs: a rank hashes the replicated tensors another rank writes, on
the shared hash pool while it writes its own chunks; those it writes are
digested from their chunk names, which the write computes anyway. Each rank's
acknowledgement, which the ranks exchange already, carries one 32-byte digest
of all its replicated values; only when those differ do the ranks exchange a
digest per value, to name what differs.

A DTensor block that several ranks hold (along a ``Replicate`` mesh dimension:
HSDP's replicas) is written by one of them (castore.format.dtensor), so its
copies are compared the same way: a rank that holds a block another rank
writes hashes it as it hashes a replicated tensor (its grid chunks, as the
writer cuts them), the writer digests it from its chunk names. The
acknowledgement carries, for each set of ranks that hold the same blocks (one
set for HSDP), one digest of the blocks this rank holds with them; only where
two holders' digests differ do the ranks exchange a digest per block, and every
rank raises ReplicaMismatchError naming the key path, the block's offsets and
the ranks that differ.

Where some ranks pass an empty dict for a subtree that others pass (a region,
castore.dist.holders), a rank's values there are compared only with the other
holders of the region: the acknowledgement carries one digest of the part every
rank holds, and one per region this rank holds; a region only one rank holds has
nothing to compare.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

import msgpack
import numpy as np

from castore.core.chunkio import cut_leaf, digests_in_order, entry_of
from castore.core.unchanged import VersionCache
from castore.dist.comm import Group
from castore.dist.holders import Holding
from castore.errors import ReplicaMismatchError
from castore.format.hashing import digest_bytes
from castore.format.objects import TensorEntry
from castore.format.tree import EncodedTree, TensorLeaf, value_digests

# The longest list of differing values one error names.
_NAMED = 5


def tensor_digest(chunks: Iterable[bytes]) -> bytes:
    """A replicated tensor's digest: of its chunk names, in order (a write's own names)."""
    return digest_bytes(b"".join(chunks))


class ReplicaDigests:
    """This rank's digest of each value it passes as replicated, and of each DTensor
    block it holds that other ranks hold too."""

    def __init__(self, encoded: EncodedTree, chunk_size: int) -> None:
        self.skeleton = encoded.skeleton
        # The replicated values' tensors, and the DTensor blocks other ranks hold too.
        self.leaves = [leaf for leaf in encoded.leaves if not leaf.sharded or leaf.replicas]
        self.blocks = {leaf.name: leaf for leaf in self.leaves if leaf.sharded}
        self.chunk_size = chunk_size
        self.tensors: dict[str, bytes] = {}
        self.block_digests: dict[str, bytes] = {}
        self._hashing: list[tuple[TensorLeaf, Iterator[bytes]]] = []
        self._aside: threading.Thread | None = None
        self.holding: Holding | None = None  # None or no regions: every rank holds all
        self.rank = 0

    def hold(self, holding: Holding, rank: int) -> None:
        """Compare only what this rank holds: the part every rank holds, and its regions."""
        self.holding, self.rank = holding, rank

    def start(
        self,
        written: set[str],
        versions: VersionCache | None = None,
        run: str = "",
        *,
        aside: bool = False,
    ) -> None:
        """Start hashing the replicated tensors and blocks this rank does not write (``written``).

        ``versions`` (a save that trusts version counters): a tensor that has not
        moved since this handle last digested it is not hashed again. ``aside``: on
        one thread of its own, not the shared pool, so the chunks this rank writes
        are hashed first (the pool runs its tasks in order) and this fills the time
        the write waits for the disk.
        """
        others = [leaf for leaf in self.leaves if leaf.name not in written]
        trusted = versions.unmoved(run, others, self.chunk_size) if versions else {}
        for index, leaf in enumerate(others):
            if index in trusted:
                self._hashing.append((leaf, iter(trusted[index].chunks)))
            else:
                views = cut_leaf(leaf, self.chunk_size, _host_bytes(leaf))
                self._hashing.append((leaf, digests_in_order(views, inline=aside)))
        if aside and self._hashing:
            self._aside = threading.Thread(
                target=self._hash_all, name="castore-replicas", daemon=True
            )
            self._aside.start()

    def _hash_all(self) -> None:
        self._hashing = [(leaf, iter(tuple(digests))) for leaf, digests in self._hashing]

    def settle(self, versions: VersionCache | None = None, run: str = "") -> None:
        """Wait for the hashing :meth:`start` began (an async save: before training moves
        on); ``versions``: remember each tensor's chunks (hashed or trusted) for the next
        save, beside what this save's write recorded."""
        if self._aside is not None:
            self._aside.join()
            self._aside = None
        hashed = [(leaf, tuple(digests)) for leaf, digests in self._hashing]
        self._hashing = []
        for leaf, chunks in hashed:
            self._digested(leaf.name, tensor_digest(chunks))
        if versions is not None:
            leaves = [leaf for leaf, _ in hashed]
            entries = [entry_of(leaf, self.chunk_size, chunks) for leaf, chunks in hashed]
            versions.record(run, leaves, entries, add=True)

    def _digested(self, name: str, digest: bytes) -> None:
        if name in self.blocks:
            self.block_digests[name] = digest
        else:
            self.tensors[name] = digest

    def add_written(self, entries: Iterable[TensorEntry]) -> None:
        """The replicated tensors and blocks this rank wrote, from their chunk names."""
        replicated = {leaf.name for leaf in self.leaves}
        for entry in entries:
            if entry.name in replicated:
                self._digested(entry.name, tensor_digest(entry.chunks))

    def combined(self) -> dict[str, Any]:
        """What the ranks compare first: ``values``, one digest of every replicated value;
        ``blocks``, for each set of ranks that hold the same DTensor blocks (by a digest
        of the ranks), one digest of the blocks this rank holds with them."""
        self.settle()
        regions: dict[str, bytes] = {}
        if self.holding is not None and self.holding.regions:
            by_region: dict[str | None, list[tuple[str, bytes]]] = {}
            for path, digest in sorted(self.per_value().items()):
                by_region.setdefault(self.holding.region_of(path), []).append((path, digest))
            packed = msgpack.packb(by_region.pop(None, []))
            regions = {
                q: digest_bytes(msgpack.packb(each))
                for q, each in by_region.items()
                if q is not None
            }
        else:
            packed = msgpack.packb([digest_bytes(self.skeleton), sorted(self.tensors.items())])
        held: dict[bytes, list[Any]] = {}
        for name, digest in sorted(self.block_digests.items()):
            leaf = self.blocks[name]
            holders = digest_bytes(msgpack.packb(list(leaf.replicas)))
            held.setdefault(holders, []).append([name, list(leaf.offsets), digest])
        blocks = {holders: digest_bytes(msgpack.packb(each)) for holders, each in held.items()}
        return {"values": digest_bytes(packed), "blocks": blocks, "regions": regions}

    def per_block(self) -> list[list[Any]]:
        """Each block's ``[key path, offsets, digest]`` (a block other ranks hold too)."""
        self.settle()
        return [
            [name, list(self.blocks[name].offsets), digest]
            for name, digest in sorted(self.block_digests.items())
        ]

    def per_value(self) -> dict[str, bytes]:
        """Each value's digest by key path (a tensor's bytes where it stands), of the
        parts of the state this rank holds."""
        self.settle()
        every = {**value_digests(self.skeleton), **self.tensors}
        holding = self.holding
        if holding is None or not holding.regions:
            return every
        return {
            path: digest
            for path, digest in every.items()
            if holding.holds(self.rank, holding.region_of(path))
        }


def _host_bytes(leaf: TensorLeaf) -> np.ndarray:
    if leaf.device_bytes is not None:  # an async save's GPU tensor: its bytes come over
        return np.asarray(leaf.device_bytes.cpu().numpy())
    return leaf.data


def check_replicas(
    combined: list[dict[str, Any]],
    comm: Group,
    mine: ReplicaDigests,
    *,
    run: str,
    generation: int,
) -> None:
    """Raise ReplicaMismatchError on every rank if the ranks' replicated values, or the
    copies of a DTensor block that several ranks hold, differ.

    ``combined``: every rank's :meth:`ReplicaDigests.combined`, in rank order (the
    same list on every rank, so every rank takes the same branch). Where they
    differ the ranks exchange a digest per value and per block; values equal but
    for the order of a dict's keys are equal.
    """
    if not _any_differ(combined):
        return
    details = comm.all_gather(
        {"values": mine.per_value(), "blocks": mine.per_block()}, "save: compare replicas"
    )
    values = [detail["values"] for detail in details]
    differing = differing_values(values, mine.holding)
    if differing:
        raise ReplicaMismatchError(
            _message(differing, values, set(mine.tensors), run, generation),
            run=run,
            generation=generation,
            rank=comm.rank,
            keys=[path for path, _ in differing],
        )
    diverged = differing_blocks([detail["blocks"] for detail in details])
    if diverged:
        raise ReplicaMismatchError(
            _block_message(diverged, run, generation),
            run=run,
            generation=generation,
            rank=comm.rank,
            keys=sorted({name for name, _, _ in diverged}),
        )


def _any_differ(combined: list[dict[str, Any]]) -> bool:
    """Whether two ranks' values differ, or two holders of the same blocks' digests do."""
    if len({sent["values"] for sent in combined}) > 1:
        return True
    seen: dict[Any, set[bytes]] = {}
    for sent in combined:
        for holders, digest in sent["blocks"].items():
            seen.setdefault(holders, set()).add(digest)
        for region, digest in sent["regions"].items():  # only its holders send one
            seen.setdefault(("region", region), set()).add(digest)
    return any(len(digests) > 1 for digests in seen.values())


def differing_blocks(
    details: list[list[list[Any]]],
) -> list[tuple[str, tuple[int, ...], list[list[int]]]]:
    """Each block (key path, offsets) whose holders' digests differ, with its holders
    grouped by what they hold, the largest group first."""
    held: dict[tuple[str, tuple[int, ...]], dict[bytes, list[int]]] = {}
    for rank, blocks in enumerate(details):
        for name, offsets, digest in blocks:
            held.setdefault((name, tuple(offsets)), {}).setdefault(digest, []).append(rank)
    return [
        (name, offsets, sorted(groups.values(), key=lambda g: (-len(g), g[0])))
        for (name, offsets), groups in sorted(held.items())
        if len(groups) > 1
    ]


def differing_values(
    details: list[dict[str, bytes]], holding: Holding | None = None
) -> list[tuple[str, list[list[int]]]]:
    """Each key path whose digest is not the same on every rank that holds it
    (``holding``: castore.dist.holders; None, every rank), with those ranks grouped by
    what they hold: the largest group first, the ranks that lack the key last."""
    paths = sorted(set().union(*details))
    differing = []
    for path in paths:
        groups: dict[bytes | None, list[int]] = {}
        region = holding.region_of(path) if holding is not None else None
        for rank, digests in enumerate(details):
            if holding is None or holding.holds(rank, region):
                groups.setdefault(digests.get(path), []).append(rank)
        if len(groups) > 1:
            absent = groups.pop(None, [])
            held = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
            differing.append((path, held + ([absent] if absent else [])))
    return differing


def _message(
    differing: list[tuple[str, list[list[int]]]],
    details: list[dict[str, bytes]],
    tensors: set[str],
    run: str,
    generation: int,
) -> str:
    path, groups = differing[0]
    what = "tensor" if path in tensors else "value"
    named = f"{what} {path or '<root>'!r}"
    others = [p or "<root>" for p, _ in differing[1:_NAMED]]
    more = f" (and {len(differing) - 1}: {', '.join(map(repr, others))}" if others else ""
    if others:
        more += ", ..." if len(differing) > _NAMED else ""
        more += ")"
    lacking = path not in details[groups[-1][0]]
    return (
        f"replicated {named}{more} differs between ranks: {_who(groups, lacking)}; nothing "
        f"of generation {generation} of run {run!r} is published. A tensor passed without "
        "castore.Shard, and every plain value, is saved once and must be the same on every "
        "rank: pass a rank's block of a sharded tensor as castore.Shard(local, global_shape, "
        "offsets), and a value meant to differ between ranks as castore.RankLocal(value)"
    )


def _block_message(
    diverged: list[tuple[str, tuple[int, ...], list[list[int]]]], run: str, generation: int
) -> str:
    name, offsets, groups = diverged[0]
    others = [f"{n!r} at {list(o)}" for n, o, _ in diverged[1:_NAMED]]
    more = f" (and {len(diverged) - 1}: {', '.join(others)}" if others else ""
    if others:
        more += ", ..." if len(diverged) > _NAMED else ""
        more += ")"
    return (
        f"DTensor block {name!r} at offsets {list(offsets)}{more} differs between its "
        f"replicas: {_who(groups, False)}; nothing of generation {generation} of run "
        f"{run!r} is published. The ranks along a DTensor's Replicate mesh dimensions (HSDP's "
        "replicas) must hold the same block and one rank writes it: a replica diverged (a "
        "missed collective, or silent data corruption); restore the last published "
        "generation on every rank (castore.dist.load)"
    )


def _who(groups: list[list[int]], lacking: bool) -> str:
    """Which ranks differ; ``lacking``: the last group lacks the value."""
    if lacking:
        holders = sorted(rank for group in groups[:-1] for rank in group)
        held = "it" if len(groups) == 2 else f"{len(groups) - 1} different copies"
        lack = f"{_ranks(groups[-1])} {_verb('lack', groups[-1])} it"
        return f"{lack}; {_ranks(holders)} {_verb('hold', holders)} {held}"
    if len(groups) == 2:
        return f"{_ranks(groups[1])} {_verb('differ', groups[1])} from {_ranks(groups[0])}"
    return f"{len(groups)} different copies, held by " + "; ".join(_ranks(g) for g in groups)


def _verb(verb: str, ranks: list[int]) -> str:
    return verb + "s" if len(ranks) == 1 else verb


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2, 5``."""
    spans: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)
