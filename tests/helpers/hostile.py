"""Hostile stores: generations whose hashes are all valid and whose meaning is wrong.

Each forged generation is written through castore's own object encoding and
published with the ordinary ref compare-and-swap, so every digest matches its
bytes; only the fields say something inconsistent (a byte count smaller than
the shape implies, a box outside its tensor, a time of infinity, ...). A
reader must answer each with a typed error or with bytes that are exactly
what the chunks hold, never with memory it did not fill.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from castore import Store
from castore.chunkstore.base import Namespace
from castore.format.grid import RUNS
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import (
    COMPACT_SHARD_FORMAT,
    GRID_SHARD_FORMAT,
    SHARD_FORMAT,
    TYPE_SHARD,
)
from castore.repo.records import RefValue

Wire = dict[str, Any]
EntryMutation = Callable[[Wire], None]
RootMutation = Callable[[Wire], None]


def _packed(wire: Any) -> bytes:
    return msgpack.packb(wire, use_bin_type=True, use_single_float=False)


def put_object(store: Store, data: bytes) -> bytes:
    """Store encoded object bytes under their digest (valid hash, any meaning)."""
    digest = digest_bytes(data)
    store.backend.put_many(Namespace.OBJECTS, [(digest, data)])
    return digest


def latest_wires(
    store: Store, run: str, generation: int | str = "latest"
) -> tuple[Digest, Wire, list[Wire]]:
    """A root of ``run`` (default the newest) and its shard manifests, as plain wire maps.

    The shards' entries are given as a list of maps each (``tensors``,
    ``local_tensors``), as format 1 lays them out, plus ``cell`` ([dimension, extent])
    for an entry on its tensor's chunk grid; :func:`publish_forged` writes them back in
    the layout a mutation asks for."""
    digest, root = store.resolve_root(run, generation)
    shards = []
    for d in root.shards:
        shard = store.read_object(d, expect=TYPE_SHARD, run=run)
        wire = shard.to_wire()
        wire["tensors"] = [_entry_wire(t) for t in shard.tensors]
        wire["local_tensors"] = [_entry_wire(t) for t in shard.local_tensors]
        shards.append(wire)
    return digest, root.to_wire(), shards


def _entry_wire(entry: Any) -> Wire:
    wire: Wire = entry.to_wire()
    if entry.cell is not None:
        wire["cell"] = list(entry.cell)
    return wire


def table_of(entries: list[Wire], grid: bool = False) -> Wire:
    """Entry maps as a tensor table, whatever their values say (hostile ones too: lists
    of another length, negative numbers, digests of the wrong size); ``grid``: with
    format 3's grid columns (an entry without ``cell`` cut every chunk_size bytes)."""

    def i64(values: list[int]) -> bytes:
        return np.asarray(values, dtype="<i8").tobytes()

    columns = {
        "chunk_size": i64([e["chunk_size"] for e in entries]),
        "chunks": b"".join(c for e in entries for c in e["chunks"]),
        "dtype": [e["dtype"] for e in entries],
        "framework": [e["framework"] for e in entries],
        "local_shape": i64([v for e in entries for v in e["local_shape"]]),
        "name": [e["name"] for e in entries],
        "nbytes": i64([e["nbytes"] for e in entries]),
        "ndim": bytes(len(e["shape"]) for e in entries),
        "offsets": i64([v for e in entries for v in e["offsets"]]),
        "shape": i64([v for e in entries for v in e["shape"]]),
    }
    if grid:
        columns["cell_dim"] = bytes(e["cell"][0] if "cell" in e else RUNS for e in entries)
        columns["cell_extent"] = i64([e["cell"][1] if "cell" in e else 0 for e in entries])
    elif any("cell" in e for e in entries):
        raise ValueError("entries on a chunk grid need a format-3 table (layout 'grid')")
    return columns


def compact_of(entries: list[Wire]) -> Wire:
    """Entry maps as a compact tensor table (format 4), whatever their values say:
    every dimension value in 8 bytes (negative ones too); there is no byte count to
    forge (the reader derives it from the box)."""

    def i64(values: list[int]) -> bytes:
        return np.asarray(values, dtype="<i8").tobytes()

    kinds: dict[tuple[Any, ...], int] = {}
    index = []
    for e in entries:
        cell = e.get("cell", [RUNS, 0])
        kind = (e["dtype"], e["framework"], e["chunk_size"], cell[0], cell[1])
        index.append(kinds.setdefault(kind, len(kinds)))
    return {
        "chunks": b"".join(c for e in entries for c in e["chunks"]),
        "kind": np.asarray(index, dtype="<u1" if len(kinds) <= 256 else "<u2").tobytes(),
        "kinds": [list(k) for k in kinds],
        "local_shape": i64([v for e in entries for v in e["local_shape"]]),
        "name": [e["name"] for e in entries],
        "ndim": bytes(len(e["shape"]) for e in entries),
        "offsets": i64([v for e in entries for v in e["offsets"]]),
        "shape": i64([v for e in entries for v in e["shape"]]),
        "width": 8,
    }


def _gridded(shard: Wire) -> bool:
    return any("cell" in e for e in (*shard["tensors"], *shard["local_tensors"]))


LAYOUTS = ("compact", "grid", "table", "rows")


def publish_forged(
    store: Store, run: str, root_wire: Wire, shard_wires: list[Wire], layout: str = "table"
) -> int:
    """Write the shards and root as the run's next generation and advance the ref to it.

    ``layout``: the shards' entries as a table (format 3 where an entry lies on a chunk
    grid, else format 2), as a format-3 table whatever the entries (``"grid"``), as a
    compact table (``"compact"``: format 4, what castore writes), or as format 1's list
    of maps (``"rows"``, what it still reads)."""
    current = store.refs.read(run)
    assert current is not None
    parent = current.root
    generation = root_wire["generation"] = current.generation + 1
    for shard in shard_wires:
        shard["generation"] = generation
        if layout == "rows":
            if _gridded(shard):
                raise ValueError("format 1 has no chunk grid: save with pre_grid_saves()")
            shard["format"] = 1
        elif layout == "compact" and isinstance(shard["tensors"], list):
            shard["format"] = COMPACT_SHARD_FORMAT
            shard["tensors"] = compact_of(shard["tensors"])
            shard["local_tensors"] = compact_of(shard["local_tensors"])
        elif isinstance(shard["tensors"], list):
            grid = layout == "grid" or _gridded(shard)
            shard["format"] = GRID_SHARD_FORMAT if grid else SHARD_FORMAT
            shard["tensors"] = table_of(shard["tensors"], grid)
            shard["local_tensors"] = table_of(shard["local_tensors"], grid)
    root_wire["shards"] = [put_object(store, _packed(s)) for s in shard_wires]
    root_wire["parent"] = parent.raw
    root_bytes = _packed(root_wire)
    root_digest = Digest(put_object(store, root_bytes))
    # The ref stays well-formed: only the objects lie.
    # ...under the writer epoch the ref already names (castore.core.fencing).
    new = RefValue(run, generation, root_digest, time.time(), epoch=current.epoch)
    store.refs.advance(run, expected=parent, new=new)
    return generation


def forge_entry(
    store: Store,
    run: str,
    tensor: str,
    mutate: EntryMutation,
    *,
    rank: int = 0,
    base: int | str = "latest",
    layout: str = "table",
) -> int:
    """Publish the next generation of ``run``: generation ``base`` with ``tensor``'s entry
    (of ``rank``) mutated, its shards in ``layout`` (see :func:`publish_forged`)."""
    _, root, shards = latest_wires(store, run, base)
    root, shards = copy.deepcopy(root), copy.deepcopy(shards)
    entries = [e for e in shards[rank]["tensors"] if e["name"] == tensor]
    if not entries:
        raise KeyError(f"rank {rank} saved no box of {tensor!r}")
    mutate(entries[0])
    return publish_forged(store, run, root, shards, layout)


def forge_root(store: Store, run: str, mutate: RootMutation) -> int:
    """Publish the next generation of ``run`` with root fields mutated."""
    _, root, shards = latest_wires(store, run)
    root, shards = copy.deepcopy(root), copy.deepcopy(shards)
    mutate(root)
    return publish_forged(store, run, root, shards)


def nested_tuple_payload(depth: int) -> bytes:
    """A state skeleton of ``depth`` nested tuples, encoded as castore encodes one."""
    from castore.format.tree import EXT_TUPLE

    value: Any = 1
    for _ in range(depth):
        value = msgpack.ExtType(EXT_TUPLE, _packed([value]))
    return _packed({"x": value})


def shard_bytes_unchecked(shard_wire: Wire) -> bytes:
    """Encode a shard wire map (for tests that compare with castore's own encoding)."""
    return _packed(shard_wire)


# Entry mutations a reader must refuse (name -> mutation), each consistent in its hashes.
def _shrink_nbytes(entry: Wire) -> None:
    # The bug: fewer bytes (and chunks) than the shape needs left the tail uninitialised.
    entry["nbytes"] = entry["chunk_size"]
    entry["chunks"] = entry["chunks"][:1]


def _grow_shape(entry: Wire) -> None:
    entry["shape"] = [10**15] + entry["shape"][1:]
    entry["local_shape"] = [10**15] + entry["local_shape"][1:]


def _huge_shape_consistent_bytes(entry: Wire) -> None:
    entry["shape"] = [10**15]
    entry["local_shape"] = [10**15]
    entry["offsets"] = [0]


def _leave_a_gap(entry: Wire) -> None:
    # Consistent in itself (bytes and chunks fit the smaller box): only coverage is wrong.
    import math

    from castore.format.dtypes import numpy_dtype

    entry["local_shape"] = [entry["local_shape"][0] - 1, *entry["local_shape"][1:]]
    entry["nbytes"] = math.prod(entry["local_shape"]) * numpy_dtype(entry["dtype"]).itemsize
    entry["chunks"] = entry["chunks"][: -(-entry["nbytes"] // entry["chunk_size"])]


BAD_ENTRIES: dict[str, EntryMutation] = {
    "nbytes and chunks smaller than the shape": _shrink_nbytes,
    "shape of 1e15 rows": _grow_shape,
    "one-dimensional shape of 1e15": _huge_shape_consistent_bytes,
    "unknown dtype": lambda e: e.update(dtype="float128"),
    "dtype of another item size": lambda e: e.update(dtype="float64"),
    "negative dimension": lambda e: e.update(
        shape=[-e["shape"][0], *e["shape"][1:]], local_shape=[-e["shape"][0], *e["shape"][1:]]
    ),
    "box past the shape": lambda e: e.update(offsets=[1] + e["offsets"][1:]),
    "negative offset": lambda e: e.update(offsets=[-1] + e["offsets"][1:]),
    "rank mismatch": lambda e: e.update(offsets=e["offsets"] + [0]),
    "zero chunk size": lambda e: e.update(chunk_size=0),
    "huge chunk size": lambda e: e.update(chunk_size=1 << 40),
    "chunk list too short": lambda e: e.update(chunks=e["chunks"][:-1]),
    "chunk list too long": lambda e: e.update(chunks=e["chunks"] + e["chunks"][:1]),
    "malformed chunk digest": lambda e: e.update(chunks=[b"x"] + e["chunks"][1:]),
    "unknown framework": lambda e: e.update(framework="jax"),
    "empty name": lambda e: e.update(name=""),
    "box smaller than the shape (a gap)": _leave_a_gap,
}
