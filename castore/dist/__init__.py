"""Multi-rank save and restore over torch.distributed (gloo, NCCL, ...).

Save is a two-phase commit (invariants 1, 2): the coordinator proposes the
generation id; every rank commits its chunks and shard manifest and
acknowledges; the coordinator re-reads every shard manifest, checks that the
sharded tensors cover their global shapes exactly once, and only then commits
the root and advances the ref; the outcome is broadcast. Any failure or dead
rank means nothing is published.

Restore (invariants 4, 5) lives in :mod:`castore.dist.restore` and is exported
here as ``load``: each rank verifies only the chunks its target boxes overlap,
all ranks agree, and only then does any rank write into its live tensors.

Every collective wait is bounded by ``timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, SupportsIndex, overload

import msgpack

from castore.dist.comm import (
    DEFAULT_TIMEOUT,
    Group,
    attempt,
    describe,
    own_groups,
    raise_failures,
    rebuild,
)
from castore.core.background import (
    AsyncOptions,
    Job,
    PendingSave,
    SaveBytes,
    report_failure,
    run_async,
    write_staged,
)
from castore.core.chunkio import WriteStats
from castore.core.commit import (
    COORDINATOR_FAULTS,
    CheckedShards,
    ShardWrite,
    build_shard,
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
    write_shard,
)
from castore.core.history import Generation
from castore.core.staging import leaf_nbytes
from castore.errors import (
    LayoutMismatchError,
)
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import GenerationRoot, encode_object
from castore.format.codec import check_setting
from castore.format.tree import EncodedTree, TensorLeaf, encode_local_state, encode_state
from castore.repo.records import RefValue, validate_run_name
from castore.dist.replicas import ReplicaDigests, check_replicas
from castore.dist.restore import LoadReport, LoadResult, load
from castore.store import Store, annotate_interrupt, check_step, digests_of
from castore.support.faults import fault_point

__all__ = ["LoadReport", "LoadResult", "PendingSave", "load", "save"]


# -- save ----------------------------------------------------------------------


@dataclass
class _Prepared:
    encoded: EncodedTree
    metadata: bytes
    data_order: dict[str, Any]
    layout: str  # digest of the tensors' names, kinds, dtypes and global shapes
    replicated: list[tuple[str, int]]  # (name, nbytes) of tensors written by one rank
    sharded_bytes: int
    replicas: ReplicaDigests  # compared across ranks before the publish
    # The global tensors this rank writes, when fixed before the ranks meet
    # (async saves stage only those); None: assigned from every rank's load.
    owned: set[str] | None = None


def _prepare(
    state: Any,
    step: SupportsIndex,
    metadata: dict[str, Any] | None,
    data_order: dict[str, Any] | None,
    chunk_size: int,
    *,
    owner: tuple[int, int] | None = None,
) -> _Prepared:
    """Encode this rank's state; ``owner`` (rank, world): fix now which tensors it writes.

    Fixed before the ranks meet, the replicated tensors are balanced alone
    (each rank's sharded bytes are not known yet), and an async save stages
    only what this rank writes (castore.core.staging).
    """
    check_step(step)
    encoded = encode_state(state, defer_device=owner is not None)
    layout = sorted(
        (leaf.name, "shard" if leaf.sharded else "replicated", leaf.dtype, list(leaf.shape))
        for leaf in encoded.leaves
    )
    replicated = sorted(
        (leaf.name, leaf_nbytes(leaf)) for leaf in encoded.leaves if not leaf.sharded
    )
    owned = None
    if owner is not None:
        rank, world = owner
        owners = _assign_replicated(replicated, [0] * world)
        owned = {leaf.name for leaf in encoded.leaves if leaf.sharded}
        owned |= {name for name, at in owners.items() if at == rank}
    return _Prepared(
        encoded=encoded,
        metadata=encode_metadata(metadata),
        data_order=check_data_order(data_order),
        layout=digest_bytes(msgpack.packb(layout)).hex(),
        replicated=replicated,
        sharded_bytes=sum(leaf_nbytes(leaf) for leaf in encoded.leaves if leaf.sharded),
        replicas=ReplicaDigests(encoded, chunk_size),
        owned=owned,
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


@overload
def save(
    store: Store,
    state: Any,
    *,
    run: str,
    step: SupportsIndex,
    metadata: dict[str, Any] | None = None,
    data_order: dict[str, Any] | None = None,
    group: Any = None,
    coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    blocking: Literal[True] = True,
    if_busy: str = "wait",
    async_options: AsyncOptions | None = None,
    trust_versions: bool = False,
    codec: str | None = None,
) -> Generation: ...


@overload
def save(
    store: Store,
    state: Any,
    *,
    run: str,
    step: SupportsIndex,
    metadata: dict[str, Any] | None = None,
    data_order: dict[str, Any] | None = None,
    group: Any = None,
    coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    blocking: Literal[False],
    if_busy: str = "wait",
    async_options: AsyncOptions | None = None,
    trust_versions: bool = False,
    codec: str | None = None,
) -> PendingSave: ...


@overload
def save(
    store: Store,
    state: Any,
    *,
    run: str,
    step: SupportsIndex,
    metadata: dict[str, Any] | None = None,
    data_order: dict[str, Any] | None = None,
    group: Any = None,
    coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    blocking: bool = ...,
    if_busy: str = "wait",
    async_options: AsyncOptions | None = None,
    trust_versions: bool = False,
    codec: str | None = None,
) -> Generation | PendingSave: ...


def save(
    store: Store,
    state: Any,
    *,
    run: str,
    step: SupportsIndex,
    metadata: dict[str, Any] | None = None,
    data_order: dict[str, Any] | None = None,
    group: Any = None,
    coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    blocking: bool = True,
    if_busy: str = "wait",
    async_options: AsyncOptions | None = None,
    trust_versions: bool = False,
    codec: str | None = None,
) -> Generation | PendingSave:
    """Save every rank's ``state`` as one generation of ``run`` (a collective call).

    Returns the same :class:`~castore.Generation` on every rank, or raises on
    every rank; nothing is published unless every rank's shard is durable and
    the coordinator has checked them all. ``data_order`` (plain values) is
    recorded in the root as given by the coordinator: ``castore.train`` puts
    the dataset hash, rank count and sampler position there. Without
    ``torch.distributed`` initialized, the process saves as a group of one.

    ``blocking=False`` returns a :class:`~castore.PendingSave` once this rank's
    state is staged, as :meth:`Store.save` does; the commit then runs on a
    writer thread over castore's own gloo group. Every rank must pass the same
    ``blocking`` and ``if_busy``; a skip is decided by all ranks together.

    ``trust_versions=True`` (blocking saves): each rank skips hashing and writing
    the CPU torch tensors whose version counters did not move since its last
    save through this store handle (see :mod:`castore.core.unchanged`).

    ``codec`` encodes this save's new chunks (``"none"``, ``"auto"``, ``"zstd"``,
    ``"bytegroup"``; see :mod:`castore.format.codec`) instead of the store
    handle's setting; every rank should pass the same.
    """
    # Before any collective: every rank opened the same store, so every rank refuses.
    store.refuse_if_closed()
    store.refuse_if_readonly("save")
    if codec is not None:
        check_setting(codec)
    step_int = _int_if_valid_step(step)
    if not blocking:
        if trust_versions:
            raise ValueError("trust_versions applies to blocking saves")
        return _save_async(
            store,
            state,
            run,
            step_int,
            metadata,
            data_order,
            group,
            coordinator,
            timeout,
            if_busy,
            async_options or AsyncOptions(),
            codec,
        )
    if if_busy != "wait":
        raise ValueError("if_busy applies to blocking=False saves; a blocking save waits")
    comm = Group(group, coordinator, timeout)
    before = store.ref_or_problem(run)
    try:
        store.background.before_blocking_save()
        return _save_in_group(
            store, state, comm, run, step_int, metadata, data_order, trust_versions, codec
        )
    except KeyboardInterrupt as interrupt:
        # Ctrl-C stays a KeyboardInterrupt; the note says whether anything was published.
        note = store.interrupted_note(run, before, publisher=comm.is_coordinator)
        annotate_interrupt(interrupt, f"{note} (rank {comm.rank})")
        raise


def _int_if_valid_step(step: SupportsIndex) -> Any:
    """``step`` as an int (from ``np.int64``, a 0-d tensor); an invalid one as given,
    for :func:`_prepare` to refuse where every rank learns of it (not here, alone)."""
    try:
        return check_step(step)
    except (TypeError, ValueError):
        return step


def _save_in_group(
    store: Store,
    state: Any,
    comm: Group,
    run: str,
    step: int,
    metadata: dict[str, Any] | None,
    data_order: dict[str, Any] | None,
    trust_versions: bool = False,
    codec: str | None = None,
) -> Generation:
    started = time.perf_counter()
    validate_run_name(run)
    prepared, failure = attempt(
        lambda: _prepare(state, step, metadata, data_order, store.chunk_size)
    )
    if prepared is not None:
        prepared.encoded.codec = codec

    def write(generation: int, mine: set[str]) -> dict[str, Any]:
        assert prepared is not None
        versions = store.versions if trust_versions else None
        if comm.world_size > 1:  # hashed on the pool while this rank writes its own
            prepared.replicas.start(mine, versions, run, aside=True)
        shard = write_shard(
            store,
            prepared.encoded,
            run=run,
            generation=generation,
            rank=comm.rank,
            own=mine,
            midway_fault="dist.worker_mid_shard",
            versions=versions,
        )
        store.background.remember(digests_of(shard.manifest))  # for a changed-chunk save next
        prepared.replicas.settle(versions, run)  # after write_shard, which records anew
        prepared.replicas.add_written(shard.manifest.tensors)
        return {**_commit_shard(store, shard, started), "replicas": prepared.replicas.combined()}

    digest = _commit_in_group(store, comm, run, step, prepared, failure, write, started)
    return Generation.from_root(digest, store.read_root(digest, run=run))


def _commit_shard(store: Store, shard: ShardWrite, started: float) -> dict[str, Any]:
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


def _commit_in_group(
    store: Store,
    comm: Group,
    run: str,
    step: int,
    prepared: _Prepared | None,
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
            "sharded_bytes": prepared.sharded_bytes if prepared else 0,
        },
        "save: prepare",
    )
    raise_failures(infos, comm, failure)
    _check_same_layout(infos, comm)
    assert prepared is not None

    proposal = _propose(store, run, step, comm)
    generation = proposal["generation"]
    mine = prepared.owned
    if mine is None:
        owners = _assign_replicated(prepared.replicated, [i["sharded_bytes"] for i in infos])
        mine = {leaf.name for leaf in prepared.encoded.leaves if leaf.sharded}
        mine |= {name for name, rank in owners.items() if rank == comm.rank}

    # Held from this rank's first dedup check until the outcome is known, so
    # garbage collection cannot delete a chunk this save found present.
    lock = contextlib.ExitStack()

    def locked_write() -> dict[str, Any]:
        lock.enter_context(store.save_lock())
        ack = write(generation, mine)
        if session is not None:  # this rank's node holds its chunks; its manifest travels
            ack["manifest"] = session.attest(ack["shard"])
        return ack

    with lock:
        ack, failure = attempt(locked_write)
        acks = comm.all_gather({"error": describe(failure), **(ack or {})}, "save: write shards")
        raise_failures(acks, comm, failure)
        check_replicas(
            [ack["replicas"] for ack in acks],
            comm,
            prepared.replicas,
            run=run,
            generation=generation,
        )
        if session is not None:
            session.replicate(acks)

        outcome: dict[str, Any] = {}
        if comm.is_coordinator:
            published, failure = attempt(
                lambda: _validate_and_publish(
                    store, prepared, acks, proposal, run, step, comm, started, session
                )
            )
            outcome = {"error": describe(failure), "root": None}
            if published is not None:
                outcome.update(published)
        outcome = comm.broadcast(outcome, "save: publish")
        if session is not None and not outcome.get("error"):
            session.publish_on_node(run, outcome["root_bytes"], acks, proposal["parent"])
            session.after_save(run, generation, Digest(outcome["root"]), outcome["promote"])
    if outcome.get("error"):
        if comm.is_coordinator and failure is not None:
            raise failure
        raise rebuild(outcome["error"], comm.coordinator)
    return Digest(outcome["root"])


# -- async save ----------------------------------------------------------------


def _save_async(
    store: Store,
    state: Any,
    run: str,
    step: int,
    metadata: dict[str, Any] | None,
    data_order: dict[str, Any] | None,
    group: Any,
    coordinator: int,
    timeout: float,
    if_busy: str,
    options: AsyncOptions,
    codec: str | None = None,
) -> PendingSave:
    """``save(..., blocking=False)``: stage here, run the commit on the writer thread.

    The ranks agree on skipping over castore's control group; the commit runs
    over castore's writer group, so it never meets training's collectives.
    """
    started = time.perf_counter()
    writer_group, control_group = own_groups(group, timeout)
    background = store.background

    def agree(busy: bool) -> bool:
        """Skip if any rank is busy: every rank must take the same decision."""
        control = Group(control_group, coordinator, timeout)
        return any(control.all_gather(busy, "save: busy"))

    comm = Group(writer_group, coordinator, timeout)
    try:
        with background.turn(if_busy, agree) as ours:
            if not ours:
                return background.skip(run, step)
            return _start_async(
                store,
                state,
                comm,
                PendingSave(run, step, started=started),
                metadata,
                data_order,
                options,
                codec,
            )
    except KeyboardInterrupt as interrupt:
        # No rank acked a shard this rank never finished staging: the coordinator
        # cannot publish it, so every rank's note is the publisher's.
        annotate_interrupt(interrupt, f"{store.staging_interrupted_note(run)} (rank {comm.rank})")
        raise


def _start_async(
    store: Store,
    state: Any,
    comm: Group,
    pending: PendingSave,
    metadata: dict[str, Any] | None,
    data_order: dict[str, Any] | None,
    options: AsyncOptions,
    codec: str | None = None,
) -> PendingSave:
    """Prepare and stage this rank's state; its writer thread runs the commit."""
    run, step, started = pending.run, pending.step, pending.started
    background = store.background

    def prepare() -> _Prepared:
        validate_run_name(run)
        prepared = _prepare(
            state, step, metadata, data_order, store.chunk_size, owner=(comm.rank, comm.world_size)
        )
        if comm.world_size > 1:  # only what this rank writes is staged: digest the rest now
            prepared.replicas.start(prepared.owned or set())
            prepared.replicas.settle()
        return prepared

    prepared, failure = attempt(prepare)
    leaves: list[TensorLeaf] = []
    local: list[TensorLeaf] = []
    local_state = b""
    if prepared is not None:
        local_state, local = encode_local_state(prepared.encoded.rank_local, defer_device=True)
        owned = prepared.owned or set()
        leaves = [leaf for leaf in prepared.encoded.leaves if leaf.name in owned] + local

    def body(job: Job) -> Generation:
        def write(generation: int, mine: set[str]) -> dict[str, Any]:
            written = write_staged(
                store.backend,
                job,
                leaves,
                store.chunk_size,
                rank=comm.rank,
                world=comm.world_size,
                midway_fault="dist.worker_mid_shard",
                codec=codec or store.codec,
            )
            store.background.remember(written.seen)
            shard = build_shard(
                run=run,
                generation=generation,
                rank=comm.rank,
                tensors=written.entries[: len(leaves) - len(local)],
                local_state=local_state,
                local_tensors=written.entries[len(leaves) - len(local) :],
                stats=written.stats,
            )
            ack = _commit_shard(store, shard, started)
            assert prepared is not None
            prepared.replicas.add_written(shard.manifest.tensors)
            ack["replicas"] = prepared.replicas.combined()
            clock[0] = time.perf_counter()
            pending.bytes = SaveBytes(
                written.stats.logical_bytes,
                pending.staged_bytes,
                shard.stats.new_bytes,
                ack["written"],
            )
            return {**ack, "held": pending.timings.get("held", 0.0)}

        digest = _commit_in_group(store, comm, run, step, prepared, failure, write, started)
        pending.timings["publish"] = time.perf_counter() - clock[0]
        return Generation.from_root(digest, store.read_root(digest, run=run))

    clock = [0.0]  # when this rank's shard was committed: the publish is timed from there
    if failure is not None:
        # The other ranks learn of it from the writer's first message, not by timing out.
        report_failure(background, pending, options, body)
        raise failure
    return run_async(
        background, pending, leaves, chunk_size=store.chunk_size, options=options, body=body
    )


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


def _propose(store: Store, run: str, step: int, comm: Group) -> dict[str, Any]:
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
    prepared: _Prepared,
    acks: list[dict[str, Any]],
    proposal: dict[str, Any],
    run: str,
    step: int,
    comm: Group,
    started: float,
    session: Any = None,
) -> dict[str, Any]:
    """Check the shards, build the root and publish it; the outcome every rank is sent."""
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
            state=prepared.encoded.skeleton,
            metadata=prepared.metadata,
            stats=root_stats(
                stats,
                max([time.perf_counter() - started] + [ack["elapsed"] for ack in acks]),
                checked.tensors,
                written_bytes=sum(ack["written"] for ack in acks),
                held_seconds=max(held) if held else None,
            ),
            frameworks=framework_versions(),
            data_order=prepared.data_order,
            writer=proposal["writer"],
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
            skeleton=prepared.encoded.skeleton,
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
        skeleton=prepared.encoded.skeleton,
        chunks_attested=True,
    )
    root = build_root(checked)
    root_bytes = encode_object(root)
    digest = Digest(digest_bytes(root_bytes))
    session.record_holdings(run, generation, digest)
    publish(store, parent=parent_ref, root=root, faults=COORDINATOR_FAULTS, notify=False)
    promote = store.selects_for_durable(run, generation)
    return {"root": digest.raw, "root_bytes": root_bytes, "promote": promote}
