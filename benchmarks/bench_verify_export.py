"""castore verify-export against hashing the exported files once, same export, same run.

Run from the repository root::

    .venv/bin/python benchmarks/bench_verify_export.py [--size-mib 1024] [--tensors 64]
        [--repeats 5] [--dir DIR] [--json [OUT]] [--small]

One generation of ``--tensors`` float32 tensors (``--size-mib`` in all) is saved
to a local store and exported with ``--statement`` as safetensors files of at most
256 MiB. Then, ``--repeats`` rounds, each in a rotated order, on a warm page cache
(every file read once before the first round):

  sha256 once         hashlib.sha256 over each file, read in 16 MiB blocks: what a
                      checker of the statement's digests (model_signing verify) does
  blake3 once         blake3 (its own thread pool) over each file, the same blocks
  verify-export       castore.verify_export: the sha256 of each file and every
                      saved chunk's blake3 at its place in the file, one read

and the export itself with and without the statement (the sha256 taken as each
file is written). Medians; goal (issue 41): verify-export at most 1.2x sha256 once.
``--json`` writes ``benchmarks/results/verify-export.json`` (or OUT). ``--small``:
16 MiB, 8 tensors, 2 rounds (the test's smoke run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import castore  # noqa: E402
from castore.export import to_safetensors  # noqa: E402
from castore.format.statement import STATEMENT_FILE  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "verify-export.json"
BLOCK = 16 << 20
SHARD = 256 << 20
GOAL = 1.2


def make_state(size_mib: int, tensors: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    per = size_mib * 2**20 // 4 // tensors
    cols = 1024 if per % 1024 == 0 else 1
    return {
        "model": {
            f"layer{i:02d}.weight": rng.standard_normal((per // cols, cols), dtype=np.float32)
            for i in range(tensors)
        }
    }


def hash_files(files: list[Path], make: Callable[[], Any]) -> list[str]:
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    digests = []
    for path in files:
        hasher = make()
        with open(path, "rb", buffering=0) as handle:
            while got := handle.readinto(buffer):
                hasher.update(view[:got])
        digests.append(hasher.hexdigest())
    return digests


def timed(action: Callable[[], Any]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def run(size_mib: int, tensors: int, repeats: int, workdir: Path) -> dict[str, Any]:
    store = castore.open(workdir / "store")
    store.save(make_state(size_mib, tensors), run="bench", step=1)
    out = workdir / "hf"
    to_safetensors(store, "bench", "latest", out, statement=True, max_shard_size=SHARD)
    files = sorted(p for p in out.iterdir() if p.name != STATEMENT_FILE)
    statement = json.loads((out / STATEMENT_FILE).read_text())
    listed = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    names = [f.name for f in files]
    assert dict(zip(names, hash_files(files, hashlib.sha256), strict=True)) == listed
    hash_files(files, blake3.blake3)  # warm the page cache for every method alike
    methods: dict[str, Callable[[], Any]] = {
        "sha256 once": lambda: hash_files(files, hashlib.sha256),
        "blake3 once": lambda: hash_files(files, lambda: blake3.blake3(max_threads=-1)),
        "verify-export": lambda: castore.verify_export(out, store),
    }
    runs: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(repeats):
        names = list(methods)
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            runs[name].append(timed(methods[name]))
    for name, statement_too in (("export", False), ("export --statement", True)):
        runs[name] = []
        target = workdir / "again"
        for _ in range(max(1, repeats // 2)):
            start = time.perf_counter()
            to_safetensors(
                store, "bench", "latest", target, statement=statement_too, max_shard_size=SHARD
            )
            runs[name].append(time.perf_counter() - start)
            shutil.rmtree(target)
    store.close()
    seconds = {name: statistics.median(values) for name, values in runs.items()}
    ratio = seconds["verify-export"] / seconds["sha256 once"]
    return {
        "size_mib": size_mib,
        "tensors": tensors,
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "repeats": repeats,
        "seconds": seconds,
        "runs": runs,
        "ratios": {
            "verify-export / sha256 once": ratio,
            "verify-export / blake3 once": seconds["verify-export"] / seconds["blake3 once"],
            "export --statement / export": seconds["export --statement"] / seconds["export"],
        },
        "goals": {f"verify-export <= {GOAL}x sha256 once": ratio <= GOAL},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: tmp)")
    parser.add_argument("--json", nargs="?", type=Path, const=DEFAULT_JSON, default=None)
    parser.add_argument("--small", action="store_true", help="16 MiB, 8 tensors, 2 rounds")
    args = parser.parse_args(argv)
    if args.small:
        args.size_mib, args.tensors, args.repeats = 16, 8, 2
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        result = run(args.size_mib, args.tensors, args.repeats, Path(scratch))
    print(f"{result['bytes'] / 2**20:.0f} MiB in {result['files']} files, medians of "
          f"{result['repeats']}:")  # fmt: skip
    for name, value in result["seconds"].items():
        print(f"  {name:20} {value:7.3f} s  {result['bytes'] / 2**30 / value:6.2f} GiB/s")
    for name, value in result["ratios"].items():
        print(f"  {name:32} {value:.2f}x")
    goals = result["goals"].items()
    print("  goals:", ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {**vars(args), "dir": None, "json": args.json.name}
        args.json.write_text(json.dumps({"args": settings, **result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
