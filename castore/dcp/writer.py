"""``CastoreWriter``: a DCP ``StorageWriter`` that saves a castore generation.

Every tensor write item is one box of its global tensor, chunked into the CAS
like every castore tensor (unchanged chunks are never written twice); a bytes
item is stored as castore's msgpack encoding (:mod:`castore.dcp.metadata`).
``finish`` publishes through castore's compare-and-swap ref advance, after
re-reading every rank's shard manifest and checking coverage and chunk
presence: nothing is visible before ``finish`` succeeds.

On a tiered store whose ranks span several nodes the ranks publish together
inside ``write_data`` instead, through castore.dist's two-phase commit
(:mod:`castore.dcp.nodes`), and ``finish`` checks what they published.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, SupportsIndex

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from castore.core.chunkio import WriteStats
from castore.core.commit import (
    CheckedShards,
    claim_writer,
    commit_objects,
    encode_metadata,
    framework_versions,
    make_root,
    publish_shards,
    root_stats,
    write_shard,
)
from castore.core.history import Generation
from castore.dcp.metadata import metadata_to_wire, plain_bytes, state_tree
from castore.dcp.nodes import planned_metadata, root_content, save_on_nodes
from castore.dcp.stores import SCHEME, StoreUser, closes_store, parse_checkpoint_id
from castore.dist.comm import DEFAULT_TIMEOUT, Group, attempt
from castore.dist.groupcommit import RootContent
from castore.errors import CorruptObjectError
from castore.format.dcplayout import BYTES, TENSORS, stored_name
from castore.format.objects import GenerationRoot
from castore.format.shard import Shard
from castore.format.tree import EncodedTree, encode_state, escape_key
from castore.repo.records import validate_run_name
from castore.store import Store, check_step


class CastoreWriter(StoreUser, StorageWriter):
    """A DCP ``StorageWriter`` that saves a castore generation of ``run``."""

    def __init__(
        self,
        store: Store | str | os.PathLike[str] | None = None,
        *,
        run: str | None = None,
        step: SupportsIndex = 0,
        timeout: float = DEFAULT_TIMEOUT,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        self._store_arg: Store | str | os.PathLike[str] | None = store
        self._opened: Store | None = None
        self.run = validate_run_name(run) if run is not None else None
        self.step = check_step(step)
        self.timeout = timeout
        # DCP's group (None: the default one): castore's own exchanges on several nodes.
        self.process_group = process_group
        self.is_coordinator = False
        self.rank: int | None = None  # in DCP's group, when DCP says it
        # Set by finish on the coordinator (on several nodes: by write_data, on every rank).
        self.generation: Generation | None = None
        self.started = time.perf_counter()
        self._published_wire: dict[str, Any] | None = None  # several nodes: the root's

    @classmethod
    def from_checkpoint_id(cls, checkpoint_id: str, *, step: SupportsIndex = 0) -> CastoreWriter:
        path, run, _ = parse_checkpoint_id(checkpoint_id)
        return cls(path, run=run, step=step)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            path, run, _ = parse_checkpoint_id(checkpoint_id)
            self._store_arg, self.run = path, run
        self.generation = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.started = time.perf_counter()  # the root's seconds: from here to the publish
        self._published_wire = None

    def storage_meta(self) -> StorageMeta | None:
        where = self._store_arg.path if isinstance(self._store_arg, Store) else self._store_arg
        return StorageMeta(checkpoint_id=f"{SCHEME}{where}/{self.run}")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # A tiered store's node (castore.tiers): several of them take castore.dcp.nodes.
        node = getattr(self._store_arg, "node_id", None)
        return replace(plan, storage_data={"castore_node": node})

    def spans_nodes(self, plans: list[SavePlan]) -> bool:
        """Whether the ranks' stores are tiered stores on several nodes."""
        return len({(plan.storage_data or {}).get("castore_node") for plan in plans}) > 1

    @closes_store
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator proposes the generation; ranks with items get shard indices.

        On several nodes the ranks propose and publish together in ``write_data``
        (castore.dcp.nodes): every rank learns who coordinates."""
        assert self.run is not None
        if self.spans_nodes(plans):
            coordinator = self._rank_in_group()
            return [
                replace(plan, storage_data={"nodes": True, "coordinator": coordinator})
                for plan in plans
            ]
        parent = self.store.refs.read(self.run)
        # Refused before any rank writes when this job may not save the run
        # (castore.core.fencing); finish checks again under the store lock.
        claim_writer(self.store, self.run, parent, self.step, warn=False)
        writers = [i for i, plan in enumerate(plans) if plan.items]
        proposal = {
            "generation": parent.generation + 1 if parent else 1,
            "parent": None if parent is None else [parent.generation, parent.root.hex, parent.time],
            "writers": len(writers),
        }
        return [
            replace(
                plan, storage_data={**proposal, "shard": writers.index(i) if plan.items else -1}
            )
            for i, plan in enumerate(plans)
        ]

    def _rank_in_group(self) -> int:
        if self.rank is not None:
            return int(self.rank)
        return dist.get_rank(self.process_group) if dist.is_initialized() else 0

    @closes_store
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        store, run = self.store, self.run
        assert run is not None
        proposal = plan.storage_data
        results: list[WriteResult] = []
        if proposal.get("nodes"):
            results = self._write_on_nodes(plan, planner)
        elif plan.items:
            tree, sizes = _items_tree(plan, planner, run)
            encoded = encode_state(tree, allow_rank_local=False)
            with store.save_lock():
                shard = write_shard(
                    store,
                    encoded,
                    run=run,
                    generation=proposal["generation"],
                    rank=proposal["shard"],
                    midway_fault="dist.worker_mid_shard",
                )
                commit_objects(store, [(shard.digest, shard.data)])
            stats = vars(shard.stats)
            for item in plan.items:
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=sizes[_stored_name(item)],
                        storage_data={
                            "shard": shard.digest.hex(),
                            "rank": proposal["shard"],
                            "stats": stats,
                        },
                    )
                )
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_on_nodes(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Every rank: write this rank's items and publish with the others (a collective
        call: castore.dcp.nodes)."""
        store, run = self.store, self.run
        assert run is not None
        comm = Group(self.process_group, plan.storage_data["coordinator"], self.timeout)

        def prepare() -> tuple[EncodedTree, dict[str, int], RootContent | None]:
            tree, sizes = _items_tree(plan, planner, run)
            content = None
            if comm.is_coordinator:
                metadata = planned_metadata(planner)
                content = root_content(metadata)
                self._published_wire = metadata_to_wire(metadata)
            return encode_state(tree, allow_rank_local=False), sizes, content

        prepared, failure = attempt(prepare)
        encoded, sizes, content = prepared if prepared is not None else (None, {}, None)
        digest = save_on_nodes(store, comm, run, self.step, encoded, content, failure, self.started)
        self.generation = Generation.from_root(digest, store.read_root(digest, run=run))
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=sizes[_stored_name(item)],
                storage_data={"root": digest.hex, "rank": comm.rank},
            )
            for item in plan.items
        ]

    @closes_store
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Check every rank's shard, then commit the root and advance the ref.

        On several nodes the ranks published in ``write_data``: check that it was
        with the Metadata DCP finishes with."""
        store, run = self.store, self.run
        assert run is not None
        if self._published_wire is not None:
            if metadata_to_wire(metadata) != self._published_wire:
                raise CorruptObjectError(
                    "DCP finished with other Metadata than its planner gave write_data, "
                    "which published the generation with the planner's",
                    run=run,
                    generation=self.generation.id if self.generation else None,
                )
            return
        shard_digests: dict[int, str] = {}
        stats = WriteStats()
        for rank_results in results:
            for result in rank_results[:1]:
                info = result.storage_data
                shard_digests[info["rank"]] = info["shard"]
                s = info["stats"]
                stats += WriteStats.from_wire(s)
        with store.save_lock():
            parent = store.refs.read(run)
            generation = parent.generation + 1 if parent else 1
            writer = claim_writer(store, run, parent, self.step)
            where = {"run": run, "generation": generation}
            missing = sorted(set(range(len(shard_digests))) - set(shard_digests))
            if missing:
                raise CorruptObjectError(f"no shard manifest for writer {missing[0]}", **where)
            digests = [bytes.fromhex(shard_digests[i]) for i in range(len(shard_digests))]

            def build_root(checked: CheckedShards) -> GenerationRoot:
                return make_root(
                    run=run,
                    generation=generation,
                    step=self.step,
                    parent=parent,
                    world_size=len(checked.manifests),
                    shards=checked.digests,
                    state=state_tree(metadata),
                    metadata=encode_metadata({"dcp": metadata_to_wire(metadata)}),
                    stats=root_stats(
                        stats,
                        time.perf_counter() - self.started,
                        len(checked.entries),
                        written_bytes=stats.stored,
                    ),
                    frameworks=framework_versions(),
                    writer=writer,
                )

            published, root = publish_shards(
                store,
                run=run,
                generation=generation,
                parent=parent,
                shards=digests,
                build_root=build_root,
                hint=": the ref moved during the save; save again",
            )
        self.generation = Generation.from_root(published, root)


def _items_tree(
    plan: SavePlan, planner: SavePlanner, run: str
) -> tuple[dict[str, Any], dict[str, int]]:
    """This rank's write items as a state tree of boxes, and each item's bytes by name."""
    tree: dict[str, Any] = {TENSORS: {}, BYTES: {}}
    sizes: dict[str, int] = {}
    for item in plan.items:
        data = planner.resolve_data(item)
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            raw = plain_bytes(data, fqn)
            blob = np.frombuffer(raw, dtype=np.uint8).copy()
            tree[BYTES][escape_key(fqn)] = Shard(blob, (len(raw),), (0,))
            sizes[stored_name(BYTES, fqn)] = len(raw)
            continue
        assert isinstance(data, torch.Tensor) and item.tensor_data is not None
        tensor = data.detach()
        chunk = item.tensor_data.chunk
        key = escape_key(fqn)
        if key in tree[TENSORS]:
            raise CorruptObjectError(
                f"DCP gave this rank two chunks of {fqn!r}; castore stores one box "
                "per tensor per rank",
                run=run,
            )
        tree[TENSORS][key] = Shard(tensor, item.tensor_data.size, chunk.offsets)
        sizes[stored_name(TENSORS, fqn)] = tensor.numel() * tensor.element_size()
    return tree, sizes


def _stored_name(item: WriteItem) -> str:
    kind = BYTES if item.type == WriteItemType.BYTE_IO else TENSORS
    return stored_name(kind, item.index.fqn)
