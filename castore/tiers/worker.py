"""A tiered store's background work: one thread serving one queue, in order.

The queue holds promotions, fast-tier collections and, on several nodes, a
node's upload and the coordinator's durable publish (castore.tiers.promotion
says what each does). Each runs on this thread, or, when the store was given
an uploader spec, in the uploader process (castore.tiers.pipe), so the copy
does not compete with training for the GIL. A failed job warns and the
thread goes on; its pin stays (castore.tiers.policy), so that the next
handle, save or ``wait_promotions()`` retries it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from castore.copying import CopiedGeneration
from castore.core.holdings import forget_elsewhere, held_shards
from castore.errors import CastoreWarning
from castore.format.hashing import Digest
from castore.gc import RetentionPolicy, collect_garbage
from castore.repo.records import RefValue
from castore.store import Store
from castore.tiers.pipe import UploaderPipe
from castore.tiers.policy import PIN_PREFIX, PINS, PUBLISH_PREFIX, TierPolicy
from castore.tiers.promotion import (
    Promoted,
    promote_generation,
    publish_uploaded,
    upload_shards,
    wait_while_arriving,
)


@dataclass
class _Work:
    # "promote", "collect", "barrier" (done once all before it are), "stop"; on several
    # nodes "upload" (a node's shards) and "publish" (the coordinator's durable publish)
    kind: str
    run: str = ""
    generation: int = 0
    shards: tuple[int, ...] = ()
    delay: float = 0.0  # seconds to wait before starting (an upload's stagger)
    # A promotion whose other ranks send their staged chunks (castore.tiers.staged):
    # wait while they arrive, at most this long without one, before copying the rest.
    peers_idle_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class PromotionWorker:
    """The queue and thread of one tiered store; ``promoted`` lists its promotions in order.

    ``uploader``: the spec castore.tiers.uploader opens its stores by (None: every
    job runs on this thread).
    """

    def __init__(
        self, fast: Store, durable: Store, policy: TierPolicy, uploader: dict[str, Any] | None
    ) -> None:
        self.fast = fast
        self.durable = durable
        self.policy = policy
        self.refs = fast.refs
        self.promoted: list[Promoted] = []
        self.saved_runs: set[str] = set()  # runs saved through this handle
        self.pipe = None if uploader is None else UploaderPipe(uploader)
        self._work: queue.Queue[_Work] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pins_resumed = False

    @property
    def started(self) -> bool:
        return self._thread is not None

    # -- what is owed -----------------------------------------------------------

    def resume_pins(self) -> None:
        """Queue the promotions an earlier handle left pinned, once per handle.

        Not at open: every process of a node opens the tiered store, and only the
        one that publishes (a job's coordinator) or waits for promotions retries them.
        """
        if self._pins_resumed or self.fast.readonly:
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

    def pin(self, run: str, generation: int, root: Digest, prefix: str = PIN_PREFIX) -> None:
        # Right after the ref advance: the generation is the newest, which fast
        # retention keeps, until this tag keeps it through the promotion.
        value = RefValue(run, generation, root, time.time())
        self.refs.write_tag(run, f"{prefix}{generation}", value)

    def owed(self) -> list[str]:
        """``run@id`` of every promotion or publish still pinned in the fast tier."""
        return sorted(
            f"{run}@{value.generation}"
            for run in self.refs.ref_runs()
            for name, value in self.refs.tags(run).items()
            if name.startswith(PINS)
        )

    # -- queueing ---------------------------------------------------------------

    def after_publish(
        self, run: str, generation: int, root: Digest, selected: bool, deferred: bool = False
    ) -> None:
        """Pin and queue the generation if the policy ``selected`` it; collect the fast tier.

        ``deferred``: pin it only; its promotion is queued by :meth:`submit_pinned` once
        its staged chunks are sent (castore.tiers.staged)."""
        self.resume_pins()
        self.saved_runs.add(run)
        if selected and deferred:
            self.pin(run, generation, root)
        elif selected:
            self.queue_promotion(run, generation, root)
        self._submit(_Work("collect", run))

    def queue_promotion(self, run: str, generation: int, root: Digest) -> _Work:
        self.pin(run, generation, root)
        return self._submit(_Work("promote", run, generation))

    def submit_pinned(self, run: str, generation: int, peers_idle_s: float = 0.0) -> None:
        """Queue the promotion of a generation pinned before (its staged chunks sent)."""
        self._submit(_Work("promote", run, generation, peers_idle_s=peers_idle_s))

    def queue_upload(
        self, run: str, generation: int, root: Digest, own: Sequence[int], delay: float = 0.0
    ) -> None:
        """Pin and upload this node's shards ``own`` of a generation (several nodes)."""
        self.pin(run, generation, root)
        self._submit(_Work("upload", run, generation, tuple(own), delay))

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
        self.resume_pins()
        self.saved_runs.add(run)
        if promote:
            self.queue_upload(run, generation, root, own, delay)
        self._submit(_Work("collect", run))

    def queue_durable_publish(self, run: str, generation: int, root: Digest) -> None:
        """The coordinator after a save on several nodes: publish the generation in the
        durable tier once the nodes' uploads hold all of it.

        Pinned here (``publishing-ID``) until it is published, so that a coordinator
        killed before that leaves the publish owed: the next handle that publishes or
        waits for promotions retries it, and a newer one published supersedes it.
        """
        self.resume_pins()
        self.saved_runs.add(run)
        self.pin(run, generation, root, PUBLISH_PREFIX)
        self._submit(_Work("publish", run, generation))

    def promote_now(self, run: str, generation: int, root: Digest) -> Promoted:
        """Promote one generation and wait for it; its outcome."""
        self.queue_promotion(run, generation, root).done.wait()
        return next(
            p for p in reversed(self.promoted) if (p.run, p.generation) == (run, generation)
        )

    def wait(self, timeout: float | None = None) -> list[Promoted]:
        """Block until every queued job ran (retrying what earlier handles left pinned
        first); this handle's promotions."""
        self.resume_pins()
        work = self._submit(_Work("barrier"))
        if not work.done.wait(timeout):
            raise TimeoutError(f"promotions still running after {timeout}s")
        return list(self.promoted)

    def drain(self) -> None:
        """Wait for what is queued, if anything ever was."""
        if self._thread is not None:
            self._submit(_Work("barrier")).done.wait()

    def stop(self) -> None:
        """Run what is queued, then end the thread and the uploader process."""
        try:
            if self._thread is not None:
                self._submit(_Work("stop")).done.wait()
                self._thread.join()
        finally:
            if self.pipe is not None:
                self.pipe.stop()

    # -- the thread ---------------------------------------------------------------

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
                    self._promote(work.run, work.generation, work.peers_idle_s)
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

    def _promote(self, run: str, generation: int, peers_idle_s: float = 0.0) -> None:
        retention = self.policy.durable_retention
        with self._recorded(run, generation) as outcome:
            if peers_idle_s > 0:  # several ranks sent their staged chunks meanwhile
                _, root = self.fast.resolve_root(run, generation)
                if len(root.shards) > 1:
                    shards = self.fast.read_shards(root)
                    chunks = sorted({c for s in shards for c in s.chunk_digests()})
                    wait_while_arriving(self.durable, chunks, idle_s=peers_idle_s)
            if self.pipe is not None:
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
        if self.pipe is not None:
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
            if self.pipe is not None:
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
        assert self.pipe is not None
        return self.pipe.run({"rate": self.policy.durable_rate, **job})

    def _collect_fast(self, run: str) -> None:
        collect_garbage(self.fast, RetentionPolicy(keep_last=self.policy.fast_keep), runs=[run])
        # Records of generations the collection dropped: the record says nothing any more.
        forget_elsewhere(Path(self.fast.path), run, set(self.fast.published(run).values()))
