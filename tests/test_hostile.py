"""A store from an untrusted source: well-hashed manifests whose fields lie, deep
nesting, lost refs, malformed reflog records. Every reader answers with a typed
castore error (or bytes exactly as the chunks hold them), never a crash, never
uninitialised memory, never a run lost to garbage collection."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from cli_runner import run_cli
from hostile import (
    BAD_ENTRIES,
    LAYOUTS,
    compact_of,
    forge_entry,
    forge_root,
    latest_wires,
    nested_tuple_payload,
    publish_forged,
    table_of,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pregrid import pre_grid_saves

import castore
import castore.dist
from castore import Store
from castore.chunkstore.base import Namespace
from castore.core.reading import check_coverage
from castore.errors import (
    CastoreError,
    CorruptObjectError,
    CoverageError,
    GenerationNotFoundError,
    LostRunError,
    UnsupportedValueError,
)
from castore.format.objects import TensorEntry
from castore.format.tree import MAX_DEPTH
from castore.gc import GcAbortedError, RetentionPolicy, collect_garbage
from castore.verify import verify_store

RUN = "hostile"
TENSOR = "w"
ORIGINAL = np.arange(24 * 16, dtype=np.float32).reshape(24, 16)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *, code: int = 1) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("castore: error:"), result.stderr
    assert "internal error" not in lines[0] and "Traceback" not in result.stderr


@pytest.fixture
def saved(store: Store) -> Store:
    """Generation 1 of RUN: one float32 tensor over several 1 KiB chunks, and a plain value,
    saved as castore did before the chunk grid (so every layout, format 1 included, can
    hold its entries; tests/test_grid_wiring.py forges grids)."""
    with pre_grid_saves():
        store.save({TENSOR: ORIGINAL, "note": "intact"}, run=RUN, step=1)
    return store


# -- inconsistent tensor entries -------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_inconsistent_entry_is_a_typed_error_for_every_reader(
    saved: Store, case: str, layout: str
) -> None:
    forged = forge_entry(saved, RUN, TENSOR, BAD_ENTRIES[case], layout=layout)
    with pytest.raises(CastoreError):
        saved.load(RUN)
    with pytest.raises(CastoreError):
        saved.read_slice(RUN, forged, TENSOR, np.s_[20:])
    with pytest.raises(CastoreError):
        castore.dist.load(saved, RUN, {}, load_rest=True, framework="numpy")
    report = verify_store(saved, run=RUN, deep=True)
    assert [p.generation for p in report.problems] == [forged], report.problems
    # The fallback walks past the forged generation to the intact one, bitwise.
    restored = saved.restore(RUN, fallback="previous")
    assert restored.generation.id == 1 and [s.generation for s in restored.skipped] == [forged]
    np.testing.assert_array_equal(restored.state[TENSOR], ORIGINAL)


def test_short_entry_no_longer_returns_stale_memory(saved: Store) -> None:
    """The reported bug: nbytes and chunks smaller than the shape gave a stale tail."""
    forge_entry(saved, RUN, TENSOR, BAD_ENTRIES["nbytes and chunks smaller than the shape"])
    with pytest.raises(CorruptObjectError, match="says 1024 bytes, its box of float32 holds"):
        saved.load(RUN)


def test_read_slice_of_a_region_no_box_covers_is_a_coverage_error(saved: Store) -> None:
    forged = forge_entry(saved, RUN, TENSOR, BAD_ENTRIES["box smaller than the shape (a gap)"])
    # Rows 0..22 are saved, row 23 is in no box: reading it must not return garbage.
    with pytest.raises(CoverageError, match="cover"):
        saved.read_slice(RUN, forged, TENSOR, np.s_[23])
    with pytest.raises(CoverageError):
        saved.read_slice(RUN, forged, TENSOR, np.s_[0])  # fails closed for the whole tensor


def test_overlapping_boxes_are_a_coverage_error_naming_the_tensor() -> None:
    """Two boxes of one tensor sharing a row (it was a TypeError: the tensor named twice)."""

    def rows(first: int) -> TensorEntry:
        return TensorEntry(TENSOR, "float32", (4, 2), (first, 0), (3, 2), 24, 64, (bytes(32),))

    with pytest.raises(CoverageError, match="overlap at offsets") as caught:
        check_coverage([rows(0), rows(1)], {"run": RUN, "generation": 1})
    assert caught.value.tensor == TENSOR


def test_a_shape_of_1e15_elements_is_refused_before_allocating(saved: Store) -> None:
    forge_entry(saved, RUN, TENSOR, BAD_ENTRIES["one-dimensional shape of 1e15"])
    with pytest.raises(CorruptObjectError, match="holds 4000000000000000"):
        saved.load(RUN)


# -- the property: random inconsistent entries -------------------------------------


def _entry_mutation(draw: Any) -> dict[str, Any]:
    small_ints = st.integers(min_value=-3, max_value=40)
    dims = st.lists(small_ints, min_size=0, max_size=3)
    fields = {
        "shape": dims,
        "offsets": dims,
        "local_shape": dims,
        "nbytes": st.integers(min_value=-5, max_value=3 * 1024),
        "chunk_size": st.sampled_from([-1, 0, 1, 512, 1024, 2048, 1 << 31]),
        "dtype": st.sampled_from(["float32", "int32", "float64", "uint8", "bfloat16", "x"]),
        "chunk_count": st.integers(min_value=0, max_value=8),
    }
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4, unique=True))
    return {name: draw(fields[name]) for name in chosen}


@st.composite
def entry_mutations(draw: Any) -> dict[str, Any]:
    return _entry_mutation(draw)


def _apply(changes: dict[str, Any]) -> Any:
    def mutate(entry: dict[str, Any]) -> None:
        for key, value in changes.items():
            if key == "chunk_count":
                entry["chunks"] = (entry["chunks"] * 8)[:value]
            else:
                entry[key] = value

    return mutate


def _expected(entry_shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """What a consistent forged entry may return: the chunk bytes, reinterpreted."""
    from castore.format.dtypes import numpy_dtype

    return np.frombuffer(ORIGINAL.tobytes(), dtype=numpy_dtype(dtype)).reshape(entry_shape)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(changes=entry_mutations(), layout=st.sampled_from(LAYOUTS))
def test_random_inconsistent_entries_give_typed_errors_or_exact_bytes(
    saved: Store, changes: dict[str, Any], layout: str
) -> None:
    forged = forge_entry(saved, RUN, TENSOR, _apply(changes), base=1, layout=layout)
    _, root = saved.resolve_root(RUN, forged)
    readers = {
        "load": lambda: saved.load(RUN, forged)[TENSOR],
        "read_slice": lambda: saved.read_slice(RUN, forged, TENSOR, ...),
        "dist.load": lambda: castore.dist.load(
            saved, RUN, {}, forged, load_rest=True, framework="numpy"
        ).state[TENSOR],
    }
    for name, read in readers.items():
        try:
            value = read()
        except CastoreError:
            continue
        # Accepted: then it must be exactly the saved bytes under the entry's meaning.
        assert value.nbytes == ORIGINAL.nbytes, (name, changes)
        assert value.tobytes() == ORIGINAL.tobytes(), (name, changes)
    report = verify_store(saved, run=RUN, generation=forged, deep=True)
    try:
        saved.load(RUN, forged)
        assert report.ok, (changes, report.problems)
    except CastoreError:
        assert not report.ok, changes
    assert root.generation == forged


# Not "compact": a format-4 table has no byte count to forge (the reader derives it
# from the box), so a short entry cannot be written in it at all.
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "compact"])
def test_the_property_catches_a_reader_that_skips_validation(
    saved: Store, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Broken control: without the entry checks, a short entry returns bytes nobody wrote."""
    import castore.core.reading as reading_module
    from castore.core.readplan import ReadPlan
    from castore.format.objects import EntryTable, TensorEntry

    def unchecked_table(table: Any, n: int) -> Any:  # where each entry's digests start, no more
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(-(-table._nbytes // table._chunk_size), out=starts[1:])
        return starts

    allocate, add_whole = reading_module.allocate, ReadPlan.add_whole

    def poisoned(dtype: str, shape: tuple[int, ...], framework: str) -> Any:
        tensor, flat = allocate(dtype, shape, framework)
        flat[:] = 0xAB  # what "uninitialised" looks like, made visible
        return tensor, flat

    def unchecked(plan: ReadPlan, entry: TensorEntry, flat: memoryview, where: Any) -> None:
        add_whole(plan, entry, flat[: entry.nbytes], where)  # the plan's own size check skipped

    monkeypatch.setattr(TensorEntry, "check", lambda self: None)
    monkeypatch.setattr(EntryTable, "_check", unchecked_table)
    monkeypatch.setattr(reading_module, "allocate", poisoned)
    monkeypatch.setattr(ReadPlan, "add_whole", unchecked)
    forged = forge_entry(
        saved, RUN, TENSOR, BAD_ENTRIES["nbytes and chunks smaller than the shape"], layout=layout
    )
    value = saved.load(RUN, forged)[TENSOR].tobytes()
    assert value[:1024] == ORIGINAL.tobytes()[:1024]
    assert value[1024:] == b"\xab" * (ORIGINAL.nbytes - 1024)  # the oracle above rejects this
    assert value != ORIGINAL.tobytes()


# -- malformed tensor tables (format 2) ----------------------------------------------


def _i64(*values: int) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


BAD_TABLES: dict[str, tuple[Any, str]] = {
    # name: (mutation of the shard's table, what the error says)
    "a field missing": (lambda t: t.pop("ndim"), "table's fields"),
    "a field too many": (lambda t: t.update(extra=b""), "table's fields"),
    "more names than entries": (lambda t: t.update(name=[*t["name"], "x"]), "1 dtypes for 2"),
    "a byte count too many": (lambda t: t.update(nbytes=t["nbytes"] + _i64(4)), "disagree"),
    "fewer dtypes than names": (lambda t: t.update(dtype=t["dtype"][:-1]), "dtypes for"),
    "a name that is not text": (lambda t: t.update(name=[b"w", *t["name"][1:]]), "strings"),
    "a column that is not bytes": (lambda t: t.update(nbytes=[1]), "has type list"),
    "a ragged integer column": (lambda t: t.update(shape=t["shape"] + b"\0"), "8-byte"),
    "more dimensions than values": (lambda t: t.update(ndim=b"\x03" + t["ndim"][1:]), "rank"),
    "65 dimensions": (
        lambda t: t.update(
            ndim=b"\x41",
            shape=_i64(*[1] * 65),
            offsets=_i64(*[0] * 65),
            local_shape=_i64(*[1] * 65),
        ),
        "65 dimensions",
    ),
    "a box of 2**80 bytes": (
        lambda t: t.update(shape=_i64(1 << 40, 1 << 40), local_shape=_i64(1 << 40, 1 << 40)),
        "holds 4835703278458516698824704",
    ),
    "digests one byte short": (lambda t: t.update(chunks=t["chunks"][:-1]), "digests of 32"),
    "a digest too many": (lambda t: t.update(chunks=t["chunks"] * 2), "digests of 32"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_a_malformed_tensor_table_is_corrupt_for_every_reader(saved: Store, case: str) -> None:
    mutate, message = BAD_TABLES[case]
    _, root, shards = latest_wires(saved, RUN)
    shards[0]["tensors"] = table_of(shards[0]["tensors"])  # format 2
    mutate(shards[0]["tensors"])
    assert_corrupt_for_every_reader(saved, publish_forged(saved, RUN, root, shards), message)


def assert_corrupt_for_every_reader(saved: Store, forged: int, message: str) -> None:
    """load, read_slice and verify refuse generation ``forged`` with ``message``; the
    previous generation restores intact."""
    with pytest.raises(CorruptObjectError, match=message):
        saved.load(RUN)
    with pytest.raises(CorruptObjectError, match=message):
        saved.read_slice(RUN, forged, TENSOR, np.s_[20:])
    report = verify_store(saved, run=RUN, deep=True)
    assert [p.generation for p in report.problems] == [forged], report.problems
    restored = saved.restore(RUN, fallback="previous")
    assert restored.generation.id == 1
    np.testing.assert_array_equal(restored.state[TENSOR], ORIGINAL)


BAD_COMPACT: dict[str, tuple[Any, str]] = {
    # name: (mutation of the shard's compact table, what the error says)
    "a field missing": (lambda t: t.pop("width"), "compact table's fields"),
    "a field of format 3": (lambda t: t.update(nbytes=b""), "compact table's fields"),
    "a width that is no width": (lambda t: t.update(width=3), "value width 3"),
    "a kind index past the kinds": (lambda t: t.update(kind=b"\x05"), "names kind 5 of 1"),
    "a kind of four fields": (lambda t: t.update(kinds=[t["kinds"][0][:4]]), "kinds must be"),
    "a cell dimension past 255": (
        lambda t: t.update(kinds=[[*t["kinds"][0][:3], 300, 0]]),
        "kinds must be",
    ),
    "an unknown dtype": (
        lambda t: t.update(kinds=[["float128", *t["kinds"][0][1:]]]),
        "unknown dtype",
    ),
    "a ragged value column": (lambda t: t.update(shape=t["shape"] + b"\0"), "whole values"),
    "more kinds indexes than names": (lambda t: t.update(kind=t["kind"] * 2), "kinds for"),
    "a box of 2**80 bytes": (
        lambda t: t.update(shape=_i64(1 << 40, 1 << 40), local_shape=_i64(1 << 40, 1 << 40)),
        "2\\^61 bytes or more",
    ),
    "digests one byte short": (lambda t: t.update(chunks=t["chunks"][:-1]), "digests of 32"),
}


@pytest.mark.parametrize("case", sorted(BAD_COMPACT))
def test_a_malformed_compact_table_is_corrupt_for_every_reader(saved: Store, case: str) -> None:
    mutate, message = BAD_COMPACT[case]
    _, root, shards = latest_wires(saved, RUN)
    shards[0]["tensors"] = compact_of(shards[0]["tensors"])  # format 4
    shards[0]["format"] = 4
    mutate(shards[0]["tensors"])
    forged = publish_forged(saved, RUN, root, shards, layout="compact")
    assert_corrupt_for_every_reader(saved, forged, message)


def test_a_store_written_with_format_1_shards_reads_unchanged(saved: Store) -> None:
    """Shards whose entries are lists of maps (every store before the table) still read."""
    _, root, shards = latest_wires(saved, RUN)
    old = publish_forged(saved, RUN, root, shards, layout="rows")
    _, forged_root = saved.resolve_root(RUN, old)
    data = saved.backend.get(Namespace.OBJECTS, forged_root.shards[0])
    assert msgpack.unpackb(data)["format"] == 1
    np.testing.assert_array_equal(saved.load(RUN, old)[TENSOR], ORIGINAL)
    np.testing.assert_array_equal(saved.read_slice(RUN, old, TENSOR, np.s_[3:5]), ORIGINAL[3:5])
    assert verify_store(saved, run=RUN, deep=True).ok
    saved.save({TENSOR: ORIGINAL, "note": "intact"}, run=RUN, step=3)  # reuses every chunk
    assert saved.generations(RUN)[-1].stats.new_chunks == 0


def test_a_load_plan_refuses_a_short_entry_even_without_the_entry_check(
    saved: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second line: the plan sizes each read by the buffer it fills, not by the entry
    alone (the control above skips both checks and gets bytes nobody wrote)."""
    from castore.format.objects import TensorEntry

    monkeypatch.setattr(TensorEntry, "check", lambda self: None)
    forged = forge_entry(
        saved, RUN, TENSOR, BAD_ENTRIES["nbytes and chunks smaller than the shape"], layout="rows"
    )
    with pytest.raises(CorruptObjectError, match="says 1024 bytes, its box holds 1536") as info:
        saved.load(RUN, forged)
    assert (info.value.tensor, info.value.run, info.value.generation) == (TENSOR, RUN, forged)


def test_read_slice_decodes_only_the_entries_it_reads(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial read builds the one entry it needs, not one per tensor of the shard."""
    from castore.format.objects import TensorEntry

    state = {f"t{i}": np.full(4, i, dtype=np.float32) for i in range(50)}
    store.save(state, run=RUN, step=1)
    built: list[str] = []
    trusted = TensorEntry.trusted.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, name: str, *fields: Any) -> Any:
        built.append(name)
        return trusted(cls, name, *fields)

    monkeypatch.setattr(TensorEntry, "trusted", classmethod(counting))
    assert store.read_slice(RUN, 1, "t7", np.s_[1:3]).tolist() == [7.0, 7.0]
    assert built == ["t7"]
    store.load(RUN)
    assert len(built) == 51  # a whole load builds every entry


# -- nesting -------------------------------------------------------------------------


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = (value,)
    return value


def test_deep_nesting_is_refused_on_save_with_the_key_path(store: Store) -> None:
    with pytest.raises(UnsupportedValueError, match=r"more than 64 levels deep at x/0/0"):
        store.save({"x": _nested(200)}, run=RUN, step=1)
    assert store.runs() == []  # nothing was published


def test_nesting_up_to_the_limit_round_trips(store: Store) -> None:
    state = {"x": _nested(MAX_DEPTH - 1), "o": OrderedDict(a=[[{"b": (1,)}]])}
    store.save(state, run=RUN, step=1)
    assert store.load(RUN) == state


def test_nested_metadata_is_refused_on_save(store: Store) -> None:
    with pytest.raises(UnsupportedValueError):
        store.save({"w": ORIGINAL}, run=RUN, step=1, metadata={"m": _nested(100)})
    with pytest.raises(UnsupportedValueError, match="data_order"):
        nested: Any = 1
        for _ in range(20):
            nested = [nested]
        store.save({"w": ORIGINAL}, run=RUN, step=1, data_order={"d": nested})


SEGFAULT_PROBE = """
import sys, castore
from castore.errors import CastoreError
store = castore.open(sys.argv[1], create=False)
try:
    {call}
except CastoreError as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
"""


@pytest.mark.parametrize(
    "call",
    [
        "store.load('hostile')",
        "store.generations('hostile')",
        "castore.dist.load(store, 'hostile', {}, load_rest=True)",
    ],
)
@pytest.mark.parametrize("field", ["state", "metadata"])
def test_crafted_deep_nesting_is_a_typed_error_not_a_segfault(
    saved: Store, store_path: Path, call: str, field: str
) -> None:
    depth = 2000  # past what the C stack survives with one unpack per level

    def deepen(root: dict[str, Any]) -> None:
        root[field] = nested_tuple_payload(depth)

    forge_root(saved, RUN, deepen)
    saved.close()
    code = "import castore.dist\n" + SEGFAULT_PROBE.format(call=call)
    result = subprocess.run(
        [sys.executable, "-c", code, str(store_path)], capture_output=True, text=True, timeout=120
    )
    if field == "state" and "generations" in call:
        assert result.returncode == 0, result  # listing never decodes a state
        return
    assert result.returncode == 3, (result.returncode, result.stderr[-2000:])
    assert "CorruptObjectError" in result.stdout and "nests more than" in result.stdout


@pytest.mark.parametrize("command", [["log"], ["du"], ["gc", "--keep", "5"], ["verify"]])
def test_cli_on_crafted_nesting_prints_one_line(
    saved: Store, store_path: Path, command: list[str]
) -> None:
    forge_root(saved, RUN, lambda root: root.update(metadata=nested_tuple_payload(2000)))
    saved.close()
    result = run_cli(command[0], store_path, *command[1:])
    if command[0] == "verify":
        assert result.returncode == 1 and "nests more than" in result.stdout, result
        return
    assert_one_line_error(result)
    assert "nests more than" in result.stderr


# -- root fields -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        ({"time": math.inf}, "non-finite time"),
        ({"time": math.nan}, "non-finite time"),
        ({"stats": {"logical_bytes": "many"}}, "finite numbers"),
        ({"frameworks": {"torch": 2}}, "version strings"),
        ({"world_size": -1}, "world_size"),
    ],
)
def test_root_with_impossible_fields_is_corrupt(
    saved: Store, store_path: Path, change: dict[str, Any], message: str
) -> None:
    forged = forge_root(saved, RUN, lambda root: root.update(change))
    with pytest.raises(CorruptObjectError, match=message):
        saved.resolve(RUN, forged)
    saved.close()
    for command in (["log", store_path], ["show", store_path, f"{RUN}@{forged}"]):
        assert_one_line_error(run_cli(*command))


# -- lost refs and GC ----------------------------------------------------------------------


def _three_generations(store: Store) -> None:
    for i in range(3):
        store.save({"w": np.full(9, i)}, run="a", step=i)


def test_gc_refuses_a_run_whose_ref_is_missing(store: Store) -> None:
    _three_generations(store)
    (store.path / "refs" / "a").unlink()
    assert store.runs() == ["a"]  # known from its reflog
    with pytest.raises(GcAbortedError, match="ref file refs/a is missing"):
        collect_garbage(store, RetentionPolicy(keep_last=100))
    for gen in (1, 2, 3):
        np.testing.assert_array_equal(store.load("a", gen)["w"], np.full(9, gen - 1))
    with pytest.raises(LostRunError):
        store.load("a")
    assert store.load("a", fallback="previous")["w"][0] == 2
    report = verify_store(store)
    assert any("ref file refs/a is missing" in p.what for p in report.problems)


def test_lost_ref_broken_control_gc_sweeps_a_run_it_cannot_see(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Broken control: listing runs from refs alone (the old way) loses the run."""
    _three_generations(store)
    (store.path / "refs" / "a").unlink()
    monkeypatch.setattr(type(store.refs), "runs", type(store.refs).ref_runs)
    report = collect_garbage(store, RetentionPolicy(keep_last=100))
    assert report.dropped == {} and report.chunks_freed == 3
    with pytest.raises(CastoreError):
        store.load("a", 3)


def test_repair_restores_a_lost_ref_from_the_reflog(store: Store, store_path: Path) -> None:
    _three_generations(store)
    (store.path / "refs" / "a").unlink()
    store.close()
    result = run_cli("repair", store_path)
    assert result.returncode == 0, result
    assert "restored the lost ref of run a" in result.stdout
    with castore.open(store_path) as reopened:
        assert reopened.resolve("a").id == 3
        assert verify_store(reopened).ok


def test_a_run_with_only_tags_left_is_lost_not_empty(store: Store) -> None:
    _three_generations(store)
    castore.gc.tag(store, "a", 1, "best")
    (store.path / "refs" / "a").unlink()
    (store.path / "logs" / "a.reflog").unlink()
    with pytest.raises(LostRunError):
        store.load("a")
    with pytest.raises(GcAbortedError):
        collect_garbage(store, RetentionPolicy(keep_last=100))


def test_an_unknown_run_is_still_not_found(store: Store) -> None:
    with pytest.raises(GenerationNotFoundError):
        store.load("nope")


# -- reflog records --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record",
    [
        "[1, 2, 3]",
        "42",
        '{"action": "advance", "generation": 2, "run": "a", "time": 1.0}',
        '{"action": "advance", "generation": "2", "root": "%s", "run": "a", "time": 1.0}',
        '{"action": "advance", "generation": 2, "root": "zz", "run": "a", "time": 1.0}',
        '{"action": "advance", "generation": 2, "root": "%s", "run": "b", "time": 1.0}',
        '{"action": "explode", "generation": 2, "root": "%s", "run": "a", "time": 1.0}',
    ],
)
def test_checksummed_reflog_line_of_the_wrong_shape_is_damage(
    store: Store, store_path: Path, record: str
) -> None:
    from castore.format.hashing import digest_bytes

    _three_generations(store)
    text = record.replace("%s", "ab" * 32)
    line = f"{text}\t{digest_bytes(text.encode()).hex()[:32]}\n"
    with open(store.refs.reflog_path("a"), "a") as handle:
        handle.write(line)
    assert [g.id for g in store.generations("a")] == [1, 2, 3]
    assert store.load("a", 2)["w"][0] == 1
    assert store.restore("a", fallback="previous").generation.id == 3
    with pytest.raises(GcAbortedError, match="damaged lines"):
        collect_garbage(store, RetentionPolicy(keep_last=1))
    report = verify_store(store, deep=True)
    assert any("damaged line" in p.what for p in report.problems), report.problems
    store.close()
    for command in (["log", store_path], ["du", store_path]):
        assert run_cli(*command).returncode == 0
    verify = run_cli("verify", store_path, "--deep")
    assert verify.returncode == 1 and "damaged line" in verify.stdout


# -- small cases -------------------------------------------------------------------------------


def test_empty_tensor_with_zero_strides_saves_and_loads(store: Store) -> None:
    torch = pytest.importorskip("torch")
    empty = torch.from_numpy(np.zeros(0))
    assert empty.stride() == (0,)
    store.save({"t": empty}, run=RUN, step=1)
    assert store.load(RUN, framework="torch")["t"].shape == (0,)
    target = torch.from_numpy(np.zeros(0))
    result = castore.dist.load(store, RUN, {"t": target})
    assert result.state["t"] is target


def test_untag_of_a_directory_in_a_tags_place_is_refused(store: Store) -> None:
    from castore.errors import UnsafeStoreFileError

    _three_generations(store)
    (store.path / "tags" / "a" / "best").mkdir(parents=True)
    with pytest.raises(UnsafeStoreFileError, match="is a directory"):
        castore.gc.untag(store, "a", "best")
    assert (store.path / "tags" / "a" / "best").is_dir()
