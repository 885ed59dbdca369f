"""Writing a generation in the order that makes it crash-safe (invariant 1).

1. ``write_shard``: a rank's chunks are committed, then (by the caller, or
   together with the root) its shard manifest object.
2. ``publish_shards``: the one publish sequence of a generation that several
   writers made (``castore.dist``, ``castore.dcp``, the tools). The
   coordinator re-reads every writer's shard manifest, checks that their
   boxes tile each tensor exactly once and that every chunk they name is
   present, builds the root, then ``publish`` commits it and advances the
   ref by compare-and-swap (the ref store logs the advance in the reflog).
   Nothing is visible to readers before that advance.

The single-process ``Store.save`` calls ``publish`` itself: its one shard is
still in memory (committed together with the root), each of its tensors is
one whole box, and it wrote or found every chunk under the store lock it
still holds, so the coordinator's checks have nothing to catch there.

This module needs only a store's parts (:class:`StoreParts`), never
:mod:`castore.store` itself, so the store facade can import it.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import numpy as np

from castore.chunkstore.base import ChunkBackend, Namespace
from castore.core.boxtable import BoxTable
from castore.core.chunkio import WriteStats, write_leaves
from castore.core.fencing import record_published, ref_for_root, root_writer, writer_epoch
from castore.core.reading import checked_entries, read_object, read_root
from castore.core.unchanged import VersionCache
from castore.errors import (
    ChunkMissingError,
    CorruptObjectError,
    LayoutMismatchError,
    UnsupportedValueError,
)
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import (
    MAX_FIELD_DEPTH,
    TYPE_SHARD,
    GenerationRoot,
    ShardManifest,
    TensorEntry,
    encode_object,
)
from castore.format.tree import (
    EncodedTree,
    check_depth,
    encode_local_state,
    encode_tree,
    tensor_names,
)
from castore.repo.records import RefValue
from castore.repo.refstore import ComposedRefStore
from castore.support.faults import fault_point
from castore.support.progress import progress_bar, progress_wanted
from castore.version import __version__


class TierHooks(Protocol):
    """The seam between a store and its tiers (castore.tiers), declared once.

    The publish sequence and castore.dist call these on every store; a store
    without tiers does nothing in each (the bodies here, which ``Store``
    inherits), and ``castore.tiers.TieredStore`` overrides them.
    """

    def after_publish(self, run: str, generation: int, root: Digest) -> None:
        """Called once ``run@generation`` is published (its ref advanced); a tiered
        store schedules its promotion here."""
        return None

    def node_session(self, comm: Any, run: str, *, restore: bool = False) -> Any:
        """What a collective save or load of ``run`` needs when its ranks' stores are on
        several nodes (a collective call there: castore.tiers.nodes.NodeSession, typed
        Any as the engine knows nothing of castore.dist's group); None on one node.
        ``restore``: the call restores (the round also gathers what a restore chooses
        by)."""
        return None

    def selects_for_durable(self, run: str, generation: int) -> bool:
        """Whether a collective save's ``run@generation`` goes on to a durable tier."""
        return False

    def report_step(self, seconds: float | None = None) -> None:
        """The training loop finished a step (``seconds`` long; None: since the last
        call). A tiered store paces its promotions by it; other stores ignore it."""
        return None

    def served_by_tier(self) -> dict[str, int]:
        """The chunk bytes each tier has served this handle's reads, by tier ("fast",
        "peer", "durable"); empty where there are no tiers."""
        return {}


class StoreParts(TierHooks, Protocol):
    """What writing a generation needs of a store: its chunk backend, chunk size, refs,
    and the hook it calls once it published (:class:`TierHooks`)."""

    @property
    def backend(self) -> ChunkBackend: ...

    @property
    def chunk_size(self) -> int: ...

    @property
    def codec(self) -> str: ...

    @property
    def refs(self) -> ComposedRefStore: ...


@dataclass(frozen=True)
class ShardWrite:
    """A rank's shard whose chunks are durable; its manifest bytes are ready to commit."""

    digest: bytes
    data: bytes
    manifest: ShardManifest
    stats: WriteStats


def write_shard(
    store: StoreParts,
    encoded: EncodedTree,
    *,
    run: str,
    generation: int,
    rank: int,
    own: set[str] | None = None,
    midway_fault: str = "save.mid_chunks",
    progress: bool = False,
    versions: VersionCache | None = None,
    codec: str | None = None,
) -> ShardWrite:
    """Commit this rank's chunks and build its shard manifest (not yet committed).

    ``own`` restricts the global tensors this rank writes (replicated tensors
    are written by one rank only); its rank-local values are always written.
    ``progress``: a bar on stderr counting the tensor bytes (see castore.support.progress).
    ``versions``: trust torch's version counters, through this handle's record of
    what it saved (castore.core.unchanged); None hashes every byte.
    ``codec``: how new chunks are stored (castore.format.codec); None: the store's.
    """
    leaves = [leaf for leaf in encoded.leaves if own is None or leaf.name in own]
    local_state, local_leaves = encode_local_state(encoded.rank_local)
    written = leaves + local_leaves
    total = sum(leaf.data.nbytes for leaf in written) if progress_wanted(progress) else 0
    known = (
        None if versions is None else versions.known(store.backend, run, written, store.chunk_size)
    )
    with progress_bar(progress, f"save {run}@{generation}", total) as bar:
        # One pass over global and per-rank tensors: batches (and commits) span both.
        entries, stats = write_leaves(
            store.backend,
            written,
            store.chunk_size,
            midway_fault=midway_fault,
            bar=bar,
            known=known,
            codec=codec or store.codec,
        )
    if versions is not None:
        versions.record(run, written, entries)
    return build_shard(
        run=run,
        generation=generation,
        rank=rank,
        tensors=entries[: len(leaves)],
        local_state=local_state,
        local_tensors=entries[len(leaves) :],
        stats=stats,
    )


def build_shard(
    *,
    run: str,
    generation: int,
    rank: int,
    tensors: list[TensorEntry],
    local_state: bytes,
    local_tensors: list[TensorEntry],
    stats: WriteStats,
) -> ShardWrite:
    """A rank's shard manifest over entries whose chunks are durable, and its bytes."""
    manifest = ShardManifest(
        run=run,
        generation=generation,
        rank=rank,
        tensors=tuple(tensors),
        local_state=local_state,
        writer={"host": socket.gethostname(), "pid": os.getpid()},
        local_tensors=tuple(local_tensors),
    )
    data = encode_object(manifest)
    return ShardWrite(digest_bytes(data), data, manifest, stats)


def commit_objects(store: StoreParts, objects: list[tuple[bytes, bytes]]) -> None:
    """Commit a rank's manifests; then check that its store lock still holds.

    The check comes before the rank acks its shard: a rank whose store lease
    was broken (castore.repo.leases) may have reused a chunk that a
    collection has deleted since, so it must not vouch for its shard.
    """
    store.backend.put_many(Namespace.OBJECTS, objects)
    store.refs.check_store_lock()


@dataclass(frozen=True)
class PublishFaults:
    """Fault point names around the publish steps."""

    before_root: str
    before_ref_advance: str
    after_ref_advance: str


SINGLE_FAULTS = PublishFaults(
    "save.before_objects", "save.before_ref_advance", "save.after_ref_advance"
)
COORDINATOR_FAULTS = PublishFaults(
    "dist.coordinator_before_root",
    "dist.coordinator_before_ref_advance",
    "dist.coordinator_after_ref_advance",
)


def publish(
    store: StoreParts,
    *,
    parent: RefValue | None,
    root: GenerationRoot,
    faults: PublishFaults,
    extra_objects: tuple[tuple[bytes, bytes], ...] = (),
    notify: bool = True,
    wrote: dict[str, int] | None = None,
) -> Digest:
    """Commit the root (with any objects not yet committed), then advance the ref.

    The last step of every publish: the ref's compare-and-swap is the commit
    point, and the ref store logs it (``wrote``: what a copy wrote, in its
    reflog record). Callers with shards from other writers use
    :func:`publish_shards`, which checks them first. ``notify=False``: the
    caller tells the store itself (``after_publish``).
    """
    root_bytes = encode_object(root)
    root_digest = Digest(digest_bytes(root_bytes))
    fault_point(faults.before_root)
    commit_objects(store, [*extra_objects, (root_digest.raw, root_bytes)])
    fault_point(faults.before_ref_advance)
    new = ref_for_root(root_digest, root)
    store.refs.advance(root.run, expected=parent.root if parent else None, new=new, wrote=wrote)
    record_published(store.refs, root.run, new)
    fault_point(faults.after_ref_advance)
    if notify:
        store.after_publish(root.run, root.generation, root_digest)
    return root_digest


def claim_writer(
    store: StoreParts, run: str, parent: RefValue | None, step: int, *, warn: bool = True
) -> dict[str, Any]:
    """The ``writer`` a root of ``run`` at ``step`` after ``parent`` records, once this
    process may publish it (castore.core.fencing: FencedError, StepOrderError, a warning)."""
    latest_step = parent.step if parent is not None else None
    if parent is not None and latest_step is None:  # a ref of before epochs: ask its root
        latest_step = read_root(store.backend, parent.root, run=run).step
    return root_writer(writer_epoch(store.refs, run, parent, step, latest_step, warn=warn))


def publish_single(
    store: StoreParts,
    shard: ShardWrite,
    *,
    step: int,
    parent: RefValue | None,
    skeleton: bytes,
    metadata: bytes,
    data_order: dict[str, Any],
    seconds: float,
    held_seconds: float | None,
    faults: PublishFaults,
    writer: dict[str, Any],
    layouts: dict[str, Any] | None = None,
) -> tuple[Digest, GenerationRoot]:
    """Publish a single writer's generation: its one shard, still in memory, and its root.

    The last step of the publish sequence only: the caller wrote the shard's
    chunks itself, whole boxes, under the store lock it still holds, so the
    coordinator's checks (:func:`check_shards`) have nothing to catch.
    """
    manifest = shard.manifest
    root = make_root(
        run=manifest.run,
        generation=manifest.generation,
        step=step,
        parent=parent,
        world_size=1,
        shards=[shard.digest],
        state=skeleton,
        metadata=metadata,
        stats=root_stats(
            shard.stats,
            seconds,
            len(manifest.tensors) + len(manifest.local_tensors),
            written_bytes=shard.stats.stored + len(shard.data),
            held_seconds=held_seconds,
        ),
        frameworks=framework_versions(),
        data_order=data_order,
        writer=writer,
        layouts=layouts,
    )
    digest = publish(
        store, parent=parent, root=root, faults=faults, extra_objects=((shard.digest, shard.data),)
    )
    return digest, root


def root_stats(
    stats: WriteStats,
    seconds: float,
    tensors: int,
    *,
    written_bytes: int,
    held_seconds: float | None = None,
) -> dict[str, Any]:
    """A root's ``stats``: ``written_bytes`` counts new chunk bytes and shard manifests;
    ``held_seconds``, how long the caller was held (the whole save unless async)."""
    return {
        "logical_bytes": stats.logical_bytes,
        "new_bytes": stats.new_bytes,
        "stored_bytes": stats.stored,
        "new_chunks": stats.new_chunks,
        "reused_chunks": stats.reused_chunks,
        "seconds": round(seconds, 6),
        "tensors": tensors,
        "written_bytes": written_bytes,
        "held_seconds": round(seconds if held_seconds is None else held_seconds, 6),
    }


def check_data_order(data_order: dict[str, Any] | None) -> dict[str, Any]:
    """A root's data-order record: a map of plain msgpack values under string keys."""
    if data_order is None:
        return {}
    if not isinstance(data_order, dict) or not all(isinstance(k, str) for k in data_order):
        raise UnsupportedValueError("data_order must be a dict with string keys")
    try:
        check_depth(data_order, "data_order", MAX_FIELD_DEPTH)
    except CorruptObjectError as exc:
        raise UnsupportedValueError(f"{exc}: flatten it") from None
    try:
        msgpack.packb(data_order, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(
            f"data_order holds a value msgpack cannot encode: {exc}"
        ) from exc
    return dict(data_order)


def make_root(
    *,
    run: str,
    generation: int,
    step: int,
    parent: RefValue | None,
    world_size: int,
    shards: list[bytes],
    state: bytes,
    metadata: bytes,
    stats: dict[str, Any],
    frameworks: dict[str, str],
    writer: dict[str, Any],
    data_order: dict[str, Any] | None = None,
    layouts: dict[str, Any] | None = None,
    whole: Sequence[TensorEntry] = (),
    lineage: dict[str, Any] | None = None,
) -> GenerationRoot:
    return GenerationRoot(
        run=run,
        generation=generation,
        step=step,
        parent=parent.root.raw if parent else None,
        time=time.time(),
        world_size=world_size,
        shards=tuple(shards),
        state=state,
        metadata=metadata,
        frameworks=frameworks,
        data_order=dict(data_order or {}),
        stats=stats,
        writer=dict(writer),
        layouts=dict(layouts or {}),
        whole=tuple(whole),
        lineage=dict(lineage or {}),
    )


# A tensor held whole by one box of at most this many chunks is repeated in the root.
WHOLE_IN_ROOT_CHUNKS = 16


def whole_in_root(entries: Mapping[str, list[TensorEntry]]) -> list[TensorEntry]:
    """The small tensors one saved box holds whole (replicated values, each written by
    one rank), for the root (GenerationRoot.whole): a rank restoring onto the saved
    layout finds them there instead of in whichever rank's manifest holds each."""
    if isinstance(entries, BoxTable):
        return entries.whole_tensors(WHOLE_IN_ROOT_CHUNKS)
    return [
        boxes[0]
        for boxes in entries.values()
        if len(boxes) == 1
        and boxes[0].local_shape == boxes[0].shape
        and len(boxes[0].chunks) <= WHOLE_IN_ROOT_CHUNKS
    ]


def encode_metadata(metadata: dict[str, Any] | None) -> bytes:
    """User metadata: plain values only, encoded like a state without tensors."""
    return encode_tree(dict(metadata or {}), allow_tensors=False)[0]


def framework_versions() -> dict[str, str]:
    """The versions a root records: castore, Python, numpy, and torch if it is loaded."""
    versions = {
        "castore": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = str(torch.__version__)
    return versions


# -- the coordinator's checks -------------------------------------------------


def read_written_shards(
    store: StoreParts, digests: list[bytes], *, run: str, generation: int, hint: str = ""
) -> list[ShardManifest]:
    """Re-read the shard manifests the writers reported, and check whose they are."""
    where = {"run": run, "generation": generation}
    shards: list[ShardManifest] = []
    for rank, digest in enumerate(digests):
        shard: ShardManifest = read_object(
            store.backend, digest, expect=TYPE_SHARD, rank=rank, **where
        )
        if (shard.run, shard.generation, shard.rank) != (run, generation, rank):
            raise CorruptObjectError(
                f"rank {rank} reported a shard of {shard.run}@{shard.generation} "
                f"rank {shard.rank}{hint}",
                **where,
            )
        shards.append(shard)
    return shards


def check_chunks_present(
    store: StoreParts, shards: list[ShardManifest], where: dict[str, Any]
) -> None:
    """Every chunk the shards name is in the store (a collection may not have raced a save)."""
    digests = list({c for s in shards for c in s.chunk_digests()})
    present = store.backend.has_many(Namespace.CHUNKS, digests)
    for digest, found in zip(digests, present, strict=True):
        if not found:
            raise ChunkMissingError(
                f"a shard names chunk {digest.hex()[:16]} that is not in the store", **where
            )


def check_names(
    skeleton: bytes, entries: Mapping[str, list[TensorEntry]], where: dict[str, Any]
) -> None:
    """The shards hold exactly the global tensors the state's skeleton names."""
    referenced = {name for name, _ in tensor_names(skeleton)}
    missing = sorted(referenced - entries.keys())
    extra = sorted(entries.keys() - referenced)
    if missing or extra:
        raise LayoutMismatchError(
            f"saved tensors do not match the state: missing {missing[:5]}, unexpected {extra[:5]}",
            **where,
        )


# -- the one publish sequence -------------------------------------------------


@dataclass(frozen=True)
class CheckedShards:
    """The shard manifests a root will name, re-read and checked by the coordinator."""

    digests: list[bytes]
    manifests: list[ShardManifest]
    entries: Mapping[str, list[TensorEntry]]  # every global tensor: name -> its distinct boxes

    @property
    def tensors(self) -> int:
        """Tensors the generation holds: each global one once, each rank's own per rank."""
        return len(self.entries) + sum(len(s.local_tensors) for s in self.manifests)


def check_shards(
    store: StoreParts,
    digests: list[bytes],
    *,
    run: str,
    generation: int,
    skeleton: bytes | None = None,
    hint: str = "",
    chunks_attested: bool = False,
) -> CheckedShards:
    """The coordinator's checks before a root may name these shards.

    Each manifest is the reporting writer's own, the boxes of every tensor
    tile it exactly once, the shards hold the tensors ``skeleton`` (the
    state's tree, when given) names, and every chunk they name is present:
    a collection may have raced a writer that found a chunk and skipped it.
    """
    where = {"run": run, "generation": generation}
    manifests = read_written_shards(store, digests, run=run, generation=generation, hint=hint)
    entries = checked_entries(manifests, where)
    if skeleton is not None:
        check_names(skeleton, entries, where)
    if not chunks_attested:  # else each writer checked its own, in the store that holds them
        check_chunks_present(store, manifests, where)
    return CheckedShards(list(digests), manifests, entries)


def publish_shards(
    store: StoreParts,
    *,
    run: str,
    generation: int,
    parent: RefValue | None,
    shards: list[bytes],
    build_root: Callable[[CheckedShards], GenerationRoot],
    faults: PublishFaults = COORDINATOR_FAULTS,
    skeleton: bytes | None = None,
    hint: str = "",
) -> tuple[Digest, GenerationRoot]:
    """Publish the committed shard manifests ``shards`` (in rank order) as one generation.

    The one publish sequence of a generation several writers made: check the
    shards (:func:`check_shards`), build the root from what was checked,
    commit it and advance the ref from ``parent`` (:func:`publish`). Any
    failed check raises before anything is written. Returns the root's
    digest and the root.
    """
    checked = check_shards(
        store, shards, run=run, generation=generation, skeleton=skeleton, hint=hint
    )
    root = build_root(checked)
    expected_parent = parent.root.raw if parent else None
    if (root.run, root.generation, root.parent, list(root.shards)) != (
        run,
        generation,
        expected_parent,
        list(shards),
    ):
        raise ValueError(
            f"the root built for {run}@{generation} does not name the checked shards and parent"
        )
    return publish(store, parent=parent, root=root, faults=faults), root


def publish_writes(
    store: StoreParts,
    *,
    run: str,
    generation: int,
    step: int,
    parent: RefValue | None,
    writes: list[ShardWrite],
    skeleton: bytes,
    metadata: dict[str, Any] | None = None,
    seconds: float = 0.0,
) -> tuple[Digest, GenerationRoot]:
    """Publish the shards one process wrote for several writers (``writes``, in rank
    order, their manifests committed) as one generation of ``len(writes)`` ranks.

    What importing a DCP checkpoint (and tools and tests that need a multi-writer
    generation without a process group) use: the root is built from the checked
    shards and published by :func:`publish_shards`, as a coordinator does.
    """
    stats = WriteStats()
    for write in writes:
        stats += write.stats
    manifests = sum(len(write.data) for write in writes)
    writer = claim_writer(store, run, parent, step)

    def build_root(checked: CheckedShards) -> GenerationRoot:
        return make_root(
            run=run,
            generation=generation,
            step=step,
            parent=parent,
            world_size=len(writes),
            shards=checked.digests,
            state=skeleton,
            metadata=encode_metadata(metadata),
            stats=root_stats(
                stats, seconds, checked.tensors, written_bytes=stats.stored + manifests
            ),
            frameworks=framework_versions(),
            writer=writer,
        )

    return publish_shards(
        store,
        run=run,
        generation=generation,
        parent=parent,
        shards=[write.digest for write in writes],
        build_root=build_root,
        skeleton=skeleton,
    )
