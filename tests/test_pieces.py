"""Chunk pieces: a read of part of a chunk reads and verifies only the 64 KiB pieces it needs.

The chaining values come from castore.format._b3tree (the BLAKE3 team's C code); they are
checked here against the blake3 package's digests, and every read path against a
real LMDB store, with damage written into the pack on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import blake3
import msgpack
import numpy as np
import pytest
import torch

import castore
from castore.chunkstore.base import Namespace
from castore.core import chunkread
from castore.errors import ChecksumMismatchError
from castore.format import pieces
from castore.format.objects import TensorEntry
from castore.testing.corrupt import flipped, raw_put

# `make test` builds the extension and says so: there it must be importable, so that a
# failed build cannot pass unnoticed as skipped tests.
if os.environ.get("CASTORE_EXPECT_B3TREE") == "1":
    assert pieces.AVAILABLE, "castore.format._b3tree was not built (see setup.py)"
needs_extension = pytest.mark.skipif(not pieces.AVAILABLE, reason="no castore.format._b3tree")

P = pieces.PIECE
# float32: 3.5 MiB, under the 4 MiB the grid cuts: one chunk of 56 pieces of 16 rows
# (docs/FORMAT.md, "The writer's grid").
ROWS, COLS = 896, 1024
ROW = COLS * 4


def _data(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@needs_extension
@pytest.mark.parametrize(
    "length", [P + 1, 2 * P, 2 * P + 1, 3 * P - 5, P + 1024, P + 1023, 1_000_000, 4 << 20]
)
def test_pieces_merge_to_the_blake3_digest(length: int) -> None:
    from castore.format import _b3tree

    data = _data(length, length)
    digest, cvs = _b3tree.tree(data)
    assert digest == blake3.blake3(data).digest()
    assert len(cvs) == 32 * pieces.piece_count(length)
    assert _b3tree.root(cvs) == digest
    for first in range(pieces.piece_count(length)):  # any run of pieces, from any piece on
        assert _b3tree.piece_cvs(data[first * P :], first) == cvs[first * 32 :]
        assert pieces.pieces_match(cvs, data[first * P : (first + 1) * P], first * P)
    # Control: one flipped byte changes its piece's value, and no other.
    damaged = flipped(data, length // 2)
    piece = (length // 2) // P
    assert not pieces.pieces_match(cvs, damaged[piece * P : (piece + 1) * P], piece * P)
    assert _b3tree.root(_b3tree.tree(damaged)[1]) != digest


def test_short_chunks_record_no_pieces() -> None:
    assert pieces.piece_count(P) == 0
    data = _data(P)
    digest, cvs = pieces.hash_chunk(data)
    assert digest == blake3.blake3(data).digest() and cvs == b""


# -- a store ------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> tuple[castore.Store, np.ndarray]:
    store = castore.open(tmp_path / "store", create=True)
    weights = np.random.default_rng(1).standard_normal((ROWS, COLS), dtype=np.float32)
    store.save({"w": weights, "b": np.arange(10, dtype=np.int64)}, run="r", step=1)
    return store, weights


def _entry(store: castore.Store, name: str = "w") -> TensorEntry:
    _, root = store.resolve_root("r", "latest")
    return store.tensor_entries(root)[name][0]


def _sliced(store: castore.Store, index: Any) -> tuple[np.ndarray, int]:
    before = store.read_counters.bytes
    result = store.read_slice("r", "latest", "w", index)
    return result, store.read_counters.bytes - before


@needs_extension
def test_a_save_records_every_chunks_pieces(saved: tuple[castore.Store, np.ndarray]) -> None:
    store, weights = saved
    entry = _entry(store)
    assert len(entry.chunks) == 1
    assert len(entry.pieces) == 56 * 32
    for index, key in enumerate(entry.chunks):
        cvs = pieces.chunk_cvs(entry, index)
        assert cvs is not None and pieces.names_chunk(cvs, key)
    assert _entry(store, "b").pieces == b""  # 80 bytes: one piece, nothing recorded
    # On the wire: a shard field beside the table, one value per entry.
    _, root = store.resolve_root("r", "latest")
    raw = store.backend.get(Namespace.OBJECTS, root.shards[0])
    wire = msgpack.unpackb(raw, raw=False)
    assert sorted(map(len, wire["pieces"])) == [0, len(entry.pieces)]


@needs_extension
@pytest.mark.parametrize(
    "rows", [(100, 700), (300, 301), (0, 1), (16, 32), (15, 17), (880, 896), (0, 896)]
)
def test_a_row_range_reads_little_more_than_it_needs(
    saved: tuple[castore.Store, np.ndarray], rows: tuple[int, int]
) -> None:
    store, weights = saved
    start, stop = rows
    result, read = _sliced(store, np.s_[start:stop])
    assert np.array_equal(result, weights[start:stop])
    needed = (stop - start) * ROW
    # At most one partial piece at each end of each chunk the range touches.
    assert needed <= read <= needed + 2 * P
    if needed >= 16 * P:
        assert read / needed <= 1.1


@needs_extension
def test_a_column_slice_still_reads_what_its_rows_span(
    saved: tuple[castore.Store, np.ndarray],
) -> None:
    store, weights = saved
    result, read = _sliced(store, np.s_[10:20, 100:200])
    assert np.array_equal(result, weights[10:20, 100:200])
    assert read <= 2 * P  # rows 10..19 lie in the first piece (and the next)


def _damage(store: castore.Store, at: int) -> None:
    """Flip byte ``at`` of the tensor's buffer in its pack on disk."""
    entry = _entry(store)
    index = 0
    key = entry.chunks[index]
    value = store.backend.get(Namespace.CHUNKS, key)
    assert value is not None
    raw_put(store, Namespace.CHUNKS, key, flipped(value, at - entry.chunk_start(index)))


@needs_extension
def test_damage_inside_the_pieces_read_is_refused(
    saved: tuple[castore.Store, np.ndarray],
) -> None:
    store, _ = saved
    _damage(store, 200 * ROW + 7)
    with pytest.raises(ChecksumMismatchError, match="chunk 0 of tensor 'w' is damaged"):
        store.read_slice("r", "latest", "w", np.s_[150:250])
    with pytest.raises(ChecksumMismatchError):
        store.load("r", "latest")


@needs_extension
def test_damage_outside_the_pieces_read_is_not_read(
    saved: tuple[castore.Store, np.ndarray],
) -> None:
    store, weights = saved
    _damage(store, 800 * ROW)  # far from rows 100..199, in the same chunk
    result, read = _sliced(store, np.s_[100:200])
    assert np.array_equal(result, weights[100:200]) and read < 8 * P
    with pytest.raises(ChecksumMismatchError):  # a whole read still finds it
        store.read_slice("r", "latest", "w", np.s_[0:896])


@needs_extension
def test_broken_control_without_the_piece_check_damage_reaches_the_caller(
    saved: tuple[castore.Store, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, weights = saved
    _damage(store, 200 * ROW + 7)
    monkeypatch.setattr(chunkread, "pieces_match", lambda cvs, data, start: True)
    result, _ = _sliced(store, np.s_[150:250])
    assert not np.array_equal(result, weights[150:250])  # the check above is what stops it


@needs_extension
def test_pieces_that_do_not_name_their_chunk_are_not_used(
    saved: tuple[castore.Store, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, weights = saved
    bogus = bytes(len(_entry(store).pieces))
    entry = _entry(store)
    forged = TensorEntry.trusted(
        entry.name, entry.dtype, entry.shape, entry.offsets, entry.local_shape, entry.nbytes,
        entry.chunk_size, entry.chunks, entry.framework, entry.cell, bogus,
    )  # fmt: skip
    out = np.empty((100, COLS), dtype=np.float32)
    flat = out.reshape(-1).view(np.uint8)
    from castore.core.reading import box_requests
    from castore.format.layout import Box

    requests = box_requests(forged, Box((100, 0), (100, COLS)), Box((100, 0), (100, COLS)), flat)
    counters = chunkread.ReadCounters()
    chunkread.read_requests(store.backend, requests, counters, {})
    assert np.array_equal(out, weights[100:200])
    assert counters.bytes == ROWS * ROW  # verified whole: the recorded values were not used


@needs_extension
def test_saves_that_trust_versions_and_async_saves_record_pieces(tmp_path: Path) -> None:
    store = castore.open(tmp_path / "store", create=True)
    weights = torch.randn(ROWS, COLS)
    store.save({"w": weights}, run="r", step=1, trust_versions=True)
    first = _entry(store).pieces
    store.save({"w": weights}, run="r", step=2, trust_versions=True)  # nothing hashed
    assert _entry(store).pieces == first and first
    weights[5, 5] += 1  # a torch op: version counter moves
    store.save({"w": weights}, run="r", step=3, blocking=False).wait()
    entry = _entry(store)
    assert len(entry.pieces) == len(first) and entry.pieces != first
    result, read = _sliced(store, np.s_[0:10])
    assert np.array_equal(result, weights[0:10].numpy()) and read == P


def test_a_store_saved_without_pieces_reads_whole_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pieces, "_b3tree", None)  # as a castore built without the extension
    store = castore.open(tmp_path / "store", create=True)
    weights = np.random.default_rng(2).standard_normal((ROWS, COLS), dtype=np.float32)
    store.save({"w": weights}, run="r", step=1)
    monkeypatch.undo()
    assert _entry(store).pieces == b""
    result, read = _sliced(store, np.s_[100:200])
    assert np.array_equal(result, weights[100:200]) and read == ROWS * ROW


@needs_extension
def test_branch_and_amend_keep_pieces_and_a_replace_records_new_ones(
    saved: tuple[castore.Store, np.ndarray],
) -> None:
    store, weights = saved
    first = _entry(store).pieces
    castore.branch(store, "r", "latest", "twin")
    castore.amend(store, "r", rename=[("w", "v")])
    _, root = store.resolve_root("twin", "latest")
    assert store.tensor_entries(root)["w"][0].pieces == first
    _, root = store.resolve_root("r", "latest")
    assert store.tensor_entries(root)["v"][0].pieces == first
    changed = weights.copy()
    changed[300] += 1
    castore.amend(store, "r", replace={"v": changed})
    _, root = store.resolve_root("r", "latest")
    entry = store.tensor_entries(root)["v"][0]
    assert entry.pieces != first and len(entry.pieces) == len(first)
    # Only the changed row's piece differs: the others are the same bytes at the same place.
    differ = [i for i in range(0, len(first), 32) if entry.pieces[i : i + 32] != first[i : i + 32]]
    assert differ == [(300 * ROW // P) * 32]
    before = store.read_counters.bytes
    rows = store.read_slice("r", "latest", "v", np.s_[290:310])
    assert np.array_equal(rows, changed[290:310])
    assert store.read_counters.bytes - before == 2 * P  # rows 290..309 straddle two pieces


@needs_extension
@pytest.mark.slow
def test_a_resharding_restore_reads_only_the_pieces_of_its_rows(
    saved: tuple[castore.Store, np.ndarray],
) -> None:
    from dist_harness import describe, run_ranks
    from pieces_workers import restore_rows

    store, weights = saved
    path = str(store.path)
    store.close()
    outcomes = run_ranks(2, restore_rows, path, timeout=150)
    assert all(o.ok for o in outcomes), describe(outcomes)
    for rank, outcome in enumerate(outcomes):
        got = outcome.value
        band = ROWS // 2
        assert np.array_equal(got["block"], weights[rank * band : (rank + 1) * band])
        # 448 rows of 4 KiB: exactly 28 pieces each, the one chunk read half by each rank.
        assert got["bytes_needed"] == band * ROW == got["bytes_read"]
