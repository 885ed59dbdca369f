"""The Makefile's set-up: the first ``make demo`` or ``make test`` says what it installs.

The set-up recipes run for real, with ``make``, against a stand-in for Python
that records each call instead of creating a virtual environment or running pip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A stand-in python3: `-m venv DIR` makes DIR/bin/python (itself); anything else is recorded.
FAKE_PYTHON = """#!/bin/sh
echo "RAN python $*"
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
fi
"""

# Each pip step, and words the line printed before it must hold.
ANNOUNCED = {
    "-m pip install --quiet torch==2.13.0": ["installing torch==2.13.0", "CPU build", "MB"],
    "-m pip install --quiet -e .[torch,dev,lightning,transformers,accelerate,signing]": [
        "installing castore",
        "dev tools",
        "transformers",
    ],
    "-m pip install --quiet -e .[torch,dev,bench]": ["installing the bench extra"],
    "-m pip install --quiet -e .[torch,dev,cadence]": ["installing the cadence extra"],
}


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_each_pip_step_is_announced_before_it_runs(tmp_path: Path) -> None:
    python = tmp_path / "python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    venv = tmp_path / "venv"
    targets = [f"{venv}/.installed", f"{venv}/.installed-bench", f"{venv}/.installed-cadence"]
    done = subprocess.run(
        ["make", "-C", str(REPO), f"VENV={venv}", f"PYTHON={python}", *targets],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if not line.startswith("make")]
    ran = [i for i, line in enumerate(lines) if line.startswith("RAN python -m pip")]
    assert sorted(lines[i].removeprefix("RAN python ") for i in ran) == sorted(ANNOUNCED)
    for at in ran:
        words = ANNOUNCED[lines[at].removeprefix("RAN python ")]
        # make prints the pip command, then pip (here its stand-in) runs: the
        # announcement is the line before the command, printed once (an @echo).
        said = lines[at - 2]
        assert all(word in said for word in words), (said, lines)
        assert " -m pip install " in lines[at - 1] and not lines[at - 1].startswith("echo")
        assert sum(line == said for line in lines) == 1, lines
    assert not [line for line in lines if line.startswith("echo ")]  # @echo: said once, not twice
    first_said = next(
        i for i, line in enumerate(lines) if "creating the virtual environment" in line
    )
    assert first_said < ran[0]
