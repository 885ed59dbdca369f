"""Sharded (DTensor) training state: FSDP2, tensor parallelism and HSDP in TrainState.

A sharded model's parameters are DTensors, and so are its optimizer's moments.
castore.dist saves each rank's block of them (docs/DIST_API.md, "DTensor
state"); restoring needs DTensor targets of the live layout, which a fresh
optimizer does not have yet: :func:`optimizer_targets` makes each saved moment
of a DTensor parameter a DTensor of that parameter's mesh and placements, so
each rank reads only its own block, at any world size or mesh. Partial
gradients (a mid-accumulation save) are this rank's blocks: saved rank-local
(:func:`local_grad`) and placed back on the same layout (:func:`placed_grad`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from castore.format.dtensor import is_dtensor
from castore.format.dtypes import torch_dtype
from castore.format.shard import NotLoaded
from castore.format.tree import join_path


def optimizer_targets(named: dict[str, Any], prefix: str) -> Callable[[NotLoaded], Any]:
    """For ``castore.dist.load(..., load_rest=...)``: the saved optimizer state under
    ``prefix`` (``{"state": {name: {key: tensor}}}``) of each DTensor parameter in
    ``named``, as a new DTensor laid out like the parameter (same global shape);
    None (read whole) for everything else: plain parameters' state, the ``step``."""
    by_path = {
        join_path(join_path(prefix, "state"), name): param
        for name, param in named.items()
        if is_dtensor(param)
    }

    def target(saved: NotLoaded) -> Any:
        parent, _, _key = saved.name.rpartition("/")
        param = by_path.get(parent)
        if param is None or tuple(saved.shape) != tuple(param.shape):
            return None
        return torch.empty_like(param.detach(), dtype=torch_dtype(saved.dtype))

    return target


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient as this rank holds it: a DTensor's local block, else itself."""
    return grad.to_local() if is_dtensor(grad) else grad  # type: ignore[attr-defined]


def placed_grad(saved: torch.Tensor, param: Any) -> torch.Tensor:
    """A saved (local) gradient as ``param``'s gradient: a DTensor like the parameter."""
    if not is_dtensor(param):
        return saved.to(device=param.device, dtype=param.dtype)
    from torch.distributed.tensor import DTensor

    local = saved.to(device=param.to_local().device, dtype=param.dtype)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


def unreduced_gradients(model: torch.nn.Module) -> list[str]:
    """The FSDP2 modules (by name) that hold gradients not yet reduce-scattered.

    Under ``set_requires_gradient_sync(False)`` FSDP2 accumulates whole gradients
    inside itself and the sharded parameters have none: a mid-accumulation save
    would miss them. Read through FSDP2's internals (no public accessor exists);
    where those change, nothing is found and nothing is refused.
    """
    holding = []
    for name, module in model.named_modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        try:
            group = state_of()._fsdp_param_group
            params = group.fsdp_params if group is not None else []
            held = any(
                getattr(p, "unsharded_accumulated_grad", None) is not None
                or getattr(p.unsharded_param, "grad", None) is not None
                for p in params
            )
        except Exception:  # torch's internals moved: say nothing
            held = False
        if held:
            holding.append(name or "<root>")
    return holding
