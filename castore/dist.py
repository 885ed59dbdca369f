"""Multi-rank save and restore over torch.distributed (gloo, NCCL, ...).

Save is a two-phase commit (invariants 1, 2): the coordinator proposes the
generation id; every rank commits its chunks and shard manifest and
acknowledges; the coordinator re-reads every shard manifest, checks that the
sharded tensors cover their global shapes exactly once, and only then commits
the root and advances the ref; the outcome is broadcast. Any failure or dead
rank means nothing is published.

Restore (invariants 4, 5) lives in :mod:`castore.restore` and is exported
here as ``load``: each rank verifies only the chunks its target boxes overlap,
all ranks agree, and only then does any rank write into its live tensors.

Every collective wait is bounded by ``timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import msgpack

from castore._comm import DEFAULT_TIMEOUT, Group, attempt, describe, raise_failures, rebuild
from castore.chunkio import WriteStats
from castore.commit import (
    CheckedShards,
    check_data_order,
    commit_objects,
    encode_metadata,
    framework_versions,
    make_root,
    publish_shards,
    root_stats,
    write_shard,
)
from castore.errors import (
    LayoutMismatchError,
)
from castore.faults import fault_point
from castore.hashing import Digest, digest_bytes
from castore.history import Generation
from castore.objects import GenerationRoot
from castore.refs import RefValue, validate_run_name
from castore.restore import LoadReport, LoadResult, load
from castore.store import Store, annotate_interrupt, check_step
from castore.tree import EncodedTree, encode_state

__all__ = ["LoadReport", "LoadResult", "load", "save"]


# -- save ----------------------------------------------------------------------


@dataclass
class _Prepared:
    encoded: EncodedTree
    metadata: bytes
    data_order: dict[str, Any]
    layout: str  # digest of the tensors' names, kinds, dtypes and global shapes
    replicated: list[tuple[str, int]]  # (name, nbytes) of tensors written by one rank
    sharded_bytes: int


def _prepare(
    state: Any, step: int, metadata: dict[str, Any] | None, data_order: dict[str, Any] | None
) -> _Prepared:
    check_step(step)
    encoded = encode_state(state)
    layout = sorted(
        (leaf.name, "shard" if leaf.sharded else "replicated", leaf.dtype, list(leaf.shape))
        for leaf in encoded.leaves
    )
    return _Prepared(
        encoded=encoded,
        metadata=encode_metadata(metadata),
        data_order=check_data_order(data_order),
        layout=digest_bytes(msgpack.packb(layout)).hex(),
        replicated=sorted(
            (leaf.name, leaf.data.nbytes) for leaf in encoded.leaves if not leaf.sharded
        ),
        sharded_bytes=sum(leaf.data.nbytes for leaf in encoded.leaves if leaf.sharded),
    )


def _assign_replicated(replicated: list[tuple[str, int]], loads: list[int]) -> dict[str, int]:
    """Each replicated tensor to one rank, largest first, to the least loaded rank."""
    loads = list(loads)
    owners: dict[str, int] = {}
    for name, size in sorted(replicated, key=lambda item: (-item[1], item[0])):
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[name] = rank
        loads[rank] += size
    return owners


def save(
    store: Store,
    state: Any,
    *,
    run: str,
    step: int,
    metadata: dict[str, Any] | None = None,
    data_order: dict[str, Any] | None = None,
    group: Any = None,
    coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
) -> Generation:
    """Save every rank's ``state`` as one generation of ``run`` (a collective call).

    Returns the same :class:`~castore.Generation` on every rank, or raises on
    every rank; nothing is published unless every rank's shard is durable and
    the coordinator has checked them all. ``data_order`` (plain values) is
    recorded in the root as given by the coordinator: ``castore.train`` puts
    the dataset hash, rank count and sampler position there. Without
    ``torch.distributed`` initialized, the process saves as a group of one.
    """
    comm = Group(group, coordinator, timeout)
    before = store.ref_or_problem(run)
    try:
        return _save_in_group(store, state, comm, run, step, metadata, data_order)
    except KeyboardInterrupt as interrupt:
        # Ctrl-C stays a KeyboardInterrupt; the note says whether anything was published.
        note = store.interrupted_note(run, before, publisher=comm.is_coordinator)
        annotate_interrupt(interrupt, f"{note} (rank {comm.rank})")
        raise


def _save_in_group(
    store: Store,
    state: Any,
    comm: Group,
    run: str,
    step: int,
    metadata: dict[str, Any] | None,
    data_order: dict[str, Any] | None,
) -> Generation:
    started = time.perf_counter()
    validate_run_name(run)
    prepared, failure = attempt(lambda: _prepare(state, step, metadata, data_order))
    infos = comm.all_gather(
        {
            "error": describe(failure),
            "layout": prepared.layout if prepared else None,
            "sharded_bytes": prepared.sharded_bytes if prepared else 0,
        },
        "save: prepare",
    )
    raise_failures(infos, comm, failure)
    _check_same_layout(infos, comm)
    assert prepared is not None

    proposal = _propose(store, run, comm)
    generation = proposal["generation"]
    owners = _assign_replicated(prepared.replicated, [i["sharded_bytes"] for i in infos])
    mine = {leaf.name for leaf in prepared.encoded.leaves if leaf.sharded}
    mine |= {name for name, rank in owners.items() if rank == comm.rank}

    # Held from this rank's first dedup check until the outcome is known, so
    # garbage collection cannot delete a chunk this save found present.
    lock = contextlib.ExitStack()

    def write() -> dict[str, Any]:
        lock.enter_context(store.save_lock())
        shard = write_shard(
            store,
            prepared.encoded,
            run=run,
            generation=generation,
            rank=comm.rank,
            own=mine,
            midway_fault="dist.worker_mid_shard",
        )
        commit_objects(store, [(shard.digest, shard.data)])
        fault_point("dist.worker_before_ack")
        chunks = sum(len(e.chunks) for e in shard.manifest.tensors + shard.manifest.local_tensors)
        return {"shard": shard.digest, "chunks": chunks, **vars(shard.stats)}

    with lock:
        ack, failure = attempt(write)
        acks = comm.all_gather({"error": describe(failure), **(ack or {})}, "save: write shards")
        raise_failures(acks, comm, failure)

        outcome: dict[str, Any] = {}
        if comm.is_coordinator:
            published, failure = attempt(
                lambda: _validate_and_publish(
                    store, prepared, acks, proposal, run, step, comm, started
                )
            )
            outcome = {"error": describe(failure), "root": published}
        outcome = comm.broadcast(outcome, "save: publish")
    if outcome.get("error"):
        if comm.is_coordinator and failure is not None:
            raise failure
        raise rebuild(outcome["error"], comm.coordinator)
    digest = Digest(outcome["root"])
    return Generation.from_root(digest, store.read_root(digest, run=run))


def _check_same_layout(infos: list[Any], comm: Group) -> None:
    reference = infos[comm.coordinator]["layout"]
    for rank, info in enumerate(infos):
        if info["layout"] != reference:
            raise LayoutMismatchError(
                f"rank {rank} passes tensors that differ from rank {comm.coordinator}'s "
                "(names, sharding, dtypes or global shapes): every rank must pass the same "
                "tree of tensors",
                rank=comm.rank,
            )


def _propose(store: Store, run: str, comm: Group) -> dict[str, Any]:
    """The coordinator reads the ref once; every rank learns the id and parent."""
    message: dict[str, Any] = {}
    failure: BaseException | None = None
    if comm.is_coordinator:
        parent, failure = attempt(lambda: store.refs.read(run))
        message = {
            "error": describe(failure),
            "generation": (parent.generation + 1) if parent else 1,
            "parent": None if parent is None else [parent.generation, parent.root.raw, parent.time],
        }
    message = comm.broadcast(message, "save: propose")
    if message.get("error"):
        if failure is not None:
            raise failure
        raise rebuild(message["error"], comm.coordinator)
    return message


def _validate_and_publish(
    store: Store,
    prepared: _Prepared,
    acks: list[dict[str, Any]],
    proposal: dict[str, Any],
    run: str,
    step: int,
    comm: Group,
    started: float,
) -> bytes:
    generation = proposal["generation"]
    parent = proposal["parent"]
    parent_ref = None if parent is None else RefValue(run, parent[0], Digest(parent[1]), parent[2])
    stats = WriteStats()
    for ack in acks:
        stats += WriteStats(
            ack["logical_bytes"], ack["new_bytes"], ack["new_chunks"], ack["reused_chunks"]
        )

    def build_root(checked: CheckedShards) -> GenerationRoot:
        return make_root(
            run=run,
            generation=generation,
            step=step,
            parent=parent_ref,
            world_size=comm.world_size,
            shards=checked.digests,
            state=prepared.encoded.skeleton,
            metadata=prepared.metadata,
            stats=root_stats(stats, time.perf_counter() - started, checked.tensors),
            frameworks=framework_versions(),
            data_order=prepared.data_order,
        )

    digest, _ = publish_shards(
        store,
        run=run,
        generation=generation,
        parent=parent_ref,
        shards=[ack["shard"] for ack in acks],
        build_root=build_root,
        skeleton=prepared.encoded.skeleton,
    )
    return digest.raw
