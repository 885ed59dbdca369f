"""Where a call's time goes: cProfile and py-spy over the paths of bench_call_costs.py.

Run from the repository root::

    .venv/bin/python benchmarks/profile_call_costs.py [--quick] [--shapes a,b]
                                                      [--paths full_save,warm_load,...]
                                                      [--profiler cprofile|pyspy|both]
                                                      [--out DIR] [--top 25]

The states are those of ``bench_call_costs.py`` ((a) 512 MiB in 64 tensors,
(b) 256 MiB in 2,004 LLM-shaped tensors), on tmpfs. Paths:

  full_save     ``castore.open`` a new store, ``save``, ``close``
  warm_load     ``castore.open``, ``load(framework="torch")``, ``close``
  read_slice    ``castore.open`` (a fresh handle), ``read_slice`` of rows 100:104, ``close``
  resave_1pct   ``castore.open`` the store, ``save`` with 1% of the bytes changed, ``close``
  lookup_10k    ``castore.open`` a store of ``--generations`` (10,000) generations of a
                tiny state, ``resolve(run, 1)``, ``close``: a new handle parses the reflog
                as a new process does (the profile runs in one process, so the first
                call's imports are not in it; bench_call_costs.py times new processes)

Each path runs once unprofiled (warm-up), then ``--loops`` times under the
profiler. cProfile (deterministic; its per-call overhead inflates small
Python functions, so read shares, not absolute times) writes ``PATH.prof``
and prints, per path, the top functions by cumulative and by self time and a
table of named castore functions: calls, cumulative time per call and per
tensor. py-spy (sampling, no overhead; ``--profiler pyspy``) re-runs this
script under ``py-spy record`` for each path and prints the main thread's
inclusive and self shares per function, counted within the path only (a
thread waiting is not sampled: shares are of the main thread's busy time).
``--components`` instead times each building block of these paths alone,
unprofiled (``benchmarks/_components.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _components import run_components
from bench_call_costs import (
    QUICK_SIZE_MIB,
    RUN,
    SHAPES,
    SLICE_ROWS,
    build_history,
    build_shape,
    castore_save,
    changed_state,
)

import castore

PATHS = ("full_save", "warm_load", "read_slice", "resave_1pct", "lookup_10k")
LOOPS = {"full_save": 3, "warm_load": 3, "read_slice": 50, "resave_1pct": 3, "lookup_10k": 10}
# Functions whose cost the profile names: (file suffix, function name), castore's own.
NAMED = [
    ("opening/directory.py", "open_store"),
    ("chunkstore/lmdb/env.py", "acquire"),
    ("chunkstore/lmdb/env.py", "_open_environment"),
    ("repo/local.py", "hold_open"),
    ("store.py", "close"),
    ("format/tree.py", "encode_state"),
    ("format/tree.py", "_torch_leaf"),
    ("format/tree.py", "decode_tree"),
    ("format/tree.py", "tensor_names"),
    ("core/commit.py", "write_shard"),
    ("core/chunkio.py", "write_leaves"),
    ("core/chunkio.py", "_cut"),
    ("core/chunkio.py", "batch"),
    ("core/chunkio.py", "_hash_into"),
    ("core/chunkio.py", "_write_unknown"),
    ("core/unchanged.py", "known"),
    ("chunkstore/lmdb/backend.py", "put_many"),
    ("chunkstore/lmdb/backend.py", "_put_chunks"),
    ("chunkstore/lmdb/backend.py", "_write_txn"),
    ("chunkstore/lmdb/packwriter.py", "append"),
    ("chunkstore/lmdb/packwriter.py", "_write_all"),
    ("chunkstore/lmdb/backend.py", "_index_new"),
    ("chunkstore/lmdb/packwriter.py", "finish"),
    ("store.py", "digests_of"),
    ("core/background.py", "remember"),
    ("core/commit.py", "build_shard"),
    ("format/objects.py", "encode_object"),
    ("format/objects.py", "to_wire"),
    ("core/commit.py", "publish_single"),
    ("core/commit.py", "publish"),
    ("core/commit.py", "commit_objects"),
    ("core/commit.py", "claim_writer"),
    ("repo/refstore.py", "advance"),
    ("core/fencing.py", "record_published"),
    ("repo/localreflog.py", "append"),
    ("core/history.py", "resolve_root"),
    ("core/history.py", "published"),
    ("repo/localreflog.py", "view"),
    ("repo/localreflog.py", "feed"),
    ("repo/localreflog.py", "_parse_reflog_line"),
    ("repo/records.py", "is_reflog_record"),
    ("repo/records.py", "add"),
    ("core/reading.py", "read_object"),
    ("format/objects.py", "decode_object"),
    ("format/objects.py", "from_wire"),
    ("format/objects.py", "check"),
    ("format/objects.py", "_inconsistency"),
    ("format/objects.py", "__init__"),
    ("format/objects.py", "_check"),
    ("format/objects.py", "entries"),
    ("core/reading.py", "read_shards"),
    ("core/reading.py", "tensor_entries"),
    ("core/reading.py", "group_entries"),
    ("core/reading.py", "check_coverage"),
    ("core/reading.py", "load_state"),
    ("core/reading.py", "plan_tensor"),
    ("core/reading.py", "allocate"),
    ("core/reading.py", "place"),
    ("core/reading.py", "read_slice"),
    ("core/reading.py", "box_requests"),
    ("core/chunkread.py", "read_requests"),
    ("core/chunkread.py", "__init__"),
    ("core/chunkread.py", "apply_fetched"),
    ("core/chunkread.py", "verify_and_deliver"),
    ("core/chunkread.py", "verify_chunk"),
    ("core/readplan.py", "add_whole"),
    ("core/readplan.py", "read_plan"),
    ("core/readplan.py", "_read_in_place"),
    ("core/readplan.py", "_fill_run"),
    ("chunkstore/lmdb/backend.py", "chunk_reader"),
    ("chunkstore/lmdb/packreader.py", "open"),
    ("chunkstore/lmdb/packreader.py", "readinto"),
    ("chunkstore/lmdb/backend.py", "_read_chunks"),
    ("chunkstore/lmdb/backend.py", "values"),
    ("core/fencing.py", "record_loaded"),
    ("format/hashing.py", "digest_bytes"),
]


# -- the paths -----------------------------------------------------------------


class Paths:
    """Every profiled path of one shape, over stores made once in ``work``."""

    def __init__(self, shape_key: str, quick: bool, generations: int, work: Path) -> None:
        shape = SHAPES[shape_key]
        self.shape = shape
        self.state = build_shape(shape, QUICK_SIZE_MIB[shape_key] if quick else shape.size_mib)
        self.tensors = len(self.state)
        self.work = work
        self.store = work / "store"
        self.generations = generations
        self.saves = 0
        self.history = work.parent / f"castore-prof-history-{generations}"  # kept for reuse
        self.delta = 1e-3

    def prepare(self, path: str) -> None:
        if path in ("warm_load", "read_slice", "resave_1pct") and not self.store.exists():
            castore_save(self.state, self.store)
        if path == "lookup_10k" and not self.history.exists():
            started = time.perf_counter()
            build_history(self.history, self.generations)
            print(
                f"  built {self.generations:,} generations in {time.perf_counter() - started:.0f} s"
            )

    def inputs(self, path: str) -> Any:
        """What one call of ``path`` takes, made before the clock starts."""
        if path == "full_save":
            shutil.rmtree(self.work / f"fresh{self.saves}", ignore_errors=True)
        if path == "resave_1pct":
            self.delta += 1e-3  # new bytes each time: the store holds the earlier ones
            return changed_state(self.state, 0.01, self.delta).state
        return None

    def full_save(self, _: Any) -> None:
        self.saves += 1
        target = self.work / f"fresh{self.saves}"
        castore_save(self.state, target)  # removed by the next inputs(), off the clock

    def warm_load(self, _: Any) -> None:
        with castore.open(self.store, create=False) as store:
            store.load(RUN, framework="torch")

    def read_slice(self, _: Any) -> None:
        with castore.open(self.store, create=False) as store:
            store.read_slice(RUN, "latest", self.shape.slice_tensor, SLICE_ROWS, framework="torch")

    def resave_1pct(self, state: Any) -> None:
        castore_save(state, self.store)

    def lookup_10k(self, _: Any) -> None:
        with castore.open(self.history, create=False) as store:
            store.resolve(RUN, 1)


def profiled_call(paths: Paths, path: str, loops: int, profiler: cProfile.Profile | None) -> float:
    """Run ``path`` ``loops`` times (``profiler`` on around each call only); seconds spent."""
    call: Callable[[Any], None] = getattr(paths, path)
    spent = 0.0
    for _ in range(loops):
        given = paths.inputs(path)
        gc.collect()
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        MARKERS[path](call, given)
        if profiler is not None:
            profiler.disable()
        spent += time.perf_counter() - started
        del given
    return spent


# One function per path, so py-spy's stacks say which path a sample belongs to.
def profiled_full_save(call: Callable[[Any], None], given: Any) -> None:
    call(given)


def profiled_warm_load(call: Callable[[Any], None], given: Any) -> None:
    call(given)


def profiled_read_slice(call: Callable[[Any], None], given: Any) -> None:
    call(given)


def profiled_resave_1pct(call: Callable[[Any], None], given: Any) -> None:
    call(given)


def profiled_lookup_10k(call: Callable[[Any], None], given: Any) -> None:
    call(given)


MARKERS: dict[str, Callable[[Callable[[Any], None], Any], None]] = {
    "full_save": profiled_full_save,
    "warm_load": profiled_warm_load,
    "read_slice": profiled_read_slice,
    "resave_1pct": profiled_resave_1pct,
    "lookup_10k": profiled_lookup_10k,
}


# -- cProfile reports -----------------------------------------------------------


def short(key: tuple[str, int, str]) -> str:
    filename, line, name = key
    if "site-packages/" in filename:
        filename = filename.split("site-packages/", 1)[1]
    elif "/castore/" in filename:
        filename = "castore/" + filename.split("/castore/", 1)[1]
    return f"{filename}:{line}({name})" if line else name


def print_top(stats: pstats.Stats, sort: str, top: int, total: float) -> None:
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    column = 3 if sort == "cumulative" else 2
    ranked = sorted(raw.items(), key=lambda item: item[1][column], reverse=True)[:top]
    print(f"  top {top} by {sort} time (ncalls, tottime s, cumtime s, share of the path):")
    for key, (_cc, calls, tottime, cumtime, _callers) in ranked:
        share = (cumtime if sort == "cumulative" else tottime) / total
        print(f"    {calls:>8} {tottime:8.4f} {cumtime:8.4f} {share:6.1%}  {short(key)}")


def print_named(stats: pstats.Stats, loops: int, units: tuple[int, str], total: float) -> None:
    """Named functions' cost per path call and per unit (a tensor, or a reflog record)."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    count, unit = units
    print(f"  named castore functions (calls per path call, cumtime per path call, per {unit}):")
    for suffix, name in NAMED:
        for key, (_cc, calls, _tt, cumtime, _callers) in raw.items():
            if key[2] == name and key[0].endswith("castore/" + suffix):
                per_call = cumtime / loops
                print(
                    f"    {calls / loops:>9.0f} calls {per_call * 1e3:9.2f} ms "
                    f"{per_call / count * 1e6:8.2f} us/{unit} {cumtime / total:6.1%}  " + short(key)
                )


def run_cprofile(paths: Paths, path: str, args: argparse.Namespace) -> None:
    paths.prepare(path)
    profiled_call(paths, path, 1, None)  # warm-up
    plain = profiled_call(paths, path, args.loops or LOOPS[path], None) / (
        args.loops or LOOPS[path]
    )
    profiler = cProfile.Profile()
    loops = args.loops or LOOPS[path]
    spent = profiled_call(paths, path, loops, profiler)
    out = args.out / f"{paths.shape.key}-{path}.prof"
    profiler.dump_stats(out)
    stats = pstats.Stats(profiler)
    print(
        f"-- ({paths.shape.key}) {path}: {plain * 1e3:.2f} ms per call unprofiled, "
        f"{spent / loops * 1e3:.2f} ms under cProfile; {loops} calls; {out}"
    )
    units = (paths.generations, "record") if path == "lookup_10k" else (paths.tensors, "tensor")
    print_named(stats, loops, units, spent)
    print_top(stats, "cumulative", args.top, spent)
    print_top(stats, "tottime", args.top, spent)


# -- py-spy --------------------------------------------------------------------


def frame_name(frame: str) -> str:
    """``func (file:line)`` -> ``func (file)``: samples of one function add up across lines."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    if "site-packages/" in where:
        where = where.split("site-packages/", 1)[1]
    elif "castore/" in where:
        where = "castore/" + where.split("castore/", 1)[1]
    return f"{name} ({where})"


def pyspy_shares(raw: Path, marker: str) -> tuple[int, Counter[str], Counter[str]]:
    """(samples in the path, inclusive samples per function, self samples per function)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = stack.split(";")
        if not any(f.startswith(marker + " ") for f in frames):
            continue
        count = int(count_text)
        total += count
        start = next(i for i, f in enumerate(frames) if f.startswith(marker + " "))
        for name in {frame_name(f) for f in frames[start + 1 :]}:
            inclusive[name] += count
        own[frame_name(frames[-1])] += count
    return total, inclusive, own


def run_pyspy(shape: str, path: str, args: argparse.Namespace) -> None:
    raw = args.out / f"{shape}-{path}.pyspy.txt"
    command = [
        str(Path(sys.executable).parent / "py-spy"), "record", "--format", "raw",
        "--rate", "500", "-o", str(raw), "--", sys.executable, __file__,
        "--child", "--shapes", shape, "--paths", path, "--generations", str(args.generations),
        "--loops", str(args.loops or LOOPS[path] * 3),
    ]  # fmt: skip
    if args.quick:
        command.append("--quick")
    subprocess.run(command, check=True, capture_output=True)
    total, inclusive, own = pyspy_shares(raw, "profiled_" + path)
    print(f"-- ({shape}) {path} under py-spy: {total} samples of the main thread in the path")
    print(f"  top {args.top} inclusive (share of the path's samples):")
    for name, count in inclusive.most_common(args.top):
        print(f"    {count / total:6.1%}  {name}")
    print(f"  top {args.top} self:")
    for name, count in own.most_common(args.top):
        print(f"    {count / total:6.1%}  {name}")


# -- main ----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small states of --quick")
    parser.add_argument("--shapes", default="a,b")
    parser.add_argument("--paths", default=",".join(PATHS))
    has_pyspy = (Path(sys.executable).parent / "py-spy").exists()
    parser.add_argument(
        "--profiler",
        choices=("cprofile", "pyspy", "both"),
        default="both" if has_pyspy else "cprofile",
        help="default: both when py-spy is in this environment (not a project dependency)",
    )
    parser.add_argument("--generations", type=int, default=None, help="lookup_10k's history")
    parser.add_argument("--loops", type=int, default=0, help="profiled calls (default per path)")
    parser.add_argument("--out", type=Path, default=Path("bench-profile"), help="profiles here")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--components", action="store_true", help="time the building blocks, no profiler"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generations is None:
        args.generations = 500 if args.quick else 10_000
    args.out.mkdir(parents=True, exist_ok=True)
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    if args.components:
        for shape in args.shapes.split(","):
            work = Path(tempfile.mkdtemp(prefix="castore-prof-", dir=base))
            try:
                paths = Paths(shape, args.quick, args.generations, work)
                paths.prepare("lookup_10k")
                print(f"-- ({shape}) building blocks, unprofiled: {paths.tensors} tensors")
                run_components(paths.state, work, paths.history / "logs" / f"{RUN}.reflog")
            finally:
                shutil.rmtree(work, ignore_errors=True)
        return 0
    for shape in args.shapes.split(","):
        for path in args.paths.split(","):
            if path == "lookup_10k" and shape != args.shapes.split(",")[0]:
                continue  # the same tiny history whatever the shape
            if args.child:
                work = Path(tempfile.mkdtemp(prefix="castore-prof-", dir=base))
                try:
                    paths = Paths(shape, args.quick, args.generations, work)
                    paths.prepare(path)
                    profiled_call(paths, path, 1, None)
                    profiled_call(paths, path, args.loops, None)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                continue
            if args.profiler in ("cprofile", "both"):
                work = Path(tempfile.mkdtemp(prefix="castore-prof-", dir=base))
                try:
                    run_cprofile(Paths(shape, args.quick, args.generations, work), path, args)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
            if args.profiler in ("pyspy", "both"):
                run_pyspy(shape, path, args)
            sys.stdout.flush()
    if not args.child:
        shutil.rmtree(base / f"castore-prof-history-{args.generations}", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
