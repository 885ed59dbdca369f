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
import contextlib
import fcntl
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from castore.chunkstore.tiered import TieredChunkBackend
from castore.copying import CopiedGeneration, copy_generation, copy_shard_chunks
from castore.core.background import Throttle
from castore.core.history import Generation, GenerationSpec
from castore.core.holdings import forget_elsewhere, held_shards, mark_elsewhere
from castore.errors import CastoreError, CastoreWarning, GenerationNotFoundError
from castore.format.hashing import Digest
from castore.format.objects import GenerationRoot
from castore.gc import RetentionPolicy, collect_garbage
from castore.opening.directory import open_address, upgrade_for_frames
from castore.opening.location import parse_location
from castore.repo.records import RefValue
from castore.store import Restored, Store
from castore.support.safefs import make_store_dir, open_store_file

PIN_PREFIX = "promoting-"  # a node's part (or, on one node, all) of a promotion is owed
PUBLISH_PREFIX = "publishing-"  # several nodes: the coordinator's durable publish is owed
PINS = (PIN_PREFIX, PUBLISH_PREFIX)


@dataclass(frozen=True)
class TierPolicy:
    """Which generations go to the durable tier, and what each tier keeps."""

    durable_every: int | None = None  # every Nth generation id (id % N == 0)
    durable_every_s: float | None = None  # a generation once this long after the last promoted
    promote: Callable[[str, int], bool] | None = None  # overrides both
    fast_keep: int = 2
    durable_retention: RetentionPolicy | None = None
    durable_rate: float | None = None  # bytes per second, for this process's promotions
    promote_on_exit: bool = True
    replicas: int = 1  # copies of each shard in the fast tiers of a job on several nodes
    upload_wait_s: float = 600.0  # how long the coordinator waits for the nodes' uploads
    durable_stagger_s: float = 0.0  # node i of N starts its uploads this * i / N late

    def __post_init__(self) -> None:
        if self.durable_every is not None and self.durable_every < 1:
            raise ValueError(f"durable_every must be at least 1, got {self.durable_every!r}")
        if self.durable_every_s is not None and not self.durable_every_s >= 0:
            raise ValueError(f"durable_every_s must be >= 0, got {self.durable_every_s!r}")
        if not isinstance(self.fast_keep, int) or self.fast_keep < 1:
            raise ValueError(f"fast_keep must be at least 1, got {self.fast_keep!r}")
        if self.durable_rate is not None and not self.durable_rate > 0:
            raise ValueError(f"durable_rate must be positive, got {self.durable_rate!r}")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas!r}")
        if not self.durable_stagger_s >= 0:
            raise ValueError(f"durable_stagger_s must be >= 0, got {self.durable_stagger_s!r}")
        if not self.upload_wait_s > 0:
            raise ValueError(f"upload_wait_s must be positive, got {self.upload_wait_s!r}")


@dataclass
class Promoted:
    """One promotion's outcome: the copy's report, or the error that stopped it."""

    run: str
    generation: int
    copied: CopiedGeneration | None = None
    error: BaseException | None = None
    seconds: float = 0.0


@dataclass
class _Work:
    # "promote", "collect", "barrier" (done once all before it are), "stop"; on several
    # nodes "upload" (a node's shards) and "publish" (the coordinator's durable publish)
    kind: str
    run: str = ""
    generation: int = 0
    shards: tuple[int, ...] = ()
    delay: float = 0.0  # seconds to wait before starting (an upload's stagger)
    done: threading.Event = field(default_factory=threading.Event)


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
    served to reads ("primary" is the fast tier).
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
        self.promoted: list[Promoted] = []
        self._last_promoted_at = time.monotonic()
        self._saved_runs: set[str] = set()
        self._work: queue.Queue[_Work] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Promotions run in castore.tiers.uploader when the durable tier can be opened
        # again there by its address (None: on this process's promotion thread).
        self._uploader_spec = uploader
        self._uploader: subprocess.Popen[str] | None = None
        self._pins_resumed = False
        self.node_id = node or f"{socket.gethostname()}:{os.path.realpath(fast.path)}"
        self._role: _NodeRole | None = None  # set by a collective call on several nodes
        if not self.readonly:
            self._take_durable_history()
        atexit.register(_say_unfinished, weakref.ref(self))

    def __repr__(self) -> str:
        fast, durable = str(self.fast.path), str(self.durable.path)
        return f"<castore.TieredStore fast={fast!r} durable={durable!r}>"

    @property
    def served_bytes(self) -> dict[str, int]:
        return dict(self.tiered_backend.served_bytes)

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
                merged.update((g.id, g) for g in Store.generations(store, run, last=last))
        if not merged:
            raise GenerationNotFoundError(f"run {run!r} has no generations", run=run)
        found = sorted(merged.values(), key=lambda g: g.id)
        return found if last is None else found[-last:]

    def candidates(self, run: str, below: int | None = None) -> list[tuple[int, Digest]]:
        merged: dict[int, Digest] = {}
        for store in (self.durable, self.fast):
            if run in store.runs():
                merged.update(Store.candidates(store, run, below))
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
        from castore.dist.comm import Group

        comm = Group(group, 0, timeout)
        session = self.node_session(comm, run)
        if session is None:
            return {run: recovery_points(self.tiers([run])).get(run, {})}
        return {run: session.recovery_points(run)}

    # -- promotion ----------------------------------------------------------------

    def _resume_pins(self) -> None:
        """Queue the promotions an earlier handle left pinned, once per handle.

        Not at open: every process of a node opens the tiered store, and only the
        one that publishes (a job's coordinator) or waits for promotions retries them.
        """
        if self._pins_resumed or self.readonly:
            return
        self._pins_resumed = True
        for run in self.refs.ref_runs():
            tags = self.refs.tags(run)
            for name, value in sorted(tags.items(), key=lambda item: item[1].generation):
                if not name.startswith(PIN_PREFIX):
                    continue
                held = held_shards(Path(self.fast.path), run, value.generation, value.root)
                if held is None:
                    self._submit(_Work("promote", run, value.generation))
                else:  # a generation of a job on several nodes: this node's part of it
                    self._submit(_Work("upload", run, value.generation, tuple(sorted(held))))
            # Several nodes: the newest owed durable publish (it supersedes older ones).
            owed = sorted(v.generation for n, v in tags.items() if n.startswith(PUBLISH_PREFIX))
            if owed:
                self._submit(_Work("publish", run, owed[-1]))

    @property
    def replicas(self) -> int:
        return self.policy.replicas

    def node_session(self, comm: Any, run: str) -> Any:
        """The session of a collective call whose ranks span several nodes (each its own
        fast tier: castore.tiers.nodes); None on one node. A collective call."""
        from castore.tiers.nodes import discover

        session = discover(self, comm, run)
        if session is not None:
            nodes = session.nodes
            self._role = _NodeRole(
                nodes.is_leader, comm.is_coordinator, tuple(nodes.ranks_on(nodes.my_node))
            )
        return session

    def selects_for_durable(self, run: str, generation: int) -> bool:
        return self._selects(run, generation)

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
        self._resume_pins()
        self._saved_runs.add(run)
        if promote:
            self._pin(run, generation, root)
            self._submit(_Work("upload", run, generation, tuple(own), delay))
        self._submit(_Work("collect", run))

    def queue_durable_publish(self, run: str, generation: int, root: Digest) -> None:
        """The coordinator after a save on several nodes: publish the generation in the
        durable tier once the nodes' uploads hold all of it.

        Pinned here (``publishing-ID``) until it is published, so that a coordinator
        killed before that leaves the publish owed: the next handle that publishes or
        waits for promotions retries it, and a newer one published supersedes it.
        """
        self._resume_pins()
        self._saved_runs.add(run)
        self._pin(run, generation, root, PUBLISH_PREFIX)
        self._submit(_Work("publish", run, generation))

    def after_publish(self, run: str, generation: int, root: Digest) -> None:
        """Pin and queue the generation if the policy selects it; collect the fast tier."""
        self._resume_pins()
        self._saved_runs.add(run)
        if self._selects(run, generation):
            self._pin(run, generation, root)
            self._submit(_Work("promote", run, generation))
        self._submit(_Work("collect", run))

    def _selects(self, run: str, generation: int) -> bool:
        policy = self.policy
        if policy.promote is not None:
            return bool(policy.promote(run, generation))
        if policy.durable_every_s is not None:
            if time.monotonic() - self._last_promoted_at >= policy.durable_every_s:
                self._last_promoted_at = time.monotonic()
                return True
            return policy.durable_every is not None and generation % policy.durable_every == 0
        return generation % (policy.durable_every or 1) == 0

    def _pin(self, run: str, generation: int, root: Digest, prefix: str = PIN_PREFIX) -> None:
        # Right after the ref advance: the generation is the newest, which fast
        # retention keeps, until this tag keeps it through the promotion.
        value = RefValue(run, generation, root, time.time())
        self.refs.write_tag(run, f"{prefix}{generation}", value)

    def promote(self, run: str, generation: GenerationSpec = "latest") -> Promoted:
        """Copy one fast-tier generation to the durable tier now; its outcome."""
        gen = Store.resolve(self, run, generation)
        self._pin(run, gen.id, Digest.from_hex(gen.root))
        work = self._submit(_Work("promote", run, gen.id))
        work.done.wait()
        return next(p for p in reversed(self.promoted) if (p.run, p.generation) == (run, gen.id))

    def wait_promotions(self, timeout: float | None = None) -> list[Promoted]:
        """Block until every queued promotion and collection ran; this handle's promotions.

        Promotions an earlier handle left unfinished are retried first.
        """
        self._resume_pins()
        work = self._submit(_Work("barrier"))
        if not work.done.wait(timeout):
            raise TimeoutError(f"promotions still running after {timeout}s")
        return list(self.promoted)

    def _submit(self, work: _Work) -> _Work:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="castore-promote", daemon=True)
            self._thread.start()
        self._work.put(work)
        return work

    def _serve(self) -> None:
        while True:
            work = self._work.get()
            try:
                if work.kind == "stop":
                    return
                if work.kind == "promote":
                    self._promote(work.run, work.generation)
                elif work.kind == "upload":
                    time.sleep(work.delay)
                    self._upload_node(work.run, work.generation, work.shards)
                elif work.kind == "publish":
                    self._publish_durable(work.run, work.generation)
                elif work.kind == "collect":
                    self._collect_fast(work.run)
            except BaseException as exc:  # noqa: BLE001 - reported, the thread goes on
                warnings.warn(
                    f"castore tiers: {work.kind} of {work.run} failed: {type(exc).__name__}: {exc}",
                    CastoreWarning,
                    stacklevel=1,
                )
            finally:
                work.done.set()

    @contextlib.contextmanager
    def _recorded(self, run: str, generation: int) -> Iterator[Promoted]:
        """Time a promotion and keep its outcome in ``promoted``, failed or not."""
        outcome = Promoted(run, generation)
        started = time.perf_counter()
        try:
            yield outcome
        except BaseException as exc:
            outcome.error = exc
            raise
        finally:
            outcome.seconds = time.perf_counter() - started
            self.promoted.append(outcome)

    def _promote(self, run: str, generation: int) -> None:
        retention = self.policy.durable_retention
        with self._recorded(run, generation) as outcome:
            if self._uploader_spec is not None:
                outcome.copied = self._upload({
                    "kind": "promote", "run": run, "generation": generation,
                    "retention": None if retention is None else asdict(retention),
                })  # fmt: skip
            else:
                outcome.copied = promote_generation(
                    self.fast,
                    self.durable,
                    run,
                    generation,
                    rate=self.policy.durable_rate,
                    retention=retention,
                )
            self.refs.delete_tag(run, f"{PIN_PREFIX}{generation}")

    def _upload_node(self, run: str, generation: int, shards: tuple[int, ...]) -> None:
        """Upload this node's shards of a generation (the chunks the durable tier lacks),
        then unpin it here: the coordinator publishes it once every node's are there."""
        if self._uploader_spec is not None:
            self._upload({"kind": "upload", "run": run, "generation": generation,
                          "shards": list(shards)})  # fmt: skip
        else:
            upload_shards(
                self.fast, self.durable, run, generation, shards, self.policy.durable_rate
            )
        self.refs.delete_tag(run, f"{PIN_PREFIX}{generation}")

    def _publish_durable(self, run: str, generation: int) -> None:
        """The coordinator: wait until the durable tier holds every chunk of the
        generation, then publish it there (castore.copying.copy_generation)."""
        retention = self.policy.durable_retention
        with self._recorded(run, generation) as outcome:
            if self._uploader_spec is not None:
                outcome.copied = self._upload({
                    "kind": "publish", "run": run, "generation": generation,
                    "wait_s": self.policy.upload_wait_s,
                    "retention": None if retention is None else asdict(retention),
                })  # fmt: skip
            else:
                outcome.copied = publish_uploaded(
                    self.fast, self.durable, run, generation, self.policy.upload_wait_s, retention
                )
            # Published: this publish and every older one owed are done with.
            for name, value in self.refs.tags(run).items():
                if name.startswith(PUBLISH_PREFIX) and value.generation <= generation:
                    self.refs.delete_tag(run, name)

    def _upload(self, job: dict[str, Any]) -> CopiedGeneration | None:
        """One job in the uploader process (castore.tiers.uploader), started if need be:
        a promotion, a node's upload or the durable publish of a job on several nodes."""
        process = self._uploader
        if process is None or process.poll() is not None:
            process = self._uploader = subprocess.Popen(
                [sys.executable, "-m", "castore.tiers.uploader"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert process.stdin is not None
            process.stdin.write(json.dumps(self._uploader_spec) + "\n")
        job = {"rate": self.policy.durable_rate, **job}
        what = f"{job['run']}@{job['generation']}"
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(json.dumps(job) + "\n")
            process.stdin.flush()
            line = process.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = process.wait()
            raise CastoreError(
                f"the uploader process died (exit status {code}) promoting {what}; "
                "the durable tier keeps its previous generation, and the promotion is retried"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise CastoreError(f"promoting {what}: {reply['error']}")
        copied = reply.get("copied")
        return None if copied is None else CopiedGeneration(**copied)

    def _stop_uploader(self) -> None:
        process, self._uploader = self._uploader, None
        if process is None:
            return
        try:
            assert process.stdin is not None
            process.stdin.close()
            process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()

    def _collect_fast(self, run: str) -> None:
        collect_garbage(self.fast, RetentionPolicy(keep_last=self.policy.fast_keep), runs=[run])
        # Records of generations the collection dropped: the record says nothing any more.
        forget_elsewhere(Path(self.fast.path), run, set(self.fast.published(run).values()))

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Wait for saves in flight, promote what ``promote_on_exit`` asks, close both tiers."""
        if self._closed:
            return
        self._closed = True
        super().close()
        try:
            if self._thread is not None:
                self._submit(_Work("barrier")).done.wait()  # what is queued, first
            if self.policy.promote_on_exit and not self.readonly:
                for run in sorted(self._saved_runs):
                    newest = self.refs.read(run)
                    if newest is None or newest.root.hex in self._durable_roots(run):
                        continue
                    role = self._role
                    if role is None:
                        self._pin(run, newest.generation, newest.root)
                        self._submit(_Work("promote", run, newest.generation))
                        continue
                    # A job on several nodes: each node leader uploads its part, the
                    # coordinator publishes once all of it is there.
                    if role.leader:
                        self._pin(run, newest.generation, newest.root)
                        self._submit(_Work("upload", run, newest.generation, role.own))
                    if role.coordinator:
                        self.queue_durable_publish(run, newest.generation, newest.root)
            if self._thread is not None:
                self._submit(_Work("stop")).done.wait()
                self._thread.join()
        finally:
            self._stop_uploader()
            self.fast.close()
            self.durable.close()

    def _durable_roots(self, run: str) -> dict[str, int]:
        if run not in self.durable.runs():
            return {}
        return self.durable.published(run, tolerate_bad_ref=True)


def _say_unfinished(ref: weakref.ref[TieredStore]) -> None:
    """At exit: a tiered store that queued promotions and was not closed says what is owed."""
    store = ref()
    if store is None or store._closed or store._thread is None or store.readonly:
        return
    try:
        owed = sorted(
            f"{run}@{value.generation}"
            for run in store.refs.ref_runs()
            for name, value in store.refs.tags(run).items()
            if name.startswith(PINS)
        )
    except CastoreError:
        return
    if owed:
        print(
            f"castore: {len(owed)} promotion(s) to {store.durable.path} unfinished at exit "
            f"({', '.join(owed)}; the tiered store was not closed): the next "
            f"castore.open_tiered on {store.fast.path} retries them",
            file=sys.stderr,
        )


def promote_generation(
    fast: Store,
    durable: Store,
    run: str,
    generation: int,
    *,
    rate: float | None = None,
    retention: RetentionPolicy | None = None,
) -> CopiedGeneration | None:
    """Copy ``run@generation`` from ``fast`` to ``durable`` (None: it is there already).

    Only the chunks ``durable`` lacks, each verified as read, at most ``rate``
    bytes per second in batches of a tenth of a second's bytes (so the reads,
    hashing and writes spread out, not one burst); then ``retention`` collects
    the durable tier's run.
    """
    held = durable.published(run, tolerate_bad_ref=True) if run in durable.runs() else {}
    digest, root = fast.resolve_root(run, generation)
    if digest.hex in held:
        return None
    latest = durable.refs.read(run)
    if latest is not None and latest.generation >= generation:
        raise CastoreError(
            f"the durable tier {durable.path} already has {run}@{latest.generation}: "
            f"{run}@{generation} is not promoted"
        )
    copied = copy_generation(
        fast,
        durable,
        digest,
        root,
        throttle=Throttle(rate).take,
        batch_bytes=None if rate is None else max(1, int(rate / 10)),
    )
    if retention is not None:
        collect_garbage(durable, retention, runs=[run])
    return copied


def upload_shards(
    fast: Store,
    durable: Store,
    run: str,
    generation: int,
    shards: Sequence[int],
    rate: float | None = None,
) -> int:
    """Copy the chunks of some shards of ``run@generation`` that ``durable`` lacks (a
    node's part of a promotion on several nodes); the bytes sent. Publishes nothing."""
    _, root = fast.resolve_root(run, generation)
    wanted = [index for index in shards if index < len(root.shards)]
    if not wanted:
        return 0
    return copy_shard_chunks(
        fast,
        durable,
        root,
        wanted,
        throttle=Throttle(rate).take,
        batch_bytes=None if rate is None else max(1, int(rate / 10)),
    )


def publish_uploaded(
    fast: Store,
    durable: Store,
    run: str,
    generation: int,
    wait_s: float,
    retention: RetentionPolicy | None = None,
) -> CopiedGeneration | None:
    """Wait (at most ``wait_s``) until ``durable`` holds every chunk of ``run@generation``
    (the nodes' uploads), then publish it there with the same root digest."""
    from castore.tiers.nodes import wait_for_chunks

    _, root = fast.resolve_root(run, generation)
    shards = fast.read_shards(root)
    chunks = sorted({c for s in shards for e in s.tensors + s.local_tensors for c in e.chunks})
    wait_for_chunks(durable, chunks, timeout=wait_s)
    return promote_generation(fast, durable, run, generation, retention=retention)


@dataclass(frozen=True)
class TierRow:
    """Where one generation is. ``fast``: "held" (the fast tiers named hold every
    shard), "K/N shards" (they hold K of its N shards: the rest are on other
    nodes or in the durable tier), "elsewhere" (listed, no chunks held) or ""
    (not listed); ``durable`` whether the durable tier has it."""

    run: str
    id: int
    step: int
    time: float
    root: str
    fast: str
    durable: bool
    pinned: bool  # pinned in a fast tier for a promotion not finished yet


def tier_report(
    fast: Store | list[Store], durable: Store, runs: list[str] | None = None
) -> list[TierRow]:
    """Per generation of ``runs`` (default: every run of any store), which tier has it.

    ``fast``: one fast tier, or the fast tiers of several nodes (their
    holdings records say which shards each holds). Reads only: no store is
    changed. Ordered by run, then id.
    """
    nodes = fast if isinstance(fast, list) else [fast]
    rows = []
    names = runs if runs is not None else sorted(
        {run for store in [*nodes, durable] for run in store.runs()}
    )  # fmt: skip
    for run in names:
        listed: dict[int, Generation] = {}
        held: dict[int, set[int]] = {}
        pins: set[int] = set()
        for node in nodes:
            if run not in node.runs():
                continue
            for gen in node.generations(run):
                listed.setdefault(gen.id, gen)
                held.setdefault(gen.id, set()).update(_held_by(node, run, gen))
            pins |= {
                value.generation
                for name, value in node.refs.tags(run).items()
                if name.startswith(PINS)
            }
        in_durable = {g.id: g for g in durable.generations(run)} if run in durable.runs() else {}
        for gen_id in sorted(set(listed) | set(in_durable)):
            gen = listed.get(gen_id) or in_durable[gen_id]
            rows.append(
                TierRow(
                    run,
                    gen_id,
                    gen.step,
                    gen.time,
                    gen.root,
                    _where(len(held[gen_id]), gen.world_size) if gen_id in listed else "",
                    gen_id in in_durable,
                    gen_id in pins,
                )  # fmt: skip
            )
    return rows


def _where(held: int, total: int) -> str:
    if held >= total:
        return "held"
    return f"{held}/{total} shards" if held else "elsewhere"


def _held_by(store: Store, run: str, gen: Generation) -> set[int]:
    """The shards of ``gen`` that ``store`` holds, by its holdings record (all without one)."""
    if not isinstance(store.path, Path):
        return set(range(gen.world_size))
    found = held_shards(store.path, run, gen.id, Digest.from_hex(gen.root))
    return set(range(gen.world_size)) if found is None else found


def recovery_points(rows: list[TierRow], now: float | None = None) -> dict[str, dict[str, float]]:
    """Per run, seconds since the newest generation each tier holds whole (its RPO now):
    ``{"fast": ..., "durable": ...}``; a tier with none of the run's generations is absent."""
    now = time.time() if now is None else now
    points: dict[str, dict[str, float]] = {}
    for row in rows:
        ages = points.setdefault(row.run, {})
        if row.fast == "held":
            ages["fast"] = min(ages.get("fast", float("inf")), now - row.time)
        if row.durable:
            ages["durable"] = min(ages.get("durable", float("inf")), now - row.time)
    return points


def _allow_frames(fast: Store) -> None:
    """A fast tier may receive chunks stored as frames (castore.format.codec): a peer
    node's copies, a compressed save. One older than frames (format 2) is upgraded to
    format 4 first, saying so once, so that an older castore refuses it whole instead of
    reporting those chunks as damage; a read-only one is left as it is (it receives
    nothing)."""
    if fast.readonly or not isinstance(fast.path, Path):
        return
    was = upgrade_for_frames(fast.path)
    if was is not None:
        warnings.warn(
            f"castore: the fast tier {fast.path} was a format {was} store; it is now format "
            "4 (it may hold compressed chunks), which a castore older than chunk compression "
            "refuses to open",
            CastoreWarning,
            stacklevel=3,
        )


def open_tiered(
    fast: str | os.PathLike[str],
    durable: str | os.PathLike[str] | Store,
    *,
    durable_every: int | None = None,
    durable_every_s: float | None = None,
    promote: Callable[[str, int], bool] | None = None,
    fast_keep: int = 2,
    durable_retention: RetentionPolicy | None = None,
    durable_rate: float | None = None,
    promote_on_exit: bool = True,
    uploader: str = "process",
    chunk_size: int | None = None,
    replicas: int = 1,
    node: str | None = None,
    upload_wait_s: float = 600.0,
    durable_stagger_s: float = 0.0,
    uploader_priority: str = "low",
    **durable_options: Any,
) -> TieredStore:
    """A :class:`TieredStore`: ``fast`` (a local directory) in front of ``durable``.

    ``durable`` is anything :func:`castore.open` takes (options in
    ``durable_options``) or an open Store (closed with the tiered store).
    Every generation is promoted unless ``durable_every`` (ids divisible by
    it), ``durable_every_s`` (the first generation that long after the last
    promotion, or one ``durable_every`` also selects) or ``promote`` says
    otherwise. ``durable_rate``: bytes per second for uploads.

    ``uploader="process"`` (the default) promotes in a process of its own
    (castore.tiers.uploader), so that the copy does not compete with training
    for this process's GIL; where the durable tier cannot be opened again by
    address there (an open Store, options that are not plain values), and with
    ``uploader="thread"``, on a thread of this process. The process runs at
    ``nice`` 10 (``uploader_priority="low"``), or, with ``"idle"``, under
    Linux's SCHED_IDLE: only on CPU time training leaves unused (measured: a
    smaller step-time cost; a node whose cores training keeps busy all the
    time would starve its promotions).

    A job whose ranks are on several nodes (each node's ranks open their own
    ``fast`` directory; ``node`` names it, by default the host name and the
    directory's real path) keeps each node's shards in its fast tier, and with
    ``replicas=2`` (or more) copies of the next node's (castore.tiers.nodes).
    Its promotions are uploaded by each node (on a thread) and published by
    the coordinator once all of a generation's chunks are in the durable tier,
    waiting at most ``upload_wait_s`` seconds for them; node i of N starts
    its upload ``durable_stagger_s * i / N`` seconds late, each node within
    ``durable_rate``.
    """
    if uploader not in ("process", "thread"):
        raise ValueError(f"uploader must be 'process' or 'thread', got {uploader!r}")
    if uploader_priority not in ("low", "idle"):
        raise ValueError(f"uploader_priority must be 'low' or 'idle', got {uploader_priority!r}")
    policy = TierPolicy(
        durable_every=durable_every,
        durable_every_s=durable_every_s,
        promote=promote,
        fast_keep=fast_keep,
        durable_retention=durable_retention,
        durable_rate=durable_rate,
        promote_on_exit=promote_on_exit,
        replicas=replicas,
        upload_wait_s=upload_wait_s,
        durable_stagger_s=durable_stagger_s,
    )
    location = parse_location(os.fspath(fast))
    if location.scheme != "file":
        raise ValueError(f"the fast tier is a local directory, not {os.fspath(fast)!r}")
    durable_store = (
        durable
        if isinstance(durable, Store)
        else open_address(durable, chunk_size=chunk_size, **durable_options)
    )
    try:
        fast_store = open_address(fast, chunk_size=chunk_size)
    except BaseException:
        if not isinstance(durable, Store):
            durable_store.close()
        raise
    try:
        _allow_frames(fast_store)
    except BaseException:
        fast_store.close()
        if not isinstance(durable, Store):
            durable_store.close()
        raise
    spec: dict[str, Any] | None = None
    if uploader == "process" and not isinstance(durable, Store):
        spec = {
            "fast": os.fspath(fast),
            "durable": os.fspath(durable),
            "options": durable_options,
            "chunk_size": chunk_size,
            "priority": uploader_priority,
        }
        try:
            json.dumps(spec)
        except (TypeError, ValueError):
            spec = None  # options that are objects: promote on a thread here
    try:
        return TieredStore(fast_store, durable_store, policy, uploader=spec, node=node)
    except BaseException:
        fast_store.close()
        if not isinstance(durable, Store):
            durable_store.close()
        raise


__all__ = [
    "Promoted",
    "promote_generation",
    "TierPolicy",
    "TierRow",
    "TieredStore",
    "open_tiered",
    "recovery_points",
    "tier_report",
]
