"""Where each generation is: the report ``castore tiers`` and ``store.tiers()`` print.

Per generation, whether the fast tiers named hold it (by their holdings
records, castore.core.holdings), list it with its chunks elsewhere or not at
all, and whether the durable tier has it; and per run, the recovery point of
each tier now (how old its newest whole generation is). Reads only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from castore.core.history import Generation
from castore.core.holdings import held_shards
from castore.format.hashing import Digest
from castore.store import Store
from castore.tiers.policy import PINS


@dataclass(frozen=True)
class TierRow:
    """Where one generation is. ``fast``: "held" (the fast tiers named hold every
    shard), "K/N shards" (they hold K of its N shards: the rest are on other
    nodes or in the durable tier), "elsewhere" (listed, no chunks held) or ""
    (not listed); ``durable`` whether the durable tier has it."""

    run: str
    id: int
    step: int
    time: float
    root: str
    fast: str
    durable: bool
    pinned: bool  # pinned in a fast tier for a promotion not finished yet


def tier_report(
    fast: Store | list[Store], durable: Store, runs: list[str] | None = None
) -> list[TierRow]:
    """Per generation of ``runs`` (default: every run of any store), which tier has it.

    ``fast``: one fast tier, or the fast tiers of several nodes (their
    holdings records say which shards each holds). Reads only: no store is
    changed. Ordered by run, then id.
    """
    nodes = fast if isinstance(fast, list) else [fast]
    rows = []
    names = runs if runs is not None else sorted(
        {run for store in [*nodes, durable] for run in store.runs()}
    )  # fmt: skip
    for run in names:
        listed: dict[int, Generation] = {}
        held: dict[int, set[int]] = {}
        pins: set[int] = set()
        for node in nodes:
            if run not in node.runs():
                continue
            for gen in node.generations(run):
                listed.setdefault(gen.id, gen)
                held.setdefault(gen.id, set()).update(_held_by(node, run, gen))
            pins |= {
                value.generation
                for name, value in node.refs.tags(run).items()
                if name.startswith(PINS)
            }
        in_durable = {g.id: g for g in durable.generations(run)} if run in durable.runs() else {}
        for gen_id in sorted(set(listed) | set(in_durable)):
            gen = listed.get(gen_id) or in_durable[gen_id]
            rows.append(
                TierRow(
                    run,
                    gen_id,
                    gen.step,
                    gen.time,
                    gen.root,
                    _where(len(held[gen_id]), gen.world_size) if gen_id in listed else "",
                    gen_id in in_durable,
                    gen_id in pins,
                )  # fmt: skip
            )
    return rows


def _where(held: int, total: int) -> str:
    if held >= total:
        return "held"
    return f"{held}/{total} shards" if held else "elsewhere"


def _held_by(store: Store, run: str, gen: Generation) -> set[int]:
    """The shards of ``gen`` that ``store`` holds, by its holdings record (all without one)."""
    if not isinstance(store.path, Path):
        return set(range(gen.world_size))
    found = held_shards(store.path, run, gen.id, Digest.from_hex(gen.root))
    return set(range(gen.world_size)) if found is None else found


def recovery_points(rows: list[TierRow], now: float | None = None) -> dict[str, dict[str, float]]:
    """Per run, seconds since the newest generation each tier holds whole (its RPO now):
    ``{"fast": ..., "durable": ...}``; a tier with none of the run's generations is absent."""
    now = time.time() if now is None else now
    points: dict[str, dict[str, float]] = {}
    for row in rows:
        ages = points.setdefault(row.run, {})
        if row.fast == "held":
            ages["fast"] = min(ages.get("fast", float("inf")), now - row.time)
        if row.durable:
            ages["durable"] = min(ages.get("durable", float("inf")), now - row.time)
    return points
