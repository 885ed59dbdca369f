"""A long-lived handle's chunk index after another handle's collection moved the chunks.

A handle reads a format-3 store's index blobs once and keeps the chunk map;
a collection on another handle (another process, another node) may merge
small packs into a new one and delete the old ones, so the map names packs
that are gone while every retained chunk is intact in the new pack. Every
read path goes through ``BlobPackBackend.read_many``; these tests take the
long-lived handle through each of them, on a shared directory and on S3
(moto), and check that it returns the intact generation, byte for byte, and
that a chunk that is really gone still reads as missing after one refresh.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from blob_places import Place, s3_place, shared_place
from safetensors.numpy import load_file

import castore
from castore import Store
from castore.chunkstore.blobpacks import BlobPackBackend
from castore.errors import ChunkMissingError, NoValidGenerationError
from castore.export import to_safetensors
from castore.gc import collect_garbage
from castore.retention import RetentionPolicy
from castore.verify import verify_store

GEN1 = {"a": np.arange(1000.0)}
GEN2 = {"a": np.arange(1000.0) + 1}


@pytest.fixture(params=["shared", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "shared":
        return shared_place(tmp_path / "shared")
    return s3_place(request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket"))


def stale_reader(place: Place) -> Store:
    """A handle whose index predates a collection that replaced every pack it names.

    Generations 1 and 2 are both retained (``keep_last=2``): nothing they need
    is deleted, only moved.
    """
    writer = place.open()
    writer.save(GEN1, run="r", step=1)
    writer.save(GEN2, run="r", step=2)
    writer.close()
    reader = place.open()
    np.testing.assert_array_equal(reader.load("r")["a"], GEN2["a"])
    before = set(place.names("packs/"))
    with place.open() as collector:
        collect_garbage(collector, RetentionPolicy(keep_last=2))
    # The premise: the packs the reader's index names are all gone.
    assert before and not before & set(place.names("packs/"))
    return reader


def count_refreshes(store: Store) -> list[int]:
    """Count the index refreshes of ``store``'s backend (the real method runs)."""
    backend = store.backend
    assert isinstance(backend, BlobPackBackend)
    calls = [0]
    real = backend.refresh

    def counted() -> None:
        calls[0] += 1
        real()

    backend.refresh = counted  # type: ignore[method-assign]
    return calls


def delete_blobs(place: Place, prefix: str) -> None:
    """Delete every blob under ``prefix`` beneath castore (damage)."""
    for name in place.names(prefix):
        if place.kind == "shared":
            (Path(place.address) / name).unlink()
        else:
            place.client.delete_object(Bucket=place.bucket, Key=place.prefix + name)


def test_a_retained_generation_loads_on_a_handle_opened_before_a_collection(
    place: Place,
) -> None:
    reader = stale_reader(place)
    with reader:
        loaded = reader.load("r")
        assert loaded["a"].tobytes() == GEN2["a"].tobytes()
        assert reader.load("r", 1)["a"].tobytes() == GEN1["a"].tobytes()
        # fallback="previous" must not skip the newest, intact generation.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            restored = reader.restore("r", fallback="previous")
        assert restored.generation.id == 2 and not restored.skipped


def test_a_chunk_really_gone_is_missing_after_one_refresh(place: Place) -> None:
    reader = stale_reader(place)
    with reader:
        delete_blobs(place, "packs/")  # now every chunk is gone, not moved
        refreshes = count_refreshes(reader)
        with pytest.raises(ChunkMissingError, match="tensor 'a'"):
            reader.load("r")
        assert refreshes[0] == 1  # one refresh on the first failed pack read, no loop
        with pytest.raises(NoValidGenerationError):
            reader.load("r", fallback="previous")


def check_slice(store: Store, out: Path) -> None:
    got = store.read_slice("r", "latest", "a", slice(100, 900))
    assert got.tobytes() == GEN2["a"][100:900].tobytes()


def check_verify(store: Store, out: Path) -> None:
    report = verify_store(store, deep=True)
    assert report.ok, report.problems


def check_export(store: Store, out: Path) -> None:
    to_safetensors(store, "r", "latest", out / "export")
    assert load_file(out / "export" / "model.safetensors")["a"].tobytes() == GEN2["a"].tobytes()


def check_copy(store: Store, out: Path) -> None:
    castore.copy(store, out / "copy", run="r", all_generations=True)
    with castore.open(out / "copy") as copied:
        assert copied.load("r")["a"].tobytes() == GEN2["a"].tobytes()
        assert copied.load("r", 1)["a"].tobytes() == GEN1["a"].tobytes()


@pytest.mark.parametrize("check", [check_slice, check_verify, check_export, check_copy])
def test_every_read_path_of_a_stale_handle_finds_the_moved_chunks(
    check: Callable[[Store, Path], None], tmp_path: Path
) -> None:
    """read_slice, verify --deep, export and copy, each on a stale handle (shared directory)."""
    with stale_reader(shared_place(tmp_path / "store")) as reader:
        check(reader, tmp_path)


DIST_RESTORE = """
import os, sys
import numpy as np, torch, torch.distributed as dist
import castore, castore.dist
from castore.gc import collect_garbage
from castore.retention import RetentionPolicy

path = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("pg"), rank=0, world_size=1)
writer = castore.open(path, shared=True)
writer.save({"a": torch.arange(1000.0)}, run="r", step=1)
writer.save({"a": torch.arange(1000.0) + 1}, run="r", step=2)
reader = castore.open(path, shared=True)
target = {"a": torch.zeros(1000, dtype=torch.float32)}
castore.dist.load(reader, "r", target)
collect_garbage(castore.open(path, shared=True), RetentionPolicy(keep_last=2))
target = {"a": torch.zeros(1000, dtype=torch.float32)}
result = castore.dist.load(reader, "r", target)
assert torch.equal(target["a"], torch.arange(1000.0) + 1), target["a"][:4]
print("restored generation", result.report.generation.id)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_dist_restore_on_a_stale_handle_finds_the_moved_chunks(tmp_path: Path) -> None:
    """castore.dist.load (castore/dist/restore.py) in a group of one, in a child process."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DIST_RESTORE), str(tmp_path / "store")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "restored generation 2" in done.stdout
