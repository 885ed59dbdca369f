"""Optimizer state keyed by parameter name, and the module whose names those are.

``optimizer.state_dict()`` keys its state by position in the parameter list
it was built with; names survive a rebuilt optimizer, a reordered parameter
list or a new parameter. Names are the inner module's (:func:`unwrap`), so a
checkpoint loads with or without DistributedDataParallel and ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def optimizer_state_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name instead of position.

    Positions depend on the order parameters were handed to the optimizer; names
    survive a rebuilt optimizer, a reordered parameter list, or a new parameter.
    """
    names = parameter_names(model)
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
    groups, by_position = match_groups(parameter_names(model), optimizer, state)
    optimizer.load_state_dict({"state": by_position, "param_groups": groups})


def match_groups(
    names: dict[int, str], optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    """The positional param groups and state for ``optimizer`` (ValueError if they differ)."""
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
    return groups, by_position


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's name in the unwrapped ``model``, by the parameter's ``id``."""
    return {id(param): name for name, param in unwrap(model).named_parameters()}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DistributedDataParallel and ``torch.compile`` wrappers.

    Names are the inner module's, so a checkpoint loads with or without them.
    """
    while True:
        inner = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            inner = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            inner = model._orig_mod  # a torch.compile OptimizedModule
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
