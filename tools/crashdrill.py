"""Crash drill: real multi-rank saves, real SIGKILLs, fresh readers, bitwise resumes.

Every scenario runs real processes in a real gloo group (CPU, deterministic
algorithms) training the small DDP job of tools/resume_parity.py (dropout,
AdamW, warmup scheduler, GradScaler, 2 accumulated microbatches per update, a
NumPy noise generator, a ResumableDistributedSampler). The job saves with
``castore.train.TrainState.save`` after every update, so generations 1..U of
run "drill" hold updates 1..U. Then, per scenario:

1. crash: a fault point is armed (``castore.support.faults.arm(point, "kill")``) in
   one process only, right before the save of update U; that process SIGKILLs
   itself at that point of the two-phase commit. Worker points arm rank 1,
   coordinator points rank 0. The other ranks must fail on their own with a
   castore error (none may return from the save, none may outlive
   ``--save-timeout`` by 10 s; the drill dumps their stacks to their logs,
   SIGKILLs them and fails the row). GC points instead let the job finish its
   U saves, then run the CLI's ``castore gc STORE --keep 2``
   (``castore.cli.main``) in a fresh process with
   ``CASTORE_FAULTS=<point>=kill``.
2. read: a fresh process opens the store and resolves "latest" (the
   generation a resume selects), runs ``verify_store(deep=True)`` (every chunk
   re-hashed) and restores every generation still listed.
3. resume: fresh processes at the same rank count run
   ``TrainState.load(resume="exact")`` and ONE update; its sample ids,
   weights, losses (per microbatch and rank) and resulting parameters,
   optimizer moments, scheduler and scaler must equal bitwise the same update
   of an uninterrupted reference run (no castore involved) at the same rank
   count. Recovery time is from the parent's clock just before it starts the
   resume processes to the end of that first resumed update (slowest rank).

Scenarios and the generation a fresh reader must select:

  worker_mid_shard      dist.worker_mid_shard on rank 1, after its first
                        committed write batch of several           -> U-1
  coordinator_before_ref_advance                                   -> U-1
  coordinator_after_ref_advance  new, and every checksum passes    -> U
  worker_before_ack     rank 1's shard manifest is committed       -> U-1
  coordinator_before_root                                          -> U-1
  gc_mid_sweep          gc killed after its first batch of objects -> U
  gc_mid_chunks         gc killed after its first batch of chunks  -> U
  worker_mid_multipart  blob.mid_multipart on rank 1: its first pack's first
                        part uploaded, the upload never completed  -> U-1
                        (--backend s3 only)
  async_mid_snapshot    async.mid_snapshot on rank 1's training thread,
                        staging its first tensor                   -> U-1
  async_mid_write       async.mid_write on rank 1's writer thread, after its
                        first committed write batch of several     -> U-1
  async_acked_before_publish  dist.coordinator_before_ref_advance on rank
                        0's writer thread: every rank acked        -> U-1
  async_published       no fault: the async save of U publishes    -> U

The async rows save every update with ``TrainState.save(..., blocking=False)``
and train on while each save is in flight: the job runs a whole update past
each save call before that save's writer may write a chunk (the drill holds
the write), so every generation, U-1 included, is written after the next
optimizer step has changed the live tensors. After the save of U a crash row
trains one microbatch more (under ``no_sync``: a dead peer must surface
through castore, not through DDP's all-reduce), the control a whole update;
then each rank waits on ``PendingSave.result()``. The writer-thread faults
fire only after the training thread has run on. The survivors must fail with
a castore error (through ``result()`` or the save call), as in every save row;
``async_published`` must return generation U on every rank, and every rank
must then exit 0. The evidence column says which thread died
and how far training and the write had got.

``--backend`` puts every store of the drill on the local store (LMDB, the
default), a shared directory (``castore.open(path, shared=True)``) or S3
(moto's server on the loopback, started by the drill; tools/drill_backends.py).
On the blob backends each process is a node with its own index cache, and
the stores are opened with a 2 s store lease, so the collection after a
SIGKILLed ``castore gc`` waits seconds, not a minute, for its lease; on S3
packs go up as multipart uploads of 8 KiB parts, so that
``worker_mid_multipart`` kills a rank inside one.

So that "mid" really is mid with a state of ~70 KiB, the drill writes with
4 KiB chunks and shrinks castore's write batch (``chunkio.WRITE_BATCH_BYTES``,
256 MiB) to 8 KiB in its training processes and the collector's delete batch
(``gc.DELETE_BATCH``, 1024 keys) to 2 in its ``castore gc`` process: at the
defaults a shard or a sweep this small is one batch, and the "mid" points fire
only after the last one. The row's evidence column shows how far the killed
process got (bytes of its shard durable; objects and chunks swept).

A GC row collects a byte-for-byte copy of one uninterrupted job's store
(trained once per drill); a fresh reader's dry run on that store says what
the collection frees, and the fresh reader after the kill how much of it was
swept. A GC row also checks that the run lists exactly U-1 and U, and runs the
collection again without the fault: it must finish the sweep (no garbage
left, the store still verifies).

The table has one row per scenario; the exit status is 1 if any row fails.
``--quick`` (2 ranks, 3 updates, every scenario) takes about 35 s on a
2-core machine. ``--control skip-optimizer`` is a broken control: the resume
restores only the weights (``castore.train.load_weights``) and the data
position, so its rows must FAIL the bitwise comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
import _ranks  # noqa: E402
import resume_parity  # noqa: E402 - the training job this drill crashes and resumes
from drill_backends import BACKENDS, DrillBackend, open_options  # noqa: E402

RUN = "drill"
CHUNK_SIZE = 4096  # the store's chunk size: a shard spans many chunks
WRITE_BATCH = 2 * CHUNK_SIZE  # castore.core.chunkio.WRITE_BATCH_BYTES in the drill's savers
DELETE_BATCH = 2  # castore.gc.DELETE_BATCH in the drill's collector
GC_KEEP = 2
GRACE = 10.0  # seconds beyond --save-timeout the survivors get to fail on their own
STARTED_ENV = "CRASHDRILL_STARTED"


@dataclass(frozen=True)
class Scenario:
    name: str
    point: str  # "" for the async control: nothing is armed
    kind: str  # "save" (armed in one rank of the job) or "gc" (armed in castore gc)
    rank: int | None  # the rank whose process dies (None: the collector or nobody)
    expect: str  # "previous" (U-1) or "new" (U)
    blocking: bool = True  # False: every save of the job is async (blocking=False)


SCENARIOS = (
    Scenario("worker_mid_shard", "dist.worker_mid_shard", "save", 1, "previous"),
    Scenario(
        "coordinator_before_ref_advance",
        "dist.coordinator_before_ref_advance",
        "save",
        0,
        "previous",
    ),
    Scenario(
        "coordinator_after_ref_advance", "dist.coordinator_after_ref_advance", "save", 0, "new"
    ),
    Scenario("worker_before_ack", "dist.worker_before_ack", "save", 1, "previous"),
    Scenario("coordinator_before_root", "dist.coordinator_before_root", "save", 0, "previous"),
    Scenario("gc_mid_sweep", "gc.mid_sweep", "gc", None, "new"),
    Scenario("gc_mid_chunks", "gc.mid_chunks", "gc", None, "new"),
    Scenario("async_mid_snapshot", "async.mid_snapshot", "save", 1, "previous", blocking=False),
    Scenario("async_mid_write", "async.mid_write", "save", 1, "previous", blocking=False),
    Scenario(
        "async_acked_before_publish",
        "dist.coordinator_before_ref_advance",
        "save",
        0,
        "previous",
        blocking=False,
    ),
    Scenario("async_published", "", "save", None, "new", blocking=False),
    # S3 only: rank 1 dies between the first part of a pack and the upload's completion.
    Scenario("worker_mid_multipart", "blob.mid_multipart", "save", 1, "previous"),
)
S3_ONLY = {"worker_mid_multipart"}
BY_NAME = {s.name: s for s in SCENARIOS}


# -- the training job (runs in each rank's process) ------------------------------


def _state_digest(job: dict[str, Any]) -> str:
    """One digest of the parameters, optimizer moments, scheduler and scaler bits."""
    final = resume_parity._final(job)
    return hashlib.sha256(json.dumps(final, sort_keys=True).encode()).hexdigest()[:16]


def _train(
    job: dict[str, Any], *, until: int, after_update: Any = None, then: int = 0
) -> dict[int, dict[str, Any]]:
    """Train to update ``until``, then ``then`` microbatches more; per update: batches, state."""
    import torch

    model, state, sampler = job["model"], job["state"], job["sampler"]
    optimizer, scheduler, scaler = job["optimizer"], job["scheduler"], job["scaler"]
    updates: dict[int, dict[str, Any]] = {}
    epoch = sampler.epoch
    stop = until * resume_parity.ACCUMULATION + then  # in microbatches

    def position() -> int:
        return state.update * resume_parity.ACCUMULATION + state.microbatch

    while position() < stop:
        sampler.set_epoch(epoch)  # keeps a just-loaded position of this epoch
        for ids, x, y in job["loader"]:
            last = state.microbatch + 1 == resume_parity.ACCUMULATION
            noise = job["noise"].normal(0.0, 0.01, x.shape).astype("float32")
            x = x + torch.from_numpy(noise)
            record = updates.setdefault(state.update + 1, {"microbatches": []})
            record["microbatches"].append(
                {"ids": ids.tolist(), "weights": resume_parity._weights_digest(job["inner"])}
            )
            with contextlib.nullcontext() if last else model.no_sync():
                loss = torch.nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss / resume_parity.ACCUMULATION).backward()
            record["microbatches"][-1]["loss"] = float(loss.item()).hex()
            state.microbatch_done(len(ids))
            if state.microbatch == resume_parity.ACCUMULATION:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                state.update_done()
                record["state"] = _state_digest(job)
                record["at"] = time.time()
                if after_update is not None:
                    after_update(state.update)
            if position() >= stop:
                return updates
        epoch += 1
    return updates


def _note(path: Path, entry: dict[str, Any]) -> None:
    """Append one line; it reaches the page cache before a SIGKILL can stop us."""
    with path.open("a") as handle:
        handle.write(json.dumps(entry) + "\n")


def _progress(config: dict[str, Any], rank: int) -> Path:
    return Path(config["workdir"], f"progress-{rank}.jsonl")


@contextlib.contextmanager
def _noting_batches(backend: Any, progress: Path) -> Iterator[None]:
    """Note the bytes of each committed batch of chunks ``backend`` writes meanwhile."""
    from castore.chunkstore.base import Namespace

    put_many = backend.put_many

    def watched_put(namespace: Any, items: Any) -> Any:
        sizes: list[int] = []

        def tee() -> Any:
            for key, value in items:
                sizes.append(memoryview(value).nbytes)
                yield key, value

        result = put_many(namespace, tee())
        if namespace is Namespace.CHUNKS:
            _note(progress, {"committed_bytes": sum(sizes)})
        return result

    backend.put_many = watched_put
    try:
        yield
    finally:
        del backend.put_many


def _noting_thread(point: str, progress: Path) -> None:
    """Note the thread that reaches ``point`` (the caller's or the writer's), then go on."""
    import castore.support.faults

    real = castore.support.faults.fault_point

    def noted(name: str) -> None:
        if name == point:
            thread = threading.current_thread().name
            _note(progress, {"fault": name, "thread": thread, "at": time.time()})
        real(name)

    # Each castore module holds its own reference to fault_point.
    for module in list(sys.modules.values()):
        if module.__name__.startswith("castore") and getattr(module, "fault_point", None) is real:
            module.fault_point = noted  # type: ignore[attr-defined]


def _arm(config: dict[str, Any], rank: int, update: int) -> None:
    """Arm the scenario's fault point in this process, and watch how far the save gets."""
    import castore.core.chunkio
    import castore.core.commit
    import castore.support.faults

    point = config["point"]
    progress = _progress(config, rank)
    _note(progress, {"armed": point, "update": update})
    if point == "dist.worker_mid_shard":
        # Observation only: record the shard's size and each committed batch.
        write_leaves = castore.core.commit.write_leaves

        def watched_write(backend: Any, leaves: Any, chunk_size: int, **kwargs: Any) -> Any:
            total = sum(leaf.data.nbytes for leaf in leaves)
            batch_bytes = castore.core.chunkio.WRITE_BATCH_BYTES
            _note(progress, {"shard_bytes": total, "batch_bytes": batch_bytes})
            with _noting_batches(backend, progress):
                return write_leaves(backend, leaves, chunk_size, **kwargs)

        castore.core.commit.write_leaves = watched_write  # type: ignore[assignment]
    if not config["blocking"]:
        _noting_thread(point, progress)
    castore.support.faults.arm(point, "kill")


def _hold_async_writes(
    config: dict[str, Any], rank: int, ran_on: dict[int, threading.Event]
) -> None:
    """Hold each async save's chunk writes until training has run on past its save call.

    So the writer thread's fault points fire while training continues, never
    before the caller's next step changed the live tensors, and every row's
    generation U-1 is written after update U's optimizer step (the snapshot
    alone may hold its bytes). The last save's write notes its batches.
    """
    from castore.core.staging import state_bytes
    from castore.dist import saver

    write_staged = saver.write_staged
    progress = _progress(config, rank)

    def held_write(backend: Any, job: Any, leaves: Any, chunk_size: int, **kwargs: Any) -> Any:
        step = job.pending.step
        held = ran_on[step].wait(config["save_timeout"])
        if step != config["updates"]:
            return write_staged(backend, job, leaves, chunk_size, **kwargs)
        _note(progress, {"write_held": held, "shard_bytes": state_bytes(leaves)})
        with _noting_batches(backend, progress):
            return write_staged(backend, job, leaves, chunk_size, **kwargs)

    saver.write_staged = held_write  # type: ignore[assignment]


def _train_and_save(
    job: dict[str, Any], store: Any, config: dict[str, Any], rank: int
) -> dict[str, Any]:
    """The ``train`` phase: save after every update, blocking or async.

    Async, training runs on after each save call: a whole update before the
    next save, and after the last save (U) one more microbatch (kept local by
    ``no_sync``: a dead peer must surface through castore, not through DDP's
    all-reduce), or, with no fault armed, a whole update; then ``result()``.
    """
    from castore.errors import CastoreError

    updates, blocking = config["updates"], config["blocking"]
    progress = _progress(config, rank)
    ran_on: dict[int, threading.Event] = {}  # save step -> training ran on since its call
    pending: dict[int, Any] = {}
    where = ["training"]
    if not blocking:
        _hold_async_writes(config, rank, ran_on)

    def save(update: int) -> None:
        if update - 1 in ran_on:
            ran_on[update - 1].set()
        if update > updates:
            return
        if update == updates and config.get("armed_rank") == rank:
            if update - 1 in pending and not blocking:
                # The fault is armed process-wide: let the save of U-1, still in
                # flight, finish first (the save call would wait for it anyway).
                pending[update - 1].wait()
            _arm(config, rank, update)
        where[0] = "save"
        if not blocking:
            ran_on[update] = threading.Event()
        options = {} if blocking else {"blocking": False}
        saved = job["state"].save(store, run=RUN, timeout=config["save_timeout"], **options)
        pending[update] = saved
        where[0] = "training"
        if update == updates and not blocking:
            _note(progress, {"save_returned": time.time()})

    then = 0
    if not blocking:
        crash = config.get("armed_rank") is not None
        then = resume_parity.ACCUMULATION - 1 if crash else resume_parity.ACCUMULATION
    try:
        _train(job, until=updates, after_update=save, then=then)
        if not blocking:
            _note(progress, {"trained_on": then, "at": time.time()})
            ran_on[updates].set()
            where[0] = "result()"
            pending[updates] = pending[updates].result()
    except Exception as exc:
        failed = {"failed_in": where[0], "error": type(exc).__name__}
        _note(progress, {**failed, "castore_error": isinstance(exc, CastoreError)})
        raise
    return {"saved": updates, "generation": pending[updates].id}


def worker(config: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """One rank of one launch: ``reference``, ``train`` (saving) or ``resume``."""
    import faulthandler

    import torch

    import castore
    import castore.core.background
    import castore.core.chunkio
    import castore.train

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the drill's "where stuck?"
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    job = resume_parity._job(config, rank, world)
    phase = config["phase"]
    if phase == "reference":
        return {"updates": _train(job, until=config["updates"] + 1)}
    node = f"{config['label']}-rank{rank}"
    store = castore.open(config["store"], create=False, **open_options(node))
    if phase == "train":
        castore.core.chunkio.WRITE_BATCH_BYTES = config["write_batch"]
        trained = _train_and_save(job, store, config, rank)
        store.close()  # as a job should: it raises an async save's error nobody saw
        return trained
    # phase == "resume"
    started = float(os.environ[STARTED_ENV])
    if config["control"] == "skip-optimizer":
        # The broken control: weights and data position only; optimizer, scheduler,
        # scaler and RNG streams stay as freshly built.
        loaded = castore.train.load_weights(store, RUN, job["model"], timeout=config["timeout"])
        generation = loaded.generation
        order = generation.data_order
        job["sampler"].load_state_dict(castore.train.sampler_position(order))
        job["state"].update = order["update"]
    else:
        resumed = job["state"].load(store, run=RUN, resume="exact", timeout=config["timeout"])
        generation = resumed.generation
    loaded_update = job["state"].update
    first = _train(job, until=loaded_update + 1)[loaded_update + 1]
    return {
        "generation": generation.id,
        "update": loaded_update + 1,
        "record": first,
        "recovery_seconds": first["at"] - started,
    }


# -- fresh processes that join no group: the reader and the collector -----------


def _reader(path: str, plan_keep: int | None) -> int:
    """What a fresh reader of the store sees, as one JSON line on stdout."""
    import castore
    from castore.errors import CastoreError
    from castore.gc import RetentionPolicy, collect_garbage
    from castore.verify import verify_store

    out: dict[str, Any] = {}
    with _closing(castore.open(path, create=False, **open_options("reader"))) as store:
        try:
            out["selected"] = store.resolve(RUN, "latest").id
        except CastoreError as exc:
            out["selected"] = None
            out["select_error"] = f"{type(exc).__name__}: {exc}"
        report = verify_store(store, deep=True)
        out["verify_ok"] = report.ok
        out["verify_generations"] = report.generations
        out["verify_chunks_hashed"] = report.chunks_hashed
        out["problems"] = [str(p) for p in report.problems][:10]
        loads: dict[str, str] = {}
        try:
            listed = [g.id for g in store.generations(RUN)]
        except CastoreError as exc:
            listed = []
            loads["listing"] = f"{type(exc).__name__}: {exc}"
        for gen_id in listed:
            try:
                store.restore(RUN, gen_id)
                loads[str(gen_id)] = "ok"
            except CastoreError as exc:
                loads[str(gen_id)] = f"{type(exc).__name__}: {exc}"
        out["listed"] = listed
        out["loads"] = loads
        # Unreferenced bytes right now: a dry run that keeps every generation.
        garbage = collect_garbage(store, RetentionPolicy(keep_last=10**9), dry_run=True)
        out["garbage"] = {"objects": garbage.objects_freed, "chunks": garbage.chunks_freed}
        if plan_keep is not None:
            plan = collect_garbage(store, RetentionPolicy(keep_last=plan_keep), dry_run=True)
            out["would_free"] = {"objects": plan.objects_freed, "chunks": plan.chunks_freed}
    print(json.dumps(out))
    return 0


class _closing:
    def __init__(self, store: Any) -> None:
        self.store = store

    def __enter__(self) -> Any:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


def _collector(path: str, keep: int, delete_batch: int) -> int:
    """``castore gc STORE --keep K --yes``: the CLI's own code, with a smaller delete batch.

    ``--yes``: run from a terminal, the drill's collector would otherwise stop at
    gc's question, which nobody sees (its output is captured).
    """
    import castore
    import castore.cli.collection
    import castore.gc
    from castore.cli import main as castore_cli

    castore.gc.DELETE_BATCH = delete_batch
    options = open_options("collector")
    if options:  # a store on blobs: this node's cache, the drill's short store lease

        def open_here(path: str) -> Any:
            return castore.open(path, create=False, **options)

        castore.cli.collection.open_existing = open_here
    return castore_cli(["gc", path, "--keep", str(keep), "--yes"])


def _self_command(*args: str) -> list[str]:
    return [str(Path(__file__).resolve()), *args]


def read_store(path: str, *, plan_keep: int | None = None) -> dict[str, Any]:
    command = _self_command("--reader", path)
    if plan_keep is not None:
        command += ["--plan-keep", str(plan_keep)]
    env = {k: v for k, v in os.environ.items() if k != "CASTORE_FAULTS"}
    done = _ranks.run_script(command, env=env, timeout=120)
    if done.returncode != 0:
        return {"selected": None, "reader_error": done.stderr[-800:]}
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def collect(path: str, *, fault: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CASTORE_FAULTS"}
    if fault:
        env["CASTORE_FAULTS"] = f"{fault}=kill"
    command = _self_command("--collector", path, str(GC_KEEP), str(DELETE_BATCH))
    return _ranks.run_script(command, env=env, timeout=120)


# -- launching ranks ---------------------------------------------------------------


@dataclass
class Launch:
    """How the processes of one launch ended."""

    returncodes: list[int]
    results: list[dict[str, Any] | None]
    killed_by_drill: list[int]
    seconds: float
    logs: str = ""
    armed_died_at: float | None = None  # when the parent saw the armed rank gone


def launch(
    config: dict[str, Any], phase: str, label: str, *, armed_rank: int | None = None
) -> Launch:
    """Start every rank of one launch; if ``armed_rank`` dies, let the others fail alone."""
    started = time.time()
    workers = _ranks.start_workers(
        Path(__file__).resolve(),
        config,
        phase=phase,
        label=label,
        world=config["ranks"],
        env=_ranks.worker_env(STARTED_ENV, started),
        armed_rank=armed_rank,
    )
    armed_died: float | None = None
    armed_died_at: float | None = None

    def armed_rank_gone_past_grace() -> bool:
        nonlocal armed_died, armed_died_at
        armed = workers.procs[armed_rank] if armed_rank is not None else None
        if armed is not None and armed_died is None and armed.poll() is not None:
            armed_died, armed_died_at = time.monotonic(), time.time()
        return armed_died is not None and time.monotonic() - armed_died > config["grace"]

    workers.wait(config["timeout"], stop=armed_rank_gone_past_grace, poll=0.01)
    stuck = [p for p in workers.procs if p.poll() is None]
    for proc in stuck:  # their stacks go to their logs (faulthandler, see worker)
        proc.send_signal(signal.SIGUSR1)
    if stuck:
        time.sleep(0.5)
    killed = workers.kill_remaining()
    return Launch(
        [p.returncode for p in workers.procs],
        workers.results(),
        killed,
        time.time() - started,
        workers.log_tails(600),
        armed_died_at,
    )


def _require_ok(launch_: Launch, what: str) -> list[dict[str, Any]]:
    oks = []
    for rank, result in enumerate(launch_.results):
        if result is None or "ok" not in result:
            detail = result["error"] if result else f"exit {launch_.returncodes[rank]}"
            raise SystemExit(f"{what}: rank {rank} failed: {detail}\n{launch_.logs}")
        oks.append(result["ok"])
    return oks


# -- one scenario --------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    point: str
    killed: str
    exit_code: int | None = None
    survivors: str = ""
    evidence: str = ""
    expected: int | None = None
    selected: int | None = None
    verify: bool = False
    listed: list[int] = field(default_factory=list)
    all_listed_load: bool = False
    garbage_left: dict[str, int] = field(default_factory=dict)
    resumed_generation: int | None = None
    resumed_equal: bool = False
    recovery_seconds: float | None = None
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures


def _new_store(location: str) -> None:
    import castore

    castore.open(location, chunk_size=CHUNK_SIZE, **open_options("creator")).close()


def _entries(progress: Path) -> list[dict[str, Any]]:
    if not progress.exists():
        return []
    return [json.loads(line) for line in progress.read_text().splitlines()]


def _survivors(crash: Launch, armed: int | None, scenario_dir: Path) -> tuple[str, list[str]]:
    """How the ranks that were not armed ended, and what is wrong with that.

    Each must fail on its own with a castore error within its save timeout: a
    survivor that returned published a generation without the dead rank, and
    one the drill had to kill broke castore's bounded waits. Where an async
    save's error surfaced (its ``result()``, or the save call itself) is shown.
    """
    ends: dict[str, list[int]] = {}
    problems = []
    latest = None
    for rank, result in enumerate(crash.results):
        if rank == armed:
            continue
        failed = next(
            (e for e in _entries(scenario_dir / f"progress-{rank}.jsonl") if "failed_in" in e), {}
        )
        if rank in crash.killed_by_drill:
            end = "killed by drill"
            stuck = _stuck_at(scenario_dir / f"crash-{rank}.log")
            problems.append(
                f"rank {rank} still ran {GRACE:g}s past its save timeout; its threads' "
                f"innermost castore frames: {stuck}"
            )
        elif result is None:
            end = f"exit {crash.returncodes[rank]}"
            problems.append(f"rank {rank} died without a result (exit {crash.returncodes[rank]})")
        elif "error" in result:
            end = result["error"]["type"]
            if failed and failed["failed_in"] != "save":
                end += f" via {failed['failed_in']}"
            latest = max(latest or 0.0, result["error"]["at"])
            if not failed.get("castore_error"):
                problems.append(
                    f"rank {rank} failed {failed.get('failed_in', 'outside the job')} with "
                    f"{end}, not a castore error: {result['error']['message'][:200]}"
                )
        elif armed is None:
            end = f"returned generation {result['ok']['generation']}"
        else:
            end = "returned"
            problems.append(f"rank {rank} finished the save although rank {armed} died")
        ends.setdefault(end, []).append(rank)
    text = ", ".join(f"{end} (r{','.join(map(str, ranks))})" for end, ranks in ends.items())
    if latest is not None and crash.armed_died_at is not None:
        text += f" in {max(0.0, latest - crash.armed_died_at):.2f}s"
    return text, problems


def _last_line(log: Path) -> str:
    """The last line of a rank's log that is not one of DDP's warnings."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return next((line for line in reversed(lines) if "reducer.cpp" not in line), "")


def _stuck_at(log: Path) -> str:
    """Each thread's innermost castore frame in the faulthandler dump of a stuck rank."""
    if not log.exists():
        return "no log"
    frames: list[str] = []
    found: str | None = None
    for line in log.read_text(errors="replace").splitlines():
        text = line.strip()
        if text.startswith(("Thread 0x", "Current thread")):
            frames += [found] if found else []
            found = None
        elif found is None and text.startswith("File ") and "/castore/" in text:
            # File "/.../castore/background.py", line 222 in drain (innermost first)
            path, _, where = text[len('File "') :].partition('", line ')
            found = f"{Path(path).name}:{where.replace(' in ', ' ')}"
    frames += [found] if found else []
    return "; ".join(frames) or "none"


def _mid_shard_evidence(progress: Path) -> tuple[str, bool]:
    """Bytes of the killed rank's shard durable when it died (mid-shard: some, not all)."""
    if not progress.exists():
        return "no progress recorded", False
    entries = _entries(progress)
    total = next((e["shard_bytes"] for e in entries if "shard_bytes" in e), None)
    committed = [e["committed_bytes"] for e in entries if "committed_bytes" in e]
    if total is None:
        return "the shard write never started", False
    done = sum(committed)
    text = f"{len(committed)} batch(es), {done} of {total} B durable"
    return text, 0 < done < total


def _async_evidence(scenario: Scenario, progress: Path) -> tuple[str, bool]:
    """Which thread of the killed rank died, and whether training had run on by then."""
    entries = _entries(progress)
    fault = next((e for e in entries if "fault" in e), None)
    returned = next((e["save_returned"] for e in entries if "save_returned" in e), None)
    trained = next((e for e in entries if "trained_on" in e), None)
    if fault is None:
        return "the fault point was never reached", False
    if scenario.point == "async.mid_snapshot":
        text = f"{fault['thread']} died staging; the save call never returned"
        return text, fault["thread"] == "MainThread" and returned is None
    if returned is None or trained is None:
        return f"{fault['thread']} died before training ran on past the save call", False
    text = (
        f"{fault['thread']} thread died {fault['at'] - returned:.2f}s after save() "
        f"returned, {trained['trained_on']} microbatch trained on"
    )
    ok = fault["thread"] != "MainThread" and trained["at"] <= fault["at"]
    if scenario.point == "async.mid_write":
        batches, mid = _mid_shard_evidence(progress)
        text, ok = f"{text}; {batches}", ok and mid
    return text, ok


def _published_evidence(crash: Launch, scenario_dir: Path, updates: int) -> tuple[str, bool]:
    """The async control: every rank trained a whole update on, then result() gave U."""
    trained, held = [], []
    for rank in range(len(crash.results)):
        entries = _entries(scenario_dir / f"progress-{rank}.jsonl")
        trained += [e["trained_on"] for e in entries if "trained_on" in e]
        held += [e["write_held"] for e in entries if "write_held" in e]
    generations = {r["ok"]["generation"] for r in crash.results if r and "ok" in r}
    ranks = len(crash.results)
    text = (
        f"every rank trained update {updates + 1} before writing {updates}: "
        f"{sum(held)}/{ranks}; result() gave {sorted(generations)}"
    )
    ok = len(trained) == ranks and held == [True] * ranks and generations == {updates}
    return text, ok


def run_save_scenario(
    config: dict[str, Any], scenario: Scenario, row: Row, scenario_dir: Path, backend: DrillBackend
) -> str:
    store = backend.location(scenario_dir)
    _new_store(store)
    settings = {
        **config,
        "store": store,
        "point": scenario.point,
        "workdir": str(scenario_dir),
        "blocking": scenario.blocking,
    }
    crash = launch(settings, "train", "crash", armed_rank=scenario.rank)
    row.survivors, problems = _survivors(crash, scenario.rank, scenario_dir)
    row.failures += problems
    if scenario.rank is None:
        row.exit_code = max(crash.returncodes, key=abs)
        row.evidence, published = _published_evidence(crash, scenario_dir, config["updates"])
        if not published:
            row.failures.append(f"the async saves did not all publish: {row.evidence}")
        if any(crash.returncodes):
            last_words = {
                rank: _last_line(scenario_dir / f"crash-{rank}.log")
                for rank, code in enumerate(crash.returncodes)
                if code
            }
            row.failures.append(
                f"every rank returned generation {config['updates']}, then exited "
                f"{crash.returncodes}; last log lines: {last_words}"
            )
        return store
    row.exit_code = crash.returncodes[scenario.rank]
    if row.exit_code != -signal.SIGKILL:
        row.failures.append(
            f"rank {scenario.rank} was to die by SIGKILL at {scenario.point}, exit {row.exit_code}"
            f"\n{crash.logs}"
        )
    progress = scenario_dir / f"progress-{scenario.rank}.jsonl"
    armed = next((e for e in _entries(progress) if "armed" in e), None)
    if not armed or armed.get("update") != config["updates"]:
        row.failures.append(f"the fault was not armed at the save of update {config['updates']}")
    if not scenario.blocking:
        row.evidence, fits = _async_evidence(scenario, progress)
        if not fits:
            row.failures.append(f"not killed as the scenario says: {row.evidence}")
    elif scenario.point == "dist.worker_mid_shard":
        row.evidence, mid = _mid_shard_evidence(progress)
        if not mid:
            row.failures.append(f"not killed mid-shard: {row.evidence}")
    if scenario.point == "blob.mid_multipart":
        uploads = backend.incomplete_uploads(store)
        row.evidence = f"{uploads} multipart upload(s) left incomplete"
        if uploads < 1:
            row.failures.append(f"not killed mid-multipart: {row.evidence}")
    return store


@dataclass(frozen=True)
class Trained:
    """The uninterrupted job's store that every GC row collects a copy of."""

    location: str
    would_free: dict[str, int]  # what ``castore gc --keep GC_KEEP`` frees of it (a dry run)


def run_gc_scenario(
    scenario: Scenario, row: Row, scenario_dir: Path, trained: Trained, backend: DrillBackend
) -> tuple[str, dict[str, Any]]:
    """Collect a copy of the trained store with ``castore gc`` killed mid-sweep.

    Returns the store and what a fresh reader saw there after the kill.
    """
    store = backend.location(scenario_dir)
    backend.copy(trained.location, store)  # byte for byte: the trained store's would_free
    would = trained.would_free
    killed = collect(store, fault=scenario.point)
    row.exit_code = killed.returncode
    if killed.returncode != -signal.SIGKILL:
        row.failures.append(
            f"castore gc was to die by SIGKILL at {scenario.point}, exit {killed.returncode}: "
            f"{(killed.stdout + killed.stderr)[-400:]}"
        )
    after = read_store(store)
    left = after.get("garbage", {"objects": -1, "chunks": -1})
    swept = {kind: would[kind] - left[kind] for kind in ("objects", "chunks")}
    row.evidence = (
        f"swept {swept['objects']}/{would['objects']} objects, "
        f"{swept['chunks']}/{would['chunks']} chunks"
    )
    if scenario.point == "gc.mid_sweep":
        mid = 0 < swept["objects"] < would["objects"] and swept["chunks"] == 0
    else:
        mid = swept["objects"] == would["objects"] and 0 < swept["chunks"] < would["chunks"]
    if not mid:
        row.failures.append(f"not killed mid-sweep at {scenario.point}: {row.evidence}")
    return store, after


def _compare(
    reference: list[dict[str, Any]], resumed: list[dict[str, Any]], update: int
) -> list[str]:
    """Every rank's first resumed update against the reference's same update, bitwise."""
    differences = []
    for rank, (ref, new) in enumerate(zip(reference, resumed, strict=True)):
        want = ref["updates"].get(str(update))
        got = new["record"]
        if want is None:
            differences.append(f"the reference has no update {update}")
            continue
        for key in ("microbatches", "state"):
            if want[key] != got[key]:
                differences.append(f"rank {rank} update {update}: {key} differ")
    return differences


def run_scenario(
    config: dict[str, Any],
    scenario: Scenario,
    reference: list[dict[str, Any]],
    trained: Trained | None,
    backend: DrillBackend,
) -> Row:
    clock = time.perf_counter()
    updates = config["updates"]
    row = Row(
        scenario=scenario.name,
        point=scenario.point,
        killed=(
            "castore gc"
            if scenario.kind == "gc"
            else "nobody"
            if scenario.rank is None
            else f"rank {scenario.rank}"
        ),
        expected=updates - 1 if scenario.expect == "previous" else updates,
    )
    scenario_dir = Path(config["workdir"], scenario.name)
    scenario_dir.mkdir(parents=True, exist_ok=True)
    if scenario.kind == "save":
        store = run_save_scenario(config, scenario, row, scenario_dir, backend)
        seen = read_store(store)
    else:
        assert trained is not None
        store, seen = run_gc_scenario(scenario, row, scenario_dir, trained, backend)

    row.selected = seen.get("selected")
    row.verify = bool(seen.get("verify_ok"))
    row.listed = seen.get("listed", [])
    row.all_listed_load = bool(row.listed) and all(
        v == "ok" for v in seen.get("loads", {}).values()
    )
    row.garbage_left = seen.get("garbage", {})
    if scenario.kind == "save" and not row.evidence:
        row.evidence = (
            f"garbage left: {row.garbage_left.get('objects')} objects, "
            f"{row.garbage_left.get('chunks')} chunks"
        )
    if row.selected != row.expected:
        row.failures.append(
            f"a fresh reader selects generation {row.selected}, expected {row.expected}"
            + (
                f" ({seen.get('select_error') or seen.get('reader_error')})"
                if not row.selected
                else ""
            )
        )
    if not row.verify:
        row.failures.append(f"verify --deep: {seen.get('problems') or seen.get('reader_error')}")
    if not row.all_listed_load:
        row.failures.append(f"not every listed generation loads: {seen.get('loads')}")
    if scenario.kind == "gc" and row.listed != list(range(updates - GC_KEEP + 1, updates + 1)):
        row.failures.append(f"after gc --keep {GC_KEEP} the run lists {row.listed}")

    resume = launch({**config, "store": store, "workdir": str(scenario_dir)}, "resume", "resume")
    results = resume.results
    if any(r is None or "ok" not in r for r in results):
        errors = [
            r["error"] if r else f"exit {c}"
            for r, c in zip(results, resume.returncodes, strict=True)
        ]
        row.failures.append(f"the resume failed: {errors}\n{resume.logs}")
    else:
        resumed = [r["ok"] for r in results]  # type: ignore[index]
        row.resumed_generation = resumed[0]["generation"]
        row.recovery_seconds = max(r["recovery_seconds"] for r in resumed)
        differences = _compare(reference, resumed, resumed[0]["update"])
        row.resumed_equal = not differences
        if differences:
            row.failures.append(
                "first resumed update differs from the reference: " + "; ".join(differences)
            )
        if row.resumed_generation != row.expected:
            row.failures.append(f"the resume loaded generation {row.resumed_generation}")

    if scenario.kind == "gc":
        finished = collect(store, fault=None)
        again = read_store(store)
        if finished.returncode != 0 or again.get("garbage") != {"objects": 0, "chunks": 0}:
            row.failures.append(
                f"a second gc did not finish the sweep: exit {finished.returncode}, "
                f"garbage {again.get('garbage')}"
            )
        elif not again.get("verify_ok"):
            row.failures.append(f"after the second gc: {again.get('problems')}")
    row.seconds = time.perf_counter() - clock
    return row


# -- the drill -------------------------------------------------------------------------


def run_drill(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="castore-crashdrill-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "workdir": str(workdir),
        "ranks": args.ranks,
        "updates": args.updates,
        "save_timeout": args.save_timeout,
        "grace": args.save_timeout + GRACE,
        "timeout": args.timeout,
        "write_batch": WRITE_BATCH,
        "blocking": True,  # the async rows' saves pass blocking=False
        "control": args.control,
        "backend": args.backend,
        "codec": args.codec,
    }
    with DrillBackend(args.backend, workdir, args.codec) as backend:
        return _run_rows(args, config, backend)


def _run_rows(
    args: argparse.Namespace, config: dict[str, Any], backend: DrillBackend
) -> dict[str, Any]:
    workdir = Path(config["workdir"])
    scenarios = [BY_NAME[name] for name in args.scenarios]
    clock = time.perf_counter()
    timings: dict[str, float] = {}
    ref_dir = workdir / "reference"
    ref_dir.mkdir(exist_ok=True)
    reference = _require_ok(
        launch({**config, "workdir": str(ref_dir)}, "reference", "reference"), "reference"
    )
    timings["reference"] = time.perf_counter() - clock
    trained: Trained | None = None
    if any(s.kind == "gc" for s in scenarios):
        step = time.perf_counter()
        trained_dir = workdir / "trained"
        trained_dir.mkdir(exist_ok=True)
        location = backend.location(trained_dir)
        _new_store(location)
        _require_ok(
            launch({**config, "store": location, "workdir": str(trained_dir)}, "train", "train"),
            "uninterrupted training for the gc scenarios",
        )
        plan = read_store(location, plan_keep=GC_KEEP)
        trained = Trained(location, plan.get("would_free", {"objects": 0, "chunks": 0}))
        timings["train_for_gc"] = time.perf_counter() - step
    rows = []
    for scenario in scenarios:
        row = run_scenario(config, scenario, reference, trained, backend)
        rows.append(row)
        if args.verbose:
            print(f"{row.scenario}: {'PASS' if row.passed else 'FAIL'} ({row.seconds:.1f}s)")
    timings["total"] = time.perf_counter() - clock
    return {"config": config, "rows": rows, "timings": timings}


def print_table(drill: dict[str, Any]) -> None:
    from tabulate import tabulate

    config = drill["config"]
    updates = config["updates"]
    print(
        f"crash drill ({config['backend']} store): {config['ranks']} ranks, generations "
        f"1..{updates} (fault armed at the save of update {updates}), chunks {CHUNK_SIZE} B, "
        f"write batch {WRITE_BATCH} B, "
        f"gc --keep {GC_KEEP} with delete batch {DELETE_BATCH}"
        + (f", CONTROL {config['control']}" if config["control"] else "")
    )
    rows = []
    for index, row in enumerate(drill["rows"], 1):
        rows.append(
            [
                index,
                row.scenario,
                row.point or "-",
                f"{row.killed} ({row.exit_code})",
                row.survivors or "-",
                row.evidence,
                f"{row.selected} ({row.expected})",
                "ok" if row.verify else "FAIL",
                "yes" if row.resumed_equal else "NO",
                "-" if row.recovery_seconds is None else f"{row.recovery_seconds:.2f}",
                "PASS" if row.passed else "FAIL",
            ]
        )
    print(
        tabulate(
            rows,
            headers=[
                "#",
                "scenario",
                "fault point",
                "killed (exit)",
                "other ranks",
                "crash evidence",
                "selects (expected)",
                "verify --deep",
                "resume == ref",
                "recovery s",
                "result",
            ],
        )
    )
    for row in drill["rows"]:
        for failure in row.failures:
            print(f"FAIL {row.scenario}: {failure}")
    timings = drill["timings"]
    recovery = [r.recovery_seconds for r in drill["rows"] if r.recovery_seconds is not None]
    print(
        f"wall time {timings['total']:.1f}s (reference {timings['reference']:.1f}s"
        + (f", training for gc {timings['train_for_gc']:.1f}s" if "train_for_gc" in timings else "")
        + "); recovery (resume process start to first resumed update, slowest rank): "
        + (
            f"median {sorted(recovery)[len(recovery) // 2]:.2f}s, max {max(recovery):.2f}s"
            if recovery
            else "-"
        )
    )
    passed = sum(r.passed for r in drill["rows"])
    print(f"RESULT: {passed}/{len(drill['rows'])} scenarios pass")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, default=None, help="world size (default 4; quick 2)")
    parser.add_argument(
        "--updates",
        type=int,
        default=None,
        help="updates (= generations) of the job; the fault hits the last save "
        "(default 4; quick 3)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="local",
        help="where the stores live: the local store (LMDB), a shared directory, or S3 "
        "(moto's server on the loopback); default local",
    )
    parser.add_argument(
        "--scenarios",
        default=None,
        help="comma list (default: all that apply to the backend): "
        + ", ".join(s.name for s in SCENARIOS)
        + f" ({', '.join(sorted(S3_ONLY))}: s3 only)",
    )
    parser.add_argument(
        "--codec",
        choices=["none", "auto", "zstd", "bytegroup"],
        default=None,
        help="every store compresses new chunks by this codec (default: the store's own: "
        "none on local stores, auto on blobs)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 ranks, 3 updates, every scenario (~35 s)"
    )
    parser.add_argument(
        "--control",
        choices=["skip-optimizer"],
        default=None,
        help="a broken control: resume the weights and data position only (must FAIL)",
    )
    parser.add_argument("--save-timeout", type=float, default=20.0, help="castore timeout (s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--workdir", default=None, help="keep every launch's files here")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per scenario")
    args = parser.parse_args(argv)
    args.ranks = args.ranks or (2 if args.quick else 4)
    args.updates = args.updates or (3 if args.quick else 4)
    if args.scenarios is None:
        applies = [s.name for s in SCENARIOS if args.backend == "s3" or s.name not in S3_ONLY]
        args.scenarios = ",".join(applies)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.scenarios if s not in BY_NAME]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(BY_NAME)}")
    s3_only = [s for s in args.scenarios if s in S3_ONLY and args.backend != "s3"]
    if s3_only:
        parser.error(f"scenarios {s3_only} apply to --backend s3 only")
    if args.ranks < 2:
        parser.error("--ranks must be at least 2 (worker faults need a rank besides rank 0)")
    if args.updates < GC_KEEP + 1:
        parser.error(f"--updates must be at least {GC_KEEP + 1} (gc --keep {GC_KEEP} drops one)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _ranks.run_child(Path(argv[1]), int(argv[2]), worker)
    if argv[:1] == ["--reader"]:
        keep = int(argv[3]) if argv[2:3] == ["--plan-keep"] else None
        return _reader(argv[1], keep)
    if argv[:1] == ["--collector"]:
        return _collector(argv[1], int(argv[2]), int(argv[3]))
    args = parse_args(argv)
    drill = run_drill(args)
    print_table(drill)
    if args.json:
        rows = [{**asdict(r), "passed": r.passed} for r in drill["rows"]]
        Path(args.json).write_text(
            json.dumps(
                {"config": drill["config"], "timings": drill["timings"], "rows": rows}, indent=1
            )
        )
    if args.workdir is None:
        shutil.rmtree(drill["config"]["workdir"], ignore_errors=True)
    return 0 if all(r.passed for r in drill["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
