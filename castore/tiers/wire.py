"""What nodes send each other over castore's process group, and how it is framed.

Chunks travel framed: for each one asked for, its length as a little-endian
int64 (-1: not sent), then its bytes; a reply cut short reads as "not sent"
for what is missing, and the requester takes those from another source.
Roots and shard manifests travel as (digest, bytes) pairs; every receiver
checks the bytes against the digest before it keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from castore.chunkstore.base import ChunkBackend, Namespace
from castore.core.reading import count_object_reads
from castore.errors import CorruptObjectError
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import (
    TYPE_ROOT,
    TYPE_SHARD,
    GenerationRoot,
    ShardManifest,
    decode_object,
)
from castore.support import framing


def read_objects(backend: ChunkBackend, keys: list[bytes]) -> list[bytes]:
    """The objects ``keys`` from this node's fast tier, each verified against its name."""
    found: dict[bytes, bytes] = {}

    def keep(values: Any) -> None:
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                found[key] = bytes(value)

    backend.read_many(Namespace.OBJECTS, keys, keep)
    count_object_reads(len(found), sum(len(v) for v in found.values()))
    for key in keys:
        if key not in found or digest_bytes(found[key]) != key:
            raise CorruptObjectError(
                f"object {key.hex()[:16]} is not intact in this node's fast tier"
            )
    return [found[k] for k in keys]


def decode_root(data: bytes) -> GenerationRoot:
    root = decode_object(data, expect=TYPE_ROOT)
    assert isinstance(root, GenerationRoot)
    return root


def decode_shard(data: bytes) -> ShardManifest:
    shard = decode_object(data, expect=TYPE_SHARD)
    assert isinstance(shard, ShardManifest)
    return shard


def root_among(objects: list[tuple[bytes, bytes]], digest: Digest) -> GenerationRoot:
    for key, value in objects:
        if key == digest.raw:
            return decode_root(value)
    raise CorruptObjectError(f"root {digest.short} was not sent")


def frame(values: Sequence[bytes | None]) -> bytearray:
    """Chunks for a peer, framed (castore.support.framing)."""
    return framing.frame(values)


def unframe(data: bytes, count: int) -> list[bytes | None]:
    """The ``count`` chunks of a peer's frame; one cut short or not sent is None."""
    return [None if v is None else bytes(v) for v in framing.unframe(data, count)]
