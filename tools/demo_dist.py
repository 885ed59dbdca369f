"""The multi-rank part of `make demo`: 4 ranks save, 2 ranks restore (gloo, CPU).

Four real processes train a small model with DDP and AdamW and save the
whole training state every step as one castore generation: each rank writes
its dim-0 block of every parameter and of its optimizer moments (a ZeRO/FSDP
style sharded checkpoint), its own RNG stream as per-rank state, and the
replicated step counter. Then two fresh processes restore the newest
generation onto 2 ranks (each asking only for its half of every tensor),
and check every element against the full tensors saved for reference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import join_tcp_group, spawn_ranks, stop_ranks  # noqa: E402
from demo import build_model  # noqa: E402  (the same model as the single-process demo)

import castore  # noqa: E402
import castore.dist  # noqa: E402
from castore.cli import main as castore_cli  # noqa: E402

RUN = "dist-demo"
SAVE_RANKS = 4
RESTORE_RANKS = 2
STEPS = 4
VOCAB = 4096


def rows_of(length: int, rank: int, world: int) -> tuple[int, int]:
    """(start, count) of ``rank``'s block when ``length`` rows split over ``world`` ranks."""
    base, extra = divmod(length, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def block(tensor: torch.Tensor, rank: int, world: int) -> castore.Shard:
    if tensor.dim() == 0:
        raise ValueError("0-d tensors are replicated, not sharded")
    start, count = rows_of(tensor.shape[0], rank, world)
    offsets = (start,) + (0,) * (tensor.dim() - 1)
    return castore.Shard(tensor.detach()[start : start + count].clone(), tensor.shape, offsets)


def sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, world: int
) -> dict[str, Any]:
    names = {id(p): n for n, p in model.named_parameters()}
    moments: dict[str, Any] = {}
    for param, state in optimizer.state.items():
        moments[names[id(param)]] = {
            "exp_avg": block(state["exp_avg"], rank, world),
            "exp_avg_sq": block(state["exp_avg_sq"], rank, world),
            "step": float(state["step"]),
        }
    return {
        "model": {name: block(t, rank, world) for name, t in model.state_dict().items()},
        "optimizer": {"state": moments, "lr": optimizer.param_groups[0]["lr"]},
        "step": step,
        "rng": castore.RankLocal({"torch": torch.get_rng_state()}),
    }


def train_and_save(rank: int, world: int, port: int, store_path: str, reference: str) -> None:
    join_tcp_group(rank, world, port)
    torch.manual_seed(1234 + rank)
    ddp = nn.parallel.DistributedDataParallel(build_model())
    model = ddp.module
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with castore.open(store_path) as store:
        for step in range(1, STEPS + 1):
            tokens = torch.randint(0, VOCAB, (16, 16))
            loss = nn.functional.cross_entropy(ddp(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            gen = castore.dist.save(
                store, sharded_state(model, optimizer, step, rank, world), run=RUN, step=step
            )
            if rank == 0:
                print(
                    f"  step {step}: 4 ranks saved generation {gen.id} "
                    f"({gen.stats.logical_bytes / 2**20:.1f} MiB, "
                    f"{gen.stats.new_bytes / 2**20:.1f} MiB new)",
                    flush=True,
                )
    if rank == 0:  # the full tensors, for the restore check (outside the store)
        names = {id(p): n for n, p in model.named_parameters()}
        full = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
        for param, state in optimizer.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                full[f"optimizer/{names[id(param)]}/{key}"] = state[key].clone()
        torch.save(full, reference)
    dist.destroy_process_group()


def restore(rank: int, world: int, port: int, store_path: str, reference: str, out: Any) -> None:
    join_tcp_group(rank, world, port)
    full = torch.load(reference)
    targets: dict[str, Any] = {"model": {}, "optimizer": {"state": {}}}
    for key, tensor in full.items():
        start, count = rows_of(tensor.shape[0], rank, world)
        empty = torch.full((count, *tensor.shape[1:]), float("nan"), dtype=tensor.dtype)
        target = castore.Shard(empty, tensor.shape, (start,) + (0,) * (tensor.dim() - 1))
        kind, name = key.split("/", 1)
        if kind == "model":
            targets["model"][name] = target
        else:
            param, moment = name.rsplit("/", 1)
            targets["optimizer"]["state"].setdefault(param, {})[moment] = target
    with castore.open(store_path, create=False) as store:
        dist.barrier()
        started = time.perf_counter()
        result = castore.dist.load(store, RUN, targets, rank_local="drop")
        seconds = time.perf_counter() - started
    mismatches = 0
    for key, tensor in full.items():
        kind, name = key.split("/", 1)
        if kind == "model":
            shard = result.state["model"][name]
        else:
            param, moment = name.rsplit("/", 1)
            shard = result.state["optimizer"]["state"][param][moment]
        start, count = rows_of(tensor.shape[0], rank, world)
        if not torch.equal(shard.local, tensor[start : start + count]):
            mismatches += 1
    report = result.report
    out.put(
        {
            "rank": rank,
            "seconds": seconds,
            "bytes_read": report.bytes_read,
            "bytes_needed": report.bytes_needed,
            "chunks": report.chunks_read,
            "mismatches": mismatches,
            "tensors": len(full),
            "step": result.state["step"],
            "generation": report.generation.id,
        }
    )
    dist.destroy_process_group()


def launch(target: Any, world: int, *args: Any) -> None:
    procs = spawn_ranks(mp.get_context("spawn"), target, world, *args)
    codes = stop_ranks(procs, timeout=600)
    if any(code != 0 for code in codes):
        raise SystemExit(f"demo: a rank failed (exit codes {codes})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", default="./demo-store")
    args = parser.parse_args()
    store_path = str(Path(args.store).resolve())
    scratch = tempfile.mkdtemp(prefix="castore-demo-")
    reference = os.path.join(scratch, "reference.pt")
    try:
        print(f"\n== {SAVE_RANKS} ranks (gloo) train and save a sharded state every step ==")
        launch(train_and_save, SAVE_RANKS, store_path, reference)
        print(f"\n$ castore log {args.store} --run {RUN}")
        castore_cli(["log", args.store, "--run", RUN])
        print(f"\n== {RESTORE_RANKS} fresh ranks restore the newest generation ==")
        results = mp.get_context("spawn").Queue()
        launch(restore, RESTORE_RANKS, store_path, reference, results)
        rows = sorted(
            (results.get(timeout=60) for _ in range(RESTORE_RANKS)), key=lambda r: r["rank"]
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        tabulate(
            [
                [
                    r["rank"],
                    r["generation"],
                    r["tensors"],
                    f"{r['bytes_read'] / 2**20:.2f} MiB",
                    f"{r['bytes_needed'] / 2**20:.2f} MiB",
                    f"{r['bytes_read'] / max(r['bytes_needed'], 1):.3f}",
                    f"{r['seconds']:.3f}s",
                    "all equal" if r["mismatches"] == 0 else f"{r['mismatches']} DIFFER",
                ]
                for r in rows
            ],
            headers=["rank", "gen", "tensors", "read", "needed", "read/needed", "restore", "check"],
        )
    )
    if any(r["mismatches"] for r in rows):
        print("FAILED: restored blocks differ from the saved tensors")
        return 1
    print(
        f"\nrestored generation {rows[0]['generation']} (saved by {SAVE_RANKS} ranks) onto "
        f"{RESTORE_RANKS} ranks: every element of every block matches"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
