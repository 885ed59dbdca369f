"""Per-rank functions for tests/test_direct_restore.py, run by tests/helpers/dist_harness.py.

A state of row-sharded tensors (castore.Shard blocks) and small replicated values
(each written by one rank), saved at one world size and restored at the same or
another, reporting how many shard manifests the rank read and what it restored
(numpy, for the parent to compare).
"""

from __future__ import annotations

from typing import Any

import numpy as np

SHAPES = {"w": (24, 6), "b": (24,), "m": (24, 6)}
REPLICATED = {"step": np.array(7, dtype=np.int64), "scale": np.arange(5, dtype=np.float64),
              "lr": np.array([0.5], dtype=np.float32)}  # fmt: skip


def whole(name: str) -> np.ndarray:
    size = int(np.prod(SHAPES[name]))
    seed = sum(map(ord, name))
    return (np.arange(size, dtype=np.float32) * 0.5 + seed).reshape(SHAPES[name])


def rows(world: int, rank: int) -> tuple[int, int]:
    size = 24 // world
    return rank * size, size


def block(name: str, world: int, rank: int, *, empty: bool = False) -> Any:
    import castore

    start, size = rows(world, rank)
    shape = SHAPES[name]
    part = np.ascontiguousarray(whole(name)[start : start + size])
    return castore.Shard(
        np.zeros_like(part) if empty else part, shape, (start,) + (0,) * (len(shape) - 1)
    )


def state(world: int, rank: int, *, empty: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {name: block(name, world, rank, empty=empty) for name in SHAPES}
    for name, value in REPLICATED.items():
        out[name] = np.zeros_like(value) if empty else value.copy()
    return out


def save(rank: int, world: int, path: str) -> int:
    import castore
    import castore.dist

    with castore.open(path) as store:
        return castore.dist.save(store, state(world, rank), run="run", step=1).id


def restore(rank: int, world: int, path: str, mode: str = "targets") -> dict[str, Any]:
    """Restore into this rank's blocks and the replicated values. ``mode``: "targets"
    (every tensor a target), "rest" (only "w" a target, the rest through a load_rest
    callable giving this rank's blocks), "rest-whole" (load_rest=True: the rest whole),
    "broken" (a direct path that takes any box it finds in the two manifests as the
    target's whole source: a broken control)."""
    import castore
    import castore.dist
    from castore.dist import planning

    if mode == "broken":
        planning.is_saved_box = lambda box, boxes: True  # type: ignore[assignment]
        planning.covered_once = lambda *args, **kwargs: None  # type: ignore[assignment]
    targets = state(world, rank, empty=True)
    rest: Any = False
    if mode == "rest":
        targets = {"w": targets["w"]}

        def rest(saved: Any) -> Any:
            if saved.name in SHAPES:
                return block(saved.name, world, rank, empty=True)
            return np.zeros(saved.shape, dtype=REPLICATED[saved.name].dtype)

    elif mode == "rest-whole":
        targets, rest = {"w": targets["w"]}, True
    with castore.open(path) as store:
        result = castore.dist.load(store, "run", targets, load_rest=rest)
    start, size = rows(world, rank)
    got = {}
    for name, value in result.state.items():
        got[name] = value.local if isinstance(value, castore.Shard) else np.asarray(value)
    expected = {**{n: v.copy() for n, v in REPLICATED.items()}}
    for name in SHAPES:
        expected[name] = whole(name) if mode == "rest-whole" and name != "w" else (
            whole(name)[start : start + size]
        )
    return {
        "manifests": result.report.manifests_read,
        "resharded": result.report.resharded,
        "got": got,
        "expected": expected,
    }
