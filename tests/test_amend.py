"""castore.amend and ``castore amend``: a generation with subtrees dropped, in O(metadata).

On a local (LMDB) store, a shared-directory store and S3 (moto): dropping the
optimizer state publishes a generation (on a new run or the same one) whose kept
tensors restore bitwise, with no chunk written and its lineage recorded; a pattern
that matches nothing, or a result with no tensor, is an AmendError and writes
nothing; garbage collection keeps what the amended generation shares. A SIGKILL
before the ref advance leaves the run as it was; the CLI prints one line. Broken
control: an amend whose state tree keeps what its manifests dropped is refused by
the publish's check that the tree and the manifests name the same tensors.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_runner import clean_env, run_cli
from s3_server import store_options

import castore
from castore import lineage
from castore.chunkstore.base import Namespace
from castore.errors import AmendError, GenerationNotFoundError, LayoutMismatchError
from castore.gc import RetentionPolicy, collect_garbage
from castore.verify import verify_store

CHUNK = 4096


def state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": np.arange(5.0)},
        "optim": {"m": rng.standard_normal((64, 32)), "step": seed},
        "lr": 0.1 * seed,
    }


@pytest.fixture(params=["lmdb", "shared", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    kind = request.param
    if kind == "s3":
        options = store_options(request.getfixturevalue("s3_endpoint"), str(tmp_path / "cache"))
        location = f"s3://{request.getfixturevalue('s3_bucket')}/amend"
    else:
        location, options = str(tmp_path / "store"), {"shared": kind == "shared"}
    with castore.open(location, chunk_size=CHUNK, **options) as store:
        store.save(state(1), run="train", step=10)
    options.pop("shared", None)
    return location, options


def test_dropping_the_optimizer_keeps_the_model_bitwise_and_writes_no_chunk(
    where: tuple[str, dict[str, Any]],
) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        chunks = set(store.backend.iter_keys(Namespace.CHUNKS))
        made = castore.amend(store, "train", 1, drop=["optim/**"], to_run="release")
        assert (made.run, made.id, made.step) == ("release", 1, 10)
        assert made.lineage["op"] == "amend" and made.lineage["drop"] == ["optim/**"]
        assert made.stats.new_bytes == 0 and made.stats.tensors == 2
        assert set(store.backend.iter_keys(Namespace.CHUNKS)) == chunks
        loaded = store.load(run="release")
        assert sorted(loaded) == ["lr", "model"]
        for name, value in state(1)["model"].items():
            assert loaded["model"][name].tobytes() == value.tobytes()
        same = castore.amend(store, "train", drop=["model/b"])  # the run's next generation
        assert (same.id, same.parent) == (2, store.resolve("train", 1).root)
        assert "b" not in store.load(run="train")["model"]
        assert verify_store(store, deep=True).ok


def test_refusals_are_typed_and_write_nothing(where: tuple[str, dict[str, Any]]) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        objects = set(store.backend.iter_keys(Namespace.OBJECTS))
        with pytest.raises(AmendError, match="'nothing/\\*\\*' matches no key path of train@1"):
            castore.amend(store, "train", drop=["nothing/**"])
        with pytest.raises(AmendError, match="would leave no tensor"):
            castore.amend(store, "train", drop=["model/**", "optim/**"])
        with pytest.raises(AmendError, match="nothing to amend"):
            castore.amend(store, "train")
        with pytest.raises(GenerationNotFoundError):
            castore.amend(store, "nope", drop=["optim/**"])
        assert set(store.backend.iter_keys(Namespace.OBJECTS)) == objects
        assert [g.id for g in store.generations("train")] == [1]


def test_gc_keeps_the_chunks_an_amended_generation_shares(
    where: tuple[str, dict[str, Any]],
) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        castore.amend(store, "train", drop=["optim/**"])  # train@2
        collect_garbage(store, RetentionPolicy(keep_last=1))  # train@1 dropped
        with pytest.raises(GenerationNotFoundError):
            store.load(run="train", generation=1)
        assert store.load(run="train")["model"]["w"].tobytes() == state(1)["model"]["w"].tobytes()
        assert verify_store(store, deep=True).ok


def test_broken_control_a_tree_that_keeps_what_the_manifests_dropped_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with castore.open(tmp_path / "s", chunk_size=CHUNK) as store:
        store.save(state(1), run="train", step=10)
        real, names = lineage.drop_paths, lineage.tensor_names
        amended: list[bytes] = []

        def forgetful(skeleton: bytes, matches: Any) -> tuple[bytes, list[str]]:
            tree, dropped = real(skeleton, matches)
            amended.append(tree)
            return skeleton, dropped  # the tree unchanged...

        monkeypatch.setattr(lineage, "drop_paths", forgetful)
        # ...while the manifests keep only what the amended tree names.
        monkeypatch.setattr(lineage, "tensor_names", lambda data: names(amended[-1]))
        with pytest.raises(LayoutMismatchError, match="missing"):
            castore.amend(store, "train", drop=["optim/**"])
        assert [g.id for g in store.generations("train")] == [1]


AMEND_SRC = textwrap.dedent(
    """
    import sys
    import castore

    with castore.open(sys.argv[1]) as store:
        castore.amend(store, "train", drop=["optim/**"])
    """
)


def test_sigkill_before_the_ref_advance_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(state(1), run="train", step=10)
    child = subprocess.run(
        [sys.executable, "-c", AMEND_SRC, str(path)], capture_output=True, text=True,
        timeout=60, env=clean_env(CASTORE_FAULTS="lineage.before_ref_advance"),
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    with castore.open(path) as store:
        assert [g.id for g in store.generations("train")] == [1]
        assert verify_store(store, deep=True).ok
        assert castore.amend(store, "train", drop=["optim/**"]).id == 2  # the retry works


def test_the_cli_amends_and_refuses_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(state(1), run="train", step=10)
    done = run_cli("amend", path, "train@1", "--drop", "optim/**", "--to", "release")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("published release@1 from train@1 without optim/**: 2 tensor")
    bad = run_cli("amend", path, "train", "--drop", "nothing")
    assert bad.returncode != 0 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "matches no key path" in bad.stderr
    log = run_cli("log", path)
    assert "amend of train@1" in log.stdout
    show = run_cli("show", path, "release")
    assert show.returncode == 0, show.stderr
    assert "from       amend of train@1 (drop optim/**)" in show.stdout.splitlines()


def hf_state() -> dict[str, Any]:
    return {
        "model.layers.0.w": np.arange(12.0).reshape(3, 4),
        "model.layers.1.w": np.ones(3, np.float32),
        "lm_head.w": np.zeros(2),
        "extra": {"enc.a": np.arange(4), "enc.b": 3},
    }


def test_renaming_keys_keeps_every_tensor_bitwise(where: tuple[str, dict[str, Any]]) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        store.save(hf_state(), run="hf", step=3)
        chunks = set(store.backend.iter_keys(Namespace.CHUNKS))
        made = castore.amend(
            store, "hf", rename=[("model.", ""), ("extra/enc.", "extra/encoder.")], to_run="plain"
        )
        assert made.lineage["rename"] == [["model.", ""], ["extra/enc.", "extra/encoder."]]
        assert set(store.backend.iter_keys(Namespace.CHUNKS)) == chunks
        loaded = store.load(run="plain")
        assert sorted(loaded) == ["extra", "layers.0.w", "layers.1.w", "lm_head.w"]
        assert loaded["extra"]["encoder.b"] == 3
        source = hf_state()
        assert loaded["layers.0.w"].tobytes() == source["model.layers.0.w"].tobytes()
        assert loaded["extra"]["encoder.a"].tobytes() == source["extra"]["enc.a"].tobytes()
        part = store.read_slice("plain", "latest", "layers.0.w", np.s_[1:, 2])
        assert part.tolist() == [6.0, 10.0]
        assert verify_store(store, deep=True).ok


@pytest.mark.parametrize(
    "rename, message",
    [
        ([("model.layers.0.", "model.layers.1.")], "two keys would be named 'model.layers.1.w'"),
        ([("model.layers.", "model/layers.")], "not a key's level"),
        ([("nothing.", "x.")], "'nothing.' matches no key of hf@1"),
        ([("lm_head.w", "")], "would give key ''"),
    ],
)
def test_a_rename_that_cannot_be_made_is_refused(
    tmp_path: Path, rename: list[tuple[str, str]], message: str
) -> None:
    with castore.open(tmp_path / "s", chunk_size=CHUNK) as store:
        store.save(hf_state(), run="hf", step=3)
        objects = set(store.backend.iter_keys(Namespace.OBJECTS))
        with pytest.raises(AmendError, match=message.replace(".", "\\.").replace("'", "'")):
            castore.amend(store, "hf", rename=rename)
        assert set(store.backend.iter_keys(Namespace.OBJECTS)) == objects


def test_the_cli_renames(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(hf_state(), run="hf", step=3)
    done = run_cli("amend", path, "hf", "--rename", "model.=", "--to", "plain")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("published plain@1 from hf@1 with 1 rename(s): 4 tensor(s)")
    bad = run_cli("amend", path, "hf", "--rename", "model.")
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "OLD=NEW" in bad.stderr
