"""Cost against history: does a save, a listing or a lookup slow down as generations pile up?

Run from the repository root::

    .venv/bin/python benchmarks/bench_history.py [--points 1,100,1000,10000] [--probe 20]
                                                 [--workdir DIR] [--json OUT]

One store and one run receive saves of a small training-like state (32 fp32
tensors of 1 to 32 KiB, 0.5 MiB in all, plus a step counter and a learning
rate), one tensor refilled in place before each save, as a job saving every
minute would. When the run reaches each history size in ``--points`` (1, 100,
1,000, 10,000 generations), the script measures, as medians:

  save      the next ``--probe`` (20) ``store.save`` calls, each one timed
  peer      ``torch.save`` of the same state into a new file, the same number
            of times, in the same run: a peer with no history at all
  gens      ``store.generations(run)``, every generation (its output grows)
  last10    ``store.generations(run, last=10)``: the newest 10 only
  log -n 10 ``castore log STORE -n 10`` in this process (stdout discarded)
  by id     ``store.resolve(run, 1)``: the oldest generation, by id
  fresh     a second ``castore.open`` of the store, ``resolve(run, 1)`` and
            close: a new process's first lookup by id, which reads the reflog

and the number of pack files and the reflog's size. The table then shows the
ratio of each figure at the last point to the first (1.0: independent of
history), and save latency against torch.save's in the same run. Finally
``gc --keep 3`` runs on the full store, and the pack files before and after
are shown (GC merges small packs into one).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import castore
from castore import cli
from castore.gc import RetentionPolicy, collect_garbage


def make_state(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"layer{i:02d}": torch.rand(256 * (1 + i % 32), generator=generator) for i in range(32)
    }
    return {"model": tensors, "step": 0, "lr": 1e-3}


def timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pack_count(store_dir: Path) -> int:
    return sum(1 for name in os.listdir(store_dir / "chunks" / "packs") if name.endswith(".pack"))


def measure(
    store: castore.Store, store_dir: Path, state: dict[str, Any], probe: int, scratch: Path
) -> dict[str, float]:
    names = sorted(state["model"])
    save_times = []
    for i in range(probe):
        state["model"][names[i % len(names)]].add_(1.0)
        state["step"] += 1
        start = time.perf_counter()
        store.save(state, run="job", step=state["step"])
        save_times.append(time.perf_counter() - start)

    def peer() -> None:
        torch.save(state, scratch / "peer.pt")

    def log_n() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main(["log", str(store_dir), "-n", "10"])

    def fresh() -> None:
        # A new handle's first lookup by id: the reflog read and parsed from disk.
        with castore.open(store_dir, create=False) as other:
            other.resolve("job", 1)

    return {
        "save": statistics.median(save_times),
        "peer": timed(peer, probe),
        "gens": timed(lambda: store.generations("job"), 5),
        "last10": timed(lambda: store.generations("job", last=10), 5),
        "log -n 10": timed(log_n, 5),
        "by id": timed(lambda: store.resolve("job", 1), 5),
        "fresh": timed(fresh, 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="1,100,1000,10000", help="history sizes measured")
    parser.add_argument("--probe", type=int, default=20, help="saves timed at each point")
    parser.add_argument("--workdir", type=Path, default=None, help="where the store goes")
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    args = parser.parse_args()
    points = sorted(int(p) for p in args.points.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="castore-history-", dir=args.workdir))
    store_dir = workdir / "store"
    state = make_state()
    rows: list[tuple[int, dict[str, float], int, int]] = []
    try:
        with castore.open(store_dir) as store:
            names = sorted(state["model"])
            count = 0
            for point in points:
                while count < point:
                    state["model"][names[count % len(names)]].add_(1.0)
                    state["step"] += 1
                    store.save(state, run="job", step=state["step"])
                    count += 1
                figures = measure(store, store_dir, state, args.probe, workdir)
                count += args.probe
                reflog = (store_dir / "logs" / "job.reflog").stat().st_size
                rows.append((point, figures, pack_count(store_dir), reflog))
                print(
                    f"{point:>6} generations: "
                    + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in figures.items())
                    + f", {rows[-1][2]} packs",
                    flush=True,
                )
            packs_before = pack_count(store_dir)
            start = time.perf_counter()
            collect_garbage(store, RetentionPolicy(keep_last=3))
            gc_seconds = time.perf_counter() - start
            packs_after = pack_count(store_dir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    keys = list(rows[0][1])
    print()
    print("| generations | " + " | ".join(keys) + " | packs | reflog |")
    print("| --- " * (len(keys) + 3) + "|")
    for point, figures, packs, reflog in rows:
        cells = " | ".join(f"{figures[k] * 1e3:.2f} ms" for k in keys)
        print(f"| {point:,} | {cells} | {packs:,} | {reflog / 1024:.0f} KiB |")
    first, last = rows[0][1], rows[-1][1]
    print(
        "| last/first | "
        + " | ".join(f"{last[k] / first[k]:.2f}x" for k in keys)
        + f" | {rows[-1][2] / rows[0][2]:.0f}x | |"
    )
    print()
    for point, figures, _, _ in rows:
        print(f"save at {point:,} generations: {figures['save'] / figures['peer']:.2f}x torch.save")
    print(
        f"gc --keep 3 over {count:,} generations: {gc_seconds:.2f} s, "
        f"{packs_before:,} packs -> {packs_after:,}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": [
                        {"generations": p, "figures": f, "packs": n, "reflog_bytes": r}
                        for p, f, n, r in rows
                    ],
                    "gc_seconds": gc_seconds,
                    "packs_before_gc": packs_before,
                    "packs_after_gc": packs_after,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
