"""A branch of a generation against rewriting the checkpoint (issue 41's goal for branch).

Run from the repository root::

    .venv/bin/python benchmarks/bench_lineage.py [--size-mib 1024] [--tensors 64]
        [--repeats 5] [--dir DIR] [--json [OUT]] [--small]

One generation of ``--size-mib`` MiB of float32 tensors (random values, so
nothing deduplicates) is saved to an LMDB store in ``--dir`` (default a
temporary directory). Then, each ``--repeats`` times:

  castore branch   ``castore.branch`` of that generation into a new run: the
                   call's seconds, the bytes it wrote (the root's
                   ``written_bytes``: manifests; plus the root) and how much the
                   store's files grew on disk
  torch.save       the same state written again with ``torch.save`` and fsynced:
                   what a file checkpoint's "new run from this one" costs at least
                   (a copy of the file; an edit would add a ``torch.load``)
  safetensors      the same with safetensors ``save_file`` and fsync

Medians, and each as a ratio to castore's branch in the same run. The goal
(issue 41): a branch of a 1 GiB generation in under 50 ms, writing under
1 MiB. ``--small``: 16 MiB in 8 tensors, 2 repeats (the smoke test).
``--json`` writes ``benchmarks/results/lineage.json`` (or OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import castore  # noqa: E402
import castore.chunkstore.base  # noqa: E402
from castore.format.objects import encode_object  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "lineage.json"


def build_state(size_mib: int, tensors: int) -> dict[str, dict[str, np.ndarray]]:
    """Half the tensors under "model", half under "optim" (as a training state holds
    weights and moments)."""
    rng = np.random.default_rng(0)
    per = (size_mib << 20) // tensors // 4
    rows = max(per // 1024, 1)
    half = tensors // 2
    made = [rng.standard_normal((rows, 1024), dtype=np.float32) for _ in range(tensors)]
    return {
        "model": {f"layers.{t}.weight": made[t] for t in range(half)},
        "optim": {f"layers.{t}.exp_avg": made[half + t] for t in range(tensors - half)},
    }


def flat(state: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {f"{part}.{name}": a for part, tree in state.items() for name, a in tree.items()}


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def fsynced(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed_amend(store: castore.Store, repeats: int, **change: Any) -> tuple[list[float], list[int]]:
    seconds, written = [], []
    for i in range(repeats):
        started = time.perf_counter()
        made = castore.amend(store, "base", 1, to_run=f"amend-{len(store.runs())}-{i}", **change)
        seconds.append(time.perf_counter() - started)
        _, root = store.resolve_root(made.run)
        written.append(made.stats.written_bytes + len(encode_object(root)))
    return seconds, written


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from safetensors.numpy import load_file, save_file

    state = build_state(args.size_mib, args.tensors)
    nbytes = sum(a.nbytes for tree in state.values() for a in tree.values())
    store_path = work / "store"
    runs: dict[str, list[float]] = {}
    written: dict[str, list[int]] = {}
    with castore.open(store_path) as store:
        base = store.save(state, run="base", step=100)
        chunks = len(list(store.backend.iter_keys(castore.chunkstore.base.Namespace.CHUNKS)))
        runs["castore branch"], written["castore branch"], grown = [], [], []
        for i in range(args.repeats):
            before = disk_bytes(store_path)
            started = time.perf_counter()
            made = castore.branch(store, "base", base.id, f"ft-{i}")
            runs["castore branch"].append(time.perf_counter() - started)
            _, root = store.resolve_root(made.run)
            written["castore branch"].append(made.stats.written_bytes + len(encode_object(root)))
            grown.append(disk_bytes(store_path) - before)
        loaded = store.load(run=f"ft-{args.repeats - 1}")
        assert all(loaded["model"][k].tobytes() == v.tobytes() for k, v in state["model"].items())
        runs["castore amend: drop optim"], written["castore amend: drop optim"] = timed_amend(
            store, args.repeats, drop=["optim/**"]
        )
        renames = [("model/layers.", "model/blocks."), ("optim/layers.", "optim/blocks.")]
        runs["castore amend: rename every key"], written["castore amend: rename every key"] = (
            timed_amend(store, args.repeats, rename=renames)
        )
        after = len(list(store.backend.iter_keys(castore.chunkstore.base.Namespace.CHUNKS)))
    tensors = {k: torch.from_numpy(v) for k, v in flat(state).items()}
    arrays = flat(state)
    pt, st = work / "state.pt", work / "state.safetensors"
    torch.save(tensors, pt)
    save_file(arrays, str(st))
    for name in ("torch.save", "safetensors", "torch: load, drop optim, save",
                 "safetensors: load, drop optim, save"):  # fmt: skip
        runs[name] = []
    for i in range(args.repeats):
        out = work / f"copy-{i}"
        for name, write in (
            ("torch.save", lambda out=out: torch.save(tensors, out)),
            ("safetensors", lambda out=out: save_file(arrays, str(out))),
            ("torch: load, drop optim, save", lambda out=out: torch.save(
                {k: v for k, v in torch.load(pt).items() if not k.startswith("optim.")}, out)),
            ("safetensors: load, drop optim, save", lambda out=out: save_file(
                {k: v for k, v in load_file(str(st)).items() if not k.startswith("optim.")},
                str(out))),
        ):  # fmt: skip
            started = time.perf_counter()
            write()
            fsynced(out)
            runs[name].append(time.perf_counter() - started)
            out.unlink()
    seconds = {name: statistics.median(values) for name, values in runs.items()}
    branch = seconds["castore branch"]
    drop = seconds["castore amend: drop optim"]
    rename = seconds["castore amend: rename every key"]
    medians = {name: statistics.median(values) for name, values in written.items()}
    return {
        "size_mib": args.size_mib,
        "tensors": args.tensors,
        "logical_bytes": nbytes,
        "repeats": args.repeats,
        "seconds": seconds,
        "runs": runs,
        "written_bytes": medians,
        "branch_written_bytes": medians["castore branch"],
        "branch_disk_growth_bytes": statistics.median(grown),
        "ratios_to_branch": {
            "torch.save": seconds["torch.save"] / branch,
            "safetensors": seconds["safetensors"] / branch,
        },  # fmt: skip
        "ratios_to_drop": {
            "torch: load, drop optim, save": seconds["torch: load, drop optim, save"] / drop,
            "safetensors: load, drop optim, save": (
                seconds["safetensors: load, drop optim, save"] / drop
            ),
        },
        "goals": {
            "branch under 50 ms": branch < 0.050,
            "branch writes under 1 MiB": medians["castore branch"] < 1 << 20,
            "drop and rename under 0.2 s": max(drop, rename) < 0.2,
            "branch, drop and rename write no chunk": after == chunks,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", nargs="?", type=Path, const=DEFAULT_JSON, default=None)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args(argv)
    if args.small:
        args.size_mib, args.tensors, args.repeats = 16, 8, 2
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        result = measure(args, Path(work))
    s = result["seconds"]
    print(f"{args.size_mib} MiB in {args.tensors} tensors, medians of {args.repeats}:")
    for name, value in s.items():
        wrote = result["written_bytes"].get(name)
        extra = f", wrote {wrote:,.0f} bytes (no chunk)" if wrote is not None else ""
        print(f"  {name:<38} {1000 * value:9.1f} ms{extra}")
    goals = result["goals"].items()
    print("  goals:", ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {**vars(args), "dir": None, "json": args.json.name}
        args.json.write_text(json.dumps({"args": settings, **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
