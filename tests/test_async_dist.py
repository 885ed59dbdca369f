"""Async multi-rank saves on real gloo ranks (async_workers.py via dist_harness.py, tests/helpers).

Each launch costs seconds (every rank imports torch), so one launch runs several
scenarios, each on a store of its own, and the tests read its outcomes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import async_workers as w
import numpy as np
import pytest
from dist_harness import RankOutcome, describe, run_ranks

import castore
from castore.verify import verify_store

LAUNCH_TIMEOUT = 90.0
STAGGER_S = 2.0
KILL_TIMEOUT = 20.0  # the save's collective timeout when a rank dies
PHASES = ("held", "snapshot", "staging_wait", "write", "publish", "total")

# One worker runs the module: its module-scoped fixtures are built once.
pytestmark = pytest.mark.xdist_group("async_dist")


def values(outcomes: list[RankOutcome]) -> list[Any]:
    assert all(o.ok for o in outcomes), describe(outcomes)
    return [o.value for o in outcomes]


def assert_generation_holds(path: Path, seed: int, world_size: int = 2) -> None:
    """The latest generation at ``path`` holds, bitwise, the state of ``seed``."""
    with castore.open(path) as store:
        loaded = store.load(w.RUN)
    expected = w.global_arrays(seed)
    for name, array in expected.items():
        group, key = name.split("/")
        got = loaded[group][key]
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert got.tobytes() == array.tobytes(), f"{name} differs from the state when saved"
    for rank in range(world_size):
        assert loaded["rng"][rank].tobytes() == w.rank_local(seed, rank).tobytes()
    assert loaded["step"] == seed


def assert_verifies(path: Path) -> None:
    with castore.open(path) as store:
        report = verify_store(store)
    assert report.ok, report.problems


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("async-dist")
    outcomes = run_ranks(2, w.scenarios, str(root), STAGGER_S, timeout=LAUNCH_TIMEOUT)
    per_rank = values(outcomes)
    return {"root": root, **{name: [r[name] for r in per_rank] for name in per_rank[0]}}


def test_mutating_every_tensor_after_an_async_save_leaves_the_generation_intact(
    scenarios: dict[str, Any],
) -> None:
    ranks = scenarios["mutate"]
    assert ranks[0]["root"] == ranks[1]["root"]  # one generation, on every rank
    assert_generation_holds(scenarios["root"] / "mutate", seed=5)


def test_an_async_multi_rank_generation_records_the_bytes_written_and_the_time_held(
    scenarios: dict[str, Any],
) -> None:
    ranks = scenarios["mutate"]
    stats = ranks[0]["stats"]
    assert stats.written_bytes == sum(r["bytes"].written for r in ranks)
    assert stats.held_seconds == pytest.approx(max(r["timings"]["held"] for r in ranks), abs=1e-5)
    for rank in ranks:
        assert 0 < rank["timings"]["held"] < rank["timings"]["total"], rank["timings"]


def test_a_multi_rank_root_never_says_a_rank_was_held_longer_than_the_save(
    scenarios: dict[str, Any],
) -> None:
    early = scenarios["skewed"][1]
    assert early["timings"]["held"] >= w.SKEW_S * 0.8  # it waited for the coordinator to skip
    stats = early["stats"]
    assert stats.held_seconds <= stats.seconds, stats


def test_an_async_multi_rank_save_times_every_phase(scenarios: dict[str, Any]) -> None:
    for rank in scenarios["mutate"]:
        assert set(PHASES) <= set(rank["timings"]), rank["timings"]


def test_every_rank_skips_when_any_rank_is_busy(scenarios: dict[str, Any]) -> None:
    for rank, outcome in enumerate(scenarios["skip"]):
        assert outcome["skipped"] and outcome["result"] is None, (rank, outcome)
        assert outcome["counters"]["skipped"] == 1, (rank, outcome)
        # The next save, with nobody busy, is taken by every rank; the skipped one left nothing.
        assert not outcome["after_skipped"] and outcome["after_id"] == 1, (rank, outcome)
        assert outcome["ids"] == [1], (rank, outcome)


def test_stagger_delays_the_later_ranks_first_write(scenarios: dict[str, Any]) -> None:
    first, second = scenarios["stagger"]
    # Rank 1 of 2 starts writing stagger_s / 2 late; the clock is the machine's monotonic one.
    delay = second["timeline"][0][0] - first["started"]
    assert delay >= 0.4 * STAGGER_S, delay
    assert first["timeline"][0][0] < second["timeline"][0][0]


@pytest.mark.parametrize("killed", [1, 0], ids=["worker", "coordinator"])
def test_a_rank_killed_mid_write_publishes_nothing_and_the_next_group_saves(
    tmp_path: Path, killed: int
) -> None:
    path = tmp_path / "store"
    outcomes = run_ranks(
        2, w.killed_mid_write, str(path), killed, KILL_TIMEOUT, timeout=LAUNCH_TIMEOUT
    )
    dead, survivor = outcomes[killed], outcomes[1 - killed]
    assert dead.exitcode == -9 and not dead.killed_by_harness, describe(outcomes)
    assert survivor.ok, describe(outcomes)
    failed = survivor.value
    assert failed["error"] is not None and "CastoreError" in failed["mro"], failed
    assert failed["seconds"] < KILL_TIMEOUT + 10, failed
    assert failed["latest"] == 1, failed
    with castore.open(path) as store:
        assert [g.id for g in store.generations(w.RUN)] == [1]
    assert_generation_holds(path, seed=1)
    assert_verifies(path)

    again = values(run_ranks(2, w.save_and_mutate, str(path), 6, timeout=LAUNCH_TIMEOUT))
    assert {r["id"] for r in again} == {2}
    assert_generation_holds(path, seed=6)
    assert_verifies(path)


def test_the_expected_state_is_what_the_workers_build() -> None:
    """The parent's expectation and the ranks' blocks come from the same seed."""
    torch = pytest.importorskip("torch")
    blocks = [w.make_state(7, rank, 2)["model"]["w"].local for rank in range(2)]
    np.testing.assert_array_equal(torch.cat(blocks).numpy(), w.global_arrays(7)["model/w"])
