"""Rough edges a new user meets in the first hour: each error says what and where."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import castore
import castore.dist
from castore import Store
from castore.errors import GenerationNotFoundError, UnsupportedValueError


def test_loading_from_a_store_open_just_created_says_it_is_empty(tmp_path: Path) -> None:
    typo = tmp_path / "typo"
    with castore.open(typo) as store, pytest.raises(GenerationNotFoundError) as caught:
        store.load("exp1")
    message = str(caught.value)
    assert f"store at {typo} is empty" in message
    assert "create=False" in message
    with castore.open(typo) as store, pytest.raises(GenerationNotFoundError, match="is empty"):
        store.load("exp1", fallback="previous")  # the fallback's own path


def test_a_missing_run_in_a_store_with_runs_is_not_called_empty(tmp_path: Path) -> None:
    with castore.open(tmp_path / "s") as store:
        store.save({"x": 1}, run="exp1", step=1)
        with pytest.raises(GenerationNotFoundError) as caught:
            store.load("exp2")
    assert "empty" not in str(caught.value)
    assert "'exp2' has no generations" in str(caught.value)


def test_opening_without_create_refuses_a_missing_store(tmp_path: Path) -> None:
    with pytest.raises(castore.errors.StoreNotFoundError):
        castore.open(tmp_path / "typo", create=False)
    assert not (tmp_path / "typo").exists()


# -- values a state may hold ---------------------------------------------------------


def test_a_meta_tensor_is_refused_naming_its_key_path(store: Store) -> None:
    with pytest.raises(UnsupportedValueError, match="at model/w is on the meta device"):
        store.save({"model": {"w": torch.empty(4, device="meta")}}, run="r", step=1)
    assert store.runs() == []


def test_a_quantized_tensor_is_refused_as_quantized_not_as_a_layout(store: Store) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantize_per_tensor
        quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(UnsupportedValueError) as caught:
        store.save({"q": {"w": quantized}}, run="r", step=1)
    message = str(caught.value)
    assert "tensor at q/w is quantized" in message
    assert "dequantize first" in message
    assert "dense" not in message


def test_a_sparse_tensor_is_refused_naming_its_layout(store: Store) -> None:
    with pytest.raises(UnsupportedValueError, match=r"at s has layout torch.sparse_coo.*dense"):
        store.save({"s": torch.eye(3).to_sparse()}, run="r", step=1)


def test_numpy_text_scalars_are_stored_as_plain_text(store: Store) -> None:
    state = {"name": np.str_("hi"), "tag": np.bytes_(b"\x00yo"), "n": np.float32(1.5)}
    store.save(state, run="r", step=1)
    loaded = store.load("r")
    assert loaded == {"name": "hi", "tag": b"\x00yo", "n": np.float32(1.5)}
    assert type(loaded["name"]) is str  # a numpy text scalar comes back as plain text
    assert type(loaded["tag"]) is bytes
    assert type(loaded["n"]) is np.float32  # numeric numpy scalars keep their type
