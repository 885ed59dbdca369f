"""Per-rank script for tests/test_replicas.py, run by tests/helpers/dist_harness.py.

Each case saves a state whose replicated values are equal on every rank, or
differ on some ranks in one way; the rank reports what its save did and what
the run's ref names afterwards. Results are plain values (numpy arrays, not
tensors), so the parent needs no torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import castore
import castore.dist
from castore import RankLocal

STEP = 0


def _tensor(rank: int, differs: bool) -> Any:
    import torch

    return torch.arange(16.0).reshape(4, 4) + (100 * rank if differs else 0)


def _states(rank: int, world: int) -> dict[str, Any]:
    """Each case's state on this rank, by case name."""
    import torch

    plain = {"lr": 0.1, "betas": (0.9, 0.99), "names": ["a", "b"], "nested": {"k": [1, {"x": 2}]}}
    equal = {
        "w": _tensor(rank, False),
        "big": torch.ones(3000),  # several chunks at the store's chunk size
        "np": np.arange(6, dtype=np.int64),
        "cfg": plain,
        "mine": RankLocal(torch.full((3,), float(rank))),  # may differ freely
    }
    # A dict whose keys are listed in another order on odd ranks: equal values.
    order = {"b": 2, "a": 1} if rank % 2 else {"a": 1, "b": 2}
    return {
        "equal": equal,
        "key_order": {**equal, "cfg": {**plain, "order": order}},
        # The case: each rank passes its own rows as a whole tensor.
        "tensor": {**equal, "w": _tensor(rank, True)},
        # The last rank alone holds one flipped element, deep in a chunk.
        "one_element": {**equal, "big": _flip_last(rank, world, torch.ones(3000))},
        "numpy": {**equal, "np": np.arange(6, dtype=np.int64) * (rank + 1)},
        "plain": {**equal, "cfg": {**plain, "nested": {"k": [1, {"x": 2 + rank}]}}},
        "missing_key": {**equal, "cfg": {**plain, **({"extra": 1} if rank == 0 else {})}},
        "kind": {
            **equal,
            "cfg": {**plain, "names": ("a", "b") if rank == world - 1 else ["a", "b"]},
        },
        "several": {**equal, "w": _tensor(rank, True), "np": np.arange(6) * (rank + 1)},
    }


def _flip_last(rank: int, world: int, tensor: Any) -> Any:
    if rank == world - 1:
        tensor[2500] = 2.0
    return tensor


def run_cases(rank: int, world: int, path: str, cases: list[str], blocking: bool) -> dict[str, Any]:
    """Save each case as the next step of run R; what each save did, and the ref after it."""
    states = _states(rank, world)
    out: dict[str, Any] = {}
    with castore.open(path) as store:
        for step, case in enumerate(cases, start=1):
            result: dict[str, Any] = {}
            try:
                saved = castore.dist.save(
                    store, states[case], run="R", step=step, blocking=blocking
                )
                if not blocking:
                    saved = saved.result()
                result["generation"] = saved.id
            except castore.CastoreError as exc:
                result.update(error=type(exc).__name__, message=exc.message, text=str(exc))
                result["keys"] = getattr(exc, "keys", None)
            result["latest"] = store.generations("R")[-1].id if store.runs() else None
            out[case] = result
        loaded = castore.dist.load(store, "R", {}, load_rest=True)
        out["loaded_w"] = loaded.state["w"].numpy()
        out["loaded_mine"] = loaded.state["mine"].numpy()
    return out


def trusting_saves(rank: int, world: int, path: str) -> list[dict[str, Any]]:
    """Saves that trust version counters: an unchanged replicated tensor is not hashed
    again to compare, and one changed in place on one rank alone is still caught."""
    import torch

    hashed = count_hashing()
    state = {"a": torch.zeros(4000), "b": torch.zeros(4000)}
    for tensor in state.values():
        tensor.add_(1.0)  # a counter at 0 is never trusted
    steps = [
        ("first", lambda: None),
        ("unchanged", lambda: None),
        ("one_rank_moved", lambda: state["a"].add_(1.0) if rank == world - 1 else None),
        ("all_moved", lambda: state["a"].add_(1.0) if rank != world - 1 else None),
    ]
    with castore.open(path) as store:
        return trusting_saves_of(store, state, steps, hashed)


def count_hashing() -> list[int]:
    """Count the chunks castore.dist.replicas hashes to compare: one entry per call,
    cleared by trusting_saves_of before each save."""
    from castore.dist import replicas

    hashed: list[int] = []
    hash_views = replicas.digests_in_order

    def counting(views: Any, **options: Any) -> Any:
        hashed.append(len(views))
        return hash_views(views, **options)

    replicas.digests_in_order = counting  # type: ignore[assignment]
    return hashed


def trusting_saves_of(
    store: Any, state: Any, steps: list[tuple[str, Any]], hashed: list[int]
) -> list[dict[str, Any]]:
    """Each step's change, then a trusting save of ``state``: published or the error's
    name, and the bytes hashed to compare (``hashed``, filled by the caller's probe)."""
    out = []
    for step, (case, change) in enumerate(steps, start=1):
        change()
        hashed.clear()
        result: dict[str, Any] = {"case": case}
        try:
            castore.dist.save(store, state, run="T", step=step, trust_versions=True)
            result["published"] = True
        except castore.CastoreError as exc:
            result["error"] = type(exc).__name__
        result["hashed_to_compare"] = sum(hashed)
        out.append(result)
    return out
