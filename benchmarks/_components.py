"""Unprofiled timings of the building blocks of a castore call, for profile_call_costs.py.

Each block is timed alone (median CPU time of ``REPEATS`` runs, garbage
collected first) on a store holding one full save of the state, so that its cost per
tensor, per chunk or per reflog record can be read without a profiler's
overhead. These reach into castore's modules (format, core, chunkstore),
never into private names.
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import msgpack
import torch
from bench_call_costs import RUN, castore_save
from safetensors.torch import save_file

import castore
from castore.core.chunkio import write_leaves
from castore.core.chunkread import ReadCounters
from castore.core.commit import build_shard
from castore.core.reading import group_entries, plan_tensor, read_shards
from castore.core.readplan import ReadPlan, read_plan
from castore.format.objects import TYPE_SHARD, TensorEntry, decode_object
from castore.format.tree import decode_tree, encode_state

REPEATS = 5


def median_time(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    """Median CPU seconds of this process (every thread) over ``repeats`` calls.

    CPU time, not wall time: on a shared, oversubscribed machine the wall
    clock counts the time other processes ran; the work done is the CPU time.
    """
    times = []
    for _ in range(repeats):
        gc.collect()
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return statistics.median(times)


def cpu_time(
    fn: Callable[[], Any], after: Callable[[], Any], repeats: int = REPEATS
) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds of this process, every thread); ``after``
    runs untimed after each call."""
    walls, cpus = [], []
    for _ in range(repeats):
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        after()
    return statistics.median(walls), statistics.median(cpus)


def report(label: str, seconds: float, units: int, unit: str) -> None:
    print(f"    {seconds * 1e3:9.2f} ms CPU {seconds / units * 1e6:9.2f} us/{unit}  {label}")


def save_blocks(state: dict[str, torch.Tensor], store: castore.Store) -> None:
    n = len(state)
    encoded = encode_state(state)
    report("encode_state (tree + leaves)", median_time(lambda: encode_state(state)), n, "tensor")
    report(
        "minimum per tensor: reshape(-1).view(uint8).numpy()",
        median_time(lambda: [t.reshape(-1).view(torch.uint8).numpy() for t in state.values()]),
        n,
        "tensor",
    )
    report(
        "write_leaves, every chunk present (hash + index lookups + entries)",
        median_time(lambda: write_leaves(store.backend, encoded.leaves, store.chunk_size)),
        n,
        "tensor",
    )
    entries, stats = write_leaves(store.backend, encoded.leaves, store.chunk_size)
    report(
        "TensorEntry objects for every leaf",
        median_time(lambda: [TensorEntry(**vars(e)) for e in entries]),
        n,
        "tensor",
    )
    shard_args = dict(run=RUN, generation=9, rank=0, local_state=b"", local_tensors=[])
    report(
        "build_shard: ShardManifest, encode_object, blake3",
        median_time(lambda: build_shard(tensors=entries, stats=stats, **shard_args)),
        n,
        "tensor",
    )
    data = build_shard(tensors=entries, stats=stats, **shard_args).data
    print(f"    shard manifest: {len(data):,} bytes ({len(data) / n:.0f} per tensor)")
    report(
        "msgpack.unpackb of the manifest", median_time(lambda: msgpack.unpackb(data)), n, "tensor"
    )
    wire = msgpack.unpackb(data)
    report(
        "TensorEntry.from_wire for every entry (fields typed, check())",
        median_time(lambda: [TensorEntry.from_wire(t) for t in wire["tensors"]]),
        n,
        "tensor",
    )
    report(
        "decode_object(manifest) whole",
        median_time(lambda: decode_object(data, expect=TYPE_SHARD)),
        n,
        "tensor",
    )
    report("blake3 of the manifest", median_time(lambda: blake3.blake3(data).digest()), n, "tensor")


def load_blocks(state: dict[str, torch.Tensor], store: castore.Store) -> None:
    n = len(state)
    _, root = store.resolve_root(RUN, "latest")
    report(
        "read_shards (get, blake3, decode)",
        median_time(lambda: read_shards(store.backend, root)),
        n,
        "tensor",
    )
    shards = read_shards(store.backend, root)
    where = {"run": RUN, "generation": root.generation}
    report("group_entries", median_time(lambda: group_entries(shards, where)), n, "tensor")
    entries = group_entries(shards, where)

    def plan() -> ReadPlan:
        reads = ReadPlan()
        for boxes in entries.values():
            plan_tensor(boxes, "torch", where, reads)
        return reads

    report("plan_tensor for every tensor (allocate, plan)", median_time(plan), n, "tensor")
    report(
        "torch.empty for every tensor alone",
        median_time(lambda: [torch.empty(t.shape, dtype=t.dtype) for t in state.values()]),
        n,
        "tensor",
    )
    planned = plan()
    chunks = len(planned.keys) + len(planned.requests)
    report(
        "read_plan: read, verify every chunk in place (plan included)",
        median_time(lambda: read_plan(store.backend, plan(), ReadCounters(), where)),
        chunks,
        "chunk",
    )
    # The same with the backend's pread reader withheld: read_many maps the packs,
    # each chunk is hashed where it is mapped, then copied (what every load did before).
    reader = store.backend.chunk_reader
    store.backend.chunk_reader = lambda keys: None  # type: ignore[method-assign]
    try:
        report(
            "read_plan through read_many: map, verify, copy (plan included)",
            median_time(lambda: read_plan(store.backend, plan(), ReadCounters(), where)),
            chunks,
            "chunk",
        )
    finally:
        store.backend.chunk_reader = reader  # type: ignore[method-assign]
    tensors = {name: None for name in entries}
    report(
        "decode_tree of the root's state skeleton",
        median_time(lambda: decode_tree(root.state, lambda name, _f: tensors[name], lambda p: {})),
        n,
        "tensor",
    )
    print(f"    root state skeleton: {len(root.state):,} bytes; {chunks} chunk requests")


def open_blocks(path: Path) -> None:
    def open_close() -> None:
        with castore.open(path, create=False):
            pass

    def open_latest() -> None:
        with castore.open(path, create=False) as store:
            store.resolve_root(RUN, "latest")

    report("castore.open + close", median_time(open_close, 20), 1, "call")
    report("castore.open + resolve_root('latest') + close", median_time(open_latest, 20), 1, "call")


def reflog_blocks(reflog: Path) -> None:
    lines = [line for line in reflog.read_bytes().split(b"\n") if line]
    n = len(lines)
    texts = [line.rpartition(b"\t")[0] for line in lines]
    report("split lines", median_time(lambda: reflog.read_bytes().split(b"\n")), n, "record")
    report(
        "blake3 of each record's JSON",
        median_time(lambda: [blake3.blake3(t).digest() for t in texts]),
        n,
        "record",
    )
    report(
        "json.loads of each record",
        median_time(lambda: [json.loads(t) for t in texts]),
        n,
        "record",
    )


def cpu_of_saves(state: dict[str, torch.Tensor], work: Path) -> None:
    store, single = work / "cpu-castore", work / "cpu.safetensors"

    def ours() -> None:
        castore_save(state, store)

    def theirs() -> None:
        save_file(state, single)

    def clean() -> None:
        shutil.rmtree(store, ignore_errors=True)
        single.unlink(missing_ok=True)

    for label, fn in (("castore save", ours), ("safetensors save_file", theirs)):
        wall, cpu = cpu_time(fn, clean, 3)
        print(f"    {label}: {wall:.3f} s wall, {cpu:.3f} s CPU (all threads)")


def run_components(state: dict[str, torch.Tensor], work: Path, reflog: Path | None) -> None:
    store_path = work / "components-store"
    castore_save(state, store_path)
    with castore.open(store_path, create=False) as store:
        print("  save blocks (store holds the state already: every chunk present)")
        save_blocks(state, store)
        print("  load blocks")
        load_blocks(state, store)
    print("  open")
    open_blocks(store_path)
    print("  CPU time of a full save, castore against safetensors")
    cpu_of_saves(state, work)
    if reflog is not None:
        print(f"  reflog parts ({reflog})")
        reflog_blocks(reflog)
