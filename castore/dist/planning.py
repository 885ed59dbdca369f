"""A restoring rank's plan: which saved boxes each of its targets reads.

castore.dist.load's first phase, before any chunk is read. Onto the saved
layout a rank reads its own shard manifest and rank 0's and finds each target
there whole (:func:`plan_restore`); onto any other layout it reads every
manifest and searches each tensor's boxes by index (castore.core.boxtable).
Each target is checked against what was saved (dtype, global shape, covered
exactly once) before anything is allocated for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from castore.core.boxindex import BoxIndex, covered_once
from castore.core.boxtable import BoxTable
from castore.core.chunkread import ChunkRequest
from castore.core.reading import (
    allocate,
    box_requests,
    check_coverage,
    framework_for,
    grouped_entries,
)
from castore.errors import CoverageError, LayoutMismatchError, TensorNotFoundError
from castore.format.dtensor import dtensor_block, is_dtensor
from castore.format.layout import Box
from castore.format.objects import GenerationRoot, ShardManifest, TensorEntry
from castore.format.shard import NotLoaded, Shard
from castore.format.tree import join_path, tensor_names, torch_bytes


@dataclass
class Target:
    name: str
    live: Any  # the caller's Shard, DTensor or tensor
    tensor: Any  # the array or tensor to fill
    box: Box
    dtype: str  # castore dtype name, the saved tensor's
    flat: Any = None  # the bytes chunks are delivered into (the tensor's own, or staging)
    staging: Any = None  # set when the tensor's memory cannot take bytes directly
    sources: list[TensorEntry] | None = None  # the saved boxes it overlaps (None: all)



def direct_shards(shards: Sequence[ShardManifest], rank: int) -> list[int]:
    """The manifests a rank restoring onto the saved layout reads: its own, and rank 0's
    (which holds what one replica wrote for all); none where it has no own."""
    if not 0 <= rank < len(shards):
        return []
    return sorted({rank, 0})


def plan_restore(
    shards: Sequence[ShardManifest],
    root: GenerationRoot,
    found: list[tuple[str, Any]],
    where: dict[str, Any],
    *,
    direct: list[int] | None = None,
    rest: tuple[str, bool | Callable[[NotLoaded], Any]] | None = None,
) -> tuple[Mapping[str, list[TensorEntry]], list[Target]]:
    """The saved boxes a rank's targets ``found`` read, and the targets planned;
    ``rest``: (framework, like) of ``load_rest``, the saved tensors no target names.

    ``direct``: the manifests to try first (:func:`direct_shards`), with the small
    tensors the root repeats (GenerationRoot.whole). Where each target is a box they
    hold whole, and they name every tensor of the state, that is the plan: the
    coordinator checked before the publish that each tensor's boxes tile it exactly
    once (castore.core.commit.check_shards), so a saved box equal to the target is its
    only source, and the rank reads two manifests, not R. Otherwise (resharding,
    tensors held elsewhere) every manifest is read and searched."""
    if rest is not None and callable(rest[1]):
        rest = (rest[0], _once(rest[1]))  # asked once a tensor, whichever plan holds
    if direct:
        some = _direct_entries([shards[i] for i in direct], root, where)
        if {name for name, _ in tensor_names(root.state)} <= some.keys():
            try:
                wanted = _plan(found, some, where, rest)
            except (CoverageError, TensorNotFoundError):
                pass  # the whole generation decides (and names what is wrong)
            else:
                if all(is_saved_box(t.box, sources_of(t, some)) for t in wanted):
                    return some, wanted
    entries = grouped_entries(list(shards), where)
    return entries, _plan(found, entries, where, rest)


def _plan(
    found: list[tuple[str, Any]],
    entries: Mapping[str, list[TensorEntry]],
    where: dict[str, Any],
    rest: tuple[str, bool | Callable[[NotLoaded], Any]] | None,
) -> list[Target]:
    wanted = plan_targets(found, entries, where)
    if rest is not None:
        wanted += plan_rest(entries, {t.name for t in wanted}, rest[0], rest[1], where)
    return wanted


def _direct_entries(
    some: list[ShardManifest], root: GenerationRoot, where: dict[str, Any]
) -> dict[str, list[TensorEntry]]:
    """The boxes of ``some`` manifests, and the root's whole small tensors besides."""
    entries = dict(grouped_entries(some, where).items())
    for entry in root.whole:
        entries.setdefault(entry.name, [entry])
    return entries


def _once(like: Callable[[NotLoaded], Any]) -> Callable[[NotLoaded], Any]:
    given: dict[str, Any] = {}

    def target(saved: NotLoaded) -> Any:
        if saved.name not in given:
            given[saved.name] = like(saved)
        return given[saved.name]

    return target


def sources_of(target: Target, entries: Mapping[str, list[TensorEntry]]) -> list[TensorEntry]:
    """The saved boxes to compare a target's box with: those it overlaps, or, for an
    empty box (which overlaps none), every box of the tensor (an empty local shard
    saved as such is a saved box too)."""
    if target.sources is None or not target.box.numel:
        return entries[target.name]
    return target.sources


def resharded(wanted: list[Target], entries: Mapping[str, list[TensorEntry]]) -> int:
    """How many targets are no saved box (read by byte range: another layout)."""
    return sum(not is_saved_box(t.box, sources_of(t, entries)) for t in wanted)


def is_saved_box(box: Box, boxes: list[TensorEntry]) -> bool:
    return any(e.offsets == box.offsets and e.local_shape == box.shape for e in boxes)



def target_leaves(node: Any, path: str, found: list[tuple[str, Any]]) -> None:
    """Every tensor, DTensor or Shard in a target tree, named by key path like a saved state."""
    if isinstance(node, Shard) or _is_array(node):  # a DTensor is a torch.Tensor
        found.append((path or ".", node))
    elif isinstance(node, dict):
        for key, value in node.items():
            target_leaves(value, join_path(path, key), found)
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            target_leaves(value, join_path(path, index), found)


def _is_array(value: Any) -> bool:
    import torch

    return isinstance(value, (np.ndarray, torch.Tensor))


def plan_targets(
    found: list[tuple[str, Any]], entries: Mapping[str, list[TensorEntry]], where: dict[str, Any]
) -> list[Target]:
    """Each target (key path, live tensor) checked against its saved boxes."""
    from castore.format.dtypes import name_of_numpy_dtype, name_of_torch_dtype

    indexes: dict[str, BoxIndex] = {}
    planned: list[Target] = []
    table = entries if isinstance(entries, BoxTable) else None
    for name, live in found:
        if name not in entries:
            raise TensorNotFoundError(
                f"target {name!r} is not a tensor of this generation", **where
            )
        saved = table.first(name) if table is not None else entries[name][0]
        # A DTensor fills its local tensor: the block its mesh and placements give.
        shard = dtensor_block(live, name).shard if is_dtensor(live) else live
        tensor = shard.local if isinstance(shard, Shard) else shard
        dtype = (
            name_of_numpy_dtype(tensor.dtype, name)
            if isinstance(tensor, np.ndarray)
            else name_of_torch_dtype(tensor.dtype, name)
        )
        global_shape = shard.global_shape if isinstance(shard, Shard) else tuple(tensor.shape)
        if not (table.agree(name) if table is not None else _agree(entries[name])):
            check_coverage(entries[name], where)  # raises: the saved boxes disagree
        if dtype != saved.dtype or tuple(global_shape) != saved.shape:
            raise LayoutMismatchError(
                f"target {name!r} is {dtype}{list(global_shape)}, the saved tensor is "
                f"{saved.dtype}{list(saved.shape)}",
                tensor=name,
                **where,
            )
        box = (
            Box(shard.offsets, shard.local_shape)
            if isinstance(shard, Shard)
            else Box.whole(saved.shape)
        )
        # The saved boxes this target reads, found by index, and checked to cover its
        # box exactly once: what its bytes depend on (castore.core.boxindex).
        if table is not None:
            sources = table.overlapping(name, box)
        else:
            index = indexes.get(name)
            if index is None:
                index = indexes[name] = BoxIndex(entries[name])
            sources = index.overlapping(box)
        covered_once(sources, box, {**where, "tensor": name}, check_coverage)
        target = Target(name, live, tensor, box, saved.dtype, sources=sources)
        target.flat = _writable_bytes(tensor)
        if target.flat is None:
            target.staging, target.flat = allocate(saved.dtype, box.shape, "numpy")
        planned.append(target)
    return planned


def _agree(boxes: list[TensorEntry]) -> bool:
    first = boxes[0]
    return all(b.shape == first.shape and b.dtype == first.dtype for b in boxes)


def plan_rest(
    entries: Mapping[str, list[TensorEntry]],
    named: set[str],
    framework: str,
    like: bool | Callable[[NotLoaded], Any],
    where: dict[str, Any],
) -> list[Target]:
    """Every saved tensor that no target names: into the target ``like`` gives for it
    (a callable), else whole into a new tensor."""
    planned: list[Target] = []
    given: list[tuple[str, Any]] = []
    for name, boxes in entries.items():
        if name in named:
            continue
        saved = boxes[0]
        target = like(NotLoaded(name, saved.dtype, saved.shape)) if callable(like) else None
        if target is not None:
            given.append((name, target))
            continue
        check_coverage(boxes, where)
        tensor, flat = allocate(saved.dtype, saved.shape, framework_for(saved, framework))
        target = Target(name, tensor, tensor, Box.whole(saved.shape), saved.dtype, flat=flat)
        planned.append(target)
    return planned + plan_targets(given, entries, where)


def _writable_bytes(tensor: Any) -> np.ndarray | None:
    """A flat uint8 view of a C-contiguous host tensor's own memory, else None."""
    if isinstance(tensor, np.ndarray):
        if tensor.flags.c_contiguous and tensor.flags.writeable:
            return tensor.reshape(-1).view(np.uint8)
        return None

    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return torch_bytes(tensor.detach())
    return None


def chunk_requests(
    target: Target, entries: Mapping[str, list[TensorEntry]]
) -> list[ChunkRequest]:
    requests: list[ChunkRequest] = []
    for entry in entries[target.name] if target.sources is None else target.sources:
        region = target.box.intersect(Box(entry.offsets, entry.local_shape))
        if region is None or not region.numel:
            continue
        requests += box_requests(entry, region, target.box, target.flat)
    return requests
