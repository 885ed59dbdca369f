"""Per-rank functions for tests/test_direct_restore.py, run by tests/helpers/dist_harness.py.

A state of row-sharded tensors (castore.Shard blocks), saved at one world size
and restored at the same or another, reporting how many shard manifests the
rank read and what it restored (numpy, for the parent to compare).
"""

from __future__ import annotations

from typing import Any

import numpy as np

SHAPES = {"w": (24, 6), "b": (24,), "m": (24, 6)}


def whole(name: str) -> np.ndarray:
    size = int(np.prod(SHAPES[name]))
    seed = sum(map(ord, name))
    return (np.arange(size, dtype=np.float32) * 0.5 + seed).reshape(SHAPES[name])


def rows(world: int, rank: int) -> tuple[int, int]:
    size = 24 // world
    return rank * size, size


def state(world: int, rank: int, *, empty: bool = False) -> dict[str, Any]:
    import castore
    import castore.dist

    start, size = rows(world, rank)
    out: dict[str, Any] = {}
    for name, shape in SHAPES.items():
        block = np.ascontiguousarray(whole(name)[start : start + size])
        out[name] = castore.Shard(
            np.zeros_like(block) if empty else block, shape, (start,) + (0,) * (len(shape) - 1)
        )
    return out


def save(rank: int, world: int, path: str) -> int:
    import castore
    import castore.dist

    with castore.open(path) as store:
        return castore.dist.save(store, state(world, rank), run="run", step=1).id


def restore(rank: int, world: int, path: str, broken: bool = False) -> dict[str, Any]:
    """Restore into this rank's blocks; ``broken``: a direct path that takes any box it
    finds in the two manifests as the target's whole source (a broken control)."""
    import castore
    import castore.dist
    from castore.dist import planning

    if broken:
        planning.is_saved_box = lambda box, boxes: True  # type: ignore[assignment]
        planning.covered_once = lambda *args, **kwargs: None  # type: ignore[assignment]
    targets = state(world, rank, empty=True)
    with castore.open(path) as store:
        report = castore.dist.load(store, "run", targets).report
    start, size = rows(world, rank)
    return {
        "manifests": report.manifests_read,
        "resharded": report.resharded,
        "got": {n: t.local for n, t in targets.items()},
        "expected": {n: whole(n)[start : start + size] for n in SHAPES},
    }
