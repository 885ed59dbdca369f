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
