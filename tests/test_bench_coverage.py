"""benchmarks/bench_coverage.py stays runnable: its ``--small`` run, and its layouts.

No timings are asserted (docs/PERFORMANCE.md "The coverage check" has the
measured figures): the run must finish, time the fast check on every case
and the quadratic one beside it, and record the job and its goal. The
layouts it times must be valid tilings, or it would time a refusal: each is
held to the quadratic check, and a damaged one is refused (the broken control).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bench_runner import run_bench

from castore.errors import CoverageError
from castore.format.objects import TensorEntry
from castore.testing.coverage import quadratic_check_coverage

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_coverage  # noqa: E402  (benchmarks/ is not a package)


def test_small_run_times_every_case_and_writes_its_record(tmp_path: Path) -> None:
    out = tmp_path / "coverage.json"
    done = run_bench("bench_coverage.py", "--small", "--repeats", "2", "--json", str(out))
    record = json.loads(out.read_text())
    cases = {row["case"]: row for row in record["one_tensor"]}
    assert list(cases) == ["64 row boxes", "256 row boxes", "16 x 16 blocks", "256 bricks"]
    for row in cases.values():
        assert len(row["fast_s"]) == 2 and row["fast_median_s"] > 0
    assert cases["256 row boxes"]["quadratic_over_fast"] > 0
    job = record["job"]
    assert job["boxes"] == 64 * 64 and job["check_median_s"] > 0
    assert record["goals"][0]["met"] is True  # 4,096 boxes: far inside the second
    assert "goal: [MET]" in done.stdout


@pytest.mark.parametrize(
    "boxes",
    [
        bench_coverage.row_boxes("rows", 16),
        bench_coverage.block_boxes(4),
        bench_coverage.brick_boxes(8, 4),
    ],
    ids=["rows", "blocks", "bricks"],
)
def test_the_layouts_timed_are_tilings_and_a_damaged_one_is_refused(
    boxes: list[TensorEntry],
) -> None:
    quadratic_check_coverage(boxes, bench_coverage.WHERE)
    last = boxes[-1]
    moved = bench_coverage.entry(
        last.name, last.shape, (last.offsets[0] - 1, *last.offsets[1:]), last.local_shape
    )
    with pytest.raises(CoverageError, match="overlap"):
        quadratic_check_coverage([*boxes[:-1], moved], bench_coverage.WHERE)
