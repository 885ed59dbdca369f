"""Per-rank functions for tests/test_dtensor_replicas.py, run by tests/helpers/dist_harness.py.

Two ranks on a 1-D CPU mesh over gloo. ``w`` is a DTensor placed ``[Replicate()]``:
both ranks hold its one block, rank 0 writes it and rank 1's copy is compared
(castore.dist.replicas); ``rows`` is placed ``[Shard(0)]`` (blocks no other rank
holds); ``step`` is a plain value. Each function returns plain values and numpy
arrays for the parent to check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from replica_workers import count_hashing, trusting_saves_of
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import castore
import castore.dist
from castore.dist import replicas

CHUNK_SIZE = 256  # w's 1280 bytes span several chunks


def state_of(mesh: DeviceMesh, w_local: torch.Tensor, rank: int) -> dict[str, Any]:
    rows = torch.arange(24, dtype=torch.float32).reshape(6, 4)[3 * rank : 3 * rank + 3]
    return {
        "model": {"w": DTensor.from_local(w_local, mesh, [Replicate()], run_check=False)},
        "rows": DTensor.from_local(rows.clone(), mesh, [Shard(0)], run_check=False),
        "step": 3,
    }


def replica_w(rank: int, differ_on: int | None) -> torch.Tensor:
    """w's block as ``rank`` holds it: one element off on rank ``differ_on``."""
    local = torch.arange(320, dtype=torch.float32).reshape(8, 40) + 0.5
    if rank == differ_on:
        local[5, 17] += 1.0
    return local


def save_case(store: castore.Store, state: Any, step: int, blocking: bool) -> dict[str, Any]:
    """Save ``state`` as the next step of run R: the generation, or what was raised."""
    result: dict[str, Any] = {}
    try:
        saved = castore.dist.save(store, state, run="R", step=step, blocking=blocking)
        if not blocking:
            saved = saved.result()
        result["generation"] = saved.id
    except castore.CastoreError as exc:
        result.update(error=type(exc).__name__, text=str(exc), keys=getattr(exc, "keys", None))
    result["latest"] = store.generations("R")[-1].id
    return result


def without_block_comparison(call: Callable[[], Any]) -> Any:
    """The broken control: the blocks' digests compared as if they never differ."""
    original = replicas.differing_blocks
    replicas.differing_blocks = lambda details: []  # type: ignore[assignment]
    try:
        return call()
    finally:
        replicas.differing_blocks = original  # type: ignore[assignment]


def equal_then_differing(rank: int, world: int, path: str, blocking: bool) -> dict[str, Any]:
    """Equal replicas (published), rank 1's copy one element off (refused), then the
    same with the block comparison disabled (the control); what a load gives after."""
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    with castore.open(path, chunk_size=CHUNK_SIZE) as store:
        out["equal"] = save_case(store, state_of(mesh, replica_w(rank, None), rank), 1, blocking)
        differing = state_of(mesh, replica_w(rank, 1), rank)
        out["one_element"] = save_case(store, differing, 2, blocking)
        out["control"] = without_block_comparison(lambda: save_case(store, differing, 3, blocking))
        loaded = castore.dist.load(store, "R", {}, load_rest=True)
        out["loaded_w"] = loaded.state["model"]["w"].numpy()
    out["held_w"] = replica_w(rank, 1).numpy()
    return out


def trusting_saves(rank: int, world: int, path: str) -> list[dict[str, Any]]:
    """Saves that trust version counters: an unmoved replica is not hashed again to
    compare, and one changed in place on one rank alone is still caught."""
    hashed = count_hashing()
    mesh = init_device_mesh("cpu", (world,))
    local = replica_w(rank, None)
    local.add_(1.0)  # a counter at 0 is never trusted
    state = state_of(mesh, local, rank)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("first", lambda: None),
        ("unchanged", lambda: None),
        ("one_rank_moved", lambda: local[0, 0].add_(1.0) if rank == 1 else None),
    ]
    with castore.open(path, chunk_size=CHUNK_SIZE) as store:
        return trusting_saves_of(store, state, steps, hashed)


def hsdp_one_replica_off(rank: int, world: int, path: str) -> dict[str, Any]:
    """A 2x2 mesh (replicate, shard): ``w`` placed ``[Replicate(), Shard(0)]``, so ranks 0
    and 2 hold rows 0-3, ranks 1 and 3 rows 4-7. Equal, then rank 3's copy one element off."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rows = 4 * mesh.get_coordinate()[1]
    out: dict[str, Any] = {}
    with castore.open(path, chunk_size=CHUNK_SIZE) as store:
        for step, differ_on in [(1, None), (2, 3)]:
            local = replica_w(rank, differ_on)[rows : rows + 4].clone()
            w = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False)
            case = "equal" if differ_on is None else "one_element"
            out[case] = save_case(store, {"w": w, "step": step}, step, blocking=True)
    return out
