"""Promotion from memory (castore.tiers.staged): a save's staged chunks sent to the
durable tier, paced by the steps the job reports.

Real stores on disk (the fast and the durable tier local LMDB stores), real
async saves and their staging buffers. A buffer "taken again" is taken from
the store's own staging pool, as the next save takes it.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dist_workers as w
import numpy as np
import pytest
from _helpers import assert_state_equal
from dist_harness import run_ranks
from test_dist import script_results

import castore
from castore.core.staging import StagedChunk, StagingBuffer
from castore.tiers import PIN_PREFIX, TieredStore, open_tiered
from castore.tiers.staged import StagedSender, StepPacer
from castore.verify import verify_store

CHUNK = 1024


def state(step: int) -> dict[str, Any]:
    """12 distinct chunks of 1 KiB: a weight of 8 KiB (staged in a 6 KiB and a 2 KiB
    buffer) and one of 4 KiB (one 4 KiB buffer)."""
    weight = np.arange(2048, dtype=np.float32) + 0.5
    weight[:256] = step
    return {"weight": weight, "frozen": np.arange(1024, dtype=np.float32) + 1000 * step}


def open_pair(tmp_path: Path, **options: Any) -> TieredStore:
    options.setdefault("chunk_size", CHUNK)
    options.setdefault("promote_on_exit", False)
    return open_tiered(tmp_path / "fast", tmp_path / "durable", **options)


def save_async(store: TieredStore, step: int) -> None:
    store.save(state(step), run="r", step=step, blocking=False).result()


def take_buffer(store: TieredStore, nbytes: int) -> StagingBuffer:
    """Take a staging buffer from the pool, as the next save would, and write into it."""
    buffer = store.background.pool.take(nbytes, pinned=False, aborted=lambda: False)
    buffer.array[:] = 0xFF
    return buffer


@pytest.mark.parametrize("uploader", ["thread", "process"])
def test_a_promotion_from_staged_memory_reads_no_chunk_from_the_fast_tier(
    tmp_path: Path, uploader: str
) -> None:
    with open_pair(tmp_path, durable_every=1, uploader=uploader) as store:
        store.report_step(0.1)
        save_async(store, 1)
        [promoted] = store.wait_promotions()
        assert promoted.error is None and promoted.copied is not None
        assert promoted.copied.chunks_copied == 0  # read from the fast tier: none
        assert store.staged_sends["sent_chunks"] == 12
        assert store.staged_sends["gone_chunks"] == store.staged_sends["fast_chunks"] == 0
        # The next promoted save sends only what changed (1 chunk of the weight and
        # the 4 of frozen); the durable tier has the rest.
        save_async(store, 2)
        [_, second] = store.wait_promotions()
        assert second.copied is not None and second.copied.chunks_copied == 0
        assert store.staged_sends["sent_chunks"] == 12 + 5
        assert store.staged_sends["present_chunks"] == 7
    # The promoted generations restore bitwise from the durable tier alone.
    with castore.open(tmp_path / "durable") as durable:
        assert [g.id for g in durable.generations("r")] == [1, 2]
        assert_state_equal(durable.load("r", 1), state(1))
        assert_state_equal(durable.load("r", 2), state(2))
        assert verify_store(durable, deep=True).ok


def test_chunks_whose_buffers_were_taken_again_are_read_from_the_fast_tier(
    tmp_path: Path,
) -> None:
    with open_pair(tmp_path, durable_every=1, uploader="thread") as store:
        store.report_step()  # the first report starts the clock: no budget yet
        save_async(store, 1)
        assert store.staged_sends["sent_chunks"] == 0  # nothing granted: nothing sent
        take_buffer(store, 4 * CHUNK)  # frozen's buffer: its 4 chunks are gone
        [promoted] = store.wait_promotions()
        sends = store.staged_sends
        assert (sends["sent_chunks"], sends["gone_chunks"]) == (8, 4)
        # Exactly the gone ones are read from the fast tier (verified), and sent.
        assert (sends["fast_chunks"], sends["fast_bytes"]) == (4, 4 * CHUNK)
        assert promoted.copied is not None and promoted.copied.chunks_copied == 0
    with castore.open(tmp_path / "durable") as durable:
        assert_state_equal(durable.load("r"), state(1))
        assert verify_store(durable, deep=True).ok


def test_broken_control_without_the_epoch_check_a_rewritten_buffer_reaches_the_durable_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The promotion relies on ownership, not on a second hash: the epoch check is what
    keeps a buffer rewritten after hashing out of the durable tier."""

    def unchecked(self: StagedChunk) -> bytes:
        return bytes(self.view)

    monkeypatch.setattr(StagedChunk, "copy_if_intact", unchecked)
    with open_pair(tmp_path, durable_every=1, uploader="thread") as store:
        store.report_step()
        save_async(store, 1)
        take_buffer(store, 4 * CHUNK)
        store.wait_promotions()
        assert store.staged_sends["gone_chunks"] == 0
    with castore.open(tmp_path / "durable") as durable:
        report = verify_store(durable, deep=True)
        assert not report.ok and len(report.problems) >= 1


def test_a_promotion_cut_off_after_the_staged_sends_is_retried_and_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_pair(tmp_path, durable_every=2, uploader="thread") as store:
        store.report_step(0.1)
        save_async(store, 1)
        save_async(store, 2)
        store.wait_promotions()

        def cut(*args: Any, **kwargs: Any) -> None:
            raise ConnectionError("the uplink went away before the publish")

        monkeypatch.setattr("castore.tiers.promotion.copy_generation", cut)
        save_async(store, 3)
        save_async(store, 4)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            promoted = store.wait_promotions()
        assert isinstance(promoted[-1].error, ConnectionError)
        assert store.staged_sends["sent_chunks"] > 12  # generation 4's chunks went ahead
        assert [g.id for g in store.durable.generations("r")] == [2]
        assert verify_store(store.durable, deep=True).ok
        assert f"{PIN_PREFIX}4" in store.fast.refs.tags("r")
        monkeypatch.undo()
    with open_pair(tmp_path, durable_every=2, uploader="thread") as store:
        promoted = store.wait_promotions()  # the next handle finishes it
        assert [(p.generation, p.error) for p in promoted] == [(4, None)]
        assert promoted[0].copied is not None and promoted[0].copied.chunks_copied == 0
        assert_state_equal(castore.open(tmp_path / "durable").load("r"), state(4))


@pytest.mark.slow
def test_every_rank_sends_its_own_staged_chunks_and_the_promotion_reads_none(
    tmp_path: Path,
) -> None:
    """Two gloo ranks on one node: each sends its shard's chunks from its own staging
    buffers, and the coordinator's promotion finds nothing left to read."""
    castore.open(tmp_path / "durable", shared=True).close()
    spec = {"fast": str(tmp_path / "fast"), "durable": str(tmp_path / "durable"),
            "durable_every": 2, "chunk_size": 256, "promote_on_exit": False}  # fmt: skip
    ops: list[dict[str, Any]] = [{"op": "step", "seconds": 0.1}]
    for step in (10, 20):
        ops.append({"op": "save", "run": "r", "seed": 3, "step": step, "blocking": False})
        ops.append({"op": "step", "seconds": 100.0})  # a long step: budget for all of it
    ops.append({"op": "barrier"})
    ops.append({"op": "promotions", "rank": 0})  # the coordinator's promotion, waited for
    ops.append({"op": "barrier"})
    ops.append({"op": "promotions", "rank": -1})  # every rank: what it sent
    outcomes = run_ranks(2, w.run_script, spec, ops, timeout=240)
    results = script_results(outcomes, 2)
    assert results[0][-3]["errors"] == [] and results[0][-3]["fast_chunks"] == [0]
    reports = [per_rank[-1]["staged"] for per_rank in results]
    assert all(sent["sent_chunks"] > 0 for sent in reports), reports
    assert all(sent["gone_chunks"] == sent["fast_chunks"] == 0 for sent in reports), reports
    with castore.open(tmp_path / "durable") as durable:
        assert [g.id for g in durable.generations("r")] == [2]
        assert verify_store(durable, deep=True).ok


# -- the pace ----------------------------------------------------------------------


class FakeClock:
    """The sender's clock: a put of n bytes costs n microseconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def staged(count: int, size: int) -> list[StagedChunk]:
    buffer = StagingBuffer(np.arange(count * size, dtype=np.uint64).view(np.uint8)[: count * size])
    view = memoryview(buffer.array)
    return [
        StagedChunk(bytes([i]) * 32, buffer, buffer.epoch, view[i * size : (i + 1) * size])
        for i in range(count)
    ]


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the sender did not settle"
        time.sleep(0.002)


def test_the_step_paced_sender_sends_no_more_than_its_budget_per_step() -> None:
    clock = FakeClock()
    received: list[int] = []
    lock = threading.Lock()

    def put_many(items: list[tuple[bytes, bytes]]) -> None:
        with lock:
            for _, data in items:
                clock.now += len(data) * 1e-6
                received.append(len(data))

    pacer = StepPacer(0.1, clock=clock, weight=1.0)  # 10% of each step
    sender = StagedSender(put_many, lambda keys: [False] * len(keys), pacer, slice_bytes=300)
    sender.offer("r", 1, staged(20, 300))  # 6,000 bytes: 6 ms of cost
    time.sleep(0.05)
    assert received == []  # no step reported: no budget
    slice_cost = 300e-6
    for step in range(1, 40):
        pacer.report(0.01)  # a 10 ms step grants 1 ms: 1,000 bytes
        wait_until(lambda: pacer.balance <= 0 or sum(received) == 6000)
        # Over the steps so far: what the steps granted, plus at most the slice in hand.
        assert pacer.spent <= pacer.granted + slice_cost + 1e-12
        assert sum(received) <= step * 1000 + 300
        if sum(received) == 6000:
            break
    assert sum(received) == 6000 and step >= 6
    sender.stop()
    assert [bytes_ for _, bytes_, _ in sender.slices] == [300] * 20


def test_report_step_on_a_plain_store_is_a_no_op(tmp_path: Path) -> None:
    with castore.open(tmp_path / "plain") as plain:
        plain.report_step(0.1)
        plain.report_step()


def test_the_sender_waits_while_a_save_is_staging_and_charges_its_cost_weighted() -> None:
    clock = FakeClock()
    received: list[int] = []
    staging = [True]

    def put_many(items: list[tuple[bytes, bytes]]) -> None:
        for _, data in items:
            clock.now += len(data) * 1e-6
            received.append(len(data))

    pacer = StepPacer(0.1, clock=clock, weight=2.0, hold=lambda: staging[0])
    sender = StagedSender(put_many, lambda keys: [False] * len(keys), pacer, slice_bytes=300)
    sender.offer("r", 1, staged(4, 300))
    pacer.report(1.0)  # 100 ms of budget: enough for all of it
    time.sleep(0.05)
    assert received == []  # held while "this process's save is staging"
    staging[0] = False
    wait_until(lambda: sum(received) == 1200)
    assert pacer.spent == pytest.approx(2 * 1200e-6)  # each clock second costs two
    sender.stop()
