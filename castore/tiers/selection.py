"""Which generation a restore of a tiered job selects: one rule for the job and the tools.

A restore of a job whose ranks span several nodes (castore.tiers.nodes) picks
the newest generation complete across what is reachable: one whose saved
shards the live nodes' fast tiers hold together (by their holdings records,
castore.core.holdings), or one the durable tier has. ``castore tiers`` asks
the same question of the fast directories it is given (a lost node's is
gone): :func:`restore_choice` answers it with the functions the job's
coordinator decides with, so the tool cannot say one thing and the restore
do another.

A node's *view* of a run is a list of rows ``[id, root digest (32 bytes),
saved world size, [shards it holds]]``, one per generation its fast tier
lists: what each node's leader sends the coordinator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from castore.core.holdings import held_shards
from castore.errors import RefConflictError
from castore.format.hashing import Digest
from castore.store import Store

View = list[list[Any]]  # [id, root digest, saved world size, [held shards]] per generation


def node_view(fast: Store, run: str) -> View:
    """The generations of ``run`` that one node's fast tier lists, and the shards it holds."""
    if run not in fast.runs():
        return []
    rows = []
    for gen, digest in fast.candidates(run):
        root = fast.read_root(digest, run=run)
        held = None
        if isinstance(fast.path, Path):
            held = held_shards(fast.path, run, gen, digest)
        shards = list(range(root.world_size)) if held is None else sorted(held)
        rows.append([gen, digest.raw, root.world_size, shards])
    return rows


def covered_generations(run: str, views: Sequence[View]) -> dict[int, bytes]:
    """The generations whose saved shards the nodes' views cover together: id -> root."""
    covered: dict[tuple[int, bytes], set[int]] = {}
    sizes: dict[tuple[int, bytes], int] = {}
    for view in views:
        for gen, root, world_size, shards in view:
            key = (int(gen), bytes(root))
            covered.setdefault(key, set()).update(int(s) for s in shards)
            sizes[key] = int(world_size)
    found: dict[int, bytes] = {}
    for (gen, root), shards in covered.items():
        if shards >= set(range(sizes[(gen, root)])):
            if gen in found and found[gen] != root:
                raise RefConflictError(
                    f"two nodes hold different generations {gen} of run {run!r}", run=run
                )
            found[gen] = root
    return found


def restore_candidates(
    run: str, views: Sequence[View], durable: Store, below: int | None = None
) -> list[tuple[int, bytes]]:
    """What a restore tries, newest first: the generations the views cover together and
    those the durable tier has (at most ``below``, when given)."""
    found = covered_generations(run, views)
    if run in durable.runs():
        for gen, digest in durable.candidates(run):
            if gen in found and found[gen] != digest.raw:
                raise RefConflictError(
                    f"the fast and durable tiers hold different generations {gen} of run "
                    f"{run!r}",
                    run=run,
                )
            found[gen] = digest.raw
    return [
        (gen, root)
        for gen, root in sorted(found.items(), reverse=True)
        if below is None or gen <= below
    ]


@dataclass(frozen=True)
class RestoreChoice:
    """The generation a restore would select now, where its bytes would come from, and how
    far behind the newest generation any tier lists it is."""

    run: str
    id: int
    step: int
    root: str
    world_size: int  # the saved rank count: its shards
    nodes: dict[int, list[int]]  # index of each fast tier given that holds shards of it
    durable: bool  # the durable tier has it (the source of whatever no node holds)
    newest_id: int
    newest_step: int

    @property
    def generations_behind(self) -> int:
        return self.newest_id - self.id

    @property
    def steps_behind(self) -> int:
        return self.newest_step - self.step


def restore_choice(fast: Sequence[Store], durable: Store, run: str) -> RestoreChoice | None:
    """The generation a restore of ``run`` selects with these fast tiers (a lost node's is
    not among them) and ``durable``; None when nothing is complete anywhere."""
    views = [node_view(node, run) for node in fast]
    candidates = restore_candidates(run, views, durable)
    if not candidates:
        return None
    gen, root = candidates[0]
    digest = Digest(root)
    holder = next((n for n, v in zip(fast, views, strict=True) if _lists(v, gen, root)), None)
    chosen = (holder or durable).read_root(digest, run=run)
    newest = _newest(fast, durable, run)
    nodes = {
        index: shards
        for index, view in enumerate(views)
        for g, r, _, shards in view
        if (g, bytes(r)) == (gen, root) and shards
    }
    in_durable = run in durable.runs() and gen in dict(durable.candidates(run))
    return RestoreChoice(
        run,
        gen,
        chosen.step,
        digest.hex,
        chosen.world_size,
        nodes,
        in_durable,
        max(newest[0], gen),
        max(newest[1], chosen.step),
    )


def _lists(view: View, gen: int, root: bytes) -> bool:
    return any((g, bytes(r)) == (gen, root) for g, r, _, _ in view)


def _newest(fast: Sequence[Store], durable: Store, run: str) -> tuple[int, int]:
    """The newest generation any tier lists of ``run``: (id, step)."""
    newest = (-1, -1)
    for store in [*fast, durable]:
        if run in store.runs():
            last = store.generations(run, last=1)
            if last and last[-1].id > newest[0]:
                newest = (last[-1].id, last[-1].step)
    return newest
