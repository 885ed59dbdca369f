"""A restore onto the saved layout reads its own shard manifest (and rank 0's), not
all R: the coordinator checked before the publish that every tensor's boxes tile it
once, so a saved box equal to a rank's target is its only source. Any other layout
reads every manifest and searches them.

Real gloo ranks (tests/helpers/direct_workers.py). Broken control: a direct path
that takes whatever boxes it finds in the two manifests as the whole source,
restoring 4 ranks' save onto 2, leaves rows unread, and the bitwise check
catches it.
"""

from __future__ import annotations

import direct_workers as w
import pytest
from _helpers import assert_bitwise, rank_values
from dist_harness import run_ranks

TIMEOUT = 120


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("direct") / "store")
    assert rank_values(run_ranks(4, w.save, path, timeout=TIMEOUT)) == [1, 1, 1, 1]
    return path


def test_onto_the_saved_layout_each_rank_reads_two_manifests(saved: str) -> None:
    ranks = rank_values(run_ranks(4, w.restore, saved, timeout=TIMEOUT))
    assert [r["manifests"] for r in ranks] == [1, 2, 2, 2]  # rank 0: its own is rank 0's
    assert [r["resharded"] for r in ranks] == [0, 0, 0, 0]
    for r in ranks:
        assert_bitwise(r["got"], r["expected"])


@pytest.mark.parametrize("world", [2, 3])
def test_onto_another_layout_each_rank_reads_every_manifest(saved: str, world: int) -> None:
    ranks = rank_values(run_ranks(world, w.restore, saved, timeout=TIMEOUT))
    assert [r["manifests"] for r in ranks] == [4] * world
    assert all(r["resharded"] == len(w.SHAPES) for r in ranks)
    for r in ranks:
        assert_bitwise(r["got"], r["expected"])


def test_broken_control_a_direct_path_that_takes_any_box_misses_rows(saved: str) -> None:
    ranks = rank_values(run_ranks(2, w.restore, saved, True, timeout=TIMEOUT))
    assert [r["manifests"] for r in ranks] == [1, 2]  # it stopped at the two manifests
    with pytest.raises(AssertionError):
        for r in ranks:
            assert_bitwise(r["got"], r["expected"])
