"""The repository contract suites (castore.testing) over every implementation.

Local parts run on a real store directory under tmp_path (real files, real
``flock``); memory parts in this process. The store lock of a store on blobs
runs the suite with every taker a separate handle (another node: only the
store lease blobs keep them apart), on memory blobs, a shared directory and
S3 (moto on the loopback).
A broken control at the end shows the compare-and-swap tests fail for a ref
table that ignores ``expected``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from castore.blob import MemoryBlobStore, PosixBlobStore
from castore.blob.base import BlobStore
from castore.errors import RefConflictError, UnsupportedOperationError
from castore.format.hashing import Digest
from castore.repo.base import AroundSwap, RefTable
from castore.repo.blobs import BlobStoreLocks
from castore.repo.local import LocalLocks, LocalRefTable, LocalTagTable, RefStore
from castore.repo.localreflog import LocalReflog
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


# -- store leases: each store-lock taker another node -----------------------------


class EachStoreLockANewNode(BlobStoreLocks):
    """Every store lock taken through a new BlobStoreLocks on the same blobs (a node each)."""

    def __init__(self, blobs: BlobStore) -> None:
        super().__init__(blobs, store_lease=30.0)
        self.blobs = blobs

    def store_lock(
        self, *, exclusive: bool, timeout: float, busy: str
    ) -> AbstractContextManager[None]:
        return self._on_a_new_node(exclusive, timeout, busy)

    @contextmanager
    def _on_a_new_node(self, exclusive: bool, timeout: float, busy: str) -> Iterator[None]:
        node = BlobStoreLocks(self.blobs, store_lease=30.0)
        with node.store_lock(exclusive=exclusive, timeout=timeout, busy=busy):
            yield


try:
    import s3_server
except pytest.skip.Exception:  # boto3 or moto is not installed: the S3 case skips
    s3_server = None


class TestStoreLeasesAcrossNodes(StoreLocksTests):
    @pytest.fixture(params=["memory", "posix", "s3"])
    def locks(self, request: pytest.FixtureRequest, tmp_path: Path) -> BlobStoreLocks:
        if request.param == "memory":
            return EachStoreLockANewNode(MemoryBlobStore(list_page_size=7))
        if request.param == "posix":
            return EachStoreLockANewNode(PosixBlobStore(tmp_path / "shared"))
        if s3_server is None:
            pytest.skip("boto3 and moto are needed for the S3 case")
        from castore.blob.s3 import S3BlobStore

        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        return EachStoreLockANewNode(
            S3BlobStore(bucket, "locks", **s3_server.store_arguments(endpoint))
        )


def test_the_lease_suite_fails_nodes_that_share_no_lease() -> None:
    """Broken control: nodes with only in-process locks do not exclude each other."""

    class NoLeases(EachStoreLockANewNode):
        @contextmanager
        def _on_a_new_node(self, exclusive: bool, timeout: float, busy: str) -> Iterator[None]:
            with BlobStoreLocks().store_lock(exclusive=exclusive, timeout=timeout, busy=busy):
                yield

    suite = StoreLocksTests()
    with pytest.raises(AssertionError):
        suite.test_exclusive_excludes_shared_and_exclusive(NoLeases(MemoryBlobStore()))
    suite.test_exclusive_excludes_shared_and_exclusive(EachStoreLockANewNode(MemoryBlobStore()))


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
