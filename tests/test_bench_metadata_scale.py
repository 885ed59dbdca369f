"""benchmarks/bench_metadata_scale.py stays runnable, and measures what it says.

No timings are asserted (docs/SCALE.md has the figures). Its ``--small`` run
must write a row per layout and size; the manifests it builds must be what a
writer builds (they decode, group and pass the coverage check, and a restoring
rank plans one request per chunk of its own box); the broken control, one box
moved onto its neighbour, must fail the coverage check it times.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_metadata_scale as bench  # noqa: E402  (benchmarks/ is not a package)

from castore.core.reading import check_coverage, group_entries  # noqa: E402
from castore.errors import CoverageError  # noqa: E402
from castore.format.objects import TensorEntry, decode_object, encode_object  # noqa: E402


def test_small_run_writes_a_row_per_layout_and_size(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    assert bench.main(["--small", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layout"], r["ranks"]) for r in rows] == [
        (layout, ranks) for layout in ("fsdp", "tp", "hsdp") for ranks in (16, 64)
    ]
    for row in rows:
        assert row["boxes"] == row["ranks"] * 10
        assert row["requests_per_tensor"] >= 1
        assert 0 < row["manifest_bytes_per_box"] < 1024
        assert all(seconds >= 0 for seconds in row["seconds"].values())


@pytest.mark.parametrize("layout", ["fsdp", "tp", "hsdp"])
def test_the_manifests_are_a_writers_and_tile_each_tensor(layout: str) -> None:
    shards = [decode_object(encode_object(s)) for s in bench.manifests(layout, 8, 3)]
    entries = group_entries(shards, bench.WHERE)
    assert sorted(entries) == [f"layers.{t}.weight" for t in range(3)]
    for boxes in entries.values():
        assert len(boxes) == (4 if layout == "hsdp" else 8)  # replicas count once
        check_coverage(boxes, bench.WHERE)


def test_broken_control_a_moved_box_fails_the_coverage_check() -> None:
    shards = bench.manifests("fsdp", 8, 1)
    moved = shards[3].tensors[0]  # rows 12-15, moved up 2 rows onto rank 2's 8-11
    tensors = (
        TensorEntry.trusted(
            moved.name, moved.dtype, moved.shape, (10, 0), moved.local_shape, moved.nbytes,
            moved.chunk_size, moved.chunks, moved.framework, moved.cell,
        ),
    )  # fmt: skip
    shards[3] = dataclasses.replace(shards[3], tensors=tensors)
    entries = group_entries(shards, bench.WHERE)
    with pytest.raises(CoverageError, match="overlap"):
        check_coverage(entries["layers.0.weight"], bench.WHERE)
