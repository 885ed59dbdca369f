"""What the chunk grid costs a same-layout save and load, beside castore before it.

Run from the repository root, with a checkout of castore before the grid::

    git worktree add /tmp/castore-before 170dda6   # main before issue 38's wiring
    .venv/bin/python benchmarks/bench_grid_cost.py --baseline /tmp/castore-before \\
        [--repeats 3] [--rounds 2] [--json [OUT]]

Three states of fp32 random values, each saved by one process into a new
store on ``/dev/shm`` (memory, so the figures are castore's own work, not a
disk's): 16 tensors of 32 MiB, 64 of 8 MiB, 512 of 1 MiB, 2,000 of 128 KiB.
For each: a full save, a re-save with 10% of the tensors changed, one with 1% changed
(default options: every byte hashed), and a load of the whole state. Each
figure is the median of ``--repeats`` runs in one process; the process runs
once per castore per round, the two castores alternating, ``--rounds`` times
(these machines are noisy; a ratio compares runs of the same round). The
baseline runs the same script with its own castore first on ``sys.path``.

Prints, per state and operation, grid / before as the median ratio over the
rounds, and the chunk counts of a full save. Issue 38's goals: a full save at
least 0.95x of castore before the grid (time ratio at most 1/0.95), re-saves
no slower, and today's chunk count per tensor within 1.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = "benchmarks/results/grid-cost.json"
STATES = {"16 x 32 MiB": (16, (2048, 4096)), "64 x 8 MiB": (64, (2048, 1024)),
          "512 x 1 MiB": (512, (512, 512)), "2,000 x 128 KiB": (2000, (128, 256))}  # fmt: skip
OPERATIONS = ("full", "10%", "1%", "load")


def measure(repeats: int) -> dict[str, Any]:
    """The medians of this process's castore (whatever ``import castore`` finds)."""
    import numpy as np

    import castore

    out: dict[str, Any] = {}
    for label, (count, shape) in STATES.items():
        rng = np.random.default_rng(0)
        state = {f"t{i}": rng.standard_normal(shape, dtype=np.float32) for i in range(count)}
        keys = list(state)
        times: dict[str, list[float]] = {op: [] for op in OPERATIONS}
        chunks = 0
        for _ in range(repeats):
            scratch = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            try:
                with castore.open(os.path.join(scratch, "s")) as store:
                    started = time.perf_counter()
                    gen = store.save(state, run="r", step=1)
                    times["full"].append(time.perf_counter() - started)
                    chunks = gen.stats.new_chunks
                    for step, (op, share) in enumerate((("10%", 10), ("1%", 100)), start=2):
                        changed = {k: state[k] + step for k in keys[: max(1, count // share)]}
                        started = time.perf_counter()
                        store.save({**state, **changed}, run="r", step=step)
                        times[op].append(time.perf_counter() - started)
                    started = time.perf_counter()
                    store.load(run="r", generation=1)
                    times["load"].append(time.perf_counter() - started)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        out[label] = {op: statistics.median(v) for op, v in times.items()}
        out[label]["chunks"] = chunks
        out[label]["tensors"] = count
    return out


def run_one(castore_dir: Path | None, repeats: int) -> dict[str, Any]:
    env = dict(os.environ)
    if castore_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(castore_dir), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--repeats", str(repeats)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # not the repository: the baseline must win the import
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of castore before the grid")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", nargs="?", const=DEFAULT_JSON, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats)))
        return
    if args.baseline is None or not (args.baseline / "castore" / "__init__.py").is_file():
        parser.error("--baseline must be a checkout of castore (a folder holding castore/)")
    grid_dir = HERE.parent
    rounds = []
    for _ in range(args.rounds):
        rounds.append({"before": run_one(args.baseline, args.repeats),
                       "grid": run_one(grid_dir, args.repeats)})  # fmt: skip
    from tabulate import tabulate

    rows = []
    for label in STATES:
        row: dict[str, Any] = {"state": label}
        for op in OPERATIONS:
            ratios = [r["grid"][label][op] / r["before"][label][op] for r in rounds]
            row[op] = statistics.median(ratios)
        before = rounds[-1]["before"][label]
        grid = rounds[-1]["grid"][label]
        row["chunks per tensor"] = (
            f"{grid['chunks'] / grid['tensors']:.0f} / {before['chunks'] / before['tensors']:.0f}"
        )
        row["full s (before)"] = statistics.median(r["before"][label]["full"] for r in rounds)
        rows.append(row)
    print(tabulate(rows, headers="keys", floatfmt=".2f"))
    print("(grid / before: time ratios, medians over rounds; chunks: grid / before)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args) | {"baseline": str(args.baseline)},
                    "rounds": rounds,
                    "ratios": rows,
                },
                indent=1,
                default=str,
            )  # fmt: skip
            + "\n"
        )


if __name__ == "__main__":
    main()
