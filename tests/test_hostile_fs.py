"""A store from an untrusted source, a full disk, and ranks creating one store at once.

Real parts throughout: a real LMDB environment on disk, real symlinks and
named pipes (``os.symlink``/``os.mkfifo``), real subprocesses wherever the
old failure was a hang, and real racing processes for store creation. A full
disk is injected by replacing ``os.write``/``os.fsync`` for the one file under
test; everything else runs for real.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cli_runner
import numpy as np
import pytest
from _helpers import assert_state_equal, process_context
from cli_runner import clean_env

import castore
import castore.chunkstore.lmdb.backend as lmdb_backend
import castore.opening.directory as opening
from castore.errors import (
    CastoreError,
    NotAStoreError,
    StoreError,
    StoreFullError,
    UnsafeStoreFileError,
)
from castore.gc import RetentionPolicy, collect_garbage, tag, untag
from castore.repo.records import ReflogWarning
from castore.repo.reffile import DurabilityWarning
from castore.verify import verify_store

RUN = "a"
CHUNK = 1024


def state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(3 * CHUNK // 8), "step": seed}


@pytest.fixture(scope="module")
def base_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run ``a`` with generations 1-3 and tag ``best`` on 1."""
    path = tmp_path_factory.mktemp("hostile") / "store"
    with castore.open(path, chunk_size=CHUNK) as store:
        for seed in (1, 2, 3):
            store.save(state(seed), run=RUN, step=seed)
        tag(store, RUN, 1, "best")
    return path


@pytest.fixture
def store_path(base_store: Path, tmp_path: Path) -> Path:
    """A private copy of ``base_store`` that a test may damage."""
    return Path(shutil.copytree(base_store, tmp_path / "store"))


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the store: nothing castore does may change it."""
    path = tmp_path / "outside"
    path.mkdir()
    return path


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file below ``directory``: relative path -> (bytes, mtime_ns)."""
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found[str(path.relative_to(directory))] = (path.read_bytes(), path.stat().st_mtime_ns)
    return found


def a_pack(store_path: Path) -> str:
    """The newest pack: it holds the chunks of the latest generation."""
    packs = (store_path / "chunks/packs").iterdir()
    return "chunks/packs/" + max(packs, key=lambda p: p.lstat().st_mtime_ns).name


def swap_for_symlink(store_path: Path, entry: str, outside: Path, *, dangling: bool) -> Path:
    """Replace ``entry`` with a symlink to a copy outside (or to a name not there yet)."""
    inside = store_path / entry
    target = outside / entry.replace("/", "_")
    if not dangling:
        if inside.is_dir():
            shutil.copytree(inside, target)
        else:
            shutil.copyfile(inside, target)
    if inside.is_dir():
        shutil.rmtree(inside)
    else:
        inside.unlink(missing_ok=True)
    os.symlink(target, inside)
    return target


# -- what a caller does with the store --------------------------------------------


def open_and_load(path: Path) -> None:
    with castore.open(path, create=False) as store:
        store.load(RUN)


def save(path: Path) -> None:
    with castore.open(path, create=False) as store:
        store.save(state(9), run=RUN, step=9)


def collect(path: Path) -> None:
    with castore.open(path, create=False) as store:
        collect_garbage(store, RetentionPolicy(keep_last=1))


def tag_one(path: Path) -> None:
    with castore.open(path, create=False) as store:
        tag(store, RUN, 2, "second")


def untag_best(path: Path) -> None:
    with castore.open(path, create=False) as store:
        untag(store, RUN, "best")


SYMLINKED: list[tuple[str, bool, Callable[[Path], None]]] = [
    # (entry, dangling target, operation): an entry LMDB or castore would follow.
    ("chunks/lock.mdb", False, open_and_load),  # LMDB writes its lock table into it
    ("chunks/data.mdb", False, open_and_load),
    ("chunks", False, open_and_load),
    ("chunks/packs", False, open_and_load),
    ("castore.json", False, open_and_load),
    ("locks/open.lock", True, open_and_load),  # would create a file outside
    ("locks/store.lock", True, save),
    ("locks/a.lock", True, save),
    ("refs/a", False, open_and_load),
    ("refs/a", False, save),
    ("refs", False, open_and_load),
    ("logs/a.reflog", False, save),  # an append through it would write outside
    ("logs/a.reflog", False, collect),
    ("logs", False, save),
    ("tags", False, tag_one),
    ("tags/a", False, tag_one),
    ("tags/a", False, untag_best),  # an unlink through it would delete outside
    ("tags/a/best", False, collect),
    ("PACK", False, open_and_load),
]


@pytest.mark.parametrize(
    ("entry", "dangling", "operation"),
    SYMLINKED,
    ids=[f"{e}-{op.__name__}" for e, _, op in SYMLINKED],
)
def test_a_symlinked_store_entry_is_refused_and_nothing_outside_changes(
    store_path: Path,
    outside: Path,
    entry: str,
    dangling: bool,
    operation: Callable[[Path], None],
) -> None:
    entry = a_pack(store_path) if entry == "PACK" else entry
    target = swap_for_symlink(store_path, entry, outside, dangling=dangling)
    before = snapshot(outside)
    with pytest.raises(UnsafeStoreFileError, match="symlink") as info:
        operation(store_path)
    assert entry.split("/")[-1] in str(info.value)  # names the path
    assert snapshot(outside) == before  # no byte, no mtime changed outside
    assert target.exists() != dangling  # nothing created through a dangling link


def test_broken_control_lmdb_writes_through_a_symlinked_lock_file_without_the_check(
    store_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: with the pre-open check removed, the outside file changes."""
    target = outside / "victim"
    target.write_bytes(b"precious" * 1024)
    (store_path / "chunks/lock.mdb").unlink()
    os.symlink(target, store_path / "chunks/lock.mdb")
    before = snapshot(outside)

    def no_checks(path: Path, *, create: bool = True) -> int:  # what LmdbBackend did before
        return (path / "data.mdb").stat().st_size

    monkeypatch.setattr(lmdb_backend, "_check_environment_files", no_checks)
    open_and_load(store_path)
    assert snapshot(outside) != before


def test_verify_refuses_a_symlinked_pack_and_gc_leaves_it(store_path: Path, outside: Path) -> None:
    """A verify reports the unsafe entry as a problem without following it; gc never
    opens a pack it keeps and never deletes what the link points at."""
    target = swap_for_symlink(store_path, a_pack(store_path), outside, dangling=False)
    before = snapshot(outside)
    with castore.open(store_path, create=False) as store:
        report = verify_store(store, deep=True)
        assert not report.ok and any("symlink" in p.what for p in report.problems), report
        try:
            collect_garbage(store, RetentionPolicy(keep_last=1))
        except CastoreError:
            pass  # refusing is fine too: what matters is the target below
    assert snapshot(outside) == before and target.exists()


def test_the_store_root_itself_may_be_a_symlink(store_path: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    os.symlink(store_path, link)
    with castore.open(link, create=False) as store:
        assert_state_equal(store.load(RUN), state(3))
        store.save(state(4), run=RUN, step=4)


# -- named pipes: a typed error, never a hang ------------------------------------


def run_python(code: str, store_path: Path) -> subprocess.CompletedProcess[str]:
    program = (
        "import sys, castore\n"
        "from castore.errors import CastoreError\n"
        f"path = {str(store_path)!r}\n"
        "try:\n"
        f"    {code}\n"
        "except CastoreError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "    sys.exit(1)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=20, env=clean_env()
    )


def run_cli(*args: object) -> subprocess.CompletedProcess[str]:
    return cli_runner.run_cli(*args, env=clean_env(), timeout=20)


def swap_for_fifo(store_path: Path, entry: str) -> None:
    (store_path / entry).unlink()
    os.mkfifo(store_path / entry)


LOAD = "castore.open(path, create=False).load('a')"
SAVE = "castore.open(path, create=False).save({'x': 1}, run='a', step=9)"
FIFO_PYTHON = [
    ("PACK", LOAD),
    ("refs/a", LOAD),
    ("castore.json", LOAD),
    ("logs/a.reflog", SAVE),
    ("locks/a.lock", SAVE),
]


@pytest.mark.parametrize(("entry", "code"), FIFO_PYTHON, ids=[e for e, _ in FIFO_PYTHON])
def test_a_named_pipe_fails_a_load_or_save_with_a_typed_error(
    store_path: Path, entry: str, code: str
) -> None:
    entry = a_pack(store_path) if entry == "PACK" else entry
    swap_for_fifo(store_path, entry)
    done = run_python(code, store_path)  # a hang fails here, by TimeoutExpired
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("UnsafeStoreFileError") and "named pipe" in done.stdout


FIFO_CLI = [
    ("refs/a", "log"),
    ("refs/a", "gc"),
    ("logs/a.reflog", "log"),
    ("logs/a.reflog", "gc"),
    ("castore.json", "verify"),
    ("tags/a/best", "gc"),
    ("tags/a/best", "log"),
]


@pytest.mark.parametrize(("entry", "command"), FIFO_CLI, ids=[f"{e}-{c}" for e, c in FIFO_CLI])
def test_a_named_pipe_makes_the_cli_exit_1_with_one_line(
    store_path: Path, entry: str, command: str
) -> None:
    swap_for_fifo(store_path, entry)
    policy = ["--keep", "3"] if command == "gc" else []  # off a terminal, gc needs one
    done = run_cli(command, store_path, *policy)  # a hang fails here, by TimeoutExpired
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("castore: error: UnsafeStoreFileError")
    assert "named pipe" in lines[0]


def test_the_cli_on_a_named_pipe_pack_refuses_or_skips_it_and_never_hangs(
    store_path: Path,
) -> None:
    pack = store_path / a_pack(store_path)
    swap_for_fifo(store_path, a_pack(store_path))
    verify = run_cli("verify", "--deep", store_path)
    assert verify.returncode == 1 and "Traceback" not in verify.stderr
    assert "named pipe" in verify.stdout + verify.stderr  # reported, never read from
    gc = run_cli("gc", "--keep", "1", store_path)  # never opens the pipe: returns at once
    assert gc.returncode in (0, 1) and "Traceback" not in gc.stderr, gc.stderr
    assert pack.is_fifo()


# -- a full disk ----------------------------------------------------------------


def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture
def fail_writes(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[str]]:
    """Make ``os.write`` (or ``os.fsync``) fail with ``code`` for files whose path has
    ``part`` (or ends with it: ``whole``)."""

    def install(
        part: str, code: int = errno.ENOSPC, call: str = "write", *, whole: bool = False
    ) -> list[str]:
        real = getattr(os, call)
        hits: list[str] = []

        def failing(fd: int, *args: Any) -> Any:
            path = fd_path(fd)
            if path.endswith(part) if whole else part in path:
                hits.append(path)
                raise OSError(code, os.strerror(code))
            return real(fd, *args)

        monkeypatch.setattr(os, call, failing)
        return hits

    return install


def temp_files(store_path: Path) -> list[str]:
    return sorted(str(p.relative_to(store_path)) for p in store_path.rglob(".*.tmp"))


def test_a_full_disk_writing_the_ref_publishes_nothing_and_leaves_no_temp_file(
    store_path: Path, fail_writes: Callable[..., list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    with castore.open(store_path, create=False) as store:
        hits = fail_writes("/refs/.a.")
        with pytest.raises(StoreFullError, match="writing the ref of run 'a'") as info:
            store.save(state(4), run=RUN, step=4)
        monkeypatch.undo()
        assert hits and isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
        assert info.value.phase == "writing the ref of run 'a'"
        assert temp_files(store_path) == []
        assert [g.id for g in store.generations(RUN)] == [1, 2, 3]
        assert_state_equal(store.load(RUN), state(3))
        assert store.save(state(4), run=RUN, step=4).id == 4  # space came back


def test_an_io_error_syncing_the_ref_is_a_typed_store_error(
    store_path: Path, fail_writes: Callable[..., list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    with castore.open(store_path, create=False) as store:
        fail_writes("/refs/.a.", errno.EIO, "fsync")
        with pytest.raises(StoreError, match="writing the ref of run 'a'") as info:
            store.save(state(4), run=RUN, step=4)
        monkeypatch.undo()
        assert not isinstance(info.value, StoreFullError)
        assert temp_files(store_path) == []
        assert [g.id for g in store.generations(RUN)] == [1, 2, 3]


def test_a_failed_sync_of_the_refs_directory_after_the_rename_warns_not_raises(
    store_path: Path, fail_writes: Callable[..., list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers see the renamed ref at once: the save must not report failure."""
    with castore.open(store_path, create=False) as store:
        hits = fail_writes("/store/refs", errno.EIO, "fsync", whole=True)
        with pytest.warns(DurabilityWarning, match="may not survive a crash"):
            gen = store.save(state(4), run=RUN, step=4)
        monkeypatch.undo()
        assert hits and gen.id == 4 and store.resolve(RUN).id == 4
        assert store.refs.reflog(RUN)[-1]["generation"] == 4


def test_a_full_disk_appending_the_reflog_after_publishing_warns_and_the_next_save_repairs(
    store_path: Path, fail_writes: Callable[..., list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    reflog = store_path / "logs" / "a.reflog"
    with castore.open(store_path, create=False) as store:
        size = reflog.stat().st_size
        fail_writes("a.reflog")
        with pytest.warns(ReflogWarning, match="generation 4 of run 'a' is published"):
            gen = store.save(state(4), run=RUN, step=4)  # success: readers see it
        monkeypatch.undo()
        assert gen.id == 4 and store.resolve(RUN).id == 4
        assert_state_equal(store.load(RUN), state(4))
        assert reflog.stat().st_size == size  # no torn record left behind
        assert 4 not in [r["generation"] for r in store.refs.reflog(RUN)]
        store.save(state(5), run=RUN, step=5)
        records = [(r["action"], r["generation"]) for r in store.refs.reflog(RUN)]
        assert records[-2:] == [("recovered", 4), ("advance", 5)]
        assert store.refs.read_reflog(RUN)[1] == []  # no damaged line


def test_short_writes_never_tear_a_ref_or_a_reflog_record(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write

    def short_write(fd: int, data: Any) -> int:
        return real_write(fd, memoryview(data)[:7])  # legal: write may write less

    with castore.open(store_path, create=False) as store:
        monkeypatch.setattr(os, "write", short_write)
        store.save(state(4), run=RUN, step=4)
        tag(store, RUN, 4, "four")
        monkeypatch.undo()
        assert store.refs.read(RUN) is not None and store.refs.read(RUN).generation == 4
        assert store.refs.tags(RUN)["four"].generation == 4
        records, damaged = store.refs.read_reflog(RUN)
        assert damaged == [] and records[-1]["generation"] == 4


def test_a_full_disk_writing_a_tag_raises_and_leaves_no_temp_file(
    store_path: Path, fail_writes: Callable[..., list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    with castore.open(store_path, create=False) as store:
        fail_writes("/tags/a/.")
        with pytest.raises(StoreFullError, match="writing tag 'second' of run 'a'"):
            tag(store, RUN, 2, "second")
        monkeypatch.undo()
        assert temp_files(store_path) == [] and set(store.refs.tags(RUN)) == {"best"}


def test_a_full_disk_creating_the_store_marker_is_typed(
    tmp_path: Path, fail_writes: Callable[..., list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_writes("castore.json", errno.EDQUOT)
    with pytest.raises(StoreFullError, match="creating the store marker"):
        castore.open(tmp_path / "new")
    monkeypatch.undo()
    assert list((tmp_path / "new").iterdir()) == []
    with castore.open(tmp_path / "new") as store:  # space came back
        store.save(state(1), run=RUN, step=1)


def test_a_full_disk_writing_a_pack_is_store_full(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, buffers: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with castore.open(store_path, create=False) as store:
        packs = sorted((store_path / "chunks/packs").iterdir())
        monkeypatch.setattr(os, "writev", full)
        with pytest.raises(StoreFullError, match="cannot write a chunk pack") as info:
            store.save(state(4), run=RUN, step=4)
        monkeypatch.undo()
        assert info.value.phase == "writing a chunk pack"
        assert sorted((store_path / "chunks/packs").iterdir()) == packs


# -- creating a store: racing ranks, a grown map, the marker's chunk size ---------


def _open_rounds(
    root: str, rounds: int, barrier: Any, results: Any, rank: int
) -> None:  # pragma: no cover - runs in a child process
    for round_ in range(rounds):
        path = Path(root) / f"r{round_}"
        barrier.wait()
        try:
            with castore.open(path, chunk_size=CHUNK + round_ % 2) as store:
                outcome = f"ok {store.chunk_size}"
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            outcome = f"{type(exc).__name__}: {exc}"
        results.put((round_, rank, outcome))


def test_ranks_creating_one_store_at_once_all_open_the_same_store(tmp_path: Path) -> None:
    ranks, rounds = 8, 30
    context = process_context()
    barrier = context.Barrier(ranks)
    results = context.Queue()
    workers = [
        context.Process(target=_open_rounds, args=(str(tmp_path), rounds, barrier, results, r))
        for r in range(ranks)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=60) for _ in range(ranks * rounds)]
    for worker in workers:
        worker.join(timeout=30)
    failures = [o for o in outcomes if not o[2].startswith("ok")]
    assert failures == []
    per_round: dict[int, set[str]] = {}
    for round_, _rank, outcome in outcomes:
        per_round.setdefault(round_, set()).add(outcome)
    assert all(len(seen) == 1 for seen in per_round.values())  # one marker per store


def test_a_store_created_between_the_marker_check_and_the_listing_is_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race made deterministic: another process creates the store inside the window."""
    path = tmp_path / "store"
    path.mkdir()
    real_is_empty = opening._is_empty

    def another_rank_wins(root: Path) -> bool:
        code = f"import castore; castore.open({str(root)!r}, chunk_size=512).close()"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=clean_env())
        return real_is_empty(root)

    monkeypatch.setattr(opening, "_is_empty", another_rank_wins)
    with castore.open(path) as store:
        assert store.chunk_size == 512  # the winner's marker, read after the re-check


def test_a_map_grown_by_another_process_during_open_is_adopted(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunks = store_path / "chunks"
    real_open = lmdb_backend.lmdb.open
    grow = (
        "from castore.chunkstore.lmdb.backend import LmdbBackend\n"
        "from castore.chunkstore.base import Namespace\n"
        f"b = LmdbBackend({str(chunks)!r}, map_size=1 << 20)\n"
        "b.put_many(Namespace.OBJECTS, [(bytes([i]) * 32, bytes(64 << 10)) for i in range(64)])\n"
        "assert b.map_size > 1 << 21, b.map_size\n"
    )

    def open_then_grow(*args: Any, **kwargs: Any) -> Any:
        env = real_open(*args, **kwargs)
        subprocess.run([sys.executable, "-c", grow], check=True, timeout=60, env=clean_env())
        return env

    monkeypatch.setattr(lmdb_backend.lmdb, "open", open_then_grow)
    backend = lmdb_backend.LmdbBackend(chunks, map_size=1 << 20)
    monkeypatch.undo()
    try:
        assert backend.map_size > 1 << 21
    finally:
        backend.close()


@pytest.mark.parametrize("bad", [-5, 0, "4096", True, 1.5, 1 << 31, None])
def test_a_marker_with_a_bad_chunk_size_is_not_a_store(store_path: Path, bad: Any) -> None:
    marker = store_path / "castore.json"
    config = json.loads(marker.read_text())
    config["chunk_size"] = bad
    marker.write_text(json.dumps(config))
    with pytest.raises(NotAStoreError, match="castore.json") as info:
        castore.open(store_path, create=False)
    assert "chunk" in str(info.value)


@pytest.mark.parametrize("bad", [0, -1, 1 << 31, 2.0])
def test_a_bad_chunk_size_argument_is_a_value_error_and_creates_nothing(
    tmp_path: Path, bad: Any
) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        castore.open(tmp_path / "new", chunk_size=bad)
    assert not (tmp_path / "new").exists()
