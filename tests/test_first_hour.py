"""Rough edges a new user meets in the first hour: each error says what and where."""

from __future__ import annotations

from pathlib import Path

import pytest

import castore
from castore.errors import GenerationNotFoundError


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
