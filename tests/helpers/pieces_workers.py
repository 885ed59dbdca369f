"""Rank functions for tests/test_pieces.py: a resharding restore of part of a chunk."""

from __future__ import annotations

from typing import Any

import numpy as np

ROWS, COLS = 896, 1024  # float32, 3.5 MiB: one chunk of 56 pieces (tests/test_pieces.py)


def restore_rows(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Restore this rank's band of rows of ``w`` (saved whole by one process) into a Shard."""
    import castore
    import castore.dist

    band = ROWS // world_size
    target = np.zeros((band, COLS), dtype=np.float32)
    with castore.open(path) as store:
        result = castore.dist.load(
            store, "r", {"w": castore.Shard(target, (ROWS, COLS), (rank * band, 0))}
        )
    report = result.report
    return {
        "bytes_read": report.bytes_read,
        "bytes_needed": report.bytes_needed,
        "resharded": report.resharded,
        "block": target,
    }
