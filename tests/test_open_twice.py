"""One store opened twice in one process: the handles share one LMDB environment.

py-lmdb refuses to open one environment twice in a process, so these used to fail
with "already open in this process": a notebook cell that opens a store run
again, a DCP writer given a path while a ``Store`` on it is open. Every test uses
a real store on disk; the threads and the fork are real too.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import assert_state_equal
from conftest import TEST_CHUNK_SIZE, StateFactory

import castore
from castore.chunkstore.base import Namespace
from castore.chunkstore.lmdb import env as lmdb_env
from castore.chunkstore.lmdb.backend import LmdbBackend
from castore.dcp import CastoreReader, CastoreWriter
from castore.errors import StoreError, StoreLockedError
from castore.gc import compact
from castore.repair import rebuild_index
from castore.verify import verify_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def open_twice(
    path: Path | str, other: Path | str | None = None
) -> tuple[castore.Store, castore.Store]:
    first = castore.open(path, chunk_size=TEST_CHUNK_SIZE)
    try:
        return first, castore.open(other if other is not None else path)
    except BaseException:
        first.close()
        raise


def test_what_one_handle_saves_the_other_loads(store_path: Path, make_state: StateFactory) -> None:
    first, second = open_twice(store_path)
    try:
        saved = first.save(make_state(1), run="a", step=1)
        assert_state_equal(second.load("a"), make_state(1))
        assert second.generations("a") == [saved]
        second.save(make_state(2), run="b", step=1)
        assert_state_equal(first.load("b"), make_state(2))
        assert first.runs() == second.runs() == ["a", "b"]
    finally:
        first.close()
        second.close()


def test_closing_one_handle_leaves_the_other_working(
    store_path: Path, make_state: StateFactory
) -> None:
    first, second = open_twice(store_path)
    first.save(make_state(1), run="a", step=1)
    first.close()
    first.close()  # harmless
    with pytest.raises(StoreError, match="closed"):
        first.load("a")
    try:
        second.save(make_state(2), run="a", step=2)
        assert_state_equal(second.load("a", 1), make_state(1))
        assert_state_equal(second.load("a", 2), make_state(2))
        assert lmdb_env.is_open(store_path / "chunks")
    finally:
        second.close()
    assert not lmdb_env.is_open(store_path / "chunks")  # the last handle closed it
    with castore.open(store_path) as again:
        assert [g.id for g in again.generations("a")] == [1, 2]


def test_a_relative_and_an_absolute_path_share_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_state: StateFactory
) -> None:
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    first, second = open_twice("ckpt", tmp_path / "elsewhere" / ".." / "ckpt")
    try:
        assert first.backend._env is second.backend._env  # type: ignore[attr-defined]
        first.save(make_state(3), run="r", step=1)
        assert_state_equal(second.load("r"), make_state(3))
    finally:
        first.close()
        second.close()


def test_a_store_opened_again_after_the_first_was_dropped(
    store_path: Path, make_state: StateFactory
) -> None:
    """A notebook cell run twice: the second open rebinds the name and drops the first."""
    store = castore.open(store_path, chunk_size=TEST_CHUNK_SIZE)
    store.save(make_state(1), run="r", step=1)
    store = castore.open(store_path)
    gc.collect()
    try:
        assert_state_equal(store.load("r"), make_state(1))
    finally:
        store.close()
    # The dropped Store gave back its share of the environment and its open lock.
    assert not lmdb_env.is_open(store_path / "chunks")
    compact(store_path)


def test_a_second_open_with_a_larger_map_grows_it_and_a_smaller_keeps_it(tmp_path: Path) -> None:
    first = LmdbBackend(tmp_path / "env", map_size=1 << 20)
    larger = LmdbBackend(tmp_path / "env", map_size=1 << 24)
    smaller = LmdbBackend(tmp_path / "env", map_size=1 << 20)
    try:
        assert first.map_size == larger.map_size == smaller.map_size == 1 << 24
        key = bytes(32)
        smaller.put_many(Namespace.OBJECTS, [(key, bytes(4 << 20))])  # more than 1 MiB
        assert first.get(Namespace.OBJECTS, key) == bytes(4 << 20)
    finally:
        for backend in (first, larger, smaller):
            backend.close()


def test_dcp_by_checkpoint_id_while_a_store_is_open(store_path: Path) -> None:
    state = {"w": torch.randn(40, 8, generator=torch.Generator().manual_seed(1)), "epoch": 3}
    with castore.open(store_path, chunk_size=TEST_CHUNK_SIZE) as store:
        writer = CastoreWriter.from_checkpoint_id(f"castore://{store_path}/r", step=5)
        dcp.save(state, storage_writer=writer, no_dist=True)
        assert writer.generation is not None
        # The writer closed its own handle after each step; the Store's still works.
        assert store.generations("r") == [writer.generation]
        target = {"w": torch.zeros(40, 8), "epoch": 0}
        reader = CastoreReader.from_checkpoint_id(f"castore://{store_path}/r@1")
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert torch.equal(target["w"], state["w"]) and target["epoch"] == 3
        assert torch.equal(store.load("r", framework="torch")["t"]["w"], state["w"])
        dcp.save(
            state, storage_writer=CastoreWriter(str(store_path), run="r", step=6), no_dist=True
        )
        assert [g.id for g in store.generations("r")] == [1, 2]
        assert verify_store(store, deep=True).ok


def test_two_handles_save_different_runs_from_two_threads(
    store_path: Path, make_state: StateFactory
) -> None:
    first, second = open_twice(store_path)
    failures: list[BaseException] = []
    start = threading.Barrier(2)

    def save_steps(store: castore.Store, run: str, seed: int) -> None:
        try:
            start.wait()
            for step in range(1, 6):
                store.save(make_state(seed + step), run=run, step=step)
        except BaseException as exc:  # reported below, on the test's thread
            failures.append(exc)

    threads = [
        threading.Thread(target=save_steps, args=(first, "left", 0)),
        threading.Thread(target=save_steps, args=(second, "right", 100)),
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not failures, failures
        for run, seed in (("left", 0), ("right", 100)):
            assert [g.id for g in first.generations(run)] == [1, 2, 3, 4, 5]
            for step in range(1, 6):
                assert_state_equal(second.load(run, step), make_state(seed + step))
        assert verify_store(first, deep=True).ok
    finally:
        first.close()
        second.close()


def test_compact_while_this_process_has_the_store_open_refuses_and_loses_nothing(
    store_path: Path, make_state: StateFactory
) -> None:
    first, second = open_twice(store_path)
    first.save(make_state(1), run="r", step=1)
    first.save(make_state(2), run="r", step=2)
    with pytest.raises(StoreLockedError, match="is open"):
        compact(store_path)
    first.close()
    with pytest.raises(StoreLockedError, match="is open"):  # one handle is still open
        compact(store_path)
    assert_state_equal(second.load("r", 1), make_state(1))
    second.close()
    compact(store_path)
    with castore.open(store_path) as store:
        assert_state_equal(store.load("r", 2), make_state(2))
        assert verify_store(store, deep=True).ok


def test_offline_operations_refuse_a_bare_backend_that_holds_no_open_lock(
    store_path: Path, make_state: StateFactory
) -> None:
    with castore.open(store_path, chunk_size=TEST_CHUNK_SIZE) as store:
        store.save(make_state(1), run="r", step=1)
    bare = LmdbBackend(store_path / "chunks")
    try:
        with pytest.raises(StoreLockedError, match="open in this process"):
            compact(store_path)
        with pytest.raises(StoreLockedError, match="open in this process"):
            rebuild_index(store_path)
    finally:
        bare.close()
    with castore.open(store_path) as store:
        assert_state_equal(store.load("r"), make_state(1))


def _in_a_child(work: Callable[[], str]) -> str:
    """Run ``work`` in a forked child; what it returned (or raised)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write_fd, work().encode())
        except BaseException as exc:
            os.write(write_fd, f"{type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as reader:
        reported = reader.read().decode()
    assert os.waitstatus_to_exitcode(status) == 0, reported
    return reported


def test_a_forked_child_opens_its_own_environment(
    store_path: Path, make_state: StateFactory
) -> None:
    with castore.open(store_path, chunk_size=TEST_CHUNK_SIZE) as store:
        store.save(make_state(1), run="parent", step=1)

    def save_in_child() -> str:
        with castore.open(store_path) as child:
            child.save(make_state(2), run="child", step=1)
            return f"saved {child.runs()}"

    assert _in_a_child(save_in_child) == "saved ['child', 'parent']"
    with castore.open(store_path) as store:
        assert_state_equal(store.load("child"), make_state(2))


def test_a_forked_child_never_reuses_the_environment_its_parent_holds(
    store_path: Path, make_state: StateFactory
) -> None:
    """LMDB cannot open it afresh in the child, and closing the inherited copy there would
    drop the parent's reader slots: the child gets a typed error, the parent goes on."""
    with castore.open(store_path, chunk_size=TEST_CHUNK_SIZE) as store:
        store.save(make_state(1), run="r", step=1)
        reading = store.backend._env.begin()  # type: ignore[attr-defined]
        try:

            def open_in_child() -> str:
                try:
                    castore.open(store_path)
                except StoreError as exc:
                    return f"refused: {exc}"
                return "opened"

            def use_inherited() -> str:
                try:
                    store.load("r")
                except StoreError as exc:
                    return f"refused: {exc}"
                return "used"

            refused = _in_a_child(open_in_child)
            assert refused.startswith("refused: ") and "forked" in refused, refused
            assert "spawn" in refused
            assert _in_a_child(use_inherited).startswith("refused: "), "used across fork"
            assert "no active readers" not in store.backend._env.readers()  # type: ignore[attr-defined]
        finally:
            reading.abort()
        store.save(make_state(2), run="r", step=2)
        assert_state_equal(store.load("r", 1), make_state(1))


def test_broken_control_without_sharing_the_second_open_fails(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registry that remembers nothing: the second open meets py-lmdb's refusal."""

    class Forgetful(dict[lmdb_env.Key, lmdb_env.SharedEnv]):
        def __setitem__(self, key: lmdb_env.Key, value: lmdb_env.SharedEnv) -> None:
            pass

    monkeypatch.setattr(lmdb_env, "_registry", Forgetful())
    first = castore.open(store_path)
    try:
        with pytest.raises(StoreError, match="already open in this process"):
            castore.open(store_path)
    finally:
        first.close()
