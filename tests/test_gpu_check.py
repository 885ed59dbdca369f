"""tools/gpu_check.py runs: here (no CUDA) it says it skipped; with CUDA every check is ok."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SKIP_LINE = "gpu_check: no CUDA device (torch.cuda.is_available() is False): skipped"


@pytest.mark.slow
def test_gpu_check_skips_in_one_line_without_cuda_and_passes_every_check_with_it() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    if not torch.cuda.is_available():
        assert (done.returncode, done.stdout) == (0, SKIP_LINE + "\n"), done.stderr
        return
    assert done.returncode == 0, done.stdout + done.stderr
    rows = done.stdout.splitlines()[2:]  # after the device line and the header
    assert len(rows) == 5 and all(row.split()[1] == "ok" for row in rows), done.stdout
