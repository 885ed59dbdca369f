"""The state-tree encoder: pinned bytes, and its fast path for plain CPU tensors.

A generation's root holds the encoded skeleton and its chunks are named by
the leaves' bytes, so the same state must encode to the same bytes in every
castore version: the pin below was computed on the encoder before its fast
path existed (issue 26).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import blake3
import msgpack
import numpy as np
import torch

from castore import RankLocal, Shard
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
