"""Per-rank script for tests/test_grid_wiring.py, run by tests/helpers/dist_harness.py.

Every rank builds the same global state (seeded), passes its block of each
tensor as a ``castore.Shard`` cut by ``torch.chunk`` (rows or columns), saves
it with ``castore.dist.save``, then loads the generation back into fresh
blocks of the same layout and reports whether they are bitwise its own.
``restore`` loads a generation saved by another layout into this layout's
blocks. Results are plain values, so the parent needs no torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import castore
import castore.dist

RUN = "grid"
SHAPES = {"w": (4096, 64), "emb": (2800, 48), "v": (60000,)}


def whole_state(seed: int) -> dict[str, np.ndarray]:
    """The global tensors, the same on every rank (and in the parent)."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def _blocks(tensor: Any, rank: int, world: int, axis: int) -> tuple[Any, tuple[int, ...]]:
    import torch

    axis = min(axis, tensor.dim() - 1)
    parts = torch.chunk(tensor, world, dim=axis)
    offset = sum(part.shape[axis] for part in parts[:rank])
    offsets = [0] * tensor.dim()
    offsets[axis] = offset
    block = parts[rank] if rank < len(parts) else tensor.narrow(axis, 0, 0)
    return block.contiguous(), tuple(offsets)


def _sharded(seed: int, rank: int, world: int, axis: int) -> dict[str, Any]:
    import torch

    state = {}
    for name, array in whole_state(seed).items():
        block, offsets = _blocks(torch.from_numpy(array), rank, world, axis)
        state[name] = castore.Shard(block, array.shape, offsets)
    return state


def _targets(rank: int, world: int, axis: int) -> dict[str, Any]:
    import torch

    targets = {}
    for name, shape in SHAPES.items():
        block, offsets = _blocks(torch.zeros(shape), rank, world, axis)
        targets[name] = castore.Shard(block, shape, offsets)
    return targets


def _matches(loaded: dict[str, Any], seed: int, rank: int, world: int, axis: int) -> bool:
    import torch

    for name, array in whole_state(seed).items():
        expected, _ = _blocks(torch.from_numpy(array), rank, world, axis)
        got = loaded[name].local if isinstance(loaded[name], castore.Shard) else loaded[name]
        if not torch.equal(got, expected):
            return False
    return True


def save(rank: int, world: int, path: str, seed: int, axis: int, step: int) -> dict[str, Any]:
    """Save this layout's blocks; load them back into fresh blocks of the same layout."""
    with castore.open(path) as store:
        gen = castore.dist.save(store, _sharded(seed, rank, world, axis), run=RUN, step=step)
        back = castore.dist.load(store, RUN, _targets(rank, world, axis)).state
        return {
            "generation": gen.id,
            "new_bytes": gen.stats.new_bytes,
            "logical_bytes": gen.stats.logical_bytes,
            "bitwise": _matches(back, seed, rank, world, axis),
        }


def restore(rank: int, world: int, path: str, seed: int, axis: int, generation: int) -> bool:
    """Load ``generation`` (saved by any layout) into this layout's blocks: bitwise?"""
    with castore.open(path) as store:
        back = castore.dist.load(store, RUN, _targets(rank, world, axis), generation).state
        return _matches(back, seed, rank, world, axis)
