"""The blob contract (castore.testing.BlobStoreTests) over memory and a shared directory.

The shared directory is a real directory under tmp_path, raced by threads in
the suite and, below, by real processes (spawned, as on other nodes, with no
shared memory), and killed mid-write with SIGKILL. A broken control shows the
race tests fail a swap that does not re-read the version under its lock.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import blake3
import blob_workers
import pytest
from _helpers import process_context

from castore.blob import MemoryBlobStore, PosixBlobStore, Version
from castore.errors import (
    LockLostError,
    StoreLockedError,
    UnsafeStoreFileError,
    UnsupportedBackendError,
)
from castore.testing import BlobStoreTests

WORKERS = Path(__file__).parent / "helpers" / "blob_workers.py"


class TestMemoryBlobs(BlobStoreTests):
    streamed_peak_limit = None  # it keeps each blob whole, by design

    @pytest.fixture
    def blobs(self) -> MemoryBlobStore:
        return MemoryBlobStore(list_page_size=7)


class TestPosixBlobs(BlobStoreTests):
    @pytest.fixture
    def blobs(self, tmp_path: Path) -> PosixBlobStore:
        return PosixBlobStore(tmp_path / "shared", stale_lock_after=30.0)


def test_a_memory_list_reads_in_pages() -> None:
    blobs = MemoryBlobStore(list_page_size=3)
    for i in range(10):
        blobs.create(f"n/{i}", b"")
    listing = blobs.list("n/")
    assert [next(listing) for _ in range(3)] == ["n/0", "n/1", "n/2"]
    blobs.create("n/25", b"")  # lands after the page already read: the next pages see it
    assert list(listing) == ["n/25", "n/3", "n/4", "n/5", "n/6", "n/7", "n/8", "n/9"]


# -- the shared directory: what lies on disk -------------------------------------------


def test_blobs_are_plain_files_and_versions_hash_their_bytes(tmp_path: Path) -> None:
    blobs = PosixBlobStore(tmp_path)
    version = blobs.swap("refs/main", b"ref bytes", None)
    assert (tmp_path / "refs" / "main").read_bytes() == b"ref bytes"
    assert version == Version("blake3:" + blake3.blake3(b"ref bytes").hexdigest())
    assert sorted(p.name for p in (tmp_path / "refs").iterdir()) == ["main"]  # no temp, no lock


def test_temp_lock_and_foreign_entries_are_never_listed(tmp_path: Path) -> None:
    blobs = PosixBlobStore(tmp_path)
    blobs.create("packs/a.pack", b"a")
    for debris in (".a.pack.0123456789abcdef.tmp", ".a.pack.lock", "with space", "-dash"):
        (tmp_path / "packs" / debris).write_bytes(b"debris")
    os.mkfifo(tmp_path / "packs" / "fifo")
    os.symlink(tmp_path / "packs" / "a.pack", tmp_path / "packs" / "link")
    assert list(blobs.list()) == ["packs/a.pack"]


def test_a_symlinked_directory_is_refused_and_nothing_lands_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    root = tmp_path / "shared"
    blobs = PosixBlobStore(root)
    os.symlink(outside, root / "evil")
    with pytest.raises(UnsafeStoreFileError, match="symlink"):
        blobs.create("evil/x", b"payload")
    with pytest.raises(UnsafeStoreFileError):
        blobs.swap("evil/secret", b"payload", None)
    with pytest.raises(UnsafeStoreFileError):
        blobs.get("evil/secret")
    with pytest.raises(UnsafeStoreFileError):
        blobs.delete("evil/secret")
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_bytes() == b"secret"
    assert list(blobs.list()) == []


def test_a_symlink_or_pipe_in_place_of_a_blob_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "target"
    outside.write_bytes(b"not yours")
    root = tmp_path / "shared"
    blobs = PosixBlobStore(root)
    os.symlink(outside, root / "link")
    os.mkfifo(root / "pipe")
    for name in ("link", "pipe"):
        for attempt in (
            lambda n=name: blobs.get(n),
            lambda n=name: blobs.head(n),
            lambda n=name: blobs.read_versioned(n),
            lambda n=name: blobs.create(n, b"x"),
            lambda n=name: blobs.swap(n, b"x", None),
            lambda n=name: blobs.delete(n),
        ):
            with pytest.raises(UnsafeStoreFileError):
                attempt()  # and promptly: a pipe is never opened for reading
    assert outside.read_bytes() == b"not yours"
    assert (root / "link").is_symlink()


# -- the shared directory: locks -----------------------------------------------------


def _kill_at(point: str, root: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    env["CASTORE_FAULTS"] = f"{point}=kill"
    killed = subprocess.run(
        [sys.executable, str(WORKERS), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr


def test_a_create_killed_before_its_link_leaves_no_blob(tmp_path: Path) -> None:
    _kill_at("blob.create_before_link", tmp_path, "create", str(tmp_path), "packs/p", "bytes")
    blobs = PosixBlobStore(tmp_path)
    assert blobs.head("packs/p") is None and list(blobs.list()) == []
    (debris,) = list((tmp_path / "packs").iterdir())
    assert debris.name.startswith(".p.") and debris.name.endswith(".tmp")
    assert debris.read_bytes() == b"bytes"  # synced whole, just never named
    blobs.create("packs/p", b"again")
    assert blobs.get("packs/p") == b"again"


def test_a_lock_left_by_a_killed_swap_is_broken_after_the_timeout(tmp_path: Path) -> None:
    blobs = PosixBlobStore(tmp_path, stale_lock_after=0.5, lock_wait=0.2)
    first = blobs.swap("refs/r", b"before", None)
    _kill_at("blob.swap_before_rename", tmp_path, "swap", str(tmp_path), "refs/r", "never")
    assert (tmp_path / "refs" / ".r.lock").exists()
    assert blobs.read_versioned("refs/r") == (b"before", first)  # the kill published nothing
    # A waiter that gives up before the timeout is refused, naming the dead holder.
    with pytest.raises(StoreLockedError, match=r"locked by .*:\d+:"):
        blobs.swap("refs/r", b"after", first)
    patient = PosixBlobStore(tmp_path, stale_lock_after=0.5)
    started = time.monotonic()
    second = patient.swap("refs/r", b"after", first)
    assert time.monotonic() - started >= 0.5
    assert patient.read_versioned("refs/r") == (b"after", second)
    assert sorted(p.name for p in (tmp_path / "refs").iterdir() if p.name.endswith("lock")) == []
    assert list(patient.list()) == ["refs/r"]


def test_a_live_holder_is_not_broken_before_the_timeout(tmp_path: Path) -> None:
    blobs = PosixBlobStore(tmp_path, stale_lock_after=5.0)
    first = blobs.swap("refs/r", b"one", None)
    entered, leave = threading.Event(), threading.Event()

    class Slow(PosixBlobStore):
        def _recheck(self, dir_fd: int, leaf: str, name: str, expected: Version | None) -> None:
            entered.set()
            leave.wait(30)
            super()._recheck(dir_fd, leaf, name, expected)

    holder = threading.Thread(
        target=lambda: Slow(tmp_path, stale_lock_after=5.0).swap("refs/r", b"slow", first)
    )
    holder.start()
    try:
        assert entered.wait(30)
        waiter = PosixBlobStore(tmp_path, stale_lock_after=5.0, lock_wait=0.5)
        with pytest.raises(StoreLockedError):
            waiter.swap("refs/r", b"waiter", first)
    finally:
        leave.set()
        holder.join(30)
    assert blobs.get("refs/r") == b"slow"


def test_a_holder_past_half_its_timeout_writes_nothing(tmp_path: Path) -> None:
    blobs = PosixBlobStore(tmp_path, stale_lock_after=0.4)
    first = blobs.swap("refs/r", b"one", None)

    class Stalls(PosixBlobStore):
        def _recheck(self, dir_fd: int, leaf: str, name: str, expected: Version | None) -> None:
            super()._recheck(dir_fd, leaf, name, expected)
            time.sleep(0.3)  # past 0.2 s, half the timeout: a waiter could break it soon

    with pytest.raises(LockLostError, match="nothing was written"):
        Stalls(tmp_path, stale_lock_after=0.4).swap("refs/r", b"late", first)
    assert blobs.read_versioned("refs/r") == (b"one", first)
    blobs.swap("refs/r", b"two", first)  # the lock was released


def test_a_holder_whose_lock_was_broken_writes_nothing(tmp_path: Path) -> None:
    blobs = PosixBlobStore(tmp_path, stale_lock_after=30.0)
    first = blobs.swap("refs/r", b"one", None)
    lock = tmp_path / "refs" / ".r.lock"

    class Robbed(PosixBlobStore):
        def _recheck(self, dir_fd: int, leaf: str, name: str, expected: Version | None) -> None:
            super()._recheck(dir_fd, leaf, name, expected)
            lock.unlink()  # as a waiter breaking it would, then taking it itself
            lock.write_bytes(b'{"owner": "another:1:1", "token": "theirs", "acquired": 0}')

    with pytest.raises(LockLostError, match="broken"):
        Robbed(tmp_path, stale_lock_after=30.0).swap("refs/r", b"robbed", first)
    assert blobs.read_versioned("refs/r") == (b"one", first)
    assert lock.exists()  # the other holder's lock is left alone


# -- the shared directory: real processes racing ---------------------------------------

PROCESSES = 4
ROUNDS = 50


def _race_processes(root: Path, *, broken: bool = False) -> list[tuple[int, int, bool, bool, str]]:
    PosixBlobStore(root).swap("race/ref", b"start", None)
    processes = process_context()
    barrier, results = processes.Barrier(PROCESSES), processes.Queue()
    racers = [
        processes.Process(
            target=blob_workers.race, args=(str(root), i, ROUNDS, barrier, results, broken)
        )
        for i in range(PROCESSES)
    ]
    for racer in racers:
        racer.start()
    try:
        outcomes = [results.get(timeout=240) for _ in range(PROCESSES * ROUNDS)]
    finally:
        for racer in racers:
            racer.join(60)
            if racer.is_alive():
                racer.kill()
    assert [racer.exitcode for racer in racers] == [0] * PROCESSES
    return outcomes


def _check_rounds(root: Path, outcomes: list[tuple[int, int, bool, bool, str]]) -> None:
    blobs = PosixBlobStore(root)
    creates = Counter(o[0] for o in outcomes if o[2])
    swaps = Counter(o[0] for o in outcomes if o[3])
    assert creates == Counter(range(ROUNDS)), f"create winners per round: {creates}"
    assert swaps == Counter(range(ROUNDS)), f"swap winners per round: {swaps}"
    previous = b"start"
    for round_ in range(ROUNDS):
        mine = [o for o in outcomes if o[0] == round_]
        (creator,) = [o[1] for o in mine if o[2]]
        (swapper,) = [o[1] for o in mine if o[3]]
        assert blobs.get(f"race/create-{round_}") == f"{creator}".encode()
        # Every racer read the winner of the round before, and nothing else.
        assert {o[4] for o in mine} == {"blake3:" + blake3.blake3(previous).hexdigest()}
        previous = f"{round_}:{swapper}".encode()
    assert blobs.get("race/ref") == previous


@pytest.mark.slow
def test_processes_racing_on_a_shared_directory_one_winner_each_round(tmp_path: Path) -> None:
    _check_rounds(tmp_path, _race_processes(tmp_path))


# -- broken control ------------------------------------------------------------------


def test_the_race_tests_fail_a_swap_that_skips_the_recheck(tmp_path: Path) -> None:
    suite = BlobStoreTests()
    with pytest.raises(AssertionError) as failed:
        suite.test_racing_swaps_from_one_version_exactly_one_wins(
            blob_workers.SkipsRecheck(tmp_path / "threads")
        )
    print(f"threads: {str(failed.value).splitlines()[0]}")
    suite.test_racing_swaps_from_one_version_exactly_one_wins(PosixBlobStore(tmp_path / "sound"))

    outcomes = _race_processes(tmp_path / "processes", broken=True)
    with pytest.raises(AssertionError) as failed:
        _check_rounds(tmp_path / "processes", outcomes)
    print(f"processes: {str(failed.value).splitlines()[0]}")


def test_a_broken_create_would_fail_too(tmp_path: Path) -> None:
    """A create that replaces instead of linking lets every racer 'win'."""

    class Replaces(PosixBlobStore):
        def _link(self, dir_fd: int, temp: str, leaf: str, name: str) -> bool:
            os.rename(temp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return True

    with pytest.raises(AssertionError):
        BlobStoreTests().test_racing_creates_exactly_one_wins(Replaces(tmp_path))
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        BlobStoreTests().test_a_second_create_raises_and_keeps_the_first(Replaces(tmp_path / "b"))


def test_a_filesystem_without_hard_links_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    blobs = PosixBlobStore(tmp_path)
    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(UnsupportedBackendError, match="cannot make hard links") as refused:
        blobs.create("packs/p", b"x")
    assert "\n" not in str(refused.value)
    monkeypatch.undo()
    assert list(blobs.list()) == [] and list((tmp_path / "packs").iterdir()) == []
