"""The repository contract suites (castore.testing) over every implementation.

Local parts run on a real store directory under tmp_path (real files, real
``flock``); memory parts in this process. A broken control at the end shows
the compare-and-swap tests fail for a ref table that ignores ``expected``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from castore.errors import RefConflictError, UnsupportedOperationError
from castore.hashing import Digest
from castore.repo.base import AroundSwap, RefTable
from castore.repo.local import LocalLocks, LocalReflog, LocalRefTable, LocalTagTable, RefStore
from castore.repo.memory import (
    MemoryLocks,
    MemoryReflog,
    MemoryRefStore,
    MemoryRefTable,
    MemoryTagTable,
)
from castore.repo.records import DEFAULT_LOCK_TIMEOUT, RefValue, run_lock_busy
from castore.testing import ReflogTests, RefTableTests, StoreLocksTests, TagTableTests

# -- local directory --------------------------------------------------------------


class TestLocalRefTable(RefTableTests):
    @pytest.fixture
    def refs(self, tmp_path: Path) -> RefTable:
        return LocalRefTable(tmp_path, LocalLocks(tmp_path))


class TestLocalReflog(ReflogTests):
    @pytest.fixture
    def reflog(self, tmp_path: Path) -> LocalReflog:
        return LocalReflog(tmp_path)


class TestLocalReflogReadByANewHandle(ReflogTests):
    """Every read by a handle that has parsed nothing yet: the file, not a kept view."""

    @pytest.fixture
    def reflog(self, tmp_path: Path) -> LocalReflog:
        class Forgetful(LocalReflog):
            def view(self, run: str, *, fresh: bool = False):  # type: ignore[no-untyped-def]
                return LocalReflog(tmp_path).view(run, fresh=fresh)

            def records_backwards(self, run: str):  # type: ignore[no-untyped-def]
                return LocalReflog(tmp_path).records_backwards(run)

        return Forgetful(tmp_path)


class TestLocalTagTable(TagTableTests):
    @pytest.fixture
    def tags(self, tmp_path: Path) -> LocalTagTable:
        return LocalTagTable(tmp_path)


class TestLocalLocks(StoreLocksTests):
    @pytest.fixture
    def locks(self, tmp_path: Path) -> LocalLocks:
        return LocalLocks(tmp_path)


class TestLocalRefStoreParts(RefTableTests):
    """The parts as RefStore composes them (the ref table shares the locks part)."""

    @pytest.fixture
    def refs(self, tmp_path: Path) -> RefTable:
        return RefStore(tmp_path).parts.refs


# -- memory -----------------------------------------------------------------------


class TestMemoryRefTable(RefTableTests):
    @pytest.fixture
    def refs(self) -> RefTable:
        return MemoryRefTable(MemoryLocks())


class TestMemoryReflog(ReflogTests):
    @pytest.fixture
    def reflog(self) -> MemoryReflog:
        return MemoryReflog()


class TestMemoryTagTable(TagTableTests):
    @pytest.fixture
    def tags(self) -> MemoryTagTable:
        return MemoryTagTable()


class TestMemoryLocks(StoreLocksTests):
    @pytest.fixture
    def locks(self) -> MemoryLocks:
        return MemoryLocks()


def test_a_memory_refstore_refuses_what_needs_a_directory_in_one_line() -> None:
    refs = MemoryRefStore()
    with pytest.raises(UnsupportedOperationError, match="not supported by the in-memory") as e:
        refs.reflog_path("r")
    assert isinstance(e.value, NotImplementedError) and "\n" not in str(e.value)
    assert refs.reflog_location("r") == "the in-memory reflog of run 'r'"


def test_a_local_refstore_names_its_reflog_file(tmp_path: Path) -> None:
    refs = RefStore(tmp_path)
    assert refs.reflog_path("r") == tmp_path / "logs" / "r.reflog"
    assert refs.reflog_location("r") == str(tmp_path / "logs" / "r.reflog")


# -- broken control -----------------------------------------------------------------


class IgnoresExpected(MemoryRefTable):
    """A ref table whose advance forgets the compare: it swaps whatever the ref names."""

    def advance(
        self,
        run: str,
        *,
        expected: Digest | None,
        new: RefValue,
        around: AroundSwap | None = None,
        timeout: float = DEFAULT_LOCK_TIMEOUT,
    ) -> RefValue | None:
        with self.locks.run_lock(run, timeout=timeout, busy=run_lock_busy(run, timeout)):
            current = self.read(run)
            if current is not None and new.generation <= current.generation:
                raise RefConflictError("generation ids must increase", run=run)
            self._refs[run] = new
            return current


def test_the_ref_contract_fails_a_table_that_ignores_expected() -> None:
    suite = RefTableTests()
    for check in (
        suite.test_racing_advances_from_one_expected_value_exactly_one_wins,
        suite.test_a_conflicting_expected_value_raises_and_leaves_the_ref,
    ):
        # A failed check raises AssertionError, or pytest's Failed for a missing raise.
        with pytest.raises((AssertionError, pytest.fail.Exception)) as failed:
            check(IgnoresExpected(MemoryLocks()))
        print(f"{check.__name__}: {failed.type.__name__}: {str(failed.value).splitlines()[0]}")
        check(MemoryRefTable(MemoryLocks()))  # the sound table passes the same check
