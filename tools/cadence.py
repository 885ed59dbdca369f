"""The receipt that checkpointing does not stall training: `make cadence`.

Trains a small transformer language model (token and position embeddings,
``--layers`` ``nn.TransformerEncoderLayer``s, an LM head; AdamW) on the CPU
with ``--ranks`` real processes in one gloo group under DDP, one intra-op
thread each, for ``--steps`` timed steps after a few untimed warm-up steps,
and saves the whole training state (every parameter, every AdamW moment and
step tensor, the learning rate and the step counter, as one flat dict) every
``--every`` steps, except at the last step, so every save's publish lands
while the job still trains. Modes:

  baseline                 no checkpointing
  castore-sync             castore.dist.save (blocking)
  castore-async            castore.dist.save(blocking=False), full-copy staging
  castore-async-changed    the same, staging only the chunks that changed
  castore-async-throttled  full staging, writes capped at --throttle-mib-s per
                           rank, hashing on one thread (hash_threads=1), and
                           rank r starting --stagger-s * r / ranks late
  castore-tiered           castore.open_tiered: the throttled mode's async saves
                           into a fast tier in /dev/shm; every second generation
                           (and the last) promoted to the store by the
                           coordinator's uploader process (nice 10), capped at
                           --throttle-mib-s for the whole job
  castore-tiered-idle      the same, the uploader process under SCHED_IDLE
                           (uploader_priority="idle")
  castore-tiered-stepped   castore-tiered whose ranks report each step
                           (store.report_step()): each rank sends a promoted
                           generation's chunks from its staging buffers within
                           --step-budget of each step's time
  dcp-sync                 torch.distributed.checkpoint.save (FileSystemWriter)
  dcp-async                torch.distributed.checkpoint.async_save (thread
                           executor, torch's default), on its own gloo group so
                           its background collectives never meet DDP's

Every mode runs in a fresh group of processes (so the resident-set high-water
mark belongs to one mode), once per round, in an order that rotates from one
round to the next so machine noise spreads evenly over the modes. castore
saves into a fresh store per run, DCP into a fresh folder per save, all inside
one temporary folder per run. An async save is awaited before the next save
of its mode (castore: ``if_busy="wait"``; DCP: the future) and at the end;
that wait counts as stall.

Each run then does, untimed for the training figures:

- the broken control: ``Config.idle_saves`` (2) of the same saves on an idle
  job (call save, wait for its publish, repeat; between two saves the
  optimizer steps once on the last gradients, so every tensor changes as in
  training and no save is deduplicated away);
- the memcpy reference: every tensor of the state copied into preallocated
  (already touched) buffers, ``Config.copy_repeats`` (5) times.

Figures, over ranks and rounds: the step time (from the start of one step to
the start of the next, so it includes any save call made after the step) at
p50, p99 and max, each as a ratio to the baseline's; the stall per save (wall
time the training thread spent in the save call, including any wait for the
previous save; the median leaves out each run's first save, which allocates
what later saves reuse, and is shown apart); the time from the call to the
durable publish; the recovery point objective in steps, K + the most steps
that began between a save's call and its publish (past the run's end, time
converted at the median step time, rounded up), i.e. the steps a crash just
before a publish would lose; castore's peak staging bytes and the rise of
the process's VmHWM over its training-only high-water mark; bytes written per
save, whole job (castore: new chunk bytes and manifests; DCP: the size of the
folder it wrote). Goals (issue 13), for castore's async modes: median stall
<= 1.2x the memcpy of the state; staging <= 1.0x the state (full copy) and
< 1.5x the changed bytes (changed-chunk staging). castore stages only the
replicated tensors its rank writes, so the stall is also shown against a
memcpy of as many bytes as the rank staged.

Output (``--out``, default ``cadence-out/``): ``receipt.json`` (every input
and figure, and the raw step times and save records) and ``steps.png``
(median step time per step, one line per mode, saves marked). The run
docs/PERFORMANCE.md quotes is kept as benchmarks/results/cadence-receipt.json
and benchmarks/results/cadence-steps.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import queue
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from tabulate import tabulate
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import print_goals, tree_bytes  # noqa: E402
from _ranks import join_tcp_group, spawn_ranks, stop_ranks  # noqa: E402

import castore  # noqa: E402
import castore.dist  # noqa: E402

MIB = 1 << 20
RUN = "cadence"
MODES = (
    "baseline",
    "castore-sync",
    "castore-async",
    "castore-async-changed",
    "castore-async-throttled",
    "castore-tiered",
    "castore-tiered-idle",
    "castore-tiered-stepped",
    "dcp-sync",
    "dcp-async",
)
TIERED_EVERY = 2  # castore-tiered promotes every 2nd generation to the durable store
TIERED_P99_GOAL = 1.05  # issue 25: tiered saves' step p99 against the baseline's
STEPPED_P99_GOAL = 1.10  # issue 42: step-paced promotions' p99 against the baseline's
STEPPED_OVER_THROTTLED = 0.02  # ... and at most the throttled mode's plus this
P99_GOAL = 1.10  # throttled async saves: step p99 against the baseline's
CASTORE_ASYNC = (
    "castore-async",
    "castore-async-changed",
    "castore-async-throttled",
    "castore-tiered",
    "castore-tiered-idle",
    "castore-tiered-stepped",
)
ASYNC_MODES = (*CASTORE_ASYNC, "dcp-async")
NOTES = (
    "step: start of one step to the start of the next (a save call made after it included)",
    "stall: wall time the training thread spent in the save call (sync: the whole save);"
    " med (and call→publish med): each run's saves after its first, which allocates",
    "RPO: K + the most steps that began between a save's call and its publish (rounded up)",
    "stall/memcpy: against copying every tensor of the state; …of staged bytes: against"
    " copying as many bytes as the rank staged (castore stages the replicated tensors it writes)",
    "RSS rise: VmHWM at the end of the timed steps less VmHWM after the warm-up steps",
)
STALL_GOAL = 1.2  # an async save's median stall <= 1.2x a plain copy of the state's tensors
RUN_TIMEOUT = 600.0  # seconds one mode's run may take
# Imported once by the fork server, so a run's ranks start in a fraction of a second
# instead of each importing torch again (5 s a run on a 2-core machine).
PRELOAD = ["torch", "torch.distributed.checkpoint", "castore.dist", "tabulate", "_common", "_ranks"]


@dataclass(frozen=True)
class Config:
    """Every input of one invocation (it goes into the receipt as is)."""

    ranks: int = 2
    steps: int = 40
    every: int = 10
    d_model: int = 256
    layers: int = 4
    vocab: int = 4096
    seq: int = 64
    batch: int = 2
    rounds: int = 4
    modes: tuple[str, ...] = MODES
    throttle_mib_s: float = 64.0
    stagger_s: float = 0.3
    step_budget: float = 0.02  # castore-tiered-stepped's durable_step_budget
    warmup: int = 3
    idle_saves: int = 2
    copy_repeats: int = 5

    @property
    def heads(self) -> int:
        return max(1, self.d_model // 64)


QUICK: dict[str, Any] = {"steps": 12, "every": 4, "d_model": 64, "layers": 2, "vocab": 1024}
QUICK |= {"seq": 32, "rounds": 1, "warmup": 2, "idle_saves": 1, "copy_repeats": 3}
QUICK |= {"stagger_s": 0.02}


# -- the model and its training ------------------------------------------------


class TinyLM(nn.Module):
    """A causal transformer language model small enough for a 2-core machine."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.position = nn.Parameter(torch.randn(cfg.seq, cfg.d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.heads, 4 * cfg.d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(cfg.seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.encoder(hidden, mask=self.mask, is_causal=True))


def tokens_for(cfg: Config, rank: int, step: int) -> torch.Tensor:
    """The batch of ``rank`` at ``step``: the same in every mode, so every mode does equal work."""
    generator = torch.Generator().manual_seed(1_000_003 * rank + step)
    return torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=generator)


def train_step(ddp: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    logits = ddp(tokens)
    vocab = logits.shape[-1]
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """The whole training state as one flat dict of tensors and plain values (DCP's usual shape)."""
    state: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, moments in optimizer.state.items():
        for key, value in moments.items():
            state[f"optim.{names[id(param)]}.{key}"] = value
    state["optim.lr"] = optimizer.param_groups[0]["lr"]
    state["step"] = step
    return state


def state_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]


# -- savers: one per kind of save, all with the same calls --------------------


@dataclass
class SaveRecord:
    """One save as this rank saw it; times are ``time.perf_counter()`` seconds."""

    step: int
    called: float
    returned: float  # the training thread has control back
    published: float | None = None  # durable and visible (None: skipped)
    written: int = 0  # bytes the save wrote, whole job (0 where another rank reports it)
    staging_peak: int = 0  # castore's tracked staging bytes
    new_bytes: int = 0  # castore async: new chunk bytes this rank wrote (the changed bytes)
    staged_bytes: int = 0  # castore async: bytes this rank copied into staging
    timings: dict[str, float] = field(default_factory=dict)  # castore's own, by phase


class Saver:
    """Saves the training state every K steps; ``finish`` waits for every save in flight."""

    def __init__(self) -> None:
        self.records: list[SaveRecord] = []

    def save(self, state: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def step_done(self) -> None:
        """A training step finished (a saver that paces by steps hears of it)."""

    def finish(self) -> None:
        """Wait for every save still in flight and complete its record."""

    def close(self) -> None:
        self.finish()


class CastoreSaver(Saver):
    """castore.dist.save into one store; blocking when ``options`` is None."""

    def __init__(
        self,
        store_path: str,
        options: Any | None,
        tiered: dict[str, Any] | None = None,
        report_steps: bool = False,
    ) -> None:
        super().__init__()
        self.store = (
            castore.open(store_path, create=False)
            if tiered is None
            else castore.open_tiered(durable=store_path, **tiered)
        )
        self.options = options
        self.report_steps = report_steps
        self.in_flight: list[tuple[SaveRecord, Any]] = []

    def step_done(self) -> None:
        if self.report_steps:
            self.store.report_step()

    def save(self, state: dict[str, Any], step: int) -> None:
        called = time.perf_counter()
        if self.options is None:
            generation = castore.dist.save(self.store, state, run=RUN, step=step)
            now = time.perf_counter()
            stats = generation.stats  # the whole job's, on every rank
            written = stats.written_bytes or stats.new_bytes if dist.get_rank() == 0 else 0
            self.records.append(SaveRecord(step, called, now, now, written))
            return
        pending = castore.dist.save(
            self.store,
            state,
            run=RUN,
            step=step,
            blocking=False,
            if_busy="wait",
            async_options=self.options,
        )
        record = SaveRecord(step, called, time.perf_counter())
        self.records.append(record)
        self.in_flight.append((record, pending))

    def finish(self) -> None:
        for record, pending in self.in_flight:
            generation = pending.result()
            if generation is not None:
                record.published = record.called + pending.timings["total"]
            record.written = pending.bytes.written  # this rank's: summed over ranks later
            record.staging_peak = pending.peak_staging_bytes
            record.new_bytes = pending.bytes.new
            record.staged_bytes = pending.bytes.staged
            record.timings = dict(pending.timings)
        self.in_flight.clear()

    def close(self) -> None:
        self.finish()
        self.store.close()
        if isinstance(self.store, castore.TieredStore):
            self.tier_figures = {
                "staged_sends": self.store.staged_sends,
                "promoted": [
                    {"generation": p.generation, "seconds": p.seconds,
                     "fast_tier_chunks": p.copied.chunks_copied if p.copied else None,
                     "fast_tier_bytes": p.copied.bytes_copied if p.copied else None}
                    for p in self.store.promoted
                ],
            }  # fmt: skip


class DcpSaver(Saver):
    """torch.distributed.checkpoint save or async_save, one folder per save."""

    def __init__(self, folder: Path, asynchronous: bool) -> None:
        super().__init__()
        self.folder = folder
        self.asynchronous = asynchronous
        # async_save's thread runs collectives while DDP runs its own: never on one group.
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.in_flight: list[tuple[SaveRecord, Future[Any]]] = []

    def save(self, state: dict[str, Any], step: int) -> None:
        called = time.perf_counter()
        self.wait_in_flight()
        writer = dcp.FileSystemWriter(str(self.folder / f"step-{step:08d}"))
        if not self.asynchronous:
            dcp.save(state, storage_writer=writer)
            now = time.perf_counter()
            self.records.append(SaveRecord(step, called, now, now))
            return
        future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        assert isinstance(future, Future)  # the default stager is synchronous: a plain future
        record = SaveRecord(step, called, time.perf_counter())
        future.add_done_callback(lambda _done: setattr(record, "published", time.perf_counter()))
        self.records.append(record)
        self.in_flight.append((record, future))

    def wait_in_flight(self) -> None:
        for _record, future in self.in_flight:
            future.result()
        self.in_flight.clear()

    def finish(self) -> None:
        self.wait_in_flight()
        dist.barrier()  # every rank's files are complete before rank 0 sizes them
        if dist.get_rank() == 0:
            for record in self.records:
                if not record.written:
                    record.written = tree_bytes(self.folder / f"step-{record.step:08d}")[0]


class NoSaver(Saver):
    """The baseline: never saves."""

    def save(self, state: dict[str, Any], step: int) -> None:
        raise AssertionError("the baseline does not save")


def async_options(mode: str, cfg: Config) -> Any | None:
    """castore's AsyncOptions for ``mode`` (None: a blocking save)."""
    if mode == "castore-sync":
        return None
    if mode == "castore-async-throttled" or mode.startswith("castore-tiered"):
        return castore.AsyncOptions(
            staging="full",
            max_write_bytes_per_s=int(cfg.throttle_mib_s * MIB),
            hash_threads=1,
            stagger_s=cfg.stagger_s,
        )
    return castore.AsyncOptions(staging="changed" if mode.endswith("-changed") else "full")


def fast_tier(folder: Path) -> Path:
    """castore-tiered's fast tier for the run in ``folder``: in /dev/shm where there is one."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"castore-cadence-{folder.name}"
    return folder / "fast"


def make_saver(mode: str, cfg: Config, folder: Path) -> Saver:
    if mode == "baseline":
        return NoSaver()
    if mode.startswith("castore-tiered"):
        tiered = {
            "fast": str(fast_tier(folder)),
            "durable_every": TIERED_EVERY,
            "durable_rate": cfg.throttle_mib_s * MIB,
            "uploader_priority": "idle" if mode.endswith("-idle") else "low",
        }
        if mode.endswith("-stepped"):
            tiered["durable_step_budget"] = cfg.step_budget
        stepped = mode.endswith("-stepped")
        return CastoreSaver(str(folder / "store"), async_options(mode, cfg), tiered, stepped)
    if mode.startswith("castore"):
        return CastoreSaver(str(folder / "store"), async_options(mode, cfg))
    return DcpSaver(folder, asynchronous=mode == "dcp-async")


# -- one rank of one run --------------------------------------------------------


def vm_hwm() -> int:
    """This process's resident-set high-water mark in bytes (VmHWM; it cannot be reset)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def timed_steps(
    ddp: DDP, optimizer: torch.optim.Optimizer, cfg: Config, rank: int, saver: Saver
) -> list[float]:
    """Train ``cfg.steps`` steps, saving every ``cfg.every`` but the last; the start times."""
    starts = []
    for step in range(1, cfg.steps + 1):
        starts.append(time.perf_counter())
        train_step(ddp, optimizer, tokens_for(cfg, rank, step))
        saver.step_done()
        if not isinstance(saver, NoSaver) and step % cfg.every == 0 and step < cfg.steps:
            saver.save(training_state(ddp.module, optimizer, step), step)
    starts.append(time.perf_counter())  # the end of the last step
    return starts


def idle_control(
    ddp: DDP, optimizer: torch.optim.Optimizer, cfg: Config, saver: Saver
) -> list[SaveRecord]:
    """The broken control: the same saves with no training between them."""
    saver.records = []
    for index in range(cfg.idle_saves):
        optimizer.step()  # every tensor changes as in training; untimed
        dist.barrier()
        step = cfg.steps + 1 + index
        saver.save(training_state(ddp.module, optimizer, step), step)
        saver.finish()
    return saver.records


def copy_reference(state: dict[str, Any], repeats: int) -> list[float]:
    """Seconds to copy every tensor of ``state`` into preallocated, touched buffers."""
    tensors = state_tensors(state)
    buffers = [torch.zeros_like(t) for t in tensors]
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)
        seconds.append(time.perf_counter() - started)
    return seconds


def run_rank(rank: int, world: int, port: int, cfg: Config, mode: str, folder: str) -> dict:
    """One rank's whole run of ``mode``: warm-up, timed steps with saves, control, reference."""
    torch.set_num_threads(1)
    join_tcp_group(rank, world, port)
    torch.manual_seed(0)  # the same initial model in every mode (DDP broadcasts rank 0's anyway)
    ddp = DDP(TinyLM(cfg))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    saver = make_saver(mode, cfg, Path(folder))
    for index in range(cfg.warmup):
        train_step(ddp, optimizer, tokens_for(cfg, rank, 1_000_000 + index))
    training_hwm = vm_hwm()
    starts = timed_steps(ddp, optimizer, cfg, rank, saver)
    saver.finish()
    peak_hwm = vm_hwm()
    under_load = saver.records
    idle = idle_control(ddp, optimizer, cfg, saver) if mode != "baseline" else []
    state = training_state(ddp.module, optimizer, cfg.steps)
    copies = copy_reference(state, cfg.copy_repeats)
    saver.close()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "mode": mode,
        "starts": starts,
        "saves": [asdict(r) for r in under_load],
        "idle": [asdict(r) for r in idle],
        "copy_seconds": copies,
        "training_hwm": training_hwm,
        "peak_hwm": peak_hwm,
        "params": sum(p.numel() for p in ddp.parameters()),
        "state_bytes": sum(t.numel() * t.element_size() for t in state_tensors(state)),
        "tiers": getattr(saver, "tier_figures", None),
    }


def rank_entry(rank: int, world: int, port: int, cfg: Config, mode: str, folder: str, out: Any):
    """Process target: ``run_rank``, its result or its traceback put on ``out``."""
    try:
        out.put(run_rank(rank, world, port, cfg, mode, folder))
    except BaseException:
        out.put({"rank": rank, "error": traceback.format_exc()})
        sys.exit(1)  # the parent prints the traceback, once


# -- the parent ----------------------------------------------------------------


def launch(cfg: Config, mode: str, scratch: Path) -> list[dict]:
    """Run ``mode`` once on ``cfg.ranks`` fresh processes; their results, by rank."""
    folder = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=scratch))
    if mode.startswith("castore"):
        castore.open(folder / "store").close()  # created here: ranks must not race to create it
    if mode.startswith("castore-tiered"):
        castore.open(fast_tier(folder)).close()
    context = mp.get_context("forkserver")
    results = context.Queue()
    procs = spawn_ranks(context, rank_entry, cfg.ranks, cfg, mode, str(folder), results)
    replies: list[dict] = []
    try:
        while len(replies) < cfg.ranks:
            reply = next_reply(results, procs, mode)
            if "error" in reply:
                raise SystemExit(f"cadence: {mode}: rank {reply['rank']} failed:\n{reply['error']}")
            replies.append(reply)
    finally:
        stop_ranks(procs, timeout=30)
        shutil.rmtree(folder, ignore_errors=True)
        if mode.startswith("castore-tiered"):
            shutil.rmtree(fast_tier(folder), ignore_errors=True)
    return sorted(replies, key=lambda r: r["rank"])


def next_reply(results: Any, procs: list[Any], mode: str) -> dict:
    """The next rank's result; exits when a rank died without one or the run overran."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while True:
        try:
            reply: dict = results.get(timeout=1.0)
            return reply
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise SystemExit(
                    f"cadence: {mode}: a rank died or hung (exit codes {dead})"
                ) from None


def rotated(modes: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    shift = round_index % len(modes)
    return modes[shift:] + modes[:shift]


# -- figures -------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (``fraction`` in 0..1) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def step_times(run: dict) -> list[float]:
    starts = run["starts"]
    return [b - a for a, b in zip(starts, starts[1:], strict=False)]


def steps_before_publish(record: dict, starts: list[float], step_seconds: float) -> int:
    """Steps that began between a save's call and its publish (its lag, rounded up).

    A publish after the run's last step converts the time past the end at
    ``step_seconds`` per step, rounded up.
    """
    published = record["published"]
    began = sum(1 for start in starts[:-1] if record["called"] <= start < published)
    if published > starts[-1]:
        began += math.ceil((published - starts[-1]) / step_seconds)
    return began


def written_per_save(runs: list[dict], key: str) -> list[int]:
    """Bytes each save wrote, whole job: the ranks' reports of one save summed."""
    totals: dict[tuple[int, int], int] = {}
    for run in runs:
        for record in run[key]:
            slot = (run["round"], record["step"])
            totals[slot] = totals.get(slot, 0) + record["written"]
    return list(totals.values())


def stall(record: dict) -> float:
    return float(record["returned"] - record["called"])


def save_figures(runs: list[dict], key: str, after_first: bool) -> dict[str, Any]:
    """Stall and publish times of the saves under ``key`` ("saves" or "idle").

    With ``after_first``, the median stall leaves out each run's first save
    (which allocates what later saves reuse); its median is reported apart.
    """
    records = [r for run in runs for r in run[key]]
    steady = [r for run in runs for r in run[key][int(after_first) :]] or records
    publishes = [r["published"] - r["called"] for r in steady if r["published"] is not None]
    return {
        "saves": len(records),
        "skipped": sum(r["published"] is None for r in records),
        "stall_median_s": statistics.median(stall(r) for r in steady),
        "stall_max_s": max(stall(r) for r in records),
        "first_stall_median_s": (
            statistics.median(stall(run[key][0]) for run in runs) if after_first else None
        ),
        "publish_median_s": statistics.median(publishes) if publishes else None,
        "written_median_bytes": statistics.median(written_per_save(runs, key)),
    }


def stall_over_copy_of_staged(runs: list[dict], load: dict, copy_s: float) -> float | None:
    """The median stall against a memcpy of only the bytes a rank staged (castore async)."""
    staged = statistics.median(r["staged_bytes"] for run in runs for r in run["saves"])
    if not staged:
        return None
    return float(load["stall_median_s"] / (copy_s * staged / runs[0]["state_bytes"]))


def mode_figures(runs: list[dict], cfg: Config, copy_s: float) -> dict[str, Any]:
    """Every figure of one mode over its ranks and rounds (ratios to baseline added later)."""
    steps = [t for run in runs for t in step_times(run)]
    figures: dict[str, Any] = {
        "step_s": {
            "p50": percentile(steps, 0.5),
            "p99": percentile(steps, 0.99),
            "max": max(steps),
        },
        "rss_rise_bytes": max(run["peak_hwm"] - run["training_hwm"] for run in runs),
        "peak_hwm_bytes": max(run["peak_hwm"] for run in runs),
    }
    if not runs[0]["saves"]:
        return figures
    lags = [
        steps_before_publish(record, run["starts"], figures["step_s"]["p50"])
        for run in runs
        for record in run["saves"]
        if record["published"] is not None
    ]
    load = save_figures(runs, "saves", after_first=True)
    figures |= {
        "under_load": load,
        "idle": save_figures(runs, "idle", after_first=False) if runs[0]["idle"] else None,
        "rpo_steps": cfg.every + max(lags, default=0),
        "staging_peak_bytes": max(r["staging_peak"] for run in runs for r in run["saves"]),
        "new_median_bytes_per_rank": statistics.median(
            r["new_bytes"] for run in runs for r in run["saves"]
        ),
        "state_bytes_per_rank": runs[0]["state_bytes"],
        "stall_over_copy": load["stall_median_s"] / copy_s,
        # castore stages only the replicated tensors its rank writes: the same bytes copied.
        "stall_over_copy_of_staged": stall_over_copy_of_staged(runs, load, copy_s),
    }
    return figures


def summarize(runs: dict[str, list[dict]], cfg: Config) -> dict[str, Any]:
    """Figures of every mode, the memcpy reference, and step-time ratios to the baseline."""
    copies = [s for mode_runs in runs.values() for run in mode_runs for s in run["copy_seconds"]]
    copy_s = statistics.median(copies)
    figures = {mode: mode_figures(mode_runs, cfg, copy_s) for mode, mode_runs in runs.items()}
    baseline = figures.get("baseline")
    for mode_figs in figures.values():
        mode_figs["step_ratio"] = (
            {k: v / baseline["step_s"][k] for k, v in mode_figs["step_s"].items()}
            if baseline
            else None
        )
    return {"copy_median_s": copy_s, "copy_samples": len(copies), "modes": figures}


# -- printing, the receipt and the plot ------------------------------------------


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.01 else f"{seconds * 1e3:.0f} ms"


def mib(count: float | None) -> str:
    return "-" if count is None else f"{count / MIB:.1f}"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def training_table(summary: dict[str, Any]) -> str:
    """What each mode cost the training thread: step-time ratios to the baseline, stalls."""
    rows = []
    for mode, fig in summary["modes"].items():
        load = fig.get("under_load") or {}
        step_ratio = fig["step_ratio"] or {}
        rows.append(
            [
                mode,
                *(ratio(step_ratio.get(k)) for k in ("p50", "p99", "max")),
                ms(load.get("stall_median_s")),
                ms(load.get("stall_max_s")),
                ms(load.get("first_stall_median_s")),
                ratio(fig["stall_over_copy"]) if mode in ASYNC_MODES else "-",
                ratio(fig.get("stall_over_copy_of_staged")),
            ]
        )
    headers = ["mode", "step p50", "step p99", "step max", "stall med", "stall max"]
    headers += ["1st save stall", "stall/memcpy", "…of staged bytes"]
    return tabulate(rows, headers=headers)


def durability_table(summary: dict[str, Any]) -> str:
    """What each mode's saves took to be durable, and what they cost in memory and bytes."""
    rows = []
    for mode, fig in summary["modes"].items():
        load = fig.get("under_load") or {}
        rows.append(
            [
                mode,
                ms(load.get("publish_median_s")),
                fig.get("rpo_steps", "-"),
                mib(fig.get("staging_peak_bytes")) if mode in CASTORE_ASYNC else "-",
                mib(fig["rss_rise_bytes"]),
                mib(load.get("written_median_bytes")),
            ]
        )
    headers = ["mode", "call→publish med", "RPO steps", "staging MiB", "RSS rise MiB"]
    return tabulate(rows, headers=[*headers, "written MiB/save"], disable_numparse=True)


def idle_table(summary: dict[str, Any]) -> str:
    """Under load against the broken control (an idle job), mode by mode."""
    rows = []
    for mode, fig in summary["modes"].items():
        if not fig.get("idle"):
            continue
        load, idle = fig["under_load"], fig["idle"]
        stretch = (
            load["publish_median_s"] / idle["publish_median_s"]
            if load["publish_median_s"] and idle["publish_median_s"]
            else None
        )
        rows.append(
            [
                mode,
                ms(load["stall_median_s"]),
                ms(idle["stall_median_s"]),
                ms(load["publish_median_s"]),
                ms(idle["publish_median_s"]),
                ratio(stretch),
                ratio((fig["step_ratio"] or {}).get("p99")),
            ]
        )
    headers = ["mode", "stall (load)", "stall (idle)", "publish (load)", "publish (idle)"]
    return tabulate(rows, headers=[*headers, "load/idle", "step p99 (load only)"])


def staging_goal(mode: str, fig: dict[str, Any]) -> dict[str, Any] | None:
    """Issue 13's staging bounds: full copy <= 1.0x the state, changed < 1.5x the changed bytes."""
    peak = fig["staging_peak_bytes"]
    if mode == "castore-async":
        bound, what = fig["state_bytes_per_rank"], "<= 1.0x the state's tensor bytes"
        share = peak / bound
        met = share <= 1.0
    elif mode == "castore-async-changed":
        bound, what = fig["new_median_bytes_per_rank"], "< 1.5x the changed bytes"
        share = peak / bound if bound else math.inf
        met = share < 1.5
    else:
        return None
    return {
        "goal": f"{mode}: peak staging per rank {what}",
        "measured": f"{share:.2f}x ({mib(peak)} MiB against {mib(bound)} MiB)",
        "met": met,
    }


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 13's goals for castore's async modes, measured under load."""
    verdicts = []
    for mode in CASTORE_ASYNC:
        fig = summary["modes"].get(mode)
        if fig is None:
            continue
        staging = staging_goal(mode, fig)
        if staging:
            verdicts.append(staging)
        verdicts.append(
            {
                "goal": f"{mode}: median stall <= {STALL_GOAL}x a memcpy of the state's tensors",
                "measured": f"{fig['stall_over_copy']:.3f}x "
                f"({ms(fig['under_load']['stall_median_s'])} against "
                f"{ms(summary['copy_median_s'])})",
                "met": fig["stall_over_copy"] <= STALL_GOAL,
            }
        )
    verdicts += step_goals(summary["modes"])
    return verdicts


def step_goals(modes: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 13's step-time goals: async p99 <= DCP async_save's; throttled <= 1.10x baseline."""
    p99 = {mode: (fig.get("step_ratio") or {}).get("p99") for mode, fig in modes.items()}
    verdicts = []
    if p99.get("castore-async") and p99.get("dcp-async"):
        verdicts.append(
            {
                "goal": "castore-async: step p99 <= dcp-async's step p99",
                "measured": f"{p99['castore-async']:.2f}x against {p99['dcp-async']:.2f}x "
                "the baseline's",
                "met": p99["castore-async"] <= p99["dcp-async"],
            }
        )
    if p99.get("castore-async-throttled"):
        verdicts.append(
            {
                "goal": f"castore-async-throttled: step p99 <= {P99_GOAL}x the baseline's",
                "measured": f"{p99['castore-async-throttled']:.2f}x",
                "met": p99["castore-async-throttled"] <= P99_GOAL,
            }
        )
    for tiered in ("castore-tiered", "castore-tiered-idle"):  # issue 25
        if not p99.get(tiered):
            continue
        verdicts.append(
            {
                "goal": f"{tiered}: step p99 <= {TIERED_P99_GOAL}x the baseline's",
                "measured": f"{p99[tiered]:.2f}x",
                "met": p99[tiered] <= TIERED_P99_GOAL,
            }
        )
        if p99.get("castore-async-throttled"):
            verdicts.append(
                {
                    "goal": f"{tiered}: step p99 <= castore-async-throttled's (saving every"
                    f" K straight to the store, where tiered promotes every {TIERED_EVERY}K)",
                    "measured": f"{p99[tiered]:.2f}x against "
                    f"{p99['castore-async-throttled']:.2f}x the baseline's",
                    "met": p99[tiered] <= p99["castore-async-throttled"],
                }
            )
    stepped = p99.get("castore-tiered-stepped")
    if stepped:  # issue 42
        verdicts.append(
            {
                "goal": f"castore-tiered-stepped: step p99 <= {STEPPED_P99_GOAL}x the baseline's",
                "measured": f"{stepped:.2f}x",
                "met": stepped <= STEPPED_P99_GOAL,
            }
        )
        throttled = p99.get("castore-async-throttled")
        if throttled:
            verdicts.append(
                {
                    "goal": "castore-tiered-stepped: step p99 <= castore-async-throttled's + "
                    f"{STEPPED_OVER_THROTTLED}",
                    "measured": f"{stepped:.2f}x against {throttled:.2f}x the baseline's",
                    "met": stepped <= throttled + STEPPED_OVER_THROTTLED,
                }
            )
    return verdicts


def relative_run(run: dict) -> dict:
    """A run's raw record with times in seconds from its first timed step."""
    origin = run["starts"][0]

    def shift(record: dict) -> dict:
        moved = dict(record)
        for key in ("called", "returned", "published"):
            if moved[key] is not None:
                moved[key] = moved[key] - origin
        return moved

    return run | {
        "starts": [s - origin for s in run["starts"]],
        "saves": [shift(r) for r in run["saves"]],
        "idle": [shift(r) for r in run["idle"]],
    }


def write_receipt(path: Path, inputs: dict, summary: dict, runs: dict, verdicts: list) -> None:
    raw = {mode: [relative_run(run) for run in mode_runs] for mode, mode_runs in runs.items()}
    receipt = {"inputs": inputs, "figures": summary, "definitions": NOTES, "goals": verdicts}
    receipt["raw"] = raw
    path.write_text(json.dumps(receipt, indent=1) + "\n")


def plot(path: Path, runs: dict[str, list[dict]], cfg: Config) -> None:
    """Median step time per step (over ranks and rounds), one line per mode, saves marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(11, 5.5))
    steps = list(range(1, cfg.steps + 1))
    for mode, mode_runs in runs.items():
        per_step = zip(*(step_times(run) for run in mode_runs), strict=True)
        axes.plot(steps, [statistics.median(t) * 1e3 for t in per_step], label=mode, lw=1.2)
    for step in range(cfg.every, cfg.steps, cfg.every):
        axes.axvline(step, color="grey", ls=":", lw=1)
    axes.set_xlabel(f"step (dotted: a save is called after the step; every {cfg.every} steps)")
    axes.set_ylabel("step time, ms (median over ranks and rounds)")
    axes.set_title(f"castore cadence: {cfg.ranks} ranks, gloo + DDP on CPU")
    axes.set_ylim(bottom=0)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- command line --------------------------------------------------------------


INT_OPTIONS = ("ranks", "steps", "every", "d_model", "layers", "vocab", "seq", "batch", "rounds")
OPTIONS: dict[str, type] = {name: int for name in INT_OPTIONS}
OPTIONS |= {"throttle_mib_s": float, "stagger_s": float, "step_budget": float}


def parse_args(argv: list[str] | None = None) -> tuple[Config, Path]:
    """The configuration: Config's defaults, or QUICK's with --quick, then the options given."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = Config()
    for name, kind in OPTIONS.items():
        flag = f"--{name.replace('_', '-')}"
        parser.add_argument(flag, type=kind, help=f"default {getattr(defaults, name)}")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list (default: all)")
    parser.add_argument("--out", type=Path, default=Path("cadence-out"))
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (under 1 min)")
    args = parser.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    chosen = QUICK.copy() if args.quick else {}
    chosen |= {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    cfg = Config(**chosen, modes=modes)
    if cfg.every >= cfg.steps or cfg.every < 1 or cfg.ranks < 1 or cfg.rounds < 1:
        parser.error("need 1 <= --every < --steps, --ranks >= 1 and --rounds >= 1")
    return cfg, args.out


def runnable_modes(modes: tuple[str, ...]) -> tuple[str, ...]:
    """``modes`` less castore's async ones when this castore has no async save yet."""
    if hasattr(castore, "AsyncOptions"):
        return modes
    missing = [m for m in modes if m in CASTORE_ASYNC]
    if missing:
        print(f"castore {castore.__version__} has no AsyncOptions: skipping {', '.join(missing)}")
    return tuple(m for m in modes if m not in CASTORE_ASYNC)


def run_all(cfg: Config, scratch: Path) -> dict[str, list[dict]]:
    """Every mode once per round, in an order that rotates from round to round."""
    runs: dict[str, list[dict]] = {mode: [] for mode in cfg.modes}
    for round_index in range(cfg.rounds):
        for mode in rotated(cfg.modes, round_index):
            started = time.perf_counter()
            for run in launch(cfg, mode, scratch):
                runs[mode].append(run | {"round": round_index})
            seconds = time.perf_counter() - started
            print(f"  round {round_index + 1}/{cfg.rounds}  {mode:<24} {seconds:5.1f}s", flush=True)
    return runs


def inputs_of(cfg: Config, runs: dict[str, list[dict]], seconds: float) -> dict[str, Any]:
    first = next(iter(runs.values()))[0]
    return {
        "config": asdict(cfg),
        "model_params": first["params"],
        "state_tensor_bytes": first["state_bytes"],
        "versions": {"torch": torch.__version__, "castore": castore.__version__},
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse_args(argv)
    cfg = Config(**(asdict(cfg) | {"modes": runnable_modes(cfg.modes)}))
    out.mkdir(parents=True, exist_ok=True)
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    started = time.perf_counter()
    print(f"cadence: {cfg.ranks} ranks, {cfg.rounds} rounds of {', '.join(cfg.modes)}")
    scratch = Path(tempfile.mkdtemp(prefix="cadence-"))
    try:
        runs = run_all(cfg, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    inputs = inputs_of(cfg, runs, time.perf_counter() - started)
    summary = summarize(runs, cfg)
    verdicts = goals(summary)
    base = summary["modes"].get("baseline")
    print(
        f"\nmodel {inputs['model_params'] / 1e6:.2f} M params, state "
        f"{inputs['state_tensor_bytes'] / MIB:.1f} MiB of tensors per rank; a save every "
        f"{cfg.every} of {cfg.steps} steps; memcpy of the state {ms(summary['copy_median_s'])}"
    )
    if base:
        print("baseline step time: " + ", ".join(f"{k} {ms(v)}" for k, v in base["step_s"].items()))
    print("\nunder load: the training thread (step times as ratios to the baseline's)")
    print(training_table(summary))
    print("\nunder load: durability, memory, bytes\n" + durability_table(summary))
    print("\n".join(f"  {note}" for note in NOTES))
    print("\nthe broken control: the same saves on an idle job\n" + idle_table(summary))
    write_receipt(out / "receipt.json", inputs, summary, runs, verdicts)
    plot(out / "steps.png", runs, cfg)
    print(f"\nwrote {out / 'receipt.json'} and {out / 'steps.png'} ({inputs['wall_s']:.0f}s)")
    print_goals(verdicts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
