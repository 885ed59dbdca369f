"""Tiers: a fast node-local store in front of a durable one, with the Store API.

``castore.open_tiered(fast=PATH, durable=STORE_OR_ADDRESS, ...)`` returns a
:class:`TieredStore`. Saves (``save``, ``castore.dist.save``,
``TrainState.save``, the DCP writer) publish in the fast tier, a local store
(``/dev/shm`` or NVMe), and never wait for the durable one. A generation the
policy selects (``durable_every`` generations, ``durable_every_s`` seconds, or
``promote(run, generation)``) is pinned in the fast tier and copied to the
durable tier in the background (by the uploader process, castore.tiers.uploader,
or on a thread), within ``durable_rate`` bytes per second: only the chunks
the durable store lacks, each verified as it is read, and published there
with the same root digest through the durable store's own publish sequence
(castore.copying.copy_generation). A promotion that fails
or is cut off leaves the durable store's previous generation as it was; its
pin stays, and the next handle (or the next save) retries it, sending only
what is still missing.

Retention is per tier and never crosses: the fast tier keeps its last
``fast_keep`` generations plus the pinned ones (collected on the background
thread after each save), the durable tier what ``durable_retention`` keeps
(after each promotion; None: never collected here). Each is its own store,
so a collection of one deletes nothing of the other.

Reads (``load``, ``restore``, ``read_slice``, ``castore.dist.load``) take
each chunk from the fast tier when it holds an intact copy and from the
durable tier otherwise (castore.chunkstore.tiered): a wiped or damaged fast
tier costs bandwidth, not the restore. A generation is looked up in the fast
tier's history, then in the durable one's. A fast tier behind the durable
one (a new node) takes the durable tier's newest generation of each run as
its own at open, root and manifests only, recorded as held elsewhere
(castore.core.holdings), so that the next save follows it and promotes.

On one node every process of a job opens the same ``fast`` path, and
promotions are started by the process that publishes (a dist job's
coordinator). A job on several nodes, each with a fast tier of its own, is
castore.tiers.nodes: each node holds its ranks' shards (and, with
``replicas=2``, its peer's), a restore reads each chunk from its node, a
peer node or the durable tier, and each node uploads its own shards.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import socket
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from castore.chunkstore.tiered import TieredChunkBackend
from castore.copying import copy_generation
from castore.core.background import Job
from castore.core.history import Generation, GenerationSpec
from castore.core.holdings import mark_elsewhere
from castore.errors import CastoreError, GenerationNotFoundError
from castore.format.hashing import Digest
from castore.format.objects import GenerationRoot
from castore.store import Restored, Store
from castore.support.safefs import make_store_dir, open_store_file
from castore.tiers.policy import PIN_PREFIX, PromotionSchedule, TierPolicy
from castore.tiers.promotion import Promoted
from castore.tiers.report import TierRow, recovery_points, tier_report
from castore.tiers.staged import StagedSender, StepPacer
from castore.tiers.worker import PromotionWorker

if TYPE_CHECKING:  # castore.dist imports torch, which importing castore must not
    from castore.tiers.nodes import NodeSession


@dataclass
class _NodeRole:
    """This process's part in a job on several nodes, from its last collective call."""

    leader: bool  # the lowest rank on its node: writes its node's records, uploads
    coordinator: bool  # publishes in the durable tier
    own: tuple[int, ...]  # the ranks on its node (whose shards it uploads)


class TieredStore(Store):
    """A fast store in front of a durable one (see the module docstring).

    ``fast`` and ``durable`` are the two Stores; ``promoted`` lists this
    handle's promotions in order; ``served_bytes`` counts the bytes each tier
    served to reads ("fast", "durable").
    """

    def __init__(
        self,
        fast: Store,
        durable: Store,
        policy: TierPolicy,
        uploader: dict[str, Any] | None = None,
        node: str | None = None,
    ) -> None:
        backend = TieredChunkBackend(fast.backend, [("durable", durable.backend)])
        super().__init__(
            fast.path, backend, fast.chunk_size, refs=fast.refs, readonly=fast.readonly_reason
        )
        self.fast = fast
        self.durable = durable
        self.policy = policy
        self.tiered_backend = backend
        self._schedule = PromotionSchedule(policy)
        # Promotions run in castore.tiers.uploader when the durable tier can be opened
        # again there by its address (None: on this process's promotion thread).
        self._worker = PromotionWorker(fast, durable, policy, uploader)
        self.promoted: list[Promoted] = self._worker.promoted
        self._closed = False
        self.node_id = node or f"{socket.gethostname()}:{os.path.realpath(fast.path)}"
        self._role: _NodeRole | None = None  # set by a collective call on several nodes
        # Staged sends (castore.tiers.staged): made at the first report_step().
        self._pacer: StepPacer | None = None
        self._sender: StagedSender | None = None
        if not self.readonly:
            self._take_durable_history()
            hook = weakref.WeakMethod(self._after_async_save)
            self.background.after_job.append(lambda job, gen: _call(hook, job, gen))
        atexit.register(_say_unfinished, weakref.ref(self))

    def __repr__(self) -> str:
        fast, durable = str(self.fast.path), str(self.durable.path)
        return f"<castore.TieredStore fast={fast!r} durable={durable!r}>"

    @property
    def served_bytes(self) -> dict[str, int]:
        """Bytes (chunks and objects) each tier served this handle's reads: "fast",
        "durable"."""
        return dict(self.tiered_backend.served_bytes)

    def served_by_tier(self) -> dict[str, int]:
        """Chunk bytes each tier served this handle's reads (castore.dist's report)."""
        return dict(self.tiered_backend.served_chunk_bytes)

    # -- history across the tiers -------------------------------------------------

    def _take_durable_history(self) -> None:
        """Make each run's newest durable generation the fast tier's, where it is newer.

        Under a lock of the fast directory's own: every process of the node opens
        it at once, and one of them takes each run's history.
        """
        behind = [run for run in self.durable.refs.ref_runs() if self._behind(run)]
        if not behind:
            return
        directory = make_store_dir(Path(self.fast.path) / "tiers")
        fd = open_store_file(directory / "take-history.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            for run in behind:
                newest = self.durable.refs.read(run)
                if newest is None or not self._behind(run):
                    continue  # another process of the node took it meanwhile
                root = self.durable.read_root(newest.root, run=run)
                copy_generation(self.durable, self.fast, newest.root, root, chunks=False)
                mark_elsewhere(Path(self.fast.path), run, root.generation, newest.root)
        finally:
            os.close(fd)  # releases the lock

    def _behind(self, run: str) -> bool:
        newest, mine = self.durable.refs.read(run), self.fast.refs.read(run)
        return newest is not None and (mine is None or mine.generation < newest.generation)

    def resolve_root(
        self, run: str, generation: GenerationSpec = "latest"
    ) -> tuple[Digest, GenerationRoot]:
        try:
            return super().resolve_root(run, generation)
        except GenerationNotFoundError:
            return self.durable.resolve_root(run, generation)

    def resolve(self, run: str, generation: GenerationSpec = "latest") -> Generation:
        try:
            return super().resolve(run, generation)
        except GenerationNotFoundError:
            return self.durable.resolve(run, generation)

    def generations(self, run: str, *, last: int | None = None) -> list[Generation]:
        """The run's generations in either tier, oldest first; ``last=N``: the newest N."""
        merged: dict[int, Generation] = {}
        for store in (self.durable, self.fast):  # the fast tier's entry where both have one
            if run in store.runs():
                merged.update((g.id, g) for g in store.generations(run, last=last))
        if not merged:
            raise GenerationNotFoundError(f"run {run!r} has no generations", run=run)
        found = sorted(merged.values(), key=lambda g: g.id)
        return found if last is None else found[-last:]

    def candidates(self, run: str, below: int | None = None) -> list[tuple[int, Digest]]:
        merged: dict[int, Digest] = {}
        for store in (self.durable, self.fast):
            if run in store.runs():
                merged.update(store.candidates(run, below))
        return sorted(merged.items(), key=lambda item: -item[0])

    def restore(
        self,
        run: str,
        generation: GenerationSpec = "latest",
        *,
        framework: str = "numpy",
        fallback: str | None = None,
        progress: bool = False,
    ) -> Restored:
        """:meth:`Store.restore`; ``sources`` says how many bytes each tier served."""
        before = self.served_bytes
        restored = super().restore(
            run, generation, framework=framework, fallback=fallback, progress=progress
        )
        after = self.served_bytes
        restored.sources = {
            k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)
        }
        return restored

    def runs(self) -> list[str]:
        return sorted(set(self.fast.runs()) | set(self.durable.runs()))

    def tiers(self, runs: list[str] | None = None) -> list[TierRow]:
        """Per generation, which tier has it (:func:`tier_report` of the two tiers)."""
        return tier_report(self.fast, self.durable, runs)

    def recovery_points(
        self,
        run: str | None = None,
        *,
        collective: bool = False,
        group: Any = None,
        timeout: float = 600.0,
    ) -> dict[str, dict[str, float]]:
        """Per run, seconds since its newest generation held whole in each tier (the RPO
        per tier now): ``{run: {"fast": s, "durable": s}}``.

        ``collective=True`` (a collective call of the ranks of ``group``, None: the
        world; a ``run`` is needed): the fast tier's newest is the newest
        generation the nodes' fast tiers hold whole together (castore.tiers.nodes).
        """
        if not collective:
            points = recovery_points(self.tiers(None if run is None else [run]))
            return points
        if run is None:
            raise ValueError("a collective recovery_points needs the run")
        from castore.dist.comm import Group  # torch: only when a collective call is made

        comm = Group(group, 0, timeout)
        session = self.node_session(comm, run, restore=True)
        if session is None:
            return {run: recovery_points(self.tiers([run])).get(run, {})}
        return {run: session.recovery_points(run)}

    # -- promotion ----------------------------------------------------------------

    @property
    def replicas(self) -> int:
        return self.policy.replicas

    def node_session(self, comm: Any, run: str, *, restore: bool = False) -> NodeSession | None:
        """The session of a collective call whose ranks span several nodes (each its own
        fast tier: castore.tiers.nodes); None on one node. A collective call; ``restore``:
        it also gathers the nodes' views of ``run`` (castore.tiers.nodes.discover)."""
        from castore.tiers.nodes import discover  # castore.dist.comm: torch, only here

        session = discover(self, comm, run, restore=restore)
        if session is not None:
            nodes = session.nodes
            self._role = _NodeRole(
                nodes.is_leader, comm.is_coordinator, tuple(nodes.ranks_on(nodes.my_node))
            )
        return session

    def selects_for_durable(self, run: str, generation: int) -> bool:
        return self._schedule.selects(run, generation)

    def queue_node_work(
        self,
        run: str,
        generation: int,
        root: Digest,
        promote: bool,
        own: list[int],
        *,
        delay: float = 0.0,
    ) -> None:
        """A node leader after a save on several nodes: pin and upload its node's shards
        when the generation is promoted; collect its node's fast tier."""
        self._worker.queue_node_work(run, generation, root, promote, own, delay=delay)

    def queue_durable_publish(self, run: str, generation: int, root: Digest) -> None:
        """The coordinator after a save on several nodes: publish the generation in the
        durable tier once the nodes' uploads hold all of it (pinned until then)."""
        self._worker.queue_durable_publish(run, generation, root)

    def after_publish(self, run: str, generation: int, root: Digest) -> None:
        """Pin and queue the generation if the policy selects it; collect the fast tier.

        Published by this handle's async save while the job reports its steps: its
        promotion waits until this process has sent its staged chunks."""
        selected = self._schedule.selects(run, generation)
        deferred = selected and self._sends_staged() and self._writing_async()
        self._worker.after_publish(run, generation, root, selected, deferred)
        if deferred:
            assert self._sender is not None
            self._sender.expect(run, generation, lambda: self._release_promotion(run, generation))

    # -- staged sends (castore.tiers.staged) ----------------------------------------

    def report_step(self, seconds: float | None = None) -> None:
        """The training loop finished a step ``seconds`` long (None: the time since the
        last call). Call it on every rank, after each step: a promoted generation's
        chunks are then sent from the async save's staging buffers, within
        ``durable_step_budget`` of each step's time (castore.tiers.staged)."""
        if self.readonly:
            return
        if self._pacer is None:
            background = self.background
            self._pacer = StepPacer(
                self.policy.durable_step_budget, hold=lambda: background.staging_now > 0
            )
            self._sender = StagedSender.for_stores(
                self.fast.backend,
                self.durable.backend,
                self._pacer,
                self.policy.durable_rate,
                self.durable.codec,
            )
        self._pacer.report(seconds)

    @property
    def staged_sends(self) -> dict[str, int]:
        """What this process sent from staging buffers: ``sent_chunks``, ``sent_bytes``,
        ``present_chunks`` (the durable tier had them), ``gone_chunks`` (a later save
        had taken their buffers), ``fast_chunks``, ``fast_bytes`` (of those, read from
        the fast tier, verified, and sent), ``slices``."""
        return {} if self._sender is None else dict(self._sender.counters)

    def _sends_staged(self) -> bool:
        """Staged sends: the job reports steps, on one node."""
        return self._sender is not None and self._role is None

    def _writing_async(self) -> bool:
        running = self.background.running
        return running is not None and running[0] == threading.get_ident()

    def _after_async_save(self, job: Job, generation: Generation | None) -> None:
        """An async save of this handle finished: owe its staged chunks to the durable
        tier if its generation is pinned for promotion (by this process or the job's
        coordinator), else release a promotion waiting for them."""
        sender = self._sender
        if sender is None:
            return
        run = job.pending.run
        if (
            generation is not None
            and self._sends_staged()
            and f"{PIN_PREFIX}{generation.id}" in self.refs.tags(run)
        ):
            sender.offer(run, generation.id, job.staged)
        else:
            sender.release(run)

    def _release_promotion(self, run: str, generation: int) -> None:
        """The staged chunks of a deferred promotion are sent (or gone): promote it, after
        waiting while the other ranks' chunks still arrive."""
        step = self._pacer.step_seconds if self._pacer is not None else None
        self._worker.submit_pinned(run, generation, peers_idle_s=max(1.0, 10 * (step or 0.1)))

    def promote(self, run: str, generation: GenerationSpec = "latest") -> Promoted:
        """Copy one fast-tier generation to the durable tier now; its outcome."""
        gen = super().resolve(run, generation)
        return self._worker.promote_now(run, gen.id, Digest.from_hex(gen.root))

    def wait_promotions(self, timeout: float | None = None) -> list[Promoted]:
        """Block until every queued promotion and collection ran; this handle's promotions.

        Promotions an earlier handle left unfinished are retried first; staged chunks
        still owed are sent first, unpaced.
        """
        if self._sender is not None:
            if (current := self.background.in_flight()) is not None:
                current.wait(timeout)
            self._sender.drain(timeout)
        return self._worker.wait(timeout)

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Wait for saves in flight, promote what ``promote_on_exit`` asks, close both tiers."""
        if self._closed:
            return
        self._closed = True
        super().close()
        try:
            if self._sender is not None:
                self._sender.stop()  # sends what is owed, then queues its promotions
            self._worker.drain()  # what is queued, first
            if self.policy.promote_on_exit and not self.readonly:
                for run in sorted(self._worker.saved_runs):
                    self._promote_on_exit(run)
        finally:
            try:
                self._worker.stop()
            finally:
                self.fast.close()
                self.durable.close()

    def _promote_on_exit(self, run: str) -> None:
        """Queue the promotion of ``run``'s newest generation unless the durable tier has it."""
        newest = self.refs.read(run)
        if newest is None or newest.root.hex in self._durable_roots(run):
            return
        role = self._role
        if role is None:
            self._worker.queue_promotion(run, newest.generation, newest.root)
            return
        # A job on several nodes: each node leader uploads its part, the
        # coordinator publishes once all of it is there.
        if role.leader:
            self._worker.queue_upload(run, newest.generation, newest.root, role.own)
        if role.coordinator:
            self._worker.queue_durable_publish(run, newest.generation, newest.root)

    def _durable_roots(self, run: str) -> dict[str, int]:
        if run not in self.durable.runs():
            return {}
        return self.durable.published(run, tolerate_bad_ref=True)


def _call(hook: weakref.WeakMethod[Any], job: Job, generation: Generation | None) -> None:
    method = hook()
    if method is not None:
        method(job, generation)


def _say_unfinished(ref: weakref.ref[TieredStore]) -> None:
    """At exit: a tiered store that queued promotions and was not closed says what is owed."""
    store = ref()
    if store is None or store._closed or not store._worker.started or store.readonly:
        return
    try:
        owed = store._worker.owed()
    except CastoreError:
        return
    if owed:
        print(
            f"castore: {len(owed)} promotion(s) to {store.durable.path} unfinished at exit "
            f"({', '.join(owed)}; the tiered store was not closed): the next "
            f"castore.open_tiered on {store.fast.path} retries them",
            file=sys.stderr,
        )
