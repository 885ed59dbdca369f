"""Tiers on one node: save stall, upload bytes and restore time, against the peers.

Run from the repository root::

    .venv/bin/python benchmarks/bench_tiers.py [--state-mib 64] [--steps 10] [--every 5]
                                               [--repeats 3] [--workdir DIR] [--json OUT]

A state of ``--state-mib`` MiB of fp32 in 16 tensors is saved ``--steps`` times;
before every save but the first, 2 of the 16 tensors (12.5% of the bytes) get
new random values. The *durable* place is a directory under ``--workdir`` (on
disk; default ``bench-tiers/`` in the repository), the *fast* tier a directory
under ``/dev/shm`` where there is one. Five ways to save the same states:

  tiered        castore.open_tiered(fast, durable, durable_every=--every): the
                save publishes in the fast tier; every --every-th generation and
                the last are promoted to the durable directory (a shared-directory
                store) on castore's background thread
  castore       castore.open(durable, shared=True).save: castore straight to the
                durable directory ("durable only", today's castore)
  torch.save    one file per save in the durable directory, fsynced
  DCP           dcp.save(FileSystemWriter(dir_i, sync_files=True), no_dist=True)

Reported per way (medians over the steps of ``--repeats`` runs): the time a
save holds the caller; for tiered, the upload bytes of each promotion against
the chunk bytes the durable store lacked (the durable directory's growth over
``bytes_copied``: manifests, index, reflog and pack headers included), and
whether the promotions overlapped the next saves. Restore: the newest state
loaded through the tiered store (all local), through a tiered store whose fast
tier was wiped (every chunk from the durable tier), from the castore store,
torch.load and DCP; the page cache is dropped before each restore where this
process may. Ratios are against the peers measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import drop_caches, tree_bytes  # noqa: E402

import castore  # noqa: E402

TENSORS = 16
CHANGED = 2


def make_state(mib: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    per = mib * (1 << 20) // TENSORS // 4
    return {f"layer{i:02d}": rng.standard_normal(per, dtype=np.float32) for i in range(TENSORS)}


def step_states(mib: int, steps: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    state = make_state(mib, rng)
    out = [dict(state)]
    for step in range(1, steps):
        state = dict(state)
        for k in range(CHANGED):
            name = f"layer{(step * CHANGED + k) % TENSORS:02d}"
            state[name] = rng.standard_normal(state[name].size, dtype=np.float32)
        out.append(state)
    return out


def fast_root() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="castore-bench-fast-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="castore-bench-fast-"))


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def one_run(args: argparse.Namespace, states: list[dict[str, np.ndarray]], work: Path) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    fast = fast_root()
    out: dict[str, Any] = {"saves": {}, "restore": {}, "promotions": []}
    try:
        # -- tiered ------------------------------------------------------------
        durable = work / "tiered-durable"
        castore.open(durable, shared=True).close()
        growth: list[tuple[int, int]] = []
        store = castore.open_tiered(fast / "tier", durable, durable_every=args.every)
        try:
            times = []
            for step, state in enumerate(states, 1):
                seconds, _ = timed(lambda s=state, n=step: store.save(s, run="job", step=n))
                times.append(seconds)
                if step % args.every == 0:  # measure each promotion's bytes alone
                    before = tree_bytes(durable)[0]
                    promoted = store.wait_promotions()[-1]
                    assert promoted.error is None and promoted.copied is not None, promoted
                    growth.append((tree_bytes(durable)[0] - before, promoted.copied.bytes_copied))
            out["saves"]["tiered"] = times
            out["promotions"] = growth
            newest = len(states)
            drop_caches()
            seconds, _ = timed(lambda: store.load("job"))
            out["restore"]["tiered, all local"] = seconds
        finally:
            store.close()  # promotes the newest
        shutil.rmtree(fast / "tier")
        drop_caches()
        store = castore.open_tiered(fast / "tier", durable)
        try:
            seconds, restored = timed(lambda: store.restore("job"))
            assert restored.generation.id == newest
            out["restore"]["tiered, fast tier lost"] = seconds
            out["restore_sources"] = restored.sources
        finally:
            store.close()

        # -- castore straight to the durable directory ------------------------------
        direct = castore.open(work / "castore-durable", shared=True)
        try:
            out["saves"]["castore"] = [
                timed(lambda s=state, n=step: direct.save(s, run="job", step=n))[0]
                for step, state in enumerate(states, 1)
            ]
            drop_caches()
            out["restore"]["castore"] = timed(lambda: direct.load("job"))[0]
        finally:
            direct.close()

        # -- torch.save --------------------------------------------------------------
        torch_dir = work / "torch"
        torch_dir.mkdir()
        times = []
        for step, state in enumerate(states, 1):
            tensors = {k: torch.from_numpy(v) for k, v in state.items()}
            path = torch_dir / f"step{step}.pt"

            def save_torch(tensors: dict = tensors, path: Path = path) -> None:
                with open(path, "wb") as handle:
                    torch.save(tensors, handle)
                    handle.flush()
                    os.fsync(handle.fileno())

            times.append(timed(save_torch)[0])
        out["saves"]["torch.save"] = times
        drop_caches()
        last = torch_dir / f"step{len(states)}.pt"
        out["restore"]["torch.load"] = timed(lambda: torch.load(last, weights_only=True))[0]

        # -- DCP ------------------------------------------------------------------------
        times = []
        for step, state in enumerate(states, 1):
            tensors = {k: torch.from_numpy(v) for k, v in state.items()}
            writer = dcp.FileSystemWriter(work / f"dcp{step}", sync_files=True)
            times.append(
                timed(lambda t=tensors, w=writer: dcp.save(t, storage_writer=w, no_dist=True))[0]
            )
        out["saves"]["DCP"] = times
        drop_caches()
        target = {k: torch.empty(v.size) for k, v in states[-1].items()}
        reader = dcp.FileSystemReader(work / f"dcp{len(states)}")
        out["restore"]["DCP"] = timed(
            lambda: dcp.load(target, storage_reader=reader, no_dist=True)
        )[0]
    finally:
        shutil.rmtree(fast, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("bench-tiers"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    states = step_states(args.state_mib, args.steps, seed=1)
    runs = []
    for repeat in range(args.repeats):
        work = args.workdir / f"run{repeat}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            runs.append(one_run(args, states, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    saves = {
        way: statistics.median(t for run in runs for t in run["saves"][way][1:])
        for way in runs[0]["saves"]
    }
    restores = {
        way: statistics.median(run["restore"][way] for run in runs) for way in runs[0]["restore"]
    }
    promotions = [p for run in runs for p in run["promotions"]]
    upload = statistics.median(grown / copied for grown, copied in promotions if copied)
    print(
        f"{args.state_mib} MiB fp32 in {TENSORS} tensors, {args.steps} saves, "
        f"{100 * CHANGED / TENSORS:.1f}% new per save, durable every {args.every}; "
        f"medians of {args.repeats} runs (saves after the first)"
    )
    print()
    print("| save (holds the caller) | seconds | tiered is |")
    print("| --- | --- | --- |")
    for way, seconds in saves.items():
        ratio = "" if way == "tiered" else f"{seconds / saves['tiered']:.1f}x faster"
        print(f"| {way} | {seconds:.3f} | {ratio} |")
    print()
    print("| restore the newest | seconds | against all local |")
    print("| --- | --- | --- |")
    for way, seconds in restores.items():
        print(f"| {way} | {seconds:.3f} | {seconds / restores['tiered, all local']:.2f}x |")
    print()
    print(
        f"promotions: durable directory growth / chunk bytes sent = {upload:.3f} "
        f"(median of {len(promotions)}); a lost fast tier's restore read "
        f"{runs[0]['restore_sources']} bytes by tier"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                 "saves": saves, "restores": restores, "upload_ratio": upload},
                indent=2,
            ) + "\n"
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
