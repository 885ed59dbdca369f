"""Multi-rank restore with castore.dist: same topology (8 -> 8) against resharded (8 -> 4).

Run from the repository root::

    .venv/bin/python benchmarks/bench_restore.py [--size-mib 256] [--reps 3] [--warmup 1]
                                                 [--dir DIR] [--json OUT] [--warm-only]
                                                 [--quiet-wait 20] [--max-redo 2] [--check]

Eight real processes (``multiprocessing`` spawn) join one gloo group
(``tcp://127.0.0.1:<free port>``) and stay alive for the whole run, so process
start and imports are never timed. The parent drives them over pipes.

The state (``--size-mib`` MiB of fp32 in all) is sharded along dim 0, each rank
holding its ``numpy.array_split``-style block (``castore.Shard(local,
global_shape, offsets)``; the first ``rows % ranks`` ranks get one row more):

  chunk-aligned tensors  every row is a whole number of store chunks (4 MiB by
                         default), so any dim-0 block boundary is a chunk
                         boundary; some row counts are not divisible by 4 or 8,
                         so both splits are uneven and the 4-rank boundaries
                         fall inside the 8 saved blocks
  unaligned tensor       4000-byte rows (chunks do not hold whole rows), an odd
                         row count: resharded blocks start and end mid-chunk
  replicated             a few small plain tensors (identical on every rank),
                         plus a plain int

Every value is a cheap deterministic hash of (tensor, element index), so any
rank can rebuild any block to check it, and no two chunks are equal (no dedup).

The 8 ranks save once (``castore.dist.save``, timed for information) into a
fresh store. Then each repetition restores it with ``castore.dist.load`` into
preallocated torch tensors (filled with NaN first), once per topology:

  8 -> 8 (same)        the 8 ranks, each asking for the block it saved
  8 -> 4 (resharded)   ranks 0-3 of the same processes in a ``new_group`` of 4,
                       each asking for its 4-way dim-0 block of every tensor
                       (ranks 4-7 sit idle on their pipe)

Each topology runs cold (page cache dropped by the parent just before the
command is sent, when it may) and then warm (right after the cold run, which
read every chunk). The order of the topologies alternates from one repetition
to the next (rep 1: 8->8 then 8->4; rep 2: 8->4 then 8->8; ...), and one untimed
warm-up repetition comes first; it also checks every restored block against
the originals and restores each subset of tensors alone (aligned, unaligned,
replicated) to get bytes read per subset.

Timing: each participating rank opens the store, allocates and fills its
targets, re-touches the code paths a page-cache drop evicts (hashing, numpy,
torch, LMDB open), then enters a barrier of its group; the restore time is
the wall time of the ``load`` call alone, the max over ranks. The phases come
from ``report.timings`` (max over ranks per phase); "other" is the load time
not in any phase (the collective waits, mostly the outcome all-gather, where
fast ranks wait for the slowest). Bytes are ``report.bytes_read`` and
``report.bytes_needed`` summed over ranks; "chunk floor" is what a reader that
fetches exactly the chunks overlapping each target block would read (computed
here from the layout). "CPU s" is the user+sys CPU time of the load calls
summed over ranks (``os.times`` in each rank, all threads). The table shows
medians over the timed repetitions; ``--check`` makes a missed goal exit with
status 1.

Shared machines: before each timed restore the parent waits (up to
``--quiet-wait`` s) until other processes use under 10% of the CPUs, and
measures, from /proc, the CPU time others used during the restore (the
machine's busy time minus the parent's and the ranks'); a restore where that
exceeds 10% of the CPUs is run again (up to ``--max-redo`` times). The share
kept is in the JSON (``foreign_cpu_share``), and a warning is printed when a
disturbed restore had to be kept.

Caveat: each restore allocates its staging buffers afresh, and what that
costs depends on the allocator's state. glibc serves blocks under its dynamic
mmap threshold (at most 32 MiB) from recycled heap memory and larger ones from
fresh, zero-filled pages, so the 8 -> 8 blocks (smaller) are partly recycled
while the 8 -> 4 blocks are not. ``MALLOC_MMAP_THRESHOLD_=1048576`` in the
environment makes both topologies pay the same (every large block fresh).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _common import PipedRanks, disk_free, drop_caches, join_gloo, print_goals
from tabulate import tabulate

import castore

MIB = 1 << 20
GIB = 1 << 30
RUN = "bench"
SAVE_RANKS = 8
RESHARD_RANKS = 4
TOPOLOGIES = [SAVE_RANKS, RESHARD_RANKS]
LABELS = {SAVE_RANKS: "8→8 (same)", RESHARD_RANKS: "8→4 (resharded)"}
UNALIGNED_COLS = 1000  # 4000-byte rows: no whole number of rows fills a 4 MiB chunk
SLAB = 1 << 20  # elements generated / compared at a time (reused buffers)
PHASES = ["metadata", "planning", "read_verify", "assembly"]
SUBSETS = ["aligned", "unaligned", "replicated"]
COLLECTIVE_TIMEOUT = 300.0
FOREIGN_WARN = 0.10  # warn when other processes used more of the CPUs during a restore

# Goals (checked in evaluate_goals, on medians and summed bytes)
TIME_GOAL = 1.15  # resharded restore time <= 1.15x the same-topology restore time
BYTES_GOAL = 1.01  # bytes read <= 1.01x bytes needed for dim-0 sharding


# -- the state ---------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    kind: str  # "aligned", "unaligned" (dim-0 sharded) or "replicated"
    shape: tuple[int, ...]
    salt: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4

    @property
    def sharded(self) -> bool:
        return self.kind != "replicated"


def not_multiple_of_4(rows: int, remainder: int) -> int:
    """The nearest row count >= rows with ``rows % 4 == remainder`` (remainder in 1..3)."""
    while rows % 4 != remainder:
        rows += 1
    return rows


def build_specs(size_mib: int, chunk_size: int) -> list[TensorSpec]:
    """Tensors summing to about ``size_mib`` MiB (more when that is below the minimum shapes).

    Aligned tensors have rows of 2 or 1 chunks; at least 8 rows each, so no rank's
    block is empty.
    """
    if chunk_size % 4:
        raise ValueError(f"chunk size {chunk_size} is not a whole number of fp32 elements")
    target = size_mib * MIB
    replicated = [
        TensorSpec("final_norm.weight", "replicated", (4096,), 101),
        TensorSpec("rope.cache", "replicated", (256, 128), 102),
        TensorSpec("loss_scale", "replicated", (1,), 103),
    ]
    unaligned_rows = not_multiple_of_4(max(9, round(0.125 * target / (UNALIGNED_COLS * 4))), 1)
    unaligned = TensorSpec("lm_head.weight", "unaligned", (unaligned_rows, UNALIGNED_COLS), 4)
    used = unaligned.nbytes + sum(s.nbytes for s in replicated)
    chunks = max(0, (target - used) // chunk_size)
    cols = chunk_size // 4
    embed_rows = not_multiple_of_4(max(8, round(0.4 * chunks / 2)), 3)  # odd
    fc1_rows = not_multiple_of_4(max(8, round(0.3 * chunks)), 2)  # even, not a multiple of 4
    fc2_rows = max(8, chunks - 2 * embed_rows - fc1_rows)  # the rest, whatever it divides by
    aligned = [
        TensorSpec("embed.weight", "aligned", (embed_rows, 2 * cols), 1),
        TensorSpec("mlp.fc1.weight", "aligned", (fc1_rows, cols), 2),
        TensorSpec("mlp.fc2.weight", "aligned", (fc2_rows, cols), 3),
    ]
    return aligned + [unaligned] + replicated


def row_elems(spec: TensorSpec) -> int:
    return math.prod(spec.shape[1:])


def split(rows: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of each part, numpy.array_split style: 10 rows in 4 -> 3, 3, 2, 2."""
    base, extra = divmod(rows, parts)
    bounds, start = [], 0
    for index in range(parts):
        length = base + (1 if index < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


class _Values:
    """fp32 values of flat elements of a tensor: a 64-bit mixing hash of (salt, index).

    Computed in place in reused slab buffers (no big temporaries, so no page-fault
    storm); 24 bits of the hash are kept, exact in fp32; no two chunks are equal.
    """

    def __init__(self) -> None:
        self.iota = np.arange(SLAB, dtype=np.uint64)
        self.x = np.empty(SLAB, dtype=np.uint64)
        self.t = np.empty(SLAB, dtype=np.uint64)
        self.f = np.empty(SLAB, dtype=np.float32)

    def __call__(self, salt: int, start: int, count: int) -> np.ndarray:
        x, t, f = self.x[:count], self.t[:count], self.f[:count]
        np.add(self.iota[:count], np.uint64(start), out=x)
        np.multiply(x, np.uint64(0x9E3779B97F4A7C15), out=x)  # uint64: wraps, by design
        np.add(x, np.uint64(salt * 0xD1B54A32D192ED03 % (1 << 64)), out=x)
        for shift, factor in ((31, 0xBF58476D1CE4E5B9), (29, 0x94D049BB133111EB)):
            np.right_shift(x, np.uint64(shift), out=t)
            np.bitwise_xor(x, t, out=x)
            np.multiply(x, np.uint64(factor), out=x)
        np.right_shift(x, np.uint64(40), out=x)
        np.copyto(f, x, casting="unsafe")
        np.multiply(f, np.float32(1.0 / (1 << 24)), out=f)
        np.subtract(f, np.float32(0.5), out=f)
        return f


_VALUES: _Values | None = None


def values(salt: int, start: int, count: int) -> np.ndarray:
    """A view of the values of flat elements [start, start + count), count <= SLAB."""
    global _VALUES
    if _VALUES is None:
        _VALUES = _Values()
    return _VALUES(salt, start, count)


def fill(flat: Any, salt: int, start: int) -> None:
    """Fill a contiguous 1-D CPU torch tensor with its original values."""
    out = flat.numpy()
    for at in range(0, out.size, SLAB):
        count = min(SLAB, out.size - at)
        out[at : at + count] = values(salt, start + at, count)


def matches(flat: Any, salt: int, start: int) -> bool:
    data = flat.numpy()
    for at in range(0, data.size, SLAB):
        count = min(SLAB, data.size - at)
        if not np.array_equal(data[at : at + count], values(salt, start + at, count)):
            return False
    return True


def block_of(spec: TensorSpec, rank: int, world: int) -> tuple[int, int]:
    """(first row, rows) of ``rank``'s dim-0 block; the whole tensor when replicated."""
    if not spec.sharded:
        return 0, spec.shape[0]
    return split(spec.shape[0], world)[rank]


def tensor_tree(specs: list[TensorSpec], rank: int, world: int, kinds: set[str], *, data: bool):
    """This rank's state (``data``: filled with the originals) or load targets (NaN)."""
    import torch

    from castore import Shard

    tree: dict[str, Any] = {"model": {}, "replicated": {}}
    for spec in specs:
        if spec.kind not in kinds:
            continue
        first, rows = block_of(spec, rank, world)
        local = torch.empty((rows, *spec.shape[1:]), dtype=torch.float32)
        if data:
            fill(local.view(-1), spec.salt, first * row_elems(spec))
        else:
            local.fill_(float("nan"))  # touched, like live parameters, and checkably stale
        if spec.sharded:
            offsets = (first,) + (0,) * (len(spec.shape) - 1)
            tree["model"][spec.name] = Shard(local, spec.shape, offsets)
        else:
            tree["replicated"][spec.name] = local
    return tree


def check_tree(specs: list[TensorSpec], tree: dict[str, Any], rank: int, world: int) -> list[str]:
    """Names of the restored blocks that differ from the originals."""
    from castore import Shard

    bad = []
    for spec in specs:
        section = tree["model"] if spec.sharded else tree["replicated"]
        if spec.name not in section:
            continue
        leaf = section[spec.name]
        local = leaf.local if isinstance(leaf, Shard) else leaf
        first, _ = block_of(spec, rank, world)
        if not matches(local.reshape(-1), spec.salt, first * row_elems(spec)):
            bad.append(spec.name)
    return bad


def chunk_floor(spec: TensorSpec, world: int, chunk_size: int) -> tuple[int, int]:
    """(bytes needed, bytes of the chunks overlapping the targets), summed over ``world`` ranks."""
    if not spec.sharded:
        return world * spec.nbytes, world * spec.nbytes  # read whole by every rank
    row_bytes = spec.nbytes // spec.shape[0]
    needed = floor = 0
    for start, length in split(spec.shape[0], world):
        needed += length * row_bytes
        for saved_start, saved_len in split(spec.shape[0], SAVE_RANKS):
            lo, hi = max(start, saved_start), min(start + length, saved_start + saved_len)
            if hi <= lo:
                continue
            box_bytes = saved_len * row_bytes
            first = (lo - saved_start) * row_bytes // chunk_size
            last = ((hi - saved_start) * row_bytes - 1) // chunk_size
            floor += sum(
                min(chunk_size, box_bytes - i * chunk_size) for i in range(first, last + 1)
            )
    return needed, floor


# -- the ranks ---------------------------------------------------------------


def rewarm_code(store_path: str) -> None:
    """Touch the code a page-cache drop evicted (not the store's data) before a timed load."""
    import torch

    from castore.format.hashing import digest_bytes

    digest_bytes(bytes(1 << 20), threads=1)
    np.frombuffer(bytes(1 << 16), dtype=np.uint8).copy()
    torch.zeros(1 << 14).add_(1.0)
    castore.open(store_path, create=False).close()


def worker(rank: int, port: int, store_path: str, specs: list[TensorSpec], conn: Any) -> None:
    import torch.distributed as dist

    import castore.dist

    try:
        join_gloo(rank, port, SAVE_RANKS, COLLECTIVE_TIMEOUT)
        groups = {SAVE_RANKS: None, RESHARD_RANKS: dist.new_group(list(range(RESHARD_RANKS)))}
    except Exception:  # noqa: BLE001 - the parent must hear about it
        conn.send({"error": traceback.format_exc()})
        return
    conn.send({"ready": True})
    all_kinds = {"aligned", "unaligned", "replicated"}

    def save() -> dict[str, Any]:
        state = tensor_tree(specs, rank, SAVE_RANKS, all_kinds, data=True)
        state["step"] = 1000
        store = castore.open(store_path, create=False)
        try:
            dist.barrier()
            started = time.perf_counter()
            generation = castore.dist.save(
                store, state, run=RUN, step=1000, timeout=COLLECTIVE_TIMEOUT
            )
            seconds = time.perf_counter() - started
        finally:
            store.close()
        return {
            "seconds": seconds,
            "generation": generation.id,
            "new_bytes": generation.new_bytes,
            "logical_bytes": generation.logical_bytes,
        }

    def restore(world: int, kinds: list[str], verify: bool) -> dict[str, Any]:
        if rank >= world:
            return {"idle": True}
        group = groups[world]
        targets = tensor_tree(specs, rank, world, set(kinds), data=False)
        rewarm_code(store_path)
        store = castore.open(store_path, create=False)
        try:
            dist.barrier(group=group)
            cpu_before = os.times()
            began = time.time()
            started = time.perf_counter()
            result = castore.dist.load(store, RUN, targets, group=group, timeout=COLLECTIVE_TIMEOUT)
            seconds = time.perf_counter() - started
            ended = time.time()
            cpu_after = os.times()
        finally:
            store.close()
        report = result.report
        out = {
            "seconds": seconds,
            "cpu_s": (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system),
            "cpu_sys_s": cpu_after.system - cpu_before.system,
            "began": began,
            "ended": ended,
            "bytes_read": report.bytes_read,
            "bytes_needed": report.bytes_needed,
            "chunks_read": report.chunks_read,
            "timings": dict(report.timings),
        }
        if verify:
            out["bad"] = check_tree(specs, targets, rank, world)
            out["same_objects"] = all(
                result.state[section][name] is leaf
                for section in ("model", "replicated")
                for name, leaf in targets[section].items()
            )
        return out

    while True:
        command = conn.recv()
        if command[0] == "stop":
            break
        try:
            if command[0] == "save":
                reply = save()
            elif command[0] == "rss":
                reply = {}
            else:
                reply = restore(*command[1:])
            reply["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        except Exception:  # noqa: BLE001 - the parent must hear about it
            reply = {"error": traceback.format_exc()}
        conn.send(reply)
    dist.destroy_process_group()


class Ranks(PipedRanks):
    """Eight live worker processes in one gloo group, driven over pipes."""

    def __init__(self, store_path: Path, specs: list[TensorSpec]) -> None:
        self.foreign_cpu_s = 0.0
        super().__init__(SAVE_RANKS, worker, (str(store_path), specs), "bench-rank")

    def command(self, *command: Any) -> list[dict[str, Any]]:
        """Send ``command`` to every rank; their replies, plus the CPU others used meanwhile.

        ``self.foreign_cpu_s`` is the machine's busy CPU time (steal included) during the
        command minus what this parent and the ranks used: other work on the machine.
        """
        before = machine_busy_s(), self.own_cpu_s()
        replies = super().command(*command)
        self.foreign_cpu_s = (machine_busy_s() - before[0]) - (self.own_cpu_s() - before[1])
        return replies

    def own_cpu_s(self) -> float:
        parent = os.times()
        return parent.user + parent.system + sum(process_cpu_s(p.pid) for p in self.procs)


_TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all CPUs; steal included) since boot."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _TICK


def process_cpu_s(pid: int) -> float:
    """user + system CPU seconds of one process, all its threads."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


# -- page cache --------------------------------------------------------------


# -- the run -----------------------------------------------------------------


@dataclass
class Results:
    times: dict[str, list[float]] = field(default_factory=dict)
    spans: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)  # CPU s of the load, summed
    cpu_sys: dict[str, list[float]] = field(default_factory=dict)  # of which in the kernel
    per_rank: dict[str, list[list[dict[str, Any]]]] = field(default_factory=dict)
    foreign: dict[str, list[float]] = field(default_factory=dict)  # share of the CPUs
    phases: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # per topology, "overall"
    notes: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, world: int, replies: list[dict[str, Any]]) -> None:
        active = [r for r in replies if not r.get("idle")]
        self.times.setdefault(key, []).append(max(r["seconds"] for r in active))
        self.spans.setdefault(key, []).append(
            max(r["ended"] for r in active) - min(r["began"] for r in active)
        )
        self.cpu.setdefault(key, []).append(sum(r["cpu_s"] for r in active))
        self.cpu_sys.setdefault(key, []).append(sum(r["cpu_sys_s"] for r in active))
        fields = ("seconds", "cpu_s", "cpu_sys_s", "timings", "bytes_read", "bytes_needed")
        self.per_rank.setdefault(key, []).append([{f: r[f] for f in fields} for r in active])
        names = list(PHASES) + sorted({k for r in active for k in r["timings"]} - set(PHASES))
        phases = self.phases.setdefault(key, {})
        for name in names:
            phases.setdefault(name, []).append(max(r["timings"].get(name, 0.0) for r in active))
        phases.setdefault("other", []).append(
            max(r["seconds"] - sum(r["timings"].values()) for r in active)
        )
        totals = byte_totals(active)
        seen = self.bytes.setdefault(f"{world}/overall", totals)
        if seen != totals:
            self.notes.setdefault("byte_count_drift", []).append({key: totals, "first": seen})

    def median(self, key: str) -> float:
        return statistics.median(self.times[key])


def byte_totals(active: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "bytes_read": sum(r["bytes_read"] for r in active),
        "bytes_needed": sum(r["bytes_needed"] for r in active),
        "chunks_read": sum(r["chunks_read"] for r in active),
    }


def key_of(world: int, mode: str) -> str:
    return f"{LABELS[world]} {mode}"


@dataclass
class Quiet:
    """Keeping other work on a shared machine out of the timings.

    Before each timed restore, wait (up to ``wait_s``) until other processes use
    under FOREIGN_WARN of the CPUs; a restore during which they used more is
    run again (cache dropped again when cold), up to ``max_redo`` times.
    """

    wait_s: float
    max_redo: int
    waited_s: float = 0.0
    redone: int = 0
    gave_up: int = 0

    def wait(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            before, started = machine_busy_s(), time.monotonic()
            time.sleep(0.5)
            share = (machine_busy_s() - before) / (
                (time.monotonic() - started) * (os.cpu_count() or 1)
            )
            self.waited_s += time.monotonic() - started
            if share < FOREIGN_WARN or time.monotonic() > deadline:
                return


def timed_restore(
    ranks: Ranks, world: int, mode: str, verify: bool, quiet: Quiet
) -> tuple[list[dict[str, Any]], float]:
    """One restore of every tensor; its replies and the share of the CPUs others used."""
    everything = ["aligned", "unaligned", "replicated"]
    for attempt in range(quiet.max_redo + 1):
        quiet.wait()
        if mode == "cold" and not drop_caches():
            raise RuntimeError("dropping the page cache stopped working")
        began = time.perf_counter()
        replies = ranks.command("restore", world, everything, verify)
        share = ranks.foreign_cpu_s / ((time.perf_counter() - began) * (os.cpu_count() or 1))
        if share <= FOREIGN_WARN:
            break
        if attempt < quiet.max_redo:
            quiet.redone += 1
        else:
            quiet.gave_up += 1
    return replies, share


def one_rep(
    rep: int, ranks: Ranks, results: Results, cold: bool, verify: bool, quiet: Quiet
) -> None:
    """Both topologies, cold (when possible) then warm; the order alternates with ``rep``."""
    order = TOPOLOGIES if rep % 2 == 0 else TOPOLOGIES[::-1]
    for world in order:
        modes = ["cold", "warm"] if cold else ["warm"]
        if not cold:  # the store into the page cache
            ranks.command("restore", world, ["aligned", "unaligned", "replicated"], False)
        for mode in modes:
            replies, share = timed_restore(ranks, world, mode, verify, quiet)
            results.foreign.setdefault(key_of(world, mode), []).append(share)
            if verify:
                check_replies(replies, f"{LABELS[world]} {mode}")
            results.add(key_of(world, mode), world, replies)


def check_replies(replies: list[dict[str, Any]], what: str) -> None:
    for rank, reply in enumerate(replies):
        if reply.get("idle"):
            continue
        if reply["bad"]:
            raise AssertionError(f"{what}: rank {rank} restored wrong values in {reply['bad']}")
        if not reply["same_objects"]:
            raise AssertionError(f"{what}: rank {rank}: result.state does not hold its targets")


def subset_bytes(ranks: Ranks, results: Results) -> None:
    """Bytes read and needed per subset of tensors (untimed, warm), each restored alone."""
    for world in TOPOLOGIES:
        for subset in SUBSETS:
            replies = ranks.command("restore", world, [subset], True)
            check_replies(replies, f"{LABELS[world]} {subset} only")
            results.bytes[f"{world}/{subset}"] = byte_totals(
                [r for r in replies if not r.get("idle")]
            )


def summarize(
    results: Results, specs: list[TensorSpec], chunk_size: int, cold: bool
) -> tuple[list[list[Any]], list[dict[str, Any]], list[list[Any]], list[dict[str, Any]]]:
    time_rows, time_records = [], []
    modes = ["cold", "warm"] if cold else ["warm"]
    for mode in modes:
        reference = results.median(key_of(SAVE_RANKS, mode))
        for world in TOPOLOGIES:
            key = key_of(world, mode)
            med = results.median(key)
            phases = {n: statistics.median(v) for n, v in results.phases[key].items()}
            overall = results.bytes[f"{world}/overall"]
            ratio_bytes = overall["bytes_read"] / overall["bytes_needed"]
            time_rows.append(
                [
                    LABELS[world],
                    mode,
                    f"{med:.3f}",
                    f"{min(results.times[key]):.3f}",
                    f"{med / reference:.2f}x",
                    f"{ratio_bytes:.4f}",
                    f"{statistics.median(results.cpu[key]):.2f} "
                    f"({statistics.median(results.cpu_sys[key]):.2f})",
                    *(f"{phases[n]:.3f}" for n in phases),
                ]
            )
            time_records.append(
                {
                    "topology": LABELS[world],
                    "restore_ranks": world,
                    "cache": mode,
                    "median_s": med,
                    "min_s": min(results.times[key]),
                    "times_s": results.times[key],
                    "span_s": results.spans[key],
                    "cpu_s_summed_over_ranks": results.cpu[key],
                    "cpu_sys_s_summed_over_ranks": results.cpu_sys[key],
                    "per_rank": results.per_rank[key],
                    "foreign_cpu_share": results.foreign[key],
                    "ratio_vs_same": med / reference,
                    "bytes_read_over_needed": ratio_bytes,
                    "phase_medians_s": phases,
                    "phase_times_s": results.phases[key],
                }
            )
    byte_rows, byte_records = [], []
    for world in TOPOLOGIES:
        for subset in [*SUBSETS, "overall"]:
            got = results.bytes[f"{world}/{subset}"]
            chosen = [s for s in specs if subset in ("overall", s.kind)]
            floors = [chunk_floor(s, world, chunk_size) for s in chosen]
            needed, floor = sum(f[0] for f in floors), sum(f[1] for f in floors)
            byte_rows.append(
                [
                    LABELS[world],
                    subset,
                    f"{got['bytes_needed'] / MIB:.2f}",
                    f"{got['bytes_read'] / MIB:.2f}",
                    f"{got['bytes_read'] / got['bytes_needed']:.4f}",
                    f"{floor / needed:.4f}",
                    got["chunks_read"],
                ]
            )
            byte_records.append(
                {
                    "topology": LABELS[world],
                    "subset": subset,
                    **got,
                    "read_over_needed": got["bytes_read"] / got["bytes_needed"],
                    "layout_needed_bytes": needed,
                    "chunk_floor_bytes": floor,
                }
            )
    return time_rows, time_records, byte_rows, byte_records


def evaluate_goals(results: Results, cold: bool) -> list[dict[str, Any]]:
    verdicts = []
    for mode in ["cold", "warm"] if cold else ["warm"]:
        ratio = results.median(key_of(RESHARD_RANKS, mode)) / results.median(
            key_of(SAVE_RANKS, mode)
        )
        verdicts.append(
            {
                "goal": f"resharded restore <= {TIME_GOAL}x same-topology time ({mode})",
                "measured": f"{ratio:.3f}x",
                "value": ratio,
                "met": ratio <= TIME_GOAL,
            }
        )
    for world in [RESHARD_RANKS, SAVE_RANKS]:
        for subset, text in [("aligned", "chunk-aligned dim-0 tensors"), ("overall", "overall")]:
            got = results.bytes[f"{world}/{subset}"]
            ratio = got["bytes_read"] / got["bytes_needed"]
            verdicts.append(
                {
                    "goal": f"bytes read <= {BYTES_GOAL}x needed, {text}, {LABELS[world]}",
                    "measured": f"{ratio:.4f}x",
                    "value": ratio,
                    "met": ratio <= BYTES_GOAL,
                }
            )
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256, help="state size (default 256)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed repetitions first (default 1, min 1)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default /tmp)")
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    parser.add_argument("--warm-only", action="store_true", help="do not drop the page cache")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        help="before each timed restore, wait up to this long for other work to stop (s, 20)",
    )
    parser.add_argument(
        "--max-redo",
        type=int,
        default=2,
        help="rerun a restore disturbed by other work up to this many times (default 2)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is not met")
    args = parser.parse_args(argv)
    args.warmup = max(1, args.warmup)  # the first (untimed) repetition verifies

    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    need = int(2.5 * args.size_mib * MIB)
    if disk_free(base) < need:
        print(f"not enough disk under {base}: need {need / GIB:.1f} GiB", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="castore-bench-restore-", dir=base))
    store_path = work / "store"
    with castore.open(store_path) as store:  # created once, here, before the ranks race
        chunk_size = store.chunk_size
    specs = build_specs(args.size_mib, chunk_size)
    logical = sum(s.nbytes for s in specs)
    cold = not args.warm_only and drop_caches()
    print(f"{len(specs)} tensors, {logical / MIB:.1f} MiB, chunk size {chunk_size / MIB:g} MiB:")
    for spec in specs:
        splits = (
            " / ".join(",".join(str(n) for _, n in split(spec.shape[0], w)) for w in TOPOLOGIES)
            if spec.sharded
            else "whole on every rank"
        )
        print(f"  {spec.kind:10} {spec.name:18} {spec.shape!s:16} rows per rank: {splits}")
    print(
        f"page cache drop: {'works, restores are cold and warm' if cold else 'not used: warm only'}"
        f"\nscratch: {work}, reps: {args.reps} (+{args.warmup} untimed warm-up)",
        flush=True,
    )

    results = Results()
    quiet = Quiet(args.quiet_wait, args.max_redo)
    started = time.perf_counter()
    ranks: Ranks | None = None
    try:
        ranks = Ranks(store_path, specs)
        print(f"{SAVE_RANKS} ranks up in {time.perf_counter() - started:.1f} s", flush=True)
        saves = ranks.command("save")
        results.notes["save_s"] = max(r["seconds"] for r in saves)
        results.notes["save_new_bytes"] = saves[0]["new_bytes"]
        print(
            f"save ({SAVE_RANKS} ranks, castore.dist.save): {results.notes['save_s']:.2f} s, "
            f"{saves[0]['new_bytes'] / MIB:.1f} MiB of new chunks",
            flush=True,
        )
        os.sync()
        for rep in range(-args.warmup, args.reps):
            rep_start = time.perf_counter()
            first = rep == -args.warmup
            one_rep(rep, ranks, results if rep >= 0 else Results(), cold, first, quiet)
            if first:
                subset_bytes(ranks, results)
            label = f"rep {rep + 1}/{args.reps}" if rep >= 0 else "warm-up (untimed, verified)"
            print(f"{label}: {time.perf_counter() - rep_start:.1f} s", flush=True)
        results.notes["max_rss_mib_per_rank"] = [r["max_rss_mib"] for r in ranks.command("rss")]
    finally:
        if ranks is not None:
            ranks.close()
        shutil.rmtree(work, ignore_errors=True)
    print("verified once: every restored block equals the original\n")

    time_rows, time_records, byte_rows, byte_records = summarize(results, specs, chunk_size, cold)
    phase_names = list(time_records[0]["phase_medians_s"])
    headers = ["topology", "cache", "median s", "min s", "x 8→8", "read/needed", "CPU s (sys)"]
    headers += [f"{name} s" for name in phase_names]
    print(tabulate(time_rows, headers=headers, tablefmt="github", disable_numparse=True))
    print(
        "\nrestore s: wall time of castore.dist.load, max over ranks (after a barrier); "
        "'x 8→8': median over the same-topology median, same cache state (<1 = faster).\n"
        "phases: report.timings, max over ranks, median over reps; 'other' = load time "
        "outside every phase (collective waits).\n"
        f"CPU s: user+sys CPU time of the load calls summed over ranks (in brackets: sys), "
        f"median over reps "
        f"({os.cpu_count()} CPUs here: wall >= CPU s / {os.cpu_count()}).\n"
    )
    headers = ["topology", "subset", "needed MiB", "read MiB", "read/needed", "chunk floor"]
    headers += ["chunks read"]
    print(tabulate(byte_rows, headers=headers, tablefmt="github", disable_numparse=True))
    print(
        "\nbytes: report.bytes_read / bytes_needed summed over ranks (subsets restored alone); "
        "'chunk floor': the bytes of the chunks overlapping each target block, over the bytes "
        "needed (the least a chunk-granular reader can read)."
    )
    print(
        f"save: {results.notes['save_s']:.2f} s; peak RSS per rank (MiB): "
        f"{', '.join(f'{m:.0f}' for m in results.notes['max_rss_mib_per_rank'])}"
    )

    shares = [v for key in results.times for v in results.foreign[key]]
    results.notes["quiet"] = {
        "waited_s": quiet.waited_s,
        "restores_rerun": quiet.redone,
        "kept_although_disturbed": quiet.gave_up,
    }
    print(
        f"other work on the machine during the kept restores: median "
        f"{statistics.median(shares):.1%}, max {max(shares):.1%} of the CPUs "
        f"({quiet.redone} disturbed restores rerun, {quiet.waited_s:.0f} s spent waiting "
        "for quiet)"
    )
    if max(shares) > FOREIGN_WARN:
        print(
            f"WARNING: other processes used over {FOREIGN_WARN:.0%} of the CPUs during some "
            "restores; those times are inflated (see 'foreign_cpu_share' in the JSON)"
        )
    print()

    verdicts = evaluate_goals(results, cold)
    print_goals(verdicts)
    print(f"\ntotal time {time.perf_counter() - started:.0f} s")

    if args.json:
        payload = {
            "size_mib": args.size_mib,
            "logical_bytes": logical,
            "chunk_size": chunk_size,
            "tensors": [asdict(s) for s in specs],
            "save_ranks": SAVE_RANKS,
            "reshard_ranks": RESHARD_RANKS,
            "reps": args.reps,
            "warmup_reps": args.warmup,
            "cold_restores": cold,
            "scratch_dir": str(base),
            "versions": {
                "python": platform.python_version(),
                "torch": importlib.metadata.version("torch"),
                "castore": castore.__version__,
            },
            "cpus": os.cpu_count(),
            "restores": time_records,
            "bytes": byte_records,
            "notes": results.notes,
            "goals": verdicts,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if args.check and not all(v["met"] for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
