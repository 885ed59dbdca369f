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
from dataclasses import replace
from pathlib import Path
from typing import Any

import dist_workers as w
import numpy as np
import pytest
from cli_runner import clean_env, run_cli
from dist_harness import run_ranks
from s3_server import kind_of_store
from test_dist import script_results

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
    location, options = kind_of_store(request, tmp_path, request.param, "amend")
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
    diff = run_cli("diff", path, "release", "--stat")  # against what it was made from
    assert diff.stdout.startswith("release@1 vs train@1: 0 changed (0 B new), 0 added, 1 removed")


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


# -- replace, graft and metadata ---------------------------------------------------


def chunks_named(store: Any) -> set[bytes]:
    """Every chunk a generation of the store names."""
    named: set[bytes] = set()
    for run in store.runs():
        for gen in store.generations(run):
            _, root = store.resolve_root(run, gen.id)
            for shard in store.read_shards(root):
                named.update(c for e in shard.tensors for c in e.chunks)
    return named


def test_replacing_a_tensor_writes_only_its_new_chunks(where: tuple[str, dict[str, Any]]) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        chunks = set(store.backend.iter_keys(Namespace.CHUNKS))
        new = state(1)["model"]["w"].copy()
        new[40:] += 1  # the second of its two 4 KiB chunks
        made = castore.amend(store, "train", replace={"model/w": new}, metadata={"note": "fixed"})
        assert made.lineage["replace"] == ["model/w"]
        assert made.lineage["metadata"] == {"set": ["note"], "unset": []}
        assert (made.stats.new_chunks, made.stats.new_bytes) == (1, CHUNK)
        assert len(set(store.backend.iter_keys(Namespace.CHUNKS)) - chunks) == 1
        loaded = store.load(run="train")
        assert loaded["model"]["w"].tobytes() == new.tobytes()
        assert loaded["optim"]["m"].tobytes() == state(1)["optim"]["m"].tobytes()
        assert store.resolve("train").metadata == {"note": "fixed"}
        assert store.read_slice("train", "latest", "model/w", np.s_[39:41]).tobytes() == (
            new[39:41].tobytes()
        )
        # A new shape (and dtype) is one box; the metadata key removed again.
        castore.amend(store, "train", replace={"model/b": np.zeros((2, 2), np.int8)},
                      metadata={"note": None})  # fmt: skip
        assert store.load(run="train")["model"]["b"].tolist() == [[0, 0], [0, 0]]
        assert store.resolve("train").metadata == {}
        assert verify_store(store, deep=True).ok


def test_a_torch_tensor_replaces_a_tensor(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with castore.open(tmp_path / "s", chunk_size=CHUNK) as store:
        store.save({"w": torch.zeros(4, 3), "b": torch.ones(2)}, run="t", step=1)
        castore.amend(store, "t", replace={"w": torch.arange(12.0).reshape(4, 3)})
        loaded = store.load(run="t", framework="torch")
        assert torch.equal(loaded["w"], torch.arange(12.0).reshape(4, 3))
        assert torch.equal(loaded["b"], torch.ones(2))


def teacher(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "encoder.w": rng.standard_normal((16, 8)).astype(np.float32),
            "encoder.b": rng.standard_normal(8),
            "head": rng.standard_normal((4, 8)),
        },
        "optim": {"m": rng.standard_normal((16, 8))},
    }


def test_grafting_a_teachers_encoder_reuses_its_chunks(where: tuple[str, dict[str, Any]]) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        store.save(teacher(1), run="student", step=1)
        store.save(teacher(2), run="teacher", step=7)
        chunks = set(store.backend.iter_keys(Namespace.CHUNKS))
        made = castore.amend(store, "student", graft=["teacher@1:model/encoder.=model/encoder."])
        assert [(s["run"], s["generation"]) for s in made.lineage["from"]] == [
            ("student", 1), ("teacher", 1)
        ]  # fmt: skip
        assert made.lineage["graft"] == [
            {"from": 1, "source": "model/encoder.", "target": "model/encoder."}
        ]
        assert made.stats.new_bytes == 0
        assert set(store.backend.iter_keys(Namespace.CHUNKS)) == chunks
        loaded = store.load(run="student")
        for name in ("encoder.w", "encoder.b"):
            assert loaded["model"][name].tobytes() == teacher(2)["model"][name].tobytes()
        assert loaded["model"]["head"].tobytes() == teacher(1)["model"]["head"].tobytes()
        # A graft into a new place: the teacher's whole optimizer under a new key.
        castore.amend(store, "student", graft=["teacher:optim=teacher_optim"])
        loaded = store.load(run="student")
        assert loaded["teacher_optim"]["m"].tobytes() == teacher(2)["optim"]["m"].tobytes()
        assert loaded["optim"]["m"].tobytes() == teacher(1)["optim"]["m"].tobytes()
        assert verify_store(store, deep=True).ok


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"graft": ["nope:model/w=model/w"]}, GenerationNotFoundError, "no run 'nope'"),
        ({"graft": ["teacher@1:model/x=model/x"]}, AmendError, "no key path of teacher@1"),
        ({"graft": ["teacher:model/head=model/head"]}, AmendError, "a graft keeps each tensor"),
        ({"graft": ["teacher:model/head"]}, AmendError, "RUN\\[@GEN\\]:OLD=NEW"),
        ({"graft": ["teacher:model/head=nothing/head"]}, AmendError, "no dict at 'nothing'"),
        ({"replace": {"model/nope": np.zeros(2)}}, AmendError, "not a tensor of student@1"),
        ({"replace": {"model/head": [1, 2]}}, AmendError, "give one whole tensor"),
        ({"metadata": {"nope": None}}, AmendError, "has no metadata key 'nope'"),
        ({"metadata": {"dcp": 1}}, AmendError, "castore's own"),
    ],
)
def test_a_graft_replace_or_metadata_edit_that_cannot_be_made_is_refused(
    tmp_path: Path, change: dict[str, Any], error: type[Exception], message: str
) -> None:
    with castore.open(tmp_path / "s", chunk_size=CHUNK) as store:
        store.save(teacher(1), run="student", step=1)
        bigger = teacher(2)
        bigger["model"]["head"] = np.zeros((5, 8))
        store.save(bigger, run="teacher", step=7)
        objects = set(store.backend.iter_keys(Namespace.OBJECTS))
        chunks = set(store.backend.iter_keys(Namespace.CHUNKS))
        with pytest.raises(error, match=message):
            castore.amend(store, "student", **change)
        assert set(store.backend.iter_keys(Namespace.OBJECTS)) == objects
        assert set(store.backend.iter_keys(Namespace.CHUNKS)) == chunks
        assert [g.id for g in store.generations("student")] == [1]


def test_a_per_rank_value_cannot_be_grafted(tmp_path: Path) -> None:
    with castore.open(tmp_path / "s", chunk_size=CHUNK) as store:
        store.save(teacher(1), run="student", step=1)
        store.save({"model": {"rng": castore.RankLocal(3)}, "w": np.ones(2)}, run="t", step=1)
        with pytest.raises(AmendError, match="per-rank value 'model/rng' cannot be grafted"):
            castore.amend(store, "student", graft=["t:model/rng=model/rng"])


def test_gc_after_graft_and_replace_keeps_exactly_what_is_named(
    where: tuple[str, dict[str, Any]],
) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        store.save(teacher(2), run="teacher", step=7)
        castore.amend(store, "train", graft=["teacher:model=teacher"], to_run="mix")  # mix@1
        castore.amend(store, "mix", replace={"model/w": np.zeros((64, 32), np.float32)})
        store.save(teacher(3), run="teacher", step=8)
        store.save(state(2), run="train", step=20)
        report = collect_garbage(store, RetentionPolicy(keep_last=1))  # the first of each run
        assert report.chunks_freed > 0
        assert set(store.backend.iter_keys(Namespace.CHUNKS)) == chunks_named(store)
        loaded = store.load(run="mix")  # teacher@1's and train@1's chunks, held by mix@2
        assert loaded["teacher"]["head"].tobytes() == teacher(2)["model"]["head"].tobytes()
        assert loaded["model"]["b"].tobytes() == state(1)["model"]["b"].tobytes()
        assert not loaded["model"]["w"].any()
        assert verify_store(store, deep=True).ok


def sharded_amend(path: Path) -> list[dict[str, Any]]:
    """Save dist_workers' 2-rank state (seed 1 and seed 2 on two runs), replace its
    row-sharded ``model/emb`` and graft the seed-2 run's ``model/proj`` (column-sharded)
    and ``optim/table`` (replicated) into it; each rank's restore onto the saved layout."""
    save = [
        {"op": "save", "run": "a", "seed": 1, "step": 1},
        {"op": "save", "run": "b", "seed": 2, "step": 1},
    ]
    script_results(run_ranks(2, w.run_script, str(path), save, timeout=150), 2)
    with castore.open(path) as store:
        castore.amend(
            store, "a", replace={"model/emb": new_emb()},
            graft=["b:model/proj=model/proj", "b:optim/table=optim/table"],
        )  # fmt: skip
        _, root = store.resolve_root("a")
        shards = store.read_shards(root)
        boxes = [{e.name: (e.offsets, e.local_shape) for e in s.tensors} for s in shards]
        assert boxes[0]["model/emb"] == ((0, 0), (32, 8))
        assert boxes[1]["model/emb"] == ((32, 0), (32, 8))
        assert boxes[1]["model/proj"] == ((0, 8), (6, 8))
        assert verify_store(store, deep=True).ok
    load = [{"op": "load", "run": "a", "framework": "numpy"}]
    return [r[0] for r in script_results(run_ranks(2, w.run_script, str(path), load), 2)]


def new_emb() -> np.ndarray:
    return np.arange(64 * 8, dtype=np.float32).reshape(64, 8)


def expected_block(name: str, rank: int) -> np.ndarray:
    whole = new_emb() if name == "model/emb" else w.full_tensors(
        2 if name in ("model/proj", "optim/table") else 1
    )[name]
    return whole[w.box_slices(*w.box_of(name, rank, 2))]


def test_a_sharded_generation_stays_sharded_through_replace_and_graft(tmp_path: Path) -> None:
    loads = sharded_amend(tmp_path / "s")
    for rank, out in enumerate(loads):
        assert "error" not in out, out
        assert out["report"]["resharded"] == 0  # each rank reads its saved boxes whole
        for name, (_, block) in out["boxes"].items():
            assert block.tobytes() == expected_block(name, rank).tobytes(), (rank, name)


def test_broken_control_boxes_cut_from_the_wrong_rows_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = lineage._box_leaf

    def first_rows(new: Any, entry: Any, *, whole: bool) -> Any:
        """Every box's bytes cut from the tensor's first rows, placed where they belong."""
        leaf = real(new, replace(entry, offsets=(0,) * len(entry.offsets)), whole=whole)
        return replace(leaf, offsets=entry.offsets)

    monkeypatch.setattr(lineage, "_box_leaf", first_rows)
    loads = sharded_amend(tmp_path / "s")
    emb = loads[1]["boxes"]["model/emb"][1]
    assert emb.tobytes() != expected_block("model/emb", 1).tobytes()


REPLACE_SRC = textwrap.dedent(
    """
    import sys
    import numpy as np
    import castore

    with castore.open(sys.argv[1]) as store:
        castore.amend(store, "train", replace={"model/w": np.ones((64, 32), np.float32)})
    """
)


def test_sigkill_mid_replace_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(state(1), run="train", step=10)
    for point in ("lineage.mid_chunks", "lineage.before_root"):
        child = subprocess.run(
            [sys.executable, "-c", REPLACE_SRC, str(path)], capture_output=True, text=True,
            timeout=60, env=clean_env(CASTORE_FAULTS=point),
        )  # fmt: skip
        assert child.returncode == -9, child.stderr
        with castore.open(path) as store:
            assert [g.id for g in store.generations("train")] == [1], point
            assert verify_store(store, deep=True).ok
    with castore.open(path) as store:
        collect_garbage(store, RetentionPolicy(keep_last=1))  # the orphaned new chunk goes
        assert set(store.backend.iter_keys(Namespace.CHUNKS)) == chunks_named(store)
        made = castore.amend(store, "train", replace={"model/w": np.ones((64, 32), np.float32)})
        assert made.id == 2 and store.load(run="train")["model"]["w"].all()


def test_the_cli_grafts_replaces_and_edits_metadata(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(teacher(1), run="student", step=1)
        store.save(teacher(2), run="teacher", step=7)
    head = np.full((4, 8), 2.0)
    np.save(tmp_path / "head.npy", head)
    (tmp_path / "junk.npy").write_bytes(b"x" * 50)
    done = run_cli(
        "amend", path, "student", "--graft", "teacher@1:model/encoder.=model/encoder.",
        "--replace", f"model/head={tmp_path / 'head.npy'}", "--set", "note=grafted",
        "--set", "epochs=3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "published student@2 from student@1 with 1 graft(s) and with model/head replaced and "
        "with 2 metadata key(s) edited: 4 tensor(s)"
    ), done.stdout
    assert "of new chunks written" in done.stdout
    with castore.open(path) as store:
        loaded = store.load(run="student")
        assert loaded["model"]["head"].tobytes() == head.tobytes()
        assert loaded["model"]["encoder.w"].tobytes() == teacher(2)["model"]["encoder.w"].tobytes()
        assert store.resolve("student").metadata == {"note": "grafted", "epochs": 3}
    for args, message in [
        (["--graft", "teacher:model/x=model/x"], "no key path of teacher@1 starts with"),
        (["--replace", "model/head=missing.npy"], "no file 'missing.npy'"),
        (["--replace", "model/head"], "KEY_PATH=FILE"),
        (["--unset", "nope"], "has no metadata key 'nope'"),
        (["--replace", f"model/head={tmp_path / 'junk.npy'}"], "junk.npy is not a .npy file"),
    ]:
        bad = run_cli("amend", path, "student", *args)
        assert bad.returncode != 0 and bad.stdout == "", args
        assert bad.stderr.count("\n") == 1 and message in bad.stderr, bad.stderr


def test_the_cli_replaces_from_a_safetensors_file(tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "s"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save(teacher(1), run="student", step=1)
    safetensors_numpy.save_file(
        {"a": np.zeros((4, 8)), "b": np.ones((4, 8))}, str(tmp_path / "t.safetensors")
    )
    many = run_cli("amend", path, "student", "--replace", f"model/head={tmp_path}/t.safetensors")
    assert many.returncode != 0 and "holds 2 tensors: name one as t.safetensors:NAME" in many.stderr
    done = run_cli("amend", path, "student", "--replace", f"model/head={tmp_path}/t.safetensors:b")
    assert done.returncode == 0, done.stderr
    with castore.open(path) as store:
        assert store.load(run="student")["model"]["head"].tolist() == np.ones((4, 8)).tolist()
