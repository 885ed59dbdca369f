"""Run a benchmark's small mode from tests: ``run_bench("bench_x.py", "--small", ...)``.

The script runs from the repository root with this checkout first on PYTHONPATH, as
``.venv/bin/python benchmarks/bench_x.py`` would; a failure shows the tails of its
output. Returns the finished process (its stdout is the benchmark's summary).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
