"""Cost that must not grow with history: reflog reads, listings, lookups and pack count.

No timings here (benchmarks/bench_history.py measures those): these tests
count the work itself (reflog bytes read, roots read, pack files), so they
hold on a noisy machine and fail if a save or a listing goes back to reading
the whole history.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import assert_state_equal

import castore
import castore.gc as gc_module
import castore.repo.localreflog as local_repo
from castore import Store, cli
from castore.gc import RetentionPolicy, collect_garbage
from castore.opening import directory as opening
from castore.repo import reflogindex
from castore.repo.local import RefStore
from castore.repo.records import PUBLISH_ACTIONS
from castore.verify import verify_store

RUN = "h"


def state(i: int) -> dict[str, Any]:
    """Two small tensors; ``b`` changes with every save, ``a`` never does."""
    return {"a": np.arange(64, dtype=np.float32), "b": np.full(64, i, dtype=np.float32), "i": i}


def saved(path: Path, count: int, **open_args: Any) -> Store:
    store = castore.open(path, **open_args)
    for i in range(count):
        store.save(state(i), run=RUN, step=i)
    return store


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every reflog byte range read, as its length."""
    reads: list[int] = []
    real = local_repo._read_from

    def counting(fd: int, start: int, end: int) -> bytes:
        data = real(fd, start, end)
        reads.append(len(data))
        return data

    monkeypatch.setattr(local_repo, "_read_from", counting)
    return reads


def test_a_save_reads_only_the_reflog_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save reads the log's end (its last publish record) and the index's header; once
    in REINDEX_BYTES of records it also rewrites the index (castore.repo.reflogindex),
    reading the log past the index's prefix and the index itself."""
    store = saved(tmp_path / "s", 400)
    reflog = store.refs.reflog_path(RUN)
    assert reflog.stat().st_size > 20 * local_repo._TAIL_PIECE  # much longer than a tail read
    store.close()
    index = reflog.with_suffix(local_repo.INDEX_SUFFIX)
    reads: list[tuple[int, int]] = []  # (inode, bytes) of each read
    real = local_repo._read_from

    def counting(fd: int, start: int, end: int) -> bytes:
        data = real(fd, start, end)
        reads.append((os.fstat(fd).st_ino, len(data)))
        return data

    monkeypatch.setattr(local_repo, "_read_from", counting)
    rewrites = 0
    with castore.open(tmp_path / "s") as store:  # as a new process: nothing parsed yet
        for step in range(400, 440):
            reads.clear()
            before = index.read_bytes()
            store.save(state(step), run=RUN, step=step)
            log_read = sum(n for inode, n in reads if inode == reflog.stat().st_ino)
            if index.read_bytes() == before:
                assert 0 < log_read <= local_repo._TAIL_PIECE + local_repo._ANCHOR
                # The index's footer and directory, and each segment's header.
                segments = reflogindex.MAX_SEGMENTS * (16 + reflogindex.SEGMENT_HEADER)
                assert sum(n for _, n in reads) - log_read <= reflogindex.FOOTER_SIZE + segments
            else:
                rewrites += 1
                tail = local_repo._TAIL_PIECE + local_repo._ANCHOR + local_repo.REINDEX_BYTES
                assert log_read <= tail + 2 * 300  # and the last two records, once each
        assert [r["generation"] for r in store.refs.reflog(RUN)][-2:] == [439, 440]
    # 40 records of about 280 bytes: one or two rewrites of the index, not one a save.
    assert 1 <= rewrites <= 2


def test_the_tail_read_finds_the_last_advance_behind_collect_records(tmp_path: Path) -> None:
    with saved(tmp_path / "s", 300) as store:
        collect_garbage(store, RetentionPolicy(keep_last=1))  # ~300 collect records at the end
        records = store.refs.reflog(RUN)
        assert records[-1]["action"] == "collect"
        last = store.refs.last_published(RUN)
        publish = [r for r in records if r["action"] in PUBLISH_ACTIONS]
        assert last == publish[-1]
        store.save(state(300), run=RUN, step=300)
        # The advance was already logged, so no "recovered" record was added.
        assert [r["action"] for r in store.refs.reflog(RUN)][-1] == "advance"
        assert all(r["action"] != "recovered" for r in store.refs.reflog(RUN))


def test_the_reflog_view_parses_only_appended_lines(tmp_path: Path, bytes_read: list[int]) -> None:
    with saved(tmp_path / "s", 50) as store:
        store.refs.reflog_view(RUN)
        bytes_read.clear()
        store.save(state(50), run=RUN, step=50)
        store.save(state(51), run=RUN, step=51)
        bytes_read.clear()
        assert store.resolve(RUN, 1).id == 1  # from the view this handle keeps
        # Only the two records appended since the last lookup are read.
        line = len(store.refs.reflog_path(RUN).read_bytes().splitlines()[-1]) + 1
        assert sum(bytes_read) <= 2 * line + 16
        view = store.refs.reflog_view(RUN)
        records, damaged = store.refs.read_reflog(RUN)
        assert view.records == records and view.damaged == damaged == []


def test_the_view_sees_appends_from_another_process(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with saved(path, 3) as store:
        assert [g.id for g in store.generations(RUN)] == [1, 2, 3]
        code = (
            "import sys, numpy as np, castore\n"
            "with castore.open(sys.argv[1]) as s:\n"
            "    s.save({'b': np.ones(8)}, run='h', step=9)\n"
        )
        store.close()
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120)
    with castore.open(path) as store:
        assert [g.id for g in store.generations(RUN)] == [1, 2, 3, 4]


def test_a_torn_tail_is_read_but_not_kept_and_a_replaced_file_is_reread(tmp_path: Path) -> None:
    with saved(tmp_path / "s", 3) as store:
        path = store.refs.reflog_path(RUN)
        whole = path.read_bytes()
        store.refs.reflog_view(RUN)  # cached
        with open(path, "ab") as handle:
            handle.write(b'{"action":"adv')  # a crash mid-append
        view = store.refs.reflog_view(RUN)
        assert len(view.records) == 3 and view.damaged == []
        store.save(state(3), run=RUN, step=3)  # ends the torn line, appends its own
        assert [g.id for g in store.generations(RUN)] == [1, 2, 3, 4]
        assert store.refs.reflog_view(RUN).records == store.refs.reflog(RUN)
        # The log replaced by a shorter file (a new inode): read from its start.
        replacement = path.with_suffix(".new")
        replacement.write_bytes(whole.splitlines(keepends=True)[0])
        replacement.replace(path)
        assert [r["generation"] for r in store.refs.reflog_view(RUN).records] == [1]


def test_generations_last_reads_only_the_roots_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with saved(tmp_path / "s", 40) as store:
        everything = store.generations(RUN)
        assert [g.id for g in everything] == list(range(1, 41))
        reads: list[int] = []
        real = Store.read_root

        def counting(self: Store, digest: Any, *, run: str) -> Any:
            reads.append(1)
            return real(self, digest, run=run)

        monkeypatch.setattr(Store, "read_root", counting)
        newest = store.generations(RUN, last=3)
        assert newest == everything[-3:]
        assert len(reads) == 3
        assert store.generations(RUN, last=0) == []
        assert store.generations(RUN, last=100) == everything
        with pytest.raises(ValueError, match="last must be"):
            store.generations(RUN, last=-1)


def test_the_chain_still_orders_generations_the_log_lost(tmp_path: Path) -> None:
    """Reflog lines lost: parents reached through the chain come out in order."""
    with saved(tmp_path / "s", 6) as store:
        path = store.refs.reflog_path(RUN)
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(lines[0] + lines[5])  # only generations 1 and 6 logged
    with castore.open(tmp_path / "s") as store:
        assert [g.id for g in store.generations(RUN)] == [1, 2, 3, 4, 5, 6]
        assert [g.id for g in store.generations(RUN, last=2)] == [5, 6]
        assert store.resolve(RUN, 3).id == 3


def test_gc_merges_small_packs_into_one(tmp_path: Path) -> None:
    with saved(tmp_path / "s", 12) as store:
        pack_dir = tmp_path / "s" / "chunks" / "packs"
        assert len(list(pack_dir.glob("*.pack"))) == 12  # one per save
        report = collect_garbage(store, RetentionPolicy(keep_last=12))  # drops nothing
        assert report.dropped == {}
        assert report.packs_merged == 12
        assert len(list(pack_dir.glob("*.pack"))) == 1
        for i in range(12):
            assert_state_equal(store.load(RUN, i + 1), state(i))
        assert verify_store(store, deep=True).ok
        again = collect_garbage(store, RetentionPolicy(keep_last=12))
        assert again.packs_merged == 0  # a lone small pack is not rewritten


def test_gc_leaves_packs_above_the_merge_size_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with saved(tmp_path / "s", 1) as store:
        big = next((tmp_path / "s" / "chunks" / "packs").glob("*.pack"))
        monkeypatch.setattr(gc_module, "MERGE_PACKS_BELOW", big.stat().st_size)
        for i in range(1, 4):
            store.save(state(i), run=RUN, step=i)
        report = collect_garbage(store, RetentionPolicy(keep_last=4))
        assert report.packs_merged == 3
        assert big.exists()  # not below the limit: left as it is
        assert len(list(big.parent.glob("*.pack"))) == 2
        assert_state_equal(store.load(RUN, 4), state(3))


def test_log_n_prints_only_the_newest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved(tmp_path / "s", 5).close()
    assert cli.main(["log", str(tmp_path / "s"), "-n", "2"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [int(r.split()[0]) for r in rows] == [4, 5]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["log", str(tmp_path / "s"), "-n", "0"])
    assert exit_info.value.code != 0
    assert "--max-count" in capsys.readouterr().err


def test_a_new_refstore_reads_the_same_history(tmp_path: Path) -> None:
    with saved(tmp_path / "s", 5) as store:
        ours = store.refs.reflog_view(RUN)
        theirs = RefStore(tmp_path / "s").reflog_view(RUN)
        assert ours.records == theirs.records
        assert ours.listed == theirs.listed
        assert ours.collected == theirs.collected


def test_a_new_handle_lists_the_newest_from_the_reflog_tail(
    tmp_path: Path, bytes_read: list[int]
) -> None:
    with saved(tmp_path / "s", 300) as store:
        collect_garbage(store, RetentionPolicy(keep_last=250))  # collect records at the end
        everything = store.generations(RUN)
        assert [g.id for g in everything] == list(range(51, 301))
        size = store.refs.reflog_path(RUN).stat().st_size
    with castore.open(tmp_path / "s") as store:  # nothing parsed yet, as in a new process
        bytes_read.clear()
        assert store.generations(RUN, last=3) == everything[-3:]
        assert sum(bytes_read) < size // 4
        # Past the newest, down to where the collection stopped: still exact.
        assert store.generations(RUN) == everything
        bytes_read.clear()
        assert cli.main(["log", str(tmp_path / "s"), "-n", "2"]) == 0
        # The tail twice: the listing, then what copies wrote (castore.copying.copies_logged).
        assert sum(bytes_read) < size // 3


def test_opening_a_store_reads_its_marker_once_and_makes_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an open of an existing store costs does not depend on its history either;
    it used to read castore.json twice and try to create refs/, locks/ and logs/ again."""
    saved(tmp_path / "s", 2).close()
    marker_reads: list[str] = []
    made: list[str] = []
    real_read, real_mkdir = opening.read_store_file, os.mkdir

    def counting_read(path: Path, **kwargs: Any) -> bytes:
        marker_reads.append(path.name)
        return real_read(path, **kwargs)

    def counting_mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        made.append(str(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(opening, "read_store_file", counting_read)
    monkeypatch.setattr(os, "mkdir", counting_mkdir)
    with castore.open(tmp_path / "s") as store:
        assert store.resolve(RUN).id == 2
    assert marker_reads == ["castore.json"]
    assert not [path for path in made if Path(path).name in ("refs", "locks", "logs")]
