"""The two-phase commit of a multi-rank save (``castore.dist.save``), blocking or async.

The coordinator proposes the generation id; every rank commits its chunks and
shard manifest and acknowledges; the coordinator re-reads every shard
manifest, checks that the sharded tensors cover their global shapes exactly
once, and only then commits the root and advances the ref; the outcome is
broadcast (invariants 1, 2). Any failure or dead rank means nothing is
published. :mod:`castore.dist.saver` prepares each rank's state and writes its
shard; this module is what the ranks do together.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, SupportsIndex

import msgpack

from castore.core.chunkio import WriteStats
from castore.core.commit import (
    COORDINATOR_FAULTS,
    CheckedShards,
    ShardWrite,
    check_data_order,
    check_shards,
    claim_writer,
    commit_objects,
    encode_metadata,
    framework_versions,
    make_root,
    publish,
    publish_shards,
    root_stats,
    whole_in_root,
)
from castore.core.staging import leaf_nbytes
from castore.dist.comm import (
    Group,
    attempt,
    describe,
    raise_failures,
    rebuild,
)
from castore.dist.holders import Holding, Outline, agree_on_holding, empty_dicts
from castore.dist.replicas import ReplicaDigests, check_replicas
from castore.errors import UnsupportedValueError
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import GenerationRoot, encode_object
from castore.format.tree import EncodedTree, encode_state, layouts_of
from castore.repo.records import RefValue
from castore.store import Store, check_step
from castore.support.faults import fault_point


@dataclass
class Prepared:
    encoded: EncodedTree
    metadata: bytes
    data_order: dict[str, Any]
    layout: str  # digest of the tensors' names, kinds, dtypes and global shapes
    outline: Outline  # those names, kinds, dtypes and global shapes
    empties: list[str]  # the key paths of the state's empty dicts (castore.dist.holders)
    replicated: list[tuple[str, int]]  # (name, nbytes) of tensors written by one rank
    # The sharded tensors whose block this rank writes (all but the replicas of a
    # block another rank writes: TensorLeaf.written_elsewhere), and their bytes.
    blocks: set[str]
    sharded_bytes: int
    replicas: ReplicaDigests  # compared across ranks before the publish
    # The global tensors this rank writes, when fixed before the ranks meet
    # (async saves stage only those); None: assigned from every rank's load.
    owned: set[str] | None = None


def prepare(
    state: Any,
    step: SupportsIndex,
    metadata: dict[str, Any] | None,
    data_order: dict[str, Any] | None,
    chunk_size: int,
    *,
    owner: tuple[int, int] | None = None,
) -> Prepared:
    """Encode this rank's state; ``owner`` (rank, world): fix now which tensors it writes.

    Fixed before the ranks meet, the replicated tensors are balanced alone
    (each rank's sharded bytes are not known yet), and an async save stages
    only what this rank writes (castore.core.staging).
    """
    check_step(step)
    encoded = encode_state(state, defer_device=owner is not None)
    layout: Outline = sorted(
        (leaf.name, "shard" if leaf.sharded else "replicated", leaf.dtype, list(leaf.shape))
        for leaf in encoded.leaves
    )
    replicated = sorted(
        (leaf.name, leaf_nbytes(leaf)) for leaf in encoded.leaves if not leaf.sharded
    )
    blocks = [leaf for leaf in encoded.leaves if leaf.sharded and not leaf.written_elsewhere]
    owned = None
    if owner is not None:
        rank, world = owner
        owners = assign_replicated(replicated, [0] * world)
        owned = {leaf.name for leaf in blocks}
        owned |= {name for name, at in owners.items() if at == rank}
    return Prepared(
        encoded=encoded,
        metadata=encode_metadata(metadata),
        data_order=check_data_order(data_order),
        layout=digest_bytes(msgpack.packb(layout)).hex(),
        outline=layout,
        empties=empty_dicts(encoded.skeleton),
        replicated=replicated,
        blocks={leaf.name for leaf in blocks},
        sharded_bytes=sum(leaf_nbytes(leaf) for leaf in blocks),
        replicas=ReplicaDigests(encoded, chunk_size),
        owned=owned,
    )


def owned_tensors(prepared: Prepared, holding: Holding, loads: list[int], rank: int) -> set[str]:
    """The global tensors ``rank`` writes: its blocks, and its share of the replicated
    tensors of each part of the state it holds, balanced among that part's holders."""
    by_region: dict[str | None, list[tuple[str, int]]] = {}
    for name, size in prepared.replicated:
        by_region.setdefault(holding.region_of(name), []).append((name, size))
    sizes = dict(prepared.replicated)
    common = assign_replicated(by_region.pop(None, []), loads)
    after = list(loads)
    for name, at in common.items():
        after[at] += sizes[name]
    mine = set(prepared.blocks) | {name for name, at in common.items() if at == rank}
    for region, tensors in by_region.items():  # only a holder of the region has its tensors
        holders = holding.holders(region)
        owners = assign_replicated(tensors, [after[h] for h in holders])
        mine |= {name for name, at in owners.items() if holders[at] == rank}
    return mine


def assign_replicated(replicated: list[tuple[str, int]], loads: list[int]) -> dict[str, int]:
    """Each replicated tensor to one rank, largest first, to the least loaded rank."""
    loads = list(loads)
    owners: dict[str, int] = {}
    for name, size in sorted(replicated, key=lambda item: (-item[1], item[0])):
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[name] = rank
        loads[rank] += size
    return owners


def commit_shard(store: Store, shard: ShardWrite, started: float) -> dict[str, Any]:
    """Commit this rank's shard manifest; the ack the coordinator gathers.

    ``elapsed``: seconds since this rank's call, so the root's ``seconds`` cover
    the rank that called first (the coordinator's clock alone may start later).
    """
    commit_objects(store, [(shard.digest, shard.data)])
    fault_point("dist.worker_before_ack")
    chunks = sum(len(e.chunks) for e in shard.manifest.tensors + shard.manifest.local_tensors)
    written = shard.stats.stored + len(shard.data)
    elapsed = time.perf_counter() - started
    return {
        "shard": shard.digest,
        "chunks": chunks,
        "written": written,
        "elapsed": elapsed,
        **vars(shard.stats),
    }


def commit_in_group(
    store: Store,
    comm: Group,
    run: str,
    step: int,
    prepared: Prepared | None,
    failure: BaseException | None,
    write: Callable[[int, set[str]], dict[str, Any]],
    started: float,
) -> Digest:
    """The two-phase commit of the module text, from the ranks' prepared states.

    ``write(generation, names)`` commits this rank's chunks of the global
    tensors ``names`` (and its rank-local values) and its shard manifest, and
    returns its ack. Returns the published root's digest on every rank.
    """
    # A tiered store whose ranks span several nodes (castore.tiers.nodes): None otherwise.
    session = store.node_session(comm, run)
    if session is not None:
        session.catch_up(run)
    infos = comm.all_gather(
        {
            "error": describe(failure),
            "layout": prepared.layout if prepared else None,
            "empties": prepared.empties if prepared else [],
            "sharded_bytes": prepared.sharded_bytes if prepared else 0,
        },
        "save: prepare",
    )
    raise_failures(infos, comm, failure)
    assert prepared is not None
    holding = agree_on_holding(infos, comm, prepared.outline, prepared.encoded.skeleton)
    if holding.regions and prepared.owned is not None:
        raise UnsupportedValueError(
            "an async save (blocking=False) of a state that some ranks pass as empty dicts "
            "is not supported yet: pass blocking=True",
            run=run,
            rank=comm.rank,
        )
    prepared.replicas.hold(holding, comm.rank)
    # The generation's tree: a rank's that passes all of it (castore.dist.holders).
    reference = holding.reference(comm.coordinator)

    proposal = propose(store, run, step, comm)
    generation = proposal["generation"]
    mine = prepared.owned
    if mine is None:
        loads = [i["sharded_bytes"] for i in infos]
        mine = owned_tensors(prepared, holding, loads, comm.rank)
    names, replicas = mine, prepared.replicas

    def write_mine() -> dict[str, Any]:
        ack = write(generation, names)
        if comm.rank == reference != comm.coordinator:  # the coordinator's tree lacks parts
            ack["skeleton"] = prepared.encoded.skeleton
        return ack

    def compare_replicas(acks: list[dict[str, Any]]) -> None:
        check_replicas(
            [ack["replicas"] for ack in acks],
            comm,
            replicas,
            run=run,
            generation=generation,
        )

    content = RootContent(
        prepared.encoded.skeleton,
        prepared.metadata,
        prepared.data_order,
        layouts_of(prepared.encoded),
    )
    return publish_in_group(
        store,
        comm,
        run,
        step,
        proposal,
        session,
        write_mine,
        content,
        started,
        check_acks=compare_replicas,
    )


@dataclass(frozen=True)
class RootContent:
    """What a collective save's root holds besides its shards and figures: the state's
    skeleton (the tensors it names), the metadata, the data-order record."""

    skeleton: bytes
    metadata: bytes
    data_order: dict[str, Any]
    layouts: dict[str, Any] = field(default_factory=dict)  # each DTensor's mesh and placements


def publish_in_group(
    store: Store,
    comm: Group,
    run: str,
    step: int,
    proposal: dict[str, Any],
    session: Any,
    write: Callable[[], dict[str, Any]],
    content: RootContent | None,
    started: float,
    *,
    check_acks: Callable[[list[dict[str, Any]]], None] | None = None,
) -> Digest:
    """Phase two of the module text, once the coordinator proposed the generation.

    ``write()`` commits this rank's chunks and shard manifest (of
    ``proposal["generation"]``) and returns its ack (:func:`commit_shard`);
    ``check_acks(acks)`` checks every rank's ack before the publish (a
    collective call); ``content`` is the root's (the coordinator's is used);
    ``session``: the tiered store's on several nodes (castore.tiers.nodes),
    or None. The castore.dist save and the DCP writer on several nodes
    (castore.dcp) both end here. Returns the published root's digest on every
    rank, or raises on every rank.
    """
    # Held from this rank's first dedup check until the outcome is known, so
    # garbage collection cannot delete a chunk this save found present.
    lock = contextlib.ExitStack()

    def locked_write() -> dict[str, Any]:
        lock.enter_context(store.save_lock())
        ack = write()
        if session is not None:  # this rank's node holds its chunks; its manifest travels
            ack["manifest"] = session.attest(ack["shard"])
        return ack

    with lock:
        ack, failure = attempt(locked_write)
        acks = comm.all_gather({"error": describe(failure), **(ack or {})}, "save: write shards")
        raise_failures(acks, comm, failure)
        if check_acks is not None:
            check_acks(acks)
        if session is not None:
            session.replicate(acks)

        outcome: dict[str, Any] = {}
        if comm.is_coordinator:
            assert content is not None
            published, failure = attempt(
                lambda: _validate_and_publish(
                    store, content, acks, proposal, run, step, comm, started, session
                )
            )
            outcome = {"error": describe(failure), "root": None}
            if published is not None:
                outcome.update(published)
        outcome = comm.broadcast(outcome, "save: publish")
        if session is not None and not outcome.get("error"):
            session.publish_on_node(run, outcome["root_bytes"], acks, proposal["parent"])
            generation = proposal["generation"]
            session.after_save(run, generation, Digest(outcome["root"]), outcome["promote"])
    if outcome.get("error"):
        if comm.is_coordinator and failure is not None:
            raise failure
        raise rebuild(outcome["error"], comm.coordinator)
    return Digest(outcome["root"])


def propose(store: Store, run: str, step: int, comm: Group) -> dict[str, Any]:
    """The coordinator reads the ref once and checks that this job may save the run
    (castore.core.fencing); every rank learns the id, the parent and the root's writer."""
    message: dict[str, Any] = {}
    failure: BaseException | None = None
    if comm.is_coordinator:

        def read() -> tuple[RefValue | None, dict[str, Any]]:
            parent = store.refs.read(run)
            return parent, claim_writer(store, run, parent, step)

        read_ref, failure = attempt(read)
        parent, writer = read_ref if read_ref is not None else (None, {})
        message = {
            "error": describe(failure),
            "generation": (parent.generation + 1) if parent else 1,
            "parent": None if parent is None else [parent.generation, parent.root.raw, parent.time],
            "writer": writer,
        }
    message = comm.broadcast(message, "save: propose")
    if message.get("error"):
        if failure is not None:
            raise failure
        raise rebuild(message["error"], comm.coordinator)
    return message


def _validate_and_publish(
    store: Store,
    content: RootContent,
    acks: list[dict[str, Any]],
    proposal: dict[str, Any],
    run: str,
    step: int,
    comm: Group,
    started: float,
    session: Any = None,
) -> dict[str, Any]:
    """Check the shards, build the root and publish it; the outcome every rank is sent.

    Where the coordinator passes only part of the state (castore.dist.holders), the
    rank whose tree is the generation's sent its skeleton in its ack."""
    sent = [ack["skeleton"] for ack in acks if "skeleton" in ack]
    if sent:
        content = replace(content, skeleton=sent[0])
    generation = proposal["generation"]
    parent = proposal["parent"]
    parent_ref = None if parent is None else RefValue(run, parent[0], Digest(parent[1]), parent[2])
    stats = WriteStats()
    for ack in acks:
        stats += WriteStats.from_wire(ack)
    held = [ack["held"] for ack in acks if "held" in ack]

    def build_root(checked: CheckedShards) -> GenerationRoot:
        return make_root(
            run=run,
            generation=generation,
            step=step,
            parent=parent_ref,
            world_size=comm.world_size,
            shards=checked.digests,
            state=content.skeleton,
            metadata=content.metadata,
            stats=root_stats(
                stats,
                max([time.perf_counter() - started] + [ack["elapsed"] for ack in acks]),
                checked.tensors,
                written_bytes=sum(ack["written"] for ack in acks),
                held_seconds=max(held) if held else None,
            ),
            frameworks=framework_versions(),
            data_order=content.data_order,
            writer=proposal["writer"],
            layouts=content.layouts,
            whole=whole_in_root(checked.entries) if comm.world_size > 1 else (),
        )

    shards = [ack["shard"] for ack in acks]
    if session is None:
        digest, _ = publish_shards(
            store,
            run=run,
            generation=generation,
            parent=parent_ref,
            shards=shards,
            build_root=build_root,
            skeleton=content.skeleton,
        )
        return {"root": digest.raw}
    # Several nodes: the manifests came in the acks, and each rank checked its node holds
    # its chunks (the coordinator cannot see other nodes' stores).
    commit_objects(store, [(ack["shard"], ack["manifest"]) for ack in acks])
    checked = check_shards(
        store,
        shards,
        run=run,
        generation=generation,
        skeleton=content.skeleton,
        chunks_attested=True,
    )
    root = build_root(checked)
    root_bytes = encode_object(root)
    digest = Digest(digest_bytes(root_bytes))
    session.record_holdings(run, generation, digest)
    publish(store, parent=parent_ref, root=root, faults=COORDINATOR_FAULTS, notify=False)
    promote = store.selects_for_durable(run, generation)
    return {"root": digest.raw, "root_bytes": root_bytes, "promote": promote}
