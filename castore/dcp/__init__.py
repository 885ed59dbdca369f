"""castore as a storage backend for ``torch.distributed.checkpoint`` (DCP).

``dcp.save(state_dict, storage_writer=CastoreWriter(store, run="r", step=100))``
and ``dcp.load(state_dict, storage_reader=CastoreReader(store, run="r"))`` use
DCP's own planners (DTensor and FSDP resharding included); castore stores the
bytes:

* every tensor write item is one box of its global tensor, chunked into the
  CAS like every castore tensor (so unchanged chunks are never written twice,
  and every read is verified); a bytes item (a non-tensor value, which DCP's
  planner pickles) is unpickled with ``weights_only=True`` and stored as
  castore's msgpack encoding in a uint8 box, so no pickle reaches the store;
* DCP's ``Metadata`` is kept without pickle, as plain values in the root's
  metadata (``{"dcp": ...}``: dtypes by name, sizes and chunk boxes as lists);
* ``finish`` publishes through castore's compare-and-swap ref advance, after
  re-reading every rank's shard manifest and checking coverage and chunk
  presence: a DCP save is a castore generation (``castore log``, ``verify``,
  ``gc``), and nothing is visible before ``finish`` succeeds;
* a read item fetches only the chunks that overlap its element range; every
  rank verifies all it reads where it lies in the store's memory map, the
  ranks agree, and only then are the bytes copied once into the planner's
  tensors (invariant 4).

A checkpoint id ``castore://STORE/RUN[@GEN]`` is accepted by ``reset`` and
``validate_checkpoint_id``. torch 2.13 picks a backend from ``checkpoint_id``
alone only among its own (file system, fsspec), so pass the writer or reader
explicitly: ``storage_writer=CastoreWriter.from_checkpoint_id("castore://...")``.
"""

from __future__ import annotations

import functools
import io
import os
from dataclasses import replace
from typing import Any, SupportsIndex

import msgpack
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from castore.core import fencing
from castore.core.chunkio import WriteStats
from castore.core.chunkread import ChunkRequest, read_agree_deliver
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
from castore.core.history import Generation, split_address
from castore.core.opening import open_address
from castore.core.reading import allocate, box_requests
from castore.dist.comm import DEFAULT_TIMEOUT, Group, attempt, describe, raise_failures
from castore.errors import (
    CastoreError,
    CorruptObjectError,
    InvalidNameError,
    RefConflictError,
    UnsupportedOperationError,
    UnsupportedValueError,
)
from castore.format.dtypes import SUPPORTED_DTYPES, torch_dtype
from castore.format.hashing import Digest
from castore.format.layout import Box
from castore.format.objects import GenerationRoot
from castore.format.shard import Shard
from castore.format.tree import (
    EXT_TENSOR,
    decode_tree,
    encode_state,
    encode_tree,
    escape_key,
    torch_bytes,
)
from castore.repo.records import validate_run_name
from castore.store import Store, check_step

SCHEME = "castore://"
TENSORS = "t"  # state-tree key of DCP's tensors: t/<fqn>
BYTES = "b"  # and of its bytes items: b/<fqn>


def parse_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> tuple[str, str, str]:
    """``castore://STORE/RUN[@GEN]`` -> (store path, run, generation)."""
    text = str(checkpoint_id)
    if not text.startswith(SCHEME):
        raise InvalidNameError(f"not a castore checkpoint id: {text!r} (castore://STORE/RUN[@GEN])")
    path, _, target = text[len(SCHEME) :].rpartition("/")
    if not path or not target:
        raise InvalidNameError(f"castore checkpoint id {text!r} needs a store path and a run")
    run, generation = split_address(target)
    validate_run_name(run)
    return path, run, generation


def _open(store: Store | str | os.PathLike[str]) -> Store:
    if isinstance(store, Store):
        return store
    # As given: Path() would fold an s3:// address into a local directory "s3:".
    return open_address(store)


def _name(kind: str, fqn: str) -> str:
    return f"{kind}/{escape_key(fqn)}"


# -- Metadata without pickle --------------------------------------------------------


def _encode_metadata(md: Metadata) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    blobs: list[str] = []
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            blobs.append(fqn)
            continue
        props = item.properties
        tensors[fqn] = {
            "dtype": str(props.dtype).removeprefix("torch."),
            "size": list(item.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks],
            "requires_grad": bool(props.requires_grad),
            "pin_memory": bool(props.pin_memory),
        }
    return {
        "format": 1,
        "version": md.version,
        "tensors": tensors,
        "bytes": blobs,
        "planner_data": md.planner_data,
    }


def _decode_metadata(wire: dict[str, Any], storage_data: Any) -> Metadata:
    """DCP's Metadata from its stored plain values; anything malformed is damage."""
    try:
        return _metadata_from_wire(wire, storage_data)
    except CastoreError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CorruptObjectError(
            f"the stored DCP metadata is malformed: {type(exc).__name__}: {exc}"
        ) from exc


def _metadata_from_wire(wire: dict[str, Any], storage_data: Any) -> Metadata:
    state: dict[str, Any] = {}
    for fqn, t in wire["tensors"].items():
        if t["dtype"] not in SUPPORTED_DTYPES:
            raise CorruptObjectError(f"the stored DCP metadata gives {fqn!r} dtype {t['dtype']!r}")
        props = TensorProperties(
            dtype=torch_dtype(t["dtype"]),
            requires_grad=t["requires_grad"],
            pin_memory=t["pin_memory"],
        )
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in t["chunks"]
        ]
        state[fqn] = TensorStorageMetadata(props, torch.Size(t["size"]), chunks)
    for fqn in wire["bytes"]:
        state[fqn] = BytesStorageMetadata()
    return Metadata(
        state_dict_metadata=state,
        planner_data=wire.get("planner_data"),
        storage_data=storage_data,
        version=wire.get("version"),
    )


def _plain_bytes(data: Any, fqn: str) -> bytes:
    """A bytes item as castore's own msgpack encoding instead of DCP's pickle.

    DCP's planners serialize non-tensor values with ``torch.save`` (pickle).
    castore keeps pickle out of the store: the value is unpickled with
    ``weights_only=True`` (the restricted unpickler that runs no code) and
    stored as a plain-value tree; a value that is not plain is refused, named.
    """
    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:
        raise UnsupportedValueError(
            f"the non-tensor value at {fqn!r} is not plain data (torch.load with "
            f"weights_only=True refused it: {type(exc).__name__}); castore stores no pickle",
            key_path=fqn,
        ) from exc
    skeleton, _ = encode_tree(value, allow_tensors=False)
    return skeleton


def _pickle_for_planner(encoded: bytes, fqn: str, where: dict[str, Any]) -> bytes:
    """What DCP's planner expects to unpickle, rebuilt from the stored plain value."""
    try:
        value = decode_tree(encoded)
    except CastoreError as exc:
        raise CorruptObjectError(f"bytes item {fqn!r} does not decode: {exc}", **where) from exc
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _skeleton(md: Metadata) -> bytes:
    """The root's state tree: every tensor and bytes item as a tensor reference."""

    def ref(name: str) -> msgpack.ExtType:
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb([name, "torch"], use_bin_type=True))

    tree: dict[str, Any] = {TENSORS: {}, BYTES: {}}
    for fqn, item in md.state_dict_metadata.items():
        kind = BYTES if isinstance(item, BytesStorageMetadata) else TENSORS
        tree[kind][escape_key(fqn)] = ref(_name(kind, fqn))
    return msgpack.packb(tree, use_bin_type=True)


def _closes_store(method: Any) -> Any:
    """Close a store opened from a path when the step returns (futures are done by then)."""

    @functools.wraps(method)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self._release()

    return step


class _StoreUser:
    """The store a writer or reader works on; one opened from a path is closed after
    each step (see :func:`_closes_store`)."""

    _store_arg: Store | str | os.PathLike[str] | None
    _opened: Store | None
    run: str | None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return str(checkpoint_id).startswith(SCHEME)

    @property
    def store(self) -> Store:
        if self._store_arg is None or self.run is None:
            raise InvalidNameError(
                f"{type(self).__name__} needs a store and a run (or a castore:// id)"
            )
        if isinstance(self._store_arg, Store):
            return self._store_arg
        if self._opened is None:
            self._opened = _open(self._store_arg)
        return self._opened

    def _release(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None


# -- writer -------------------------------------------------------------------------


class CastoreWriter(_StoreUser, StorageWriter):
    """A DCP ``StorageWriter`` that saves a castore generation of ``run``."""

    def __init__(
        self,
        store: Store | str | os.PathLike[str] | None = None,
        *,
        run: str | None = None,
        step: SupportsIndex = 0,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        self._store_arg: Store | str | os.PathLike[str] | None = store
        self._opened: Store | None = None
        self.run = validate_run_name(run) if run is not None else None
        self.step = check_step(step)
        self.timeout = timeout
        self.is_coordinator = False
        self.generation: Generation | None = None  # set by finish on the coordinator

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

    def storage_meta(self) -> StorageMeta | None:
        where = self._store_arg.path if isinstance(self._store_arg, Store) else self._store_arg
        return StorageMeta(checkpoint_id=f"{SCHEME}{where}/{self.run}")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # A tiered store's node (castore.tiers): the coordinator refuses several of them.
        node = getattr(self._store_arg, "node_id", None)
        return replace(plan, storage_data={"castore_node": node})

    @_closes_store
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator proposes the generation; ranks with items get shard indices."""
        assert self.run is not None
        nodes = {(plan.storage_data or {}).get("castore_node") for plan in plans}
        if len(nodes) > 1:
            raise UnsupportedOperationError(
                "the DCP writer cannot save to tiered stores on several nodes (each node's "
                "fast tier holds only its ranks' chunks): save with castore.dist.save or "
                "castore.train.TrainState there"
            )
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

    @_closes_store
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        store, run = self.store, self.run
        assert run is not None
        proposal = plan.storage_data
        results: list[WriteResult] = []
        if plan.items:
            tree: dict[str, Any] = {TENSORS: {}, BYTES: {}}
            sizes: dict[str, int] = {}
            for item in plan.items:
                data = planner.resolve_data(item)
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    raw = _plain_bytes(data, fqn)
                    blob = np.frombuffer(raw, dtype=np.uint8).copy()
                    tree[BYTES][escape_key(fqn)] = Shard(blob, (len(raw),), (0,))
                    sizes[_name(BYTES, fqn)] = len(raw)
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
                sizes[_name(TENSORS, fqn)] = tensor.numel() * tensor.element_size()
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
                kind = BYTES if item.type == WriteItemType.BYTE_IO else TENSORS
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=sizes[_name(kind, item.index.fqn)],
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

    @_closes_store
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Check every rank's shard, then commit the root and advance the ref."""
        store, run = self.store, self.run
        assert run is not None
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
                    state=_skeleton(metadata),
                    metadata=encode_metadata({"dcp": _encode_metadata(metadata)}),
                    stats=root_stats(
                        stats, 0.0, len(checked.entries), written_bytes=stats.stored
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


def _writable(target: torch.Tensor, dtype: str) -> np.ndarray | None:
    """The target's own bytes, when chunks can be delivered straight into them."""
    from castore.format.dtypes import name_of_torch_dtype

    if target.device.type != "cpu" or not target.is_contiguous():
        return None
    if name_of_torch_dtype(target.dtype, "target") != dtype:
        return None
    return torch_bytes(target)


# -- reader -------------------------------------------------------------------------


class CastoreReader(_StoreUser, StorageReader):
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

    @_closes_store
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
        return _decode_metadata(wire, {"castore_run": self.run, "castore_root": digest.hex})

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

    @_closes_store
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
                    boxes = entries.get(_name(BYTES, fqn))
                    if not boxes:
                        raise CorruptObjectError(f"no saved bytes item {fqn!r}", **where)
                    array = store.read_tensor(boxes, "numpy", {**where, "tensor": fqn})
                    blobs.append((item, _pickle_for_planner(array.tobytes(), fqn, where)))
                    continue
                boxes = entries.get(_name(TENSORS, fqn))
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


__all__ = ["CastoreReader", "CastoreWriter", "MetadataIndex", "parse_checkpoint_id"]
