"""Per-rank functions for tests/test_dcp.py (castore as a torch.distributed.checkpoint
backend), run by tests/helpers/dist_harness.py as ``fn(rank, world_size, *args)`` in a gloo group.

The model is sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) over a 1-D CPU
DeviceMesh; its state and its Adam optimizer's go through DCP's own
``get_state_dict`` / ``set_state_dict``. Every comparison is made on a *snapshot*: each
value of the state dict, DTensors gathered to full tensors (``full_tensor()``, a collective
every rank joins), taken after ``set_state_dict`` from the live model and optimizer.

Load targets start filled with SENTINEL (tensors) and SENTINEL-valued hyperparameters, so a
load that writes nothing, or only part, shows.
"""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import castore
from castore.chunkstore.base import Namespace
from castore.dcp import CastoreReader, CastoreWriter
from castore.format.tree import escape_key
from castore.verify import verify_store

# 128-byte chunks: fc1.weight's 6-row block (at world size 4) is three chunks.
CHUNK_SIZE = 128
RUN = "m"
SEED, OTHER_SEED, RACE_SEED = 3, 11, 5
SENTINEL = -7.0
SOLO_TIMEOUT = 3.0  # castore's collective timeout for the lone no_dist load
HYPER = ("lr", "eps", "betas")  # param-group values set to SENTINEL in load targets


class Net(nn.Module):
    """Rows: fc1 24 (even at 4 and 2), fc2 10 (3/3/3/1 at 4), head 2 (two ranks of 4 hold
    an empty shard); a bfloat16 buffer stays a plain (replicated) tensor under FSDP2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 10)
        self.head = nn.Linear(10, 2, bias=False)
        self.register_buffer("scale", torch.randn(40).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def build(world_size: int | None, seed: int, train_steps: int) -> tuple[nn.Module, Any]:
    """The model (FSDP2 over ``world_size`` ranks; None: plain) and its Adam optimizer."""
    torch.manual_seed(seed)
    model = Net()
    if world_size is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in (model.fc1, model.fc2, model.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(seed + 1000)
    for _ in range(train_steps):  # the same batch on every rank: FSDP averages equal grads
        model(torch.randn(4, 16, generator=generator)).square().sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def state_of(model: nn.Module, optim: Any) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def apply(model: nn.Module, optim: Any, state: dict[str, Any]) -> None:
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _walk(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _walk(f"{prefix}.{key}" if prefix else str(key), item, out)
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        for index, item in enumerate(value):
            _walk(f"{prefix}.{index}", item, out)
    else:
        out[prefix] = value


def leaves(state: dict[str, Any]) -> dict[str, Any]:
    """The state's leaves by dotted path (param groups by index)."""
    out: dict[str, Any] = {}
    _walk("", state, out)
    return out


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Every leaf as a full CPU tensor (DTensors gathered: all ranks must call) or a copy."""
    out = {}
    for path, value in leaves(state).items():
        if isinstance(value, DTensor):
            out[path] = value.full_tensor().detach().clone()
        elif isinstance(value, torch.Tensor):
            out[path] = value.detach().clone()
        else:
            out[path] = copy.deepcopy(value)
    return out


def local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def fill_sentinel(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for value in leaves(state).values():
            if isinstance(value, torch.Tensor):
                local(value).fill_(SENTINEL)
    for group in state["optim"]["param_groups"]:
        group["lr"], group["eps"], group["betas"] = SENTINEL, SENTINEL, (SENTINEL, SENTINEL)


def untouched(state: dict[str, Any]) -> dict[str, bool]:
    """For each leaf of a target: does it still hold SENTINEL (every local element)?"""
    flags = {}
    for path, value in leaves(state).items():
        if isinstance(value, torch.Tensor):
            flags[path] = bool((local(value).float() == SENTINEL).all())
        elif path.rsplit(".", 1)[-1] in HYPER:
            flags[path] = value in (SENTINEL, (SENTINEL, SENTINEL))
    return flags


def live_untouched(model: nn.Module, optim: Any) -> bool:
    """The live parameters and optimizer tensors themselves (not the state dict's views)."""
    tensors = [local(p.detach()) for p in model.parameters()]
    tensors += [local(v) for s in optim.state.values() for v in s.values() if torch.is_tensor(v)]
    return bool(tensors) and all(bool((t.float() == SENTINEL).all()) for t in tensors)


def target(world_size: int | None) -> tuple[nn.Module, Any, dict[str, Any]]:
    """A model and optimizer of another seed, their state dict filled with SENTINEL."""
    model, optim = build(world_size, OTHER_SEED, train_steps=0)
    state = state_of(model, optim)  # initializes Adam's state (a zero-lr step)
    fill_sentinel(state)
    return model, optim, state


def load_snapshot(world_size: int | None, reader: Any, **options: Any) -> dict[str, Any]:
    """dcp.load into a fresh target, set_state_dict, and snapshot the live model/optimizer."""
    model, optim, state = target(world_size)
    dcp.load(state, storage_reader=reader, **options)
    apply(model, optim, state)
    return snapshot(state_of(model, optim))


def error_of(exc: BaseException) -> dict[str, Any]:
    """A DCP failure, picklable: its type, message and the per-rank causes DCP gathered."""
    failures = getattr(exc, "failures", None) or {}
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "causes": {
            rank: (type(cause).__name__, tuple(c.__name__ for c in type(cause).__mro__))
            for rank, (cause, _) in failures.items()
        },
    }


def chunk_keys(store: castore.Store) -> list[bytes]:
    return sorted(store.backend.iter_keys(Namespace.CHUNKS))


def tensor_name(fqn: str) -> str:
    """The castore tensor a DCP fqn is stored as (castore.dcp: ``t/<fqn>``)."""
    return f"t/{escape_key(fqn)}"


# -- async_save: a writer that holds the upload until told -----------------------------------


class GatedWriter(CastoreWriter):
    """Test-only: ``write_data`` signals ``entered``, then waits for ``release``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()
        self.release = threading.Event()

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.entered.set()
        if not self.release.wait(60):
            raise TimeoutError("the test never released the gated upload")
        return super().write_data(plan, planner)


# -- the 4-rank script ------------------------------------------------------------------------


def _damage_and_load(
    rank: int, world_size: int, store: castore.Store, digest: bytes, how: str
) -> dict[str, Any]:
    """Rank 0 flips a byte of one chunk (or deletes it); every rank loads; rank 0 puts the
    chunk back."""
    good = None
    if rank == 0:
        good = store.backend.get(Namespace.CHUNKS, digest)
        assert good is not None
        if how == "flip":
            bad = bytearray(good)
            bad[len(bad) // 2] ^= 0xFF
            store.backend.raw_put(Namespace.CHUNKS, digest, bytes(bad))
        else:
            assert store.backend.delete_many(Namespace.CHUNKS, [digest]) == 1
    dist.barrier()
    model, optim, state = target(world_size)
    out: dict[str, Any] = {}
    try:
        dcp.load(state, storage_reader=CastoreReader(store, run=RUN, timeout=60))
    except BaseException as exc:
        out["error"] = error_of(exc)
    out["untouched"] = untouched(state)
    out["live_untouched"] = live_untouched(model, optim)
    dist.barrier()
    if rank == 0:
        assert good is not None
        if how == "flip":
            store.backend.raw_put(Namespace.CHUNKS, digest, good)
        else:
            store.backend.put_many(Namespace.CHUNKS, [(digest, good)])
    dist.barrier()
    return out


def world4_script(rank: int, world_size: int, path: str, ref_dir: str) -> dict[str, Any]:
    """Save at 4 (castore and DCP's FileSystemWriter), load both at 4, re-save unchanged,
    load with a corrupted chunk (read by every rank / by rank 0 only), async_save."""
    out: dict[Any, Any] = {}
    with castore.open(path) as store:
        model, optim = build(world_size, SEED, train_steps=1)
        state = state_of(model, optim)
        out["saved"] = snapshot(state)
        out["locals"] = {  # this rank's own shard sizes: the premise of the layout
            p: tuple(local(v).shape) for p, v in leaves(state).items() if torch.is_tensor(v)
        }

        # 1. save at 4: castore, and DCP's own file system backend as the reference
        writer = CastoreWriter(store, run=RUN, step=1)
        dcp.save(state, storage_writer=writer)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(ref_dir))
        out["generation"] = writer.generation
        reader = CastoreReader(store, run=RUN)
        out["castore@4"] = load_snapshot(world_size, reader)
        out["reader_generation"] = reader.generation
        out["reference@4"] = load_snapshot(world_size, dcp.FileSystemReader(ref_dir))

        # 2. save the unchanged state again: no chunk is written
        dist.barrier()
        before = chunk_keys(store) if rank == 0 else None
        again = CastoreWriter(store, run=RUN, step=2)
        dcp.save(state, storage_writer=again)
        dist.barrier()
        out["resave"] = {
            "generation": again.generation,
            "keys_unchanged": chunk_keys(store) == before if rank == 0 else None,
        }

        # 3. a corrupted chunk: of the replicated buffer (every rank reads it), then of
        #    rows 0-5 of fc1.weight (only rank 0 reads its saved block at world size 4)
        entries = store.tensor_entries(store.resolve_root(RUN)[1])
        buffer_box = entries[tensor_name("model.scale")][0]
        block = next(e for e in entries[tensor_name("model.fc1.weight")] if e.offsets == (0, 0))
        damage = (("all", "flip"), ("rank0", "flip"), ("rank0", "delete"))
        for readers, how in damage:
            box = buffer_box if readers == "all" else block
            digest = box.chunks[0]
            users = [n for n, boxes in entries.items() for b in boxes if digest in b.chunks]
            out[readers, how] = {"users": users}
            out[readers, how].update(_damage_and_load(rank, world_size, store, digest, how))
        out["after_repair"] = load_snapshot(world_size, CastoreReader(store, run=RUN))

        # 4. async_save of a newer state (one more step): published only after the upload
        model, optim = build(world_size, SEED, train_steps=2)
        newer = state_of(model, optim)
        out["async_saved"] = snapshot(newer)
        dist.barrier()
        ids_before = [g.id for g in store.generations(RUN)]
        gated = GatedWriter(store, run=RUN, step=3)
        future = dcp.async_save(newer, storage_writer=gated)
        assert isinstance(future, concurrent.futures.Future), type(future)
        entered = gated.entered.wait(60)
        during = {
            "entered": entered,
            "ids": [g.id for g in store.generations(RUN)],
            "done": future.done(),
        }
        time.sleep(0.2)  # the upload is held: still not done, still nothing published
        during["still_ids"] = [g.id for g in store.generations(RUN)]
        during["still_done"] = future.done()
        gated.release.set()
        future.result(timeout=60)
        dist.barrier()
        out["async"] = {
            "before": ids_before,
            "during": during,
            "after": [g.id for g in store.generations(RUN)],
            "generation": gated.generation,
            "latest": store.resolve(RUN),
        }
        if rank == 0:
            report = verify_store(store, deep=True)
            out["async"]["verify"] = (report.ok, [str(p) for p in report.problems])
        dist.barrier()
        out["async_loaded"] = load_snapshot(world_size, CastoreReader(store, run=RUN))
    return out


# -- the 2-rank script ------------------------------------------------------------------------


class RaceReader(CastoreReader):
    """Test-only: another writer publishes between rank 0's and rank 1's read_metadata.

    Rank 0 resolves "latest", then touches ``flag``; rank 1 waits for it, publishes a new
    generation of the run (a no_dist DCP save of ``publish``), then resolves "latest".
    """

    def __init__(self, *args: Any, flag: str, publish: dict[str, Any] | None, **kw: Any):
        super().__init__(*args, **kw)
        self.flag, self.publish = Path(flag), publish

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self.publish is None:  # rank 0
            metadata = super().read_metadata(*args, **kwargs)
            self.flag.touch()
            return metadata
        deadline = time.monotonic() + 20
        while not self.flag.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        state, self.publish = self.publish, None
        dcp.save(state, storage_writer=CastoreWriter(self.store, run=RUN, step=9), no_dist=True)
        return super().read_metadata(*args, **kwargs)


def world2_script(rank: int, world_size: int, path: str, ref_dir: str, flag: str) -> dict:
    """Load generation 1 (saved at 4) at 2 from castore and the reference; then the race."""
    out: dict[str, Any] = {}
    with castore.open(path) as store:
        reader = CastoreReader(store, run=RUN, generation=1)
        out["castore@2"] = load_snapshot(world_size, reader)
        out["reader_generation"] = reader.generation
        out["reference@2"] = load_snapshot(world_size, dcp.FileSystemReader(ref_dir))

        # "latest" while another job publishes: every rank must read the same generation
        dist.barrier()
        publish = None
        if rank == 1:
            other, other_optim = build(None, RACE_SEED, train_steps=1)
            publish = state_of(other, other_optim)
            out["race_published"] = snapshot(publish)
        racer = RaceReader(store, run=RUN, flag=flag, publish=publish)
        try:
            out["race"] = load_snapshot(world_size, racer)
        except BaseException as exc:
            out["race"] = error_of(exc)
        out["race_generation"] = racer.generation.id if racer.generation else None
        out["race_ids"] = [g.id for g in store.generations(RUN)]

        # rank 0 alone loads generation 1 into a plain model, no_dist=True, while rank 1 does
        # no collective at all (waits for a file): DCP's reader does it, castore's must too
        dist.barrier()
        done = Path(flag + ".solo")
        if rank == 0:
            out["solo_reference"] = load_snapshot(None, dcp.FileSystemReader(ref_dir), no_dist=True)
            started = time.monotonic()
            # A load by this rank alone: the reader must not wait for the others.
            solo = CastoreReader(
                store, run=RUN, generation=1, timeout=SOLO_TIMEOUT, collective=False
            )
            try:
                out["solo"] = load_snapshot(None, solo, no_dist=True)
            except BaseException as exc:
                out["solo"] = error_of(exc)
            out["solo_seconds"] = time.monotonic() - started
            done.touch()
        else:
            deadline = time.monotonic() + 60
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        # no collective after this point: a rank may have left one unanswered
    return out
