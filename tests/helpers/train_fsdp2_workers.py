"""Per-rank functions for tests/test_train_fsdp2.py, run by tests/helpers/dist_harness.py.

TrainState with a real FSDP2 (``fully_shard``) model and its AdamW optimizer,
on CPU over gloo: tests/helpers/dtensor_workers.py's MLP (uneven shards, an
empty one at 2+ ranks), two updates, saved as run "train"; then a fresh model
and an optimizer that has never stepped (no moments yet) restore it at any
world size through ``TrainState.load``. Each function returns numpy arrays
and plain values.
"""

from __future__ import annotations

from typing import Any

import dtensor_workers as w
import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import castore
import castore.train
import castore.train.state

RUN = "train"
UPDATES = 2


def live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state as TrainState keys it (parameter names)."""
    return {
        "model": model.state_dict(),
        "optimizer": castore.train.optimizer_state_by_name(model, optimizer)["state"],
    }


def moments_laid_out_like_their_parameters(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[str]:
    """Where an optimizer moment is not a DTensor of its parameter's layout (none)."""
    wrong = []
    state = castore.train.optimizer_state_by_name(model, optimizer)["state"]
    for name, param in model.named_parameters():
        for key, value in state.get(name, {}).items():
            if key == "step":
                continue
            if not isinstance(value, DTensor):
                wrong.append(f"{name}/{key}: {type(value).__name__}")
            elif (value.device_mesh, value.placements, value.shape) != (
                param.device_mesh,
                param.placements,
                param.shape,
            ):
                wrong.append(f"{name}/{key}: {value.placements} vs {param.placements}")
    return wrong


def save_train(rank: int, world: int, path: str) -> dict[str, Any]:
    """Two AdamW updates of the FSDP2 MLP, saved through TrainState as run "train"."""
    mesh = init_device_mesh("cpu", (world,))
    store = castore.open(path, chunk_size=w.CHUNK_SIZE)
    model, optimizer = w.sharded_model(mesh, seed=0, steps=UPDATES)
    state = castore.train.TrainState(model, optimizer)
    for _ in range(UPDATES):
        state.microbatch_done(4)
        state.update_done()
    generation = state.save(store, run=RUN)
    return {"generation": generation.id, "saved": w.full_arrays(live_state(model, optimizer))}


def load_train(rank: int, world: int, path: str, broken: bool = False) -> dict[str, Any]:
    """A fresh FSDP2 MLP and an optimizer that never stepped restore run "train" at
    ``world`` ranks; then one more step. ``broken``: the control, whose optimizer moments
    are read whole as plain tensors (as TrainState read them before DTensor targets)."""
    mesh = init_device_mesh("cpu", (world,))
    store = castore.open(path)
    model, optimizer = w.sharded_model(mesh, seed=11, steps=0)
    state = castore.train.TrainState(model, optimizer)
    original = castore.train.state.optimizer_targets
    if broken:
        castore.train.state.optimizer_targets = lambda named, prefix: True
    try:
        resumed = state.load(store, run=RUN, resume="exact" if world == 2 else "continuation")
    finally:
        castore.train.state.optimizer_targets = original
    out: dict[str, Any] = {
        "claim": resumed.claim,
        "update": resumed.update,
        "after": w.full_arrays(live_state(model, optimizer)),
        "layout": moments_laid_out_like_their_parameters(model, optimizer),
        "bytes_read": resumed.report.bytes_read if resumed.report else None,
        "local_bytes": sum(
            t.to_local().numel() * t.element_size()
            for _, t in w.tensors(live_state(model, optimizer))
            if isinstance(t, DTensor)
        ),
    }
    torch.manual_seed(3)
    out["step"] = w.attempt(lambda: _one_step(model, optimizer))
    return out


def _one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    model(torch.randn(4, 16)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(np.float32(sum(p.to_local().sum().item() for p in model.parameters())))


def unsynced_mid_accumulation_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """A mid-accumulation save while FSDP2 holds the partial gradients unreduced
    (``set_requires_gradient_sync(False)``): refused. The broken control skips the
    check: the save publishes with no partial gradient in it."""
    mesh = init_device_mesh("cpu", (world,))
    store = castore.open(path, chunk_size=w.CHUNK_SIZE)
    model, optimizer = w.sharded_model(mesh, seed=0, steps=1)
    state = castore.train.TrainState(model, optimizer, accumulation_steps=2)
    model.set_requires_gradient_sync(False)
    torch.manual_seed(5)
    model(torch.randn(4, 16)).pow(2).mean().backward()
    state.microbatch_done(4)
    out = {"refused": w.attempt(lambda: state.save(store, run="nosync", mid_accumulation=True))}
    out["runs_after_refusal"] = sorted(store.runs())
    original = castore.train.state.unreduced_gradients
    castore.train.state.unreduced_gradients = lambda model: []
    try:
        state.save(store, run="nosync_control", mid_accumulation=True)
    finally:
        castore.train.state.unreduced_gradients = original
    saved = castore.open(path).load("nosync_control", framework="torch")
    out["control_grads"] = sorted(saved["rank"].get("grads", {})) if rank == 0 else None
    return out


def recorded_layouts(rank: int, world: int, path: str) -> dict[str, Any]:
    """A restore of run "train" onto ``world`` ranks: the generation's recorded layouts,
    and how many targets were no saved box (resharded)."""
    mesh = init_device_mesh("cpu", (world,))
    store = castore.open(path)
    model, optimizer = w.sharded_model(mesh, seed=11, steps=0)
    state = castore.train.TrainState(model, optimizer)
    resumed = state.load(store, run=RUN, resume="exact" if world == 2 else "continuation")
    assert resumed.report is not None
    return {
        "layouts": resumed.generation.layouts,
        "resharded": resumed.report.resharded,
        "manifests": resumed.report.manifests_read,
    }


def train_2d(rank: int, world: int, path: str, kind: str) -> dict[str, Any]:
    """TrainState on a 2x2 mesh: ``kind`` "hsdp" (FSDP2 replicated over "replicate") or
    "tp" (tensor parallel on "tp", FSDP2 on "dp": strided shards). Two updates saved,
    restored into a fresh model and optimizer of the same layout, then one more step."""
    import dtensor_tp_workers

    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

        def build(seed: int, steps: int) -> Any:
            return w.sharded_model(mesh, seed=seed, steps=steps)
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def build(seed: int, steps: int) -> Any:
            return dtensor_tp_workers.model_2d(mesh, seed=seed, steps=steps)

    store = castore.open(path, chunk_size=w.CHUNK_SIZE)
    model, optimizer = build(0, UPDATES)
    state = castore.train.TrainState(model, optimizer)
    for _ in range(UPDATES):
        state.microbatch_done(4)
        state.update_done()
    state.save(store, run=kind)
    saved = w.full_arrays(live_state(model, optimizer))
    fresh, fresh_optimizer = build(11, 0)
    resumed = castore.train.TrainState(fresh, fresh_optimizer).load(store, run=kind)
    return {
        "claim": resumed.claim,
        "saved": saved,
        "after": w.full_arrays(live_state(fresh, fresh_optimizer)),
        "layout": moments_laid_out_like_their_parameters(fresh, fresh_optimizer),
        "placements": sorted({str(p.placements) for p in fresh.parameters()}),
    }
