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

from pathlib import Path

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


@pytest.mark.parametrize("mode", ["targets", "rest"])
def test_onto_the_saved_layout_each_rank_reads_two_manifests(saved: str, mode: str) -> None:
    """Every tensor a target, or the rest through a load_rest callable (as
    TrainState restores optimizer moments): two manifests a rank, though the
    replicated values were written by ranks 1 to 3 (the root repeats them)."""
    ranks = rank_values(run_ranks(4, w.restore, saved, mode, timeout=TIMEOUT))
    assert [r["manifests"] for r in ranks] == [1, 2, 2, 2]  # rank 0: its own is rank 0's
    assert [r["resharded"] for r in ranks] == [0, 0, 0, 0]
    for r in ranks:
        assert_bitwise(r["got"], r["expected"])


def test_the_replicated_values_were_written_by_other_ranks_and_the_root_repeats_them(
    saved: str,
) -> None:
    import castore

    with castore.open(saved) as store:
        _, root = store.resolve_root("run")
        shards = store.read_shards(root)
    writers = {e.name: s.rank for s in shards for e in s.tensors if e.name in w.REPLICATED}
    assert sorted(writers) == sorted(w.REPLICATED) and set(writers.values()) - {0}
    assert sorted(e.name for e in root.whole) == sorted(w.REPLICATED)


def test_whole_state_targets_for_sharded_tensors_read_every_manifest(saved: str) -> None:
    """load_rest=True reads each untargeted tensor whole: the sharded ones are no saved
    box, so the rank reads all four manifests."""
    ranks = rank_values(run_ranks(4, w.restore, saved, "rest-whole", timeout=TIMEOUT))
    assert [r["manifests"] for r in ranks] == [4] * 4
    for r in ranks:
        assert_bitwise(r["got"], r["expected"])


@pytest.mark.parametrize("world", [2, 3])
def test_onto_another_layout_each_rank_reads_every_manifest(saved: str, world: int) -> None:
    ranks = rank_values(run_ranks(world, w.restore, saved, timeout=TIMEOUT))
    assert [r["manifests"] for r in ranks] == [4] * world
    assert all(r["resharded"] == len(w.SHAPES) for r in ranks)  # the replicated: saved boxes
    for r in ranks:
        assert_bitwise(r["got"], r["expected"])


def test_broken_control_a_direct_path_that_takes_any_box_misses_rows(saved: str) -> None:
    ranks = rank_values(run_ranks(2, w.restore, saved, "broken", timeout=TIMEOUT))
    assert [r["manifests"] for r in ranks] == [1, 2]  # it stopped at the two manifests
    with pytest.raises(AssertionError):
        for r in ranks:
            assert_bitwise(r["got"], r["expected"])


def test_verify_names_a_root_whose_whole_entries_are_not_the_shards(
    saved: str, tmp_path: Path
) -> None:
    """The root's copies of the small tensors' entries must be the shard manifests':
    a root that says "scale" is float32 where its shard says float64 is a problem."""
    import shutil

    from hostile import latest_wires, publish_forged

    import castore
    from castore.verify import verify_store

    copy = tmp_path / "store"
    shutil.copytree(saved, copy)
    with castore.open(copy) as store:
        assert verify_store(store).ok
        _, root, shards = latest_wires(store, "run")
        whole = root["whole"]
        at = whole["name"].index("scale")
        kind = whole["kind"][at]
        whole["kinds"].append(["float32", *whole["kinds"][kind][1:]])
        whole["kind"] = (
            whole["kind"][:at] + bytes([len(whole["kinds"]) - 1]) + whole["kind"][at + 1 :]
        )
        forged = publish_forged(store, "run", root, shards, layout="compact")
        report = verify_store(store)
    assert [p.generation for p in report.problems] == [forged]
    assert "the root's entry of tensor 'scale' is not the shards' entry" in str(report.problems)
