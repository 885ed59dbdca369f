"""castore.dist on stores laid out as blobs: a shared directory and S3 (moto).

Each rank is a node: its own process and its own index cache directory, no
LMDB shared between ranks (tests/helpers/dist_blob_workers.py). Per backend, one
launch of 4 ranks saves run P twice (the second time with every tenth row of
``big/rows`` changed) and restores it at 4; then each rank moves to another
node (a new store handle with a cold index cache of its own) and subgroups of
2 and 3 ranks restore generation 2, and generation 1 at 3.

Restores must be bitwise; for ``big/rows``, whose boxes are whole chunks at
4, 2 and 3 ranks, the ranged requests must fetch the needed chunks and
nothing else, and at most 1% more bytes than those chunks hold (a pack's
record headers, 40 bytes per chunk, come along when neighbours share a
request). The re-save must store only the changed rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dist_blob_workers as b
import dist_workers as w
import numpy as np
import pytest
from dist_harness import RankOutcome, describe, run_ranks
from s3_server import REGION, s3_client, store_arguments

import castore
from castore.verify import verify_store

# One worker runs the module: its module-scoped fixtures are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dist_blobs")]

LAUNCH_TIMEOUT = 150.0
ALL_NAMES = [*w.TENSORS, b.ALIGNED]
FETCH_SLACK = 1.01  # bytes fetched over chunk bytes needed

SAVE_OPS: list[dict[str, Any]] = [
    {"op": "save", "run": "P", "seed": 1, "step": 10},  # 0
    {"op": "stored"},  # 1
    {"op": "save", "run": "P", "seed": 1, "step": 20, "changed_seed": 5},  # 2
    {"op": "stored"},  # 3
    {"op": "load", "run": "P", "names": ALL_NAMES, "rank_local": "same"},  # 4: 4 -> 4
]
RESTORE_OPS: list[dict[str, Any]] = [
    # 6, 7: generation 2 at 2 ranks (global ranks 0 and 1)
    {"op": "load", "run": "P", "names": ALL_NAMES, "rank_local": "drop", "group": [0, 1]},
    {"op": "load", "run": "P", "names": [b.ALIGNED], "rank_local": "drop", "group": [0, 1]},
    # 8, 9: generation 2 at 3 ranks (uneven boxes)
    {"op": "load", "run": "P", "names": ALL_NAMES, "rank_local": "drop", "group": [0, 1, 2]},
    {"op": "load", "run": "P", "names": [b.ALIGNED], "rank_local": "drop", "group": [0, 1, 2]},
    # 10: generation 1 at 3 ranks, after the re-save
    {
        "op": "load",
        "run": "P",
        "names": [b.ALIGNED],
        "rank_local": "drop",
        "generation": 1,
        "group": [0, 1, 2],
    },
]


def _results(outcomes: list[RankOutcome]) -> list[list[Any]]:
    assert all(o.ok for o in outcomes), describe(outcomes)
    return [o.value for o in outcomes]


def _op(results: list[list[Any]], index: int) -> list[Any]:
    """Op ``index``'s result on every rank that ran it (not on those outside its group)."""
    found = [per_rank[index] for per_rank in results]
    return [x for x in found if x is not None and not x.get("skipped")]


def _location(kind: str, tmp: Path, endpoint: str | None) -> tuple[str, dict[str, Any]]:
    """Where the store lives and the options every node opens it with."""
    if kind == "shared":
        return str(tmp / "shared-store"), {"shared": True}
    assert endpoint is not None
    bucket = f"castore-dist-{tmp.name.lower().replace('_', '-')}"[:63]
    s3_client(endpoint).create_bucket(Bucket=bucket)
    arguments = store_arguments(endpoint)
    options = {
        "endpoint_url": endpoint,
        "region": REGION,
        "s3_options": {
            "access_key": arguments["access_key"],
            "secret_key": arguments["secret_key"],
        },
    }
    return f"s3://{bucket}/stores/dist", options


@pytest.fixture(scope="module", params=["shared", "s3"])
def blob_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"dist-{kind}")
    endpoint = request.getfixturevalue("s3_endpoint") if kind == "s3" else None
    location, options = _location(kind, tmp, endpoint)
    castore.open(location, chunk_size=b.CHUNK_SIZE, cache_dir=tmp / "parent", **options).close()
    nodes = {**options, "cache_root": str(tmp / "save-nodes")}
    # Op 5: every rank moves to another node (a new handle, a cold index cache).
    ops = [*SAVE_OPS, {"op": "move", "cache_root": str(tmp / "restore-nodes")}, *RESTORE_OPS]
    results = _results(run_ranks(4, b.node_script, location, nodes, ops, timeout=LAUNCH_TIMEOUT))
    with castore.open(location, cache_dir=tmp / "parent", **options) as store:
        report = verify_store(store, deep=True)
        ids = [g.id for g in store.generations("P")]
    return {
        "kind": kind,
        "results": results,
        "verify": (report.ok, [str(p) for p in report.problems]),
        "ids": ids,
        "cache_dirs": [
            sorted(p.name for p in (tmp / nodes).iterdir())
            for nodes in ("save-nodes", "restore-nodes")
        ],
    }


def _assert_bitwise(per_rank: list[dict[str, Any]], seed: int, changed: int | None) -> None:
    """Each rank's boxes hold exactly its block; the blocks tile every sharded tensor once."""
    full = {**w.full_tensors(seed), b.ALIGNED: b.big_rows(seed, changed)}
    for name in per_rank[0]["boxes"]:
        rebuilt = np.zeros_like(full[name])
        written = np.zeros(full[name].shape, dtype=np.int64)
        for rank, result in enumerate(per_rank):
            offsets, block = result["boxes"][name]
            where = tuple(slice(o, o + s) for o, s in zip(offsets, block.shape, strict=True))
            expected = full[name][where]
            assert block.dtype == expected.dtype and block.shape == expected.shape, (name, rank)
            assert block.tobytes() == expected.tobytes(), f"{name} on rank {rank}/{len(per_rank)}"
            rebuilt[where] = block
            written[where] += 1
        if name == b.ALIGNED or w.TENSORS[name][2] is not None:
            assert (written == 1).all(), f"{name}: the boxes do not tile the tensor"
            assert rebuilt.tobytes() == full[name].tobytes(), name


def _assert_fetches_only_the_needed_chunks(per_rank: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(per_rank):
        offsets, block = result["boxes"][b.ALIGNED]
        # The premise: the box is whole chunks, so its bytes are the chunk bytes needed.
        assert offsets[0] * block.shape[1] * 4 % b.CHUNK_SIZE == 0
        needed = block.nbytes
        assert needed % b.CHUNK_SIZE == 0 and needed == result["bytes_needed"]
        # Stores on blobs compress (codec "auto"): a restore fetches the needed chunks'
        # frames, whole, and nothing else; never more than their raw bytes.
        stored = result["stored_needed"]
        assert 0 < stored <= needed, (rank, stored, needed)
        fetch = result["fetch"]
        assert fetch["chunk_bytes"] == stored, (rank, fetch, stored)
        assert stored <= fetch["bytes"] <= FETCH_SLACK * stored, (rank, fetch, stored)
        assert fetch["requests"] >= 1


def test_four_ranks_save_one_generation_each_time(blob_runs: dict[str, Any]) -> None:
    for index, (gen_id, step) in ((0, (1, 10)), (2, (2, 20))):
        generations = [r["generation"] for r in _op(blob_runs["results"], index)]
        assert len({g.root for g in generations}) == 1, generations
        assert generations[0].id == gen_id and generations[0].step == step
        assert generations[0].world_size == 4
    assert blob_runs["ids"] == [1, 2]
    assert blob_runs["verify"] == (True, [])
    assert blob_runs["cache_dirs"] == [["node0", "node1", "node2", "node3"]] * 2


@pytest.mark.parametrize(
    ("index", "ranks", "generation"),
    [(4, 4, 2), (6, 2, 2), (8, 3, 2)],
    ids=["4->4", "4->2", "4->3"],
)
def test_restore_is_bitwise_at_another_rank_count(
    blob_runs: dict[str, Any], index: int, ranks: int, generation: int
) -> None:
    per_rank = _op(blob_runs["results"], index)
    assert len(per_rank) == ranks
    assert {r["generation"] for r in per_rank} == {generation}
    _assert_bitwise(per_rank, seed=1, changed=5)
    for rank, result in enumerate(per_rank):
        if index == 4:  # RankLocal "same": each rank its own value back
            expected_bytes, cursor = w.rank_local_value(1, rank)
            assert result["rank_local"]["cursor"] == cursor
            assert np.asarray(result["rank_local"]["state"]).tobytes() == expected_bytes.tobytes()
        else:
            assert result["rank_local"] is None


@pytest.mark.parametrize(
    ("index", "ranks", "changed"),
    [(7, 2, 5), (9, 3, 5), (10, 3, None)],
    ids=["4->2", "4->3", "4->3 generation 1"],
)
def test_restore_fetches_at_most_one_percent_over_the_needed_chunk_bytes(
    blob_runs: dict[str, Any], index: int, ranks: int, changed: int | None
) -> None:
    per_rank = _op(blob_runs["results"], index)
    assert len(per_rank) == ranks
    _assert_bitwise(per_rank, seed=1, changed=changed)
    _assert_fetches_only_the_needed_chunks(per_rank)


def test_a_ten_percent_change_stores_only_the_changed_rows(blob_runs: dict[str, Any]) -> None:
    changed_bytes = len(b.changed_rows()) * b.CHUNK_SIZE
    total = b.ROWS * b.CHUNK_SIZE
    assert 0.09 < changed_bytes / total < 0.11  # the premise: about 10% of big/rows
    first, second = _op(blob_runs["results"], 0)[0], _op(blob_runs["results"], 2)[0]
    assert second["generation"].new_bytes == changed_bytes
    assert second["generation"].logical_bytes == first["generation"].logical_bytes
    before, after = _op(blob_runs["results"], 1)[0], _op(blob_runs["results"], 3)[0]
    # Stored as frames (a store on blobs compresses): the changed chunks, compressed.
    stored = second["generation"].stats.stored_bytes
    assert 0.5 * changed_bytes < stored < changed_bytes
    assert after["chunks"] - before["chunks"] == stored
    # Pack bytes: the changed chunks plus a header per pack and per record.
    assert stored <= after["packs"] - before["packs"] <= 1.05 * stored


def test_the_fetch_check_fails_when_other_chunks_are_fetched(blob_runs: dict[str, Any]) -> None:
    # A broken control: the same check on a restore that also read every other tensor.
    per_rank = _op(blob_runs["results"], 8)
    with pytest.raises(AssertionError):
        _assert_fetches_only_the_needed_chunks(per_rank)
