"""The reflog's derived index (castore.repo.reflogindex): a lookup by id reads a few records.

A new handle finds a generation by id through ``logs/RUN.idx`` instead of
parsing the whole reflog. The log stays the truth: every hit is checked
against its own line, and an index that is absent, stale, damaged or
crafted gives the same answers as the log (by reading it), never another
generation. Counted, not timed (benchmarks/bench_call_costs.py times it).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import castore
import castore.repo.localreflog as local_repo
from castore import Store
from castore.core.commit import commit_objects
from castore.errors import CastoreError, GenerationNotFoundError
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import encode_object
from castore.gc import RetentionPolicy, collect_garbage
from castore.repair import repair_store
from castore.repo import reflogindex
from castore.repo.base import Reflog
from castore.repo.localreflog import LocalReflog
from castore.verify import verify_store

RUN = "h"
SAVES = 200
# keep_last=120 and every_steps=5: of ids 1..80, only 1, 6, 11, ... 76 stay.
POLICY = RetentionPolicy(keep_last=120, every_steps=5)
KEPT = {i for i in range(1, SAVES + 1) if i > 80 or i % 5 == 1}


def state(i: int) -> dict[str, Any]:
    return {"a": np.arange(64, dtype=np.float32), "b": np.full(64, i, dtype=np.float32), "i": i}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 200 generations, 64 of ids 2..80 collected."""
    path = tmp_path_factory.mktemp("built") / "s"
    with castore.open(path) as store:
        for i in range(SAVES):
            store.save(state(i), run=RUN, step=i)
        collect_garbage(store, POLICY)
    return path


@pytest.fixture
def history(built: Path, tmp_path: Path) -> Path:
    path = tmp_path / "s"
    shutil.copytree(built, path)
    return path


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every reflog line parsed, by any reader of the local reflog."""
    lines: list[bytes] = []
    real = local_repo._parse_reflog_line

    def counting(line: bytes, run: str) -> tuple[Any, bool]:
        lines.append(line)
        return real(line, run)

    monkeypatch.setattr(local_repo, "_parse_reflog_line", counting)
    return lines


@pytest.fixture
def fresh(history: Path) -> Iterator[Store]:
    """A handle that has parsed nothing yet, as a new process's."""
    with castore.open(history) as store:
        yield store


def log_lines(store: Store) -> int:
    return len(store.refs.reflog_path(RUN).read_bytes().splitlines())


def index_path(store: Store) -> Path:
    return store.refs.reflog_path(RUN).with_suffix(local_repo.INDEX_SUFFIX)


def expect_lookups(store: Store) -> None:
    """Ids at the start, middle and end, collected ids and ids never published."""
    for gen_id in (1, 6, 76, 81, 100, 150, 199, 200, "200", "1"):
        found = store.resolve(RUN, gen_id)
        assert found.id == int(gen_id) and found.step == int(gen_id) - 1
    for gone in (2, 3, 79, 80, 201, 10**6, "999999"):
        with pytest.raises(GenerationNotFoundError):
            store.resolve(RUN, gone)


def test_every_id_resolves_as_the_log_says_through_the_index(
    history: Path, parsed: list[bytes]
) -> None:
    with castore.open(history) as store:
        index = index_path(store)
        assert index.is_file() and store.runs() == [RUN]
        for gen_id in range(1, SAVES + 1):
            if gen_id in KEPT:
                assert store.resolve(RUN, gen_id).id == gen_id
        expect_lookups(store)
    with castore.open(history) as store:
        assert store.refs.reflog_view(RUN).listed == {g.root: g.id for g in store.generations(RUN)}
        assert {g.id for g in store.generations(RUN)} == KEPT
        assert verify_store(store).ok


def test_a_lookup_by_id_parses_a_few_records_not_the_log(fresh: Store, parsed: list[bytes]) -> None:
    lines = log_lines(fresh)
    assert lines > SAVES + 60  # 200 advances, 64 collects, 5 more
    for gen_id in (1, 100, 200):
        parsed.clear()
        assert fresh.resolve(RUN, gen_id).id == gen_id
        # The records past the index's prefix, and the one record the hit names.
        per_line = len(fresh.refs.reflog_path(RUN).read_bytes()) / lines
        assert len(parsed) <= local_repo.REINDEX_BYTES / per_line + 2


def test_without_the_fast_path_a_lookup_parses_every_line(
    fresh: Store, parsed: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control of the test above: the log read whole counts every line."""
    monkeypatch.setattr(LocalReflog, "listed_with_id", Reflog.listed_with_id)
    assert fresh.resolve(RUN, 100).id == 100
    assert len(parsed) >= log_lines(fresh)


@pytest.mark.parametrize("reindex_bytes", [local_repo.REINDEX_BYTES, 1 << 30])
def test_records_past_the_index_count_collects_and_new_ids_included(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reindex_bytes: int
) -> None:
    """Collect records in the index, and (never rewritten) only past its prefix."""
    with castore.open(tmp_path / "s") as store:
        for i in range(60):
            store.save(state(i), run=RUN, step=i)
        assert index_path(store).is_file()
        monkeypatch.setattr(local_repo, "REINDEX_BYTES", reindex_bytes)
        collect_garbage(store, RetentionPolicy(keep_last=10, every_steps=7))
        for i in range(60, 63):
            store.save(state(i), run=RUN, step=i)
        expected = {g.id for g in store.generations(RUN)}
    assert 1 in expected and 2 not in expected and 63 in expected
    with castore.open(tmp_path / "s") as store:
        for gen_id in range(1, 65):
            if gen_id in expected:
                assert store.resolve(RUN, gen_id).id == gen_id
            else:
                with pytest.raises(GenerationNotFoundError):
                    store.resolve(RUN, gen_id)


def test_a_store_without_an_index_reads_the_log_and_the_next_save_writes_it(
    history: Path, parsed: list[bytes]
) -> None:
    with castore.open(history) as store:
        index_path(store).unlink()  # a store from before the index, or its index deleted
    with castore.open(history) as store:
        expect_lookups(store)
        assert not index_path(store).exists()
    with castore.open(history) as store:
        store.save(state(SAVES + 5), run=RUN, step=SAVES + 5)
        assert index_path(store).is_file()
    with castore.open(history) as store:
        parsed.clear()
        assert store.resolve(RUN, 100).id == 100
        assert len(parsed) < log_lines(store) // 4


def test_saves_keep_the_index_close_behind_the_log(tmp_path: Path) -> None:
    """Rewritten once REINDEX_BYTES lie past its prefix: rarely, and never far behind."""
    with castore.open(tmp_path / "s") as store:
        written = set()
        for i in range(120):
            store.save(state(i), run=RUN, step=i)
            log = store.refs.reflog_path(RUN).stat().st_size
            if not index_path(store).exists():
                assert log < local_repo.REINDEX_BYTES
                continue
            with open(index_path(store), "rb") as handle:
                index = reflogindex.ReflogIndex(
                    lambda at, n: os.pread(handle.fileno(), n, at),
                    os.fstat(handle.fileno()).st_size,
                    max_entries=log,
                )
            assert log - index.covered < local_repo.REINDEX_BYTES
            written.add(index.covered)
        # One index write per REINDEX_BYTES of log, the first once the log is that long.
        assert 1 <= len(written) <= log // local_repo.REINDEX_BYTES


# -- hostile indexes and logs: a fallback or the log's answer, never another generation --

IDS = (1, 2, 6, 76, 79, 100, 150, 200, 201)


def answers(path: Path) -> dict[int, str]:
    """What a new handle says of each id in IDS: a root's hex, or the error's type."""
    found = {}
    with castore.open(path) as store:
        for gen_id in IDS:
            try:
                generation = store.resolve(RUN, gen_id)
                assert generation.id == gen_id
                found[gen_id] = generation.root
            except CastoreError as exc:  # not found; or damage, as the log says
                found[gen_id] = type(exc).__name__
    return found


def log_answers(path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[int, str]:
    """The same questions answered by the log read whole."""
    with monkeypatch.context() as patch:
        patch.setattr(LocalReflog, "listed_with_id", Reflog.listed_with_id)
        return answers(path)


def rewrite_index(path: Path, **changes: Any) -> None:
    """Replace ``path``'s index by one encoded from its tables with ``changes`` applied."""
    index_file = path / "logs" / f"{RUN}{local_repo.INDEX_SUFFIX}"
    data = index_file.read_bytes()
    index = reflogindex.ReflogIndex(lambda at, n: data[at : at + n], len(data), max_entries=10**6)
    listed, collected = (table.copy() for table in index.tables())
    for position, (field, value) in changes.get("listed", {}).items():
        listed[field][position] = value
    covered = changes.get("covered", index.covered)
    segment = reflogindex.encode_segment((listed, collected))
    index_file.write_bytes(reflogindex.encode_index([segment], covered, index.anchor))


def row_of(path: Path, gen_id: int) -> int:
    index_file = path / "logs" / f"{RUN}{local_repo.INDEX_SUFFIX}"
    data = index_file.read_bytes()
    index = reflogindex.ReflogIndex(lambda at, n: data[at : at + n], len(data), max_entries=10**6)
    return int(np.flatnonzero(index.tables()[0]["id"] == gen_id)[0])


def line_of(path: Path, gen_id: int) -> int:
    """The byte offset of the advance record of ``gen_id`` in the reflog."""
    data = (path / "logs" / f"{RUN}.reflog").read_bytes()
    offset = 0
    for line in data.splitlines(keepends=True):
        if f'"action":"advance","generation":{gen_id},'.encode() in line:
            return offset
        offset += len(line)
    raise AssertionError(f"no advance record of generation {gen_id}")


def claiming(count: int) -> Callable[[bytes], bytes]:
    """The first segment's header claiming ``count`` listed entries, its checksum redone."""

    def craft(data: bytes) -> bytes:
        fields = bytearray(data[: reflogindex.SEGMENT_HEADER - reflogindex.CHECK_SIZE])
        fields[16:24] = count.to_bytes(8, "little")  # after magic, version, entries per page
        check = digest_bytes(bytes(fields))[: reflogindex.CHECK_SIZE]
        return bytes(fields) + check + data[reflogindex.SEGMENT_HEADER :]

    return craft


DAMAGE = {
    "segment header byte": lambda data: data[:20] + bytes([data[20] ^ 1]) + data[21:],
    "listed page byte": lambda data: data[:200] + bytes([data[200] ^ 1]) + data[201:],
    "footer byte": lambda data: data[:-3] + bytes([data[-3] ^ 1]) + data[-2:],
    "cut short": lambda data: data[: len(data) // 2],
    "bytes added": lambda data: data + b"\0" * 56,
    "empty": lambda data: b"",
    # A header, its checksum valid, claiming 10**12 entries: refused before any is read.
    "10**12 entries": claiming(10**12),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_index_is_not_used_and_the_next_save_rewrites_it(
    history: Path, parsed: list[bytes], monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    expected = log_answers(history, monkeypatch)
    index_file = history / "logs" / f"{RUN}{local_repo.INDEX_SUFFIX}"
    index_file.write_bytes(DAMAGE[damage](index_file.read_bytes()))
    assert answers(history) == expected
    with castore.open(history) as store:
        # The next rewrite replaces it (with REINDEX_BYTES=1, this save's): damage in a
        # page a writer does not read is found once it extends the index.
        monkeypatch.setattr(local_repo, "REINDEX_BYTES", 1)
        store.save(state(SAVES + 5), run=RUN, step=SAVES + 5)
        monkeypatch.undo()
    with castore.open(history) as store:
        parsed.clear()
        assert store.resolve(RUN, 100).id == 100
        assert len(parsed) < log_lines(store) // 4


CRAFTED = {
    # The listing of id 100 pointing at another record: its line names generation 150.
    "line of another id": lambda path: {
        "listed": {row_of(path, 100): ("line", line_of(path, 150))}
    },
    # ... and claiming generation 150's root: the line says 150, not 100.
    "another root": lambda path: {
        "listed": {row_of(path, 150): ("id", 100)},
    },
    # A line offset inside a record, not at its start.
    "mid-line": lambda path: {"listed": {row_of(path, 100): ("line", line_of(path, 100) + 1)}},
    # Past the log's end.
    "line past the end": lambda path: {"listed": {row_of(path, 100): ("line", 1 << 40)}},
    # An index claiming to cover more of the log than there is, or a prefix it does not end.
    "covered past the end": lambda path: {"covered": 1 << 40},
    "covered mid-log": lambda path: {"covered": line_of(path, 150) + 10},
    # Id 100 left out: the lookup walks the chain, as for a lost log line.
    "id left out": lambda path: {"listed": {row_of(path, 100): ("id", 10**9)}},
}


@pytest.mark.parametrize("craft", CRAFTED, ids=list(CRAFTED))
def test_a_crafted_index_never_gives_another_generation(
    history: Path, monkeypatch: pytest.MonkeyPatch, craft: str
) -> None:
    expected = log_answers(history, monkeypatch)
    rewrite_index(history, **CRAFTED[craft](history))
    assert answers(history) == expected


def test_an_index_listing_many_roots_under_one_id_is_refused(
    history: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = log_answers(history, monkeypatch)
    rows = {position: ("id", 100) for position in range(reflogindex.MAX_SAME_ID + 10)}
    rewrite_index(history, listed=rows)
    assert answers(history) == expected


def test_a_crafted_log_line_naming_another_root_under_an_id_is_read_and_refused(
    history: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record with a good checksum that lists generation 150's root under id 100 (and
    under an id never published): the root read says 150, so neither lookup returns it."""
    with castore.open(history) as store:
        root = store.resolve(RUN, 150).root
        reflog = store.refs.parts.reflog
        for claimed in (100, 500):
            record = {
                "action": "advance",
                "generation": claimed,
                "host": "h",
                "parent": None,
                "pid": 1,
                "root": root,
                "run": RUN,
                "time": 1.0,
            }
            reflog.append(RUN, record)
    expected = log_answers(history, monkeypatch)
    assert expected[100] != expected[150]
    found = answers(history)
    assert found == expected
    with castore.open(history) as store:
        assert store.resolve(RUN, 100).step == 99
        with pytest.raises(GenerationNotFoundError):
            store.resolve(RUN, 500)


def test_a_log_replaced_under_its_index_is_read_whole(
    history: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index's prefix must end the way the log's does: a shorter log of other
    records (a restored copy, say) is not the index's, whatever their sizes."""
    reflog = history / "logs" / f"{RUN}.reflog"
    lines = reflog.read_bytes().splitlines(keepends=True)
    reflog.write_bytes(b"".join(lines[:150]))
    expected = log_answers(history, monkeypatch)
    assert answers(history) == expected
    # The log lost the collect records: a collected id is a missing root, as it says.
    assert expected[2] == "ObjectMissingError" and len(expected[150]) == 64


def test_an_index_naming_a_root_the_log_never_published_is_refused(
    history: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root of generation 100 that no record names (a save that lost its ref's race
    leaves one): an index listing it under 100 fails the check against the log's line."""
    expected = log_answers(history, monkeypatch)
    with castore.open(history) as store:
        digest, root = store.resolve_root(RUN, 100)
        orphan = dataclasses.replace(root, step=12345)
        data = encode_object(orphan)
        commit_objects(store, [(digest_bytes(data), data)])
        assert store.read_root(Digest(digest_bytes(data)), run=RUN).generation == 100
    row = row_of(history, 100)
    rewrite_index(history, listed={row: ("root", np.void(digest_bytes(data)))})
    assert answers(history) == expected
    with castore.open(history) as store:
        assert store.resolve(RUN, 100).step == 99


# -- format 3: the index as a blob beside the record blobs -------------------------------


def test_a_store_on_blobs_finds_a_generation_by_id_reading_a_few_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared-directory store (the posix blob store): an index blob beside the records;
    a new handle's lookup by id gets a few record blobs, not one per record."""
    from castore.blob.posix import PosixBlobStore
    from castore.repo import blobreflog

    path = tmp_path / "shared"
    with castore.open(path, shared=True) as store:
        for i in range(60):
            store.save(state(i), run=RUN, step=i)
        collect_garbage(store, RetentionPolicy(keep_last=20, every_steps=4))
        store.save(state(60), run=RUN, step=60)
        expected = {g.id: g.root for g in store.generations(RUN)}
    assert 1 in expected and 2 not in expected and 61 in expected
    indexes = sorted((path / "logs" / RUN).glob("index.*"))
    assert len(indexes) == 1  # the older ones deleted
    records_read: list[str] = []
    real = PosixBlobStore.read_versioned

    def counting(self: PosixBlobStore, name: str) -> Any:
        if name.startswith(f"logs/{RUN}/"):
            records_read.append(name)
        return real(self, name)

    monkeypatch.setattr(PosixBlobStore, "read_versioned", counting)
    for gen_id in (1, 5, 41, 45, 61):
        with castore.open(path, shared=True) as store:
            records_read.clear()
            assert store.resolve(RUN, gen_id).root == expected[gen_id]
            # Its last record, those after it (and the one absent), the one the hit names.
            assert len(records_read) <= blobreflog.REINDEX_RECORDS + 3
    for gone in (2, 3, 62):
        with castore.open(path, shared=True) as store:
            with pytest.raises(GenerationNotFoundError):
                store.resolve(RUN, gone)
    # The control: without the index, every record blob is read.
    monkeypatch.setattr(blobreflog.BlobReflog, "listed_with_id", Reflog.listed_with_id)
    with castore.open(path, shared=True) as store:
        records_read.clear()
        assert store.resolve(RUN, 41).root == expected[41]
        assert len(records_read) >= 60


def test_a_damaged_or_crafted_index_blob_is_refused(tmp_path: Path) -> None:
    """On blobs as in a directory: a flipped byte, or an index naming a root of the same id
    that no record names, and the lookup reads the records instead."""
    path = tmp_path / "shared"
    with castore.open(path, shared=True) as store:
        for i in range(40):
            store.save(state(i), run=RUN, step=i)
        expected = store.resolve(RUN, 20).root
        digest, root = store.resolve_root(RUN, 20)
        orphan = encode_object(dataclasses.replace(root, step=12345))
        commit_objects(store, [(digest_bytes(orphan), orphan)])
    (index_file,) = (path / "logs" / RUN).glob("index.*")
    good = index_file.read_bytes()
    index = reflogindex.ReflogIndex(lambda at, n: good[at : at + n], len(good), max_entries=40)
    listed, collected = (table.copy() for table in index.tables())
    listed["root"][int(np.flatnonzero(listed["id"] == 20)[0])] = np.void(digest_bytes(orphan))
    segment = reflogindex.encode_segment((listed, collected))
    crafted = reflogindex.encode_index([segment], index.covered, index.anchor)
    for bad in (good[:300] + bytes([good[300] ^ 1]) + good[301:], crafted):
        index_file.write_bytes(bad)
        with castore.open(path, shared=True) as store:
            assert store.resolve(RUN, 20).root == expected
    with castore.open(path, shared=True) as store:  # the crafted one: verify names it
        assert any("reflog index" in p.what for p in verify_store(store).problems)
        assert repair_store(store).reflog_indexes_rebuilt == [RUN]
        assert verify_store(store).ok
        assert store.resolve(RUN, 20).root == expected
    assert len(list((path / "logs" / RUN).glob("index.*"))) == 1  # the crafted one replaced


def test_verify_names_an_index_that_disagrees_with_its_log_and_repair_rewrites_it(
    history: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one thing an index's checks cannot see: its log edited in place. The collect
    record of generation 2 made to name generation 100's root (same length, checksum
    redone): the log now lists 2 and drops 100, the index still says the opposite."""
    reflog = history / "logs" / f"{RUN}.reflog"
    with castore.open(history) as store:
        root_of_100 = store.resolve(RUN, 100).root
    data = reflog.read_bytes()
    at = data.index(b'{"action":"collect","generation":2,')
    end = data.index(b"\n", at)
    record = json.loads(data[at:end].rpartition(b"\t")[0])
    record["root"] = root_of_100
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    line = f"{text}\t{digest_bytes(text.encode()).hex()[:32]}".encode()
    assert len(line) == end - at
    with open(reflog, "r+b") as handle:  # in place: the same inode and length
        handle.seek(at)
        handle.write(line)
    expected = log_answers(history, monkeypatch)
    assert expected[100] == "GenerationNotFoundError" and expected[2] == "ObjectMissingError"
    assert answers(history)[100] == root_of_100  # the index is trusted: verify must say so
    with castore.open(history) as store:
        problems = [p.what for p in verify_store(store).problems]
        assert any("reflog index" in what and "disagrees" in what for what in problems)
        assert repair_store(store).reflog_indexes_rebuilt == [RUN]
        assert not any("reflog index" in p.what for p in verify_store(store).problems)
    assert answers(history) == expected


# -- the segments: extending an index says what summarising every record says ------------


@settings(max_examples=60, deadline=None)
@given(
    actions=st.lists(st.tuples(st.integers(0, 11), st.booleans()), min_size=1, max_size=80),
    cuts=st.lists(st.integers(1, 80), max_size=8),
)
def test_an_index_extended_segment_by_segment_answers_as_the_records_do(
    actions: list[tuple[int, bool]], cuts: list[int]
) -> None:
    """Any order of publish and collect records over a few roots (each under its own id:
    collected, logged again, collected before it was published), indexed in runs cut
    anywhere, then merged as writers merge them: the same tables and lookups."""
    records = [
        {
            "action": "collect" if collect else "advance",
            "generation": 1 + r // 2,
            "root": bytes([r]).hex() * 32,
        }
        for r, collect in actions
    ]
    bounds = sorted({0, len(records), *(c for c in cuts if c < len(records))})
    whole = reflogindex.Summary()
    index = None
    for start, stop in itertools.pairwise(bounds):
        part = reflogindex.Summary()
        for position in range(start, stop):
            part.add(records[position], position)
            whole.add(records[position], position)
        data = (
            reflogindex.build(part, stop, "0" * 32)
            if index is None
            else reflogindex.extend(index, part, stop, "0" * 32)
        )
        index = reflogindex.ReflogIndex(
            lambda at, n, d=data: d[at : at + n], len(data), max_entries=10**6
        )
    assert index is not None and len(index.segments) <= max(1, len(bounds).bit_length() + 1)
    assert reflogindex.same_tables(index.tables(), whole.tables())
    for generation in range(0, 8):
        found = reflogindex.lookup(index, reflogindex.Summary(), generation)
        expected = [r for r, e in whole.listed.items() if e.generation == generation]
        assert [listing.root for listing in found] == expected
