"""ResumableDistributedSampler: a drop-in that resumes exactly, or continues across rank counts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from torch.utils.data.distributed import DistributedSampler

import castore
from castore.data import ResumableDistributedSampler, dataset_hash, dataset_hash_of_files

CASES = [
    (n, w, shuffle, drop)
    for n in (12, 13, 7)
    for w in (1, 2, 3, 4)
    for shuffle in (True, False)
    for drop in (False, True)
]


def streams(n: int, world: int, **options: object) -> list[list[int]]:
    return [list(ResumableDistributedSampler(range(n), world, r, **options)) for r in range(world)]


@pytest.mark.parametrize(("n", "world", "shuffle", "drop_last"), CASES)
def test_without_resume_it_is_exactly_torch_distributed_sampler(
    n: int, world: int, shuffle: bool, drop_last: bool
) -> None:
    for epoch in (0, 3):
        for rank in range(world):
            ours = ResumableDistributedSampler(range(n), world, rank, shuffle, 7, drop_last)
            theirs = DistributedSampler(range(n), world, rank, shuffle, 7, drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


@pytest.mark.parametrize(("n", "world", "shuffle", "drop_last"), CASES)
def test_exact_resume_at_the_same_rank_count_yields_the_identical_stream(
    n: int, world: int, shuffle: bool, drop_last: bool
) -> None:
    full = streams(n, world, shuffle=shuffle, seed=3, drop_last=drop_last)
    per_rank = len(full[0])
    for k in range(per_rank + 1):  # every save point, including before and after all
        samplers = [
            ResumableDistributedSampler(range(n), world, r, shuffle, 3, drop_last)
            for r in range(world)
        ]
        iterators = [iter(s) for s in samplers]
        for it in iterators:
            for _ in range(k):
                next(it)
        state = samplers[0].state_dict()
        assert state["consumed_samples"] == k * world
        for rank in range(world):
            resumed = ResumableDistributedSampler(range(n), world, rank, shuffle, 0, drop_last)
            resumed.load_state_dict(state)
            assert list(resumed) == full[rank][k:]


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (4, 3), (3, 2), (2, 1)])
@pytest.mark.parametrize("n", [24, 25])
def test_continuation_on_another_rank_count_uses_every_sample_once(
    before: int, after: int, n: int
) -> None:
    first = [ResumableDistributedSampler(range(n), before, r, seed=11) for r in range(before)]
    iterators = [iter(s) for s in first]
    drawn = [next(it) for _ in range(3) for it in iterators]  # 3 rounds on every rank
    state = first[0].state_dict()
    rest = []
    for rank in range(after):
        sampler = ResumableDistributedSampler(range(n), after, rank, seed=0)
        sampler.load_state_dict(state)
        rest += list(sampler)
    # Every sample of the epoch exactly once, plus only the padding that
    # evenly dividing the remainder over `after` ranks needs (as DistributedSampler pads).
    assert not set(drawn) & set(rest)  # nothing consumed before is served again
    counts = Counter(drawn + rest)
    assert set(counts) == set(range(n))
    padding = sum(counts.values()) - n
    assert 0 <= padding < after
    assert sum(c - 1 for c in counts.values()) == padding


def test_broken_control_a_plain_restart_repeats_samples() -> None:
    """Restarting without the saved position re-serves consumed samples: the check notices."""
    first = ResumableDistributedSampler(range(24), 4, 0, seed=5)
    iterator = iter(first)
    consumed = [next(iterator) for _ in range(3)]
    restarted = list(ResumableDistributedSampler(range(24), 4, 0, seed=5))
    assert set(consumed) & set(restarted)  # a resume without state repeats data


def test_state_is_plain_values_and_round_trips_through_a_store(tmp_path: Path) -> None:
    sampler = ResumableDistributedSampler(range(30), 3, 1, seed=9)
    sampler.set_epoch(2)
    iterator = iter(sampler)
    next(iterator)
    next(iterator)
    with castore.open(tmp_path / "store") as store:
        store.save({"sampler": sampler.state_dict()}, run="r", step=1)
        state = store.load("r")["sampler"]
    assert state == {
        "version": 1,
        "seed": 9,
        "epoch": 2,
        "consumed_samples": 6,
        "num_replicas": 3,
        "dataset_len": 30,
        "shuffle": True,
        "drop_last": False,
    }
    resumed = ResumableDistributedSampler(range(30), 3, 1)
    resumed.load_state_dict(state)
    resumed_stream = list(resumed)
    fresh = ResumableDistributedSampler(range(30), 3, 1, seed=9)
    fresh.set_epoch(2)
    assert resumed_stream == list(fresh)[2:]


def test_set_epoch_starts_the_next_epoch_from_its_beginning() -> None:
    sampler = ResumableDistributedSampler(range(10), 2, 0, seed=1)
    sampler.load_state_dict({**sampler.state_dict(), "consumed_samples": 6})
    assert len(sampler) == 2
    sampler.set_epoch(1)
    assert len(sampler) == 5 and sampler.consumed == 0


def test_caller_can_state_the_true_consumed_count() -> None:
    sampler = ResumableDistributedSampler(range(16), 2, 0)
    list(sampler)  # a prefetching loader drew everything
    assert sampler.state_dict()["consumed_samples"] == 16
    assert sampler.state_dict(consumed_samples=6)["consumed_samples"] == 6


def test_a_different_dataset_is_refused() -> None:
    state = ResumableDistributedSampler(range(10), 2, 0).state_dict()
    with pytest.raises(ValueError, match="dataset of 10 samples"):
        ResumableDistributedSampler(range(11), 2, 0).load_state_dict(state)


def test_dataset_hashes_name_content_and_order(tmp_path: Path) -> None:
    assert dataset_hash(["a", "b"]) == dataset_hash(["a", "b"])
    assert dataset_hash(["a", "b"]) != dataset_hash(["b", "a"])
    assert dataset_hash([1, 2]) != dataset_hash(["1", "2"])
    first, second = tmp_path / "x.bin", tmp_path / "y.bin"
    first.write_bytes(b"one")
    second.write_bytes(b"two")
    before = dataset_hash_of_files([first, second])
    assert before == dataset_hash_of_files([str(first), str(second)])
    second.write_bytes(b"TWO")
    assert dataset_hash_of_files([first, second]) != before
