"""Per-rank functions for tests/test_hf_sharded.py, run by tests/helpers/dist_harness.py.

A Hugging Face-style base (a safetensors file, imported with ``castore import``)
loaded into a fresh FSDP2 (``fully_shard``) model by ``castore.train.load_weights``:
each rank reads only the rows its shards cover, where DCP's and Accelerate's
recipe has rank 0 read the whole file and broadcast it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import castore
import castore.train


class Base(torch.nn.Module):
    """Rows that do not divide by 2 or 3: uneven shards."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(301, 32)
        self.proj = torch.nn.Linear(32, 97)
        self.head = torch.nn.Linear(97, 5)


def base_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(42)
    return {name: t.detach().clone() for name, t in Base().state_dict().items()}


def load_base(rank: int, world: int, path: str, sharded: bool = True) -> dict[str, Any]:
    """A fresh model (seed 7) takes run "base" through load_weights(prefix=""): sharded
    with fully_shard, or (the control) whole on every rank."""
    torch.manual_seed(7)
    model = Base()
    if sharded:
        mesh = init_device_mesh("cpu", (world,))
        for module in (model.embed, model.proj, model.head, model):
            fully_shard(module, mesh=mesh)
    with castore.open(path) as store:
        loaded = castore.train.load_weights(store, "base", model, prefix="")
    assert loaded.report is not None
    whole = {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()
        for name, t in model.state_dict().items()
    }
    local = sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
        for t in model.state_dict().values()
    )
    return {
        "tensors": loaded.tensors,
        "whole": whole,
        "bytes_read": loaded.report.bytes_read,
        "local_bytes": local,
    }
