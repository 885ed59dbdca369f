"""RNG capture: after a round trip through a real store, every stream continues exactly."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import castore
from castore.train import capture_rng, restore_rng


def draws(gen: np.random.Generator) -> list[Any]:
    return [
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        float(np.random.randn()),
        float(gen.standard_normal()),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    ]


@pytest.mark.parametrize("framework", ["numpy", "torch", "auto"])
def test_every_stream_continues_after_a_store_round_trip(tmp_path: Path, framework: str) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    gen = np.random.default_rng(4)
    random.gauss(0, 1)  # leave a cached gaussian in Python's state
    np.random.randn()  # and in numpy's
    with castore.open(tmp_path / "store") as store:
        store.save({"rng": capture_rng({"data": gen})}, run="r", step=1)
        expected = draws(gen)  # what an uninterrupted run draws next
        draws(gen)  # move every stream on, as if training continued
        restore_rng(store.load("r", framework=framework)["rng"], {"data": gen})
    assert draws(gen) == expected


def test_broken_control_without_restore_the_draws_differ(tmp_path: Path) -> None:
    gen = np.random.default_rng(4)
    state = capture_rng({"data": gen})
    expected = draws(gen)
    assert draws(gen) != expected  # the comparison above can fail
    restore_rng(state, {"data": gen})
    assert draws(gen) == expected


def test_a_generator_without_saved_state_is_an_error() -> None:
    state = capture_rng()
    with pytest.raises(KeyError, match="data"):
        restore_rng(state, {"data": np.random.default_rng(0)})


def test_cuda_state_needs_the_same_device_count() -> None:
    state = capture_rng()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * (torch.cuda.device_count() + 1)
    with pytest.raises(RuntimeError, match="CUDA generators"):
        restore_rng(state)
