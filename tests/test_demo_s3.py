"""`make demo-s3` (tools/demo_s3.py), run for real with --quick.

The demo starts its own moto S3 server, saves from 4 real gloo ranks to
s3://demo/ckpt, restores onto 2 and checks every element, then copies a local
store's generation into S3 and loads it back bit for bit. Its broken control,
``--tamper`` (the reference altered after the save: the demo reports "1 DIFFER"
and exits 1), was run once when the demo was written; it is not repeated here,
to keep the suite's time (each run starts 7 processes that import torch).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto.server")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "tools" / "demo_s3.py"


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, str(DEMO), "--quick", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_demo_saves_restores_and_copies_through_s3() -> None:
    done = _demo()
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "4 ranks saved generation 2" in out
    assert out.count(": all equal") == 2  # both restoring ranks
    assert "copied 1 generation(s)" in out
    assert "every tensor and value matches what was saved, bit for bit" in out
    assert "dist-demo" in out and "FAILED" not in out
