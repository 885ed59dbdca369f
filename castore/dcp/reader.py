"""``CastoreReader``: a DCP ``StorageReader`` that loads a castore generation.

A read item fetches only the chunks that overlap its element range; every
rank verifies all it reads where it lies in the store's memory map, the ranks
agree, and only then are the bytes copied once into the planner's tensors
(invariant 4).
"""

from __future__ import annotations

import io
import os
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from castore.core import fencing
from castore.core.chunkread import ChunkRequest, read_agree_deliver
from castore.core.history import Generation
from castore.core.reading import allocate, box_requests
from castore.dcp.metadata import metadata_from_wire, pickle_for_planner
from castore.dcp.stores import StoreUser, closes_store, parse_checkpoint_id
from castore.dist.comm import DEFAULT_TIMEOUT, Group, attempt, describe, raise_failures
from castore.errors import CorruptObjectError, RefConflictError
from castore.format.dcplayout import BYTES, TENSORS, stored_name
from castore.format.dtypes import name_of_torch_dtype
from castore.format.hashing import Digest
from castore.format.layout import Box
from castore.format.tree import torch_bytes
from castore.repo.records import validate_run_name
from castore.store import Store


def _writable(target: torch.Tensor, dtype: str) -> np.ndarray | None:
    """The target's own bytes, when chunks can be delivered straight into them."""
    if target.device.type != "cpu" or not target.is_contiguous():
        return None
    if name_of_torch_dtype(target.dtype, "target") != dtype:
        return None
    return torch_bytes(target)


class CastoreReader(StoreUser, StorageReader):
    """A DCP ``StorageReader`` that loads a castore generation of ``run``."""

    def __init__(
        self,
        store: Store | str | os.PathLike[str] | None = None,
        *,
        run: str | None = None,
        generation: int | str = "latest",
        timeout: float = DEFAULT_TIMEOUT,
        process_group: Any = None,
        collective: bool = True,
    ) -> None:
        super().__init__()
        self._store_arg: Store | str | os.PathLike[str] | None = store
        self._opened: Store | None = None
        self.run = validate_run_name(run) if run is not None else None
        self.process_group = process_group
        # False for a load by some ranks alone (dcp.load(..., no_dist=True) inside a group).
        self.collective = collective
        self.generation_spec = generation
        self.timeout = timeout
        self.root_hex: str | None = None
        self.generation: Generation | None = None

    @classmethod
    def from_checkpoint_id(cls, checkpoint_id: str) -> CastoreReader:
        path, run, generation = parse_checkpoint_id(checkpoint_id)
        return cls(path, run=run, generation=generation)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            path, run, generation = parse_checkpoint_id(checkpoint_id)
            self._store_arg, self.run, self.generation_spec = path, run, generation
        self.root_hex = None

    @closes_store
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Resolve the generation (on the coordinator) and rebuild DCP's Metadata."""
        assert self.run is not None
        newest = fencing.newest_published(self.store.refs, self.run)  # before resolving
        digest, root = self.store.resolve_root(self.run, self.generation_spec)
        self.generation = Generation.from_root(digest, root)
        fencing.record_loaded(  # a resume point
            self.store.refs, self.run, digest, root.step, generation=root.generation, newest=newest
        )
        wire = self.generation.metadata.get("dcp")
        if not isinstance(wire, dict):
            raise CorruptObjectError(
                f"{self.run}@{root.generation} was not saved through castore.dcp", run=self.run
            )
        return metadata_from_wire(wire, {"castore_run": self.run, "castore_root": digest.hex})

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.root_hex = metadata.storage_data["castore_root"]
        if kwargs.get("use_collectives") is False:
            self.collective = False

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Each rank says which root it resolved; the coordinator checks they agree.
        return replace(plan, storage_data={"castore_root": self.root_hex})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Invariant 5: every rank must read the one generation (DCP resolves per rank)."""
        roots = {(plan.storage_data or {}).get("castore_root") for plan in plans}
        if len(roots) > 1:
            raise RefConflictError(
                f"the ranks resolved different generations of {self.run!r} (the ref moved "
                "while they read it); load again, or pin generation=",
                run=self.run,
            )
        return plans

    @closes_store
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        store, run = self.store, self.run
        assert run is not None and self.root_hex is not None
        comm = Group(self.process_group, 0, self.timeout) if self.collective else None
        agreed = False

        def agree(error: BaseException | None) -> None:
            # Every rank verified all it reads before any rank writes a target (invariant 4).
            nonlocal agreed
            agreed = True
            if comm is None:
                if error is not None:
                    raise error
                return
            outcomes = comm.all_gather({"error": describe(error)}, "dcp.read: agree")
            raise_failures(outcomes, comm, error)

        def plan_reads() -> tuple[list[Any], list[Any], list[ChunkRequest], dict[str, Any]]:
            digest = Digest.from_hex(self.root_hex or "")
            root = store.read_root(digest, run=run)
            entries = store.tensor_entries(root)
            where: dict[str, Any] = {"run": run, "generation": root.generation}
            blobs, targets, requests = [], [], []
            for item in plan.items:
                fqn = item.storage_index.fqn
                if item.type == LoadItemType.BYTE_IO:
                    boxes = entries.get(stored_name(BYTES, fqn))
                    if not boxes:
                        raise CorruptObjectError(f"no saved bytes item {fqn!r}", **where)
                    array = store.read_tensor(boxes, "numpy", {**where, "tensor": fqn})
                    blobs.append((item, pickle_for_planner(array.tobytes(), fqn, where)))
                    continue
                boxes = entries.get(stored_name(TENSORS, fqn))
                saved_offsets = tuple(item.storage_index.offset or ())
                entry = next((b for b in boxes or [] if tuple(b.offsets) == saved_offsets), None)
                if entry is None:
                    raise CorruptObjectError(
                        f"no saved chunk of {fqn!r} at offsets {list(saved_offsets)}", **where
                    )
                start = [o + s for o, s in zip(saved_offsets, item.storage_offsets, strict=True)]
                region = Box(tuple(start), tuple(item.lengths))
                inside = Box(entry.offsets, entry.local_shape).intersect(region) == region
                if region.numel and not inside:
                    raise CorruptObjectError(
                        f"DCP metadata places {fqn!r} at {start}+{list(item.lengths)}, outside "
                        f"its saved box at {list(saved_offsets)}+{list(entry.local_shape)}",
                        **where,
                    )
                target = planner.resolve_tensor(item).detach()  # not written before `agree`
                flat = _writable(target, entry.dtype)
                staging = None
                if flat is None:  # another device, dtype or layout: stage, copy once agreed
                    staging, flat = allocate(entry.dtype, region.shape, "torch")
                requests += box_requests(entry, region, region, flat)
                targets.append((item, target, staging))
            return blobs, targets, requests, where

        planned, failure = attempt(plan_reads)
        if failure is not None:
            agree(failure)
        blobs, targets, requests, where = planned
        try:
            # Verified where they lie in the memory map, delivered only after `agree`.
            read_agree_deliver(store.backend, requests, store.read_counters, where, agree)
        except Exception as exc:
            if not agreed:
                agree(exc)
            raise
        for item, value in blobs:
            planner.load_bytes(item, io.BytesIO(value))
        for item, target, staging in targets:
            if staging is not None:
                target.copy_(staging.reshape(target.shape))
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future
