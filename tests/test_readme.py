"""Every ```python and ```sh block of README.md and docs/*.md runs as written.

The blocks of one file run in order, in one fresh process (forked from the
suite's zygote, which imported torch once: castore.testing.zygote; a fresh
interpreter where there is none), in an empty directory, sharing one namespace
(sh blocks run with bash, ``set -e``, with ``castore`` and the commands this
interpreter's environment installed, such as ``model_signing``, on PATH). Names a block
uses but does not define (``state``, ``weights``, ``dataset``,
``ddp_model``...) come from PRELUDE below, never from editing the document. The
process is a gloo group of one, so the multi-rank examples run their collective
code paths. A block that cannot run here is skipped only by an HTML comment
right before its fence, visible in the raw file:
``<!-- readme-test: skip (why) -->``.

A ``castore.train.DataCursorWarning`` is an error here: the training example
must count its examples correctly.

A document that names ``s3://`` stores gets what a job on S3 has: moto's S3
server on the loopback (tests/helpers/s3_server.py), ``AWS_ENDPOINT_URL`` and dummy
credentials in the environment, and the bucket ``my-bucket`` (S3_BUCKET)
created. Without boto3 and moto (the ``dev`` extra) such a document is skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from castore.testing.zygote import TORCH_PRELOAD, ZygoteMismatch
from castore.testing.zygote import shared as shared_zygote

try:
    import s3_server
except pytest.skip.Exception:  # boto3 or moto missing
    s3_server = None  # type: ignore[assignment]

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = {"python", "sh", "console"}
S3_BUCKET = "my-bucket"  # the bucket the documents' s3:// examples name
SKIP = re.compile(r"<!-- readme-test: skip \((?P<why>[^)]+)\) -->")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")

# Stand-ins for what a real job has at hand; the documents use them as given.
PRELUDE = """
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

torch.manual_seed(0)
_rng = np.random.default_rng(0)
state = {
    "model": {
        "embed.weight": _rng.standard_normal((256, 64)).astype(np.float32),
        "head.bias": np.zeros(64, dtype=np.float32),
    },
    "optimizer": {"lr": 1e-3, "betas": (0.9, 0.999)},
    "epoch": 1,
}
weights = {"embed.weight": torch.randn(1024, 256), "head.weight": torch.randn(1024, 256)}
state_dict = {"w": torch.randn(16, 16), "epoch": 1}
sample_ids = [f"sample-{i}" for i in range(400)]
dataset = TensorDataset(torch.randn(400, 8), torch.randn(400, 1))
b, epochs = 4, 2  # 2 epochs of 100 microbatches: 100 updates, one save
ddp_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)
scaler = torch.amp.GradScaler("cpu")
rng = np.random.default_rng(1)
loss_fn = nn.functional.mse_loss
"""

# Runs in the child: the group of one, warnings as errors, then each block.
RUNNER = """
import os, subprocess, sys, warnings
sys.path[0] = ""  # the working directory first, as for python -c, also when run as a file
import torch.distributed as dist
from castore.train import DataCursorWarning

warnings.simplefilter("error", DataCursorWarning)
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("pg"), rank=0, world_size=1)
namespace = {"__name__": "__readme__"}
exec(compile(sys.argv[1], "<prelude>", "exec"), namespace)
for path, line, lang, source in eval(sys.argv[2]):
    print(f"--- {path}:{line} ({lang})", flush=True)
    if lang == "python":
        # Padded so that a traceback names the document's own line numbers.
        exec(compile("\\n" * line + source, path, "exec"), namespace)
    else:
        subprocess.run(
            ["bash", "-euo", "pipefail", "-c", source], check=True, stdin=subprocess.DEVNULL
        )
dist.destroy_process_group()
print("--- all blocks ran", flush=True)
"""


@dataclass(frozen=True)
class Block:
    path: str
    line: int  # the fence's line (1-based); the code starts on the next line
    lang: str
    source: str
    skip: str | None


def blocks(document: Path) -> list[Block]:
    """The fenced code blocks of a document, with their skip reason if marked."""
    lines = document.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marked = SKIP.fullmatch(before.strip())
        found.append(
            Block(
                document.name if document.parent == REPO else f"docs/{document.name}",
                index + 1,
                opening["lang"],
                "\n".join(lines[index + 1 : end]) + "\n",
                marked["why"] if marked else None,
            )
        )
        index = end + 1
    return found


def castore_command(bin_dir: Path) -> None:
    """A ``castore`` command that runs this checkout's castore, with this interpreter."""
    bin_dir.mkdir()
    script = bin_dir / "castore"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m castore.cli "$@"\n')
    script.chmod(0o755)


def s3_environment(request: pytest.FixtureRequest) -> dict[str, str]:
    """The variables that point boto3 at the test server, whose S3_BUCKET exists."""
    if s3_server is None:
        pytest.skip("the document's s3:// examples need boto3 and moto (the dev extra)")
    endpoint = request.getfixturevalue("s3_endpoint")
    client = s3_server.s3_client(endpoint)
    if S3_BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=S3_BUCKET)
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": s3_server.DUMMY_KEY,
        "AWS_SECRET_ACCESS_KEY": s3_server.DUMMY_SECRET,
        "AWS_DEFAULT_REGION": s3_server.REGION,
    }


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_code_block_runs_as_written(
    document: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    found = blocks(document)
    runnable = [b for b in found if b.lang in RUNNABLE and b.skip is None]
    stray = [b for b in found if b.skip is not None and b.lang not in RUNNABLE]
    assert not stray, f"skip markers on blocks that would not run anyway: {stray}"
    if not runnable:
        pytest.skip(f"{document.name}: every code block is marked skip or is not code")
    castore_command(tmp_path / "bin")
    work = tmp_path / "work"
    work.mkdir()
    uses_s3 = any("s3://" in b.source for b in runnable)
    env = {
        **{k: v for k, v in os.environ.items() if not (uses_s3 and k == "AWS_PROFILE")},
        **(s3_environment(request) if uses_s3 else {}),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join(
            [str(tmp_path / "bin"), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
        ),
    }
    listed = repr([(b.path, b.line, b.lang, b.source) for b in runnable])
    code, stdout, stderr = run_runner(tmp_path, work, env, [PRELUDE, listed], timeout=120)
    assert code == 0 and "--- all blocks ran" in stdout, f"{stdout[-3000:]}\n{stderr[-5000:]}"


def run_runner(
    tmp_path: Path, work: Path, env: dict[str, str], args: list[str], *, timeout: float
) -> tuple[int, str, str]:
    """``python RUNNER ARGS...`` in ``work``: its exit status, stdout and stderr.

    Forked from the zygote where there is one: importing torch (PRELUDE) is
    most of a document's CPU time otherwise.
    """
    script, out, err = tmp_path / "runner.py", tmp_path / "stdout", tmp_path / "stderr"
    script.write_text(RUNNER)
    zygote = shared_zygote(TORCH_PRELOAD, env)
    if zygote is not None:
        try:
            child = zygote.fork([str(script), *args], env=env, cwd=work, stdout=out, stderr=err)
        except ZygoteMismatch:
            pass
        else:
            try:
                code = child.wait(timeout)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            return code, out.read_text(), err.read_text()
    done = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout, done.stderr


def test_skip_markers_say_why_and_stay_few() -> None:
    skipped = [b for document in DOCUMENTS for b in blocks(document) if b.skip is not None]
    for block in skipped:
        assert block.skip and block.skip.strip(), block
    readme = [b for b in skipped if b.path == "README.md"]
    assert len(readme) <= 2, [f"{b.path}:{b.line} ({b.skip})" for b in readme]


def test_the_extractor_finds_a_marked_block(tmp_path: Path) -> None:
    doc = tmp_path / "X.md"
    doc.write_text(
        "text\n\n<!-- readme-test: skip (needs 4 ranks) -->\n```python\nx = 1\n```\n"
        "```sh\necho hi\n```\n"
    )
    first, second = blocks(doc)
    assert (first.lang, first.line, first.source, first.skip) == (
        "python",
        4,
        "x = 1\n",
        "needs 4 ranks",
    )
    assert (second.lang, second.skip, second.source) == ("sh", None, "echo hi\n")
