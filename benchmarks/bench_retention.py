"""Retention and garbage collection: bytes kept against DCP, and GC time against store size.

Run from the repository root::

    .venv/bin/python benchmarks/bench_retention.py [--state-mib 64] [--saves 20]
                                                   [--gc-state-mib 32] [--gc-sizes 2,4,8]
                                                   [--repeats 3] [--workdir DIR] [--json OUT]
                                                   [--warm-only] [--keep] [--check]

Part 1, bytes on disk. A fine-tuning state of ``--state-mib`` MiB of fp32
(``{"model": {...}}``: 18 backbone tensors, 90% of the bytes, and 2 head
tensors, 10%; every tensor 1024 columns wide) is saved ``--saves`` (20) times.
Before every save but the first the head is refilled in place with new random
values; the backbone never changes. The same states are saved twice:

  castore  one store (``castore.open``, default chunk size), ``store.save(state,
           run="ft", step=i)`` for each i
  DCP      one directory per save, ``dcp.save(state, storage_writer=
           FileSystemWriter(dir_i, sync_files=True), no_dist=True)`` in this one
           process (no process group), as ``bench_save_load.py`` calls it

castore's bytes are shown three ways: the distinct chunk bytes the 20
generations reference (``castore.gc.disk_usage(store).referenced_bytes``),
every chunk and manifest stored (``physical_bytes``), and the store directory
as the file system sees it (LMDB files, packs, refs and logs). Sizes "on
disk" are allocated blocks (``st_blocks * 512``, as ``du``), taken after
``sync``; "apparent" is the sum of file sizes. Every ratio is against the
allocated bytes of the DCP directories written in the same run. The
theoretical ratio is (1 + (n - 1) f) / n for n saves of which a fraction f
changes: (1 + 19 x 0.1) / 20 = 0.145.

Part 2, GC time against store size. For each k of ``--gc-sizes`` (2, 4, 8) a
fresh store receives 2k saves of a ``--gc-state-mib`` MiB state (same layout),
every save with all values new, so no chunk is shared between generations.
``collect_garbage(store, RetentionPolicy(keep_last=k))`` then keeps the newest
k generations (k times the state's data) and deletes the oldest k (as much
again). The timed quantity is the wall time of that one ``collect_garbage``
call, a real run (not a dry run), with its mark, scan and sweep phases from
``GcReport.timings``. Each repetition rebuilds every store (``--repeats``, 3;
the order of the sizes rotates between repetitions) and the tables show
medians. Before each collection the page cache is dropped, when this process
may, so the store is read from disk as a large store would be
(``--warm-only``: never drop it; the store just written is then in memory).
The first repetition checks that the store afterwards holds exactly the k
kept generations' chunks and that the oldest kept one loads unchanged.

Goal (from the issue): castore's bytes for the 20 saves <= 0.2x DCP's.
``--check`` makes a missed goal exit with status 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _common import disk_free, drop_caches, print_goals, tree_bytes
from tabulate import tabulate

import castore
from castore.gc import RetentionPolicy, collect_garbage, disk_usage

MIB = 1 << 20
GIB = 1 << 30
BACKBONE_TENSORS = 18
HEAD_TENSORS = 2
HEAD_FRACTION = 0.10
COLUMNS = 1024  # fp32 elements per row: 4 KiB rows
RUN = "ft"
GOAL_RATIO = 0.2


# -- the state ---------------------------------------------------------------


def build_state(state_mib: float) -> dict[str, torch.Tensor]:
    """Backbone and head tensors of ~state_mib MiB, the head HEAD_FRACTION of the bytes.

    Zero-filled: callers fill them (``fill``) with seeded random values.
    """
    row_bytes = 4 * COLUMNS
    total = state_mib * MIB
    backbone_rows = max(1, round(total * (1 - HEAD_FRACTION) / BACKBONE_TENSORS / row_bytes))
    head_rows = max(1, round(total * HEAD_FRACTION / HEAD_TENSORS / row_bytes))
    state = {
        f"backbone.{i}.weight": torch.zeros(backbone_rows, COLUMNS) for i in range(BACKBONE_TENSORS)
    }
    state.update({f"head.{j}.weight": torch.zeros(head_rows, COLUMNS) for j in range(HEAD_TENSORS)})
    return state


def fill(tensors: list[torch.Tensor], seed: int) -> None:
    """New random values, in place (the same seed gives the same values)."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in tensors:
        tensor.normal_(generator=gen)


def head_of(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [t for name, t in state.items() if name.startswith("head.")]


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# -- helpers -----------------------------------------------------------------


def dcp_save(state: dict[str, Any], path: Path) -> None:
    """As bench_save_load.py: one process, no process group, files fsync'd."""
    writer = dcp.FileSystemWriter(str(path), sync_files=True)
    dcp.save(state, storage_writer=writer, no_dist=True)


def timed(fn: Any) -> tuple[float, Any]:
    gc.collect()
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def needed_bytes(state_mib: float, saves: int, gc_state_mib: float, sizes: list[int]) -> int:
    """Scratch space at the peak: part 1 (DCP dirs + store) or one part-2 store, + margin."""
    part1 = state_mib * MIB * (saves + 1 + (saves - 1) * HEAD_FRACTION)
    part2 = gc_state_mib * MIB * 2 * max(sizes)
    return int(1.2 * max(part1, part2)) + 256 * MIB


# -- part 1: bytes on disk ---------------------------------------------------


def part_bytes(work: Path, state_mib: float, saves: int) -> dict[str, Any]:
    model = build_state(state_mib)
    fill(list(model.values()), seed=0)
    state = {"model": model}
    head = head_of(model)
    logical, head_bytes = nbytes(list(model.values())), nbytes(head)
    fraction = head_bytes / logical
    print(
        f"part 1: {len(model)} tensors, {mib(logical)} MiB; head {len(head)} tensors, "
        f"{mib(head_bytes)} MiB ({fraction:.1%}); {saves} saves",
        flush=True,
    )
    store_dir, dcp_root = work / "castore", work / "dcp"
    dcp_root.mkdir()
    castore_times, dcp_times, new_bytes = [], [], []
    store = castore.open(store_dir)
    try:
        chunk_size = store.chunk_size
        for step in range(saves):
            if step:
                fill(head, seed=1000 + step)  # only the head changes
            seconds, generation = timed(lambda s=step: store.save(state, run=RUN, step=s))
            castore_times.append(seconds)
            new_bytes.append(generation.new_bytes)
            seconds, _ = timed(lambda s=step: dcp_save(state, dcp_root / f"step-{s:03d}"))
            dcp_times.append(seconds)
        usage = disk_usage(store)
    finally:
        store.close()
    os.sync()
    store_apparent, store_allocated = tree_bytes(store_dir)
    dcp_apparent, dcp_allocated = tree_bytes(dcp_root)
    theory = (1 + (saves - 1) * fraction) / saves
    return {
        "state_mib": state_mib,
        "logical_bytes": logical,
        "head_bytes": head_bytes,
        "head_fraction": fraction,
        "tensors": len(model),
        "saves": saves,
        "castore_chunk_size": chunk_size,
        "castore_referenced_bytes": usage.referenced_bytes,
        "castore_physical_bytes": usage.physical_bytes,
        "castore_file_bytes": usage.file_bytes,
        "castore_dedup_ratio": usage.dedup_ratio,
        "castore_new_bytes_per_save": new_bytes,
        "castore_dir_apparent_bytes": store_apparent,
        "castore_dir_allocated_bytes": store_allocated,
        "dcp_apparent_bytes": dcp_apparent,
        "dcp_allocated_bytes": dcp_allocated,
        "theoretical_ratio": theory,
        "castore_save_s": castore_times,
        "dcp_save_s": dcp_times,
    }


def bytes_table(r: dict[str, Any]) -> list[list[str]]:
    dcp_disk, n = r["dcp_allocated_bytes"], r["saves"]
    rows = [
        (
            "castore: chunks the generations reference (disk_usage referenced_bytes)",
            r["castore_referenced_bytes"],
            None,
        ),
        (
            "castore: chunks + manifests stored (disk_usage physical_bytes)",
            r["castore_physical_bytes"],
            None,
        ),
        (
            "castore: store directory (LMDB file, packs, refs, logs)",
            r["castore_dir_apparent_bytes"],
            r["castore_dir_allocated_bytes"],
        ),
        (f"DCP: {n} checkpoint directories", r["dcp_apparent_bytes"], dcp_disk),
    ]
    table = []
    for label, apparent, allocated in rows:
        measured = allocated if allocated is not None else apparent
        table.append(
            [
                label,
                mib(apparent),
                mib(allocated) if allocated is not None else "-",
                mib(measured / n),
                f"{measured / dcp_disk:.3f}x",
            ]
        )
    theory = r["theoretical_ratio"]
    table.append(
        [
            f"theoretical: (1 + {n - 1} x {r['head_fraction']:.2f}) / {n} of DCP",
            "-",
            "-",
            mib(theory * dcp_disk / n),
            f"{theory:.3f}x",
        ]
    )
    return table


# -- part 2: GC time against store size --------------------------------------


def build_gc_store(path: Path, state_mib: float, k: int) -> tuple[int, int]:
    """2k generations, every value new each time; returns (state bytes, chunks per state)."""
    model = build_state(state_mib)
    tensors = list(model.values())
    with castore.open(path) as store:
        for generation in range(1, 2 * k + 1):
            fill(tensors, seed=generation)
            saved = store.save({"model": model}, run=RUN, step=generation)
    return nbytes(tensors), saved.stats.new_chunks


def check_after_gc(path: Path, state_mib: float, k: int, state_bytes: int) -> None:
    """Only the k newest generations remain, chunk for chunk, and the oldest of them loads."""
    with castore.open(path, create=False) as store:
        usage = disk_usage(store)
        ids = [u.id for u in usage.generations]
        if ids != list(range(k + 1, 2 * k + 1)):
            raise AssertionError(f"k={k}: generations {ids} remain")
        if usage.garbage_bytes or usage.referenced_bytes != k * state_bytes:
            raise AssertionError(
                f"k={k}: {usage.referenced_bytes} referenced, {usage.garbage_bytes} garbage"
            )
        loaded = store.load(RUN, k + 1, framework="torch")["model"]
    want = build_state(state_mib)
    fill(list(want.values()), seed=k + 1)
    for name, tensor in want.items():
        if not torch.equal(loaded[name], tensor):
            raise AssertionError(f"k={k}: {name} of generation {k + 1} differs after gc")


def one_gc(work: Path, state_mib: float, k: int, cold: bool, verify: bool) -> dict[str, Any]:
    path = work / f"gc-{k}"
    try:
        state_bytes, chunks_per_state = build_gc_store(path, state_mib, k)
        with castore.open(path, create=False) as store:
            before = disk_usage(store)
        os.sync()
        if cold and not drop_caches():
            raise RuntimeError("dropping the page cache stopped working")
        with castore.open(path, create=False) as store:
            seconds, report = timed(lambda: collect_garbage(store, RetentionPolicy(keep_last=k)))
        if verify:
            check_after_gc(path, state_mib, k, state_bytes)
        return {
            "seconds": seconds,
            "report_seconds": report.seconds,
            "timings": dict(report.timings),
            "store_bytes": before.physical_bytes,
            "kept_bytes": k * state_bytes,
            "bytes_freed": report.bytes_freed,
            "file_bytes_freed": report.file_bytes_freed,
            "chunks_freed": report.chunks_freed,
            "objects_freed": report.objects_freed,
            "chunks_per_state": chunks_per_state,
            "state_bytes": state_bytes,
        }
    finally:
        shutil.rmtree(path, ignore_errors=True)


def part_gc(
    work: Path, state_mib: float, sizes: list[int], repeats: int, cold: bool
) -> dict[int, list[dict[str, Any]]]:
    runs: dict[int, list[dict[str, Any]]] = {k: [] for k in sizes}
    for rep in range(repeats):
        started = time.perf_counter()
        order = sizes[rep % len(sizes) :] + sizes[: rep % len(sizes)]
        for k in order:
            runs[k].append(one_gc(work, state_mib, k, cold, verify=rep == 0))
        print(f"  rep {rep + 1}/{repeats}: {time.perf_counter() - started:.1f} s", flush=True)
    return runs


def gc_summary(runs: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    records = []
    for k, samples in runs.items():
        first = samples[0]
        phase = {
            name: statistics.median(s["timings"].get(name, 0.0) for s in samples)
            for name in ("mark", "scan", "sweep", "reclaim")
        }
        seconds = statistics.median(s["seconds"] for s in samples)
        records.append(
            {
                "k": k,
                "generations_saved": 2 * k,
                "generations_kept": k,
                "store_bytes": first["store_bytes"],
                "kept_bytes": first["kept_bytes"],
                "bytes_freed": first["bytes_freed"],
                "file_bytes_freed": first["file_bytes_freed"],
                "chunks_freed": first["chunks_freed"],
                "objects_freed": first["objects_freed"],
                "median_s": seconds,
                "times_s": [s["seconds"] for s in samples],
                "median_phase_s": phase,
                "s_per_gib_store": seconds / (first["store_bytes"] / GIB),
                "state_bytes": first["state_bytes"],
            }
        )
    return records


def gc_table(records: list[dict[str, Any]]) -> list[list[str]]:
    base = records[0]
    rows = []
    for r in records:
        phase = r["median_phase_s"]
        rows.append(
            [
                f"{r['k']}x",
                f"{r['generations_saved']} / {r['generations_kept']}",
                f"{r['store_bytes'] / GIB:.3f}",
                f"{r['bytes_freed'] / GIB:.3f}",
                f"{r['median_s'] * 1000:.1f}",
                f"{phase['mark'] * 1000:.1f}",
                f"{phase['scan'] * 1000:.1f}",
                f"{phase['sweep'] * 1000:.1f}",
                f"{phase['reclaim'] * 1000:.1f}",
                f"{r['file_bytes_freed'] / GIB:.3f}",
                f"{r['s_per_gib_store']:.3f}",
                f"{r['median_s'] / base['median_s']:.2f}x",
            ]
        )
    return rows


# -- main --------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--state-mib", type=float, default=64, help="part 1 state size (default 64)"
    )
    parser.add_argument("--saves", type=int, default=20, help="part 1 saves (default 20)")
    parser.add_argument(
        "--gc-state-mib", type=float, default=32, help="part 2 state size (default 32)"
    )
    parser.add_argument(
        "--gc-sizes",
        default="2,4,8",
        help="part 2 store sizes, in states kept (default 2,4,8; the first is the baseline)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="part 2 repetitions (default 3)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="scratch directory (default /tmp)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    parser.add_argument("--warm-only", action="store_true", help="do not drop the page cache")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is not met")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.gc_sizes.split(",")]
    if args.saves < 2 or args.repeats < 1 or not sizes or min(sizes) < 1:
        parser.error("need --saves >= 2, --repeats >= 1 and positive --gc-sizes")
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")

    base = args.workdir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    state_mib, gc_state_mib = args.state_mib, args.gc_state_mib
    need = needed_bytes(state_mib, args.saves, gc_state_mib, sizes)
    free = disk_free(base)
    if free < need:
        scale = (free - 256 * MIB) / (need - 256 * MIB)
        state_mib, gc_state_mib = state_mib * scale, gc_state_mib * scale
        if scale <= 0 or min(state_mib, gc_state_mib) < 1:
            print(f"not enough disk under {base}: need {need / GIB:.2f} GiB", file=sys.stderr)
            return 2
        print(
            f"NOTE: {free / GIB:.2f} GiB free under {base}, the defaults need "
            f"{need / GIB:.2f} GiB: scaled down to --state-mib {state_mib:.1f} and "
            f"--gc-state-mib {gc_state_mib:.1f}",
            flush=True,
        )
    cold = not args.warm_only and drop_caches()
    print(
        f"scratch: {base} ({free / GIB:.1f} GiB free); page cache before gc: "
        f"{'dropped (cold)' if cold else 'kept (warm)'}",
        flush=True,
    )

    work = Path(tempfile.mkdtemp(prefix="castore-bench-retention-", dir=base))
    started = time.perf_counter()
    try:
        part1 = part_bytes(work, state_mib, args.saves)
        shutil.rmtree(work / "castore", ignore_errors=True)
        shutil.rmtree(work / "dcp", ignore_errors=True)
        print(
            f"part 2: gc of stores holding 2k saves of a {gc_state_mib:g} MiB state, "
            f"k in {sizes}, keep_last=k, {args.repeats} repetitions",
            flush=True,
        )
        runs = part_gc(work, gc_state_mib, sizes, args.repeats, cold)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    gc_records = gc_summary(runs)

    n = part1["saves"]
    print(
        f"\nBytes of {n} saves of a {mib(part1['logical_bytes'])} MiB state "
        f"({part1['head_fraction']:.0%} changed between saves), castore chunk size "
        f"{part1['castore_chunk_size'] // MIB} MiB:\n"
    )
    headers = ["what", "apparent MiB", "on disk MiB", "per save MiB", "x DCP on disk"]
    print(tabulate(bytes_table(part1), headers=headers, tablefmt="github", disable_numparse=True))
    later = part1["castore_new_bytes_per_save"][1:]
    print(
        f"\ncastore wrote {mib(part1['castore_new_bytes_per_save'][0])} MiB of chunks on the "
        f"first save and {mib(statistics.median(later))} MiB (median) on each later one; "
        f"dedup ratio {part1['castore_dedup_ratio']:.2f}.\n"
        f"save time, median: castore {statistics.median(part1['castore_save_s'][1:]):.3f} s "
        f"(first {part1['castore_save_s'][0]:.3f} s), DCP "
        f"{statistics.median(part1['dcp_save_s']):.3f} s. 'x DCP on disk' divides the "
        "allocated bytes (or, for the two disk_usage rows, the stored bytes) by the DCP "
        "directories' allocated bytes."
    )

    print(
        f"\nGC time against store size ({mib(gc_records[0]['state_bytes'])} MiB state; real "
        f"collections, medians of {args.repeats}, each on a freshly built "
        f"store, page cache {'dropped' if cold else 'kept'} before the collection):\n"
    )
    headers = [
        "kept data",
        "saved / kept",
        "store GiB",
        "freed GiB",
        "gc ms",
        "mark ms",
        "scan ms",
        "sweep ms",
        "reclaim ms",
        "pack GiB freed",
        "s per GiB",
        "x time at " + f"{sizes[0]}x",
    ]
    print(tabulate(gc_table(gc_records), headers=headers, tablefmt="github", disable_numparse=True))
    first, last = gc_records[0], gc_records[-1]
    time_ratio = last["median_s"] / first["median_s"]
    data_ratio = last["store_bytes"] / first["store_bytes"]
    print(
        f"\n'store GiB' is every chunk and manifest stored before the collection (kept + "
        f"dropped); 's per GiB' divides the gc time by it; 'gc ms' is the wall time of "
        f"collect_garbage, the phases come from GcReport.timings.\n"
        f"gc time at {last['k']}x / at {first['k']}x: {time_ratio:.2f} for "
        f"{data_ratio:.2f}x the data (linear would be {data_ratio:.2f})\n"
    )

    candidates = {
        "disk_usage referenced_bytes": part1["castore_referenced_bytes"],
        "store directory on disk": part1["castore_dir_allocated_bytes"],
    }
    verdicts = []
    for label, value in candidates.items():
        ratio = value / part1["dcp_allocated_bytes"]
        verdicts.append(
            {
                "goal": f"castore bytes of {n} saves <= {GOAL_RATIO}x DCP's ({label})",
                "measured": f"{ratio:.3f}x DCP (theory {part1['theoretical_ratio']:.3f}x)",
                "value": ratio,
                "met": ratio <= GOAL_RATIO,
            }
        )
    print_goals(verdicts)
    print(f"\ntotal time {time.perf_counter() - started:.0f} s")

    if args.json:
        payload = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "state_mib": state_mib,
            "gc_state_mib": gc_state_mib,
            "cold_gc": cold,
            "scratch_dir": str(base),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "castore": castore.__version__,
            },
            "cpus": os.cpu_count(),
            "bytes": part1,
            "gc": gc_records,
            "gc_time_ratio_last_first": time_ratio,
            "gc_data_ratio_last_first": data_ratio,
            "goals": verdicts,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if args.check and not all(v["met"] for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
