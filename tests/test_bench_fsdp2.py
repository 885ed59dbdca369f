"""benchmarks/bench_fsdp2.py stays runnable: its ``--small`` run on real gloo ranks.

No timings are asserted (docs/PERFORMANCE.md "FSDP2 state against DCP" has the
measured figures): the run must finish, check every load it times, and record
each operation for castore and its peers; its frozen re-save must write about
the unfrozen tenth. The checks the run relies on are shown to catch a wrong
value (the broken controls).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from bench_runner import run_bench

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import _fsdp2_ranks  # noqa: E402  (benchmarks/ is not a package)
import bench_fsdp2  # noqa: E402

pytestmark = pytest.mark.slow


def test_small_run_checks_every_load_and_records_each_system(tmp_path: Path) -> None:
    out = tmp_path / "fsdp2.json"
    done = run_bench(
        "bench_fsdp2.py", "--small", "--warm-only", "--dir", str(tmp_path), "--json", str(out),
        timeout=600,
    )
    assert "checked once: every load, restore and re-save equals what was saved" in done.stdout
    record = json.loads(out.read_text())
    peers = ["dcp", "tc"] if record["torch_checkpointing"]["available"] else ["dcp"]
    if not record["torch_checkpointing"]["available"]:
        assert "not importable" in record["torch_checkpointing"]["why"]
    operations = [r["operation"] for r in record["results"]]
    assert operations == ["save", "load (warm)", "restore 2->3 (warm)", "frozen re-save"]
    for row in record["results"]:
        for system in ["castore", *peers]:
            assert row[system]["median_s"] > 0, (row["operation"], system)
    frozen = record["frozen_resave_bytes"]
    assert 0.05 < frozen["castore_new_over_state"] <= bench_fsdp2.FROZEN_GOAL
    assert frozen["dcp_on_disk_over_state"] >= 1.0  # DCP writes the whole state again
    assert [goal["met"] for goal in record["goals"]][1] is True
    assert list(tmp_path.iterdir()) == [out]  # the scratch folder is gone


def test_a_block_one_element_off_is_named() -> None:
    """The 2-rank check (local blocks) and the 3-rank one (full values' digests)."""
    saved = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optim": {"step": torch.tensor(1.0)}}
    loaded = _fsdp2_ranks.snapshot(saved)
    assert _fsdp2_ranks.differing(loaded, saved) == []
    assert _fsdp2_ranks.full_digests(loaded) == _fsdp2_ranks.full_digests(saved)

    loaded["model"]["w"][1, 2] += 1  # broken control: one element off
    assert _fsdp2_ranks.differing(loaded, saved) == ["/model/w"]
    digests = _fsdp2_ranks.full_digests(loaded)
    assert [p for p, d in digests.items() if d != _fsdp2_ranks.full_digests(saved)[p]] == [
        "/model/w"
    ]
    with pytest.raises(AssertionError, match=r"rank 1 loaded wrong values in \['/model/w'\]"):
        bench_fsdp2.check([{"bad": []}, {"bad": ["/model/w"]}], "castore load")


def test_nan_filled_targets_are_not_the_saved_state() -> None:
    """A load that writes nothing leaves the NaN fill, which the check names."""
    saved = {"model": {"w": torch.ones(2, 2)}}
    targets = _fsdp2_ranks.snapshot(saved)
    _fsdp2_ranks.fill_nan(targets)
    assert _fsdp2_ranks.differing(targets, saved) == ["/model/w"]
