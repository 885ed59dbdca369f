"""Per-rank functions for tests/test_export.py, run by dist_harness.py in a gloo group."""

from __future__ import annotations

import torch

import castore
import castore.dist

SHAPE = (19, 13)
# Uneven 2-D blocks, one per rank: (row offset, col offset), (rows, cols).
BLOCKS = [((0, 0), (7, 5)), ((0, 5), (7, 8)), ((7, 0), (12, 9)), ((7, 9), (12, 4))]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool]


def full_state() -> dict[str, torch.Tensor]:
    """The same full tensors on every rank (fixed seed): one 2-D weight per dtype,
    a replicated bias and a 0-d step counter, named as a module's parameters."""
    gen = torch.Generator().manual_seed(14)
    state: dict[str, torch.Tensor] = {}
    for index, dtype in enumerate(DTYPES):
        if dtype is torch.int64:
            value = torch.randint(-(1 << 40), 1 << 40, SHAPE, generator=gen)
        elif dtype is torch.bool:
            value = torch.rand(SHAPE, generator=gen) > 0.5
        else:
            value = torch.randn(SHAPE, generator=gen).to(dtype)
        state[f"layers.{index}.weight"] = value
    state["head.bias"] = torch.randn(40, generator=gen)
    state["steps"] = torch.tensor(123, dtype=torch.int64)
    return state


def save_uneven_blocks(rank: int, world_size: int, store_path: str) -> None:
    """Save ``full_state`` with each rank holding its uneven 2-D block of every weight."""
    assert world_size == len(BLOCKS)
    (r0, c0), (rows, cols) = BLOCKS[rank]
    state: dict[str, object] = {}
    for name, value in full_state().items():
        if name.startswith("layers."):
            block = value[r0 : r0 + rows, c0 : c0 + cols].clone()
            state[name] = castore.Shard(block, SHAPE, (r0, c0))
        else:
            state[name] = value
    with castore.open(store_path) as store:
        castore.dist.save(store, {"model": state}, run="r", step=7)
