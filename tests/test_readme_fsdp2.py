"""README's FSDP2 script, run as its reader would: torchrun at 2 ranks, then at 3.

The script (the README block that starts ``# train_fsdp2.py``) trains a
``fully_shard`` model 10 updates per launch, saving every 5 through
TrainState. Its second launch, on 3 ranks, must resume after update 10 as a
continuation and save updates 15 and 20; each generation's data-order record
names the world size that wrote it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import castore

pytestmark = [pytest.mark.slow]

README = Path(__file__).resolve().parents[1] / "README.md"


def script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if b.startswith("# train_fsdp2.py")]
    assert len(found) == 1, "README has one train_fsdp2.py block"
    return found[0]


def torchrun(workdir: Path, ranks: int) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={ranks}", "train_fsdp2.py"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_readme_fsdp2_script_trains_at_2_ranks_and_resumes_at_3(tmp_path: Path) -> None:
    (tmp_path / "train_fsdp2.py").write_text(script())
    first = torchrun(tmp_path, 2)
    assert "resumed" not in first
    second = torchrun(tmp_path, 3)
    # The ranks' lines may reach torchrun's stdout interleaved: found, not split.
    lines = sorted(re.findall(r"rank \d+: resumed \(\w+\) after update \d+", second))
    assert lines == [f"rank {r}: resumed (continuation) after update 10" for r in range(3)], second
    with castore.open(tmp_path / "ckpt-fsdp2") as store:
        generations = store.generations("fsdp2")
        assert [g.step for g in generations] == [5, 10, 15, 20]
        assert [g.data_order["world_size"] for g in generations] == [2, 2, 3, 3]
        # One process reads the 3 ranks' shards back whole: every tensor of the model.
        model = store.load("fsdp2", framework="torch")["model"]
    assert {name: tuple(t.shape) for name, t in model.items()} == {
        "0.weight": (64, 8), "0.bias": (64,), "2.weight": (1, 64), "2.bias": (1,),
    }  # fmt: skip
