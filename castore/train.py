"""Training-state capture (in progress): every RNG stream a resume needs.

``capture_rng()`` returns plain values and tensors (no pickle) for Python's
``random``, NumPy's global state and any ``numpy.random.Generator`` handed to
it, torch's CPU generator, and every CUDA device's generator when CUDA is
available. ``restore_rng()`` puts them back, so the next draw of every stream
is the one an uninterrupted run would have made. Wrap the result in
:class:`castore.RankLocal` in a multi-rank save: RNG streams are per rank.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

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
    """Put back streams captured by :func:`capture_rng` (any tensor type loads)."""
    if state.get("version") != RNG_VERSION:
        raise ValueError(f"unknown RNG state version {state.get('version')!r}")
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
    wanted = dict(generators or {})
    missing = sorted(set(wanted) - set(state["numpy_generators"]))
    if missing:
        raise KeyError(f"no saved state for numpy generators {missing}")
    for name, gen in wanted.items():
        gen.bit_generator.state = state["numpy_generators"][name]
    torch.set_rng_state(_as_byte_tensor(state["torch"]))
    cuda = list(state["cuda"])
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda):
            raise RuntimeError(
                f"the saved state has {len(cuda)} CUDA generators; this process sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} devices"
            )
        torch.cuda.set_rng_state_all([_as_byte_tensor(s) for s in cuda])


def _as_byte_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(torch.uint8).cpu()
    return torch.from_numpy(np.ascontiguousarray(value, dtype=np.uint8))
