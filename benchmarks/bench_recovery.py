"""Recovery time of the demo-size job: process start to the first resumed update.

Run from the repository root::

    .venv/bin/python benchmarks/bench_recovery.py [--repeats 3] [--ranks 4] [--resume-ranks 2]
                                                  [--updates 2] [--dir DIR] [--json OUT]
                                                  [--warm-only] [--warm-imports]
                                                  [--no-peers-at-resume-ranks]

The job is the demo's model (``tools/demo.build_model``: about 25 MiB of fp32
weights, a frozen embedding backbone and output projection, a trainable
512x512 adapter) under ``DistributedDataParallel(find_unused_parameters=True)``
in a gloo group on CPU, AdamW over the trainable parameters, a synthetic token
dataset (512 sequences of 16 tokens) fed by a
``castore.data.ResumableDistributedSampler`` (8 sequences per rank per update),
and a ``castore.train.TrainState`` over all of it.

Setup (untimed, printed for information): ``--ranks`` processes train
``--updates`` updates and save the training state three ways: ``TrainState.save``
into a castore store; ``torch.save`` of ``{"model", "optimizer"}`` state dicts
into one file by rank 0 (fsync'd); ``dcp.save`` of the same two state dicts
(``get_state_dict``: keyed by parameter name) by every rank.

Measured: each repetition launches fresh processes (``subprocess.Popen`` of
this file, a ``file://`` rendezvous) for every scenario, in an order that
rotates from one repetition to the next:

  castore R->R exact          ``TrainState.load(resume="exact")`` at ``--ranks``
  castore R->r continuation   ``TrainState.load(resume="continuation")`` at
                              ``--resume-ranks``
  torch.load R->R             every rank ``torch.load``s the one file and calls
                              ``load_state_dict`` on the model and optimizer
  DCP R->R                    ``get_state_dict`` (DCP's recipe: it also creates
                              the optimizer's state), ``dcp.load``, ``set_state_dict``
  torch.load / DCP R->r       the same at ``--resume-ranks`` (unless
                              ``--no-peers-at-resume-ranks``); DCP reads the
                              R-rank checkpoint

then every rank runs one update. The parent records ``time.time()`` just
before the first ``Popen`` and passes it in the environment; each rank records
when it has imported torch, castore and the demo (``import``), joined the
process group (``group``), built the model, DDP wrapper, optimizer, data
pipeline and TrainState and passed a barrier (``model built``), restored
(``restore``: for castore, ``castore.open`` plus ``TrainState.load``; the
phases are the load's ``report.timings``, "other" is the rest: opening the
store, agreeing on the root, the claim and layout checks, putting the
optimizer, RNG streams and sampler position in place, and waits on the
collectives), and finished its first update (``first update``). After the
restore each rank hashes its model parameters and optimizer state (excluded
from the times) and the parent checks that every rank of every launch
restored exactly what setup saved.

castore verifies each chunk where it lies (blake3) while the next one is
read: validation and data transfer are one pass, reported as ``read_verify``.

Each row is the slowest rank of a launch (the largest total), as medians over
``--repeats`` launches per column (so the total need not equal the sum of the
medians). The restore ratios are castore's restore step over the peer's at the
same rank count (the largest restore time over the ranks, medians), <1 means
castore is faster.

Page cache: before each launch the parent drops the page cache
(``_common.drop_caches``) when it may, so the checkpoint, and the Python and
torch libraries, are read from disk: recovery on a fresh node. With
``--warm-imports`` an untimed process then imports the same modules, putting
the libraries back in the cache (a restart on the same node; on this VM that
saves about 0.5-1 s of import time per rank, and adds about 3.5 s per launch to
the run). ``--warm-only`` never drops the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUN = "recovery"
DATASET = 512  # sequences
SEQ = 16  # tokens per sequence
BATCH = 8  # sequences per rank per update
START_ENV = "CASTORE_BENCH_STARTED"
MIB = 1 << 20
EXIT_GRACE = 15.0  # seconds a rank may take to exit after every rank wrote its result


# -- the job (runs in each rank's process) -----------------------------------------


def _import_everything() -> None:
    """What a rank imports before it can do anything: torch, castore and the demo model."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import castore  # noqa: F401
    import castore.data  # noqa: F401
    import castore.train  # noqa: F401

    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import demo  # noqa: F401


@dataclass
class Job:
    inner: Any
    model: Any
    optimizer: Any
    sampler: Any
    loader: Any
    state: Any
    batches: Any = None
    store: Any = None  # the castore store a restore opened (closed after the update)


def _build_job(rank: int, world: int) -> Job:
    import torch
    from demo import build_model
    from torch.nn.parallel import DistributedDataParallel

    import castore.data
    import castore.train

    inner = build_model()  # seeded: the same initial weights in every process
    model = DistributedDataParallel(inner, find_unused_parameters=True)
    trainable = [p for p in inner.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    tokens = torch.randint(0, 4096, (DATASET, SEQ), generator=torch.Generator().manual_seed(99))
    dataset = torch.utils.data.TensorDataset(torch.arange(DATASET), tokens)
    sampler = castore.data.ResumableDistributedSampler(dataset, world, rank, seed=7)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator()
    )
    state = castore.train.TrainState(
        model,
        optimizer,
        sampler=sampler,
        dataset_hash=castore.data.dataset_hash(range(DATASET)),
    )
    return Job(inner, model, optimizer, sampler, loader, state)


def _update(job: Job) -> float:
    import torch
    from demo import VOCAB

    if job.batches is None:
        job.batches = iter(job.loader)
    ids, tokens = next(job.batches)
    logits = job.model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1))
    job.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    job.optimizer.step()
    job.state.microbatch_done(len(ids))
    job.state.update_done()
    return float(loss.item())


def _digest(job: Job) -> str:
    """Parameters and optimizer state by name, bitwise (to check what a restore put back)."""
    import castore.train

    hasher = hashlib.blake2b(digest_size=16)
    for name, param in job.inner.named_parameters():
        hasher.update(name.encode())
        hasher.update(param.detach().contiguous().numpy().tobytes())
    optim = castore.train.optimizer_state_by_name(job.inner, job.optimizer)
    for name in sorted(optim["state"]):
        for key, value in sorted(optim["state"][name].items()):
            hasher.update(f"{name}/{key}".encode())
            if hasattr(value, "numpy"):
                hasher.update(value.detach().contiguous().numpy().tobytes())
            else:
                hasher.update(repr(value).encode())
    return hasher.hexdigest()


def _setup(config: dict[str, Any], job: Job, rank: int) -> dict[str, Any]:
    """Train a few updates, then save the same state with castore, torch.save and DCP."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import castore

    losses = [_update(job) for _ in range(config["updates"])]
    out: dict[str, Any] = {"losses": losses}
    dist.barrier()
    clock = time.perf_counter()
    with castore.open(config["store"], create=True) as store:
        generation = job.state.save(store, run=RUN)
    dist.barrier()
    out["castore_save_s"] = time.perf_counter() - clock
    out["castore_logical_bytes"] = generation.stats.logical_bytes
    out["castore_new_bytes"] = generation.stats.new_bytes
    clock = time.perf_counter()
    if rank == 0:
        with open(config["torch_file"], "wb") as handle:
            torch.save(
                {"model": job.inner.state_dict(), "optimizer": job.optimizer.state_dict()},
                handle,
            )
            handle.flush()
            os.fsync(handle.fileno())
    dist.barrier()
    out["torch_save_s"] = time.perf_counter() - clock
    clock = time.perf_counter()
    model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=config["dcp_dir"])
    dist.barrier()
    out["dcp_save_s"] = time.perf_counter() - clock
    out["digest"] = _digest(job)
    return out


def _restore(config: dict[str, Any], job: Job) -> dict[str, Any]:
    """The restore step of one method; returns its breakdown (seconds) and what it read."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import castore

    method = config["method"]
    clock = time.perf_counter()
    if method == "castore":
        store = castore.open(config["store"], create=False)
        opened = time.perf_counter()
        resumed = job.state.load(store, run=RUN, resume=config["resume"])
        report = resumed.report
        assert report is not None
        job.store = store
        return {
            "open_s": opened - clock,
            "load_s": time.perf_counter() - opened,
            "phases": dict(report.timings),
            "bytes_read": report.bytes_read,
            "bytes_needed": report.bytes_needed,
            "chunks_read": report.chunks_read,
            "claim": resumed.claim,
            "rng": resumed.rng,
            "update": resumed.update,
            "notes": resumed.notes,
        }
    if method == "torch":
        saved = torch.load(config["torch_file"], weights_only=True)
        read = time.perf_counter()
        job.inner.load_state_dict(saved["model"])
        job.optimizer.load_state_dict(saved["optimizer"])
        return {
            "read_s": read - clock,
            "apply_s": time.perf_counter() - read,
            "bytes_read": os.path.getsize(config["torch_file"]),
        }
    # DCP's recipe: state dicts keyed by name, read in place, then set.
    model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
    prepared = time.perf_counter()
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=config["dcp_dir"])
    read = time.perf_counter()
    set_state_dict(job.model, job.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return {
        "prepare_s": prepared - clock,
        "read_s": read - prepared,
        "apply_s": time.perf_counter() - read,
        "bytes_read": sum(p.stat().st_size for p in Path(config["dcp_dir"]).iterdir()),
    }


def _rank_main(spec: Path, rank: int) -> int:
    started = float(os.environ[START_ENV])
    marks: dict[str, float] = {}
    _import_everything()
    marks["import"] = time.time()
    import torch
    import torch.distributed as dist

    config = json.loads(spec.read_text())
    world = config["world"]
    out_path = Path(config["workdir"], f"{config['label']}-{rank}.json")
    torch.set_num_threads(1)  # several ranks share this machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{config['rendezvous']}", rank=rank, world_size=world
    )
    marks["group"] = time.time()
    result: dict[str, Any] = {"rank": rank}
    try:
        job = _build_job(rank, world)
        dist.barrier()  # every rank built (DDP's constructor already synchronized them)
        marks["model"] = time.time()
        if config["method"] == "setup":
            result.update(_setup(config, job, rank))
        else:
            result["restore"] = _restore(config, job)
            marks["restored"] = time.time()
            clock = time.perf_counter()
            result["digest"] = _digest(job)  # not timed: subtracted below
            result["check_s"] = time.perf_counter() - clock
            marks["update_start"] = time.time()
            result["loss"] = _update(job)
            marks["update"] = time.time()
            if job.store is not None:
                job.store.close()
        result["marks"] = {name: at - started for name, at in marks.items()}
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    partial = out_path.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    partial.rename(out_path)  # the parent sees a whole result or none
    dist.destroy_process_group()
    os._exit(0)  # nothing left to do: skip interpreter teardown (gloo threads, atexit)


# -- the parent: launch, collect, summarize ------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    method: str  # castore, torch or dcp
    ranks: int
    resume: str | None = None


def _scenarios(args: argparse.Namespace) -> list[Scenario]:
    big, small = args.ranks, args.resume_ranks
    found = [
        Scenario(f"castore {big}->{big} exact", "castore", big, "exact"),
        Scenario(f"castore {big}->{small} continuation", "castore", small, "continuation"),
        Scenario(f"torch.load {big}->{big}", "torch", big),
        Scenario(f"DCP {big}->{big}", "dcp", big),
    ]
    if args.peers_at_resume_ranks and small != big:
        found += [
            Scenario(f"torch.load {big}->{small}", "torch", small),
            Scenario(f"DCP {big}->{small}", "dcp", small),
        ]
    return found


def _launch(
    base: dict[str, Any], label: str, world: int, method: str, **extra: Any
) -> list[dict[str, Any]]:
    workdir = Path(base["workdir"])
    spec = workdir / f"{label}.spec.json"
    rendezvous = workdir / f"rendezvous-{label}"
    rendezvous.unlink(missing_ok=True)
    config = {
        **base,
        **extra,
        "label": label,
        "world": world,
        "method": method,
        "rendezvous": str(rendezvous),
    }
    spec.write_text(json.dumps(config))
    env = {**os.environ, START_ENV: repr(time.time())}
    env.pop("CASTORE_FAULTS", None)
    procs = []
    for rank in range(world):
        with open(workdir / f"{label}-{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--rank", str(spec), str(rank)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
    outputs = [workdir / f"{label}-{rank}.json" for rank in range(world)]
    deadline = time.monotonic() + base["timeout"]
    all_done: float | None = None
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if all_done is None and all(o.exists() for o in outputs):
            all_done = time.monotonic()
        if all_done is not None and time.monotonic() - all_done > EXIT_GRACE:
            break  # every rank reported; one is stuck on its way out
        time.sleep(0.02)
    stuck = []
    for rank, proc in enumerate(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            stuck.append(rank)
        proc.wait()
    results = []
    for rank in range(world):
        path = workdir / f"{label}-{rank}.json"
        if not path.exists():
            tail = (workdir / f"{label}-{rank}.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"{label}: rank {rank} left no result (log tail: {tail})")
        result = json.loads(path.read_text())
        if not result.get("ok"):
            raise SystemExit(f"{label}: rank {rank} failed: {result.get('error')}")
        result["killed_after_result"] = rank in stuck
        results.append(result)
    return results


def _prewarm() -> None:
    """Bring the interpreter, torch and castore back into the page cache (untimed)."""
    subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--prewarm"],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _summarize_launch(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One launch: the slowest rank's timeline, plus the restore step over all ranks."""
    rows = []
    for result in results:
        marks = result["marks"]
        row = {
            "rank": result["rank"],
            "import": marks["import"],
            "group": marks["group"] - marks["import"],
            "model": marks["model"] - marks["group"],
            "restore": marks["restored"] - marks["model"],
            "update": marks["update"] - marks["update_start"],
        }
        row["total"] = sum(row[k] for k in ("import", "group", "model", "restore", "update"))
        detail = result["restore"]
        if "phases" in detail:
            for phase, seconds in detail["phases"].items():
                row[phase] = seconds
            row["other"] = row["restore"] - sum(detail["phases"].values())
            row["open"] = detail["open_s"]
        else:
            for key in ("prepare_s", "read_s", "apply_s"):
                if key in detail:
                    row[key[:-2]] = detail[key]
        row["bytes_read"] = detail["bytes_read"]
        rows.append(row)
    slowest = max(rows, key=lambda r: r["total"])
    return {
        "slowest": slowest,
        "restore_step": max(r["restore"] for r in rows),
        "ranks": rows,
        "digests": sorted({r["digest"] for r in results}),
        "details": [r["restore"] for r in results],
        "killed_after_result": [r["rank"] for r in results if r["killed_after_result"]],
    }


def _median_rows(launches: list[dict[str, Any]]) -> dict[str, float]:
    keys = launches[0]["slowest"].keys() - {"rank"}
    medians = {k: statistics.median(run["slowest"][k] for run in launches) for k in keys}
    medians["restore_step"] = statistics.median(run["restore_step"] for run in launches)
    return medians


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _report(
    scenarios: list[Scenario], medians: dict[str, dict[str, float]], args: argparse.Namespace
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    from tabulate import tabulate

    timeline = []
    for scenario in scenarios:
        m = medians[scenario.name]
        if scenario.method == "castore":
            parts = " / ".join(
                _fmt(m.get(p), 3) for p in ("metadata", "planning", "read_verify", "assembly")
            )
            parts += f" (+{_fmt(m.get('other'), 3)} other)"
        elif scenario.method == "torch":
            parts = f"torch.load {_fmt(m.get('read'), 3)} + apply {_fmt(m.get('apply'), 3)}"
        else:
            parts = (
                f"get_state_dict {_fmt(m.get('prepare'), 3)} + dcp.load "
                f"{_fmt(m.get('read'), 3)} + set {_fmt(m.get('apply'), 3)}"
            )
        timeline.append(
            [
                scenario.name,
                _fmt(m["import"]),
                _fmt(m["group"]),
                _fmt(m["model"]),
                _fmt(m["restore"], 3),
                parts,
                _fmt(m["update"], 3),
                _fmt(m["total"]),
            ]
        )
    print(f"recovery timeline, seconds (slowest rank of each launch, medians of {args.repeats}):")
    print(
        tabulate(
            timeline,
            headers=[
                "scenario",
                "start->import",
                "->group",
                "->model built",
                "->restored",
                "restore: metadata / planning / read_verify / assembly (castore)",
                "->first update",
                "total",
            ],
            tablefmt="github",
            disable_numparse=True,
        )
    )

    ratios, records = [], []
    for scenario in scenarios:
        if scenario.method != "castore":
            continue
        own = medians[scenario.name]["restore_step"]
        peers: dict[str, float | None] = {}
        for method, label in (("torch", "torch.load"), ("dcp", "DCP")):
            peer = next(
                (s for s in scenarios if s.method == method and s.ranks == scenario.ranks), None
            )
            peers[label] = medians[peer.name]["restore_step"] if peer else None
        row = [scenario.name, _fmt(own, 3)]
        record: dict[str, Any] = {"scenario": scenario.name, "castore_restore_s": own}
        for label, seconds in peers.items():
            row += [_fmt(seconds, 3), f"{own / seconds:.2f}x" if seconds else "-"]
            record[f"{label}_restore_s"] = seconds
            record[f"castore_over_{label}"] = own / seconds if seconds else None
        ratios.append(row)
        records.append(record)
    print(
        "\nrestore step (largest over the ranks, medians): castore against the peers at the "
        "same rank count (time ratio, <1 = castore faster):"
    )
    print(
        tabulate(
            ratios,
            headers=[
                "scenario",
                "castore s",
                "torch.load s",
                "castore / torch.load",
                "DCP s",
                "castore / DCP",
            ],
            tablefmt="github",
            disable_numparse=True,
        )
    )
    if any(r[2] == "-" or r[4] == "-" for r in ratios):
        print("('-': no peer ran at that rank count: --no-peers-at-resume-ranks)")
    return timeline, records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="launches per scenario (3)")
    parser.add_argument("--ranks", type=int, default=4, help="world size of the saved job (4)")
    parser.add_argument(
        "--resume-ranks", type=int, default=2, help="world size of the continuation (2)"
    )
    parser.add_argument("--updates", type=int, default=2, help="updates before the save (2)")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (/tmp)")
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    parser.add_argument("--warm-only", action="store_true", help="never drop the page cache")
    parser.add_argument(
        "--warm-imports",
        action="store_true",
        help="after dropping the cache, re-warm the libraries by an untimed import",
    )
    parser.add_argument(
        "--no-peers-at-resume-ranks",
        dest="peers_at_resume_ranks",
        action="store_false",
        help="run torch.load and DCP at --ranks only (about 30%% less time)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.ranks < 1 or args.resume_ranks < 1 or args.updates < 1:
        parser.error("--repeats, --ranks, --resume-ranks and --updates must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--rank":
        return _rank_main(Path(sys.argv[2]), int(sys.argv[3]))
    if argv is None and sys.argv[1:] == ["--prewarm"]:
        _import_everything()
        return 0
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import drop_caches

    began = time.perf_counter()
    base_dir = args.dir or Path(tempfile.gettempdir())
    base_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="castore-recovery-", dir=base_dir))
    base = {
        "workdir": str(workdir),
        "store": str(workdir / "store"),
        "torch_file": str(workdir / "state.pt"),
        "dcp_dir": str(workdir / "dcp"),
        "updates": args.updates,
        "timeout": args.timeout,
    }
    cold = not args.warm_only and drop_caches()
    cache_note = (
        "dropped before each launch, then the libraries re-warmed by an untimed import: "
        "the checkpoint is read from disk, imports are warm"
        if cold and args.warm_imports
        else "dropped before each launch (a fresh node): the checkpoint and the libraries "
        "are both read from disk"
        if cold
        else "not dropped (warm-only, or not permitted here): everything is warm"
    )
    scenarios = _scenarios(args)
    try:
        setup = _launch(base, "setup", args.ranks, "setup")
        info = setup[0]
        digest = info["digest"]
        if any(r["digest"] != digest for r in setup):
            raise SystemExit("setup: the ranks hold different states after training")
        dcp_bytes = sum(p.stat().st_size for p in Path(base["dcp_dir"]).iterdir())
        torch_bytes = Path(base["torch_file"]).stat().st_size
        print(
            f"demo-size job: {args.ranks} gloo ranks (CPU, {os.cpu_count()} cores), "
            f"{args.updates} updates, then saved (setup, untimed runs of the whole job):\n"
            f"  castore TrainState.save  {info['castore_logical_bytes'] / MIB:.1f} MiB logical, "
            f"{info['castore_new_bytes'] / MIB:.1f} MiB new, {info['castore_save_s']:.2f} s\n"
            f"  torch.save (rank 0)      {torch_bytes / MIB:.1f} MiB, "
            f"{info['torch_save_s']:.2f} s\n"
            f"  dcp.save ({args.ranks} ranks)       {dcp_bytes / MIB:.1f} MiB, "
            f"{info['dcp_save_s']:.2f} s\n"
            f"page cache: {cache_note}\n"
            f"repeats: {args.repeats}, scenarios: {', '.join(s.name for s in scenarios)}",
            flush=True,
        )
        launches: dict[str, list[dict[str, Any]]] = {s.name: [] for s in scenarios}
        for rep in range(args.repeats):
            order = scenarios[rep % len(scenarios) :] + scenarios[: rep % len(scenarios)]
            for scenario in order:
                clock = time.perf_counter()
                if cold:
                    if not drop_caches():
                        raise SystemExit("dropping the page cache stopped working")
                    if args.warm_imports:
                        _prewarm()
                prepared = time.perf_counter()
                label = f"{scenario.method}-{scenario.ranks}-{rep}"
                results = _launch(
                    base, label, scenario.ranks, scenario.method, resume=scenario.resume
                )
                summary = _summarize_launch(results)
                summary["prepare_wall_s"] = prepared - clock  # drop (and re-warm), untimed
                summary["launch_wall_s"] = time.perf_counter() - prepared
                if summary["digests"] != [digest]:
                    raise SystemExit(
                        f"{scenario.name}: restored state differs from the saved one "
                        f"({summary['digests']} != {digest})"
                    )
                launches[scenario.name].append(summary)
            print(
                f"repeat {rep + 1}/{args.repeats}: {time.perf_counter() - began:.0f} s", flush=True
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    medians = {name: _median_rows(runs) for name, runs in launches.items()}
    stuck = [
        f"{name} #{i + 1} ranks {run['killed_after_result']}"
        for name, runs in launches.items()
        for i, run in enumerate(runs)
        if run["killed_after_result"]
    ]
    if stuck:
        print(
            f"note: ranks that hung on exit after reporting were killed {EXIT_GRACE:g} s later "
            f"(after the timed region): {'; '.join(stuck)}"
        )
    print(
        "every launch restored on every rank the very parameters and optimizer state "
        "setup saved (blake2b of both, checked outside the timed regions)\n"
    )
    _, ratio_records = _report(scenarios, medians, args)
    castore_detail = launches[scenarios[0].name][0]["details"][0]
    for scenario in scenarios:
        if scenario.method == "castore":
            first = launches[scenario.name][0]["details"][0]
            print(
                f"{scenario.name}: claim {first['claim']}, RNG streams {first['rng']}, "
                f"resumed after update {first['update']}"
            )
    print(
        "\nstart->import: interpreter start and importing torch, castore and the demo; "
        "->group: gloo init_process_group (file://); ->model built: the demo model, "
        "DDP(find_unused_parameters=True), AdamW, sampler, DataLoader, TrainState, a "
        "barrier; ->restored: castore.open + TrainState.load (torch.load + load_state_dict; "
        "DCP: get_state_dict + dcp.load + set_state_dict); ->first update: one forward, "
        "backward, all-reduce and AdamW step. castore's read_verify is one pass: each chunk "
        "is verified (blake3) where it lies while the next is read, so validation and data "
        "transfer are not separate phases. 'other' = opening the store, agreeing on the "
        "root, claim and layout checks, optimizer/RNG/sampler put in place, collective waits."
        f"\ncastore read {castore_detail['bytes_read'] / MIB:.1f} MiB per rank "
        f"({castore_detail['chunks_read']} chunks) for "
        f"{castore_detail['bytes_needed'] / MIB:.1f} MiB needed."
    )
    print(f"\ntotal time {time.perf_counter() - began:.0f} s")

    if args.json:
        import torch

        import castore

        payload = {
            "config": {
                "repeats": args.repeats,
                "ranks": args.ranks,
                "resume_ranks": args.resume_ranks,
                "updates": args.updates,
                "dataset": DATASET,
                "seq": SEQ,
                "batch_per_rank": BATCH,
                "cold_checkpoint": cold,
                "warm_imports": not cold or args.warm_imports,
                "page_cache": cache_note,
                "scratch_dir": str(base_dir),
            },
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "castore": castore.__version__,
            },
            "cpus": os.cpu_count(),
            "setup": {
                **{k: v for k, v in info.items() if k not in ("marks", "ok", "rank")},
                "torch_file_bytes": torch_bytes,
                "dcp_bytes": dcp_bytes,
            },
            "scenarios": [
                {
                    "name": s.name,
                    "method": s.method,
                    "ranks": s.ranks,
                    "resume": s.resume,
                    "median_slowest_rank_s": medians[s.name],
                    "launches": launches[s.name],
                }
                for s in scenarios
            ],
            "restore_ratios": ratio_records,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
