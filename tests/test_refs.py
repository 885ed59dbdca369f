"""Refs, reflogs, names, versions, opening, unsupported values and LMDB map growth."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from _helpers import assert_state_equal

import castore
from castore import Store, cli
from castore.chunkstore.base import Namespace
from castore.errors import (
    CorruptRefError,
    FormatVersionError,
    GenerationNotFoundError,
    IntegrityError,
    InvalidNameError,
    NotAStoreError,
    RefConflictError,
    StoreNotFoundError,
    UnsupportedValueError,
)
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import GenerationRoot, ShardManifest, encode_object
from castore.repo.records import RefValue
from castore.repo.reffile import REF_MAGIC
from castore.verify import verify_store

RUN = "run"


def make_state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((8, 16), dtype=np.float32),
        "meta": {"seed": seed, "name": f"s{seed}"},
    }


def ref_file(store: Store, run: str = RUN) -> Path:
    return store.path / "refs" / run


def counts(store: Store) -> tuple[int, int]:
    return (
        sum(1 for _ in store.backend.iter_keys(Namespace.CHUNKS)),
        sum(1 for _ in store.backend.iter_keys(Namespace.OBJECTS)),
    )


# -- compare-and-swap -----------------------------------------------------------


def next_value(store: Store, generation: int, root: Digest) -> RefValue:
    """A new value of RUN's ref under the writer epoch it names now (castore.core.fencing)."""
    current = store.refs.read(RUN)
    return RefValue(RUN, generation, root, time.time(), epoch=current.epoch if current else 0)


def test_advance_from_a_stale_root_conflicts_and_leaves_the_ref(store: Store) -> None:
    g1 = store.save(make_state(1), run=RUN, step=1)
    g2 = store.save(make_state(2), run=RUN, step=2)
    before = ref_file(store).read_bytes()
    reflog_before = store.refs.reflog(RUN)

    stale = Digest.from_hex(g1.root)
    with pytest.raises(RefConflictError, match="ref moved") as info:
        store.refs.advance(RUN, expected=stale, new=next_value(store, 3, stale))
    assert info.value.run == RUN

    assert ref_file(store).read_bytes() == before
    assert store.refs.reflog(RUN) == reflog_before
    assert store.resolve(RUN).id == 2 and store.resolve(RUN).root == g2.root
    assert_state_equal(store.load(RUN), make_state(2))

    # expected=None ("no ref yet") is stale too once the run exists.
    with pytest.raises(RefConflictError):
        store.refs.advance(RUN, expected=None, new=next_value(store, 3, stale))
    assert ref_file(store).read_bytes() == before

    # Control: the right expected value advances.
    current = Digest.from_hex(g2.root)
    store.refs.advance(RUN, expected=current, new=next_value(store, 3, stale))
    assert store.refs.read(RUN) is not None and store.refs.read(RUN).generation == 3


def test_advance_of_a_missing_ref_from_some_root_conflicts(store: Store) -> None:
    some = Digest(b"\x01" * 32)
    with pytest.raises(RefConflictError, match="found no ref"):
        store.refs.advance("fresh", expected=some, new=RefValue("fresh", 1, some, time.time()))
    assert store.refs.read("fresh") is None
    assert not ref_file(store, "fresh").exists()


@pytest.mark.parametrize("generation", [2, 1, 0, -5])
def test_generation_ids_must_increase(store: Store, generation: int) -> None:
    store.save(make_state(1), run=RUN, step=1)
    g2 = store.save(make_state(2), run=RUN, step=2)
    before = ref_file(store).read_bytes()
    current = Digest.from_hex(g2.root)
    with pytest.raises(RefConflictError, match="generation ids must increase"):
        store.refs.advance(RUN, expected=current, new=next_value(store, generation, current))
    assert ref_file(store).read_bytes() == before
    assert store.save(make_state(3), run=RUN, step=3).id == 3  # control


def test_save_racing_another_save_conflicts(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    g1 = store.save(make_state(1), run=RUN, step=1)
    import castore.core.commit as store_module

    real_fault_point = store_module.fault_point
    winner: list[castore.Generation] = []
    raced = threading.Event()

    def other_save_publishes_first(name: str) -> None:
        # The loser has read its parent (gen 1) and committed its objects; now,
        # before it advances the ref, another writer publishes generation 2.
        if name == "save.before_ref_advance" and not raced.is_set():
            raced.set()
            winner.append(store.save(make_state(20), run=RUN, step=20))
        real_fault_point(name)

    monkeypatch.setattr(store_module, "fault_point", other_save_publishes_first)
    with pytest.raises(RefConflictError, match="reload and retry"):
        store.save(make_state(10), run=RUN, step=30)
    monkeypatch.undo()

    assert winner and winner[0].id == 2 and winner[0].parent == g1.root
    latest = store.resolve(RUN)
    assert latest.root == winner[0].root and latest.step == 20
    assert_state_equal(store.load(RUN), make_state(20))
    assert [r["generation"] for r in store.refs.reflog(RUN)] == [1, 2]
    # A retry bases itself on the winner.
    g3 = store.save(make_state(10), run=RUN, step=30)
    assert g3.id == 3 and g3.parent == winner[0].root


def test_concurrent_saves_with_retry_give_a_gapless_chain(store: Store) -> None:
    per_thread, threads = 5, 3
    failures: list[BaseException] = []

    def writer(seed: int) -> None:
        try:
            for i in range(per_thread):
                while True:
                    try:
                        # One process is one writer: its steps may not go back, so the
                        # saver is told apart by metadata, not by step.
                        store.save(
                            make_state(seed * 100 + i),
                            run=RUN,
                            step=0,
                            metadata={"saver": seed * 100 + i},
                        )
                        break
                    except RefConflictError:
                        continue
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not failures
    total = per_thread * threads
    gens = store.generations(RUN)
    assert [g.id for g in gens] == list(range(1, total + 1))
    assert all(b.parent == a.root for a, b in zip(gens[:-1], gens[1:], strict=True))
    assert sorted(g.metadata["saver"] for g in gens) == sorted(
        t * 100 + i for t in range(threads) for i in range(per_thread)
    )
    records = store.refs.reflog(RUN)
    assert [r["generation"] for r in records] == list(range(1, total + 1))
    assert {r["action"] for r in records} == {"advance"}


# -- run names --------------------------------------------------------------------

BAD_NAMES = ["../x", "a/b", "", ".hidden", "x" * 200, "x" * 129, "a b", "a..b", "-x", "a\n", "é"]
NOT_STRINGS = [None, 5, b"run", Path("run")]


@pytest.mark.parametrize("name", BAD_NAMES + NOT_STRINGS, ids=repr)
def test_invalid_run_names_are_refused_everywhere(
    store: Store, store_path: Path, name: Any
) -> None:
    state = make_state()
    store.save(state, run=RUN, step=0)
    listing = sorted(p.relative_to(store_path.parent) for p in store_path.parent.rglob("*"))
    some = Digest(b"\x02" * 32)

    calls = [
        lambda: store.save(state, run=name, step=1),
        lambda: store.load(name),
        lambda: store.resolve(name),
        lambda: store.generations(name),
        lambda: store.read_slice(name, "latest", "w", 0),
        lambda: store.refs.read(name),
        lambda: store.refs.reflog(name),
        lambda: store.refs.advance(name, expected=None, new=RefValue(str(name), 1, some, 0.0)),
    ]
    for call in calls:
        with pytest.raises(InvalidNameError) as info:
            call()
        assert isinstance(info.value, ValueError)
        assert "invalid run name" in str(info.value)

    # Nothing was written anywhere, inside or outside the store.
    assert sorted(p.relative_to(store_path.parent) for p in store_path.parent.rglob("*")) == listing
    assert store.runs() == [RUN]


@pytest.mark.parametrize("name", ["a", "Z9", "run-1_b.c", "x" * 128, "1.0"])
def test_valid_run_names_are_accepted(store: Store, name: str) -> None:
    state = make_state()
    assert store.save(state, run=name, step=1).id == 1
    assert_state_equal(store.load(name), state)
    assert store.runs() == [name]


# -- format versions ------------------------------------------------------------


def test_future_store_marker_version_is_refused(store_path: Path) -> None:
    castore.open(store_path).close()
    marker = store_path / "castore.json"
    config = json.loads(marker.read_text())
    assert config["format_version"] == 4  # control: what we are about to bump
    config["format_version"] = 999
    marker.write_text(json.dumps(config))

    for create in (True, False):
        with pytest.raises(FormatVersionError, match="upgrade castore"):
            castore.open(store_path, create=create)
    assert json.loads(marker.read_text())["format_version"] == 999  # not rewritten


def test_store_of_format_1_is_refused_with_what_to_do(
    store_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    castore.open(store_path).close()
    marker = store_path / "castore.json"
    config = json.loads(marker.read_text())
    config["format_version"] = 1  # chunk bytes inside LMDB: not readable any more
    marker.write_text(json.dumps(config))
    with pytest.raises(FormatVersionError, match="format version 1, which kept chunk bytes"):
        castore.open(store_path)
    assert cli.main(["log", str(store_path)]) != 0
    err = capsys.readouterr().err
    assert "format version 1" in err and len(err.strip().splitlines()) == 1


def _put_object(store: Store, data: bytes) -> Digest:
    digest = Digest(digest_bytes(data))
    store.backend.put_many(Namespace.OBJECTS, [(digest.raw, data)])
    return digest


def test_future_root_object_version_is_refused(store: Store) -> None:
    store.save(make_state(), run=RUN, step=1)
    digest, root = store.resolve_root(RUN)
    wire = root.to_wire()
    wire.update(format=999, generation=2, parent=digest.raw)
    future = _put_object(store, msgpack.packb(wire, use_bin_type=True))
    store.refs.advance(RUN, expected=digest, new=next_value(store, 2, future))

    with pytest.raises(FormatVersionError, match="format version 999") as info:
        store.load(RUN)
    assert info.value.run == RUN and "upgrade castore" in str(info.value)
    assert not isinstance(info.value, IntegrityError)
    report = verify_store(store)
    assert not report.ok and "FormatVersionError" in report.problems[0].what


def test_future_shard_object_version_is_refused(store: Store) -> None:
    shard = ShardManifest(run=RUN, generation=1, rank=0, tensors=())
    wire = shard.to_wire()
    wire["format"] = 999
    shard_digest = _put_object(store, msgpack.packb(wire, use_bin_type=True))
    root = GenerationRoot(
        run=RUN,
        generation=1,
        step=0,
        parent=None,
        time=1.0,
        world_size=1,
        shards=(shard_digest.raw,),
        state=msgpack.packb({}),
    )
    root_digest = _put_object(store, encode_object(root))
    store.refs.advance(RUN, expected=None, new=RefValue(RUN, 1, root_digest, 1.0))
    with pytest.raises(FormatVersionError, match="format version 999"):
        store.load(RUN)


def test_future_ref_version_is_refused(store: Store) -> None:
    store.save(make_state(), run=RUN, step=1)
    path = ref_file(store)
    data = path.read_bytes()
    body = bytearray(data[:-32])
    struct.pack_into("<H", body, len(REF_MAGIC), 999)
    path.write_bytes(bytes(body) + digest_bytes(bytes(body)))  # checksum is valid

    with pytest.raises(FormatVersionError, match="format version 999"):
        store.load(RUN)
    with pytest.raises(FormatVersionError):
        store.refs.read(RUN)


# -- damaged refs ----------------------------------------------------------------


def _assert_ref_refused(store: Store, store_path: Path, error: type[Exception]) -> None:
    """The damaged ref is refused by every reader and by verify; no data comes back."""
    for call in (
        lambda: store.load(RUN),
        lambda: store.resolve(RUN),
        lambda: store.refs.read(RUN),
        lambda: store.generations(RUN),
        lambda: store.read_slice(RUN, "latest", "w", 0),
    ):
        with pytest.raises(error) as info:
            call()
        assert info.value.run == RUN
    before = ref_file(store).read_bytes()
    # A save must not paper over it (e.g. restart the run at generation 1).
    with pytest.raises(error):
        store.save(make_state(9), run=RUN, step=9)
    assert ref_file(store).read_bytes() == before
    store.close()
    assert cli.main(["verify", str(store_path)]) == 1


@pytest.fixture
def saved_ref(store: Store) -> bytes:
    store.save(make_state(1), run=RUN, step=1)
    store.save(make_state(2), run=RUN, step=2)
    assert_state_equal(store.load(RUN), make_state(2))  # control
    return ref_file(store).read_bytes()


VERSION_FIELD = range(len(REF_MAGIC), len(REF_MAGIC) + 2)


def test_garbled_ref_is_refused_at_every_byte(store: Store, saved_ref: bytes) -> None:
    path = ref_file(store)
    for at in range(len(saved_ref)):
        for mask in (0x01, 0x80):
            damaged = bytearray(saved_ref)
            damaged[at] ^= mask
            path.write_bytes(bytes(damaged))
            # A flip that raises the version field reads as "from the future";
            # anywhere else the ref is simply corrupt.
            expected = (
                (CorruptRefError, FormatVersionError) if at in VERSION_FIELD else (CorruptRefError)
            )
            with pytest.raises(expected):
                store.load(RUN)
    path.write_bytes(saved_ref)
    assert_state_equal(store.load(RUN), make_state(2))  # control: the original is fine


@pytest.mark.parametrize("at", [20, -1, -33])
def test_garbled_ref_is_refused_by_all_readers_and_verify(
    store: Store, store_path: Path, saved_ref: bytes, at: int
) -> None:
    damaged = bytearray(saved_ref)
    damaged[at] ^= 0x04
    ref_file(store).write_bytes(bytes(damaged))
    _assert_ref_refused(store, store_path, CorruptRefError)


@pytest.mark.parametrize("keep", ["0", "5", "14", "half", "len-1", "len+1"])
def test_truncated_or_extended_ref_is_corrupt(
    store: Store, store_path: Path, saved_ref: bytes, keep: str
) -> None:
    size = len(saved_ref)
    if keep == "len+1":
        data = saved_ref + b"\x00"
    else:
        length = {"half": size // 2, "len-1": size - 1}.get(keep) or int(keep)
        data = saved_ref[:length]
    ref_file(store).write_bytes(data)
    _assert_ref_refused(store, store_path, CorruptRefError)


def test_ref_with_wrong_magic_is_corrupt(store: Store, store_path: Path, saved_ref: bytes) -> None:
    body = b"NOTAREF\n" + saved_ref[len(REF_MAGIC) : -32]
    ref_file(store).write_bytes(body + digest_bytes(body))  # checksum valid, magic wrong
    _assert_ref_refused(store, store_path, CorruptRefError)


def test_ref_naming_another_run_is_corrupt(
    store: Store, store_path: Path, saved_ref: bytes
) -> None:
    store.save(make_state(5), run="other", step=5)
    ref_file(store).write_bytes(ref_file(store, "other").read_bytes())  # valid, wrong run
    with pytest.raises(CorruptRefError, match="names run 'other'"):
        store.refs.read(RUN)
    _assert_ref_refused(store, store_path, CorruptRefError)


def test_ref_with_a_bad_payload_but_valid_checksum_is_corrupt(
    store: Store, store_path: Path, saved_ref: bytes
) -> None:
    payload = msgpack.packb({"run": RUN, "generation": "two", "root": b"x", "time": 0.0})
    body = struct.pack("<8sHI", REF_MAGIC, 1, len(payload)) + payload
    ref_file(store).write_bytes(body + digest_bytes(body))
    _assert_ref_refused(store, store_path, CorruptRefError)


def test_cli_verify_of_an_intact_store_exits_zero(store: Store, store_path: Path) -> None:
    store.save(make_state(), run=RUN, step=1)
    store.close()
    assert cli.main(["verify", str(store_path)]) == 0


# -- reflog ----------------------------------------------------------------------


def test_every_advance_is_in_the_reflog(store: Store) -> None:
    gens = [store.save(make_state(i), run=RUN, step=10 * i) for i in range(3)]
    records = store.refs.reflog(RUN)
    assert len(records) == 3
    parent = None
    for record, gen in zip(records, gens, strict=True):
        assert record["action"] == "advance"
        assert record["generation"] == gen.id
        assert record["root"] == gen.root
        assert record["parent"] == parent
        assert record["run"] == RUN
        parent = gen.root
    assert store.refs.reflog("never-saved") == []


def test_a_torn_last_reflog_line_is_skipped(store: Store) -> None:
    store.save(make_state(1), run=RUN, step=1)
    store.save(make_state(2), run=RUN, step=2)
    path = store.refs.reflog_path(RUN)
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    assert len(lines) == 2
    for cut in (1, len(lines[1]) // 2, len(lines[1]) - 2):
        path.write_bytes(lines[0] + lines[1][:cut])
        records = store.refs.reflog(RUN)
        assert [r["generation"] for r in records] == [1]


def test_a_torn_last_reflog_line_does_not_swallow_the_next_record(store: Store) -> None:
    store.save(make_state(1), run=RUN, step=1)
    path = store.refs.reflog_path(RUN)
    intact = path.read_bytes()
    path.write_bytes(intact + intact[:30])  # a torn, partial second record
    g2 = store.save(make_state(2), run=RUN, step=2)
    records = store.refs.reflog(RUN)
    assert [(r["generation"], r["root"]) for r in records] == [
        (1, records[0]["root"]),
        (2, g2.root),
    ]


def test_a_lost_reflog_record_is_recovered_by_the_next_advance(store: Store) -> None:
    g1 = store.save(make_state(1), run=RUN, step=1)
    g2 = store.save(make_state(2), run=RUN, step=2)
    path = store.refs.reflog_path(RUN)
    lines = path.read_bytes().splitlines(keepends=True)
    # The ref names gen 2 but its record "never made it": a crash between the
    # ref replace and the reflog append.
    path.write_bytes(lines[0])
    assert [r["generation"] for r in store.refs.reflog(RUN)] == [1]

    g3 = store.save(make_state(3), run=RUN, step=3)
    records = store.refs.reflog(RUN)
    assert [(r["action"], r["generation"]) for r in records] == [
        ("advance", 1),
        ("recovered", 2),
        ("advance", 3),
    ]
    assert records[1]["root"] == g2.root and records[1]["parent"] == g1.root
    assert records[2]["root"] == g3.root and records[2]["parent"] == g2.root


def test_an_intact_reflog_gets_no_recovered_record(store: Store) -> None:
    for i in range(3):
        store.save(make_state(i), run=RUN, step=i)
    assert all(r["action"] == "advance" for r in store.refs.reflog(RUN))


# -- opening ---------------------------------------------------------------------


def test_open_a_file_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("hello")
    for create in (True, False):
        with pytest.raises(NotAStoreError):
            castore.open(path, create=create)
    assert path.read_text() == "hello"


def test_open_a_foreign_directory_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "project"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(NotAStoreError, match="not a castore store"):
        castore.open(path)
    assert sorted(p.name for p in path.iterdir()) == ["notes.txt"]  # nothing created


def test_open_a_foreign_marker_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "other"
    path.mkdir()
    (path / "castore.json").write_text('{"format": "something-else", "format_version": 1}')
    with pytest.raises(NotAStoreError):
        castore.open(path)
    (path / "castore.json").write_text("{not json")
    with pytest.raises(NotAStoreError):
        castore.open(path)


def test_open_missing_without_create(tmp_path: Path) -> None:
    path = tmp_path / "nowhere"
    with pytest.raises(StoreNotFoundError) as info:
        castore.open(path, create=False)
    assert isinstance(info.value, FileNotFoundError)
    assert not path.exists()
    # Control: with create (the default) the same path becomes a store.
    with castore.open(path) as store:
        assert store.runs() == []
    assert (path / "castore.json").is_file()
    castore.open(path, create=False).close()


def test_load_of_an_unknown_run_is_not_found(store: Store) -> None:
    with pytest.raises(GenerationNotFoundError) as info:
        store.load("nobody")
    assert isinstance(info.value, LookupError)


# -- unsupported values ------------------------------------------------------------


def _sparse() -> Any:
    torch = pytest.importorskip("torch")
    return torch.eye(3).to_sparse()


UNSUPPORTED = [
    pytest.param(lambda: {"a": {"b": {1, 2}}}, "a/b", id="set"),
    pytest.param(lambda: {"x": [0, object()]}, "x/1", id="object"),
    pytest.param(lambda: {"opt": {(0, 1): 3}}, "opt", id="tuple-key"),
    pytest.param(lambda: {"m": {"sparse": _sparse()}}, "m/sparse", id="torch-sparse"),
    pytest.param(lambda: {"arr": np.array([1, "a"], dtype=object)}, "arr", id="object-array"),
]


@pytest.mark.parametrize("make_bad, path", UNSUPPORTED)
def test_unsupported_values_are_refused_before_anything_is_written(
    store: Store, make_bad: Any, path: str
) -> None:
    store.save(make_state(1), run=RUN, step=1)
    ref_before = ref_file(store).read_bytes()
    counts_before = counts(store)
    # A good tensor comes first: even its chunks must not be written.
    state = {"first": np.arange(1000, dtype=np.int64), **make_bad()}

    with pytest.raises(UnsupportedValueError) as info:
        store.save(state, run=RUN, step=2)
    assert isinstance(info.value, TypeError)
    assert info.value.key_path == path
    assert f" {path}" in str(info.value)

    assert ref_file(store).read_bytes() == ref_before
    assert counts(store) == counts_before
    assert store.resolve(RUN).id == 1
    with pytest.raises(UnsupportedValueError):
        store.save(make_bad(), run="fresh", step=0)
    assert store.runs() == [RUN]


def test_unsupported_metadata_is_refused(store: Store) -> None:
    with pytest.raises(UnsupportedValueError, match="at tags"):
        store.save(make_state(), run=RUN, step=1, metadata={"tags": {"a", "b"}})
    with pytest.raises(UnsupportedValueError, match="tensors are not allowed"):
        store.save(make_state(), run=RUN, step=1, metadata={"w": np.zeros(2)})
    assert store.runs() == []
    assert counts(store) == (0, 0)


# -- LMDB map growth --------------------------------------------------------------


def test_a_tiny_lmdb_map_grows_to_fit_a_save(tmp_path: Path) -> None:
    # Chunk bytes go to pack files; what fills the map is the manifest, here one
    # entry for each of 6000 small tensors (about 300 KiB of msgpack in the compact
    # table, over a map of 256 KiB).
    path = tmp_path / "tiny"
    tiny_map = 1 << 18
    rng = np.random.default_rng(0)
    many = {f"t{i:05d}": rng.standard_normal(2) for i in range(6000)}
    with castore.open(path, map_size=tiny_map) as store:
        assert store.backend.map_size == tiny_map
        store.save(many, run=RUN, step=1)
        assert store.backend.map_size > tiny_map
        assert_state_equal(store.load(RUN), many)

    # Reopened with the same tiny map: LMDB rounds up to what is used, and the
    # map grows again for more data.
    more = {name: value + 1.0 for name, value in many.items()}
    with castore.open(path, map_size=tiny_map) as store:
        grown = store.backend.map_size
        store.save(more, run=RUN, step=2)
        assert store.backend.map_size > grown
    with castore.open(path) as store:
        assert_state_equal(store.load(RUN, 1), many)
        assert_state_equal(store.load(RUN, 2), more)


def test_advance_refuses_a_value_for_another_run(store: Store) -> None:
    gen = store.save(make_state(), run="b", step=1)
    root = Digest.from_hex(gen.root)
    with pytest.raises((ValueError, RefConflictError)):
        store.refs.advance("a", expected=None, new=RefValue("b", 1, root, time.time()))
    assert store.refs.read("a") is None
