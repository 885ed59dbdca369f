"""Per-rank functions for tests/test_full_state.py, run by tests/helpers/dist_harness.py.

A state only rank 0 holds: ``get_state_dict(model, optimizer,
options=StateDictOptions(full_state_dict=True, cpu_offload=True))`` of a real
FSDP2 MLP (tests/helpers/dtensor_workers.py's) gives rank 0 the whole model and
optimizer as plain tensors and every other rank empty dicts. Each function
returns numpy arrays and plain values keyed by key path, so the parent compares
them bitwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from dtensor_workers import (
    CHUNK_SIZE,
    MLP,
    attempt,
    full_arrays,
    restore,
    sharded_model,
    tensors,
    training_state,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import castore
import castore.dist
from castore.dist import groupcommit

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def full_state(model: MLP, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The portable checkpoint recipe: rank 0 holds it all, the others ``{}`` each."""
    model_state, optim_state = get_state_dict(model, optimizer, options=FULL)
    return {"model": model_state, "optim": optim_state}


def plain_arrays(state: Any) -> dict[str, np.ndarray]:
    """Each plain tensor of a state, by key path (no collective)."""
    return {path: tensor.detach().clone().numpy() for path, tensor in tensors(state)}


def ref_generation(store: castore.Store, run: str) -> int | None:
    ref = store.refs.read(run)
    return None if ref is None else ref.generation


def holder_assignment_ignored(prepared: Any, holding: Any, loads: list[int], rank: int) -> set[str]:
    """The broken control: the replicated tensors balanced over every rank, as if every
    rank held them (each rank from its own tree, as before regions)."""
    owners = groupcommit.assign_replicated(prepared.replicated, loads)
    return set(prepared.blocks) | {name for name, at in owners.items() if at == rank}


def broken_assignment(store: castore.Store, state: Any) -> dict[str, Any]:
    original = groupcommit.owned_tensors
    groupcommit.owned_tensors = holder_assignment_ignored
    try:
        return attempt(lambda: castore.dist.save(store, state, run="broken", step=2).id)
    finally:
        groupcommit.owned_tensors = original


def refusals(store: castore.Store, rank: int) -> dict[str, Any]:
    """Trees that disagree where both ranks pass something are refused; run "full" stays."""
    one = torch.arange(3.0)
    cases = {
        # Both non-empty, a tensor of another shape.
        "shape": {"model": {"w": one if rank == 0 else torch.arange(4.0)}},
        # Rank 1 passes the model empty, and "extra/x" of another shape.
        "beside_empty": {
            "model": {"w": one} if rank == 0 else {},
            "extra": {"x": one if rank == 0 else torch.arange(4.0)},
        },
        # Rank 1 passes the model empty and a tensor rank 0 does not pass.
        "stray": {"model": {"w": one}} if rank == 0 else {"model": {}, "stray": one},
        # Each rank passes empty what the other holds: no rank passes the whole state.
        "split": {"model": {"w": one}, "optim": {}}
        if rank == 0
        else {"model": {}, "optim": {"m": one}},
        # Rank 1 passes {} where rank 0 passes a tensor.
        "not_a_dict": {"model": one} if rank == 0 else {"model": {}},
    }
    return {
        name: attempt(lambda state=state: castore.dist.save(store, state, run="full", step=3).id)
        for name, state in cases.items()
    }


def save_full(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save a trained FSDP2 model's full state from rank 0 (run "full") and its sharded
    state (run "sharded"); the refusals; the broken control."""
    mesh = init_device_mesh("cpu", (world,))
    store = castore.open(path, chunk_size=CHUNK_SIZE)
    model, optimizer = sharded_model(mesh, seed=0, steps=2)
    sharded = training_state(model, optimizer)
    state = full_state(model, optimizer)
    out: dict[str, Any] = {
        "held": plain_arrays(state),
        "empty": state == {"model": {}, "optim": {}},
    }
    generation = castore.dist.save(store, state, run="full", step=2)
    out["generation"] = generation.id
    out["logical_bytes"] = generation.logical_bytes
    out["sharded_saved"] = full_arrays(sharded)
    out["sharded"] = castore.dist.save(store, sharded, run="sharded", step=2).id
    out["coordinator_1"] = castore.dist.save(store, state, run="coord1", step=2, coordinator=1).id
    out["async"] = attempt(
        lambda: castore.dist.save(store, state, run="async", step=2, blocking=False).result()
    )
    out["async_ref"] = ref_generation(store, "async")
    out["refusals"] = refusals(store, rank)
    out["after_refusals"] = ref_generation(store, "full")
    out["broken"] = broken_assignment(store, state)
    out["broken_ref"] = ref_generation(store, "broken")
    return out


def into_rank0_only(store: castore.Store, mesh: DeviceMesh, run: str) -> dict[str, Any]:
    """The broadcast_from_rank0 recipe: full-state targets on rank 0, ``{}`` on the
    others; then torch broadcasts them into a fresh sharded model."""
    model, optimizer = sharded_model(mesh, seed=11, steps=1)
    targets = full_state(model, optimizer)
    result = castore.dist.load(store, run, targets)
    loaded = plain_arrays(result.state) if dist.get_rank() == 0 else {}
    model_state = result.state["model"] if dist.get_rank() == 0 else {}
    optim_state = result.state["optim"] if dist.get_rank() == 0 else {}
    # Not set_state_dict: given {} for the model it skips the model on ranks 1+, while
    # rank 0 broadcasts it (torch's optim_only=not model_state_dict): a hang.
    set_model_state_dict(model, model_state, options=BROADCAST)
    set_optimizer_state_dict(model, optimizer, optim_state, options=BROADCAST)
    return {
        "loaded": loaded,
        "after": full_arrays(training_state(model, optimizer)),
        "bytes_read": result.report.bytes_read,
    }


def rank0_reads_all(store: castore.Store, run: str) -> dict[str, Any]:
    """No targets anywhere; rank 0 alone reads the rest (``load_rest``): the plain dicts."""
    result = castore.dist.load(store, run, {}, load_rest=dist.get_rank() == 0, framework="torch")
    return {"loaded": plain_arrays(result.state), "bytes_read": result.report.bytes_read}


def every_rank_whole(store: castore.Store, mesh: DeviceMesh, run: str) -> dict[str, Any]:
    """Full-state targets on every rank (each gets the whole state)."""
    model, optimizer = sharded_model(mesh, seed=11, steps=1)
    listed = [full_state(model, optimizer)]  # a collective; only rank 0's is whole
    dist.broadcast_object_list(listed, src=0)  # the template rank 0 got, on every rank
    result = castore.dist.load(store, run, listed[0])
    return {"loaded": plain_arrays(result.state)}


def restore_full(rank: int, world: int, path: str) -> dict[str, Any]:
    """Restore run "full" at ``world`` ranks every way, and run "sharded" into rank 0's
    full-state targets."""
    mesh = init_device_mesh("cpu", (world,))
    store = castore.open(path, chunk_size=CHUNK_SIZE)
    return {
        "sharded_targets": restore(store, mesh, "full"),
        "rank0_only": into_rank0_only(store, mesh, "full"),
        "load_rest": rank0_reads_all(store, "full"),
        "whole_everywhere": every_rank_whole(store, mesh, "full"),
        "reverse": into_rank0_only(store, mesh, "sharded"),
    }
