"""Markers that say how a value is laid out across ranks.

They are plain containers: castore does not import torch to build them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Shard:
    """This rank's block of a tensor, placed in global coordinates.

    ``local`` is a numpy array or torch tensor of shape ``local_shape``; it
    covers ``[offsets[d], offsets[d] + local_shape[d])`` of every dimension
    ``d`` of a tensor whose full shape is ``global_shape``. As a load target,
    ``local`` is the preallocated tensor that receives that block.
    """

    local: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.offsets = tuple(int(o) for o in self.offsets)
        shape = self.local_shape
        if not (len(shape) == len(self.global_shape) == len(self.offsets)):
            raise ValueError(
                f"Shard: local shape {shape}, global shape {self.global_shape} and offsets "
                f"{self.offsets} must have the same number of dimensions"
            )
        for dim, (o, s, g) in enumerate(zip(self.offsets, shape, self.global_shape, strict=True)):
            if o < 0 or o + s > g:
                raise ValueError(
                    f"Shard: dimension {dim} block [{o}, {o + s}) lies outside global size {g}"
                )

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.local.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


@dataclass
class RankLocal:
    """State that differs per rank (RNG streams, per-rank cursors).

    Saved once per rank, and restored to the same rank index.
    """

    value: Any


@dataclass(frozen=True)
class NotLoaded:
    """Stands in for a saved tensor that a partial restore did not read."""

    name: str
    dtype: str
    shape: tuple[int, ...]
