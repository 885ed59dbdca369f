"""Optimizer state keyed by parameter name survives a reordered optimizer; by position not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import castore
from castore.train import load_optimizer_state_by_name, optimizer_state_by_name


def model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    return model, torch.randn(8, 6), torch.randn(8, 3)


def step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def resumed_params(tmp_path: Path, *, by_name: bool) -> list[torch.Tensor]:
    model, x, y = model_and_data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(3):
        step(model, optimizer, x, y)
    with castore.open(tmp_path / "store") as store:
        store.save(
            {
                "model": model.state_dict(),
                "optim": optimizer_state_by_name(model, optimizer),
                "optim_by_position": optimizer.state_dict(),
            },
            run="r",
            step=3,
        )
        saved = store.load("r", framework="torch")
    # A fresh process builds its optimizer with the parameters in another order.
    fresh, _, _ = model_and_data()
    fresh.load_state_dict(saved["model"])
    reordered = torch.optim.AdamW(list(fresh.parameters())[::-1], lr=0.05)
    if by_name:
        load_optimizer_state_by_name(fresh, reordered, saved["optim"])
    else:
        reordered.load_state_dict(saved["optim_by_position"])
    step(fresh, reordered, x, y)
    return [p.detach().clone() for p in fresh.parameters()]


def reference_params() -> list[torch.Tensor]:
    model, x, y = model_and_data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(4):
        step(model, optimizer, x, y)
    return [p.detach().clone() for p in model.parameters()]


def test_by_name_resume_matches_the_uninterrupted_run_bitwise(tmp_path: Path) -> None:
    got, want = resumed_params(tmp_path, by_name=True), reference_params()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_broken_control_by_position_resume_goes_wrong(tmp_path: Path) -> None:
    # Positional state puts each moment on another parameter: here shapes clash.
    with pytest.raises(RuntimeError, match="size of tensor"):
        resumed_params(tmp_path, by_name=False)


def test_state_names_every_trained_parameter() -> None:
    model, x, y = model_and_data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    step(model, optimizer, x, y)
    state = optimizer_state_by_name(model, optimizer)
    names = [name for name, _ in model.named_parameters()]
    assert sorted(state["state"]) == sorted(names)
    assert state["param_groups"][0]["params"] == names
    assert state["param_groups"][0]["lr"] == 0.05
