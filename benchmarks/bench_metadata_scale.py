"""The coordinator's and a restoring rank's metadata work at 16 to 10,000 ranks, without ranks.

Run from the repository root::

    .venv/bin/python benchmarks/bench_metadata_scale.py [--ranks 16,128,1024]
        [--tensors 10,100,1024] [--layouts fsdp,tp,hsdp] [--sample 8] [--repeats 3]
        [--json [OUT]] [--small]

Synthetic shard manifests stand in for R ranks' saves of T tensors, built as
castore's writers build them (real ``TensorEntry`` objects on the tensor's
chunk grid, one 32-byte digest per chunk), and go through castore's own
code, timed on one core (one process, no threads):

  encode    one rank encodes its shard manifest (``encode_object``)
  decode    the coordinator decodes the R manifests (``decode_object``)
  group     their boxes grouped by tensor, replicas once, as columns
            (``grouped_entries``: castore.core.boxtable, no object per box)
  coverage  every tensor's boxes checked to tile it once (``BoxTable.check``)
  names     the skeleton's tensors against the shards' (``check_names``)
  root      the root built and encoded (``make_root``, ``encode_object``)
  plan      one restoring rank onto the same layout (``castore.dist.planning``'s
            ``plan_restore`` and ``chunk_requests``): it decodes its own manifest
            and rank 0's and plans its T targets from them; "resharding": the
            same rank planning as any other layout does, decoding all R manifests

Layouts: ``fsdp`` (each rank a block of rows of every tensor, 4 rows of a
(4R, 1024) fp32 tensor), ``tp`` (FSDP over 8-way tensor parallelism: blocks
of 4 rows x 128 columns of (4R/8, 1024)) and
``hsdp`` (two replica groups of R/2 ranks, each holding blocks of 8 rows;
identical boxes count once). Where the per-entry path is taken (shards
without tables), its per-tensor phases are timed on ``--sample`` tensors and
scaled by T/sample (such rows say "extrapolated"). Also reported: manifest bytes per box beyond its
chunk digests, and the root's bytes. Prints a table; ``--json`` writes
``benchmarks/results/metadata-scale.json`` (or OUT).

It does not count the collectives, the store requests or the bytes moved: the
model of scale (docs/SCALE.md) counts those. Issue 40's goals, for 1,024
ranks x 1,024 tensors: coverage at most 1 s, the coordinator's whole path at
most 5 s, a rank's planning at most 0.5 s, at most 64 bytes of manifest per
box beyond its digests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from castore.core.boxtable import BoxTable  # noqa: E402
from castore.core.commit import check_names, make_root  # noqa: E402
from castore.core.reading import check_coverage, grouped_entries  # noqa: E402
from castore.dist import planning  # noqa: E402
from castore.format.grid import box_chunk_count, writer_cell  # noqa: E402
from castore.format.layout import Box  # noqa: E402
from castore.format.objects import (  # noqa: E402
    ShardManifest,
    TensorEntry,
    decode_object,
    encode_object,
)
from castore.format.shard import Shard  # noqa: E402
from castore.format.tree import encode_state  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "metadata-scale.json"
CHUNK_SIZE = 4 << 20
ITEMSIZE = 4  # float32
WIDTH = 1024
TP = 8  # the tensor-parallel degree of the "tp" layout
RUN = "scale"
WHERE = {"run": RUN, "generation": 1}


def boxes_of(layout: str, ranks: int) -> tuple[tuple[int, int], list[Box]]:
    """A tensor's global shape and each rank's box of it (rank order)."""
    if layout == "fsdp":
        shape = (4 * ranks, WIDTH)
        return shape, [Box((4 * r, 0), (4, WIDTH)) for r in range(ranks)]
    if layout == "tp":
        # FSDP over 8-way tensor parallelism of a row-parallel weight: tp cuts columns,
        # FSDP rows (2-D blocks of 4 rows x 128 columns).
        tp = min(TP, ranks)
        groups = ranks // tp
        shape = (4 * groups, WIDTH)
        cols = WIDTH // tp
        return shape, [Box((4 * (r // tp), cols * (r % tp)), (4, cols)) for r in range(ranks)]
    if layout == "hsdp":
        group = max(ranks // 2, 1)
        shape = (8 * group, WIDTH)
        return shape, [Box((8 * (r % group), 0), (8, WIDTH)) for r in range(ranks)]
    raise ValueError(f"unknown layout {layout!r}")


def digest(index: int) -> bytes:
    return index.to_bytes(8, "little") * 4


def manifests(layout: str, ranks: int, tensors: int) -> list[ShardManifest]:
    """Every rank's shard manifest: one box of each tensor, digests as a writer names them."""
    shape, boxes = boxes_of(layout, ranks)
    cell = writer_cell(shape, ITEMSIZE, CHUNK_SIZE)
    counts = [box_chunk_count(box.offsets, box.shape, cell) for box in boxes]
    shards = []
    for rank, box in enumerate(boxes):
        first = (rank % max(len(boxes) // (2 if layout == "hsdp" else 1), 1)) * 1000
        entries = tuple(
            TensorEntry.trusted(
                f"layers.{t}.weight",
                "float32",
                shape,
                box.offsets,
                box.shape,
                box.numel * ITEMSIZE,
                CHUNK_SIZE,
                tuple(digest(t * 10**10 + first + i) for i in range(counts[rank])),
                "torch",
                cell,
            )
            for t in range(tensors)
        )
        shards.append(ShardManifest(RUN, 1, rank, entries))
    return shards


def skeleton_of(tensors: int) -> bytes:
    empty = np.empty((0,), dtype=np.float32)
    return encode_state({f"layers.{t}.weight": empty for t in range(tensors)}).skeleton


class Decoded(Sequence[ShardManifest]):
    """The encoded manifests, each decoded when a planner first asks for it."""

    def __init__(self, encoded: list[bytes]) -> None:
        self.encoded = encoded
        self.read: dict[int, ShardManifest] = {}

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        if index not in self.read:
            self.read[index] = decode_object(self.encoded[index])
        return self.read[index]


def timed(call: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The median seconds of ``call`` (garbage collection off while it runs) and its value."""
    seconds, value = [], None
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            started = time.perf_counter()
            value = call()
            seconds.append(time.perf_counter() - started)
        finally:
            gc.enable()
    return statistics.median(seconds), value


def targets_of(layout: str, ranks: int, tensors: list[str], rank: int) -> list[tuple[str, Any]]:
    """Rank ``rank``'s targets onto the saved layout: its own box of each tensor."""
    shape, boxes = boxes_of(layout, ranks)
    box = boxes[rank]
    local = np.empty(box.shape, dtype=np.float32)
    return [(name, Shard(local, shape, box.offsets)) for name in tensors]


def measure(layout: str, ranks: int, tensors: int, args: argparse.Namespace) -> dict[str, Any]:
    repeats, sample = args.repeats, min(args.sample, tensors)
    scale = tensors / sample
    shards = manifests(layout, ranks, tensors)
    one = shards[0]
    encode_s, first = timed(lambda: encode_object(one), repeats)
    encoded = [first] + [encode_object(s) for s in shards[1:]]
    shards.clear()
    decode_s, decoded = timed(lambda: [decode_object(b) for b in encoded], 1)
    group_s, entries = timed(lambda: grouped_entries(decoded, WHERE), repeats)
    columns = isinstance(entries, BoxTable)  # else the per-entry path: sampled
    if columns:
        sample, scale = tensors, 1.0
    names = list(entries)[:sample]

    def coverage() -> None:
        if isinstance(entries, BoxTable):
            assert entries.check(), "the synthetic boxes must tile every tensor"
            return
        for name in names:
            check_coverage(entries[name], WHERE)

    coverage_s, _ = timed(coverage, repeats)
    skeleton = skeleton_of(tensors)
    names_s, _ = timed(lambda: check_names(skeleton, entries, WHERE), repeats)
    digests = [bytes(32)] * ranks

    def root() -> bytes:
        made = make_root(
            run=RUN,
            generation=1,
            step=1,
            parent=None,
            world_size=ranks,
            shards=digests,
            state=skeleton,
            metadata=b"",
            stats={"logical_bytes": 0},
            frameworks={},
            writer={},
        )
        return encode_object(made)

    root_s, root_bytes = timed(root, repeats)
    saved_root = decode_object(root_bytes)
    rank = ranks // 2
    targets = targets_of(layout, ranks, names, rank)

    def plan(direct: bool) -> int:
        """One rank's planning from the encoded manifests: onto the saved layout (its
        own manifest and rank 0's) or as any other layout is planned (all of them)."""
        shards = Decoded(encoded)
        picks = planning.direct_shards(shards, rank) if direct else None
        found, wanted = planning.plan_restore(shards, saved_root, targets, WHERE, direct=picks)
        return sum(len(planning.chunk_requests(t, found)) for t in wanted)

    plan_s, requests = timed(lambda: plan(True), repeats)
    plan_all_s, _ = timed(lambda: plan(False), 1)
    chunks = sum(len(e.chunks) for e in decoded[0].tensors)
    coordinator = decode_s + group_s + coverage_s * scale + names_s + root_s
    if columns:
        planned, planned_all = plan_s, plan_all_s
    else:  # the per-entry path plans a sample of targets: scaled
        planned = decode_s + group_s + (plan_s - decode_s - group_s) * scale
        planned_all = decode_s + group_s + (plan_all_s - decode_s - group_s) * scale
    return {
        "layout": layout,
        "ranks": ranks,
        "tensors": tensors,
        "boxes": ranks * tensors,
        "sample": sample,
        "extrapolated": sample < tensors,
        "seconds": {
            "encode (one rank)": encode_s,
            "decode": decode_s,
            "group": group_s,
            "coverage": coverage_s * scale,
            "names": names_s,
            "root": root_s,
            "coordinator": coordinator,
            "restore planning (one rank)": planned,
            "restore planning, another layout (one rank)": planned_all,
        },
        "requests_per_tensor": requests / sample,
        "manifest_bytes_per_box": (len(encoded[0]) - 32 * chunks) / tensors,
        "manifest_bytes": len(encoded[0]),
        "root_bytes": len(root_bytes),
    }


def report(rows: list[dict[str, Any]]) -> None:
    from tabulate import tabulate

    table = []
    for row in rows:
        s = row["seconds"]
        mark = " *" if row["extrapolated"] else ""
        table.append(
            [
                row["layout"],
                row["ranks"],
                row["tensors"],
                f"{row['boxes']:,}",
                f"{s['coverage']:.3f}{mark}",
                f"{s['decode']:.3f}",
                f"{s['coordinator']:.3f}{mark}",
                f"{s['restore planning (one rank)']:.3f}{mark}",
                f"{s['restore planning, another layout (one rank)']:.3f}{mark}",
                f"{row['manifest_bytes_per_box']:.0f}",
                f"{row['root_bytes']:,}",
            ]
        )
    print(
        tabulate(
            table,
            headers=[
                "layout",
                "ranks",
                "tensors",
                "boxes",
                "coverage s",
                "decode s",
                "coordinator s",
                "rank planning s",
                "resharding s",
                "manifest B/box",
                "root B",
            ],
        )
    )
    if any(row["extrapolated"] for row in rows):
        print("* per-tensor phases timed on --sample tensors and scaled to all of them")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="16,128,1024", help="comma-separated rank counts")
    parser.add_argument("--tensors", default="10,100,1024", help="comma-separated tensor counts")
    parser.add_argument("--layouts", default="fsdp,tp,hsdp")
    parser.add_argument("--sample", type=int, default=8, help="tensors the per-tensor phases time")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", nargs="?", type=Path, const=DEFAULT_JSON, default=None)
    parser.add_argument("--small", action="store_true", help="16 and 64 ranks, 10 tensors, once")
    args = parser.parse_args(argv)
    if args.small:
        args.ranks, args.tensors, args.repeats = "16,64", "10", 1
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    rows = []
    for layout in args.layouts.split(","):
        for ranks in (int(r) for r in args.ranks.split(",")):
            for tensors in (int(t) for t in args.tensors.split(",")):
                rows.append(measure(layout, ranks, tensors, args))
                print(
                    f"{layout} {ranks} ranks x {tensors} tensors: "
                    f"coordinator {rows[-1]['seconds']['coordinator']:.3f} s",
                    file=sys.stderr,
                    flush=True,
                )
    report(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": args.json.name}, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
