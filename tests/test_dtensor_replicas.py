"""The replicas of a DTensor block are compared before a publish (castore.dist.replicas).

Real ranks on a 1-D gloo mesh of two (tests/helpers/dtensor_replica_workers.py)
hold one block of a ``[Replicate()]`` DTensor; rank 0 writes it. Equal
replicas publish; rank 1's copy one element off raises ReplicaMismatchError on
both ranks, naming the key path, the offsets and the ranks, and publishes
nothing (the ref still names the last good generation), blocking and async;
on a 2x2 HSDP mesh (4 ranks) the replicas of each shard are compared. A
save that trusts version counters does not hash an unmoved replica again, and
still catches one changed on one rank. The broken control disables the
comparison of blocks: the differing save then publishes rank 0's copy.
"""

from __future__ import annotations

from typing import Any

import dtensor_replica_workers as rw
import numpy as np
import pytest
from dist_harness import describe, run_groups

import castore
from castore.dist.replicas import differing_blocks

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dtensor_replicas")]

TIMEOUT = 150.0


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Two ranks each: the cases blocking, the cases async, the trusting saves; four
    ranks on a 2x2 HSDP mesh."""
    base = tmp_path_factory.mktemp("dtensor_replicas")
    paths = {name: str(base / name) for name in ("blocking", "async", "trusting", "hsdp")}
    for path in paths.values():
        castore.open(path, chunk_size=rw.CHUNK_SIZE).close()
    outcomes = run_groups(
        [
            (2, rw.equal_then_differing, (paths["blocking"], True), {"timeout": TIMEOUT}),
            (2, rw.equal_then_differing, (paths["async"], False), {"timeout": TIMEOUT}),
            (2, rw.trusting_saves, (paths["trusting"],), {"timeout": TIMEOUT}),
            (4, rw.hsdp_one_replica_off, (paths["hsdp"],), {"timeout": TIMEOUT}),
        ]
    )
    results = {}
    for name, outcome in zip(paths, outcomes, strict=True):
        assert all(o.exitcode == 0 and o.error_type is None for o in outcome), describe(outcome)
        results[name] = [o.value for o in outcome]
    return results


@pytest.mark.parametrize("launch", ["blocking", "async"])
def test_equal_replicas_publish_and_one_element_off_publishes_nothing(
    launches: dict[str, list[Any]], launch: str
) -> None:
    ranks = launches[launch]
    assert [r["equal"] for r in ranks] == [{"generation": 1, "latest": 1}] * 2
    refused = [r["one_element"] for r in ranks]
    assert {r.get("error") for r in refused} == {"ReplicaMismatchError"}, refused
    assert {r["latest"] for r in refused} == {1}  # the ref still names generation 1
    assert {tuple(r["keys"]) for r in refused} == {("model/w",)}
    for r in refused:
        text = r["text"]
        assert "\n" not in text
        assert "'model/w' at offsets [0, 0]" in text, text
        assert "rank 1 differs from rank 0" in text, text
        assert "nothing of generation 2 of run 'R' is published" in text, text


@pytest.mark.parametrize("launch", ["blocking", "async"])
def test_broken_control_without_the_comparison_the_diverged_replica_is_lost(
    launches: dict[str, list[Any]], launch: str
) -> None:
    ranks = launches[launch]
    assert [r["control"] for r in ranks] == [{"generation": 2, "latest": 2}] * 2
    writer, replica = ranks
    # Published: rank 0's copy; rank 1's differing element is gone, and nobody was told.
    np.testing.assert_array_equal(replica["loaded_w"], writer["held_w"])
    assert not np.array_equal(replica["loaded_w"], replica["held_w"])


def test_hsdp_each_shard_s_replicas_are_compared_and_named_by_rank(
    launches: dict[str, list[Any]],
) -> None:
    ranks = launches["hsdp"]
    assert [r["equal"] for r in ranks] == [{"generation": 1, "latest": 1}] * 4
    refused = [r["one_element"] for r in ranks]
    assert {r.get("error") for r in refused} == {"ReplicaMismatchError"}, refused
    assert {r["latest"] for r in refused} == {1}
    for r in refused:  # rows 4-7, held by ranks 1 and 3; rows 0-3 (ranks 0, 2) agree
        assert "DTensor block 'w' at offsets [4, 0] differs" in r["text"], r["text"]
        assert "rank 3 differs from rank 1;" in r["text"], r["text"]
        assert "(and" not in r["text"]


def test_trusting_saves_skip_an_unmoved_replica_and_catch_a_moved_one(
    launches: dict[str, list[Any]],
) -> None:
    writer, replica = launches["trusting"]
    published = [r.get("published", False) for r in replica]
    assert published == [True, True, False], replica
    assert replica[2]["error"] == "ReplicaMismatchError"
    assert writer[2].get("error") == "ReplicaMismatchError"
    hashed = {r["case"]: r["hashed_to_compare"] for r in replica}
    assert hashed["first"] > 1  # w's chunks, cut on the grid rank 0 cuts
    assert hashed["unchanged"] == 0  # unmoved since the last save: its chunks trusted
    assert hashed["one_rank_moved"] == hashed["first"]
    assert all(r["hashed_to_compare"] == 0 for r in writer)  # rank 0 writes it


def test_differing_blocks_groups_holders_largest_first() -> None:
    a, b = b"a" * 32, b"b" * 32
    details = [[["w", [0, 4], a]], [["w", [0, 4], b]], [["w", [0, 4], a]], [["v", [2], a]]]
    assert differing_blocks(details) == [("w", (0, 4), [[0, 2], [1]])]
    assert differing_blocks([[["w", [0], a]], [["w", [0], a]], [["w", [4], b]]]) == []

