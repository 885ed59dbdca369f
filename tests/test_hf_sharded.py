"""A Hugging Face base into a sharded model without any rank holding it all.

A safetensors file is imported (``castore import``), then 1, 2 and 3 real gloo
ranks each load it into a fresh ``fully_shard`` model with
``castore.train.load_weights(..., prefix="")``
(tests/helpers/hf_sharded_workers.py). Every parameter equals the file's,
bitwise, and each rank reads about its own share of the bytes: at N ranks at
most 1/N of the file plus a chunk per tensor boundary. The broken control
loads into a model that is not sharded: every rank reads the whole file.
"""

from __future__ import annotations

from typing import Any

import hf_sharded_workers as w
import pytest
from dist_harness import describe, run_ranks
from safetensors.torch import save_file

import castore
from castore.importer import import_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dtensor")]

CHUNK_SIZE = 1024  # a store whose chunks are small against the tensors (64 KiB cells
# and 4 MiB chunks against tensors of megabytes, scaled down)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], int]:
    tmp = tmp_path_factory.mktemp("hf")
    state = w.base_state()
    save_file(state, tmp / "model.safetensors")
    path = str(tmp / "store")
    with castore.open(path, chunk_size=CHUNK_SIZE) as store:
        report = import_checkpoint(store, "base", tmp / "model.safetensors")
    assert report.tensors == len(state)
    file_bytes = sum(t.numel() * t.element_size() for t in state.values())
    return path, {name: t.numpy() for name, t in state.items()}, file_bytes


def outcomes(world: int, path: str, sharded: bool = True) -> list[dict[str, Any]]:
    ranks = run_ranks(world, w.load_base, path, sharded, timeout=120.0)
    assert all(o.ok for o in ranks), describe(ranks)
    return [o.value for o in ranks]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_reads_its_own_rows_of_an_imported_base(
    world: int, base: tuple[str, dict[str, Any], int]
) -> None:
    path, expected, file_bytes = base
    ranks = outcomes(world, path)
    for rank in ranks:
        assert rank["tensors"] == len(expected)
        for name, array in expected.items():
            assert rank["whole"][name].tobytes() == array.tobytes(), name
        # Its own shards' bytes, and at most a partial chunk at each end of each box.
        assert rank["bytes_read"] <= rank["local_bytes"] + 2 * len(expected) * CHUNK_SIZE
    assert sum(r["bytes_read"] for r in ranks) <= file_bytes + 2 * world * len(expected) * (
        CHUNK_SIZE
    )
    if world == 3:
        assert max(r["bytes_read"] for r in ranks) < 0.45 * file_bytes


def test_broken_control_an_unsharded_model_reads_the_whole_file_on_every_rank(
    base: tuple[str, dict[str, Any], int],
) -> None:
    path, expected, file_bytes = base
    for rank in outcomes(3, path, sharded=False):
        assert rank["bytes_read"] == file_bytes
        assert all(rank["whole"][n].tobytes() == a.tobytes() for n, a in expected.items())
