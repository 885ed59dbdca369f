"""``castore tiers``: which tier holds each generation, and what a restore selects now."""

from __future__ import annotations

import argparse
import contextlib

from castore.cli.output import format_age, format_time, spans, text_table
from castore.cli.stores import open_existing
from castore.errors import StoreNotFoundError
from castore.tiers import TierRow, recovery_points, tier_report
from castore.tiers.selection import RestoreChoice, restore_choice


def cmd_tiers(args: argparse.Namespace) -> int:
    paths = [args.store, *args.node]
    with contextlib.ExitStack() as stack:
        nodes = {}  # index in ``paths`` -> the fast tier there; a lost node has none
        for index, path in enumerate(paths):
            try:
                nodes[index] = stack.enter_context(open_existing(path))
            except StoreNotFoundError:
                pass  # a lost node: its directory is gone (said below)
        durable = stack.enter_context(open_existing(args.durable))
        live = list(nodes.values())
        rows = tier_report(live, durable, [args.run] if args.run else None)
        runs = sorted({row.run for row in rows})
        choices = {run: restore_choice(live, durable, run) for run in runs}
    _print_tier_rows(rows)
    for index in sorted(set(range(len(paths))) - set(nodes)):
        print(
            f"node {paths[index]}: lost (no store there): the fast column counts the other "
            "nodes' fast tiers only"
        )
    ages = recovery_points(rows)
    for run in runs:
        print(_restore_line(run, choices[run], [paths[index] for index in nodes]))
        said = ", ".join(f"{tier} {format_age(s)}" for tier, s in ages.get(run, {}).items())
        print(f"{run}: newest generation per tier: {said or 'none held whole'}")
    return 0


def _print_tier_rows(rows: list[TierRow]) -> None:
    if not rows:
        print("no generations")
        return
    table = [
        [
            row.run,
            row.id,
            row.step,
            format_time(row.time),
            row.fast or "-",
            "yes" if row.durable else ("pending" if row.pinned else "-"),
            row.root[:12],
        ]
        for row in rows
    ]
    print(text_table(table, ["run", "id", "step", "time", "fast", "durable", "root"],
                     text=("run", "root")))  # fmt: skip


def _restore_line(run: str, choice: RestoreChoice | None, paths: list[str]) -> str:
    """Which generation a restore selects now (castore.tiers.selection), from where, and
    how far behind the newest generation any tier lists."""
    if choice is None:
        return f"{run}: a restore now finds no generation complete in the tiers given"
    sources = [
        paths[index] + ("" if len(held) == choice.world_size else f" (shards {spans(held)})")
        for index, held in sorted(choice.nodes.items())
    ]
    said = ("the fast tier of " if len(sources) == 1 else "the fast tiers of ") + ", ".join(sources)
    said = said if sources else ""
    if choice.durable:
        said = f"{said} and the durable tier" if said else "the durable tier"
    behind = (
        "the newest"
        if choice.generations_behind == 0
        else f"{choice.generations_behind} generation(s), {choice.steps_behind} step(s) behind "
        f"the newest ({choice.newest_id}, step {choice.newest_step})"
    )
    return (
        f"{run}: a restore now selects generation {choice.id} (step {choice.step}), "
        f"{behind}, from {said}"
    )
