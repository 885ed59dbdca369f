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


def one_node_restores_counted(rank: int, world_size: int, work: str) -> list[dict[str, int]]:
    """Both ranks on one node (one fast tier): save once, then restore without and with
    ``fallback="previous"``; each restore's collective calls by phase."""
    import os

    import numpy as np

    import castore
    import castore.dist
    from castore.dist.comm import collective_counts

    block = np.full((2, 4), rank, dtype=np.float32)
    with castore.open_tiered(
        os.path.join(work, "fast"), os.path.join(work, "durable"), chunk_size=16
    ) as store:
        state = {"w": castore.Shard(block, (2 * world_size, 4), (2 * rank, 0))}
        castore.dist.save(store, state, run="r", step=1)
        phases = []
        for fallback in (None, "previous"):
            target = np.zeros_like(block)
            shard = castore.Shard(target, (2 * world_size, 4), (2 * rank, 0))
            before = collective_counts()
            castore.dist.load(store, "r", {"w": shard}, fallback=fallback)
            phases.append(dict((collective_counts() - before).phases))
            assert np.array_equal(target, block)
    return phases


def several_node_restores_counted(
    rank: int, world_size: int, work: str, control: bool
) -> list[tuple[dict[str, int], int]]:
    """Each rank a node of its own (its own fast tier; one copy): save twice, then
    restore the newest without and with ``fallback="previous"``; each restore's
    collective calls by phase and how often the durable tier's history was read.
    ``control``: the discovery round's choice disabled (the coordinator chooses)."""
    import os

    import numpy as np

    import castore
    import castore.dist
    from castore.dist.comm import collective_counts
    from castore.tiers.nodes import NodeSession

    if control:
        NodeSession._newest_here = lambda self, run, views: None  # type: ignore[method-assign]
    shape = (2 * world_size, 4)
    fast, durable = os.path.join(work, f"fast{rank}"), os.path.join(work, "durable")
    with castore.open_tiered(fast, durable, chunk_size=16, durable_every=2) as store:
        for step in (1, 2):
            block = np.full((2, 4), 10 * step + rank, dtype=np.float32)
            state = {"w": castore.Shard(block, shape, (2 * rank, 0))}
            castore.dist.save(store, state, run="r", step=step)
        store.wait_promotions()  # the durable tier has generation 2: a candidate there too
        read = store.durable.candidates
        history_reads = []

        def counted(*args: Any, **kwargs: Any) -> Any:
            history_reads.append(args)
            return read(*args, **kwargs)

        store.durable.candidates = counted  # type: ignore[method-assign]
        found = []
        for fallback in (None, "previous"):
            target = np.zeros((2, 4), dtype=np.float32)
            before, reads = collective_counts(), len(history_reads)
            result = castore.dist.load(
                store, "r", {"w": castore.Shard(target, shape, (2 * rank, 0))}, fallback=fallback
            )
            assert result.report.generation.id == 2
            assert np.array_equal(target, np.full((2, 4), 20 + rank, dtype=np.float32))
            found.append(
                (dict((collective_counts() - before).phases), len(history_reads) - reads)
            )
    return found
