"""The ``Store`` facade: save, load, list and slice generations.

A store is a directory::

    castore.json    store marker: format name and version, default chunk size
    chunks/         the LMDB environment (chunk index and objects); chunks/packs/ the bytes
    refs/RUN        one self-checking ref per run (the commit point)
    logs/RUN.reflog every ref advance, one checksummed JSON line each
    locks/RUN.lock  flock target for compare-and-swap ref advances

Write order (invariant 1): chunks committed, then manifest objects committed,
then the ref advanced. A crash at any point leaves garbage, never a dangling
reference. This module knows nothing of torch; tensors from torch are handled
by :mod:`castore.tree`, which imports torch only when it sees one.
"""

from __future__ import annotations

import heapq
import itertools
import platform
import re
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from castore import dtypes
from castore.chunkio import ChunkRequest, ReadCounters, read_requests, request_bytes
from castore.chunkstore.base import ChunkBackend, Namespace
from castore.commit import (
    SINGLE_FAULTS,
    check_coverage,
    check_data_order,
    group_entries,
    make_root,
    publish,
    root_stats,
    write_shard,
)
from castore.errors import (
    AllocationError,
    CastoreError,
    ChecksumMismatchError,
    CorruptObjectError,
    FormatVersionError,
    GenerationNotFoundError,
    IntegrityError,
    LostRunError,
    NoValidGenerationError,
    ObjectMissingError,
    TensorNotFoundError,
    UnsupportedValueError,
)
from castore.hashing import Digest, digest_bytes
from castore.layout import Box, plan_copy
from castore.objects import (
    TYPE_ROOT,
    TYPE_SHARD,
    GenerationRoot,
    ShardManifest,
    TensorEntry,
    decode_object,
)
from castore.progress import NO_BAR, Bar, progress_bar, progress_wanted
from castore.refs import ComposedRefStore, RefStore, RefValue, validate_run_name
from castore.repo.base import LockHold
from castore.tree import decode_local_state, decode_tree, encode_state, encode_tree, torch_bytes

GenerationSpec = int | str


@dataclass(frozen=True)
class SaveStats:
    """What one save cost: bytes it covered, bytes it actually wrote, time."""

    logical_bytes: int
    new_bytes: int
    new_chunks: int
    reused_chunks: int
    seconds: float
    tensors: int

    @property
    def dedup_ratio(self) -> float:
        """Fraction of logical bytes that were already stored (0..1)."""
        return 1.0 - self.new_bytes / self.logical_bytes if self.logical_bytes else 1.0


class FallbackWarning(UserWarning):
    """A load with ``fallback="previous"`` skipped generations that did not validate."""


@dataclass(frozen=True)
class Skipped:
    """A generation a fallback did not load, and why."""

    generation: int  # 0 for the run's ref itself, when it was damaged
    root: str  # hex digest, or "ref"
    error: str  # the exception type
    reason: str


@dataclass
class Restored:
    """What :meth:`Store.restore` loaded."""

    state: Any
    generation: Generation
    skipped: list[Skipped]
    timings: dict[str, float]


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
            ),
            metadata=decode_tree(root.metadata) if root.metadata else {},
            frameworks=dict(root.frameworks),
            data_order=dict(root.data_order),
        )


def annotate_interrupt(interrupt: KeyboardInterrupt, note: str) -> None:
    """Put ``note`` in the interrupt's message, keeping its type and traceback.

    The message, not ``add_note`` (Python 3.11+): Ctrl-C's interrupt has none,
    and the traceback's last line then says what the save left.
    """
    message = " ".join(str(arg) for arg in interrupt.args)
    interrupt.args = (f"{message}; {note}" if message else note,)


MAX_STEP = (1 << 63) - 1  # a root's step is an int64 (msgpack and every reader's int)


def check_step(step: Any) -> int:
    """A generation's ``step``: a non-negative int that fits int64 (a count of steps)."""
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be a non-negative int64 (0 to 2**63-1), got {step}")
    return step


def encode_metadata(metadata: dict[str, Any] | None) -> bytes:
    """User metadata: plain values only, encoded like a state without tensors."""
    return encode_tree(dict(metadata or {}), allow_tensors=False)[0]


def framework_versions() -> dict[str, str]:
    from castore import __version__

    versions = {
        "castore": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = str(torch.__version__)
    return versions


class Store:
    """A castore store on disk. Use :func:`castore.open` to get one."""

    def __init__(
        self,
        path: Path,
        backend: ChunkBackend,
        chunk_size: int,
        *,
        refs: ComposedRefStore | None = None,
    ) -> None:
        """A store over ``backend`` (chunks, objects) and ``refs`` (refs, reflog, tags,
        locks; default: those of the directory ``path``). ``path`` also names the
        store in messages."""
        self.path = path
        self.backend = backend
        self.chunk_size = chunk_size
        self.refs = RefStore(path) if refs is None else refs
        self.read_counters = ReadCounters()
        self._open_lock: weakref.finalize | None = None

    # -- lifecycle --------------------------------------------------------

    def _hold_open_lock(self, hold: LockHold) -> None:
        """Keep ``hold`` (the shared open lock, see castore.gc.compact) until :meth:`close`.

        A Store dropped unclosed (a notebook cell run again rebinds it) lets go of
        the lock too, or compact would be refused until the process exits.
        """
        self._open_lock = weakref.finalize(self, hold.release)
        self._open_lock.atexit = False

    def close(self) -> None:
        """Close this handle; other Stores open on the same path are unaffected."""
        self.backend.close()
        if self._open_lock is not None:
            self._open_lock()  # releases the shared open lock, once

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<castore.Store {str(self.path)!r}>"

    # -- save -------------------------------------------------------------

    def save(
        self,
        state: Any,
        *,
        run: str,
        step: int,
        metadata: dict[str, Any] | None = None,
        data_order: dict[str, Any] | None = None,
        progress: bool = False,
    ) -> Generation:
        """Save ``state`` as the next generation of ``run`` and publish it atomically.

        ``data_order`` (a map of plain values) is recorded in the root; see
        ``docs/FORMAT.md``. ``progress=True`` shows a bar of the tensor bytes
        on stderr when it is a terminal (see :mod:`castore.progress`).
        """
        validate_run_name(run)
        check_step(step)
        started = time.perf_counter()
        encoded = encode_state(state)
        for leaf in encoded.leaves:
            if leaf.sharded:
                raise UnsupportedValueError(
                    f"Shard at {leaf.name} is one rank's block: save sharded state with "
                    "castore.dist.save",
                    key_path=leaf.name,
                )
        metadata_bytes = encode_metadata(metadata)
        order = check_data_order(data_order)
        before = self.ref_or_problem(run)
        try:
            with self.save_lock():
                return self._save_locked(
                    encoded, run, step, metadata_bytes, order, started, progress
                )
        except KeyboardInterrupt as interrupt:
            # Ctrl-C stays a KeyboardInterrupt; the note says whether anything was published.
            annotate_interrupt(interrupt, self.interrupted_note(run, before))
            raise

    def ref_or_problem(self, run: str) -> RefValue | str | None:
        """The ref of ``run`` now (None: no ref), or why it cannot be read; never raises."""
        try:
            return self.refs.read(run)
        except CastoreError as exc:
            return f"unreadable ({type(exc).__name__})"

    def interrupted_note(
        self, run: str, before: RefValue | str | None, *, publisher: bool = True
    ) -> str:
        """What an interrupted save of ``run`` left, from its ref before the save and now.

        Generation ids only grow, so a ref that names what it named before the
        save did not advance: nothing was published. ``publisher`` is False on a
        rank that is not the coordinator, which may still publish after it.
        """
        now = self.ref_or_problem(run)
        if isinstance(before, str) or isinstance(now, str):
            return (
                f"castore: save of run {run!r} interrupted; its ref is {now or 'absent'}: "
                f"check what is published with `castore log {self.path} --run {run}`"
            )
        if before != now:
            assert now is not None
            return (
                f"castore: save of run {run!r} interrupted after its ref advanced: generation "
                f"{now.generation} is published"
            )
        previous = (
            f"the previous generation of {run!r} ({before.generation}) is intact"
            if before is not None
            else f"run {run!r} still has no generations"
        )
        if not publisher:
            return (
                f"castore: save of run {run!r} interrupted on this rank before its ref moved; "
                f"{previous} unless the coordinator publishes: ask the store what is latest"
            )
        return f"castore: save interrupted: nothing was published; {previous}"

    def save_lock(self) -> Any:
        """The shared store lock a save holds from its first dedup check to its publish.

        Garbage collection takes it exclusively, so it never deletes a chunk a
        save has found present and skipped (invariant 6).
        """
        return self.refs.store_lock(
            exclusive=False,
            timeout=self.refs.save_wait,
            busy=f"store busy: garbage collection held {self.path} for {self.refs.save_wait:.0f}s",
        )

    def _save_locked(
        self,
        encoded: Any,
        run: str,
        step: int,
        metadata_bytes: bytes,
        order: dict[str, Any],
        started: float,
        progress: bool,
    ) -> Generation:
        parent = self.refs.read(run)
        generation = parent.generation + 1 if parent else 1
        shard = write_shard(
            self, encoded, run=run, generation=generation, rank=0, progress=progress
        )
        manifest = shard.manifest
        root = make_root(
            run=run,
            generation=generation,
            step=step,
            parent=parent,
            world_size=1,
            shards=[shard.digest],
            state=encoded.skeleton,
            metadata=metadata_bytes,
            stats=root_stats(
                shard.stats,
                time.perf_counter() - started,
                len(manifest.tensors) + len(manifest.local_tensors),
            ),
            frameworks=framework_versions(),
            data_order=order,
        )
        digest = publish(
            self,
            parent=parent,
            root=root,
            faults=SINGLE_FAULTS,
            extra_objects=((shard.digest, shard.data),),
        )
        return Generation.from_root(digest, root)

    # -- objects ----------------------------------------------------------

    def read_object(self, digest: bytes, *, expect: str, **where: Any) -> Any:
        """Read, verify and decode one manifest object."""
        data = self.backend.get(Namespace.OBJECTS, digest)
        if data is None:
            raise ObjectMissingError(f"{expect} object {digest.hex()[:16]} is missing", **where)
        actual = digest_bytes(data)
        if actual != digest:
            raise ChecksumMismatchError(
                f"{expect} object is damaged", expected=digest.hex(), actual=actual.hex(), **where
            )
        try:
            return decode_object(data, expect=expect)
        except (CorruptObjectError, FormatVersionError) as exc:
            raise type(exc)(f"{expect} object {digest.hex()[:16]}: {exc}", **where) from exc

    def read_root(self, digest: Digest, *, run: str) -> GenerationRoot:
        root: GenerationRoot = self.read_object(digest.raw, expect=TYPE_ROOT, run=run)
        if root.run != run:
            raise CorruptObjectError(f"root {digest.short} belongs to run {root.run!r}", run=run)
        return root

    def read_shards(self, root: GenerationRoot) -> list[ShardManifest]:
        where = {"run": root.run, "generation": root.generation}
        if len(root.shards) != root.world_size:
            raise CorruptObjectError(
                f"root says {root.world_size} rank(s) wrote it but lists "
                f"{len(root.shards)} shard manifest(s)",
                **where,
            )
        shards: list[ShardManifest] = []
        for index, digest in enumerate(root.shards):
            shard: ShardManifest = self.read_object(digest, expect=TYPE_SHARD, shard=index, **where)
            if shard.run != root.run or shard.generation != root.generation:
                raise CorruptObjectError(
                    f"shard {index} belongs to {shard.run}@{shard.generation}", **where
                )
            if shard.rank != index:
                raise CorruptObjectError(
                    f"shard {index} is rank {shard.rank}'s manifest (listed twice or out of "
                    "rank order)",
                    **where,
                )
            shards.append(shard)
        return shards

    def tensor_entries(
        self, root: GenerationRoot, shards: list[ShardManifest] | None = None
    ) -> dict[str, list[TensorEntry]]:
        """Every global tensor of a generation: name -> the distinct boxes that make it up."""
        where = {"run": root.run, "generation": root.generation}
        return group_entries(self.read_shards(root) if shards is None else shards, where)

    # -- resolving generations ---------------------------------------------

    def runs(self) -> list[str]:
        return self.refs.runs()

    def _latest(self, run: str) -> RefValue:
        ref = self.refs.read(run)
        if ref is None:
            self._check_not_lost(run)
            raise self._no_generations(run)
        return ref

    def _no_generations(self, run: str) -> GenerationNotFoundError:
        """``run`` has no generations; in a store with no runs at all, say the store is empty.

        ``castore.open`` creates a store at a mistyped path: an empty store is the
        likelier cause than a missing run, and the message should say so.
        """
        if self.refs.runs():
            return GenerationNotFoundError(f"run {run!r} has no generations", run=run)
        return GenerationNotFoundError(
            f"run {run!r} has no generations: the store at {self.path} is empty "
            "(castore.open created it just now? pass create=False to open only existing "
            "stores)",
            run=run,
        )

    def _check_not_lost(self, run: str) -> None:
        """A run without a ref but with history lost its ref: damage, not an empty run."""
        listed, _ = self.logged(run)
        if listed or run in self.refs.runs():
            raise LostRunError(
                f"run {run!r} has history ({len(listed)} published generation(s) in its "
                f"reflog) but its ref file refs/{run} is missing: load a generation by id or "
                "with fallback='previous', or run `castore repair` to restore the ref",
                run=run,
            )

    def logged(self, run: str) -> tuple[dict[str, int], set[str]]:
        """From the reflog: root hex -> id of every published, uncollected generation,
        and the root hexes garbage collection dropped (copies: the caller may change them)."""
        view = self.refs.reflog_view(run)
        return dict(view.listed), set(view.collected)

    def published(self, run: str, *, tolerate_bad_ref: bool = False) -> dict[str, int]:
        """Root hex -> generation id of every published, uncollected generation (by the log).

        The reflog records each ref advance and each generation garbage
        collection dropped; the ref itself is always included.
        """
        listed, _ = self.logged(run)
        try:
            latest = self._latest(run)
        except CastoreError:
            if not listed or not tolerate_bad_ref:
                raise
            return listed  # a damaged ref: the log still names what was published
        listed[latest.root.hex] = latest.generation
        return listed

    def iter_chain(self, run: str) -> Iterator[tuple[Digest, GenerationRoot]]:
        """Roots of ``run`` still stored, from the newest back to the oldest, read lazily.

        The ref and the reflog's published generations, joined with the parent
        links of each root (so a lost log line hides nothing the chain still
        reaches), minus what garbage collection dropped. A listed root that is
        missing is damage: this fails closed. The log is read from its end and
        only the roots yielded (and a few parents) are read, so the newest few
        cost the same however long the history.
        """
        latest = self._latest(run)
        stream = self.refs.published_newest_first(run)
        listed = itertools.chain([(latest.root.hex, latest.generation)], stream)
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
                    root = self.read_root(digest, run=run)
                except ObjectMissingError:
                    if hex_digest in from_chain and hex_digest in self.logged(run)[1]:
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

    def resolve_root(
        self, run: str, generation: GenerationSpec = "latest"
    ) -> tuple[Digest, GenerationRoot]:
        """Find one generation: ``"latest"``, an id (int or digits), a tag name or a root
        hex prefix (an exact tag name wins over a prefix; digits are always an id)."""
        validate_run_name(run)
        named = None
        if generation == "latest":
            named = self._latest(run)
        elif isinstance(generation, str) and not generation.isdigit():
            named = self.refs.tag(run, generation)
        if named is not None:
            root = self.read_root(named.root, run=run)
            if root.generation != named.generation:
                what = "ref" if generation == "latest" else f"tag {generation!r}"
                raise CorruptObjectError(
                    f"{what} names generation {named.generation}, its root says {root.generation}",
                    run=run,
                )
            return named.root, root
        wanted_id, prefix = _parse_generation(generation)
        if wanted_id is not None:
            # The log names most generations directly: read only that root.
            for hex_digest, listed_id in self.published(run, tolerate_bad_ref=True).items():
                if listed_id == wanted_id:
                    digest = Digest.from_hex(hex_digest)
                    root = self.read_root(digest, run=run)
                    if root.generation == wanted_id:
                        return digest, root
        if prefix:
            matches = [
                h for h in self.published(run, tolerate_bad_ref=True) if h.startswith(prefix)
            ]
            if len(matches) > 1:
                raise GenerationNotFoundError(
                    f"root prefix {prefix!r} is ambiguous in run {run!r}: use more digits",
                    run=run,
                )
            if len(matches) == 1:
                digest = Digest.from_hex(matches[0])
                return digest, self.read_root(digest, run=run)
        by_prefix: list[tuple[Digest, GenerationRoot]] = []
        for digest, root in self.iter_chain(run):
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

    def resolve(self, run: str, generation: GenerationSpec = "latest") -> Generation:
        return Generation.from_root(*self.resolve_root(run, generation))

    def generations(self, run: str, *, last: int | None = None) -> list[Generation]:
        """Every stored generation of ``run``, oldest first; ``last=N``: only the newest N.

        ``last`` reads only the roots it returns, so it costs the same however
        long the run's history.
        """
        validate_run_name(run)
        if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 0):
            raise ValueError(f"last must be a count of generations (an int >= 0), not {last!r}")
        chain = self.iter_chain(run)
        if last is not None:
            chain = itertools.islice(chain, last)
        return [Generation.from_root(d, r) for d, r in chain][::-1]

    # -- load -------------------------------------------------------------

    def candidates(self, run: str, below: int | None = None) -> list[tuple[int, Digest]]:
        """Generations a fallback may try, newest first: (id, root digest).

        From the ref and the reflog, without reading a root, so a damaged ref
        or root does not hide the generations before it. ``below``: only ids
        up to it.
        """
        validate_run_name(run)
        listed, _ = self.logged(run)
        try:
            latest = self.refs.read(run)
        except CastoreError:
            latest = None  # a damaged ref: the log still names what was published
        if latest is not None:
            listed[latest.root.hex] = latest.generation
        if not listed:
            raise self._no_generations(run)
        found = [(g, Digest.from_hex(h)) for h, g in listed.items() if below is None or g <= below]
        # Newest first; for one id, the root the ref names (the commit point) first.
        ref_root = latest.root.hex if latest is not None else None
        return sorted(found, key=lambda item: (-item[0], item[1].hex != ref_root))

    def ref_problem(self, run: str) -> list[Skipped]:
        """A damaged ref as a skipped entry, so a fallback past it is never silent."""
        try:
            self.refs.read(run)
        except CastoreError as exc:
            return [Skipped(0, "ref", type(exc).__name__, str(exc))]
        return []

    def restore(
        self,
        run: str,
        generation: GenerationSpec = "latest",
        *,
        framework: str = "numpy",
        fallback: str | None = None,
        progress: bool = False,
    ) -> Restored:
        """Like :meth:`load`, and says what it loaded, what it skipped and how long it took.

        ``fallback="previous"`` walks back from ``generation`` through the run's
        history to the newest generation that fully validates (every object and
        chunk verified), reporting each one skipped and why. The default fails
        closed: the first problem raises.
        """
        _check_framework(framework)
        if fallback not in (None, "previous"):
            raise ValueError(f"fallback must be None or 'previous', got {fallback!r}")
        if fallback is None:
            digest, root = self.resolve_root(run, generation)
            return self._restore_root(run, digest, root, framework, [], progress)
        below = None
        if generation != "latest":
            below = self.resolve(run, generation).id if not _is_id(generation) else int(generation)
        skipped = self.ref_problem(run) if generation == "latest" else []
        for gen_id, digest in self.candidates(run, below):
            try:
                root = self.read_root(digest, run=run)
                if root.generation != gen_id:
                    raise CorruptObjectError(
                        f"the log names generation {gen_id}, its root says {root.generation}",
                        run=run,
                    )
                return self._restore_root(run, digest, root, framework, skipped, progress)
            except IntegrityError as exc:
                skipped.append(Skipped(gen_id, digest.hex, type(exc).__name__, str(exc)))
        listed = "; ".join(f"{s.generation}: {s.error}" for s in skipped)
        raise NoValidGenerationError(
            f"no generation of run {run!r} validates (skipped {listed})", run=run
        )

    def _restore_root(
        self,
        run: str,
        digest: Digest,
        root: GenerationRoot,
        framework: str,
        skipped: list[Skipped],
        progress: bool = False,
    ) -> Restored:
        clock = time.perf_counter()
        timings: dict[str, float] = {}
        shards = self.read_shards(root)
        entries = self.tensor_entries(root, shards)
        timings["metadata"] = time.perf_counter() - clock
        clock = time.perf_counter()
        state = self._load_root(run, root, shards, entries, framework, progress)
        timings["read_verify"] = time.perf_counter() - clock
        return Restored(state, Generation.from_root(digest, root), list(skipped), timings)

    def load(
        self,
        run: str,
        generation: GenerationSpec = "latest",
        *,
        framework: str = "numpy",
        fallback: str | None = None,
        progress: bool = False,
    ) -> Any:
        """Rebuild the state saved as ``run@generation``; every byte is verified first.

        ``framework`` picks the array type of every tensor: ``"numpy"`` (works
        without torch), ``"torch"``, or ``"auto"``: each as it was saved.
        ``fallback="previous"`` loads the newest generation at or before it that
        validates, with a warning naming each one skipped (:meth:`restore`
        returns them). ``progress=True`` shows a bar of the tensor bytes read
        and verified on stderr when it is a terminal (see :mod:`castore.progress`).
        """
        restored = self.restore(
            run, generation, framework=framework, fallback=fallback, progress=progress
        )
        if restored.skipped:
            warnings.warn(
                f"castore: loaded {run}@{restored.generation.id} after skipping "
                + "; ".join(f"{s.generation} ({s.error}: {s.reason})" for s in restored.skipped),
                FallbackWarning,
                stacklevel=2,
            )
        return restored.state

    def _load_root(
        self,
        run: str,
        root: GenerationRoot,
        shards: list[ShardManifest],
        entries: dict[str, list[TensorEntry]],
        framework: str,
        progress: bool = False,
    ) -> Any:
        where: dict[str, Any] = {"run": run, "generation": root.generation}
        # Every tensor is planned first, then all are read in one go: one read
        # transaction and one set of pack maps, each shared chunk verified once.
        requests: list[ChunkRequest] = []
        tensors = {
            name: self.plan_tensor(boxes, _framework_for(boxes[0], framework), where, requests)
            for name, boxes in entries.items()
        }
        per_rank: dict[str, dict[int, Any]] = {}
        total = 0
        if progress_wanted(progress):  # counting costs a pass over the requests: only for a bar
            local_bytes = sum(e.nbytes for shard in shards for e in shard.local_tensors)
            total = request_bytes(requests) + local_bytes
        with progress_bar(progress, f"load {run}@{root.generation}", total) as bar:
            read_requests(self.backend, requests, self.read_counters, where, bar)
            for shard in shards:
                for path in decode_local_state(shard.local_state):
                    value = self.load_rank_local(shard, path, framework, where, bar)
                    per_rank.setdefault(path, {})[shard.rank] = value

        def lookup(name: str, _saved_framework: str) -> Any:
            if name not in tensors:
                raise CorruptObjectError(
                    f"state refers to tensor {name!r}, no shard holds it", **where
                )
            return tensors[name]

        def rank_local(path: str) -> dict[int, Any]:
            # Without a process group there is no "this rank": give every rank's value.
            return per_rank.get(path, {})

        return decode_tree(root.state, lookup, rank_local)

    def load_rank_local(
        self,
        shard: ShardManifest,
        path: str,
        framework: str,
        where: dict[str, Any],
        bar: Bar = NO_BAR,
    ) -> Any:
        """Rebuild one RankLocal value of the rank that wrote ``shard``."""
        skeletons = decode_local_state(shard.local_state)
        if path not in skeletons:
            raise CorruptObjectError(
                f"rank {shard.rank} has no per-rank value at {path!r}", rank=shard.rank, **where
            )
        boxes = {entry.name: entry for entry in shard.local_tensors}

        def lookup(name: str, _saved_framework: str) -> Any:
            entry = boxes.get(name)
            if entry is None:
                raise CorruptObjectError(
                    f"per-rank tensor {name!r} of rank {shard.rank} is not in its shard", **where
                )
            return self.read_tensor([entry], _framework_for(entry, framework), where, bar)

        return decode_tree(skeletons[path], lookup)

    def read_tensor(
        self,
        boxes: list[TensorEntry],
        framework: str,
        where: dict[str, Any],
        bar: Bar = NO_BAR,
    ) -> Any:
        """A new tensor holding the saved boxes of one tensor, every chunk verified."""
        requests: list[ChunkRequest] = []
        tensor = self.plan_tensor(boxes, framework, where, requests)
        read_requests(self.backend, requests, self.read_counters, where, bar)
        return tensor

    def plan_tensor(
        self,
        boxes: list[TensorEntry],
        framework: str,
        where: dict[str, Any],
        requests: list[ChunkRequest],
    ) -> Any:
        """A new, unfilled tensor for ``boxes``; the reads that fill it go on ``requests``."""
        first = boxes[0]
        if len(boxes) == 1 and first.local_shape == first.shape:
            # One box the size of the tensor covers it exactly: the entry's own
            # check put the box inside the shape. The common case, made cheap
            # for states of many small tensors.
            tensor, flat = _allocate(first.dtype, first.shape, framework)
            place = _place_whole(first, flat)
            requests += [ChunkRequest(first, i, place) for i in range(len(first.chunks))]
            return tensor
        check_coverage(boxes, where)  # before allocating: the boxes must add up to the shape
        tensor, flat = _allocate(first.dtype, first.shape, framework)
        whole = Box.whole(first.shape)
        for entry in boxes:
            requests += box_requests(entry, Box(entry.offsets, entry.local_shape), whole, flat)
        return tensor

    def read_slice(
        self,
        run: str,
        generation: GenerationSpec,
        name: str,
        index: Any,
        *,
        framework: str = "numpy",
    ) -> Any:
        """Return ``tensor[index]`` of one saved tensor, reading only the chunks it overlaps."""
        from castore.layout import normalize_index

        _check_framework(framework)
        digest, root = self.resolve_root(run, generation)
        boxes = self.tensor_entries(root).get(name)
        where = {"run": run, "generation": root.generation, "tensor": name}
        if not boxes:
            raise TensorNotFoundError(f"no tensor {name!r} in {run}@{root.generation}", **where)
        shape, dtype = boxes[0].shape, boxes[0].dtype
        check_coverage(boxes, where)  # no region of the result may be left unwritten
        box, selector = normalize_index(index, shape)
        out, flat = _allocate(dtype, box.shape, "numpy")
        requests: list[ChunkRequest] = []
        for entry in boxes:
            region = box.intersect(Box(entry.offsets, entry.local_shape))
            if region is not None and region.numel:
                requests += box_requests(entry, region, box, flat)
        read_requests(self.backend, requests, self.read_counters, where)
        result = out[selector]
        if framework == "torch":
            return numpy_as_torch(result, dtype)
        return result


ChunkDelivery = Callable[[int, np.ndarray], None]


def box_transfer(
    entry: TensorEntry, region: Box, dst_box: Box, dst_flat: np.ndarray
) -> tuple[Sequence[int] | np.ndarray, ChunkDelivery]:
    """Which chunks of a saved box hold ``region``, and how each lands in a destination.

    ``dst_flat`` is the flat byte buffer of the box ``dst_box`` (global
    coordinates); ``region`` lies inside both boxes.
    """
    entry_box = Box(entry.offsets, entry.local_shape)
    if region == entry_box == dst_box:
        return range(len(entry.chunks)), _place_whole(entry, dst_flat)
    plan = plan_copy(
        entry.local_shape,
        region.relative_to(entry_box),
        dst_box.shape,
        region.relative_to(dst_box),
        dtypes.numpy_dtype(entry.dtype).itemsize,
    )

    def scatter(index: int, chunk: np.ndarray) -> None:
        plan.copy_from_chunk(index * entry.chunk_size, chunk, dst_flat)

    return plan.chunk_indices(entry.chunk_size), scatter


def _place_whole(entry: TensorEntry, dst_flat: np.ndarray) -> ChunkDelivery:
    """Delivery into a buffer that is the saved box's own: chunk i lands at i*chunk_size."""
    chunk_size = entry.chunk_size

    def place(index: int, chunk: np.ndarray) -> None:
        at = index * chunk_size
        dst_flat[at : at + chunk.size] = chunk

    return place


def box_requests(
    entry: TensorEntry, region: Box, dst_box: Box, dst_flat: np.ndarray
) -> list[ChunkRequest]:
    """The chunk reads that copy ``region`` of a saved box into a destination (box_transfer)."""
    indices, deliver = box_transfer(entry, region, dst_box, dst_flat)
    return [ChunkRequest(entry, int(i), deliver) for i in indices]


def _is_id(spec: GenerationSpec) -> bool:
    return isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit())


def _parse_generation(spec: GenerationSpec) -> tuple[int | None, str | None]:
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


def _check_framework(framework: str) -> None:
    if framework not in ("numpy", "torch", "auto"):
        raise ValueError(f"framework must be 'numpy', 'torch' or 'auto', got {framework!r}")


def _framework_for(entry: TensorEntry, requested: str) -> str:
    """``auto`` gives each tensor back as the kind of array it was saved from."""
    if requested != "auto":
        return requested
    return "torch" if entry.framework == "torch" else "numpy"


def _allocate(dtype: str, shape: tuple[int, ...], framework: str) -> tuple[Any, np.ndarray]:
    """A new tensor and a flat uint8 view of its memory.

    Callers check the saved boxes' coverage first, so the size is one the
    manifest's chunks account for; this process may still lack the memory.
    """
    try:
        if framework == "torch":
            import torch

            tensor = torch.empty(shape, dtype=dtypes.torch_dtype(dtype))
            return tensor, torch_bytes(tensor)
        array = np.empty(shape, dtype=dtypes.numpy_dtype(dtype))
        return array, array.reshape(-1).view(np.uint8)
    except (MemoryError, RuntimeError) as exc:  # torch reports a failed allocation as RuntimeError
        raise AllocationError(
            f"cannot allocate a {dtype} tensor of shape {list(shape)}: {exc}",
        ) from exc


def numpy_as_torch(array: np.ndarray, dtype: str) -> Any:
    """A torch tensor sharing ``array``'s bytes (a copy only if it is not contiguous).

    Goes through uint8 because torch cannot take numpy's bfloat16/float8 types.
    """
    import torch

    raw = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return raw.view(dtypes.torch_dtype(dtype)).reshape(array.shape)
