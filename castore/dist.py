"""Multi-rank save and restore over torch.distributed (gloo, NCCL, ...).

Save is a two-phase commit (invariants 1, 2): the coordinator proposes the
generation id; every rank commits its chunks and shard manifest and
acknowledges; the coordinator re-reads every shard manifest, checks that the
sharded tensors cover their global shapes exactly once, and only then commits
the root and advances the ref; the outcome is broadcast. Any failure or dead
rank means nothing is published.

Restore (invariants 4, 5): the coordinator resolves the generation once and
broadcasts its root; each rank reads and verifies only the chunks its target
boxes overlap, into staging buffers; all ranks exchange their outcome, and
only if every rank succeeded does any rank copy into its live tensors.

Every collective wait is bounded by ``timeout`` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from castore import errors
from castore._comm import Group
from castore.chunkio import ChunkRequest, WriteStats, read_agree_deliver
from castore.chunkstore.base import Namespace
from castore.commit import (
    COORDINATOR_FAULTS,
    check_coverage,
    commit_objects,
    group_entries,
    make_root,
    publish,
    root_stats,
    write_shard,
)
from castore.dtypes import numpy_dtype
from castore.errors import (
    CastoreError,
    ChunkMissingError,
    CorruptObjectError,
    LayoutMismatchError,
    RankFailedError,
    RankLocalMismatchError,
    TensorNotFoundError,
)
from castore.faults import fault_point
from castore.hashing import Digest, digest_bytes
from castore.layout import Box
from castore.objects import TYPE_SHARD, GenerationRoot, ShardManifest, TensorEntry
from castore.refs import RefValue, validate_run_name
from castore.shard import NotLoaded, Shard
from castore.store import (
    Generation,
    Store,
    _allocate,
    box_transfer,
    encode_metadata,
    framework_versions,
)
from castore.tree import EncodedTree, decode_tree, encode_state, join_path, tensor_names

__all__ = ["LoadReport", "LoadResult", "load", "save"]

DEFAULT_TIMEOUT = 600.0


# -- failures as messages ------------------------------------------------------


def _attempt(action: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return action(), None
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        return None, exc


def _describe(exc: BaseException | None) -> dict[str, str] | None:
    if exc is None:
        return None
    return {"type": type(exc).__name__, "message": str(exc)}


def _raise_failures(messages: list[Any], comm: Group, own: BaseException | None) -> None:
    """Raise on every rank if any rank reported an error (the first, in rank order)."""
    if own is not None:
        raise own
    for rank, message in enumerate(messages):
        if message.get("error"):
            raise _rebuild(message["error"], rank)


def _rebuild(error: dict[str, str], rank: int) -> CastoreError:
    """Another rank's error as the same castore type (RankFailedError otherwise)."""
    cls = getattr(errors, error["type"], None)
    message = f"rank {rank} failed: {error['message']}"
    if isinstance(cls, type) and issubclass(cls, CastoreError):
        return cls.from_remote(message, failed_rank=rank)
    return RankFailedError.from_remote(f"{message} ({error['type']})", failed_rank=rank)


# -- save ----------------------------------------------------------------------


@dataclass
class _Prepared:
    encoded: EncodedTree
    metadata: bytes
    layout: str  # digest of the tensors' names, kinds, dtypes and global shapes
    replicated: list[tuple[str, int]]  # (name, nbytes) of tensors written by one rank
    sharded_bytes: int


def _prepare(state: Any, step: int, metadata: dict[str, Any] | None) -> _Prepared:
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    encoded = encode_state(state)
    layout = sorted(
        (leaf.name, "shard" if leaf.sharded else "replicated", leaf.dtype, list(leaf.shape))
        for leaf in encoded.leaves
    )
    return _Prepared(
        encoded=encoded,
        metadata=encode_metadata(metadata),
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
    group: Any = None,
    coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
) -> Generation:
    """Save every rank's ``state`` as one generation of ``run`` (a collective call).

    Returns the same :class:`~castore.Generation` on every rank, or raises on
    every rank; nothing is published unless every rank's shard is durable and
    the coordinator has checked them all.
    """
    comm = Group(group, coordinator, timeout)
    started = time.perf_counter()
    validate_run_name(run)
    prepared, failure = _attempt(lambda: _prepare(state, step, metadata))
    infos = comm.all_gather(
        {
            "error": _describe(failure),
            "layout": prepared.layout if prepared else None,
            "sharded_bytes": prepared.sharded_bytes if prepared else 0,
        },
        "save: prepare",
    )
    _raise_failures(infos, comm, failure)
    _check_same_layout(infos, comm)
    assert prepared is not None

    proposal = _propose(store, run, comm)
    generation = proposal["generation"]
    owners = _assign_replicated(prepared.replicated, [i["sharded_bytes"] for i in infos])
    mine = {leaf.name for leaf in prepared.encoded.leaves if leaf.sharded}
    mine |= {name for name, rank in owners.items() if rank == comm.rank}

    def write() -> dict[str, Any]:
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

    ack, failure = _attempt(write)
    acks = comm.all_gather({"error": _describe(failure), **(ack or {})}, "save: write shards")
    _raise_failures(acks, comm, failure)

    outcome: dict[str, Any] = {}
    if comm.is_coordinator:
        published, failure = _attempt(
            lambda: _validate_and_publish(store, prepared, acks, proposal, run, step, comm, started)
        )
        outcome = {"error": _describe(failure), "root": published}
    outcome = comm.broadcast(outcome, "save: publish")
    if outcome.get("error"):
        if comm.is_coordinator and failure is not None:
            raise failure
        raise _rebuild(outcome["error"], comm.coordinator)
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
        parent, failure = _attempt(lambda: store.refs.read(run))
        message = {
            "error": _describe(failure),
            "generation": (parent.generation + 1) if parent else 1,
            "parent": None if parent is None else [parent.generation, parent.root.raw, parent.time],
        }
    message = comm.broadcast(message, "save: propose")
    if message.get("error"):
        if failure is not None:
            raise failure
        raise _rebuild(message["error"], comm.coordinator)
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
    where = {"run": run, "generation": generation}
    shards: list[ShardManifest] = []
    for rank, ack in enumerate(acks):
        shard: ShardManifest = store.read_object(
            ack["shard"], expect=TYPE_SHARD, rank=rank, **where
        )
        if (shard.run, shard.generation, shard.rank) != (run, generation, rank):
            raise CorruptObjectError(
                f"rank {rank} acknowledged a shard of {shard.run}@{shard.generation} "
                f"rank {shard.rank}",
                **where,
            )
        shards.append(shard)
    entries = group_entries(shards, where)
    for boxes in entries.values():
        check_coverage(boxes, where)
    _check_names(prepared.encoded.skeleton, entries, where)
    _check_chunks_present(store, shards, where)
    stats = WriteStats()
    for ack in acks:
        stats += WriteStats(
            ack["logical_bytes"], ack["new_bytes"], ack["new_chunks"], ack["reused_chunks"]
        )
    tensors = len(entries) + sum(len(s.local_tensors) for s in shards)
    parent = proposal["parent"]
    parent_ref = None if parent is None else RefValue(run, parent[0], Digest(parent[1]), parent[2])
    root = make_root(
        run=run,
        generation=generation,
        step=step,
        parent=parent_ref,
        world_size=comm.world_size,
        shards=[ack["shard"] for ack in acks],
        state=prepared.encoded.skeleton,
        metadata=prepared.metadata,
        stats=root_stats(stats, time.perf_counter() - started, tensors),
        frameworks=framework_versions(),
    )
    digest = publish(store, parent=parent_ref, root=root, faults=COORDINATOR_FAULTS)
    return digest.raw


def _check_names(
    skeleton: bytes, entries: dict[str, list[TensorEntry]], where: dict[str, Any]
) -> None:
    referenced = {name for name, _ in tensor_names(skeleton)}
    missing = sorted(referenced - entries.keys())
    extra = sorted(entries.keys() - referenced)
    if missing or extra:
        raise LayoutMismatchError(
            f"saved tensors do not match the state: missing {missing[:5]}, unexpected {extra[:5]}",
            **where,
        )


def _check_chunks_present(store: Store, shards: list[ShardManifest], where: dict[str, Any]) -> None:
    digests = list({c for s in shards for e in s.tensors + s.local_tensors for c in e.chunks})
    present = store.backend.has_many(Namespace.CHUNKS, digests)
    for digest, found in zip(digests, present, strict=True):
        if not found:
            raise ChunkMissingError(
                f"a shard names chunk {digest.hex()[:16]} that is not in the store", **where
            )


# -- load ----------------------------------------------------------------------


@dataclass
class LoadReport:
    """What one rank's restore read, and how long each phase took (seconds)."""

    generation: Generation
    bytes_read: int = 0
    bytes_needed: int = 0
    chunks_read: int = 0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class LoadResult:
    """The restored state tree of this rank and the report of how it was read."""

    state: Any
    report: LoadReport


@dataclass
class _Target:
    name: str
    live: Any  # the caller's Shard or tensor
    tensor: Any  # the array or tensor to fill
    box: Box
    itemsize: int
    flat: Any = None  # the bytes chunks are delivered into (the tensor's own, or staging)
    staging: Any = None  # set when the tensor's memory cannot take bytes directly


RankLocalPolicy = str | Callable[[int], int]


def load(
    store: Store,
    run: str,
    targets: Any,
    generation: int | str = "latest",
    *,
    group: Any = None,
    coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    rank_local: RankLocalPolicy = "same",
    framework: str = "auto",
) -> LoadResult:
    """Restore ``run@generation`` into this rank's ``targets`` (a collective call).

    Only the chunks that overlap each target's box are read; every chunk is
    verified; no target changes unless every rank read and verified all it
    needs. ``rank_local`` says how RankLocal values map onto this group:
    ``"same"`` (same world size, same rank), ``"drop"``, or a callable giving
    the saved rank whose value this rank takes.
    """
    comm = Group(group, coordinator, timeout)
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    validate_run_name(run)
    digest = _agree_on_root(store, run, generation, comm)
    read_before = (store.read_counters.chunks, store.read_counters.bytes)

    def plan_everything() -> tuple[Any, ...]:
        nonlocal clock
        root = store.read_root(digest, run=run)
        shards = store.read_shards(root)
        timings["metadata"] = time.perf_counter() - clock
        clock = time.perf_counter()
        where = {"run": run, "generation": root.generation, "rank": comm.rank}
        entries = store.tensor_entries(root, shards)
        wanted = _plan_targets(targets, entries, where)
        requests = [r for t in wanted for r in _chunk_requests(t, entries[t.name])]
        timings["planning"] = time.perf_counter() - clock
        clock = time.perf_counter()
        per_rank, per_rank_bytes = _read_rank_local(
            store, root, shards, comm, rank_local, framework, where
        )
        return root, entries, wanted, requests, per_rank, per_rank_bytes, where

    agreed = False

    def agree(error: BaseException | None) -> None:
        # The all-ranks outcome (invariant 4): raises everywhere unless all verified.
        nonlocal agreed, clock
        agreed = True
        outcomes = comm.all_gather({"error": _describe(error)}, "load: agree")
        _raise_failures(outcomes, comm, error)
        timings["read_verify"] = time.perf_counter() - clock
        clock = time.perf_counter()  # what follows is assembly: copying into the targets

    planned, failure = _attempt(plan_everything)
    if failure is not None:
        agree(failure)
    root, entries, wanted, requests, per_rank, per_rank_bytes, where = planned
    try:
        # Chunks are verified where they lie; targets are written only after `agree`.
        read_agree_deliver(store.backend, requests, store.read_counters, where, agree)
    except Exception as exc:
        if not agreed:
            agree(exc)  # tell the other ranks before raising here
        raise
    for target in wanted:
        _assign(target)
    state = _result_tree(root, entries, wanted, per_rank)
    timings["assembly"] = time.perf_counter() - clock
    report = LoadReport(
        generation=Generation.from_root(digest, root),
        bytes_read=store.read_counters.bytes - read_before[1],
        bytes_needed=sum(t.box.numel * t.itemsize for t in wanted) + per_rank_bytes,
        chunks_read=store.read_counters.chunks - read_before[0],
        timings=timings,
    )
    return LoadResult(state, report)


def _agree_on_root(store: Store, run: str, generation: int | str, comm: Group) -> Digest:
    """Invariant 5: the coordinator resolves the generation once, for everyone."""
    message: dict[str, Any] = {}
    failure: BaseException | None = None
    if comm.is_coordinator:
        found, failure = _attempt(lambda: store.resolve_root(run, generation)[0].raw)
        message = {"error": _describe(failure), "root": found}
    message = comm.broadcast(message, "load: resolve")
    if message.get("error"):
        if failure is not None:
            raise failure
        raise _rebuild(message["error"], comm.coordinator)
    return Digest(message["root"])


def _target_leaves(node: Any, path: str, found: list[tuple[str, Any]]) -> None:
    """Every tensor or Shard in a target tree, named by key path like a saved state."""
    if isinstance(node, Shard) or _is_array(node):
        found.append((path or ".", node))
    elif isinstance(node, dict):
        for key, value in node.items():
            _target_leaves(value, join_path(path, key), found)
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            _target_leaves(value, join_path(path, index), found)


def _is_array(value: Any) -> bool:
    import torch

    return isinstance(value, (np.ndarray, torch.Tensor))


def _plan_targets(
    targets: Any, entries: dict[str, list[TensorEntry]], where: dict[str, Any]
) -> list[_Target]:
    from castore.dtypes import name_of_numpy_dtype, name_of_torch_dtype

    found: list[tuple[str, Any]] = []
    _target_leaves(targets, "", found)
    planned: list[_Target] = []
    for name, live in found:
        boxes = entries.get(name)
        if not boxes:
            raise TensorNotFoundError(
                f"target {name!r} is not a tensor of this generation", **where
            )
        saved = boxes[0]
        check_coverage(boxes, where)
        tensor = live.local if isinstance(live, Shard) else live
        dtype = (
            name_of_numpy_dtype(tensor.dtype, name)
            if isinstance(tensor, np.ndarray)
            else name_of_torch_dtype(tensor.dtype, name)
        )
        global_shape = live.global_shape if isinstance(live, Shard) else tuple(tensor.shape)
        if dtype != saved.dtype or tuple(global_shape) != saved.shape:
            raise LayoutMismatchError(
                f"target {name!r} is {dtype}{list(global_shape)}, the saved tensor is "
                f"{saved.dtype}{list(saved.shape)}",
                tensor=name,
                **where,
            )
        box = (
            Box(live.offsets, live.local_shape)
            if isinstance(live, Shard)
            else Box.whole(saved.shape)
        )
        target = _Target(name, live, tensor, box, numpy_dtype(saved.dtype).itemsize)
        target.flat = _writable_bytes(tensor)
        if target.flat is None:
            target.staging, target.flat = _allocate(saved.dtype, box.shape, "numpy")
        planned.append(target)
    return planned


def _writable_bytes(tensor: Any) -> np.ndarray | None:
    """A flat uint8 view of a C-contiguous host tensor's own memory, else None."""
    if isinstance(tensor, np.ndarray):
        if tensor.flags.c_contiguous and tensor.flags.writeable:
            return tensor.reshape(-1).view(np.uint8)
        return None
    import torch

    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach().reshape(-1).view(torch.uint8).numpy()
    return None


def _chunk_requests(target: _Target, boxes: list[TensorEntry]) -> list[ChunkRequest]:
    requests: list[ChunkRequest] = []
    for entry in boxes:
        region = target.box.intersect(Box(entry.offsets, entry.local_shape))
        if region is None or not region.numel:
            continue
        indices, deliver = box_transfer(entry, region, target.box, target.flat)
        requests += [ChunkRequest(entry, int(i), deliver) for i in indices]
    return requests


def _read_rank_local(
    store: Store,
    root: GenerationRoot,
    shards: list[ShardManifest],
    comm: Group,
    policy: RankLocalPolicy,
    framework: str,
    where: dict[str, Any],
) -> tuple[dict[str, Any], int]:
    """This rank's RankLocal values, and the tensor bytes they needed."""
    paths: list[str] = []
    decode_tree(root.state, lambda name, fw: None, lambda path: paths.append(path))
    if not paths or policy == "drop":
        return dict.fromkeys(paths), 0
    if policy == "same":
        if root.world_size != comm.world_size:
            raise RankLocalMismatchError(
                f"per-rank state was saved by {root.world_size} ranks and is restored onto "
                f"{comm.world_size}: pass rank_local='drop' or a mapping new_rank -> saved rank",
                **where,
            )
        source = comm.rank
    elif callable(policy):
        source = int(policy(comm.rank))
    else:
        raise ValueError(f"rank_local must be 'same', 'drop' or a callable, got {policy!r}")
    if not 0 <= source < len(shards) or shards[source].rank != source:
        raise RankLocalMismatchError(
            f"rank {comm.rank} maps to saved rank {source}, which does not exist", **where
        )
    values = {path: store.load_rank_local(shards[source], path, framework, where) for path in paths}
    return values, sum(entry.nbytes for entry in shards[source].local_tensors)


def _assign(target: _Target) -> None:
    """Copy a verified staging array into the caller's live tensor (if one was needed)."""
    if target.staging is None:
        return  # the chunks were delivered into the tensor's own memory
    if isinstance(target.tensor, np.ndarray):
        np.copyto(target.tensor, target.staging)
        return
    import torch

    raw = torch.from_numpy(np.ascontiguousarray(target.staging).reshape(-1).view(np.uint8))
    source = raw.view(target.tensor.dtype).reshape(target.tensor.shape)
    with torch.no_grad():
        target.tensor.copy_(source)  # to any device, into any strides


def _result_tree(
    root: GenerationRoot,
    entries: dict[str, list[TensorEntry]],
    wanted: list[_Target],
    per_rank: dict[str, Any],
) -> Any:
    by_name = {target.name: target.live for target in wanted}

    def tensor(name: str, _framework: str) -> Any:
        if name in by_name:
            return by_name[name]
        boxes = entries.get(name)
        if not boxes:
            raise CorruptObjectError(f"state refers to tensor {name!r}, no shard holds it")
        return NotLoaded(name, boxes[0].dtype, boxes[0].shape)

    return decode_tree(root.state, tensor, lambda path: per_rank.get(path))
