"""``CastoreReader``: a DCP ``StorageReader`` that loads a castore generation.

A read item fetches only the chunks that overlap its element range; every
rank verifies all it reads where it lies in the store's memory map, the ranks
agree, and only then are the bytes copied once into the planner's tensors
(invariant 4).

On a tiered store whose ranks span several nodes the generation is the one
``castore.dist.load`` would choose, and each rank's chunks come from its node,
a peer node or the durable tier (:mod:`castore.dcp.nodes`).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field, replace
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
from castore.core.reading import allocate, box_requests, read_tensor
from castore.dcp.metadata import metadata_from_wire, pickle_for_planner
from castore.dcp.stores import StoreUser, closes_store, parse_checkpoint_id
from castore.dist.comm import DEFAULT_TIMEOUT, Group, attempt, describe, raise_failures
from castore.dist.restore import every_failure_is_integrity, root_on_nodes
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
        # The chunk bytes each source served this rank's last read_data ("fast", "peer",
        # "durable"; a tiered store only).
        self.bytes_by_source: dict[str, int] = {}
        self._session: Any = None  # on several nodes: castore.tiers.nodes.NodeSession
        self._damage_only = False  # the ranks agreed that a read failed for damage alone

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
        self._session = None
        if self.collective:  # a tiered store on several nodes: castore.dist.load's choice
            comm = Group(self.process_group, 0, self.timeout)
            self._session = self.store.node_session(comm, self.run, restore=True)
        if self._session is not None:
            digest = root_on_nodes(self.store, self.run, self.generation_spec, comm, self._session)
            root = self.store.read_root(digest, run=self.run)
        else:
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
        comm = Group(self.process_group, 0, self.timeout) if self.collective else None
        served_before = self.store.served_by_tier()
        if self._session is None:
            self._read(plan, planner, comm, recheck=None)
            self.bytes_by_source = {
                k: v - served_before.get(k, 0)
                for k, v in self.store.served_by_tier().items()
                if v > served_before.get(k, 0)
            }
        else:
            assert comm is not None
            for recheck in (False, True):
                try:
                    self._read(plan, planner, comm, recheck=recheck)
                    break
                except Exception:
                    if recheck or not self._damage_only:
                        raise
                    # every rank agreed: all read again, damaged copies fetched anew
            self.bytes_by_source = self._session.sources()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read(
        self, plan: LoadPlan, planner: LoadPlanner, comm: Group | None, recheck: bool | None
    ) -> None:
        """Plan, fetch (on several nodes: ``recheck`` is NodeSession.fetch's), verify,
        agree, deliver."""
        store, run, root_hex = self.store, self.run, self.root_hex
        assert run is not None and root_hex is not None
        agreed = False
        self._damage_only = False

        def agree(error: BaseException | None) -> None:
            # Every rank verified all it reads before any rank writes a target (invariant 4).
            nonlocal agreed
            agreed = True
            if comm is None:
                if error is not None:
                    raise error
                return
            outcomes = comm.all_gather({"error": describe(error)}, "dcp.read: agree")
            self._damage_only = every_failure_is_integrity(outcomes)
            raise_failures(outcomes, comm, error)

        planned, failure = attempt(lambda: _plan_reads(store, run, root_hex, plan, planner))
        backend = store.backend
        if recheck is not None:  # every rank fetches, whatever its planning gave
            keys = [] if planned is None else planned.keys()
            session = self._session
            backend, fetched = attempt(lambda: session.fetch(keys, recheck=recheck))
            failure = failure or fetched
        if failure is None:
            assert planned is not None
            _, failure = attempt(lambda: planned.read_bytes_items(backend, store))
        if failure is not None:
            agree(failure)
        assert planned is not None
        try:
            # Verified where they lie in the memory map, delivered only after `agree`.
            read_agree_deliver(backend, planned.requests, store.read_counters, planned.where, agree)
        except Exception as exc:
            if not agreed:
                agree(exc)
            raise
        for item, value in planned.blobs:
            planner.load_bytes(item, io.BytesIO(value))
        for item, target, staging in planned.targets:
            if staging is not None:
                target.copy_(staging.reshape(target.shape))
            planner.commit_tensor(item, target)


@dataclass
class _Reads:
    """One rank's reads of a load plan: its chunk requests into the targets, its bytes
    items (read and decoded before the ranks agree)."""

    where: dict[str, Any]
    requests: list[ChunkRequest] = field(default_factory=list)
    targets: list[Any] = field(default_factory=list)  # (item, target, staging or None)
    bytes_items: list[Any] = field(default_factory=list)  # (item, saved boxes)
    blobs: list[Any] = field(default_factory=list)  # (item, what the planner unpickles)

    def keys(self) -> list[bytes]:
        """Every chunk these reads need."""
        keys = [r.entry.chunks[r.index] for r in self.requests]
        return keys + [c for _, boxes in self.bytes_items for b in boxes for c in b.chunks]

    def read_bytes_items(self, backend: Any, store: Store) -> None:
        for item, boxes in self.bytes_items:
            fqn = item.storage_index.fqn
            where = {**self.where, "tensor": fqn}
            array = read_tensor(backend, store.read_counters, boxes, "numpy", where)
            self.blobs.append((item, pickle_for_planner(array.tobytes(), fqn, self.where)))


def _plan_reads(
    store: Store, run: str, root_hex: str, plan: LoadPlan, planner: LoadPlanner
) -> _Reads:
    root = store.read_root(Digest.from_hex(root_hex), run=run)
    entries = store.tensor_entries(root)
    reads = _Reads({"run": run, "generation": root.generation})
    where = reads.where
    for item in plan.items:
        fqn = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            boxes = entries.get(stored_name(BYTES, fqn))
            if not boxes:
                raise CorruptObjectError(f"no saved bytes item {fqn!r}", **where)
            reads.bytes_items.append((item, boxes))
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
        reads.requests += box_requests(entry, region, region, flat)
        reads.targets.append((item, target, staging))
    return reads
