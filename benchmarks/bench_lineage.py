"""Branch and amend of a generation against rewriting the checkpoint (issue 41's goals).

Run from the repository root::

    .venv/bin/python benchmarks/bench_lineage.py [--size-mib 1024] [--tensors 64]
        [--repeats 5] [--dir DIR] [--json [OUT]] [--small]

One generation of ``--size-mib`` MiB of float32 tensors (random values, so
nothing deduplicates) is saved to an LMDB store in ``--dir`` (default a
temporary directory). Then, each ``--repeats`` times:

  castore branch   ``castore.branch`` of that generation into a new run: the
                   call's seconds, the bytes it wrote (the root's
                   ``written_bytes``: manifests; plus the root) and how much the
                   store's files grew on disk
  torch.save       the same state written again with ``torch.save`` and fsynced:
                   what a file checkpoint's "new run from this one" costs at least
                   (a copy of the file; an edit would add a ``torch.load``)
  safetensors      the same with safetensors ``save_file`` and fsync

and each amend (``castore.amend`` onto a new run) against the same edit of the
file (``torch.load`` or safetensors ``load_file``, the edit, ``torch.save`` or
``save_file``, fsync):

  drop optim       ``drop=["optim/**"]``: half the tensors left out
  rename           every key renamed
  replace          one tensor (1/64 of the state: 16 MiB at 1 GiB) replaced by
                   new random values (a fresh array each repeat)
  graft            six tensors (96 MiB at 1 GiB) grafted from a "teacher"
                   run of the same shapes saved in the same store

Medians, and each peer as a ratio to castore in the same run. The goals
(issue 41): a branch of a 1 GiB generation in under 50 ms, writing under
1 MiB; each amend under 0.2 s, writing at most 1.02x the new tensor bytes
(none for drop, rename and a graft from the same store).
``--small``: 16 MiB in 8 tensors, 2 repeats (the smoke test).
``--json`` writes ``benchmarks/results/lineage.json`` (or OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import castore  # noqa: E402
import castore.chunkstore.base  # noqa: E402
from castore.format.objects import encode_object  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "lineage.json"


def build_state(size_mib: int, tensors: int) -> dict[str, dict[str, np.ndarray]]:
    """Half the tensors under "model", half under "optim" (as a training state holds
    weights and moments)."""
    rng = np.random.default_rng(0)
    per = (size_mib << 20) // tensors // 4
    rows = max(per // 1024, 1)
    half = tensors // 2
    made = [rng.standard_normal((rows, 1024), dtype=np.float32) for _ in range(tensors)]
    return {
        "model": {f"layers.{t}.weight": made[t] for t in range(half)},
        "optim": {f"layers.{t}.exp_avg": made[half + t] for t in range(tensors - half)},
    }


def flat(state: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {f"{part}.{name}": a for part, tree in state.items() for name, a in tree.items()}


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def fsynced(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed_amend(
    store: castore.Store, label: str, changes: list[dict[str, Any]]
) -> tuple[list[float], list[int], list[int]]:
    """Seconds, bytes written (manifests, root and new chunks) and new chunk bytes of
    one amend of base@1 per change, each onto a new run (LABEL-0, LABEL-1, ...)."""
    seconds, written, new = [], [], []
    for i, change in enumerate(changes):
        started = time.perf_counter()
        made = castore.amend(store, "base", 1, to_run=f"{label}-{i}", **change)
        seconds.append(time.perf_counter() - started)
        _, root = store.resolve_root(made.run)
        written.append(made.stats.written_bytes + len(encode_object(root)))
        new.append(made.stats.new_bytes)
    return seconds, written, new


GRAFTED = 6  # tensors grafted from the teacher (96 MiB of a 1 GiB state)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from safetensors.numpy import load_file, save_file

    state = build_state(args.size_mib, args.tensors)
    nbytes = sum(a.nbytes for tree in state.values() for a in tree.values())
    store_path = work / "store"
    runs: dict[str, list[float]] = {}
    written: dict[str, list[int]] = {}
    with castore.open(store_path) as store:
        base = store.save(state, run="base", step=100)
        chunks = len(list(store.backend.iter_keys(castore.chunkstore.base.Namespace.CHUNKS)))
        runs["castore branch"], written["castore branch"], grown = [], [], []
        for i in range(args.repeats):
            before = disk_bytes(store_path)
            started = time.perf_counter()
            made = castore.branch(store, "base", base.id, f"ft-{i}")
            runs["castore branch"].append(time.perf_counter() - started)
            _, root = store.resolve_root(made.run)
            written["castore branch"].append(made.stats.written_bytes + len(encode_object(root)))
            grown.append(disk_bytes(store_path) - before)
        loaded = store.load(run=f"ft-{args.repeats - 1}")
        assert all(loaded["model"][k].tobytes() == v.tobytes() for k, v in state["model"].items())
        rng = np.random.default_rng(1)
        first = state["model"]["layers.0.weight"]
        fresh = [rng.standard_normal(first.shape, dtype=np.float32) for _ in range(args.repeats)]
        grafted = min(GRAFTED, args.tensors // 2)
        teacher = {
            "model": {
                f"layers.{t}.weight": rng.standard_normal(first.shape, dtype=np.float32)
                for t in range(grafted)
            }
        }
        store.save(teacher, run="teacher", step=1)
        chunks = len(list(store.backend.iter_keys(castore.chunkstore.base.Namespace.CHUNKS)))
        grafts = [f"teacher:model/layers.{t}.=model/layers.{t}." for t in range(grafted)]
        renames = [("model/layers.", "model/blocks."), ("optim/layers.", "optim/blocks.")]
        new_bytes: dict[str, list[int]] = {}
        for name, changes in (
            ("castore amend: drop optim", [{"drop": ["optim/**"]}] * args.repeats),
            ("castore amend: rename every key", [{"rename": renames}] * args.repeats),
            ("castore amend: graft", [{"graft": grafts}] * args.repeats),
        ):
            label = name.split(": ")[1].split()[0]
            runs[name], written[name], new_bytes[name] = timed_amend(store, label, changes)
        after = len(list(store.backend.iter_keys(castore.chunkstore.base.Namespace.CHUNKS)))
        name = "castore amend: replace one tensor"
        runs[name], written[name], new_bytes[name] = timed_amend(
            store, "replace", [{"replace": {"model/layers.0.weight": a}} for a in fresh]
        )
        assert store.load(run="replace-0")["model"]["layers.0.weight"].tobytes() == (
            fresh[0].tobytes()
        )
        grafted_run = store.load(run="graft-0")
        assert grafted_run["model"]["layers.0.weight"].tobytes() == (
            teacher["model"]["layers.0.weight"].tobytes()
        )
    tensors = {k: torch.from_numpy(v) for k, v in flat(state).items()}
    arrays = flat(state)
    pt, st = work / "state.pt", work / "state.safetensors"
    torch.save(tensors, pt)
    save_file(arrays, str(st))
    teacher_tensors = {f"model.{k}": v for k, v in teacher["model"].items()}
    torch_teacher = {k: torch.from_numpy(v) for k, v in teacher_tensors.items()}

    def torch_edit(edit: Any) -> Any:
        return lambda out: torch.save(edit(torch.load(pt)), out)

    def safetensors_edit(edit: Any) -> Any:
        return lambda out: save_file(edit(load_file(str(st))), str(out))

    def dropped(tree: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in tree.items() if not k.startswith("optim.")}

    def renamed(tree: dict[str, Any]) -> dict[str, Any]:
        return {k.replace(".layers.", ".blocks."): v for k, v in tree.items()}

    peers: dict[str, Any] = {
        "torch.save": lambda out: torch.save(tensors, out),
        "safetensors": lambda out: save_file(arrays, str(out)),
        "torch: load, drop optim, save": torch_edit(dropped),
        "safetensors: load, drop optim, save": safetensors_edit(dropped),
        "torch: load, rename, save": torch_edit(renamed),
        "safetensors: load, rename, save": safetensors_edit(renamed),
        "torch: load, graft, save": torch_edit(lambda t: {**t, **torch_teacher}),
        "safetensors: load, graft, save": safetensors_edit(lambda t: {**t, **teacher_tensors}),
    }
    replaced = "model.layers.0.weight"
    for i in range(args.repeats):
        peers[f"torch: load, replace, save #{i}"] = torch_edit(
            lambda t, i=i: {**t, replaced: torch.from_numpy(fresh[i])}
        )
        peers[f"safetensors: load, replace, save #{i}"] = safetensors_edit(
            lambda t, i=i: {**t, replaced: fresh[i]}
        )
    for name in peers:
        runs[name.split(" #")[0]] = []
    for i in range(args.repeats):
        for name, write in peers.items():
            if " #" in name and not name.endswith(f"#{i}"):
                continue
            out = work / f"copy-{i}"
            started = time.perf_counter()
            write(out)
            fsynced(out)
            runs[name.split(" #")[0]].append(time.perf_counter() - started)
            out.unlink()
    seconds = {name: statistics.median(values) for name, values in runs.items()}
    branch = seconds["castore branch"]
    medians = {name: statistics.median(values) for name, values in written.items()}
    amends = {
        "drop optim": "castore amend: drop optim",
        "rename": "castore amend: rename every key",
        "replace": "castore amend: replace one tensor",
        "graft": "castore amend: graft",
    }
    peer = {"drop optim": "drop optim", "rename": "rename", "replace": "replace", "graft": "graft"}
    replaced_bytes = state["model"]["layers.0.weight"].nbytes
    replace_new = statistics.median(new_bytes["castore amend: replace one tensor"])
    return {
        "size_mib": args.size_mib,
        "tensors": args.tensors,
        "logical_bytes": nbytes,
        "repeats": args.repeats,
        "seconds": seconds,
        "runs": runs,
        "written_bytes": medians,
        "new_chunk_bytes": {name: statistics.median(v) for name, v in new_bytes.items()},
        "replaced_tensor_bytes": replaced_bytes,
        "grafted_bytes": grafted * replaced_bytes,
        "branch_written_bytes": medians["castore branch"],
        "branch_disk_growth_bytes": statistics.median(grown),
        "ratios_to_branch": {
            "torch.save": seconds["torch.save"] / branch,
            "safetensors": seconds["safetensors"] / branch,
        },  # fmt: skip
        "ratios_to_amend": {
            op: {
                f"{tool}: load, {peer[op]}, save": seconds[f"{tool}: load, {peer[op]}, save"]
                / seconds[ours]
                for tool in ("torch", "safetensors")
            }
            for op, ours in amends.items()
        },
        "goals": {
            "branch under 50 ms": branch < 0.050,
            "branch writes under 1 MiB": medians["castore branch"] < 1 << 20,
            "each amend under 0.2 s": max(seconds[ours] for ours in amends.values()) < 0.2,
            "branch, drop, rename and graft write no chunk": after == chunks,
            "replace writes at most 1.02x the tensor": replace_new <= 1.02 * replaced_bytes,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", nargs="?", type=Path, const=DEFAULT_JSON, default=None)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args(argv)
    if args.small:
        args.size_mib, args.tensors, args.repeats = 16, 8, 2
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        result = measure(args, Path(work))
    s = result["seconds"]
    print(f"{args.size_mib} MiB in {args.tensors} tensors, medians of {args.repeats}:")
    for name, value in s.items():
        wrote = result["written_bytes"].get(name)
        new = result["new_chunk_bytes"].get(name, 0)
        chunks = f"{new:,.0f} of new chunks" if new else "no chunk"
        extra = f", wrote {wrote:,.0f} bytes ({chunks})" if wrote is not None else ""
        print(f"  {name:<38} {1000 * value:9.1f} ms{extra}")
    goals = result["goals"].items()
    print("  goals:", ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {**vars(args), "dir": None, "json": args.json.name}
        args.json.write_text(json.dumps({"args": settings, **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
