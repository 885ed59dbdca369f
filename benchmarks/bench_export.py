"""Export to Hugging Face safetensors: castore against DCP's consolidation, same state.

Run from the repository root::

    .venv/bin/python benchmarks/bench_export.py [--size-mib 1024] [--ranks 4] [--rounds 3]
                                                [--json OUT]

4 gloo ranks hold a ``--size-mib`` state of 2-D fp32 and bf16 tensors, each
rank its dim-0 block of every tensor, and save it twice: with
``castore.dist.save`` (each block a ``castore.Shard``) and with DCP's
``HuggingFaceStorageWriter(save_distributed=True)`` (each block a DTensor),
which leaves one safetensors file of blocks per rank. Then, each in a fresh
process of its own, timed with its peak RSS above the process's RSS before it
starts (``/proc/self/clear_refs``, ``VmHWM``):

  castore export   ``castore.export.to_safetensors(store, run, "latest", out)``
  DCP consolidate  ``consolidate_safetensors_files(sharded, out, mapping)``,
                   what DCP runs to turn a distributed save into full tensors
  DCP + fsync      the same, then an fsync of each output file: DCP does not
                   sync its output, castore's export is durable when it returns

``os.sync()`` runs (untimed) before each, so one method's writeback does not
slow the next.

Both write one ``model.safetensors`` of the full tensors; both outputs are
read back with the safetensors library and compared tensor by tensor (blake3
of the bytes), outside the timed part. Rounds alternate the order. Goal (issue
14): castore's throughput >= 1.0x DCP's at <= 0.25x its peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import PipedRanks, print_goals, rss_kib  # noqa: E402

import castore  # noqa: E402
import castore.dist  # noqa: E402

RUN = "bench"
METHODS = ("castore", "dcp", "dcp+fsync")
COLUMNS = 4096


def tensor_specs(size_mib: int, ranks: int) -> list[tuple[str, int, torch.dtype]]:
    """(name, rows, dtype) of the state: 16 tensors, the last 4 bf16; rows divide by ranks."""
    per_tensor = size_mib * 2**20 // 16
    specs = []
    for index in range(16):
        dtype = torch.bfloat16 if index >= 12 else torch.float32
        rows = per_tensor // (COLUMNS * dtype.itemsize) // ranks * ranks
        specs.append((f"model.layers.{index}.weight", max(ranks, rows), dtype))
    return specs


def full_tensor(name: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # same on every rank
    return torch.randn(rows, COLUMNS, generator=generator).to(dtype)


def save_rank(rank: int, port: int, world: int, size_mib: int, work: str, conn: Any) -> None:
    """One rank: save its blocks with castore and with DCP's HF writer, then wait."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        blocks, dtensors = {}, {}
        for name, rows, dtype in tensor_specs(size_mib, world):
            part = rows // world
            local = full_tensor(name, rows, dtype)[rank * part : (rank + 1) * part].clone()
            blocks[name] = castore.Shard(local, (rows, COLUMNS), (rank * part, 0))
            dtensors[name] = DTensor.from_local(local, mesh, [Shard(0)])
        with castore.open(f"{work}/store") as store:
            castore.dist.save(store, blocks, run=RUN, step=1)
        writer = HuggingFaceStorageWriter(f"{work}/dcp", save_distributed=True)
        dcp.save(dtensors, storage_writer=writer)
        conn.send({"saved": True})
        conn.recv()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
        conn.send({"error": repr(exc)})


# -- the timed part, each in a fresh process ------------------------------------


def child(method: str, work: str, out: str) -> dict[str, Any]:
    if method == "castore":
        import castore.export as export

        def run() -> None:
            with castore.open(f"{work}/store", create=False) as store:
                export.to_safetensors(store, RUN, "latest", out)

    else:
        from safetensors import safe_open
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files,
        )

        names: list[str] = []
        for path in sorted(Path(work, "dcp").glob("*.safetensors")):
            with safe_open(str(path), "np") as handle:
                names += list(handle.keys())

        def run() -> None:
            os.makedirs(out)  # DCP writes into an existing directory
            mapping = dict.fromkeys(names, 1)
            consolidate_safetensors_files(f"{work}/dcp", out, fqn_to_index_mapping=mapping)
            if method == "dcp+fsync":  # durable on return, as castore's export is
                for path in Path(out).iterdir():
                    fd = os.open(path, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)

    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5\n")
    before = rss_kib("VmRSS")
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak_rss_bytes": (rss_kib("VmHWM") - before) * 1024}


def output_digests(out: str) -> dict[str, str]:
    """name -> blake3 of the bytes, for every tensor of every safetensors file in ``out``."""
    from safetensors import safe_open

    from castore.format.hashing import digest_bytes

    digests = {}
    for path in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = handle.get_tensor(name)
                digests[name] = digest_bytes(tensor.view(torch.uint8).numpy()).hex()
    return digests


def run_method(method: str, work: str, out: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", method, "--work", work, "--out", out]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.work, args.out)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-export-") as work:
        # Each rank's first reply, which PipedRanks waits for, says it has saved.
        PipedRanks(args.ranks, save_rank, (args.ranks, args.size_mib, work), "export").close()
        state_bytes = sum(
            rows * COLUMNS * dtype.itemsize
            for _, rows, dtype in tensor_specs(args.size_mib, args.ranks)
        )
        results: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
        for round_ in range(args.rounds):
            for method in METHODS[round_ % 3 :] + METHODS[: round_ % 3]:
                out = f"{work}/out-{method}-{round_}"
                os.sync()  # the last method's writeback does not slow this one
                results[method].append(run_method(method, work, out))
                if round_ == 0:
                    results[method][-1]["digests"] = output_digests(out)
                subprocess.run(["rm", "-rf", out], check=True)
        digests = [results[method][0].pop("digests") for method in METHODS]
        same = all(d == digests[0] for d in digests)
    summary = {
        method: {
            "seconds": statistics.median(r["seconds"] for r in runs),
            "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in runs),
        }
        for method, runs in results.items()
    }
    castore_fig, dcp_fig = summary["castore"], summary["dcp"]
    rows = [
        [
            label,
            f"{fig['seconds']:.2f}",
            f"{state_bytes / fig['seconds'] / 2**20:.0f}",
            f"{fig['peak_rss_bytes'] / 2**20:.0f}",
        ]
        for label, fig in (
            ("castore export", castore_fig),
            ("DCP consolidate", dcp_fig),
            ("DCP consolidate + fsync", summary["dcp+fsync"]),
        )
    ]
    print(f"state {state_bytes / 2**20:.0f} MiB saved by {args.ranks} ranks; outputs equal: {same}")
    print(tabulate(rows, headers=["method", "seconds", "MiB/s", "peak RSS rise MiB"]))
    speed = dcp_fig["seconds"] / castore_fig["seconds"]
    durable = summary["dcp+fsync"]["seconds"] / castore_fig["seconds"]
    print(f"castore export's throughput against DCP consolidate + fsync: {durable:.2f}x")
    memory = castore_fig["peak_rss_bytes"] / max(1, dcp_fig["peak_rss_bytes"])
    print_goals(
        [
            {"goal": "throughput >= 1.0x DCP's", "met": speed >= 1.0, "measured": f"{speed:.2f}x"},
            {
                "goal": "peak memory <= 0.25x DCP's",
                "met": memory <= 0.25,
                "measured": f"{memory:.2f}x",
            },
            {"goal": "outputs equal", "met": same, "measured": str(same)},
        ]
    )
    if args.json:
        args.json.write_text(json.dumps({"state_bytes": state_bytes, "methods": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
