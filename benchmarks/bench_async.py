"""Async saves: the caller's stall and the staging memory, against a plain copy and DCP.

Run from the repository root::

    .venv/bin/python benchmarks/bench_async.py [--size-mib 256] [--saves 6] [--rounds 3]
                                               [--ranks 4] [--rank-mib 32] [--stagger-s 1.0]
                                               [--json OUT]

Part 1, stall and memory. One fp32 state of ``--size-mib`` MiB shaped like a
small transformer (benchmarks/bench_save_load.py's ``build_state``). Each
method runs in a process of its own (so its peak RSS is its own), ``--saves``
saves in a row; before every save a different 10% of the state's 4 MiB
chunks change (one element each). The first two saves warm up (the first
writes everything, the second finds the buffers it reuses); the peak RSS is
reset after them (``/proc/self/clear_refs``) and the rest are measured.
Rounds rotate the order of the methods, so drift hits them alike:

  memcpy             copy every tensor into preallocated tensors: the floor
  castore async      ``Store.save(blocking=False)``, full-copy staging
  castore changed    ``blocking=False``, ``AsyncOptions(staging="changed")``
  castore sync       ``Store.save`` (blocking)
  DCP async_save     ``dcp.async_save`` (its default thread mode), no_dist
  torch.save         to a file, flushed and fsynced

Reported per method: stall (median time the caller was held), time to
durable (call to publish; DCP: until its future resolves), staging bytes
castore tracks (median of per-save peaks), and peak RSS above the state
(``VmHWM`` minus the RSS before the measured saves).

Part 2, bursts. ``--ranks`` gloo ranks each hold a ``--rank-mib`` MiB shard
and start an async ``castore.dist.save`` at the same moment, without and then
with ``stagger_s``; each rank's handle records when each chunk went to
storage. The peak aggregate write rate is the most bytes all ranks handed
over in any 100 ms window.

Goals (issue 13): stall per async save <= 1.2x memcpy; staging <= 1.0x the
state in full-copy mode and < 1.5x the changed bytes in changed-chunk mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import PipedRanks, print_goals, rss_kib  # noqa: E402
from bench_save_load import build_state  # noqa: E402

import castore  # noqa: E402
import castore.dist  # noqa: E402

CHUNK = 4 << 20
CHANGED_FRACTION = 0.10
METHODS = ["memcpy", "castore async", "castore changed", "castore sync", "DCP async_save"]
METHODS.append("torch.save")
WARMUP_SAVES = 2
WINDOW_S = 0.1


# -- part 1: one method in a process of its own ---------------------------------


def reset_peak_rss() -> None:
    """Make VmHWM the current RSS (Linux 4.0+), so later peaks are this phase's."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5\n")


def change_chunks(state: dict[str, torch.Tensor], fraction: float, seed: int) -> int:
    """Change one element in ``fraction`` of the state's chunks; return their bytes."""
    chunks = [
        (name, at)
        for name, tensor in state.items()
        for at in range(0, tensor.numel() * tensor.element_size(), CHUNK)
    ]
    generator = torch.Generator().manual_seed(seed)
    count = max(1, round(fraction * len(chunks)))
    changed = 0
    for index in torch.randperm(len(chunks), generator=generator)[:count].tolist():
        name, at = chunks[index]
        flat = state[name].view(-1)
        flat[at // flat.element_size()] += 1.0
        changed += min(CHUNK, flat.numel() * flat.element_size() - at)
    return changed


class Saver:
    """One method's save: ``save()`` returns (stall s, durable s, tracked staging bytes)."""

    def __init__(self, method: str, state: dict[str, torch.Tensor], work: Path) -> None:
        self.method, self.state, self.work = method, state, work
        self.count = 0
        self.copies = {name: torch.empty_like(t) for name, t in state.items()}
        self.store = castore.open(work / "store") if method.startswith("castore") else None
        options = castore.AsyncOptions(staging="changed" if "changed" in method else "full")
        self.options = options

    def save(self) -> tuple[float, float, int]:
        self.count += 1
        started = time.perf_counter()
        if self.method == "memcpy":
            for name, tensor in self.state.items():
                self.copies[name].copy_(tensor)
            held = time.perf_counter() - started
            return held, held, 0
        if self.method == "castore sync":
            assert self.store is not None
            self.store.save(self.state, run="bench", step=self.count)
            held = time.perf_counter() - started
            return held, held, 0
        if self.method.startswith("castore"):
            return self._castore_async(started)
        if self.method == "DCP async_save":
            return self._dcp_async(started)
        return self._torch_save(started)

    def _castore_async(self, started: float) -> tuple[float, float, int]:
        assert self.store is not None
        pending = self.store.save(
            self.state, run="bench", step=self.count, blocking=False, async_options=self.options
        )
        held = time.perf_counter() - started
        pending.result()
        return held, time.perf_counter() - started, pending.peak_staging_bytes

    def _dcp_async(self, started: float) -> tuple[float, float, int]:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(self.work / f"dcp-{self.count}"), sync_files=True)
        future = dcp.async_save(self.state, storage_writer=writer, no_dist=True)
        held = time.perf_counter() - started
        future.result()
        return held, time.perf_counter() - started, 0

    def _torch_save(self, started: float) -> tuple[float, float, int]:
        with open(self.work / f"torch-{self.count}.pt", "wb") as handle:
            torch.save(self.state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        held = time.perf_counter() - started
        return held, held, 0


def one_method(method: str, size_mib: int, saves: int, seed: int) -> dict[str, Any]:
    """Run ``saves`` saves of ``method`` here (a child process); its medians and peaks."""
    torch.set_num_threads(1)
    state = build_state(size_mib, seed)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as work:
        saver = Saver(method, state, Path(work))
        if method == "castore changed":  # a blocking save first: the store holds the chunks
            assert saver.store is not None
            saver.store.save(state, run="bench", step=0)
        stalls, durables, staged, changed = [], [], [], []
        for index in range(saves):
            changed.append(change_chunks(state, CHANGED_FRACTION, seed * 1000 + index))
            if index == WARMUP_SAVES:
                reset_peak_rss()
                rss_before = rss_kib("VmRSS")
            held, durable, tracked = saver.save()
            if index >= WARMUP_SAVES:
                stalls.append(held)
                durables.append(durable)
                staged.append(tracked)
        peak_rss = (rss_kib("VmHWM") - rss_before) * 1024
        if saver.store is not None:
            saver.store.close()
    return {
        "method": method,
        "state_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "changed_bytes": statistics.median(changed),
        "stall_s": statistics.median(stalls),
        "durable_s": statistics.median(durables),
        "staging_bytes": statistics.median(staged),
        "peak_rss_bytes": peak_rss,
    }


def run_part1(args: argparse.Namespace) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = METHODS[round_ % len(METHODS) :] + METHODS[: round_ % len(METHODS)]
        for method in order:
            command = [sys.executable, __file__, "--child", method, "--size-mib"]
            command += [str(args.size_mib), "--saves", str(args.saves), "--seed", str(round_)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{method} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.splitlines()[-1]))
            print(f"  round {round_ + 1}: {method} done", file=sys.stderr)
    return results


def summarize_part1(results: list[dict[str, Any]]) -> tuple[list[list[Any]], dict[str, Any]]:
    by: dict[str, dict[str, float]] = {}
    for method in METHODS:
        mine = [r for r in results if r["method"] == method]
        by[method] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("stall_s", "durable_s", "staging_bytes", "peak_rss_bytes")
        }
    state_bytes = results[0]["state_bytes"]
    changed = statistics.median(r["changed_bytes"] for r in results)
    memcpy = by["memcpy"]["stall_s"]
    rows = [
        [
            method,
            f"{1000 * v['stall_s']:.1f}",
            f"{v['stall_s'] / memcpy:.2f}x",
            f"{1000 * v['durable_s']:.0f}",
            f"{v['staging_bytes'] / 2**20:.1f}" if method.startswith("castore") else "-",
            f"{v['peak_rss_bytes'] / 2**20:.1f}",
        ]
        for method, v in by.items()
    ]
    summary = {"state_bytes": state_bytes, "changed_bytes": changed, "methods": by}
    return rows, summary


# -- part 2: bursts with and without stagger -----------------------------------


def burst_rank(rank: int, port: int, world: int, rank_mib: int, store: str, conn: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        handle = castore.open(store)
        rows = rank_mib * 2**20 // 4 // 1024
        local = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rank))
        state = {"w": castore.Shard(local, (rows * world, 1024), (rows * rank, 0))}
        conn.send({"ready": True})
        while (command := conn.recv())[0] != "stop":
            _, step, stagger = command
            local.add_(1.0)  # every chunk new
            dist.barrier()
            options = castore.AsyncOptions(stagger_s=stagger)
            pending = castore.dist.save(
                handle, state, run="burst", step=step, blocking=False, async_options=options
            )
            pending.result()
            conn.send({"timeline": pending.timeline})
        handle.close()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
        conn.send({"error": repr(exc)})


def peak_rate(timelines: list[list[tuple[float, int]]]) -> float:
    """The most bytes per second all ranks handed to storage in any WINDOW_S window."""
    events = sorted(event for timeline in timelines for event in timeline)
    best = total = 0
    start = 0
    for end in range(len(events)):
        total += events[end][1]
        while events[end][0] - events[start][0] > WINDOW_S:
            total -= events[start][1]
            start += 1
        best = max(best, total)
    return best / WINDOW_S


def run_part2(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as work:
        ranks = PipedRanks(
            args.ranks, burst_rank, (args.ranks, args.rank_mib, f"{work}/store"), "burst"
        )
        try:
            rates: dict[str, list[float]] = {"no stagger": [], "stagger": []}
            for step in range(2 * args.rounds):
                mode = "stagger" if step % 2 else "no stagger"
                stagger = args.stagger_s if step % 2 else 0.0
                replies = ranks.command("save", step, stagger)
                rates[mode].append(peak_rate([reply["timeline"] for reply in replies]))
        finally:
            ranks.close()
    return {mode: statistics.median(values) for mode, values in rates.items()}


# -- main ----------------------------------------------------------------------


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    by = summary["methods"]
    memcpy = by["memcpy"]["stall_s"]
    state, changed = summary["state_bytes"], summary["changed_bytes"]
    full, delta = by["castore async"], by["castore changed"]
    return [
        {
            "goal": "stall per async save <= 1.2x memcpy (full-copy)",
            "met": full["stall_s"] <= 1.2 * memcpy,
            "measured": f"{full['stall_s'] / memcpy:.2f}x",
        },
        {
            "goal": "full-copy staging <= 1.0x the state's tensor bytes",
            "met": full["staging_bytes"] <= state,
            "measured": f"{full['staging_bytes'] / state:.2f}x",
        },
        {
            "goal": "changed-chunk staging < 1.5x the changed bytes (10% changed)",
            "met": delta["staging_bytes"] < 1.5 * changed,
            "measured": f"{delta['staging_bytes'] / changed:.2f}x",
        },
        {
            "goal": "stall per async save <= DCP async_save's",
            "met": full["stall_s"] <= by["DCP async_save"]["stall_s"],
            "measured": f"{full['stall_s'] / by['DCP async_save']['stall_s']:.2f}x",
        },
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rank-mib", type=int, default=32)
    parser.add_argument("--stagger-s", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(one_method(args.child, args.size_mib, args.saves, args.seed)))
        return 0
    print(f"part 1: {args.size_mib} MiB state, {args.saves} saves x {args.rounds} rounds")
    rows, summary = summarize_part1(run_part1(args))
    headers = ["method", "stall ms", "x memcpy", "durable ms", "staging MiB", "peak RSS MiB"]
    print(tabulate(rows, headers=headers))
    print(
        f"state {summary['state_bytes'] / 2**20:.0f} MiB; changed per save "
        f"{summary['changed_bytes'] / 2**20:.1f} MiB"
    )
    print(f"part 2: {args.ranks} ranks x {args.rank_mib} MiB, stagger {args.stagger_s} s")
    bursts = run_part2(args)
    print(
        tabulate(
            [[mode, f"{rate / 2**20:.0f}"] for mode, rate in bursts.items()],
            headers=["", "peak aggregate MiB/s (100 ms)"],
        )
    )
    print(f"stagger / no stagger: {bursts['stagger'] / bursts['no stagger']:.2f}x")
    verdicts = goals(summary)
    print_goals(verdicts)
    if args.json:
        args.json.write_text(json.dumps({"part1": summary, "part2": bursts, "goals": verdicts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
