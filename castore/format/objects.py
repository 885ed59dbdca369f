"""Immutable manifest objects and their canonical msgpack encoding.

Every object is a msgpack map whose keys are sorted, that carries ``format``
(the format version) and ``type``, and is stored under the blake3 digest of its
encoded bytes. Encoding the same object twice gives the same bytes, so equal
objects get equal names. See docs/FORMAT.md for the field reference.

One idea, about 600 lines because every stored object (root, shard manifest,
the shard's tensor table) and its checked msgpack form belong to the one format.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from castore.errors import CorruptObjectError, FormatVersionError
from castore.format.compact import encode_compact, expand_compact
from castore.format.dtypes import SUPPORTED_DTYPES, numpy_dtype
from castore.format.grid import RUNS, box_chunk_count, box_chunk_starts, cell_problem
from castore.format.hashing import Digest, digest_of
from castore.format.layout import spanned
from castore.format.tree import check_depth

# The newest object format this castore reads. Roots are written as format 1 (their
# fields have not changed, so an older castore still lists them); shard manifests as
# format 2, whose tensors are a table of columns (below) instead of a list of maps, or
# format 3 when any entry's chunks lie on its tensor's grid (castore.format.grid).
FORMAT_VERSION = 4
ROOT_FORMAT = 1
SHARD_FORMAT = 2
GRID_SHARD_FORMAT = 3
# Format 4: the table compact (castore.format.compact); written wherever format 3 was.
COMPACT_SHARD_FORMAT = 4
# Limits a manifest must keep; a file never chooses a size beyond them.
MAX_DIMS = 64
MAX_CHUNK_SIZE = 1 << 30
FRAMEWORKS = ("numpy", "torch")
# Free-form maps in a root (data order, stats, versions) nest at most this deep.
MAX_FIELD_DEPTH = 8

TYPE_ROOT = "root"
TYPE_SHARD = "shard"


@dataclass(frozen=True)
class TensorEntry:
    """One rank's box of one tensor, as a list of chunk digests.

    ``offsets`` and ``local_shape`` place this box in the tensor's global
    ``shape``. With ``cell`` (dimension, extent), the tensor's chunk grid
    (castore.format.grid), chunk ``i`` holds the box's part of the ``i``-th cell
    it overlaps, one byte range of its row-major buffer; without (entries
    written before the grid), bytes ``[i*chunk_size, (i+1)*chunk_size)``.
    :meth:`chunk_start` and :meth:`chunk_length` say where either kind lies.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    nbytes: int
    chunk_size: int
    chunks: tuple[bytes, ...]
    framework: str = "numpy"
    cell: tuple[int, int] | None = None
    # The chaining values of the chunks' 64 KiB pieces (castore.format.pieces), for reads
    # of part of a chunk; empty where none were recorded.
    pieces: bytes = field(default=b"", compare=False, repr=False)

    @classmethod
    def trusted(
        cls,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        offsets: tuple[int, ...],
        local_shape: tuple[int, ...],
        nbytes: int,
        chunk_size: int,
        chunks: tuple[bytes, ...],
        framework: str,
        cell: tuple[int, int] | None = None,
        pieces: bytes = b"",
    ) -> TensorEntry:
        """An entry whose fields were checked together already (a decoded table)."""
        entry = object.__new__(cls)
        entry.__dict__.update(
            name=name,
            dtype=dtype,
            shape=shape,
            offsets=offsets,
            local_shape=local_shape,
            nbytes=nbytes,
            chunk_size=chunk_size,
            chunks=chunks,
            framework=framework,
            cell=cell,
            pieces=pieces,
        )
        return entry

    @property
    def chunk_starts(self) -> np.ndarray:
        """Where each chunk starts in the box's buffer (int64, ascending, one per chunk)."""
        starts: np.ndarray | None = self.__dict__.get("_starts")
        if starts is None:  # computed once (not a cached_property: 3.11's takes a lock)
            if self.cell is None:
                starts = np.arange(0, self.nbytes, self.chunk_size, dtype=np.int64)
            else:
                itemsize = numpy_dtype(self.dtype).itemsize
                starts = box_chunk_starts(self.offsets, self.local_shape, itemsize, self.cell)
            self.__dict__["_starts"] = starts
        return starts

    def chunk_start(self, index: int) -> int:
        """Where chunk ``index`` starts in the box's buffer."""
        if self.cell is None:
            return index * self.chunk_size
        if len(self.chunks) == 1:
            return 0
        return int(self.chunk_starts[index])

    def chunk_length(self, index: int) -> int:
        """The bytes chunk ``index`` holds (what its stored record must decode to)."""
        if self.cell is None:
            return min(self.chunk_size, self.nbytes - index * self.chunk_size)
        if len(self.chunks) == 1:
            return self.nbytes
        starts = self.chunk_starts
        end = int(starts[index + 1]) if index + 1 < len(starts) else self.nbytes
        return end - int(starts[index])

    def chunk_indices(self, starts: np.ndarray, run_bytes: int) -> np.ndarray:
        """Sorted indices of the chunks holding any byte of the runs at ``starts``
        (``run_bytes`` each, in this box's buffer)."""
        if starts.size == 0 or run_bytes == 0:
            return np.empty(0, dtype=np.int64)
        if self.cell is None:
            first = starts // self.chunk_size
            last = (starts + run_bytes - 1) // self.chunk_size
        else:
            bounds = self.chunk_starts
            first = np.searchsorted(bounds, starts, side="right") - 1
            last = np.searchsorted(bounds, starts + run_bytes - 1, side="right") - 1
        return spanned(first, last)

    def to_wire(self) -> dict[str, Any]:
        """The format-1 map of an entry (format 1 has no grid: a gridded entry is
        written only in a table, see encode_table)."""
        return {
            "chunk_size": self.chunk_size,
            "chunks": list(self.chunks),
            "dtype": self.dtype,
            "framework": self.framework,
            "local_shape": list(self.local_shape),
            "name": self.name,
            "nbytes": self.nbytes,
            "offsets": list(self.offsets),
            "shape": list(self.shape),
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> TensorEntry:
        entry = cls(
            name=_typed(wire, "name", str),
            dtype=_typed(wire, "dtype", str),
            shape=_int_tuple(wire, "shape"),
            offsets=_int_tuple(wire, "offsets"),
            local_shape=_int_tuple(wire, "local_shape"),
            nbytes=_typed(wire, "nbytes", int),
            chunk_size=_typed(wire, "chunk_size", int),
            chunks=tuple(_typed(wire, "chunks", list)),
            framework=_typed(wire, "framework", str),
        )
        entry.check()
        return entry

    def check(self) -> None:
        """Raise CorruptObjectError unless every field agrees with every other.

        Called before anything is allocated or read for the entry, so a
        well-hashed but inconsistent manifest can never size a buffer.
        """
        problem = self._inconsistency()
        if problem:
            raise CorruptObjectError(f"tensor entry {problem}", tensor=self.name)

    def _inconsistency(self) -> str | None:
        if not self.name:
            return "has an empty name"
        if self.dtype not in SUPPORTED_DTYPES:
            return f"has unknown dtype {self.dtype!r}"
        if self.framework not in FRAMEWORKS:
            return f"has unknown framework {self.framework!r}"
        n_dims = len(self.shape)
        if n_dims > MAX_DIMS:
            return f"has {n_dims} dimensions (at most {MAX_DIMS})"
        if len(self.offsets) != n_dims or len(self.local_shape) != n_dims:
            return "rank mismatch between shape, offsets and local_shape"
        if any(g < 0 for g in self.shape):
            return f"has a negative dimension in shape {list(self.shape)}"
        if any(
            o < 0 or s < 0 or o + s > g
            for o, s, g in zip(self.offsets, self.local_shape, self.shape, strict=True)
        ):
            return "box outside its shape"
        if not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            return f"has chunk size {self.chunk_size} (1 to {MAX_CHUNK_SIZE})"
        itemsize = numpy_dtype(self.dtype).itemsize
        expected_bytes = math.prod(self.local_shape) * itemsize
        if self.nbytes != expected_bytes:
            return f"says {self.nbytes} bytes, its box of {self.dtype} holds {expected_bytes}"
        if self.cell is None:
            expected_chunks = -(-self.nbytes // self.chunk_size)
        else:
            problem = cell_problem(self.shape, itemsize, self.cell)
            if problem:
                return problem
            expected_chunks = (
                0 if not self.nbytes else box_chunk_count(self.offsets, self.local_shape, self.cell)
            )
        if len(self.chunks) != expected_chunks:
            return f"lists {len(self.chunks)} chunks, its size needs {expected_chunks}"
        if not all(isinstance(c, bytes) and len(c) == 32 for c in self.chunks):
            return "has a malformed chunk digest"
        return None


@dataclass(frozen=True)
class ShardManifest:
    """What one writing rank saved: its tensor boxes and its rank-local state.

    ``tensors`` are boxes of the generation's global tensors; ``local_state``
    maps each RankLocal key path to an encoded state tree whose tensors are
    ``local_tensors`` (names scoped to this rank).
    """

    run: str
    generation: int
    rank: int
    tensors: tuple[TensorEntry, ...]
    local_state: bytes = b""
    writer: dict[str, Any] = field(default_factory=dict)
    local_tensors: tuple[TensorEntry, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        # The compact table (format 4) where an entry lies on a grid: a shard of pre-grid
        # entries stays format 2, which an older castore still reads.
        grid = any(e.cell is not None for e in (*self.tensors, *self.local_tensors))
        table = encode_compact if grid else encode_table
        wire = {
            "format": COMPACT_SHARD_FORMAT if grid else SHARD_FORMAT,
            "generation": self.generation,
            "local_state": self.local_state,
            "local_tensors": table(self.local_tensors),
            "rank": self.rank,
            "run": self.run,
            "tensors": table(self.tensors),
            "type": TYPE_SHARD,
            "writer": dict(sorted(self.writer.items())),
        }
        # Chunk pieces (docs/FORMAT.md): one bytes value per tensor entry, in table order.
        # A reader that does not know the field reads the shard as before.
        pieces = [e.pieces for e in self.tensors]
        if any(pieces):
            wire["pieces"] = pieces
        return dict(sorted(wire.items()))

    def chunk_digests(self) -> list[bytes]:
        """Every chunk digest the shard names, in order (repeats included)."""
        return [c for e in (*self.tensors, *self.local_tensors) for c in e.chunks]

    @classmethod
    def from_wire(cls, wire: dict[str, Any], *, only: str | None = None) -> ShardManifest:
        """Decode a shard of format 1 (entries as maps), 2 (entries as a table) or 3
        (a table whose entries may lie on their tensor's grid).

        ``only``: decode just the entries of that global tensor and no rank-local
        tensors (a partial read); the table is still checked whole, column-wise.
        """
        writer = _typed(wire, "writer", dict)
        check_depth(writer, "shard field 'writer'", MAX_FIELD_DEPTH)
        if wire.get("format") == 1:
            tensors = tuple(TensorEntry.from_wire(t) for t in _typed(wire, "tensors", list))
            if only is not None:
                tensors = tuple(t for t in tensors if t.name == only)
                local_tensors: tuple[TensorEntry, ...] = ()
            else:
                local_tensors = tuple(
                    TensorEntry.from_wire(t) for t in _typed(wire, "local_tensors", list)
                )
        else:
            version = wire.get("format")
            grid = version in (GRID_SHARD_FORMAT, COMPACT_SHARD_FORMAT)
            columns = expand_compact if version == COMPACT_SHARD_FORMAT else _as_is
            table = EntryTable(columns(_typed(wire, "tensors", dict)), grid=grid)
            table.take_pieces(wire.get("pieces"))
            local_tensors = (
                EntryTable(columns(_typed(wire, "local_tensors", dict)), grid=grid).entries()
                if only is None
                else ()
            )
            if only is None:  # entries built when first asked for
                return TableShard.from_table(wire, table, writer, local_tensors)
            tensors = table.named(only)
        return cls(
            run=_typed(wire, "run", str),
            generation=_positive(wire, "generation"),
            rank=_non_negative(wire, "rank"),
            tensors=tensors,
            local_state=_typed(wire, "local_state", bytes),
            writer=writer,
            local_tensors=local_tensors,
        )


class TableShard(ShardManifest):
    """A decoded shard whose tensor entries are built from its checked ``table`` when
    first asked for: the coordinator's checks and a restore's planning read the table's
    columns (castore.core.boxtable) and build entries only for the boxes they use."""

    table: EntryTable

    @classmethod
    def from_table(
        cls,
        wire: dict[str, Any],
        table: EntryTable,
        writer: dict[str, Any],
        local_tensors: tuple[TensorEntry, ...],
    ) -> TableShard:
        shard = object.__new__(cls)
        shard.__dict__.update(
            run=_typed(wire, "run", str),
            generation=_positive(wire, "generation"),
            rank=_non_negative(wire, "rank"),
            local_state=_typed(wire, "local_state", bytes),
            writer=writer,
            local_tensors=local_tensors,
            table=table,
        )
        return shard

    def chunk_digests(self) -> list[bytes]:
        raw = self.table.chunk_bytes  # cut from the table, no entry built
        own = [raw[at : at + 32] for at in range(0, len(raw), 32)]
        return own + [c for e in self.local_tensors for c in e.chunks]

    @property  # type: ignore[override]
    def tensors(self) -> tuple[TensorEntry, ...]:
        built: tuple[TensorEntry, ...] | None = self.__dict__.get("_tensors")
        if built is None:
            built = self.__dict__["_tensors"] = self.table.entries()
        return built

    @tensors.setter
    def tensors(self, value: tuple[TensorEntry, ...]) -> None:
        self.__dict__["_tensors"] = value


@dataclass(frozen=True)
class GenerationRoot:
    """The Merkle root of one generation; its digest names the generation."""

    run: str
    generation: int
    step: int
    parent: bytes | None
    time: float
    world_size: int
    shards: tuple[bytes, ...]
    state: bytes
    metadata: bytes = b""
    frameworks: dict[str, str] = field(default_factory=dict)
    data_order: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    # Who published it: host, pid, job and writer epoch (castore.core.fencing); roots
    # written before epochs have none, and encode without the key.
    writer: dict[str, Any] = field(default_factory=dict)
    # Each DTensor's mesh and placements, by key path (castore.format.dtensor.layout_record);
    # roots without DTensors encode without the key.
    layouts: dict[str, Any] = field(default_factory=dict)
    # The small tensors one box holds whole (replicated values, each written by one rank),
    # their entries repeated from the shards: a rank restoring onto the saved layout reads
    # them here instead of the manifest of whichever rank wrote each (castore.dist.planning).
    # Roots without any encode without the key.
    whole: tuple[TensorEntry, ...] = ()
    # Where a generation made from others came from (castore.lineage): ``op`` ("branch")
    # and ``from``, a list of {run, generation, root}. Saves record none.
    lineage: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "data_order": dict(sorted(self.data_order.items())),
            "format": ROOT_FORMAT,
            "frameworks": dict(sorted(self.frameworks.items())),
            "generation": self.generation,
            "metadata": self.metadata,
            "parent": self.parent,
            "run": self.run,
            "shards": list(self.shards),
            "state": self.state,
            "stats": dict(sorted(self.stats.items())),
            "step": self.step,
            "time": float(self.time),
            "type": TYPE_ROOT,
            "world_size": self.world_size,
        }
        if self.writer:
            wire["writer"] = dict(sorted(self.writer.items()))
        if self.layouts:
            wire["layouts"] = dict(sorted(self.layouts.items()))
        if self.whole:
            wire["whole"] = encode_compact(self.whole)
        if self.lineage:
            wire["lineage"] = dict(sorted(self.lineage.items()))
        return wire

    @property
    def epoch(self) -> int:
        """The writer epoch this generation was published under (0: before epochs)."""
        epoch = self.writer.get("epoch", 0)
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> GenerationRoot:
        parent = wire.get("parent")
        if parent is not None and not (isinstance(parent, bytes) and len(parent) == 32):
            raise CorruptObjectError("root has a malformed parent digest")
        shards = tuple(_typed(wire, "shards", list))
        if not all(isinstance(s, bytes) and len(s) == 32 for s in shards):
            raise CorruptObjectError("root has a malformed shard digest")
        stamp = float(_typed(wire, "time", (int, float)))
        if not math.isfinite(stamp):
            raise CorruptObjectError(f"root has a non-finite time {stamp}")
        frameworks = _typed(wire, "frameworks", dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in frameworks.items()):
            raise CorruptObjectError("root field 'frameworks' must map names to version strings")
        stats = _typed(wire, "stats", dict)
        if not all(
            isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v)
            for k, v in stats.items()
        ):
            raise CorruptObjectError("root field 'stats' must map names to finite numbers")
        data_order = _typed(wire, "data_order", dict)
        check_depth(data_order, "root field 'data_order'", MAX_FIELD_DEPTH)
        writer = wire.get("writer", {})
        if not isinstance(writer, dict):
            raise CorruptObjectError("root field 'writer' is not a map")
        check_depth(writer, "root field 'writer'", MAX_FIELD_DEPTH)
        layouts = wire.get("layouts", {})
        if not isinstance(layouts, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in layouts.items()
        ):
            raise CorruptObjectError("root field 'layouts' must map key paths to maps")
        check_depth(layouts, "root field 'layouts'", MAX_FIELD_DEPTH)
        lineage = wire.get("lineage", {})
        if not isinstance(lineage, dict):
            raise CorruptObjectError("root field 'lineage' is not a map")
        check_depth(lineage, "root field 'lineage'", MAX_FIELD_DEPTH)
        whole: tuple[TensorEntry, ...] = ()
        if "whole" in wire:
            try:
                whole = EntryTable(expand_compact(wire["whole"]), grid=True).entries()
            except CorruptObjectError as exc:
                raise CorruptObjectError(f"root field 'whole': {exc}") from exc
        return cls(
            run=_typed(wire, "run", str),
            generation=_positive(wire, "generation"),
            step=_typed(wire, "step", int),
            parent=parent,
            time=stamp,
            world_size=_non_negative(wire, "world_size"),
            shards=shards,
            state=_typed(wire, "state", bytes),
            metadata=_typed(wire, "metadata", bytes),
            frameworks=frameworks,
            data_order=data_order,
            stats=stats,
            writer=writer,
            layouts=layouts,
            whole=whole,
            lineage=lineage,
        )


# -- the tensor table (shard manifests of format 2) ------------------------------------
#
# A shard's entries as columns: per entry its name, dtype and framework (lists of str),
# its number of dimensions (u8), its byte count and chunk size (i64 LE); per dimension
# of every entry in order its global size, box offset and box size (i64 LE); per chunk
# of every entry in order its digest (32 bytes). Decoding checks whole columns at once
# (numpy), so one entry costs a few microseconds, not one Python object graph each.

TABLE_KEYS = (
    "chunk_size", "chunks", "dtype", "framework", "local_shape",
    "name", "nbytes", "ndim", "offsets", "shape",
)  # fmt: skip
# Format 3 adds, per entry, its tensor's grid: the cell dimension (u8; RUNS for an
# entry cut every chunk_size bytes, as in format 2) and the cell extent along it (i64).
GRID_TABLE_KEYS = tuple(sorted((*TABLE_KEYS, "cell_dim", "cell_extent")))
_I64 = np.dtype("<i8")
# A box may hold at most this many bytes (checked in floating point first, so the
# exact integer products below cannot overflow).
MAX_BOX_BYTES = 1 << 61
_ITEMSIZE = {name: numpy_dtype(name).itemsize for name in SUPPORTED_DTYPES}


def encode_table(entries: Sequence[TensorEntry], *, grid: bool = False) -> dict[str, Any]:
    """The columns of ``entries``, keys in canonical (sorted) order; ``grid``: with
    format 3's grid columns."""
    shape: list[int] = []
    offsets: list[int] = []
    local: list[int] = []
    for e in entries:
        shape += e.shape
        offsets += e.offsets
        local += e.local_shape
    columns = {
        "chunk_size": _i64_bytes([e.chunk_size for e in entries]),
        "chunks": b"".join(c for e in entries for c in e.chunks),
        "dtype": [e.dtype for e in entries],
        "framework": [e.framework for e in entries],
        "local_shape": _i64_bytes(local),
        "name": [e.name for e in entries],
        "nbytes": _i64_bytes([e.nbytes for e in entries]),
        "ndim": bytes(len(e.shape) for e in entries),
        "offsets": _i64_bytes(offsets),
        "shape": _i64_bytes(shape),
    }
    if grid:
        columns["cell_dim"] = bytes(RUNS if e.cell is None else e.cell[0] for e in entries)
        columns["cell_extent"] = _i64_bytes([0 if e.cell is None else e.cell[1] for e in entries])
    elif any(e.cell is not None for e in entries):
        raise ValueError("entries on a grid need the grid columns (format 3)")
    return dict(sorted(columns.items()))


def _i64_bytes(values: list[int]) -> bytes:
    return np.asarray(values, dtype=_I64).tobytes() if values else b""


class EntryTable:
    """A decoded, checked tensor table: entries are built only when asked for."""

    __slots__ = ("names", "_dtypes", "_frameworks", "_ndim", "_dims", "_dim_start",
                 "_nbytes", "_chunk_size", "_chunks", "_chunk_start", "_cells",
                 "_pieces")  # fmt: skip

    def __init__(self, wire: Any, *, grid: bool = False) -> None:
        keys = GRID_TABLE_KEYS if grid else TABLE_KEYS
        if not isinstance(wire, dict) or sorted(wire) != list(keys):
            raise CorruptObjectError("tensor table does not have the table's fields")
        names = _str_column(wire, "name")
        n = len(names)
        dtypes = _str_column(wire, "dtype", n)
        frameworks = _str_column(wire, "framework", n)
        ndim = np.frombuffer(_typed(wire, "ndim", bytes), dtype=np.uint8)
        nbytes = _i64_column(wire, "nbytes")
        chunk_size = _i64_column(wire, "chunk_size")
        if not len(ndim) == len(nbytes) == len(chunk_size) == n:
            raise CorruptObjectError(f"tensor table columns disagree on its {n} entries")
        dims = [_i64_column(wire, key) for key in ("shape", "offsets", "local_shape")]
        total_dims = int(ndim.sum(dtype=np.int64))
        if any(len(column) != total_dims for column in dims):
            raise CorruptObjectError(
                f"tensor table has {[len(c) for c in dims]} shape, offset and box values "
                f"where its entries' dimensions need {total_dims} each (rank mismatch)"
            )
        chunks = _typed(wire, "chunks", bytes)
        self._pieces: list[bytes] | None = None
        self._cells: tuple[Any, Any] | None = None
        if grid:
            cell_dim = np.frombuffer(_typed(wire, "cell_dim", bytes), dtype=np.uint8)
            cell_extent = _i64_column(wire, "cell_extent")
            if not len(cell_dim) == len(cell_extent) == n:
                raise CorruptObjectError(f"tensor table grid columns disagree on its {n} entries")
            self._cells = (cell_dim.astype(np.int64), cell_extent)
        self.names, self._dtypes, self._frameworks = names, dtypes, frameworks
        self._ndim, self._dims, self._nbytes, self._chunk_size = ndim, dims, nbytes, chunk_size
        self._chunks = chunks
        self._dim_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(ndim, out=self._dim_start[1:])
        self._chunk_start = self._check(n)

    def _check(self, n: int) -> Any:
        """Every entry's fields agree (as TensorEntry.check), checked column-wise.

        Returns where each entry's chunk digests start (n + 1 offsets, in digests)."""
        names, dtypes, frameworks = self.names, self._dtypes, self._frameworks
        if not n:  # no entries (most shards' rank-local tensors): nothing to cross-check
            if self._chunks:
                raise CorruptObjectError(
                    f"tensor table lists {len(self._chunks)} bytes of chunk digests, its "
                    "entries need 0 digests of 32 bytes"
                )
            return np.zeros(1, dtype=np.int64)
        if not all(names):
            return self._fail(names.index(""), "has an empty name")
        unknown = set(dtypes) - SUPPORTED_DTYPES
        if unknown:
            dtype = next(d for d in dtypes if d in unknown)
            return self._fail(dtypes.index(dtype), f"has unknown dtype {dtype!r}")
        unknown = set(frameworks) - set(FRAMEWORKS)
        if unknown:
            framework = next(f for f in frameworks if f in unknown)
            return self._fail(frameworks.index(framework), f"has unknown framework {framework!r}")
        too_deep = np.flatnonzero(self._ndim > MAX_DIMS)
        if len(too_deep):
            i = int(too_deep[0])
            return self._fail(i, f"has {int(self._ndim[i])} dimensions (at most {MAX_DIMS})")
        shape, offsets, local = self._dims
        owner = np.repeat(np.arange(n), self._ndim)  # the entry of every dimension value
        bad = np.flatnonzero(shape < 0)
        if len(bad):
            i = int(owner[bad[0]])
            return self._fail(i, f"has a negative dimension in shape {list(self._of(0, i))}")
        bad = np.flatnonzero((offsets < 0) | (local < 0) | (local > shape - offsets))
        if len(bad):
            return self._fail(int(owner[bad[0]]), "box outside its shape")
        bad = np.flatnonzero((self._chunk_size <= 0) | (self._chunk_size > MAX_CHUNK_SIZE))
        if len(bad):
            i = int(bad[0])
            return self._fail(
                i, f"has chunk size {int(self._chunk_size[i])} (1 to {MAX_CHUNK_SIZE})"
            )
        itemsize = np.fromiter(map(_ITEMSIZE.__getitem__, dtypes), dtype=np.int64, count=n)
        # Elements per box: products over each entry's dimensions, 1 for a scalar. In
        # floating point first: a box past MAX_BOX_BYTES is refused before the exact
        # product (which then cannot overflow) is taken.
        has_dims = self._ndim > 0
        starts = self._dim_start[:-1][has_dims]
        rough = np.ones(n, dtype=np.float64)
        exact = np.ones(n, dtype=np.int64)
        if len(starts):
            rough[has_dims] = np.multiply.reduceat(local.astype(np.float64), starts)
        rough *= itemsize
        bad = np.flatnonzero(rough >= MAX_BOX_BYTES)
        if len(bad):
            i = int(bad[0])
            holds = math.prod(self._of(2, i)) * _ITEMSIZE[dtypes[i]]
            return self._fail(i, f"says {int(self._nbytes[i])} bytes, its box of {dtypes[i]} "
                              f"holds {holds}")  # fmt: skip
        if len(starts):
            exact[has_dims] = np.multiply.reduceat(local, starts)
        exact *= itemsize
        bad = np.flatnonzero(self._nbytes != exact)
        if len(bad):
            i = int(bad[0])
            return self._fail(i, f"says {int(self._nbytes[i])} bytes, its box of {dtypes[i]} "
                              f"holds {int(exact[i])}")  # fmt: skip
        counts = -(-self._nbytes // self._chunk_size)
        if self._cells is not None:
            counts = self._grid_counts(n, counts, itemsize)
        chunk_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=chunk_start[1:])
        listed, rest = divmod(len(self._chunks), 32)
        if rest or listed != int(chunk_start[-1]):
            raise CorruptObjectError(
                f"tensor table lists {len(self._chunks)} bytes of chunk digests, its entries "
                f"need {int(chunk_start[-1])} digests of 32 bytes"
            )
        return chunk_start

    def _grid_counts(self, n: int, counts: Any, itemsize: Any) -> Any:
        """Each entry's chunk count where its chunks lie on a grid (the others keep
        ``counts``), after checking every grid against its tensor, column-wise."""
        assert self._cells is not None
        cell_dim, extent = self._cells
        gridded = cell_dim != RUNS
        shape, offsets, local = self._dims
        ndim = self._ndim.astype(np.int64)
        scalar = gridded & (ndim == 0)
        bad = np.flatnonzero(scalar & ((cell_dim != 0) | (extent != 1)))
        if len(bad):
            return self._fail(int(bad[0]), "has a grid other than [0, 1] for a 0-d tensor")
        banded = gridded & (ndim > 0)
        bad = np.flatnonzero(banded & (cell_dim >= ndim))
        if len(bad):
            i = int(bad[0])
            return self._fail(i, f"has cell dimension {int(cell_dim[i])} for a tensor of "
                              f"{int(ndim[i])} dimensions")  # fmt: skip
        where = self._dim_start[:-1] + np.where(banded, cell_dim, 0)
        where = np.minimum(where, max(len(shape) - 1, 0))
        size_k = np.where(banded, shape[where] if len(shape) else 0, 1)
        bad = np.flatnonzero(banded & ((extent < 1) | (extent > np.maximum(size_k, 1))))
        if len(bad):
            i = int(bad[0])
            return self._fail(i, f"has cell extent {int(extent[i])} along a dimension of "
                              f"{int(size_k[i])}")  # fmt: skip
        # Per dimension value: before, at or after its entry's cell dimension.
        position = np.arange(len(shape), dtype=np.int64) - np.repeat(self._dim_start[:-1], ndim)
        k = np.repeat(np.where(banded, cell_dim, -1), ndim)
        has_dims = self._ndim > 0
        starts = self._dim_start[:-1][has_dims]
        after = np.ones(n, dtype=np.float64)
        lead = np.ones(n, dtype=np.int64)
        if len(starts):
            tail = np.where((position > k) & (k >= 0), shape, 1).astype(np.float64)
            after[has_dims] = np.multiply.reduceat(tail, starts)
            lead[has_dims] = np.multiply.reduceat(np.where(position < k, local, 1), starts)
        bad = np.flatnonzero(banded & (extent * after * itemsize > MAX_CHUNK_SIZE))
        if len(bad):
            return self._fail(int(bad[0]), f"has cells of more than {MAX_CHUNK_SIZE} bytes")
        lo = np.where(banded, offsets[where] if len(offsets) else 0, 0)
        span = np.where(banded, local[where] if len(local) else 0, 0)
        safe = np.maximum(extent, 1)
        bands = -(-(lo + span) // safe) - lo // safe
        grid_counts = np.where(ndim == 0, 1, lead * bands)
        grid_counts = np.where(self._nbytes == 0, 0, grid_counts)
        return np.where(gridded, grid_counts, counts)

    def _of(self, column: int, i: int) -> tuple[int, ...]:
        start, stop = int(self._dim_start[i]), int(self._dim_start[i + 1])
        return tuple(self._dims[column][start:stop].tolist())

    def _fail(self, i: int, problem: str) -> Any:
        raise CorruptObjectError(f"tensor entry {problem}", tensor=self.names[i])

    def __len__(self) -> int:
        return len(self.names)

    @property
    def dtypes(self) -> list[str]:
        return self._dtypes

    @property
    def ndim(self) -> Any:
        """Each entry's number of dimensions (uint8)."""
        return self._ndim

    @property
    def dims(self) -> tuple[Any, Any, Any]:
        """Every entry's shape, offsets and box sizes, one int64 array each, entry after
        entry (entry ``i``'s values from ``dim_start[i]`` to ``dim_start[i + 1]``)."""
        return self._dims[0], self._dims[1], self._dims[2]

    @property
    def dim_start(self) -> Any:
        return self._dim_start

    @property
    def chunk_start(self) -> Any:
        """Where each entry's digests start in :attr:`chunk_bytes`, in digests (n + 1)."""
        return self._chunk_start

    def take_pieces(self, pieces: Any) -> None:
        """The shard's chunk pieces (docs/FORMAT.md), one bytes value per entry, or None.

        Their lengths are checked where a read uses them (castore.format.pieces):
        values that do not merge to their chunk's name are not used.
        """
        if pieces is None:
            return
        if not isinstance(pieces, list) or len(pieces) != len(self.names):
            raise CorruptObjectError(
                f"shard field 'pieces' must list one value for each of its {len(self.names)} "
                "tensor entries"
            )
        if not set(map(type, pieces)) <= {bytes}:
            raise CorruptObjectError("shard field 'pieces' must hold bytes")
        self._pieces = pieces

    @property
    def chunk_bytes(self) -> bytes:
        """Every entry's chunk digests, 32 bytes each, entry after entry."""
        return self._chunks

    def entries(self, indices: Iterable[int] | None = None) -> tuple[TensorEntry, ...]:
        """The entries at ``indices`` (default all), in order."""
        shape, offsets, local = (column.tolist() for column in self._dims)
        dim_start = self._dim_start.tolist()
        chunk_start = self._chunk_start.tolist()
        nbytes, chunk_size = self._nbytes.tolist(), self._chunk_size.tolist()
        if self._cells is None:
            cells: list[tuple[int, int] | None] = [None] * len(self.names)
        else:
            cells = [
                None if d == RUNS else (d, e)
                for d, e in zip(self._cells[0].tolist(), self._cells[1].tolist(), strict=True)
            ]
        if indices is None:  # every digest: cut once, each entry takes a slice of the list
            raw = self._chunks
            every = [raw[at : at + 32] for at in range(0, len(raw), 32)]

            def chunks_of(i: int) -> tuple[bytes, ...]:
                return tuple(every[chunk_start[i] : chunk_start[i + 1]])
        else:

            def chunks_of(i: int) -> tuple[bytes, ...]:
                raw = self._chunks
                return tuple(
                    raw[at : at + 32]
                    for at in range(chunk_start[i] * 32, chunk_start[i + 1] * 32, 32)
                )

        new = TensorEntry.trusted
        pieces = self._pieces or [b""] * len(self.names)
        return tuple(
            new(
                self.names[i],
                self._dtypes[i],
                tuple(shape[dim_start[i] : dim_start[i + 1]]),
                tuple(offsets[dim_start[i] : dim_start[i + 1]]),
                tuple(local[dim_start[i] : dim_start[i + 1]]),
                nbytes[i],
                chunk_size[i],
                chunks_of(i),
                self._frameworks[i],
                cells[i],
                pieces[i],
            )
            for i in (range(len(self.names)) if indices is None else indices)
        )

    def entry_at(self, i: int) -> TensorEntry:
        """Entry ``i`` alone (without the whole columns :meth:`entries` converts)."""
        d0, d1 = int(self._dim_start[i]), int(self._dim_start[i + 1])
        c0, c1 = int(self._chunk_start[i]) * 32, int(self._chunk_start[i + 1]) * 32
        raw = self._chunks
        cell = None
        if self._cells is not None and int(self._cells[0][i]) != RUNS:
            cell = (int(self._cells[0][i]), int(self._cells[1][i]))
        shape, offsets, local = self._dims
        return TensorEntry.trusted(
            self.names[i],
            self._dtypes[i],
            tuple(shape[d0:d1].tolist()),
            tuple(offsets[d0:d1].tolist()),
            tuple(local[d0:d1].tolist()),
            int(self._nbytes[i]),
            int(self._chunk_size[i]),
            tuple(raw[at : at + 32] for at in range(c0, c1, 32)),
            self._frameworks[i],
            cell,
            b"" if self._pieces is None else self._pieces[i],
        )

    def named(self, name: str) -> tuple[TensorEntry, ...]:
        """The entries of tensor ``name`` (none if this shard holds no box of it)."""
        return self.entries([i for i, n in enumerate(self.names) if n == name])


def _as_is(columns: dict[str, Any]) -> dict[str, Any]:
    return columns


def _str_column(wire: dict[str, Any], key: str, count: int | None = None) -> list[str]:
    values: list[str] = _typed(wire, key, list)
    if count is not None and len(values) != count:
        raise CorruptObjectError(f"tensor table has {len(values)} {key}s for {count} entries")
    if not set(map(type, values)) <= {str}:
        raise CorruptObjectError(f"tensor table column {key!r} must hold strings")
    return values


def _i64_column(wire: dict[str, Any], key: str) -> Any:
    data = _typed(wire, key, bytes)
    if len(data) % 8:
        raise CorruptObjectError(f"tensor table column {key!r} is not whole 8-byte integers")
    return np.frombuffer(data, dtype=_I64).astype(np.int64)  # native order, its own copy


AnyObject = GenerationRoot | ShardManifest
_DECODERS: dict[str, Any] = {TYPE_ROOT: GenerationRoot, TYPE_SHARD: ShardManifest}


def encode_object(obj: AnyObject) -> bytes:
    """Canonical msgpack bytes of a manifest object."""
    return msgpack.packb(obj.to_wire(), use_bin_type=True, use_single_float=False)


def object_digest(data: bytes) -> Digest:
    return digest_of(data)


def decode_object(
    data: bytes | memoryview, *, expect: str | None = None, only: str | None = None
) -> AnyObject:
    """Decode and validate an object's bytes; the caller has checked the digest.

    ``only`` (shards): decode the entries of that one tensor (ShardManifest.from_wire).
    """
    try:
        wire = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CorruptObjectError(f"object bytes are not valid msgpack: {exc}") from exc
    if not isinstance(wire, dict):
        raise CorruptObjectError("object is not a msgpack map")
    version = wire.get("format")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptObjectError("object has no format version")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"object written by format version {version}; this castore reads up to "
            f"{FORMAT_VERSION}: upgrade castore"
        )
    kind = wire.get("type")
    if not isinstance(kind, str) or kind not in _DECODERS or (expect not in (None, kind)):
        raise CorruptObjectError(f"object type is {kind!r}, expected {expect or 'a known type'}")
    try:
        if only is not None and kind == TYPE_SHARD:
            obj: AnyObject = ShardManifest.from_wire(wire, only=only)
        else:
            obj = _DECODERS[kind].from_wire(wire)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptObjectError(f"malformed {kind} object: {exc}") from exc
    return obj


def _typed(wire: dict[str, Any], key: str, kind: Any) -> Any:
    if key not in wire:
        raise CorruptObjectError(f"object field {key!r} is missing")
    value = wire[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptObjectError(f"object field {key!r} has type {type(value).__name__}")
    return value


def _positive(wire: dict[str, Any], key: str) -> int:
    value: int = _typed(wire, key, int)
    if value < 1:
        raise CorruptObjectError(f"object field {key!r} is {value}, must be at least 1")
    return value


def _non_negative(wire: dict[str, Any], key: str) -> int:
    value: int = _typed(wire, key, int)
    if value < 0:
        raise CorruptObjectError(f"object field {key!r} is {value}, must not be negative")
    return value


def _int_tuple(wire: dict[str, Any], key: str) -> tuple[int, ...]:
    values = _typed(wire, key, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CorruptObjectError(f"object field {key!r} must be a list of integers")
    return tuple(values)
