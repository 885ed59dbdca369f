"""History: the published generations of a run, found through its ref and reflog.

A run's history is its ref (the newest published root, the commit point),
its reflog (every advance, and every generation garbage collection dropped)
and the parent link each root carries. Everything here reads those and the
roots they name; nothing writes. :class:`~castore.Store` delegates its
``resolve``, ``generations``, ``candidates`` and friends to these functions,
and ``castore.dist.restore``, ``castore.gc`` and ``castore.verify`` reach them
through the store.

The store is passed as a :class:`RunHistory`: its path (for messages), its
refs, and its verified root reads. Roots are read through the store's own
``read_root``, so a caller that counts or intercepts root reads sees them all.
"""

from __future__ import annotations

import difflib
import heapq
import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from castore.errors import (
    CastoreError,
    CorruptObjectError,
    GenerationNotFoundError,
    InvalidNameError,
    LostRunError,
    NoValidGenerationError,
    ObjectMissingError,
)
from castore.format.hashing import Digest
from castore.format.objects import GenerationRoot
from castore.format.tree import decode_tree
from castore.repo.records import LATEST, RefValue, validate_run_name
from castore.repo.refstore import ComposedRefStore

GenerationSpec = int | str
RUNS_LISTED = 10  # runs a mistyped run's error names before it only counts them


class RunHistory(Protocol):
    """What reading a run's history needs of a store."""

    @property
    def path(self) -> Path | str: ...

    @property
    def refs(self) -> ComposedRefStore: ...

    def read_root(self, digest: Digest, *, run: str) -> GenerationRoot: ...


@dataclass(frozen=True)
class SaveStats:
    """What one save cost: bytes it covered, bytes it actually wrote, time."""

    logical_bytes: int
    new_bytes: int
    new_chunks: int
    reused_chunks: int
    seconds: float
    tensors: int
    written_bytes: int = 0  # new chunk bytes and shard manifests (older roots: new_bytes)
    held_seconds: float = 0.0  # the caller held by the save (older roots: seconds)
    stored_bytes: int = 0  # the new chunks' bytes as stored, compressed (older roots: new_bytes)

    @property
    def compression(self) -> float:
        """Stored over raw bytes of the new chunks (1.0: stored raw, or nothing new)."""
        return self.stored_bytes / self.new_bytes if self.new_bytes else 1.0

    @property
    def dedup_ratio(self) -> float:
        """Fraction of logical bytes that were already stored (0..1)."""
        return 1.0 - self.new_bytes / self.logical_bytes if self.logical_bytes else 1.0


@dataclass(frozen=True)
class Generation:
    """One published generation of a run."""

    run: str
    id: int
    root: str
    step: int
    time: float
    parent: str | None
    world_size: int
    stats: SaveStats
    metadata: dict[str, Any] = field(default_factory=dict)
    frameworks: dict[str, str] = field(default_factory=dict)
    data_order: dict[str, Any] = field(default_factory=dict)
    # Who published it: host, pid, job and writer epoch (empty before epochs existed).
    writer: dict[str, Any] = field(default_factory=dict)
    # Each DTensor's mesh and placements at the save, by key path (empty without DTensors).
    layouts: dict[str, Any] = field(default_factory=dict)
    # Where a generation made from others came from ({} for a save): castore.lineage.
    lineage: dict[str, Any] = field(default_factory=dict)

    @property
    def logical_bytes(self) -> int:
        return self.stats.logical_bytes

    @property
    def new_bytes(self) -> int:
        return self.stats.new_bytes

    @classmethod
    def from_root(cls, digest: Digest, root: GenerationRoot) -> Generation:
        stats = root.stats
        return cls(
            run=root.run,
            id=root.generation,
            root=digest.hex,
            step=root.step,
            time=root.time,
            parent=root.parent.hex() if root.parent else None,
            world_size=root.world_size,
            stats=SaveStats(
                logical_bytes=int(stats.get("logical_bytes", 0)),
                new_bytes=int(stats.get("new_bytes", 0)),
                new_chunks=int(stats.get("new_chunks", 0)),
                reused_chunks=int(stats.get("reused_chunks", 0)),
                seconds=float(stats.get("seconds", 0.0)),
                tensors=int(stats.get("tensors", 0)),
                written_bytes=int(stats.get("written_bytes", stats.get("new_bytes", 0))),
                held_seconds=float(stats.get("held_seconds", stats.get("seconds", 0.0))),
                stored_bytes=int(stats.get("stored_bytes", stats.get("new_bytes", 0))),
            ),
            metadata=decode_tree(root.metadata) if root.metadata else {},
            frameworks=dict(root.frameworks),
            data_order=dict(root.data_order),
            writer=dict(root.writer),
            layouts=dict(root.layouts),
            lineage=dict(root.lineage),
        )


@dataclass(frozen=True)
class Skipped:
    """A generation a fallback did not load, and why."""

    generation: int  # 0 for the run's ref itself, when it was damaged
    root: str  # hex digest, or "ref"
    error: str  # the exception type
    reason: str


T = TypeVar("T")


def fall_back(
    run: str,
    candidates: Iterable[tuple[int, Digest]],
    load: Callable[[int, Digest], T],
    is_damage: Callable[[Exception], bool],
    skipped: list[Skipped],
    *,
    scope: str = "",
) -> T:
    """``load`` the newest of ``candidates`` (id, root; newest first) that loads.

    A generation whose failure ``is_damage`` (an integrity error; on several ranks,
    one every rank agreed on) is added to ``skipped`` and the next one tried; any
    other failure is raised at once. None loads: NoValidGenerationError, listing
    every generation skipped and why. ``scope`` (" on every rank") ends its message.
    """
    for gen_id, digest in candidates:
        try:
            return load(gen_id, digest)
        except Exception as exc:
            if not is_damage(exc):
                raise
            skipped.append(Skipped(gen_id, digest.hex, type(exc).__name__, str(exc)))
    listed = "; ".join(f"{s.generation}: {s.error}" for s in skipped)
    raise NoValidGenerationError(
        f"no generation of run {run!r} validates{scope} (skipped {listed})", run=run
    )


# -- the ref and the reflog ---------------------------------------------------


def latest(store: RunHistory, run: str) -> RefValue:
    """What the ref of ``run`` names; a run without one is empty, or lost its ref."""
    ref = store.refs.read(run)
    if ref is None:
        ref = check_not_lost(store, run)
    if ref is None:
        raise no_generations(store, run)
    return ref


def no_generations(store: RunHistory, run: str) -> GenerationNotFoundError:
    """``run`` has no generations: a run of the store without any, or a name it lacks."""
    if run in store.refs.runs():
        return GenerationNotFoundError(f"run {run!r} has no generations", run=run)
    return unknown_run(store, run)


def unknown_run(store: RunHistory, run: str) -> GenerationNotFoundError:
    """``run`` is no run of the store: name its runs, and the one nearest to ``run``.

    The one wording of a mistyped run, whoever finds it (a load, verify, gc,
    every command). ``castore.open`` creates a store at a mistyped path: in a
    store with no runs at all, that is the likelier cause, and the message says so.
    """
    runs = store.refs.runs()
    if not runs:
        return GenerationNotFoundError(
            f"run {run!r} has no generations: the store at {store.path} is empty "
            "(castore.open created it just now? pass create=False to open only existing "
            "stores)",
            run=run,
        )
    listed = ", ".join(runs[:RUNS_LISTED])
    if len(runs) > RUNS_LISTED:
        listed += f", ... ({len(runs)} runs: castore log lists them)"
    near = difflib.get_close_matches(run, runs, n=1)
    hint = f": did you mean {near[0]!r}?" if near else ""
    message = f"no run {run!r} in the store at {store.path}, whose runs are {listed}{hint}"
    return GenerationNotFoundError(message, run=run)


def check_not_lost(store: RunHistory, run: str) -> RefValue | None:
    """A run whose ref read as absent: None if it has no history; LostRunError if it lost its ref.

    Returns the ref when the run's first generation was published after the
    caller read it: a publish writes the ref before its reflog record, so
    history found here with no ref on a second read is a lost ref, while a
    ref found on that read is the generation just published, not damage.
    """
    listed, _ = logged(store, run)
    if listed or run in store.refs.runs():
        ref = store.refs.read(run)
        if ref is not None:
            return ref
        raise LostRunError(
            f"run {run!r} has history ({len(listed)} published generation(s) in its "
            f"reflog) but its ref file refs/{run} is missing: load a generation by id or "
            "with fallback='previous', or run `castore repair` to restore the ref",
            run=run,
        )
    return None


def logged(store: RunHistory, run: str) -> tuple[dict[str, int], set[str]]:
    """From the reflog: root hex -> id of every published, uncollected generation,
    and the root hexes garbage collection dropped (copies: the caller may change them)."""
    view = store.refs.reflog_view(run)
    return dict(view.listed), set(view.collected)


def published(store: RunHistory, run: str, *, tolerate_bad_ref: bool = False) -> dict[str, int]:
    """Root hex -> generation id of every published, uncollected generation (by the log).

    The reflog records each ref advance and each generation garbage
    collection dropped; the ref itself is always included.
    """
    listed, _ = logged(store, run)
    try:
        newest = latest(store, run)
    except CastoreError:
        if not listed or not tolerate_bad_ref:
            raise
        return listed  # a damaged ref: the log still names what was published
    listed[newest.root.hex] = newest.generation
    return listed


# -- the chain of roots -------------------------------------------------------


def iter_chain(store: RunHistory, run: str) -> Iterator[tuple[Digest, GenerationRoot]]:
    """Roots of ``run`` still stored, from the newest back to the oldest, read lazily.

    The ref and the reflog's published generations, joined with the parent
    links of each root (so a lost log line hides nothing the chain still
    reaches), minus what garbage collection dropped. A listed root that is
    missing is damage: this fails closed. The log is read from its end and
    only the roots yielded (and a few parents) are read, so the newest few
    cost the same however long the history.
    """
    newest = latest(store, run)
    stream = store.refs.published_newest_first(run)
    listed = itertools.chain([(newest.root.hex, newest.generation)], stream)
    # Max-heap on generation id. The log lists ids in increasing order, so its
    # entries are moved in only while they could be the next newest; a root
    # is yielded once the id it claims is confirmed, so the order holds even
    # where the log's id was wrong.
    heap: list[tuple[int, str, GenerationRoot | None]] = []
    queued: set[str] = set()
    from_chain: set[str] = set()  # parents queued from a root's link, not the log
    pending = next(listed, None)
    while True:
        while pending is not None and (not heap or pending[1] >= -heap[0][0]):
            if pending[0] not in queued:
                queued.add(pending[0])
                heapq.heappush(heap, (-pending[1], pending[0], None))
            pending = next(listed, None)
        if not heap:
            return
        key, hex_digest, root = heapq.heappop(heap)
        digest = Digest.from_hex(hex_digest)
        if root is None:
            if hex_digest in from_chain and hex_digest in stream.collected:
                continue  # garbage collection dropped it: the chain ends here
            try:
                root = store.read_root(digest, run=run)
            except ObjectMissingError:
                if hex_digest in from_chain and hex_digest in logged(store, run)[1]:
                    continue  # collected, its record older than the log read so far
                raise
            if root.generation != -key:
                heapq.heappush(heap, (-root.generation, hex_digest, root))
                continue
        if root.parent is not None:
            parent = root.parent.hex()
            if parent not in queued:
                queued.add(parent)
                from_chain.add(parent)
                # A parent's id is below its child's: the bound orders it until read.
                heapq.heappush(heap, (-(root.generation - 1), parent, None))
        yield digest, root


def generations(store: RunHistory, run: str, *, last: int | None = None) -> list[Generation]:
    """Every stored generation of ``run``, oldest first; ``last=N``: only the newest N.

    ``last`` reads only the roots it returns, so it costs the same however
    long the run's history.
    """
    validate_run_name(run)
    if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 0):
        raise ValueError(f"last must be a count of generations (an int >= 0), not {last!r}")
    chain = iter_chain(store, run)
    if last is not None:
        chain = itertools.islice(chain, last)
    return [Generation.from_root(d, r) for d, r in chain][::-1]


# -- resolving one generation -------------------------------------------------


def resolve_root(
    store: RunHistory, run: str, generation: GenerationSpec = "latest"
) -> tuple[Digest, GenerationRoot]:
    """Find one generation: ``"latest"``, an id (int or digits), a tag name or a root
    hex prefix (an exact tag name wins over a prefix; digits are always an id)."""
    validate_run_name(run)
    named = None
    if generation == "latest":
        named = latest(store, run)
    elif isinstance(generation, str) and not generation.isdigit():
        named = store.refs.tag(run, generation)
    if named is not None:
        root = store.read_root(named.root, run=run)
        if root.generation != named.generation:
            what = "ref" if generation == "latest" else f"tag {generation!r}"
            raise CorruptObjectError(
                f"{what} names generation {named.generation}, its root says {root.generation}",
                run=run,
            )
        return named.root, root
    wanted_id, prefix = parse_generation(generation)
    if wanted_id is not None:
        found = _by_logged_id(store, run, wanted_id)
        if found is not None:
            return found
    if prefix:
        found = _by_logged_prefix(store, run, prefix)
        if found is not None:
            return found
    return _resolve_by_chain(store, run, generation, wanted_id, prefix)


def _by_logged_id(
    store: RunHistory, run: str, wanted_id: int
) -> tuple[Digest, GenerationRoot] | None:
    """The log names most generations directly: read only the roots it lists under the id.

    What :func:`published` would say of the id (the ref's root counts, under
    the ref's id), without listing every generation: the reflog answers from
    its index where it keeps one, so a new handle's lookup reads a few records.
    """
    listed = store.refs.listed_with_id(run, wanted_id)
    try:
        newest: RefValue | None = latest(store, run)
    except CastoreError:
        if not listed and not logged(store, run)[0]:
            raise
        newest = None  # a damaged ref: the log still names what was published
    if newest is not None:
        if newest.generation == wanted_id and newest.root.hex not in listed:
            listed.append(newest.root.hex)
        elif newest.generation != wanted_id and newest.root.hex in listed:
            listed.remove(newest.root.hex)
    for hex_digest in listed:
        digest = Digest.from_hex(hex_digest)
        root = store.read_root(digest, run=run)
        if root.generation == wanted_id:
            return digest, root
    return None


def _by_logged_prefix(
    store: RunHistory, run: str, prefix: str
) -> tuple[Digest, GenerationRoot] | None:
    matches = [h for h in published(store, run, tolerate_bad_ref=True) if h.startswith(prefix)]
    if len(matches) > 1:
        raise GenerationNotFoundError(
            f"root prefix {prefix!r} is ambiguous in run {run!r}: use more digits",
            run=run,
        )
    if len(matches) == 1:
        digest = Digest.from_hex(matches[0])
        return digest, store.read_root(digest, run=run)
    return None


def _resolve_by_chain(
    store: RunHistory,
    run: str,
    generation: GenerationSpec,
    wanted_id: int | None,
    prefix: str | None,
) -> tuple[Digest, GenerationRoot]:
    """What the log did not name: walk the chain of parent links."""
    by_prefix: list[tuple[Digest, GenerationRoot]] = []
    for digest, root in iter_chain(store, run):
        if root.generation == wanted_id:
            return digest, root
        if prefix and digest.hex.startswith(prefix):
            by_prefix.append((digest, root))
        if prefix is None and wanted_id is not None and root.generation < wanted_id:
            break
    if len(by_prefix) == 1:
        return by_prefix[0]
    if len(by_prefix) > 1:
        raise GenerationNotFoundError(
            f"root prefix {prefix!r} is ambiguous in run {run!r}: use more digits", run=run
        )
    raise GenerationNotFoundError(f"run {run!r} has no generation {generation!r}", run=run)


def resolve(store: RunHistory, run: str, generation: GenerationSpec = "latest") -> Generation:
    return Generation.from_root(*resolve_root(store, run, generation))


def split_address(address: str) -> tuple[str, str]:
    """``RUN[@GEN]`` -> (run, generation); ``RUN`` alone is ``"latest"``.

    ``RUN@`` is refused, not read as the newest: an id, tag or prefix that a
    script left empty would otherwise load another generation than it meant.
    """
    run, at, generation = address.partition("@")
    if at and not generation:
        raise InvalidNameError(
            f"{address!r} names no generation after '@': write {run} (or {run}@latest) "
            f"for the newest, {run}@ID, {run}@TAG or {run}@ROOT-PREFIX",
            run=run or None,
        )
    if at and not run:
        raise InvalidNameError(f"{address!r} names no run before '@': write RUN@{generation}")
    return run, generation or LATEST


def is_id(spec: GenerationSpec) -> bool:
    """``spec`` names a generation by its id (an int, or digits)."""
    return isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit())


def parse_generation(spec: GenerationSpec) -> tuple[int | None, str | None]:
    """A generation spec other than ``"latest"`` or a tag: (id, root hex prefix), either None."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec, None
    if isinstance(spec, str) and re.fullmatch(r"[0-9a-f]{6,64}", spec):
        # Six or more digits may be an id or a root prefix: an id match wins.
        return (int(spec) if spec.isdigit() else None), spec
    if isinstance(spec, str) and spec.isdigit():
        return int(spec), None
    raise GenerationNotFoundError(
        f"bad generation {spec!r}: use 'latest', an id, a tag name, or a root digest prefix "
        "(6+ hex digits)"
    )


# -- fallback -----------------------------------------------------------------


def candidates(store: RunHistory, run: str, below: int | None = None) -> list[tuple[int, Digest]]:
    """Generations a fallback may try, newest first: (id, root digest).

    From the ref and the reflog, without reading a root, so a damaged ref
    or root does not hide the generations before it. ``below``: only ids
    up to it.
    """
    validate_run_name(run)
    listed, _ = logged(store, run)
    try:
        newest = store.refs.read(run)
    except CastoreError:
        newest = None  # a damaged ref: the log still names what was published
    if newest is not None:
        listed[newest.root.hex] = newest.generation
    if not listed:
        raise no_generations(store, run)
    found = [(g, Digest.from_hex(h)) for h, g in listed.items() if below is None or g <= below]
    # Newest first; for one id, the root the ref names (the commit point) first.
    ref_root = newest.root.hex if newest is not None else None
    return sorted(found, key=lambda item: (-item[0], item[1].hex != ref_root))


def ref_problem(store: RunHistory, run: str) -> list[Skipped]:
    """A damaged ref as a skipped entry, so a fallback past it is never silent."""
    try:
        store.refs.read(run)
    except CastoreError as exc:
        return [Skipped(0, "ref", type(exc).__name__, str(exc))]
    return []
