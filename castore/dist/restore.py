"""Multi-rank restore (``castore.dist.load``): verify everything, agree, then write.

Invariants 4 and 5: the coordinator resolves the generation once and
broadcasts its root; each rank plans which chunks its target boxes overlap,
fetches and verifies them where they lie in the store's memory map, and the
ranks exchange their outcome inside that read transaction; only if every rank
succeeded are the verified bytes copied into the live tensors.

One idea in about 600 lines: the plan, the agreement and the writes of one
restore share its targets and options; the node-spanning path (tiers) is the
same restore reading through other sources.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from castore import errors
from castore.core import fencing, reading
from castore.core.boxtable import BoxTable
from castore.core.chunkread import ReadCounters, read_agree_deliver
from castore.core.history import Generation, Skipped, fall_back
from castore.core.reading import (
    check_framework,
    numpy_as_torch,
)
from castore.dist import coopread, planning
from castore.dist.comm import DEFAULT_TIMEOUT, Group, attempt, describe, raise_failures, rebuild
from castore.errors import (
    CorruptObjectError,
    IntegrityError,
    NoValidGenerationError,
    RankLocalMismatchError,
)
from castore.format.dtypes import numpy_dtype
from castore.format.hashing import Digest
from castore.format.objects import GenerationRoot, ShardManifest, TensorEntry
from castore.format.shard import NotLoaded
from castore.format.tree import decode_tree
from castore.repo.records import validate_run_name
from castore.store import Store


@dataclass
class LoadReport:
    """What one rank's restore read, and how long each phase took (seconds)."""

    generation: Generation
    bytes_read: int = 0
    bytes_needed: int = 0
    chunks_read: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    skipped: list[Skipped] = field(default_factory=list)  # generations a fallback passed over
    # Tiered stores on several nodes: the bytes each source gave ("fast", "peer", "durable").
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    # Targets that are no saved box (another layout: read by byte range from the boxes
    # they overlap); 0 when each target is a box the save wrote (the same layout).
    resharded: int = 0
    # Shard manifests this rank read: 2 at most onto the saved layout (its own and rank
    # 0's), every rank's when it reshards or loads what no target names.
    manifests_read: int = 0
    # Cooperative reads (castore.dist.coopread): the chunks and bytes other ranks read
    # from the store and sent this one (bytes_read and chunks_read count the store's alone).
    chunks_from_peers: int = 0
    bytes_from_peers: int = 0


@dataclass
class LoadResult:
    """The restored state tree of this rank and the report of how it was read."""

    state: Any
    report: LoadReport


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
    load_rest: bool | Callable[[NotLoaded], Any] = False,
    fallback: str | None = None,
    cooperative: bool | str = "auto",
) -> LoadResult:
    """Restore ``run@generation`` into this rank's ``targets`` (a collective call).

    Only the chunks that overlap each target's box are read; every chunk is
    verified; no target changes unless every rank read and verified all it
    needs. ``rank_local`` says how RankLocal values map onto this group:
    ``"same"`` (same world size, same rank), ``"drop"``, or a callable giving
    the saved rank whose value this rank takes. Saved tensors that no target
    names come back as :class:`~castore.NotLoaded`, or, with ``load_rest``,
    read whole into new arrays of ``framework`` (``"auto"``: as saved).
    ``load_rest`` may instead be a callable: given each such tensor's
    :class:`~castore.NotLoaded` (key path, dtype, global shape), it returns a
    target for it (a tensor, DTensor or Shard of that dtype and shape, read
    like any target: only its box), or None to read it whole as above.

    ``fallback="previous"``: when the ranks agree that the generation is
    damaged (every failure an integrity error), try the one before it, and so
    on; the report lists each generation skipped and why. Nothing live
    changes for a skipped generation.

    ``cooperative``: a chunk several ranks need is read from the store by one
    of them and sent to the others, each copy verified where it lands
    (castore.dist.coopread). ``"auto"``: on for stores whose reads are remote
    (S3, a shared directory), off for a local store; ``True``: once per job;
    ``"node"``: once per node (host); ``False``: every rank reads what it
    needs. Every rank must pass the same.
    """
    comm = Group(group, coordinator, timeout)
    validate_run_name(run)
    check_framework(framework)
    coopread.check_setting(cooperative)
    if fallback not in (None, "previous"):
        raise ValueError(f"fallback must be None or 'previous', got {fallback!r}")
    # What the ref names as the load begins; the coordinator's alone, as only it proposes
    # saves (its next save tells another writer's generations from these: fencing).
    newest = fencing.newest_published(store.refs, run) if comm.is_coordinator else None
    options = _Options(targets, rank_local, framework, load_rest, newest, cooperative)
    # A tiered store whose ranks span several nodes (castore.tiers.nodes): None otherwise.
    session = store.node_session(comm, run, restore=True)
    if session is not None:
        return _load_from_nodes(store, run, generation, comm, options, fallback, session)
    # One node (or no tiers): the discovery above was this load's one "tiers: nodes"
    # round; agree_on_root and agree_on_candidates would run it again.
    if fallback is None:
        digest = _resolve_root(store, run, generation, comm)
        return _load_root(store, run, digest, None, comm, options, [], _Outcome())
    candidates, skipped = _resolve_candidates(store, run, generation, comm)
    outcome = _Outcome()  # the attempt's: what the ranks agreed its failure was

    def load_one(gen_id: int, digest: Digest) -> LoadResult:
        outcome.every_failure_is_integrity = False
        return _load_root(store, run, digest, gen_id, comm, options, skipped, outcome)

    return fall_back(
        run, candidates, load_one, lambda _: outcome.every_failure_is_integrity, skipped,
        scope=" on every rank",
    )  # fmt: skip


def _load_from_nodes(
    store: Store,
    run: str,
    generation: int | str,
    comm: Group,
    options: _Options,
    fallback: str | None,
    session: Any,
) -> LoadResult:
    """A restore from the nodes' fast tiers and the durable tier (castore.tiers.nodes).

    The newest generation complete somewhere; a generation that fails only
    for damage is tried once more with this rank's damaged chunks fetched
    from elsewhere, then (``fallback="previous"``) the one before it.
    """
    candidates = _node_candidates(
        store, run, generation, comm, session, newest_only=fallback is None
    )
    skipped: list[Skipped] = []
    outcome = _Outcome()  # the last attempt's: what the ranks agreed its failure was

    def load_one(gen_id: int, digest: Digest) -> LoadResult:
        for recheck in (False, True):
            outcome.every_failure_is_integrity = False
            try:
                session.seed(run, digest)
                return _load_root(
                    store, run, digest, gen_id, comm, options, skipped, outcome,
                    session=session, recheck=recheck,
                )  # fmt: skip
            except Exception:
                if recheck or not outcome.every_failure_is_integrity:
                    raise
                # every rank agreed: all try again, damaged copies fetched anew
        raise AssertionError("unreachable: the second try returns or raises")

    if fallback is None:
        return load_one(*candidates[0])
    return fall_back(
        run, candidates, load_one, lambda _: outcome.every_failure_is_integrity, skipped,
        scope=" on every rank",
    )  # fmt: skip


@dataclass
class _Options:
    targets: Any
    rank_local: RankLocalPolicy
    framework: str
    load_rest: bool | Callable[[NotLoaded], Any]
    newest: int | None  # the generation id the run's ref named as the load began
    cooperative: bool | str = "auto"


@dataclass
class _Outcome:
    """Whether the ranks agreed that every failure was damage (the same on every rank)."""

    every_failure_is_integrity: bool = False


def _load_root(
    store: Store,
    run: str,
    digest: Digest,
    expected_id: int | None,
    comm: Group,
    options: _Options,
    skipped: list[Skipped],
    outcome: _Outcome,
    *,
    session: Any = None,
    recheck: bool = False,
) -> LoadResult:
    targets, rank_local = options.targets, options.rank_local
    framework, load_rest = options.framework, options.load_rest
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    read_before = (store.read_counters.chunks, store.read_counters.bytes)
    served_before = store.served_by_tier()  # a tiered store on one node: per tier

    opened: dict[str, reading.ShardList] = {}

    def plan_everything() -> tuple[Any, ...]:
        nonlocal clock
        root = store.read_root(digest, run=run)
        if expected_id is not None and root.generation != expected_id:
            raise CorruptObjectError(
                f"the log names generation {expected_id}, its root says {root.generation}",
                run=run,
            )
        shards = opened["shards"] = reading.ShardList(store.backend, root)
        found: list[tuple[str, Any]] = []
        planning.target_leaves(targets, "", found)
        direct = planning.direct_shards(shards, comm.rank)
        for index in direct or range(len(shards)):
            shards[index]  # read and verified now: the metadata phase
        timings["metadata"] = time.perf_counter() - clock
        clock = time.perf_counter()
        where = {"run": run, "generation": root.generation, "rank": comm.rank}
        rest = (framework, load_rest) if load_rest else None
        entries, wanted = planning.plan_restore(
            shards, root, found, where, direct=direct or None, rest=rest
        )
        requests = [r for t in wanted for r in planning.chunk_requests(t, entries)]
        timings["planning"] = time.perf_counter() - clock
        clock = time.perf_counter()
        if session is not None:  # read after the fetch from the other nodes
            return root, entries, wanted, requests, shards, where
        per_rank, per_rank_bytes = _read_rank_local(
            store, root, shards, comm, rank_local, framework, where
        )
        return root, entries, wanted, requests, per_rank, per_rank_bytes, where

    agreed = False

    def agree(error: BaseException | None) -> None:
        # The all-ranks outcome (invariant 4): raises everywhere unless all verified.
        nonlocal agreed, clock
        agreed = True
        outcomes = comm.all_gather({"error": describe(error)}, "load: agree")
        outcome.every_failure_is_integrity = every_failure_is_integrity(outcomes)
        raise_failures(outcomes, comm, error)
        timings["read_verify"] = time.perf_counter() - clock
        clock = time.perf_counter()  # what follows is assembly: copying into the targets

    planned, failure = attempt(plan_everything)
    backend = store.backend
    if session is not None:
        # Every rank takes part in the fetch, whatever its planning gave.
        keys = []
        if failure is None:
            root, entries, wanted, requests, shards, where = planned
            keys = [r.entry.chunks[r.index] for r in requests]
            keys += _rank_local_chunks(shards, root, comm, rank_local)
        backend, fetch_failure = attempt(lambda: session.fetch(keys, recheck=recheck))
        failure = failure or fetch_failure
        timings["fetch"] = time.perf_counter() - clock  # what the nodes sent each other
        clock = time.perf_counter()
        if failure is None:

            def read_local() -> tuple[Any, ...]:
                per_rank, per_rank_bytes = _read_rank_local(
                    store, root, shards, comm, rank_local, framework, where, backend
                )
                return root, entries, wanted, requests, per_rank, per_rank_bytes, where

            planned, failure = attempt(read_local)
    shared = None
    mode = None if session is not None else coopread.cooperation(options.cooperative, backend, comm)
    if mode is not None:
        # Every rank takes part in the sharing, whatever its planning gave.
        asked = planned[3] if failure is None else []
        shared, share_failure = coopread.share_chunks(
            backend, asked, comm, store.read_counters, mode
        )
        backend, failure = shared, failure or share_failure
        timings["cooperate"] = time.perf_counter() - clock
        clock = time.perf_counter()
    if failure is not None:
        agree(failure)
    root, entries, wanted, requests, per_rank, per_rank_bytes, where = planned
    # Through shared reads, what the store served is counted as it passes (not what peers sent).
    counters = store.read_counters if shared is None else ReadCounters()
    try:
        # Chunks are verified where they lie; targets are written only after `agree`.
        read_agree_deliver(backend, requests, counters, where, agree)
    except Exception as exc:
        if not agreed:
            agree(exc)  # tell the other ranks before raising here
        raise
    for target in wanted:
        _assign(target)
    state = _result_tree(root, entries, wanted, per_rank)
    timings["assembly"] = time.perf_counter() - clock
    fencing.record_loaded(  # a resume point (every rank)
        store.refs, run, digest, root.step, generation=root.generation, newest=options.newest
    )
    report = LoadReport(
        generation=Generation.from_root(digest, root),
        bytes_read=store.read_counters.bytes - read_before[1],
        bytes_needed=sum(t.box.numel * numpy_dtype(t.dtype).itemsize for t in wanted)
        + per_rank_bytes,
        chunks_read=store.read_counters.chunks - read_before[0],
        timings=timings,
        skipped=list(skipped),
        bytes_by_source=(
            session.sources() if session is not None else _served(store, served_before)
        ),
        resharded=planning.resharded(wanted, entries),
        manifests_read=opened["shards"].read,
        chunks_from_peers=0 if shared is None else shared.received_chunks,
        bytes_from_peers=0 if shared is None else shared.received_bytes,
    )
    return LoadResult(state, report)


def _served(store: Store, before: dict[str, int]) -> dict[str, int]:
    """The chunk bytes each tier of a tiered store on one node served since ``before``
    ("fast", "durable"); empty for any other store."""
    return {
        source: count - before.get(source, 0)
        for source, count in store.served_by_tier().items()
        if count > before.get(source, 0)
    }


def every_failure_is_integrity(outcomes: list[dict[str, Any]]) -> bool:
    """Whether some rank failed and every failure the ranks exchanged (``{"error": ...}``
    messages, castore.dist.comm.describe) was damage (an IntegrityError)."""
    failed = [o["error"]["type"] for o in outcomes if o.get("error")]
    return bool(failed) and all(map(_is_integrity, failed))


def _is_integrity(type_name: str) -> bool:
    cls = getattr(errors, type_name, None)
    return isinstance(cls, type) and issubclass(cls, IntegrityError)


def agree_on_candidates(
    store: Store, run: str, generation: int | str, comm: Group
) -> tuple[list[tuple[int, Digest]], list[Skipped]]:
    """The coordinator's fallback order, newest first, and a damaged ref, for every rank.

    Through a tiered store whose ranks span several nodes: the generations complete
    in the live nodes' fast tiers or in the durable tier (call :func:`seed_root`
    before reading each).
    """
    session = store.node_session(comm, run, restore=True)
    if session is not None:
        return _node_candidates(store, run, generation, comm, session), []
    return _resolve_candidates(store, run, generation, comm)


def _resolve_candidates(
    store: Store, run: str, generation: int | str, comm: Group
) -> tuple[list[tuple[int, Digest]], list[Skipped]]:
    """:func:`agree_on_candidates` on one node: the coordinator's order, broadcast."""
    message: dict[str, Any] = {}
    failure: BaseException | None = None
    if comm.is_coordinator:

        def candidates() -> dict[str, Any]:
            below = None
            if generation != "latest":
                below = store.resolve(run, generation).id
            bad_ref = store.ref_problem(run) if generation == "latest" else []
            return {
                "candidates": [[g, d.raw] for g, d in store.candidates(run, below)],
                "ref": [[k.error, k.reason] for k in bad_ref],
            }

        found, failure = attempt(candidates)
        message = {"error": describe(failure), **(found or {})}
    message = comm.broadcast(message, "load: candidates")
    if message.get("error"):
        if failure is not None:
            raise failure
        raise rebuild(message["error"], comm.coordinator)
    skipped = [Skipped(0, "ref", error, reason) for error, reason in message["ref"]]
    return [(int(g), Digest(d)) for g, d in message["candidates"]], skipped


def _node_candidates(
    store: Store,
    run: str,
    generation: int | str,
    comm: Group,
    session: Any,
    *,
    newest_only: bool = False,
) -> list[tuple[int, Digest]]:
    """What a restore through tiers on several nodes may read, newest first: the
    generations complete in the live nodes' fast tiers or in the durable tier
    (``generation`` other than "latest": that one, if it is). ``newest_only``: only the
    first is read (castore.tiers.nodes.NodeSession.agree_candidates)."""
    below = None
    if generation != "latest":
        found, failure = None, None
        if comm.is_coordinator:
            found, failure = attempt(lambda: store.resolve(run, generation).id)
        outcomes = comm.all_gather({"error": describe(failure), "id": found}, "load: resolve")
        raise_failures(outcomes, comm, failure)
        below = outcomes[comm.coordinator]["id"]
    candidates = session.agree_candidates(run, below, newest_only=newest_only)
    if generation != "latest":
        candidates = [(g, d) for g, d in candidates if g == below][:1]
    if not candidates:
        raise NoValidGenerationError(
            f"no generation of run {run!r} is complete in the fast tiers of the live nodes "
            "or in the durable tier",
            run=run,
        )
    return candidates


def root_on_nodes(
    store: Store, run: str, generation: int | str, comm: Group, session: Any
) -> Digest:
    """Through a tiered store whose ranks span several nodes (``session``: its
    castore.tiers.nodes.NodeSession): the root :func:`load` would read, "latest" the
    newest generation complete in the live nodes' fast tiers or in the durable tier;
    every node that lacks its root and manifests is sent them (a collective call)."""
    digest = _node_candidates(store, run, generation, comm, session, newest_only=True)[0][1]
    session.seed(run, digest)
    return digest


def seed_root(store: Store, run: str, digest: Digest, comm: Group) -> None:
    """Through a tiered store whose ranks span several nodes, give every node that lacks
    them the root and manifests of ``digest`` (a collective call there); else nothing."""
    session = store.node_session(comm, run)
    if session is not None:
        session.seed(run, digest)


def agree_on_root(store: Store, run: str, generation: int | str, comm: Group) -> Digest:
    """Invariant 5: the coordinator resolves the generation once, for everyone.

    Through a tiered store whose ranks span several nodes, "latest" is the newest
    generation complete in the live nodes' fast tiers or in the durable tier (as
    :func:`load` chooses), and every node that lacks its root and manifests is sent
    them, so that every rank can read them (a collective call either way).
    """
    session = store.node_session(comm, run, restore=True)
    if session is not None:
        return root_on_nodes(store, run, generation, comm, session)
    return _resolve_root(store, run, generation, comm)


def _resolve_root(store: Store, run: str, generation: int | str, comm: Group) -> Digest:
    """:func:`agree_on_root` on one node: the coordinator's root, broadcast."""
    message: dict[str, Any] = {}
    failure: BaseException | None = None
    if comm.is_coordinator:
        found, failure = attempt(lambda: store.resolve_root(run, generation)[0].raw)
        message = {"error": describe(failure), "root": found}
    message = comm.broadcast(message, "load: resolve")
    if message.get("error"):
        if failure is not None:
            raise failure
        raise rebuild(message["error"], comm.coordinator)
    return Digest(message["root"])


def _rank_local_chunks(
    shards: Sequence[ShardManifest], root: GenerationRoot, comm: Group, policy: RankLocalPolicy
) -> list[bytes]:
    """The chunks of the RankLocal values this rank will read (none where it reads none)."""
    paths: list[str] = []
    decode_tree(root.state, lambda name, fw: None, lambda path: paths.append(path))
    if not paths or policy == "drop":
        return []
    if policy == "same":
        source = comm.rank
    elif callable(policy):
        source = int(policy(comm.rank))
    else:
        return []
    if not 0 <= source < len(shards):
        return []
    return [chunk for entry in shards[source].local_tensors for chunk in entry.chunks]


def _read_rank_local(
    store: Store,
    root: GenerationRoot,
    shards: Sequence[ShardManifest],
    comm: Group,
    policy: RankLocalPolicy,
    framework: str,
    where: dict[str, Any],
    backend: Any = None,
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
    if backend is not None:
        values = {
            path: reading.load_rank_local(
                backend, store.read_counters, shards[source], path, framework, where
            )
            for path in paths
        }
    else:
        values = {
            path: store.load_rank_local(shards[source], path, framework, where) for path in paths
        }
    return values, sum(entry.nbytes for entry in shards[source].local_tensors)


def _assign(target: planning.Target) -> None:
    """Copy a verified staging array into the caller's live tensor (if one was needed)."""
    if target.staging is None:
        return  # the chunks were delivered into the tensor's own memory
    if isinstance(target.tensor, np.ndarray):
        np.copyto(target.tensor, target.staging)
        return
    import torch

    source = numpy_as_torch(target.staging, target.dtype)
    with torch.no_grad():
        target.tensor.copy_(source)  # to any device, into any strides


def _result_tree(
    root: GenerationRoot,
    entries: Mapping[str, list[TensorEntry]],
    wanted: list[planning.Target],
    per_rank: dict[str, Any],
) -> Any:
    by_name = {target.name: target.live for target in wanted}

    def tensor(name: str, _framework: str) -> Any:
        if name in by_name:
            return by_name[name]
        if name not in entries:
            raise CorruptObjectError(f"state refers to tensor {name!r}, no shard holds it")
        saved = entries.first(name) if isinstance(entries, BoxTable) else entries[name][0]
        return NotLoaded(name, saved.dtype, saved.shape)

    return decode_tree(root.state, tensor, lambda path: per_rank.get(path))
