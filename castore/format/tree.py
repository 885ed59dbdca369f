"""State trees: nested containers of tensors and plain values, without pickle.

A state is split in two: its tensors, each named by its key path and stored as
chunks, and everything else, encoded as msgpack. msgpack has no tuple, no
ordered-dict and no tensor, so those are msgpack extension types whose payload
is itself msgpack (codes below, documented in docs/FORMAT.md).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from castore.errors import CastoreError, CorruptObjectError, UnsupportedValueError
from castore.format.dtensor import DTensorBlock, dtensor_block, is_dtensor
from castore.format.dtypes import (
    SUPPORTED_DTYPES,
    name_of_numpy_dtype,
    name_of_torch_dtype,
    numpy_dtype,
)
from castore.format.hashing import digest_bytes
from castore.format.shard import RankLocal, Shard

EXT_TUPLE = 1
EXT_TENSOR = 2
EXT_ORDERED_DICT = 3
EXT_BIG_INT = 4
EXT_NUMPY_SCALAR = 5
EXT_RANK_LOCAL = 6

_INT_MIN, _UINT_MAX = -(1 << 63), (1 << 64) - 1
# Containers may nest this deep in a state (real states nest a handful of levels).
# The bound keeps every walk of a tree shallow: decoding nests one msgpack unpack
# (with its own C stack frame of tens of KiB) per tuple or ordered-dict level,
# so a file must never choose the depth.
MAX_DEPTH = 64


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor (or this rank's block of one) found in a state, with its bytes.

    ``shape`` is the global shape; ``offsets``/``local_shape`` place the block
    (the whole tensor unless it came from a :class:`~castore.Shard` or a DTensor).
    ``written_elsewhere``: a replica of a block another rank writes (a DTensor
    along its Replicate mesh dimensions, castore.format.dtensor): named in this
    rank's layout, left out of its shard, so the block is written once.
    ``replicas``: the global ranks that hold the same block, this one among
    them (empty unless another does): their copies are compared before a
    publish (castore.dist.replicas).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray  # flat, C-contiguous uint8 view of little-endian bytes
    framework: str
    offsets: tuple[int, ...] = ()
    local_shape: tuple[int, ...] = ()
    sharded: bool = False
    written_elsewhere: bool = False
    replicas: tuple[int, ...] = ()
    # A DTensor's mesh and placements (castore.format.dtensor.layout_record); else None.
    layout: dict[str, Any] | None = field(default=None, compare=False)
    # An async save's tensor still on its GPU: its flat uint8 bytes there, copied
    # to pinned host memory by castore.core.staging (``data`` is then empty).
    device_bytes: Any = None
    # A plain CPU torch tensor whose memory ``data`` views, and its version counter
    # when it was encoded (castore.core.unchanged: a save that trusts versions).
    source: Any = field(default=None, compare=False, repr=False)
    version: int = field(default=-1, compare=False)

    def __post_init__(self) -> None:
        if not self.local_shape:
            object.__setattr__(self, "local_shape", self.shape)
        if not self.offsets:
            object.__setattr__(self, "offsets", (0,) * len(self.shape))

    @classmethod
    def whole(
        cls,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        data: np.ndarray,
        framework: str,
        source: Any = None,
        version: int = -1,
    ) -> TensorLeaf:
        """The leaf of a whole tensor (not a block), as ``TensorLeaf(name, dtype, shape,
        data, framework, source=..., version=...)`` makes it, without the frozen
        dataclass's setattr per field: a state of 2,004 tensors makes 2,004 of these."""
        leaf = object.__new__(cls)
        leaf.__dict__.update(
            name=name,
            dtype=dtype,
            shape=shape,
            data=data,
            framework=framework,
            offsets=(0,) * len(shape),
            local_shape=shape,
            sharded=False,
            written_elsewhere=False,
            replicas=(),
            layout=None,
            device_bytes=None,
            source=source,
            version=version,
        )
        return leaf


def escape_key(key: str | int) -> str:
    """One key-path component: ``/`` separates components, so escape it.

    The empty key becomes ``%`` (a bare ``%`` never results from escaping), so
    it cannot vanish from a path and collide with its parent.
    """
    if key == "":
        return "%"
    return str(key).replace("%", "%25").replace("/", "%2F")


def join_path(parent: str, key: str | int) -> str:
    return f"{parent}/{escape_key(key)}" if parent else escape_key(key)


def layouts_of(encoded: EncodedTree) -> dict[str, Any]:
    """Each DTensor leaf's mesh and placements, by key path (the root's ``layouts``)."""
    return {leaf.name: leaf.layout for leaf in encoded.leaves if leaf.layout is not None}


class _Encoder:
    def __init__(
        self, allow_tensors: bool, allow_rank_local: bool, defer_device: bool = False
    ) -> None:
        self.allow_tensors = allow_tensors
        self.allow_rank_local = allow_rank_local
        self.defer_device = defer_device
        self.leaves: list[TensorLeaf] = []
        self.names: set[str] = set()
        self.rank_local: dict[str, Any] = {}
        self.plain_torch = _plain_torch()
        self.plain_torch_types = () if self.plain_torch is None else self.plain_torch.types
        self.packer = msgpack.Packer(use_bin_type=True, use_single_float=False)

    def encode(self, value: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedValueError(
                f"containers nest more than {MAX_DEPTH} levels deep at {path or '<root>'}; "
                "flatten the state",
                key_path=path,
            )
        if type(value) in self.plain_torch_types:  # the common leaf first
            return self._tensor(value, path)
        if isinstance(value, (Shard, RankLocal)):
            return self._marker(value, path)
        if isinstance(value, (np.str_, np.bytes_)):
            # Text has no numpy_dtype name (those are numeric): stored as plain str/bytes.
            return str(value) if isinstance(value, np.str_) else bytes(value)
        if isinstance(value, np.generic):  # before float: np.float64 subclasses float
            dtype = name_of_numpy_dtype(value.dtype, path)
            payload = [dtype, np.asarray(value).astype(numpy_dtype(dtype)).tobytes()]
            return msgpack.ExtType(EXT_NUMPY_SCALAR, _pack(payload))
        if value is None or isinstance(value, (bool, str, float)):
            return value
        if isinstance(value, int):
            if _INT_MIN <= value <= _UINT_MAX:
                return int(value)
            return msgpack.ExtType(EXT_BIG_INT, str(int(value)).encode())
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        if is_dtensor(value):  # a torch.Tensor too: before the plain tensors
            block = dtensor_block(value, path)
            return self._tensor(block.shard.local, path, block.shard, block)
        if isinstance(value, np.ndarray) or _is_torch_tensor(value):
            return self._tensor(value, path)
        if isinstance(value, OrderedDict):
            pairs = [
                [self._key(k, path), self.encode(v, join_path(path, k), depth + 1)]
                for k, v in value.items()
            ]
            return msgpack.ExtType(EXT_ORDERED_DICT, _pack(pairs))
        if isinstance(value, dict):
            return {
                self._key(k, path): self.encode(v, join_path(path, k), depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self.encode(v, join_path(path, i), depth + 1) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [self.encode(v, join_path(path, i), depth + 1) for i, v in enumerate(value)]
            return msgpack.ExtType(EXT_TUPLE, _pack(items))
        raise UnsupportedValueError(
            f"cannot store a value of type {type(value).__module__}.{type(value).__qualname__} "
            f"at {path or '<root>'} without pickle; convert it to plain types first",
            key_path=path,
        )

    @staticmethod
    def _key(key: Any, path: str) -> str | int:
        if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
            return key
        raise UnsupportedValueError(
            f"dict key {key!r} of type {type(key).__name__} at {path or '<root>'}: "
            "keys must be str or int",
            key_path=path,
        )

    def _marker(self, value: Shard | RankLocal, path: str) -> msgpack.ExtType:
        if isinstance(value, Shard):
            if not (isinstance(value.local, np.ndarray) or _is_torch_tensor(value.local)):
                raise UnsupportedValueError(
                    f"Shard at {path or '<root>'} holds a {type(value.local).__name__}, "
                    "not an array or tensor",
                    key_path=path,
                )
            return self._tensor(value.local, path, shard=value)
        if not self.allow_rank_local:
            raise UnsupportedValueError(
                f"RankLocal at {path or '<root>'} cannot nest here", key_path=path
            )
        self.rank_local[path] = value.value
        return msgpack.ExtType(EXT_RANK_LOCAL, _pack(path))

    def _tensor(
        self,
        value: Any,
        path: str,
        shard: Shard | None = None,
        block: DTensorBlock | None = None,
    ) -> msgpack.ExtType:
        if not self.allow_tensors:
            raise UnsupportedValueError(
                f"tensors are not allowed here ({path or '<root>'})", key_path=path
            )
        name = path or "."
        if name in self.names:
            raise UnsupportedValueError(f"two tensors map to the name {name!r}", key_path=path)
        self.names.add(name)
        if isinstance(value, np.ndarray):
            leaf = _numpy_leaf(value, name)
        else:
            plain = self.plain_torch and _plain_torch_leaf(value, name, self.plain_torch)
            leaf = plain or _torch_leaf(value, name, self.defer_device)
        if shard is not None:
            leaf = TensorLeaf(
                name=name,
                dtype=leaf.dtype,
                shape=shard.global_shape,
                data=leaf.data,
                framework=leaf.framework,
                offsets=shard.offsets,
                local_shape=leaf.shape,
                sharded=True,
                written_elsewhere=block is not None and not block.writes,
                replicas=block.replicas if block is not None else (),
                layout=block.layout if block is not None else None,
                device_bytes=leaf.device_bytes,
                source=leaf.source,
                version=leaf.version,
            )
        self.leaves.append(leaf)
        # The same bytes as _pack's (a reused Packer skips building one per tensor).
        return msgpack.ExtType(EXT_TENSOR, self.packer.pack([name, leaf.framework]))


def _is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # never import torch just to look
    return torch is not None and isinstance(value, torch.Tensor)


@dataclass(frozen=True)
class _PlainTorch:
    """What the fast path for plain CPU tensors compares against (see _plain_torch_leaf).

    ``types``: exactly these, no subclass (a subclass may override what the
    checks rely on). ``dtypes``: torch dtype -> (castore name, the dtype of the
    same size to view it as for ``.numpy()``, or None where numpy has the type).
    """

    types: tuple[type, ...]
    dtypes: dict[Any, tuple[str, Any]]
    strided: Any


_PLAIN_TORCH: list[_PlainTorch] = []  # built once, on first use with torch imported


def _plain_torch() -> _PlainTorch | None:
    torch = sys.modules.get("torch")  # never import torch just to look
    if torch is None:
        return None
    if not _PLAIN_TORCH:
        dtypes = {}
        for name in SUPPORTED_DTYPES:
            dtype = getattr(torch, name, None)
            stand_in = _numpy_stand_in(torch, dtype) if isinstance(dtype, torch.dtype) else None
            if stand_in is not None:
                dtypes[dtype] = (name, None if stand_in == dtype else stand_in)
        _PLAIN_TORCH.append(_PlainTorch((torch.Tensor, torch.nn.Parameter), dtypes, torch.strided))
    return _PLAIN_TORCH[0]


def _numpy_stand_in(torch: Any, dtype: Any) -> Any:
    """``dtype`` itself if numpy has it, else a numpy-known integer type of its size
    (bfloat16: int16), else None (the fast path then leaves ``dtype`` alone)."""
    probe = torch.empty(0, dtype=dtype)
    try:
        probe.numpy()
        return dtype
    except (TypeError, RuntimeError):  # "Got unsupported ScalarType"
        return {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(probe.element_size())


def _plain_torch_leaf(tensor: Any, name: str, plain: _PlainTorch) -> TensorLeaf | None:
    """A leaf viewing a plain CPU tensor's memory as it is, or None for the general path.

    Plain: on the CPU, dense, contiguous, no conjugate or negative bit, not
    nested, not empty, of a dtype castore stores (quantized ones are not
    among them). For such a tensor the general path's ``detach``,
    ``.to("cpu")``, ``resolve_conj``, ``resolve_neg`` and ``contiguous`` each
    return a view of the same memory, so this leaf holds the same bytes;
    every other tensor, each one the general path refuses included, takes
    that path.
    """
    kind = plain.dtypes.get(tensor.dtype)
    if (
        kind is None
        or not tensor.is_cpu
        or tensor.layout is not plain.strided
        or tensor.is_nested
        or not tensor.is_contiguous()
        or tensor.is_neg()
        or tensor.is_conj()
        or not tensor.numel()
    ):
        return None
    source, version = tensor, tensor._version
    if tensor.requires_grad:
        tensor = tensor.detach()
    dtype, view_as = kind
    array = (tensor if view_as is None else tensor.view(view_as)).numpy()
    flat = array.reshape(-1).view(np.uint8)
    return TensorLeaf.whole(name, dtype, tuple(tensor.shape), flat, "torch", source, version)


def _numpy_leaf(array: np.ndarray, name: str) -> TensorLeaf:
    dtype = name_of_numpy_dtype(array.dtype, name)
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    flat = little.reshape(-1).view(np.uint8)
    return TensorLeaf(name, dtype, tuple(array.shape), flat, "numpy")


def _torch_leaf(tensor: Any, name: str, defer_device: bool = False) -> TensorLeaf:
    _check_torch_storable(tensor, name)
    dtype = name_of_torch_dtype(tensor.dtype, name)
    if defer_device and tensor.device.type != "cpu" and tensor.numel():
        import torch

        on_device = tensor.detach().resolve_conj().resolve_neg().contiguous()
        flat = on_device.reshape(-1).view(torch.uint8)
        empty = np.empty(0, dtype=np.uint8)
        return TensorLeaf(name, dtype, tuple(tensor.shape), empty, "torch", device_bytes=flat)
    host = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    flat = torch_bytes(host)
    return TensorLeaf(name, dtype, tuple(tensor.shape), flat, "torch")


def _check_torch_storable(tensor: Any, name: str) -> None:
    """Refuse, naming the key path, a tensor whose bytes castore cannot take as they are."""
    import torch

    if tensor.is_quantized:  # strided, so the layout check below would call it dense
        raise UnsupportedValueError(
            f"tensor at {name} is quantized ({tensor.dtype}): quantized tensors are not "
            "stored; dequantize first (tensor.dequantize())",
            key_path=name,
        )
    if tensor.layout != torch.strided:
        raise UnsupportedValueError(
            f"tensor at {name} has layout {tensor.layout}; only dense (strided) tensors are "
            "stored: convert it first (tensor.to_dense())",
            key_path=name,
        )
    if tensor.device.type == "meta":
        raise UnsupportedValueError(
            f"tensor at {name} is on the meta device: it has no data; materialize it first",
            key_path=name,
        )


def torch_bytes(tensor: Any) -> np.ndarray:
    """A flat uint8 view of a contiguous CPU tensor's memory.

    An empty tensor may have zero strides (``torch.from_numpy(np.zeros(0))``),
    which torch refuses to view as bytes; it has no bytes to view. A lone
    element is contiguous whatever its stride (``x[::2]`` of two elements),
    but torch views as bytes only a stride of 1: it is given that stride.
    """
    import torch

    count = tensor.numel()
    if count == 0:
        return np.empty(0, dtype=np.uint8)
    flat = tensor.reshape(-1) if count > 1 else tensor.as_strided((1,), (1,))
    return flat.view(torch.uint8).numpy()


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True, use_single_float=False)


@dataclass
class EncodedTree:
    """A state split into its msgpack skeleton, its tensors and its per-rank parts."""

    skeleton: bytes
    leaves: list[TensorLeaf]
    rank_local: dict[str, Any]  # key path -> the raw value inside RankLocal(...)


def encode_state(
    state: Any, *, base_path: str = "", allow_rank_local: bool = True, defer_device: bool = False
) -> EncodedTree:
    """Encode a state that may hold tensors, Shards and RankLocal markers.

    ``defer_device``: leave GPU tensors' bytes on their device (``device_bytes``)
    for an async save to stage; otherwise they are copied to the host here.
    """
    encoder = _Encoder(
        allow_tensors=True, allow_rank_local=allow_rank_local, defer_device=defer_device
    )
    skeleton = encoder.encode(state, base_path)
    return EncodedTree(_pack(skeleton), encoder.leaves, encoder.rank_local)


def encode_local_state(
    rank_local: dict[str, Any], *, defer_device: bool = False
) -> tuple[bytes, list[TensorLeaf]]:
    """A rank's RankLocal values: a msgpack map of key path -> encoded tree, and their tensors."""
    if not rank_local:
        return b"", []
    skeletons: dict[str, bytes] = {}
    leaves: list[TensorLeaf] = []
    for path, value in rank_local.items():
        encoded = encode_state(
            value, base_path=path, allow_rank_local=False, defer_device=defer_device
        )
        skeletons[path] = encoded.skeleton
        leaves += encoded.leaves
    return _pack(skeletons), leaves


def decode_local_state(data: bytes) -> dict[str, bytes]:
    """The key path -> encoded tree map written by :func:`encode_local_state`."""
    if not data:
        return {}
    try:
        skeletons = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise CorruptObjectError(f"rank-local state does not decode: {exc}") from exc
    if not isinstance(skeletons, dict) or not all(
        isinstance(k, str) and isinstance(v, bytes) for k, v in skeletons.items()
    ):
        raise CorruptObjectError("rank-local state is not a map of key paths to trees")
    return skeletons


def encode_tree(state: Any, *, allow_tensors: bool = True) -> tuple[bytes, list[TensorLeaf]]:
    """Encode a state without per-rank parts: its skeleton as msgpack, its tensors as leaves."""
    encoder = _Encoder(allow_tensors, allow_rank_local=False)
    skeleton = encoder.encode(state, "")
    return _pack(skeleton), encoder.leaves


TensorLookup = Callable[[str, str], Any]
RankLocalLookup = Callable[[str], Any]


def decode_tree(
    data: bytes, tensors: TensorLookup | None = None, rank_local: RankLocalLookup | None = None
) -> Any:
    """Rebuild a state; ``tensors(name, framework)`` supplies each tensor and
    ``rank_local(path)`` each per-rank value.

    Hostile bytes give CorruptObjectError: extension payloads nest at most
    ``MAX_DEPTH`` unpacks deep, and the rebuilt tree at most ``MAX_DEPTH``
    containers deep.
    """
    nested = 0

    def ext_hook(code: int, payload: bytes) -> Any:
        if code == EXT_TUPLE:
            return tuple(_unpack(payload))
        if code == EXT_ORDERED_DICT:
            return OrderedDict((k, v) for k, v in _unpack(payload))
        if code == EXT_BIG_INT:
            return int(payload.decode())
        if code == EXT_NUMPY_SCALAR:
            return _numpy_scalar(_unpack(payload))
        if code == EXT_TENSOR:
            name, framework = _unpack(payload)
            if tensors is None:
                raise CorruptObjectError(f"tensor reference {name!r} where none is allowed")
            return tensors(name, framework)
        if code == EXT_RANK_LOCAL:
            path = _unpack(payload)
            if rank_local is None or not isinstance(path, str):
                raise CorruptObjectError(f"per-rank reference {path!r} where none is allowed")
            return rank_local(path)
        raise CorruptObjectError(f"unknown msgpack extension code {code} in a state")

    def _unpack(payload: bytes) -> Any:
        nonlocal nested
        if nested > MAX_DEPTH:  # the top-level unpack plus one per nested extension
            raise CorruptObjectError(f"state nests more than {MAX_DEPTH} levels deep")
        nested += 1
        try:
            return msgpack.unpackb(payload, raw=False, strict_map_key=False, ext_hook=ext_hook)
        finally:
            nested -= 1

    try:
        tree = _unpack(data)
    except CastoreError:
        raise
    except (ValueError, TypeError, RecursionError, msgpack.ExtraData, msgpack.FormatError) as exc:
        # StackError (nesting past msgpack's own stack) is a ValueError.
        raise CorruptObjectError(f"state does not decode: {exc}") from exc
    check_depth(tree, "state")
    return tree


def _numpy_scalar(payload: Any) -> Any:
    dtype, raw = payload
    if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES or not isinstance(raw, bytes):
        raise CorruptObjectError(f"numpy scalar of unknown dtype {dtype!r}")
    values = np.frombuffer(raw, dtype=numpy_dtype(dtype))
    if values.size != 1 or len(raw) != values.itemsize:
        raise CorruptObjectError(f"numpy scalar of {dtype} has {len(raw)} bytes")
    return values[0]


def check_depth(value: Any, what: str, limit: int = MAX_DEPTH) -> None:
    """Raise CorruptObjectError if containers in ``value`` nest deeper than ``limit``.

    Iterative, so the check itself cannot be driven into deep recursion.
    """
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > limit:
            raise CorruptObjectError(f"{what} nests more than {limit} levels deep")
        stack.extend((child, depth + 1) for child in children)


def value_digests(skeleton: bytes) -> dict[str, bytes]:
    """The blake3 digest of each plain value in a state's skeleton, by key path.

    Tensors and per-rank values appear as their references (their names), so
    two skeletons whose plain values are equal give equal maps, whatever order
    their dicts list keys in; each container adds its kind at its own path, so
    ``{}`` and ``[]`` differ. For a skeleton this process encoded (its depth
    was bounded then), never for bytes read from a store.
    """
    found: dict[str, bytes] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, msgpack.ExtType) and node.code in (EXT_TUPLE, EXT_ORDERED_DICT):
            kind = "tuple" if node.code == EXT_TUPLE else "ordered-dict"
            items = _unpack_raw(node.data)
            pairs = enumerate(items) if node.code == EXT_TUPLE else items
        elif isinstance(node, dict):
            kind, pairs = "dict", node.items()
        elif isinstance(node, list):
            kind, pairs = "list", enumerate(node)
        else:
            found[path] = digest_bytes(_pack(node))
            return
        found[path] = digest_bytes(kind.encode())
        for key, value in pairs:
            walk(value, join_path(path, key))

    walk(_unpack_raw(skeleton), "")
    return found


def dict_sizes(skeleton: bytes) -> dict[str, int]:
    """The number of keys of each dict (or ordered dict) in a state's skeleton, by key path.

    Where a rank passes ``{}`` and another rank a subtree, the first holds
    nothing there (castore.dist.holders). For a skeleton this process encoded.
    """
    found: dict[str, int] = {}
    stack: list[tuple[Any, str]] = [(_unpack_raw(skeleton), "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, msgpack.ExtType) and node.code in (EXT_TUPLE, EXT_ORDERED_DICT):
            items = _unpack_raw(node.data)
            pairs = enumerate(items) if node.code == EXT_TUPLE else items
            if node.code == EXT_ORDERED_DICT:
                found[path] = len(items)
        elif isinstance(node, dict):
            found[path], pairs = len(node), node.items()
        elif isinstance(node, list):
            pairs = enumerate(node)
        else:
            continue
        stack.extend((value, join_path(path, key)) for key, value in pairs)
    return found


def drop_paths(skeleton: bytes, matches: Callable[[str], bool]) -> tuple[bytes, list[str]]:
    """The skeleton without every dict entry (and its subtree) whose key path ``matches``,
    and those key paths. List and tuple items are never dropped: the key paths (and so
    the tensor names) of the items after them would change."""
    dropped: list[str] = []

    def keep(items: Any, path: str) -> list[tuple[Any, Any]]:
        kept = []
        for key, value in items:
            at = join_path(path, key)
            if matches(at):
                dropped.append(at)
            else:
                kept.append((key, walk(value, at)))
        return kept

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, msgpack.ExtType) and node.code == EXT_TUPLE:
            items = _unpack_raw(node.data)
            inner = [walk(v, join_path(path, i)) for i, v in enumerate(items)]
            return msgpack.ExtType(EXT_TUPLE, _pack(inner))
        if isinstance(node, msgpack.ExtType) and node.code == EXT_ORDERED_DICT:
            pairs = keep(_unpack_raw(node.data), path)
            return msgpack.ExtType(EXT_ORDERED_DICT, _pack([list(p) for p in pairs]))
        if isinstance(node, dict):
            return dict(keep(node.items(), path))
        if isinstance(node, list):
            return [walk(v, join_path(path, i)) for i, v in enumerate(node)]
        return node

    tree = walk(_unpack_raw(skeleton), "")
    return _pack(tree), dropped


def rename_paths(
    skeleton: bytes, rename: Callable[[str, str], str | None]
) -> tuple[bytes, dict[str, str], list[str]]:
    """The skeleton with dict keys renamed: ``rename(parent_path, key)`` gives a string
    key's new name, or None to keep it. Returns the skeleton, each tensor's new name by
    its old one (a tensor's name is its key path), and the per-rank values whose key
    path changed (the caller decides). Two keys of one dict renamed alike are refused
    (CorruptObjectError names the path)."""
    tensors: dict[str, str] = {}
    moved_local: list[str] = []

    def entries(items: Any, old: str, new: str) -> list[tuple[Any, Any]]:
        out: dict[Any, Any] = {}
        for key, value in items:
            renamed = rename(old, key) if isinstance(key, str) else None
            name = key if renamed is None else renamed
            if name in out:
                raise CorruptObjectError(f"two keys would be named {join_path(new, name)!r}")
            out[name] = walk(value, join_path(old, key), join_path(new, name))
        return list(out.items())

    def walk(node: Any, old: str, new: str) -> Any:
        if isinstance(node, msgpack.ExtType):
            if node.code == EXT_TUPLE:
                items = _unpack_raw(node.data)
                inner = [walk(v, join_path(old, i), join_path(new, i)) for i, v in enumerate(items)]
                return msgpack.ExtType(EXT_TUPLE, _pack(inner))
            if node.code == EXT_ORDERED_DICT:
                pairs = entries(_unpack_raw(node.data), old, new)
                return msgpack.ExtType(EXT_ORDERED_DICT, _pack([list(p) for p in pairs]))
            if node.code == EXT_TENSOR:
                name, framework = _unpack_raw(node.data)
                tensors[name] = new
                return msgpack.ExtType(EXT_TENSOR, _pack([new, framework]))
            if node.code == EXT_RANK_LOCAL and old != new:
                moved_local.append(old)
            return node
        if isinstance(node, dict):
            return dict(entries(node.items(), old, new))
        if isinstance(node, list):
            return [walk(v, join_path(old, i), join_path(new, i)) for i, v in enumerate(node)]
        return node

    tree = walk(_unpack_raw(skeleton), "", "")
    return _pack(tree), tensors, moved_local


def dict_items_at(skeleton: bytes, parent: str) -> list[tuple[Any, Any]] | None:
    """The (key, raw node) pairs of the dict (or ordered dict) at key path ``parent``
    ("" is the top), or None where no dict is there. Nodes stay as msgpack gives them
    (extension types unread), ready for :func:`replace_items`."""
    node = _unpack_raw(skeleton)
    for part in parent.split("/") if parent else ():
        node = _child(node, part)
    return _pairs_of(node)


def _child(node: Any, part: str) -> Any:
    pairs = _pairs_of(node)
    if pairs is not None:
        return next((value for key, value in pairs if escape_key(key) == part), None)
    if isinstance(node, msgpack.ExtType) and node.code == EXT_TUPLE:
        node = _unpack_raw(node.data)
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return node[int(part)]
    return None


def _pairs_of(node: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, msgpack.ExtType) and node.code == EXT_ORDERED_DICT:
        return [(key, value) for key, value in _unpack_raw(node.data)]
    return None


def replace_items(
    skeleton: bytes,
    parent: str,
    change: Callable[[list[tuple[Any, Any]]], list[tuple[Any, Any]]],
) -> bytes:
    """The skeleton with the pairs of the dict at key path ``parent`` replaced by
    ``change(pairs)`` (an ordered dict stays one); the caller found the dict there
    (:func:`dict_items_at`)."""
    parts = parent.split("/") if parent else []

    def walk(node: Any, depth: int) -> Any:
        if depth == len(parts):
            pairs = change(_pairs_of(node) or [])
            if isinstance(node, dict):
                return dict(pairs)
            return msgpack.ExtType(EXT_ORDERED_DICT, _pack([list(p) for p in pairs]))
        part = parts[depth]
        found = _pairs_of(node)
        if found is not None:
            out = [(k, walk(v, depth + 1) if escape_key(k) == part else v) for k, v in found]
            if isinstance(node, dict):
                return dict(out)
            return msgpack.ExtType(EXT_ORDERED_DICT, _pack([list(p) for p in out]))
        tuple_ = isinstance(node, msgpack.ExtType) and node.code == EXT_TUPLE
        items = list(_unpack_raw(node.data) if tuple_ else node)
        items[int(part)] = walk(items[int(part)], depth + 1)
        return msgpack.ExtType(EXT_TUPLE, _pack(items)) if tuple_ else items

    return _pack(walk(_unpack_raw(skeleton), 0))


def retarget_tensors(node: Any, old: str, new: str) -> tuple[Any, dict[str, str], list[str]]:
    """A raw subtree (from :func:`dict_items_at`) with each tensor named ``old...``
    renamed ``new...`` (its key path moved from under ``old`` to under ``new``), those
    names (old -> new), and the per-rank values it holds (their names cannot move)."""
    names: dict[str, str] = {}
    local: list[str] = []

    def walk(value: Any) -> Any:
        if isinstance(value, msgpack.ExtType):
            if value.code in (EXT_TUPLE, EXT_ORDERED_DICT):
                return msgpack.ExtType(value.code, _pack(walk(_unpack_raw(value.data))))
            if value.code == EXT_TENSOR:
                name, framework = _unpack_raw(value.data)
                names[name] = new + name[len(old) :] if name.startswith(old) else name
                return msgpack.ExtType(EXT_TENSOR, _pack([names[name], framework]))
            if value.code == EXT_RANK_LOCAL:
                local.append(str(_unpack_raw(value.data)))
            return value
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(node), names, local


def _unpack_raw(data: bytes) -> Any:
    """msgpack with extension types left as they are (their payloads unread)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def tensor_names(data: bytes) -> list[tuple[str, str]]:
    """The (name, framework) of every tensor a state refers to, in order."""
    found: list[tuple[str, str]] = []

    def record(name: str, framework: str) -> None:
        found.append((name, framework))

    decode_tree(data, record, lambda path: None)
    return found
