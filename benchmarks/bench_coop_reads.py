"""Cooperative reads in castore.dist.load: bytes read from the store, and restore time.

Run from the repository root::

    .venv/bin/python benchmarks/bench_coop_reads.py [--state-mib 64] [--tensors 16]
                                                    [--ranks 2,4] [--repeats 3] [--dir DIR]
                                                    [--json OUT]

For each rank count, spawned processes join one gloo group and stay alive for
the whole run (process start and imports are never timed). Every rank saves
the same replicated state (``--tensors`` fp32 tensors of random values,
``--state-mib`` in all, no ``castore.Shard``: a data-parallel job's weights)
into two stores: a shared-directory store (format 3 on a directory, each rank
its own index cache, as a node would; ``codec="none"``) and a local LMDB store
(one node). Then each rank restores the whole state into preallocated
tensors, with ``cooperative=False`` (every rank reads all of it from the store)
and ``cooperative=True`` (each chunk read by one rank and sent to the others
over gloo, verified where it lands; castore.dist.coopread), in an order that
alternates per repetition.

A time is the slowest rank's ``castore.dist.load`` after a barrier. The ratio
is the chunk bytes all ranks read from the store (``LoadReport.bytes_read``,
summed) over the unique chunk bytes of the state. On this machine the shared
directory is a local disk whose pages are cached: its reads cost what a
network file system or S3 would not, so the times are the case least
favourable to cooperation; the bytes are what they would be anywhere.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from _common import PipedRanks, join_gloo
from tabulate import tabulate

import castore
import castore.dist

MIB = 1 << 20
COLLECTIVE_TIMEOUT = 300.0
STORES = ("directory", "lmdb")
SETTINGS = {"alone": False, "cooperative": True}


def make_state(state_mib: int, tensors: int) -> dict[str, Any]:
    import torch

    numel = state_mib * MIB // 4 // tensors
    return {
        f"layers.{i:03d}.weight": torch.randn(numel, generator=torch.Generator().manual_seed(i))
        for i in range(tensors)
    }


def open_store(kind: str, path: str, rank: int) -> castore.Store:
    if kind == "directory":
        return castore.open(path, cache_dir=Path(path + "-caches", f"rank{rank}"))
    return castore.open(path)


def worker(rank: int, port: int, world: int, state_mib: int, tensors: int, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    try:
        join_gloo(rank, port, world, COLLECTIVE_TIMEOUT)
        state = make_state(state_mib, tensors)
        conn.send({"ready": True})
    except Exception:  # noqa: BLE001 - the parent must hear about it
        conn.send({"error": traceback.format_exc()})
        return
    stores: dict[str, castore.Store] = {}
    while True:
        command = conn.recv()
        if command[0] == "stop":
            return
        try:
            if command[0] == "close":
                for store in stores.values():
                    store.close()
                stores.clear()
                conn.send({"closed": True})
                continue
            _, kind, path, setting = command
            store = stores.get(path) or stores.setdefault(path, open_store(kind, path, rank))
            if setting is None:
                castore.dist.save(store, state, run="bench", step=1, timeout=COLLECTIVE_TIMEOUT)
                conn.send({"saved": True})
                continue
            targets = {name: torch.empty_like(t) for name, t in state.items()}
            dist.barrier()
            started = time.perf_counter()
            report = castore.dist.load(
                store, "bench", targets, cooperative=setting, timeout=COLLECTIVE_TIMEOUT
            ).report
            seconds = time.perf_counter() - started
            dist.barrier()
            same = all(torch.equal(targets[name], state[name]) for name in state)
            conn.send(
                {
                    "seconds": seconds,
                    "bytes_read": report.bytes_read,
                    "bytes_from_peers": report.bytes_from_peers,
                    "bytes_needed": report.bytes_needed,
                    "timings": report.timings,
                    "same": same,
                }
            )
        except Exception:  # noqa: BLE001
            conn.send({"error": traceback.format_exc()})


def run_world(args: argparse.Namespace, world: int) -> dict[str, Any]:
    ranks = PipedRanks(world, worker, (world, args.state_mib, args.tensors), "coop")
    samples: dict[str, list[dict[str, Any]]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="bench-coop-", dir=args.dir))
    try:
        paths = {kind: str(scratch / kind) for kind in STORES}
        castore.open(paths["directory"], shared=True, codec="none", cache_dir=scratch / "p").close()
        castore.open(paths["lmdb"]).close()
        for kind in STORES:
            ranks.command("save", kind, paths[kind], None)
        for repeat in range(args.repeats):
            order = list(SETTINGS) if repeat % 2 == 0 else list(reversed(SETTINGS))
            for kind in STORES:
                for name in order:
                    replies = ranks.command("load", kind, paths[kind], SETTINGS[name])
                    if not all(reply["same"] for reply in replies):
                        raise RuntimeError(f"{kind} {name}: a rank's restore differs")
                    samples.setdefault(f"{kind} {name}", []).append(
                        {
                            "seconds": max(reply["seconds"] for reply in replies),
                            "bytes_read": sum(reply["bytes_read"] for reply in replies),
                            "bytes_from_peers": sum(r["bytes_from_peers"] for r in replies),
                            "unique": replies[0]["bytes_needed"],
                            "phases": {
                                phase: max(r["timings"].get(phase, 0.0) for r in replies)
                                for phase in replies[0]["timings"]
                            },
                        }
                    )
        ranks.command("close")
    finally:
        ranks.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        case: {
            "seconds": statistics.median(s["seconds"] for s in runs),
            "read_ratio": runs[0]["bytes_read"] / runs[0]["unique"],
            "peer_ratio": runs[0]["bytes_from_peers"] / runs[0]["unique"],
            "all_seconds": [s["seconds"] for s in runs],
            # Each phase of LoadReport.timings: the slowest rank's, median of the repeats.
            "phases": {
                phase: statistics.median(s["phases"][phase] for s in runs)
                for phase in runs[0]["phases"]
            },
        }
        for case, runs in samples.items()
    }


def report(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> None:
    rows = []
    for world, cases in results.items():
        for kind in STORES:
            alone = cases[f"{kind} alone"]["seconds"]
            for name in SETTINGS:
                case = cases[f"{kind} {name}"]
                rows.append(
                    [
                        world,
                        kind,
                        name,
                        f"{case['read_ratio']:.2f}",
                        f"{case['peer_ratio']:.2f}",
                        f"{case['seconds']:.3f}",
                        f"{case['seconds'] / alone:.2f}x",
                        f"{case['phases'].get('cooperate', 0.0):.3f}",
                        f"{case['phases'].get('read_verify', 0.0):.3f}",
                    ]
                )
    print(
        f"{args.state_mib} MiB replicated in {args.tensors} fp32 tensors, restored whole on "
        f"every rank; {args.repeats} repetitions (medians)"
    )
    headers = [
        "ranks", "store", "reads", "store/unique", "peers/unique", "s", "/ alone",
        "cooperate s", "read_verify s",
    ]  # fmt: skip
    print(tabulate(rows, headers=headers, tablefmt="github"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-mib", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch folder (default: the system's)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    results = {int(world): run_world(args, int(world)) for world in args.ranks.split(",")}
    report(results, args)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "dir")}
        Path(args.json).write_text(
            json.dumps({"settings": settings, "results": results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
