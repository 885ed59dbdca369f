"""TrainState with FSDP2: DTensor parameters and moments saved, resumed and resharded.

Real ``fully_shard`` on CPU over gloo, in real processes. Two parts:

- tests/helpers/train_fsdp2_workers.py: an FSDP2 MLP (uneven and empty shards)
  and AdamW, saved through TrainState at 2 ranks, restored at 1, 2 and 3 ranks
  into a fresh model whose optimizer never stepped: parameters and moments
  bitwise, every moment a DTensor of its parameter's layout, each rank reading
  about its own blocks, and training steps on. The broken control reads the
  moments whole as plain tensors, as TrainState did before: the step fails.
- tools/resume_parity.py with ``model="fsdp2"`` (4 ranks): a job SIGKILLed after
  its save, resumed in fresh processes, matches the uninterrupted job bitwise
  (losses, parameters, moments, scheduler, scaler), at an update boundary and
  mid-accumulation; onto 2 ranks it continues, using each sample of the epoch
  once; through tiers on 2 simulated nodes, a lost node resumes from its peer's
  copy or from the durable tier. Broken controls (weights only, partial
  gradients dropped) fail the comparison.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import dtensor_workers
import numpy as np
import pytest
import train_fsdp2_workers as w
from _helpers import assert_bitwise, rank_values
from cli_runner import run_cli
from dist_harness import run_ranks

import castore

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import resume_parity as parity  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_fsdp2")]

LAUNCH_TIMEOUT = 120.0


# -- restore into a fresh sharded model and optimizer, at any world size ----------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, np.ndarray]]:
    path = str(tmp_path_factory.mktemp("train") / "store")
    castore.open(path, chunk_size=dtensor_workers.CHUNK_SIZE).close()
    ranks = rank_values(run_ranks(2, w.save_train, path, timeout=LAUNCH_TIMEOUT))
    assert [r["generation"] for r in ranks] == [1, 1]
    return path, ranks[0]["saved"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_state_restores_fsdp2_params_and_moments_bitwise_at_any_world_size(
    world: int, saved: tuple[str, dict[str, np.ndarray]]
) -> None:
    path, expected = saved
    ranks = rank_values(run_ranks(world, w.load_train, path, timeout=LAUNCH_TIMEOUT))
    for rank in ranks:
        assert rank["claim"] == ("exact" if world == 2 else "continuation")
        assert rank["update"] == w.UPDATES
        assert_bitwise(rank["after"], expected)
        assert rank["layout"] == []  # every moment a DTensor laid out like its parameter
        assert "value" in rank["step"], rank["step"]  # and the optimizer steps on
    if world == 3:
        # No per-rank state is read onto another world size: each rank reads its own
        # blocks, the "step" scalars and a few chunks where cells are cut.
        whole = sum(a.nbytes for a in expected.values())
        steps = sum(a.nbytes for n, a in expected.items() if n.endswith("/step"))
        for rank in ranks:
            assert rank["bytes_read"] <= rank["local_bytes"] + steps + 6 * 256
            assert rank["bytes_read"] < 0.6 * whole


def test_broken_control_moments_read_whole_cannot_step(
    saved: tuple[str, dict[str, np.ndarray]],
) -> None:
    """Moments read whole as plain tensors (no DTensor targets): the bytes are all there,
    but each rank read the whole state and the optimizer cannot step."""
    path, expected = saved
    ranks = rank_values(run_ranks(3, w.load_train, path, True, timeout=LAUNCH_TIMEOUT))
    whole = sum(a.nbytes for a in expected.values())
    for rank in ranks:
        assert_bitwise(rank["after"], expected)
        assert rank["layout"] and all("Tensor" in where for where in rank["layout"])
        assert rank["bytes_read"] >= whole - sum(
            a.nbytes for n, a in expected.items() if n.startswith("model/")
        )
        assert rank["step"].get("error") == "RuntimeError", rank["step"]


# -- a SIGKILLed FSDP2 job resumed (tools/resume_parity.py, model="fsdp2") --------------------

RANKS = 4
UPDATES = 6
SAVE_AT = 4
DURABLE_EVERY = 3


def _config(path: Path, **how: Any) -> dict[str, Any]:
    return parity.make_config(
        path, ranks=RANKS, updates=UPDATES, save_at=SAVE_AT, timeout=240.0, model="fsdp2", **how
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
    resumed = parity.run_resume(config, label=f"resume{next(_launches)}", **how)
    return parity.judge(config, reference, resumed, resume=how.get("resume", "exact"))


def test_a_sigkilled_fsdp2_job_resumes_bitwise_identical(
    reference: list[dict[str, Any]], at_boundary: dict[str, Any]
) -> None:
    with castore.open(at_boundary["store"]) as store:
        assert [g.step for g in store.generations(parity.RUN)] == [SAVE_AT]
    verdict = _resume(at_boundary, reference)
    info = verdict["resumed"]
    assert (info["claim"], info["rng"], info["update"]) == ("exact", "restored", SAVE_AT)
    assert verdict["microbatches_compared"] == (UPDATES - SAVE_AT) * parity.ACCUMULATION * RANKS
    assert verdict["losses_equal"]
    assert verdict["final_equal"] == dict.fromkeys(
        ("params", "moments", "scheduler", "scaler"), True
    )
    assert verdict["holds"]


def test_a_mid_accumulation_fsdp2_save_resumes_with_its_sharded_gradients(
    reference: list[dict[str, Any]], mid_accumulation: dict[str, Any]
) -> None:
    verdict = _resume(mid_accumulation, reference)
    info = verdict["resumed"]
    assert (info["claim"], info["partial_update"]) == ("exact", "restored")
    assert (info["update"], info["microbatch"]) == (SAVE_AT, 1)
    assert verdict["holds"], verdict


def test_an_fsdp2_job_continues_onto_two_ranks_using_each_sample_once(
    reference: list[dict[str, Any]], at_boundary: dict[str, Any]
) -> None:
    verdict = _resume(at_boundary, reference, ranks=2, resume="continuation")
    assert (verdict["resumed"]["claim"], verdict["resumed"]["rng"]) == (
        "continuation",
        "reseeded",
    )
    assert verdict["mode"] == "coverage" and verdict["missing"] == verdict["repeated"] == []
    assert verdict["holds"]


def test_an_exact_fsdp2_resume_onto_two_ranks_is_refused(
    reference: list[dict[str, Any]], at_boundary: dict[str, Any]
) -> None:
    verdict = _resume(at_boundary, reference, ranks=2, resume="exact")
    assert verdict["refused"]["type"] == "ResumeMismatchError"
    assert "world_size: saved 4, here 2" in verdict["refused"]["message"]


def test_broken_controls_weights_only_and_dropped_gradients_fail(
    reference: list[dict[str, Any]],
    at_boundary: dict[str, Any],
    mid_accumulation: dict[str, Any],
) -> None:
    weights = _resume(at_boundary, reference, control="weights-only")
    assert not weights["final_equal"]["moments"] and not weights["holds"]
    dropped = _resume(mid_accumulation, reference, control="drop-partial-grads")
    assert not dropped["final_equal"]["params"] and not dropped["holds"]


# -- through tiers: 2 simulated nodes of 2 ranks, node 1 lost after the kill ------------------


def _tiered(path: Path, replicas: int) -> tuple[dict[str, Any], dict[str, Any]]:
    config = _config(path, tiers=replicas, ranks_per_node=2, durable_every=DURABLE_EVERY)
    interrupted = parity.run_interrupted(config)
    parity.lose_node(config, 1)
    return config, interrupted


@pytest.mark.parametrize("replicas", [2, 1])
def test_through_tiers_an_fsdp2_job_that_lost_a_node_resumes_bitwise(
    replicas: int, reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Two copies: the last save, from the peer node, not a byte from the durable tier.
    One copy: the newest durable generation (update 3), update 4 redone; the ranks of
    the node that lived read it from their own fast tier."""
    config, interrupted = _tiered(tmp_path, replicas)
    resumed = parity.run_resume(config, label=f"tiers{replicas}")
    verdict = parity.judge(config, reference, resumed, interrupted=interrupted, lost_node=1)
    tiers = verdict["tiers"]
    served = tiers["bytes_by_source"]
    if replicas == 2:
        assert tiers["restored_generation"] == [SAVE_AT] and tiers["updates_redone"] == 0
        assert all(s.get("durable", 0) == 0 for s in served), served
        assert all(s.get("peer", 0) > 0 for s in served[2:]), served
    else:
        assert tiers["restored_generation"] == [DURABLE_EVERY]
        assert tiers["updates_redone"] == SAVE_AT - DURABLE_EVERY
        # Node 0 still holds generation 3 (fast_keep=2): only the lost node's ranks
        # read the durable tier, and each reads its own blocks there.
        assert all(s.get("fast", 0) > 0 and s.get("durable", 0) == 0 for s in served[:2])
        assert all(s.get("durable", 0) > 0 for s in served[2:]), served
    assert verdict["losses_equal"] and all(verdict["final_equal"].values())
    assert tiers["holds"] and verdict["holds"]


def test_a_mid_accumulation_save_with_unreduced_fsdp2_gradients_is_refused(
    tmp_path: Path,
) -> None:
    """Under set_requires_gradient_sync(False) the sharded parameters have no gradient:
    the save is refused in one line on every rank and publishes nothing. The broken
    control, without the check, publishes a mid-accumulation save without them."""
    path = str(tmp_path / "store")
    ranks = rank_values(
        run_ranks(2, w.unsynced_mid_accumulation_save, path, timeout=LAUNCH_TIMEOUT)
    )
    for rank in ranks:
        refused = rank["refused"]
        assert refused.get("error") == "SaveBoundaryError", refused
        assert "set_requires_gradient_sync(False)" in refused["message"]
        assert "\n" not in refused["message"]
        assert rank["runs_after_refusal"] == []
    assert ranks[0]["control_grads"] == []  # the partial update, silently lost


@pytest.mark.parametrize("world", [2, 3])
def test_the_generation_records_each_dtensors_mesh_and_placements(
    world: int, saved: tuple[str, dict[str, np.ndarray]]
) -> None:
    """Every DTensor (parameters and moments) is recorded as saved from a mesh of 2 with
    placement Shard(0); plain tensors (each "step") are not. Onto the same layout every
    target is a saved box (resharded 0); at 3 ranks the sharded ones are not."""
    path, expected = saved
    ranks = rank_values(run_ranks(world, w.recorded_layouts, path, timeout=LAUNCH_TIMEOUT))
    layouts = ranks[0]["layouts"]
    sharded = sorted(n for n in expected if not n.endswith("/step"))
    assert sorted(layouts) == [n.replace("optimizer/", "optimizer/state/", 1) for n in sharded]
    assert all(
        v == {"mesh": [2], "mesh_dims": None, "placements": ["S(0)"]} for v in layouts.values()
    )
    resharded = [r["resharded"] for r in ranks]
    manifests = [r["manifests"] for r in ranks]
    if world == 2:
        assert resharded == [0, 0]
        # Onto the saved layout a rank reads its own manifest and rank 0's (each "step",
        # a replicated value one rank wrote, the root repeats): castore.dist.planning.
        assert manifests == [1, 2]
    else:  # the MLP's 3 weights and 2 biases and their 2 moments each, at least on one rank
        assert max(resharded) >= len(sharded) // 2
        assert manifests == [2, 2, 2]  # every manifest, to reshard
    with castore.open(path) as store:
        shown = store.resolve(w.RUN).layouts
    assert shown == layouts
    show = run_cli("show", path, w.RUN)
    assert show.returncode == 0, show.stderr
    lines = {line.split()[0]: line for line in show.stdout.splitlines() if line.strip()}
    assert lines["model/inp.weight"].rstrip().endswith("2: S(0)")
    assert lines["optimizer/state/inp.weight/step"].rstrip().endswith("-")


@pytest.mark.parametrize("kind", ["hsdp", "tp"])
def test_train_state_restores_hsdp_and_fsdp2_over_tp_bitwise(kind: str, tmp_path: Path) -> None:
    """On a 2x2 mesh: HSDP (Replicate, Shard(0)) and FSDP2 over tensor parallelism
    (strided shards) saved through TrainState, restored into fresh models of the same
    layout: parameters and moments bitwise, each moment a DTensor like its parameter."""
    path = str(tmp_path / "store")
    ranks = rank_values(run_ranks(4, w.train_2d, path, kind, timeout=LAUNCH_TIMEOUT))
    for rank in ranks:
        assert rank["claim"] == "exact"
        assert_bitwise(rank["after"], rank["saved"])
        assert rank["layout"] == []
    marker = "Replicate()" if kind == "hsdp" else "_StridedShard"
    assert any(marker in p for p in ranks[0]["placements"]), ranks[0]["placements"]
