"""The cost of a tensor and of a call: castore against safetensors, torch and DCP, with the floor.

Run from the repository root::

    .venv/bin/python benchmarks/bench_call_costs.py [--quick] [--reps 3] [--warmup 1]
                                                    [--generations 10000] [--dir DIR]
                                                    [--only loads,slices,...] [--json OUT]

Everything runs on tmpfs (``/dev/shm`` when writable, else the system's temp
directory; the run says which), so the figures are software cost: an fsync
there returns at once. Two states (issue 26), fp32, built once each:

(a) 512 MiB in 64 tensors, the transformer of ``bench_save_load.py``: 7 blocks
    of 9 tensors and one embedding. Bytes dominate.
(b) 256 MiB in 2,004 tensors, LLM-shaped (:func:`build_llm_state`): 100 decoder
    blocks of 7 matrices (q, k, v, o with 4:1 grouped-query k/v; a SwiGLU
    MLP's gate, up and down) and 13 vectors and scalars (two LayerNorms with
    bias, q/k/v/o biases, per-head q/k norms, attention sinks, the down
    projection's bias, a scalar residual gate), a final LayerNorm, and an
    untied embedding and LM head that take the rest of the budget.
    1,302 tensors are at most 4 KiB. Fixed per-tensor costs dominate.

Each repetition runs every step once, interleaved: the order of the saves, of
the loads and of the slices rotates from one repetition to the next, and one
untimed warm-up repetition comes first. Before every timed step the results
of the step before are dropped and the garbage collector runs. Steps:

saves (each into a new path; every one synced as its writer syncs)
  castore save        ``castore.open(new)``, ``save``, ``close`` (pack fdatasync, LMDB
                      commit, ref and reflog, directory fsyncs)
  safetensors save    ``save_file`` then ``os.fsync`` of the file
  torch.save          to a file, ``flush``, ``os.fsync``
  DCP save            ``dcp.save(FileSystemWriter(sync_files=True), no_dist=True)``
warm loads (the files are in memory: tmpfs)
  castore load        ``castore.open``, ``load(framework="torch")``, ``close``; every
                      chunk verified
  safetensors load    ``load_file(backend="pread")``; ``backend="mmap"`` is measured too
  torch.load          ``torch.load(weights_only=True)``
  DCP load            ``torch.empty_like`` for every tensor (timed), then ``dcp.load``
slices (rows 100:104 of one mid-sized matrix, open included)
  castore read_slice  ``castore.open`` (a fresh handle), ``read_slice(framework="torch")``,
                      ``close``
  safetensors slice   ``safe_open(...)`` (mmap) and ``get_slice(name)[100:104]``
re-saves into the store holding the full save (open and close included, as there)
  1% and 10% of the bytes changed: whole tensors from the top block down, and
  the leading elements of one more tensor to make the fraction exact.
castore open + close of the existing store, alone: part of every castore row.

The floor beside each row is the verified cost castore cannot avoid: one
blake3 pass over the bytes it must verify, cut and threaded as castore cuts
and threads them (chunks of ``DEFAULT_CHUNK_SIZE``; chunks of at least
``INLINE_BYTES`` on a pool of max(2, min(8, CPUs)) threads in tasks of about
``TASK_BYTES``, smaller ones on the calling thread), plus one copy of the
bytes it must move into memory already mapped (a memcpy; what a load pays
beyond that to fault in fresh pages, ``torch.empty`` + first touch of every
byte, is measured too: "fresh pages" in the JSON and the run's output). Each
floor part is the best of three tries within a repetition (a floor is what it
costs at best; this machine is shared), then the median over the repetitions.
Saves and loads: every byte hashed and copied. A slice: the chunks the rows
overlap hashed, the rows copied. A re-save: every byte hashed, the changed
bytes copied.

Last, the first lookup by generation id in a new process: a store with one
generation and one with ``--generations`` (10,000), of a tiny state (one
1 KiB tensor and a step); each measurement is a new Python process that
imports castore (untimed), then times ``castore.open``, ``resolve(run, 1)``
and ``close``. ``resolve(run, "latest")`` is timed the same way for contrast.

The table gives medians, absolute seconds and ratios: against a peer, the
peer's time over castore's (castore's speed in units of the peer's, >1 =
castore faster); a re-save, its time over castore's own full save; a lookup,
its time at the long history over its time at one generation. ``--json``
writes every repetition's times. ``--only`` runs some of the step groups
(``loads``, ``slices``, ``resaves``, ``lookups``; the saves, which make the
files, and the floors always run) and leaves the others' rows out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import safetensors
import torch
import torch.distributed.checkpoint as dcp
from bench_save_load import build_state
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import castore
from castore.core.chunkio import DEFAULT_CHUNK_SIZE
from castore.core.hashpool import INLINE_BYTES, TASK_BYTES

MIB = 1 << 20
RUN = "bench"
SMALL = 4096  # "small tensor": at most this many bytes
SLICE_ROWS = slice(100, 104)
HASH_WORKERS = max(2, min(8, os.cpu_count() or 2))  # castore.core.hashpool's pool size
LLM_LAYERS = 100
LLM_HEAD_DIM = 64


@dataclass(frozen=True)
class Shape:
    key: str
    label: str
    size_mib: int
    slice_tensor: str  # a mid-sized matrix read_slice reads a few rows of


SHAPES = {
    "a": Shape("a", "512 MiB, 64 tensors", 512, "layers.3.attn.out.weight"),
    "b": Shape("b", "256 MiB, 2,004 tensors (LLM)", 256, "layers.50.mlp.up_proj.weight"),
}
QUICK_SIZE_MIB = {"a": 64, "b": 32}
GROUPS = ("loads", "slices", "resaves", "lookups")  # --only: the saves and floors always run


# -- states --------------------------------------------------------------------


def _llm_dims(hidden: int) -> tuple[int, int, int]:
    """(k/v width, MLP width, heads) of a block of width ``hidden``."""
    kv = max(LLM_HEAD_DIM, hidden // 4)  # grouped-query attention, 4 query heads per k/v head
    mlp = -(-8 * hidden // 3 // 64) * 64  # SwiGLU's 8/3 h, rounded up to 64
    return kv, mlp, hidden // LLM_HEAD_DIM


def _llm_block(prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
    kv, mlp, heads = _llm_dims(hidden)
    h = (hidden,)
    return {
        prefix + "attn_norm.weight": h,
        prefix + "attn_norm.bias": h,
        prefix + "attn.q_proj.weight": (hidden, hidden),
        prefix + "attn.q_proj.bias": h,
        prefix + "attn.k_proj.weight": (kv, hidden),
        prefix + "attn.k_proj.bias": (kv,),
        prefix + "attn.v_proj.weight": (kv, hidden),
        prefix + "attn.v_proj.bias": (kv,),
        prefix + "attn.o_proj.weight": (hidden, hidden),
        prefix + "attn.o_proj.bias": h,
        prefix + "attn.q_norm.weight": (LLM_HEAD_DIM,),
        prefix + "attn.k_norm.weight": (LLM_HEAD_DIM,),
        prefix + "attn.sinks": (heads,),
        prefix + "mlp_norm.weight": h,
        prefix + "mlp_norm.bias": h,
        prefix + "mlp.gate_proj.weight": (mlp, hidden),
        prefix + "mlp.up_proj.weight": (mlp, hidden),
        prefix + "mlp.down_proj.weight": (hidden, mlp),
        prefix + "mlp.down_proj.bias": h,
        prefix + "mlp.gate": (),
    }


def build_llm_state(size_mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """~size_mib MiB in 2,004 fp32 tensors: 100 blocks of 20, a final norm, embedding, head.

    The width is the largest multiple of 64 whose blocks take at most three
    quarters of the budget (at most 1,024, so every vector stays <= 4 KiB);
    the untied embedding and LM head share the rest.
    """
    target = size_mib * MIB
    hidden = 64
    while hidden < 1024:
        block = sum(math.prod(s) for s in _llm_block("", hidden + 64).values())
        if LLM_LAYERS * block * 4 > 0.75 * target:
            break
        hidden += 64
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(LLM_LAYERS):
        shapes.update(_llm_block(f"layers.{layer}.", hidden))
    shapes["final_norm.weight"] = (hidden,)
    shapes["final_norm.bias"] = (hidden,)
    used = sum(math.prod(s) for s in shapes.values()) * 4
    vocab = max(1, (target - used) // (2 * 4 * hidden))
    shapes = {"embed_tokens.weight": (vocab, hidden), **shapes, "lm_head.weight": (vocab, hidden)}
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def build_shape(shape: Shape, size_mib: int) -> dict[str, torch.Tensor]:
    return build_state(size_mib) if shape.key == "a" else build_llm_state(size_mib)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class Change:
    """A copy of a state with ``fraction`` of its bytes changed."""

    state: dict[str, torch.Tensor]
    tensors: list[str]  # names of the tensors changed (the last one maybe in part)
    changed_bytes: int


def changed_state(state: dict[str, torch.Tensor], fraction: float, delta: float) -> Change:
    """Whole tensors from the top block down, then the leading elements of one more.

    A tensor too large for what is left of the budget is skipped for a whole
    change; the first one skipped gets the remainder as a partial change.
    """
    budget = int(fraction * sum(nbytes(t) for t in state.values())) // 4 * 4
    new = dict(state)
    names: list[str] = []
    partial: str | None = None
    left = budget
    for name in reversed(list(state)):
        size = nbytes(state[name])
        if size <= left:
            new[name] = state[name] + delta
            names.append(name)
            left -= size
        elif partial is None:
            partial = name
        if not left:
            break
    if left and partial is not None:
        flat = state[partial].reshape(-1).clone()
        flat[: left // 4] += delta
        new[partial] = flat.reshape(state[partial].shape)
        names.append(partial)
        left -= left // 4 * 4
    return Change(new, names, budget - left)


# -- the steps -----------------------------------------------------------------


def castore_save(state: dict[str, torch.Tensor], path: Path) -> castore.Generation:
    with castore.open(path) as store:
        return store.save(state, run=RUN, step=0)


def castore_open_close(path: Path) -> None:
    with castore.open(path, create=False):
        pass


def castore_load(path: Path) -> Any:
    with castore.open(path, create=False) as store:
        return store.load(RUN, framework="torch")


def castore_slice(path: Path, name: str, rows: slice = SLICE_ROWS) -> torch.Tensor:
    with castore.open(path, create=False) as store:
        result: torch.Tensor = store.read_slice(RUN, "latest", name, rows, framework="torch")
        return result


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safetensors_save(state: dict[str, torch.Tensor], path: Path) -> None:
    save_file(state, path)
    fsync_file(path)


def safetensors_slice(path: Path, name: str, rows: slice = SLICE_ROWS) -> torch.Tensor:
    with safe_open(path, framework="pt") as handle:
        result: torch.Tensor = handle.get_slice(name)[rows]
        return result


def torch_save(state: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def dcp_save(state: dict[str, torch.Tensor], path: Path) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True), no_dist=True)


def dcp_load(template: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    out = {name: torch.empty_like(t) for name, t in template.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return out


# -- the floor -----------------------------------------------------------------


def _pieces(views: list[memoryview]) -> list[memoryview]:
    """Every view cut into chunks as castore cuts a tensor's bytes."""
    out: list[memoryview] = []
    for view in views:
        out += [
            view[at : at + DEFAULT_CHUNK_SIZE] for at in range(0, view.nbytes, DEFAULT_CHUNK_SIZE)
        ]
    return out


def _hash_run(run: list[memoryview]) -> None:
    for piece in run:
        blake3.blake3(piece, max_threads=1).digest()


def hash_pass(pool: ThreadPoolExecutor, views: list[memoryview]) -> None:
    """One blake3 pass over ``views``: big chunks on the pool in ~TASK_BYTES tasks, small here."""
    futures, run, size = [], [], 0
    for piece in _pieces(views):
        if piece.nbytes < INLINE_BYTES:
            blake3.blake3(piece, max_threads=1).digest()
            continue
        run.append(piece)
        size += piece.nbytes
        if size >= TASK_BYTES:
            futures.append(pool.submit(_hash_run, run))
            run, size = [], 0
    if run:
        futures.append(pool.submit(_hash_run, run))
    for future in futures:
        future.result()


def copy_pass(views: list[memoryview], out: np.ndarray) -> None:
    """One copy of ``views`` into ``out``, memory already mapped: a memcpy."""
    at = 0
    for view in views:
        out[at : at + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
        at += view.nbytes


def fresh_pages(size: int) -> torch.Tensor:
    """``size`` bytes of new memory, every page touched once: what a load adds to a memcpy."""
    return torch.empty(size, dtype=torch.uint8).fill_(0)


def byte_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]


@dataclass
class FloorInputs:
    """The bytes each floor hashes and copies."""

    everything: list[memoryview]
    slice_chunks: list[memoryview]  # the chunks the slice's rows overlap
    slice_rows: list[memoryview]
    changed: dict[str, list[memoryview]]  # "1%" -> the changed bytes


def floor_inputs(
    state: dict[str, torch.Tensor], name: str, changes: dict[str, Change]
) -> FloorInputs:
    matrix = state[name]
    row_bytes = nbytes(matrix) // matrix.shape[0]
    start, end = SLICE_ROWS.start * row_bytes, SLICE_ROWS.stop * row_bytes
    first, last = start // DEFAULT_CHUNK_SIZE, (end - 1) // DEFAULT_CHUNK_SIZE
    flat = byte_views([matrix])[0]
    chunk_span = flat[first * DEFAULT_CHUNK_SIZE : (last + 1) * DEFAULT_CHUNK_SIZE]
    changed = {}
    for label, change in changes.items():
        views = byte_views([change.state[n] for n in change.tensors])
        changed[label] = [memoryview(np.frombuffer(v, np.uint8)) for v in views]
        # the partial tensor counts only its changed prefix
        total = sum(v.nbytes for v in changed[label])
        if total > change.changed_bytes:
            last_view = changed[label][-1]
            changed[label][-1] = last_view[: last_view.nbytes - (total - change.changed_bytes)]
    return FloorInputs(byte_views(list(state.values())), [chunk_span], [flat[start:end]], changed)


# -- measuring -----------------------------------------------------------------


@dataclass
class Results:
    times: dict[str, list[float]] = field(default_factory=dict)

    def add(self, step: str, seconds: float) -> None:
        self.times.setdefault(step, []).append(seconds)

    def median(self, step: str) -> float:
        return statistics.median(self.times[step])

    def has(self, *steps: str) -> bool:
        return all(step in self.times for step in steps)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``fn()`` timed, after a garbage collection (what the step before left is freed)."""
    gc.collect()
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def rotate(items: list[Any], by: int) -> list[Any]:
    by %= len(items)
    return items[by:] + items[:by]


def assert_same(step: str, got: Any, want: dict[str, torch.Tensor]) -> None:
    if set(got) != set(want):
        raise AssertionError(f"{step}: loaded keys differ from saved keys")
    for key, tensor in want.items():
        if got[key].dtype != tensor.dtype or not torch.equal(got[key], tensor):
            raise AssertionError(f"{step}: {key} differs from what was saved")


@dataclass
class Case:
    """One shape's state and everything derived from it."""

    shape: Shape
    state: dict[str, torch.Tensor]
    changes: dict[str, Change]
    floor: FloorInputs


def run_saves(case: Case, out: Path, rep: int, results: Results) -> dict[str, Path]:
    paths = {
        "castore": out / "castore",
        "safetensors": out / "state.safetensors",
        "torch": out / "state.pt",
        "dcp": out / "dcp",
    }
    saves: list[tuple[str, Callable[[], Any]]] = [
        ("castore save", lambda: castore_save(case.state, paths["castore"])),
        ("safetensors save", lambda: safetensors_save(case.state, paths["safetensors"])),
        ("torch.save", lambda: torch_save(case.state, paths["torch"])),
        ("DCP save", lambda: dcp_save(case.state, paths["dcp"])),
    ]
    for step, save in rotate(saves, rep):
        results.add(step, timed(save)[0])
    return paths


def run_loads(case: Case, paths: dict[str, Path], rep: int, results: Results, check: bool) -> None:
    loads: list[tuple[str, Callable[[], Any]]] = [
        ("castore load", lambda: castore_load(paths["castore"])),
        ("safetensors load (pread)", lambda: load_file(paths["safetensors"], backend="pread")),
        ("safetensors load (mmap)", lambda: load_file(paths["safetensors"], backend="mmap")),
        ("torch.load", lambda: torch.load(paths["torch"], weights_only=True)),
        ("DCP load", lambda: dcp_load(case.state, paths["dcp"])),
    ]
    for step, load in rotate(loads, rep):
        seconds, loaded = timed(load)
        results.add(step, seconds)
        if check:
            assert_same(step, loaded, case.state)
        del loaded


def save_without_pieces(state: dict[str, torch.Tensor], path: Path) -> None:
    """A castore save that records no chunk pieces, as a castore without castore.format._b3tree
    writes it: its slices read and verify whole chunks (docs/FORMAT.md, "Chunk pieces")."""
    from castore.format import pieces

    built, pieces._b3tree = pieces._b3tree, None
    try:
        castore_save(state, path)
    finally:
        pieces._b3tree = built


def run_slices(case: Case, paths: dict[str, Path], rep: int, results: Results, check: bool) -> None:
    name = case.shape.slice_tensor
    rows = case.state[name].shape[0]
    ranges = {"": SLICE_ROWS, " (a quarter)": slice(rows // 4 + 3, rows // 2 + 3)}
    whole = paths["castore"].parent / "castore-whole-chunks"
    save_without_pieces(case.state, whole)
    slices: list[tuple[str, Callable[[], Any], slice]] = []
    for suffix, span in ranges.items():
        slices += [
            (
                f"castore read_slice{suffix}",
                lambda s=span: castore_slice(paths["castore"], name, s),
                span,
            ),
            (
                f"castore read_slice (whole chunks){suffix}",
                lambda s=span: castore_slice(whole, name, s),
                span,
            ),
            (
                f"safetensors get_slice{suffix}",
                lambda s=span: safetensors_slice(paths["safetensors"], name, s),
                span,
            ),
        ]
        for label, path in (("", paths["castore"]), (" (whole chunks)", whole)):
            with castore.open(path, create=False) as store:
                before = store.read_counters.bytes
                store.read_slice(RUN, "latest", name, span)
                # Bytes, not seconds: the median works the same.
                results.add(f"slice bytes read{label}{suffix}", store.read_counters.bytes - before)
        want = case.state[name][span]
        results.add(f"slice bytes needed{suffix}", want.numel() * want.element_size())
    for step, read, span in rotate(slices, rep):
        seconds, got = timed(read)
        results.add(step, seconds)
        if check and not torch.equal(got, case.state[name][span]):
            raise AssertionError(f"{step}: rows {span} of {name} differ")


def run_resaves(case: Case, paths: dict[str, Path], results: Results, check: bool) -> None:
    results.add("castore open+close", timed(lambda: castore_open_close(paths["castore"]))[0])
    for generation, (label, change) in enumerate(case.changes.items(), start=2):
        seconds, gen = timed(lambda c=change: castore_save(c.state, paths["castore"]))
        results.add(f"castore re-save {label}", seconds)
        if check:
            if gen.id != generation or gen.new_bytes < change.changed_bytes:
                raise AssertionError(f"re-save {label}: generation {gen.id}, {gen.new_bytes} B")
            with castore.open(paths["castore"], create=False) as store:
                assert_same(
                    f"re-save {label}", store.load(RUN, generation, framework="torch"), change.state
                )


def run_trusted_resave(case: Case, paths: dict[str, Path], results: Results, check: bool) -> None:
    """The 1% change made in place on tensors a handle saved before, re-saved by that handle
    with ``trust_versions=True`` (castore.core.unchanged), and with the default (hash every
    byte) on the same handle, for the same change back."""
    change = case.changes["1%"]
    # Copies whose version counters are 1, as a trained model's are (copy_ is in place).
    state = {k: torch.empty_like(v).copy_(v) for k, v in case.state.items()}
    with castore.open(paths["castore"], create=False) as store:
        store.save(state, run="trusted", step=1, trust_versions=True)  # a full save: untimed
        for name in change.tensors:
            state[name].copy_(change.state[name])
        seconds, _ = timed(lambda: store.save(state, run="trusted", step=2, trust_versions=True))
        results.add("castore re-save 1% trusted", seconds)
        if check:
            assert_same("trusted re-save", store.load("trusted", 2, framework="torch"), state)
        for name in change.tensors:
            state[name].copy_(case.state[name])
        seconds, _ = timed(lambda: store.save(state, run="trusted", step=3))
        results.add("castore re-save 1% same handle", seconds)


def best_of(fn: Callable[[], Any], tries: int = 3) -> float:
    return min(timed(fn)[0] for _ in range(tries))


def run_floors(case: Case, pool: ThreadPoolExecutor, results: Results) -> None:
    floor = case.floor
    total = sum(v.nbytes for v in floor.everything)
    results.add("fresh pages all", best_of(lambda: fresh_pages(total)))
    out = np.ones(total, dtype=np.uint8)  # mapped and touched before any copy is timed
    results.add("floor hash all", best_of(lambda: hash_pass(pool, floor.everything)))
    results.add("floor copy all", best_of(lambda: copy_pass(floor.everything, out)))
    results.add("floor hash slice chunks", best_of(lambda: hash_pass(pool, floor.slice_chunks)))
    results.add("floor copy slice rows", best_of(lambda: copy_pass(floor.slice_rows, out)))
    for label, views in floor.changed.items():
        results.add(f"floor copy {label}", best_of(lambda v=views: copy_pass(v, out)))
        results.add(f"floor hash {label}", best_of(lambda v=views: hash_pass(pool, v)))


def run_shape(case: Case, args: argparse.Namespace, base: Path) -> Results:
    results = Results()
    work = Path(tempfile.mkdtemp(prefix="castore-callcosts-", dir=base))
    with ThreadPoolExecutor(HASH_WORKERS) as pool:
        try:
            for rep in range(-args.warmup, args.reps):
                started = time.perf_counter()
                sink = results if rep >= 0 else Results()
                check = rep == -args.warmup
                out = work / f"rep{rep}"
                out.mkdir()
                try:
                    paths = run_saves(case, out, rep, sink)
                    if "loads" in args.only:
                        run_loads(case, paths, rep, sink, check)
                    if "slices" in args.only:
                        run_slices(case, paths, rep, sink, check)
                    if "resaves" in args.only:
                        run_resaves(case, paths, sink, check)
                        run_trusted_resave(case, paths, sink, check)
                    run_floors(case, pool, sink)
                finally:
                    shutil.rmtree(out, ignore_errors=True)
                label = f"rep {rep + 1}/{args.reps}" if rep >= 0 else "warm-up (untimed, checked)"
                print(f"  {label}: {time.perf_counter() - started:.1f} s", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return results


# -- first lookup by id in a new process ---------------------------------------------

_CHILD = """
import json, sys, time
import castore
path, spec = sys.argv[1], sys.argv[2]
spec = int(spec) if spec.isdigit() else spec
started = time.perf_counter()
store = castore.open(path, create=False)
opened = time.perf_counter()
store.resolve("bench", spec)
resolved = time.perf_counter()
store.close()
done = time.perf_counter()
print(json.dumps({"total": done - started, "open": opened - started, "resolve": resolved - opened}))
"""


def build_history(path: Path, generations: int) -> None:
    weights = torch.zeros(256)
    with castore.open(path) as store:
        for step in range(1, generations + 1):
            weights[step % 256] += 1.0
            store.save({"w": weights, "step": step}, run=RUN, step=step)


def child_lookup(path: Path, spec: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), spec], capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise RuntimeError(f"lookup child failed:\n{done.stderr}")
    figures: dict[str, float] = json.loads(done.stdout)
    return figures


def run_lookups(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="castore-lookup-", dir=base))
    counts = [1, args.generations]
    try:
        started = time.perf_counter()
        for count in counts:
            build_history(work / f"g{count}", count)
        print(f"  built stores of {counts} generations in {time.perf_counter() - started:.0f} s")
        times: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.lookup_reps):
            for count in counts:
                for spec in ("1", "latest"):
                    figures = child_lookup(work / f"g{count}", spec)
                    times.setdefault(f"{count} {spec}", []).append(figures)
        reflog = (work / f"g{args.generations}" / "logs" / f"{RUN}.reflog").stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"generations": counts, "times": times, "reflog_bytes": reflog}


def lookup_median(lookups: dict[str, Any], key: str, part: str = "total") -> float:
    return statistics.median(t[part] for t in lookups["times"][key])


# -- the table -----------------------------------------------------------------

PEERS = [
    ("full save", "castore save", "safetensors save", "safetensors `save_file` + fsync"),
    ("full save", "castore save", "torch.save", "torch.save + fsync"),
    ("full save", "castore save", "DCP save", "DCP save"),
    ("warm load", "castore load", "safetensors load (pread)", "safetensors `load_file` (pread)"),
    ("warm load", "castore load", "safetensors load (mmap)", "safetensors `load_file` (mmap)"),
    ("warm load", "castore load", "torch.load", "torch.load"),
    ("warm load", "castore load", "DCP load", "DCP load"),
    (
        "read_slice, open included",
        "castore read_slice",
        "safetensors get_slice",
        "safetensors `get_slice`, open included",
    ),
    (
        "read_slice, open included",
        "castore read_slice",
        "castore read_slice (whole chunks)",
        "castore `read_slice` verifying whole chunks (a store saved without pieces)",
    ),
    (
        "read_slice of a quarter of the rows, open included",
        "castore read_slice (a quarter)",
        "safetensors get_slice (a quarter)",
        "safetensors `get_slice`, open included",
    ),
    (
        "read_slice of a quarter of the rows, open included",
        "castore read_slice (a quarter)",
        "castore read_slice (whole chunks) (a quarter)",
        "castore `read_slice` verifying whole chunks (a store saved without pieces)",
    ),
]


def floor_of(results: Results, what: str) -> float:
    hash_all, copy_all = results.median("floor hash all"), results.median("floor copy all")
    if what in ("castore save", "castore load"):
        return hash_all + copy_all
    if what == "castore read_slice":
        return results.median("floor hash slice chunks") + results.median("floor copy slice rows")
    if what.startswith("castore read_slice"):
        return math.nan  # no floor measured for the other ranges
    if what == "castore re-save 1% trusted":  # hash and copy the 1% that changed
        return results.median("floor hash 1%") + results.median("floor copy 1%")
    label = what.removeprefix("castore re-save ").removesuffix(" same handle")
    return hash_all + results.median(f"floor copy {label}")


def table_rows(shape: Shape, results: Results) -> list[list[str]]:
    rows = []
    for operation, ours, peer, peer_label in PEERS:
        if not results.has(ours, peer):
            continue
        mine, theirs, floor = results.median(ours), results.median(peer), floor_of(results, ours)
        rows.append(
            [
                f"{operation} vs {peer_label}",
                shape.key,
                f"{mine:.4f}",
                f"{theirs:.4f}",
                f"**{theirs / mine:.2f}x** its speed",
                "" if math.isnan(floor) else f"{floor:.4f}",
                "" if math.isnan(floor) else f"{mine / floor:.1f}x",
            ]
        )
    for suffix, rows_read in (("", "rows 100-103"), (" (a quarter)", "a quarter of the rows")):
        if not results.has(f"slice bytes needed{suffix}"):
            continue
        needed = results.median(f"slice bytes needed{suffix}")
        for label in ("", " (whole chunks)"):
            read = results.median(f"slice bytes read{label}{suffix}")
            what = "pieces" if not label else "whole chunks"
            rows.append(
                [
                    f"read_slice of {rows_read}: bytes read / bytes needed ({what})",
                    shape.key,
                    f"{read:.0f}",
                    f"{needed:.0f}",
                    f"**{read / needed:.2f}x**",
                    "",
                    "",
                ]
            )
    full = results.median("castore save")
    if not results.has("castore open+close"):  # no re-saves
        return rows
    for label in ("1%", "10%"):
        mine, floor = (
            results.median(f"castore re-save {label}"),
            floor_of(results, f"castore re-save {label}"),
        )
        rows.append(
            [
                f"re-save, {label} changed, vs castore's own full save",
                shape.key,
                f"{mine:.4f}",
                f"{full:.4f}",
                f"**{mine / full:.2f}x** its time",
                f"{floor:.4f}",
                f"{mine / floor:.1f}x",
            ]
        )
    for what, label in (
        ("castore re-save 1% same handle", "1% changed in place, default (every byte hashed)"),
        ("castore re-save 1% trusted", "1% changed in place, `trust_versions=True`"),
    ):
        mine, floor = results.median(what), floor_of(results, what)
        rows.append(
            [
                f"re-save on the handle that saved before, {label}, vs castore's own full save",
                shape.key,
                f"{mine:.4f}",
                f"{full:.4f}",
                f"**{mine / full:.2f}x** its time",
                f"{floor:.4f}",
                f"{mine / floor:.1f}x",
            ]
        )
    rows.append(
        [
            "castore open + close of the store (in every castore row above)",
            shape.key,
            f"{results.median('castore open+close'):.4f}",
            "",
            "",
            "",
            "",
        ]
    )
    return rows


def lookup_rows(lookups: dict[str, Any]) -> list[list[str]]:
    one, many = lookups["generations"]
    rows = []
    for spec in ("1", "latest"):
        first, last = (
            lookup_median(lookups, f"{one} {spec}"),
            lookup_median(lookups, f"{many} {spec}"),
        )
        rows.append(
            [
                f"new process: open + resolve(run, {spec!r}) at {many:,} vs at {one} generation",
                "-",
                f"{last:.4f}",
                f"{first:.4f}",
                f"**{last / first:.2f}x** its time",
                "~0",
                "",
            ]
        )
    return rows


def print_table(rows: list[list[str]]) -> None:
    headers = ["operation", "shape", "castore s", "peer s", "ratio", "floor s", "castore / floor"]
    print("| " + " | ".join(headers) + " |")
    print("| " + " | ".join("---" for _ in headers) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


# -- main ----------------------------------------------------------------------


def scratch_base(requested: Path | None) -> tuple[Path, str]:
    if requested is not None:
        return requested, f"{requested} (as asked)"
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm, "/dev/shm (tmpfs)"
    fallback = Path(tempfile.gettempdir())
    return fallback, f"{fallback} (/dev/shm not writable: NOT tmpfs, fsyncs reach a disk)"


def make_case(shape: Shape, size_mib: int) -> Case:
    state = build_shape(shape, size_mib)
    changes = {"1%": changed_state(state, 0.01, 1e-3), "10%": changed_state(state, 0.10, 2e-3)}
    return Case(shape, state, changes, floor_inputs(state, shape.slice_tensor, changes))


def describe(case: Case) -> dict[str, Any]:
    sizes = [nbytes(t) for t in case.state.values()]
    return {
        "shape": case.shape.key,
        "label": case.shape.label,
        "bytes": sum(sizes),
        "tensors": len(sizes),
        "tensors_at_most_4kib": sum(s <= SMALL for s in sizes),
        "slice_tensor": case.shape.slice_tensor,
        "slice_tensor_shape": list(case.state[case.shape.slice_tensor].shape),
        "changed": {
            label: {"tensors": len(c.tensors), "bytes": c.changed_bytes}
            for label, c in case.changes.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small states and history, to try it out"
    )
    parser.add_argument("--shapes", default="a,b", help="which shapes (a, b or a,b)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed repetitions first (default 1)"
    )
    parser.add_argument("--generations", type=int, default=None, help="long history (10000)")
    parser.add_argument("--lookup-reps", type=int, default=5, help="new processes per lookup")
    parser.add_argument("--dir", type=Path, default=None, help="scratch (default /dev/shm)")
    parser.add_argument("--json", type=Path, default=None, help="write raw results here")
    parser.add_argument(
        "--only",
        default=",".join(GROUPS),
        help=f"step groups to run, of {','.join(GROUPS)} (saves and floors always run)",
    )
    args = parser.parse_args(argv)
    args.only = set(args.only.split(","))
    if not args.only <= set(GROUPS):
        parser.error(f"--only takes some of {','.join(GROUPS)}")
    if args.generations is None:
        args.generations = 500 if args.quick else 10_000
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    base, where = scratch_base(args.dir)
    print(f"scratch: {where}; reps {args.reps} (+{args.warmup} warm-up); CPUs {os.cpu_count()}")
    payload: dict[str, Any] = {
        "scratch": where,
        "reps": args.reps,
        "warmup": args.warmup,
        "only": sorted(args.only),
        "shapes": [],
    }
    rows: list[list[str]] = []
    for key in args.shapes.split(","):
        shape = SHAPES[key]
        case = make_case(shape, QUICK_SIZE_MIB[key] if args.quick else shape.size_mib)
        info = describe(case)
        print(
            f"== ({key}) {info['bytes'] / MIB:.0f} MiB in {info['tensors']} tensors "
            f"({info['tensors_at_most_4kib']} <= 4 KiB); changes {info['changed']}",
            flush=True,
        )
        results = run_shape(case, args, base)
        rows += table_rows(shape, results)
        print(
            f"  floor parts: blake3 of every byte {results.median('floor hash all'):.4f} s, "
            f"one copy of every byte {results.median('floor copy all'):.4f} s; new memory, "
            f"every page touched (not in the floor) {results.median('fresh pages all'):.4f} s"
        )
        payload["shapes"].append({**info, "times_s": results.times})
        del case
    if "lookups" in args.only:
        print(
            f"== first lookup by id in a new process, 1 and {args.generations:,} generations",
            flush=True,
        )
        lookups = run_lookups(args, base)
        rows += lookup_rows(lookups)
        payload["lookups"] = lookups
    print()
    print_table(rows)
    print(
        "\nratio: 'its speed' = peer time / castore time (>1: castore faster); 'its time' = "
        "castore time / reference time. floor: one blake3 pass over the bytes castore must "
        "verify (castore's chunking and threads) + one memcpy of the bytes it must move."
    )
    payload["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "castore": castore.__version__,
        "blake3": getattr(blake3, "__version__", "?"),
    }
    payload["cpus"] = os.cpu_count()
    payload["chunk_size"] = DEFAULT_CHUNK_SIZE
    payload["table"] = rows
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
