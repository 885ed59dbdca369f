"""Per-rank functions for tests/test_dist_coopread.py, run by tests/helpers/dist_harness.py.

Each rank opens one store (a shared directory, each rank its own index cache,
as a node would; or one local LMDB store) and saves replicated state: plain
tensors every rank holds whole (``rep/*``) and a DTensor ``hsdp`` placed
``[Replicate()]`` on 2 ranks, ``[Replicate(), Shard(0)]`` on a 2 x 2 mesh at 4
(ranks 0 and 2 hold rows 0-7, ranks 1 and 3 rows 8-15). It then restores it
several ways and reports, per restore, the chunk bytes it read from the store
(the report, and the blob backend's own fetch counters), the bytes peers sent
it, and what its targets hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import castore
import castore.dist
from castore.chunkstore.bloblayout import pack_blob
from castore.dist import coopread

CHUNK_SIZE = 1024
RUN = "C"
SENTINEL = -7.0
HSDP_ROWS, HSDP_COLS = 16, 40
REPLICATED = {"w": (24, 40), "emb": (50, 30), "bias": (7,)}


def full_tensors(seed: int = 1) -> dict[str, np.ndarray]:
    """Every saved tensor whole, by key path."""
    rng = np.random.default_rng(seed)
    tensors = {
        f"rep/{name}": rng.standard_normal(shape).astype(np.float32)
        for name, shape in REPLICATED.items()
    }
    tensors["hsdp"] = rng.standard_normal((HSDP_ROWS, HSDP_COLS)).astype(np.float32)
    return tensors


def mesh_of(world: int) -> tuple[DeviceMesh, list[Any]]:
    if world == 4:
        return init_device_mesh("cpu", (2, 2)), [Replicate(), Shard(0)]
    return init_device_mesh("cpu", (world,)), [Replicate()]


def hsdp_rows(rank: int, world: int) -> slice:
    if world == 4:
        half = HSDP_ROWS // 2
        return slice(half * (rank % 2), half * (rank % 2 + 1))
    return slice(0, HSDP_ROWS)


def state_of(rank: int, world: int, mesh: DeviceMesh, placements: list[Any]) -> dict[str, Any]:
    full = full_tensors()
    local = torch.from_numpy(full["hsdp"][hsdp_rows(rank, world)].copy())
    return {
        "rep": {name: torch.from_numpy(full[f"rep/{name}"].copy()) for name in REPLICATED},
        "hsdp": DTensor.from_local(local, mesh, placements, run_check=False),
    }


def targets_of(rank: int, world: int, mesh: DeviceMesh, placements: list[Any]) -> dict[str, Any]:
    """Targets of the saved layout, every element SENTINEL."""
    rows = hsdp_rows(rank, world)
    local = torch.full((rows.stop - rows.start, HSDP_COLS), SENTINEL)
    return {
        "rep": {name: torch.full(shape, SENTINEL) for name, shape in REPLICATED.items()},
        "hsdp": DTensor.from_local(local, mesh, placements, run_check=False),
    }


def held(targets: dict[str, Any]) -> dict[str, np.ndarray]:
    found = {f"rep/{name}": t.numpy().copy() for name, t in targets["rep"].items()}
    found["hsdp"] = targets["hsdp"].to_local().numpy().copy()
    return found


def unique_chunk_bytes(store: castore.Store) -> int:
    """The stored bytes of the distinct chunks of the run's generation: what the ranks
    need together (each tensor is restored whole by some rank)."""
    _, root = store.resolve_root(RUN, "latest")
    lengths = {
        entry.chunks[index]: entry.chunk_length(index)
        for boxes in store.tensor_entries(root).values()
        for entry in boxes
        for index in range(len(entry.chunks))
    }
    return sum(lengths.values())


def fetched_chunk_bytes(store: castore.Store) -> int:
    """The blob backend's own count of chunk bytes fetched (the report's for LMDB)."""
    fetches = getattr(store.backend, "fetches", None)
    return store.read_counters.bytes if fetches is None else fetches.chunk_bytes


def restore(
    rank: int,
    world: int,
    store: castore.Store,
    mesh: DeviceMesh,
    placements: list[Any],
    setting: Any,
) -> dict[str, Any]:
    """One restore: what it read and received, and what the targets hold after it, or
    the error it raised (and whether the targets still hold only SENTINEL)."""
    targets = targets_of(rank, world, mesh, placements)
    before = fetched_chunk_bytes(store)
    try:
        report = castore.dist.load(store, RUN, targets, cooperative=setting).report
    except castore.CastoreError as exc:
        values = held(targets)
        return {
            "error": type(exc).__name__,
            "integrity": isinstance(exc, castore.errors.IntegrityError),
            "message": str(exc),
            "unchanged": all(bool((v == SENTINEL).all()) for v in values.values()),
        }
    return {
        "bytes_read": report.bytes_read,
        "chunks_read": report.chunks_read,
        "bytes_needed": report.bytes_needed,
        "chunks_from_peers": report.chunks_from_peers,
        "bytes_from_peers": report.bytes_from_peers,
        "fetched": fetched_chunk_bytes(store) - before,
        "timings": sorted(report.timings),
        "values": held(targets),
    }


def flip_what_is_sent(original: Any) -> Any:
    """The broken sender: every chunk it frames has one byte flipped."""

    def framed(values: list[bytes | None]) -> bytes:
        flipped = []
        for value in values:
            if value is not None:
                damaged = bytearray(value)
                damaged[len(damaged) // 2] ^= 0xFF
                value = bytes(damaged)
            flipped.append(value)
        return original(flipped)

    return framed


def damage_in_pack(store: castore.Store, path: str) -> str:
    """Flip one byte of the first chunk of ``rep/w`` where the shared directory holds it."""
    _, root = store.resolve_root(RUN, "latest")
    key = store.tensor_entries(root)["rep/w"][0].chunks[0]
    where = store.backend.locate([key])[0]
    pack = Path(path) / pack_blob(where.pack)
    data = bytearray(pack.read_bytes())
    data[where.offset + 5] ^= 0xFF
    pack.write_bytes(bytes(data))
    return key.hex()


def shared_directory_script(rank: int, world: int, path: str, cache_root: str) -> dict[str, Any]:
    """Save, then restore with cooperation "auto", off, True, per node (ranks split over
    two simulated nodes), with a sender that flips bytes, and after a chunk was damaged
    in the store."""
    mesh, placements = mesh_of(world)
    out: dict[str, Any] = {}
    with castore.open(path, shared=True, cache_dir=Path(cache_root, f"rank{rank}")) as store:
        castore.dist.save(store, state_of(rank, world, mesh, placements), run=RUN, step=1)
        out["unique"] = unique_chunk_bytes(store)
        for name, setting in (("auto", "auto"), ("off", False), ("job", True)):
            out[name] = restore(rank, world, store, mesh, placements, setting)
        original_node, original_frame = coopread.node_name, coopread.frame
        coopread.node_name = lambda: f"node{rank * 2 // world}"  # type: ignore[assignment]
        try:
            out["node"] = restore(rank, world, store, mesh, placements, "node")
        finally:
            coopread.node_name = original_node  # type: ignore[assignment]
        coopread.frame = flip_what_is_sent(original_frame)  # type: ignore[assignment]
        try:
            out["peer_damage"] = restore(rank, world, store, mesh, placements, "auto")
            out["peer_damage_off"] = restore(rank, world, store, mesh, placements, False)
        finally:
            coopread.frame = original_frame  # type: ignore[assignment]
        dist.barrier()
        if rank == 0:
            out["damaged_chunk"] = damage_in_pack(store, path)
        dist.barrier()
        out["store_damage"] = restore(rank, world, store, mesh, placements, "auto")
    return out


def local_store_script(rank: int, world: int, path: str) -> dict[str, Any]:
    """One local LMDB store on one node: cooperation "auto" (off there) and True."""
    mesh, placements = mesh_of(world)
    out: dict[str, Any] = {}
    with castore.open(path) as store:
        castore.dist.save(store, state_of(rank, world, mesh, placements), run=RUN, step=1)
        out["unique"] = unique_chunk_bytes(store)
        out["auto"] = restore(rank, world, store, mesh, placements, "auto")
        out["job"] = restore(rank, world, store, mesh, placements, True)
    return out
