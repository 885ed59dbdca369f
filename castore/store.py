"""The ``Store`` facade: save, load, list and slice generations.

A store is a directory::

    castore.json    store marker: format name and version, default chunk size
    chunks/         the LMDB environment (chunk index and objects); chunks/packs/ the bytes
    refs/RUN        one self-checking ref per run (the commit point)
    logs/RUN.reflog every ref advance, one checksummed JSON line each
    locks/RUN.lock  flock target for compare-and-swap ref advances

Write order (invariant 1): chunks committed, then manifest objects committed,
then the ref advanced (:mod:`castore.core.commit`). Reads live in
:mod:`castore.core.reading`, a run's published generations in
:mod:`castore.core.history`; the methods here delegate to them. This module knows
nothing of torch; tensors from torch are handled by :mod:`castore.format.tree`,
which imports torch only when it sees one.

One idea, about 770 lines because ``Store`` is the public handle: each documented
method (save and its ``@overload`` set, load, slices, history, tags, close) keeps its
signature and docstring here, while the work is in ``core/``.
"""

from __future__ import annotations

import operator
import reprlib
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, overload

from castore.blob.counting import BlobRequests
from castore.chunkstore.base import ChunkBackend
from castore.core import fencing, history, reading
from castore.core.background import (
    Background,
    OnPublish,
    PendingSave,
    follow_publish,
    save_async,
)
from castore.core.chunkread import ReadCounters
from castore.core.commit import (
    SINGLE_FAULTS,
    TierHooks,
    check_data_order,
    claim_writer,
    encode_metadata,
    framework_versions,
    publish_single,
    write_shard,
)
from castore.core.history import Generation, GenerationSpec, SaveStats, Skipped
from castore.core.reading import (
    ChunkDelivery,
    box_requests,
    box_transfer,
    check_framework,
    numpy_as_torch,
)
from castore.core.readplan import ReadPlan
from castore.core.saveoptions import SaveKeywords, SaveOptions
from castore.core.unchanged import VersionCache
from castore.errors import (
    CastoreError,
    CorruptObjectError,
    FallbackWarning,
    IntegrityError,
    StoreError,
    UnsupportedValueError,
)
from castore.format.hashing import Digest
from castore.format.objects import GenerationRoot, ShardManifest, TensorEntry
from castore.format.tree import EncodedTree, encode_state, layouts_of
from castore.repo.base import LockHold
from castore.repo.local import RefStore
from castore.repo.records import RefValue, validate_run_name
from castore.repo.refstore import ComposedRefStore
from castore.support.progress import NO_BAR, Bar
from castore.support.readonly import ReadOnly

if TYPE_CHECKING:
    from typing_extensions import Unpack

# Some of these now live in castore.core.reading, castore.core.history and castore.core.commit;
# they are re-exported so that importers of castore.store keep finding them.
__all__ = [
    "ChunkDelivery",
    "FallbackWarning",
    "Generation",
    "GenerationSpec",
    "Restored",
    "SaveStats",
    "Skipped",
    "Store",
    "annotate_interrupt",
    "box_requests",
    "box_transfer",
    "check_step",
    "encode_metadata",
    "framework_versions",
    "numpy_as_torch",
]


class StoreSaveKeywords(SaveKeywords, total=False):
    """:meth:`Store.save`'s keywords besides ``run``, ``step`` and ``blocking``."""

    data_order: dict[str, Any] | None
    progress: bool
    on_publish: OnPublish | None


@dataclass
class Restored:
    """What :meth:`Store.restore` loaded."""

    state: Any
    generation: Generation
    skipped: list[Skipped]
    timings: dict[str, float]
    # Bytes each tier served this restore (castore.tiers: "fast", "durable").
    sources: dict[str, int] = field(default_factory=dict)


def annotate_interrupt(interrupt: KeyboardInterrupt, note: str) -> None:
    """Put ``note`` in the interrupt's message, keeping its type and traceback.

    The message, not ``add_note`` (Python 3.11+): Ctrl-C's interrupt has none,
    and the traceback's last line then says what the save left.
    """
    message = " ".join(str(arg) for arg in interrupt.args)
    interrupt.args = (f"{message}; {note}" if message else note,)


MAX_STEP = (1 << 63) - 1  # a root's step is an int64 (msgpack and every reader's int)


def check_step(step: Any) -> int:
    """A generation's ``step`` as an int: a non-negative integer that fits int64.

    Anything ``operator.index`` takes is an integer (an int, ``np.int64``, a 0-d
    integer tensor: what a training loop's counter often is); bools, floats and
    arrays of more than one dimension are refused. Every save path calls this.
    """
    dtype, ndim = str(getattr(step, "dtype", "")), getattr(step, "ndim", 0)
    if isinstance(step, bool) or dtype in ("bool", "torch.bool") or ndim != 0:
        raise _not_a_step(step)  # True would pass operator.index as 1
    try:
        value = operator.index(step)
    except TypeError:
        raise _not_a_step(step) from None
    if not 0 <= value <= MAX_STEP:
        raise ValueError(f"step must be a non-negative int64 (0 to 2**63-1), got {value}")
    return value


def _not_a_step(step: Any) -> TypeError:
    # Built only when refusing: the repr of a large array costs, and a save never needs it.
    return TypeError(
        "step must be an integer (an int, a NumPy integer or a 0-d integer tensor), "
        f"got {type(step).__name__} {reprlib.repr(step)}"
    )


def digests_of(shard: ShardManifest) -> set[bytes]:
    """Every chunk a shard names (what a changed-chunk save after it need not stage)."""
    return set(shard.chunk_digests())


class Store(TierHooks):
    """A castore store on disk. Use :func:`castore.open` to get one.

    Its tier hooks (:class:`~castore.core.commit.TierHooks`) do nothing;
    castore.tiers.TieredStore overrides them.
    """

    def __init__(
        self,
        path: Path | str,
        backend: ChunkBackend,
        chunk_size: int,
        *,
        refs: ComposedRefStore | None = None,
        readonly: ReadOnly | None = None,
        blob_requests: Callable[[], BlobRequests] | None = None,
        codec: str = "none",
    ) -> None:
        """A store over ``backend`` (chunks, objects) and ``refs`` (refs, reflog, tags,
        locks; default: those of the directory ``path``). ``path`` also names the
        store in messages: a local directory, or the URL of a store on blobs.
        ``readonly`` (why it is read-only) refuses every write (castore.support.readonly).
        ``blob_requests``: the counts of the blob store under a store on blobs."""
        self.path: Path | str = path
        self._blob_requests = blob_requests
        self.readonly_reason = readonly
        self.backend = backend
        self.chunk_size = chunk_size
        # How this handle's saves encode new chunks (castore.format.codec): the store
        # marker's setting unless castore.open was given another; a save may override it.
        self.codec = codec
        self.refs = RefStore(Path(path)) if refs is None else refs
        self.read_counters = ReadCounters()
        self._open_lock: weakref.finalize | None = None
        self._background: Background | None = None
        self._closed = False
        # What trusting saves (trust_versions=True) of this handle wrote, per tensor.
        self.versions = VersionCache()

    def blob_requests(self) -> BlobRequests:
        """The requests this handle made to its blobs since it was opened (a store on S3
        or a shared directory: castore.blob.counting); none for a local store."""
        return BlobRequests() if self._blob_requests is None else self._blob_requests()

    @property
    def readonly(self) -> bool:
        """Whether this handle refuses writes (opened read-only; see :func:`castore.open`)."""
        return self.readonly_reason is not None

    def refuse_if_closed(self) -> None:
        """Raise StoreError if :meth:`close` was called (an async save would never start)."""
        if self._closed:
            raise StoreError(
                "this store handle is closed: open the store again (castore.open)",
                path=str(self.path),
            )

    def refuse_if_readonly(self, what: str, hint: str = "") -> None:
        """Raise ReadOnlyStoreError naming ``what`` ("save") if this handle is read-only."""
        if self.readonly_reason is not None:
            raise self.readonly_reason.refuse(what, hint)

    @property
    def background(self) -> Background:
        """This handle's async saves: the one in flight, staging buffers, counters."""
        if self._background is None:
            self._background = Background(str(self.path))
        return self._background

    # -- lifecycle --------------------------------------------------------

    def hold_open_lock(self, hold: LockHold) -> None:
        """Keep ``hold`` (the shared open lock, see castore.gc.compact) until :meth:`close`.

        A Store dropped unclosed (a notebook cell run again rebinds it) lets go of
        the lock too, or compact would be refused until the process exits.
        """
        self._open_lock = weakref.finalize(self, hold.release)
        self._open_lock.atexit = False

    def close(self) -> None:
        """Close this handle; other Stores open on the same path are unaffected.

        A save in flight is waited for first; an async save's error that nobody
        has seen is raised once the handle is closed.
        """
        background = self._background
        if background is not None and (current := background.in_flight()) is not None:
            current.wait()
        self._closed = True
        self.backend.close()
        if self._open_lock is not None:
            self._open_lock()  # releases the shared open lock, once
        if background is not None:
            background.stop_writer()
            background.pool.clear()
            background.raise_unobserved()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<castore.Store {str(self.path)!r}>"

    # -- save -------------------------------------------------------------

    @overload
    def save(
        self,
        state: Any,
        *,
        run: str,
        step: SupportsIndex,
        blocking: Literal[True] = True,
        **keywords: Unpack[StoreSaveKeywords],
    ) -> Generation: ...

    @overload
    def save(
        self,
        state: Any,
        *,
        run: str,
        step: SupportsIndex,
        blocking: Literal[False],
        **keywords: Unpack[StoreSaveKeywords],
    ) -> PendingSave: ...

    def save(
        self,
        state: Any,
        *,
        run: str,
        step: SupportsIndex,
        blocking: bool = True,
        **keywords: Unpack[StoreSaveKeywords],
    ) -> Generation | PendingSave:
        """Save ``state`` as the next generation of ``run`` and publish it atomically.

        ``data_order`` (a map of plain values) is recorded in the root; see
        ``docs/FORMAT.md``. ``progress=True`` shows a bar of the tensor bytes
        on stderr when it is a terminal (see :mod:`castore.support.progress`).

        ``blocking=False`` returns a :class:`~castore.PendingSave` as soon as the
        state is snapshotted; the caller may then change it freely, and a
        background thread writes and publishes it (:mod:`castore.core.background`).
        ``if_busy`` (``"wait"`` or ``"skip"``) says what an async save does while
        another is in flight; ``async_options`` (:class:`~castore.AsyncOptions`)
        bounds staging memory and paces the write. A blocking save waits for
        a save in flight. Either kind first raises an earlier async save's
        error that nobody has seen.

        ``trust_versions=True`` (blocking saves) neither hashes nor writes a CPU
        torch tensor that this handle saved before for ``run`` and whose version
        counter has not moved since: safe only when tensors change through
        PyTorch operations, see :mod:`castore.core.unchanged`. By default every
        byte is hashed.

        ``codec`` encodes this save's new chunks (``"none"``, ``"auto"``,
        ``"zstd"``, ``"bytegroup"``; see :mod:`castore.format.codec`) instead of
        the handle's setting (:attr:`codec`, from :func:`castore.open` or the
        store's marker).

        ``on_publish(generation)`` runs right after the ref advanced: before a
        blocking save returns, and on the writer thread before an async save's
        handle is done, so what it writes (a framework's pointer file, a tag)
        keeps up with what is published even if the process dies later. Its
        error is raised (by ``result()``, async) with the generation published.
        """
        started = time.perf_counter()
        self.refuse_if_closed()
        self.refuse_if_readonly("save")
        validate_run_name(run)
        step = check_step(step)
        data_order = keywords.pop("data_order", None)
        progress = keywords.pop("progress", False)
        on_publish = keywords.pop("on_publish", None)
        options = SaveOptions.of("save", blocking, keywords)
        if blocking:
            self.background.before_blocking_save()
            encoded, metadata_bytes, order = self._encode_for_save(state, options, data_order)
            generation = self._save_blocking(
                encoded, run, step, metadata_bytes, order, started, progress, options
            )
            if (
                on_publish is not None
                and (error := follow_publish(on_publish, generation, run)) is not None
            ):
                raise error
            return generation
        with self.background.turn(options.if_busy) as ours:
            if not ours:
                return self.background.skip(run, step)
            encoded, metadata_bytes, order = self._encode_for_save(state, options, data_order)
            # Refused now, not on the writer thread, when this process may not save
            # the run (castore.core.fencing); the writer checks again before it publishes.
            claim_writer(self, run, self.refs.read(run), step, warn=False)
            try:
                return save_async(
                    self,
                    encoded,
                    PendingSave(run, step, started=started, on_publish=on_publish),
                    metadata_bytes,
                    order,
                    options.async_options,
                    options.codec or self.codec,
                )
            except KeyboardInterrupt as interrupt:
                annotate_interrupt(interrupt, self.staging_interrupted_note(run))
                raise

    @staticmethod
    def _encode_for_save(
        state: Any, options: SaveOptions, data_order: dict[str, Any] | None
    ) -> tuple[EncodedTree, bytes, dict[str, Any]]:
        """The state, metadata and data order as a save writes them (none of it yet)."""
        encoded = encode_state(state, defer_device=not options.blocking)
        for leaf in encoded.leaves:
            # A block that is the whole tensor (a DTensor on a one-rank mesh) is the tensor.
            if leaf.sharded and leaf.local_shape != leaf.shape:
                raise UnsupportedValueError(
                    f"{leaf.name} is one rank's block (a castore.Shard or a DTensor): save "
                    "sharded state with castore.dist.save",
                    key_path=leaf.name,
                )
        return encoded, encode_metadata(options.metadata), check_data_order(data_order)

    def _save_blocking(
        self,
        encoded: Any,
        run: str,
        step: int,
        metadata_bytes: bytes,
        order: dict[str, Any],
        started: float,
        progress: bool,
        options: SaveOptions,
    ) -> Generation:
        before = self.ref_or_problem(run)
        try:
            with self.save_lock():
                return self._save_locked(
                    encoded, run, step, metadata_bytes, order, started, progress, options
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

    def staging_interrupted_note(self, run: str) -> str:
        """What an async save of ``run`` interrupted before it returned left.

        Cut short while staging, it never commits (its writer aborts or never
        starts): the ref now is the ref it found, so no save pays a ref read.
        """
        current = self.background.in_flight()
        if current is not None and current.run == run:
            return (
                f"castore: save of run {run!r} interrupted as it returned: step "
                f"{current.step} is staged and publishes in the background (exit waits for it)"
            )
        return self.interrupted_note(run, self.ref_or_problem(run))

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
        options: SaveOptions,
    ) -> Generation:
        parent = self.refs.read(run)
        generation = parent.generation + 1 if parent else 1
        writer = claim_writer(self, run, parent, step)
        shard = write_shard(
            self,
            encoded,
            run=run,
            generation=generation,
            rank=0,
            progress=progress,
            versions=self.versions if options.trust_versions else None,
            codec=options.codec,
        )
        self.background.remember(digests_of(shard.manifest))  # for a changed-chunk save next
        digest, root = publish_single(
            self,
            shard,
            step=step,
            parent=parent,
            skeleton=encoded.skeleton,
            metadata=metadata_bytes,
            data_order=order,
            seconds=time.perf_counter() - started,
            held_seconds=None,
            faults=SINGLE_FAULTS,
            writer=writer,
            layouts=layouts_of(encoded),
        )
        return Generation.from_root(digest, root)

    def claim_run(self, run: str) -> None:
        """Make this process the owner of ``run`` from its next save.

        That save publishes under a new writer epoch, so every other writer's
        next save of the run fails with FencedError, and it may save a step
        below the run's latest (a restart from an earlier point on purpose).
        Not needed to resume a run: a process that loads it and saves on owns
        it from its first save (see castore.core.fencing). In a multi-rank job, call
        it on every rank; the coordinator's call is the one that counts.
        """
        validate_run_name(run)
        fencing.claim_run(self.refs, run)

    # -- objects ----------------------------------------------------------

    def read_object(self, digest: bytes, *, expect: str, **where: Any) -> Any:
        """Read, verify and decode one manifest object."""
        return reading.read_object(self.backend, digest, expect=expect, **where)

    def read_root(self, digest: Digest, *, run: str) -> GenerationRoot:
        return reading.read_root(self.backend, digest, run=run)

    def read_shards(self, root: GenerationRoot) -> list[ShardManifest]:
        return reading.read_shards(self.backend, root)

    def tensor_entries(
        self, root: GenerationRoot, shards: list[ShardManifest] | None = None
    ) -> Mapping[str, list[TensorEntry]]:
        """Every global tensor of a generation: name -> the distinct boxes that make it up
        (each tensor's entries built when it is first looked up)."""
        return reading.tensor_entries(self.backend, root, shards)

    # -- resolving generations (castore.core.history) --------------------------

    def runs(self) -> list[str]:
        return self.refs.runs()

    def logged(self, run: str) -> tuple[dict[str, int], set[str]]:
        """From the reflog: root hex -> id of every published, uncollected generation,
        and the root hexes garbage collection dropped (copies: the caller may change them)."""
        return history.logged(self, run)

    def published(self, run: str, *, tolerate_bad_ref: bool = False) -> dict[str, int]:
        """Root hex -> generation id of every published, uncollected generation (by the log)."""
        return history.published(self, run, tolerate_bad_ref=tolerate_bad_ref)

    def iter_chain(self, run: str) -> Iterator[tuple[Digest, GenerationRoot]]:
        """Roots of ``run`` still stored, from the newest back to the oldest, read lazily."""
        return history.iter_chain(self, run)

    def resolve_root(
        self, run: str, generation: GenerationSpec = "latest"
    ) -> tuple[Digest, GenerationRoot]:
        """Find one generation: ``"latest"``, an id (int or digits), a tag name or a root
        hex prefix (an exact tag name wins over a prefix; digits are always an id)."""
        return history.resolve_root(self, run, generation)

    def resolve(self, run: str, generation: GenerationSpec = "latest") -> Generation:
        return history.resolve(self, run, generation)

    def generations(self, run: str, *, last: int | None = None) -> list[Generation]:
        """Every stored generation of ``run``, oldest first; ``last=N``: only the newest N.

        ``last`` reads only the roots it returns, so it costs the same however
        long the run's history.
        """
        return history.generations(self, run, last=last)

    def candidates(self, run: str, below: int | None = None) -> list[tuple[int, Digest]]:
        """Generations a fallback may try, newest first: (id, root digest), no root read."""
        return history.candidates(self, run, below)

    def ref_problem(self, run: str) -> list[Skipped]:
        """A damaged ref as a skipped entry, so a fallback past it is never silent."""
        return history.ref_problem(self, run)

    # -- load -------------------------------------------------------------

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
        check_framework(framework)
        if fallback not in (None, "previous"):
            raise ValueError(f"fallback must be None or 'previous', got {fallback!r}")
        newest = fencing.newest_published(self.refs, run)  # before resolving: see fencing
        if fallback is None:
            digest, root = self.resolve_root(run, generation)
            return self._restore_root(digest, root, framework, [], progress, newest)
        below = None
        if generation != "latest":
            below = (
                self.resolve(run, generation).id
                if not history.is_id(generation)
                else int(generation)
            )
        skipped = self.ref_problem(run) if generation == "latest" else []

        def load(gen_id: int, digest: Digest) -> Restored:
            root = self.read_root(digest, run=run)
            if root.generation != gen_id:
                raise CorruptObjectError(
                    f"the log names generation {gen_id}, its root says {root.generation}",
                    run=run,
                )
            return self._restore_root(digest, root, framework, skipped, progress, newest)

        def is_damage(exc: Exception) -> bool:
            return isinstance(exc, IntegrityError)

        return history.fall_back(run, self.candidates(run, below), load, is_damage, skipped)

    def _restore_root(
        self,
        digest: Digest,
        root: GenerationRoot,
        framework: str,
        skipped: list[Skipped],
        progress: bool = False,
        newest: int | None = None,
    ) -> Restored:
        clock = time.perf_counter()
        timings: dict[str, float] = {}
        shards = self.read_shards(root)
        entries = self.tensor_entries(root, shards)
        timings["metadata"] = time.perf_counter() - clock
        clock = time.perf_counter()
        state = reading.load_state(
            self.backend, self.read_counters, root, shards, entries, framework, progress
        )
        timings["read_verify"] = time.perf_counter() - clock
        fencing.record_loaded(
            self.refs, root.run, digest, root.step, generation=root.generation, newest=newest
        )
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
        without torch), ``"torch"``, or ``"auto"``: each as it was saved. Each
        tensor is new and owns its memory; a torch tensor's is a numpy array's,
        so its storage cannot be resized in place (as safetensors').
        ``fallback="previous"`` loads the newest generation at or before it that
        validates, with a warning naming each one skipped (:meth:`restore`
        returns them). ``progress=True`` shows a bar of the tensor bytes read
        and verified on stderr when it is a terminal (see :mod:`castore.support.progress`).
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

    def load_rank_local(
        self,
        shard: ShardManifest,
        path: str,
        framework: str,
        where: dict[str, Any],
        bar: Bar = NO_BAR,
    ) -> Any:
        """Rebuild one RankLocal value of the rank that wrote ``shard``."""
        return reading.load_rank_local(
            self.backend, self.read_counters, shard, path, framework, where, bar
        )

    def read_tensor(
        self,
        boxes: list[TensorEntry],
        framework: str,
        where: dict[str, Any],
        bar: Bar = NO_BAR,
    ) -> Any:
        """A new tensor holding the saved boxes of one tensor, every chunk verified."""
        return reading.read_tensor(self.backend, self.read_counters, boxes, framework, where, bar)

    def plan_tensor(
        self,
        boxes: list[TensorEntry],
        framework: str,
        where: dict[str, Any],
        plan: ReadPlan,
    ) -> Any:
        """A new, unfilled tensor for ``boxes``; the reads that fill it go on ``plan``."""
        return reading.plan_tensor(boxes, framework, where, plan)

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
        check_framework(framework)
        _, root = self.resolve_root(run, generation)
        return reading.read_slice(
            self.backend, self.read_counters, root, name, index, framework=framework
        )
