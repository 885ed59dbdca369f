"""Per-rank functions for tests/test_dcp_tiers.py, run by tests/helpers/dist_harness.py:
``torch.distributed.checkpoint``'s own ``save`` and ``load`` through castore.dcp on a
tiered store whose ranks span several nodes (castore.tiers.nodes).

``config`` is the keyword arguments of ``castore.open_tiered`` where ``nodes`` (one fast
directory per node) splits the ranks evenly over the nodes, or ``{"durable_only": PATH}``
(the durable store alone, opened as a plain store). Two states: ``plain`` (eight plain
tensors and a step: DCP's planner gives each tensor to one rank, so every rank writes
some) and ``fsdp`` (dcp_workers' FSDP2 model and Adam state: every rank writes its
blocks). Results are snapshots (dcp_workers.snapshot: DTensors gathered to full tensors)
that the parent compares bitwise.
"""

from __future__ import annotations

from typing import Any

import dcp_workers as w
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import castore
from castore.dcp import CastoreReader, CastoreWriter

STEP_KEY = "step"


class UnroutedWriter(CastoreWriter):
    """Broken control: the writer as if it did not see several nodes (one store's
    sequence: the coordinator re-reads every shard in its own node's store)."""

    def spans_nodes(self, plans: list[Any]) -> bool:
        return False


class PlannerWithoutMetadata(DefaultSavePlanner):
    """A planner that keeps no global Metadata where the writer looks for it."""

    def create_global_plan(self, all_plans: list[Any]) -> Any:
        plans, metadata = super().create_global_plan(all_plans)
        del self.metadata
        return plans, metadata


def open_store(rank: int, world_size: int, config: dict[str, Any]) -> castore.Store:
    if "durable_only" in config:
        return castore.open(config["durable_only"])
    options = dict(config)
    nodes = options.pop("nodes")
    options["fast"] = nodes[rank * len(nodes) // world_size]
    return castore.open_tiered(**options)


def plain_state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {f"w{i}": torch.randn(40 + 8 * i, generator=generator) for i in range(8)}
    return {"model": tensors, STEP_KEY: seed}


def plain_target() -> dict[str, Any]:
    state = plain_state(0)
    for tensor in state["model"].values():
        tensor.fill_(w.SENTINEL)
    state[STEP_KEY] = -1
    return state


def _save(world_size: int, store: castore.Store, op: dict[str, Any]) -> dict[str, Any]:
    if op["kind"] == "plain":
        state = plain_state(op["seed"])
    else:
        model, optim = w.build(world_size, op["seed"], train_steps=1)
        state = w.state_of(model, optim)
    saved = w.snapshot(state)  # before the save: what it must hold
    cls = UnroutedWriter if op.get("unrouted") else CastoreWriter
    writer = cls(store, run=op["run"], step=op["step"], timeout=op.get("timeout", 60.0))
    planner = PlannerWithoutMetadata() if op.get("planner") == "without_metadata" else None
    try:
        dcp.save(state, storage_writer=writer, planner=planner)
    except BaseException as exc:
        return {"error": w.error_of(exc), "saved": saved}
    generation = writer.generation.id if writer.generation is not None else None
    return {"generation": generation, "saved": saved}


def _load(world_size: int, store: castore.Store, op: dict[str, Any]) -> dict[str, Any]:
    reader = CastoreReader(
        store, run=op["run"], generation=op.get("generation", "latest"), timeout=60.0
    )
    try:
        if op["kind"] == "plain":
            state = plain_target()
            dcp.load(state, storage_reader=reader)
            loaded = w.snapshot(state)
        else:
            loaded = w.load_snapshot(world_size, reader)
    except BaseException as exc:
        return {"error": w.error_of(exc)}
    assert reader.generation is not None
    return {
        "generation": reader.generation.id,
        "loaded": loaded,
        "sources": dict(reader.bytes_by_source),
    }


def run_script(
    rank: int, world_size: int, config: dict[str, Any], ops: list[dict[str, Any]]
) -> list[Any]:
    """Run ``ops`` in order on one store handle, one result per op:
    {"op": "save", run, kind, seed, step, [unrouted, planner, timeout]}, {"op": "load", run, kind,
    [generation]}, {"op": "wait_promotions"}."""
    results: list[Any] = []
    with open_store(rank, world_size, config) as store:
        for op in ops:
            if op["op"] == "save":
                results.append(_save(world_size, store, op))
            elif op["op"] == "load":
                results.append(_load(world_size, store, op))
            elif op["op"] == "wait_promotions":
                store.wait_promotions()  # type: ignore[attr-defined]
                results.append(None)
            else:
                raise ValueError(f"unknown op {op['op']!r}")
    return results
