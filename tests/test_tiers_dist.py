"""castore.dist on a tiered store: real gloo ranks of one node sharing its fast tier.

Four ranks save three generations through ``castore.dist.save`` on handles of
``castore.open_tiered`` (one fast directory, the node's; the durable tier a
shared directory). The coordinator promotes every second generation and, at
close, the newest. Then the fast tier is wiped (the node is replaced) and two
and three ranks restore from what is left: every box bitwise, every chunk
from the durable tier.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import dist_workers as w
import numpy as np
import pytest
from dist_harness import run_ranks
from test_dist import script_results

import castore
from castore.verify import verify_store

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tiers-dist")]

SEED = 3
# At another rank count a rank's own values (RankLocal) have no owner: dropped.
RESHARD_LOAD = {"op": "load", "run": "r", "rank_local": "drop"}


def tiered(tmp: Path) -> dict[str, Any]:
    return {
        "fast": str(tmp / "fast"),
        "durable": str(tmp / "durable"),
        "durable_every": 2,
        "chunk_size": 256,
    }


def assert_bitwise(per_rank: list[dict[str, Any]]) -> None:
    """Each rank's boxes hold exactly its block of the saved tensors."""
    full = w.full_tensors(SEED)
    for rank, result in enumerate(per_rank):
        assert "error" not in result, result
        for name, (offsets, block) in result["boxes"].items():
            where = tuple(slice(o, o + s) for o, s in zip(offsets, block.shape, strict=True))
            assert block.tobytes() == full[name][where].tobytes(), (name, rank)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tiers-dist")
    castore.open(tmp / "durable", shared=True).close()
    ops = [{"op": "save", "run": "r", "seed": SEED, "step": step} for step in (10, 20, 30)]
    ops.append({"op": "load", "run": "r"})
    results = script_results(run_ranks(4, w.run_script, tiered(tmp), ops, timeout=240), 4)
    return {"tmp": tmp, "results": results}


def test_ranks_save_in_the_fast_tier_and_the_coordinator_promotes(saved: dict[str, Any]) -> None:
    tmp = saved["tmp"]
    for index, gen_id in enumerate((1, 2, 3)):
        generations = [per_rank[index]["generation"] for per_rank in saved["results"]]
        assert {g.id for g in generations} == {gen_id}
    assert_bitwise([per_rank[3] for per_rank in saved["results"]])
    served = [per_rank[3]["report"]["bytes_by_source"] for per_rank in saved["results"]]
    assert all(set(s) == {"fast"} for s in served), served  # all from the node's fast tier
    with castore.open(tmp / "durable") as durable:
        assert [g.id for g in durable.generations("r")] == [2, 3]  # every 2nd, then the last
        assert verify_store(durable, deep=True).ok
    with castore.open(tmp / "fast") as fast:
        assert [g.id for g in fast.generations("r")] == [2, 3]  # fast_keep=2
        assert verify_store(fast, deep=True).ok


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_replaced_node_restores_from_the_durable_tier_at_another_rank_count(
    saved: dict[str, Any], ranks: int, tmp_path: Path
) -> None:
    node = tmp_path / "node"
    shutil.copytree(saved["tmp"] / "durable", node / "durable")  # fast tier: none
    results = script_results(
        run_ranks(ranks, w.run_script, tiered(node), [RESHARD_LOAD], timeout=240),
        ranks,
    )
    per_rank = [r[0] for r in results]
    assert all("error" not in r for r in per_rank), per_rank[0].get("error")
    assert {r["report"]["generation"].id for r in per_rank} == {3}
    assert_bitwise(per_rank)
    with castore.open(node / "fast") as fast:
        report = verify_store(fast)
        assert report.ok and report.held_elsewhere == [("r", 3)]
    assert not np.any([r["report"]["bytes_read"] == 0 for r in per_rank])
    # Every byte came from the durable tier: the fast one was wiped.
    sources = [r["report"]["bytes_by_source"] for r in per_rank]
    assert all(set(s) == {"durable"} for s in sources), sources
