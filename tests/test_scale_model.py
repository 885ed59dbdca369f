"""benchmarks/_scale_model.py's CPU rows come from bench_metadata_scale.py's results.

The table at 1,000 and 10,000 ranks (docs/SCALE.md) is printed by
benchmarks/bench_tiers_scale.py; its CPU rows must be the figures the metadata
benchmark wrote, not typed in, and a results file without a row near a
reference rank count must say so rather than borrow a far one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import _scale_model as model  # noqa: E402  (benchmarks/ is not a package)


def row(ranks: int, coordinator: float, planning: float) -> dict:
    seconds = {"coordinator": coordinator, "restore planning (one rank)": planning}
    return {"layout": "fsdp", "ranks": ranks, "tensors": 1024, "extrapolated": False,
            "seconds": seconds}  # fmt: skip


def test_the_cpu_rows_are_the_nearest_measured_rows(tmp_path: Path) -> None:
    results = tmp_path / "metadata-scale.json"
    other = dict(row(1024, 9.0, 9.0), layout="tp")  # another layout: never taken
    rows = [row(128, 0.5, 0.6), row(1024, 5.25, 6.5), other, row(10000, 93.0, 89.0)]
    results.write_text(json.dumps({"rows": rows}))
    table = model.cpu_rows([1000, 10000], results)
    coordinator, planning, dcp = table.values()
    assert coordinator == ["5.2 (at 1,024 ranks)", "93.0"]
    assert planning == ["6.5 (at 1,024 ranks)", "89.0"]
    assert dcp == ["200+ (reported at 1,024 ranks)", "not reported"]


def test_the_repositorys_results_give_both_reference_columns() -> None:
    saved = json.loads(model.METADATA_SCALE.read_text())["rows"]
    at_10k = next(r for r in saved if r["layout"] == "fsdp" and r["ranks"] == 10000)
    table = model.cpu_rows([1000, 10000])
    assert list(table.values())[0][1].startswith(f"{at_10k['seconds']['coordinator']:,.1f}")


def test_broken_control_no_row_near_a_reference_is_refused(tmp_path: Path) -> None:
    results = tmp_path / "metadata-scale.json"
    results.write_text(json.dumps({"rows": [row(128, 0.5, 0.6), row(1024, 5.2, 6.0)]}))
    with pytest.raises(ValueError, match="near 10,000 ranks .* --ranks 10000"):
        model.cpu_rows([1000, 10000], results)
