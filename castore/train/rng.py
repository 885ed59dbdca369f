"""Every RNG stream of a process: captured, put back, or reseeded after a change of ranks.

The streams are Python's ``random``, NumPy's global state and named
``numpy.random.Generator`` objects, torch's CPU generator and every CUDA
device's. A captured state is plain values and tensors, so castore saves it
without pickle.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from castore.format.hashing import digest_bytes

RNG_VERSION = 1


def capture_rng(generators: Mapping[str, np.random.Generator] | None = None) -> dict[str, Any]:
    """Every RNG stream of this process (plus the named numpy Generators)."""
    np_state: Any = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "version": RNG_VERSION,
        "python": random.getstate(),
        "numpy": {
            "algorithm": np_state[0],
            "keys": np.array(np_state[1], copy=True),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "numpy_generators": {
            name: gen.bit_generator.state for name, gen in (generators or {}).items()
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng(
    state: Mapping[str, Any], generators: Mapping[str, np.random.Generator] | None = None
) -> None:
    """Put back streams captured by :func:`capture_rng` (any tensor type loads).

    Checks everything first: on an error no stream has changed.
    """
    if state.get("version") != RNG_VERSION:
        raise ValueError(f"unknown RNG state version {state.get('version')!r}")
    wanted = dict(generators or {})
    missing = sorted(set(wanted) - set(state["numpy_generators"]))
    if missing:
        raise KeyError(f"no saved state for numpy generators {missing}")
    cuda = list(state["cuda"])
    if cuda and cuda_devices() != len(cuda):
        raise RuntimeError(
            f"the saved state has {len(cuda)} CUDA generators; this process sees "
            f"{cuda_devices()} devices"
        )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state["numpy"]
    np.random.set_state(
        (
            saved["algorithm"],
            np.asarray(saved["keys"], dtype=np.uint32),
            saved["pos"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    )
    for name, gen in wanted.items():
        gen.bit_generator.state = state["numpy_generators"][name]
    torch.set_rng_state(_as_byte_tensor(state["torch"]))
    if cuda:
        torch.cuda.set_rng_state_all([_as_byte_tensor(s) for s in cuda])


def cuda_devices() -> int:
    """How many CUDA devices (each with its own generator) this process sees."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _as_byte_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(torch.uint8).cpu()
    return torch.from_numpy(np.ascontiguousarray(value, dtype=np.uint8))


def reseed_rng(root: bytes, rank: int, generators: Mapping[str, np.random.Generator]) -> None:
    """New, distinct, reproducible streams for ``rank`` after a change of rank count."""

    def seed(stream: str) -> int:
        return int.from_bytes(digest_bytes(root + f"/{stream}/{rank}".encode())[:8], "little")

    random.seed(seed("python"))
    np.random.seed(seed("numpy") % 2**32)
    torch.manual_seed(seed("torch"))  # also every CUDA device
    for name, gen in generators.items():
        gen.bit_generator.state = type(gen.bit_generator)(seed(f"numpy/{name}")).state
