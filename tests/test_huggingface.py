"""castore as a Hugging Face ``Trainer`` callback, with the real package training a tiny GPT-2 on CPU.

Skipped only when the ``transformers`` extra is not installed (``make test`` installs it).
"""

from __future__ import annotations

import filecmp
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
torch = pytest.importorskip("torch")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import castore  # noqa: E402
from castore.errors import (  # noqa: E402
    GenerationNotFoundError,
    ImportSourceError,
    UnsupportedValueError,
)
from castore.gc import RetentionPolicy, collect_garbage  # noqa: E402
from castore.integrations.checkpoint_dirs import MARKER  # noqa: E402
from castore.integrations.huggingface import CastoreCallback, restore_checkpoint  # noqa: E402

pytestmark = pytest.mark.xdist_group("huggingface")

RUN = "hf-trainer"
WORKERS = Path(__file__).resolve().parent / "hf_workers.py"
# 32 samples, 4 a batch, 2 epochs: 16 steps, a checkpoint every 4.
STEPS = [4, 8, 12, 16]


class Tokens(torch.utils.data.Dataset):  # type: ignore[misc]
    """32 fixed sequences of 16 tokens; each is its own label (a language model's task)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 64, (32, 16), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.x[index], "labels": self.x[index]}


def train(
    output_dir: Path,
    callbacks: list[Any],
    resume: str | None = None,
    optimizer: Any = None,
    **options: Any,
) -> Any:
    """Train the tiny GPT-2 (2 layers, width 32, dropout on: its RNG matters) and return
    the Trainer; ``options`` override the TrainingArguments below."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    arguments = {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "per_device_train_batch_size": 4,
        "num_train_epochs": 2,
        "save_steps": 4,
        "report_to": "none",
        "logging_steps": 100,
        "seed": 0,
        "disable_tqdm": True,
        **options,
    }
    optimizers = (optimizer(model.parameters()) if optimizer else None, None)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**arguments),
        train_dataset=Tokens(),
        callbacks=callbacks,
        optimizers=optimizers,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def weights(trainer: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in trainer.model.state_dict().items()}


def assert_same_weights(got: Any, want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].tobytes() == value.tobytes(), name


def checkpoint_dirs(output_dir: Path) -> list[str]:
    """The ``checkpoint-STEP`` directories in ``output_dir``, oldest first."""
    return sorted((p.name for p in output_dir.glob("checkpoint-*")), key=lambda n: int(n[11:]))


def assert_same_checkpoint(restored: Path, written: Path) -> None:
    """Every file the Trainer wrote (but training_args.bin) is there, byte for byte."""
    want = sorted(p.name for p in written.iterdir() if p.name != "training_args.bin")
    got = sorted(p.name for p in restored.iterdir() if p.name != MARKER)
    assert got == want
    for name in want:
        assert filecmp.cmp(restored / name, written / name, shallow=False), name


@dataclass(frozen=True)
class Reference:
    """An uninterrupted run with the callback: its final weights, its store, its directories."""

    weights: dict[str, np.ndarray]
    store: Path
    output_dir: Path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    root = tmp_path_factory.mktemp("reference")
    trainer = train(root / "out", [CastoreCallback(root / "store", run=RUN)])
    return Reference(weights(trainer), root / "store", root / "out")


def test_every_checkpoint_comes_back_byte_for_byte(reference: Reference, tmp_path: Path) -> None:
    assert checkpoint_dirs(reference.output_dir) == [f"checkpoint-{s}" for s in STEPS]
    with castore.open(reference.store) as store:
        generations = store.generations(RUN)
        assert [g.step for g in generations] == STEPS
        assert store.refs.tags(RUN).keys() == {f"checkpoint-{s}" for s in STEPS}
        for generation in generations:
            path = restore_checkpoint(store, tmp_path / "out", run=RUN, generation=generation.id)
            assert path == str(tmp_path / "out" / f"checkpoint-{generation.step}")
            assert_same_checkpoint(Path(path), reference.output_dir / Path(path).name)
            assert (Path(path) / MARKER).is_file()


def test_a_restored_checkpoint_is_left_alone_and_a_partial_one_replaced(
    reference: Reference, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    written = reference.output_dir / "checkpoint-16"
    path = Path(restore_checkpoint(reference.store, out, run=RUN))  # latest: step 16
    assert path == out / "checkpoint-16"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.iterdir()}
    assert restore_checkpoint(reference.store, out, run=RUN) == str(path)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.iterdir()} == before

    # A checkpoint the Trainer had begun to write when it was killed: a truncated
    # optimizer.pt and no marker. Restoring the same step replaces it whole.
    shutil.rmtree(path)
    shutil.copytree(written, path)
    with (path / "optimizer.pt").open("r+b") as handle:
        handle.truncate(100)
    assert restore_checkpoint(reference.store, out, run=RUN) == str(path)
    assert_same_checkpoint(path, written)
    assert (path / MARKER).is_file()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-16"]  # no temporary left
