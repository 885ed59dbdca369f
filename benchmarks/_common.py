"""Helpers shared by the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import os
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
