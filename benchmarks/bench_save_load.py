"""Save/load throughput of castore against torch.save and torch.distributed.checkpoint.

Run from the repository root::

    .venv/bin/python benchmarks/bench_save_load.py [--shape transformer|llm|many-small]
                                                   [--all-shapes] [--size-mib N] [--tensors N]
                                                   [--reps 3] [--warmup 1] [--dir DIR]
                                                   [--json OUT] [--settle 15]
                                                   [--warm-only] [--check]
                                                   [--codecs none,auto]

One fp32 state is built once, of one of these shapes (``--all-shapes``: each
in turn, one table each):

transformer (default)
  ``--size-mib`` MiB (default 1024) in 64 tensors shaped like a small
  transformer: 2-D weights, 1-D biases and norms, one embedding. Bytes
  dominate: the large-tensor path.
llm
  ``--size-mib`` MiB (default 256) in 2,003 tensors: 100 blocks of 20 tensors
  (attention and MLP weights, and 14 norms, biases, per-head norms and
  scalar gates, all under 4 KiB at the default size), a final norm and an
  embedding that takes the rest of the budget. Fixed per-tensor costs matter.
many-small
  ``--tensors`` (default 20,000) 1-D tensors of 64 to 1,024 elements (256 B
  to 4 KiB), like the per-parameter moments of an optimizer. Fixed
  per-tensor costs dominate.

Each repetition runs every method once, so that slow drift of the machine
(page cache, disk, thermal) hits all methods alike; the order of the saves and
of the loads rotates from one repetition to the next, and one untimed warm-up
repetition comes first. Outputs are deleted at the end of each repetition,
followed by ``sync`` and a pause (``--settle``, 15 s): on a thin-provisioned
virtual disk mounted with ``discard``, rewriting blocks freed moments ago can
be 5x faster than writing blocks whose discard has gone through (after the
next journal commit), and without the pause whichever save ran first in a
repetition would get that unrealistic fast path:

saves (every one durable before the clock stops)
  castore full save   ``castore.open(fresh).save(state)`` and ``close()``
  torch.save          to a file, then ``flush()`` and ``os.fsync``
  DCP save            ``dcp.save(..., FileSystemWriter(sync_files=True), no_dist=True)``
loads (cold: page cache dropped first, when this process may; then warm)
  castore load        ``castore.open(store).load("bench", framework="torch")``
  torch.load          ``torch.load(path)``
  DCP load            preallocate with ``torch.empty_like`` (timed), then ``dcp.load``
re-saves (10% of the state's bytes changed, saved into the store that already
holds the full save; only the re-save is timed)
  castore re-save (cold store)   page cache dropped first: the store's existing
                                 chunks are not in memory (a large store, a
                                 new process, a busy machine)
  castore re-save (warm store)   a second re-save with other changes to the
                                 same tensors, the whole store read into the
                                 page cache first (untimed)

Loaded values are compared with the saved ones once (in the first repetition
run), outside the timed regions. Before each timed step the garbage collector
runs and ``os.sync()`` flushes any writeback left by the step before. The table
shows medians; "x DCP" and "x torch.save" are speedups (other's median time /
this one's), so >1 means faster. Every save is compared with the matching save
(the re-saves with the full saves), every load with the load of the same cache
state. The goals are checked against the same medians; ``--check`` makes a
missed goal exit with status 1. A last line gives the re-saves' time as a
fraction of castore's own full save: what a save costs beyond the bytes it
writes.

``--codecs LIST`` (default ``none``) measures castore once per chunk codec
(``none``, ``auto``, ``zstd``, ``bytegroup``; see castore.format.codec), each
its own method in every repetition, rotated with the others: "castore save
[auto]", "castore load [auto] (warm)", its re-saves, each codec into its own
store (created with ``castore.open(path, codec=...)``). A codec table then
gives, per codec, the bytes its store holds (the full save's
``stats.stored_bytes`` and ``written_bytes``, and the store's size on disk)
and its medians, each against ``none``'s. Without ``--codecs`` the run, its
method names and its tables are what they were before codecs existed: one
castore method, with the local store's default codec (``none``); a ``none``
store is opened without ``codec=``, so the script also runs on a castore
from before codecs (to compare a commit with an older one).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _common import disk_free, drop_caches, parse_codecs, print_goals, tree_bytes
from tabulate import tabulate

import castore
from castore.core.chunkio import DEFAULT_CHUNK_SIZE, WRITE_BATCH_BYTES

MIB = 1 << 20
GIB = 1 << 30
N_LAYERS = 7  # 7 layers x 9 tensors + 1 embedding = 64 tensors
CHANGED_FRACTION = 0.10
RUN = "bench"

# Goals: (label, method, reference, kind, threshold)
#   kind "speedup": reference_time / method_time >= threshold
#   kind "time":    method_time / reference_time <= threshold
GOALS = [
    ("full save throughput >= 1.0x DCP save", "castore save", "DCP save", "speedup", 1.0),
    ("10%-changed re-save time <= 0.25x DCP save", "castore re-save", "DCP save", "time", 0.25),
    ("load throughput >= 1.0x DCP load", "castore load", "DCP load", "speedup", 1.0),
]
# States of many small tensors: a load at least as fast as torch.load's.
SMALL_TENSOR_GOALS = [
    ("load throughput >= 1.0x torch.load", "castore load", "torch.load", "speedup", 1.0),
]
SHAPES = ("transformer", "llm", "many-small")
DEFAULT_SIZE_MIB = {"transformer": 1024, "llm": 256}
DEFAULT_TENSORS = 20_000
LLM_LAYERS = 100
LLM_HEAD_DIM = 64


# -- the state ---------------------------------------------------------------


def build_state(size_mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """~size_mib MiB of fp32 tensors: N_LAYERS transformer blocks plus an embedding.

    The hidden size is picked so the blocks take about three quarters of the
    budget; the embedding's vocabulary absorbs the rest, so the total is within
    one embedding row of the target.
    """
    target = size_mib * MIB
    per_layer_elems = lambda h: 12 * h * h + 11 * h  # noqa: E731 - weights + biases + norms
    hidden = max(64, int(math.sqrt(0.75 * target / 4 / N_LAYERS / 12)) // 64 * 64)
    while hidden > 64 and N_LAYERS * per_layer_elems(hidden) * 4 > target:
        hidden -= 64
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(N_LAYERS):
        p = f"layers.{layer}."
        shapes[p + "attn_norm.weight"] = (hidden,)
        shapes[p + "attn.qkv.weight"] = (3 * hidden, hidden)
        shapes[p + "attn.qkv.bias"] = (3 * hidden,)
        shapes[p + "attn.out.weight"] = (hidden, hidden)
        shapes[p + "attn.out.bias"] = (hidden,)
        shapes[p + "mlp_norm.weight"] = (hidden,)
        shapes[p + "mlp.fc1.weight"] = (4 * hidden, hidden)
        shapes[p + "mlp.fc1.bias"] = (4 * hidden,)
        shapes[p + "mlp.fc2.weight"] = (hidden, 4 * hidden)
    # mlp.fc2.bias is folded away to keep 9 per layer; the embedding fills the rest.
    used = sum(math.prod(s) for s in shapes.values()) * 4
    vocab = max(1, (target - used) // (4 * hidden))
    shapes = {"embed.weight": (vocab, hidden), **shapes}
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def build_llm_state(size_mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """~size_mib MiB in LLM_LAYERS blocks of 20 tensors, a final norm and an embedding.

    Each block has six weight matrices and 14 vectors and scalars (norms,
    biases, per-head q/k norms, gates), most of them a few hundred bytes, as
    in real language models. The hidden size is picked as in ``build_state``.
    """
    target = size_mib * MIB
    hidden = max(64, int(math.sqrt(0.75 * target / 4 / LLM_LAYERS / 12)) // 64 * 64)
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(LLM_LAYERS):
        p = f"layers.{layer}."
        for norm in ("attn_norm", "mlp_norm"):
            shapes[p + norm + ".weight"] = (hidden,)
            shapes[p + norm + ".bias"] = (hidden,)
        for proj in ("q", "k", "v", "o"):
            shapes[p + f"attn.{proj}.weight"] = (hidden, hidden)
            shapes[p + f"attn.{proj}.bias"] = (hidden,)
        shapes[p + "attn.q_norm.weight"] = (LLM_HEAD_DIM,)
        shapes[p + "attn.k_norm.weight"] = (LLM_HEAD_DIM,)
        shapes[p + "attn.gate"] = ()
        shapes[p + "mlp.fc1.weight"] = (4 * hidden, hidden)
        shapes[p + "mlp.fc1.bias"] = (4 * hidden,)
        shapes[p + "mlp.fc2.weight"] = (hidden, 4 * hidden)
        shapes[p + "mlp.fc2.bias"] = (hidden,)
        shapes[p + "mlp.gate"] = ()
    shapes["final_norm.weight"] = (hidden,)
    shapes["final_norm.bias"] = (hidden,)
    used = sum(math.prod(s) for s in shapes.values()) * 4
    vocab = max(1, (target - used) // (4 * hidden))
    shapes = {"embed.weight": (vocab, hidden), **shapes}
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def build_many_small_state(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` fp32 vectors of 64..1024 elements: two moments per parameter, as in Adam."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(64, 1025, (count,), generator=gen).tolist()
    return {
        f"optim.{i // 2}.{('exp_avg', 'exp_avg_sq')[i % 2]}": torch.randn(n, generator=gen)
        for i, n in enumerate(sizes)
    }


def build_shape(shape: str, size_mib: int | None, tensors: int) -> dict[str, torch.Tensor]:
    if shape == "many-small":
        return build_many_small_state(tensors)
    size = size_mib or DEFAULT_SIZE_MIB[shape]
    return build_llm_state(size) if shape == "llm" else build_state(size)


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def changed_copy(
    state: dict[str, torch.Tensor], delta: float = 1e-3
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A shallow copy with about CHANGED_FRACTION of the bytes changed (``+ delta``).

    Tensors are taken from the top layer down (as when fine-tuning the last
    layers), skipping any that would overshoot the target by more than 2%.
    """
    total = nbytes(state)
    budget = CHANGED_FRACTION * total * 1.02
    picked: list[str] = []
    changed_bytes = 0
    for name in reversed(list(state)):
        size = state[name].numel() * state[name].element_size()
        if changed_bytes + size <= budget:
            picked.append(name)
            changed_bytes += size
        if changed_bytes >= CHANGED_FRACTION * total * 0.98:
            break
    new = dict(state)
    for name in picked:
        new[name] = state[name] + delta  # every element (so every chunk) changes
    return new, picked


# -- page cache --------------------------------------------------------------


# -- methods -----------------------------------------------------------------


def castore_save(
    state: dict[str, torch.Tensor], path: Path, codec: str = "none"
) -> tuple[castore.Generation, int]:
    """Save into the store at ``path`` (created if new) with ``codec``.

    ``none`` opens the store without ``codec=`` (a local store's default), so
    this runs on a castore from before codecs too; the handle must agree.
    """
    store = castore.open(path) if codec == "none" else castore.open(path, codec=codec)
    try:
        if getattr(store, "codec", "none") != codec:
            raise RuntimeError(f"{path}: the store saves with {store.codec!r}, not {codec!r}")
        return store.save(state, run=RUN, step=0), store.chunk_size
    finally:
        store.close()


def castore_load(path: Path) -> Any:
    store = castore.open(path, create=False)
    try:
        return store.load(RUN, framework="torch")
    finally:
        store.close()


def torch_save(state: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def torch_load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def dcp_save(state: dict[str, torch.Tensor], path: Path) -> None:
    writer = dcp.FileSystemWriter(str(path), sync_files=True)
    dcp.save(state, storage_writer=writer, no_dist=True)


def dcp_load(template: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    out = {name: torch.empty_like(t) for name, t in template.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return out


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    os.sync()  # no writeback left over from an earlier step runs inside this one
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def assert_same(name: str, got: Any, want: dict[str, torch.Tensor]) -> None:
    if not isinstance(got, dict) or set(got) != set(want):
        raise AssertionError(f"{name}: loaded keys differ from saved keys")
    for key, tensor in want.items():
        other = got[key]
        if other.dtype != tensor.dtype or other.shape != tensor.shape:
            raise AssertionError(f"{name}: {key} has {other.dtype}{tuple(other.shape)}")
        if not torch.equal(other, tensor):
            raise AssertionError(f"{name}: {key} differs from what was saved")


# -- the run -----------------------------------------------------------------


@dataclass
class Results:
    times: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def add(self, method: str, seconds: float) -> None:
        self.times.setdefault(method, []).append(seconds)

    def median(self, method: str) -> float:
        return statistics.median(self.times[method])


def rotate(items: list[Any], by: int) -> list[Any]:
    by %= len(items)
    return items[by:] + items[:by]


def one_rep(
    rep: int,
    state: dict[str, torch.Tensor],
    changed: list[dict[str, torch.Tensor]],
    work: Path,
    results: Results,
    cold: bool,
    verify: bool,
    settle: float,
    tags: dict[str, str],
) -> None:
    """Every method once. The order of the saves, and of the loads, rotates with ``rep``:
    how fast this disk writes depends on whether the blocks were freed just before,
    and a fixed order would hand the same position to the same method every time.
    ``tags`` maps each codec to measure to its methods' tag (``""``: no ``--codecs``).
    """
    out = work / f"rep{rep}"
    out.mkdir(parents=True)
    stores = {codec: out / f"castore-{codec}" for codec in tags}
    pt_file, dcp_dir = out / "state.pt", out / "dcp"
    try:

        def save_castore(codec: str) -> None:
            store, tag = stores[codec], tags[codec]
            seconds, (gen, chunk_size) = timed(lambda: castore_save(state, store, codec))
            results.add(f"castore save{tag}", seconds)
            results.notes.setdefault("castore_chunk_size", chunk_size)
            results.notes.setdefault(f"castore_save_new_bytes{tag}", gen.new_bytes)
            # untimed: what the codec stored (getattr: a castore from before codecs)
            stats = gen.stats
            results.notes.setdefault(
                f"castore_save_stored_bytes{tag}", getattr(stats, "stored_bytes", stats.new_bytes)
            )
            results.notes.setdefault(f"castore_save_written_bytes{tag}", stats.written_bytes)
            apparent, allocated = tree_bytes(store)
            results.notes.setdefault(f"castore_store_apparent_bytes{tag}", apparent)
            results.notes.setdefault(f"castore_store_allocated_bytes{tag}", allocated)

        def save_torch() -> None:
            results.add("torch.save", timed(lambda: torch_save(state, pt_file))[0])

        def save_dcp() -> None:
            results.add("DCP save", timed(lambda: dcp_save(state, dcp_dir))[0])

        saves = [functools.partial(save_castore, codec) for codec in tags]
        for save in rotate([*saves, save_torch, save_dcp], rep):
            save()

        # loads: cold (if the cache can be dropped), then warm
        loaders: list[tuple[str, Callable[[], Any]]] = [
            (f"castore load{tags[codec]}", lambda s=stores[codec]: castore_load(s))
            for codec in tags
        ]
        loaders += [
            ("torch.load", lambda: torch_load(pt_file)),
            ("DCP load", lambda: dcp_load(state, dcp_dir)),
        ]
        for method, loader in rotate(loaders, rep):
            if cold:
                if not drop_caches():
                    raise RuntimeError("dropping the page cache stopped working")
                seconds, loaded = timed(loader)
                results.add(f"{method} (cold)", seconds)
                del loaded
            else:
                loader()  # make sure the file is cached even if the save bypassed the cache
            seconds, loaded = timed(loader)
            results.add(f"{method} (warm)", seconds)
            if verify:
                assert_same(method, loaded, state)
            del loaded

        # re-saves with ~10% of the bytes changed into the store holding the full save:
        # first with the store out of the page cache, then (other changes) with it in;
        # each codec's pair in turn, the codecs' order rotating too
        modes = ["(cold store)", "(warm store)"] if cold else ["(warm store)"]
        for codec in rotate(list(tags), rep):
            store, tag = stores[codec], tags[codec]
            for generation, (mode, new_state) in enumerate(
                zip(modes, changed[: len(modes)], strict=True), start=2
            ):
                if mode == "(cold store)":
                    if not drop_caches():
                        raise RuntimeError("dropping the page cache stopped working")
                else:
                    castore_load(store)  # bring the whole store into the page cache
                seconds, (gen, _) = timed(
                    lambda s=new_state, p=store, c=codec: castore_save(s, p, c)
                )
                results.add(f"castore re-save{tag} {mode}", seconds)
                results.notes.setdefault(f"castore_resave_new_bytes{tag}", gen.new_bytes)
                results.notes.setdefault(
                    f"castore_resave_reused_chunks{tag}", gen.stats.reused_chunks
                )
                results.notes.setdefault(
                    f"castore_resave_stored_bytes{tag}",
                    getattr(gen.stats, "stored_bytes", gen.new_bytes),
                )
                if verify:
                    with castore.open(store, create=False) as opened:
                        loaded = opened.load(RUN, generation, framework="torch")
                    assert_same(f"castore re-save{tag} {mode}", loaded, new_state)
                    del loaded
    finally:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        time.sleep(settle)  # let the freed blocks' discards go through (see the docstring)


def summarize(
    results: Results, logical: int, cold: bool, tags: list[str]
) -> tuple[list[list[Any]], list[dict]]:
    """Table rows and JSON rows: median, GiB/s and speedups against the matching reference.

    ``tags``: the castore methods' codec tags, in order (``[""]``: no ``--codecs``).
    """

    def refs(method: str) -> tuple[str, str]:
        if "save" in method:
            return "DCP save", "torch.save"
        mode = method[method.index("(") :]
        return f"DCP load {mode}", f"torch.load {mode}"

    modes = ["(cold)", "(warm)"] if cold else ["(warm)"]
    order = [
        f"castore {what}{tag}{mode}"
        for tag in tags
        for what, mode in (("save", ""), ("re-save", " (cold store)"), ("re-save", " (warm store)"))
    ]
    order += ["torch.save", "DCP save"]
    loads = [f"castore load{tag}" for tag in tags] + ["torch.load", "DCP load"]
    order += [f"{m} {mode}" for mode in modes for m in loads]
    rows, records = [], []
    for method in order:
        if method not in results.times:
            continue
        med = results.median(method)
        vs_dcp, vs_torch = (results.median(r) / med for r in refs(method))
        rows.append(
            [
                method,
                f"{med:.3f}",
                f"{min(results.times[method]):.3f}",
                f"{logical / GIB / med:.2f}",
                f"{vs_dcp:.2f}x",
                f"{vs_torch:.2f}x",
            ]
        )
        records.append(
            {
                "method": method,
                "median_s": med,
                "min_s": min(results.times[method]),
                "times_s": results.times[method],
                "gib_per_s": logical / GIB / med,
                "speedup_vs_dcp": vs_dcp,
                "speedup_vs_torch": vs_torch,
            }
        )
    return rows, records


def evaluate_goals(
    results: Results, cold: bool, goals: list[tuple[str, str, str, str, float]], tag: str = ""
) -> list[dict[str, Any]]:
    """Each goal for the castore methods tagged ``tag`` (one codec; ``""``: no ``--codecs``)."""
    load_modes = ["(cold)", "(warm)"] if cold else ["(warm)"]
    store_modes = ["(cold store)", "(warm store)"] if cold else ["(warm store)"]
    verdicts = []
    for label, base, reference, kind, threshold in goals:
        method = base + tag
        if base.endswith("load"):
            pairs = [(f"{method} {m}", f"{reference} {m}", f"{label}{tag} {m}") for m in load_modes]
        elif base.endswith("re-save"):
            pairs = [(f"{method} {m}", reference, f"{label}{tag} {m}") for m in store_modes]
        else:
            pairs = [(method, reference, label + tag)]
        for m, r, text in pairs:
            ratio = results.median(r) / results.median(m)
            if kind == "time":
                ratio = 1.0 / ratio
                met = ratio <= threshold
                measured = f"{ratio:.3f}x {reference.split(' (')[0]} time"
            else:
                met = ratio >= threshold
                measured = f"{ratio:.2f}x {reference.split(' (')[0]} throughput"
            verdicts.append({"goal": text, "measured": measured, "value": ratio, "met": met})
    return verdicts


def resave_fractions(results: Results, tag: str = "") -> dict[str, float]:
    """Each re-save's median time over castore's full-save median (codec ``tag``'s)."""
    full = results.median(f"castore save{tag}")
    prefix = f"castore re-save{tag} ("
    return {
        method: results.median(method) / full
        for method in results.times
        if method.startswith(prefix)
    }


def codec_rows(
    results: Results, tags: dict[str, str], cold: bool
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """Per codec: the bytes its store holds and its medians, each over ``none``'s (if run)."""
    notes = results.notes
    ref = tags.get("none")
    modes = ["(cold)", "(warm)"] if cold else ["(warm)"]
    rows, records = [], []
    for codec, tag in tags.items():
        record: dict[str, Any] = {"codec": codec}
        for what in ("save_stored", "save_written", "store_allocated", "resave_stored"):
            key = f"castore_{what}_bytes{tag}"
            record[f"{what}_bytes"] = notes[key]
            record[f"{what}_over_none"] = (
                notes[key] / notes[f"castore_{what}_bytes{ref}"] if ref is not None else None
            )
        times = {"save": f"castore save{tag}"}
        times.update({f"load {m}": f"castore load{tag} {m}" for m in modes})
        for what, method in times.items():
            # throughput over none's: none's median time / this codec's
            record[f"{what} throughput_over_none"] = (
                results.median(method.replace(tag, ref, 1)) / results.median(method)
                if ref is not None
                else None
            )
        rows.append(
            [
                codec,
                f"{notes[f'castore_save_stored_bytes{tag}'] / MIB:.1f}",
                _times(record["save_stored_over_none"]),
                f"{notes[f'castore_store_allocated_bytes{tag}'] / MIB:.1f}",
                _times(record["store_allocated_over_none"]),
                f"{notes[f'castore_resave_stored_bytes{tag}'] / MIB:.1f}",
            ]
            + [_times(record[f"{what} throughput_over_none"]) for what in times]
        )
        records.append(record)
    return rows, records


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def run_shape(shape: str, args: argparse.Namespace, base: Path, cold: bool) -> dict[str, Any]:
    """Build one state, run every repetition, print its table; return its JSON record."""
    print(f"== shape {shape}: building the state ...", flush=True)
    state = build_shape(shape, args.size_mib, args.tensors)
    changed_a, picked = changed_copy(state, 1e-3)
    changed_b, _ = changed_copy(state, 2e-3)
    logical = nbytes(state)
    small = sum(t.numel() * t.element_size() < 4096 for t in state.values())
    changed_bytes = sum(state[n].numel() * state[n].element_size() for n in picked)
    print(
        f"{len(state)} tensors ({small} under 4 KiB), {logical / GIB:.3f} GiB; re-save changes "
        f"{len(picked)} tensors, {changed_bytes / MIB:.1f} MiB ({changed_bytes / logical:.1%} "
        f"of the bytes)\n"
        f"page cache drop: {'works, loads are cold and warm' if cold else 'not used: warm only'}"
        f"\nscratch: {base}, reps: {args.reps} (+{args.warmup} untimed warm-up)",
        flush=True,
    )
    tags = codec_tags(args.codecs)
    need = int((2.5 + len(tags)) * logical)
    if disk_free(base) < need:
        raise SystemExit(f"not enough disk under {base}: need {need / GIB:.1f} GiB")

    results = Results()
    work = Path(tempfile.mkdtemp(prefix="castore-bench-", dir=base))
    started = time.perf_counter()
    try:
        for rep in range(-args.warmup, args.reps):
            rep_start = time.perf_counter()
            sink = results if rep >= 0 else Results()
            one_rep(
                rep,
                state,
                [changed_a, changed_b],
                work,
                sink,
                cold,
                rep == -args.warmup,
                args.settle,
                tags,
            )
            label = f"rep {rep + 1}/{args.reps}" if rep >= 0 else "warm-up (untimed)"
            print(f"{label}: {time.perf_counter() - rep_start:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("verified once: every load equals what was saved\n")

    rows, records = summarize(results, logical, cold, list(tags.values()))
    headers = ["method", "median s", "min s", "GiB/s", "x DCP", "x torch.save"]
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    print(
        "\nGiB/s is the whole state's size over time (the re-save too). 'x DCP' and "
        "'x torch.save' are speedups over the matching save or load (>1 = faster)."
    )
    fractions: dict[str, float] = {}
    for tag in tags.values():
        notes = results.notes
        print(
            f"castore re-save{tag} wrote {notes[f'castore_resave_new_bytes{tag}'] / MIB:.1f} MiB "
            f"of new chunks ({notes[f'castore_resave_reused_chunks{tag}']} chunks reused)"
        )
        these = resave_fractions(results, tag)
        prefix = f"castore re-save{tag} "
        print(
            f"castore re-save{tag} time / castore full save{tag} time: "
            + ", ".join(f"{method[len(prefix) :]} {f:.2f}" for method, f in these.items())
        )
        fractions.update(these)
    print()
    codec_table: list[dict[str, Any]] = []
    if args.codecs is not None:
        table, codec_table = codec_rows(results, tags, cold)
        modes = ["cold", "warm"] if cold else ["warm"]
        headers = ["codec", "stored MiB", "x none", "store du MiB", "x none", "re-save MiB"]
        headers += ["save thr. x none"] + [f"load {m} thr. x none" for m in modes]
        print(tabulate(table, headers=headers, tablefmt="github", disable_numparse=True))
        print(
            "\nstored: the full save's new chunks as stored (stats.stored_bytes; raw: "
            f"{results.notes[f'castore_save_new_bytes{next(iter(tags.values()))}'] / MIB:.1f} "
            "MiB); store du: the store's allocated size on disk after it; re-save: the "
            "first re-save's stored bytes. thr. x none: none's median time / this codec's "
            "(>1 = faster than none).\n"
        )

    goals = GOALS if shape == "transformer" else SMALL_TENSOR_GOALS
    verdicts = [v for tag in tags.values() for v in evaluate_goals(results, cold, goals, tag)]
    print_goals(verdicts)
    print(f"\nshape {shape}: total time {time.perf_counter() - started:.0f} s\n", flush=True)
    return {
        "shape": shape,
        "size_mib": logical / MIB,
        "logical_bytes": logical,
        "tensors": len(state),
        "tensors_under_4kib": small,
        "changed_tensors": picked,
        "changed_bytes": changed_bytes,
        "results": records,
        "resave_over_full_save": fractions,
        "codecs": list(tags),
        "codec_table": codec_table,
        "notes": results.notes,
        "goals": verdicts,
    }


def codec_tags(codecs: list[str] | None) -> dict[str, str]:
    """Each codec to measure and its methods' tag: ``{"none": ""}`` without ``--codecs``."""
    if codecs is None:
        return {"none": ""}
    return {codec: f" [{codec}]" for codec in codecs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="transformer", help="state shape")
    parser.add_argument("--all-shapes", action="store_true", help="run every shape in turn")
    parser.add_argument(
        "--size-mib", type=int, default=None, help="state size (transformer 1024, llm 256)"
    )
    parser.add_argument(
        "--tensors", type=int, default=DEFAULT_TENSORS, help="many-small: tensor count (20000)"
    )
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed repetitions first (default 1)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default /tmp)")
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    parser.add_argument(
        "--settle", type=float, default=15.0, help="pause after each rep's cleanup (s, default 15)"
    )
    parser.add_argument("--warm-only", action="store_true", help="do not drop the page cache")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is not met")
    parser.add_argument(
        "--codecs",
        type=parse_codecs,
        default=None,
        help="castore once per codec, e.g. none,auto (default: none, untagged)",
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")

    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    cold = not args.warm_only and drop_caches()
    started = time.perf_counter()
    shapes = SHAPES if args.all_shapes else (args.shape,)
    records = [run_shape(shape, args, base, cold) for shape in shapes]
    print(f"total time {time.perf_counter() - started:.0f} s")

    if args.json:
        payload = {
            "shapes": records,
            "reps": args.reps,
            "warmup_reps": args.warmup,
            "settle_s": args.settle,
            "cold_loads": cold,
            "scratch_dir": str(base),
            "castore_default_chunk_size": DEFAULT_CHUNK_SIZE,
            "castore_write_batch_bytes": WRITE_BATCH_BYTES,
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "castore": castore.__version__,
            },
            "castore_path": Path(castore.__file__).parent.name,
            "cpus": os.cpu_count(),
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    met = all(v["met"] for record in records for v in record["goals"])
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
