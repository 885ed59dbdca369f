"""An FSDP2 model's state: castore.dist against DCP and Meta's torch_checkpointing.

Run from the repository root::

    .venv/bin/python benchmarks/bench_fsdp2.py [--state-mib 256] [--blocks 20] [--frozen 0.9]
                                               [--repeats 3] [--warmup 1] [--quiet 8] [--settle 5]
                                               [--dir DIR] [--json [OUT]] [--warm-only] [--check]
                                               [--small]

torch_checkpointing is measured where it imports: install it outside the
project's environment and put it on the path for this run alone, e.g.
``pip install --no-deps --target /tmp/tc torch_checkpointing==0.1.1`` and
``PYTHONPATH=/tmp/tc``. Without it the run measures castore and DCP and the
JSON says why torch_checkpointing is missing.

The state: a ``fully_shard`` (FSDP2) model on a 1-D CPU mesh of gloo ranks,
``--blocks`` residual MLP blocks (width ``w`` -> ``4w`` -> ``w``, ``w`` chosen
so that parameters and AdamW's two moments come to ``--state-mib``) and a
LayerNorm, after one AdamW step, as ``get_state_dict`` gives it: ``{"model":
..., "optim": ...}``, every parameter and moment a DTensor ``Shard(0)``. Two
groups of ranks stay alive for the whole run (``multiprocessing`` spawn, so
process start and imports are never timed): 2 ranks that train and save, and
3 ranks that restore. Each repetition, in one fresh scratch folder (the order
of the systems rotates from one repetition to the next):

  save at 2 ranks        castore.dist.save into a fresh LMDB store; dcp.save with
                         FileSystemWriter (sync_files=True, its default);
                         torch_checkpointing's CheckpointManager.save
  load at 2 ranks        into the DTensors of another FSDP2 model's state (another
                         seed, one step; every local block NaN-filled first):
                         castore.dist.load, dcp.load with FileSystemReader,
                         CheckpointManager.load; cold (page cache dropped just
                         before, where permitted) and then warm
  restore 2 -> 3 ranks   the same loads by the 3-rank group (uneven blocks: 4w
                         rows do not divide by 3), cold and then warm
  frozen re-save         a second step with the first 90% of the blocks frozen
                         (``requires_grad=False``: no gradient, so AdamW leaves
                         their parameters and moments as they were), saved at 2
                         ranks: castore into the same store (its second
                         generation); DCP and torch_checkpointing into new
                         folders (they have no dedup); page cache dropped first

torch_checkpointing 0.1.1 does not run on CPU and ext4 as shipped (see
``_fsdp2_ranks.tc_manager``): its multi-rank metadata gather allocates CUDA
tensors, and its default O_DIRECT writes fail with EINVAL on ext4. It runs
here with that gather done by ``all_gather_object`` and buffered writes, as
``tc`` (each rank fsyncs the files it wrote before the commit, the durability
O_DIRECT gives) and, saves only, ``tc-nosync`` (no fsync at all).

A time is the slowest rank's call, from a barrier, median over the timed
repetitions. Before each timed step but the warm loads the parent syncs (or
drops the page cache) and pauses ``--quiet`` seconds, as benchmarks/bench_dcp.py
does (why: its docstring). The first repetition (untimed with ``--warmup 1``)
checks every load: at 2 ranks each local block against the state saved, at 3
ranks each tensor's full value (sha256) against the saved state's, and it
loads every frozen re-save back. ``--small``: a tiny state, 1 repetition that
checks, no pauses (the smoke run of tests/test_bench_fsdp2.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _common import PipedRanks, disk_free, drop_caches, print_goals, tree_bytes
from _fsdp2_ranks import Shape, shape_for, worker
from tabulate import tabulate

import castore

MIB = 1 << 20
DEFAULT_JSON = "benchmarks/results/fsdp2.json"
SAVE_GOAL = 1.0  # DCP's save time / castore's, 2 ranks
FROZEN_GOAL = 0.12  # castore's new bytes / state bytes, re-save with 90% frozen
PEERS = {"dcp": "DCP", "tc": "torch_checkpointing"}
TC_WHY = (
    "as shipped (0.1.1) it does not run here: its multi-rank metadata gather "
    "(DefaultMetadataManager._all_gather_pickled_data) allocates CUDA tensors, and its "
    "default O_DIRECT writes fail with EINVAL on ext4 (torch.save's writes are unaligned); "
    "measured with that gather on the CPU (all_gather_object) and buffered writes"
)


@dataclass
class Results:
    times: dict[str, list[float]] = field(default_factory=dict)
    per_rank: dict[str, list[list[float]]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, replies: list[dict[str, Any]]) -> None:
        seconds = [r["seconds"] for r in replies]
        self.times.setdefault(key, []).append(max(seconds))
        self.per_rank.setdefault(key, []).append(seconds)

    def median(self, key: str) -> float:
        return statistics.median(self.times[key])


@dataclass
class Run:
    """What one benchmark run drives: its two groups of ranks and its settings."""

    two: PipedRanks
    three: PipedRanks
    saves: list[str]  # castore, dcp, tc, tc-nosync
    loads: list[str]  # castore, dcp, tc
    cold: bool
    quiet: float
    settle: float
    base_digests: dict[str, str]


def rotate(items: list[str], by: int) -> list[str]:
    by %= len(items)
    return items[by:] + items[:by]


def prepare(drop: bool, quiet: float) -> None:
    """Before a timed step: flush (and drop the page cache), then let freed memory go idle."""
    if drop:
        if not drop_caches():
            raise RuntimeError("dropping the page cache stopped working")
    else:
        os.sync()
    time.sleep(quiet)


def check(replies: list[dict[str, Any]], what: str) -> None:
    for rank, reply in enumerate(replies):
        if reply.get("bad"):
            raise AssertionError(f"{what}: rank {rank} loaded wrong values in {reply['bad']}")


# -- one repetition --------------------------------------------------------------------------


def one_rep(rep: int, run: Run, work: Path, results: Results, verify: bool) -> None:
    out = work / f"rep{rep}"
    out.mkdir(parents=True)
    paths = {system: out / system for system in run.saves}
    with castore.open(paths["castore"]) as store:  # empty, before the ranks open it
        results.notes.setdefault("chunk_size", store.chunk_size)
    quiet = run.quiet if rep >= 0 else 0.0
    try:
        saves(rep, run, paths, results, quiet)
        loads(rep, run, paths, results, quiet, verify)
        frozen_resaves(rep, run, paths, results, quiet, verify)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        time.sleep(run.settle if rep >= 0 else 0.0)


def saves(rep: int, run: Run, paths: dict[str, Path], results: Results, quiet: float) -> None:
    for system in rotate(run.saves, rep):
        prepare(False, quiet)
        replies = run.two.command("save", system, str(paths[system]), "base", 1)
        results.add(f"save {system}", replies)
        written = tree_bytes(paths[system])[0]
        results.notes.setdefault("save_bytes_on_disk", {})[system] = written
        if system == "castore":
            results.notes["castore_save_stats"] = replies[0]["stats"]


def loads(
    rep: int, run: Run, paths: dict[str, Path], results: Results, quiet: float, verify: bool
) -> None:
    modes = ["cold", "warm"] if run.cold else ["warm"]
    for label, ranks in (("load", run.two), ("restore 2->3", run.three)):
        for system in rotate(run.loads, rep):
            for mode in modes:
                prepare(mode == "cold", quiet if mode == "cold" else 0.0)
                replies = ranks.command("load", system, str(paths[system]), "base", verify)
                results.add(f"{label} ({mode}) {system}", replies)
                if verify:
                    check(replies, f"{system} {label} ({mode})")
                    if ranks is run.three:
                        same_digests(run, system, mode)


def same_digests(run: Run, system: str, mode: str) -> None:
    """Every tensor restored at 3 ranks equals the saved one, compared whole (sha256)."""
    got = run.three.command("digests", "targets")[0]["digests"]
    wrong = sorted(p for p in run.base_digests if got.get(p) != run.base_digests[p])
    if wrong or got.keys() != run.base_digests.keys():
        raise AssertionError(f"{system} restore 2->3 ({mode}): wrong values in {wrong[:5]}")


def frozen_resaves(
    rep: int, run: Run, paths: dict[str, Path], results: Results, quiet: float, verify: bool
) -> None:
    targets = {s: paths[s] if s == "castore" else paths[s].with_name(f"{s}-frozen") for s in paths}
    for system in rotate(run.saves, rep):
        before = tree_bytes(paths["castore"])[0] if system == "castore" else 0
        prepare(run.cold, quiet)  # cold: castore's store is not in the page cache
        replies = run.two.command("save", system, str(targets[system]), "frozen", 2)
        results.add(f"frozen re-save {system}", replies)
        written = tree_bytes(targets[system])[0] - before
        results.notes.setdefault("frozen_bytes_on_disk", {})[system] = written
        if system == "castore":
            results.notes["castore_frozen_stats"] = replies[0]["stats"]
            if replies[0]["generation"] != 2:
                raise AssertionError(f"re-save published {replies[0]['generation']}, not 2")
    if verify:  # each re-save loads back as the frozen state (untimed)
        for system in run.loads:
            replies = run.two.command("load", system, str(targets[system]), "frozen", True)
            check(replies, f"{system} frozen re-save, loaded back")


# -- the report ------------------------------------------------------------------------------


def operations(cold: bool) -> list[str]:
    modes = ["cold", "warm"] if cold else ["warm"]
    ops = ["save"]
    ops += [f"load ({m})" for m in modes] + [f"restore 2->3 ({m})" for m in modes]
    return ops + ["frozen re-save"]


def summarize(results: Results, run: Run) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """One row per operation: each system's median, each peer's over castore's."""
    rows, records = [], []
    for op in operations(run.cold):
        systems = run.saves if "save" in op else run.loads
        mine = results.median(f"{op} castore")
        row = [op, f"{mine:.3f}"]
        record: dict[str, Any] = {"operation": op}
        for system in systems:
            key = f"{op} {system}"
            med = results.median(key)
            record[system] = {
                "median_s": med,
                "times_s": results.times[key],
                "per_rank_s": results.per_rank[key],
                "ratio_over_castore": med / mine,
            }
            if system != "castore":
                row += [f"{med:.3f}", f"{med / mine:.2f}x"]
        row += ["", ""] * (len(run.saves) - len(systems))
        rows.append(row)
        records.append(record)
    return rows, records


def frozen_bytes(results: Results) -> dict[str, Any]:
    stats = results.notes["castore_frozen_stats"]
    state = stats["logical_bytes"]
    disk = results.notes["frozen_bytes_on_disk"]
    figures = {"state_bytes": state, "castore_new_over_state": stats["new_bytes"] / state}
    for system, written in disk.items():
        figures[f"{system}_on_disk_over_state"] = written / state
    return figures


def evaluate_goals(results: Results, figures: dict[str, Any]) -> list[dict[str, Any]]:
    ratio = results.median("save dcp") / results.median("save castore")
    new = figures["castore_new_over_state"]
    return [
        {
            "goal": f"save at 2 ranks: DCP's time / castore's >= {SAVE_GOAL}",
            "measured": f"{ratio:.2f}x",
            "value": ratio,
            "met": ratio >= SAVE_GOAL,
        },
        {
            "goal": f"re-save with 90% frozen: castore's new bytes / state <= {FROZEN_GOAL}",
            "measured": f"{new:.3f}",
            "value": new,
            "met": new <= FROZEN_GOAL,
        },
    ]


def report(results: Results, run: Run) -> tuple[list[dict[str, Any]], dict[str, Any], list[Any]]:
    rows, records = summarize(results, run)
    headers = ["operation", "castore s"]
    for system in run.saves[1:]:
        headers += [f"{system} s", f"{system} / castore"]
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    figures = frozen_bytes(results)
    print(
        "\ntime: the call, slowest rank, median over repetitions; 'X / castore': X's time "
        "over castore's (above 1: castore faster).\nfrozen re-save, bytes over the state's "
        f"{figures['state_bytes'] / MIB:.1f} MiB: castore new "
        f"{figures['castore_new_over_state']:.3f} (store grew "
        f"{figures['castore_on_disk_over_state']:.3f}), "
        + ", ".join(
            f"{s} {figures[f'{s}_on_disk_over_state']:.3f}" for s in run.saves if s != "castore"
        )
    )
    verdicts = evaluate_goals(results, figures)
    print_goals(verdicts)
    return records, figures, verdicts


# -- main ------------------------------------------------------------------------------------


def tc_status() -> dict[str, Any]:
    if importlib.util.find_spec("torch_checkpointing") is None:
        return {
            "available": False,
            "why": "not importable: install it outside the project's environment, e.g. "
            "pip install --no-deps --target /tmp/tc torch_checkpointing==0.1.1, and run "
            "with PYTHONPATH=/tmp/tc",
        }
    import torch_checkpointing

    return {"available": True, "version": torch_checkpointing.__version__, "note": TC_WHY}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=float, default=256.0, help="state (default 256)")
    parser.add_argument("--blocks", type=int, default=20, help="MLP blocks (default 20)")
    parser.add_argument("--frozen", type=float, default=0.9, help="blocks frozen (0.9)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (1)")
    parser.add_argument("--quiet", type=float, default=8.0, help="pause before a step (s, 8)")
    parser.add_argument("--settle", type=float, default=5.0, help="pause after a rep (s, 5)")
    parser.add_argument("--dir", type=Path, default=None, help="scratch (default: /tmp)")
    parser.add_argument("--json", nargs="?", type=Path, const=Path(DEFAULT_JSON), default=None)
    parser.add_argument("--warm-only", action="store_true", help="do not drop the page cache")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is not met")
    parser.add_argument("--small", action="store_true", help="tiny state, 1 checked rep")
    args = parser.parse_args(argv)
    if args.small:
        args.state_mib, args.blocks, args.repeats, args.warmup = 0.5, 10, 1, 0
        args.quiet = args.settle = 0.0
    if args.repeats < 1 or args.warmup < 0 or args.blocks < 2:
        parser.error("need --repeats >= 1, --warmup >= 0, --blocks >= 2")
    return args


def start(shape: Shape, tc: dict[str, Any], args: argparse.Namespace) -> Run:
    two = PipedRanks(2, worker, (2, shape, True), "fsdp2-save")
    try:
        three = PipedRanks(3, worker, (3, shape, False), "fsdp2-restore")
    except BaseException:
        two.close()
        raise
    digests = two.command("digests", "base")[0]["digests"]
    peers = ["dcp", "tc"] if tc["available"] else ["dcp"]
    return Run(
        two=two,
        three=three,
        saves=["castore", *peers] + (["tc-nosync"] if tc["available"] else []),
        loads=["castore", *peers],
        cold=not args.warm_only and drop_caches(),
        quiet=args.quiet,
        settle=args.settle,
        base_digests=digests,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    shape = shape_for(args.state_mib, args.blocks, args.frozen)
    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    if disk_free(base) < 8 * shape.state_bytes:  # one rep: 4 saves and 3 frozen re-saves
        print(f"not enough disk under {base} for 8x the state", file=sys.stderr)
        return 2
    tc = tc_status()
    print(
        f"FSDP2 MLP: {shape.blocks} blocks of width {shape.width}, {shape.params:,} parameters; "
        f"parameters and AdamW moments {shape.state_bytes / MIB:.1f} MiB; "
        f"{shape.frozen} blocks frozen for the re-save "
        f"({1 - shape.trainable_params / shape.params:.1%} of the parameters)\n"
        f"torch_checkpointing: {tc}\nscratch {base}, repeats {args.repeats} "
        f"(+{args.warmup} untimed), quiet {args.quiet:g} s, settle {args.settle:g} s",
        flush=True,
    )
    started = time.perf_counter()
    results = Results()
    work = Path(tempfile.mkdtemp(prefix="castore-bench-fsdp2-", dir=base))
    run = None
    try:
        run = start(shape, tc, args)
        print(
            f"ranks up and trained in {time.perf_counter() - started:.0f} s; "
            f"loads {'cold and warm' if run.cold else 'warm only'}",
            flush=True,
        )
        for rep in range(-args.warmup, args.repeats):
            rep_start = time.perf_counter()
            sink = results if rep >= 0 else Results()
            one_rep(rep, run, work, sink, verify=rep == -args.warmup)
            print(
                f"rep {rep + 1}/{args.repeats}" if rep >= 0 else "warm-up (untimed, checked)",
                f"{time.perf_counter() - rep_start:.0f} s",
                flush=True,
            )
    finally:
        if run is not None:
            run.two.close()
            run.three.close()
        shutil.rmtree(work, ignore_errors=True)
    print("checked once: every load, restore and re-save equals what was saved\n")
    records, figures, verdicts = report(results, run)
    print(f"\ntotal time {time.perf_counter() - started:.0f} s")
    if args.json:
        payload = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "shape": asdict(shape) | {"params": shape.params, "state_bytes": shape.state_bytes},
            "frozen_params_fraction": 1 - shape.trainable_params / shape.params,
            "ranks": {"save": 2, "restore": 3},
            "cold_loads": run.cold,
            "systems": {"saves": run.saves, "loads": run.loads},
            "torch_checkpointing": tc,
            "versions": versions(),
            "cpus": os.cpu_count(),
            "results": records,
            "frozen_resave_bytes": figures,
            "notes": results.notes,
            "goals": verdicts,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if args.check and not all(v["met"] for v in verdicts) else 0


def versions() -> dict[str, str]:
    import torch

    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "castore": castore.__version__,
    }


if __name__ == "__main__":
    sys.exit(main())
