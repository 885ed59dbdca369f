"""benchmarks/bench_verify_export.py stays runnable: its ``--small`` run exports with a
statement, times verify-export beside hashing the files once and records the goal (no
timing asserted here: the measured figures are in docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
from pathlib import Path

from bench_runner import run_bench

REPO = Path(__file__).resolve().parent.parent


def test_small_run_verifies_and_writes_its_record(tmp_path: Path) -> None:
    out = tmp_path / "verify-export.json"
    done = run_bench(
        "bench_verify_export.py", "--small", "--dir", str(tmp_path), "--json", str(out)
    )
    record = json.loads(out.read_text())
    assert set(record["seconds"]) == {
        "sha256 once", "blake3 once", "verify-export", "export", "export --statement"
    }  # fmt: skip
    assert all(len(runs) >= 1 for runs in record["runs"].values())
    assert record["bytes"] >= 16 << 20 and record["files"] >= 1
    assert list(record["goals"]) == ["verify-export <= 1.2x sha256 once"]
    assert record["args"]["dir"] is None  # no machine path in the record
    assert "verify-export" in done.stdout and "goals:" in done.stdout
