"""DCP's ``Metadata`` and non-tensor items kept without pickle.

DCP's ``Metadata`` is kept as plain values in the root's metadata (``{"dcp":
...}``: dtypes by name, sizes and chunk boxes as lists), and each bytes item
(a non-tensor value, which DCP's planner pickles) as castore's msgpack
encoding; the layout they make is :mod:`castore.format.dcplayout`.
"""

from __future__ import annotations

import io
from typing import Any

import msgpack
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from castore.errors import CastoreError, CorruptObjectError, UnsupportedValueError
from castore.format.dcplayout import BYTES, TENSORS, stored_name
from castore.format.dtypes import SUPPORTED_DTYPES, torch_dtype
from castore.format.tree import EXT_TENSOR, decode_tree, encode_tree, escape_key


def metadata_to_wire(md: Metadata) -> dict[str, Any]:
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


def metadata_from_wire(wire: dict[str, Any], storage_data: Any) -> Metadata:
    """DCP's Metadata from its stored plain values; anything malformed is damage."""
    try:
        return _decode_wire(wire, storage_data)
    except CastoreError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CorruptObjectError(
            f"the stored DCP metadata is malformed: {type(exc).__name__}: {exc}"
        ) from exc


def _decode_wire(wire: dict[str, Any], storage_data: Any) -> Metadata:
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


def plain_bytes(data: Any, fqn: str) -> bytes:
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


def pickle_for_planner(encoded: bytes, fqn: str, where: dict[str, Any]) -> bytes:
    """What DCP's planner expects to unpickle, rebuilt from the stored plain value."""
    try:
        value = decode_tree(encoded)
    except CastoreError as exc:
        raise CorruptObjectError(f"bytes item {fqn!r} does not decode: {exc}", **where) from exc
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def state_tree(md: Metadata) -> bytes:
    """The root's state tree: every tensor and bytes item as a tensor reference."""

    def ref(name: str) -> msgpack.ExtType:
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb([name, "torch"], use_bin_type=True))

    tree: dict[str, Any] = {TENSORS: {}, BYTES: {}}
    for fqn, item in md.state_dict_metadata.items():
        kind = BYTES if isinstance(item, BytesStorageMetadata) else TENSORS
        tree[kind][escape_key(fqn)] = ref(stored_name(kind, fqn))
    return msgpack.packb(tree, use_bin_type=True)
