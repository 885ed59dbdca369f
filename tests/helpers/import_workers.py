"""Per-rank functions for tests/test_import.py, run by dist_harness.py in a gloo group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def full_state() -> dict[str, Any]:
    """The same full tensors on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(5)
    return {
        "model": {
            "w": torch.randn(10, 8, generator=gen),  # 5 rows per rank
            "emb": torch.randn(6, 4, generator=gen).to(torch.bfloat16),
            "scale": torch.arange(7, dtype=torch.int64),  # replicated
        },
        "step": 42,
        "note": "two ranks",
    }


def save_sharded(rank: int, world_size: int, directory: str) -> None:
    """Save ``full_state`` with model.w and model.emb sharded by rows over the ranks."""
    mesh = init_device_mesh("cpu", (world_size,))
    state = full_state()
    for name in ("w", "emb"):
        state["model"][name] = distribute_tensor(state["model"][name], mesh, [Shard(0)])
    dcp.save(state, checkpoint_id=directory)
