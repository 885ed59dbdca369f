"""Garbage collection against saves of other nodes, on stores laid out as blobs.

On a shared directory or S3 the store lock is a lease protocol
(castore.repo.leases), not ``flock``. The hazard is the one of
test_gc_concurrency.py: a save finds chunk X present and skips it, a
collection that does not see the save's generation deletes X, and the save
publishes a generation naming a missing chunk. Each interleaving is forced
with pauses (an Event a patched method waits on), and a stalled holder is
made by freezing its lease renewals; two handles with their own index cache
and their own leases are two nodes. What a stall longer than the lease does:

* a save stalled past ``store_lease`` has its lease broken by a collection,
  which then collects; the save fails closed (LockLostError) at its next
  check, before its shard ack and before the ref's compare-and-swap, and
  publishes nothing;
* a collection stalled past it has its lease broken by a save, which goes
  on; the collection fails closed at its next check (before it logs what it
  drops, before each delete batch, before it reclaims) and deletes nothing
  more;
* a killed collection holds the store for ``store_lease`` at most.

The control runs the first race with the leases switched off (each node's
lock in-process only) and shows the published generation naming X, gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gc_lease_workers
import numpy as np
import pytest
from _helpers import assert_state_equal

import castore
import castore.gc
from castore import Store
from castore.chunkstore.base import Namespace
from castore.errors import LockLostError, StoreLockedError
from castore.gc import RetentionPolicy, collect_garbage
from castore.repo.leases import LeaseWarning, StoreLeases
from castore.verify import verify_store

try:
    import s3_server
except pytest.skip.Exception:  # no boto3 or moto: the S3 cases skip, the rest run
    s3_server = None  # type: ignore[assignment]

RUN = "run"
CHUNK_SIZE = 1024
# Seconds: a stalled holder is broken this long after its last renewal. Short,
# so the stall cases take a few seconds; the other cases hold leases of LONG.
# Not shorter: a node that is not frozen must renew within LEASE / 2 or its own
# check stops it (LockLostError), and on a loaded 2-core machine a renewal (a
# thread to schedule, a write and an fsync) has been seen to take a whole second.
LEASE = 4.0
LONG = 60.0
WORKERS = Path(__file__).parent / "helpers" / "gc_lease_workers.py"


def _array(seed: int, elements: int = 1024) -> np.ndarray:
    """float32, 4 KiB: 4 chunks of 1 KiB."""
    return np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)


X, Y, K = _array(1), _array(2), _array(3)
WITH_X = {"w": X, "k": K}  # generation 1, and what the save under test saves again
WITH_Y = {"w": Y, "k": K}  # generation 2: X is garbage once generation 1 is dropped

Opener = Callable[[str, float], Store]


# -- nodes, pauses, stalls ------------------------------------------------------------


@pytest.fixture(params=["shared"])
def open_node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """``open_node(name, lease)``: a handle of one store, as node ``name`` sees it."""
    opened: list[Store] = []
    if request.param == "s3":
        if s3_server is None:
            pytest.skip("boto3 and moto are needed for the S3 cases")
        endpoint = request.getfixturevalue("s3_endpoint")
        arguments = s3_server.store_arguments(endpoint)
        where = f"s3://{request.getfixturevalue('s3_bucket')}/store"
        s3 = {"s3_options": {k: arguments[k] for k in ("access_key", "secret_key")}}
        s3.update(endpoint_url=arguments["endpoint_url"], region=arguments["region"])
    else:
        where, s3 = str(tmp_path / "store"), {"shared": True}

    def _open(name: str, lease: float) -> Store:
        store = castore.open(
            where,
            chunk_size=CHUNK_SIZE,
            store_lease=lease,
            cache_dir=tmp_path / "cache" / name,
            **s3,
        )
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.close()


class Pause:
    """Called from the code under test: says it got there, then waits to be let go."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()

    def __call__(self) -> None:
        self.reached.set()
        if not self.go.wait(60):
            raise TimeoutError("the test never let the paused step go")


def pause_after_dedup(store: Store, monkeypatch: pytest.MonkeyPatch) -> Pause:
    """Pause ``store``'s next save right after put_many decided which chunks it skips."""
    pause = Pause()
    put_many = store.backend.put_many

    def paused(namespace: Namespace, items: Any) -> Any:
        result = put_many(namespace, items)
        if Namespace(namespace) is Namespace.CHUNKS and not pause.reached.is_set():
            pause()
        return result

    monkeypatch.setattr(store.backend, "put_many", paused)
    return pause


def leases_of(store: Store) -> StoreLeases:
    leases = store.refs.parts.locks.store_leases
    assert isinstance(leases, StoreLeases)
    return leases


def freeze_renewals(store: Store, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Stop ``store``'s lease renewals (a frozen node) until the returned Event is set."""
    leases = leases_of(store)
    renew = leases.renew
    thaw = threading.Event()

    def frozen() -> None:
        thaw.wait(60)
        renew()

    monkeypatch.setattr(leases, "renew", frozen)
    return thaw


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - the test thread looks at it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def joined(thread: threading.Thread, outcome: dict[str, Any]) -> dict[str, Any]:
    thread.join(60)
    assert not thread.is_alive(), "the thread under test never finished"
    return outcome


def start_worker(*args: object) -> subprocess.Popen[str]:
    """``python gc_lease_workers.py ARGS...``: another node, in its own process."""
    return subprocess.Popen(
        [sys.executable, str(WORKERS), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def data_blobs(store: Store) -> set[str]:
    """Every blob of the store but the leases: packs, index blobs, objects, refs, records."""
    return {name for name in store.backend.blobs.list("") if not name.startswith("locks/")}


def chunks_of(store: Store, run: str, generation: int, tensor: str) -> list[bytes]:
    _, root = store.resolve_root(run, generation)
    (entry,) = store.tensor_entries(root)[tensor]
    return list(entry.chunks)


def present(store: Store, chunks: list[bytes]) -> list[bool]:
    return store.backend.has_many(Namespace.CHUNKS, chunks)


def two_generations(store: Store) -> list[bytes]:
    """Generations 1 (X, K) and 2 (Y, K): X's chunks are garbage once 1 is dropped."""
    assert store.save(WITH_X, run=RUN, step=1).id == 1
    assert store.save(WITH_Y, run=RUN, step=2).id == 2
    x_chunks = chunks_of(store, RUN, 1, "w")
    assert len(set(x_chunks)) == 4 and not set(x_chunks) & set(chunks_of(store, RUN, 2, "w"))
    return x_chunks


def keep_last_one(store: Store, *, lock_timeout: float) -> castore.gc.GcReport:
    return collect_garbage(store, RetentionPolicy(keep_last=1), lock_timeout=lock_timeout)


def assert_sound(store: Store) -> None:
    assert verify_store(store, deep=True).problems == []


# -- a save that reused X, and a collection ----------------------------------------------


@pytest.mark.parametrize("open_node", ["shared", "s3"], indirect=True)
def test_a_collection_waits_for_a_save_that_reused_a_chunk(
    open_node: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node A's save skipped X (present); node B's collection may not delete it."""
    a, b = open_node("a", LONG), open_node("b", LONG)
    x_chunks = two_generations(a)
    pause = pause_after_dedup(a, monkeypatch)
    saver, outcome = in_thread(lambda: a.save(WITH_X, run=RUN, step=3))
    try:
        assert pause.reached.wait(60), outcome
        before = data_blobs(b)
        started = time.monotonic()
        with pytest.raises(StoreLockedError, match="store busy"):
            keep_last_one(b, lock_timeout=0.5)
        assert time.monotonic() - started >= 0.5
        assert data_blobs(b) == before  # nothing deleted, nothing logged as collected
        assert [g.id for g in b.generations(RUN)] == [1, 2]
    finally:
        pause.go.set()
    generation = joined(saver, outcome)["value"]
    assert generation.id == 3 and generation.stats.reused_chunks == 8  # X and K, skipped

    # Let go, the collection runs after the save: X is named by generation 3, so kept.
    report = keep_last_one(b, lock_timeout=10)
    assert report.dropped == {RUN: [1, 2]}
    assert present(b, x_chunks) == [True] * 4
    assert_sound(b)
    assert_state_equal(b.load(RUN), WITH_X)


def test_control_without_leases_the_race_publishes_a_missing_chunk(
    open_node: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broken control: each node's store lock in-process only, the race goes through."""
    a, b = open_node("a", LONG), open_node("b", LONG)
    for node in (a, b):
        node.refs.parts.locks.store_leases = None
    x_chunks = two_generations(a)
    pause = pause_after_dedup(a, monkeypatch)
    saver, outcome = in_thread(lambda: a.save(WITH_X, run=RUN, step=3))
    try:
        assert pause.reached.wait(60), outcome
        report = keep_last_one(b, lock_timeout=0.5)  # nothing keeps it waiting
        assert report.dropped == {RUN: [1]}
        assert present(b, x_chunks) == [False] * 4
    finally:
        pause.go.set()
    assert joined(saver, outcome)["value"].id == 3  # published, naming X

    problems = verify_store(b, deep=False).problems
    assert {(p.run, p.generation) for p in problems} == {(RUN, 3)}
    assert len(problems) == 4 and all("is missing" in p.what for p in problems)


def test_a_save_waits_for_a_collection_then_rewrites_what_it_deleted(
    open_node: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node B collects (paused before its sweep); node A's save of X waits, then writes X."""
    a, b = open_node("a", LONG), open_node("b", LONG)
    x_chunks = two_generations(a)
    pause = Pause()
    delete_many = b.backend.delete_many

    def paused(namespace: Namespace, keys: Any) -> int:
        if not pause.reached.is_set():
            pause()
        return delete_many(namespace, keys)

    monkeypatch.setattr(b.backend, "delete_many", paused)
    collector, collected = in_thread(lambda: keep_last_one(b, lock_timeout=10))
    try:
        assert pause.reached.wait(60), collected
        before = data_blobs(a)
        saver, outcome = in_thread(lambda: a.save(WITH_X, run=RUN, step=3))
        time.sleep(0.5)
        assert saver.is_alive() and outcome == {}  # waiting for the collection
        assert data_blobs(a) == before  # and nothing written meanwhile
    finally:
        pause.go.set()
    assert joined(collector, collected)["value"].dropped == {RUN: [1]}
    generation = joined(saver, outcome)["value"]
    # X was deleted by the collection: the save wrote its 4 chunks again.
    assert generation.id == 3 and generation.stats.new_chunks == 4
    assert present(a, x_chunks) == [True] * 4
    assert_sound(a)
    assert_state_equal(a.load(RUN), WITH_X)


# -- stalls longer than the lease --------------------------------------------------------


@pytest.mark.parametrize("open_node", ["shared", "s3"], indirect=True)
def test_a_save_stalled_past_its_lease_is_broken_and_publishes_nothing(
    open_node: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node A stalls after skipping X; B breaks A's lease, collects X; A fails closed."""
    a, b = open_node("a", LEASE), open_node("b", LEASE)
    x_chunks = two_generations(a)
    pause = pause_after_dedup(a, monkeypatch)
    saver, outcome = in_thread(lambda: a.save(WITH_X, run=RUN, step=3))
    assert pause.reached.wait(60), outcome
    thaw = freeze_renewals(a, monkeypatch)  # from here on, A is frozen
    try:
        started = time.monotonic()
        report = keep_last_one(b, lock_timeout=30)
        assert time.monotonic() - started >= LEASE  # waited a whole lease for A first
        assert report.dropped == {RUN: [1]}
        assert present(b, x_chunks) == [False] * 4  # the chunks A skipped are gone
    finally:
        pause.go.set()
        joined(saver, outcome)
        thaw.set()
    error = outcome.get("error")
    assert isinstance(error, LockLostError), outcome
    assert "stopped before publishing or deleting anything" in str(error)
    assert b.refs.read(RUN).generation == 2  # nothing published
    assert [g.id for g in b.generations(RUN)] == [2]
    assert_sound(b)
    assert_state_equal(b.load(RUN), WITH_Y)
    # A again, not frozen: X is absent now, so its save writes it.
    generation = a.save(WITH_X, run=RUN, step=3)
    assert generation.id == 3 and generation.stats.new_chunks == 4
    assert_sound(b)


def test_a_collection_stalled_past_its_lease_is_broken_and_deletes_nothing(
    open_node: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's collection stalls after marking; A breaks its lease, saves X; B fails closed."""
    a, b = open_node("a", LEASE), open_node("b", LEASE)
    x_chunks = two_generations(a)
    pause = Pause()
    stored = castore.gc._stored

    def paused(store: Store, dry_run: bool) -> Any:
        found = stored(store, dry_run)
        pause()  # marked (X is garbage to it) and listed: next it logs and deletes
        return found

    monkeypatch.setattr(castore.gc, "_stored", paused)
    collector, collected = in_thread(lambda: keep_last_one(b, lock_timeout=10))
    assert pause.reached.wait(60), collected
    thaw = freeze_renewals(b, monkeypatch)
    try:
        a.refs.save_wait = 30
        started = time.monotonic()
        generation = a.save(WITH_X, run=RUN, step=3)
        assert time.monotonic() - started >= LEASE  # waited a whole lease for B first
        assert generation.id == 3 and generation.stats.reused_chunks == 8  # X, skipped
        before = data_blobs(a)
    finally:
        with pytest.warns(LeaseWarning, match="broken while held"):
            pause.go.set()
            outcome = joined(collector, collected)
        thaw.set()
    assert isinstance(outcome.get("error"), LockLostError), outcome
    assert data_blobs(a) == before  # nothing deleted, nothing logged as collected
    assert [g.id for g in a.generations(RUN)] == [1, 2, 3]
    assert present(a, x_chunks) == [True] * 4
    assert_sound(a)
    # A later collection sees generation 3 and keeps X.
    assert keep_last_one(b, lock_timeout=10).dropped == {RUN: [1, 2]}
    assert present(a, x_chunks) == [True] * 4
    assert_sound(a)
    assert_state_equal(a.load(RUN), WITH_X)


def test_a_collection_stalled_in_its_sweep_stops_before_the_next_batch(
    open_node: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B stalls after deleting objects, before chunks; A breaks it and reuses X; B stops.

    Generation 1's pack holds X and K; K stays live, so deleting X rewrites the
    pack's index blob without X (which hides X) before any old blob is deleted:
    the collection's own check before the batch is what stops it.
    """
    a, b = open_node("a", LEASE), open_node("b", LEASE)
    x_chunks = two_generations(a)
    pause = Pause()
    delete_many = b.backend.delete_many

    def paused(namespace: Namespace, keys: Any) -> int:
        deleted = delete_many(namespace, keys)
        if Namespace(namespace) is Namespace.OBJECTS:
            pause()  # generation 1's root and shard are gone; X not yet
        return deleted

    monkeypatch.setattr(b.backend, "delete_many", paused)
    collector, collected = in_thread(lambda: keep_last_one(b, lock_timeout=10))
    assert pause.reached.wait(60), collected
    thaw = freeze_renewals(b, monkeypatch)
    try:
        a.refs.save_wait = 30
        generation = a.save(WITH_X, run=RUN, step=3)
        assert generation.id == 3 and generation.stats.reused_chunks == 8
        before = data_blobs(a)
    finally:
        with pytest.warns(LeaseWarning, match="broken while held"):
            pause.go.set()
            outcome = joined(collector, collected)
        thaw.set()
    assert isinstance(outcome.get("error"), LockLostError), outcome
    assert present(a, x_chunks) == [True] * 4  # not hidden by a smaller index blob
    assert_sound(a)
    assert data_blobs(a) == before
    assert [g.id for g in a.generations(RUN)] == [2, 3]  # 1 was logged as collected
    assert_state_equal(a.load(RUN), WITH_X)


@pytest.mark.slow
def test_a_killed_collection_holds_the_store_for_one_lease_at_most(
    open_node: Opener, tmp_path: Path
) -> None:
    """A collection SIGKILLed in its sweep: a save waits one lease, then goes on."""
    a = open_node("a", LEASE)
    x_chunks = two_generations(a)
    collector = start_worker("collector", tmp_path / "store", tmp_path / "cache" / "b", LEASE)
    try:
        assert collector.stdout is not None
        line = collector.stdout.readline()
        assert line == "sweeping\n", (line, collector.stderr.read() if collector.stderr else "")
        patient = open_node("patient", LONG)  # breaks nothing within the test
        patient.refs.save_wait = 0.5
        with pytest.raises(StoreLockedError, match="garbage collection"):
            patient.save(WITH_X, run=RUN, step=3)
        os.kill(collector.pid, signal.SIGKILL)
        assert collector.wait(30) == -signal.SIGKILL
    finally:
        if collector.poll() is None:
            collector.kill()
            collector.wait()
    a.refs.save_wait = 30
    started = time.monotonic()
    generation = a.save(WITH_X, run=RUN, step=3)
    assert LEASE <= time.monotonic() - started < 30
    assert generation.id == 3
    assert present(a, x_chunks) == [True] * 4  # killed before it deleted any
    assert_sound(a)
    assert keep_last_one(a, lock_timeout=10).chunks_freed == 4  # Y: the sweep finished
    assert_sound(a)
    assert_state_equal(a.load(RUN), WITH_X)


# -- many rounds, three nodes ------------------------------------------------------------

GC_ROUNDS = 100


def wait_for_new_generations(
    store: Store, savers: list[subprocess.Popen[str]], since: dict[str, int]
) -> dict[str, int]:
    """Each run's newest generation, once every run of ``since`` has a newer one."""
    deadline = time.monotonic() + 60
    while True:
        now = {}
        for run in since:
            ref = store.refs.read(run)
            now[run] = ref.generation if ref is not None else 0
        if all(now[run] > since[run] for run in since):
            return now
        failed = [p.stderr.read() for p in savers if p.poll() is not None and p.stderr]
        assert not failed, failed[0][-2000:]
        assert time.monotonic() < deadline, f"no new generation in 60 s: {now}"
        time.sleep(0.002)


@pytest.fixture
def quick_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs where there is one, else ``tmp_path``.

    Each blob write of a shared directory fsyncs a file and a directory; on a
    busy disk that is most of the time of 100 rounds, and durability is not
    what they test (the ordering of the store's requests is).
    """
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK | os.X_OK)):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="castore-gc-leases-", dir=shm) as path:
        yield Path(path)


@pytest.mark.slow
def test_collections_concurrent_with_two_nodes_saving_never_lose_a_chunk(
    quick_dir: Path,
) -> None:
    """GC_ROUNDS collections (keep 1) while two other processes save; verify after each."""
    path, stop_file, round_file = quick_dir / "store", quick_dir / "stop", quick_dir / "round"
    collecting = round_file.with_name("round.collecting")
    store = gc_lease_workers.open_node(str(path), str(quick_dir / "cache" / "gc"), LONG)
    savers = [
        start_worker(
            "saver", path, quick_dir / "cache" / str(n), LONG, n, stop_file, 100_000, round_file
        )
        for n in (0, 1)
    ]
    runs = ["node0", "node1"]
    published = dict.fromkeys(runs, 0)
    rounds: list[tuple[int, bool]] = []  # chunks freed, both nodes still saving
    try:
        while len(rounds) < GC_ROUNDS:
            # A round starts once each node has published since the last. Both
            # nodes start a save as the collection starts and save on until it
            # ends (gc_lease_workers.RoundWatch): every collection overlaps saves
            # of both, and no save between collections lengthens the reflogs
            # that each collection and verify read whole.
            published = wait_for_new_generations(store, savers, published)
            next_round = quick_dir / "round.next"
            next_round.write_text(str(len(rounds)))
            os.replace(next_round, round_file)
            collecting.touch()
            report = keep_last_one(store, lock_timeout=60)
            collecting.unlink()
            problems = verify_store(store, deep=False).problems
            assert problems == [], (len(rounds), problems[:3])
            rounds.append((report.chunks_freed, all(p.poll() is None for p in savers)))
        stop_file.touch()
        outputs = [p.communicate(timeout=60) for p in savers]
    finally:
        stop_file.touch()
        for process in savers:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, (_, err) in zip(savers, outputs, strict=True):
        assert process.returncode == 0, err[-2000:]
    saved = [[line.split() for line in out.splitlines()] for out, _ in outputs]
    assert all(len(lines) >= GC_ROUNDS for lines in saved), [len(lines) for lines in saved]
    # The race was really run: collections freed chunks while both nodes saved, and
    # saves reused chunks that were present, or rewrote those a collection freed.
    assert sum(1 for freed, running in rounds if freed and running) >= GC_ROUNDS // 2
    new_chunks = [int(new) for lines in saved for *_, new in lines]  # of 5 (4 pool, 1 own)
    assert new_chunks.count(1) >= 1  # reused all its pool chunks
    assert sum(1 for n in new_chunks if n > 1) >= 1  # rewrote pool chunks a collection freed
    assert verify_store(store, deep=True).problems == []
    for node, lines in enumerate(saved):
        run, newest = lines[-1][1], int(lines[-1][2])
        assert store.resolve(run).id == newest
        assert_state_equal(store.load(run), gc_lease_workers.state(node, newest))
    store.close()


def test_a_collection_stalled_between_two_packs_hides_nothing_more(
    open_node: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two packs hold garbage next to live chunks; B stalls after rewriting the first one."""
    a, b = open_node("a", LEASE), open_node("b", LEASE)
    x2, k2 = _array(4), _array(5)
    a.save(WITH_X, run=RUN, step=1)  # pack 1: X, K
    a.save({**WITH_Y, "w2": x2, "k2": k2}, run=RUN, step=2)  # pack 2: Y, X2, K2
    a.save({**WITH_Y, "k2": k2}, run=RUN, step=3)  # no pack: X and X2 are garbage
    pause = Pause()
    delete = b.backend.blobs.delete

    def paused(name: str) -> bool:
        deleted = delete(name)
        if name.startswith("index/") and not pause.reached.is_set():
            pause()  # one pack's index blob rewritten without its garbage; the other's not yet
        return deleted

    monkeypatch.setattr(b.backend.blobs, "delete", paused)
    collector, collected = in_thread(lambda: keep_last_one(b, lock_timeout=10))
    assert pause.reached.wait(60), collected
    thaw = freeze_renewals(b, monkeypatch)
    both = {"w": X, "k": K, "w2": x2, "k2": k2}
    try:
        a.refs.save_wait = 30
        generation = a.save(both, run=RUN, step=4)  # writes the hidden one, reuses the other
        assert generation.id == 4
    finally:
        with pytest.warns(LeaseWarning, match="broken while held"):
            pause.go.set()
            outcome = joined(collector, collected)
        thaw.set()
    assert isinstance(outcome.get("error"), LockLostError), outcome
    assert verify_store(a, deep=False).problems == []  # generation 4 names no hidden chunk
    assert_state_equal(a.load(RUN), both)


def test_a_save_stalled_between_its_pack_and_its_index_leaves_no_dangling_index(
    open_node: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stalls with its pack written, unindexed; B breaks A, collects (orphan pack gone)."""
    a, b = open_node("a", LEASE), open_node("b", LEASE)
    two_generations(a)
    z = {"w": _array(9), "k": K}
    pause = Pause()
    create = a.backend.blobs.create

    def paused(name: str, data: Any) -> Any:
        created = create(name, data)
        if name.startswith("packs/"):
            pause()  # the pack is written; its index blob is next
        return created

    monkeypatch.setattr(a.backend.blobs, "create", paused)
    saver, outcome = in_thread(lambda: a.save(z, run=RUN, step=3))
    assert pause.reached.wait(60), outcome
    thaw = freeze_renewals(a, monkeypatch)
    try:
        report = keep_last_one(b, lock_timeout=30)
        assert report.dropped == {RUN: [1]}
    finally:
        pause.go.set()
        joined(saver, outcome)
        thaw.set()
    assert isinstance(outcome.get("error"), LockLostError), outcome
    # Another save of the same state must write the chunks of A's pack, not reuse
    # them (before the fix it found them in A's late index blob and named 4 chunks
    # of a pack that was gone).
    generation = b.save(z, run=RUN, step=3)
    assert generation.id == 3
    assert verify_store(b, deep=True).problems == []
    assert_state_equal(b.load(RUN), z)


def test_a_tag_stalled_past_its_lease_is_not_written(
    open_node: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resolves generation 1 to tag it, stalls; B breaks A, drops 1; A writes no tag."""
    a, b = open_node("a", LEASE), open_node("b", LEASE)
    two_generations(a)
    pause = Pause()
    resolve = a.resolve

    def paused(*args: Any, **kwargs: Any) -> Any:
        found = resolve(*args, **kwargs)
        pause()
        return found

    monkeypatch.setattr(a, "resolve", paused)
    tagger, outcome = in_thread(lambda: castore.gc.tag(a, RUN, 1, "keep"))
    assert pause.reached.wait(60), outcome
    thaw = freeze_renewals(a, monkeypatch)
    try:
        assert keep_last_one(b, lock_timeout=30).dropped == {RUN: [1]}
    finally:
        pause.go.set()
        joined(tagger, outcome)
        thaw.set()
    assert isinstance(outcome.get("error"), LockLostError), outcome
    assert b.refs.tags(RUN) == {}  # no tag naming a collected generation
    assert [g.id for g in b.generations(RUN)] == [2]
    assert_sound(b)
