"""Which ranks hold which parts of a multi-rank save's state (``castore.dist.save``).

Every rank usually passes the same tree. A rank may instead pass an empty dict
where another rank passes a subtree: it holds nothing there, and the subtree is
saved from the ranks that pass it. ``get_state_dict(model, optimizer,
options=StateDictOptions(full_state_dict=True, cpu_offload=True))`` gives rank
0 the whole state and every other rank empty dicts: rank 0 alone writes it.

The rule. A key path where some rank passes ``{}`` and some other rank passes
something is a *region*: the ranks that pass something there hold it, and they
must pass a non-empty dict there. A region is written by its holders alone
(each tensor whole, by one holder), and its values are compared among its
holders only (castore.dist.replicas); a region no rank holds is an empty dict
like any other. At least one rank must pass every region (the whole tree): the
generation's tree is that rank's. Everything else must agree on every rank as
before: tensors that differ where both ranks hold them are refused with the key
path named (:class:`~castore.errors.LayoutMismatchError`).

What it costs: each rank's first message carries the key paths of its empty
dicts (a handful in real states). Only where those differ do the ranks exchange
one digest per region of the tensors they hold there; only where tensors differ
does each distinct tree of tensors travel, once, to name the first key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from castore.dist.comm import Group
from castore.errors import LayoutMismatchError
from castore.format.hashing import digest_bytes
from castore.format.tree import dict_sizes

# A tensor as the ranks compare it: (key path, "shard" or "replicated", dtype, global shape).
Outline = list[tuple[str, str, str, list[int]]]


def empty_dicts(skeleton: bytes) -> list[str]:
    """The key paths of the empty dicts in a state's skeleton (``""``: the state itself)."""
    return sorted(path for path, size in dict_sizes(skeleton).items() if size == 0)


def within(path: str, region: str) -> bool:
    """Whether ``path`` is ``region`` or lies below it (``""``: the whole state)."""
    return region == "" or path == region or path.startswith(region + "/")


def _depth(path: str) -> int:
    return 0 if path == "" else path.count("/") + 1


@dataclass(frozen=True)
class Holding:
    """The regions of one save and who holds them: the same on every rank.

    ``regions``: shallowest first. ``pruned[rank]``: the regions where that rank
    passes ``{}``; it holds a region unless one of those is the region or above it.
    """

    regions: tuple[str, ...]
    pruned: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, empties: list[list[str]]) -> Holding:
        """From every rank's empty dicts (:func:`empty_dicts`), in rank order."""
        sets = [set(paths) for paths in empties]
        every = set.intersection(*sets)
        regions: list[str] = []
        for path in sorted(set.union(*sets) - every, key=lambda p: (_depth(p), p)):
            kept = [*regions, path]
            # A path every rank passes empty, or lies below an empty one, is just empty.
            if any(not any(q in mine and within(path, q) for q in kept) for mine in sets):
                regions.append(path)
        pruned = tuple(tuple(q for q in regions if q in mine) for mine in sets)
        return cls(tuple(regions), pruned)

    def region_of(self, path: str) -> str | None:
        """The deepest region ``path`` lies in; None: the part every rank holds."""
        found = None
        for region in self.regions:
            if within(path, region):
                found = region
        return found

    def holds(self, rank: int, region: str | None) -> bool:
        return region is None or not any(within(region, q) for q in self.pruned[rank])

    def holders(self, region: str | None) -> list[int]:
        return [rank for rank in range(len(self.pruned)) if self.holds(rank, region)]

    @property
    def full(self) -> list[int]:
        """The ranks that pass the whole tree."""
        return [rank for rank, pruned in enumerate(self.pruned) if not pruned]

    def reference(self, coordinator: int) -> int:
        """The rank whose tree is the generation's: the coordinator if it passes all."""
        full = self.full
        return coordinator if coordinator in full else full[0]


def agree_on_holding(
    infos: list[dict[str, Any]],
    comm: Group,
    outline: Outline,
    skeleton: bytes,
) -> Holding:
    """Who holds what, from the first messages (each rank's ``layout`` digest and
    ``empties``); raise LayoutMismatchError on every rank where trees disagree.

    ``outline`` and ``skeleton``: this rank's. A collective call: ranks exchange
    more only where empties or layouts differ.
    """
    holding = Holding.of([info["empties"] for info in infos])
    if not holding.regions:
        if len({info["layout"] for info in infos}) > 1:
            _refuse_difference(infos, comm, outline, holding)
        return holding
    if not holding.full:
        raise LayoutMismatchError(_none_full(holding), rank=comm.rank)
    sizes = dict_sizes(skeleton)
    mine = {
        "digests": _region_digests(outline, holding, comm.rank),
        "not_dicts": [
            q for q in holding.regions if holding.holds(comm.rank, q) and sizes.get(q, 0) == 0
        ],
    }
    sent = comm.all_gather(mine, "save: compare holdings")
    for rank, each in enumerate(sent):
        if each["not_dicts"]:
            raise LayoutMismatchError(
                _not_a_dict(holding, rank, each["not_dicts"][0]), rank=comm.rank
            )
    for index in range(len(holding.regions) + 1):
        digests = {each["digests"][index] for each in sent} - {None}
        if len(digests) > 1:
            _refuse_difference(infos, comm, outline, holding)
    return holding


def _region_digests(outline: Outline, holding: Holding, rank: int) -> list[bytes | None]:
    """One digest of this rank's tensors in the part every rank holds, then one per
    region (None where it holds none)."""
    by_region: dict[str | None, Outline] = {}
    for tensor in outline:
        by_region.setdefault(holding.region_of(tensor[0]), []).append(tensor)
    return [
        digest_bytes(msgpack.packb(sorted(by_region.get(region, []))))
        if holding.holds(rank, region)
        else None
        for region in (None, *holding.regions)
    ]


def _refuse_difference(
    infos: list[dict[str, Any]], comm: Group, outline: Outline, holding: Holding
) -> None:
    """Raise LayoutMismatchError on every rank, naming the first key that differs.

    Each distinct tree of tensors travels once: from the first rank that passes it.
    """
    layouts = [info["layout"] for info in infos]
    first = layouts.index(layouts[comm.rank]) == comm.rank
    sent = comm.all_gather(outline if first else None, "save: name the difference")
    outlines = [sent[layouts.index(layout)] for layout in layouts]
    reference = holding.reference(comm.coordinator)
    for rank, theirs in enumerate(outlines):
        found = _first_difference(outlines[reference], theirs, holding, rank)
        if found is not None:
            key, ours, its = found
            raise LayoutMismatchError(
                f"rank {rank} passes {its} at {key!r} where rank {reference} passes {ours}: "
                "every rank must pass the same tree of tensors, or an empty dict where "
                "another rank passes a subtree (docs/DIST_API.md)",
                rank=comm.rank,
                tensor=key,
            )
    raise LayoutMismatchError(  # digests differ, outlines do not: never, but fail closed
        f"the ranks' trees of tensors differ from rank {reference}'s", rank=comm.rank
    )


def _first_difference(
    reference: Outline, theirs: Outline, holding: Holding, rank: int
) -> tuple[str, str, str] | None:
    """The first key path (sorted) where ``rank``'s tensors differ from the reference's
    in the regions it holds: (path, what the reference passes, what ``rank`` passes)."""
    expected = {t[0]: t for t in reference if holding.holds(rank, holding.region_of(t[0]))}
    actual = {t[0]: t for t in theirs}
    for key in sorted(expected.keys() | actual.keys()):
        ours, its = expected.get(key), actual.get(key)
        if ours is None or its is None or list(ours) != list(its):
            return key, _what(ours), _what(its)
    return None


def _what(tensor: tuple[str, str, str, list[int]] | None) -> str:
    if tensor is None:
        return "no tensor"
    _, kind, dtype, shape = tensor
    return f"a {'sharded ' if kind == 'shard' else ''}{dtype}{list(shape)} tensor"


def _none_full(holding: Holding) -> str:
    said = [
        f"rank {rank} passes an empty dict at {pruned[0] or '<root>'!r}"
        for rank, pruned in enumerate(holding.pruned)
    ][:3]
    return (
        f"no rank passes the whole state ({'; '.join(said)}, which other ranks hold): "
        "where some ranks pass empty dicts, one rank at least must pass all of the "
        "state (docs/DIST_API.md)"
    )


def _not_a_dict(holding: Holding, rank: int, region: str) -> str:
    empty = next(r for r, pruned in enumerate(holding.pruned) if region in pruned)
    return (
        f"rank {rank} passes no dict at {region or '<root>'!r} where rank {empty} passes "
        "an empty one: a rank may pass {} only where other ranks pass a dict "
        "(docs/DIST_API.md)"
    )
