"""What comparing replicated values across ranks costs a castore.dist save.

Run from the repository root::

    .venv/bin/python benchmarks/bench_replicas.py [--state-mib 256] [--tensors 32] [--ranks 2]
                                                  [--repeats 5] [--hsdp] [--quiet 2] [--dir DIR]
                                                  [--json OUT]

``--ranks`` spawned processes join one gloo group and stay alive for the whole
run (process start and imports are never timed). Each passes the same state,
as a data-parallel job does: ``--tensors`` fp32 tensors of random values
(seeded per tensor, the same on every rank), ``--state-mib`` in all, every one
passed as replicated (no ``castore.Shard``). castore writes each replicated
tensor once, on one rank; since the check, every rank also digests the
replicated tensors the other ranks write, and the ranks compare one digest
each before the publish (castore.dist.replicas). ``--hsdp`` passes each tensor
as a DTensor replicated over a mesh of every rank (HSDP's replicas of a
block): the rank at coordinate 0 writes it, and the others digest their copy.

Each repetition, in a fresh scratch folder, times (in an order that rotates):

  torch.save       rank 0 ``torch.save`` of the state to one file, fsynced
  DCP              ``dcp.save`` with ``FileSystemWriter(sync_files=True)`` (DCP
                   writes one replica of each plain tensor and never compares them)
  castore          ``castore.dist.save`` into a new store (every chunk new)
  unchecked        the same with the comparison switched off in the ranks (the
                   save as it was before the check), into another new store

then, for both castore variants, re-saves of the unchanged state into the
same store: generation 2 as saves are by default (every chunk hashed, none
written), and generation 4 with ``trust_versions=True`` (generation 3 records
the version counters; nothing changed since, so nothing is hashed).

A time is the slowest rank's call after a barrier. The parent syncs and pauses
``--quiet`` seconds before each step. Prints medians and ratios, and the goal
of the check's issue: the check costs at most 5% of a save with replicated state.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from _common import PipedRanks, join_gloo, print_goals
from tabulate import tabulate

import castore
import castore.dist
import castore.dist.groupcommit

MIB = 1 << 20
COLLECTIVE_TIMEOUT = 300.0
METHODS = ["torch.save", "DCP", "castore", "unchecked"]
RESAVES = [
    "castore re-save",
    "unchecked re-save",
    "castore trusting re-save",
    "unchecked trusting re-save",
]
ROWS = METHODS + RESAVES
GOAL = 1.05  # castore's save time <= 1.05x the unchecked save's (first save and re-save)


def make_state(state_mib: int, tensors: int, hsdp: bool = False) -> dict[str, Any]:
    """The replicated state; ``hsdp``: each tensor a DTensor replicated over a mesh of
    every rank (HSDP's replicas: the rank at coordinate 0 writes, the others hash)."""
    import torch

    numel = state_mib * MIB // 4 // tensors
    state = {
        f"layers.{i:03d}.weight": torch.randn(numel, generator=torch.Generator().manual_seed(i))
        for i in range(tensors)
    }
    for tensor in state.values():
        tensor.mul_(1.0)  # a version counter at 0 is never trusted (castore.core.unchanged)
    if hsdp:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        state = {
            name: DTensor.from_local(t, mesh, [Replicate()], run_check=False)
            for name, t in state.items()
        }
    return state


def switch_off_the_check() -> None:
    """The save as it was before replicated values were compared (this process only)."""
    from castore.dist import replicas

    def start(self: Any, *args: Any, **options: Any) -> None:
        pass

    replicas.ReplicaDigests.start = start  # type: ignore[method-assign]
    castore.dist.groupcommit.check_replicas = lambda *args, **kwargs: None


def worker(
    rank: int, port: int, world: int, state_mib: int, tensors: int, hsdp: bool, conn: Any
) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    try:
        join_gloo(rank, port, world, COLLECTIVE_TIMEOUT)
        state = make_state(state_mib, tensors, hsdp)
        conn.send({"ready": True})
    except Exception:  # noqa: BLE001 - the parent must hear about it
        conn.send({"error": traceback.format_exc()})
        return

    stores: dict[str, Any] = {}

    def timed(method: str, path: str, step: int, trust: bool) -> float:
        store = None
        if method in ("castore", "unchecked"):
            # Opened before the clock, and kept for the whole repetition: a trusting
            # save needs the handle's record of the save before.
            store = stores.setdefault(path, castore.open(path, create=False))
        dist.barrier()
        started = time.perf_counter()
        if store is not None:
            castore.dist.save(
                store,
                state,
                run="bench",
                step=step,
                timeout=COLLECTIVE_TIMEOUT,
                trust_versions=trust,
            )
        elif method == "DCP":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))
        elif rank == 0:
            with open(path, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
        seconds = time.perf_counter() - started
        dist.barrier()
        return seconds

    while True:
        command = conn.recv()
        if command[0] == "stop":
            return
        if command[0] == "close":
            for store in stores.values():
                store.close()
            stores.clear()
            conn.send({"closed": True})
            continue
        try:
            _, method, path, step, trust = command
            if method == "unchecked":
                switch_off_the_check()
            try:
                conn.send({"seconds": timed(method, path, step, trust)})
            finally:
                castore.dist.groupcommit.check_replicas = CHECK
                castore.dist.replicas.ReplicaDigests.start = START  # type: ignore[method-assign]
        except Exception:  # noqa: BLE001
            conn.send({"error": traceback.format_exc()})


START = castore.dist.replicas.ReplicaDigests.start
CHECK = castore.dist.groupcommit.check_replicas


def run(args: argparse.Namespace) -> dict[str, Any]:
    ranks = PipedRanks(
        args.ranks, worker, (args.ranks, args.state_mib, args.tensors, args.hsdp), "replicas"
    )
    times: dict[str, list[float]] = {m: [] for m in ROWS}
    try:
        for rep in range(args.repeats):
            scratch = Path(tempfile.mkdtemp(prefix="bench-replicas-", dir=args.dir))
            try:
                order = METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]
                for method in order:
                    path = scratch / method.replace(".", "-")
                    if method in ("castore", "unchecked"):
                        castore.open(path).close()
                    times[method].append(step(ranks, method, path, 1, args.quiet))
                both = ("castore", "unchecked") if rep % 2 else ("unchecked", "castore")
                for method in both:
                    path = scratch / method
                    times[f"{method} re-save"].append(step(ranks, method, path, 2, args.quiet))
                    step(ranks, method, path, 3, args.quiet, trust=True)  # records the versions
                    again = step(ranks, method, path, 4, args.quiet, trust=True)
                    times[f"{method} trusting re-save"].append(again)
            finally:
                ranks.command("close")
                shutil.rmtree(scratch)
    finally:
        ranks.close()
    return {name: statistics.median(values) for name, values in times.items()} | {"all": times}


def step(
    ranks: PipedRanks, method: str, path: Path, number: int, quiet: float, trust: bool = False
) -> float:
    os.sync()
    time.sleep(quiet)
    replies = ranks.command("save", method, str(path), number, trust)
    return max(reply["seconds"] for reply in replies)


def report(medians: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    gib = args.state_mib / 1024
    rows = []
    for name in ROWS:
        seconds = medians[name]
        rows.append([name, f"{seconds:.3f}", f"{gib / seconds:.2f}", *ratios(medians, name)])
    print(
        f"{args.state_mib} MiB in {args.tensors} replicated fp32 tensors, {args.ranks} ranks, "
        f"{args.repeats} repetitions (medians)"
    )
    headers = ["save", "s", "GiB/s", "/ torch.save", "/ DCP", "/ unchecked"]
    print(tabulate(rows, headers=headers, tablefmt="github"))
    verdicts = []
    for name, what in (
        ("castore", "a first save"),
        ("castore re-save", "an unchanged re-save"),
        ("castore trusting re-save", "a trusting re-save"),
    ):
        ratio = medians[name] / medians[name.replace("castore", "unchecked")]
        verdicts.append(
            {"goal": f"check <= 5% of {what}", "measured": f"{ratio:.3f}x", "met": ratio <= GOAL}
        )
    print_goals(verdicts)
    return verdicts


def ratios(medians: dict[str, Any], name: str) -> list[str]:
    seconds = medians[name]
    unchecked = medians[name.replace("castore", "unchecked")]
    return [
        f"{seconds / medians['torch.save']:.2f}x",
        f"{seconds / medians['DCP']:.2f}x",
        f"{seconds / unchecked:.3f}x" if name.startswith(("castore", "unchecked")) else "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--hsdp",
        action="store_true",
        help="the tensors as DTensors replicated over every rank (HSDP's replicas)",
    )
    parser.add_argument("--quiet", type=float, default=2.0, help="seconds to pause before a step")
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    parser.add_argument("--json", default=None, help="write the medians and verdicts here")
    args = parser.parse_args()
    medians = run(args)
    verdicts = report(medians, args)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), **medians, "goals": verdicts}, indent=1)
        )


if __name__ == "__main__":
    main()
