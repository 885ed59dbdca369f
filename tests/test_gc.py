"""Retention, garbage collection, tags, disk usage and compaction, on real LMDB stores.

What a collection must keep is worked out here, independently of castore:
expected chunk keys are the blake3 digests of each saved array's 1 KiB pieces
(or the union of the chunk lists of the retained generations' shard manifests),
and every retained generation is loaded back and compared bitwise with what the
test saved.
"""

from __future__ import annotations

import hashlib
import math
import re
import shutil
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_runner import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import castore
import castore.core.commit as castore_commit
from castore import Store, gc
from castore.chunkstore.base import Namespace
from castore.chunkstore.lmdb.backend import LmdbBackend
from castore.errors import (
    GenerationNotFoundError,
    InvalidNameError,
    StoreLockedError,
)
from castore.format.hashing import Digest, digest_bytes
from castore.verify import verify_store

CHUNK = 1024
FLOATS = CHUNK // 4  # float32 values per chunk

BACKBONE_CHUNKS = 90  # fine-tuning state: a frozen backbone, 90% of the bytes ...
HEAD_CHUNKS = 10  # ... and a head (10%) rewritten by every save
STATE_BYTES = (BACKBONE_CHUNKS + HEAD_CHUNKS) * CHUNK
HEAD_BYTES = HEAD_CHUNKS * CHUNK


# -- helpers ------------------------------------------------------------------------


def rand(seed: int, chunks: int) -> np.ndarray:
    """``chunks`` KiB of float32 noise: every 1 KiB piece distinct."""
    return np.random.default_rng(seed).standard_normal(chunks * FLOATS, dtype=np.float32)


BACKBONE = rand(1, BACKBONE_CHUNKS)


def finetune_state(head_seed: int, backbone: np.ndarray = BACKBONE) -> dict[str, Any]:
    return {"backbone": backbone, "head": rand(head_seed, HEAD_CHUNKS), "seed": head_seed}


def small_state(seed: int) -> dict[str, Any]:
    """Two tensors: one shared by every small state (``shared``), one its own (``own``)."""
    return {"shared": rand(7, 2), "own": rand(100 + seed, 1), "n": seed}


def open_new(path: Path) -> Store:
    return castore.open(path, chunk_size=CHUNK)


def assert_bitwise_equal(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected)
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_bitwise_equal(actual[key], expected[key])
    elif isinstance(expected, np.ndarray):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
        assert actual.tobytes() == expected.tobytes()
    else:
        assert actual == expected


def arrays(state: Any) -> Iterator[np.ndarray]:
    if isinstance(state, np.ndarray):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from arrays(value)


def piece_digests(state: Any) -> set[bytes]:
    """Digests of the chunk-size pieces of every array (how castore names chunks)."""
    found: set[bytes] = set()
    for array in arrays(state):
        data = np.ascontiguousarray(array).tobytes()
        found.update(digest_bytes(data[at : at + CHUNK]) for at in range(0, len(data), CHUNK))
    return found


def raw_put(store: Store, namespace: Namespace, key: bytes, value: bytes) -> None:
    """Overwrite a stored value (damage), through the LMDB backend's test hook."""
    assert isinstance(store.backend, LmdbBackend)
    store.backend.raw_put(namespace, key, value)


def chunk_keys(store: Store) -> set[bytes]:
    return set(store.backend.iter_keys(Namespace.CHUNKS))


def object_keys(store: Store) -> set[bytes]:
    return set(store.backend.iter_keys(Namespace.OBJECTS))


def chunk_bytes(store: Store) -> int:
    return sum(size for _key, size in store.backend.value_sizes(Namespace.CHUNKS))


def all_sizes(store: Store) -> dict[tuple[str, bytes], int]:
    return {
        (ns.value, key): size for ns in Namespace for key, size in store.backend.value_sizes(ns)
    }


def referenced(store: Store) -> tuple[set[bytes], set[bytes]]:
    """(objects, chunks) the listed generations of every run reference, from their manifests."""
    objects: set[bytes] = set()
    chunks: set[bytes] = set()
    for run in store.runs():
        for gen in store.generations(run):
            digest, root = store.resolve_root(run, gen.id)
            objects.add(digest.raw)
            objects.update(root.shards)
            for shard in store.read_shards(root):
                for entry in shard.tensors + shard.local_tensors:
                    chunks.update(entry.chunks)
    return objects, chunks


def ids(store: Store, run: str) -> list[int]:
    return [g.id for g in store.generations(run)]


def reasons_of(plans: list[gc.RunPlan], run: str) -> dict[int, list[str]]:
    return next(p.reasons for p in plans if p.run == run)


def save_steps(store: Store, run: str, steps: list[int]) -> list[castore.Generation]:
    return [store.save(small_state(i), run=run, step=step) for i, step in enumerate(steps)]


# -- 1. retention rules ----------------------------------------------------------------


def test_keep_last_keeps_the_newest_k(store: Store) -> None:
    save_steps(store, "a", [10, 20, 30, 40, 50])
    plans = gc.plan_retention(store, gc.RetentionPolicy(keep_last=3))
    assert [p.run for p in plans] == ["a"]
    assert reasons_of(plans, "a") == {1: [], 2: [], 3: ["last 3"], 4: ["last 3"], 5: ["last 3"]}
    assert (plans[0].kept, plans[0].dropped) == ([3, 4, 5], [1, 2])
    default = gc.RetentionPolicy()
    assert (default.keep_last, default.every_steps, default.every_seconds) == (3, None, None)
    one = gc.plan_retention(store, gc.RetentionPolicy(keep_last=1))[0]
    assert one.kept == [5] and one.reasons[5] == ["last 1"]
    many = gc.plan_retention(store, gc.RetentionPolicy(keep_last=50))[0]
    assert many.kept == [1, 2, 3, 4, 5] and many.dropped == []


def test_tags_keep_generations(store: Store) -> None:
    save_steps(store, "a", [1, 2, 3, 4, 5])
    gc.tag(store, "a", 2, "best")
    gc.tag(store, "a", 2, "alpha")
    gc.tag(store, "a", 5, "final")
    plan = gc.plan_retention(store, gc.RetentionPolicy(keep_last=1))[0]
    assert plan.tags == {"alpha": 2, "best": 2, "final": 5}
    assert plan.reasons == {
        1: [],
        2: ["tag alpha", "tag best"],  # tags in name order
        3: [],
        4: [],
        5: ["last 1", "tag final"],
    }


def test_every_steps_keeps_the_first_generation_of_each_bucket(store: Store) -> None:
    # steps:      0   50  100  100  150  230  299  300
    # bucket/100: 0   0   1    1    1    2    2    3
    save_steps(store, "a", [0, 50, 100, 100, 150, 230, 299, 300])
    plan = gc.plan_retention(store, gc.RetentionPolicy(keep_last=1, every_steps=100))[0]
    assert plan.reasons == {
        1: ["every 100 steps (from 0)"],
        2: [],
        3: ["every 100 steps (from 100)"],  # the first of two at step 100: the lower id
        4: [],
        5: [],
        6: ["every 100 steps (from 200)"],
        7: [],
        8: ["last 1", "every 100 steps (from 300)"],
    }


def test_every_seconds_keeps_the_newest_of_each_interval(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Save times come from the clock castore.core.commit reads; give it known values.
    times = iter([100.0, 200.0, 200.0, 3700.0, 3800.0, 7300.0])
    monkeypatch.setattr(castore_commit, "time", types.SimpleNamespace(time=lambda: next(times)))
    save_steps(store, "a", [1, 2, 3, 4, 5, 6])
    monkeypatch.undo()
    assert [g.time for g in store.generations("a")] == [100.0, 200.0, 200.0, 3700.0, 3800.0, 7300.0]
    plan = gc.plan_retention(store, gc.RetentionPolicy(keep_last=1, every_seconds=3600))[0]
    assert plan.reasons == {
        1: [],
        2: [],
        3: ["newest of its 1h"],  # two saves at 200.0: the newer id wins
        4: [],
        5: ["newest of its 1h"],
        6: ["last 1", "newest of its 1h"],
    }


def test_every_seconds_on_the_real_clock(store: Store) -> None:
    save_steps(store, "a", [1, 2, 3, 4])
    gens = store.generations("a")
    for seconds, label in ((86400.0, "1d"), (1209600.0, "2w"), (90.0, "90s"), (1800.0, "30m")):
        newest: dict[int, int] = {}
        for g in gens:  # oldest first: the last one seen in a bucket is the newest
            newest[math.floor(g.time / seconds)] = g.id
        plan = gc.plan_retention(store, gc.RetentionPolicy(keep_last=1, every_seconds=seconds))[0]
        expected = {g.id: ["last 1"] if g.id == 4 else [] for g in gens}
        for gen_id in newest.values():
            expected[gen_id].append(f"newest of its {label}")
        assert plan.reasons == expected


def test_rules_compose_and_list_every_reason(store: Store) -> None:
    save_steps(store, "a", [0, 50, 100, 150, 200, 250])
    gc.tag(store, "a", 5, "best")
    gc.tag(store, "a", 1, "first")
    day = 86400.0
    policy = gc.RetentionPolicy(keep_last=2, every_steps=100, every_seconds=day)
    expected = {
        1: ["tag first", "every 100 steps (from 0)"],
        2: [],
        3: ["every 100 steps (from 100)"],
        4: [],
        5: ["last 2", "tag best", "every 100 steps (from 200)"],
        6: ["last 2"],
    }
    newest: dict[int, int] = {}
    for g in store.generations("a"):  # one bucket, unless a UTC midnight fell in this test
        newest[math.floor(g.time / day)] = g.id
    for gen_id in newest.values():
        expected[gen_id].append("newest of its 1d")
    assert expected[6] == ["last 2", "newest of its 1d"]
    plan = gc.plan_retention(store, policy)[0]
    assert plan.reasons == expected
    report = gc.collect_garbage(store, policy)
    assert [(p.run, p.reasons) for p in report.plans] == [("a", expected)]
    assert report.dropped == {"a": [i for i in (2, 4) if not expected[i]]}
    assert ids(store, "a") == [i for i in range(1, 7) if expected[i]]


def test_runs_selects_where_the_policy_applies(store: Store) -> None:
    save_steps(store, "a", [1, 2, 3])
    save_steps(store, "b", [1, 2, 3])
    save_steps(store, "c", [1, 2])
    plans = gc.plan_retention(store, gc.RetentionPolicy(keep_last=1), runs=["b"])
    assert [p.run for p in plans] == ["a", "b", "c"]
    assert reasons_of(plans, "a") == {i: ["run not selected"] for i in (1, 2, 3)}
    assert reasons_of(plans, "b") == {1: [], 2: [], 3: ["last 1"]}
    assert reasons_of(plans, "c") == {i: ["run not selected"] for i in (1, 2)}
    report = gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1), runs=["b"])
    assert report.dropped == {"b": [1, 2]}
    assert (ids(store, "a"), ids(store, "b"), ids(store, "c")) == ([1, 2, 3], [3], [1, 2])
    with pytest.raises(GenerationNotFoundError, match="nobody"):
        gc.plan_retention(store, gc.RetentionPolicy(), runs=["nobody"])
    with pytest.raises(InvalidNameError):
        gc.collect_garbage(store, gc.RetentionPolicy(), runs=["../a"])
    assert (ids(store, "a"), ids(store, "b"), ids(store, "c")) == ([1, 2, 3], [3], [1, 2])


@pytest.mark.parametrize(
    "options, words",
    [
        ({"keep_last": 0}, "keep_last must be at least 1"),
        ({"keep_last": -2}, "keep_last must be at least 1"),
        ({"keep_last": 2.0}, "keep_last"),
        ({"every_steps": 0}, "every_steps must be positive"),
        ({"every_steps": -100}, "every_steps must be positive"),
        ({"every_seconds": 0.0}, "every_seconds must be positive"),
        ({"every_seconds": -60.0}, "every_seconds must be positive"),
    ],
)
def test_bad_policies_raise_value_error(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        gc.RetentionPolicy(**options)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90s", 90.0),
        ("30m", 1800.0),
        ("6h", 21600.0),
        ("1d", 86400.0),
        ("2w", 1209600.0),
        ("90", 90.0),
        (" 2H ", 7200.0),
        ("1.5h", 5400.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert gc.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "5x", "m", "1d2h", "-1h", "0s", "0", "nan"])
def test_parse_duration_rejects_bad_input(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        gc.parse_duration(text)


# -- 2. after a real collection ------------------------------------------------------


def test_collect_drops_exactly_the_unretained_and_keeps_the_rest_intact(store: Store) -> None:
    # Six generations of a fine-tuning run; heads 3 and 4 are equal (chunks shared).
    heads = [10, 11, 12, 12, 13, 14]
    saved = {
        i: store.save(finetune_state(seed), run="a", step=100 * i).id
        for i, seed in enumerate(heads, 1)
    }
    assert list(saved.values()) == [1, 2, 3, 4, 5, 6]
    states = {i: finetune_state(seed) for i, seed in enumerate(heads, 1)}
    roots = {g.id: g.root for g in store.generations("a")}
    gc.tag(store, "a", 2, "best")  # older than the gap it will sit behind

    before = all_sizes(store)
    report = gc.collect_garbage(store, gc.RetentionPolicy(keep_last=2))
    assert not report.dry_run
    assert report.dropped == {"a": [1, 3, 4]}
    assert report.plans[0].kept == [2, 5, 6]

    assert ids(store, "a") == [2, 5, 6]
    for gone in (1, 3, 4):
        with pytest.raises(GenerationNotFoundError):
            store.resolve("a", gone)
        with pytest.raises(GenerationNotFoundError):
            store.resolve("a", roots[gone][:12])  # nor by root prefix
        with pytest.raises(GenerationNotFoundError):
            store.load("a", gone)
    for kept in (2, 5, 6):
        assert store.resolve("a", kept).root == roots[kept]
        assert_bitwise_equal(store.load("a", kept), states[kept])
    assert_bitwise_equal(store.load("a"), states[6])

    check = verify_store(store, deep=True)
    assert check.ok, check.problems
    assert (check.generations, check.objects) == (3, 6)

    # What is left is exactly what the retained generations reference...
    objects, chunks = referenced(store)
    assert chunk_keys(store) == chunks
    assert object_keys(store) == objects
    # ... worked out a second way: the pieces of the arrays the test saved.
    assert chunks == set().union(*(piece_digests(states[i]) for i in (2, 5, 6)))
    # ... and the report counts exactly what went.
    after = all_sizes(store)
    freed = {key: size for key, size in before.items() if key not in after}
    assert set(after) <= set(before)
    assert report.chunks_freed == sum(ns == "chunks" for ns, _ in freed) == 2 * HEAD_CHUNKS
    assert report.objects_freed == sum(ns == "objects" for ns, _ in freed) == 6
    assert report.bytes_freed == sum(freed.values())

    # The reflog says which were collected; a second collection has nothing to do.
    collected = [r["generation"] for r in store.refs.reflog("a") if r["action"] == "collect"]
    assert sorted(collected) == [1, 3, 4]
    again = gc.collect_garbage(store, gc.RetentionPolicy(keep_last=2))
    assert again.dropped == {}
    assert (again.chunks_freed, again.objects_freed, again.bytes_freed) == (0, 0, 0)
    assert all_sizes(store) == after

    # Saving goes on after the gap: a new id, deduplicated against what is left.
    gen = store.save(finetune_state(13), run="a", step=700)
    assert gen.id == 7 and gen.new_bytes == 0
    assert ids(store, "a") == [2, 5, 6, 7]


def test_collect_is_refused_while_a_save_holds_the_store(store: Store) -> None:
    save_steps(store, "a", [1, 2, 3])
    before = all_sizes(store)
    with store.save_lock():
        with pytest.raises(StoreLockedError, match="store busy"):
            gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1), lock_timeout=0.2)
    assert all_sizes(store) == before
    assert ids(store, "a") == [1, 2, 3]
    assert gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1)).dropped == {"a": [1, 2]}


def test_a_sweep_cut_short_hides_dropped_generations_and_the_next_one_finishes(
    store: Store,
) -> None:
    from castore.support import faults

    states = {i: small_state(i) for i in range(1, 5)}
    for i, state in states.items():
        store.save(state, run="a", step=i)
    gc.tag(store, "a", 1, "keep")
    faults.arm("gc.before_sweep", "raise")
    try:
        with pytest.raises(faults.InjectedFault):
            gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    finally:
        faults.disarm("gc.before_sweep")
    assert ids(store, "a") == [1, 4]  # hidden at once, though nothing is deleted yet
    for kept in (1, 4):
        assert_bitwise_equal(store.load("a", kept), states[kept])
    usage = gc.disk_usage(store)
    # The `own` chunks of 2 and 3, and their roots and shard manifests.
    assert usage.garbage_bytes > 2 * CHUNK
    assert verify_store(store, deep=True).ok

    report = gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    assert report.dropped == {}  # already dropped: this pass only sweeps
    assert (report.chunks_freed, report.objects_freed) == (2, 4)
    assert report.bytes_freed == usage.garbage_bytes  # du predicted exactly what gc frees
    objects, chunks = referenced(store)
    assert (object_keys(store), chunk_keys(store)) == (objects, chunks)
    assert gc.disk_usage(store).garbage_bytes == 0


# -- 3. chunks shared across runs ------------------------------------------------------


def test_chunks_shared_with_another_run_survive_and_dry_run_predicts_the_real_run(
    store: Store,
) -> None:
    big0, big1 = rand(50, 8), rand(51, 8)
    a_states = [
        {"big": big0, "head": rand(60, 1)},
        {"big": big0, "head": rand(61, 1)},
        {"big": big1, "head": rand(62, 1)},
        {"big": big1, "head": rand(63, 1)},
    ]
    b_state = {"big": big0, "extra": rand(70, 2)}
    for i, state in enumerate(a_states):
        store.save(state, run="a", step=i)
    store.save(b_state, run="b", step=0)
    a_reflog = store.refs.reflog_path("a").read_bytes()

    policy = gc.RetentionPolicy(keep_last=1)
    before = all_sizes(store)
    dry = gc.collect_garbage(store, policy, runs=["a"], dry_run=True)
    assert dry.dry_run
    assert all_sizes(store) == before  # nothing deleted
    assert store.refs.reflog_path("a").read_bytes() == a_reflog  # nothing recorded
    assert ids(store, "a") == [1, 2, 3, 4]
    assert dry.dropped == {"a": [1, 2, 3]}

    real = gc.collect_garbage(store, policy, runs=["a"])
    assert real.dropped == dry.dropped
    assert [(p.run, p.reasons) for p in real.plans] == [(p.run, p.reasons) for p in dry.plans]
    assert (real.bytes_freed, real.chunks_freed, real.objects_freed) == (
        dry.bytes_freed,
        dry.chunks_freed,
        dry.objects_freed,
    )
    after = all_sizes(store)
    assert real.bytes_freed == sum(n for key, n in before.items() if key not in after)
    assert real.chunks_freed == 3  # the heads of a@1..3; big0 is b's, big1 is a@4's

    assert ids(store, "a") == [4] and ids(store, "b") == [1]
    assert_bitwise_equal(store.load("b", 1), b_state)
    assert_bitwise_equal(store.load("a", 4), a_states[3])
    assert all(store.backend.has_many(Namespace.CHUNKS, sorted(piece_digests(b_state))))
    expected = piece_digests(b_state) | piece_digests(a_states[3])
    assert chunk_keys(store) == expected
    assert verify_store(store, deep=True).ok

    # Applying the policy to every run now drops nothing more: big0 stays, b's.
    assert gc.collect_garbage(store, policy).bytes_freed == 0
    assert chunk_keys(store) == expected


# -- 4. property: random saves, tags and collections over several runs ---------------------

RUNS = ("r0", "r1", "r2")
TAGS = ("t1", "t2")
POOL = [rand(200 + i, 2) for i in range(4)]  # arrays shared within and across runs

# ("save", run, pool picks, step increment): one save per pick pair, a burst of 1-4.
save_op = st.tuples(
    st.just("save"),
    st.integers(0, len(RUNS) - 1),
    st.lists(
        st.tuples(st.integers(0, len(POOL) - 1), st.integers(0, len(POOL) - 1)),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 30),
)
tag_op = st.tuples(
    st.just("tag"), st.integers(0, len(RUNS) - 1), st.integers(0, 99), st.sampled_from(TAGS)
)
untag_op = st.tuples(st.just("untag"), st.integers(0, len(RUNS) - 1), st.sampled_from(TAGS))
gc_op = st.tuples(st.just("gc"), st.integers(1, 3), st.sampled_from([None, 10, 25, 40]))
operations = st.lists(
    st.one_of(save_op, save_op, save_op, tag_op, tag_op, untag_op, gc_op), min_size=4, max_size=16
)


def model_kept(
    gens: dict[int, int], tagged: set[int], keep_last: int, every: int | None
) -> list[int]:
    """The ids a policy keeps, from the test's own record (id -> step) of a run."""
    keep = set(sorted(gens)[-keep_last:]) | tagged
    if every:
        first: dict[int, int] = {}
        for gen_id, step in sorted(gens.items(), key=lambda item: (item[1], item[0])):
            first.setdefault(step // every, gen_id)
        keep |= set(first.values())
    return sorted(keep)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(ops=operations, last=gc_op)
def test_random_saves_tags_and_collections_keep_what_the_policy_says(
    ops: list[tuple[Any, ...]], last: tuple[Any, ...]
) -> None:
    with tempfile.TemporaryDirectory() as tmp, open_new(Path(tmp) / "store") as store:
        states: dict[str, dict[int, dict[str, Any]]] = {run: {} for run in RUNS}
        steps: dict[str, dict[int, int]] = {run: {} for run in RUNS}  # listed id -> step
        tags: dict[str, dict[str, int]] = {run: {} for run in RUNS}
        next_id = dict.fromkeys(RUNS, 1)
        last_step = dict.fromkeys(RUNS, 0)
        for op in [*ops, last]:  # every example ends with a collection
            run = RUNS[op[1]] if op[0] != "gc" else ""
            if op[0] == "save":
                _, _, picks, inc = op
                for i, j in picks:
                    state = {"x": POOL[i], "y": POOL[j], "k": [i, j]}
                    last_step[run] += inc
                    gen = store.save(state, run=run, step=last_step[run])
                    assert gen.id == next_id[run]
                    next_id[run] += 1
                    states[run][gen.id] = state
                    steps[run][gen.id] = last_step[run]
            elif op[0] == "tag":
                _, _, pick, name = op
                if not steps[run]:
                    with pytest.raises(GenerationNotFoundError):
                        gc.tag(store, run, 1, name)
                    continue
                target = sorted(steps[run])[pick % len(steps[run])]
                assert gc.tag(store, run, target, name).id == target
                tags[run][name] = target
            elif op[0] == "untag":
                name = op[2]
                if name in tags[run]:
                    gc.untag(store, run, name)
                    del tags[run][name]
                else:
                    with pytest.raises(GenerationNotFoundError):
                        gc.untag(store, run, name)
            else:
                _, keep_last, every = op
                policy = gc.RetentionPolicy(keep_last=keep_last, every_steps=every)
                report = gc.collect_garbage(store, policy)
                expected = {
                    run: model_kept(steps[run], set(tags[run].values()), keep_last, every)
                    for run in RUNS
                    if steps[run]
                }
                assert {p.run: p.kept for p in report.plans} == expected
                for run, kept in expected.items():
                    steps[run] = {i: steps[run][i] for i in kept}
                    states[run] = {i: states[run][i] for i in kept}
                check_store(store, states, tags)
        check_store(store, states, tags)


def check_store(
    store: Store, states: dict[str, dict[int, dict[str, Any]]], tags: dict[str, dict[str, int]]
) -> None:
    """Listed == the model; every listed generation loads as saved; chunks exactly as needed."""
    assert store.runs() == [run for run in RUNS if states[run]]
    expected_chunks: set[bytes] = set()
    for run in store.runs():
        listed = ids(store, run)
        assert listed == sorted(states[run])
        assert max(listed) == store.resolve(run).id  # the newest is always listed
        assert set(tags[run].values()) <= set(listed)
        assert {n: v.generation for n, v in store.refs.tags(run).items()} == tags[run]
        for gen_id, state in states[run].items():
            assert_bitwise_equal(store.load(run, gen_id), state)
            expected_chunks |= piece_digests(state)
    needed = sorted(referenced(store)[1])
    assert all(store.backend.has_many(Namespace.CHUNKS, needed))
    assert set(needed) == expected_chunks
    # Every save published and every collection swept: no garbage, nothing missing.
    assert chunk_keys(store) == expected_chunks


# -- 5. a collection that cannot read what it keeps deletes nothing ----------------------


def _three_generations(store: Store) -> dict[int, dict[str, Any]]:
    states = {i: small_state(i) for i in (1, 2, 3, 4)}
    for i, state in states.items():
        store.save(state, run="a", step=i)
    store.save(small_state(9), run="b", step=1)
    gc.tag(store, "a", 1, "old")
    return states


@pytest.mark.parametrize("damage", ["garbage", "deleted"])
def test_gc_aborts_when_a_retained_shard_manifest_is_damaged(store: Store, damage: str) -> None:
    _three_generations(store)
    _, root = store.resolve_root("a", 1)  # retained by its tag, behind the dropped 2 and 3
    shard = root.shards[0]
    if damage == "garbage":
        raw_put(store, Namespace.OBJECTS, shard, b"garbage")
    else:
        assert store.backend.delete_many(Namespace.OBJECTS, [shard]) == 1
    chunks, objects = chunk_keys(store), object_keys(store)
    reflog = store.refs.reflog_path("a").read_bytes()

    with pytest.raises(gc.GcAbortedError) as caught:
        gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    error = caught.value
    assert "nothing deleted" in str(error) and "a@1" in str(error)
    assert (error.run, error.generation) == ("a", 1)  # type: ignore[attr-defined]
    assert (chunk_keys(store), object_keys(store)) == (chunks, objects)
    assert store.refs.reflog_path("a").read_bytes() == reflog  # no collect records either
    assert ids(store, "a") == [1, 2, 3, 4]
    # A dry run refuses the same way.
    with pytest.raises(gc.GcAbortedError):
        gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1), dry_run=True)


def test_gc_aborts_when_the_newest_root_is_damaged(store: Store) -> None:
    _three_generations(store)
    newest = Digest.from_hex(store.resolve("b").root)
    raw_put(store, Namespace.OBJECTS, newest.raw, b"garbage")
    chunks, objects = chunk_keys(store), object_keys(store)
    with pytest.raises(gc.GcAbortedError, match="run 'b'") as caught:
        gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1), runs=["a"])
    assert caught.value.run == "b"  # type: ignore[attr-defined]
    assert (chunk_keys(store), object_keys(store)) == (chunks, objects)


@pytest.mark.parametrize("damaged_run", ["a", "b"])
def test_gc_aborts_on_a_damaged_reflog_line(store: Store, damaged_run: str) -> None:
    states = _three_generations(store)
    store.save(small_state(10), run="b", step=2)
    store.save(small_state(11), run="b", step=3)
    path = store.refs.reflog_path(damaged_run)
    lines = path.read_bytes().split(b"\n")
    middle = lines[1]
    at = middle.index(b'"host":"') + len(b'"host":"')
    lines[1] = middle[:at] + (b"X" if middle[at : at + 1] != b"X" else b"Y") + middle[at + 1 :]
    path.write_bytes(b"\n".join(lines))
    assert store.refs.read_reflog(damaged_run)[1] == [2]
    chunks, objects = chunk_keys(store), object_keys(store)

    with pytest.raises(gc.GcAbortedError, match="reflog") as caught:
        gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1), runs=["a"])
    assert caught.value.run == damaged_run  # type: ignore[attr-defined]
    assert "damaged lines [2]" in str(caught.value)
    assert (chunk_keys(store), object_keys(store)) == (chunks, objects)
    assert all(r["action"] != "collect" for r in store.refs.reflog("a"))
    for i, state in states.items():
        assert_bitwise_equal(store.load("a", i), state)


@pytest.mark.parametrize("where", ["closing-brace", "checksum-digit"])
def test_gc_never_deletes_a_tagged_generation_after_reflog_damage(store: Store, where: str) -> None:
    for i in range(1, 5):
        store.save(small_state(i), run="a", step=i)
    gc.tag(store, "a", 1, "best")
    gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    assert ids(store, "a") == [1, 4]
    digest, root = store.resolve_root("a", 1)
    needed = [digest.raw, *root.shards]

    path = store.refs.reflog_path("a")
    lines = path.read_bytes().split(b"\n")
    text, check = lines[0].rsplit(b"\t", 1)  # a whole line: generation 1's advance
    if where == "closing-brace":
        lines[0] = text[:-1] + b"]\t" + check
    else:
        lines[0] = text + b"\tg" + check[1:]
    path.write_bytes(b"\n".join(lines))

    with pytest.raises(gc.GcAbortedError, match="reflog"):
        gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    assert all(store.backend.has_many(Namespace.OBJECTS, needed)), "tagged a@1 was deleted"


def test_gc_refuses_when_a_tag_names_a_generation_the_history_lost(store: Store) -> None:
    for i in range(1, 5):
        store.save(small_state(i), run="a", step=i)
    gc.tag(store, "a", 1, "best")
    gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))  # a@1 now sits behind a gap
    digest, root = store.resolve_root("a", 1)
    needed = [digest.raw, *root.shards]
    path = store.refs.reflog_path("a")
    lines = path.read_bytes().split(b"\n")
    assert b'"generation":1' in lines[0]
    path.write_bytes(b"\n".join(lines[1:]))  # the line that listed a@1 is gone, cleanly
    assert ids(store, "a") == [4]
    with pytest.raises(gc.GcAbortedError, match="tag 'best'.*does not list"):
        gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    assert all(store.backend.has_many(Namespace.OBJECTS, needed)), "tagged a@1 was deleted"


# -- 6. tags ----------------------------------------------------------------------


def test_tag_untag_and_collect(store: Store) -> None:
    states = {i: small_state(i) for i in range(1, 5)}
    for i, state in states.items():
        store.save(state, run="a", step=10 * i)
    gen = gc.tag(store, "a", 2, "best")
    assert isinstance(gen, castore.Generation)
    assert (gen.run, gen.id, gen.step) == ("a", 2, 20)
    assert gen.root == store.resolve("a", 2).root
    assert gc.tag(store, "a", "latest", "head").id == 4
    assert {n: v.generation for n, v in store.refs.tags("a").items()} == {"best": 2, "head": 4}
    # A tag names its generation wherever a generation is asked for.
    assert store.resolve("a", "best").id == 2
    assert_bitwise_equal(store.load("a", "best"), states[2])
    assert gc.tag(store, "a", "best", "also-best").id == 2
    gc.untag(store, "a", "also-best")

    report = gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    assert report.dropped == {"a": [1, 3]}
    assert report.plans[0].reasons[2] == ["tag best"]
    assert ids(store, "a") == [2, 4]
    assert_bitwise_equal(store.load("a", 2), states[2])

    with pytest.raises(GenerationNotFoundError):
        gc.tag(store, "a", 3, "late")  # dropped: cannot be tagged
    with pytest.raises(GenerationNotFoundError):
        gc.tag(store, "a", 9, "never")
    with pytest.raises(GenerationNotFoundError):
        gc.tag(store, "nobody", 1, "x")
    for bad in ("bad name", "../up", "", ".hidden", "a/b"):
        with pytest.raises(InvalidNameError):
            gc.tag(store, "a", 2, bad)
    assert set(store.refs.tags("a")) == {"best", "head"}

    gc.untag(store, "a", "best")
    with pytest.raises(GenerationNotFoundError, match="no tag 'best'"):
        gc.untag(store, "a", "best")
    with pytest.raises(GenerationNotFoundError):
        gc.untag(store, "a", "missing")
    report = gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    assert report.dropped == {"a": [2]}
    assert ids(store, "a") == [4]
    with pytest.raises(GenerationNotFoundError):
        store.load("a", 2)


def test_a_tag_name_that_run_at_name_cannot_address_is_refused(
    store: Store, store_path: Path
) -> None:
    save_steps(store, "a", [10, 20, 30])
    refused = [("123", "all digits"), ("2", "all digits"), ("007", "all digits")]
    refused += [("latest", "newest generation")]
    for name, words in refused:
        with pytest.raises(InvalidNameError, match=words) as caught:
            gc.tag(store, "a", 1, name)
        assert "could never be named" in str(caught.value) and "run=a" in str(caught.value)
    with pytest.raises(InvalidNameError, match="step-123"):  # the hint
        gc.tag(store, "a", 1, "123")
    assert store.refs.tags("a") == {}
    # Names RUN@NAME does reach: digits with a letter, a dot, a hex word a tag wins over.
    for name in ("v123", "step-123", "1.5", "Latest", "abcdef"):
        assert gc.tag(store, "a", 2, name).id == 2
        assert store.resolve("a", name).id == 2
    assert store.resolve("a", "3").id == 3
    # A tag named before the rule (its file put in place) still pins and can be removed.
    tags = store_path / "tags" / "a"
    shutil.copy(tags / "v123", tags / "123")
    assert store.refs.tags("a")["123"].generation == 2
    gc.untag(store, "a", "123")
    assert "123" not in store.refs.tags("a")


def test_retagging_moves_what_the_tag_keeps(store: Store) -> None:
    save_steps(store, "a", [1, 2, 3, 4])
    gc.tag(store, "a", 1, "best")
    gc.tag(store, "a", 2, "best")
    assert gc.plan_retention(store, gc.RetentionPolicy(keep_last=1))[0].kept == [2, 4]
    gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    assert ids(store, "a") == [2, 4]


def test_moving_a_tag_says_which_generation_it_no_longer_pins(store: Store) -> None:
    gens = save_steps(store, "a", [1, 2, 3, 4])
    new = gc.set_tag(store, "a", 1, "best")
    assert (new.name, new.generation.id, new.previous, new.moved) == ("best", 1, None, False)
    same = gc.set_tag(store, "a", 1, "best")
    assert same.previous is not None and same.previous.generation == 1 and not same.moved
    moved = gc.set_tag(store, "a", 3, "best")
    assert moved.moved and moved.generation.id == 3
    assert moved.previous is not None
    assert (moved.previous.generation, moved.previous.root.hex) == (1, gens[0].root)
    # What it says holds: generation 1 is pinned no more, and goes.
    assert gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1)).dropped == {"a": [1, 2]}
    assert ids(store, "a") == [3, 4]


# -- 7. disk usage -----------------------------------------------------------------


def test_disk_usage_of_a_fine_tuning_run(store: Store) -> None:
    heads = [10, 11, 11, 12]  # generations 2 and 3 have the same head
    for i, seed in enumerate(heads, 1):
        store.save(finetune_state(seed), run="a", step=i)
    usage = gc.disk_usage(store)
    assert [(u.run, u.id, u.step) for u in usage.generations] == [("a", i, i) for i in (1, 2, 3, 4)]
    assert all(u.logical_bytes == STATE_BYTES for u in usage.generations)
    assert all(u.referenced_bytes == STATE_BYTES for u in usage.generations)
    assert [u.exclusive_bytes for u in usage.generations] == [HEAD_BYTES, 0, 0, HEAD_BYTES]
    stored = BACKBONE_CHUNKS * CHUNK + 3 * HEAD_BYTES
    assert usage.referenced_bytes == stored == chunk_bytes(store)
    assert usage.logical_bytes == 4 * STATE_BYTES
    assert usage.dedup_ratio == pytest.approx(4 * STATE_BYTES / stored)
    objects = sum(n for _, n in store.backend.value_sizes(Namespace.OBJECTS))
    assert usage.physical_bytes == stored + objects
    assert usage.garbage_bytes == 0
    assert usage.file_bytes == files_on_disk(store.path) > stored

    # A chunk shared with another run is not exclusive to a@1 any more; rows of
    # one run still count the other run's references.
    store.save({"head": rand(10, HEAD_CHUNKS)}, run="b", step=0)
    only_a = gc.disk_usage(store, ["a"])
    assert [u.run for u in only_a.generations] == ["a"] * 4
    assert [u.exclusive_bytes for u in only_a.generations] == [0, 0, 0, HEAD_BYTES]
    assert only_a.referenced_bytes == stored  # b added no new chunk

    # A stray chunk is garbage until a collection frees it.
    stray = b"stray chunk " * 50
    store.backend.put_many(Namespace.CHUNKS, [(digest_bytes(stray), stray)])
    with_stray = gc.disk_usage(store)
    assert with_stray.garbage_bytes == len(stray)
    assert with_stray.physical_bytes == only_a.physical_bytes + len(stray)
    assert with_stray.referenced_bytes == stored
    report = gc.collect_garbage(store, gc.RetentionPolicy(keep_last=10))
    assert report.dropped == {}
    assert (report.chunks_freed, report.bytes_freed) == (1, len(stray))
    assert gc.disk_usage(store).garbage_bytes == 0

    gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1), runs=["a"])
    after = gc.disk_usage(store)
    assert after.garbage_bytes == 0
    assert [(u.run, u.id) for u in after.generations] == [("a", 4), ("b", 1)]
    assert [u.exclusive_bytes for u in after.generations] == [
        BACKBONE_CHUNKS * CHUNK + HEAD_BYTES,
        HEAD_BYTES,
    ]
    assert after.referenced_bytes == chunk_bytes(store) == STATE_BYTES + HEAD_BYTES


# -- 8. storage growth of a fine-tuning run (the test) ---------------------------


def _twenty_saves(path: Path, rewrite_backbone: bool) -> tuple[int, list[castore.Generation]]:
    with open_new(path) as store:
        gens = []
        for i in range(20):
            backbone = rand(5000 + i, BACKBONE_CHUNKS) if rewrite_backbone else BACKBONE
            gens.append(store.save(finetune_state(9000 + i, backbone), run="ft", step=i))
        return chunk_bytes(store), gens


def test_storage_growth_of_twenty_fine_tuning_saves(tmp_path: Path) -> None:
    assert 10 * BACKBONE_CHUNKS * CHUNK == 9 * STATE_BYTES  # the backbone is 90%
    stored, gens = _twenty_saves(tmp_path / "dedup", rewrite_backbone=False)
    expected = (1 + 19 * 0.1) * STATE_BYTES
    assert abs(stored - expected) <= 0.02 * expected, (stored, expected)
    assert gens[0].new_bytes == STATE_BYTES
    assert all(g.new_bytes == HEAD_BYTES for g in gens[1:])
    assert all(g.logical_bytes == STATE_BYTES for g in gens)

    # Broken control: a backbone that changes every save cannot deduplicate. The
    # same measurement then reads ~20x, so it does tell the two apart.
    control, _ = _twenty_saves(tmp_path / "control", rewrite_backbone=True)
    assert abs(control - 20 * STATE_BYTES) <= 0.02 * 20 * STATE_BYTES, control
    assert control / stored > 6


def files_on_disk(path: Path) -> int:
    """The LMDB data file plus every pack, measured with plain stat calls."""
    chunks = path / "chunks"
    packs = sum(p.stat().st_size for p in (chunks / "packs").glob("*.pack"))
    return (chunks / "data.mdb").stat().st_size + packs


def pack_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "chunks" / "packs").glob("*.pack"))


def dense_pack_bytes(store: Store) -> int:
    """What the live chunks take in packs with no dead record (headers included, 1 pack)."""
    sizes = [n for _, n in store.backend.value_sizes(Namespace.CHUNKS)]
    return sum(sizes) + 40 * len(sizes) + 16


def test_gc_gives_pack_space_back(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with open_new(path) as store:
        for i in range(20):
            store.save(finetune_state(700 + i), run="a", step=i)
        before = pack_bytes(path)
        assert before >= chunk_bytes(store)  # 20 heads and one backbone
        report = gc.collect_garbage(store, gc.RetentionPolicy(keep_last=2))
        live = chunk_bytes(store)
        assert live == STATE_BYTES + HEAD_BYTES
        after = pack_bytes(path)
        # 18 heads' packs held nothing live and are gone; what is left is at most
        # twice the live bytes (a pack under half live is rewritten).
        assert report.file_bytes_freed == before - after > 0
        assert after <= 2 * dense_pack_bytes(store)
        # Every remaining pack is named by the index: nothing orphaned.
        named = {store.backend.locate(k).pack for k in store.backend.iter_keys(Namespace.CHUNKS)}
        assert set(store.backend.pack_files()) == named
        for gen_id in (19, 20):
            assert_bitwise_equal(store.load("a", gen_id), finetune_state(700 + gen_id - 1))
        assert verify_store(store, deep=True).ok


# -- 9. compaction ------------------------------------------------------------------


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_compact_after_gc_shrinks_and_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "store"
    data_file = path / "chunks" / "data.mdb"
    with open_new(path) as store:
        for i in range(20):
            store.save(finetune_state(300 + i), run="a", step=i)
        gc.tag(store, "a", 5, "mid")
        gc.collect_garbage(store, gc.RetentionPolicy(keep_last=2))
        assert ids(store, "a") == [5, 19, 20]
        keys = all_sizes(store)
    size_before = data_file.stat().st_size
    files_before = files_on_disk(path)

    report = gc.compact(path)
    assert report.bytes_before == files_before
    assert report.bytes_after == files_on_disk(path)
    assert data_file.stat().st_size < size_before  # 17 heads' pages were free
    with castore.open(path, create=False) as store:
        # Every pack is dense now: the live records and nothing else.
        named = {store.backend.locate(k).pack for k in store.backend.iter_keys(Namespace.CHUNKS)}
        assert set(store.backend.pack_files()) == named
        assert pack_bytes(path) == dense_pack_bytes(store) + 16 * (len(named) - 1)
    assert not list((path / "chunks").glob(".compact-*"))

    with castore.open(path, create=False) as store:
        assert all_sizes(store) == keys
        assert ids(store, "a") == [5, 19, 20]
        for gen_id in (5, 19, 20):
            assert_bitwise_equal(store.load("a", gen_id), finetune_state(300 + gen_id - 1))
        check = verify_store(store, deep=True)
        assert check.ok and check.generations == 3
        gen = store.save(finetune_state(999), run="a", step=99)  # writable after the swap
        assert gen.id == 21 and gen.new_bytes == HEAD_BYTES
    again = gc.compact(path)
    assert again.bytes_after <= again.bytes_before


def test_compact_is_refused_while_the_store_is_open(store: Store, store_path: Path) -> None:
    save_steps(store, "a", [1, 2, 3])
    gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    files = [store_path / "chunks" / "data.mdb", *(store_path / "chunks" / "packs").iterdir()]
    before = [_file_digest(f) for f in files]
    with pytest.raises(StoreLockedError, match="open"):
        gc.compact(store_path)
    assert [_file_digest(f) for f in files] == before
    assert len(list((store_path / "chunks" / "packs").iterdir())) == len(files) - 1
    assert not list((store_path / "chunks").glob(".compact-*"))
    assert ids(store, "a") == [3]
    assert_bitwise_equal(store.load("a", 3), small_state(2))


# -- 10. the castore command --------------------------------------------------------


def table_rows(stdout: str) -> list[list[str]]:
    """Body rows of the first table (after tabulate's dashed rule), split on 2+ spaces."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if set(line.replace(" ", "")) == {"-"})
    body = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        body.append(re.split(r"\s{2,}", line.strip()))
    return body


@pytest.fixture
def cli_store(tmp_path: Path) -> Path:
    """exp@1..3 (steps 100, 200, 300) and other@1."""
    path = tmp_path / "cli"
    with open_new(path) as store:
        for i in (1, 2, 3):
            store.save(finetune_state(400 + i), run="exp", step=100 * i)
        store.save(small_state(1), run="other", step=5)
    return path


def test_cli_gc_dry_run_then_collect(cli_store: Path) -> None:
    with castore.open(cli_store, create=False) as store:
        keys = all_sizes(store)
    dry = run_cli("gc", cli_store, "--dry-run", "--keep", "1")
    assert dry.returncode == 0, dry.stderr
    table = table_rows(dry.stdout)
    assert [(r[0], r[1], r[2], r[4]) for r in table] == [
        ("exp", "1", "100", "drop"),
        ("exp", "2", "200", "drop"),
        ("exp", "3", "300", "keep"),
        ("other", "1", "5", "keep"),
    ]
    assert table[2][5] == "last 1"
    summary = dry.stdout.strip().splitlines()[-1]
    assert summary.startswith("dry run: would drop 2 generation(s); would free")
    assert f"({2 * HEAD_CHUNKS} chunk(s), 4 object(s))" in summary
    with castore.open(cli_store, create=False) as store:
        assert all_sizes(store) == keys
        assert ids(store, "exp") == [1, 2, 3]

    real = run_cli("gc", cli_store, "--keep", "1")
    assert real.returncode == 0, real.stderr
    assert [r[4] for r in table_rows(real.stdout)] == ["dropped", "dropped", "keep", "keep"]
    summary = real.stdout.strip().splitlines()[-1]
    assert summary.startswith("2 generation(s) dropped; freed ")
    assert f"({2 * HEAD_CHUNKS} chunk(s), 4 object(s))" in summary
    with castore.open(cli_store, create=False) as store:
        assert ids(store, "exp") == [3] and ids(store, "other") == [1]
        assert_bitwise_equal(store.load("exp", 3), finetune_state(403))
    log = run_cli("log", cli_store, "--run", "exp")
    assert [r[0] for r in table_rows(log.stdout)] == ["3"]


def test_cli_tag_log_untag(cli_store: Path) -> None:
    tagged = run_cli("tag", cli_store, "exp@2", "best")
    assert tagged.returncode == 0, tagged.stderr
    assert tagged.stdout.startswith("tagged exp@2 (") and tagged.stdout.strip().endswith("as best")
    log = run_cli("log", cli_store, "--run", "exp")
    assert log.returncode == 0, log.stderr
    assert {r[0]: r[-1] for r in table_rows(log.stdout)}["2"] == "best"
    assert [len(r) for r in table_rows(log.stdout)] == [10, 11, 10]  # only id 2 has a tags cell

    kept = run_cli("gc", cli_store, "--keep", "1", "--run", "exp")
    assert kept.returncode == 0, kept.stderr
    by_id = {(r[0], r[1]): r for r in table_rows(kept.stdout)}
    assert by_id[("exp", "2")][4:] == ["keep", "tag best"]
    assert by_id[("other", "1")][4:] == ["keep", "run not selected"]
    assert by_id[("exp", "1")][4] == "dropped"

    untagged = run_cli("untag", cli_store, "exp", "best")
    assert untagged.returncode == 0, untagged.stderr
    assert untagged.stdout.strip() == "removed tag best of run exp"
    assert all(len(r) == 10 for r in table_rows(run_cli("log", cli_store, "--run", "exp").stdout))
    assert run_cli("gc", cli_store, "--keep", "1").returncode == 0
    with castore.open(cli_store, create=False) as store:
        assert ids(store, "exp") == [3]


def test_cli_retag_says_which_generation_the_tag_no_longer_pins(cli_store: Path) -> None:
    with castore.open(cli_store, create=False) as store:
        root = {g.id: g.root[:12] for g in store.generations("exp")}
    first = run_cli("tag", cli_store, "exp@1", "best")
    assert first.stdout == f"tagged exp@1 ({root[1]}) as best\n"
    assert run_cli("tag", cli_store, "exp@1", "first").returncode == 0
    moved = run_cli("tag", cli_store, "exp@2", "best")
    assert moved.returncode == 0 and moved.stderr == ""
    assert moved.stdout == (
        f"moved tag best from exp@1 ({root[1]}) to exp@2 ({root[2]}); "
        "exp@1 is no longer pinned by it (tag first still pins it)\n"
    )
    assert run_cli("untag", cli_store, "exp", "first").returncode == 0
    again = run_cli("tag", cli_store, "exp@3", "best")
    assert again.stdout == (
        f"moved tag best from exp@2 ({root[2]}) to exp@3 ({root[3]}); "
        "exp@2 is no longer pinned by it (castore gc may now drop it)\n"
    )
    same = run_cli("tag", cli_store, "exp@3", "best")
    assert same.stdout == f"tagged exp@3 ({root[3]}) as best\n"
    assert run_cli("gc", cli_store, "--keep", "1").returncode == 0
    with castore.open(cli_store, create=False) as store:
        assert ids(store, "exp") == [3]


def test_cli_du(cli_store: Path) -> None:
    with castore.open(cli_store, create=False) as store:
        usage = gc.disk_usage(store)
    result = run_cli("du", cli_store)
    assert result.returncode == 0, result.stderr
    table = table_rows(result.stdout)
    assert [(r[0], r[1], r[2]) for r in table] == [
        ("exp", "1", "100"),
        ("exp", "2", "200"),
        ("exp", "3", "300"),
        ("other", "1", "5"),
    ]
    assert [r[3] for r in table[:3]] == ["100.0 KiB"] * 3
    assert [r[5] for r in table[:3]] == ["10.0 KiB"] * 3  # each head is only its own
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert lines["logical"].startswith("logical   ") and "in 4 generation(s)" in lines["logical"]
    assert f"(dedup {usage.dedup_ratio:.2f}x of raw chunk bytes)" in lines["stored"]
    assert usage.dedup_ratio == pytest.approx(
        (3 * STATE_BYTES + 3 * CHUNK) / (BACKBONE_CHUNKS * CHUNK + 3 * HEAD_BYTES + 3 * CHUNK)
    )
    assert "of it garbage" in lines["physical"]
    assert "LMDB file and chunk packs" in lines["files"]


def test_cli_compact(cli_store: Path) -> None:
    assert run_cli("gc", cli_store, "--keep", "1").returncode == 0
    result = run_cli("compact", cli_store)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"compacted {cli_store}: ")
    with castore.open(cli_store, create=False) as store:
        assert_bitwise_equal(store.load("exp"), finetune_state(403))
        assert verify_store(store, deep=True).ok


# Bad option values (--keep 0, --every soon) are usage errors, exit 2: tests/test_cli.py.
CLI_ERRORS = [
    ("gc-missing-store", lambda s, t: ["gc", t / "nowhere", "--keep", "1"], "StoreNotFoundError"),
    (
        "gc-unknown-run",
        lambda s, t: ["gc", s, "--keep", "1", "--run", "nobody"],
        "GenerationNotFoundError",
    ),
    # Off a terminal, nobody can be asked: a policy or --yes says to delete.
    ("gc-no-policy", lambda s, t: ["gc", s], "pass the policy (--keep K, --every-steps N"),
    ("gc-no-policy-run", lambda s, t: ["gc", s, "--run", "exp"], "or --yes for the default"),
    ("untag-missing", lambda s, t: ["untag", s, "exp", "nope"], "GenerationNotFoundError"),
    ("tag-bad-name", lambda s, t: ["tag", s, "exp@1", "bad name"], "InvalidNameError"),
    ("tag-all-digits", lambda s, t: ["tag", s, "exp@1", "123"], "all digits, and RUN@123"),
    ("tag-latest", lambda s, t: ["tag", s, "exp@1", "latest"], "RUN@latest always means"),
    ("tag-unknown-gen", lambda s, t: ["tag", s, "exp@9", "x"], "GenerationNotFoundError"),
    ("du-missing-store", lambda s, t: ["du", t / "nowhere"], "StoreNotFoundError"),
    ("compact-missing", lambda s, t: ["compact", t / "nowhere"], "nowhere"),
]


@pytest.mark.parametrize(
    "build, words", [e[1:] for e in CLI_ERRORS], ids=[e[0] for e in CLI_ERRORS]
)
def test_cli_errors_are_one_line(cli_store: Path, tmp_path: Path, build: Any, words: str) -> None:
    with castore.open(cli_store, create=False) as store:
        keys = all_sizes(store)
    result = run_cli(*build(cli_store, tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("castore: error: ")
    assert words in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    with castore.open(cli_store, create=False) as store:
        assert all_sizes(store) == keys
        assert ids(store, "exp") == [1, 2, 3]


def test_cli_compact_refused_while_open(cli_store: Path) -> None:
    data_file = cli_store / "chunks" / "data.mdb"
    with castore.open(cli_store, create=False):
        before = _file_digest(data_file)
        result = run_cli("compact", cli_store)
    assert result.returncode == 1
    assert result.stderr.startswith("castore: error: StoreLockedError")
    assert len(result.stderr.splitlines()) == 1
    assert _file_digest(data_file) == before


def test_du_of_one_run_counts_only_that_runs_chunks(store: Store) -> None:
    """The "stored" figure and the dedup ratio of `du --run R` are R's alone."""
    import numpy as np

    from castore.gc import disk_usage

    for step in range(3):
        store.save({"w": np.arange(4096, dtype=np.float32)}, run="same", step=step)
    store.save({"w": np.arange(8192, dtype=np.float32) + 1e6}, run="other", step=1)
    one = disk_usage(store, ["same"])
    assert one.referenced_bytes == 4096 * 4 and one.dedup_ratio == 3.0
    assert disk_usage(store).referenced_bytes == 4096 * 4 + 8192 * 4
    with pytest.raises(GenerationNotFoundError, match="nope"):
        disk_usage(store, ["nope"])


def test_a_tag_wins_over_the_root_prefix_it_spells_and_digits_stay_ids(
    store: Store, store_path: Path
) -> None:
    for i in range(1, 4):
        store.save(small_state(i), run="a", step=i)
    third = store.resolve("a", 3)
    # A tag named like generation 3's root prefix (one with a letter: digits cannot tag).
    size = next(n for n in range(8, 64) if not third.root[:n].isdigit())
    gc.tag(store, "a", 1, third.root[:size])
    assert store.resolve("a", third.root[:size]).id == 1
    assert store.resolve("a", third.root[: size + 1]).id == 3  # no such tag: the prefix
    with pytest.raises(InvalidNameError, match="all digits"):
        gc.tag(store, "a", 1, "2")  # a tag named like an id is refused ...
    tags = store_path / "tags" / "a"
    shutil.copy(tags / third.root[:size], tags / "2")  # ... and one made before the rule
    assert store.refs.tags("a")["2"].generation == 1
    assert store.resolve("a", "2").id == 2  # is never what RUN@2 means
    with pytest.raises(GenerationNotFoundError, match="a tag name"):
        store.resolve("a", "no-such-tag")
