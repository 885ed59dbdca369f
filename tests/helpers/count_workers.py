"""Per-rank functions for tests/test_counts.py, run by tests/helpers/dist_harness.py."""

from __future__ import annotations

from typing import Any


def collectives_counted(rank: int, world_size: int) -> list[dict[str, Any]]:
    """One all_gather, one broadcast and one exchange of known sizes; each call's counts."""
    from castore.dist.comm import Group, collective_counts

    comm = Group(None, 0, 60.0)
    calls = [
        lambda: comm.all_gather(b"x" * rank, "test: gather"),
        lambda: comm.broadcast(b"y" * 10 if rank == 0 else None, "test: broadcast"),
        lambda: comm.exchange({(rank + 1) % world_size: b"z" * (rank + 5)}, "test: exchange"),
    ]
    spans = []
    for call in calls:
        before = collective_counts()
        call()
        moved = collective_counts() - before
        spans.append(
            {
                "calls": dict(moved.calls),
                "phases": dict(moved.phases),
                "rounds": moved.rounds,
                "sent": moved.sent,
                "received": moved.received,
            }
        )
    return spans
