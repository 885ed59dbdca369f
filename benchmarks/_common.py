"""Helpers shared by the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import stat
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPLY_TIMEOUT = 900.0  # seconds a rank may take to answer one command


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def disk_free(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def print_goals(verdicts: list[dict[str, Any]]) -> None:
    print("goals:")
    for verdict in verdicts:
        mark = "MET" if verdict["met"] else "NOT MET"
        print(f"  [{mark:7}] {verdict['goal']}: {verdict['measured']}")


def rss_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def tree_bytes(path: Path) -> tuple[int, int]:
    """(apparent, allocated) bytes of the regular files under ``path``, like ``du``.

    Apparent is the sum of ``st_size``; allocated is ``st_blocks * 512``, which
    is smaller for sparse files. A file with several hard links counts once.
    """
    seen: set[tuple[int, int]] = set()
    apparent = allocated = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            info = os.lstat(os.path.join(folder, name))
            if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            apparent += info.st_size
            allocated += info.st_blocks * 512
    return apparent, allocated


def join_gloo(rank: int, port: int, world: int, timeout_s: float) -> None:
    """Join a gloo group on the loopback as one benchmark rank: torch.distributed's
    warnings off, one intra-op thread (the ranks share the machine's cores)."""
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PipedRanks:
    """``world`` spawned worker processes, one pipe each, driven by commands.

    ``worker(rank, port, *args, conn)`` answers each command it receives on
    ``conn`` with a dict (``{"error": text}`` on failure) and returns on
    ``("stop",)``; its first reply, after start-up, is collected here.
    """

    def __init__(
        self, world: int, worker: Callable[..., None], args: tuple[Any, ...], name: str
    ) -> None:
        context = mp.get_context("spawn")
        port = free_port()
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # many ranks on few cores
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for rank in range(world):
            parent_end, child_end = context.Pipe()
            proc = context.Process(
                target=worker, args=(rank, port, *args, child_end), name=f"{name}-{rank}"
            )
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        self.collect("start")

    def collect(self, what: str) -> list[dict[str, Any]]:
        replies = []
        deadline = time.monotonic() + REPLY_TIMEOUT
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True)):
            while not conn.poll(0.2):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank} died or hung during {what}")
            reply = conn.recv()
            if "error" in reply:
                raise RuntimeError(f"rank {rank} failed during {what}:\n{reply['error']}")
            replies.append(reply)
        return replies

    def command(self, *command: Any) -> list[dict[str, Any]]:
        for conn in self.conns:
            conn.send(command)
        return self.collect(str(command[:2]))

    def close(self) -> None:
        for proc, conn in zip(self.procs, self.conns, strict=True):
            if proc.is_alive():
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()  # our own child, by its handle
                proc.join()


# --codecs of the save/load and S3 benchmarks: castore.format.codec.SETTINGS.
CODECS = ("none", "auto", "zstd", "bytegroup")


def parse_codecs(text: str) -> list[str]:
    """``--codecs``: a comma-separated list of distinct codecs."""
    codecs = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in codecs if c not in CODECS]
    if not codecs or unknown or len(set(codecs)) != len(codecs):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a comma-separated list of distinct codecs from {', '.join(CODECS)}"
        )
    return codecs


# -- the framework benchmarks (bench_lightning.py, bench_huggingface.py) -------------


def median_later(values: list[float]) -> float:
    """The median of every value after the first (a first save opens and warms up)."""
    return statistics.median(values[1:]) if len(values) > 1 else values[0]


def same_state(a: Any, b: Any) -> bool:
    """Two states equal bit for bit: torch tensors and numpy arrays by dtype and
    value, containers by their keys and items, plain values by ``==``."""
    import numpy as np

    torch = sys.modules.get("torch")  # a torch tensor only where torch is imported
    if torch is not None and isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def add_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's totals, bytes per later save and time per later save over the first
    run's (the framework alone), as ``ratio_*`` fields for the JSON record."""
    base = results[0]
    for r in results:
        r["ratio_total_allocated"] = r["total_allocated"] / base["total_allocated"]
        r["ratio_total_apparent"] = r["total_apparent"] / base["total_apparent"]
        r["ratio_median_later_save_bytes"] = (
            r["median_later_save_bytes"] / base["median_later_save_bytes"]
        )
        r["ratio_median_later_save_s"] = r["median_later_save_s"] / base["median_later_save_s"]
    return results


def mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"
