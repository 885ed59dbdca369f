"""``castore log --graph``: generations and their parents across runs, as a text graph.

Each generation is one line, newest first, children always above their parents,
with a lane per line of descent (as ``git log --graph`` draws commits)::

    * ft@2      step 11  9b1c2d3e4f50  save
    * ft@1      step 10  0a1b2c3d4e5f  branch of base@1
    | * base@2  step 20  3fa2c1d0e4a1  save
    |-/
    * base@1    step 10  77e0c1d2a3b4  import safetensors model.safetensors

A generation's parents are its run's previous generation (a save's) and every
generation its root's ``lineage`` names (a branch's source, an amend's source
and its graft donors). The first parent continues the generation's lane; each
other parent gets a lane of its own (``|-\\``); lanes that wait for the same
generation join at it (``|-/``). A parent that is not drawn (collected, in
another store, older than ``-n`` shows) is named on the line, with why.

The layout (:func:`display_order`, :func:`draw`) knows nothing of stores: keys and
parents in, rows of text out.
"""

from __future__ import annotations

import argparse
import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from castore.cli import origins
from castore.cli.stores import open_existing
from castore.copying import copies_logged
from castore.core.history import Generation
from castore.store import Store

# -- the layout -----------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the graph: a generation's (``key``) or an edge row's (``key`` None)."""

    graph: str
    key: str | None


def display_order(parents: Mapping[str, Sequence[str]], rank: Callable[[str], Any]) -> list[str]:
    """Every key of ``parents``, children before their parents (parents outside the
    mapping are ignored). Among the keys whose children are all placed, the next is the
    last placed key's first parent, so that a run's generations stay together; else the
    one ``rank`` puts highest (the newest)."""
    children: dict[str, int] = dict.fromkeys(parents, 0)
    for key, named in parents.items():
        for parent in dict.fromkeys(named):
            if parent in children and parent != key:
                children[parent] += 1
    by_rank = sorted(parents, key=rank, reverse=True)
    position = {key: index for index, key in enumerate(by_rank)}
    ready = [position[key] for key in by_rank if children[key] == 0]
    heapq.heapify(ready)
    placed: set[str] = set()
    order: list[str] = []
    while len(order) < len(parents):
        key = _next_key(parents, order, children, placed, ready, by_rank)
        placed.add(key)
        order.append(key)
        for parent in dict.fromkeys(parents[key]):
            if parent in children and parent not in placed and parent != key:
                children[parent] -= 1
                if children[parent] == 0:
                    heapq.heappush(ready, position[parent])
    return order


def _next_key(
    parents: Mapping[str, Sequence[str]],
    order: list[str],
    children: dict[str, int],
    placed: set[str],
    ready: list[int],
    by_rank: list[str],
) -> str:
    if order:
        first = next(iter(parents[order[-1]]), None)
        if first in children and first not in placed and children[first] == 0:
            return first
    while ready:
        key = by_rank[heapq.heappop(ready)]
        if key not in placed:
            return key
    # Only a cycle leaves no key ready; roots name their parents by digest, so a cycle
    # needs a hash collision. Drawn anyway: the newest key left, its edges upward dropped.
    return next(key for key in by_rank if key not in placed)


def draw(order: Sequence[str], parents: Mapping[str, Sequence[str]]) -> list[Row]:
    """The rows of the graph of ``order`` (from :func:`display_order`): a row per key,
    ``*`` in its lane, and edge rows where lanes join or a key's other parents branch off.
    Only parents in ``order`` and below their child are drawn."""
    below = set(order)
    lanes: list[str | None] = []  # the key each lane leads down to; None: a free lane
    rows: list[Row] = []
    ended = -1  # the lane of the row above, if it ended there: not reused at once
    for key in order:
        below.discard(key)
        hits = [lane for lane, waits in enumerate(lanes) if waits == key]
        # A "*" right under a "*" reads as its parent: a new lane never starts there.
        column = hits[0] if hits else _free_lane(lanes, ended)
        if len(hits) > 1:
            rows.append(Row(_edge_row(lanes, column, hits[1:], joining=True), None))
            for lane in hits[1:]:
                lanes[lane] = None
        rows.append(Row(_node_row(lanes, column), key))
        drawn = [p for p in dict.fromkeys(parents.get(key, ())) if p in below]
        lanes[column] = drawn[0] if drawn else None
        ended = -1 if drawn else column
        forks = []
        for parent in drawn[1:]:
            lane = _free_lane(lanes, column)
            lanes[lane] = parent
            forks.append(lane)
        if forks:
            rows.append(Row(_edge_row(lanes, column, forks, joining=False), None))
        while lanes and lanes[-1] is None:
            lanes.pop()
    return rows


def _free_lane(lanes: list[str | None], taken: int) -> int:
    """The leftmost free lane other than ``taken``, a new one if none is free."""
    for lane, waits in enumerate(lanes):
        if waits is None and lane != taken:
            return lane
    lanes.append(None)
    if len(lanes) - 1 == taken:
        lanes.append(None)
    return len(lanes) - 1


def _node_row(lanes: list[str | None], column: int) -> str:
    marks = ["*" if lane == column else "|" if waits else " " for lane, waits in enumerate(lanes)]
    return " ".join(marks).rstrip()


def _edge_row(lanes: list[str | None], column: int, ends: list[int], *, joining: bool) -> str:
    """``|-/`` (lanes joining ``column`` from the right), ``\\-|`` (from the left), or the
    same mirrored for lanes that branch off ``column`` (``|-\\``, ``/-|``)."""
    cells = list(" ".join("|" if waits else " " for waits in lanes))
    cells[2 * column] = "|"
    for end in ends:
        right = end > column
        cells[2 * end] = "/" if right == joining else "\\"
        low, high = sorted((2 * column, 2 * end))
        for at in range(low + 1, high):
            if cells[at] == " ":
                cells[at] = "-"
    return "".join(cells).rstrip()


# -- a store's generations and their parents ------------------------------------------


@dataclass
class _Parent:
    """A parent a generation names: its run (if a string), root (if a valid digest) and
    how it is named on the line."""

    run: str | None
    root: str | None
    name: str | None  # None: the run's previous generation, named once its id is known


@dataclass
class _Shown:
    gen: Generation
    parents: list[_Parent]
    drawn: list[str] = field(default_factory=list)  # root hexes of the parents drawn
    notes: list[str] = field(default_factory=list)  # the others, and why not drawn


class _Listings:
    """Each run's listed generations, read once (``last``: the newest N of each)."""

    def __init__(self, store: Store, last: int | None) -> None:
        self.store, self.last = store, last
        self.runs = set(store.runs())
        self.by_run: dict[str, list[Generation]] = {}
        self.by_root: dict[str, Generation] = {}
        self.logs: dict[str, tuple[dict[str, int], set[str]]] = {}

    def of(self, run: str) -> list[Generation]:
        if run not in self.by_run:
            self.by_run[run] = self.store.generations(run, last=self.last)
            self.by_root.update((gen.root, gen) for gen in self.by_run[run])
        return self.by_run[run]

    def find(self, parent: _Parent) -> Generation | None:
        if parent.run not in self.runs or parent.root is None:
            return None  # a run this store does not have (or a hostile name): never opened
        self.of(parent.run)
        found = self.by_root.get(parent.root)
        return found if found is not None and found.run == parent.run else None

    def logged(self, run: str) -> tuple[dict[str, int], set[str]]:
        if run not in self.logs:
            self.logs[run] = self.store.logged(run)
        return self.logs[run]

    def collected_id(self, run: str, root: str) -> int | None:
        """The id the reflog's newest record of ``root`` gives it (its ``collect`` record)."""
        for record in self.store.refs.records_backwards(run):
            if record["root"] == root:
                return int(record["generation"])
        return None

    def why_not_drawn(self, parent: _Parent) -> str:
        """``base@3 collected`` (or ``not in this store``, ``not shown (-n)``)."""
        if parent.run not in self.runs or parent.root is None:
            return f"{parent.name} not in this store"
        published, collected = self.logged(parent.run)
        if parent.name is None:  # the run's previous generation: named by id if logged
            number = published.get(parent.root) or self.collected_id(parent.run, parent.root)
            where = f"{parent.run}@{number}" if number else parent.root[:12]
            parent.name = f"parent {where}"
        if parent.root in collected:
            return f"{parent.name} collected"
        if parent.root in published:
            return f"{parent.name} not shown (-n)"
        return f"{parent.name} not in this store"


def _parents(gen: Generation) -> list[_Parent]:
    """The run's previous generation (if any), then every source the lineage names."""
    named = [_Parent(gen.run, gen.parent, None)] if gen.parent is not None else []
    named += [_Parent(s.run, s.root, s.name) for s in origins.sources(gen.lineage)]
    unique: dict[str | int, _Parent] = {}
    for index, parent in enumerate(named):
        if parent.root in unique:  # an amend on its own run: its parent is also its source
            unique[parent.root].name = parent.name
        else:
            unique[parent.root if parent.root is not None else index] = parent
    return list(unique.values())


def gather(store: Store, run: str | None, last: int | None) -> list[_Shown]:
    """Every listed generation of every run, or ``run``'s and all they descend from (in
    any run of the store), with their parents: drawn, or named with why not."""
    listings = _Listings(store, last)
    shown: dict[str, Generation] = {}
    runs = [run] if run else sorted(listings.runs)
    frontier = [gen for name in runs for gen in listings.of(name)]
    while frontier:
        found = []
        for gen in frontier:
            if gen.root not in shown:
                shown[gen.root] = gen
                found += [listings.find(p) for p in _parents(gen)]
        frontier = [gen for gen in found if gen is not None and gen.root not in shown]
    result = []
    for gen in shown.values():
        item = _Shown(gen, _parents(gen))
        for parent in item.parents:
            if parent.root in shown and shown[parent.root].run == parent.run:
                item.drawn.append(parent.root)
            else:
                item.notes.append(listings.why_not_drawn(parent))
        result.append(item)
    return result


def graph_lines(store: Store, shown: Iterable[_Shown]) -> list[str]:
    """The graph's lines: each generation's with its run@id, step, root prefix, where it
    came from and tags; edge rows between them."""
    items = {item.gen.root: item for item in shown}
    parents = {root: item.drawn for root, item in items.items()}
    order = display_order(parents, lambda root: _recency(items[root].gen))
    rows = draw(order, parents)
    describe = _Describer(store, [item.gen for item in items.values()])
    width = max(len(row.graph) for row in rows)
    label = max(len(f"{item.gen.run}@{item.gen.id}") for item in items.values())
    step = max(len(str(item.gen.step)) for item in items.values())
    lines = []
    for row in rows:
        if row.key is None:
            lines.append(row.graph.rstrip())
            continue
        item = items[row.key]
        gen = item.gen
        lines.append(
            f"{row.graph:<{width}}  {f'{gen.run}@{gen.id}':<{label}}  step {gen.step:<{step}}  "
            f"{gen.root[:12]}  {describe(item)}"
        )
    return lines


def _recency(gen: Generation) -> tuple[float, str, int]:
    return (gen.time, gen.run, gen.id)


class _Describer:
    """What a line says of its generation: how it was made, parents not drawn, tags."""

    def __init__(self, store: Store, gens: list[Generation]) -> None:
        runs = {gen.run for gen in gens}
        self.copies = {
            root: record
            for run in runs
            for root, record in copies_logged(
                store, run, {gen.root for gen in gens if gen.run == run}
            ).items()
        }
        self.tags: dict[str, list[str]] = {}
        for run in runs:
            for name, value in store.refs.tags(run).items():
                self.tags.setdefault(value.root.hex, []).append(name)

    def __call__(self, item: _Shown) -> str:
        gen = item.gen
        made = origins.origin(gen)
        text = made + origins.changes(gen.lineage) if made else origins.imported(gen) or "save"
        if gen.root in self.copies:  # published here by castore copy (its reflog says so)
            text = f"copied here: {text}"
        if item.notes:
            text += "; " + "; ".join(item.notes[: origins.ITEM_LIMIT])
            more = len(item.notes) - origins.ITEM_LIMIT
            text += f"; ... {more} more parent(s) not drawn" if more > 0 else ""
        tags = sorted(self.tags.get(gen.root, []))
        return text + (f"  [tag{'s' if len(tags) > 1 else ''} {', '.join(tags)}]" if tags else "")


def cmd_log_graph(args: argparse.Namespace) -> int:
    with open_existing(args.store) as store:
        shown = gather(store, args.run, args.max_count)
        lines = graph_lines(store, shown) if shown else ["no generations"]
    print("\n".join(lines))
    return 0
