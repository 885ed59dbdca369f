"""A rank SIGKILLed at castore's first collective: every survivor raises within the timeout.

Real ranks in a real gloo group (tests/helpers/dist_harness.py). The process group's
own timeout is set far above castore's, so a wait that only the group's timeout
bounds (gloo's ``new_group`` rendezvous, run by ``castore.dist.comm.own_groups``)
shows as a survivor still running when the harness gives up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import describe, run_ranks
from group_setup_workers import save_with_a_peer_killed

import castore

pytest.importorskip("torch.distributed")

WORLD = 4
TIMEOUT = 5.0  # castore's timeout for the save
MARGIN = 15.0  # start-up of the survivors' first save, and a loaded two-core machine
GROUP_TIMEOUT = 300.0  # the default group's own timeout: far above the bound


@pytest.mark.parametrize(
    ("victim", "blocking"),
    [(3, False), (0, False), (3, True)],
    ids=["async-peer", "async-store-host", "blocking-peer"],
)
def test_a_rank_killed_before_its_first_save_makes_every_survivor_raise_in_time(
    tmp_path: Path, victim: int, blocking: bool
) -> None:
    """Async saves set up castore's own groups first (a collective of every rank);
    rank 0 also hosts the rendezvous store, so killing it takes the store away."""
    store = tmp_path / "store"
    castore.open(store).close()
    outcomes = run_ranks(
        WORLD,
        save_with_a_peer_killed,
        str(store),
        victim,
        TIMEOUT,
        blocking,
        timeout=TIMEOUT + MARGIN + 30,
        pg_timeout=GROUP_TIMEOUT,
    )
    assert outcomes[victim].exitcode == -9, describe(outcomes)
    for outcome in outcomes:
        if outcome.rank == victim:
            continue
        assert not outcome.timed_out and outcome.value is not None, describe(outcomes)
        raised = outcome.value
        assert "DistributedError" in raised["mro"], describe(outcomes)
        assert raised["seconds"] < TIMEOUT + MARGIN, describe(outcomes)
        assert "\n" not in raised["message"], raised["message"]
    with castore.open(store) as opened:
        assert opened.runs() == []  # nothing published
