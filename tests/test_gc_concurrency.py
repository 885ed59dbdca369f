"""Garbage collection against concurrent saves, SIGKILL mid-collection, and compaction.

Real processes, a real SIGKILL and a real LMDB store on disk. The hazard under
test: a save finds chunk X present and skips writing it; a collection that
does not yet see the save's generation deletes X; the save then publishes a
generation that names a missing chunk. ``locks/store.lock`` (shared by saves
from the first dedup check to the ref advance, exclusive for a collection)
must close that window; the control test opens it by hand to show the hazard
is real and that the checks used here detect it.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gc_workers
import numpy as np
import pytest
from _helpers import assert_state_equal
from cli_runner import CLI, clean_env, run_cli

import castore
import castore.core.commit
import castore.store
from castore import Store
from castore.chunkstore.base import Namespace
from castore.core.commit import (
    SINGLE_FAULTS,
    claim_writer,
    make_root,
    publish,
    root_stats,
    write_shard,
)
from castore.errors import ChunkMissingError, GenerationNotFoundError, StoreLockedError
from castore.format.tree import encode_state
from castore.gc import DELETE_BATCH, RetentionPolicy, collect_garbage
from castore.store import encode_metadata, framework_versions
from castore.verify import verify_store

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).parent / "helpers" / "gc_workers.py"


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=clean_env(**env), timeout=120)


def keys(store: Store, namespace: Namespace) -> set[bytes]:
    return set(store.backend.iter_keys(namespace))


def referenced(store: Store) -> tuple[set[bytes], set[bytes]]:
    """Objects (roots, shards) and chunks that every listed generation of every run names."""
    objects: set[bytes] = set()
    chunks: set[bytes] = set()
    for run in store.runs():
        for digest, root in store.iter_chain(run):
            objects.add(digest.raw)
            objects.update(root.shards)
            for shard in store.read_shards(root):
                for entry in shard.tensors + shard.local_tensors:
                    chunks.update(entry.chunks)
    return objects, chunks


def chunks_of(store: Store, run: str, generation: int, tensor: str) -> list[bytes]:
    _, root = store.resolve_root(run, generation)
    (entry,) = store.tensor_entries(root)[tensor]
    return list(entry.chunks)


def stop_process(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)


# -- 1. a collection loop while another process saves ------------------------------

MIN_SAVES = 80
MAX_SAVES = 400
MIN_GC_ROUNDS = 50


def test_gc_loop_while_another_process_saves(tmp_path: Path) -> None:
    """Randomized: MIN_GC_ROUNDS collections overlap MIN_SAVES+ saves of another process."""
    path = tmp_path / "store"
    records_file = tmp_path / "records.jsonl"
    stop_file = tmp_path / "stop"
    rng = np.random.default_rng(4242)
    run = gc_workers.RUN
    rounds: list[dict[str, Any]] = []
    with castore.open(path, chunk_size=gc_workers.CHUNK_SIZE) as store:
        saver = subprocess.Popen(
            [
                sys.executable,
                str(WORKERS),
                "saver",
                str(path),
                str(records_file),
                str(stop_file),
                str(MIN_SAVES),
                str(MAX_SAVES),
                "7",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        try:
            while saver.poll() is None:
                if len(rounds) >= MIN_GC_ROUNDS:
                    stop_file.touch()  # the saver stops once it has made MIN_SAVES too
                keep = int(rng.integers(1, 4))
                gc_report = collect_garbage(store, RetentionPolicy(keep_last=keep), lock_timeout=30)
                rounds.append(
                    {
                        "keep": keep,
                        "report": gc_report,
                        "overlapped": saver.poll() is None,
                    }
                )
                time.sleep(float(rng.uniform(0.0, 0.012)))
            _, stderr = saver.communicate(timeout=60)
        finally:
            stop_process(saver)
        assert saver.returncode == 0, f"a save failed while collections ran:\n{stderr}"

        records = [json.loads(line) for line in records_file.read_text().splitlines()]
        by_gen = {r["gen"]: r for r in records}
        saves = len(records)
        overlapped = sum(r["overlapped"] for r in rounds)
        assert saves >= MIN_SAVES
        assert [r["gen"] for r in records] == list(range(1, saves + 1))
        assert overlapped >= MIN_GC_ROUNDS
        assert saves + len(rounds) >= 100

        # Each collection kept exactly the newest keep_last generations it listed.
        dropped_total = freed_total = 0
        for item in rounds:
            for plan in item["report"].plans:
                ids = [g.id for g in plan.generations]
                assert plan.kept == ids[-item["keep"] :]
                dropped_total += len(plan.dropped)
            freed_total += item["report"].chunks_freed
        assert dropped_total >= saves // 2 and freed_total > 0

        # The hazard was really exercised. A save that reused (skipped) more pool
        # arrays than it shares with the generation just before it deduplicated
        # against chunks only older generations referenced: ones any collection
        # with keep_last=1 drops. A save that wrote more pool arrays than it uses
        # for the first time rewrote chunks a collection had already deleted.
        per_array = gc_workers.POOL_CHUNKS
        dedup_on_droppable = rewrote_collected = 0
        seen: set[int] = set()
        for r in records:
            pool_new, rest = divmod(r["new_chunks"] - gc_workers.FRESH_CHUNKS, per_array)
            assert rest == 0 and 0 <= pool_new <= gc_workers.SLOTS, r
            pool_reused = gc_workers.SLOTS - pool_new
            previous = set(by_gen[r["gen"] - 1]["pool"]) if r["gen"] > 1 else set()
            if pool_reused > len(set(r["pool"]) & previous):
                dedup_on_droppable += 1
            if pool_new > len(set(r["pool"]) - seen):
                rewrote_collected += 1
            seen.update(r["pool"])
        assert dedup_on_droppable >= 3, (dedup_on_droppable, saves)
        assert rewrote_collected >= 3, (rewrote_collected, saves)

        # Nothing retained lost a byte: every listed generation is whole and right.
        assert verify_store(store, deep=True).problems == []
        listed = store.generations(run)
        assert listed[-1].id == saves
        assert {g.id for g in listed} <= set(by_gen)
        for gen in listed:
            r = by_gen[gen.id]
            expected = gc_workers.build_state(r["pool"], r["fresh"], r["step"])
            assert_state_equal(store.load(run, gen.id), expected)

        # One more collection with no saver left: exactly the referenced chunks remain.
        # (An earlier keep_last=1 round may already have dropped generation saves - 1.)
        collect_garbage(store, RetentionPolicy(keep_last=1), lock_timeout=5)
        assert [g.id for g in store.generations(run)] == [saves]
        objects, chunks = referenced(store)
        assert keys(store, Namespace.CHUNKS) == chunks
        assert keys(store, Namespace.OBJECTS) == objects
        assert verify_store(store, deep=True).problems == []
        r = by_gen[saves]
        expected = gc_workers.build_state(r["pool"], r["fresh"], r["step"])
        assert_state_equal(store.load(run), expected)
    print(
        f"\n{saves} saves, {len(rounds)} collections ({overlapped} overlapping), "
        f"{dedup_on_droppable} saves deduplicated against droppable-only chunks, "
        f"{rewrote_collected} rewrote collected chunks"
    )


# -- 2. the race the store lock closes, deterministically ---------------------------

RUN = "run"


def _array(seed: int, elements: int = 1024) -> np.ndarray:
    """float32, 4 KiB by default: 4 chunks of the conftest store's 1 KiB."""
    return np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)


X = _array(1)
Y = _array(2)


@pytest.fixture
def x_only_in_droppable(store: Store) -> list[bytes]:
    """Generation 1 holds X, generation 2 (the newest) does not: X's chunks are droppable."""
    assert store.save({"w": X}, run=RUN, step=1).id == 1
    assert store.save({"w": Y}, run=RUN, step=2).id == 2
    x_chunks = chunks_of(store, RUN, 1, "w")
    assert len(set(x_chunks)) == 4
    assert not set(x_chunks) & set(chunks_of(store, RUN, 2, "w"))
    return x_chunks


def test_control_lock_free_save_publishes_a_missing_chunk(
    store: Store, x_only_in_droppable: list[bytes]
) -> None:
    """By hand, what a save without the store lock would do: the hazard is real."""
    x_chunks = x_only_in_droppable
    encoded = encode_state({"w": X})
    parent = store.refs.read(RUN)
    assert parent is not None and parent.generation == 2
    # The dedup check: X is present, so none of its chunks is written.
    shard = write_shard(store, encoded, run=RUN, generation=3, rank=0)
    assert (shard.stats.new_chunks, shard.stats.reused_chunks) == (0, 4)
    assert shard.manifest.tensors[0].chunks == tuple(x_chunks)

    # A collection sees generations 1 and 2 only: it drops 1 and deletes X.
    report = collect_garbage(store, RetentionPolicy(keep_last=1), lock_timeout=1)
    assert report.dropped == {RUN: [1]}
    assert store.backend.has_many(Namespace.CHUNKS, x_chunks) == [False] * 4

    # The save goes on and publishes (as Store._save_locked does).
    root = make_root(
        run=RUN,
        generation=3,
        step=3,
        parent=parent,
        world_size=1,
        shards=[shard.digest],
        state=encoded.skeleton,
        metadata=encode_metadata(None),
        stats=root_stats(shard.stats, 0.0, 1, written_bytes=shard.stats.new_bytes),
        frameworks=framework_versions(),
        writer=claim_writer(store, RUN, parent, 3),
    )
    publish(
        store,
        parent=parent,
        root=root,
        faults=SINGLE_FAULTS,
        extra_objects=((shard.digest, shard.data),),
    )
    assert store.resolve(RUN).id == 3

    problems = verify_store(store, deep=True).problems
    assert len(problems) == 4
    assert {(p.run, p.generation) for p in problems} == {(RUN, 3)}
    for problem, chunk in zip(problems, x_chunks, strict=True):
        assert "is missing" in problem.what and chunk.hex()[:16] in problem.what
    with pytest.raises(ChunkMissingError):
        store.load(RUN)


@pytest.mark.parametrize("pause_at", ["after write_shard", "before publish"])
def test_gc_is_refused_while_a_save_is_between_dedup_and_publish(
    store: Store,
    x_only_in_droppable: list[bytes],
    monkeypatch: pytest.MonkeyPatch,
    pause_at: str,
) -> None:
    """The same interleaving through Store.save: the collection must wait, then fail.

    The save is paused right after its dedup check (write_shard skipped X) or
    right before its publish: the whole window the store lock must cover.
    """
    x_chunks = x_only_in_droppable
    y_chunks = chunks_of(store, RUN, 2, "w")
    paused, release = threading.Event(), threading.Event()

    def pause() -> None:
        paused.set()
        if not release.wait(30):
            raise TimeoutError("the test never released the save")

    if pause_at == "after write_shard":
        original_write_shard = castore.store.write_shard

        def paused_write_shard(*args: Any, **kwargs: Any) -> Any:
            shard = original_write_shard(*args, **kwargs)
            pause()
            return shard

        monkeypatch.setattr(castore.store, "write_shard", paused_write_shard)
    else:
        original_publish = castore.core.commit.publish  # publish_single calls it by this name

        def paused_publish(*args: Any, **kwargs: Any) -> Any:
            pause()
            return original_publish(*args, **kwargs)

        monkeypatch.setattr(castore.core.commit, "publish", paused_publish)
    outcome: dict[str, Any] = {}

    def save() -> None:
        try:
            outcome["gen"] = store.save({"w": X}, run=RUN, step=3)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            outcome["error"] = exc

    saver = threading.Thread(target=save)
    saver.start()
    try:
        assert paused.wait(30), outcome
        before = (
            keys(store, Namespace.CHUNKS),
            keys(store, Namespace.OBJECTS),
            store.refs.reflog(RUN),
        )
        assert set(x_chunks) <= before[0]  # the save skipped X: it is there
        started = time.monotonic()
        with pytest.raises(StoreLockedError, match="store busy"):
            collect_garbage(store, RetentionPolicy(keep_last=1), lock_timeout=0.5)
        assert time.monotonic() - started >= 0.5
        after = (
            keys(store, Namespace.CHUNKS),
            keys(store, Namespace.OBJECTS),
            store.refs.reflog(RUN),
        )
        assert after == before  # nothing deleted, nothing logged as collected
        assert [g.id for g in store.generations(RUN)] == [1, 2]
    finally:
        release.set()
        saver.join(30)
    assert not saver.is_alive()
    assert "error" not in outcome, outcome
    gen = outcome["gen"]
    assert gen.id == 3 and (gen.stats.new_chunks, gen.stats.reused_chunks) == (0, 4)

    report = collect_garbage(store, RetentionPolicy(keep_last=1), lock_timeout=5)
    assert report.dropped == {RUN: [1, 2]}
    assert store.backend.has_many(Namespace.CHUNKS, x_chunks) == [True] * 4
    assert store.backend.has_many(Namespace.CHUNKS, y_chunks) == [False] * 4
    assert verify_store(store, deep=True).problems == []
    assert_state_equal(store.load(RUN, 3), {"w": X})


def test_a_save_waits_for_a_running_gc(store: Store, x_only_in_droppable: list[bytes]) -> None:
    z = _array(3)
    before_ref = store.refs.read(RUN)
    before_chunks = keys(store, Namespace.CHUNKS)
    outcome: dict[str, Any] = {}

    def save() -> None:
        try:
            outcome["gen"] = store.save({"w": z}, run=RUN, step=3)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            outcome["error"] = exc

    with store.refs.store_lock(exclusive=True, timeout=1, busy="test: lock taken"):
        store.refs.save_wait = 0.5
        started = time.monotonic()
        with pytest.raises(StoreLockedError, match="garbage collection"):
            store.save({"w": z}, run=RUN, step=3)
        assert time.monotonic() - started >= 0.5
        assert store.refs.read(RUN) == before_ref
        assert keys(store, Namespace.CHUNKS) == before_chunks  # no chunk written either

        store.refs.save_wait = 30
        saver = threading.Thread(target=save)
        saver.start()
        time.sleep(0.3)
        assert saver.is_alive() and outcome == {}  # waiting for the lock
        assert store.refs.read(RUN) == before_ref
    saver.join(30)
    assert not saver.is_alive()
    assert "error" not in outcome, outcome
    assert outcome["gen"].id == 3
    assert_state_equal(store.load(RUN), {"w": z})
    assert verify_store(store, deep=True).problems == []


# -- 3. a collection SIGKILLed before and in the middle of its sweep ------------------

MAIN, SIDE = "main", "side"
KILL_CHUNK_SIZE = 64
MAIN_GENERATIONS = 12


def main_state(gen: int) -> dict[str, Any]:
    return {
        "w": _array(100 + gen, 2048),  # 8 KiB: 128 chunks of 64 B, new every generation
        "shared": _array(99, 256),  # 1 KiB: 16 chunks, in every generation of both runs
        "step": gen,
    }


def side_state(gen: int) -> dict[str, Any]:
    # Side generation 1 shares main generation 3's "w" (which main drops),
    # side generation 2 shares main generation 12's (which main keeps).
    shared_with = {1: 3, 2: 12}[gen]
    return {"w": main_state(shared_with)["w"], "shared": _array(99, 256), "own": _array(7 + gen)}


EXPECTED = {(MAIN, g): main_state(g) for g in range(1, MAIN_GENERATIONS + 1)}
EXPECTED.update({(SIDE, g): side_state(g) for g in (1, 2)})
KEPT = [(MAIN, 11), (MAIN, 12), (SIDE, 1), (SIDE, 2)]


@pytest.fixture(scope="module")
def kill_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gc-kill") / "store"
    with castore.open(path, chunk_size=KILL_CHUNK_SIZE) as store:
        for gen in range(1, MAIN_GENERATIONS + 1):
            assert store.save(main_state(gen), run=MAIN, step=gen).id == gen
        for gen in (1, 2):
            assert store.save(side_state(gen), run=SIDE, step=gen).id == gen
    return path


def snapshot(path: Path) -> dict[str, Any]:
    with castore.open(path) as store:
        objects, chunks = referenced(store)
        return {
            "chunks": keys(store, Namespace.CHUNKS),
            "objects": keys(store, Namespace.OBJECTS),
            "referenced_objects": objects,
            "referenced_chunks": chunks,
            "listed": {run: [g.id for g in store.generations(run)] for run in store.runs()},
            "dropped_roots": {
                bytes.fromhex(g.root)
                for g in store.generations(MAIN)
                if g.id <= MAIN_GENERATIONS - 2
            },
            "collect_records": [r for r in store.refs.reflog(MAIN) if r.get("action") == "collect"],
        }


def gc_command(path: Path, how: str) -> list[str]:
    """``castore gc --keep 2``, run as the CLI or through ``castore.cli.main`` with a tweak."""
    args = ["gc", str(path), "--keep", "2"]
    if how == "cli":
        return [str(CLI), *args]
    if how == "batch8":
        # A smaller delete batch, so the kill at gc.mid_sweep lands among the dropped roots.
        tweak = "castore.gc.DELETE_BATCH = 8"
    else:
        raise ValueError(how)
    code = f"import os, signal, sys, castore.gc, castore.cli\n{tweak}\n"
    code += "sys.exit(castore.cli.main(sys.argv[1:]))\n"
    return [sys.executable, "-c", code, *args]


def assert_retained_intact(path: Path) -> None:
    result = cli("verify", str(path), "--deep")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "OK"
    with castore.open(path) as store:
        assert [g.id for g in store.generations(MAIN)] == [11, 12]
        assert [g.id for g in store.generations(SIDE)] == [1, 2]
        for run, gen in KEPT:
            assert_state_equal(store.load(run, gen), EXPECTED[(run, gen)])
        for gen in range(1, MAIN_GENERATIONS - 1):
            with pytest.raises(GenerationNotFoundError):
                store.resolve(MAIN, gen)


@pytest.mark.parametrize(
    "point, how",
    [
        ("gc.before_sweep", "cli"),
        ("gc.mid_sweep", "cli"),
        ("gc.mid_sweep", "batch8"),
        ("gc.mid_chunks", "cli"),
    ],
    ids=["before_sweep", "mid_sweep", "mid_sweep-batch8", "mid_chunks"],
)
def test_gc_sigkilled_during_collection_keeps_retained_generations(
    kill_template: Path, tmp_path: Path, point: str, how: str
) -> None:
    path = tmp_path / "store"
    shutil.copytree(kill_template, path)
    before = snapshot(path)
    garbage_chunks = before["chunks"] - _retained_chunks(path)
    garbage_objects = before["objects"] - _retained_objects(path)
    # More than one delete batch of chunks: 9 dropped "w" arrays of 128 chunks
    # (main generation 3's is still used by the side run).
    assert len(garbage_chunks) == 9 * 128 > DELETE_BATCH
    assert len(garbage_objects) == 2 * 10
    assert len(before["dropped_roots"]) == 10 and before["dropped_roots"] <= garbage_objects

    killed = subprocess.run(
        gc_command(path, how),
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(CASTORE_FAULTS=f"{point}=kill"),
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr

    after = snapshot(path)
    # The collect records were written first: the dropped ten are gone from listings.
    assert sorted(r["generation"] for r in after["collect_records"]) == list(range(1, 11))
    assert after["listed"] == {MAIN: [11, 12], SIDE: [1, 2]}
    # Exactly what the sweep order (roots, shards, then chunks) had deleted at the kill.
    deleted_objects = before["objects"] - after["objects"]
    deleted_chunks = before["chunks"] - after["chunks"]
    if point == "gc.before_sweep":
        assert deleted_objects == deleted_chunks == set()
    elif point == "gc.mid_sweep" and how == "cli":  # the first batch: every object, no chunk
        assert deleted_objects == garbage_objects and deleted_chunks == set()
    elif how == "batch8":  # the first 8 dropped roots
        assert len(deleted_objects) == 8 and deleted_objects <= before["dropped_roots"]
        assert deleted_chunks == set()
    else:  # every garbage object and the first batch of garbage chunks
        assert deleted_objects == garbage_objects
        assert len(deleted_chunks) == DELETE_BATCH and deleted_chunks <= garbage_chunks
    assert_retained_intact(path)

    # A second collection finishes the sweep: only what retained generations name is left.
    finished = cli("gc", str(path), "--keep", "2")
    assert finished.returncode == 0, finished.stdout + finished.stderr
    left_chunks = len(after["chunks"] - after["referenced_chunks"])
    left_objects = len(after["objects"] - after["referenced_objects"])
    assert "0 generation(s) dropped; freed" in finished.stdout
    assert f"({left_chunks} chunk(s), {left_objects} object(s))" in finished.stdout
    final = snapshot(path)
    assert final["chunks"] == final["referenced_chunks"] == after["referenced_chunks"]
    assert final["objects"] == final["referenced_objects"] == after["referenced_objects"]
    assert final["chunks"] == before["chunks"] - garbage_chunks
    assert_retained_intact(path)


def _retained_chunks(path: Path) -> set[bytes]:
    with castore.open(path) as store:
        chunks: set[bytes] = set()
        for run, gen in KEPT:
            _, root = store.resolve_root(run, gen)
            for shard in store.read_shards(root):
                for entry in shard.tensors:
                    chunks.update(entry.chunks)
        return chunks


def _retained_objects(path: Path) -> set[bytes]:
    with castore.open(path) as store:
        objects: set[bytes] = set()
        for run, gen in KEPT:
            digest, root = store.resolve_root(run, gen)
            objects.add(digest.raw)
            objects.update(root.shards)
        return objects


# -- 4. compaction refuses while another process has the store open ------------------


def test_compact_refuses_while_another_process_holds_the_store_open(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with castore.open(path, chunk_size=1024) as store:
        for gen in range(1, 6):
            store.save({"w": _array(200 + gen, 8192), "step": gen}, run=RUN, step=gen)
        collect_garbage(store, RetentionPolicy(keep_last=2), lock_timeout=5)  # free pages
    data_file = path / "chunks" / "data.mdb"

    holder = subprocess.Popen(
        [sys.executable, str(WORKERS), "holder", str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "open"
        data_before = data_file.read_bytes()
        refused = cli("compact", str(path))
        assert refused.returncode != 0
        assert refused.stdout == ""
        lines = refused.stderr.splitlines()
        assert len(lines) == 1, refused.stderr
        assert re.fullmatch(r"castore: error: StoreLockedError: .*\bopen\b.*", lines[0]), lines
        assert data_file.read_bytes() == data_before
        assert not list((path / "chunks").glob(".compact-*"))
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
        assert holder.stdout.read().strip() == "closed"
    finally:
        stop_process(holder)
        for stream in (holder.stdin, holder.stdout, holder.stderr):
            if stream is not None and not stream.closed:
                stream.close()

    size_before = data_file.stat().st_size
    done = cli("compact", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"compacted {path}: ")
    assert data_file.stat().st_size < size_before  # the pages of 3 dropped generations
    assert not list((path / "chunks").glob(".compact-*"))
    verified = cli("verify", str(path), "--deep")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.splitlines()[-1] == "OK"
    with castore.open(path) as store:
        assert [g.id for g in store.generations(RUN)] == [4, 5]
        for gen in (4, 5):
            assert_state_equal(store.load(RUN, gen), {"w": _array(200 + gen, 8192), "step": gen})
