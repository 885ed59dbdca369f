"""Damage inside the LMDB file: typed errors, never a signal, and gc never destroys data.

Real stores on disk, real byte damage to ``chunks/data.mdb``. Anything that
could kill the process (SIGBUS, SIGSEGV) runs in a subprocess whose exit code
is asserted. The worst case found: a damaged free list is invisible to loads
and to ``verify --deep``, and the next write transaction (a collection's
sweep) reuses a live page, so every generation becomes unloadable; gc now
audits the file first and refuses.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from _helpers import assert_state_equal
from cli_runner import run_cli

import castore
import castore.chunkstore.lmdb.backend as lmdb_backend
import castore.chunkstore.lmdb.packwriter as packwriter
import castore.gc as gc_module
from castore import Store
from castore.chunkstore.base import Namespace
from castore.errors import CastoreError, IndexCorruptError, IntegrityError, StoreFullError
from castore.format.hashing import digest_bytes
from castore.gc import GcAbortedError, RetentionPolicy, collect_garbage
from castore.repair import rebuild_index
from castore.verify import verify_store

CHUNK = 256
RUN = "r"
GENERATIONS = 8
PAGE = 4096
SIGNALS = {-signal.SIGBUS, -signal.SIGSEGV, 128 + signal.SIGBUS, 128 + signal.SIGSEGV}


def state(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {
        "w": rng.standard_normal(512).astype(np.float32),  # 8 chunks, new every generation
        "shared": np.arange(1024, dtype=np.float32),  # 16 chunks, the same in every generation
        "step": i,
    }


def make_store(path: Path, *, garbage: int = 0) -> None:
    """Eight generations, one pack each, plus ``garbage`` unreferenced chunks (a failed save's)."""
    with castore.open(path, chunk_size=CHUNK) as store:
        for i in range(1, GENERATIONS + 1):
            store.save(state(i), run=RUN, step=i)
        if garbage:
            rng = np.random.default_rng(99)
            pieces = [rng.bytes(300) for _ in range(garbage)]
            store.backend.put_many(Namespace.CHUNKS, [(digest_bytes(p), p) for p in pieces])


def loadable(store: Store) -> list[int]:
    """The generations that load and equal what was saved."""
    good = []
    for i in range(1, GENERATIONS + 1):
        try:
            loaded = store.load(RUN, i)
        except CastoreError:
            continue
        assert_state_equal(loaded, state(i))  # never wrong bytes
        good.append(i)
    return good


def python(code: str, *args: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        stdin=subprocess.DEVNULL,  # not a terminal: gc never asks
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=120)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pristine") / "store"
    make_store(path, garbage=40)
    return path


@pytest.fixture
def damaged(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine store, for one test to damage."""
    copy = tmp_path / "store"
    subprocess.run(["cp", "-a", str(pristine), str(copy)], check=True)
    return copy


def data_file(store: Path) -> Path:
    return store / "chunks" / "data.mdb"


# -- a truncated file ------------------------------------------------------------------

LOAD_ALL = """
import sys, castore
with castore.open(sys.argv[1]) as store:
    for gen in store.generations("r"):
        store.load("r", gen.id)
print("LOADED")
"""


@pytest.mark.parametrize("keep", [PAGE * 2 + 100, 5000, 100])
def test_a_truncated_lmdb_file_is_a_typed_error_never_a_signal(damaged: Path, keep: int) -> None:
    os.truncate(data_file(damaged), keep)  # half-way, shorter than two pages, shorter than one
    result = python(LOAD_ALL, damaged)
    assert result.returncode == 1 and "IndexCorruptError" in result.stderr, result.stderr[-500:]
    assert "truncated" in result.stderr and "castore repair --rebuild-index" in result.stderr
    for command in ("verify", "log"):
        run = cli(command, damaged)
        assert run.returncode == 1, (command, run.returncode, run.stderr)
        [line] = run.stderr.strip().splitlines()
        assert line.startswith("castore: error: IndexCorruptError: ") and "data.mdb is" in line


def test_broken_control_without_the_header_check_a_truncated_file_kills_the_process(
    damaged: Path,
) -> None:
    os.truncate(data_file(damaged), PAGE * 8)
    unchecked = (
        "import castore.chunkstore.lmdb.env as b\n"  # where the environment is opened
        "b.check_data_file = b.pad_data_file = lambda p: None\n"  # (padding would zero-fill)
    )
    result = python(unchecked + LOAD_ALL, damaged)
    assert result.returncode in SIGNALS, (result.returncode, result.stderr[-300:])


# -- flipped and zeroed pages -------------------------------------------------------------

SWEEP = """
import os, shutil, sys
import castore
from castore.errors import CastoreError
from castore.verify import verify_store
source, work = sys.argv[1], sys.argv[2]
for spec in sys.argv[3:]:
    kind, offset = spec.split(":")
    offset = int(offset)
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(source, work)
    print("TRY", spec, flush=True)
    with open(os.path.join(work, "chunks", "data.mdb"), "r+b") as f:
        f.seek(offset)
        if kind == "zero":
            f.write(bytes(4096))
        else:
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    outcomes = []
    try:
        with castore.open(work) as store:
            for gen in range(1, 9):
                try:
                    store.load("r", gen)
                    outcomes.append("ok")
                except CastoreError as exc:
                    outcomes.append(type(exc).__name__)
            report = verify_store(store, deep=True)
            outcomes.append("verify-ok" if report.ok else "verify-problems")
    except CastoreError as exc:
        outcomes.append("open:" + type(exc).__name__)
    print("OUTCOME", spec, " ".join(outcomes), flush=True)
print("SWEEP DONE")
"""


def sweep_specs(size: int) -> list[str]:
    meta_fields = [16, 40, 136, 144, PAGE + 16, PAGE + 136, PAGE + 144]
    flips = [f"flip:{o}" for o in meta_fields]
    pages = size // PAGE
    # Every page's header (flags, lower bound) and a node pointer, and a few bodies.
    for page in range(2, pages):
        base = page * PAGE
        flips += [f"flip:{base + 10}", f"flip:{base + 12}", f"flip:{base + 17}"]
    flips += [f"flip:{page * PAGE + 3000}" for page in range(2, pages, 4)]
    zeros = [f"zero:{page * PAGE}" for page in range(2, pages, 3)]
    return flips + zeros


def test_flipped_and_zeroed_pages_give_typed_errors_or_correct_data(
    pristine: Path, tmp_path: Path
) -> None:
    specs = sweep_specs(data_file(pristine).stat().st_size)
    result = python(SWEEP, pristine, tmp_path / "work", *specs)
    tried = [line for line in result.stdout.splitlines() if line.startswith("TRY")]
    assert result.returncode == 0, f"died at {tried[-1:]} with {result.returncode}: {result.stderr}"
    assert "SWEEP DONE" in result.stdout
    outcomes = [
        line.split()[2:] for line in result.stdout.splitlines() if line.startswith("OUTCOME")
    ]
    assert len(outcomes) == len(specs) > 40
    # Many flips land in free pages (no effect); enough of them must hit live structure.
    damaged = [o for o in outcomes if o != ["ok"] * GENERATIONS + ["verify-ok"]]
    assert len(damaged) >= 10
    for outcome in damaged:  # a load that failed always shows up in verify as a problem
        assert outcome[0].startswith("open:") or outcome[-1] == "verify-problems", outcome


# -- a damaged index entry ------------------------------------------------------------


def _raw_index_put(store: Path, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(store / "chunks"), max_dbs=4)
    try:
        index = env.open_db(b"chunk_index")
        with env.begin(write=True) as txn:
            txn.put(key, value, db=index)
    finally:
        env.close()


def newest_chunk(store: Store) -> bytes:
    _, root = store.resolve_root(RUN, "latest")
    [shard] = store.read_shards(root)
    return next(e for e in shard.tensors if e.name == "w").chunks[0]


def test_an_index_value_of_the_wrong_length_is_index_corruption(damaged: Path) -> None:
    with castore.open(damaged) as store:
        chunk = newest_chunk(store)
    _raw_index_put(damaged, chunk, b"\x01" * 10)
    with castore.open(damaged) as store:
        with pytest.raises(IndexCorruptError, match="chunk_index value is 10 bytes"):
            store.load(RUN)
        restored = store.restore(RUN, fallback="previous")
        assert restored.generation.id == GENERATIONS - 1
        assert [s.generation for s in restored.skipped] == [GENERATIONS]
        report = verify_store(store, deep=True)
        assert (RUN, GENERATIONS) in report.damaged_generations
        with pytest.raises(GcAbortedError):  # the sweep lists sizes: the bad value stops it
            collect_garbage(store, RetentionPolicy(keep_last=100))
    run = cli("verify", "--deep", damaged)  # structural verify only asks "present?": it is
    assert run.returncode == 1 and "IndexCorruptError" in run.stdout, run.stdout + run.stderr


def test_a_misdirected_index_entry_is_caught_and_gc_refuses(damaged: Path) -> None:
    with castore.open(damaged) as store:
        chunk = newest_chunk(store)
        backend = store.backend
        assert isinstance(backend, lmdb_backend.LmdbBackend)
        where = backend.locate(chunk)
        assert where is not None
    # Point it one record further on in the same pack: same length, other bytes.
    wrong = packwriter.PackLocation(where.length, where.pack, where.offset + where.length + 40)
    _raw_index_put(damaged, chunk, wrong.encode())
    with castore.open(damaged) as store:
        check = store.backend.check_index()
        assert not check.ok and any(chunk.hex()[:16] in p for p in check.problems)
        with pytest.raises(GcAbortedError, match="disagrees with the packs"):
            collect_garbage(store, RetentionPolicy(keep_last=100))
        assert loadable(store) == list(range(1, GENERATIONS))  # the newest reads wrong bytes
        problems = verify_store(store, deep=True).problems
        assert any(p.run == "(store)" and chunk.hex()[:16] in p.what for p in problems)


# -- iteration that misses entries: the cross-check and reclaim's own guard ---------------


class _BlindTxn:
    """A read transaction whose index iteration skips ``hidden`` keys; lookups still find them.

    What a damaged B-tree can do: the collection lists live packs by iterating.
    """

    def __init__(self, txn: Any, index: Any, hidden: set[bytes]) -> None:
        self._txn, self._index, self._hidden = txn, index, hidden

    def cursor(self, db: Any = None) -> Iterator[tuple[bytes, bytes]]:
        cursor = self._txn.cursor(db=db)
        if db is not self._index:
            return cursor  # type: ignore[no-any-return]
        return ((k, v) for k, v in cursor if bytes(k) not in self._hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


def blind(monkeypatch: pytest.MonkeyPatch, store: Store, hidden: set[bytes]) -> None:
    backend = store.backend
    assert isinstance(backend, lmdb_backend.LmdbBackend)
    real_begin = backend._begin

    def begin(*, write: bool, buffers: bool = False) -> Any:
        txn = real_begin(write=write, buffers=buffers)
        return txn if write else _BlindTxn(txn, backend._index, hidden)

    monkeypatch.setattr(backend, "_begin", begin)


def pack_chunks(store: Store, gen: int) -> set[bytes]:
    """Every chunk stored in the pack that generation ``gen``'s first new chunk lives in."""
    backend = store.backend
    assert isinstance(backend, lmdb_backend.LmdbBackend)
    _, root = store.resolve_root(RUN, gen)
    [shard] = store.read_shards(root)
    first = next(e for e in shard.tensors if e.name == "w").chunks[0]
    pack = backend.locate(first).pack  # type: ignore[union-attr]
    return {k for k in backend.iter_keys(Namespace.CHUNKS) if backend.locate(k).pack == pack}  # type: ignore[union-attr]


@pytest.mark.parametrize("guard", ["check", "reclaim", "none"])
def test_gc_never_deletes_a_pack_that_only_iteration_misses(
    damaged: Path, monkeypatch: pytest.MonkeyPatch, guard: str
) -> None:
    with castore.open(damaged) as store:
        hidden = pack_chunks(store, 1)  # generation 1's own pack (w, and shared)
        blind(monkeypatch, store, hidden)
        assert loadable(store) == list(range(1, GENERATIONS + 1))  # lookups still work
        if guard != "check":  # broken control: no cross-check before the sweep
            monkeypatch.setattr(gc_module, "_check_index", lambda store, dry_run: None)
        if guard == "none":  # ...and no second look by reclaim either
            monkeypatch.setattr(lmdb_backend.LmdbBackend, "_refuse_named", lambda self, p: None)
        if guard == "check":
            with pytest.raises(GcAbortedError, match="iteration does not list it"):
                collect_garbage(store, RetentionPolicy(keep_last=100))
        elif guard == "reclaim":
            with pytest.raises(IndexCorruptError, match="reclaim refused, no pack deleted"):
                collect_garbage(store, RetentionPolicy(keep_last=100))
        else:
            collect_garbage(store, RetentionPolicy(keep_last=100))
        monkeypatch.undo()
    with castore.open(damaged) as store:
        if guard == "none":  # every generation needs the shared chunks of pack 1
            assert loadable(store) == []
        else:
            assert loadable(store) == list(range(1, GENERATIONS + 1))


# -- a damaged free list: the worst case found ----------------------------------------


def damage_free_list(path: Path) -> int:
    """Make the free list name the objects tree's root, a live page: one number changed.

    Returns the page. Loads and ``verify --deep`` never read the free list; the
    next write transaction allocates from it.
    """
    data = bytearray(path.read_bytes())
    txnids = [struct.unpack_from("<Q", data, m * PAGE + 144)[0] for m in (0, 1)]
    meta = PAGE * (txnids[1] > txnids[0])
    free_root, main_root = (struct.unpack_from("<Q", data, meta + at)[0] for at in (80, 128))
    main = bytes(data[main_root * PAGE : (main_root + 1) * PAGE])
    at = main.index(b"objects")  # the node's key; its MDB_db record (root at +40) follows
    objects_root = struct.unpack_from("<Q", main, at + len(b"objects") + 40)[0]
    page = free_root * PAGE
    flags, lower = struct.unpack_from("<HH", data, page + 10)
    assert flags == 0x02 and lower > 16  # a leaf with records: (txnid -> page list)
    (node,) = struct.unpack_from("<H", data, page + 16)
    _, _, node_flags, key_size = struct.unpack_from("<HHHH", data, page + node)
    assert node_flags == 0  # the page list is inline
    pages_at = page + node + 8 + key_size
    (count,) = struct.unpack_from("<Q", data, pages_at)
    # The list is sorted descending; LMDB hands out its last (smallest) entry first.
    struct.pack_into("<Q", data, pages_at + 8 * count, objects_root)
    path.write_bytes(bytes(data))
    return int(objects_root)


@pytest.mark.parametrize("control", [False, True])
def test_a_damaged_free_list_makes_gc_refuse_before_it_writes(
    damaged: Path, monkeypatch: pytest.MonkeyPatch, control: bool
) -> None:
    damage_free_list(data_file(damaged))
    with castore.open(damaged) as store:
        assert loadable(store) == list(range(1, GENERATIONS + 1))
        assert verify_store(store).ok  # structure and chunks: the damage is invisible here
        if control:  # broken control: gc without its pre-sweep check
            monkeypatch.setattr(gc_module, "_check_index", lambda store, dry_run: None)
            collect_garbage(store, RetentionPolicy(keep_last=100))  # frees the 40 garbage chunks
        else:
            with pytest.raises(GcAbortedError, match="both reachable and in the freeDB"):
                collect_garbage(store, RetentionPolicy(keep_last=100))
            report = verify_store(store, deep=True)
            assert report.damaged_generations == [("(store)", None)]
    with castore.open(damaged) as store:
        assert loadable(store) == ([] if control else list(range(1, GENERATIONS + 1)))
    if not control:  # the fix: a fresh LMDB file, then gc works
        report = rebuild_index(damaged)
        assert report.objects_kept == 2 * GENERATIONS and not report.lost
        with castore.open(damaged) as store:
            assert store.backend.check_index().ok
            assert collect_garbage(store, RetentionPolicy(keep_last=100)).chunks_freed == 40
            assert loadable(store) == list(range(1, GENERATIONS + 1))


# -- rebuilding the index -----------------------------------------------------------------


def test_rebuild_restores_a_lost_chunk_index_bitwise(damaged: Path) -> None:
    env = lmdb.open(str(damaged / "chunks"), max_dbs=4)
    index = env.open_db(b"chunk_index")
    with env.begin(write=True) as txn:
        txn.drop(index, delete=False)  # every entry gone
    env.close()
    with castore.open(damaged) as store:
        assert loadable(store) == []
    run = cli("repair", "--rebuild-index", damaged)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "indexed 120 chunk(s)" in run.stdout and "OK: every generation is whole" in run.stdout
    with castore.open(damaged) as store:
        assert loadable(store) == list(range(1, GENERATIONS + 1))
        assert verify_store(store, deep=True).ok
    assert len(list((damaged / "chunks").glob("data.mdb.damaged-*"))) == 1  # kept, not deleted


def test_rebuild_of_a_truncated_file_says_which_generations_stay_damaged(damaged: Path) -> None:
    os.truncate(data_file(damaged), PAGE * 4)
    run = cli("repair", "--rebuild-index", damaged)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "LOST" in run.stdout and "was truncated" in run.stdout
    assert "DAMAGED r@" in run.stdout
    with castore.open(damaged) as store:  # opens again; the chunk index is whole
        assert store.backend.check_index().ok
        assert len(list(store.backend.iter_keys(Namespace.CHUNKS))) == 120


# -- a full map, a full disk ----------------------------------------------------------------


def test_a_tiny_map_size_is_a_full_store_or_grows(tmp_path: Path) -> None:
    with pytest.raises(StoreFullError, match="LMDB map is full"):
        castore.open(tmp_path / "tiny", map_size=4096)
    make_store(tmp_path / "small")
    with castore.open(tmp_path / "small", map_size=64 * 1024) as store:
        for i in range(GENERATIONS + 1, GENERATIONS + 6):
            store.save(state(i), run=RUN, step=i)  # the map grows on demand
        assert store.backend.map_size > 64 * 1024  # type: ignore[attr-defined]
        assert_state_equal(store.load(RUN), state(GENERATIONS + 5))


class _FullDiskTxn:
    def __init__(self, txn: Any) -> None:
        self._txn = txn

    def commit(self) -> None:
        self._txn.abort()
        raise lmdb.DiskError("mdb_txn_commit: No space left on device")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


def test_a_disk_error_on_commit_is_a_full_store_and_the_previous_generation_stays(
    damaged: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with castore.open(damaged) as store:
        backend = store.backend
        assert isinstance(backend, lmdb_backend.LmdbBackend)
        real_begin = backend._begin

        def begin(*, write: bool, buffers: bool = False) -> Any:
            txn = real_begin(write=write, buffers=buffers)
            return _FullDiskTxn(txn) if write else txn

        monkeypatch.setattr(backend, "_begin", begin)
        with pytest.raises(StoreFullError, match="disk is full"):
            store.save(state(50), run=RUN, step=50)
        monkeypatch.undo()
        assert [g.id for g in store.generations(RUN)][-1] == GENERATIONS
        assert_state_equal(store.load(RUN), state(GENERATIONS))
        assert store.save(state(50), run=RUN, step=50).id == GENERATIONS + 1


def test_every_lmdb_error_leaves_the_backend_typed(tmp_path: Path) -> None:
    from castore.chunkstore.lmdb.file import translate

    where = tmp_path
    assert isinstance(translate(lmdb.CorruptedError("x"), where, "read"), IntegrityError)
    assert isinstance(translate(lmdb.PageNotFoundError("x"), where, "read"), IndexCorruptError)
    assert isinstance(translate(lmdb.MapFullError("x"), where, "write"), StoreFullError)
    assert isinstance(translate(lmdb.DiskError("x"), where, "write"), StoreFullError)
    other = translate(lmdb.ReadersFullError("x"), where, "read")
    assert type(other).__name__ == "StoreError" and "ReadersFullError" in str(other)
