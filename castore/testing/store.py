"""A whole store, end to end: save, load, generations, tags, gc, verify, repair, du.

Run over every way to build a ``Store`` (a directory, memory, later object
storage): whatever the parts underneath, what a user sees is the same.
Only the public API and the interfaces of the parts are used, so a failure
here names behaviour, not layout.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import pytest

from castore.chunkstore.base import Namespace
from castore.errors import (
    FallbackWarning,
    GenerationNotFoundError,
    RefConflictError,
    StoreLockedError,
)
from castore.format.hashing import Digest
from castore.gc import RetentionPolicy, collect_garbage, disk_usage, tag, untag
from castore.repair import repair_store
from castore.repo.records import RefValue
from castore.store import Store
from castore.verify import verify_store


def state(seed: int, *, changed: int = 0) -> dict[str, Any]:
    """A small model state: ``frozen`` is the same for every seed, ``head`` is not."""
    rng = np.random.default_rng(seed)
    return {
        "frozen": np.arange(4096, dtype=np.float32).reshape(64, 64),
        "head": rng.standard_normal(700).astype(np.float64),
        "ids": np.arange(seed, seed + 50, dtype=np.int64),
        "step": seed,
        "name": f"state {seed}",
        "changed": changed,
    }


def assert_same(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert actual.tobytes() == expected.tobytes()
    else:
        assert actual == expected


class StoreTests:
    """Subclass and override the ``store`` fixture with a fresh, empty Store (closed after)."""

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("override the store fixture to build the implementation")

    def test_an_empty_store_has_no_runs(self, store: Store) -> None:
        assert store.runs() == []
        with pytest.raises(GenerationNotFoundError):
            store.load("r")

    def test_save_and_load_round_trip(self, store: Store) -> None:
        saved = state(1)
        gen = store.save(saved, run="r", step=10, metadata={"loss": 0.5})
        assert (gen.run, gen.id, gen.step, gen.parent) == ("r", 1, 10, None)
        assert gen.metadata == {"loss": 0.5}
        assert_same(store.load("r"), saved)
        assert_same(store.load("r", 1), saved)
        assert_same(store.load("r", gen.root[:12]), saved)
        assert store.runs() == ["r"]

    def test_generations_chain_and_an_unchanged_save_writes_nothing_new(self, store: Store) -> None:
        first = store.save(state(1), run="r", step=1)
        second = store.save(state(1), run="r", step=2)
        third = store.save(state(2), run="r", step=3)
        assert second.new_bytes == 0 < third.new_bytes
        listed = store.generations("r")
        assert [g.id for g in listed] == [1, 2, 3]
        assert [g.parent for g in listed] == [None, first.root, second.root]
        assert [g.id for g in store.generations("r", last=2)] == [2, 3]
        assert_same(store.load("r", 1), state(1))
        assert_same(store.load("r"), state(2))

    def test_read_slice_reads_what_was_saved(self, store: Store) -> None:
        saved = state(3)
        store.save(saved, run="r", step=1)
        part = store.read_slice("r", "latest", "frozen", (slice(10, 20), slice(5, 9)))
        assert part.tobytes() == saved["frozen"][10:20, 5:9].tobytes()

    def test_runs_are_independent(self, store: Store) -> None:
        store.save(state(1), run="a", step=1)
        store.save(state(2), run="b", step=1)
        store.save(state(3), run="b", step=2)
        assert store.runs() == ["a", "b"]
        assert [g.id for g in store.generations("a")] == [1]
        assert_same(store.load("b"), state(3))

    def test_every_advance_is_logged_in_order(self, store: Store) -> None:
        for seed in range(1, 4):
            store.save(state(seed), run="r", step=seed)
        records = store.refs.reflog("r")
        assert [(r["action"], r["generation"]) for r in records] == [
            ("advance", 1),
            ("advance", 2),
            ("advance", 3),
        ]
        assert store.refs.last_published("r") == records[-1]

    def test_a_stale_compare_and_swap_is_refused(self, store: Store) -> None:
        first = store.save(state(1), run="r", step=1)
        store.save(state(2), run="r", step=2)
        stale = RefValue("r", 3, Digest.from_hex(first.root), 0.0)
        with pytest.raises(RefConflictError):
            store.refs.advance("r", expected=Digest.from_hex(first.root), new=stale)
        assert store.resolve("r").id == 2

    def test_tags_pin_generations_through_gc(self, store: Store) -> None:
        for seed in range(1, 5):
            store.save(state(seed), run="r", step=seed)
        tag(store, "r", 1, "best")
        assert store.resolve("r", "best").id == 1
        report = collect_garbage(store, RetentionPolicy(keep_last=1))
        assert report.dropped == {"r": [2, 3]}
        assert report.chunks_freed > 0
        assert [g.id for g in store.generations("r")] == [1, 4]
        assert_same(store.load("r", "best"), state(1))
        assert_same(store.load("r"), state(4))
        with pytest.raises(GenerationNotFoundError):
            store.load("r", 2)
        actions = [(r["action"], r["generation"]) for r in store.refs.reflog("r")]
        assert actions[-2:] == [("collect", 2), ("collect", 3)]
        assert verify_store(store, deep=True).ok
        untag(store, "r", "best")
        assert collect_garbage(store, RetentionPolicy(keep_last=1)).dropped == {"r": [1]}
        assert [g.id for g in store.generations("r")] == [4]
        assert verify_store(store, deep=True).ok

    def test_disk_usage_counts_what_only_one_generation_holds(self, store: Store) -> None:
        store.save(state(1), run="r", step=1)
        store.save(state(2), run="r", step=2)
        usage = disk_usage(store)
        assert [u.id for u in usage.generations] == [1, 2]
        assert all(0 < u.exclusive_bytes < u.referenced_bytes for u in usage.generations)
        assert usage.garbage_bytes == 0
        assert usage.dedup_ratio > 1.0

    def test_verify_finds_a_missing_chunk_and_repair_reports_it(self, store: Store) -> None:
        store.save(state(1), run="r", step=1)
        assert verify_store(store, deep=True).ok
        chunk = next(iter(store.backend.iter_keys(Namespace.CHUNKS)))
        store.backend.delete_many(Namespace.CHUNKS, [chunk])
        report = verify_store(store)
        assert not report.ok
        assert any(p.run == "r" for p in report.problems), report.problems
        repaired = repair_store(store)
        assert "r@1" in repaired.damaged

    def test_repair_of_an_intact_store_changes_nothing(self, store: Store) -> None:
        store.save(state(1), run="r", step=1)
        report = repair_store(store)
        assert report.damaged == {} and report.refs_restored == {}
        assert not report.corrupt_chunks and not report.corrupt_objects
        assert_same(store.load("r"), state(1))

    def test_fallback_skips_a_generation_whose_root_is_gone(self, store: Store) -> None:
        store.save(state(1), run="r", step=1)
        second = store.save(state(2), run="r", step=2)
        store.backend.delete_many(Namespace.OBJECTS, [Digest.from_hex(second.root).raw])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = store.load("r", fallback="previous")
        assert_same(loaded, state(1))
        assert any(issubclass(w.category, FallbackWarning) for w in caught)

    def test_a_save_waits_for_gc_then_says_the_store_is_busy(self, store: Store) -> None:
        store.save(state(1), run="r", step=1)
        store.refs.save_wait = 0.3
        with store.refs.store_lock(exclusive=True, timeout=1, busy="test: gc running"):
            with pytest.raises(StoreLockedError, match="busy"):
                store.save(state(2), run="r", step=2)
        assert store.resolve("r").id == 1
        store.refs.save_wait = 60
        assert store.save(state(2), run="r", step=2).id == 2

    def test_concurrent_saves_of_one_run_give_a_gapless_chain(self, store: Store) -> None:
        errors: list[BaseException] = []

        def saver(seed: int) -> None:
            for _ in range(200):
                try:
                    # One step for all: saves racing from one process are one writer,
                    # and a step below the latest would be refused (castore.core.fencing).
                    store.save(state(seed), run="r", step=7)
                    return
                except RefConflictError:
                    continue  # another thread published first: retry on the new ref
                except BaseException as exc:
                    errors.append(exc)
                    return
            errors.append(AssertionError(f"saver {seed} never published in 200 tries"))

        threads = [threading.Thread(target=saver, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert errors == []
        listed = store.generations("r")
        assert [g.id for g in listed] == [1, 2, 3, 4]
        assert all(g.parent == p.root for p, g in zip(listed[:-1], listed[1:], strict=True))
        assert verify_store(store, deep=True).ok
