"""Multi-rank save (``castore.dist.save``), as DCP's ``state_dict_saver``: blocking or async.

Each rank encodes its state and writes its shard; the ranks publish it together
through the two-phase commit of :mod:`castore.dist.groupcommit`. An async save
stages this rank's state and runs the commit on the store's writer thread,
over castore's own gloo groups. Every collective wait is bounded by
``timeout`` seconds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, overload

from castore.core.background import (
    Job,
    PendingSave,
    SaveBytes,
    report_failure,
    run_async,
    write_staged,
)
from castore.core.commit import build_shard, write_shard
from castore.core.history import Generation
from castore.core.saveoptions import SaveKeywords, SaveOptions
from castore.dist.comm import DEFAULT_TIMEOUT, Group, attempt, own_groups
from castore.dist.groupcommit import Prepared, commit_in_group, commit_shard, prepare
from castore.format.tree import TensorLeaf, encode_local_state
from castore.repo.records import validate_run_name
from castore.store import Store, annotate_interrupt, check_step, digests_of

if TYPE_CHECKING:
    from typing_extensions import Unpack


class DistSaveKeywords(SaveKeywords, total=False):
    """:func:`save`'s keywords besides ``run``, ``step`` and ``blocking``."""

    data_order: dict[str, Any] | None
    group: Any
    coordinator: int
    timeout: float


@overload
def save(
    store: Store,
    state: Any,
    *,
    run: str,
    step: SupportsIndex,
    blocking: Literal[True] = True,
    **keywords: Unpack[DistSaveKeywords],
) -> Generation: ...


@overload
def save(
    store: Store,
    state: Any,
    *,
    run: str,
    step: SupportsIndex,
    blocking: Literal[False],
    **keywords: Unpack[DistSaveKeywords],
) -> PendingSave: ...


@overload
def save(
    store: Store,
    state: Any,
    *,
    run: str,
    step: SupportsIndex,
    blocking: bool = ...,
    **keywords: Unpack[DistSaveKeywords],
) -> Generation | PendingSave: ...


def save(
    store: Store,
    state: Any,
    *,
    run: str,
    step: SupportsIndex,
    blocking: bool = True,
    **keywords: Unpack[DistSaveKeywords],
) -> Generation | PendingSave:
    """Save every rank's ``state`` as one generation of ``run`` (a collective call).

    Returns the same :class:`~castore.Generation` on every rank, or raises on
    every rank; nothing is published unless every rank's shard is durable and
    the coordinator has checked them all. ``data_order`` (plain values) is
    recorded in the root as given by the coordinator: ``castore.train`` puts
    the dataset hash, rank count and sampler position there; ``metadata``
    (plain values) too. Without ``torch.distributed`` initialized, the process
    saves as a group of one; ``group``, ``coordinator`` (its rank in the group)
    and ``timeout`` (seconds, every collective wait) say which group.

    ``blocking=False`` returns a :class:`~castore.PendingSave` once this rank's
    state is staged, as :meth:`Store.save` does; the commit then runs on a
    writer thread over castore's own gloo group. Every rank must pass the same
    ``blocking`` and ``if_busy``; a skip is decided by all ranks together.
    ``async_options`` (:class:`~castore.AsyncOptions`) as for :meth:`Store.save`.

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
    data_order = keywords.pop("data_order", None)
    group = keywords.pop("group", None)
    coordinator = keywords.pop("coordinator", 0)
    timeout = keywords.pop("timeout", DEFAULT_TIMEOUT)
    options = SaveOptions.of("save", blocking, keywords)
    step_int = _int_if_valid_step(step)
    if not blocking:
        return _save_async(
            store, state, run, step_int, data_order, group, coordinator, timeout, options
        )
    comm = Group(group, coordinator, timeout)
    before = store.ref_or_problem(run)
    try:
        store.background.before_blocking_save()
        return _save_in_group(store, state, comm, run, step_int, data_order, options)
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
    data_order: dict[str, Any] | None,
    options: SaveOptions,
) -> Generation:
    started = time.perf_counter()
    validate_run_name(run)
    prepared, failure = attempt(
        lambda: prepare(state, step, options.metadata, data_order, store.chunk_size)
    )

    def write(generation: int, mine: set[str]) -> dict[str, Any]:
        assert prepared is not None
        versions = store.versions if options.trust_versions else None
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
            codec=options.codec,
        )
        store.background.remember(digests_of(shard.manifest))  # for a changed-chunk save next
        prepared.replicas.settle(versions, run)  # after write_shard, which records anew
        prepared.replicas.add_written(shard.manifest.tensors)
        return {**commit_shard(store, shard, started), "replicas": prepared.replicas.combined()}

    digest = commit_in_group(store, comm, run, step, prepared, failure, write, started)
    return Generation.from_root(digest, store.read_root(digest, run=run))


# -- async save ----------------------------------------------------------------


def _save_async(
    store: Store,
    state: Any,
    run: str,
    step: int,
    data_order: dict[str, Any] | None,
    group: Any,
    coordinator: int,
    timeout: float,
    options: SaveOptions,
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
        with background.turn(options.if_busy, agree) as ours:
            if not ours:
                return background.skip(run, step)
            return _start_async(
                store,
                state,
                comm,
                PendingSave(run, step, started=started),
                data_order,
                options,
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
    data_order: dict[str, Any] | None,
    options: SaveOptions,
) -> PendingSave:
    """Prepare and stage this rank's state; its writer thread runs the commit."""
    run, step, started = pending.run, pending.step, pending.started
    background = store.background

    def prepare_here() -> Prepared:
        validate_run_name(run)
        owner = (comm.rank, comm.world_size)
        prepared = prepare(state, step, options.metadata, data_order, store.chunk_size, owner=owner)
        if comm.world_size > 1:  # only what this rank writes is staged: digest the rest now
            prepared.replicas.start(prepared.owned or set())
            prepared.replicas.settle()
        return prepared

    prepared, failure = attempt(prepare_here)
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
                codec=options.codec or store.codec,
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
            ack = commit_shard(store, shard, started)
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

        digest = commit_in_group(store, comm, run, step, prepared, failure, write, started)
        pending.timings["publish"] = time.perf_counter() - clock[0]
        return Generation.from_root(digest, store.read_root(digest, run=run))

    clock = [0.0]  # when this rank's shard was committed: the publish is timed from there
    if failure is not None:
        # The other ranks learn of it from the writer's first message, not by timing out.
        report_failure(background, pending, options.async_options, body)
        raise failure
    return run_async(
        background,
        pending,
        leaves,
        chunk_size=store.chunk_size,
        options=options.async_options,
        body=body,
    )
