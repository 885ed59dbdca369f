"""Every global tensor box of a generation as columns: grouped, deduplicated and
checked without a Python object per box.

A 1,024-rank job saving 1,024 tensors has a million boxes. Building a
``TensorEntry`` for each costs about 3 µs, and the coordinator's checks
before a publish, like every restoring rank's planning, would spend seconds
on objects they mostly never look at. :class:`BoxTable` reads the decoded
shards' tables (castore.format.objects.EntryTable) as arrays: it groups the
boxes by tensor, counts identical boxes of replicas once (their digests
compared column-wise), checks each tensor's boxes for agreement and coverage
(castore.format.coverage), and builds entries only for the boxes a caller
asks for (:meth:`BoxTable.overlapping`), or for a whole tensor on indexing.

Anything unusual (a disagreement, an overlap, a gap, a conflict between
replicas, coordinates past 2^62, shards without a table) is handed to the
per-entry path in castore.core.reading, which raises what it always raised
or gives the same grouping: this module is a fast path, never a second
judge.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from castore.core.boxindex import SortedBoxes
from castore.format.coverage import SAFE_COORDINATE, overlapping_pair
from castore.format.layout import Box
from castore.format.objects import ShardManifest, TableShard, TensorEntry


class _Unusual(Exception):
    """The fast path declines: the per-entry path decides (and names what is wrong)."""


class BoxTable(Mapping[str, list[TensorEntry]]):
    """name -> the distinct boxes of each global tensor, in the order the shards list
    them (as castore.core.reading.group_entries gives), built only when indexed."""

    def __init__(self, shards: Sequence[ShardManifest]) -> None:
        tables = [s.table for s in shards if isinstance(s, TableShard)]
        if len(tables) != len(shards):
            raise _Unusual("a shard without a table")
        self._shards = list(shards)
        counts = np.array([len(t) for t in tables], dtype=np.int64)
        total = int(counts.sum())
        ids: dict[str, int] = {}
        name_id = _numbered([t.names for t in tables], ids, total)
        self._names = list(ids)
        dtype_id = _numbered([t.dtypes for t in tables], {}, total)
        ndim = np.concatenate([t.ndim for t in tables]).astype(np.int64) if total else counts[:0]
        width = int(ndim.max()) if total else 0
        # Each entry's shape, offsets and box sizes as rows padded with zeros.
        flat = [np.concatenate([t.dims[k] for t in tables]) for k in range(3)] if total else []
        padded = [np.zeros((total, width), dtype=np.int64) for _ in range(3)]
        if total and width:
            owner = np.repeat(np.arange(total), ndim)
            dim_start = np.zeros(total + 1, dtype=np.int64)
            np.cumsum(ndim, out=dim_start[1:])
            position = np.arange(len(owner)) - dim_start[owner]
            for k in range(3):
                padded[k][owner, position] = flat[k]
            if int(flat[0].max()) >= SAFE_COORDINATE:
                raise _Unusual("coordinates past 2^62")
        self._shape, self._offsets, self._local = padded
        self._ndim, self._dtype_id = ndim, dtype_id
        # Where each entry lives: its shard and its row there; its digests in `_digests`.
        self._shard_of = np.repeat(np.arange(len(tables)), counts)
        self._row = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        base = np.cumsum([0] + [int(t.chunk_start[-1]) for t in tables])
        self._chunk_lo = np.concatenate(
            [t.chunk_start[:-1] + base[i] for i, t in enumerate(tables)] or [counts[:0]]
        )
        self._chunk_hi = np.concatenate(
            [t.chunk_start[1:] + base[i] for i, t in enumerate(tables)] or [counts[:0]]
        )
        self._tables = tables
        kept = self._distinct(name_id)
        # The distinct boxes grouped by tensor, each tensor's in shard order.
        order = kept[np.lexsort((kept, name_id[kept]))]
        groups = name_id[order]
        cuts = np.flatnonzero(np.diff(groups)) + 1
        self._order = order
        self._bounds = np.concatenate(([0], cuts, [len(order)])).astype(np.int64)
        self._built: dict[str, list[TensorEntry]] = {}
        self._entries: dict[int, TensorEntry] = {}  # built one at a time, by row
        self._indexes: dict[str, tuple[np.ndarray, SortedBoxes]] = {}

    # -- grouping --------------------------------------------------------------

    def _distinct(self, name_id: np.ndarray) -> np.ndarray:
        """The entries left when identical boxes (same tensor, offsets and box sizes)
        count once, the first listed kept; _Unusual where such boxes name other bytes."""
        total = len(name_id)
        if not total:
            return np.arange(0)
        keys = [np.arange(total)]
        keys += [self._local[:, d] for d in reversed(range(self._local.shape[1]))]
        keys += [self._offsets[:, d] for d in reversed(range(self._offsets.shape[1]))]
        keys += [self._ndim, name_id]
        order = np.lexsort(keys)
        same = np.ones(total, dtype=bool)
        same[0] = False
        for column in (name_id, self._ndim, *self._offsets.T, *self._local.T):
            ranked = column[order]
            same[1:] &= ranked[1:] == ranked[:-1]
        if not same.any():
            return np.arange(total)
        # Each repeat's first: the nearest earlier position that starts a run.
        starts = np.where(~same, np.arange(total), 0)
        first = order[np.maximum.accumulate(starts)]
        repeat = order[same]
        original = first[same]
        if (self._dtype_id[repeat] != self._dtype_id[original]).any():
            raise _Unusual("replicas of a box disagree on its dtype")
        self._same_digests(repeat, original)
        keep = np.ones(total, dtype=bool)
        keep[repeat] = False
        return np.flatnonzero(keep)

    def _same_digests(self, a: np.ndarray, b: np.ndarray) -> None:
        counts = self._chunk_hi[a] - self._chunk_lo[a]
        if (counts != self._chunk_hi[b] - self._chunk_lo[b]).any():
            raise _Unusual("replicas of a box list different chunks")
        digests = self._digests()
        steps = np.repeat(np.cumsum(counts) - counts, counts)
        within = np.arange(int(counts.sum())) - steps
        left = np.repeat(self._chunk_lo[a], counts) + within
        right = np.repeat(self._chunk_lo[b], counts) + within
        if (digests[left] != digests[right]).any():
            raise _Unusual("replicas of a box list different chunks")

    def _digests(self) -> np.ndarray:
        raw = b"".join(t.chunk_bytes for t in self._tables)
        return np.frombuffer(raw, dtype=np.uint64).reshape(-1, 4)

    # -- checks ----------------------------------------------------------------

    def check(self) -> bool:
        """Whether every tensor's boxes agree on its dtype and shape and cover it exactly
        once (as castore.core.reading.check_coverage says of each)."""
        try:
            self._check()
        except _Unusual:
            return False
        return True

    def _check(self) -> None:
        order, bounds = self._order, self._bounds
        if not len(order):
            return
        first = np.repeat(order[bounds[:-1]], np.diff(bounds))
        shape = self._shape[order]
        if (
            (self._dtype_id[order] != self._dtype_id[first]).any()
            or (self._ndim[order] != self._ndim[first]).any()
            or (shape != self._shape[first]).any()
        ):
            raise _Unusual("boxes of a tensor disagree")
        lo_all, size_all = self._offsets[order], self._local[order]
        for t in range(len(bounds) - 1):
            a, b = int(bounds[t]), int(bounds[t + 1])
            dims = int(self._ndim[order[a]])
            lo = np.ascontiguousarray(lo_all[a:b, :dims].T)
            size = size_all[a:b, :dims].T
            if overlapping_pair(lo, lo + size) is not None:
                raise _Unusual("boxes of a tensor overlap")
            whole = math.prod(shape[a, :dims].tolist())
            if dims and float(np.prod(size.max(axis=1), dtype=np.float64)) * (b - a) >= (
                SAFE_COORDINATE
            ):
                raise _Unusual("element counts past int64")
            covered = int(size.prod(axis=0).sum()) if dims else b - a
            if covered != whole:
                raise _Unusual("boxes of a tensor leave a gap")

    # -- the mapping -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._slot

    @property
    def _slot(self) -> dict[str, int]:
        slot: dict[str, int] | None = self.__dict__.get("_slots")
        if slot is None:
            slot = self.__dict__["_slots"] = {n: i for i, n in enumerate(self._names)}
        return slot

    def __getitem__(self, name: str) -> list[TensorEntry]:
        built = self._built.get(name)
        if built is None:
            t = self._slot[name]  # KeyError: no such tensor
            rows = self._order[self._bounds[t] : self._bounds[t + 1]]
            built = self._built[name] = [self._entry(int(i)) for i in rows]
        return built

    def _entry(self, i: int) -> TensorEntry:
        entry = self._entries.get(i)
        if entry is None:
            at, row = int(self._shard_of[i]), int(self._row[i])
            ready = self._shards[at].__dict__.get("_tensors")
            entry = ready[row] if ready is not None else self._tables[at].entry_at(row)
            self._entries[i] = entry
        return entry

    def items(self) -> Any:
        self._build_all()
        return super().items()

    def values(self) -> Any:
        self._build_all()
        return super().values()

    def _build_all(self) -> None:
        """Every tensor's entries, through each shard's table at once (faster than one
        entry at a time when all of them are wanted)."""
        if len(self._built) == len(self._names):
            return
        every = [s.tensors for s in self._shards]
        shard_of, row = self._shard_of.tolist(), self._row.tolist()
        for t, name in enumerate(self._names):
            if name not in self._built:
                rows = self._order[self._bounds[t] : self._bounds[t + 1]].tolist()
                self._built[name] = [every[shard_of[i]][row[i]] for i in rows]

    def whole_tensors(self, max_chunks: int) -> list[TensorEntry]:
        """The entries of the tensors that one box holds whole, in at most ``max_chunks``
        chunks (replicated values), built alone."""
        order, bounds = self._order, self._bounds
        single = np.flatnonzero(np.diff(bounds) == 1)
        rows = order[bounds[single]]
        whole = (self._local[rows] == self._shape[rows]).all(axis=1)
        small = self._chunk_hi[rows] - self._chunk_lo[rows] <= max_chunks
        return [self._entry(int(i)) for i in rows[whole & small]]

    # -- a restoring rank's view ---------------------------------------------------

    def first(self, name: str) -> TensorEntry:
        """The first listed box of tensor ``name`` (KeyError: none)."""
        t = self._slot[name]
        return self._entry(int(self._order[self._bounds[t]]))

    def agree(self, name: str) -> bool:
        """Whether every box of ``name`` has the first's dtype and shape."""
        rows = self._rows(name)
        if len(rows) == 1:
            return True
        head = rows[0]
        return bool(
            (self._dtype_id[rows] == self._dtype_id[head]).all()
            and (self._ndim[rows] == self._ndim[head]).all()
            and (self._shape[rows] == self._shape[head]).all()
        )

    def _rows(self, name: str) -> np.ndarray:
        t = self._slot[name]
        return self._order[self._bounds[t] : self._bounds[t + 1]]

    def overlapping(self, name: str, region: Box) -> list[TensorEntry]:
        """The boxes of ``name`` that share an element with ``region`` (what
        castore.core.boxindex.BoxIndex.overlapping finds), built alone."""
        index = self._indexes.get(name)
        if index is None:
            rows = self._rows(name)
            dims = int(self._ndim[rows[0]])
            index = self._indexes[name] = (
                rows,
                SortedBoxes(self._offsets[rows, :dims], self._local[rows, :dims]),
            )
        rows, boxes = index
        return [self._entry(int(rows[i])) for i in boxes.overlapping(region)]


def _numbered(columns: list[list[str]], ids: dict[str, int], total: int) -> np.ndarray:
    """Each string of the columns as the order it was first seen in (``ids`` filled).
    A column equal to the one before (every FSDP rank names the same tensors) takes
    its numbers without a lookup per string."""
    out = np.empty(total, dtype=np.int64)
    at, before = 0, None
    numbers = out[:0]
    for column in columns:
        if column != before:
            numbers = np.fromiter(
                (ids.setdefault(v, len(ids)) for v in column), np.int64, len(column)
            )
            before = column
        out[at : at + len(column)] = numbers
        at += len(column)
    return out


def box_table(shards: Sequence[ShardManifest]) -> BoxTable | None:
    """The shards' boxes as a :class:`BoxTable`, or None where the per-entry path must
    decide (shards without a table, replicas that disagree, huge coordinates)."""
    try:
        return BoxTable(shards)
    except _Unusual:
        return None
