"""A resumable drop-in for ``torch.utils.data.DistributedSampler``.

The sampler's position is one number: how many samples of the current epoch
the whole job has consumed. With the same rank count, seed and dataset, a
resumed sampler yields exactly the stream the uninterrupted one would have
("exact" resume). With another rank count it continues the same epoch order
from the global position, so every remaining sample of the epoch is used once
across the new ranks ("continuation").
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from castore.format.hashing import digest_bytes

STATE_VERSION = 1


@dataclass(frozen=True)
class SamplerPass:
    """What one rank's sampler handed out at one position (epoch, start) before it moved on.

    ``yielded`` counts every index handed out there, over every iterator;
    ``exhausted`` says an iterator reached the end of this rank's share.
    """

    epoch: int
    start: int
    yielded: int
    exhausted: bool


class ResumableDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    """``DistributedSampler`` with ``state_dict()`` / ``load_state_dict()``.

    Without a resume it yields exactly what ``DistributedSampler`` yields. The
    position counts samples handed out by every rank in lock-step (synchronous
    data parallelism): after each rank drew ``k`` samples, the job consumed
    ``k * num_replicas``. A DataLoader that prefetches draws ahead of the
    training loop: pass the true count to :meth:`state_dict` then.

    Without ``num_replicas``/``rank`` and outside an initialized process group
    it is the whole job: one replica, rank 0 (torch's own sampler refuses).
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            # A single process saves "alone" (docs/TRAINING.md): be the one replica it is.
            num_replicas = 1 if num_replicas is None else num_replicas
            rank = 0 if rank is None else rank
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self.start = 0  # global samples of this epoch consumed before this iteration
        self.drawn = 0  # samples this rank has handed out in this iteration
        # Since the position was last set, over every iterator: TrainState checks
        # the examples it was told about against these (see SamplerPass).
        self.yielded = 0
        self.exhausted = False
        self.last_pass: SamplerPass | None = None  # the position set_epoch moved away from
        self.resumed_from: int | None = None  # the rank count that consumed `start`
        self._resume_pending = False  # a loaded position not yet iterated from

    @property
    def _dataset_len(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # a sized dataset, as in torch

    # -- order ------------------------------------------------------------

    def epoch_order(self) -> list[int]:
        """The epoch's global sample order, before padding or truncation."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(self._dataset_len, generator=generator).tolist()
        return list(range(self._dataset_len))

    def _fit(self, indices: list[int], world: int) -> list[int]:
        """Pad (by wrapping) or truncate to a multiple of ``world``, as DistributedSampler does."""
        if not indices:
            return []
        if self.drop_last:
            return indices[: len(indices) - len(indices) % world]
        padding = -len(indices) % world
        return indices + (indices * math.ceil(padding / len(indices)))[:padding]

    def _remaining(self) -> list[int]:
        order = self.epoch_order()
        if self.resumed_from in (None, self.num_replicas):
            # Same rank count: slice the very sequence the original ranks drew from.
            return self._fit(order, self.num_replicas)[self.start :]
        # Another rank count: continue the epoch order from the global position.
        return self._fit(order[self.start :], self.num_replicas)

    @property
    def epoch_size(self) -> int:
        """Samples the whole job draws in this epoch (padding included), resumed part too."""
        n = self._dataset_len

        def fitted(count: int) -> int:
            if count <= 0:
                return 0
            if self.drop_last:
                return count - count % self.num_replicas
            return count + (-count % self.num_replicas)

        if self.resumed_from in (None, self.num_replicas):
            return fitted(n)
        return self.start + fitted(n - self.start)

    def __iter__(self) -> Iterator[int]:
        mine = self._remaining()[self.rank :: self.num_replicas]
        self.drawn = 0
        self._resume_pending = False
        for index in mine:
            self.drawn += 1
            self.yielded += 1
            yield index
        self.exhausted = True

    def __len__(self) -> int:
        return len(self._remaining()[self.rank :: self.num_replicas])

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning.

        A position just loaded for this same epoch is kept, so the usual loop
        ``for epoch in range(sampler.epoch, n): sampler.set_epoch(epoch); ...``
        resumes where the checkpoint left off; any other epoch drops it.
        """
        if self._resume_pending and epoch == self.epoch:
            return
        self._resume_pending = False
        self.last_pass = SamplerPass(self.epoch, self.start, self.yielded, self.exhausted)
        super().set_epoch(epoch)
        self.start = 0
        self.drawn = 0
        self.resumed_from = None
        self._reset_pass()

    def _reset_pass(self) -> None:
        self.yielded = 0
        self.exhausted = False

    # -- state ------------------------------------------------------------

    @property
    def consumed(self) -> int:
        """Samples of this epoch the whole job has consumed, as far as this rank knows."""
        return self.start + self.drawn * self.num_replicas

    def state_dict(self, consumed_samples: int | None = None) -> dict[str, Any]:
        """Seed, epoch and the global consumed count (msgpack-friendly, no pickle)."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed_samples": self.consumed if consumed_samples is None else consumed_samples,
            "num_replicas": self.num_replicas,
            "dataset_len": self._dataset_len,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position (same or different rank count)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown sampler state version {state.get('version')!r}")
        if state["dataset_len"] != self._dataset_len:
            raise ValueError(
                f"sampler state is for a dataset of {state['dataset_len']} samples, "
                f"this one has {self._dataset_len}"
            )
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"consumed_samples must not be negative, got {consumed}")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.shuffle = bool(state["shuffle"])
        self.drop_last = bool(state["drop_last"])
        self.start = consumed
        self.drawn = 0
        self.resumed_from = int(state["num_replicas"])
        self._resume_pending = True
        self.last_pass = None  # a loaded position replaces the pass; nothing finished
        self._reset_pass()


def dataset_hash(samples: Iterable[str | int | bytes]) -> str:
    """A digest naming a dataset by its ordered sample ids."""
    items = [s if isinstance(s, (str, int, bytes)) else str(s) for s in samples]
    return digest_bytes(msgpack.packb(["castore-dataset-ids", items], use_bin_type=True)).hex()


def dataset_hash_of_files(paths: Iterable[str | os.PathLike[str]]) -> str:
    """A digest naming a dataset by its files' names, sizes and contents, in order."""
    described = []
    for path in map(Path, paths):
        data = path.read_bytes()
        described.append([path.name, len(data), digest_bytes(data)])
    return digest_bytes(
        msgpack.packb(["castore-dataset-files", described], use_bin_type=True)
    ).hex()
