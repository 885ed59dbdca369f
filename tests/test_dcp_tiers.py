"""The DCP backend on a tiered store on several nodes: ``dcp.save`` / ``dcp.load`` with
castore.dcp's writer and reader, real gloo ranks, each pair of them a "node" with its own
fast tier (castore.tiers.nodes), the durable tier a shared directory.

Four ranks on two nodes save three generations (seeds 3, 4, 5) of two runs through
``dcp.save``: ``p``, plain tensors (DCP's planner gives each to one rank), and ``f``, an
FSDP2 model and its Adam state (every rank writes its blocks). Every second generation
is promoted. With ``replicas=2`` each node also holds the other's shards; with 1, only its
own. Then ``dcp.load`` reads them back bitwise: as saved, after a node is lost (its fast
directory deleted, its ranks restarted on an empty one), with a fast-tier chunk damaged,
and from the durable store alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import dcp_tier_workers as tw
import pytest
from dist_harness import run_ranks
from test_dcp import assert_same_state
from test_dist import script_results

import castore
from castore.chunkstore.base import Namespace
from castore.format.hashing import Digest
from castore.testing.corrupt import flipped
from castore.verify import verify_store

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dcp-tiers")]

SEEDS = {1: 3, 2: 4, 3: 5}  # generation id -> the seed its state was made with
RUNS = {"p": "plain", "f": "fsdp"}


def config(tmp: Path, replicas: int) -> dict[str, Any]:
    return {
        "nodes": [str(tmp / "fast0"), str(tmp / "fast1")],
        "durable": str(tmp / "durable"),
        "durable_every": 2,
        "chunk_size": 128,
        "replicas": replicas,
        "promote_on_exit": False,
        "uploader": "thread",
    }


def launch(tmp: Path | dict[str, Any], replicas: int, ops: list[dict[str, Any]]) -> list[Any]:
    tiers = tmp if isinstance(tmp, dict) else config(tmp, replicas)
    return script_results(run_ranks(4, tw.run_script, tiers, ops, timeout=300), 4)


def loads(**options: Any) -> list[dict[str, Any]]:
    return [{"op": "load", "run": run, "kind": kind, **options} for run, kind in RUNS.items()]


def save_three(tmp: Path, replicas: int) -> dict[str, Any]:
    """Three generations of each run, then a load of each; what was saved (by seed) and
    what each rank loaded."""
    castore.open(tmp / "durable", shared=True).close()
    ops = [
        {"op": "save", "run": run, "kind": kind, "seed": seed, "step": 10 * gen}
        for gen, seed in SEEDS.items()
        for run, kind in RUNS.items()
    ]
    results = launch(tmp, replicas, [*ops, *loads(), {"op": "wait_promotions"}])
    for rank in results:
        for op in rank[: len(ops)]:
            assert "error" not in op, op["error"]
        assert [op["generation"] for op in rank[: len(ops)]] == [1, 1, 2, 2, 3, 3]
    saved = {(op["run"], op["seed"]): results[0][i]["saved"] for i, op in enumerate(ops)}
    loaded = [rank[len(ops) : len(ops) + 2] for rank in results]
    return {"tmp": tmp, "saved": saved, "loaded": loaded}


@pytest.fixture(scope="module")
def two_copies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return save_three(tmp_path_factory.mktemp("dcp-f2"), 2)


@pytest.fixture(scope="module")
def one_copy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return save_three(tmp_path_factory.mktemp("dcp-f1"), 1)


def copy_of(saved: dict[str, Any], tmp: Path) -> Path:
    shutil.copytree(saved["tmp"], tmp / "job")
    return tmp / "job"


def assert_loaded(
    saved: dict[str, Any], per_rank: list[list[dict[str, Any]]], generation: int
) -> list[dict[str, dict[str, int]]]:
    """Every rank loaded ``generation`` of each run, bitwise as saved; the bytes each
    source served, per rank and run."""
    served = []
    for rank, results in enumerate(per_rank):
        for run, result in zip(RUNS, results, strict=True):
            assert "error" not in result, (rank, run, result["error"])
            assert result["generation"] == generation, (rank, run)
            want = saved["saved"][(run, SEEDS[generation])]
            assert_same_state(result["loaded"], want, f"{run}@{generation}, rank {rank}")
        served.append({run: r["sources"] for run, r in zip(RUNS, results, strict=True)})
    return served


# -- what the nodes hold ---------------------------------------------------------------


def test_dcp_save_on_two_nodes_loads_back_bitwise_from_the_fast_tiers(
    one_copy: dict[str, Any], two_copies: dict[str, Any]
) -> None:
    for saved in (one_copy, two_copies):
        served = assert_loaded(saved, saved["loaded"], 3)
        assert all("durable" not in s for rank in served for s in rank.values()), served
    # One copy: each node holds its own ranks' chunks, and its ranks read the others' from
    # the other node (plain tensors: DCP gives each to one rank, so every rank reads some).
    served = assert_loaded(one_copy, one_copy["loaded"], 3)
    assert all(rank["p"].get("peer", 0) > 0 for rank in served), served


def test_each_node_lists_every_generation_and_holds_its_shards(
    one_copy: dict[str, Any], two_copies: dict[str, Any]
) -> None:
    for saved in (one_copy, two_copies):
        tmp = saved["tmp"]
        for node in ("fast0", "fast1"):
            with castore.open(tmp / node) as fast:
                for run in RUNS:
                    assert [g.id for g in fast.generations(run)] == [2, 3]  # fast_keep=2
        with castore.open(tmp / "durable") as durable:
            for run in RUNS:
                assert [g.id for g in durable.generations(run)] == [2]  # every second
            assert verify_store(durable, deep=True).ok
    for node in ("fast0", "fast1"):
        with castore.open(two_copies["tmp"] / node) as fast:  # each holds both nodes' shards
            report = verify_store(fast, deep=True)
            assert report.ok and report.held_elsewhere == [], report.problems
        with castore.open(one_copy["tmp"] / node) as fast:  # each holds its own ranks' shards
            report = verify_store(fast, deep=True)
            assert report.ok, report.problems
            assert sorted(report.held_elsewhere) == [("f", 2), ("f", 3), ("p", 2), ("p", 3)]


def test_the_generation_records_each_rank_and_dcps_metadata(one_copy: dict[str, Any]) -> None:
    with castore.open(one_copy["tmp"] / "fast0") as fast:
        for run in RUNS:
            generation = fast.resolve(run)
            root = fast.read_root(Digest.from_hex(generation.root), run=run)
            assert root.world_size == 4 and len(root.shards) == 4  # a shard per rank
            assert isinstance(generation.metadata.get("dcp"), dict)


# -- losing a node ---------------------------------------------------------------------


def test_with_two_copies_a_lost_node_loads_the_newest_from_its_peer_and_goes_on(
    two_copies: dict[str, Any], tmp_path: Path
) -> None:
    job = copy_of(two_copies, tmp_path)
    shutil.rmtree(job / "fast1")  # node 1 is gone; its ranks restart on an empty one
    again = {"op": "save", "run": "p", "kind": "plain", "seed": 6, "step": 40}
    results = launch(job, 2, [*loads(), again])
    served = assert_loaded(two_copies, [rank[:2] for rank in results], 3)
    assert all("durable" not in s for rank in served for s in rank.values()), served
    for rank in served[2:]:  # node 1's ranks: everything from node 0
        assert all(s.get("peer", 0) > 0 and "fast" not in s for s in rank.values()), served
    # The job goes on: the next save is generation 4 on both nodes, and promoted.
    assert {rank[2].get("generation") for rank in results} == {4}, [r[2] for r in results]
    for node in ("fast0", "fast1"):
        with castore.open(job / node) as fast:
            assert fast.resolve("p").id == 4
            assert verify_store(fast, deep=True).ok
    with castore.open(job / "durable") as durable:
        assert [g.id for g in durable.generations("p")] == [2, 4]
        assert verify_store(durable, deep=True).ok


def test_with_one_copy_a_lost_node_loads_the_newest_durable_generation(
    one_copy: dict[str, Any], tmp_path: Path
) -> None:
    job = copy_of(one_copy, tmp_path)
    shutil.rmtree(job / "fast1")
    results = launch(job, 1, loads())
    served = assert_loaded(one_copy, results, 2)  # 3 is on node 0 alone: not complete
    assert all(s.get("durable", 0) > 0 for rank in served[2:] for s in rank.values()), served


def test_a_damaged_fast_chunk_is_read_from_the_peer_node(
    two_copies: dict[str, Any], tmp_path: Path
) -> None:
    job = copy_of(two_copies, tmp_path)
    with castore.open(job / "fast0") as fast:
        root = fast.read_root(Digest.from_hex(fast.resolve("p").root), run="p")
        chunks = sorted({c for s in fast.read_shards(root) for e in s.tensors for c in e.chunks})
        for chunk in chunks:
            value = fast.backend.get(Namespace.CHUNKS, chunk)
            assert value is not None
            fast.backend.raw_put(Namespace.CHUNKS, chunk, flipped(bytes(value), len(value) // 2))
    results = launch(job, 2, loads())
    served = assert_loaded(two_copies, results, 3)  # the same generation, bitwise
    assert all(rank["p"].get("peer", 0) > 0 for rank in served[:2]), served


# -- the durable tier --------------------------------------------------------------------


def test_a_promoted_generation_loads_from_the_durable_store_alone(
    one_copy: dict[str, Any],
) -> None:
    results = launch({"durable_only": str(one_copy["tmp"] / "durable")}, 1, loads())
    assert_loaded(one_copy, results, 2)


# -- refusals and the broken control -------------------------------------------------


def test_without_the_routing_the_coordinator_finds_the_other_nodes_shards_missing(
    tmp_path: Path,
) -> None:
    """Broken control: the DCP writer as if on one store. The coordinator re-reads every
    rank's shard in its own node's fast tier, where node 1's are not: nothing is published.
    A planner that keeps no global Metadata is refused, and nothing is published; the
    same save through the routed writer is published on both nodes."""
    castore.open(tmp_path / "durable", shared=True).close()
    save = {"op": "save", "run": "p", "kind": "plain", "seed": 3, "step": 10}
    ops = [{**save, "unrouted": True}, {**save, "planner": "without_metadata"}, save]
    unrouted, no_metadata, routed = zip(*launch(tmp_path, 1, ops), strict=True)
    for result in unrouted:  # the coordinator's finish failed, and DCP told every rank
        assert result["error"]["causes"][0][0] == "ObjectMissingError", result["error"]
        assert "shard object" in result["error"]["message"], result["error"]["message"]
    for result in no_metadata:  # refused on every rank, before any rank wrote
        assert "UnsupportedOperationError" in result["error"]["message"], result["error"]
        assert "planner.metadata" in result["error"]["message"]
    assert {result.get("generation") for result in routed} == {1}
    for node in ("fast0", "fast1"):
        with castore.open(tmp_path / node) as fast:
            assert [g.id for g in fast.generations("p")] == [1]  # only the routed save
