"""Everything a store does, on stores laid out as blobs: a shared directory and S3 (moto).

Each test runs once per backend, in one process, except the ``castore``
command's tests: they run the CLI in a subprocess that reaches an S3 store
only through boto3's chain (``AWS_ENDPOINT_URL`` and the credentials in its
environment), several commands per process (see :mod:`blob_places`).
What cannot apply to a store on blobs (compact, rebuilding the LMDB index)
is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from blob_places import Place, s3_place, shared_place
from safetensors.numpy import load_file

import castore
import castore.gc
from castore.errors import IntegrityError
from castore.repair import repair_store
from castore.store import FallbackWarning
from castore.verify import verify_store

CHUNK = 1024
BACKENDS = ["shared", "s3"]


@pytest.fixture(params=BACKENDS)
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "shared":
        return shared_place(tmp_path / "shared")
    return s3_place(request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket"))


def state(seed: int) -> dict[str, Any]:
    """A few chunks of tensors and some plain values; every chunk differs between seeds."""
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": rng.standard_normal((32, 16), dtype=np.float32),  # 2 KiB: two chunks
            "b": rng.standard_normal(16, dtype=np.float32),
        },
        "opt": {"lr": 0.1 * (seed + 1), "betas": (0.9, 0.99)},
        "epoch": seed,
    }


def assert_same(actual: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and np.array_equal(actual, expected)
    else:
        assert actual == expected and type(actual) is type(expected)


def two_generations(place: Place) -> tuple[list[str], list[str]]:
    """Save r@1 (seed 0) and r@2 (seed 1); the packs each one wrote."""
    with place.open(chunk_size=CHUNK) as store:
        store.save(state(0), run="r", step=10)
        first = place.names("packs/")
        store.save(state(1), run="r", step=20)
    second = [name for name in place.names("packs/") if name not in first]
    assert first and second
    return first, second


def garble(place: Place, name: str) -> None:
    """Flip the last byte of a blob: in a pack, inside the last chunk's bytes."""
    data = bytearray(place.read(name))
    data[-1] ^= 0xFF
    place.rewrite(name, bytes(data))


# -- save, load, restore, read_slice, fallback ------------------------------------------


def test_save_load_restore_read_slice_and_fallback(place: Place) -> None:
    _, newest = two_generations(place)
    with place.open() as store:
        assert [(g.id, g.step) for g in store.generations("r")] == [(1, 10), (2, 20)]
        assert_same(store.load("r"), state(1))
        restored = store.restore("r", 1)
        assert restored.generation.id == 1 and not restored.skipped
        assert_same(restored.state, state(0))
        part = store.read_slice("r", "latest", "model/w", (slice(3, 9), slice(2, 5)))
        assert np.array_equal(part, state(1)["model"]["w"][3:9, 2:5])

    for name in newest:
        garble(place, name)
    with place.open() as store:  # a fresh handle: nothing cached of the old bytes
        with pytest.raises(IntegrityError):
            store.load("r")
        with pytest.warns(FallbackWarning, match="skipping 2"):
            fallen_back = store.load("r", fallback="previous")
        assert_same(fallen_back, state(0))
        assert store.resolve("r").id == 2  # a load publishes nothing, falls back or not


# -- TrainState and castore.dcp (one process, no process group) -----------------------


def test_train_state_saves_and_resumes(place: Place) -> None:
    torch = pytest.importorskip("torch")
    from castore.train import Resumed, TrainState

    def rig(seed: int) -> tuple[Any, Any, TrainState]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        return model, optimizer, TrainState(model, optimizer)

    def update(model: Any, optimizer: Any, train: TrainState) -> None:
        model(torch.ones(3, 4)).square().sum().backward()
        train.microbatch_done(3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train.update_done()

    model, optimizer, train = rig(0)
    update(model, optimizer, train)
    with place.open(chunk_size=CHUNK) as store:
        saved = train.save(store, run="t")
    update(model, optimizer, train)  # what a resume must replay
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model2, optimizer2, train2 = rig(1)
    with place.open() as store:
        resumed = train2.load(store, run="t")
    assert isinstance(resumed, Resumed) and resumed.claim == "exact"
    assert resumed.generation.root == saved.root
    update(model2, optimizer2, train2)
    for key, value in model2.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_writer_and_reader_by_address(
    place: Place, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """CastoreWriter/Reader given the store's address (a string), as a checkpoint id names it."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from castore.dcp import CastoreReader, CastoreWriter

    for key, value in place.env.items():  # an address carries no endpoint: boto3's chain does
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)  # where an address taken for a relative path would land
    address = place.address
    if place.kind == "shared":
        castore.open(address, shared=True).close()  # its marker says "blobs" from then on
    saved = {"model": {"w": torch.arange(600.0).reshape(30, 20)}, "step": 7}
    writer = CastoreWriter(address, run="d", step=3)
    dcp.save(saved, storage_writer=writer, no_dist=True)
    assert writer.generation is not None and writer.generation.step == 3
    target = {"model": {"w": torch.zeros(30, 20)}, "step": 0}
    dcp.load(target, storage_reader=CastoreReader(address, run="d"), no_dist=True)
    assert torch.equal(target["model"]["w"], saved["model"]["w"])
    assert target["step"] == 7
    assert not (tmp_path / "s3:").exists()
    with place.open() as store:
        assert [g.id for g in store.generations("d")] == [1]
        assert verify_store(store, deep=True).ok


# -- gc, verify, repair, du in this process -------------------------------------------


def test_gc_verify_and_repair(place: Place) -> None:
    _, newest = two_generations(place)
    with place.open(chunk_size=CHUNK) as store:
        store.save(state(2), run="r", step=30)
        report = castore.gc.collect_garbage(store, castore.gc.RetentionPolicy(keep_last=1))
        assert report.dropped == {"r": [1, 2]}
        assert report.chunks_freed > 0
        assert [g.id for g in store.generations("r")] == [3]
        assert verify_store(store, deep=True).ok
    assert not set(newest) & set(place.names("packs/"))  # r@2's only pack is gone

    latest = place.names("packs/")
    for name in latest:
        garble(place, name)
    with place.open() as store:
        assert verify_store(store).ok  # structural: the chunks are present
        deep = verify_store(store, deep=True)
        assert not deep.ok and deep.damaged_generations == [("r", 3)]
        sampled = verify_store(store, sample=1.0)
        assert not sampled.ok
        repaired = repair_store(store)
        assert len(repaired.corrupt_chunks) == len(latest)  # the last chunk of each pack
        assert list(repaired.damaged) == ["r@3"]
    with place.open() as store:
        after = verify_store(store)
        assert not after.ok  # the chunks are gone now: the damage stays reported
        assert any("missing" in str(p).lower() for p in after.problems)


# -- the castore command -----------------------------------------------------------------


def test_cli_inspects_tags_checks_and_collects(place: Place) -> None:
    two_generations(place)
    with place.open() as store:
        store.save(state(2), run="r", step=30)
    store_arg = place.address
    (log, show, tag, tagged, deep, sampled, du, gc, after, repair, compact, rebuild) = place.cli(
        ["log", store_arg],
        ["show", store_arg, "r@1"],
        ["tag", store_arg, "r@1", "keep"],
        ["log", store_arg, "--run", "r"],
        ["verify", store_arg, "--deep"],
        ["verify", store_arg, "r@latest", "--sample", "50"],
        ["du", store_arg],
        ["gc", store_arg, "--keep", "1", "--yes"],
        ["log", store_arg],
        ["repair", store_arg],
        ["compact", store_arg],
        ["repair", store_arg, "--rebuild-index"],
    )
    for result in (log, show, tag, tagged, deep, sampled, du, gc, after, repair):
        assert result.code == 0 and result.err == "", result
    assert [line.split()[:2] for line in log.out.splitlines()[2:]] == [
        ["1", "10"],
        ["2", "20"],
        ["3", "30"],
    ]
    assert show.out.startswith("generation r@1  step 10") and "model/w" in show.out
    assert "tagged r@1" in tag.out and "keep" in tagged.out.splitlines()[2]
    assert "deep (every chunk re-hashed)" in deep.out and deep.out.endswith("OK\n")
    assert "sampled" in sampled.out and sampled.out.endswith("OK\n")
    assert "3 generation(s)" in du.out and "blobs" in du.out
    assert "1 generation(s) dropped" in gc.out  # r@2; r@1 is tagged, r@3 the newest
    assert [line.split()[0] for line in after.out.splitlines()[2:]] == ["1", "3"]
    assert "OK: every generation is whole" in repair.out
    for refused, words in ((compact, "compact"), (rebuild, "rebuild")):
        assert refused.code != 0 and refused.out == ""
        assert len(refused.err.splitlines()) == 1, refused.err
        assert refused.err.startswith("castore: error: UnsupportedOperationError")
        assert words in refused.err and place.address in refused.err
    with place.open() as store:
        assert [g.id for g in store.generations("r")] == [1, 3]
        assert verify_store(store, deep=True).ok


def test_cli_export_import_and_diff(place: Place, tmp_path: Path) -> None:
    """A generation on blobs exports to safetensors, imports back into the same store
    (only manifests are new) and diffs, all through the CLI."""
    two_generations(place)
    out = tmp_path / "hf"
    export, import_, each = place.cli(
        ["export", place.address, "r@2", str(out), "--prefix", "model/", "--strip-prefix"],
        ["import", place.address, "back", str(out)],
        ["diff", place.address, "r", "--each"],
    )
    for result in (export, import_, each):
        assert result.code == 0 and result.err == "", result
    assert "exported 2 tensor(s)" in export.out
    assert "as back@1" in import_.out and "wrote 0 B" in import_.out
    assert [line.split(":")[0] for line in each.out.splitlines()] == [
        "r@1 vs nothing",
        "r@2 vs r@1",
    ]
    exported = load_file(out / "model.safetensors")
    assert_same(exported, state(1)["model"])
    with place.open() as store:
        assert_same(store.load("back"), state(1)["model"])


# -- castore copy between any two stores ------------------------------------------------


def roots(store: castore.Store, run: str = "r") -> list[tuple[int, str]]:
    return [(g.id, g.root) for g in store.generations(run)]


def test_copy_local_to_s3_to_local_and_shared(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str
) -> None:
    local, back = tmp_path / "local", tmp_path / "back"
    s3 = s3_place(s3_endpoint, s3_bucket)
    shared = shared_place(tmp_path / "shared")
    with castore.open(local, chunk_size=CHUNK) as store:
        store.save(state(0), run="r", step=10)
        store.save(state(1), run="r", step=20)
        store.save(state(1), run="r", step=30)  # every chunk r@2's: nothing new to copy
        expected = roots(store)
    shared.open().close()  # a shared store is created as one; a missing DST becomes a local store
    results = s3.cli(
        ["copy", local, s3.address, "--all"],
        ["copy", local, s3.address, "--all"],
        ["copy", s3.address, back, "--all"],
        ["copy", s3.address, shared.address, "--run", "r", "--generation", "2"],
        ["copy", s3.address, shared.address],
        ["copy", s3.address, shared.address],
        ["verify", s3.address, "--deep"],
        ["verify", back, "--deep"],
        ["verify", shared.address, "--deep"],
        ["copy", s3.address, s3.address + "/"],  # the same store, spelled otherwise
    )
    *results, same = results
    for result in results:
        assert result.code == 0 and result.err == "", result
    assert same.code == 1 and same.out == "" and len(same.err.splitlines()) == 1
    assert "source and destination are the same store" in same.err
    to_s3, again, to_back, only_2, rest, shared_again = (r.out.splitlines() for r in results[:6])
    chunks_of_one = 3  # model/w is two 1 KiB chunks, model/b one
    assert to_s3[:3] == [
        f"r@1 {expected[0][1][:12]}: copied {chunks_of_one} chunk(s) (2.1 KiB), 0 already there, "
        "of 2.1 KiB",
        f"r@2 {expected[1][1][:12]}: copied {chunks_of_one} chunk(s) (2.1 KiB), 0 already there, "
        "of 2.1 KiB",
        f"r@3 {expected[2][1][:12]}: copied 0 chunk(s) (0 B), {chunks_of_one} already there, "
        "of 2.1 KiB",
    ]
    assert again[-1] == f"nothing to copy: 3 generation(s) already in {s3.address}"
    assert to_back[-1].startswith("copied 3 generation(s), 0 already there: 4.1 KiB transferred")
    assert only_2[0].startswith(f"r@2 {expected[1][1][:12]}: copied {chunks_of_one} chunk(s)")
    assert only_2[0].endswith("; its parent is not copied")
    assert rest[0].startswith(f"r@3 {expected[2][1][:12]}: copied 0 chunk(s)")  # r@2's chunks
    assert shared_again[-1] == f"nothing to copy: 1 generation(s) already in {shared.address}"
    for verified in results[6:]:
        assert verified.out.endswith("OK\n"), verified.out
    with s3.open() as store:
        assert roots(store) == expected
        assert_same(store.load("r", 1), state(0))
    with shared.open() as store:
        assert roots(store) == expected[1:]  # r@1 is logged as not held there
        assert_same(store.load("r"), state(1))
    with castore.open(back, create=False) as store:
        assert roots(store) == expected
