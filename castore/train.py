"""Training-state capture (in progress): RNG streams and optimizer state by name.

``capture_rng()`` returns plain values and tensors (no pickle) for Python's
``random``, NumPy's global state and any ``numpy.random.Generator`` handed to
it, torch's CPU generator, and every CUDA device's generator when CUDA is
available. ``restore_rng()`` puts them back, so the next draw of every stream
is the one an uninterrupted run would have made. Wrap the result in
:class:`castore.RankLocal` in a multi-rank save: RNG streams are per rank.

``optimizer_state_by_name()`` keys optimizer state by parameter name, never by
position, and ``load_optimizer_state_by_name()`` maps it back onto whatever
order the new optimizer holds its parameters in.
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


def optimizer_state_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name instead of position.

    Positions depend on the order parameters were handed to the optimizer; names
    survive a rebuilt optimizer, a reordered parameter list, or a new parameter.
    """
    names = _parameter_names(model)
    raw = optimizer.state_dict()
    positions: dict[int, str] = {}
    groups = []
    for live, saved in zip(optimizer.param_groups, raw["param_groups"], strict=True):
        group_names = [names[id(p)] for p in live["params"]]
        positions.update(zip(saved["params"], group_names, strict=True))
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": group_names})
    state = {positions[index]: value for index, value in raw["state"].items()}
    return {"state": state, "param_groups": groups}


def load_optimizer_state_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> None:
    """Load a state from :func:`optimizer_state_by_name` into ``optimizer``."""
    names = _parameter_names(model)
    saved_groups = list(state["param_groups"])
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"saved optimizer has {len(saved_groups)} param groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    position = 0
    by_position: dict[int, Any] = {}
    groups = []
    for live, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        live_names = [names[id(p)] for p in live["params"]]
        if sorted(live_names) != sorted(saved["params"]):
            raise ValueError(
                f"param group holds {sorted(live_names)[:5]}..., the saved one "
                f"{sorted(saved['params'])[:5]}..."
            )
        ids = list(range(position, position + len(live_names)))
        position += len(live_names)
        for index, name in zip(ids, live_names, strict=True):
            if name in state["state"]:
                by_position[index] = state["state"][name]
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": by_position, "param_groups": groups})


def _parameter_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(param): name for name, param in model.named_parameters()}
