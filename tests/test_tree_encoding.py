"""The state-tree encoder: pinned bytes, and its fast path for plain CPU tensors.

A generation's root holds the encoded skeleton and its chunks are named by
the leaves' bytes, so the same state must encode to the same bytes in every
castore version: the pin below was computed on the encoder before its fast
path existed (issue 26).
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from typing import Any

import blake3
import msgpack
import numpy as np
import pytest
import torch

from castore import RankLocal, Shard, UnsupportedValueError
from castore.format.dtypes import SUPPORTED_DTYPES
from castore.format.tree import EncodedTree, TensorLeaf, encode_local_state, encode_state


def _ramp(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` whose bytes count up from 0 (every dtype's bit patterns)."""
    count = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.arange(count, dtype=torch.int64).remainder(251).to(torch.uint8)
    if dtype == torch.bool:
        raw = raw.remainder(2)
    return raw.view(dtype).reshape(shape)


def mixed_state() -> dict[str, Any]:
    """Every kind of value and tensor layout the encoder meets, small."""
    base = _ramp(torch.float32, (4, 6))
    complex_values = _ramp(torch.complex64, (3,)).nan_to_num()
    grad = _ramp(torch.float32, (5,)).requires_grad_()
    return {
        "model": {
            "w": base,
            "bf": _ramp(torch.bfloat16, (3, 2)),
            "f8": _ramp(torch.float8_e4m3fn, (7,)),
            "f8b": _ramp(torch.float8_e5m2, (2, 2)),
            "mask": _ramp(torch.bool, (9,)),
            "ids": _ramp(torch.int64, (2, 3)),
            "scalar": torch.tensor(2.5),
            "scalar_bf": torch.tensor(-1.5, dtype=torch.bfloat16),
            "empty": torch.empty(0, 3),
            "transposed": base.t(),
            "column": base[:, 1],
            "offset_rows": base[1:3],
            "odd_strides": _ramp(torch.float32, (5, 1)).t(),
            "expanded": torch.ones(1).expand(1, 4),
            "conj": complex_values.conj(),
            "neg": complex_values.conj().imag,
            "param": torch.nn.Parameter(_ramp(torch.float16, (4,))),
            "grad": grad * 1,
            "np": np.arange(6, dtype=">i4").reshape(2, 3),
        },
        "shard": Shard(_ramp(torch.float32, (2, 3)), (4, 3), (2, 0)),
        "optim": OrderedDict([("lr", 1e-3), ("betas", (0.9, 0.999)), ("step", 2**70)]),
        "list": [1, "two", None, True, b"\x00", np.float32(1.5), np.int8(-3)],
        1: {"%": torch.zeros(2, dtype=torch.int32), "a/b": torch.ones(3, dtype=torch.uint8)},
        "rng": RankLocal({"seed": 7, "state": _ramp(torch.uint8, (16,))}),
    }


def _leaf_record(leaf: TensorLeaf) -> list[Any]:
    return [
        leaf.name,
        leaf.dtype,
        list(leaf.shape),
        list(leaf.offsets),
        list(leaf.local_shape),
        leaf.framework,
        leaf.sharded,
        leaf.data.tobytes(),
    ]


def _fingerprint(encoded: EncodedTree) -> str:
    """The skeleton, every leaf's fields and bytes, and the per-rank part's encoding."""
    local_skeleton, local_leaves = encode_local_state(encoded.rank_local)
    leaves = [_leaf_record(leaf) for leaf in encoded.leaves + local_leaves]
    packed = msgpack.packb([encoded.skeleton, local_skeleton, leaves])
    return blake3.blake3(packed).hexdigest()


# Computed with the encoder of commit dd3e8a6 (before the fast path).
PINNED_SKELETON_DIGEST = "d2790611f1b82b186f76194092bba1d12bab0de3e8a6784473b2a11be90c1e6b"
PINNED_FINGERPRINT = "1b915caf5a6c1ffd7edf478f7fec7a07d9dac184dfd77c4d34d65e6b48c02bcf"


def test_a_mixed_state_encodes_to_the_pinned_bytes() -> None:
    encoded = encode_state(mixed_state())
    assert blake3.blake3(encoded.skeleton).hexdigest() == PINNED_SKELETON_DIGEST
    assert _fingerprint(encoded) == PINNED_FINGERPRINT


class _Subclass(torch.Tensor):
    """A tensor subclass: never on the fast path, so it shows what the general path gives."""


def _general(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(_Subclass)


TENSORS = sorted(k for k, v in mixed_state()["model"].items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("name", TENSORS)
def test_the_fast_path_gives_the_general_paths_leaf(name: str) -> None:
    value = mixed_state()["model"][name]
    fast = encode_state({"x": value})
    general = encode_state({"x": _general(value)})
    assert fast.skeleton == general.skeleton
    (fast_leaf,), (general_leaf,) = fast.leaves, general.leaves
    assert _leaf_record(fast_leaf) == _leaf_record(general_leaf)
    assert fast_leaf.data.dtype == np.uint8 and fast_leaf.data.ndim == 1
    assert fast_leaf.data.flags.c_contiguous


@pytest.mark.parametrize("dtype", sorted(SUPPORTED_DTYPES))
def test_a_plain_cpu_tensor_is_viewed_not_copied(dtype: str) -> None:
    tensor = _ramp(getattr(torch, dtype), (3, 4))
    (leaf,) = encode_state({"t": tensor}).leaves
    assert leaf.dtype == dtype
    assert leaf.data.ctypes.data == tensor.data_ptr()  # the tensor's own memory
    assert leaf.data.nbytes == tensor.numel() * tensor.element_size()


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantize_per_tensor
        return torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)


def _sparse_csr() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CSR support is "in beta state"
        return torch.eye(3).to_sparse_csr()


def _fnuz() -> torch.Tensor:
    return torch.zeros(2, dtype=torch.float8_e4m3fnuz)  # a float8 castore does not store


REFUSED = [
    pytest.param(lambda: torch.empty(4, device="meta"), "is on the meta device", id="meta"),
    pytest.param(_quantized, "is quantized", id="quantized"),
    pytest.param(lambda: torch.eye(3).to_sparse(), "layout torch.sparse_coo", id="sparse-coo"),
    pytest.param(_sparse_csr, "layout torch.sparse_csr", id="sparse-csr"),
    pytest.param(_fnuz, "dtype torch.float8_e4m3fnuz", id="float8-fnuz"),
]


@pytest.mark.parametrize("make, message", REFUSED)
def test_what_the_general_path_refuses_is_refused_naming_the_key_path(
    make: Any, message: str
) -> None:
    with pytest.raises(UnsupportedValueError) as caught:
        encode_state({"m": {"w": make()}})
    assert caught.value.key_path == "m/w"
    assert message in str(caught.value) and " m/w" in str(caught.value)


def _lone_elements() -> dict[str, torch.Tensor]:
    """One element each, with a stride other than 1: contiguous all the same."""
    values = _ramp(torch.float32, (4,))
    complex_values = _ramp(torch.complex64, (2,)).nan_to_num()
    return {
        "every_other": values[::2][1:],
        "column": _ramp(torch.bfloat16, (3, 2))[1:2, 1],
        "negative_bit": complex_values[1:].conj().imag,
    }


@pytest.mark.parametrize("name", sorted(_lone_elements()))
def test_a_lone_element_of_any_stride_is_stored(name: str) -> None:
    """The general path's torch_bytes once raised here (torch views a stride of 2 as bytes
    only when it is 1), both for plain tensors and ones with a negative bit."""
    tensor = _lone_elements()[name]
    assert tensor.numel() == 1 and tensor.stride() != (1,) and tensor.is_contiguous()
    expected = tensor.reshape(()).clone().reshape(1).view(torch.uint8).numpy().tobytes()
    assert len(expected) == tensor.element_size()
    for value in (tensor, _general(tensor)):
        (leaf,) = encode_state({"x": value}).leaves
        assert leaf.data.tobytes() == expected


def test_every_spelling_of_a_supported_dtype_has_its_one_name() -> None:
    """The names are looked up in a table built once; dtypes equal to a table entry but
    spelled otherwise (the C type names, big-endian) still find theirs, and an
    unsupported one is refused."""
    from castore.errors import UnsupportedValueError
    from castore.format.dtypes import SUPPORTED_DTYPES, name_of_numpy_dtype, numpy_dtype

    for name in SUPPORTED_DTYPES:
        little = numpy_dtype(name)
        assert little.byteorder in "<=|" and name_of_numpy_dtype(little) == name
        assert name_of_numpy_dtype(little.newbyteorder(">")) == name
    for spelled, name in [(np.longlong, "int64"), (np.ulonglong, "uint64"), (np.intc, "int32"),
                          (np.double, "float64"), (np.half, "float16")]:  # fmt: skip
        assert name_of_numpy_dtype(np.dtype(spelled)) == name
    with pytest.raises(UnsupportedValueError, match="cannot be stored at w"):
        name_of_numpy_dtype(np.dtype("U3"), "w")
