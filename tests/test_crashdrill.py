"""The crash drill (tools/crashdrill.py), run for real: --quick, and a broken control.

``--quick`` starts real gloo processes at 2 ranks, SIGKILLs one process at each
fault point of the two-phase commit and of garbage collection, and resumes in
fresh processes. Every row must pass: the generation a fresh reader selects is
the expected one, the store verifies deep, and the first resumed update equals
the uninterrupted reference bitwise. On S3 (``--backend s3``, moto), a rank
killed mid-multipart-upload, the coordinator killed on either side of the ref
compare-and-swap and GC killed mid-sweep pass the same checks (the full
matrix, and ``--backend shared``, from the CLI). The control resumes the
weights only, so the drill must notice and exit 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

DRILL = Path(__file__).resolve().parent.parent / "tools" / "crashdrill.py"
UPDATES = 3  # --quick: generations 1..3, the fault hits the save of update 3

# scenario -> (fault point, generation a fresh reader must select)
EXPECTED = {
    "worker_mid_shard": ("dist.worker_mid_shard", UPDATES - 1),
    "coordinator_before_ref_advance": ("dist.coordinator_before_ref_advance", UPDATES - 1),
    "coordinator_after_ref_advance": ("dist.coordinator_after_ref_advance", UPDATES),
    "worker_before_ack": ("dist.worker_before_ack", UPDATES - 1),
    "coordinator_before_root": ("dist.coordinator_before_root", UPDATES - 1),
    "gc_mid_sweep": ("gc.mid_sweep", UPDATES),
    "gc_mid_chunks": ("gc.mid_chunks", UPDATES),
}


# On S3 (moto), the row only the blob backends have and the one that leaves a dead
# collector's store lease behind. `tools/crashdrill.py --backend s3` (and `shared`)
# also runs the coordinator's rows around the ref compare-and-swap; all pass there,
# and the suite keeps to these two for its time (each S3 row costs about 25 s here).
S3_EXPECTED = {
    "worker_mid_multipart": ("blob.mid_multipart", UPDATES - 1),
    "gc_mid_sweep": ("gc.mid_sweep", UPDATES),
}


def _drill(
    tmp_path: Path, *args: str, timeout: float = 300
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "drill.json"
    done = subprocess.run(
        [sys.executable, str(DRILL), "--quick", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), done.stdout + done.stderr
    return done, json.loads(out.read_text())


def test_quick_drill_passes_every_scenario(tmp_path: Path) -> None:
    done, report = _drill(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["scenario"]: row for row in report["rows"]}
    assert set(rows) == set(EXPECTED)
    for name, (point, generation) in EXPECTED.items():
        row = rows[name]
        assert row["passed"], (name, row["failures"])
        assert row["point"] == point
        assert row["exit_code"] == -9, name  # the armed process died by SIGKILL
        assert row["selected"] == generation, name
        assert row["resumed_generation"] == generation, name
        assert row["verify"], name
        assert row["all_listed_load"], name
        assert row["resumed_equal"], name
        assert row["recovery_seconds"] > 0, name
    assert rows["coordinator_after_ref_advance"]["garbage_left"] == {"objects": 0, "chunks": 0}
    for line in ("PASS", "RESULT: 7/7 scenarios pass"):
        assert line in done.stdout


def test_quick_drill_on_s3_passes_the_blob_rows(tmp_path: Path) -> None:
    pytest.importorskip("moto.server")
    scenarios = ",".join(S3_EXPECTED)
    done, report = _drill(tmp_path, "--backend", "s3", "--scenarios", scenarios, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["config"]["backend"] == "s3"
    rows = {row["scenario"]: row for row in report["rows"]}
    assert list(rows) == list(S3_EXPECTED)
    for name, (point, generation) in S3_EXPECTED.items():
        row = rows[name]
        assert row["passed"], (name, row["failures"])
        assert row["point"] == point
        assert row["exit_code"] == -9, name
        assert row["selected"] == row["resumed_generation"] == generation, name
        assert row["verify"] and row["all_listed_load"] and row["resumed_equal"], name
    # The killed rank left its pack's multipart upload begun, never completed.
    assert "multipart upload(s) left incomplete" in rows["worker_mid_multipart"]["evidence"]
    assert "RESULT: 2/2 scenarios pass" in done.stdout


def test_blob_only_rows_are_refused_on_other_backends(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(DRILL), "--backend", "shared", "--scenarios", "worker_mid_multipart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "apply to --backend s3 only" in done.stderr


def test_broken_control_fails_the_drill(tmp_path: Path) -> None:
    done, report = _drill(
        tmp_path, "--scenarios", "coordinator_after_ref_advance", "--control", "skip-optimizer"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    (row,) = report["rows"]
    # The crash and the reader are as in the real drill; only the resume is wrong.
    assert row["selected"] == UPDATES and row["verify"]
    assert not row["resumed_equal"]
    assert not row["passed"]
    assert any("differs from the reference" in f for f in row["failures"])
    assert "FAIL" in done.stdout
