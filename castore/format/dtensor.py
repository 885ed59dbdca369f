"""DTensors as boxes: the block of a global tensor that each rank holds.

A DTensor (FSDP2, tensor parallelism, HSDP) says its global shape, and
through its device mesh and placements which block each rank holds. castore
takes that block as a :class:`~castore.Shard` in global coordinates, with
offsets derived here as DCP derives them: mesh dimensions left to right, each
``Shard(d)`` cutting the block's current extent ``s`` along ``d`` into
``torch.chunk``-style pieces (``ceil(s / n)`` long, the last ones short or
empty), so two mesh dimensions sharding one tensor dimension nest. An empty
block sits at the end of the dimension it is empty along, as DCP places it.
``Replicate`` cuts nothing: the ranks along that mesh dimension hold the same
block, and only the one at coordinate 0 on every such dimension writes it;
the ranks that hold it are named (:attr:`DTensorBlock.replicas`) so that
castore.dist.replicas compares their copies before a publish.
FSDP2 over tensor parallelism shards a tensor-parallel piece again with a
strided shard (``_StridedShard``): it applies after the plain shards of the
same dimension, inside their pieces. ``Partial`` (a pending reduction), and
strided shards that give a rank several runs of the tensor, are refused
(:class:`~castore.errors.UnsupportedPlacementError`).

torch is never imported here: a value is a DTensor only once
``torch.distributed.tensor`` is loaded, and is read through its public
attributes (``shape``, ``device_mesh``, ``placements``, ``to_local``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from castore.errors import UnsupportedPlacementError
from castore.format.layout import Box
from castore.format.shard import Shard


@dataclass(frozen=True)
class Strided:
    """A strided shard (``_StridedShard``, FSDP2 over tensor parallelism) of tensor
    dimension ``dim``: it cuts each of the ``split_factor`` pieces that the later
    mesh dimensions sharding ``dim`` make, so it applies after them."""

    dim: int
    split_factor: int


# A mesh dimension's placement, as the arithmetic below takes it: the tensor
# dimension it shards, a strided shard of one, or None for Replicate.
PlacementDim = int | Strided | None


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (never imports torch to find out)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


@dataclass(frozen=True)
class DTensorBlock:
    """This rank's block of a DTensor.

    ``shard``: the local tensor placed in global coordinates. ``writes``:
    this rank writes the block (coordinate 0 on every Replicate mesh
    dimension); its replicas on the other ranks leave it to this one.
    ``replicas``: the global ranks that hold this same block (the mesh's ranks
    along its Replicate dimensions), this one among them; empty where no other
    rank holds it.
    """

    shard: Shard
    writes: bool
    replicas: tuple[int, ...] = ()
    # What a generation records of it (docs/FORMAT.md, the root's `layouts`).
    layout: dict[str, Any] | None = None


def dtensor_block(value: Any, path: str) -> DTensorBlock:
    """The block of the DTensor ``value`` (at key path ``path``) that this rank holds."""
    name = path or "<root>"
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedPlacementError(
            f"DTensor at {name} lives on a device mesh that does not include this rank: "
            "every rank that saves or loads it must be on its mesh",
            key_path=path,
        )
    global_shape = tuple(int(s) for s in value.shape)
    dims = placement_dims(value.placements, len(global_shape), path)
    check_strided(dims, tuple(mesh.shape), value.placements, path)
    box = block_of(global_shape, tuple(mesh.shape), tuple(coordinate), dims)
    local = value.to_local()
    if tuple(local.shape) != box.shape:
        raise UnsupportedPlacementError(
            f"DTensor at {name} holds a local tensor of shape {list(local.shape)} where its "
            f"mesh {list(mesh.shape)} and placements {list(value.placements)} give "
            f"{list(box.shape)}: its layout is not the one DCP derives",
            key_path=path,
        )
    shard = Shard(local, global_shape, box.offsets)
    at = tuple(coordinate)
    return DTensorBlock(
        shard,
        writes_block(at, dims),
        replica_ranks(mesh.mesh, at, dims),
        layout_record(tuple(mesh.shape), getattr(mesh, "mesh_dim_names", None), dims),
    )


def layout_record(
    mesh_shape: tuple[int, ...], names: Sequence[str] | None, dims: Sequence[PlacementDim]
) -> dict[str, Any]:
    """A DTensor's layout as a generation records it: the mesh's shape, its dimension
    names (or None) and each mesh dimension's placement, ``"S(d)"`` or ``"R"``."""
    return {
        "mesh": [int(n) for n in mesh_shape],
        "mesh_dims": None if names is None else [str(n) for n in names],
        "placements": [_placement_text(dim) for dim in dims],
    }


def _placement_text(dim: PlacementDim) -> str:
    if dim is None:
        return "R"
    if isinstance(dim, Strided):
        return f"S({dim.dim},sf={dim.split_factor})"
    return f"S({dim})"


def placement_dims(placements: Sequence[Any], ndim: int, path: str) -> tuple[PlacementDim, ...]:
    """Each mesh dimension's placement as the tensor dimension it shards (None: Replicate).

    Refuses what one box per rank cannot hold, naming the key path and placement.
    """
    name = path or "<root>"
    dims: list[PlacementDim] = []
    for mesh_dim, placement in enumerate(placements):
        where = f"DTensor at {name} has placement {placement!r} on mesh dimension {mesh_dim}"
        # Strided first: in some torch versions a strided shard is a Shard subclass.
        if "StridedShard" in type(placement).__name__ or hasattr(placement, "split_factor"):
            if not -ndim <= placement.dim < ndim:
                raise UnsupportedPlacementError(
                    f"{where}: it shards no dimension of a {ndim}-dimensional tensor",
                    key_path=path,
                )
            dims.append(Strided(placement.dim % ndim, int(placement.split_factor)))
            continue
        if placement.is_partial():
            raise UnsupportedPlacementError(
                f"{where}: a Partial placement is a pending reduction that no rank holds; "
                "reduce it first (redistribute to Replicate or Shard)",
                key_path=path,
            )
        if placement.is_replicate():
            dims.append(None)
        elif placement.is_shard() and -ndim <= placement.dim < ndim:
            dims.append(placement.dim % ndim)
        else:
            raise UnsupportedPlacementError(
                f"{where}: castore holds only Shard and Replicate placements of a "
                f"{ndim}-dimensional tensor",
                key_path=path,
            )
    return tuple(dims)


def check_strided(
    dims: Sequence[PlacementDim], mesh_shape: tuple[int, ...], placements: Any, path: str
) -> None:
    """Refuse a strided shard whose rank blocks are not one box each: castore holds the
    one FSDP2 makes over tensor parallelism, whose split factor is the product of the
    later mesh dimensions that shard the same tensor dimension (each rank's rows are
    then one run, inside its tensor-parallel piece)."""
    for mesh_dim, dim in enumerate(dims):
        if not isinstance(dim, Strided):
            continue
        after = zip(mesh_shape[mesh_dim + 1 :], dims[mesh_dim + 1 :], strict=True)
        later = [n for n, d in after if d == dim.dim]
        earlier = [d for d in dims[:mesh_dim] if _sharded_dim(d) == dim.dim]
        if dim.split_factor != math.prod(later) or earlier:
            raise UnsupportedPlacementError(
                f"DTensor at {path or '<root>'} has placements {list(placements)}: its strided "
                f"shard on mesh dimension {mesh_dim} (split factor {dim.split_factor}) gives "
                "each rank several runs of the tensor, which castore cannot hold as one box; "
                "redistribute it to Shard or Replicate placements first",
                key_path=path,
            )


def _sharded_dim(dim: PlacementDim) -> int | None:
    return dim.dim if isinstance(dim, Strided) else dim


def writes_block(coordinate: tuple[int, ...], dims: Sequence[PlacementDim]) -> bool:
    """Whether the rank at ``coordinate`` writes its block: of the replicas along the
    Replicate mesh dimensions, the one at coordinate 0 on each of them does."""
    return all(at == 0 for at, dim in zip(coordinate, dims, strict=True) if dim is None)


def replica_ranks(
    mesh_ranks: Any, coordinate: tuple[int, ...], dims: Sequence[PlacementDim]
) -> tuple[int, ...]:
    """The global ranks that hold the block at ``coordinate`` (of ``mesh_ranks``, a mesh's
    tensor of ranks): those at the same coordinate but along the Replicate dimensions.
    Empty where only this rank holds it."""
    along = tuple(
        slice(None) if dim is None else at for at, dim in zip(coordinate, dims, strict=True)
    )
    holders = tuple(int(rank) for rank in mesh_ranks[along].reshape(-1).tolist())
    return holders if len(holders) > 1 else ()


def block_of(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    dims: Sequence[PlacementDim],
) -> Box:
    """The block at ``coordinate`` of a mesh of ``mesh_shape``, placed per ``dims``.

    Pure arithmetic, the module text's rule: each sharding mesh dimension, left
    to right, takes ``torch.chunk``'s piece of the block's current extent; strided
    shards (:class:`Strided`) after the others, as they cut within those pieces.
    """
    if not len(mesh_shape) == len(coordinate) == len(dims):
        raise ValueError(
            f"mesh {list(mesh_shape)}, coordinate {list(coordinate)} and {len(dims)} "
            "placements must have one entry per mesh dimension"
        )
    offsets, shape = [0] * len(global_shape), list(global_shape)
    placed = list(zip(mesh_shape, coordinate, dims, strict=True))
    ordered = [p for p in placed if not isinstance(p[2], Strided)]
    ordered += [p for p in placed if isinstance(p[2], Strided)]
    for count, at, placement in ordered:
        dim = _sharded_dim(placement)
        if dim is None:
            continue
        size = shape[dim]
        piece = -(-size // count)
        start = min(at * piece, size)
        shape[dim] = min(start + piece, size) - start
        offsets[dim] += start
    for dim, size in enumerate(shape):
        if size == 0:
            offsets[dim] = global_shape[dim]
    return Box(tuple(offsets), tuple(shape))
