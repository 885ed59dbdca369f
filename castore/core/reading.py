"""Reading a generation: verified objects, tensor boxes, and the chunk reads that fill tensors.

Objects (roots, shard manifests) are read from a chunk backend and accepted
only if their bytes hash to the digest that named them (invariant 3). A
tensor is rebuilt from its saved boxes: the boxes must tile it exactly once
(:func:`check_coverage`, also the coordinator's check before a publish),
then each box's chunks are mapped onto the destination's bytes
(:func:`box_transfer`) and read, verified and delivered by
:mod:`castore.core.chunkread`.

:class:`~castore.Store` delegates its reads here; ``castore.dist.restore``,
``castore.dcp`` and ``castore.core.commit`` use these functions directly. Nothing
here writes to the store, and nothing imports torch until a caller asks for
a torch tensor.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from castore.chunkstore.base import ChunkBackend, Namespace
from castore.core.boxtable import box_table
from castore.core.chunkread import ChunkRequest, ReadCounters, read_requests
from castore.core.readplan import ReadPlan, read_plan
from castore.errors import (
    AllocationError,
    ChecksumMismatchError,
    CorruptObjectError,
    CoverageError,
    FormatVersionError,
    ObjectMissingError,
    TensorNotFoundError,
)
from castore.format import dtypes
from castore.format.coverage import box_corners, element_count, overlapping_pair
from castore.format.hashing import Digest, digest_bytes
from castore.format.layout import Box, CopyPlan, normalize_index, plan_copy
from castore.format.objects import (
    TYPE_ROOT,
    TYPE_SHARD,
    GenerationRoot,
    ShardManifest,
    TensorEntry,
    decode_object,
)
from castore.format.tree import decode_local_state, decode_tree
from castore.support.progress import NO_BAR, Bar, progress_bar, progress_wanted

# -- objects ------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectReads:
    """Objects (roots, manifests) read and hashed against their names in this process,
    and their bytes: a snapshot (subtract two for a span). The coordinator's share of
    a save grows with the rank count (docs/SCALE.md, "A model of scale")."""

    objects: int = 0
    bytes: int = 0

    def __sub__(self, earlier: ObjectReads) -> ObjectReads:
        return ObjectReads(self.objects - earlier.objects, self.bytes - earlier.bytes)


class _ObjectTally:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads = ObjectReads()

    def add(self, objects: int, nbytes: int) -> None:
        with self._lock:
            self._reads = ObjectReads(self._reads.objects + objects, self._reads.bytes + nbytes)

    def snapshot(self) -> ObjectReads:
        with self._lock:
            return self._reads


_OBJECT_TALLY = _ObjectTally()


def object_reads() -> ObjectReads:
    """Every object this process has read and verified (from any store) since it started."""
    return _OBJECT_TALLY.snapshot()


def count_object_reads(objects: int, nbytes: int) -> None:
    """Add reads made outside :func:`verified_object` (several objects read at once)."""
    _OBJECT_TALLY.add(objects, nbytes)


def verified_object(
    backend: ChunkBackend, digest: bytes, *, expect: str, only: str | None = None, **where: Any
) -> tuple[bytes, Any]:
    """One manifest object's bytes, verified against its name, and what they decode to.

    ``only``: of a shard, decode just that tensor's entries (decode_object)."""
    data = backend.get(Namespace.OBJECTS, digest)
    if data is None:
        raise ObjectMissingError(f"{expect} object {digest.hex()[:16]} is missing", **where)
    _OBJECT_TALLY.add(1, len(data))
    actual = digest_bytes(data)
    if actual != digest:
        raise ChecksumMismatchError(
            f"{expect} object is damaged", expected=digest.hex(), actual=actual.hex(), **where
        )
    try:
        return bytes(data), decode_object(data, expect=expect, only=only)
    except (CorruptObjectError, FormatVersionError) as exc:
        raise type(exc)(f"{expect} object {digest.hex()[:16]}: {exc}", **where) from exc


def read_object(backend: ChunkBackend, digest: bytes, *, expect: str, **where: Any) -> Any:
    """Read, verify and decode one manifest object."""
    return verified_object(backend, digest, expect=expect, **where)[1]


def read_root(backend: ChunkBackend, digest: Digest, *, run: str) -> GenerationRoot:
    """The root object ``digest`` of ``run``, verified."""
    root: GenerationRoot = read_object(backend, digest.raw, expect=TYPE_ROOT, run=run)
    if root.run != run:
        raise CorruptObjectError(f"root {digest.short} belongs to run {root.run!r}", run=run)
    return root


def read_shards(
    backend: ChunkBackend, root: GenerationRoot, *, only: str | None = None
) -> list[ShardManifest]:
    """Every shard manifest ``root`` names, verified, each the manifest of its rank.

    ``only``: each shard with just that tensor's entries decoded (a partial read:
    its other entries are checked column-wise, never built)."""
    return list(ShardList(backend, root, only=only))


class ShardList(Sequence[ShardManifest]):
    """The shard manifests ``root`` names, each read, verified and checked to be its
    rank's when first indexed: a restoring rank reads only those it needs."""

    def __init__(
        self, backend: ChunkBackend, root: GenerationRoot, *, only: str | None = None
    ) -> None:
        self.where = {"run": root.run, "generation": root.generation}
        if len(root.shards) != root.world_size:
            raise CorruptObjectError(
                f"root says {root.world_size} rank(s) wrote it but lists "
                f"{len(root.shards)} shard manifest(s)",
                **self.where,
            )
        self._backend, self._root, self._only = backend, root, only
        self._read: dict[int, ShardManifest] = {}

    def __len__(self) -> int:
        return len(self._root.shards)

    @property
    def read(self) -> int:
        """How many of the manifests were read so far."""
        return len(self._read)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"shard {index} of {len(self)}")
        shard = self._read.get(index)
        if shard is None:
            shard = self._read[index] = self._fetch(index)
        return shard

    def _fetch(self, index: int) -> ShardManifest:
        root, where = self._root, self.where
        shard: ShardManifest = verified_object(
            self._backend, root.shards[index], expect=TYPE_SHARD, only=self._only,
            shard=index, **where,
        )[1]  # fmt: skip
        if shard.run != root.run or shard.generation != root.generation:
            raise CorruptObjectError(
                f"shard {index} belongs to {shard.run}@{shard.generation}", **where
            )
        if shard.rank != index:
            raise CorruptObjectError(
                f"shard {index} is rank {shard.rank}'s manifest (listed twice or out of "
                "rank order)",
                **where,
            )
        return shard


def tensor_entries(
    backend: ChunkBackend, root: GenerationRoot, shards: list[ShardManifest] | None = None
) -> Mapping[str, list[TensorEntry]]:
    """Every global tensor of a generation: name -> the distinct boxes that make it up."""
    where = {"run": root.run, "generation": root.generation}
    return grouped_entries(read_shards(backend, root) if shards is None else shards, where)


# -- layout checks ------------------------------------------------------------


def grouped_entries(
    shards: list[ShardManifest], where: dict[str, Any]
) -> Mapping[str, list[TensorEntry]]:
    """:func:`group_entries`, read from the shards' tables as columns where there are
    several shards with tables (castore.core.boxtable: entries built only for the
    tensors asked for). One shard's entries are all wanted anyway, and built faster
    one by one."""
    table = box_table(shards) if len(shards) > 1 else None
    return table if table is not None else group_entries(shards, where)


def checked_entries(
    shards: list[ShardManifest], where: dict[str, Any]
) -> Mapping[str, list[TensorEntry]]:
    """The shards' tensors grouped (:func:`grouped_entries`), each checked to be covered
    exactly once by boxes that agree (:func:`check_coverage`): column-wise where the
    shards have tables, else, or at the first doubt, box by box (which names the fault)."""
    table = box_table(shards) if len(shards) > 1 else None
    if table is not None and table.check():
        return table
    # The per-entry path raises, naming the tensor and the fault.
    entries = group_entries(shards, where)
    for boxes in entries.values():
        check_coverage(boxes, where)
    return entries


def group_entries(
    shards: list[ShardManifest], where: dict[str, Any]
) -> dict[str, list[TensorEntry]]:
    """Every global tensor: name -> its distinct boxes.

    Two ranks may hold the same box (replicated shards); identical boxes with
    identical chunks count once, identical boxes with different bytes are an
    error.
    """
    grouped: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], TensorEntry]] = {}
    for shard in shards:
        for entry in shard.tensors:
            boxes = grouped.setdefault(entry.name, {})
            key = (entry.offsets, entry.local_shape)
            seen = boxes.get(key)
            if seen is None:
                boxes[key] = entry
            elif seen.chunks != entry.chunks or seen.dtype != entry.dtype:
                raise CoverageError(
                    f"two ranks saved different bytes for the same box {key} of tensor "
                    f"{entry.name!r}",
                    tensor=entry.name,
                    **where,
                )
    return {name: list(boxes.values()) for name, boxes in grouped.items()}


def check_coverage(boxes: list[TensorEntry], where: dict[str, Any]) -> None:
    """The boxes of one tensor must agree and cover it exactly once.

    No two boxes share an element, and together they hold as many elements as
    the tensor (each entry's own check put its box inside the shape). Boxes
    alike are two boxes: callers count replicas once (:func:`group_entries`).
    O(n log n) in the boxes for the usual layouts (castore.format.coverage).
    """
    first = boxes[0]
    name, shape = first.name, first.shape
    where = {**where, "tensor": name}
    odd = first_disagreeing(boxes)
    if odd is not None:
        raise CoverageError(
            f"boxes of tensor {name!r} disagree: {first.dtype}{list(shape)} vs "
            f"{odd.dtype}{list(odd.shape)}",
            **where,
        )
    offsets = [b.offsets for b in boxes]
    extents = [b.local_shape for b in boxes]
    corners = box_corners(offsets, extents, len(shape))
    pair = overlapping_pair(corners.lo, corners.hi)
    if pair is not None:
        at = [max(a, b) for a, b in zip(offsets[pair[0]], offsets[pair[1]], strict=True)]
        raise CoverageError(f"boxes of tensor {name!r} overlap at offsets {at}", **where)
    covered = element_count(corners, extents)
    total = math.prod(shape)
    if covered != total:
        raise CoverageError(
            f"boxes of tensor {name!r} cover {covered} of its {total} elements",
            **where,
        )


def first_disagreeing(boxes: list[TensorEntry]) -> TensorEntry | None:
    """The first box whose global shape or dtype is not the first box's, or None."""
    shape, dtype, count = boxes[0].shape, boxes[0].dtype, len(boxes)
    if [b.shape for b in boxes].count(shape) == count and [b.dtype for b in boxes].count(
        dtype
    ) == count:
        return None
    return next(b for b in boxes if b.shape != shape or b.dtype != dtype)


# -- where chunks land --------------------------------------------------------

ChunkDelivery = Callable[[int, np.ndarray], None]


def box_transfer(
    entry: TensorEntry, region: Box, dst_box: Box, dst_flat: np.ndarray
) -> tuple[Sequence[int] | np.ndarray, ChunkDelivery]:
    """Which chunks of a saved box hold ``region``, and how each lands in a destination.

    ``dst_flat`` is the flat byte buffer of the box ``dst_box`` (global
    coordinates); ``region`` lies inside both boxes.
    """
    indices, deliver, _plan = _transfer(entry, region, dst_box, dst_flat)
    return indices, deliver


def _transfer(
    entry: TensorEntry, region: Box, dst_box: Box, dst_flat: np.ndarray
) -> tuple[Sequence[int] | np.ndarray, ChunkDelivery, CopyPlan | None]:
    """box_transfer, and its copy plan (None where the saved box lands whole)."""
    entry_box = Box(entry.offsets, entry.local_shape)
    if region == entry_box == dst_box:
        return range(len(entry.chunks)), place_whole(entry, dst_flat), None
    plan = plan_copy(
        entry.local_shape,
        region.relative_to(entry_box),
        dst_box.shape,
        region.relative_to(dst_box),
        dtypes.numpy_dtype(entry.dtype).itemsize,
    )

    def scatter(index: int, chunk: np.ndarray) -> None:
        plan.copy_from_chunk(entry.chunk_start(index), chunk, dst_flat)

    return entry.chunk_indices(plan.src_starts, plan.run_bytes), scatter, plan


def chunk_spans(entry: TensorEntry, indices: np.ndarray, plan: CopyPlan) -> list[tuple[int, int]]:
    """For each chunk at ``indices``, the bytes [lo, hi) of it (from the chunk's first byte)
    that the copy ``plan`` reads: from its first run's first byte to its last run's last."""
    starts = np.sort(plan.src_starts)
    ends = starts + plan.run_bytes
    bounds = np.append(entry.chunk_starts, entry.nbytes)  # every chunk's start, then the end
    chunk_starts, chunk_ends = bounds[indices], bounds[indices + 1]
    first = np.searchsorted(ends, chunk_starts, side="right")  # first run ending past it
    last = np.searchsorted(starts, chunk_ends, side="left") - 1  # last run starting in it
    lo = np.maximum(chunk_starts, starts[first]) - chunk_starts
    hi = np.minimum(chunk_ends, ends[last]) - chunk_starts
    return list(zip(lo.tolist(), hi.tolist(), strict=True))


def place_whole(entry: TensorEntry, dst_flat: np.ndarray) -> ChunkDelivery:
    """Delivery into a buffer that is the saved box's own: each chunk lands where it starts."""
    start = entry.chunk_start

    def place(index: int, chunk: np.ndarray) -> None:
        at = start(index)
        dst_flat[at : at + chunk.size] = chunk

    return place


def box_requests(
    entry: TensorEntry, region: Box, dst_box: Box, dst_flat: np.ndarray
) -> list[ChunkRequest]:
    """The chunk reads that copy ``region`` of a saved box into a destination (box_transfer)."""
    indices, deliver, plan = _transfer(entry, region, dst_box, dst_flat)
    if plan is None or not entry.pieces:
        return [ChunkRequest(entry, int(i), deliver) for i in indices]
    # Which bytes of each chunk the copy reads: a read of part of a chunk verifies only
    # the pieces that hold them (castore.format.pieces).
    spans = chunk_spans(entry, np.asarray(indices, dtype=np.int64), plan)
    return [
        ChunkRequest(entry, int(i), deliver, span)
        for i, span in zip(indices, spans, strict=True)
    ]


def contiguous_start(entry: TensorEntry) -> int | None:
    """Where a saved box's bytes start in its whole tensor, if they are one run of bytes there.

    Row-major: a box is one run when every dimension after its last partial one
    is whole and every dimension before it has extent 1 (a range of rows, say).
    """
    shape, local = entry.shape, entry.local_shape
    partial = [dim for dim, (g, s) in enumerate(zip(shape, local, strict=True)) if g != s]
    if partial and any(s != 1 for s in local[: partial[-1]]):
        return None
    start, stride = 0, dtypes.numpy_dtype(entry.dtype).itemsize
    for offset, extent in zip(reversed(entry.offsets), reversed(shape), strict=True):
        start += offset * stride
        stride *= extent
    return start


# -- new tensors --------------------------------------------------------------


def check_framework(framework: str) -> None:
    """``framework`` is one a load can give tensors as."""
    if framework not in ("numpy", "torch", "auto"):
        raise ValueError(f"framework must be 'numpy', 'torch' or 'auto', got {framework!r}")


def framework_for(entry: TensorEntry, requested: str) -> str:
    """``auto`` gives each tensor back as the kind of array it was saved from."""
    if requested != "auto":
        return requested
    return "torch" if entry.framework == "torch" else "numpy"


def allocate(dtype: str, shape: tuple[int, ...], framework: str) -> tuple[Any, np.ndarray]:
    """A new tensor and a flat uint8 view of its memory.

    Callers check the saved boxes' coverage first, so the size is one the
    manifest's chunks account for; this process may still lack the memory.

    A torch tensor is made on a new numpy array's memory (:func:`torch_owning`):
    array, tensor and byte view take a third of the time of ``torch.empty`` and a
    byte view of it, and numpy asks the kernel for huge pages for arrays of
    4 MiB and more (transparent huge pages permitting), so reading into them
    faults once per 2 MiB, not once per 4 KiB. Each tensor still owns its memory
    alone (docs/PERFORMANCE.md, "The cost of a tensor and of a call").
    """
    try:
        array = np.empty(shape, dtype=dtypes.numpy_dtype(dtype))
    except (MemoryError, ValueError) as exc:  # ValueError: more bytes than an address space
        raise AllocationError(
            f"cannot allocate a {dtype} tensor of shape {list(shape)}: {exc}",
        ) from exc
    flat = array.reshape(-1).view(np.uint8)
    if framework == "torch":
        return torch_owning(array, flat, dtype), flat
    return array, flat


def torch_owning(array: np.ndarray, flat: np.ndarray, dtype: str) -> Any:
    """A torch tensor of ``dtype`` on the memory of a new C-contiguous ``array``
    (``flat``: its bytes), keeping it alive: its storage cannot be resized, as
    safetensors' cannot."""
    import torch

    if dtype in dtypes.NUMPY_LACKS:  # torch takes no ml_dtypes array: through bytes
        return torch.from_numpy(flat).view(dtypes.torch_dtype(dtype)).reshape(array.shape)
    return torch.from_numpy(array)


def numpy_as_torch(array: np.ndarray, dtype: str) -> Any:
    """A torch tensor sharing ``array``'s bytes (a copy only if it is not contiguous).

    Goes through uint8 because torch cannot take numpy's bfloat16/float8 types.
    """
    import torch

    raw = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return raw.view(dtypes.torch_dtype(dtype)).reshape(array.shape)


# -- reading tensors ----------------------------------------------------------


def plan_tensor(
    boxes: list[TensorEntry],
    framework: str,
    where: dict[str, Any],
    plan: ReadPlan,
) -> Any:
    """A new, unfilled tensor for ``boxes``; the reads that fill it go on ``plan``."""
    first = boxes[0]
    if len(boxes) == 1 and first.local_shape == first.shape:
        # One box the size of the tensor covers it exactly: the entry's own
        # check put the box inside the shape. The common case, made cheap
        # for states of many small tensors.
        tensor, flat = allocate(first.dtype, first.shape, framework)
        plan.add_whole(first, flat.data, where)
        return tensor
    check_coverage(boxes, where)  # before allocating: the boxes must add up to the shape
    tensor, flat = allocate(first.dtype, first.shape, framework)
    whole, view = Box.whole(first.shape), flat.data
    for entry in boxes:
        start = contiguous_start(entry)
        if start is None:  # scattered across the tensor: chunk by chunk, through a plan_copy
            box = Box(entry.offsets, entry.local_shape)
            plan.requests += box_requests(entry, box, whole, flat)
        else:  # the boxes tile the tensor (checked above): their runs do not overlap
            plan.add_whole(entry, view[start : start + entry.nbytes], where)
    return tensor


def read_tensor(
    backend: ChunkBackend,
    counters: ReadCounters,
    boxes: list[TensorEntry],
    framework: str,
    where: dict[str, Any],
    bar: Bar = NO_BAR,
) -> Any:
    """A new tensor holding the saved boxes of one tensor, every chunk verified."""
    plan = ReadPlan()
    tensor = plan_tensor(boxes, framework, where, plan)
    read_plan(backend, plan, counters, where, bar)
    return tensor


def load_rank_local(
    backend: ChunkBackend,
    counters: ReadCounters,
    shard: ShardManifest,
    path: str,
    framework: str,
    where: dict[str, Any],
    bar: Bar = NO_BAR,
) -> Any:
    """Rebuild one RankLocal value of the rank that wrote ``shard``."""

    def read(entry: TensorEntry) -> Any:
        return read_tensor(backend, counters, [entry], framework_for(entry, framework), where, bar)

    return _decode_rank_local(shard, path, where, read)


def check_rank_local(shard: ShardManifest, where: dict[str, Any]) -> None:
    """Decode every RankLocal value of ``shard`` as a load does, reading no tensor bytes.

    What a load of these values would refuse (bytes that do not decode, a
    tree nested past the limit, a tensor the shard does not hold, a tensor
    whose box is not the whole of it) raises the same error here:
    ``castore verify`` calls this so that it passes no generation a load refuses.
    """
    at_rank = {**where, "rank": shard.rank}
    for path in rank_local_skeletons(shard, where):
        _decode_rank_local(shard, path, where, lambda entry: check_coverage([entry], at_rank))


def rank_local_skeletons(shard: ShardManifest, where: dict[str, Any]) -> dict[str, bytes]:
    """Each RankLocal value's encoded tree in ``shard``, by key path; errors name the rank."""
    try:
        return decode_local_state(shard.local_state)
    except CorruptObjectError as exc:
        raise CorruptObjectError(
            f"per-rank state of rank {shard.rank}: {exc}", **where, rank=shard.rank
        ) from exc


def _decode_rank_local(
    shard: ShardManifest, path: str, where: dict[str, Any], read: Callable[[TensorEntry], Any]
) -> Any:
    """The RankLocal value at ``path`` of ``shard``, ``read(entry)`` giving each tensor."""
    skeletons = rank_local_skeletons(shard, where)
    where = {**where, "rank": shard.rank}
    if path not in skeletons:
        raise CorruptObjectError(f"rank {shard.rank} has no per-rank value at {path!r}", **where)
    boxes = {entry.name: entry for entry in shard.local_tensors}

    def lookup(name: str, _saved_framework: str) -> Any:
        entry = boxes.get(name)
        if entry is None:
            raise CorruptObjectError(
                f"per-rank tensor {name!r} of rank {shard.rank} is not in its shard", **where
            )
        return read(entry)

    try:
        return decode_tree(skeletons[path], lookup)
    except CorruptObjectError as exc:
        if exc.context:
            raise  # from lookup or read: it says where already
        # The decoder's own errors know no place: name the rank and the value.
        raise CorruptObjectError(
            f"per-rank value {path!r} of rank {shard.rank}: {exc}", **where
        ) from exc


def load_state(
    backend: ChunkBackend,
    counters: ReadCounters,
    root: GenerationRoot,
    shards: list[ShardManifest],
    entries: Mapping[str, list[TensorEntry]],
    framework: str,
    progress: bool = False,
) -> Any:
    """The whole state ``root`` saved, every rank's per-rank values included."""
    run = root.run
    where: dict[str, Any] = {"run": run, "generation": root.generation}
    # Every tensor is planned first, then all are read in one go: one index
    # snapshot, each pack opened once, each shared chunk verified once.
    plan = ReadPlan()
    tensors = {
        name: plan_tensor(boxes, framework_for(boxes[0], framework), where, plan)
        for name, boxes in entries.items()
    }
    per_rank: dict[str, dict[int, Any]] = {}
    total = 0
    if progress_wanted(progress):  # counting costs a pass over the plan: only for a bar
        local_bytes = sum(e.nbytes for shard in shards for e in shard.local_tensors)
        total = plan.nbytes() + local_bytes
    with progress_bar(progress, f"load {run}@{root.generation}", total) as bar:
        read_plan(backend, plan, counters, where, bar)
        for shard in shards:
            for path in rank_local_skeletons(shard, where):
                value = load_rank_local(backend, counters, shard, path, framework, where, bar)
                per_rank.setdefault(path, {})[shard.rank] = value

    def lookup(name: str, _saved_framework: str) -> Any:
        if name not in tensors:
            raise CorruptObjectError(f"state refers to tensor {name!r}, no shard holds it", **where)
        return tensors[name]

    def rank_local(path: str) -> dict[int, Any]:
        # Without a process group there is no "this rank": give every rank's value.
        return per_rank.get(path, {})

    return decode_tree(root.state, lookup, rank_local)


def read_slice(
    backend: ChunkBackend,
    counters: ReadCounters,
    root: GenerationRoot,
    name: str,
    index: Any,
    *,
    framework: str = "numpy",
) -> Any:
    """``tensor[index]`` of one tensor ``root`` saved, reading only the chunks it overlaps."""
    check_framework(framework)
    boxes = tensor_entries(backend, root, read_shards(backend, root, only=name)).get(name)
    where = {"run": root.run, "generation": root.generation, "tensor": name}
    if not boxes:
        raise TensorNotFoundError(f"no tensor {name!r} in {root.run}@{root.generation}", **where)
    shape, dtype = boxes[0].shape, boxes[0].dtype
    check_coverage(boxes, where)  # no region of the result may be left unwritten
    box, selector = normalize_index(index, shape)
    out, flat = allocate(dtype, box.shape, "numpy")
    requests: list[ChunkRequest] = []
    for entry in boxes:
        region = box.intersect(Box(entry.offsets, entry.local_shape))
        if region is not None and region.numel:
            requests += box_requests(entry, region, box, flat)
    read_requests(backend, requests, counters, where)
    result = out[selector]
    if framework == "torch":
        return numpy_as_torch(result, dtype)
    return result
