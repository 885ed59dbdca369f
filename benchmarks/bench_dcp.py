"""castore as a torch.distributed.checkpoint backend against FileSystemWriter/FileSystemReader.

Run from the repository root::

    .venv/bin/python benchmarks/bench_dcp.py [--state-mib 512] [--tensors 40] [--ranks 2]
                                             [--repeats 3] [--warmup 1] [--quiet 8] [--settle 5]
                                             [--dir DIR] [--json OUT] [--warm-only] [--check]

``--ranks`` real processes (``multiprocessing`` spawn) join one gloo group
(``tcp://127.0.0.1:<free port>``) and a 1-D CPU ``DeviceMesh``, and stay alive
for the whole run, so process start and imports are never timed. The parent
drives them over pipes.

The state is ``--tensors`` fp32 tensors of equal size, ``--state-mib`` MiB in
all, each a DTensor sharded ``Shard(0)`` over the mesh (``DTensor.from_local``
of this rank's dim-0 block of 4 KiB rows; the row count is a multiple of the
rank count, so the blocks are even). So DCP's planners see global shapes and
chunk offsets, the metadata a resharded load needs. Values are random
(``torch.randn``, seeded per tensor and rank): no two chunks are equal. The
re-save state is the same with every 10th tensor (10% of the tensors and of
the bytes) replaced by ``local + 1e-3``.

Each repetition runs, in one fresh scratch folder:

saves (the order of the two rotates from one repetition to the next)
  FS save            ``dcp.save(state, storage_writer=FileSystemWriter(dir, sync_files=True))``
  castore save       ``dcp.save(state, storage_writer=CastoreWriter(store, run=..., step=1))``
                     into a fresh store (created empty by the parent, untimed:
                     the ranks must not race to create it)
loads into preallocated state (DTensors over NaN-filled local blocks; order rotates)
  FS load            ``dcp.load(targets, storage_reader=FileSystemReader(dir))``
  castore load       ``dcp.load(targets, storage_reader=CastoreReader(store, run=...))``
  each cold (page cache dropped by the parent just before, when it may) and
  then warm (right after the cold load, which read every byte)
re-saves of the state with 10% of the tensors changed (order rotates; page
cache dropped before each, so castore's store is not in memory)
  FS re-save         FileSystemWriter has no dedup: a full save into a new folder
  castore re-save    CastoreWriter into the same store (generation 2): only
                     changed chunks are written

A time is the wall time of the ``dcp.save`` / ``dcp.load`` call alone, the
maximum over ranks, after a barrier (the slowest rank's call). Each rank opens
the store or builds its writer/reader and its load targets before the barrier,
and re-touches the code a page-cache drop evicts.

Every timed step but the warm loads starts from the same state: the parent
runs ``os.sync()`` (cold loads and re-saves: drops the page cache, which
syncs too), then pauses ``--quiet`` seconds (8) before sending the command.
On this VM, memory freed moments ago (a dropped page cache, a deleted file's
cached pages, a munmap'd buffer) is much cheaper to touch again than memory
freed some seconds earlier: a 512 MiB ``FileSystemWriter`` save measured
0.44-0.56 s right after dropping a populated page cache, 0.93 s 3 s after,
and 1.7 s 6 s or more after (probably the balloon driver's free page
reporting handing idle pages back to the host, which then faults them in
again). Without the pause, whichever step followed a large free (a cache
drop, the step before) would get that fast path; with it, every step pays
what a checkpoint taken minutes after the previous one pays on this VM. Warm
loads run right after their cold load, the data still cached. After each
repetition the scratch folder is deleted, followed by ``sync`` and a pause
(``--settle``, 5 s) for the freed disk blocks' discards (the disk is mounted
with ``discard``) before the next repetition's quiet pause.

One untimed warm-up repetition comes first (no pauses); it also checks every
loaded block against the originals, and loads both re-saves (castore
generation 2 and the FS re-save folder) to check them. The tables show
medians over the timed repetitions; ratios are castore against
FileSystemWriter/Reader measured in the same repetitions. ``--check`` makes a
missed goal exit with status 1.
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
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import PipedRanks, disk_free, drop_caches, join_gloo, print_goals, tree_bytes
from tabulate import tabulate

import castore

MIB = 1 << 20
GIB = 1 << 30
RUN = "bench"
COLS = 1024  # 4 KiB fp32 rows
CHANGED_EVERY = 10  # every 10th tensor changes in the re-save: 10% of tensors and bytes
DELTA = 1e-3
COLLECTIVE_TIMEOUT = 300.0
METHODS = ["FS", "castore"]

# Goals (checked on medians): castore against FileSystemWriter/Reader, same run
SAVE_GOAL = 1.0  # castore save throughput >= 1.0x FileSystemWriter's
LOAD_GOAL = 1.0  # castore load throughput >= 1.0x FileSystemReader's (cold and warm)
RESAVE_GOAL = 0.25  # castore 10%-changed re-save time <= 0.25x FileSystemWriter's full save


# -- the state ---------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    tensors: int
    rows: int  # global dim 0 of every tensor, a multiple of ``world``
    world: int

    @property
    def tensor_bytes(self) -> int:
        return self.rows * COLS * 4

    @property
    def logical_bytes(self) -> int:
        return self.tensors * self.tensor_bytes

    def name(self, index: int) -> str:
        return f"layers.{index:03d}.weight"

    def changed(self, index: int) -> bool:
        return index % CHANGED_EVERY == CHANGED_EVERY - 1


def make_layout(state_mib: int, tensors: int, world: int) -> Layout:
    per_tensor = state_mib * MIB / tensors
    rows = max(world, round(per_tensor / (COLS * 4) / world) * world)
    return Layout(tensors, rows, world)


def local_blocks(layout: Layout, rank: int) -> list[Any]:
    """This rank's dim-0 block of every tensor, random and seeded per (tensor, rank)."""
    import torch

    rows = layout.rows // layout.world
    blocks = []
    for index in range(layout.tensors):
        gen = torch.Generator().manual_seed(1_000_003 * index + rank)
        blocks.append(torch.randn((rows, COLS), generator=gen))
    return blocks


# -- the ranks ---------------------------------------------------------------


def rewarm_code() -> None:
    """Touch the code a page-cache drop evicted (not any checkpoint's data) before timing."""
    import numpy as np
    import torch

    from castore.format.hashing import digest_bytes

    digest_bytes(bytes(1 << 20), threads=1)
    np.frombuffer(bytes(1 << 16), dtype=np.uint8).copy()
    torch.zeros(1 << 14).add_(1.0)


def worker(rank: int, port: int, layout: Layout, conn: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from castore.dcp import CastoreReader, CastoreWriter

    try:
        join_gloo(rank, port, layout.world, COLLECTIVE_TIMEOUT)
        mesh = init_device_mesh("cpu", (layout.world,))
        base = local_blocks(layout, rank)
        changed = [block + DELTA if layout.changed(i) else block for i, block in enumerate(base)]
    except Exception:  # noqa: BLE001 - the parent must hear about it
        conn.send({"error": traceback.format_exc()})
        return

    def state_of(blocks: list[Any]) -> dict[str, Any]:
        return {
            layout.name(i): DTensor.from_local(block, mesh, [Shard(0)], run_check=False)
            for i, block in enumerate(blocks)
        }

    states = {"base": state_of(base), "changed": state_of(changed)}
    blocks_of = {"base": base, "changed": changed}
    conn.send({"ready": True})

    def save(method: str, path: str, which: str, step: int) -> dict[str, Any]:
        store = castore.open(path, create=False) if method == "castore" else None
        try:
            if store is None:
                writer: Any = dcp.FileSystemWriter(path, sync_files=True)
            else:
                writer = CastoreWriter(store, run=RUN, step=step, timeout=COLLECTIVE_TIMEOUT)
            rewarm_code()
            gc.collect()
            dist.barrier()
            started = time.perf_counter()
            dcp.save(states[which], storage_writer=writer)
            seconds = time.perf_counter() - started
        finally:
            if store is not None:
                store.close()
        out: dict[str, Any] = {"seconds": seconds}
        if store is not None and writer.generation is not None:  # the coordinator
            out["stats"] = vars(writer.generation.stats)
            out["generation"] = writer.generation.id
        return out

    def load(method: str, path: str, which: str, generation: int, verify: bool) -> dict[str, Any]:
        targets = {
            layout.name(i): DTensor.from_local(
                torch.full_like(block, float("nan")), mesh, [Shard(0)], run_check=False
            )
            for i, block in enumerate(base)
        }
        store = castore.open(path, create=False) if method == "castore" else None
        try:
            if store is None:
                reader: Any = dcp.FileSystemReader(path)
            else:
                reader = CastoreReader(
                    store, run=RUN, generation=generation, timeout=COLLECTIVE_TIMEOUT
                )
            rewarm_code()
            gc.collect()
            dist.barrier()
            started = time.perf_counter()
            dcp.load(targets, storage_reader=reader)
            seconds = time.perf_counter() - started
        finally:
            if store is not None:
                store.close()
        out: dict[str, Any] = {"seconds": seconds}
        if verify:
            out["bad"] = [
                layout.name(i)
                for i, block in enumerate(blocks_of[which])
                if not torch.equal(targets[layout.name(i)].to_local(), block)
            ]
        return out

    while True:
        command = conn.recv()
        if command[0] == "stop":
            break
        try:
            if command[0] == "save":
                reply = save(*command[1:])
            else:
                reply = load(*command[1:])
        except Exception:  # noqa: BLE001 - the parent must hear about it
            reply = {"error": traceback.format_exc()}
        conn.send(reply)
    dist.destroy_process_group()


class Ranks(PipedRanks):
    """``layout.world`` live worker processes in one gloo group, driven over pipes."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout.world, worker, (layout,), "bench-dcp")


# -- the run -----------------------------------------------------------------


@dataclass
class Results:
    times: dict[str, list[float]] = field(default_factory=dict)
    per_rank: dict[str, list[list[float]]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, replies: list[dict[str, Any]]) -> None:
        seconds = [r["seconds"] for r in replies]
        self.times.setdefault(key, []).append(max(seconds))
        self.per_rank.setdefault(key, []).append(seconds)

    def median(self, key: str) -> float:
        return statistics.median(self.times[key])


def rotate(items: list[Any], by: int) -> list[Any]:
    by %= len(items)
    return items[by:] + items[:by]


def check(replies: list[dict[str, Any]], what: str) -> None:
    for rank, reply in enumerate(replies):
        if reply["bad"]:
            raise AssertionError(f"{what}: rank {rank} loaded wrong values in {reply['bad']}")


def prepare(drop: bool, quiet: float) -> None:
    """Before a timed step: flush (and drop the page cache), then let freed memory go idle."""
    if drop:
        if not drop_caches():
            raise RuntimeError("dropping the page cache stopped working")
    else:
        os.sync()
    time.sleep(quiet)


def one_rep(
    rep: int,
    ranks: Ranks,
    work: Path,
    results: Results,
    cold: bool,
    verify: bool,
    quiet: float,
    settle: float,
) -> None:
    out = work / f"rep{rep}"
    out.mkdir(parents=True)
    paths = {"FS": out / "dcp", "castore": out / "store"}
    resave_paths = {"FS": out / "dcp-resave", "castore": out / "store"}
    with castore.open(paths["castore"]) as store:  # empty, before the ranks open it
        results.notes.setdefault("chunk_size", store.chunk_size)
    try:
        for method in rotate(METHODS, rep):
            prepare(False, quiet)
            replies = ranks.command("save", method, str(paths[method]), "base", 1)
            results.add(f"{method} save", replies)
            if method == "castore":
                results.notes.setdefault("castore_save_stats", replies[0]["stats"])

        for method in rotate(METHODS, rep):
            for mode in ["cold", "warm"] if cold else ["warm"]:
                if mode == "cold":
                    prepare(True, quiet)
                else:
                    os.sync()  # right after the cold load: the data is cached
                replies = ranks.command("load", method, str(paths[method]), "base", 1, verify)
                if verify:
                    check(replies, f"{method} load ({mode})")
                results.add(f"{method} load ({mode})", replies)

        for method in rotate(METHODS, rep):
            prepare(cold, quiet)  # cold: castore's store is not in the page cache
            replies = ranks.command("save", method, str(resave_paths[method]), "changed", 2)
            results.add(f"{method} re-save", replies)
            if method == "castore":
                results.notes.setdefault("castore_resave_stats", replies[0]["stats"])
                if replies[0]["generation"] != 2:
                    raise AssertionError(f"re-save published {replies[0]['generation']}, not 2")

        os.sync()
        fs_bytes = tree_bytes(paths["FS"])[1]
        results.notes.setdefault("disk_bytes_fs_one_checkpoint", fs_bytes)
        results.notes.setdefault("disk_bytes_fs_both", fs_bytes + tree_bytes(resave_paths["FS"])[1])
        results.notes.setdefault("disk_bytes_castore_both", tree_bytes(paths["castore"])[1])
        if verify:  # both re-saves load back as the changed state (untimed)
            for method in METHODS:
                replies = ranks.command(
                    "load", method, str(resave_paths[method]), "changed", 2, True
                )
                check(replies, f"{method} re-save, loaded back")
    finally:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        time.sleep(settle)  # let the freed blocks' discards go through (see the docstring)


def summarize(
    results: Results, logical: int, cold: bool
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    modes = ["cold", "warm"] if cold else ["warm"]
    keys = ["FS save", "castore save", "FS re-save", "castore re-save"]
    keys += [f"{m} load ({mode})" for mode in modes for m in METHODS]
    rows, records = [], []
    for key in keys:
        method, _, op = key.partition(" ")
        med = results.median(key)
        if op == "re-save":
            reference = results.median("FS save")
            vs = f"{med / reference:.3f}x FS save time"
        else:
            reference = results.median(f"FS {op}")
            vs = f"{reference / med:.2f}x" if method == "castore" else "1.00x"
        rows.append(
            [
                key,
                f"{med:.3f}",
                f"{min(results.times[key]):.3f}",
                f"{logical / GIB / med:.2f}",
                vs,
            ]
        )
        records.append(
            {
                "step": key,
                "median_s": med,
                "min_s": min(results.times[key]),
                "times_s": results.times[key],
                "per_rank_s": results.per_rank[key],
                "gib_per_s": logical / GIB / med,
                "fs_reference_median_s": reference,
            }
        )
    return rows, records


def evaluate_goals(results: Results, cold: bool) -> list[dict[str, Any]]:
    verdicts = []
    ratio = results.median("FS save") / results.median("castore save")
    verdicts.append(
        {
            "goal": f"save throughput >= {SAVE_GOAL}x FileSystemWriter's",
            "measured": f"{ratio:.2f}x",
            "value": ratio,
            "met": ratio >= SAVE_GOAL,
        }
    )
    for mode in ["cold", "warm"] if cold else ["warm"]:
        ratio = results.median(f"FS load ({mode})") / results.median(f"castore load ({mode})")
        verdicts.append(
            {
                "goal": f"load throughput >= {LOAD_GOAL}x FileSystemReader's ({mode})",
                "measured": f"{ratio:.2f}x",
                "value": ratio,
                "met": ratio >= LOAD_GOAL,
            }
        )
    ratio = results.median("castore re-save") / results.median("FS save")
    verdicts.append(
        {
            "goal": f"10%-changed re-save time <= {RESAVE_GOAL}x FileSystemWriter's full save",
            "measured": f"{ratio:.3f}x",
            "value": ratio,
            "met": ratio <= RESAVE_GOAL,
        }
    )
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=512, help="state size (default 512)")
    parser.add_argument("--tensors", type=int, default=40, help="tensors (default 40)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument(
        "--repeats", "--reps", type=int, default=3, help="timed repetitions (default 3)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed repetitions first (default 1, min 1)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default /tmp)")
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    parser.add_argument(
        "--quiet",
        type=float,
        default=8.0,
        help="pause before each timed step but the warm loads (s, default 8)",
    )
    parser.add_argument(
        "--settle", type=float, default=5.0, help="pause after each rep's cleanup (s, default 5)"
    )
    parser.add_argument("--warm-only", action="store_true", help="do not drop the page cache")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is not met")
    args = parser.parse_args(argv)
    args.warmup = max(1, args.warmup)  # the first (untimed) repetition verifies
    if args.tensors < CHANGED_EVERY or args.ranks < 1 or args.repeats < 1:
        parser.error(f"need --tensors >= {CHANGED_EVERY}, --ranks >= 1, --repeats >= 1")

    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    layout = make_layout(args.state_mib, args.tensors, args.ranks)
    logical = layout.logical_bytes
    # one repetition's folder holds two FS checkpoints and a store of 1.1 states
    need = int(3.5 * logical)
    if disk_free(base) < need:
        print(
            f"not enough disk under {base}: need {need / GIB:.1f} GiB (try a smaller --state-mib)",
            file=sys.stderr,
        )
        return 2
    cold = not args.warm_only and drop_caches()
    changed = [i for i in range(layout.tensors) if layout.changed(i)]
    print(
        f"{layout.tensors} fp32 DTensors of ({layout.rows}, {COLS}), Shard(0) over "
        f"{layout.world} gloo ranks ({layout.rows // layout.world} rows each): "
        f"{logical / MIB:.1f} MiB in all\n"
        f"re-save changes {len(changed)} tensors, "
        f"{len(changed) * layout.tensor_bytes / MIB:.1f} MiB "
        f"({len(changed) / layout.tensors:.0%} of the tensors and bytes)\n"
        f"page cache drop: {'works, loads are cold and warm' if cold else 'not used: warm only'}"
        f"\nscratch: {base}, repeats: {args.repeats} (+{args.warmup} untimed warm-up), "
        f"quiet {args.quiet:g} s before each step, settle {args.settle:g} s",
        flush=True,
    )

    results = Results()
    work = Path(tempfile.mkdtemp(prefix="castore-bench-dcp-", dir=base))
    started = time.perf_counter()
    ranks: Ranks | None = None
    try:
        ranks = Ranks(layout)
        print(f"{layout.world} ranks up in {time.perf_counter() - started:.1f} s", flush=True)
        for rep in range(-args.warmup, args.repeats):
            rep_start = time.perf_counter()
            first = rep == -args.warmup
            sink = results if rep >= 0 else Results()
            pauses = (0.0, 0.0) if rep < 0 else (args.quiet, args.settle)
            one_rep(rep, ranks, work, sink, cold, first, *pauses)
            if first:
                results.notes.update(
                    {k: v for k, v in sink.notes.items() if k not in results.notes}
                )
            label = f"rep {rep + 1}/{args.repeats}" if rep >= 0 else "warm-up (untimed, verified)"
            print(f"{label}: {time.perf_counter() - rep_start:.1f} s", flush=True)
    finally:
        if ranks is not None:
            ranks.close()
        shutil.rmtree(work, ignore_errors=True)
    print("verified once: every load (and both re-saves, loaded back) equals what was saved\n")

    rows, records = summarize(results, logical, cold)
    headers = ["step", "median s", "min s", "GiB/s", "castore vs FS"]
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    notes = results.notes
    full, resave = notes["castore_save_stats"], notes["castore_resave_stats"]
    print(
        "\ntime: the dcp.save / dcp.load call, max over ranks (after a barrier), median over "
        "repeats. GiB/s: the whole state's size over that time (re-saves too).\n"
        "'castore vs FS': FS median time / castore median time (throughput ratio, >1 = castore "
        "faster); for the castore re-save, its time over FileSystemWriter's full-save time.\n"
        "FS re-save: FileSystemWriter has no dedup, so it rewrites the whole state into a new "
        "folder.\n"
        f"castore full save wrote {full['new_bytes'] / MIB:.1f} MiB of new chunks "
        f"({full['new_chunks']} chunks); the re-save wrote {resave['new_bytes'] / MIB:.1f} MiB "
        f"({resave['new_chunks']} new chunks, {resave['reused_chunks']} reused); "
        f"chunk size {notes['chunk_size'] / MIB:g} MiB.\n"
        f"on disk after both saves: FS {notes['disk_bytes_fs_both'] / MIB:.1f} MiB "
        f"(two folders), castore {notes['disk_bytes_castore_both'] / MIB:.1f} MiB (one store)\n"
    )
    ratio_rows = [
        ["save throughput", f"{results.median('FS save') / results.median('castore save'):.2f}x"]
    ]
    for mode in ["cold", "warm"] if cold else ["warm"]:
        ratio = results.median(f"FS load ({mode})") / results.median(f"castore load ({mode})")
        ratio_rows.append([f"load throughput ({mode})", f"{ratio:.2f}x"])
    ratio_rows.append(
        [
            "10%-changed re-save time / FS full-save time",
            f"{results.median('castore re-save') / results.median('FS save'):.3f}x",
        ]
    )
    ratio_rows.append(
        [
            "10%-changed re-save time / FS re-save time",
            f"{results.median('castore re-save') / results.median('FS re-save'):.3f}x",
        ]
    )
    print(tabulate(ratio_rows, headers=["castore / FS", "ratio"], tablefmt="github"))
    print()

    verdicts = evaluate_goals(results, cold)
    print_goals(verdicts)
    print(f"\ntotal time {time.perf_counter() - started:.0f} s")

    if args.json:
        payload = {
            "state_mib": args.state_mib,
            "logical_bytes": logical,
            "tensors": layout.tensors,
            "tensor_shape": [layout.rows, COLS],
            "ranks": layout.world,
            "changed_tensors": [layout.name(i) for i in changed],
            "repeats": args.repeats,
            "warmup_reps": args.warmup,
            "quiet_s": args.quiet,
            "settle_s": args.settle,
            "cold_loads": cold,
            "scratch_dir": str(base),
            "versions": {
                "python": platform.python_version(),
                "torch": _torch_version(),
                "castore": castore.__version__,
            },
            "cpus": os.cpu_count(),
            "results": records,
            "notes": notes,
            "goals": verdicts,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if args.check and not all(v["met"] for v in verdicts) else 0


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    sys.exit(main())
