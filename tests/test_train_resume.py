"""Deterministic resume, proven with real DDP on gloo and real SIGKILLs.

The job (tools/resume_parity.py): a small model with dropout, AdamW, a linear
warmup scheduler, gradient accumulation over 2 microbatches, a CPU GradScaler
and a NumPy Generator for input noise, fed by a ResumableDistributedSampler,
at 4 ranks. One uninterrupted reference run is shared by every test. Two
interrupted runs save (at an update boundary, and after the first microbatch
of the next update), train on past the save and are SIGKILLed; fresh
processes then resume from what they left in the store.

Every resumed microbatch is compared with the reference's on every rank:
sample ids, a digest of the weights it saw, and the loss bits; then the final
parameters, optimizer moments, scheduler and scaler. Two broken controls
(weights only; partial gradients dropped) show the comparison catches a bad
resume.

Through tiers (castore.open_tiered, 2 simulated nodes of 2 ranks, every third
generation durable), the interrupted run saves every update and node 1's fast
directory is deleted after the kill: with two copies the resume takes the
last save from the peer node (no durable bytes), with one copy the newest
durable generation (one update older, redone), and both match the reference
bitwise. Restoring an older generation than the tiers promise fails the tier
claim even though it is bitwise on the reference's path, and the weights-only
control fails through tiers as well.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import castore
import castore.data

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import resume_parity as parity  # noqa: E402

# One worker runs the module: its module-scoped fixtures are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_resume")]

RANKS = 4
UPDATES = 10  # 8 updates make an epoch of 256 samples at 4 ranks: the run crosses one
SAVE_AT = 4


def _config(path: Path, *, mid_accumulation: bool = False) -> dict[str, Any]:
    return parity.make_config(
        path,
        ranks=RANKS,
        updates=UPDATES,
        save_at=SAVE_AT,
        mid_accumulation=mid_accumulation,
        timeout=240.0,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return parity.run_reference(_config(tmp_path_factory.mktemp("reference")))


@pytest.fixture(scope="module")
def at_boundary(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    config = _config(tmp_path_factory.mktemp("boundary"))
    parity.run_interrupted(config)  # raises unless every rank died of SIGKILL
    return config


@pytest.fixture(scope="module")
def mid_accumulation(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    config = _config(tmp_path_factory.mktemp("mid"), mid_accumulation=True)
    parity.run_interrupted(config)
    return config


_launches = itertools.count()


def _resume(config: dict[str, Any], reference: list[dict[str, Any]], **how: Any) -> dict[str, Any]:
    """Fresh processes resume from ``config``'s store; the verdict against ``reference``."""
    resumed = parity.run_resume(config, label=f"resume{next(_launches)}", **how)
    return parity.judge(config, reference, resumed, resume=how.get("resume", "exact"))


def test_the_interrupted_run_published_exactly_the_save(at_boundary: dict[str, Any]) -> None:
    with castore.open(at_boundary["store"]) as store:
        generations = store.generations(parity.RUN)
        assert [g.step for g in generations] == [SAVE_AT]  # nothing after the save
        order = generations[0].data_order
    assert order["world_size"] == RANKS
    assert order["update"] == SAVE_AT and order["microbatch"] == 0
    assert order["seed"] == 7 and order["epoch"] == 0
    per_update = RANKS * parity.MICROBATCH * parity.ACCUMULATION
    assert order["consumed_samples"] == SAVE_AT * per_update
    assert order["dataset_hash"] == castore.data.dataset_hash(range(parity.DATASET))


def test_exact_resume_is_bitwise_identical_to_the_uninterrupted_run(
    reference: list[dict[str, Any]], at_boundary: dict[str, Any]
) -> None:
    verdict = _resume(at_boundary, reference)
    info = verdict["resumed"]
    assert (info["claim"], info["rng"], info["partial_update"]) == ("exact", "restored", None)
    assert info["update"] == SAVE_AT
    # Every microbatch of every remaining update on every rank was compared.
    assert verdict["microbatches_compared"] == (UPDATES - SAVE_AT) * parity.ACCUMULATION * RANKS
    assert verdict["losses_equal"]
    assert verdict["final_equal"] == dict.fromkeys(
        ("params", "moments", "scheduler", "scaler"), True
    )
    assert verdict["holds"]
    first = verdict["first_update"]
    assert [row["update"] for row in first] == [SAVE_AT + 1] * RANKS
    assert all(row["reference_ids"] == row["resumed_ids"] for row in first)


def test_a_mid_accumulation_save_resumes_bitwise_identical(
    reference: list[dict[str, Any]], mid_accumulation: dict[str, Any]
) -> None:
    with castore.open(mid_accumulation["store"]) as store:
        order = store.resolve(parity.RUN).data_order
    assert (order["update"], order["microbatch"]) == (SAVE_AT, 1)
    verdict = _resume(mid_accumulation, reference)
    info = verdict["resumed"]
    assert (info["claim"], info["partial_update"]) == ("exact", "restored")
    assert (info["update"], info["microbatch"]) == (SAVE_AT, 1)
    # The first resumed microbatch is the second of update SAVE_AT + 1.
    expected = ((UPDATES - SAVE_AT) * parity.ACCUMULATION - 1) * RANKS
    assert verdict["microbatches_compared"] == expected
    assert verdict["holds"], verdict


def test_continuation_onto_two_ranks_uses_every_sample_of_the_epoch_once(
    reference: list[dict[str, Any]], at_boundary: dict[str, Any]
) -> None:
    verdict = _resume(at_boundary, reference, ranks=2, resume="continuation")
    info = verdict["resumed"]
    assert (info["claim"], info["rng"]) == ("continuation", "reseeded")
    assert verdict["mode"] == "coverage"
    assert verdict["missing"] == [] and verdict["repeated"] == []
    assert verdict["consumed_before_save"] + verdict["consumed_after_resume"] == parity.DATASET
    assert verdict["holds"]


def test_a_mid_accumulation_continuation_restarts_the_partial_update(
    reference: list[dict[str, Any]], mid_accumulation: dict[str, Any]
) -> None:
    verdict = _resume(mid_accumulation, reference, ranks=2, resume="continuation")
    info = verdict["resumed"]
    assert (info["partial_update"], info["microbatch"]) == ("discarded", 0)
    assert any("restarts from its first microbatch" in note for note in info["notes"])
    # The partial update's samples are consumed again, by the new ranks, exactly once.
    assert verdict["missing"] == [] and verdict["repeated"] == [] and verdict["holds"]


def test_an_exact_resume_onto_two_ranks_is_refused(
    reference: list[dict[str, Any]], at_boundary: dict[str, Any]
) -> None:
    verdict = _resume(at_boundary, reference, ranks=2, resume="exact")
    refused = verdict["refused"]
    assert refused["type"] == "ResumeMismatchError"
    assert "world_size: saved 4, here 2" in refused["message"]
    assert not verdict["holds"]


def test_broken_control_weights_only_fails_the_comparison(
    reference: list[dict[str, Any]], at_boundary: dict[str, Any]
) -> None:
    verdict = _resume(at_boundary, reference, control="weights-only")
    assert verdict["resumed"]["claim"] == "weights-only"
    assert not verdict["losses_equal"]
    assert not verdict["final_equal"]["moments"]
    assert not verdict["holds"]


def test_broken_control_dropped_partial_gradients_fail_the_comparison(
    reference: list[dict[str, Any]], mid_accumulation: dict[str, Any]
) -> None:
    verdict = _resume(mid_accumulation, reference, control="drop-partial-grads")
    assert verdict["resumed"]["partial_update"] == "restored"  # then thrown away
    assert not verdict["final_equal"]["params"]
    assert not verdict["holds"]


def test_the_tool_prints_a_receipt_and_exits_zero_when_parity_holds(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(TOOLS / "resume_parity.py"),
            "--ranks",
            "2",
            "--updates",
            "6",
            "--save-at",
            "3",
            "--json",
            str(tmp_path / "receipt.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "first resumed update, per rank" in done.stdout
    assert "RESULT: HOLDS" in done.stdout
    assert (tmp_path / "receipt.json").exists()


# -- through tiers on two simulated nodes, one of them lost ----------------------------

DURABLE_EVERY = 3  # generation id = update: the durable tier's newest at the kill is 3


def _tiered(path: Path, replicas: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """An interrupted run through tiers (2 nodes of 2 ranks), then node 1 lost."""
    config = parity.make_config(
        path,
        ranks=RANKS,
        updates=UPDATES,
        save_at=SAVE_AT,
        timeout=240.0,
        tiers=replicas,
        ranks_per_node=2,
        durable_every=DURABLE_EVERY,
    )
    interrupted = parity.run_interrupted(config)
    parity.lose_node(config, 1)
    return config, interrupted


@pytest.fixture(scope="module")
def two_copies(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    return _tiered(tmp_path_factory.mktemp("tiers-f2"), 2)


@pytest.fixture(scope="module")
def one_copy(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    return _tiered(tmp_path_factory.mktemp("tiers-f1"), 1)


def _resume_tiered(
    tiered: tuple[dict[str, Any], dict[str, Any]], reference: list[dict[str, Any]], **how: Any
) -> dict[str, Any]:
    config, interrupted = tiered
    resumed = parity.run_resume(config, label=f"resume{next(_launches)}", **how)
    return parity.judge(config, reference, resumed, interrupted=interrupted, lost_node=1)


def test_through_tiers_the_interrupted_run_left_every_save_fast_and_every_third_durable(
    one_copy: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    config, interrupted = one_copy
    assert interrupted == {
        "last_generation": SAVE_AT,
        "last_update": SAVE_AT,
        "durable_generation": 3,
        "durable_update": 3,
    }
    assert not parity.fast_dir(config, 1).exists()  # node 1 is lost
    with castore.open(parity.fast_dir(config, 0)) as fast:
        assert [g.id for g in fast.generations(parity.RUN)] == [3, 4]  # fast_keep=2


def test_through_tiers_with_two_copies_a_lost_node_resumes_from_its_peer_bitwise(
    reference: list[dict[str, Any]], two_copies: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    verdict = _resume_tiered(two_copies, reference)
    tiers = verdict["tiers"]
    assert tiers["restored_generation"] == [SAVE_AT] and tiers["updates_redone"] == 0
    served = tiers["bytes_by_source"]
    assert all(s.get("durable", 0) == 0 for s in served), served
    assert all(s.get("fast", 0) > 0 and s.get("peer", 0) == 0 for s in served[:2]), served
    assert all(s.get("peer", 0) > 0 and s.get("fast", 0) == 0 for s in served[2:]), served
    assert verdict["microbatches_compared"] == (UPDATES - SAVE_AT) * parity.ACCUMULATION * RANKS
    assert verdict["losses_equal"] and all(verdict["final_equal"].values())
    assert tiers["holds"] and verdict["holds"]


def test_through_tiers_a_resume_with_fallback_takes_the_same_generation_from_the_peer(
    reference: list[dict[str, Any]], two_copies: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    # fallback="previous" walks the candidates the nodes and the durable tier hold whole:
    # the newest is the last save, whose root the replacement node is sent first.
    verdict = _resume_tiered(two_copies, reference, fallback="previous")
    assert verdict["tiers"]["restored_generation"] == [SAVE_AT]
    assert all(s.get("durable", 0) == 0 for s in verdict["tiers"]["bytes_by_source"])
    assert verdict["holds"]


def test_through_tiers_with_one_copy_a_lost_node_resumes_from_the_durable_tier_bitwise(
    reference: list[dict[str, Any]],
    one_copy: tuple[dict[str, Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    verdict = _resume_tiered(one_copy, reference)
    tiers = verdict["tiers"]
    # The recovery point is the durable cadence: update 4 is redone, then 5 to 10 follow.
    assert tiers["restored_generation"] == [3] and tiers["expected_source"] == "durable tier"
    assert tiers["updates_redone"] == 1 and verdict["resumed"]["update"] == 3
    assert all(s.get("durable", 0) > 0 for s in tiers["bytes_by_source"]), tiers
    assert verdict["microbatches_compared"] == (UPDATES - 3) * parity.ACCUMULATION * RANKS
    assert [row["update"] for row in verdict["first_update"]] == [4] * RANKS
    assert verdict["losses_equal"] and all(verdict["final_equal"].values())
    assert verdict["holds"]
    config, _ = one_copy
    parity.print_receipt(
        {
            "config": {**config, "resume": "exact", "control": None, "resume_ranks": RANKS},
            **dict.fromkeys(("reference_seconds", "interrupted_seconds", "resume_seconds"), 0.0),
            **verdict,
        }
    )
    printed = capsys.readouterr().out
    assert "replicas=1, 2 nodes of 2 ranks, durable every 3 generations; node 1 lost" in printed
    assert "restored generation 3 (update 3); expected the newest in the durable tier" in printed
    assert "1 update(s) redone" in printed and "RESULT: HOLDS" in printed


def test_through_tiers_the_tier_claim_fails_when_an_older_generation_is_restored(
    reference: list[dict[str, Any]], one_copy: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    # Broken control of the tier claim: with two copies the newest save must be restored;
    # generation 3 restored instead is bitwise on the reference's path, and still fails.
    config, interrupted = one_copy
    resumed = parity.run_resume(config, label=f"resume{next(_launches)}")
    verdict = parity.judge(
        {**config, "tiers": 2}, reference, resumed, interrupted=interrupted, lost_node=1
    )
    assert verdict["losses_equal"] and all(verdict["final_equal"].values())
    assert verdict["tiers"]["expected_generation"] == SAVE_AT
    assert not verdict["tiers"]["holds"] and not verdict["holds"]


def test_through_tiers_broken_control_weights_only_fails_the_comparison(
    reference: list[dict[str, Any]], two_copies: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    verdict = _resume_tiered(two_copies, reference, control="weights-only")
    assert verdict["resumed"]["claim"] == "weights-only"
    assert verdict["tiers"]["restored_generation"] == [SAVE_AT]  # the right generation
    assert not verdict["losses_equal"]
    assert not verdict["final_equal"]["moments"]
    assert not verdict["holds"]
