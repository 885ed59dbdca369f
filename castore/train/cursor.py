"""The data cursor: examples counted per microbatch, checked against the sampler.

A rank's loop reports each microbatch's examples (:func:`examples_in` counts a
batch); :class:`DataCursor` keeps that count per epoch of a
:class:`~castore.data.ResumableDistributedSampler` and refuses or warns when it
cannot be this rank's examples. :func:`sampler_position` turns a generation's
data-order record back into the sampler's state.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from castore.data import ResumableDistributedSampler
from castore.errors import DataCursorWarning


def examples_in(batch: Any) -> int:
    """The number of examples in ``batch``, as :meth:`TrainState.microbatch_done` counts them.

    A non-negative int is the count; a tensor or array has its leading
    dimension; a tuple, list or dict (nested too) the leading dimension its
    tensors share, other values in it (strings, ids) aside. Anything else, no
    tensor, a 0-d tensor, or tensors that disagree is a ``ValueError``.
    """
    if isinstance(batch, (int, np.integer)) and not isinstance(batch, (bool, np.bool_)):
        if batch < 0:
            raise ValueError(f"examples must not be negative, got {batch}")
        return int(batch)
    sizes: dict[str, int] = {}
    _leading_dims(batch, "batch", sizes)
    if not sizes:
        raise ValueError(
            f"cannot count the examples of a {type(batch).__name__}: it holds no tensor or "
            "array; pass the number of examples instead"
        )
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{path}: {size}" for path, size in sizes.items())
        raise ValueError(
            f"the batch's tensors disagree on the number of examples ({listed}); pass the "
            "number of examples instead"
        )
    return next(iter(sizes.values()))


def _leading_dims(value: Any, path: str, sizes: dict[str, int]) -> None:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            raise ValueError(
                f"{path} is a 0-d tensor: it has no leading dimension to count examples "
                "by; pass the number of examples instead"
            )
        sizes[path] = int(value.shape[0])
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _leading_dims(item, f"{path}[{key!r}]", sizes)
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _leading_dims(item, f"{path}[{index}]", sizes)


class DataCursor:
    """This rank's examples counted since its sampler's start, per pass over the data.

    ``epoch_examples`` is what the loop reported since the sampler's start (a
    new epoch or a loaded position restarts it), ``update_start`` its value
    when the unfinished update began. Without a sampler only the counts are
    kept; nothing is checked.
    """

    def __init__(self, sampler: ResumableDistributedSampler | None) -> None:
        self.sampler = sampler
        self.epoch_examples = 0
        self.largest_microbatch = 0  # since the sampler's start (see _check_finished_pass)
        self.update_start = 0
        self.position = self._sampler_position()

    def _sampler_position(self) -> tuple[int, int] | None:
        return None if self.sampler is None else (self.sampler.epoch, self.sampler.start)

    def follow(self) -> None:
        """A new epoch, or a loaded position, restarts the per-epoch count."""
        position = self._sampler_position()
        if position != self.position:
            self._check_finished_pass()
            self.position = position
            self.epoch_examples = 0
            self.largest_microbatch = 0
            self.update_start = 0

    def counted(self, count: int) -> None:
        """A microbatch of ``count`` examples (checked by :meth:`check_within`) ran."""
        self.epoch_examples += count
        self.largest_microbatch = max(self.largest_microbatch, count)

    def update_started(self) -> None:
        """The next update begins here."""
        self.update_start = self.epoch_examples

    def restarted_at_loaded_position(self, accepted: int) -> None:
        """The sampler was loaded; this rank had ``accepted`` examples of a partial update.

        The loaded position already counts the partial update's samples; its
        start lies this rank's accepted examples before that position.
        """
        self.position = self._sampler_position()
        self.epoch_examples = 0
        self.update_start = -accepted

    def check_within(self, count: int) -> None:
        """No loop trains on examples its sampler never handed out to this rank.

        A loader draws ahead of the loop (prefetching), never behind it, so the
        examples counted this epoch never exceed the sampler's draws; more means
        the count is not this rank's examples (a global batch, a repeated call)
        and the saved cursor would skip unseen data.
        """
        if self.sampler is None:
            return
        handed_out = self.sampler.yielded
        if self.epoch_examples + count > handed_out:
            raise ValueError(
                f"microbatch_done({count}) would count {self.epoch_examples + count} examples "
                f"of epoch {self.sampler.epoch} on rank {self.sampler.rank}, but its sampler "
                f"has handed out only {handed_out}: pass this rank's microbatch (or its "
                "example count), once per microbatch"
            )

    def _check_finished_pass(self) -> None:
        """Warn when a pass the sampler finished was counted short by a microbatch or more.

        A warning, not an error: a loader with ``drop_last=True`` drops a last
        batch smaller than a full one, and a loop may skip examples on purpose;
        both count fewer than were drawn, correctly. A shortfall of a whole
        microbatch or more is the usual sign of ``microbatch_done(len(batch))``
        on an ``(x, y)`` batch, which counts 2; its saved cursors make a resume
        train on seen data again. Saves cannot check this (a prefetching loader
        may have finished drawing while the loop still trains), so it is checked
        once the loop has moved on to the next epoch.
        """
        sampler = self.sampler
        finished = sampler.last_pass if sampler is not None else None
        if sampler is None or finished is None or not finished.exhausted:
            return
        if (finished.epoch, finished.start) != self.position:
            return
        shortfall = finished.yielded - self.epoch_examples
        if shortfall >= max(1, self.largest_microbatch):
            warnings.warn(
                f"castore: epoch {finished.epoch} ended with {self.epoch_examples} examples "
                f"counted by microbatch_done() on rank {sampler.rank}, but its sampler "
                f"handed out {finished.yielded}: the saved data cursors "
                "under-count, so a resume trains on seen samples again. Pass each batch "
                "itself (microbatch_done(batch)) or its number of examples, not len() of "
                "an (x, y) tuple",
                DataCursorWarning,
                stacklevel=4,  # the loop's call: TrainState method -> follow -> here
            )


def sampler_position(
    data_order: Mapping[str, Any], *, rewind_partial_update: bool = False
) -> dict[str, Any]:
    """The ``ResumableDistributedSampler`` state a generation's data-order record names.

    ``rewind_partial_update`` puts the cursor back at the start of the update
    a mid-accumulation save was in (for partial gradients that were dropped).
    """
    consumed = "update_start_consumed" if rewind_partial_update else "consumed_samples"
    return {
        "version": 1,
        "seed": data_order["seed"],
        "epoch": data_order["epoch"],
        "consumed_samples": data_order[consumed],
        "num_replicas": data_order["world_size"],
        "dataset_len": data_order["dataset_len"],
        "shuffle": data_order["shuffle"],
        "drop_last": data_order["drop_last"],
    }
