"""castore.dist with real processes: N ranks in a gloo group, one store on disk.

Every launch of a group costs seconds (each rank imports torch), so each
module-scoped fixture below runs one group through a whole script of saves
and loads (tests/helpers/dist_workers.py: ``run_script``) and the tests read what each
rank reported. States come from seeds, so the parent knows every expected
byte: restored boxes are compared element for element with the full tensors,
and reassembled across ranks. Load targets start filled with SENTINEL, so a
failed load can be shown to have written nothing, on every rank.

Store layout of the fixtures (chunk size 128 bytes):

* ``saved``: run C saved by 4 ranks (seed 3), then run A saved twice by 8 ranks
  (seeds 1, 2), restored in the same 8-rank group (8->8 and 4->8);
* ``world4``: A restored by 4 ranks (8->4), C by 4; two 2-rank subgroups with a
  coordinator other than global rank 0 save and restore run S;
* ``world3``: A restored by 3 ranks (8->3, uneven), a target of the wrong dtype,
  and run V saved from and restored into strided views;
* ``numpy_2_to_1``: run D saved by 2 ranks from numpy arrays, restored by 1;
* ``failures``: six groups at once, each failing saves its own way (a raise, an
  unencodable value, bad coverage, SIGKILLs at each fault point, a stalled rank);
* ``damaged``: a copy of ``saved`` with one chunk flipped and one deleted.
"""

from __future__ import annotations

import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import dist_harness
import dist_workers as w
import numpy as np
import pytest
from dist_harness import RankOutcome, describe, run_groups, run_ranks

import castore
from castore.chunkstore.base import Namespace
from castore.verify import verify_store

# One worker runs the module: its module-scoped fixtures are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dist")]

LAUNCH_TIMEOUT = 150.0
KILL_SAVE_TIMEOUT = 10.0  # the `timeout` given to saves that lose a rank
STALL_TIMEOUT, STALL_SECONDS = 3.0, 8.0  # a save's timeout; how long its peer stalls
TIMINGS = {"metadata", "planning", "read_verify", "assembly"}


def new_store(path: Path) -> str:
    castore.open(path, chunk_size=w.CHUNK_SIZE).close()
    return str(path)


def script_results(outcomes: list[RankOutcome], ranks: int | None = None) -> list[list[Any]]:
    """Each rank's list of op results; every rank's script must have run to its end."""
    assert len(outcomes) == (ranks if ranks is not None else len(outcomes))
    assert all(o.ok for o in outcomes), describe(outcomes)
    return [o.value for o in outcomes]


def op(results: list[list[Any]], index: int) -> list[dict[str, Any]]:
    """Op ``index``'s result on every rank."""
    return [per_rank[index] for per_rank in results]


def assert_ok(per_rank: list[dict[str, Any]]) -> None:
    failed = {r: (x["error"], x["message"]) for r, x in enumerate(per_rank) if "error" in x}
    assert not failed, failed


def assert_same_array(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.tobytes() != expected.tobytes():
        np.testing.assert_array_equal(
            actual.astype(np.float64), expected.astype(np.float64), err_msg=what
        )
        raise AssertionError(f"{what}: same values, different bytes")


def check_restored(per_rank: list[dict[str, Any]], seed: int) -> None:
    """Each rank's boxes hold exactly its block of the seed's tensors, and the blocks
    of all ranks reassemble every sharded tensor in full, each element exactly once."""
    assert_ok(per_rank)
    world_size = len(per_rank)
    full = w.full_tensors(seed)
    names = list(per_rank[0]["boxes"])
    for name in names:
        shape, _, dim = w.TENSORS[name]
        rebuilt = np.zeros(shape, dtype=full[name].dtype)
        written = np.zeros(shape, dtype=np.int64)
        for rank, result in enumerate(per_rank):
            offsets, block = result["boxes"][name]
            expected_offsets, local = w.box_of(name, rank, world_size)
            assert offsets == expected_offsets
            where = w.box_slices(offsets, local)
            assert_same_array(block, full[name][where], f"{name} on rank {rank}/{world_size}")
            rebuilt[where] = block
            written[where] += 1
        if dim is not None:
            assert (written == 1).all(), f"{name}: boxes do not tile the tensor"
            assert_same_array(rebuilt, full[name], f"{name} reassembled from {world_size} ranks")
    for result in per_rank:
        assert all(result["same_objects"].values()), result["same_objects"]
        assert not any(result["unchanged"].values()), result["unchanged"]


def check_plain_state(
    per_rank: list[dict[str, Any]], seed: int, step: int, old_ranks: list[int | None]
) -> None:
    """Non-tensor values, RankLocal values (old_ranks[r] is None: dropped) and NotLoaded."""
    import castore.format.shard

    for rank, result in enumerate(per_rank):
        state = result["state"]
        assert state["step"] == step
        assert state["optim"]["hparams"] == w.hparams(seed)
        old = old_ranks[rank]
        rank_local = state["rng"]
        if old is None:
            assert rank_local is None, rank_local
        else:
            expected_bytes, expected_cursor = w.rank_local_value(seed, old)
            assert isinstance(rank_local, dict), f"RankLocal came back as {rank_local!r}"
            assert rank_local["cursor"] == expected_cursor
            assert_same_array(
                np.asarray(rank_local["state"]), expected_bytes, f"RankLocal of rank {rank}"
            )
        targeted = set(result["boxes"])
        for name, (shape, dtype, _) in w.TENSORS.items():
            leaf = w.get_path(state, name)
            if name in targeted:
                continue  # the caller's own object: checked through same_objects
            assert isinstance(leaf, castore.format.shard.NotLoaded), (name, leaf)
            assert tuple(leaf.shape) == shape and leaf.dtype == dtype, leaf


def check_reads_only_what_it_needs(per_rank: list[dict[str, Any]], rank_local: bool) -> None:
    """Only the row-sharded "model/emb" targeted, chunk-aligned: not a byte more is read.

    With ``rank_local``, the RankLocal tensor (one chunk) is needed and read as well.
    """
    assert_ok(per_rank)
    extra_bytes, extra_chunks = (w.RANK_LOCAL_BYTES, 1) if rank_local else (0, 0)
    for rank, result in enumerate(per_rank):
        assert list(result["boxes"]) == ["model/emb"]
        report = result["report"]
        _, block = result["boxes"]["model/emb"]
        assert block.nbytes % w.CHUNK_SIZE == 0  # the premise: boxes are whole chunks
        assert report["bytes_needed"] == block.nbytes + extra_bytes, (rank, report)
        assert report["bytes_read"] == report["bytes_needed"], (rank, report)
        expected_chunks = block.nbytes // w.CHUNK_SIZE + extra_chunks
        assert report["chunks_read"] == expected_chunks, (rank, report)


def assert_all_raise(per_rank: list[dict[str, Any]], error: str) -> None:
    """Every rank raised the same exception type, one that is (or subclasses) ``error``."""
    assert all("error" in x for x in per_rank), [x.get("error") for x in per_rank]
    types = {x["error"] for x in per_rank}
    assert len(types) == 1, {r: (x["error"], x["message"]) for r, x in enumerate(per_rank)}
    assert error in per_rank[0]["mro"], per_rank[0]


def fresh_look(path: str, run: str) -> dict[str, Any]:
    """Latest generation, every generation and a deep verify, from a new handle."""
    with castore.open(path) as store:
        report = verify_store(store, deep=True)
        return {
            "latest": store.resolve(run),
            "ids": [g.id for g in store.generations(run)],
            "verify_ok": report.ok,
            "problems": [str(p) for p in report.problems],
        }


# -- the harness itself ----------------------------------------------------------------------


def test_harness_values_errors_signals_timeouts_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASTORE_FAULTS", "save.mid_chunks=kill")  # must not leak into ranks
    started = time.monotonic()
    good, bad, hung = run_groups(
        [
            (3, w.all_reduce_rank, (5,), {"rank_env": {2: {"CASTORE_TEST_MARK": "two"}}}),
            (3, w.misbehave, ({1: "raise", 2: "kill"},), {}),
            # Long enough for 8 ranks to start on 2 busy cores, rank 0 included.
            (2, w.misbehave, ({1: "hang"},), {"timeout": 15.0}),
        ]
    )
    elapsed = time.monotonic() - started
    assert [o.exitcode for o in good] == [0, 0, 0], describe(good)
    assert [o.value["sum"] for o in good] == [30, 30, 30]
    assert [o.value["rank"] for o in good] == [0, 1, 2]
    assert {o.value["world_size"] for o in good} == {3}
    assert len({o.value["pid"] for o in good}) == 3
    assert [o.value["mark"] for o in good] == [None, None, "two"]
    assert {o.value["faults"] for o in good} == {None}

    assert bad[0].ok and bad[0].value == "rank 0 returned", describe(bad)
    assert bad[1].exitcode == 1 and bad[1].error_type == "HarnessProbeError"
    assert bad[1].raised_a("RuntimeError") and "raised on purpose" in str(bad[1].error_message)
    assert bad[2].exitcode == -9 and bad[2].error_type is None and not bad[2].killed_by_harness

    assert hung[0].ok, describe(hung)
    assert hung[1].timed_out and hung[1].killed_by_harness and hung[1].exitcode == -9
    assert 15 <= elapsed < 60


def test_harness_retries_a_launch_whose_port_was_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real_free_port = dist_harness.free_port
        monkeypatch.setattr(
            dist_harness, "free_port", lambda: ports.pop() if ports else real_free_port()
        )
        started = time.monotonic()
        outcomes = run_ranks(2, w.all_reduce_rank, 1, timeout=60)
    assert not ports  # the taken port was handed out first
    assert [o.value["sum"] for o in outcomes] == [3, 3], describe(outcomes)
    # The failed rendezvous was not waited out (60 s); the bound leaves room for a
    # loaded 2-core machine, where two launches took 30.2 s once.
    assert time.monotonic() - started < 45


def test_harness_refuses_functions_a_child_cannot_import() -> None:
    with pytest.raises(ValueError, match="module-level"):
        run_ranks(2, lambda rank, world_size: None)


# -- saving at one world size, restoring at others ---------------------------------------------

A_OPS: list[dict[str, Any]] = [
    # 0, 1: two generations of run A, by 8 ranks
    {"op": "save", "run": "A", "seed": 1, "step": 10, "metadata": {"note": "first"}},
    {"op": "save", "run": "A", "seed": 2, "step": 20},
    # 2: 8 -> 8, everything targeted, RankLocal to the same rank
    {"op": "load", "run": "A"},
    # 3: only the row-sharded tensor of generation 1, RankLocal dropped
    {"op": "load", "run": "A", "generation": 1, "names": ["model/emb"], "rank_local": "drop"},
    # 4: 4 -> 8, RankLocal of old rank r % 4
    {"op": "load", "run": "C", "rank_local": ("mod", 4)},
    # 5: 4 -> 8, only the row-sharded tensor, RankLocal dropped
    {"op": "load", "run": "C", "names": ["model/emb"], "rank_local": "drop"},
    # 6: as 3, with the RankLocal values
    {"op": "load", "run": "A", "generation": 1, "names": ["model/emb"]},
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = new_store(tmp_path_factory.mktemp("saved") / "store")
    c_ops = [{"op": "save", "run": "C", "seed": 3, "step": 30}]
    four = script_results(run_ranks(4, w.run_script, path, c_ops, timeout=LAUNCH_TIMEOUT), 4)
    eight = script_results(run_ranks(8, w.run_script, path, A_OPS, timeout=LAUNCH_TIMEOUT), 8)
    with castore.open(path) as store:
        chunk_bytes = sum(size for _, size in store.backend.value_sizes(Namespace.CHUNKS))
        entries = {
            (run, gen.id): store.tensor_entries(store.resolve_root(run, gen.id)[1])
            for run in ("A", "C")
            for gen in store.generations(run)
        }
        generations = {run: store.generations(run) for run in ("A", "C")}
    return {
        "path": path,
        "c_save": op(four, 0),
        "eight": eight,
        "chunk_bytes": chunk_bytes,
        "entries": entries,
        "generations": generations,
    }


@pytest.fixture(scope="module")
def world4(saved: dict[str, Any]) -> list[list[Any]]:
    ops: list[dict[str, Any]] = [
        {"op": "load", "run": "A", "rank_local": "drop"},  # 0: 8 -> 4
        {"op": "load", "run": "A", "names": ["model/emb"], "rank_local": "drop"},  # 1
        {"op": "load", "run": "A", "rank_local": "same"},  # 2: RankLocalMismatchError
        {"op": "load", "run": "C"},  # 3: 4 -> 4, after a failed load in this group
        # 4: as 1, each rank r given saved rank 2r's RankLocal
        {"op": "load", "run": "A", "names": ["model/emb"], "rank_local": ("times", 2)},
        # 5, 7: subgroups with coordinators other than global rank 0: global ranks 1 and 3
        # save run S at world size 2, then global ranks 0 and 2 restore it
        {"op": "save", "run": "S", "seed": 6, "step": 60, "group": [1, 3], "coordinator": 1},
        {"op": "barrier"},
        {"op": "load", "run": "S", "group": [0, 2], "coordinator": 1},
    ]
    return script_results(run_ranks(4, w.run_script, saved["path"], ops, timeout=LAUNCH_TIMEOUT))


@pytest.fixture(scope="module")
def world3(saved: dict[str, Any]) -> list[list[Any]]:
    ops: list[dict[str, Any]] = [
        {"op": "load", "run": "A", "rank_local": "drop"},  # 0: 8 -> 3, uneven
        {  # 1: generation 1, two tensors only, every rank given old rank 7's RankLocal
            "op": "load",
            "run": "A",
            "generation": 1,
            "names": ["model/proj", "model/conv"],
            "rank_local": ("const", 7),
        },
        {  # 2: rank 1 alone passes a float64 target for a float32 tensor
            "op": "load",
            "run": "A",
            "rank_local": "drop",
            "wrong_dtype": {1: ("model/proj", "float64")},
        },
        # 3, 4: every tensor saved from, and restored into, strided views of larger buffers
        {"op": "save", "run": "V", "seed": 7, "step": 70, "views": True},
        {"op": "load", "run": "V", "views": True},
        # 5: 8 -> 3 into numpy views
        {"op": "load", "run": "A", "rank_local": "drop", "framework": "numpy", "views": True},
    ]
    return script_results(run_ranks(3, w.run_script, saved["path"], ops, timeout=LAUNCH_TIMEOUT))


@pytest.fixture(scope="module")
def numpy_2_to_1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run D: saved by 2 ranks from numpy Shards, restored by 1 into numpy targets."""
    path = new_store(tmp_path_factory.mktemp("numpy") / "store")
    save = [
        {"op": "save", "run": "D", "seed": 4, "step": 40, "framework": "numpy"},
        {"op": "load", "run": "D", "framework": "numpy"},
    ]
    two = script_results(run_ranks(2, w.run_script, path, save, timeout=LAUNCH_TIMEOUT))
    load = [
        {"op": "load", "run": "D", "framework": "numpy", "rank_local": ("const", 1)},
        {"op": "load", "run": "D", "framework": "numpy", "rank_local": "drop"},
        {"op": "load", "run": "D", "framework": "numpy"},  # RankLocalMismatchError
    ]
    one = script_results(run_ranks(1, w.run_script, path, load, timeout=LAUNCH_TIMEOUT))
    return {"two": two, "one": one}


def test_every_rank_returns_the_same_generation_and_ids_increase(saved: dict[str, Any]) -> None:
    first, second = op(saved["eight"], 0), op(saved["eight"], 1)
    for per_rank, expected_id, step in ((first, 1, 10), (second, 2, 20)):
        assert_ok(per_rank)
        generations = [x["generation"] for x in per_rank]
        assert len({(g.run, g.id, g.root) for g in generations}) == 1, generations
        assert generations[0].id == expected_id and generations[0].step == step
        assert generations[0].world_size == 8
        assert {x["latest"] for x in per_rank} == {(expected_id, generations[0].root)}
    assert first[0]["generation"].metadata == {"note": "first"}
    assert second[0]["generation"].parent == first[0]["generation"].root

    a1, a2 = saved["generations"]["A"]
    assert (a1.root, a2.root) == (first[0]["generation"].root, second[0]["generation"].root)
    assert (a1.world_size, a2.world_size) == (8, 8)  # recorded in the root
    c_save = saved["c_save"]
    assert_ok(c_save)
    assert len({x["generation"].root for x in c_save}) == 1
    (c1,) = saved["generations"]["C"]
    assert c1.root == c_save[0]["generation"].root and c1.world_size == 4


def test_replicated_tensors_are_written_once(saved: dict[str, Any]) -> None:
    """Chunks in the store = each tensor's bytes once + each rank's RankLocal bytes."""

    def unique_bytes(seed: int, world_size: int) -> int:
        tensors = sum(array.nbytes for array in w.full_tensors(seed).values())
        return tensors + world_size * w.RANK_LOCAL_BYTES

    replicated = sum(w.full_tensors(1)[name].nbytes for name in w.REPLICATED)
    expected = unique_bytes(1, 8) + unique_bytes(2, 8) + unique_bytes(3, 4)
    assert saved["chunk_bytes"] == expected, (saved["chunk_bytes"], expected, replicated)
    for key, entries in saved["entries"].items():
        for name in w.REPLICATED:
            assert len(entries[name]) == 1, (key, name, len(entries[name]))
        for name in w.SHARDED:
            assert len(entries[name]) == (8 if key[0] == "A" else 4), (key, name)
    a2 = saved["generations"]["A"][1]
    assert a2.logical_bytes == unique_bytes(2, 8)


RESTORES = {
    # case: (fixture, how to find the op, seed, step, old rank of each new rank's RankLocal)
    "8->8": ("saved", lambda f: op(f["eight"], 2), 2, 20, list(range(8))),
    "4->8": ("saved", lambda f: op(f["eight"], 4), 3, 30, [r % 4 for r in range(8)]),
    "8->4": ("world4", lambda f: op(f, 0), 2, 20, [None] * 4),
    "4->4": ("world4", lambda f: op(f, 3), 3, 30, list(range(4))),
    "8->3": ("world3", lambda f: op(f, 0), 2, 20, [None] * 3),
    "2->2 numpy": ("numpy_2_to_1", lambda f: op(f["two"], 1), 4, 40, [0, 1]),
    "2->1 numpy": ("numpy_2_to_1", lambda f: op(f["one"], 0), 4, 40, [1]),
}


@pytest.mark.parametrize("case", list(RESTORES))
def test_restore_at_another_world_size(case: str, request: pytest.FixtureRequest) -> None:
    fixture, find, seed, step, old_ranks = RESTORES[case]
    per_rank = find(request.getfixturevalue(fixture))
    check_restored(per_rank, seed)
    check_plain_state(per_rank, seed, step, old_ranks)
    framework = "numpy" if "numpy" in case else "torch"
    for result in per_rank:  # filled in place: still the caller's kind of tensor
        assert set(result["framework_kept"].values()) == {framework}


def test_subgroups_with_another_coordinator_save_and_restore(
    world4: list[list[Any]], saved: dict[str, Any]
) -> None:
    saves, loads = op(world4, 5), op(world4, 7)
    assert saves[0] == saves[2] == {"skipped": True}
    assert loads[1] == loads[3] == {"skipped": True}
    assert_ok([saves[1], saves[3]])
    generation = saves[1]["generation"]
    assert saves[3]["generation"] == generation
    assert generation.world_size == 2 and generation.step == 60
    restored = [loads[0], loads[2]]  # group ranks 0 and 1
    check_restored(restored, seed=6)
    check_plain_state(restored, seed=6, step=60, old_ranks=[0, 1])
    assert {r["report"]["generation"].root for r in restored} == {generation.root}


def test_partial_restore_reads_and_returns_only_the_targets(
    saved: dict[str, Any], world3: list[list[Any]]
) -> None:
    # 8 -> 3, generation 1, only two tensors; every rank gets old rank 7's RankLocal.
    per_rank = op(world3, 1)
    check_restored(per_rank, seed=1)
    check_plain_state(per_rank, seed=1, step=10, old_ranks=[7, 7, 7])
    for result in per_rank:
        report = result["report"]
        targeted = sum(b.nbytes for _, b in result["boxes"].values())
        assert report["bytes_needed"] == targeted + w.RANK_LOCAL_BYTES
        assert report["bytes_needed"] <= report["bytes_read"]
        # proj (384 B) and conv (960 B) whole are 1344 B: column boxes read some of it.
        assert report["bytes_read"] <= 1344 + w.RANK_LOCAL_BYTES


EXACT_READS = {
    # case: (fixture, how to find the op, seed, step, old rank of each new rank's RankLocal)
    "8->8": ("saved", lambda f: op(f["eight"], 3), 1, 10, [None] * 8),
    "4->8": ("saved", lambda f: op(f["eight"], 5), 3, 30, [None] * 8),
    "8->4": ("world4", lambda f: op(f, 1), 2, 20, [None] * 4),
    "8->8 RankLocal same": ("saved", lambda f: op(f["eight"], 6), 1, 10, list(range(8))),
    "8->4 RankLocal mapped": ("world4", lambda f: op(f, 4), 2, 20, [0, 2, 4, 6]),
}


@pytest.mark.parametrize("case", list(EXACT_READS))
def test_restore_reads_exactly_the_needed_bytes_when_boxes_are_whole_chunks(
    case: str, request: pytest.FixtureRequest
) -> None:
    fixture, find, seed, step, old_ranks = EXACT_READS[case]
    per_rank = find(request.getfixturevalue(fixture))
    check_reads_only_what_it_needs(per_rank, rank_local=old_ranks[0] is not None)
    check_restored(per_rank, seed)
    check_plain_state(per_rank, seed, step, old_ranks)


@pytest.mark.parametrize(("index", "seed", "step"), [(4, 7, 70), (5, 2, 20)])
def test_strided_views_save_and_restore_in_place(
    world3: list[list[Any]], index: int, seed: int, step: int
) -> None:
    saved_from_views = op(world3, 3)
    assert_ok(saved_from_views)
    per_rank = op(world3, index)
    check_restored(per_rank, seed)
    check_plain_state(per_rank, seed, step, [0, 1, 2] if index == 4 else [None] * 3)
    for result in per_rank:  # the elements around each view in its buffer are untouched
        assert set(result["pads_intact"].values()) == {True}, result["pads_intact"]


def test_load_report_fields(saved: dict[str, Any], world3: list[list[Any]]) -> None:
    a2 = saved["generations"]["A"][1]
    for per_rank in (op(saved["eight"], 2), op(world3, 0)):
        for result in per_rank:
            report = result["report"]
            assert report["generation"].root == a2.root and report["generation"].id == 2
            assert set(report["timings"]) == TIMINGS, report["timings"]
            assert all(isinstance(t, float) and 0 <= t < 60 for t in report["timings"].values())
            assert report["chunks_read"] >= 1
            assert 0 < report["bytes_needed"] <= report["bytes_read"]
    # 8 -> 3: uneven row boxes do not end on chunk boundaries, yet no rank reads it all.
    total = sum(a.nbytes for a in w.full_tensors(2).values())
    assert all(r["report"]["bytes_read"] < total for r in op(world3, 0))


def test_a_target_of_the_wrong_dtype_on_one_rank_fails_every_rank(
    world3: list[list[Any]],
) -> None:
    per_rank = op(world3, 2)
    assert_all_raise(per_rank, "LayoutMismatchError")
    assert "model/proj" in per_rank[1]["message"]
    for result in per_rank:
        assert all(result["unchanged"].values()), result["unchanged"]


def test_rank_local_onto_another_world_size_needs_drop_or_a_mapping(
    world4: list[list[Any]], numpy_2_to_1: dict[str, Any]
) -> None:
    for per_rank in (op(world4, 2), op(numpy_2_to_1["one"], 2)):
        assert_all_raise(per_rank, "RankLocalMismatchError")
        assert "DistributedError" in per_rank[0]["mro"]
        for result in per_rank:
            assert all(result["unchanged"].values()), result["unchanged"]
    # "drop": RankLocal comes back as None; the tensors still load (2 -> 1).
    dropped = op(numpy_2_to_1["one"], 1)
    check_restored(dropped, seed=4)
    check_plain_state(dropped, seed=4, step=40, old_ranks=[None])


# -- a rank failing during a save ----------------------------------------------------------


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four groups at once, each saving generation 1 of run A, then failing generation 2."""
    base = tmp_path_factory.mktemp("failures")
    first = {"op": "save", "run": "A", "seed": 1, "step": 10}
    second = {"op": "save", "run": "A", "seed": 2, "step": 20, "timeout": KILL_SAVE_TIMEOUT}

    def arm(rank: int, point: str, action: str) -> dict[str, Any]:
        return {"op": "arm", "rank": rank, "point": point, "action": action}

    scripts = {
        "raise": (
            3,
            [
                first,
                arm(1, "dist.worker_mid_shard", "raise"),
                second,  # 2: rank 1 raises mid-shard
                {"op": "disarm"},
                {**second, "poison_rank": 2},  # 4: rank 2 holds an unencodable value
                {**second, "overlap_rank": 2},  # 5: rank 2's rows overlap rank 1's
                {**second, "gap_rank": 1},  # 6: rank 1 leaves out its last row
                {"op": "save", "run": "B", "seed": 5, "step": 50},  # 7: the group still works
                {**second, "extra_tensor_rank": 1},  # 8: rank 1 has one tensor more
            ],
        ),
        "stalled": (  # rank 1 alive but silent: rank 0 must give up after `timeout`
            2,
            [
                first,
                {"op": "sleep", "rank": 1, "seconds": STALL_SECONDS},
                {**second, "timeout": STALL_TIMEOUT},
            ],
        ),
        "worker_killed": (3, [first, arm(1, "dist.worker_mid_shard", "kill"), second]),
        "before_ack": (3, [first, arm(2, "dist.worker_before_ack", "kill"), second]),
        "before_root": (2, [first, arm(0, "dist.coordinator_before_root", "kill"), second]),
        "before_advance": (
            2,
            [first, arm(0, "dist.coordinator_before_ref_advance", "kill"), second],
        ),
        "after_advance": (
            2,
            [first, arm(0, "dist.coordinator_after_ref_advance", "kill"), second],
        ),
    }
    paths = {name: new_store(base / name) for name in scripts}
    started = time.monotonic()
    outcomes = run_groups(
        [
            (n, w.run_script, (paths[name], ops), {"timeout": LAUNCH_TIMEOUT})
            for name, (n, ops) in scripts.items()
        ]
    )
    elapsed = time.monotonic() - started
    return {
        "elapsed": elapsed,
        **{
            name: {"outcomes": outcome, "look": fresh_look(paths[name], "A"), "path": paths[name]}
            for name, outcome in zip(scripts, outcomes, strict=True)
        },
    }


def test_a_rank_raising_mid_save_fails_every_rank_and_publishes_nothing(
    failures: dict[str, Any],
) -> None:
    case = failures["raise"]
    results = script_results(case["outcomes"], 3)
    gen1 = op(results, 0)[0]["generation"]
    injected, poisoned = op(results, 2), op(results, 4)
    overlapping, gapped = op(results, 5), op(results, 6)

    assert injected[1]["error"] == "InjectedFault"
    assert poisoned[2]["error"] == "UnsupportedValueError"
    for per_rank, bad_rank in ((injected, 1), (poisoned, 2)):
        own = per_rank[bad_rank]["error"]
        for rank, result in enumerate(per_rank):
            assert result["error"] in (own, "RankFailedError"), (rank, result)
            if result["error"] == "RankFailedError":
                assert re.search(rf"rank\D{{0,3}}{bad_rank}\b", result["message"]), result
    for per_rank in (overlapping, gapped):
        assert_all_raise(per_rank, "CoverageError")
        assert "IntegrityError" in per_rank[0]["mro"]

    extra = op(results, 8)
    assert_all_raise(extra, "LayoutMismatchError")

    for per_rank in (injected, poisoned, overlapping, gapped, extra):
        assert {x["latest"] for x in per_rank} == {(1, gen1.root)}  # seen by every rank
    assert case["look"]["latest"].root == gen1.root  # and by a fresh handle afterwards
    assert case["look"]["ids"] == [1]
    assert case["look"]["verify_ok"], case["look"]["problems"]
    recovered = op(results, 7)
    assert_ok(recovered)
    assert len({x["generation"].root for x in recovered}) == 1


@pytest.mark.parametrize(
    ("case", "killed"),
    [
        ("worker_killed", 1),  # a worker SIGKILLed halfway through writing its shard
        ("before_ack", 2),  # a worker SIGKILLed with its shard durable, before it says so
        ("before_root", 0),  # the coordinator SIGKILLed before it writes the root
        ("before_advance", 0),  # the coordinator SIGKILLed before it advances the ref
    ],
)
def test_a_rank_killed_during_a_save_fails_the_survivors_in_time_and_publishes_nothing(
    failures: dict[str, Any], case: str, killed: int
) -> None:
    outcomes = failures[case]["outcomes"]
    dead = outcomes[killed]
    assert dead.exitcode == -9 and not dead.killed_by_harness, describe(outcomes)
    for survivor in outcomes:
        if survivor.rank == killed:
            continue
        assert survivor.ok, describe(outcomes)
        assert_ok([survivor.value[0]])
        second = survivor.value[2]
        assert "DistributedError" in second.get("mro", ()), second
        assert second["seconds"] < KILL_SAVE_TIMEOUT + 20, second
        assert second["latest"][0] == 1  # this rank sees generation 1 still latest
    look = failures[case]["look"]
    assert look["latest"].id == 1 and look["ids"] == [1]
    assert look["verify_ok"], look["problems"]


def test_a_stalled_rank_times_the_save_out_and_publishes_nothing(
    failures: dict[str, Any],
) -> None:
    case = failures["stalled"]
    results = script_results(case["outcomes"], 2)
    assert_ok(op(results, 0))
    waiting, stalled = op(results, 2)
    assert waiting["error"] == "CollectiveTimeoutError", waiting
    assert STALL_TIMEOUT * 0.9 <= waiting["seconds"] < STALL_TIMEOUT + 10, waiting
    assert "DistributedError" in stalled.get("mro", ()), stalled  # it woke to a dead save
    assert waiting["latest"][0] == stalled["latest"][0] == 1
    assert case["look"]["latest"].id == 1 and case["look"]["ids"] == [1]
    assert case["look"]["verify_ok"], case["look"]["problems"]


def test_coordinator_killed_after_the_ref_advance_leaves_the_new_generation(
    failures: dict[str, Any],
) -> None:
    case = failures["after_advance"]
    outcomes = case["outcomes"]
    assert outcomes[0].exitcode == -9 and not outcomes[0].killed_by_harness, describe(outcomes)
    assert not outcomes[1].timed_out, describe(outcomes)
    look = case["look"]
    assert look["latest"].id == 2 and look["latest"].step == 20 and look["ids"] == [1, 2]
    assert look["latest"].world_size == 2
    assert look["verify_ok"], look["problems"]
    with castore.open(case["path"]) as store:  # the published generation is complete
        state = store.load("A")
    full = w.full_tensors(2)
    for name in w.TENSORS:
        assert_same_array(np.asarray(w.get_path(state, name)), full[name], name)


# -- damaged stores: every rank fails, no target changes ----------------------------------------


@pytest.fixture(scope="module")
def damaged(saved: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A copy of ``saved``: in A@1 the first chunk of "model/emb" (rows 0-3) is flipped,
    in A@2 the chunk of "model/bias"[0:5] is deleted. Restored by 4 ranks, only rank 0's
    blocks (emb rows 0-15, bias 0-9) overlap them."""
    path = tmp_path_factory.mktemp("damaged") / "store"
    shutil.copytree(saved["path"], path)
    entries = saved["entries"]
    emb_box = next(e for e in entries["A", 1]["model/emb"] if e.offsets == (0, 0))
    bias_box = next(e for e in entries["A", 2]["model/bias"] if e.offsets == (0,))
    flipped, deleted = emb_box.chunks[0], bias_box.chunks[0]
    for key, damaged_in in ((flipped, ("A", 1)), (deleted, ("A", 2))):
        users = [k for k, tensors in entries.items() for boxes in tensors.values()
                 for box in boxes if key in box.chunks]  # fmt: skip
        assert users == [damaged_in], users  # no other generation shares the chunk
    with castore.open(path) as store:
        value = store.backend.get(Namespace.CHUNKS, flipped)
        assert value is not None
        bad = bytearray(value)
        bad[5] ^= 0xFF
        store.backend.raw_put(Namespace.CHUNKS, flipped, bytes(bad))
        assert store.backend.delete_many(Namespace.CHUNKS, [deleted]) == 1
    not_emb = [name for name in w.TENSORS if name != "model/emb"]
    ops = [
        {"op": "load", "run": "A", "generation": 1, "rank_local": "drop"},  # 0: flipped chunk
        {"op": "load", "run": "A", "generation": 2, "rank_local": "drop"},  # 1: missing chunk
        {"op": "load", "run": "A", "generation": 1, "names": not_emb, "rank_local": "drop"},
        # 3: control, the same load from the undamaged store
        {"op": "load", "run": "A", "generation": 2, "rank_local": "drop", "path": saved["path"]},
    ]
    results = script_results(run_ranks(4, w.run_script, str(path), ops, timeout=LAUNCH_TIMEOUT))
    return {"results": results}


@pytest.mark.parametrize(
    ("index", "error"), [(0, "ChecksumMismatchError"), (1, "ChunkMissingError")]
)
def test_damaged_chunk_fails_every_rank_and_changes_no_target(
    damaged: dict[str, Any], index: int, error: str
) -> None:
    per_rank = op(damaged["results"], index)
    assert_all_raise(per_rank, error)
    for rank, result in enumerate(per_rank):
        # Ranks 1-3 never needed the damaged chunk: their targets are untouched all the same.
        assert all(result["unchanged"].values()), (rank, result["unchanged"])
        assert len(result["unchanged"]) == len(w.TENSORS)


def test_damage_outside_the_targets_is_never_read(damaged: dict[str, Any]) -> None:
    per_rank = op(damaged["results"], 2)
    check_restored(per_rank, seed=1)
    assert all("model/emb" not in r["boxes"] for r in per_rank)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_the_unchanged_check_sees_one_changed_element(framework: str) -> None:
    targets = w.make_targets(1, 3, list(w.TENSORS), framework)
    assert set(w.unchanged(targets, list(w.TENSORS)).values()) == {True}
    for name in w.TENSORS:
        buffer = w.target_buffer(targets, name)
        buffer.reshape(-1)[-1] = 0
        flags = w.unchanged(targets, list(w.TENSORS))
        assert not flags[name]
        buffer.reshape(-1)[-1] = w.SENTINEL
        assert all(w.unchanged(targets, list(w.TENSORS)).values())


def test_the_unchanged_check_sees_a_successful_load(damaged: dict[str, Any]) -> None:
    """Control for the test above: the same targets, loaded from the intact store, changed."""
    per_rank = op(damaged["results"], 3)
    assert_ok(per_rank)
    for result in per_rank:
        assert set(result["unchanged"].values()) == {False}, result["unchanged"]
    check_restored(per_rank, seed=2)
