"""ResumableDistributedSampler on its own, outside any process group."""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler

from castore.data import ResumableDistributedSampler


def test_a_sampler_outside_a_process_group_is_one_replica() -> None:
    assert not torch.distributed.is_initialized()
    sampler = ResumableDistributedSampler(range(10), seed=3)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    theirs = DistributedSampler(range(10), num_replicas=1, rank=0, seed=3)
    assert list(sampler) == list(theirs)
    other = ResumableDistributedSampler(range(10), num_replicas=2)  # rank defaults to 0
    assert (other.num_replicas, other.rank) == (2, 0)
