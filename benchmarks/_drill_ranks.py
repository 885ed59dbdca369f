"""The rank side of benchmarks/bench_tiers_drill.py: the training state and the three ways
to checkpoint it, driven over a pipe (``_common.PipedRanks``).

The state is ``Layout.tensors`` fp32 tensors of ``(rows, COLS)``, each sharded by rows over
the ranks (``castore.Shard`` for castore, a ``Shard(0)`` DTensor for DCP). Step 1 makes every
block; each later step gives ``Layout.changed`` tensors new values, in turn, so about the
same share of the bytes is new at every step. A block's values follow from (tensor, the
number of times it changed, rank) alone: any process can rebuild the state of any step,
and every restore is checked against it.

Commands (each answered with a dict, ``{"error": traceback}`` on failure):

``("open", way, resume)``   open this rank's handle of ``way`` (a dict: ``"way"`` is
                            "tiered", "castore", "plain": a node's fast tier opened with
                            castore.open, or "dcp"); with ``resume``, restore the
                            newest generation first and continue from its step
``("step", step)``          one training step: change the state, compute (a sleep of
                            ``Layout.step_s``), save when the way saves at this step
``("restore", way)``        open a fresh handle of ``way``, restore its newest state,
                            close it; the seconds it took, where the bytes came from
``("stop",)``               close the handle (a tiered store promotes what it owes) and exit
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _common import join_gloo

import castore
import castore.dist

RUN = "drill"
COLS = 1024  # 4 KiB rows of fp32
COLLECTIVE_TIMEOUT = 300.0


@dataclass(frozen=True)
class Layout:
    world: int
    nodes: int
    tensors: int
    rows: int  # global rows of each tensor: a multiple of ``world``
    changed: int  # tensors given new values at every step after the first
    step_s: float  # the simulated compute of one step
    seed: int = 25

    @property
    def per_node(self) -> int:
        return self.world // self.nodes

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    @property
    def local_rows(self) -> int:
        return self.rows // self.world

    @property
    def state_bytes(self) -> int:
        return self.tensors * self.rows * COLS * 4

    def name(self, tensor: int) -> str:
        return f"layer{tensor:03d}"

    def changed_at(self, step: int) -> list[int]:
        """The tensors given new values at ``step`` (every one at step 1)."""
        if step <= 1:
            return list(range(self.tensors))
        first = (step - 2) * self.changed
        return sorted({(first + k) % self.tensors for k in range(self.changed)})

    def version(self, tensor: int, step: int) -> int:
        """How many times ``tensor`` got new values after step 1, up to ``step``."""
        return sum(tensor in self.changed_at(s) for s in range(2, step + 1))

    def block(self, tensor: int, step: int, rank: int) -> np.ndarray:
        """``rank``'s rows of ``tensor`` as they are after ``step``."""
        rng = np.random.default_rng([self.seed, tensor, self.version(tensor, step), rank])
        return rng.standard_normal((self.local_rows, COLS), dtype=np.float32)


class Rank:
    """One rank of the drill's job: its blocks and its open way of saving them."""

    def __init__(self, layout: Layout, rank: int) -> None:
        self.layout = layout
        self.rank = rank
        self.blocks = [layout.block(t, 1, rank) for t in range(layout.tensors)]
        self.way: dict[str, Any] = {}
        self.store: Any = None
        self.pending: Any = None  # the in-flight async save (castore PendingSave, DCP future)
        self.publish_s: dict[int, float] = {}  # step -> seconds from its save call to published
        self.async_group: Any = None
        self.mesh: Any = None

    # -- the state in each framework's terms -----------------------------------------

    def shards(self, blocks: list[Any]) -> dict[str, Any]:
        rows, offset = self.layout.rows, self.rank * self.layout.local_rows
        return {
            self.layout.name(t): castore.Shard(block, (rows, COLS), (offset, 0))
            for t, block in enumerate(blocks)
        }

    def dtensors(self, blocks: list[np.ndarray]) -> dict[str, Any]:
        import torch
        from torch.distributed.tensor import DTensor, Shard

        return {
            self.layout.name(t): DTensor.from_local(
                torch.from_numpy(block), self.device_mesh(), [Shard(0)], run_check=False
            )
            for t, block in enumerate(blocks)
        }

    def device_mesh(self) -> Any:
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh("cpu", (self.layout.world,))
        return self.mesh

    def wrong_blocks(self, blocks: list[np.ndarray], step: int) -> list[str]:
        """The tensors whose restored block is not bitwise the state after ``step``."""
        layout = self.layout
        return [
            layout.name(t)
            for t, block in enumerate(blocks)
            if block.tobytes() != layout.block(t, step, self.rank).tobytes()
        ]

    # -- training ------------------------------------------------------------------

    def open(self, way: dict[str, Any], resume: bool) -> dict[str, Any]:
        self.way = way
        self.store = open_way(way, self.layout.node_of(self.rank))
        if way["way"] == "dcp":
            import torch.distributed as dist

            # async_save's thread runs collectives: never on the group the job uses.
            self.async_group = dist.new_group(backend="gloo")
            self.device_mesh()
        if "warmup" in way:
            self.warm_up(way)
        step = 0
        if resume:
            blocks, restored = self.load_newest(self.store, way)
            step = restored["step"]
            wrong = self.wrong_blocks(blocks, step)
            if wrong:
                raise AssertionError(f"resumed step {step} with wrong values in {wrong}")
            self.blocks = [
                self.layout.block(t, step, self.rank) for t in range(self.layout.tensors)
            ]
        return {"step": step}

    def warm_up(self, way: dict[str, Any]) -> None:
        """One untimed save of the way into a place of its own: the saves that count do
        not pay first-call costs (imports, planners, thread pools)."""
        if way["way"] == "dcp":
            import torch.distributed.checkpoint as dcp

            writer = dcp.FileSystemWriter(way["warmup"])
            state = self.dtensors(list(self.blocks))
            future = dcp.async_save(state, storage_writer=writer, process_group=self.async_group)
            assert isinstance(future, Future)  # the default stager is synchronous
            future.result()
            return
        with castore.open(way["warmup"]) as store:
            shards = self.shards(list(self.blocks))
            castore.dist.save(store, shards, run=RUN, step=0, blocking=False).result()

    def step(self, step: int) -> dict[str, Any]:
        layout = self.layout
        for tensor in layout.changed_at(step):
            self.blocks[tensor] = layout.block(tensor, step, self.rank)
        time.sleep(layout.step_s)  # the step's compute
        state_at = time.time()
        started = time.perf_counter()
        pending = self.pending
        if isinstance(pending, castore.PendingSave) and pending.done():
            self.publish_s[pending.step] = pending.timings["total"]
        saved = self.save(step)
        return {
            "state_at": state_at,
            "save_s": time.perf_counter() - started,
            "saved": saved,
            "publish_s": dict(self.publish_s),
        }

    def save(self, step: int) -> bool:
        """castore saves with blocking=False (the tiered way every step, into the fast
        tiers; today's castore every ``every`` steps); DCP's async_save every ``every``."""
        way, every = self.way["way"], self.way["every"]
        if way != "tiered" and step % every:
            return False
        if way in ("tiered", "castore"):
            self.pending = castore.dist.save(
                self.store, self.shards(list(self.blocks)), run=RUN, step=step, blocking=False
            )
            return True
        import torch.distributed.checkpoint as dcp

        if self.pending is not None:
            self.pending.result()
        writer = dcp.FileSystemWriter(str(Path(self.way["durable"]) / f"step-{step:06d}"))
        called = time.perf_counter()
        self.pending = dcp.async_save(
            self.dtensors(list(self.blocks)), storage_writer=writer, process_group=self.async_group
        )
        self.pending.add_done_callback(
            lambda _: self.publish_s.__setitem__(step, time.perf_counter() - called)
        )
        return True

    def close(self) -> None:
        if self.pending is not None and self.way["way"] == "dcp":
            self.pending.result()
        if self.store is not None:
            self.store.close()

    # -- restore -------------------------------------------------------------------

    def restore(self, way: dict[str, Any]) -> dict[str, Any]:
        """Open ``way`` afresh and restore its newest state; timed from the open."""
        import torch.distributed as dist

        if way["way"] == "dcp":
            self.device_mesh()  # made once per job, before any restore is timed
        dist.barrier()
        started = time.perf_counter()
        store = open_way(way, self.layout.node_of(self.rank))
        opened = time.perf_counter()
        try:
            blocks, out = self.load_newest(store, way)
            seconds = time.perf_counter() - started  # every rank has its state back
        finally:
            if store is not None:
                store.close()
        wrong = self.wrong_blocks(blocks, out["step"])
        phases = {"open": opened - started, **out.get("timings", {})}
        # What the load's own phases do not cover (tiers: the nodes' discovery, the fetch).
        phases["load: rest"] = out["load_s"] - sum(out.get("timings", {}).values())
        phases["total"] = seconds
        return {**out, "seconds": seconds, "open_s": opened - started, "wrong": wrong,
                "phases": phases}  # fmt: skip

    def load_newest(
        self, store: Any, way: dict[str, Any]
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        """The newest state of ``way`` from ``store``, in new blocks, and how it was read."""
        layout = self.layout
        shape = (layout.local_rows, COLS)
        blocks = [np.full(shape, np.nan, np.float32) for _ in range(layout.tensors)]
        started = time.perf_counter()
        report: dict[str, Any] = {}
        if way["way"] == "dcp":
            step = self.dcp_restore(Path(way["durable"]), blocks)
            sources = {"durable": sum(b.nbytes for b in blocks)}
        else:
            result = castore.dist.load(store, RUN, self.shards(blocks))
            gen = result.report.generation
            step = gen.step
            place = "fast" if way["way"] == "plain" else "durable"
            sources = dict(result.report.bytes_by_source) or {place: result.report.bytes_read}
            report = {
                "generation": gen.id,
                "skipped": [s.generation for s in result.report.skipped],
                "timings": dict(result.report.timings),
            }
        load_s = time.perf_counter() - started
        return blocks, {"load_s": load_s, "step": step, "sources": sources, **report}

    def dcp_restore(self, folder: Path, blocks: list[np.ndarray]) -> int:
        """DCP's newest complete checkpoint (a step folder with its ``.metadata``)."""
        import torch.distributed.checkpoint as dcp

        complete = sorted(p for p in folder.glob("step-*") if (p / ".metadata").exists())
        if not complete:
            raise FileNotFoundError(f"no complete DCP checkpoint in {folder}")
        dcp.load(self.dtensors(blocks), storage_reader=dcp.FileSystemReader(str(complete[-1])))
        return int(complete[-1].name.split("-")[1])


def open_way(way: dict[str, Any], node: int) -> Any:
    """This rank's store of ``way`` (None for DCP, which writes folders)."""
    if way["way"] == "tiered":
        return castore.open_tiered(
            fast=way["fast"][node],
            durable=way["durable"],
            durable_every=way["every"],
            replicas=way["replicas"],
            durable_rate=way.get("rate"),
        )
    if way["way"] == "castore":
        return castore.open(way["durable"])
    if way["way"] == "plain":  # a node's fast tier as a plain local store
        return castore.open(way["fast"][node])
    return None


def worker(rank: int, port: int, layout: Layout, conn: Any) -> None:
    import torch.distributed as dist

    try:
        join_gloo(rank, port, layout.world, COLLECTIVE_TIMEOUT)
        me = Rank(layout, rank)
    except Exception:  # noqa: BLE001 - the parent must hear about it
        conn.send({"error": traceback.format_exc()})
        return
    conn.send({"ready": True, "pid": os.getpid()})
    handlers: dict[str, Callable[..., dict[str, Any]]] = {
        "open": me.open,
        "step": me.step,
        "restore": me.restore,
    }
    while True:
        command = conn.recv()
        if command[0] == "stop":
            break
        try:
            reply = handlers[command[0]](*command[1:])
        except Exception:  # noqa: BLE001 - the parent must hear about it
            reply = {"error": traceback.format_exc()}
        conn.send(reply)
    try:
        me.close()
        conn.send({"closed": True})
    except Exception:  # noqa: BLE001 - the parent must hear about it
        conn.send({"error": traceback.format_exc()})
    dist.destroy_process_group()
