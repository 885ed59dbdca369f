"""benchmarks/bench_lineage.py stays runnable: its ``--small`` run branches a generation,
times the peers beside it and records the goals (no timing asserted here: the measured
figures are in docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
from pathlib import Path

from bench_runner import run_bench

REPO = Path(__file__).resolve().parent.parent


def test_small_run_branches_and_writes_its_record(tmp_path: Path) -> None:
    out = tmp_path / "lineage.json"
    done = run_bench("bench_lineage.py", "--small", "--dir", str(tmp_path), "--json", str(out))
    record = json.loads(out.read_text())
    assert {"castore branch", "castore amend: drop optim", "castore amend: rename every key",
            "castore amend: graft", "castore amend: replace one tensor", "torch.save",
            "torch: load, drop optim, save", "safetensors: load, replace, save",
            "torch: load, graft, save"} <= set(record["seconds"])  # fmt: skip
    assert 0 < record["branch_written_bytes"] < 1 << 20  # manifests and a root, no chunk
    assert record["branch_written_bytes"] < record["logical_bytes"] / 100
    assert record["goals"]["branch, drop, rename and graft write no chunk"] is True
    replaced = record["replaced_tensor_bytes"]  # new random values: all of it new
    assert record["new_chunk_bytes"]["castore amend: replace one tensor"] == replaced
    written = record["written_bytes"]
    assert all(0 < b < 1 << 20 for k, b in written.items() if "replace" not in k)
    assert replaced < written["castore amend: replace one tensor"] < replaced + (1 << 20)
    assert "castore branch" in done.stdout and "goals:" in done.stdout
