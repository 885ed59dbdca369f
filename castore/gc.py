"""Retention, garbage collection, storage accounting and compaction (invariant 6).

**Retention** is decided per run by a :class:`RetentionPolicy`: the newest
``keep_last`` generations, every tagged generation, and optionally the first
generation of every ``every_steps`` steps and the newest of every
``every_seconds`` interval. A generation is kept when any rule keeps it; the
newest generation of a run is always kept.

**Collection** is mark and sweep over the whole store. Marking reads and
verifies every retained root of every run and its shard manifests; if any of
them cannot be read or decoded, nothing is deleted. Every object and chunk not
marked is garbage: the dropped generations' roots, shards and the chunks only
they referenced, and what failed saves left behind. A dropped generation is
first logged as collected in its run's reflog (so listings hide it even if the
sweep is cut short), then the sweep deletes in batches.

**Concurrency.** A save holds the store lock shared from its first dedup
check until its ref advance; collection holds it exclusively from marking to
the end of the sweep. So a save that found chunk X present and skipped it
cannot overlap a sweep that deletes X: either the save published first (X is
then marked) or the sweep finished first (X is then absent and the save writes
it). A collection that cannot take the lock in time fails with
``StoreLockedError`` ("store busy") and deletes nothing. On a store laid out
as blobs the lock is a lease (castore.repo.leases) that a collection stalled
past ``store_lease`` loses; it checks the lease before it logs what it drops,
before each delete batch and before it reclaims pack space, and stops with
``LockLostError`` once it is not safe (what it deleted before was garbage
when it marked, and a save that broke its lease rewrote what it needs).
Readers take no lock: a load of a retained generation is never affected; a
load of a generation being dropped may fail with a missing object, never with
wrong bytes.

A collection killed at any point leaves every retained generation intact: only
unmarked objects are ever deleted, and a later collection finishes the sweep.

About 670 lines, and more than one idea, because retention, the collection that
applies it, the tags that exempt generations from it, the usage it reports and
compaction are the one documented ``castore.gc`` API: moved out, they would leave
re-exports here.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from castore.chunkstore.base import Namespace
from castore.chunkstore.lmdb.compact import compact_lmdb_store
from castore.core.history import Generation, unknown_run
from castore.core.holdings import forget_elsewhere
from castore.errors import (
    GcAbortedError,
    GenerationNotFoundError,
    IntegrityError,
    StoreNotFoundError,
)
from castore.format.hashing import Digest
from castore.format.objects import TYPE_SHARD, GenerationRoot, ShardManifest
from castore.opening.directory import MARKER, local_lmdb_store, read_marker
from castore.repo.records import (
    DEFAULT_LOCK_TIMEOUT,
    RefValue,
    validate_run_name,
    validate_tag_name,
)
from castore.store import Store
from castore.support.faults import fault_point
from castore.support.progress import Bar, Phases, format_size, progress_bar

DELETE_BATCH = 1024  # keys per delete transaction
# A pack less than this fraction live is rewritten by a collection; compact rewrites all.
RECLAIM_MIN_LIVE = 0.5
# Packs smaller than this are merged into one by each collection: a save writes
# one pack, so frequent small saves would otherwise leave one file per save.
MERGE_PACKS_BELOW = 4 << 20
GC_FAULTS = ("gc.before_sweep", "gc.mid_sweep", "gc.mid_chunks", "gc.reclaim_rewritten")


# -- retention ------------------------------------------------------------------


@dataclass(frozen=True)
class RetentionPolicy:
    """Which generations of a run to keep. Rules compose: any rule keeps."""

    keep_last: int = 3
    every_steps: int | None = None
    every_seconds: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(
                f"keep_last must be at least 1 (the newest generation is always kept), "
                f"got {self.keep_last!r}"
            )
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be positive, got {self.every_steps!r}")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise ValueError(f"every_seconds must be positive, got {self.every_seconds!r}")

    def decide(self, generations: list[Generation], tags: dict[str, int]) -> dict[int, list[str]]:
        """Generation id -> the rules that keep it (empty list: dropped)."""
        reasons: dict[int, list[str]] = {g.id: [] for g in generations}
        newest_first = sorted(generations, key=lambda g: -g.id)
        for g in newest_first[: self.keep_last]:
            reasons[g.id].append(f"last {self.keep_last}")
        for name, gen_id in sorted(tags.items()):
            if gen_id in reasons:
                reasons[gen_id].append(f"tag {name}")
        if self.every_steps:
            first_of: dict[int, Generation] = {}
            for g in sorted(generations, key=lambda g: (g.step, g.id)):
                first_of.setdefault(g.step // self.every_steps, g)
            for bucket, g in first_of.items():
                reasons[g.id].append(
                    f"every {self.every_steps} steps (from {bucket * self.every_steps})"
                )
        if self.every_seconds:
            newest_of: dict[int, Generation] = {}
            for g in sorted(generations, key=lambda g: (g.time, g.id)):
                newest_of[math.floor(g.time / self.every_seconds)] = g
            for g in newest_of.values():
                reasons[g.id].append(f"newest of its {_duration(self.every_seconds)}")
        return reasons


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"90s"``, ``"30m"``, ``"6h"``, ``"1d"``, ``"2w"``."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    text = text.strip().lower()
    factor = units.get(text[-1:], None)
    number = text[:-1] if factor else text
    try:
        value = float(number) * (factor or 1)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 30m, 6h, 1d)") from None
    if not math.isfinite(value):
        raise ValueError(f"a duration must be finite, got {text!r}")
    if not value > 0:
        raise ValueError(f"a duration must be positive, got {text!r}")
    return value


def _duration(seconds: float) -> str:
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


# -- what a generation references -----------------------------------------------------


def _references(
    store: Store,
    digest: Digest,
    root: GenerationRoot,
    raw: dict[bytes, tuple[int, str]] | None = None,
) -> tuple[list[bytes], set[bytes]]:
    """A generation's object digests (root and shards) and chunk digests (verified reads).

    ``raw``, if given, gets each chunk's raw length and its tensor's dtype.
    """
    where = {"run": root.run, "generation": root.generation}
    objects = [digest.raw]
    chunks: set[bytes] = set()
    for rank, shard_digest in enumerate(root.shards):
        shard: ShardManifest = store.read_object(
            shard_digest, expect=TYPE_SHARD, rank=rank, **where
        )
        objects.append(shard_digest)
        for entry in shard.tensors + shard.local_tensors:
            chunks.update(entry.chunks)
            if raw is not None:
                for index, chunk in enumerate(entry.chunks):
                    length = entry.chunk_length(index)
                    raw[chunk] = (length, entry.dtype)
    return objects, chunks


def _run_generations(store: Store, run: str) -> list[tuple[Digest, GenerationRoot]]:
    try:
        return list(store.iter_chain(run))
    except (IntegrityError, GenerationNotFoundError) as exc:
        raise GcAbortedError(
            f"gc aborted, nothing deleted: run {run!r} cannot be listed: {exc.message}", run=run
        ) from exc


def _check_reflog(store: Store, run: str) -> None:
    _, damaged = store.refs.read_reflog(run)
    if damaged:
        raise GcAbortedError(
            f"gc aborted, nothing deleted: the reflog of run {run!r} has damaged lines "
            f"{damaged[:10]} ({store.refs.reflog_location(run)}); a generation they name could "
            "be dropped by mistake",
            run=run,
        )


# -- collection -------------------------------------------------------------------


@dataclass
class RunPlan:
    """Retention of one run: every listed generation and why it is kept (or not)."""

    run: str
    generations: list[Generation]
    reasons: dict[int, list[str]]
    tags: dict[str, int]

    @property
    def kept(self) -> list[int]:
        return [g.id for g in self.generations if self.reasons[g.id]]

    @property
    def dropped(self) -> list[int]:
        return [g.id for g in self.generations if not self.reasons[g.id]]


@dataclass
class GcReport:
    """What a collection kept and freed (or, for a dry run, would free)."""

    dry_run: bool
    plans: list[RunPlan]
    objects_freed: int = 0
    chunks_freed: int = 0
    bytes_freed: int = 0  # chunk and object bytes no retained generation references
    file_bytes_freed: int = 0  # pack file bytes given back to the filesystem
    packs_rewritten: int = 0  # packs whose live chunks were copied out (see reclaim)
    packs_merged: int = 0  # of those, small packs merged into one
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def dropped(self) -> dict[str, list[int]]:
        return {p.run: p.dropped for p in self.plans if p.dropped}


def plan_retention(
    store: Store, policy: RetentionPolicy, runs: list[str] | None = None
) -> list[RunPlan]:
    """Apply ``policy`` to ``runs`` (default all); other runs keep everything."""
    chosen = set(store.runs() if runs is None else [validate_run_name(r) for r in runs])
    unknown = chosen - set(store.runs())
    if unknown:
        raise unknown_run(store, sorted(unknown)[0])
    plans = []
    for run in store.runs():
        listed = _run_generations(store, run)
        generations = [Generation.from_root(d, r) for d, r in listed][::-1]
        by_root = {g.root: g.id for g in generations}
        _, collected = store.logged(run)
        tags = {}
        for name, value in store.refs.tags(run).items():
            if value.root.hex in by_root:
                tags[name] = by_root[value.root.hex]
            elif value.root.hex not in collected:
                # Fail closed: a tag must protect its generation even if the log lost it.
                raise GcAbortedError(
                    f"gc aborted, nothing deleted: tag {name!r} of run {run!r} names "
                    f"generation {value.generation} ({value.root.short}), which the run's "
                    "history does not list (is its reflog damaged?)",
                    run=run,
                    generation=value.generation,
                )
        if run in chosen:
            reasons = policy.decide(generations, tags)
        else:
            reasons = {g.id: ["run not selected"] for g in generations}
        plans.append(RunPlan(run, generations, reasons, tags))
    return plans


def collect_garbage(
    store: Store,
    policy: RetentionPolicy | None = None,
    *,
    runs: list[str] | None = None,
    dry_run: bool = False,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    progress: bool = False,
) -> GcReport:
    """Drop what ``policy`` does not keep and delete every unreferenced object and chunk.

    ``progress=True``: phase lines, and bars for the mark and the sweep, on stderr
    (a terminal).
    """
    policy = policy or RetentionPolicy()
    if not dry_run:  # a dry run only reads, so it works on a read-only store
        store.refuse_if_readonly("garbage collection")
    phases = Phases(progress, "gc", 3 if dry_run else 5)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    lock = (
        _no_lock()
        if dry_run
        else store.refs.store_lock(
            exclusive=True,
            timeout=lock_timeout,
            busy=f"store busy: a save or tag held {store.path} for {lock_timeout:g}s; "
            "nothing was deleted, try again",
        )
    )
    with lock:
        clock = time.perf_counter()
        phases.start("check the chunk index against the packs")
        # First: listing a damaged index can abort inside LMDB, and the sweep would act on it.
        _check_index(store, dry_run)
        timings["check"] = time.perf_counter() - clock
        clock = time.perf_counter()
        phases.start("list every run's generations and mark what the retained ones reference")
        for run in store.runs():
            _check_reflog(store, run)
        plans = plan_retention(store, policy, runs)
        retained = sum(len(plan.kept) for plan in plans)
        with progress_bar(progress, "gc mark", retained, unit="gen") as bar:
            marked_objects, marked_chunks = _mark(store, plans, bar)
        dropped_roots = [(p.run, g) for p in plans for g in p.generations if not p.reasons[g.id]]
        timings["mark"] = time.perf_counter() - clock
        clock = time.perf_counter()
        phases.start("list every stored object and chunk")
        stored_objects, stored_chunks = _stored(store, dry_run)
        garbage_objects = [(k, n) for k, n in stored_objects if k not in marked_objects]
        garbage_chunks = [(k, n) for k, n in stored_chunks if k not in marked_chunks]
        timings["scan"] = time.perf_counter() - clock
        report = GcReport(
            dry_run=dry_run,
            plans=plans,
            objects_freed=len(garbage_objects),
            chunks_freed=len(garbage_chunks),
            bytes_freed=sum(n for _, n in garbage_objects) + sum(n for _, n in garbage_chunks),
        )
        if not dry_run:
            clock = time.perf_counter()
            phases.start(
                f"delete {len(garbage_objects)} object(s) and {len(garbage_chunks)} chunk(s), "
                f"{format_size(report.bytes_freed)}"
            )
            # A store lease (blob stores) is checked before each step that deletes or
            # hides: a collection that stalled past it may have been broken by a save
            # that went on, so it stops (LockLostError) instead of acting on its mark.
            store.refs.check_store_lock()
            # First the durable intent: listings hide a dropped generation from now on,
            # so a sweep cut short never leaves a half-deleted generation on show.
            for run, gen in dropped_roots:
                with store.refs.locked(run):
                    store.refs.record_collected(run, gen.id, Digest.from_hex(gen.root))
            if isinstance(store.path, Path):  # a fast tier's records of what it holds
                for run in {run for run, _ in dropped_roots}:
                    forget_elsewhere(store.path, run, set(store.published(run).values()))
            fault_point("gc.before_sweep")
            # Roots first, then shards, then chunks: whatever stops the sweep, nothing
            # left behind names an object that is gone, except other garbage.
            root_set = {Digest.from_hex(g.root).raw for _, g in dropped_roots}
            ordered = sorted(garbage_objects, key=lambda item: item[0] not in root_set)
            garbage = len(garbage_objects) + len(garbage_chunks)
            with progress_bar(progress, "gc sweep", garbage, unit="key") as sweep:
                for namespace, keys, fault in (
                    (Namespace.OBJECTS, [k for k, _ in ordered], "gc.mid_sweep"),
                    (Namespace.CHUNKS, [k for k, _ in garbage_chunks], "gc.mid_chunks"),
                ):
                    for start in range(0, len(keys), DELETE_BATCH):
                        batch = keys[start : start + DELETE_BATCH]
                        store.refs.check_store_lock()
                        store.backend.delete_many(namespace, batch)
                        sweep.update(len(batch))
                        if start == 0:
                            fault_point(fault)  # after the first batch of this namespace
            timings["sweep"] = time.perf_counter() - clock
            clock = time.perf_counter()
            phases.start(
                f"give back pack space: rewrite packs under {RECLAIM_MIN_LIVE:.0%} live, "
                f"merge packs under {format_size(MERGE_PACKS_BELOW)}, "
                f"{format_size(store.backend.file_bytes())} on disk now"
            )
            store.refs.check_store_lock()
            reclaimed = store.backend.reclaim(
                min_live=RECLAIM_MIN_LIVE, merge_below=MERGE_PACKS_BELOW
            )
            report.file_bytes_freed = reclaimed.bytes_freed
            report.packs_rewritten = reclaimed.packs_rewritten
            report.packs_merged = reclaimed.packs_merged
            timings["reclaim"] = time.perf_counter() - clock
    report.seconds = time.perf_counter() - started
    report.timings = timings
    return report


def _mark(store: Store, plans: list[RunPlan], bar: Bar) -> tuple[set[bytes], set[bytes]]:
    """The objects and chunks of every retained generation; one unreadable aborts."""
    marked_objects: set[bytes] = set()
    marked_chunks: set[bytes] = set()
    for plan in plans:
        for gen in plan.generations:
            if not plan.reasons[gen.id]:
                continue
            digest = Digest.from_hex(gen.root)
            try:
                root = store.read_root(digest, run=plan.run)
                objects, chunks = _references(store, digest, root)
            except IntegrityError as exc:
                raise GcAbortedError(
                    f"gc aborted, nothing deleted: retained generation {plan.run}@{gen.id} "
                    f"cannot be read: {exc}",
                    run=plan.run,
                    generation=gen.id,
                ) from exc
            marked_objects.update(objects)
            marked_chunks.update(chunks)
            bar.update(1)
    return marked_objects, marked_chunks


def _stored(store: Store, dry_run: bool) -> tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]:
    """Every stored object and chunk with its size; a damaged index aborts the collection."""
    try:
        return (
            list(store.backend.value_sizes(Namespace.OBJECTS)),
            list(store.backend.value_sizes(Namespace.CHUNKS)),
        )
    except IntegrityError as exc:
        verb = "gc would abort" if dry_run else "gc aborted, nothing deleted"
        raise GcAbortedError(f"{verb}: the store cannot be listed: {exc}") from exc


def _check_index(store: Store, dry_run: bool) -> None:
    """Abort unless the chunk index agrees with the packs and the LMDB file is sound.

    The sweep deletes by iterating the index and the reclaim deletes packs no
    iterated entry names; a damaged index (or a damaged LMDB free list, which
    the next write would act on) turns either into data loss.
    """
    verb = "gc would abort" if dry_run else "gc aborted, nothing deleted"
    try:
        check = store.backend.check_index(hash_bytes=False)
    except IntegrityError as exc:
        raise GcAbortedError(f"{verb}: the chunk index cannot be read: {exc}") from exc
    if not check.ok:
        shown = "; ".join(check.problems[:3])
        more = f" (and {len(check.problems) - 3} more)" if len(check.problems) > 3 else ""
        raise GcAbortedError(
            f"{verb}: the chunk index disagrees with the packs: {shown}{more}; run "
            "castore repair --rebuild-index (with no other process using the store)",
            path=str(store.path),
        )


class _no_lock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- tags -------------------------------------------------------------------------


@dataclass(frozen=True)
class TagChange:
    """What :func:`set_tag` did: tag ``name`` of ``generation.run`` now names ``generation``.

    ``previous`` is what the tag named before (None: the tag is new, or its file
    was unreadable and has been replaced). When :attr:`moved`, the generation
    ``previous`` names is no longer pinned by this tag: retention may drop it
    unless another tag or rule keeps it.
    """

    name: str
    generation: Generation
    previous: RefValue | None = None

    @property
    def moved(self) -> bool:
        """The tag named another generation before."""
        return self.previous is not None and self.previous.root.hex != self.generation.root


def tag(store: Store, run: str, generation: int | str, name: str) -> Generation:
    """Pin a generation under ``name``: retention keeps it until it is untagged.

    A tag the run already has moves here; :func:`set_tag` also says what it named.
    """
    return set_tag(store, run, generation, name).generation


def set_tag(store: Store, run: str, generation: int | str, name: str) -> TagChange:
    """Point tag ``name`` of ``run`` at a generation, creating or moving it.

    The name must be one ``RUN@NAME`` can address (not all digits, not ``latest``:
    InvalidNameError).
    """
    store.refuse_if_readonly("tag")
    validate_run_name(run)
    validate_tag_name(name, run=run)
    # Shared store lock: a collection is not dropping this generation right now.
    with store.refs.store_lock(
        exclusive=False,
        timeout=store.refs.lock_timeout,
        busy=f"store busy: garbage collection held {store.path}",
    ):
        gen = store.resolve(run, generation)
        try:
            previous = store.refs.tag(run, name)
        except IntegrityError:
            previous = None  # a damaged tag file: replaced below, as before
        # A lease (blob stores) broken meanwhile: a collection may have dropped it.
        store.refs.check_store_lock()
        store.refs.write_tag(
            run, name, RefValue(run, gen.id, Digest.from_hex(gen.root), time.time())
        )
    return TagChange(name, gen, previous)


def untag(store: Store, run: str, name: str) -> None:
    store.refuse_if_readonly("untag")
    if not store.refs.delete_tag(run, name):
        if run not in store.runs():
            raise unknown_run(store, run)
        raise GenerationNotFoundError(f"run {run!r} has no tag {name!r}", run=run)


# -- accounting -------------------------------------------------------------------


@dataclass
class GenerationUsage:
    run: str
    id: int
    step: int
    logical_bytes: int  # the state's tensor bytes
    referenced_bytes: int  # distinct chunk bytes it references
    exclusive_bytes: int  # chunk bytes no other listed generation references: freed by dropping it


@dataclass
class Usage:
    generations: list[GenerationUsage]
    physical_bytes: int  # every chunk and object stored (garbage included)
    referenced_bytes: int  # distinct chunk bytes the listed (shown) generations reference
    garbage_bytes: int  # chunks and objects stored but referenced by no listed generation
    file_bytes: int  # LMDB data file plus pack files (dead space included; see compact)
    raw_bytes: int = 0  # the referenced chunks' raw bytes (referenced_bytes as stored)
    # Of the distinct chunks each run (each dtype) of the listed ones references:
    # (raw bytes, stored bytes); stored is less where a codec compressed them.
    by_run: dict[str, tuple[int, int]] = field(default_factory=dict)
    by_dtype: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def compression(self) -> float:
        """Stored over raw bytes of the referenced chunks (1.0: stored raw)."""
        return self.referenced_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def logical_bytes(self) -> int:
        return sum(g.logical_bytes for g in self.generations)

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes of all generations over the distinct chunks' raw bytes they use
        (compression apart: see ``compression``)."""
        distinct = self.raw_bytes or self.referenced_bytes
        return self.logical_bytes / distinct if distinct else 1.0


def disk_usage(store: Store, runs: list[str] | None = None) -> Usage:
    """Logical and physical bytes; per generation, what only it references.

    Exclusive bytes are counted against every listed generation of every run
    (a chunk shared with another run is not freed by dropping one generation).
    """
    chunk_sizes = dict(store.backend.value_sizes(Namespace.CHUNKS))
    object_sizes = dict(store.backend.value_sizes(Namespace.OBJECTS))
    shown = set(store.runs() if runs is None else [validate_run_name(r) for r in runs])
    unknown = shown - set(store.runs())
    if unknown:
        raise unknown_run(store, sorted(unknown)[0])
    per_gen: list[tuple[str, Generation, set[bytes]]] = []
    counts: Counter[bytes] = Counter()
    referenced_objects: set[bytes] = set()
    raw: dict[bytes, tuple[int, str]] = {}
    for run in store.runs():
        for digest, root in _run_generations(store, run):
            objects, chunks = _references(store, digest, root, raw)
            counts.update(chunks)
            referenced_objects.update(objects)
            per_gen.append((run, Generation.from_root(digest, root), chunks))
    rows = []
    for run, gen, chunks in reversed(per_gen):
        if run not in shown:
            continue
        rows.append(
            GenerationUsage(
                run=run,
                id=gen.id,
                step=gen.step,
                logical_bytes=gen.logical_bytes,
                referenced_bytes=sum(chunk_sizes.get(c, 0) for c in chunks),
                exclusive_bytes=sum(chunk_sizes.get(c, 0) for c in chunks if counts[c] == 1),
            )
        )
    rows.sort(key=lambda u: (u.run, u.id))
    referenced = sum(chunk_sizes.get(c, 0) for c in counts)  # by every run: not garbage
    shown_chunks = {c for run, _, chunks in per_gen if run in shown for c in chunks}
    physical = sum(chunk_sizes.values()) + sum(object_sizes.values())
    live_objects = sum(object_sizes.get(o, 0) for o in referenced_objects)
    by_run: dict[str, set[bytes]] = {}
    for run, _, chunks in per_gen:
        if run in shown:
            by_run.setdefault(run, set()).update(chunks)
    by_dtype: dict[str, tuple[int, int]] = {}
    for chunk in shown_chunks:
        if chunk not in chunk_sizes:
            continue  # missing: verify reports it
        length, dtype = raw[chunk]
        had = by_dtype.get(dtype, (0, 0))
        by_dtype[dtype] = (had[0] + length, had[1] + chunk_sizes.get(chunk, 0))
    return Usage(
        generations=rows,
        physical_bytes=physical,
        referenced_bytes=sum(chunk_sizes.get(c, 0) for c in shown_chunks),
        garbage_bytes=physical - referenced - live_objects,
        file_bytes=store.backend.file_bytes(),
        raw_bytes=sum(raw[c][0] for c in shown_chunks if c in chunk_sizes),
        by_run={
            run: (
                sum(raw[c][0] for c in chunks if c in chunk_sizes),
                sum(chunk_sizes.get(c, 0) for c in chunks),
            )
            for run, chunks in sorted(by_run.items())
        },
        by_dtype=dict(sorted(by_dtype.items())),
    )


# -- compaction -------------------------------------------------------------------


@dataclass
class CompactReport:
    bytes_before: int
    bytes_after: int
    seconds: float


def compact(path: str | os.PathLike[str], *, progress: bool = False) -> CompactReport:
    """Rewrite every pack with dead space and the LMDB file without its free pages.

    Offline: refused (``StoreLockedError``) while any process has the store
    open. Packs are rewritten first (see ``LmdbBackend.reclaim``). Then the
    compacted LMDB copy is checked entry by entry against the original's
    counts before it replaces ``chunks/data.mdb`` with one ``rename``.
    ``progress=True``: a line per phase on stderr (a terminal).
    """
    started = time.perf_counter()
    root = local_lmdb_store(
        path,
        "castore compact",
        "its packs are immutable blobs that castore gc already rewrites when sparse, and it "
        "has no LMDB file; there is nothing to compact",
    )
    if not root.exists():
        raise StoreNotFoundError(f"no castore store at {root}", path=str(root))
    read_marker(root / MARKER)  # a real store, of a format we know
    before, after = compact_lmdb_store(root, merge_below=MERGE_PACKS_BELOW, progress=progress)
    return CompactReport(before, after, time.perf_counter() - started)
