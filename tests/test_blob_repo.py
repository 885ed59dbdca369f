"""Refs, reflog, tags and locks over blobs (castore.repo.blobs), on memory and a shared directory.

The repository contract suites run over the blob parts on both blob stores;
a whole Store (chunks in memory, everything else as blobs) runs StoreTests.
Ref advances race from one root on threads (each its own "node", with its own
locks) and on real spawned processes over a shared directory: exactly one
wins and the reflog holds exactly one record of its advance. A broken control
shows the race test fails an advance that overwrites instead of swapping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import blob_repo_workers
import numpy as np
import pytest
from _helpers import process_context

from castore import Store
from castore.blob import MemoryBlobStore, PosixBlobStore
from castore.blob.base import BlobStore
from castore.chunkstore.memory import MemoryBackend
from castore.errors import CorruptRefError, RefConflictError, StoreLockedError
from castore.gc import GcAbortedError, RetentionPolicy, collect_garbage, tag
from castore.repo.base import RefTable
from castore.repo.blobreflog import BlobReflog, decode_record, encode_record, record_blob
from castore.repo.blobs import (
    LEASE_FREE,
    BlobRefTable,
    BlobStoreLocks,
    BlobTagTable,
    LeaseLostWarning,
    RunLeases,
    blob_refs,
)
from castore.repo.records import Record, make_reflog_record
from castore.repo.refstore import ComposedRefStore, RepoParts
from castore.testing import (
    ReflogTests,
    RefTableTests,
    StoreLocksTests,
    StoreTests,
    TagTableTests,
)
from castore.testing._values import race, value
from castore.verify import verify_store

CHUNK = 1024
RACERS = 4


@pytest.fixture(params=["memory", "posix"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "memory":
        return MemoryBlobStore(list_page_size=7)
    return PosixBlobStore(tmp_path / "shared", stale_lock_after=30.0)


# -- the contract suites ------------------------------------------------------------


class TestBlobRefTable(RefTableTests):
    @pytest.fixture
    def refs(self, blobs: BlobStore) -> RefTable:
        return BlobRefTable(blobs, BlobStoreLocks())


class TestBlobRefStoreParts(RefTableTests):
    @pytest.fixture
    def refs(self, blobs: BlobStore) -> RefTable:
        return blob_refs(blobs).parts.refs


class TestBlobReflog(ReflogTests):
    @pytest.fixture
    def reflog(self, blobs: BlobStore) -> BlobReflog:
        return BlobReflog(blobs)


class TestBlobReflogReadByANewHandle(ReflogTests):
    """Every read and append by a handle that knows nothing yet: the blobs, not a kept view."""

    @pytest.fixture
    def reflog(self, blobs: BlobStore) -> BlobReflog:
        class Forgetful(BlobReflog):
            def view(self, run: str, *, fresh: bool = False):  # type: ignore[no-untyped-def]
                return BlobReflog(blobs).view(run, fresh=fresh)

            def records_backwards(self, run: str):  # type: ignore[no-untyped-def]
                return BlobReflog(blobs).records_backwards(run)

            def append(self, run: str, record):  # type: ignore[no-untyped-def]
                BlobReflog(blobs).append(run, record)

        return Forgetful(blobs)


class TestBlobTagTable(TagTableTests):
    @pytest.fixture
    def tags(self, blobs: BlobStore) -> BlobTagTable:
        return BlobTagTable(blobs)


class TestBlobStoreLocks(StoreLocksTests):
    """In-process locks only (cross-node exclusion is not provided yet)."""

    @pytest.fixture
    def locks(self) -> BlobStoreLocks:
        return BlobStoreLocks()


class TestBlobStoreLocksWithRunLeases(StoreLocksTests):
    """The run lock also a lease blob: the suite holds as for in-process locks."""

    @pytest.fixture
    def locks(self, blobs: BlobStore) -> BlobStoreLocks:
        return BlobStoreLocks(blobs, stale_after=30.0)


def test_a_run_lease_excludes_another_node_until_released(blobs: BlobStore) -> None:
    mine, theirs = BlobStoreLocks(blobs), BlobStoreLocks(blobs)  # two nodes
    with mine.run_lock("r", timeout=1, busy="test"):
        started = time.monotonic()
        with pytest.raises(StoreLockedError, match="run r busy"):
            with theirs.run_lock("r", timeout=0.3, busy="run r busy"):
                pass
        assert time.monotonic() - started >= 0.25
        with theirs.run_lock("other", timeout=1, busy="test"):
            pass  # another run's lease is free
    with theirs.run_lock("r", timeout=1, busy="test"):
        assert blobs.get("locks/runs/r") != LEASE_FREE
    assert blobs.get("locks/runs/r") == LEASE_FREE


def test_a_lease_left_by_a_dead_holder_is_taken_over_after_stale_after(
    blobs: BlobStore,
) -> None:
    dead = RunLeases(blobs, stale_after=0.5)
    held = dead.acquire("r", timeout=1, busy="test")  # and never released: killed
    waiter = RunLeases(blobs, stale_after=0.5)
    with pytest.raises(StoreLockedError):
        waiter.acquire("r", timeout=0.3, busy="test")  # not before it looked stale
    started = time.monotonic()
    taken = waiter.acquire("r", timeout=5, busy="test")
    assert 0.4 <= time.monotonic() - started < 5
    with pytest.warns(LeaseLostWarning, match="taken over"):
        dead.release(held)  # the stalled holder finds out; it frees nothing
    assert blobs.get("locks/runs/r") != LEASE_FREE
    waiter.release(taken)
    assert blobs.get("locks/runs/r") == LEASE_FREE


class SlowReflog(BlobReflog):
    """Its appends wait a moment first: a writer slow between its ref swap and its record."""

    def append(self, run: str, record: Record) -> None:
        time.sleep(0.5)
        super().append(run, record)


def _node(blobs: BlobStore, *, leased: bool, reflog: BlobReflog) -> ComposedRefStore:
    """The ref store of one node, with run leases or (the control) in-process locks only."""
    locks = BlobStoreLocks(blobs if leased else None)
    return ComposedRefStore(
        RepoParts(BlobRefTable(blobs, locks), reflog, BlobTagTable(blobs), locks)
    )


@pytest.mark.parametrize("leased", [True, False])
def test_run_leases_keep_two_nodes_reflog_in_order(blobs: BlobStore, leased: bool) -> None:
    """Node A publishes generation 2 and is slow to log it; node B then publishes 3.

    With run leases B waits for A's record; without them (the control) B logs
    a ``recovered`` record for A's advance and the log ends out of order.
    """
    slow = _node(blobs, leased=leased, reflog=SlowReflog(blobs))
    fast = _node(blobs, leased=leased, reflog=BlobReflog(blobs))
    fast.advance("r", expected=None, new=value("r", 1))
    node_a = threading.Thread(
        target=slow.advance,
        args=("r",),
        kwargs={"expected": value("r", 1).root, "new": value("r", 2)},
    )
    node_a.start()
    deadline = time.monotonic() + 10
    while fast.read("r") != value("r", 2):  # A has swapped; its record is on its way
        assert time.monotonic() < deadline
        time.sleep(0.005)
    fast.advance("r", expected=value("r", 2).root, new=value("r", 3))
    node_a.join(10)
    logged = [(r["action"], r["generation"]) for r in blob_refs(blobs).reflog("r")]
    in_order = [("advance", 1), ("advance", 2), ("advance", 3)]
    if leased:
        assert logged == in_order
    else:
        assert logged == [("advance", 1), ("recovered", 2), ("advance", 3), ("advance", 2)]


# -- a whole store ------------------------------------------------------------------


def blob_store(blobs: BlobStore, chunks: MemoryBackend | None = None) -> Store:
    """Chunks and objects in memory; refs, reflog and tags as blobs."""
    return Store(Path("blob:test"), chunks or MemoryBackend(), CHUNK, refs=blob_refs(blobs))


class TestStoreOverBlobRefs(StoreTests):
    @pytest.fixture
    def store(self, blobs: BlobStore) -> Iterator[Store]:
        with blob_store(blobs) as opened:
            yield opened


def test_a_store_lays_out_refs_records_and_tags_as_blobs(blobs: BlobStore) -> None:
    chunks = MemoryBackend()
    with blob_store(blobs, chunks) as store:
        for step in range(1, 5):
            store.save({"w": np.arange(300.0) + step}, run="r", step=step)
        tag(store, "r", 2, "best")
        assert [g.id for g in store.generations("r", last=2)] == [3, 4]
        assert collect_garbage(store, RetentionPolicy(keep_last=1)).dropped == {"r": [1, 3]}
        assert [g.id for g in store.generations("r")] == [2, 4]
        assert store.load("r", "best")["w"].tobytes() == (np.arange(300.0) + 2).tobytes()
        assert verify_store(store, deep=True).ok
        assert list(blobs.list()) == [
            "locks/runs/r",  # the run's lease, free again
            "locks/store/gc",  # the collection's store lease, free again (no save lease left)
            *(f"logs/r/{n:012d}" for n in range(1, 7)),  # four advances, two collections
            "refs/r",
            "tags/r/best",
        ]
        assert blobs.get("locks/runs/r") == LEASE_FREE
        assert blobs.get("locks/store/gc") == b'{"free":true}'
        # A new handle on the same blobs (and chunks) reads the same history.
        again = blob_store(blobs, chunks)
        assert [g.id for g in again.generations("r")] == [2, 4]
        assert [(r["action"], r["generation"]) for r in again.refs.reflog("r")][-2:] == [
            ("collect", 1),
            ("collect", 3),
        ]


def make_record(generation: int) -> Record:
    return make_reflog_record("r", value("r", generation), parent=None, action="advance")


def test_a_record_is_one_checksummed_json_line() -> None:
    record = make_record(1)
    data = encode_record(record)
    assert data.endswith(b"\n") and data.count(b"\t") == 1
    assert decode_record(data, "r") == record
    assert decode_record(data.replace(b'"advance"', b'"advancf"'), "r") is None  # checksum
    assert decode_record(data, "other") is None  # shape: another run's record
    assert decode_record(data[:-1], "r") is None


def test_damaged_and_missing_records_are_named_and_stop_gc(blobs: BlobStore) -> None:
    with blob_store(blobs) as store:
        for step in range(1, 5):
            store.save({"w": np.arange(300.0) + step}, run="r", step=step)
        blobs.delete(record_blob("r", 2))
        blobs.delete(record_blob("r", 3))
        blobs.create(record_blob("r", 3), b"not a record\tffff\n")
        assert store.refs.read_reflog("r")[1] == [2, 3]
        with pytest.raises(GcAbortedError, match=r"damaged lines \[2, 3\].*logs/r/"):
            collect_garbage(store, RetentionPolicy(keep_last=1))
        report = verify_store(store)
        assert any("logs/r/" in p.what and "[2, 3]" in p.what for p in report.problems)


def test_a_damaged_ref_blob_raises(blobs: BlobStore) -> None:
    refs = BlobRefTable(blobs)
    refs.advance("r", expected=None, new=value("r", 1))
    found = blobs.read_versioned("refs/r")
    assert found is not None
    blobs.swap("refs/r", found[0][:-1] + b"\x00", found[1])
    with pytest.raises(CorruptRefError, match="checksum"):
        refs.read("r")


def test_two_writers_never_overwrite_each_others_records(blobs: BlobStore) -> None:
    """Two handles, each sure of the end it saw, append in turn: both records are kept."""
    first, second = BlobReflog(blobs), BlobReflog(blobs)
    records = [make_record(g) for g in range(1, 7)]
    first.append("r", records[0])
    second.append("r", records[1])  # second lists: number 2
    first.append("r", records[2])  # first believes 2 is next: taken, so it lists again
    second.append("r", records[3])
    outcomes = race(2, lambda i: (first, second)[i].append("r", records[4 + i]))
    assert outcomes == [None, None]
    kept = BlobReflog(blobs).read("r")
    assert kept[1] == []
    assert kept[0][:4] == records[:4] and sorted(r["generation"] for r in kept[0][4:]) == [5, 6]


def test_a_kept_view_reads_what_another_handle_appended(blobs: BlobStore) -> None:
    reader, writer = BlobReflog(blobs), BlobReflog(blobs)
    writer.append("r", make_record(1))
    assert [r["generation"] for r in reader.view("r").records] == [1]
    writer.append("r", make_record(2))
    writer.append("r", make_record(3))
    assert reader.last_published("r") == make_record(3)  # from the kept view, extended
    assert [r["generation"] for r in reader.view("r").records] == [1, 2, 3]
    assert reader.view("r") is reader.cached_view("r")


# -- racing advances: one winner, one record ------------------------------------------


def _start(blobs: BlobStore) -> None:
    blob_refs(blobs).advance("r", expected=None, new=value("r", 1))


def _race_threads(blobs: BlobStore, *, broken: bool) -> list[str]:
    barrier = threading.Barrier(RACERS)
    stores = [blob_repo_workers.racing_refs(blobs, barrier, broken=broken) for _ in range(RACERS)]
    return race(RACERS, lambda i: blob_repo_workers.advance_once(stores[i], i))


def _race_processes(root: Path, *, broken: bool, leased: bool = False) -> list[str]:
    processes = process_context()
    barrier, results = processes.Barrier(RACERS), processes.Queue()
    target = blob_repo_workers.race_leased if leased else blob_repo_workers.race
    racers = [
        processes.Process(target=target, args=(str(root), i, barrier, results, broken))
        for i in range(RACERS)
    ]
    for racer in racers:
        racer.start()
    try:
        found = dict(results.get(timeout=240) for _ in range(RACERS))
    finally:
        for racer in racers:
            racer.join(60)
            if racer.is_alive():
                racer.kill()
    assert [racer.exitcode for racer in racers] == [0] * RACERS
    return [found[i] for i in range(RACERS)]


def _check_one_winner(blobs: BlobStore, outcomes: list[str]) -> None:
    winners = [i for i, outcome in enumerate(outcomes) if outcome == "won"]
    assert len(winners) == 1, f"racers {winners} won: {outcomes}"
    losers = [o for i, o in enumerate(outcomes) if i != winners[0]]
    assert set(losers) == {RefConflictError.__name__}, outcomes
    refs = blob_refs(blobs)
    assert refs.read("r") == blob_repo_workers.racer_value(winners[0])
    records = refs.reflog("r")
    assert [(r["action"], r["generation"]) for r in records] == [("advance", 1), ("advance", 2)]
    assert records[-1]["root"] == blob_repo_workers.racer_value(winners[0]).root.hex


@pytest.mark.parametrize("kind", ["memory", "posix"])
def test_threads_advancing_from_one_root_one_wins_with_one_record(
    kind: str, tmp_path: Path
) -> None:
    for round_ in range(5):
        blobs: BlobStore = (
            MemoryBlobStore() if kind == "memory" else PosixBlobStore(tmp_path / f"round-{round_}")
        )
        _start(blobs)
        _check_one_winner(blobs, _race_threads(blobs, broken=False))


@pytest.mark.slow
def test_processes_advancing_from_one_root_one_wins_with_one_record(tmp_path: Path) -> None:
    for round_ in range(3):
        root = tmp_path / f"round-{round_}"
        blobs = PosixBlobStore(root)
        _start(blobs)
        _check_one_winner(blobs, _race_processes(root, broken=False))


@pytest.mark.slow
def test_processes_with_run_leases_one_wins_with_one_record(tmp_path: Path) -> None:
    for round_ in range(3):
        root = tmp_path / f"round-{round_}"
        blobs = PosixBlobStore(root)
        _start(blobs)
        _check_one_winner(blobs, _race_processes(root, broken=False, leased=True))
        assert blobs.get("locks/runs/r") == LEASE_FREE


def test_the_race_test_fails_an_advance_that_overwrites(tmp_path: Path) -> None:
    memory = MemoryBlobStore()
    _start(memory)
    outcomes = _race_threads(memory, broken=True)
    with pytest.raises(AssertionError) as failed:
        _check_one_winner(memory, outcomes)
    print(f"threads: {str(failed.value).splitlines()[0]}")

    root = tmp_path / "processes"
    _start(PosixBlobStore(root))
    outcomes = _race_processes(root, broken=True)
    with pytest.raises(AssertionError) as failed:
        _check_one_winner(PosixBlobStore(root), outcomes)
    print(f"processes: {str(failed.value).splitlines()[0]}")
