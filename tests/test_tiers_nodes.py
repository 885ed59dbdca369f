"""A tiered job on several nodes: real gloo ranks, each pair of them a "node" with its own
fast tier (castore.tiers.nodes), the durable tier a shared directory.

Four ranks on two nodes save three generations (seeds 3, 4, 5: every chunk new
each time); every second generation is promoted. With ``replicas=2`` each node
also holds the other's shards; with 1, only its own. Then a node is lost (its
fast directory deleted, its ranks restarted on an empty one), a fast-tier
chunk is damaged, or the job comes back at another rank count, and the
restore is checked: which generation, which source served the bytes, and
every box bitwise.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import dist_workers as w
import pytest
from dist_harness import run_ranks
from test_dist import script_results

import castore
from castore.chunkstore.base import Namespace
from castore.format.hashing import Digest
from castore.testing.corrupt import flipped
from castore.verify import verify_store

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tiers-nodes")]

SEEDS = {1: 3, 2: 4, 3: 5}  # generation id -> the seed its state was made with


def config(tmp: Path, replicas: int, uploader: str = "thread") -> dict[str, Any]:
    return {
        "nodes": [str(tmp / "fast0"), str(tmp / "fast1")],
        "durable": str(tmp / "durable"),
        "durable_every": 2,
        "chunk_size": 256,
        "replicas": replicas,
        "promote_on_exit": False,
        "uploader": uploader,
    }


def save_three(tmp: Path, replicas: int, uploader: str) -> list[list[dict[str, Any]]]:
    castore.open(tmp / "durable", shared=True).close()
    ops = [
        {"op": "save", "run": "r", "seed": seed, "step": 10 * gen} for gen, seed in SEEDS.items()
    ]
    tiers = config(tmp, replicas, uploader)
    return script_results(run_ranks(4, w.run_script, tiers, ops, timeout=240), 4)


@pytest.fixture(scope="module")
def two_copies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("nodes-f2")
    results = save_three(tmp, 2, "thread")  # uploads on the ranks' promotion threads
    assert all("error" not in op for rank in results for op in rank), results
    return tmp


@pytest.fixture(scope="module")
def one_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("nodes-f1")
    results = save_three(tmp, 1, "process")  # uploads in each node's uploader process
    assert all("error" not in op for rank in results for op in rank), results
    return tmp


def copy_of(saved: Path, tmp: Path) -> Path:
    shutil.copytree(saved, tmp / "job")
    return tmp / "job"


def restore(tmp: Path, replicas: int, ranks: int = 4, **load: Any) -> list[dict[str, Any]]:
    op = {"op": "load", "run": "r", **load}
    if ranks != 4:
        op["rank_local"] = "drop"  # a rank's own values have no owner at another count
    results = script_results(
        run_ranks(ranks, w.run_script, config(tmp, replicas), [op], timeout=240), ranks
    )
    return [r[0] for r in results]


def assert_bitwise(per_rank: list[dict[str, Any]], generation: int) -> None:
    """Each rank restored ``generation``, and its boxes hold exactly its block of it."""
    full = w.full_tensors(SEEDS[generation])
    for rank, result in enumerate(per_rank):
        assert "error" not in result, (rank, result.get("message"))
        assert result["report"]["generation"].id == generation, rank
        for name, (offsets, block) in result["boxes"].items():
            where = tuple(slice(o, o + s) for o, s in zip(offsets, block.shape, strict=True))
            assert block.tobytes() == full[name][where].tobytes(), (name, rank)


def sources(per_rank: list[dict[str, Any]]) -> list[dict[str, int]]:
    return [r["report"]["bytes_by_source"] for r in per_rank]


def shard_chunks(fast: Path, generation: int, shard: int) -> list[bytes]:
    with castore.open(fast) as store:
        root = store.read_root(Digest.from_hex(store.resolve("r", generation).root), run="r")
        manifest = store.read_shards(root)[shard]
        return sorted({c for e in manifest.tensors + manifest.local_tensors for c in e.chunks})


def damage(fast: Path, chunks: list[bytes]) -> None:
    with castore.open(fast) as store:
        for chunk in chunks:
            value = store.backend.get(Namespace.CHUNKS, chunk)
            assert value is not None
            store.backend.raw_put(Namespace.CHUNKS, chunk, flipped(bytes(value), 3))


# -- what the nodes hold -----------------------------------------------------------


def test_each_node_lists_every_generation_and_holds_its_shards(
    one_copy: Path, two_copies: Path
) -> None:
    for tmp in (one_copy, two_copies):
        for node in ("fast0", "fast1"):
            with castore.open(tmp / node) as fast:
                assert [g.id for g in fast.generations("r")] == [2, 3]  # fast_keep=2
        with castore.open(tmp / "durable") as durable:
            assert [g.id for g in durable.generations("r")] == [2]  # every second
            assert verify_store(durable, deep=True).ok
    for node in ("fast0", "fast1"):
        with castore.open(two_copies / node) as fast:  # each holds both nodes' shards
            report = verify_store(fast, deep=True)
            assert report.ok and report.held_elsewhere == [], report.problems
        with castore.open(one_copy / node) as fast:  # each holds its own two shards
            report = verify_store(fast, deep=True)
            assert report.ok, report.problems
            assert sorted(report.held_elsewhere) == [("r", 2), ("r", 3)]


def test_verify_on_a_node_reports_its_own_shards_damage_and_needs_its_records(
    one_copy: Path, tmp_path: Path
) -> None:
    job = copy_of(one_copy, tmp_path)
    # Broken control: without the holdings records the other node's chunks are "missing".
    shutil.rmtree(job / "fast1" / "tiers" / "elsewhere")
    with castore.open(job / "fast1") as fast:
        assert not verify_store(fast).ok
    # A chunk of a shard this node holds, gone: damage, reported.
    own = shard_chunks(job / "fast0", 3, 0)
    with castore.open(job / "fast0") as fast:
        fast.backend.delete_many(Namespace.CHUNKS, own[:1])
        report = verify_store(fast)
    assert not report.ok
    assert any(own[0].hex()[:16] in str(p) for p in report.problems), report.problems


def test_castore_tiers_counts_the_shards_each_node_holds(one_copy: Path) -> None:
    from cli_runner import run_cli

    alone = run_cli("tiers", one_copy / "fast0", one_copy / "durable").stdout
    rows = [line.split() for line in alone.splitlines() if line.startswith("r ")]
    assert [(r[1], r[-4], r[-3]) for r in rows] == [("2", "2/4", "shards"), ("3", "2/4", "shards")]
    assert "durable" in alone.splitlines()[-1] and "fast" not in alone.splitlines()[-1]
    both = run_cli(
        "tiers", one_copy / "fast0", one_copy / "durable", "--node", one_copy / "fast1"
    ).stdout
    rows = [line.split() for line in both.splitlines() if line.startswith("r ")]
    assert [(r[1], r[-3]) for r in rows] == [("2", "held"), ("3", "held")], both
    assert "fast" in both.splitlines()[-1]  # the newest generation held whole in the fast tier


def tiers_table(*fast: Path, durable: Path) -> tuple[list[list[str]], list[str]]:
    """``castore tiers`` of these fast tiers (the first as STORE, the rest as --node):
    its table rows (split) and the lines after the table."""
    from cli_runner import run_cli

    more = [arg for path in fast[1:] for arg in ("--node", path)]
    done = run_cli("tiers", fast[0], durable, *more)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    rows = [line.split() for line in lines if line.startswith("r ")]
    return rows, [line for line in lines[2:] if not line.startswith("r ")]


def test_castore_tiers_shows_a_lost_node_and_what_a_restore_selects_on_two_nodes(
    one_copy: Path, two_copies: Path, tmp_path: Path
) -> None:
    """Node 1's directory is gone: the table still comes, node 1 is named lost, and the
    generation a restore selects is the one the restores above select."""
    job = copy_of(one_copy, tmp_path / "one")
    shutil.rmtree(job / "fast1")
    rows, after = tiers_table(job / "fast0", job / "fast1", durable=job / "durable")
    assert [(r[1], r[2], *r[5:-1]) for r in rows] == [
        ("2", "20", "2/4", "shards", "yes"), ("3", "30", "2/4", "shards", "-")
    ]  # fmt: skip
    assert after[0] == f"node {job / 'fast1'}: lost (no store there): the fast column " + (
        "counts the other nodes' fast tiers only"
    )
    # One copy: node 0 holds half of 3; the newest complete is the durable tier's 2.
    assert after[1] == (
        "r: a restore now selects generation 2 (step 20), 1 generation(s), 10 step(s) behind "
        f"the newest (3, step 30), from the fast tier of {job / 'fast0'} (shards 0-1) and the "
        "durable tier"
    )
    assert after[2].startswith("r: newest generation per tier: durable ")
    # Two copies: node 0 holds all of 3, the newest.
    job = copy_of(two_copies, tmp_path / "two")
    shutil.rmtree(job / "fast1")
    rows, after = tiers_table(job / "fast0", job / "fast1", durable=job / "durable")
    assert [(r[1], *r[5:-1]) for r in rows] == [("2", "held", "yes"), ("3", "held", "-")]
    assert after[1] == (
        f"r: a restore now selects generation 3 (step 30), the newest, from the fast tier of "
        f"{job / 'fast0'}"
    )


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three ranks on three nodes, two copies of each shard: node i holds shards i and
    i-1. Generations 1-3; 2 is promoted."""
    tmp = tmp_path_factory.mktemp("nodes-3")
    castore.open(tmp / "durable", shared=True).close()
    tiers = {**config(tmp, 2), "nodes": [str(tmp / f"fast{n}") for n in range(3)]}
    ops = [{"op": "save", "run": "r", "seed": s, "step": 10 * g} for g, s in SEEDS.items()]
    results = script_results(run_ranks(3, w.run_script, tiers, ops, timeout=240), 3)
    assert all("error" not in op for rank in results for op in rank), results
    return tmp


def test_castore_tiers_shows_lost_nodes_and_what_a_restore_selects_on_three_nodes(
    three_nodes: Path, tmp_path: Path
) -> None:
    job = copy_of(three_nodes, tmp_path)
    fast = [job / f"fast{n}" for n in range(3)]
    shutil.rmtree(fast[2])
    rows, after = tiers_table(*fast, durable=job / "durable")
    assert [(r[1], *r[5:-1]) for r in rows] == [("2", "held", "yes"), ("3", "held", "-")]
    assert after[0].startswith(f"node {fast[2]}: lost")
    # Nodes 0 and 1 hold shards {0, 2} and {0, 1}: together all of the newest.
    assert after[1] == (
        f"r: a restore now selects generation 3 (step 30), the newest, from the fast tiers of "
        f"{fast[0]} (shards 0, 2), {fast[1]} (shards 0-1)"
    )
    shutil.rmtree(fast[1])  # node 0 alone holds 2 of the 3 shards of each generation
    rows, after = tiers_table(*fast, durable=job / "durable")
    assert [(r[1], *r[5:-1]) for r in rows] == [
        ("2", "2/3", "shards", "yes"), ("3", "2/3", "shards", "-")
    ]  # fmt: skip
    assert [line.split(":")[0] for line in after[:2]] == [f"node {p}" for p in fast[1:]]
    assert after[2] == (
        "r: a restore now selects generation 2 (step 20), 1 generation(s), 10 step(s) behind "
        f"the newest (3, step 30), from the fast tier of {fast[0]} (shards 0, 2) and the "
        "durable tier"
    )


def test_log_du_and_gc_on_a_node_know_what_it_holds(one_copy: Path, tmp_path: Path) -> None:
    from cli_runner import run_cli

    job = copy_of(one_copy, tmp_path)
    log = run_cli("log", job / "fast0").stdout
    assert log.splitlines()[0].split()[-1] == "here" and log.count("2/4 shards") == 2
    du = run_cli("du", job / "fast0").stdout
    assert "held here" in du and du.count("2/4 shards") == 2
    assert "here" not in run_cli("log", job / "durable").stdout  # a store that holds all
    gc = run_cli("gc", job / "fast0", "--keep", "1", "-y")
    assert gc.returncode == 0, gc.stderr
    records = job / "fast0" / "tiers" / "elsewhere" / "r"
    assert sorted(p.name for p in records.iterdir()) == ["000000000003"]  # 2's went with it
    with castore.open(job / "fast0") as fast:
        report = verify_store(fast, deep=True)
        assert report.ok and report.held_elsewhere == [("r", 3)], report.problems


# -- losing a node -------------------------------------------------------------------


def test_with_two_copies_a_lost_node_restores_the_newest_generation_from_its_peer(
    two_copies: Path, tmp_path: Path
) -> None:
    job = copy_of(two_copies, tmp_path)
    shutil.rmtree(job / "fast1")  # node 1 is gone; its ranks restart on an empty one
    per_rank = restore(job, 2)
    assert_bitwise(per_rank, 3)
    served = sources(per_rank)
    assert all("durable" not in s for s in served), served
    assert all(s.get("peer", 0) > 0 and "fast" not in s for s in served[2:]), served
    assert all(s.get("fast", 0) > 0 and "peer" not in s for s in served[:2]), served
    # The job goes on: the next save is generation 4 on both nodes, and promoted.
    ops = [{"op": "save", "run": "r", "seed": 6, "step": 40}]
    saved = script_results(run_ranks(4, w.run_script, config(job, 2), ops, timeout=240), 4)
    assert {r[0]["generation"].id for r in saved} == {4}
    for node in ("fast0", "fast1"):
        with castore.open(job / node) as fast:
            assert fast.resolve("r").id == 4
            assert verify_store(fast, deep=True).ok
    with castore.open(job / "durable") as durable:
        assert [g.id for g in durable.generations("r")] == [2, 4]
        assert verify_store(durable, deep=True).ok


def test_the_job_asks_its_recovery_point_per_tier_across_its_nodes(
    one_copy: Path, tmp_path: Path
) -> None:
    job = copy_of(one_copy, tmp_path)
    ops = [{"op": "recovery_points", "run": "r"}]
    asked = [r[0]["r"] for r in script_results(run_ranks(4, w.run_script, config(job, 1), ops), 4)]
    assert all(a == asked[0] for a in asked)  # the coordinator's answer, everywhere
    assert set(asked[0]) == {"fast", "durable"}
    assert 0 <= asked[0]["fast"] < asked[0]["durable"]  # generation 3 is newer than 2
    with castore.open_tiered(job / "fast0", job / "durable") as one_node:
        assert "fast" not in one_node.recovery_points()["r"]  # alone it holds no whole one
    shutil.rmtree(job / "fast1")
    asked = [r[0]["r"] for r in script_results(run_ranks(4, w.run_script, config(job, 1), ops), 4)]
    assert set(asked[0]) == {"durable"}  # node 1 lost: no generation is whole in fast tiers


def test_with_one_copy_a_lost_node_restores_the_newest_durable_generation(
    one_copy: Path, tmp_path: Path
) -> None:
    job = copy_of(one_copy, tmp_path)
    shutil.rmtree(job / "fast1")
    per_rank = restore(job, 1)
    assert_bitwise(per_rank, 2)  # generation 3 is on node 0 only: not complete anywhere
    served = sources(per_rank)
    assert all(s.get("durable", 0) > 0 for s in served[2:]), served


@pytest.mark.parametrize(
    ("saved", "replicas", "restored"), [("two_copies", 2, 4), ("one_copy", 1, 3)]
)
def test_a_node_killed_before_its_ref_advance_leaves_what_the_others_cover(
    request: pytest.FixtureRequest, tmp_path: Path, saved: str, replicas: int, restored: int
) -> None:
    """Node 1's leader dies between its holdings record and its ref advance while
    generation 4 is published: with two copies node 0 holds all of it; with one, the
    nodes listing it do not cover it and the restore takes generation 3 (never promoted:
    from the fast tiers)."""
    job = copy_of(request.getfixturevalue(saved), tmp_path)
    ops = [
        {"op": "arm", "rank": 2, "point": "tiers.node_before_ref_advance", "action": "kill"},
        {"op": "save", "run": "r", "seed": 6, "step": 40, "timeout": 5},
    ]
    outcomes = run_ranks(4, w.run_script, config(job, replicas), ops, timeout=240)
    assert not outcomes[2].ok  # killed
    with castore.open(job / "fast0") as fast:
        assert fast.resolve("r").id == 4  # published on the coordinator's node
    with castore.open(job / "fast1") as fast:
        assert fast.resolve("r").id == 3  # node 1's ref did not move
    per_rank = restore(job, replicas)
    full = w.full_tensors({**SEEDS, 4: 6}[restored])
    for rank, result in enumerate(per_rank):
        assert "error" not in result, (rank, result.get("message"))
        assert result["report"]["generation"].id == restored
        assert "durable" not in result["report"]["bytes_by_source"]
        for name, (offsets, block) in result["boxes"].items():
            where = tuple(slice(o, o + s) for o, s in zip(offsets, block.shape, strict=True))
            assert block.tobytes() == full[name][where].tobytes(), (name, rank)


# -- damage --------------------------------------------------------------------------


def test_a_damaged_fast_chunk_is_read_from_the_peer_node(two_copies: Path, tmp_path: Path) -> None:
    job = copy_of(two_copies, tmp_path)
    damage(job / "fast0", shard_chunks(job / "fast0", 3, 0))
    per_rank = restore(job, 2)
    assert_bitwise(per_rank, 3)  # the same generation: nothing skipped
    assert all(r["report"]["skipped"] == [] for r in per_rank)
    assert sources(per_rank)[0].get("peer", 0) > 0


def test_a_chunk_gone_from_a_node_that_holds_every_shard_is_read_from_the_peer(
    two_copies: Path, tmp_path: Path
) -> None:
    """Both nodes hold every shard, so the first try asks the other node nothing; a chunk
    its holdings promise but its fast tier lost fails that try, and the retry asks."""
    job = copy_of(two_copies, tmp_path)
    gone = [
        c for c in shard_chunks(job / "fast0", 3, 0) if c not in shard_chunks(job / "fast0", 2, 0)
    ]
    assert gone  # generation 3's own chunks: in no durable tier (it holds 2)
    with castore.open(job / "fast0") as store:
        assert store.backend.delete_many(Namespace.CHUNKS, gone) == len(gone)
    per_rank = restore(job, 2)
    assert_bitwise(per_rank, 3)
    assert all(r["report"]["skipped"] == [] for r in per_rank)
    assert sources(per_rank)[0].get("peer", 0) > 0
    assert all("durable" not in s for s in sources(per_rank))


def test_a_chunk_damaged_on_every_node_moves_all_ranks_to_the_generation_before(
    two_copies: Path, tmp_path: Path
) -> None:
    job = copy_of(two_copies, tmp_path)
    for node in ("fast0", "fast1"):  # generation 3 is in no durable tier either
        damage(job / node, shard_chunks(job / node, 3, 0))
    failed = restore(job, 2)
    assert all("IntegrityError" in r.get("mro", ()) for r in failed), failed
    assert all(all(r["unchanged"].values()) for r in failed)  # nothing live changed
    per_rank = restore(job, 2, fallback="previous")
    assert_bitwise(per_rank, 2)
    assert all(r["report"]["skipped"] == [3] for r in per_rank)


# -- another rank count ---------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_fast_tiers_restore_onto_another_rank_count(
    two_copies: Path, tmp_path: Path, ranks: int
) -> None:
    job = copy_of(two_copies, tmp_path)
    per_rank = restore(job, 2, ranks=ranks)
    assert_bitwise(per_rank, 3)
    assert all("durable" not in s for s in sources(per_rank))


# -- async saves ---------------------------------------------------------------------


def test_async_saves_on_several_nodes_publish_on_every_node(
    two_copies: Path, tmp_path: Path
) -> None:
    job = copy_of(two_copies, tmp_path)
    ops = [
        {"op": "save", "run": "r", "seed": 6, "step": 40, "blocking": False},
        {"op": "save", "run": "r", "seed": 7, "step": 50, "blocking": False},
    ]
    saved = script_results(run_ranks(4, w.run_script, config(job, 2), ops, timeout=240), 4)
    assert all("error" not in op for rank in saved for op in rank), saved
    assert {r[1]["generation"].id for r in saved} == {5}
    for node in ("fast0", "fast1"):
        with castore.open(job / node) as fast:
            assert [g.id for g in fast.generations("r")] == [4, 5]
            assert verify_store(fast, deep=True).ok
    with castore.open(job / "durable") as durable:
        assert [g.id for g in durable.generations("r")] == [2, 4]


# -- an upload cut off ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "point"),
    [(0, "copy.before_root"), (2, "copy.mid_chunks")],
    ids=["coordinator-killed-before-the-durable-root", "node-1-killed-mid-upload"],
)
def test_a_promotion_cut_off_on_several_nodes_is_retried_by_the_next_job(
    tmp_path: Path, rank: int, point: str
) -> None:
    """Generation 1 is selected for the durable tier and its promotion is cut off (the
    coordinator killed before the durable root, or node 1's leader mid-upload); the next
    job's first save retries it: the durable tier ends with generation 1 (or a newer one
    that supersedes it) and 2, and no pin is left in any fast tier."""
    castore.open(tmp_path / "durable", shared=True).close()
    tiers = {**config(tmp_path, 2), "durable_every": 1, "upload_wait_s": 5.0}
    if rank == 2:
        tiers["durable_rate"] = 5e3  # batches of 500 bytes: the kill comes mid-upload
    ops = [{"op": "save", "run": "r", "seed": 3, "step": 10}]
    killed = {rank: {"CASTORE_FAULTS": f"{point}=kill"}}
    outcomes = run_ranks(4, w.run_script, tiers, ops, timeout=240, rank_env=killed)
    assert not outcomes[rank].ok
    with castore.open(tmp_path / "durable") as durable:
        assert "r" not in durable.runs() or durable.generations("r") == []
    ops = [{"op": "save", "run": "r", "seed": 4, "step": 20}]
    tiers.pop("durable_rate", None)
    saved = script_results(run_ranks(4, w.run_script, tiers, ops, timeout=240), 4)
    assert {r[0]["generation"].id for r in saved} == {2}
    with castore.open(tmp_path / "durable") as durable:
        assert [g.id for g in durable.generations("r")] == [1, 2]
        assert verify_store(durable, deep=True).ok
    for node in ("fast0", "fast1"):
        with castore.open(tmp_path / node) as fast:
            assert fast.refs.tags("r") == {}, node  # every pin released


def test_a_node_uploads_its_shards_after_its_stagger(tmp_path: Path) -> None:
    """A node leader's upload (one process here): its shards' chunks reach the durable
    tier, no sooner than its stagger, and nothing is published there by the upload."""
    import time

    import numpy as np

    with castore.open_tiered(
        tmp_path / "fast", tmp_path / "durable", durable_every=1000, uploader="thread",
        promote_on_exit=False,
    ) as store:  # fmt: skip
        gen = store.save({"w": np.arange(5000.0)}, run="r", step=1)
        started = time.monotonic()
        store.queue_node_work("r", gen.id, Digest.from_hex(gen.root), True, [0], delay=0.5)
        store.wait_promotions()
        assert time.monotonic() - started >= 0.5
        chunks = shard_chunks(tmp_path / "fast", gen.id, 0)
        assert all(store.durable.backend.has_many(Namespace.CHUNKS, chunks))
        assert store.durable.runs() == []  # the coordinator publishes, not a node's upload
        assert store.refs.tags("r") == {}  # the node's pin is gone once its part is up


def test_a_views_shard_runs_round_trip_and_wrap_round_the_first_node() -> None:
    # The discovery round sends each node's held shards as runs (castore.tiers.nodes):
    # the first node's own shards and, with peer copies, the last node's are one run.
    import random

    from castore.tiers.nodes import _ranges, _shards

    assert _ranges([0, 1, 14, 15], 16) == [[14, 1]]
    assert _shards([[14, 1]], 16) == [0, 1, 14, 15]
    assert _ranges([2, 3, 4, 5], 16) == [[2, 5]]
    assert _ranges([0, 2], 3) == [[2, 0]]
    assert _ranges([], 4) == []
    rng = random.Random(42)
    for world_size in range(1, 12):
        for _ in range(50):
            held = sorted(rng.sample(range(world_size), rng.randint(0, world_size)))
            assert _shards(_ranges(held, world_size), world_size) == held
