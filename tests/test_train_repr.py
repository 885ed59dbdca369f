"""What castore.train's results print as: a line a person reads in a notebook."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import castore
from castore.train import TrainState, load_weights


def test_load_weights_result_prints_as_one_short_line(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with castore.open(tmp_path / "store") as store:
        state = TrainState(model)
        state.update = 12  # as if 12 optimizer updates were done
        saved = state.save(store, run="r")
        fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        loaded = load_weights(store, "r", fresh)
    text = repr(loaded)
    assert text == (
        f"<castore.train.WeightsLoaded r@1 step 12 root {saved.root[:12]}: 4 tensor(s) loaded>"
    )
    assert str(loaded) == text  # print() shows the same line
    assert "\n" not in text and text.count("r@1") == 1
    pairs = zip(model.parameters(), fresh.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_partial_load_says_how_many_names_were_missing_and_unexpected(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with castore.open(tmp_path / "store") as store:
        state = TrainState(model)
        state.update = 3
        saved = state.save(store, run="r")
        other_head = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 5))
        loaded = load_weights(store, "r", other_head, strict=False)
    assert repr(loaded) == (
        f"<castore.train.WeightsLoaded r@1 step 3 root {saved.root[:12]}: "
        "4 tensor(s) loaded, 2 missing, 0 unexpected>"
    )
