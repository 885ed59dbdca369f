"""The ranks of benchmarks/bench_fsdp2.py: an FSDP2 model, its states, three checkpointers.

Each rank joins one gloo group and a 1-D CPU mesh, builds a ``fully_shard``
MLP (``Shape``), trains it, and answers the parent's commands over a pipe
(``benchmarks/_common.PipedRanks``):

  ("save", system, path, which, step)   save ``states[which]``; the call's seconds
  ("load", system, path, which, verify) fill the load targets, then load into them
  ("digests",)                          sha256 of every tensor's full value (a collective)

``system`` is ``castore`` (``castore.dist.save`` / ``castore.dist.load`` on an
LMDB store), ``dcp`` (``dcp.save`` / ``dcp.load`` with ``FileSystemWriter`` /
``FileSystemReader``, their defaults: ``sync_files=True``) or ``tc`` (Meta's
``torch_checkpointing``: a ``CheckpointManager`` with a synchronous saver, a
``DefaultResharder`` on both items, its other defaults). Each is timed from a
barrier to the end of its call, with everything the call needs (the store
opened, the writer, reader or manager built, the targets filled) done before.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import logging
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import join_gloo

import castore
import castore.dist

RUN = "bench"
COLLECTIVE_TIMEOUT = 600.0
LR = 1e-3
BATCH = 8
SYSTEMS = ("castore", "dcp", "tc")


@dataclass(frozen=True)
class Shape:
    """``blocks`` residual MLP blocks (``width`` -> 4 ``width`` -> ``width``) and a final
    LayerNorm; the first ``frozen`` blocks are frozen for the second step."""

    width: int
    blocks: int
    frozen: int

    @property
    def params(self) -> int:
        per_block = 8 * self.width * self.width + 5 * self.width
        return self.blocks * per_block + 2 * self.width

    @property
    def trainable_params(self) -> int:
        """The parameters the second step trains (the unfrozen blocks and the norm)."""
        per_block = 8 * self.width * self.width + 5 * self.width
        return (self.blocks - self.frozen) * per_block + 2 * self.width

    @property
    def state_bytes(self) -> int:
        """fp32 parameters and AdamW's two moments (the per-parameter steps aside)."""
        return 3 * 4 * self.params


def shape_for(state_mib: float, blocks: int, frozen_fraction: float) -> Shape:
    """The width whose state (parameters and two moments, fp32) is nearest ``state_mib``."""
    per_width2 = 3 * 4 * 8 * blocks
    width = max(4, round((state_mib * (1 << 20) / per_width2) ** 0.5))
    return Shape(width, blocks, round(blocks * frozen_fraction))


def build(shape: Shape, mesh: Any, seed: int) -> tuple[Any, Any]:
    """A ``fully_shard`` model (each block, then the root) and its AdamW optimizer."""
    import torch
    from torch.distributed.fsdp import fully_shard

    class Block(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.up = torch.nn.Linear(width, 4 * width)
            self.down = torch.nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(shape.width) for _ in range(shape.blocks))
            self.norm = torch.nn.LayerNorm(shape.width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    torch.manual_seed(seed)
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train_step(model: Any, optimizer: Any, width: int, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    model(torch.randn(BATCH, width, generator=gen)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def freeze(model: Any, blocks: int) -> None:
    """``requires_grad=False`` on the first ``blocks`` blocks: AdamW skips them (no
    gradient), so their parameters and moments keep their bytes."""
    for block in model.blocks[:blocks]:
        for param in block.parameters():
            param.requires_grad_(False)


def state_of(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def snapshot(node: Any) -> Any:
    """A deep copy whose tensors (DTensors stay DTensors) no later step changes."""
    import copy

    import torch

    if isinstance(node, torch.Tensor):
        return node.detach().clone()
    if isinstance(node, dict):
        return {key: snapshot(value) for key, value in node.items()}
    if isinstance(node, list):
        return [snapshot(value) for value in node]
    return copy.deepcopy(node)


def tensors(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every tensor of a state by key path, in one order on every rank."""
    import torch

    if isinstance(node, torch.Tensor):
        return [(path, node)]
    found: list[tuple[str, Any]] = []
    if isinstance(node, dict):
        for key in sorted(node, key=str):
            found += tensors(node[key], f"{path}/{key}")
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            found += tensors(value, f"{path}/{index}")
    return found


def local(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def fill_nan(state: Any) -> None:
    for _, tensor in tensors(state):
        local(tensor).fill_(float("nan"))


def differing(loaded: Any, expected: Any) -> list[str]:
    """The key paths whose local blocks differ (the same mesh on both sides)."""
    import torch

    want = dict(tensors(expected))
    got = dict(tensors(loaded))
    if want.keys() != got.keys():
        return sorted(want.keys() ^ got.keys())
    return [p for p in want if not torch.equal(local(got[p]), local(want[p]))]


def full_digests(state: Any) -> dict[str, str]:
    """sha256 of each tensor's full value (gathered one at a time, then dropped)."""
    from torch.distributed.tensor import DTensor

    digests = {}
    for path, tensor in tensors(state):
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        digests[path] = hashlib.sha256(whole.contiguous().numpy().tobytes()).hexdigest()
    return digests


# -- the checkpointers ---------------------------------------------------------------------


def tc_manager(system: str, rank: int) -> Any:
    """torch_checkpointing's manager, as close to its defaults as runs here:

    - a synchronous saver (its async default stages into CUDA pinned memory);
    - buffered writes (``use_direct_io=False``): its default ``O_DIRECT`` open
      succeeds on ext4, then ``torch.save``'s unaligned writes fail with EINVAL;
    - a DefaultResharder on both items (without one a load cannot reshard), whose
      multi-rank metadata gather runs on CUDA only: ``gather_on_cpu`` replaces it;
    - ``tc``: each rank fsyncs the files it wrote before the commit (the durability
      its O_DIRECT default gives); ``tc-nosync``: no fsync at all.
    """
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    patch_tc_gather()
    config = CheckpointManager.Config(
        items={key: ItemSpec(resharder=DefaultResharder()) for key in ("model", "optim")},
        save=SyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        pre_finalize_callback=functools.partial(fsync_written, rank) if system == "tc" else None,
    )
    return CheckpointManager(config)


def fsync_written(rank: int, args: Any) -> None:
    """fsync the files this rank wrote into the checkpoint's temporary folder (its
    ``<item>_<rank>.pt``; rank 0 the ``metadata.pkl`` too), before torch_checkpointing's
    barrier and rename."""
    for path in Path(args.path).iterdir():
        if path.name.endswith(f"_{rank}.pt") or (rank == 0 and path.suffix == ".pkl"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def gather_on_cpu(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
    """What ``DefaultMetadataManager._all_gather_pickled_data`` returns (each rank's
    ``data`` by rank), gathered with ``all_gather_object`` instead of CUDA tensors."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, data, group=process_group)
    return dict(enumerate(gathered))


def patch_tc_gather() -> None:
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    DefaultMetadataManager._all_gather_pickled_data = gather_on_cpu  # type: ignore[method-assign]


class Checkpointer:
    """One system's save or load, set up before the clock starts and closed after."""

    def __init__(self, system: str, path: str) -> None:
        self.system, self.path = system, path
        self.handle: Any = None
        if system == "castore":
            self.handle = castore.open(path, create=False)
        elif system.startswith("tc"):
            # A manager per call: one manager caches its sharding metadata and writes
            # it only with its first checkpoint.
            self.handle = tc_manager(system, dist_rank())

    def save(self, state: Any, step: int) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        if self.system == "castore":
            gen = castore.dist.save(
                self.handle, state, run=RUN, step=step, timeout=COLLECTIVE_TIMEOUT
            )
            return {"generation": gen.id, "stats": vars(gen.stats)}
        if self.system == "dcp":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(self.path))
        else:
            self.handle.save(self.path, state)
        return {}

    def load(self, targets: Any) -> None:
        import torch.distributed.checkpoint as dcp

        if self.system == "castore":
            castore.dist.load(self.handle, RUN, targets, timeout=COLLECTIVE_TIMEOUT)
        elif self.system == "dcp":
            dcp.load(targets, storage_reader=dcp.FileSystemReader(self.path))
        else:
            self.handle.load(self.path, into=targets)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def timed(call: Any) -> tuple[float, Any]:
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    started = time.perf_counter()
    value = call()
    return time.perf_counter() - started, value


def rewarm_code() -> None:
    """Touch the code a page-cache drop evicted (no checkpoint's data) before timing."""
    import torch

    from castore.format.hashing import digest_bytes

    digest_bytes(bytes(1 << 20), threads=1)
    torch.zeros(1 << 14).add_(1.0)


# -- the worker ----------------------------------------------------------------------------


def worker(rank: int, port: int, world: int, shape: Shape, trains: bool, conn: Any) -> None:
    """One rank. ``trains``: build the saved states (the 2-rank group); else only the
    load targets (the group that restores at another rank count)."""
    try:
        states, targets = setup(rank, port, world, shape, trains)
    except Exception:  # noqa: BLE001 - the parent must hear about it
        conn.send({"error": traceback.format_exc()})
        return
    conn.send({"ready": True})
    while (command := conn.recv())[0] != "stop":
        try:
            conn.send(answer(command, states, targets))
        except Exception:  # noqa: BLE001
            conn.send({"error": traceback.format_exc()})
    import torch.distributed as dist

    dist.destroy_process_group()


def setup(
    rank: int, port: int, world: int, shape: Shape, trains: bool
) -> tuple[dict[str, Any], Any]:
    """The saved states (``base``: after one step of the whole model; ``frozen``: after
    a second step with the first ``shape.frozen`` blocks frozen) and the load targets
    (another model's state after one step of its own)."""
    from torch.distributed.device_mesh import init_device_mesh

    join_gloo(rank, port, world, COLLECTIVE_TIMEOUT)
    # torch_checkpointing logs a warning per load (plain tensors "treated as replicated",
    # its O_DIRECT read falling back to buffered reads): not this benchmark's output.
    logging.getLogger("torch_checkpointing").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", (world,))
    states: dict[str, Any] = {}
    if trains:
        model, optimizer = build(shape, mesh, seed=0)
        train_step(model, optimizer, shape.width, seed=1)
        states["base"] = snapshot(state_of(model, optimizer))
        freeze(model, shape.frozen)
        train_step(model, optimizer, shape.width, seed=2)
        states["frozen"] = state_of(model, optimizer)
    model, optimizer = build(shape, mesh, seed=10)
    train_step(model, optimizer, shape.width, seed=11)
    return states, state_of(model, optimizer)


def answer(command: tuple[Any, ...], states: dict[str, Any], targets: Any) -> dict[str, Any]:
    kind = command[0]
    if kind == "digests":
        which = command[1]
        return {"digests": full_digests(targets if which == "targets" else states[which])}
    _, system, path, which = command[:4]
    checkpointer = Checkpointer(system, path)
    try:
        if kind == "save":
            rewarm_code()
            seconds, out = timed(lambda: checkpointer.save(states[which], command[4]))
            return {"seconds": seconds, **out}
        fill_nan(targets)
        rewarm_code()
        seconds, _ = timed(lambda: checkpointer.load(targets))
    finally:
        checkpointer.close()
    out = {"seconds": seconds}
    if command[4]:  # verify against the state saved (the same mesh) when it is here
        out["bad"] = differing(targets, states[which]) if which in states else []
    return out
