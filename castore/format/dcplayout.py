"""The layout of a generation saved through ``castore.dcp``, readable without torch.

``torch.distributed.checkpoint`` hands a storage writer the state dict it
flattened: one item per fully qualified name (``fqn``, such as
``model.emb.weight``). :class:`castore.dcp.CastoreWriter` stores each one as
a castore tensor (docs/INTEROP.md, "The layout of a DCP generation"):

* a tensor item under ``t/<fqn>``, boxed as DCP's planner cut it;
* a non-tensor item (which DCP's planner pickles) under ``b/<fqn>``: a uint8
  tensor holding castore's msgpack encoding of the value (never a pickle);
* the root's state tree is ``{"t": {fqn: tensor}, "b": {fqn: tensor}}``, and
  its metadata holds DCP's ``Metadata`` as plain values under ``"dcp"``,
  with ``planner_data``: the key path DCP flattened each item from.

``fqn`` is one key-path component here (escaped by
:func:`~castore.format.tree.escape_key`). Readers other than DCP (export,
``castore.train.load_weights``) see the state dict before DCP flattened it:
each item under the key path ``planner_data`` records, joined as castore
names any saved tensor (``model/emb.weight``), as ``dcp_to_torch_save`` nests
it and ``castore import`` of a DCP directory names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from castore.format.tree import escape_key, join_path

DCP_METADATA = ".metadata"  # the file that makes a directory a DCP checkpoint
TENSORS = "t"  # state-tree key of DCP's tensors: t/<fqn>
BYTES = "b"  # and of its bytes items: b/<fqn>


def stored_name(kind: str, fqn: str) -> str:
    """The castore tensor name of DCP's item ``fqn`` (``kind``: TENSORS or BYTES)."""
    return f"{kind}/{escape_key(fqn)}"


Keys = tuple[Any, ...]  # a key path: str keys of maps, int positions of lists


def recorded_keys(recorded: Any, fqn: str) -> Keys:
    """The key path DCP recorded for ``fqn`` (a list of str and int keys); ``(fqn,)``
    when nothing usable was recorded."""
    keys = tuple(recorded) if isinstance(recorded, list | tuple) else ()
    if not keys or not all(type(key) in (str, int) for key in keys):
        return (fqn,)
    return keys


def key_path(keys: Keys) -> str:
    """The castore name of a key path (``model/emb.weight``), as a saved tensor's."""
    name = ""
    for key in keys:
        name = join_path(name, key)
    return name


@dataclass(frozen=True)
class DcpLayout:
    """DCP's items in a generation: each ``fqn`` and the key path it was flattened from."""

    tensors: dict[str, Keys]  # stored under t/<fqn>
    values: dict[str, Keys]  # stored under b/<fqn>

    @classmethod
    def of(cls, metadata: Mapping[str, Any]) -> DcpLayout | None:
        """The layout a generation's metadata records; None: not saved through castore.dcp."""
        wire = metadata.get("dcp")
        if not isinstance(wire, Mapping):
            return None
        tensors, blobs = wire.get("tensors"), wire.get("bytes")
        if not isinstance(tensors, Mapping) or not isinstance(blobs, list):
            return None
        recorded = wire.get("planner_data")
        recorded = recorded if isinstance(recorded, Mapping) else {}

        def keys(fqns: Any) -> dict[str, Keys]:
            return {f: recorded_keys(recorded.get(f), f) for f in fqns if isinstance(f, str)}

        return cls(keys(tensors), keys(blobs))

    def saved_names(self, entries: Mapping[str, Any]) -> dict[str, Any]:
        """``entries`` (stored name -> anything) of the tensor items, by the key path each
        was saved under; the stored non-tensor values are left out."""
        return {
            key_path(keys): entries[stored]
            for fqn, keys in self.tensors.items()
            if (stored := stored_name(TENSORS, fqn)) in entries
        }

    def items_under(self, key: str) -> dict[str, str]:
        """The tensor items saved one key below ``key`` (a model's state dict saved under
        ``"model"``): that key -> the item's fqn."""
        return {
            keys[1]: fqn
            for fqn, keys in self.tensors.items()
            if len(keys) == 2 and keys[0] == key and isinstance(keys[1], str)
        }

    def summary(self) -> str:
        """One line for ``castore show``: what DCP recorded, counted."""
        return (
            f"DCP checkpoint: {len(self.tensors)} tensor item(s) under t/, "
            f"{len(self.values)} non-tensor item(s) under b/ (docs/INTEROP.md)"
        )
