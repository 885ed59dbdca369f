"""`make demo-tiers` (tools/demo_tiers.py), run for real with fewer steps.

Four gloo ranks on two simulated nodes save every step through tiers; node 1's
fast directory is deleted and fresh ranks resume: with two copies from the
peer node (not a byte from the durable tier), with one copy from the durable
tier (the steps after it redone, their losses bitwise the lost job's). The
script checks every restored block against what was saved and exits non-zero
otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import castore

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import demo_tiers  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("demo_tiers")]


def test_the_demo_resumes_from_the_peer_then_from_the_durable_tier(tmp_path: Path) -> None:
    where = tmp_path / "demo-tiers"
    done = subprocess.run(
        [sys.executable, str(TOOLS / "demo_tiers.py"), "--dir", str(where), "--steps", "4"]
        + ["--more-steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "restored generation 4 (step 4), the newest save" in out
    assert "0 bytes from the durable tier" in out
    assert "restored generation 3 (step 3), the newest in the durable tier" in out
    assert "step 4 was redone, losses bitwise the lost job's: yes" in out
    assert out.count("bitwise equal") == 2 * demo_tiers.RANKS  # every rank, both runs
    assert "all checks held" in out
    # Resuming from the durable tier's older generation: the newer ones were the lost
    # job's own, published before the resume, so no other writer is warned of.
    assert "ConcurrentWriterWarning" not in out, out
    # The replacement node 1 took part in the save after the resume, on both runs.
    for replicas, newest in (("replicas2", 5), ("replicas1", 5)):
        with castore.open(where / replicas / "node1", create=False) as fast:
            assert fast.resolve(demo_tiers.RUN).id == newest


def test_the_demo_leaves_a_directory_it_did_not_make_alone(tmp_path: Path) -> None:
    other = tmp_path / "demo-tiers"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert demo_tiers.main(["--dir", str(other)]) == 1
    assert (other / "notes.txt").read_text() == "mine"
