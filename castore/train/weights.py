"""Load a saved model's parameters and buffers into a live module: never a resume.

:func:`load_weights` reads only the model's tensors of a generation (any
rank count) into the module in place; the optimizer, schedulers, RNG streams
and data position stay as they are. With ``strict=False`` it loads the names
the module and the generation share and reports the rest, as
``torch.nn.Module.load_state_dict`` does, so a backbone loads under a new head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from castore import dist as castore_dist
from castore.core.history import Generation
from castore.dist.comm import DEFAULT_TIMEOUT, Group, attempt, describe, raise_failures
from castore.dist.restore import LoadReport, agree_on_root
from castore.errors import LayoutMismatchError
from castore.format.dcplayout import TENSORS, DcpLayout
from castore.format.objects import GenerationRoot
from castore.format.tree import decode_tree
from castore.store import Store
from castore.train.optimizers import unwrap


@dataclass
class WeightsLoaded:
    """What :func:`load_weights` loaded: the model only. This is not a resume.

    ``missing_keys`` are the module's names the generation does not hold and
    ``unexpected_keys`` the saved names the module lacks (both empty unless
    ``strict=False``), as ``torch.nn.Module.load_state_dict`` reports them.
    """

    generation: Generation
    tensors: int
    report: LoadReport | None = None
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        # One line: the generation and the report (which holds it again) print whole otherwise.
        gen = self.generation
        keys = ""
        if self.missing_keys or self.unexpected_keys:
            keys = f", {len(self.missing_keys)} missing, {len(self.unexpected_keys)} unexpected"
        return (
            f"<castore.train.WeightsLoaded {gen.run}@{gen.id} step {gen.step} "
            f"root {gen.root[:12]}: {self.tensors} tensor(s) loaded{keys}>"
        )


@dataclass(frozen=True)
class KeyMatch:
    """A module's state-dict names against a saved model's."""

    shared: list[str]  # in the module's order
    missing: list[str]  # the module's names the generation does not hold, in its order
    unexpected: list[str]  # the saved names the module lacks, in the saved order


def match_model_keys(model: torch.nn.Module, saved: Any, where: dict[str, Any]) -> KeyMatch:
    """Which of ``model``'s names ``saved`` (a saved model's skeleton) holds."""
    if not isinstance(saved, Mapping):
        raise LayoutMismatchError(
            "the generation holds no model state under this prefix (an imported file "
            "keeps its names at the top of the tree: load it with prefix='')",
            **where,
        )
    live = list(model.state_dict())
    known = set(live)
    return KeyMatch(
        shared=[name for name in live if name in saved],
        missing=[name for name in live if name not in saved],
        unexpected=[name for name in saved if name not in known],
    )


def check_model_keys(model: torch.nn.Module, saved: Any, where: dict[str, Any]) -> None:
    """``model`` and the saved model hold the same names (else LayoutMismatchError)."""
    keys = match_model_keys(model, saved, where)
    missing, unexpected = sorted(keys.missing), sorted(keys.unexpected)
    if missing or unexpected:
        raise LayoutMismatchError(
            f"the model does not match the saved one: not saved {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, not in the model {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}",
            **where,
        )


def saved_skeleton(root: GenerationRoot) -> Any:
    """A root's saved tree with every tensor as None: structure and plain values only."""
    return decode_tree(root.state, lambda _name, _framework: None, lambda _path: None)


def saved_model(root: GenerationRoot, prefix: str) -> tuple[Any, dict[str, str] | None]:
    """The model saved under the key ``prefix``: its skeleton (names -> anything), and for
    a generation saved through castore.dcp, each name's DCP item (fqn); else None."""
    layout = DcpLayout.of(decode_tree(root.metadata)) if root.metadata else None
    if layout is not None:
        items = layout.items_under(prefix)
        return (items or None), items
    skeleton = saved_skeleton(root)
    if not prefix:  # the names at the top of the tree: an imported file's
        return skeleton, None
    return (skeleton.get(prefix) if isinstance(skeleton, dict) else None), None


def load_weights(
    store: Store,
    run: str,
    model: torch.nn.Module,
    generation: int | str = "latest",
    *,
    prefix: str = "model",
    strict: bool = True,
    group: Any = None,
    coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
) -> WeightsLoaded:
    """Load only the model's parameters and buffers, in place. Never a resume.

    The optimizer, schedulers, RNG streams and data position are untouched
    and nothing claims the next update matches any other run's. ``prefix`` is
    the key the model's state sits under in the saved tree (``"model"`` for
    :class:`TrainState` saves, and for a DCP save of ``{"model": model.state_dict(),
    ...}`` through :class:`castore.dcp.CastoreWriter`); ``""`` for names at the top
    of the tree, as ``castore import`` keeps a safetensors file's. A sharded model
    (FSDP2: DTensor parameters) is filled rank by rank, each rank reading only the
    bytes its own shards cover.

    ``strict=True`` refuses a model whose names differ from the saved ones
    (LayoutMismatchError, nothing changed). ``strict=False`` loads the names
    both hold and lists the others in ``missing_keys`` and
    ``unexpected_keys``. Either way a shared name whose shape or dtype differs
    is a LayoutMismatchError, and nothing changes.
    """
    comm = Group(group, coordinator, timeout)
    digest = agree_on_root(store, run, generation, comm)
    module = unwrap(model)

    def check() -> tuple[KeyMatch, dict[str, str] | None]:
        root = store.read_root(digest, run=run)
        where = {"run": run, "generation": root.generation}
        saved, items = saved_model(root, prefix)
        if strict:
            check_model_keys(module, saved, where)
        return match_model_keys(module, saved, where), items

    checked, failure = attempt(check)
    outcomes = comm.all_gather({"error": describe(failure)}, "load_weights: check")
    raise_failures(outcomes, comm, failure)
    assert checked is not None
    keys, items = checked
    live = module.state_dict()
    shared = {name: live[name] for name in keys.shared}
    targets: dict[str, Any] = {prefix: shared} if prefix else shared
    if items is not None:  # a DCP generation: its tensor items, by fqn (castore.format.dcplayout)
        targets = {TENSORS: {items[name]: live[name] for name in keys.shared}}
    loaded = castore_dist.load(
        store,
        run,
        targets,
        digest.hex,
        group=group,
        coordinator=coordinator,
        timeout=timeout,
        rank_local="drop",
        framework="torch",
    )
    return WeightsLoaded(
        loaded.report.generation, len(keys.shared), loaded.report, keys.missing, keys.unexpected
    )
