"""A state only rank 0 holds, saved from rank 0 (docs/DIST_API.md, "DTensor state").

``get_state_dict(..., options=StateDictOptions(full_state_dict=True,
cpu_offload=True))`` of a real FSDP2 MLP on CPU over gloo, in real processes
(tests/helpers/full_state_workers.py): rank 0 holds the whole model and
optimizer as plain tensors, rank 1 empty dicts. castore.dist.save writes it
from rank 0; it restores bitwise at 1, 2 and 3 ranks into fresh sharded
models, into full-state targets on rank 0 alone (then set_state_dict's
broadcast_from_rank0), and as plain dicts. A generation saved sharded
restores into rank 0's full-state targets too. Trees that disagree where
both ranks pass something are still refused; a broken control balances the
tensors over every rank as if each held them, and nothing is published.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import full_state_workers as w
import numpy as np
import pytest
from _helpers import assert_bitwise, rank_values
from dist_harness import run_ranks

import castore
from castore.dist.groupcommit import owned_tensors, prepare
from castore.dist.holders import Holding, empty_dicts
from castore.format.tree import encode_state

pytestmark = [pytest.mark.xdist_group("dtensor")]
launched = pytest.mark.slow  # the tests that start ranks

LAUNCH_TIMEOUT = 120.0


def castore_encoded(state: Any) -> bytes:
    return encode_state(state).skeleton


# -- the rule, without ranks ---------------------------------------------------------------------


def test_get_state_dict_s_empty_dicts_make_regions_rank_0_holds() -> None:
    holding = Holding.of([[], ["model", "optim"]])
    assert holding.regions == ("model", "optim") and holding.full == [0]
    assert holding.pruned == ((), ("model", "optim"))
    assert holding.region_of("model/inp.weight") == "model"
    assert holding.region_of("step") is None  # every rank holds it
    assert holding.holders("optim") == [0] and holding.holders(None) == [0, 1]


def test_an_empty_dict_every_rank_passes_or_no_rank_holds_is_just_empty() -> None:
    assert Holding.of([["a"], ["a"]]).regions == ()
    # Rank 0's "model" is empty and rank 1 passes nothing at all: nobody holds "model".
    holding = Holding.of([["model"], [""]])
    assert holding.regions == ("",) and holding.full == [0]


def test_a_region_below_another_has_the_holders_of_both() -> None:
    holding = Holding.of([[], [""], ["model"]])
    assert holding.regions == ("", "model")
    assert holding.holders("") == [0, 2] and holding.holders("model") == [0]
    assert holding.region_of("model/w") == "model" and holding.region_of("step") == ""
    assert not Holding.of([["optim"], ["model"]]).full  # each holds what the other lacks


def test_empty_dicts_are_found_at_every_depth_and_kind() -> None:
    state = {"a": {}, "b": OrderedDict(), "c": [{"d": {}}], "e": {"f": 1}}
    assert empty_dicts(castore_encoded(state)) == ["a", "b", "c/0/d"]
    assert empty_dicts(castore_encoded({})) == [""]


def test_each_tensor_of_a_region_is_owned_by_one_of_its_holders() -> None:
    """Rank 0 holds "model" alone: it owns all of it; the tensors both ranks hold are
    balanced over both."""

    def tensors(n: int) -> dict[str, np.ndarray]:
        return {f"t{i}": np.zeros(64, np.float32) for i in range(n)}

    states = [{"model": tensors(4), "both": tensors(2)}, {"model": {}, "both": tensors(2)}]
    prepared = [prepare(state, 1, None, None, 1024) for state in states]
    holding = Holding.of([p.empties for p in prepared])
    owned = [owned_tensors(p, holding, [0, 0], rank) for rank, p in enumerate(prepared)]
    assert {f"model/t{i}" for i in range(4)} <= owned[0]
    assert not any(name.startswith("model/") for name in owned[1])
    assert sorted(n for o in owned for n in o if n.startswith("both/")) == ["both/t0", "both/t1"]
    assert all(any(n.startswith("both/") for n in o) for o in owned)


# -- on ranks ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    """Runs "full" (from rank 0's full state) and "sharded" saved by 2 ranks."""
    path = tmp_path_factory.mktemp("full") / "store"
    castore.open(path, chunk_size=w.CHUNK_SIZE).close()
    return str(path), rank_values(run_ranks(2, w.save_full, str(path), timeout=LAUNCH_TIMEOUT))


@pytest.fixture(scope="module")
def restored_at(saved: Any) -> Any:
    launched: dict[int, list[dict[str, Any]]] = {}

    def at(world: int) -> list[dict[str, Any]]:
        if world not in launched:
            outcomes = run_ranks(world, w.restore_full, saved[0], timeout=LAUNCH_TIMEOUT)
            launched[world] = rank_values(outcomes)
        return launched[world]

    return at


@launched
def test_rank_0_alone_holds_the_full_state_and_it_is_published(saved: Any) -> None:
    path, ranks = saved
    held = ranks[0]["held"]
    assert not ranks[0]["empty"] and ranks[1]["empty"]
    assert "model/inp.weight" in held and "optim/state/inp.weight/exp_avg" in held
    assert [r["generation"] for r in ranks] == [1, 1]
    assert ranks[0]["logical_bytes"] == sum(a.nbytes for a in held.values())
    with castore.open(path) as store:  # one process, no group: the holder's tree, whole
        state = store.load("full", framework="torch")
        assert set(state) == {"model", "optim"}
        assert state["optim"]["param_groups"][0]["params"]
        shards = store.read_shards(store.resolve_root("full")[1])
    assert_bitwise(w.plain_arrays(state), held)
    assert [len(s.tensors) for s in shards] == [len(held), 0]  # each tensor whole, by rank 0


@launched
@pytest.mark.parametrize("world", [1, 2, 3])
def test_full_state_restores_bitwise_into_fresh_sharded_models(
    world: int, saved: Any, restored_at: Any
) -> None:
    """Each rank fills its DTensors' blocks from the whole tensors rank 0 wrote, and
    reads no more than its blocks (and the chunk cells they cut)."""
    expected = saved[1][0]["sharded_saved"]
    ranks = restored_at(world)
    steps = sum(a.nbytes for name, a in expected.items() if name.endswith("/step"))
    for rank in ranks:
        got = rank["sharded_targets"]
        assert got["same_objects"]
        assert_bitwise(got["after"], expected)
        assert got["bytes_read"] <= 4 * got["local_numel"] + steps + 6 * w.CHUNK_SIZE
    if world > 1:
        total = sum(a.nbytes for a in expected.values())
        assert all(rank["sharded_targets"]["bytes_read"] < total for rank in ranks)


@launched
@pytest.mark.parametrize("world", [1, 2, 3])
def test_full_state_restores_into_rank_0_then_broadcasts(
    world: int, saved: Any, restored_at: Any
) -> None:
    """Targets on rank 0 alone, ``{}`` elsewhere: rank 0 reads it all, the others nothing;
    set_state_dict(broadcast_from_rank0=True) gives every rank the saved model."""
    held, expected = saved[1][0]["held"], saved[1][0]["sharded_saved"]
    ranks = restored_at(world)
    assert_bitwise(ranks[0]["rank0_only"]["loaded"], held)
    for rank, result in enumerate(ranks):
        assert_bitwise(result["rank0_only"]["after"], expected)
        if rank:
            assert result["rank0_only"]["loaded"] == {}
            assert result["rank0_only"]["bytes_read"] == 0


@launched
@pytest.mark.parametrize("world", [1, 3])
def test_the_plain_full_state_dicts_round_trip(world: int, saved: Any, restored_at: Any) -> None:
    """Model and optimizer as get_state_dict gave them: read whole by rank 0 alone
    (``load_rest``), or into full-state targets on every rank."""
    held = saved[1][0]["held"]
    ranks = restored_at(world)
    assert_bitwise(ranks[0]["load_rest"]["loaded"], held)
    assert all(r["load_rest"]["loaded"] == {} for r in ranks[1:])
    for rank in ranks:
        assert_bitwise(rank["whole_everywhere"]["loaded"], held)


@launched
@pytest.mark.parametrize("world", [1, 2])
def test_a_generation_saved_sharded_restores_into_rank_0_s_full_state(
    world: int, saved: Any, restored_at: Any
) -> None:
    expected = saved[1][0]["sharded_saved"]
    ranks = restored_at(world)
    assert_bitwise(ranks[0]["reverse"]["loaded"], saved[1][0]["held"])
    for rank in ranks:
        assert_bitwise(rank["reverse"]["after"], expected)


@launched
def test_a_coordinator_that_holds_nothing_publishes_the_holder_s_tree(saved: Any) -> None:
    path, ranks = saved
    assert [r["coordinator_1"] for r in ranks] == [1, 1]
    with castore.open(path) as store:
        assert_bitwise(w.plain_arrays(store.load("coord1", framework="torch")), ranks[0]["held"])


@launched
def test_an_async_save_of_such_a_state_is_refused_for_now(saved: Any) -> None:
    _, ranks = saved
    for rank in ranks:
        assert rank["async"].get("error") == "UnsupportedValueError", rank["async"]
        assert "blocking=True" in rank["async"]["message"]
    assert [r["async_ref"] for r in ranks] == [None, None]


@launched
def test_trees_that_disagree_where_both_ranks_pass_something_are_refused(saved: Any) -> None:
    """One line on every rank naming the key and the ranks; run "full" still at 1."""
    _, ranks = saved
    expected = {
        "shape": ("LayoutMismatchError", ["rank 1", "'model/w'", "rank 0", "float32[4]"]),
        "beside_empty": ("LayoutMismatchError", ["rank 1", "'extra/x'", "float32[4]"]),
        "stray": ("LayoutMismatchError", ["rank 1", "'stray'", "no tensor"]),
        "split": ("LayoutMismatchError", ["no rank passes the whole state", "'optim'"]),
        "not_a_dict": ("LayoutMismatchError", ["rank 0 passes no dict at 'model'", "rank 1"]),
    }
    for case, (error, words) in expected.items():
        for rank in ranks:
            got = rank["refusals"][case]
            assert got.get("error") == error, (case, got)
            assert "\n" not in got["message"]
            for word in words:
                assert word in got["message"], (case, word, got["message"])
    assert [r["after_refusals"] for r in ranks] == [1, 1]


@launched
def test_broken_control_balancing_over_every_rank_publishes_nothing(saved: Any) -> None:
    """Balanced as if every rank held each tensor, rank 1 owns tensors it does not have:
    nobody writes them, the coordinator's check names them missing."""
    _, ranks = saved
    for rank in ranks:
        assert rank["broken"].get("error") in ("LayoutMismatchError", "RankFailedError")
    assert "missing" in ranks[0]["broken"]["message"]
    assert [r["broken_ref"] for r in ranks] == [None, None]
