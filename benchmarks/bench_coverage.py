"""The coverage check every publish and restore runs, fast against quadratic (issue 40, item 1).

Run from the repository root::

    .venv/bin/python benchmarks/bench_coverage.py [--repeats 5] [--quadratic-max 4096]
                                                  [--small] [--json [OUT]]

One process pinned to one core, numpy's threads off. The check is
``castore.core.reading.check_coverage`` (castore/format/coverage.py); the
quadratic one it replaced, every pair of boxes compared, is
``castore.testing.coverage.quadratic_check_coverage``. The tensor entries are
built before anything is timed (their construction is reported, not timed
with the check). Cases:

(a) one tensor of R row boxes (FSDP's row shards), R = 64, 1,024, 4,096,
    16,384; the quadratic check beside it up to ``--quadratic-max`` boxes
    (one run above 1,024: 4,096 boxes take it a minute or more). Beside
    them, the fast check on a 64 x 64 grid of blocks (2-D, tensor parallel
    inside FSDP) and on 4,096 bricks, 64 rows each cut at other columns (a
    grid of their cuts would have 64 cells a box: the sweep answers).
(b) a job: 1,024 ranks x 1,024 tensors, each tensor in row shards, about a
    million boxes; the coordinator's loop (``check_coverage`` per tensor, as
    ``castore.core.commit.check_shards`` runs it). Beside it, what reading
    the same boxes' fields costs with no check at all (the per-box Python a
    check over ``TensorEntry`` objects cannot avoid), and ``group_entries``
    over the 1,024 shard manifests (the step before the check; issue 40's
    item 2).

Medians of ``--repeats`` runs. ``--small`` (the smoke test): 256 row boxes
at most, 16 x 16 blocks and bricks (few enough for the grid), a job of 64 x
64. ``--json`` writes every run to ``benchmarks/results/coverage.json`` (or
OUT). The goal (issue 40): the job's check in at most 1 s on one core.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy: one core, no threads

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from castore.core.reading import check_coverage, group_entries  # noqa: E402
from castore.format.objects import ShardManifest, TensorEntry  # noqa: E402
from castore.testing.coverage import quadratic_check_coverage  # noqa: E402

DEFAULT_JSON = "benchmarks/results/coverage.json"
ROWS = (64, 1024, 4096, 16384)
SMALL_ROWS = (64, 256)
JOB = (1024, 1024)  # ranks, tensors
SMALL_JOB = (64, 64)
GOAL_S = 1.0
WHERE = {"run": "bench", "generation": 1}
DIGEST = bytes(32)


def entry(
    name: str, shape: tuple[int, ...], offsets: tuple[int, ...], extents: tuple[int, ...]
) -> TensorEntry:
    """A box of an fp32 tensor in one chunk (the check reads only its box, shape and dtype)."""
    nbytes = 4 * int(np.prod(extents))
    chunks = (DIGEST,) if nbytes else ()
    return TensorEntry.trusted(
        name, "float32", shape, offsets, extents, nbytes, 1 << 22, chunks, "numpy"
    )


def row_boxes(name: str, rows: int, height: int = 4, width: int = 64) -> list[TensorEntry]:
    shape, extents = (rows * height, width), (height, width)
    return [entry(name, shape, (i * height, 0), extents) for i in range(rows)]


def block_boxes(side: int) -> list[TensorEntry]:
    shape = (side * 8, side * 8)
    return [
        entry("blocks", shape, (8 * i, 8 * j), (8, 8)) for i in range(side) for j in range(side)
    ]


def brick_boxes(rows: int, per_row: int) -> list[TensorEntry]:
    """Rows of bricks, each row cut at other columns: a grid of their cuts would have
    about ``rows`` cells per box, so the check sweeps."""
    width = per_row * rows
    boxes = []
    for row in range(rows):
        marks = [0, *range(row + 1, width, rows), width]
        for start, stop in zip(marks[:-1], marks[1:], strict=True):
            boxes.append(entry("bricks", (rows, width), (row, start), (1, stop - start)))
    return boxes


def timed(call: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        gc.collect()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return times


def one_tensor_cases(
    rows: tuple[int, ...], repeats: int, quadratic_max: int
) -> list[dict[str, Any]]:
    cases: list[tuple[str, list[TensorEntry], bool]] = [
        (f"{r:,} row boxes", row_boxes("rows", r), r <= quadratic_max) for r in rows
    ]
    side = 64 if max(rows) >= 4096 else 16
    cases.append((f"{side} x {side} blocks", block_boxes(side), False))
    cases.append((f"{side * side:,} bricks", brick_boxes(side, side), False))
    out = []
    for label, boxes, quadratic in cases:
        fast = timed(lambda b=boxes: check_coverage(b, WHERE), repeats)
        row: dict[str, Any] = {"case": label, "boxes": len(boxes), "fast_s": fast}
        row["fast_median_s"] = statistics.median(fast)
        if quadratic:
            runs = repeats if len(boxes) <= 1024 else 1
            slow = timed(lambda b=boxes: quadratic_check_coverage(b, WHERE), runs)
            row["quadratic_s"] = slow
            row["quadratic_median_s"] = statistics.median(slow)
            row["quadratic_over_fast"] = row["quadratic_median_s"] / row["fast_median_s"]
        out.append(row)
        print(_case_line(row), flush=True)
    return out


def _case_line(row: dict[str, Any]) -> str:
    line = f"  {row['case']:>26}  fast {row['fast_median_s'] * 1e3:9.2f} ms"
    if "quadratic_median_s" in row:
        line += (
            f"   quadratic {row['quadratic_median_s']:8.2f} s"
            f"   quadratic / fast {row['quadratic_over_fast']:>10,.0f}x"
        )
    return line


def job_case(ranks: int, tensors: int, repeats: int) -> dict[str, Any]:
    """Every tensor in row shards over every rank, as the coordinator holds them."""
    started = time.perf_counter()
    per_tensor = [row_boxes(f"layer{t}.weight", ranks) for t in range(tensors)]
    built_s = time.perf_counter() - started
    shards = [
        ShardManifest("bench", 1, rank, tuple(boxes[rank] for boxes in per_tensor))
        for rank in range(ranks)
    ]

    def check_all() -> None:
        for boxes in per_tensor:
            check_coverage(boxes, WHERE)

    def read_fields() -> None:
        for boxes in per_tensor:
            [b.shape for b in boxes].count(boxes[0].shape)
            [b.dtype for b in boxes].count(boxes[0].dtype)
            offsets = [b.offsets for b in boxes]
            extents = [b.local_shape for b in boxes]
            del offsets, extents

    check = timed(check_all, repeats)
    fields = timed(read_fields, repeats)
    grouped = timed(lambda: group_entries(shards, WHERE), max(1, repeats // 2))
    out = {
        "ranks": ranks,
        "tensors": tensors,
        "boxes": ranks * tensors,
        "build_entries_s": built_s,
        "check_s": check,
        "check_median_s": statistics.median(check),
        "read_fields_s": fields,
        "read_fields_median_s": statistics.median(fields),
        "group_entries_s": grouped,
        "group_entries_median_s": statistics.median(grouped),
    }
    out["read_fields_share_of_check"] = out["read_fields_median_s"] / out["check_median_s"]
    return out


def pin_one_core() -> int | None:
    if not hasattr(os, "sched_setaffinity"):
        return None
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return core


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument(
        "--quadratic-max",
        type=int,
        default=4096,
        help="time the quadratic check up to this many boxes",
    )
    parser.add_argument("--small", action="store_true", help="small cases, for the smoke test")
    parser.add_argument(
        "--json", nargs="?", const=DEFAULT_JSON, default=None, help="write results here"
    )
    args = parser.parse_args(argv)
    core = pin_one_core()
    rows, job = (SMALL_ROWS, SMALL_JOB) if args.small else (ROWS, JOB)
    pinned = f"cpu {core}" if core is not None else "unpinned"
    print(f"one core ({pinned}), medians of {args.repeats}")
    print("(a) one tensor")
    cases = one_tensor_cases(rows, args.repeats, min(args.quadratic_max, max(rows)))
    print(f"(b) a job of {job[0]:,} ranks x {job[1]:,} tensors, row shards")
    result = job_case(*job, args.repeats)
    print(
        f"  {result['boxes']:,} boxes: check {result['check_median_s']:.3f} s"
        f" ({result['check_median_s'] / result['boxes'] * 1e9:.0f} ns a box);"
        f" reading their fields alone {result['read_fields_median_s']:.3f} s"
        f" ({result['read_fields_share_of_check']:.0%} of the check);"
        f" group_entries {result['group_entries_median_s']:.3f} s;"
        f" building the entries {result['build_entries_s']:.2f} s (not timed with the check)"
    )
    met = result["check_median_s"] <= GOAL_S
    goal = {
        "goal": f"the check of {result['boxes']:,} boxes in at most {GOAL_S:g} s on one core",
        "measured": f"{result['check_median_s']:.3f} s",
        "met": met,
    }
    print(f"goal: [{'MET' if met else 'NOT MET'}] {goal['goal']}: {goal['measured']}")
    if args.json:
        payload = {
            "machine": {"python": platform.python_version(), "numpy": np.__version__, "core": core},
            "args": vars(args),
            "one_tensor": cases,
            "job": result,
            "goals": [goal],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
