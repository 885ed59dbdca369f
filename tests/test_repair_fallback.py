"""Fallback to the newest valid generation, sampled verify, and repair that heals."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_runner import run_cli

import castore
import castore.dist
from castore.chunkstore.base import Namespace
from castore.errors import ChecksumMismatchError, CorruptRefError, NoValidGenerationError
from castore.format.hashing import Digest
from castore.repair import repair_store
from castore.store import FallbackWarning, Store
from castore.verify import verify_store

CHUNK = 256


def state(i: int) -> dict[str, Any]:
    return {
        "w": np.arange(256, dtype=np.float32) + i,  # 4 chunks, new every generation
        "shared": np.ones(128, dtype=np.float32),  # 2 chunks, the same in every generation
        "step": i,
    }


@pytest.fixture
def three(tmp_path: Path) -> Store:
    store = castore.open(tmp_path / "store", chunk_size=CHUNK)
    for i in range(1, 4):
        store.save(state(i), run="r", step=i)
    yield store
    store.close()


def chunks_of(store: Store, gen: int, name: str) -> list[bytes]:
    root = store.read_root(Digest.from_hex(store.resolve("r", gen).root), run="r")
    return [
        c for s in store.read_shards(root) for e in s.tensors if e.name == name for c in e.chunks
    ]


def flip(store: Store, gen: int, name: str = "w", index: int = 1) -> bytes:
    chunk = chunks_of(store, gen, name)[index]
    store.backend.raw_put(Namespace.CHUNKS, chunk, b"\x00" * CHUNK)
    return chunk


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a
    )


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=os.environ)


# -- fallback -------------------------------------------------------------------


def test_the_default_fails_closed_and_fallback_loads_the_newest_valid(three: Store) -> None:
    flip(three, 3)
    with pytest.raises(ChecksumMismatchError):
        three.load("r")
    restored = three.restore("r", fallback="previous")
    assert restored.generation.id == 2
    assert equal(restored.state, state(2))
    assert [(s.generation, s.error) for s in restored.skipped] == [(3, "ChecksumMismatchError")]
    assert "tensor=w" in restored.skipped[0].reason
    with pytest.warns(FallbackWarning, match=r"loaded r@2 after skipping 3"):
        assert equal(three.load("r", fallback="previous"), state(2))


def test_fallback_walks_back_as_far_as_it_must_and_starts_where_asked(three: Store) -> None:
    flip(three, 3)
    flip(three, 2)
    restored = three.restore("r", fallback="previous")
    assert restored.generation.id == 1
    assert [s.generation for s in restored.skipped] == [3, 2]
    assert three.restore("r", 2, fallback="previous").generation.id == 1
    assert three.restore("r", 1, fallback="previous").skipped == []
    flip(three, 1)
    with pytest.raises(NoValidGenerationError, match="3: ChecksumMismatchError"):
        three.restore("r", fallback="previous")


def test_fallback_survives_a_garbled_ref_by_reading_the_reflog(three: Store) -> None:
    (three.path / "refs" / "r").write_bytes(b"CASTREF\n garbage")
    with pytest.raises(CorruptRefError):
        three.load("r")
    restored = three.restore("r", fallback="previous")
    assert restored.generation.id == 3 and equal(restored.state, state(3))


def test_a_missing_root_is_skipped(three: Store) -> None:
    root = Digest.from_hex(three.resolve("r", 3).root)
    three.backend.delete_many(Namespace.OBJECTS, [root.raw])
    restored = three.restore("r", fallback="previous")
    assert restored.generation.id == 2
    assert restored.skipped[0].error == "ObjectMissingError"


def test_dist_load_fallback_leaves_targets_alone_until_a_generation_validates(
    three: Store,
) -> None:
    flip(three, 3)
    target = np.full(256, -7.0, dtype=np.float32)
    with pytest.raises(ChecksumMismatchError):
        castore.dist.load(three, "r", {"w": target})
    assert (target == -7.0).all()  # the failed restore wrote nothing
    result = castore.dist.load(three, "r", {"w": target}, fallback="previous")
    assert result.report.generation.id == 2
    assert [s.generation for s in result.report.skipped] == [3]
    assert np.array_equal(target, state(2)["w"])


# -- verify --sample ------------------------------------------------------------


def test_sampled_verify_rehashes_about_the_share_asked(tmp_path: Path) -> None:
    store = castore.open(tmp_path / "store", chunk_size=64)
    store.save(
        {"x": np.random.default_rng(0).standard_normal(64 * 50).astype(np.float32)}, run="r", step=1
    )  # 200 chunks
    report = verify_store(store, sample=0.25)
    assert 20 <= report.chunks_hashed <= 80 and report.ok
    assert verify_store(store, sample=1.0).chunks_hashed == 200
    assert verify_store(store).chunks_hashed == 0
    with pytest.raises(ValueError):
        verify_store(store, sample=0)
    # A sample that covers every chunk finds the damage; the structural check does not.
    chunk = next(iter(store.backend.iter_keys(Namespace.CHUNKS)))
    store.backend.raw_put(Namespace.CHUNKS, chunk, b"\x01" * 64)
    assert verify_store(store).ok
    assert not verify_store(store, sample=1.0).ok
    store.close()
    result = cli("verify", tmp_path / "store", "--sample", "100")
    assert result.returncode == 1
    assert "sampled (200 of 200 chunk(s) re-hashed, 100%;" in result.stdout


def test_verify_reports_each_damaged_generation_past_a_missing_root(three: Store) -> None:
    root = Digest.from_hex(three.resolve("r", 2).root)
    three.backend.delete_many(Namespace.OBJECTS, [root.raw])
    flip(three, 3)
    report = verify_store(three, deep=True)
    damaged = {g for _, g in report.damaged_generations}
    assert damaged == {2, 3}  # generation 1 behind the missing root is still checked
    assert report.generations == 3


# -- repair ---------------------------------------------------------------------


def test_repair_removes_only_corrupt_bytes_and_a_later_save_heals(three: Store) -> None:
    bad = flip(three, 2)
    intact_before = set(three.backend.iter_keys(Namespace.CHUNKS)) - {bad}
    objects_before = set(three.backend.iter_keys(Namespace.OBJECTS))
    report = repair_store(three)
    assert report.corrupt_chunks == [bad] and report.corrupt_objects == []
    assert set(three.backend.iter_keys(Namespace.CHUNKS)) == intact_before
    assert set(three.backend.iter_keys(Namespace.OBJECTS)) == objects_before
    assert list(report.damaged) == ["r@2"]
    assert "chunk 1 of tensor 'w' is missing" in report.damaged["r@2"][0]
    # Without repair a re-save would skip the corrupt chunk (its index says present);
    # after it, saving the same content writes the chunk again and r@2 is whole.
    three.save(state(2), run="r", step=4)
    assert verify_store(three, deep=True).ok
    assert equal(three.load("r", 2), state(2))


def test_without_repair_a_resave_does_not_heal(three: Store) -> None:
    """The broken control: the corrupt chunk stays, and the new generation shares it."""
    flip(three, 2)
    three.save(state(2), run="r", step=4)
    damaged = {g for _, g in verify_store(three, deep=True).damaged_generations}
    assert damaged == {2, 4}


def test_repair_removes_a_corrupt_object_and_names_what_is_lost(three: Store) -> None:
    root = three.read_root(Digest.from_hex(three.resolve("r", 3).root), run="r")
    shard = root.shards[0]
    three.backend.raw_put(Namespace.OBJECTS, shard, b"not a manifest")
    report = repair_store(three)
    assert report.corrupt_objects == [shard]
    assert not three.backend.has_many(Namespace.OBJECTS, [shard])[0]
    assert "ObjectMissingError" in report.damaged["r@3"][0]
    assert three.restore("r", fallback="previous").generation.id == 2


def test_repair_cli_says_what_is_lost_and_exits_by_what_remains(three: Store) -> None:
    flip(three, 3)
    path = three.path
    three.close()
    dry = cli("repair", path, "--dry-run")
    assert dry.returncode == 1 and "would remove 1 corrupt chunk(s)" in dry.stdout
    assert cli("verify", path, "--deep").returncode == 1  # the dry run changed nothing
    done = cli("repair", path)
    assert done.returncode == 1
    assert "DAMAGED r@3" in done.stdout and "data lost" in done.stdout
    with castore.open(path) as store:
        store.save(state(3), run="r", step=9)
    healed = cli("repair", path)
    assert healed.returncode == 0 and "OK: every generation is whole" in healed.stdout
