"""castore diff: what changed between two generations, from their manifests alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli

import castore
from castore import gc
from castore.diffing import GenerationDiff, diff_generations, diff_history
from castore.errors import GenerationNotFoundError
from castore.store import Store
from castore.testing import corrupt

CHUNK = 1024
REPO = Path(__file__).resolve().parent.parent


def make_state() -> dict[str, object]:
    return {
        "model": {
            "w": np.arange(1024, dtype=np.float32),  # 4 chunks of 1 KiB
            "b": np.ones(16, dtype=np.float64),
        },
        "lr": 0.1,
        "epoch": 3,
    }


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with castore.open(tmp_path / "ckpt", chunk_size=CHUNK) as opened:
        yield opened


def test_identical_saves_are_all_unchanged(store: Store) -> None:
    store.save(make_state(), run="r", step=1)
    store.save(make_state(), run="r", step=1)
    diff = diff_generations(store, "r", 2, "r", 1)
    assert (diff.added, diff.removed, diff.changed) == ({}, {}, [])
    assert diff.unchanged_count == 2
    assert diff.unchanged_bytes == 1024 * 4 + 16 * 8
    assert diff.values == [] and diff.data_order == []
    assert diff.step_a == diff.step_b == 1


def test_changed_tensor_counts_only_its_new_chunks(store: Store) -> None:
    state = make_state()
    store.save(state, run="r", step=1)
    w = np.arange(1024, dtype=np.float32)
    w[300] = -1.0  # in the second 1 KiB chunk only
    state["model"]["w"] = w  # type: ignore[index]
    store.save(state, run="r", step=2)
    diff = diff_generations(store, "r", 2, "r", 1)
    assert [c.name for c in diff.changed] == ["model/w"]
    (change,) = diff.changed
    assert change.new_chunk_bytes == CHUNK
    assert change.nbytes == 4096
    assert change.kind == "values"
    assert diff.unchanged_count == 1 and diff.unchanged_bytes == 128


def test_partial_last_chunk_counts_its_real_size(store: Store) -> None:
    store.save({"t": np.zeros(300, dtype=np.float32)}, run="r", step=1)  # 1024 + 176 bytes
    store.save({"t": np.ones(300, dtype=np.float32)}, run="r", step=2)
    (change,) = diff_generations(store, "r", 2).changed
    assert change.new_chunk_bytes == 1200


def test_added_and_removed_tensors(store: Store) -> None:
    state = make_state()
    store.save(state, run="r", step=1)
    del state["model"]["b"]  # type: ignore[attr-defined]
    state["model"]["extra"] = np.zeros(8, dtype=np.int64)  # type: ignore[index]
    store.save(state, run="r", step=2)
    diff = diff_generations(store, "r", 2, "r", 1)
    assert diff.added == {"model/extra": 64}
    assert diff.removed == {"model/b": 128}
    assert diff.changed == [] and diff.unchanged_count == 1


def test_dtype_and_shape_changes(store: Store) -> None:
    store.save({"a": np.zeros(8, np.float32), "s": np.zeros(8, np.float32)}, run="r", step=1)
    store.save({"a": np.zeros(8, np.float64), "s": np.zeros((2, 4), np.float32)}, run="r", step=2)
    changes = {c.name: c for c in diff_generations(store, "r", 2).changed}
    assert changes["a"].kind == "dtype float32 -> float64"
    assert changes["s"].kind == "shape 8 -> 2x4"
    assert not changes["s"].resharded


def test_plain_value_changes_are_listed_old_to_new(store: Store) -> None:
    state = make_state()
    store.save(state, run="r", step=1)
    state.update(lr=0.05, epoch=4, note="x" * 200)
    store.save(state, run="r", step=2)
    values = {v.path: (v.old, v.new) for v in diff_generations(store, "r", 2).values}
    assert values["lr"] == ("0.1", "0.05")
    assert values["epoch"] == ("3", "4")
    old, new = values["note"]
    assert old is None and new is not None and new.endswith("...") and len(new) <= 40


def test_step_and_data_order_differences(store: Store) -> None:
    order = {"dataset_hash": "abc", "world_size": 2, "consumed_samples": 64}
    store.save(make_state(), run="r", step=200, data_order=order)
    store.save(
        make_state(),
        run="r",
        step=300,
        data_order={**order, "dataset_hash": "def", "consumed_samples": 96},
    )
    diff = diff_generations(store, "r", 2)
    assert (diff.step_b, diff.step_a) == (200, 300)
    changes = {v.path: (v.old, v.new) for v in diff.data_order}
    assert changes == {"consumed_samples": ("64", "96"), "dataset_hash": ("'abc'", "'def'")}


def test_across_runs_fine_tune_against_base(store: Store) -> None:
    base = make_state()
    store.save(base, run="base", step=10)
    tuned = make_state()
    tuned["head"] = np.zeros(4, np.float32)
    tuned["lr"] = 0.001
    store.save(tuned, run="ft", step=3)
    diff = diff_generations(store, "ft", 1, "base", 1)
    assert (diff.label_a, diff.label_b) == ("ft@1", "base@1")
    assert list(diff.added) == ["head"]
    assert diff.unchanged_count == 2 and diff.changed == []
    assert [(v.path, v.old, v.new) for v in diff.values] == [("lr", "0.1", "0.001")]


def test_run_b_alone_means_its_latest(store: Store) -> None:
    store.save(make_state(), run="base", step=1)
    store.save(make_state(), run="base", step=2)
    store.save(make_state(), run="ft", step=1)
    assert diff_generations(store, "ft", 1, "base").gen_b == 2


def test_first_generation_diffs_against_nothing(store: Store) -> None:
    store.save(make_state(), run="r", step=1)
    diff = diff_generations(store, "r", 1)
    assert diff.gen_b is None and diff.label_b == "nothing"
    assert sorted(diff.added.values()) == [128, 4096]
    assert diff.unchanged_count == 0 and diff.removed == {}
    assert {v.path for v in diff.values} == {"lr", "epoch"}


def test_default_b_is_the_parent(store: Store) -> None:
    for step in (1, 2, 3):
        state = make_state()
        state["epoch"] = step
        store.save(state, run="r", step=step)
    diff: GenerationDiff = diff_generations(store, "r", 3)
    assert (diff.gen_a, diff.gen_b) == (3, 2)
    assert diff_generations(store, "r").gen_a == 3  # latest by default


def test_collected_parent_says_to_name_b(store: Store) -> None:
    for step in (1, 2, 3):
        store.save({"w": np.full(4, step)}, run="r", step=step)
    gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    with pytest.raises(GenerationNotFoundError, match="parent of r@3 .* was garbage-collected"):
        diff_generations(store, "r", 3)


def test_history_compares_each_kept_generation_with_the_one_before(store: Store) -> None:
    for step in range(1, 6):
        store.save({"w": np.full(256, step // 2, dtype=np.float32)}, run="r", step=step)
    history = list(diff_history(store, "r"))
    assert [(g, d and (d.gen_a, d.gen_b)) for g, d in history] == [
        (1, (1, None)), (2, (2, 1)), (3, (3, 2)), (4, (4, 3)), (5, (5, 4)),
    ]  # fmt: skip
    changed = [g for g, d in history if d is not None and d.changed]
    assert changed == [2, 4]  # w changes at steps 2 and 4 only
    assert [g for g, _ in diff_history(store, "r", 4, last=2)] == [3, 4]
    gc.tag(store, "r", 2, "keep")
    gc.collect_garbage(store, gc.RetentionPolicy(keep_last=2))
    assert [g.id for g in store.generations("r")] == [2, 4, 5]
    thinned = list(diff_history(store, "r"))
    assert thinned[0] == (2, None)  # its parent, 1, was collected: not compared
    assert [(d.gen_a, d.gen_b) for _, d in thinned[1:] if d is not None] == [(4, 2), (5, 4)]


def test_missing_run_or_generation_raises(store: Store) -> None:
    store.save(make_state(), run="r", step=1)
    with pytest.raises(GenerationNotFoundError):
        diff_generations(store, "r", 9)
    with pytest.raises(GenerationNotFoundError):
        diff_generations(store, "r", 1, "nope", 1)


def test_resharded_tensor_is_named_resharded(tmp_path: Path) -> None:
    """The same bytes saved by one rank, then as two ranks' row blocks."""
    with castore.open(tmp_path / "ckpt", chunk_size=corrupt.CHUNK_SIZE) as store:
        store.save(corrupt.make_state(1), run="single", step=10)
        corrupt.save_sharded(store, 1)
        store.save(corrupt.make_state(2), run="single", step=20)
        diff = diff_generations(store, corrupt.RUN, 1, "single", 1)
        other = diff_generations(store, corrupt.RUN, 1, "single", 2)
        unread = diff_generations(store, corrupt.RUN, 1, "single", 1, compare_limit=4095)
    (change,) = diff.changed
    assert change.name == "model/w" and change.resharded
    assert change.kind == "resharded, same bytes"
    assert change.new_chunk_bytes == 0  # row blocks fall on chunk boundaries: same chunks
    assert diff.unchanged_count == 3
    changes = {c.name: c for c in other.changed}
    assert changes["model/w"].kind == "resharded, values changed"
    assert changes["model/w"].new_chunk_bytes > 0
    (too_big,) = unread.changed  # 4 KiB: over the limit, so not read
    assert too_big.kind == "resharded (layout changed; bytes not compared)"


# -- the CLI, run as a subprocess -----------------------------------------


def run_diff(*args: object) -> subprocess.CompletedProcess[str]:
    return run_cli("diff", *args)


@pytest.fixture
def two_generations(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    with castore.open(path, chunk_size=CHUNK) as store:
        state = make_state()
        store.save(state, run="r", step=200, data_order={"dataset_hash": "abc"})
        w = np.arange(1024, dtype=np.float32)
        w[0] = -1.0
        state["model"]["w"] = w  # type: ignore[index]
        state["lr"] = 0.2
        store.save(state, run="r", step=300, data_order={"dataset_hash": "def"})
    return path


def test_cli_table_and_summary(two_generations: Path) -> None:
    done = run_diff(two_generations, "r@2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.split()[:3] == ["changed", "model/w", "values"] for line in lines)
    assert any(line.split() == ["lr", "0.1", "0.2"] for line in lines)
    assert any(line.split() == ["dataset_hash", "'abc'", "'def'"] for line in lines)
    assert lines[-1] == (
        "r@2 vs r@1: 1 changed (1.0 KiB new), 0 added, 0 removed, 1 unchanged (128 B); "
        "step 200 -> 300; 1 value(s) changed; data order: 1 key(s) changed"
    )


def test_cli_stat_is_one_line(two_generations: Path) -> None:
    done = run_diff(two_generations, "r@2", "r@1", "--stat")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1
    assert done.stdout.startswith("r@2 vs r@1: 1 changed (1.0 KiB new), 0 added")
    first = run_diff(two_generations, "r@1", "--stat")
    assert first.stdout.startswith("r@1 vs nothing: 0 changed (0 B new), 2 added, 0 removed")


def test_cli_each_prints_a_line_per_generation(two_generations: Path) -> None:
    done = run_diff(two_generations, "r", "--each")
    assert done.returncode == 0, done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == [
        "r@1 vs nothing",
        "r@2 vs r@1",
    ]
    newest = run_diff(two_generations, "r", "--each", "1")
    assert newest.stdout.splitlines() == done.stdout.splitlines()[1:]
    refused = run_diff(two_generations, "r", "r@1", "--each")
    assert refused.returncode == 1 and "name no RUN@B" in refused.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("r@9",), "GenerationNotFoundError: run 'r' has no generation '9'"),
        (("r@2", "nope@1"), "GenerationNotFoundError: no run 'nope' in the store at"),
        (("r@2", "bad name@1"), "InvalidNameError"),
    ],
)
def test_cli_errors_are_one_line(
    two_generations: Path, args: tuple[str, ...], message: str
) -> None:
    done = run_diff(two_generations, *args)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("castore: error: ")
    assert message in done.stderr


def test_cli_missing_store_is_one_line(tmp_path: Path) -> None:
    done = run_diff(tmp_path / "absent", "r@1")
    assert done.returncode == 1
    assert done.stderr.startswith("castore: error: StoreNotFoundError") and "Traceback" not in (
        done.stderr
    )


def test_cli_long_value_lists_are_cut(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with castore.open(path, chunk_size=CHUNK) as store:
        store.save({"history": list(range(100))}, run="r", step=1)
        store.save({"history": [x + 1 for x in range(100)]}, run="r", step=2)
    done = run_diff(path, "r@2")
    assert done.returncode == 0, done.stderr
    assert "history/49" in done.stdout and "history/50" not in done.stdout
    assert "... 50 more" in done.stdout
    assert done.stdout.splitlines()[-1].endswith("; step 1 -> 2; 100 value(s) changed")
