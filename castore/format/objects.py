"""Immutable manifest objects and their canonical msgpack encoding.

Every object is a msgpack map whose keys are sorted, that carries ``format``
(the format version) and ``type``, and is stored under the blake3 digest of its
encoded bytes. Encoding the same object twice gives the same bytes, so equal
objects get equal names. See docs/FORMAT.md for the field reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

from castore.errors import CorruptObjectError, FormatVersionError
from castore.format.dtypes import SUPPORTED_DTYPES, numpy_dtype
from castore.format.hashing import Digest, digest_of
from castore.format.tree import check_depth

FORMAT_VERSION = 1
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
    ``shape``; chunk ``i`` holds bytes ``[i*chunk_size, (i+1)*chunk_size)`` of
    the box's row-major buffer (the last one may be shorter).
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

    def to_wire(self) -> dict[str, Any]:
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
        expected_bytes = math.prod(self.local_shape) * numpy_dtype(self.dtype).itemsize
        if self.nbytes != expected_bytes:
            return f"says {self.nbytes} bytes, its box of {self.dtype} holds {expected_bytes}"
        expected_chunks = -(-self.nbytes // self.chunk_size)
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
        return {
            "format": FORMAT_VERSION,
            "generation": self.generation,
            "local_state": self.local_state,
            "local_tensors": [t.to_wire() for t in self.local_tensors],
            "rank": self.rank,
            "run": self.run,
            "tensors": [t.to_wire() for t in self.tensors],
            "type": TYPE_SHARD,
            "writer": dict(sorted(self.writer.items())),
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ShardManifest:
        writer = _typed(wire, "writer", dict)
        check_depth(writer, "shard field 'writer'", MAX_FIELD_DEPTH)
        return cls(
            run=_typed(wire, "run", str),
            generation=_positive(wire, "generation"),
            rank=_non_negative(wire, "rank"),
            tensors=tuple(TensorEntry.from_wire(t) for t in _typed(wire, "tensors", list)),
            local_state=_typed(wire, "local_state", bytes),
            writer=writer,
            local_tensors=tuple(
                TensorEntry.from_wire(t) for t in _typed(wire, "local_tensors", list)
            ),
        )


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

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "data_order": dict(sorted(self.data_order.items())),
            "format": FORMAT_VERSION,
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
        )


AnyObject = GenerationRoot | ShardManifest
_DECODERS: dict[str, Any] = {TYPE_ROOT: GenerationRoot, TYPE_SHARD: ShardManifest}


def encode_object(obj: AnyObject) -> bytes:
    """Canonical msgpack bytes of a manifest object."""
    return msgpack.packb(obj.to_wire(), use_bin_type=True, use_single_float=False)


def object_digest(data: bytes) -> Digest:
    return digest_of(data)


def decode_object(data: bytes | memoryview, *, expect: str | None = None) -> AnyObject:
    """Decode and validate an object's bytes; the caller has checked the digest."""
    try:
        wire = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CorruptObjectError(f"object bytes are not valid msgpack: {exc}") from exc
    if not isinstance(wire, dict):
        raise CorruptObjectError("object is not a msgpack map")
    version = wire.get("format")
    if not isinstance(version, int):
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
        obj: AnyObject = _DECODERS[kind].from_wire(wire)
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
