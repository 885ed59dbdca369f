"""Replicated values are compared across ranks before a publish (castore.dist.replicas).

Real gloo groups of 2 and 3 ranks save one case after another to run R of one
store (tests/helpers/replica_workers.py): equal replicated state publishes; a tensor,
numpy array or plain value that differs on some ranks raises
ReplicaMismatchError on every rank, naming the value and the ranks, and
publishes nothing (the ref still names the last good generation). A RankLocal
value differs freely. The broken control is castore before this check: every
mismatching case published rank 0's copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import replica_workers as rw
from dist_harness import describe, run_groups

import castore
import castore.dist
from castore.dist.replicas import differing_values

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("replicas")]

CASES = [
    "equal",
    "tensor",
    "numpy",
    "plain",
    "missing_key",
    "kind",
    "key_order",
    "one_element",
    "several",
]
PUBLISHED = {"equal", "key_order"}


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every case saved by 2 ranks (blocking), 3 ranks (blocking) and 2 ranks (async)."""
    base = tmp_path_factory.mktemp("replicas")
    launches = {"two": (2, True), "three": (3, True), "async": (2, False), "trusting": (2, None)}
    paths = {}
    for name in launches:
        paths[name] = str(base / name)
        castore.open(paths[name], chunk_size=4096).close()
    outcomes = run_groups(
        [
            (world, rw.run_cases, (paths[name], CASES, blocking), {"timeout": 150.0})
            if blocking is not None
            else (world, rw.trusting_saves, (paths[name],), {"timeout": 150.0})
            for name, (world, blocking) in launches.items()
        ]
    )
    results = {}
    for name, outcome in zip(launches, outcomes, strict=True):
        assert all(o.exitcode == 0 and o.error_type is None for o in outcome), describe(outcome)
        results[name] = [o.value for o in outcome]
    return results


@pytest.mark.parametrize("launch", ["two", "three", "async"])
def test_equal_replicas_publish_and_differing_ones_publish_nothing(
    groups: dict[str, list[dict[str, Any]]], launch: str
) -> None:
    per_rank = groups[launch]
    published = 0
    for case in CASES:
        results = [ranks[case] for ranks in per_rank]
        if case in PUBLISHED:
            published += 1
            assert {r.get("error") for r in results} == {None}, (case, results)
            assert {r["generation"] for r in results} == {published}
        else:
            assert {r.get("error") for r in results} == {"ReplicaMismatchError"}, (case, results)
            assert {r["latest"] for r in results} == {published}, (case, results)
            assert len({r["message"] for r in results}) == 1  # the same words on every rank


@pytest.mark.parametrize(
    ("case", "key", "two", "three"),
    [
        ("tensor", "tensor 'w'", "rank 1 differs from rank 0", "3 different copies"),
        ("numpy", "tensor 'np'", "rank 1 differs from rank 0", "3 different copies"),
        ("plain", "value 'cfg/nested/k/1/x'", "rank 1 differs", "3 different copies"),
        (
            "missing_key",
            "value 'cfg/extra'",
            "rank 1 lacks it; rank 0 holds it",
            "ranks 1-2 lack it; rank 0 holds it",
        ),
        ("kind", "value 'cfg/names'", "rank 1 differs from rank 0", "rank 2 differs"),
        ("one_element", "tensor 'big'", "rank 1 differs from rank 0", "rank 2 differs"),
    ],
)
def test_the_error_names_the_value_and_the_ranks_that_differ(
    groups: dict[str, list[dict[str, Any]]], case: str, key: str, two: str, three: str
) -> None:
    for launch, who in (("two", two), ("three", three), ("async", two)):
        message = groups[launch][0][case]["message"]
        assert f"replicated {key}" in message, message
        assert who in message, message
        assert "castore.Shard" in message and "castore.RankLocal" in message
        assert "nothing of generation" in message and "'R'" in message
    assert groups["three"][0]["one_element"]["message"].count("rank 2 differs from ranks 0-1")


def test_every_differing_value_is_named(groups: dict[str, list[dict[str, Any]]]) -> None:
    result = groups["two"][1]["several"]
    assert sorted(result["keys"]) == ["np", "w"]
    assert "(and 1: 'w')" in result["message"]


def test_the_published_state_and_rank_local_values_load_back(
    groups: dict[str, list[dict[str, Any]]],
) -> None:
    for launch in ("two", "three", "async"):
        for rank, out in enumerate(groups[launch]):
            np.testing.assert_array_equal(out["loaded_w"], np.arange(16.0).reshape(4, 4))
            np.testing.assert_array_equal(out["loaded_mine"], np.full(3, float(rank)))


def test_differing_values_groups_ranks_largest_first() -> None:
    a, b = b"a" * 32, b"b" * 32
    details = [{"x": a, "y": a}, {"x": b, "y": a}, {"x": a, "y": a}, {"y": a}]
    assert differing_values(details) == [("x", [[0, 2], [1], [3]])]  # rank 3 lacks it
    assert differing_values([{"x": a}, {"x": a}]) == []


def test_a_single_process_save_checks_nothing(tmp_path: Path) -> None:
    with castore.open(tmp_path / "s") as store:
        generation = castore.dist.save(store, {"w": np.arange(4.0), "lr": 0.1}, run="R", step=1)
    assert generation.id == 1


def test_a_trusting_save_hashes_only_what_moved_and_still_compares(
    groups: dict[str, list[dict[str, Any]]],
) -> None:
    """Each rank writes one of the two tensors and hashes the other (4000 fp32: 4 chunks)."""
    first, unchanged, one_moved, all_moved = zip(*groups["trusting"], strict=True)
    assert [r["hashed_to_compare"] for r in first] == [4, 4]
    assert {r.get("published") for r in first + unchanged + all_moved} == {True}
    assert [r["hashed_to_compare"] for r in unchanged] == [0, 0]
    assert {r.get("error") for r in one_moved} == {"ReplicaMismatchError"}
    assert sum(r["hashed_to_compare"] for r in one_moved) <= 4  # 'a' on one rank at most
