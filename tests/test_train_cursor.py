"""The data cursor counts examples, not batch tuples, and is checked against the sampler.

``microbatch_done(len(batch))`` on an ``(x, y)`` batch counts 2 per microbatch;
the saved cursor then under-counts and a resume trains on seen samples again.
These tests run in one process without torch.distributed (a group of one).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import castore
from castore.data import ResumableDistributedSampler, dataset_hash
from castore.train import DataCursorWarning, TrainState, examples_in

SAMPLES = 32
BATCH = 4


def ids_dataset() -> TensorDataset:
    """Each sample carries its own id, so a test can see which samples were trained."""
    ids = torch.arange(SAMPLES)
    return TensorDataset(ids.float().unsqueeze(1), ids)


def rig(seed: int = 7) -> tuple[ResumableDistributedSampler, DataLoader[Any], TrainState]:
    dataset = ids_dataset()
    sampler = ResumableDistributedSampler(dataset, seed=seed)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator())
    state = TrainState(nn.Linear(1, 1), sampler=sampler, dataset_hash=dataset_hash(range(SAMPLES)))
    return sampler, loader, state


# -- counting a batch --------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "count"),
    [
        (5, 5),
        (np.int64(3), 3),
        (torch.zeros(6, 2), 6),
        (np.zeros((4, 3)), 4),
        ((torch.zeros(4, 3), torch.zeros(4)), 4),
        ([torch.zeros(2, 3), torch.zeros(2)], 2),
        ({"x": torch.zeros(3, 8), "y": torch.zeros(3), "ids": ["a", "b", "c"]}, 3),
        ((torch.zeros(5, 1), {"mask": torch.ones(5, 7)}), 5),
    ],
)
def test_examples_in_counts_the_leading_dimension(batch: Any, count: int) -> None:
    assert examples_in(batch) == count


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ((torch.zeros(4, 3), torch.zeros(5)), r"disagree.*batch\[0\]: 4, batch\[1\]: 5"),
        ({"ids": ["a", "b"]}, "holds no tensor"),
        ("abc", "holds no tensor"),
        ((torch.zeros(4, 3), torch.tensor(1.0)), r"batch\[1\] is a 0-d tensor"),
        (-1, "must not be negative"),
        (True, "holds no tensor"),
    ],
)
def test_examples_in_refuses_what_it_cannot_count(batch: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        examples_in(batch)


def test_microbatch_done_takes_the_batch_itself() -> None:
    sampler, loader, state = rig()
    for batch in loader:
        state.microbatch_done(batch)  # an (x, ids) tuple: counts 4, not 2
        state.update_done()
        break
    assert state._cursor.epoch_examples == BATCH


# -- the cursor checked against the sampler ---------------------------------------------


def test_counting_more_than_the_sampler_handed_out_is_refused() -> None:
    sampler, loader, state = rig()
    batches = iter(loader)
    next(batches)  # the sampler handed out 4 examples to this rank
    with pytest.raises(ValueError, match="would count 8 examples of epoch 0 .* only 4"):
        state.microbatch_done(2 * BATCH)  # e.g. a global batch of 2 ranks
    assert state.microbatch == 0  # nothing was counted


def run_epoch(state: TrainState, loader: DataLoader[Any], count: Any) -> None:
    for batch in loader:
        state.microbatch_done(count(batch))
        state.update_done()


def test_an_epoch_counted_short_warns_at_the_next_epoch() -> None:
    sampler, loader, state = rig()
    sampler.set_epoch(0)
    run_epoch(state, loader, len)  # the README's old bug: len((x, ids)) == 2
    sampler.set_epoch(1)
    with pytest.warns(DataCursorWarning, match="16 examples counted .* handed out 32"):
        next_batch = next(iter(loader))
        state.microbatch_done(next_batch)


def test_an_epoch_counted_in_full_does_not_warn() -> None:
    sampler, loader, state = rig()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DataCursorWarning)
            run_epoch(state, loader, lambda batch: batch)


def test_a_loader_that_drops_its_last_partial_batch_does_not_warn() -> None:
    dataset = TensorDataset(torch.zeros(30, 1))
    sampler = ResumableDistributedSampler(dataset, seed=1)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)
    state = TrainState(nn.Linear(1, 1), sampler=sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataCursorWarning)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            run_epoch(state, loader, lambda batch: batch)


def trained_ids(store_path: Path, count: Any) -> tuple[list[int], list[int]]:
    """Ids trained before a mid-epoch save, and by a run resumed from it."""
    sampler, loader, state = rig()
    seen: list[int] = []
    with castore.open(store_path) as store:
        for batch in loader:
            seen += batch[1].tolist()
            state.microbatch_done(count(batch))
            state.update_done()
            if len(seen) == 3 * BATCH:
                state.save(store, run="r")
                break
        sampler2, loader2, resumed = rig()
        resumed.load(store, run="r")
    return seen, [i for batch in loader2 for i in batch[1].tolist()]


def test_a_resume_after_counting_batches_trains_each_sample_once(tmp_path: Path) -> None:
    seen, after = trained_ids(tmp_path / "a", lambda batch: batch)
    assert sorted(seen + after) == list(range(SAMPLES))


def test_broken_control_counting_tuples_retrains_seen_samples(tmp_path: Path) -> None:
    # What the README's old loop did: the resume repeats samples it already trained on.
    seen, after = trained_ids(tmp_path / "b", len)
    assert set(seen) & set(after)
