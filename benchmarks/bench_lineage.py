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
from castore.format.objects import encode_object  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "lineage.json"


def build_state(size_mib: int, tensors: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    per = (size_mib << 20) // tensors // 4
    rows = max(per // 1024, 1)
    return {
        f"layers.{t}.weight": rng.standard_normal((rows, 1024), dtype=np.float32)
        for t in range(tensors)
    }


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def fsynced(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from safetensors.numpy import save_file

    state = build_state(args.size_mib, args.tensors)
    nbytes = sum(a.nbytes for a in state.values())
    store_path = work / "store"
    with castore.open(store_path) as store:
        base = store.save(state, run="base", step=100)
        branch_s, written, grown = [], [], []
        for i in range(args.repeats):
            before = disk_bytes(store_path)
            started = time.perf_counter()
            made = castore.branch(store, "base", base.id, f"ft-{i}")
            branch_s.append(time.perf_counter() - started)
            _, root = store.resolve_root(made.run)
            written.append(made.stats.written_bytes + len(encode_object(root)))
            grown.append(disk_bytes(store_path) - before)
        loaded = store.load(run=f"ft-{args.repeats - 1}")
        assert all(loaded[k].tobytes() == v.tobytes() for k, v in state.items())
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    torch_s, safe_s = [], []
    for i in range(args.repeats):
        out = work / f"copy-{i}.pt"
        started = time.perf_counter()
        torch.save(tensors, out)
        fsynced(out)
        torch_s.append(time.perf_counter() - started)
        out.unlink()
        out = work / f"copy-{i}.safetensors"
        started = time.perf_counter()
        save_file(state, str(out))
        fsynced(out)
        safe_s.append(time.perf_counter() - started)
        out.unlink()
    branch, torch_t, safe_t = (statistics.median(x) for x in (branch_s, torch_s, safe_s))
    return {
        "size_mib": args.size_mib,
        "tensors": args.tensors,
        "logical_bytes": nbytes,
        "repeats": args.repeats,
        "seconds": {"castore branch": branch, "torch.save": torch_t, "safetensors": safe_t},
        "runs": {"castore branch": branch_s, "torch.save": torch_s, "safetensors": safe_s},
        "branch_written_bytes": statistics.median(written),
        "branch_disk_growth_bytes": statistics.median(grown),
        "ratios_to_branch": {"torch.save": torch_t / branch, "safetensors": safe_t / branch},
        "goals": {
            "branch under 50 ms": branch < 0.050,
            "branch writes under 1 MiB": statistics.median(written) < 1 << 20,
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
    wrote, grew = result["branch_written_bytes"], result["branch_disk_growth_bytes"]
    print(f"  castore branch  {1000 * s['castore branch']:8.1f} ms, wrote {wrote:,.0f} bytes "
          f"(disk +{grew:,.0f})")  # fmt: skip
    for peer in ("torch.save", "safetensors"):
        ratio = result["ratios_to_branch"][peer]
        print(f"  {peer:<15} {1000 * s[peer]:8.1f} ms ({ratio:.0f}x the branch)")
    goals = result["goals"].items()
    print("  goals:", ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {**vars(args), "dir": None, "json": args.json.name}
        args.json.write_text(json.dumps({"args": settings, **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
