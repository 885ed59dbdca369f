"""The lock contract: shared/exclusive store lock, run locks, the open lock; timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from castore.errors import InvalidNameError, StoreLockedError
from castore.repo.base import LockHold, StoreLocks
from castore.testing.refs import BAD_NAMES

SHORT = 0.2  # seconds a refused waiter waits: long enough to see a wait, short enough to run
LONG = 10.0  # a waiter that must get the lock: generous on a loaded machine


def _on_thread(work: Callable[[], object]) -> object:
    """What ``work()`` returned or raised, run on another thread (another holder)."""
    outcome: list[object] = [None]

    def run() -> None:
        try:
            outcome[0] = work()
        except BaseException as exc:  # the caller inspects it
            outcome[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(LONG + 5)
    assert not thread.is_alive(), "the other holder never returned"
    return outcome[0]


class StoreLocksTests:
    """Subclass and override the ``locks`` fixture with a fresh StoreLocks."""

    @pytest.fixture
    def locks(self) -> StoreLocks:
        raise NotImplementedError("override the locks fixture to build the implementation")

    def _try_store(self, locks: StoreLocks, *, exclusive: bool, timeout: float = SHORT) -> object:
        def take() -> str:
            with locks.store_lock(exclusive=exclusive, timeout=timeout, busy="test: busy"):
                return "taken"

        return _on_thread(take)

    def test_exclusive_excludes_shared_and_exclusive(self, locks: StoreLocks) -> None:
        with locks.store_lock(exclusive=True, timeout=1, busy="test"):
            for exclusive in (False, True):
                refused = self._try_store(locks, exclusive=exclusive)
                assert isinstance(refused, StoreLockedError), refused
                assert "test: busy" in str(refused)

    def test_shared_admits_shared_and_excludes_exclusive(self, locks: StoreLocks) -> None:
        with locks.store_lock(exclusive=False, timeout=1, busy="test"):
            assert self._try_store(locks, exclusive=False) == "taken"
            assert isinstance(self._try_store(locks, exclusive=True), StoreLockedError)

    def test_a_timeout_waits_about_that_long_then_raises(self, locks: StoreLocks) -> None:
        with locks.store_lock(exclusive=True, timeout=1, busy="test"):
            started = time.monotonic()
            refused = self._try_store(locks, exclusive=True, timeout=0.5)
            waited = time.monotonic() - started
        assert isinstance(refused, StoreLockedError)
        assert 0.45 <= waited < 0.5 + LONG

    def test_a_waiter_gets_the_lock_when_it_is_released(self, locks: StoreLocks) -> None:
        got: list[object] = []
        with locks.store_lock(exclusive=True, timeout=1, busy="test"):
            waiter = threading.Thread(
                target=lambda: got.append(self._try_store(locks, exclusive=True, timeout=LONG))
            )
            waiter.start()
            time.sleep(SHORT)
            assert got == []  # still waiting
        waiter.join(LONG + 10)
        assert got == ["taken"]

    def test_the_lock_is_released_when_the_block_raises(self, locks: StoreLocks) -> None:
        with pytest.raises(RuntimeError):
            with locks.store_lock(exclusive=True, timeout=1, busy="test"):
                raise RuntimeError("inside")
        with locks.store_lock(exclusive=True, timeout=1, busy="test"):
            pass

    def test_a_run_lock_excludes_the_same_run_only(self, locks: StoreLocks) -> None:
        def take(run: str) -> object:
            def inner() -> str:
                with locks.run_lock(run, timeout=SHORT, busy=f"run {run} busy"):
                    return "taken"

            return _on_thread(inner)

        with locks.run_lock("a", timeout=1, busy="test"):
            refused = take("a")
            assert isinstance(refused, StoreLockedError) and "run a busy" in str(refused)
            assert take("b") == "taken"
        assert take("a") == "taken"

    def test_run_locks_refuse_invalid_names(self, locks: StoreLocks) -> None:
        for name in BAD_NAMES:
            with pytest.raises(InvalidNameError):
                with locks.run_lock(name, timeout=SHORT, busy="test"):
                    pass

    def test_the_run_lock_and_the_store_lock_are_independent(self, locks: StoreLocks) -> None:
        with locks.store_lock(exclusive=True, timeout=1, busy="test"):
            assert _on_thread(lambda: _run_lock_taken(locks, "a")) == "taken"

    def test_open_holds_shared_admit_each_other_and_refuse_exclusive(
        self, locks: StoreLocks
    ) -> None:
        first = locks.hold_open(busy="test")
        second = _on_thread(lambda: locks.hold_open(busy="test"))
        assert isinstance(second, LockHold), second
        refused = _on_thread(lambda: locks.hold_open(exclusive=True, busy="compacting: busy"))
        assert isinstance(refused, StoreLockedError) and "compacting: busy" in str(refused)
        first.release()
        second.release()
        exclusive = _on_thread(lambda: locks.hold_open(exclusive=True, busy="test"))
        assert isinstance(exclusive, LockHold), exclusive
        assert isinstance(_on_thread(lambda: locks.hold_open(busy="open: busy")), StoreLockedError)
        exclusive.release()
        exclusive.release()  # a second release does nothing
        locks.hold_open(exclusive=True, busy="test").release()

    def test_hold_open_does_not_wait(self, locks: StoreLocks) -> None:
        held = locks.hold_open(exclusive=True, busy="test")
        try:
            started = time.monotonic()
            refused = _on_thread(lambda: locks.hold_open(busy="test"))
            assert isinstance(refused, StoreLockedError)
            assert time.monotonic() - started < 2.0
        finally:
            held.release()


def _run_lock_taken(locks: StoreLocks, run: str) -> str:
    with locks.run_lock(run, timeout=SHORT, busy="test"):
        return "taken"
