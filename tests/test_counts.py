"""castore counts itself: collectives (castore.dist.comm), blob requests
(castore.blob.counting) and objects read (castore.core.reading).

Each counter must move by exactly what a known call costs: the scale model
(benchmarks/bench_tiers_scale.py, docs/SCALE.md "A model of scale") is
checked against these counts.
"""

from __future__ import annotations

from pathlib import Path

import count_workers as w
import numpy as np
import pytest
from dist_harness import run_ranks

import castore
from castore.blob.counting import BlobRequests, CountingBlobStore
from castore.blob.memory import MemoryBlobStore
from castore.core.reading import object_reads
from castore.dist.comm import Group, collective_counts
from castore.format.hashing import Digest

# -- collectives ----------------------------------------------------------------------


@pytest.mark.slow
def test_each_collective_counts_its_call_and_the_bytes_each_rank_moved() -> None:
    outcomes = run_ranks(3, w.collectives_counted, timeout=120)
    assert all(o.ok for o in outcomes), [o.error_traceback for o in outcomes]
    spans = [o.value for o in outcomes]
    for rank, (gather, broadcast, exchange) in enumerate(spans):
        # all_gather: msgpack of b"x" * r is r + 2 bytes; every rank sends the longest
        # (rank 2's: 4), with the 8-byte length ahead, and receives the other two.
        assert gather["calls"] == {"all_gather": 1}
        assert gather["phases"] == {"test: gather": 1}
        assert (gather["sent"], gather["received"]) == (12, 24)
        # broadcast: 12 bytes of msgpack and the length; the source sends, the rest receive.
        assert broadcast["calls"] == {"broadcast": 1}
        moved = (20, 0) if rank == 0 else (0, 20)
        assert (broadcast["sent"], broadcast["received"]) == moved
        # exchange: its size table ({peer: length}: 3 bytes of msgpack) gathered like an
        # all_gather, then rank r sends r + 5 bytes to r + 1 and gets r - 1's.
        assert exchange["calls"] == {"exchange": 1}
        assert exchange["rounds"] == 1
        assert exchange["sent"] == 11 + rank + 5
        assert exchange["received"] == 22 + (rank - 1) % 3 + 5


def test_a_group_of_one_moves_nothing_and_is_not_counted() -> None:
    before = collective_counts()
    comm = Group(None, 0, 5.0)
    assert comm.solo
    assert comm.all_gather({"a": 1}, "test: solo") == [{"a": 1}]
    assert comm.broadcast("b", "test: solo") == "b"
    assert collective_counts() - before == collective_counts() - collective_counts()



@pytest.mark.slow
def test_a_one_node_tiered_restore_discovers_the_nodes_once(tmp_path: Path) -> None:
    # docs/SCALE.md's model: on one node a restore is "tiers: nodes", the root's
    # broadcast and the agreement (3 rounds). The restore used to discover the nodes
    # twice, once in castore.dist.load and again in agree_on_root (3 all_gathers).
    outcomes = run_ranks(2, w.one_node_restores_counted, str(tmp_path), timeout=120)
    assert all(o.ok for o in outcomes), [o.error_traceback for o in outcomes]
    for without, previous in (o.value for o in outcomes):
        assert without == {"tiers: nodes": 1, "load: resolve": 1, "load: agree": 1}
        assert previous == {"tiers: nodes": 1, "load: candidates": 1, "load: agree": 1}


@pytest.mark.slow
@pytest.mark.parametrize("control", [False, True])
def test_a_several_node_restore_of_the_newest_chooses_in_the_discovery_round(
    tmp_path: Path, control: bool
) -> None:
    # docs/SCALE.md's model: on several nodes the discovery round carries each node's
    # view of its fast tier, so a restore of the newest generation, whole in the fast
    # tiers, asks no "load: tiers" or "load: candidates" round and reads no durable
    # history; a fallback still takes the coordinator's choice over both tiers.
    # Control: with the discovery's choice disabled, the coordinator's rounds return.
    outcomes = run_ranks(2, w.several_node_restores_counted, str(tmp_path), control, timeout=120)
    assert all(o.ok for o in outcomes), [o.error_traceback for o in outcomes]
    for rank, ((newest, newest_reads), (previous, previous_reads)) in enumerate(
        o.value for o in outcomes
    ):
        if control:
            assert newest == previous
            assert newest["load: candidates"] == 1
            assert newest_reads == (1 if rank == 0 else 0)
        else:
            assert newest == {"tiers: nodes": 1, "load: chunks wanted": 1, "load: agree": 1}
            assert newest_reads == 0
        assert previous == {
            "tiers: nodes": 1,
            "load: candidates": 1,
            "load: chunks wanted": 1,
            "load: agree": 1,
        }
        assert previous_reads == (1 if rank == 0 else 0)  # the coordinator's, for fallbacks


# -- blob requests ----------------------------------------------------------------------


def test_each_blob_primitive_counts_one_request_under_its_area() -> None:
    blobs = CountingBlobStore(MemoryBlobStore())
    blobs.create("objects/ab/one", b"12345")
    blobs.create("objects/ab/two", [b"12", b"345678"])  # pieces counted as they pass
    version = blobs.swap("refs/run", b"abc", None)
    assert blobs.get("objects/ab/one", 1, 3) == b"23"
    assert blobs.head("objects/ab/two") == 8
    assert blobs.read_versioned("refs/run") == (b"abc", version)
    assert blobs.read_versioned("refs/absent") is None
    assert list(blobs.list("objects/")) == ["objects/ab/one", "objects/ab/two"]
    assert list(blobs.list_sizes("objects/ab/t")) == [("objects/ab/two", 8)]
    assert blobs.delete("objects/ab/one")
    assert blobs.requests() == BlobRequests(
        {
            "create objects": 2,
            "swap refs": 1,
            "get objects": 1,
            "head objects": 1,
            "read_versioned refs": 2,
            "list objects": 2,
            "delete objects": 1,
        },
        listed=3,
        sent=5 + 8 + 3,
        fetched=2 + 3,
    )
    assert blobs.requests().calls["read_versioned"] == 2
    assert blobs.requests().total == 10


def test_a_span_of_requests_is_the_difference_of_two_snapshots() -> None:
    blobs = CountingBlobStore(MemoryBlobStore())
    blobs.create("a", b"xy")
    before = blobs.requests()
    blobs.get("a")
    assert blobs.requests() - before == BlobRequests({"get a": 1}, fetched=2)


def test_a_request_that_fails_is_counted_too() -> None:
    blobs = CountingBlobStore(MemoryBlobStore())
    with pytest.raises(castore.errors.BlobNotFoundError):
        blobs.get("objects/none")
    assert blobs.requests().requests == {"get objects": 1}


def test_a_shared_store_counts_its_requests_and_a_local_one_has_none(tmp_path: Path) -> None:
    with castore.open(tmp_path / "local") as local:
        local.save({"w": np.arange(8)}, run="r", step=1)
        assert local.blob_requests() == BlobRequests()
    with castore.open(tmp_path / "shared", shared=True) as shared:
        opened = shared.blob_requests()
        # A new store: no marker, nothing listed, the marker created and read back.
        assert opened.requests == {
            "read_versioned castore.json": 2,
            "list /": 1,
            "create castore.json": 1,
        }
        shared.save({"w": np.arange(8)}, run="r", step=1)
        saved = shared.blob_requests() - opened
        assert saved.requests["create objects"] == 2  # the shard manifest and the root
        assert saved.requests["swap refs"] == 1  # the commit point
        assert saved.requests["create packs"] == 1
        assert saved.sent > 64  # the chunk's bytes among them


# -- objects read ---------------------------------------------------------------------


def test_each_object_read_and_verified_is_counted_with_its_bytes(tmp_path: Path) -> None:
    with castore.open(tmp_path / "s") as store:
        generation = store.save({"w": np.arange(8)}, run="r", step=1)
        digest = Digest.from_hex(generation.root)
        before = object_reads()
        root = store.read_root(digest, run="r")
        store.read_shards(root)
        moved = object_reads() - before
        sizes = [len(store.backend.get(castore.chunkstore.base.Namespace.OBJECTS, key) or b"")
                 for key in [digest.raw, *root.shards]]  # fmt: skip
    assert (moved.objects, moved.bytes) == (2, sum(sizes))
