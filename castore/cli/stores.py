"""The store a command names: opened as it is (never created), and what of a generation it holds."""

from __future__ import annotations

from pathlib import Path

import castore
from castore.core.history import Generation
from castore.core.holdings import held_shards
from castore.format.hashing import Digest
from castore.store import Store


def open_existing(path: str) -> Store:
    return castore.open(path, create=False)


def shards_here(store: Store, gen: Generation) -> str:
    """Which of a generation's shards this store holds: "all", "K/N shards" (a node's fast
    tier: the rest are on other nodes) or "none" (its chunks are in another tier)."""
    if not isinstance(store.path, Path):
        return "all"
    held = held_shards(store.path, gen.run, gen.id, Digest.from_hex(gen.root))
    if held is None or len(held) >= gen.world_size:
        return "all"
    return f"{len(held)}/{gen.world_size} shards" if held else "none"
