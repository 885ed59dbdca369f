"""The root's data-order record: given by the saver, stored as plain msgpack."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import castore
from castore.errors import UnsupportedValueError


def test_a_data_order_record_round_trips_through_the_root(tmp_path: Path) -> None:
    record = {
        "dataset_hash": "ab" * 32,
        "seed": 7,
        "epoch": 2,
        "consumed_samples": 96,
        "shuffle": True,
        "components": ["model", "sampler"],
        "note": None,
    }
    with castore.open(tmp_path / "store") as store:
        saved = store.save({"w": np.ones(3)}, run="r", step=1, data_order=record)
        assert saved.data_order == record
        assert store.resolve("r").data_order == record
        assert store.save({"w": np.ones(3)}, run="r", step=2).data_order == {}


@pytest.mark.parametrize(
    "record",
    [{1: "int key"}, {"value": object()}, {"value": {2, 3}}, ["not", "a", "map"]],
    ids=["int-key", "object", "set", "list"],
)
def test_a_data_order_record_that_is_not_plain_is_refused_and_nothing_is_published(
    tmp_path: Path, record: object
) -> None:
    with castore.open(tmp_path / "store") as store:
        store.save({"w": np.ones(3)}, run="r", step=1)
        with pytest.raises(UnsupportedValueError, match="data_order"):
            store.save({"w": np.zeros(3)}, run="r", step=2, data_order=record)  # type: ignore[arg-type]
        assert [g.step for g in store.generations("r")] == [1]
