"""castore.core.boxtable: a generation's boxes grouped and checked as columns.

Property tests against the per-entry path (castore.core.reading's
``group_entries`` and ``check_coverage``): on random shard sets (tilings, with
replicas of some boxes, overlaps, gaps, disagreeing shapes and dtypes, replicas
naming other bytes, 0-d tensors) the column-wise grouping gives the same boxes
in the same order, ``checked_entries`` refuses exactly what the per-entry path
refuses, with its message, and a restoring rank's ``overlapping`` finds exactly
the boxes a scan finds. Entries are built only for what is asked for. The
broken control: a table that skips the replicas' digest comparison accepts two
replicas naming different bytes, which the per-entry path refuses.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from castore.core import boxtable
from castore.core.boxtable import BoxTable, box_table
from castore.core.reading import check_coverage, checked_entries, group_entries
from castore.errors import CoverageError
from castore.format.layout import Box
from castore.format.objects import (
    ShardManifest,
    TableShard,
    TensorEntry,
    decode_object,
    encode_object,
)

WHERE = {"run": "r", "generation": 1}


def entry(name: str, shape: tuple[int, ...], box: Box, *, dtype: str = "float32",
          salt: int = 0) -> TensorEntry:  # fmt: skip
    nbytes = box.numel * 4 if dtype == "float32" else box.numel * 2
    count = -(-nbytes // 64)
    chunks = tuple(bytes([salt % 256, i % 256]) + bytes(30) for i in range(count))
    return TensorEntry(name, dtype, shape, box.offsets, box.shape, nbytes, 64, chunks, "torch")


def decoded(shards: list[list[TensorEntry]]) -> list[ShardManifest]:
    """The shards as the coordinator reads them: encoded, then decoded from bytes."""
    out = []
    for rank, entries in enumerate(shards):
        data = encode_object(ShardManifest("r", 1, rank, tuple(entries)))
        shard = decode_object(data)
        assert isinstance(shard, TableShard)
        out.append(shard)
    return out


def cuts(draw: Any, size: int, pieces: int) -> list[int]:
    inner = sorted(draw(st.lists(st.integers(0, size), min_size=pieces - 1, max_size=pieces - 1)))
    return [0, *inner, size]


@st.composite
def tiling(draw: Any) -> tuple[tuple[int, ...], list[Box]]:
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    per_dim = [cuts(draw, size, draw(st.integers(1, 4))) for size in shape]
    boxes = [
        Box(tuple(c[i] for c, i in zip(per_dim, at, strict=True)),
            tuple(c[i + 1] - c[i] for c, i in zip(per_dim, at, strict=True)))
        for at in itertools.product(*(range(len(c) - 1) for c in per_dim))
    ]  # fmt: skip
    return shape, boxes


@st.composite
def shard_sets(draw: Any) -> list[list[TensorEntry]]:
    """2-5 ranks saving 1-4 tensors: each tensor tiled, its boxes dealt to ranks (some
    given to two ranks: replicas), then at most one fault."""
    ranks = draw(st.integers(2, 5))
    shards: list[list[TensorEntry]] = [[] for _ in range(ranks)]
    for t in range(draw(st.integers(1, 4))):
        shape, boxes = draw(tiling())
        for box in boxes:
            holders = draw(st.sets(st.integers(0, ranks - 1), min_size=1, max_size=2))
            for rank in sorted(holders):
                shards[rank].append(entry(f"t{t}", shape, box))
    fault = draw(st.sampled_from(["none", "drop", "copy", "shape", "dtype", "bytes", "move"]))
    every = [(r, i) for r, s in enumerate(shards) for i in range(len(s))]
    if fault == "none" or not every:
        return shards
    rank, i = draw(st.sampled_from(every))
    e = shards[rank][i]
    box = Box(e.offsets, e.local_shape)
    if fault == "drop":
        del shards[rank][i]
    elif fault == "copy":  # another rank repeats a box, with other bytes or the same
        other = (rank + 1) % ranks
        shards[other].append(entry(e.name, e.shape, box, salt=draw(st.integers(0, 1))))
    elif fault == "shape":
        shards[rank][i] = entry(e.name, (*e.shape, 1), Box((*e.offsets, 0), (*e.local_shape, 1)))
    elif fault == "dtype":
        shards[rank][i] = entry(e.name, e.shape, box, dtype="float16")
    elif fault == "bytes":
        shards[rank][i] = entry(e.name, e.shape, box, salt=7)
    elif fault == "move" and e.shape:
        shift = tuple(min(o + 1, s - n) for o, s, n in zip(e.offsets, e.shape, e.local_shape,
                                                           strict=True))  # fmt: skip
        shards[rank][i] = entry(e.name, e.shape, Box(shift, e.local_shape))
    return shards


def per_entry(shards: list[ShardManifest]) -> tuple[dict[str, list[TensorEntry]] | None, str]:
    """What the per-entry path gives: the grouping and the refusal, if any."""
    try:
        entries = group_entries(shards, WHERE)
        for boxes in entries.values():
            check_coverage(boxes, WHERE)
    except CoverageError as exc:
        return None, str(exc)
    return entries, ""


@settings(max_examples=400, deadline=None)
@given(shard_sets())
def test_the_columns_group_and_refuse_exactly_as_the_per_entry_path(
    shards: list[list[TensorEntry]],
) -> None:
    made = decoded(shards)
    expected, refusal = per_entry(decoded(shards))
    try:
        got = checked_entries(made, WHERE)
    except CoverageError as exc:
        assert str(exc) == refusal
        return
    assert expected is not None, f"accepted what the per-entry path refuses: {refusal}"
    assert list(got) == list(expected)
    for name in expected:
        assert got[name] == expected[name]
    table = box_table(decoded(shards))
    if table is not None:  # replicas agreed: the grouping alone is the same too
        assert {n: table[n] for n in table} == expected


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_rank_finds_exactly_the_boxes_a_scan_finds(data: Any) -> None:
    shape, boxes = data.draw(tiling())
    shards = [[entry("w", shape, b) for b in boxes[r::3]] for r in range(3)]
    table = box_table(decoded(shards))
    assert isinstance(table, BoxTable) and table.check()
    for _ in range(3):
        lo = [data.draw(st.integers(0, n)) for n in shape]
        hi = [data.draw(st.integers(a, n)) for a, n in zip(lo, shape, strict=True)]
        region = Box(tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True)))
        found = table.overlapping("w", region)
        scan = []
        for e in table["w"]:
            part = region.intersect(Box(e.offsets, e.local_shape))
            if part is not None and part.numel:
                scan.append(e)
        assert sorted(found, key=repr) == sorted(scan, key=repr)


def test_entries_are_built_only_for_what_is_asked() -> None:
    """64 ranks x 32 tensors: planning one target builds one entry, not 2,048."""
    shards = [[entry(f"t{t}", (64, 8), Box((r, 0), (1, 8))) for t in range(32)] for r in range(64)]
    made = decoded(shards)
    table = box_table(made)
    assert table is not None and table.check()
    assert table.overlapping("t5", Box((10, 0), (1, 8)))[0].offsets == (10, 0)
    assert table.first("t7").offsets == (0, 0)
    assert not any("_tensors" in s.__dict__ for s in made)  # no shard built its entries
    assert len(table["t3"]) == 64  # a whole tensor, on asking
    assert sum(len(v) for v in table.values()) == 64 * 32


def test_a_huge_coordinate_takes_the_per_entry_path() -> None:
    big = 1 << 62  # rows past 2^62 (of no columns: no bytes)
    boxes = [Box((0, 0), (big, 0)), Box((big, 0), (8, 0))]
    shards = [[entry("t", (big + 8, 0), box)] for box in boxes]
    made = decoded(shards)
    assert box_table(made) is None
    assert [e.offsets for e in checked_entries(made, WHERE)["t"]] == [(0, 0), (big, 0)]


def test_broken_control_skipping_the_replicas_digests_accepts_other_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    box = Box((0, 0), (4, 4))
    shards = [[entry("t", (4, 4), box)], [entry("t", (4, 4), box, salt=3)]]
    with pytest.raises(CoverageError, match="two ranks saved different bytes"):
        checked_entries(decoded(shards), WHERE)
    monkeypatch.setattr(boxtable.BoxTable, "_same_digests", lambda self, a, b: None)
    assert box_table(decoded(shards)) is not None  # the broken table takes them
    assert checked_entries(decoded(shards), WHERE)["t"][0].chunks[0][0] == 0


# -- a restoring rank's plan at a simulated 1,024 ranks ------------------------------------


def test_planning_at_1024_ranks_reads_two_manifests_onto_the_saved_layout() -> None:
    """1,024 synthetic manifests (each rank 2 rows of 4 tensors), encoded as a writer
    encodes them: a rank restoring onto the saved layout decodes its own manifest and
    rank 0's and plans each target from its own box; planned as another layout (4 rows
    a target, straddling two ranks' boxes) it decodes all 1,024 and finds both sources."""
    from castore.core.commit import make_root
    from castore.dist import planning
    from castore.format.shard import Shard
    from castore.format.tree import encode_state

    ranks, names = 1024, [f"t{t}" for t in range(4)]
    shape = (2 * ranks, 8)
    encoded = [
        encode_object(
            ShardManifest("r", 1, r, tuple(entry(n, shape, Box((2 * r, 0), (2, 8))) for n in names))
        )
        for r in range(ranks)
    ]
    skeleton = encode_state({n: np.empty((0,), np.float32) for n in names}).skeleton
    root = make_root(
        run="r", generation=1, step=1, parent=None, world_size=ranks,
        shards=[bytes(32)] * ranks, state=skeleton, metadata=b"", stats={},
        frameworks={}, writer={},
    )  # fmt: skip

    class Lazy(list):  # the manifests, decoded when first indexed, counted
        def __init__(self) -> None:
            super().__init__([None] * ranks)
            self.read = 0

        def __getitem__(self, i: Any) -> Any:
            if isinstance(i, slice):
                return [self[j] for j in range(ranks)[i]]
            if list.__getitem__(self, i) is None:
                self.read += 1
                list.__setitem__(self, i, decode_object(encoded[i]))
            return list.__getitem__(self, i)

        def __iter__(self) -> Any:
            return (self[i] for i in range(ranks))

    rank = 700
    local = np.empty((2, 8), np.float32)
    own = [(n, Shard(local, shape, (2 * rank, 0))) for n in names]
    shards = Lazy()
    found, wanted = planning.plan_restore(
        shards, root, own, WHERE, direct=planning.direct_shards(shards, rank)
    )
    assert shards.read == 2
    assert [[e.offsets for e in t.sources or []] for t in wanted] == [[(1400, 0)]] * 4
    assert planning.resharded(wanted, found) == 0
    wide = np.empty((4, 8), np.float32)
    other = [(n, Shard(wide, shape, (2 * rank + 1, 0))) for n in names]  # rows 1401-1404
    shards = Lazy()
    found, wanted = planning.plan_restore(
        shards, root, other, WHERE, direct=planning.direct_shards(shards, rank)
    )
    assert shards.read == ranks  # the direct plan declined: every manifest read
    assert [sorted(e.offsets for e in t.sources or []) for t in wanted] == [
        [(1400, 0), (1402, 0), (1404, 0)]
    ] * 4
    assert planning.resharded(wanted, found) == 4
