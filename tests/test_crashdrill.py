"""The crash drill (tools/crashdrill.py), run for real: --quick, and a broken control.

``--quick`` starts real gloo processes at 2 ranks, SIGKILLs one process at each
fault point of the two-phase commit and of garbage collection, and of async
saves (``blocking=False``) while training runs on, and resumes in fresh
processes. Every row must pass: the generation a fresh reader selects is the
expected one, the store verifies deep, and the first resumed update equals
the uninterrupted reference bitwise; an async save that publishes while
training runs on resumes bitwise too. On S3 (``--backend s3``, moto), a rank
killed mid-multipart-upload, the coordinator killed on either side of the ref
compare-and-swap and GC killed mid-sweep pass the same checks (the full
matrix, and ``--backend shared``, from the CLI). The control resumes the
weights only, so the drill must notice and exit 1, on a blocking and an
async row.
"""

from __future__ import annotations

import importlib.util
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
    "async_mid_snapshot": ("async.mid_snapshot", UPDATES - 1),
    "async_mid_write": ("async.mid_write", UPDATES - 1),
    "async_acked_before_publish": ("dist.coordinator_before_ref_advance", UPDATES - 1),
}
# The async save of U publishes while training runs on: nothing is killed.
ASYNC_PUBLISHED = "async_published"


# On S3 (moto), the row only the blob backends have and the one that leaves a dead
# collector's store lease behind. `tools/crashdrill.py --backend s3` (and `shared`)
# also runs the coordinator's rows around the ref compare-and-swap; all pass there,
# and the suite keeps to these two for its time (each S3 row costs 7 to 15 s here).
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


# The quick drill's rows in two halves, each one run of the tool (with its own
# reference run): the suite's workers (pytest-xdist) take one each.
HALVES = {
    "commit": [
        "worker_mid_shard",
        "coordinator_before_ref_advance",
        "coordinator_after_ref_advance",
        "worker_before_ack",
        "coordinator_before_root",
    ],
    "gc-and-async": [
        "gc_mid_sweep",
        "gc_mid_chunks",
        "async_mid_snapshot",
        "async_mid_write",
        "async_acked_before_publish",
        ASYNC_PUBLISHED,
    ],
}


def test_the_halves_are_every_scenario_of_the_quick_drill() -> None:
    """A row added to the drill is added to a half, or this fails."""
    spec = importlib.util.spec_from_file_location("crashdrill_rows", DRILL)
    assert spec is not None and spec.loader is not None
    drill = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = drill  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(drill)
    finally:
        del sys.modules[spec.name]
    every = drill.parse_args(["--quick"]).scenarios  # what --quick runs with no --scenarios
    halves = [name for half in HALVES.values() for name in half]
    assert sorted(halves) == sorted(every) == sorted({*EXPECTED, ASYNC_PUBLISHED})


@pytest.mark.parametrize("half", list(HALVES))
def test_quick_drill_passes_every_scenario(tmp_path: Path, half: str) -> None:
    names = HALVES[half]
    done, report = _drill(tmp_path, "--scenarios", ",".join(names), timeout=480)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["scenario"]: row for row in report["rows"]}
    assert set(rows) == set(names)
    for name, (point, generation) in EXPECTED.items():
        if name not in rows:
            continue
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
    if "coordinator_after_ref_advance" in rows:
        garbage = rows["coordinator_after_ref_advance"]["garbage_left"]
        assert garbage == {"objects": 0, "chunks": 0}
    for line in ("PASS", f"RESULT: {len(rows)}/{len(rows)} scenarios pass"):
        assert line in done.stdout
    if half != "gc-and-async":
        return
    # Async: the snapshot died on the training thread before the save call
    # returned; the write and the publish died on the writer thread once training
    # had run on, and the survivor learnt it from result().
    assert "MainThread died staging" in rows["async_mid_snapshot"]["evidence"]
    for name in ("async_mid_write", "async_acked_before_publish"):
        assert "writer thread died" in rows[name]["evidence"], name
        assert "1 microbatch trained on" in rows[name]["evidence"], name
        assert "via result()" in rows[name]["survivors"], name
    assert "B durable" in rows["async_mid_write"]["evidence"]  # some, not all (checked)
    published = rows[ASYNC_PUBLISHED]
    assert published["passed"], published["failures"]
    assert published["exit_code"] == 0  # every rank exits cleanly after its async saves
    assert published["selected"] == published["resumed_generation"] == UPDATES
    assert published["verify"] and published["all_listed_load"] and published["resumed_equal"]
    assert "result() gave [3]" in published["evidence"]


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


def test_quick_drill_passes_with_compression_on(tmp_path: Path) -> None:
    """Chunks stored as frames (castore.format.codec) through a kill mid-shard, mid-write of
    an async save and mid-collection: the same selection, deep verify and bitwise resume."""
    names = ["worker_mid_shard", "async_mid_write", "gc_mid_chunks"]
    done, report = _drill(
        tmp_path, "--codec", "auto", "--scenarios", ",".join(names), timeout=480
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["config"]["codec"] == "auto"
    rows = {row["scenario"]: row for row in report["rows"]}
    assert list(rows) == names
    for name in names:
        row = rows[name]
        assert row["passed"], (name, row["failures"])
        assert row["exit_code"] == -9, name
        assert row["selected"] == row["resumed_generation"] == EXPECTED[name][1], name
        assert row["verify"] and row["all_listed_load"] and row["resumed_equal"], name


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
    scenarios = f"coordinator_after_ref_advance,{ASYNC_PUBLISHED}"
    done, report = _drill(tmp_path, "--scenarios", scenarios, "--control", "skip-optimizer")
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(report["rows"]) == 2
    for row in report["rows"]:
        # The crash and the reader are as in the real drill; only the resume is wrong.
        assert row["selected"] == UPDATES and row["verify"], row["scenario"]
        assert not row["resumed_equal"], row["scenario"]
        assert not row["passed"], row["scenario"]
        assert [f for f in row["failures"] if "differs from the reference" in f] == row[
            "failures"
        ], row["scenario"]
    assert "FAIL" in done.stdout
