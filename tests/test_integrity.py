"""Damage on disk is detected, named, and never returned as data.

Every test damages a real LMDB store: a byte flipped inside a stored chunk or
manifest value, a deleted record, or a hand-made object stored under its own
(correct) digest so that only its decoding can catch it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from _helpers import assert_state_equal
from cli_runner import run_cli

import castore
from castore import Store
from castore.chunkstore.base import Namespace
from castore.errors import (
    ChecksumMismatchError,
    ChunkMissingError,
    CorruptObjectError,
    GenerationNotFoundError,
    IntegrityError,
    ObjectMissingError,
)
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import FORMAT_VERSION, GenerationRoot, encode_object
from castore.format.tree import EXT_NUMPY_SCALAR
from castore.repo.records import RefValue
from castore.verify import verify_store

RUN = "run"

# w: 64x16 float32 = 4 KiB = four 1 KiB chunks of 16 rows each (the store fixture's
# chunk size is 1 KiB). Chunk 3 holds rows 48..63.
ROWS_PER_CHUNK = 16
DAMAGED_CHUNK = 3


def make_state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 16), dtype=np.float32),
        "b": rng.standard_normal(16, dtype=np.float32),
        "step": 3,
    }


def flipped(data: bytes, at: int) -> bytes:
    damaged = bytearray(data)
    damaged[at] ^= 0xFF
    return bytes(damaged)


def chunk_key(store: Store, name: str, index: int, run: str = RUN) -> bytes:
    _, root = store.resolve_root(run)
    return store.tensor_entries(root)[name][0].chunks[index]


def damage(store: Store, namespace: Namespace, key: bytes, at: int = 7) -> None:
    value = store.backend.get(namespace, key)
    assert value is not None
    store.backend.raw_put(namespace, key, flipped(value, at))
    assert store.backend.get(namespace, key) != value


def point_ref_at(store: Store, run: str, data: bytes, generation: int = 1) -> bytes:
    """Store ``data`` under its own blake3 digest and make it ``run``'s latest root."""
    digest = digest_bytes(data)
    store.backend.put_many(Namespace.OBJECTS, [(digest, data)])
    current = store.refs.read(run)
    store.refs.advance(
        run,
        expected=current.root if current else None,
        new=RefValue(
            run, generation, Digest(digest), time.time(), epoch=current.epoch if current else 0
        ),
    )
    return digest


@pytest.fixture
def saved(store: Store) -> tuple[Store, dict[str, Any]]:
    state = make_state()
    store.save(state, run=RUN, step=1)
    assert_state_equal(store.load(RUN), state)  # control: intact before any damage
    return store, state


# -- damaged chunks ----------------------------------------------------------


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_flipped_chunk_byte_fails_load_naming_the_tensor(
    saved: tuple[Store, dict[str, Any]], framework: str
) -> None:
    store, _ = saved
    key = chunk_key(store, "w", DAMAGED_CHUNK)
    damage(store, Namespace.CHUNKS, key)

    with pytest.raises(ChecksumMismatchError) as info:
        store.load(RUN, framework=framework)

    exc = info.value
    assert isinstance(exc, IntegrityError)
    assert exc.tensor == "w"
    assert exc.run == RUN and exc.generation == 1
    assert exc.expected == key.hex()
    assert exc.actual != exc.expected and len(exc.actual) == 64
    assert "'w'" in str(exc) and f"chunk {DAMAGED_CHUNK}" in str(exc)


def test_byte_flipped_in_the_pack_file_itself_is_caught(store_path: Path) -> None:
    state = make_state()
    with castore.open(store_path, chunk_size=1024) as store:
        store.save(state, run=RUN, step=1)
        key = chunk_key(store, "b", 0)
        where = store.backend.locate(key)
        assert where is not None and where.length == 64
        pack = store.backend.pack_path(where.pack)

    # Flip the chunk's last byte in the pack file with plain I/O, the store closed.
    with open(pack, "r+b") as handle:
        handle.seek(where.offset + where.length - 1)
        byte = handle.read(1)
        handle.seek(where.offset + where.length - 1)
        handle.write(bytes([byte[0] ^ 0x01]))

    with castore.open(store_path) as store:
        with pytest.raises(ChecksumMismatchError) as info:
            store.load(RUN)
        assert info.value.tensor == "b"
        # The undamaged tensor is still readable in full.
        np.testing.assert_array_equal(store.read_slice(RUN, "latest", "w", ...), state["w"])


def test_read_slice_reads_around_a_damaged_chunk(saved: tuple[Store, dict[str, Any]]) -> None:
    store, state = saved
    damage(store, Namespace.CHUNKS, chunk_key(store, "w", DAMAGED_CHUNK))
    first_bad_row = DAMAGED_CHUNK * ROWS_PER_CHUNK

    # Regions that do not touch the damaged chunk still read, and are right.
    for index in (np.s_[0:first_bad_row], np.s_[5], np.s_[10:40:3, 2:9], np.s_[first_bad_row - 1]):
        np.testing.assert_array_equal(
            store.read_slice(RUN, "latest", "w", index), state["w"][index]
        )
    np.testing.assert_array_equal(store.read_slice(RUN, 1, "b", ...), state["b"])
    # ...and a region touching it never comes back as data.
    with pytest.raises(IntegrityError):
        store.read_slice(RUN, "latest", "w", np.s_[first_bad_row])


@pytest.mark.parametrize("index", [np.s_[40:50], np.s_[63], np.s_[:, 0], np.s_[48], ...])
def test_read_slice_overlapping_a_damaged_chunk_raises_checksum_mismatch(
    saved: tuple[Store, dict[str, Any]], index: Any
) -> None:
    store, _ = saved
    key = chunk_key(store, "w", DAMAGED_CHUNK)
    damage(store, Namespace.CHUNKS, key)
    with pytest.raises(ChecksumMismatchError) as info:
        store.read_slice(RUN, "latest", "w", index)
    assert info.value.tensor == "w" and info.value.expected == key.hex()


def test_read_slice_overlapping_a_missing_chunk_raises_chunk_missing(
    saved: tuple[Store, dict[str, Any]],
) -> None:
    store, _ = saved
    store.backend.delete_many(Namespace.CHUNKS, [chunk_key(store, "w", 1)])
    with pytest.raises(ChunkMissingError) as info:
        store.read_slice(RUN, 1, "w", np.s_[20])
    assert info.value.tensor == "w"


def test_cli_deep_verify_finds_a_damaged_chunk_structural_does_not(
    saved: tuple[Store, dict[str, Any]], store_path: Path
) -> None:
    store, _ = saved
    control = run_cli("verify", store_path, "--deep")
    assert control.returncode == 0, control.stdout + control.stderr
    assert "OK" in control.stdout

    damage(store, Namespace.CHUNKS, chunk_key(store, "w", DAMAGED_CHUNK))
    store.close()

    deep = run_cli("verify", store_path, "--deep")
    assert deep.returncode == 1, deep.stdout + deep.stderr
    assert f"chunk {DAMAGED_CHUNK} of tensor 'w' is damaged" in deep.stdout
    assert f"damaged: {RUN}@1" in deep.stdout
    assert "OK" not in deep.stdout.splitlines()

    # Structural verify only checks presence, and the chunk is present.
    structural = run_cli("verify", store_path)
    assert structural.returncode == 0, structural.stdout + structural.stderr
    assert structural.stdout.splitlines()[-1] == "OK"


def test_deep_verify_reports_every_generation_sharing_a_damaged_chunk(store: Store) -> None:
    state = make_state()
    store.save(state, run=RUN, step=1)
    store.save(state, run=RUN, step=2)  # fully deduplicated: same chunks
    assert verify_store(store, deep=True).ok  # control

    damage(store, Namespace.CHUNKS, chunk_key(store, "w", 0))
    report = verify_store(store, deep=True)

    assert not report.ok
    assert report.damaged_generations == [(RUN, 1), (RUN, 2)]
    assert all("tensor 'w' is damaged" in p.what for p in report.problems)
    assert report.chunks_hashed == report.chunks == 5  # shared chunks hashed once
    assert verify_store(store, deep=False).ok


def test_deleted_chunk_is_missing_for_load_and_structural_verify(
    saved: tuple[Store, dict[str, Any]], store_path: Path
) -> None:
    store, state = saved
    key = chunk_key(store, "w", 1)
    assert store.backend.delete_many(Namespace.CHUNKS, [key]) == 1

    with pytest.raises(ChunkMissingError) as info:
        store.load(RUN)
    assert isinstance(info.value, ObjectMissingError) and isinstance(info.value, IntegrityError)
    assert info.value.tensor == "w"
    assert "chunk 1 of tensor 'w' is missing" in str(info.value)
    # Rows outside chunk 1 (rows 16..31) are still readable.
    np.testing.assert_array_equal(store.read_slice(RUN, 1, "w", np.s_[32:]), state["w"][32:])
    store.close()

    for args in (["verify", store_path], ["verify", store_path, "--deep"]):
        result = run_cli(*args)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "chunk 1 of tensor 'w' is missing" in result.stdout


# -- damaged or missing manifest objects -------------------------------------


def _object_key(store: Store, which: str) -> bytes:
    digest, root = store.resolve_root(RUN)
    return digest.raw if which == "root" else root.shards[0]


@pytest.mark.parametrize("which", ["root", "shard"])
@pytest.mark.parametrize(
    "action, error",
    [("flip", ChecksumMismatchError), ("delete", ObjectMissingError)],
)
def test_damaged_or_missing_manifest_object(
    saved: tuple[Store, dict[str, Any]],
    store_path: Path,
    which: str,
    action: str,
    error: type[Exception],
) -> None:
    store, _ = saved
    key = _object_key(store, which)
    if action == "flip":
        damage(store, Namespace.OBJECTS, key, at=20)
    else:
        assert store.backend.delete_many(Namespace.OBJECTS, [key]) == 1

    with pytest.raises(error) as info:
        store.load(RUN)
    assert not isinstance(info.value, ChunkMissingError)
    assert info.value.run == RUN
    if which == "shard":
        assert info.value.generation == 1
    if action == "flip":
        assert info.value.expected == key.hex() != info.value.actual

    report = verify_store(store)
    assert not report.ok
    assert any(error.__name__ in p.what for p in report.problems)
    store.close()

    result = run_cli("verify", store_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"PROBLEM {RUN}" in result.stdout and error.__name__ in result.stdout


def test_verify_and_load_of_an_intact_store_pass(
    saved: tuple[Store, dict[str, Any]], store_path: Path
) -> None:
    store, state = saved
    store.save(make_state(1), run="other", step=9)
    report = verify_store(store, deep=True)
    assert report.ok and report.generations == 2 and report.chunks_hashed == report.chunks > 0
    store.close()
    result = run_cli("verify", store_path, "--deep")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "OK"


# -- objects that hash correctly but do not decode ----------------------------


def _packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _root_wire(**changes: Any) -> dict[str, Any]:
    root = GenerationRoot(
        run=RUN,
        generation=1,
        step=0,
        parent=None,
        time=1.0,
        world_size=0,
        shards=(),
        state=_packed({}),
    )
    wire = root.to_wire()
    wire.update(changes)
    return wire


@pytest.mark.parametrize(
    "data, words",
    [
        (b"\xc1garbage", "not valid msgpack"),  # 0xc1 is never used by msgpack
        (b"\x93\x01\x02", "not valid msgpack"),  # truncated array
        (_packed({"format": 1, "type": "root"}) + b"\x00", "not valid msgpack"),  # extra data
        (_packed([1, 2, 3]), "not a msgpack map"),
        (_packed({"type": "root"}), "no format version"),
        (_packed({"format": FORMAT_VERSION, "type": "tree"}), "object type is 'tree'"),
        (_packed({"format": FORMAT_VERSION, "type": "root"}), "is missing"),
        (_packed(_root_wire(step="seven")), "'step' has type str"),
        (_packed(_root_wire(shards=[b"short"])), "malformed shard digest"),
        (_packed(_root_wire(state=b"\xc1")), "state does not decode"),
    ],
)
def test_object_with_a_valid_digest_that_does_not_decode(
    store: Store, data: bytes, words: str
) -> None:
    digest = point_ref_at(store, RUN, data)

    with pytest.raises(CorruptObjectError) as info:
        store.load(RUN)
    assert words in str(info.value)
    assert isinstance(info.value, IntegrityError)
    assert not isinstance(info.value, ChecksumMismatchError)  # the bytes DO match the name
    assert store.backend.get(Namespace.OBJECTS, digest) == data

    report = verify_store(store)
    assert not report.ok and "CorruptObjectError" in report.problems[0].what


def test_a_shard_where_a_root_is_expected_is_corrupt(saved: tuple[Store, dict[str, Any]]) -> None:
    store, _ = saved
    _, root = store.resolve_root(RUN)
    shard_digest = root.shards[0]
    store.refs.advance(
        "pointer",
        expected=None,
        new=RefValue("pointer", 1, Digest(shard_digest), time.time()),
    )
    with pytest.raises(CorruptObjectError, match="object type is 'shard', expected root"):
        store.load("pointer")


def test_a_root_of_another_run_is_corrupt(saved: tuple[Store, dict[str, Any]]) -> None:
    store, _ = saved
    digest, _ = store.resolve_root(RUN)
    store.refs.advance("thief", expected=None, new=RefValue("thief", 1, digest, time.time()))
    with pytest.raises(CorruptObjectError, match=f"belongs to run '{RUN}'"):
        store.load("thief")
    assert not verify_store(store, run="thief").ok
    assert verify_store(store, run=RUN).ok  # control: the real run is fine


def test_a_ref_whose_generation_disagrees_with_its_root_is_corrupt(
    saved: tuple[Store, dict[str, Any]],
) -> None:
    store, _ = saved
    ref = store.refs.read(RUN)
    assert ref is not None
    store.refs.advance(
        RUN, expected=ref.root, new=RefValue(RUN, 5, ref.root, time.time(), epoch=ref.epoch)
    )  # same root, generation 5: the root itself says 1
    with pytest.raises(CorruptObjectError, match="ref names generation 5, its root says 1"):
        store.load(RUN)


@pytest.mark.parametrize("kind", [[], {}])
def test_object_with_an_unhashable_type_field_is_corrupt(store: Store, kind: Any) -> None:
    point_ref_at(store, RUN, _packed({"format": FORMAT_VERSION, "type": kind}))
    with pytest.raises(CorruptObjectError):
        store.load(RUN)


def test_root_state_with_an_empty_numpy_scalar_is_corrupt(store: Store) -> None:
    state = _packed(msgpack.ExtType(EXT_NUMPY_SCALAR, _packed(["float32", b""])))
    point_ref_at(store, RUN, encode_object(GenerationRoot.from_wire(_root_wire(state=state))))
    with pytest.raises(CorruptObjectError):
        store.load(RUN)


def _two_generations(store: Store) -> tuple[castore.Generation, castore.Generation]:
    g1 = store.save(make_state(1), run=RUN, step=1)
    g2 = store.save(make_state(2), run=RUN, step=2)
    assert verify_store(store).ok  # control
    return g1, g2


def test_older_damaged_root_is_reported_and_never_loaded(store: Store) -> None:
    g1, _ = _two_generations(store)
    damage(store, Namespace.OBJECTS, bytes.fromhex(g1.root), at=20)
    with pytest.raises(ChecksumMismatchError):
        store.load(RUN, 1)
    assert_state_equal(store.load(RUN), make_state(2))  # the newest is intact
    report = verify_store(store)
    assert not report.ok and "ChecksumMismatchError" in report.problems[0].what


def test_older_deleted_root_is_never_loaded(store: Store) -> None:
    g1, _ = _two_generations(store)
    store.backend.delete_many(Namespace.OBJECTS, [bytes.fromhex(g1.root)])
    with pytest.raises(castore.CastoreError):
        store.load(RUN, 1)
    assert_state_equal(store.load(RUN), make_state(2))


def test_verify_reports_an_older_deleted_root(store: Store) -> None:
    g1, _ = _two_generations(store)
    store.backend.delete_many(Namespace.OBJECTS, [bytes.fromhex(g1.root)])
    report = verify_store(store)
    assert not report.ok
    assert any("ObjectMissingError" in p.what for p in report.problems)


def test_verify_of_a_run_or_generation_that_does_not_exist_raises(store: Store) -> None:
    """Not found is an error, as in load, log and du; it is not damage to report."""
    store.save(make_state(), run=RUN, step=1)
    with pytest.raises(GenerationNotFoundError, match="no run 'nope'"):
        verify_store(store, run="nope")
    with pytest.raises(GenerationNotFoundError, match="no generation 9"):
        verify_store(store, run=RUN, generation=9)
    assert verify_store(store, run=RUN, generation=1).ok


def test_a_damaged_ref_is_one_problem_not_two(store: Store) -> None:
    store.save(make_state(), run=RUN, step=1)
    (store.path / "refs" / RUN).write_bytes(b"garbage")
    report = verify_store(store, run=RUN)
    ref_problems = [p for p in report.problems if "CorruptRefError" in p.what]
    assert len(ref_problems) == 1, report.problems


@pytest.mark.parametrize("kind", ["local", "shared"])
def test_a_truncated_pack_is_named_truncated_by_plain_and_deep_verify(
    tmp_path: Path, kind: str
) -> None:
    """A pack cut to 1,000 bytes (a full disk, a copy cut short): its index still names
    every chunk, so a presence check passes; the pack's size against the index does not."""
    path = tmp_path / "s"
    with castore.open(path, chunk_size=1024, shared=kind == "shared") as store:
        store.save(make_state(), run=RUN, step=1)
    [pack] = (path / ("chunks/packs" if kind == "local" else "packs")).glob("*.pack")
    named = pack.name if kind == "local" else f"packs/{pack.name}"  # as the backend names it
    plain = run_cli("verify", path)
    assert plain.returncode == 0 and "the chunks' bytes were not read: --deep" in plain.stdout
    with open(pack, "r+b") as f:
        f.truncate(1000)
    for args in (["verify", path], ["verify", path, "--deep"]):
        result = run_cli(*args)
        assert result.returncode == 1, result.stdout + result.stderr
        problems = [line for line in result.stdout.splitlines() if "tensor 'w'" in line]
        assert problems and all(
            f"is truncated: its pack {named} is 1000 bytes" in line for line in problems
        ), result.stdout
        assert result.stdout.splitlines()[-1].endswith(f"{RUN}@1"), result.stdout
