"""DTensor leaves and targets in castore.dist (docs/DIST_API.md, "DTensor state").

Real FSDP2 (``fully_shard``) on CPU over gloo, in real processes
(tests/helpers/dtensor_workers.py): saved at 2 ranks, restored into fresh
sharded models at 1, 2 and 3 ranks, and by one process with ``Store.load``;
HSDP on a 2x2 mesh, whose replicas write each block once. Every restored
tensor is compared bitwise with the ``full_tensor()`` the saving ranks held.
Each DTensor's block is checked against torch's own derivation, on random
meshes (the arithmetic alone) and on the real meshes; a broken control
places blocks from the local shape alone and must fail.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dtensor_workers as w
import numpy as np
import pytest
from _helpers import assert_bitwise, rank_values
from dist_harness import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

# Torch's own derivation, private: the reference here, never in castore's code.
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as torch_block

import castore
from castore.format.dtensor import block_of, writes_block
from castore.format.layout import Box

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dtensor")]

LAUNCH_TIMEOUT = 120.0


def new_store(path: Path) -> str:
    castore.open(path, chunk_size=w.CHUNK_SIZE).close()
    return str(path)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    """Run "fsdp" saved by 2 ranks (and restored there at once; the refusals; the control)."""
    path = new_store(tmp_path_factory.mktemp("fsdp") / "store")
    return path, rank_values(run_ranks(2, w.save_fsdp, path, timeout=LAUNCH_TIMEOUT))


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    path = new_store(tmp_path_factory.mktemp("hsdp") / "store")
    return path, rank_values(run_ranks(4, w.save_hsdp, path, timeout=LAUNCH_TIMEOUT))


# -- the arithmetic ----------------------------------------------------------------------------


@st.composite
def layouts(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...], list[int | None]]:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    dims = draw(
        st.lists(
            st.sampled_from([None, *range(len(shape))]), min_size=len(mesh), max_size=len(mesh)
        )
    )
    return shape, mesh, dims


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_blocks_are_torchs_own_and_writers_tile_the_tensor_once(
    layout: tuple[tuple[int, ...], tuple[int, ...], list[int | None]],
) -> None:
    """At every coordinate of random meshes, castore's block (offsets and shape) is the one
    torch derives; the blocks of the writing replicas cover every element exactly once."""
    shape, mesh, dims = layout
    placements = [Replicate() if d is None else Shard(d) for d in dims]
    written = []
    for coordinate in np.ndindex(*mesh):
        box = block_of(shape, mesh, coordinate, dims)
        local, offsets = torch_block(shape, mesh, list(coordinate), placements)
        assert (box.shape, box.offsets) == (tuple(local), tuple(offsets)), coordinate
        if writes_block(coordinate, dims):
            written.append(box)
    assert sum(box.numel for box in written) == math.prod(shape)
    for i, a in enumerate(written):
        for b in written[i + 1 :]:
            overlap = a.intersect(b)
            assert overlap is None or overlap.numel == 0


def test_nested_sharding_of_one_dim_cuts_the_block_again() -> None:
    # 7 rows over 2, then the second half's 3 rows over 3: row 6 alone.
    assert block_of((7, 5), (2, 3), (1, 2), [0, 0]) == Box((6, 0), (1, 5))
    # One row over two ranks: the second's block is empty, at the end of the dimension.
    assert block_of((1, 7), (2,), (1,), [0]) == Box((1, 0), (0, 7))


# -- FSDP2 at 2 ranks, restored at 1, 2 and 3 --------------------------------------------------


def test_fsdp2_blocks_are_uneven_some_empty_and_torchs_own(fsdp: Any) -> None:
    _, ranks = fsdp
    assert [r["torch_differs"] for r in ranks] == [[], []]
    assert ranks[0]["local_shapes"]["model/inp.weight"] == (11, 16)
    assert ranks[1]["local_shapes"]["model/inp.weight"] == (10, 16)
    assert ranks[1]["local_shapes"]["model/scale"] == (0, 7)
    assert ranks[1]["local_shapes"]["optim/state/scale/exp_avg"] == (0, 7)
    assert [r["generation"] for r in ranks] == [1, 1]


Restored = Callable[[int], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def restored_at(fsdp: Any) -> Restored:
    """Run "fsdp" restored at a world size: each launched once (2: in the saving launch)."""
    path, ranks = fsdp
    launched: dict[int, list[dict[str, Any]]] = {2: [r["restored"] for r in ranks]}

    def at(world: int) -> list[dict[str, Any]]:
        if world not in launched:
            outcomes = run_ranks(world, w.restore_fsdp, path, timeout=LAUNCH_TIMEOUT)
            launched[world] = rank_values(outcomes)
        return launched[world]

    return at


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_saved_at_2_restores_bitwise_into_a_fresh_sharded_model(
    world: int, fsdp: Any, restored_at: Restored
) -> None:
    """Parameters and optimizer moments (full_tensor() of the live model and optimizer
    after the load) equal what the 2 saving ranks held, bit for bit; the targets changed
    (a fresh model differs) and came back as the caller's own DTensors."""
    saved = fsdp[1][0]["saved"]
    ranks = restored_at(world)
    assert len(ranks) == world
    for rank in ranks:
        assert rank["same_objects"]
        assert_bitwise(rank["after"], saved)
        assert any(
            rank["before"][name].tobytes() != saved[name].tobytes() for name in rank["before"]
        )
    # Each rank reads its own blocks (float32) and the 5 "step" scalars: at the saved
    # layout exactly those, on another layout a few chunks more where cells are cut.
    steps = sum(a.nbytes for name, a in saved.items() if name.endswith("/step"))
    slack = 0 if world == 2 else 6 * w.CHUNK_SIZE
    for rank in ranks:
        assert rank["bytes_read"] <= 4 * rank["local_numel"] + steps + slack


def test_store_load_in_one_process_gives_the_full_tensors(fsdp: Any) -> None:
    path, ranks = fsdp
    with castore.open(path) as store:
        state = store.load("fsdp", framework="torch")
    loaded = {name: tensor.numpy() for name, tensor in w.tensors(state)}
    assert_bitwise(loaded, ranks[0]["saved"])


def test_store_save_takes_a_whole_dtensor_and_refuses_a_rank_s_block(
    fsdp: Any, restored_at: Restored
) -> None:
    """One process (a 1-rank mesh): Store.save of the restored FSDP2 model holds the saved
    parameters. At 2 ranks each DTensor is one rank's block: refused, naming the key."""
    path, ranks = fsdp
    one = restored_at(1)[0]["store_save"]
    assert one == {"value": 1}
    with castore.open(path) as store:
        state = store.load("one_process", framework="torch")
    model = {k: v for k, v in ranks[0]["saved"].items() if k.startswith("model/")}
    assert_bitwise({name: t.numpy() for name, t in w.tensors(state)}, model)
    for rank in ranks:
        refused = rank["store_save"]
        assert refused["error"] == "UnsupportedValueError", refused
        assert (
            "one rank's block" in refused["message"] and "castore.dist.save" in refused["message"]
        )


def test_a_load_that_fails_on_one_rank_changes_no_rank_s_dtensors(fsdp: Any) -> None:
    """Rank 1 names a target the generation lacks: both ranks raise its error (rank 0's
    names rank 1), and every live DTensor of the model and optimizer is as it was."""
    ranks = fsdp[1]
    assert [r["fail_closed"]["error"] for r in ranks] == ["TensorNotFoundError"] * 2
    assert "failed_rank=1" in ranks[0]["fail_closed"]["message"]
    assert [rank["fail_closed"]["unchanged"] for rank in ranks] == [True, True]


# -- refusals and the broken control -----------------------------------------------------------


def test_partial_placement_is_refused_in_one_line_naming_the_key(fsdp: Any) -> None:
    path, ranks = fsdp
    for rank in ranks:
        refused = rank["partial"]
        assert refused["error"] == "UnsupportedPlacementError", refused
        assert "UnsupportedValueError" in refused["mro"]
        assert "grads/sum" in refused["message"] and "Partial(sum)" in refused["message"]
        assert "\n" not in refused["message"]
    with castore.open(path) as store:
        assert "partial" not in store.runs()


def test_a_strided_shard_of_several_runs_per_rank_is_refused(fsdp: Any) -> None:
    """Alone on its mesh, a strided shard gives each rank several runs of rows (FSDP2
    over tensor parallelism, which castore holds, is tests/test_dtensor_tp.py)."""
    for rank in fsdp[1]:
        refused = rank["strided"]
        assert refused["error"] == "UnsupportedPlacementError", refused
        assert "tp/w" in refused["message"] and "several runs" in refused["message"]
        assert "\n" not in refused["message"]


def test_broken_control_blocks_placed_without_the_mesh_coordinate_fail(fsdp: Any) -> None:
    """With offsets from the local shape alone (monkeypatched in the ranks), the save's
    boxes overlap and the coordinator publishes nothing; a load fills rank 1's blocks
    with rank 0's rows, so the restored tensors differ from the saved ones."""
    path, ranks = fsdp
    for rank in ranks:
        assert rank["broken_save"]["error"] == "CoverageError", rank["broken_save"]
        assert "overlap" in rank["broken_save"]["message"]
    with castore.open(path) as store:
        assert "broken" not in store.runs()
    saved = ranks[0]["saved"]
    restored = ranks[0]["broken_load"]["value"]
    differing = [name for name in saved if restored[name].tobytes() != saved[name].tobytes()]
    assert "model/inp.weight" in differing and "optim/state/out.weight/exp_avg" in differing


# -- HSDP: a 2x2 mesh, Replicate on one dimension -----------------------------------------------


def shard_boxes(path: str, run: str) -> tuple[list[Any], list[tuple[Any, ...]]]:
    """The shard manifests of ``run``'s latest generation, and every box they hold."""
    with castore.open(path) as store:
        _, root = store.resolve_root(run)
        shards = store.read_shards(root)
    return shards, [(e.name, e.offsets, e.local_shape) for s in shards for e in s.tensors]


def test_hsdp_replicas_write_each_block_once(hsdp: Any) -> None:
    """Ranks 2 and 3 (coordinate 1 on the Replicate mesh dimension) write no block of a
    DTensor with a Replicate placement; no box appears in two shard manifests; the
    generation's logical bytes are the state's own bytes, each counted once. The
    control, where every replica writes (a monkeypatch in the ranks), repeats boxes."""
    path, ranks = hsdp
    saved = ranks[0]["saved"]
    shards, boxes = shard_boxes(path, "hsdp")
    assert len(boxes) == len(set(boxes))
    # HSDP's (Replicate, Shard(0)) and the grid's (Replicate, Shard(1)); "/step" are plain.
    replicated = {n for n in saved if n.startswith(("model/", "optim/")) and "/step" not in n}
    replicated.add("grid/replicated_rows")
    written = [{e.name for e in shard.tensors} for shard in shards]
    assert [sorted(replicated & names) for names in written[2:]] == [[], []]
    assert written[0] >= replicated and written[1] >= replicated
    assert all("grid/nested" in names for names in written)  # no Replicate: every rank
    assert {r["every_replica_writes"] for r in ranks} == {1}
    _, every = shard_boxes(path, "hsdp_all_write")
    assert len(every) > len(set(every)) == len(boxes)
    assert {r["logical_bytes"] for r in ranks} == {sum(a.nbytes for a in saved.values())}
    assert [r["torch_differs"] for r in ranks] == [[]] * 4


def test_hsdp_restores_bitwise_and_reshards_nested_placements(hsdp: Any) -> None:
    path, ranks = hsdp
    saved = ranks[0]["saved"]
    training = {k: v for k, v in saved.items() if not k.startswith("grid/")}
    grid = {k.removeprefix("grid/"): v for k, v in saved.items() if k.startswith("grid/")}
    for rank in ranks:
        assert rank["restored"]["same_objects"]
        assert_bitwise(rank["restored"]["after"], training)
        assert_bitwise(rank["grid"], grid)
        assert rank["grid_torch_differs"] == []
    with castore.open(path) as store:
        state = store.load("hsdp", framework="torch")
    assert_bitwise({name: t.numpy() for name, t in w.tensors(state)}, saved)
