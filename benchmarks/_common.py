"""Helpers shared by the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any


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
