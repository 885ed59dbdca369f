"""Per-rank functions for tests/test_dtensor_tp.py, run by tests/helpers/dist_harness.py.

FSDP2 over tensor parallelism on CPU over gloo: ``parallelize_module`` with
column- and row-wise plans on a mesh's "tp" dimension, then ``fully_shard`` on
its "dp" dimension, so the column-parallel weights are strided shards
(``_StridedShard`` on dp, ``Shard`` on tp). Each function returns numpy
arrays and plain values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import castore
import castore.dist
from castore.format.dtensor import dtensor_block

CHUNK_SIZE = 64


def model_2d(mesh: DeviceMesh, rows: int = 10, seed: int = 0, steps: int = 1) -> Any:
    """A column- then row-parallel MLP (``rows`` hidden units: 5 per tp rank, 3 and 2
    per dp rank), FSDP2 on "dp", after ``steps`` AdamW steps: (model, optimizer)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, rows), torch.nn.ReLU(), torch.nn.Linear(rows, 7))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    torch.manual_seed(seed + 1)
    for _ in range(steps):
        model(torch.randn(4, 5)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def model_1d(mesh: DeviceMesh, rows: int = 10) -> Any:
    """The same MLP under FSDP2 alone (a 1-D mesh), before any step."""
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(5, rows), torch.nn.ReLU(), torch.nn.Linear(rows, 7))
    fully_shard(model, mesh=mesh)
    return model


def whole(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()
        for name, t in state.items()
    }


def placements(state: dict[str, Any]) -> dict[str, str]:
    return {n: str(t.placements) for n, t in state.items() if isinstance(t, DTensor)}


def rows_held(local: torch.Tensor, width: int) -> list[int]:
    """The global rows a local block of a tensor whose values are its element index holds."""
    return [int(row[0].item()) // width for row in local]


def save_2d(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save the FSDP2 + TP model and its optimizer's moments (run "tp"); restore them at
    once into a fresh FSDP2 + TP model of other weights."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    store = castore.open(path, chunk_size=CHUNK_SIZE)
    model, optimizer = model_2d(mesh)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    castore.dist.save(store, state, run="tp", step=1)
    fresh, _ = model_2d(mesh, seed=5, steps=0)
    result = castore.dist.load(store, "tp", {"model": fresh.state_dict()})
    return {
        "placements": placements(model.state_dict()),
        "saved": whole(model.state_dict()),
        "moments": whole(
            {f"{p}/{k}": v for p, s in state["optim"]["state"].items() for k, v in s.items()}
        ),
        "restored": whole(fresh.state_dict()),
        "resharded": result.report.resharded,
        "layouts": store.resolve("tp").layouts,
    }


def restore_1d(rank: int, world: int, path: str) -> dict[str, Any]:
    """Restore run "tp"'s model into FSDP2 alone at ``world`` ranks."""
    mesh = init_device_mesh("cpu", (world,))
    store = castore.open(path)
    model = model_1d(mesh)
    result = castore.dist.load(store, "tp", {"model": model.state_dict()})
    return {"restored": whole(model.state_dict()), "bytes_read": result.report.bytes_read}


def uneven_blocks(rank: int, world: int, path: str) -> dict[str, Any]:
    """dp=4 x tp=2 over 9 rows: each rank's rows of the column-parallel weight as FSDP2
    holds them, castore's block, and torch's own derivation; then a save at 8 ranks and
    a restore into FSDP2 alone on the same 8 ranks."""
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 9))
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(27, dtype=torch.float32).view(9, 3))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    weight = model.state_dict()["0.weight"]
    ours = dtensor_block(weight, "0.weight").shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(
        weight.shape, weight.device_mesh, weight.placements
    )
    store = castore.open(path, chunk_size=CHUNK_SIZE)
    castore.dist.save(store, {"model": model.state_dict()}, run="uneven", step=1)
    plain = torch.nn.Sequential(torch.nn.Linear(3, 9))
    fully_shard(plain, mesh=init_device_mesh("cpu", (world,)))
    castore.dist.load(store, "uneven", {"model": plain.state_dict()})
    return {
        "coordinate": tuple(weight.device_mesh.get_coordinate()),
        "held": rows_held(weight.to_local(), 3),
        "castore": list(range(ours.offsets[0], ours.offsets[0] + ours.local_shape[0])),
        "torch": list(range(offsets[0], offsets[0] + shape[0])),
        "restored": whole(plain.state_dict())["0.weight"],
    }
