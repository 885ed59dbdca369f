"""Per-rank functions for tests/test_dtensor.py, run by tests/helpers/dist_harness.py.

Real FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU over gloo: a small
MLP whose sizes do not divide by the world size (uneven shards) and whose
``scale`` parameter has one row (at 2 or more ranks some rank's shard of it is
empty), trained two AdamW steps from fixed seeds. Each function returns
numpy arrays and plain values: the full tensors (``full_tensor()``) of what
was saved or restored, keyed by key path, so the parent compares them bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import castore
import castore.dist
from castore.format import dtensor as castore_dtensor
from castore.format.layout import Box

CHUNK_SIZE = 256  # boxes of a few hundred bytes span several chunks

# The 2x2 mesh's extra tensors: name -> (global shape, placements saved, placements restored).
GRID = {
    "nested": ((7, 5), (Shard(0), Shard(0)), (Shard(1), Replicate())),
    "both_dims": ((6, 9), (Shard(0), Shard(1)), (Replicate(), Replicate())),
    "replicated_rows": ((5, 6), (Replicate(), Shard(1)), (Shard(0), Shard(0))),
}


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 21)
        self.out = torch.nn.Linear(21, 7)
        self.scale = torch.nn.Parameter(torch.randn(1, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x))) * self.scale


def sharded_model(mesh: DeviceMesh, seed: int, steps: int) -> tuple[MLP, torch.optim.Optimizer]:
    """A fully_shard MLP (HSDP on a 2-D mesh) after ``steps`` AdamW steps."""
    torch.manual_seed(seed)
    model = MLP()
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    torch.manual_seed(seed + 1)
    for _ in range(steps):
        model(torch.randn(4, 16)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def training_state(model: MLP, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}


def tensors(node: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a state, by key path, in a fixed order (the same on every rank)."""
    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, dict):
        for key in sorted(node, key=str):
            yield from tensors(node[key], f"{path}/{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from tensors(value, f"{path}/{index}")


def full_arrays(state: Any) -> dict[str, np.ndarray]:
    """Each tensor's full value (a collective: every rank gathers every DTensor)."""
    found = {}
    for path, tensor in tensors(state):
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        found[path] = whole.detach().clone().numpy()
    return found


def offsets_against_torch(state: Any) -> list[str]:
    """Where castore's block of a DTensor differs from torch's own derivation (none)."""
    differing = []
    for path, tensor in tensors(state):
        if not isinstance(tensor, DTensor):
            continue
        shard = castore_dtensor.dtensor_block(tensor, path).shard
        shape, offsets = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        if (shard.local_shape, shard.offsets) != (tuple(shape), tuple(offsets)):
            differing.append(f"{path}: {shard.local_shape}@{shard.offsets} vs {shape}@{offsets}")
    return differing


def attempt(call: Callable[[], Any]) -> dict[str, Any]:
    """What ``call`` returned, or the type, classes and message of what it raised."""
    try:
        return {"value": call()}
    except Exception as exc:
        names = [cls.__name__ for cls in type(exc).__mro__]
        return {"error": type(exc).__name__, "mro": names, "message": str(exc)}


ORIGINAL_BLOCK_OF = castore_dtensor.block_of


def without_mesh_coordinate(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    dims: Any,
) -> Box:
    """The broken control: the local block's shape, placed at the origin."""
    return Box(
        (0,) * len(global_shape),
        ORIGINAL_BLOCK_OF(global_shape, mesh_shape, coordinate, dims).shape,
    )


def broken_offsets(call: Callable[[], Any]) -> dict[str, Any]:
    """``call`` with castore's offsets taken from the local shape alone."""
    castore_dtensor.block_of = without_mesh_coordinate
    try:
        return attempt(call)
    finally:
        castore_dtensor.block_of = ORIGINAL_BLOCK_OF


def restore(
    store: castore.Store,
    mesh: DeviceMesh,
    run: str,
    fresh: tuple[MLP, torch.optim.Optimizer] | None = None,
) -> dict[str, Any]:
    """Restore ``run`` into a fresh sharded model and optimizer (other seeds, one step)."""
    model, optimizer = fresh or sharded_model(mesh, seed=11, steps=1)
    targets = training_state(model, optimizer)
    before = full_arrays({"model": targets["model"]})
    result = castore.dist.load(store, run, targets)
    same = all(result.state["model"][k] is v for k, v in targets["model"].items())
    set_optimizer_state_dict(model, optimizer, result.state["optim"])
    return {
        "before": before,
        "after": full_arrays(training_state(model, optimizer)),  # read from the live model
        "same_objects": same,
        "bytes_read": result.report.bytes_read,
        "local_numel": sum(
            t.to_local().numel() for _, t in tensors(targets) if isinstance(t, DTensor)
        ),
    }


# -- launches --------------------------------------------------------------------------------


def save_fsdp(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save a trained FSDP2 model and its optimizer as run "fsdp"; restore it at once;
    the refusals; the broken control."""
    mesh = init_device_mesh("cpu", (world,))
    store = castore.open(path, chunk_size=CHUNK_SIZE)
    model, optimizer = sharded_model(mesh, seed=0, steps=2)
    state = training_state(model, optimizer)
    out: dict[str, Any] = {"torch_differs": offsets_against_torch(state)}
    out["local_shapes"] = {
        p: tuple(t.to_local().shape) for p, t in tensors(state) if isinstance(t, DTensor)
    }
    generation = castore.dist.save(store, state, run="fsdp", step=2)
    out["generation"] = generation.id
    out["saved"] = full_arrays(state)
    out["restored"] = restore(store, mesh, "fsdp")
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    out["partial"] = attempt(
        lambda: castore.dist.save(store, {"grads": {"sum": partial}}, run="partial", step=1)
    )
    strided = DTensor.from_local(torch.ones(2, 3), mesh, [_StridedShard(0, split_factor=2)])
    out["strided"] = attempt(
        lambda: castore.dist.save(store, {"tp": {"w": strided}}, run="strided", step=1)
    )
    out["broken_save"] = broken_offsets(
        lambda: castore.dist.save(store, state, run="broken", step=2).id
    )
    out["broken_load"] = broken_offsets(lambda: restore(store, mesh, "fsdp")["after"])
    out["fail_closed"] = fail_closed(store, mesh, rank)
    out["store_save"] = attempt(lambda: store.save(state, run="blocks", step=2).id)
    return out


def fail_closed(store: castore.Store, mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    """A load that fails on rank 1 alone (a target the generation lacks) changes no
    rank's DTensors."""
    model, optimizer = sharded_model(mesh, seed=11, steps=1)
    targets = training_state(model, optimizer)
    before = full_arrays(targets)
    if rank == 1:
        targets["model"] = {**targets["model"], "missing": torch.zeros(2)}
    outcome = attempt(lambda: castore.dist.load(store, "fsdp", targets))
    outcome.pop("value", None)
    after = full_arrays(training_state(model, optimizer))
    unchanged = sorted(before) == sorted(after) and all(
        before[name].tobytes() == after[name].tobytes() for name in before
    )
    return {**outcome, "unchanged": unchanged}


def restore_fsdp(rank: int, world: int, path: str) -> dict[str, Any]:
    """Restore run "fsdp" into a fresh FSDP2 model and optimizer on ``world`` ranks; at
    one rank, save that model with ``Store.save`` too (run "one_process")."""
    mesh = init_device_mesh("cpu", (world,))
    store = castore.open(path, chunk_size=CHUNK_SIZE)
    model, optimizer = sharded_model(mesh, seed=11, steps=1)
    out = restore(store, mesh, "fsdp", (model, optimizer))
    if world == 1:
        out["store_save"] = attempt(
            lambda: store.save({"model": model.state_dict()}, run="one_process", step=0).id
        )
    return out


def every_replica_writes(store: castore.Store, state: Any) -> int:
    """The control of writing each block once: every replica writes its block (run
    "hsdp_all_write"); identical boxes still count once, so the save publishes."""
    original = castore_dtensor.writes_block
    castore_dtensor.writes_block = lambda coordinate, dims: True
    try:
        return castore.dist.save(store, state, run="hsdp_all_write", step=2).id
    finally:
        castore_dtensor.writes_block = original


def grid_tensors(
    mesh: DeviceMesh, which: int, value: Callable[[tuple[int, ...]], torch.Tensor]
) -> dict[str, DTensor]:
    """GRID's tensors with their saved (``which`` 1) or restored (2) placements."""
    return {
        name: distribute_tensor(value(spec[0]), mesh, list(spec[which]))
        for name, spec in GRID.items()
    }


def save_hsdp(rank: int, world: int, path: str) -> dict[str, Any]:
    """HSDP on a 2x2 mesh (Replicate, Shard(0)), plus nested and mixed placements:
    save as run "hsdp", restore into fresh tensors of other placements."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    store = castore.open(path, chunk_size=CHUNK_SIZE)
    model, optimizer = sharded_model(mesh, seed=0, steps=2)

    def counting(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) + 0.5

    state = {**training_state(model, optimizer), "grid": grid_tensors(mesh, 1, counting)}
    out: dict[str, Any] = {"torch_differs": offsets_against_torch(state)}
    generation = castore.dist.save(store, state, run="hsdp", step=2)
    out["generation"] = generation.id
    out["logical_bytes"] = generation.logical_bytes
    out["saved"] = full_arrays(state)
    out["restored"] = restore(store, mesh, "hsdp")
    out["every_replica_writes"] = every_replica_writes(store, state)
    grid = grid_tensors(mesh, 2, lambda shape: torch.zeros(shape))
    castore.dist.load(store, "hsdp", {"grid": grid})
    out["grid"] = full_arrays(grid)
    out["grid_torch_differs"] = offsets_against_torch(grid)
    return out
