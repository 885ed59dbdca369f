"""castore under Accelerate's save_state/load_state (CastoreState), with the real package
training a small model on CPU, in this process and as real processes (SIGKILL, gloo).

Skipped only when the ``accelerate`` extra is not installed (``make test`` installs it).
The training loop is tests/helpers/accelerate_workers.py's, shared with its subprocesses.
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from subprocess import PIPE
from typing import Any

import numpy as np
import pytest

pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
torch = pytest.importorskip("torch")

import accelerate_workers as workers  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import castore  # noqa: E402
from castore.errors import (  # noqa: E402
    GenerationNotFoundError,
    ImportSourceError,
    UnsupportedValueError,
)
from castore.integrations.accelerate import CastoreState  # noqa: E402
from castore.integrations.checkpoint_dirs import write_checkpoint_dir  # noqa: E402

RUN = workers.RUN
WORKER = Path(workers.__file__)
LAUNCH_TIMEOUT = 180


def fresh(**options: Any) -> workers.Training:
    """A new Accelerator and freshly built model, optimizer, loader and scheduler.

    Accelerate keeps its state in process-wide singletons: a new Accelerator in this
    process starts from none."""
    _reset_accelerate()
    return workers.prepare(**options)


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _leave_no_accelerate_state() -> Iterator[None]:
    yield
    _reset_accelerate()


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, np.ndarray]:
    """The final weights of a run that never saved nor stopped."""
    run = fresh()
    workers.train(run)
    return workers.weights(run)


def castore_state(run: workers.Training, tmp_path: Path, **options: Any) -> CastoreState:
    return CastoreState(
        run.accelerator, tmp_path / "store", run=RUN, staging_dir=tmp_path / "staging", **options
    )


def leftovers(tmp_path: Path) -> list[str]:
    """What CastoreState left in its staging directory once it returned: nothing (each
    save or load stages in a new directory of its own and removes it)."""
    found = (tmp_path / "staging").rglob("*")
    return sorted(str(p.relative_to(tmp_path)) for p in found)


def assert_same_weights(got: Any, want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].tobytes() == value.tobytes(), name


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal bit for bit: tensors and arrays by value, dtype and shape; containers and
    plain values by type too (a tuple stays a tuple)."""
    if torch.is_tensor(want):
        assert torch.is_tensor(got), where
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert torch.equal(got, want), where
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, where
        assert np.array_equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(want, key=str), where
        for key in want:
            assert_same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}/{index}")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def snapshot(run: workers.Training) -> dict[str, Any]:
    """Everything save_state saves of a single-process run, copied."""
    return copy.deepcopy(
        {
            "model": run.accelerator.unwrap_model(run.model).state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
        }
    )


def launch(args: list[str], cwd: Path, processes: int = 1) -> subprocess.CompletedProcess[str]:
    """accelerate_workers.py as its own process, or as ``processes`` under torchrun;
    a launch that hangs fails the test, its whole process group killed."""
    if processes == 1:
        command = [sys.executable, str(WORKER), *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc_per_node={processes}", str(WORKER), *args]
    child = subprocess.Popen(
        command, stdout=PIPE, stderr=PIPE, text=True, cwd=cwd, start_new_session=True
    )
    try:
        out, err = child.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        pytest.fail(f"{' '.join(command)} hung for {LAUNCH_TIMEOUT} s:\n{out}{err}")
    return subprocess.CompletedProcess(command, child.returncode, out, err)


# -- two processes (MULTI_CPU, gloo); first in the file: the longest test starts first --


@pytest.mark.slow
def test_two_processes_on_gloo_save_every_rng_and_resume_bitwise_after_a_kill(
    tmp_path: Path,
) -> None:
    """Two processes under torchrun: ``load()`` on the empty store raises castore's
    error on both (no hang); the main process is SIGKILLed inside the save at step 10;
    the stored generation of step 5 holds both processes' RNG files; a 2-process
    resume ends where an uninterrupted 2-process run ends, bit for bit (4 batches an
    epoch per process: step 5 is mid-epoch). The uninterrupted run is the first launch's
    first work, in fresh processes, to save a third launch: anything it left behind in
    them could only make the resume differ, never make it match."""
    common = ["store", "staging"]
    killed = launch(
        [*common, "killed.npz", "--reference", "whole.npz", "--probe", "--kill-at", "10"],
        tmp_path,
        processes=2,
    )
    output = killed.stdout + killed.stderr
    assert killed.returncode != 0 and "SIGKILL" in output, output
    for rank in (0, 1):
        probe = json.loads((tmp_path / f"killed.npz.probe-{rank}.json").read_text())
        assert probe["raised"] == "GenerationNotFoundError", (rank, probe)
        assert "has no generations" in probe["message"], (rank, probe)
    with castore.open(tmp_path / "store") as store:
        assert [g.step for g in store.generations(RUN)] == [5]
        files = store.load(RUN, "latest")["files"]
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(files)
        for rank in (0, 1):  # each process's torch, numpy and python RNG streams
            held = files[f"random_states_{rank}.pkl"]["value"]
            assert len(held["torch_manual_seed"]) == torch.get_rng_state().numel()
            assert held["numpy_random_seed"][0] == "MT19937" and held["random_state"][0] == 3

    resumed = launch([*common, "resumed.npz", "--resume"], tmp_path, processes=2)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    whole = np.load(tmp_path / "whole.npz")
    assert_same_weights(np.load(tmp_path / "resumed.npz"), {k: whole[k] for k in whole.files})


# -- one process: a kill inside a save, and resume ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_run_killed_inside_a_save_resumes_bitwise(
    tmp_path: Path, uninterrupted: dict[str, np.ndarray], blocking: bool
) -> None:
    """SIGKILL inside castore's save at step 15, before its ref advances (async: on the
    thread that stores it while training goes on): the store's latest generation is
    step 10's, and a run resumed from it with ``load()`` ends where a run that never
    saved ends, bit for bit (mid-epoch: 8 batches an epoch)."""
    flags = ["--kill-at", "15"] + ([] if blocking else ["--async"])
    killed = launch(["store", "staging", "killed.npz", *flags], tmp_path)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert not (tmp_path / "killed.npz").exists()
    with castore.open(tmp_path / "store") as store:
        assert [g.step for g in store.generations(RUN)] == [5, 10]
        assert store.resolve(RUN, "latest").step == 10

    run = fresh()
    state = castore_state(run, tmp_path)
    start = state.load()
    assert start == 10
    workers.train(run, start=start)
    assert_same_weights(workers.weights(run), uninterrupted)
    state.close()


# -- what a save holds ------------------------------------------------------------


def test_a_saved_state_loads_back_exactly_into_a_fresh_accelerator(tmp_path: Path) -> None:
    run = fresh()
    workers.train(run, stop=7)
    saved = snapshot(run)
    state = castore_state(run, tmp_path)
    generation = state.save(7)
    assert generation is not None and generation.step == 7
    assert leftovers(tmp_path) == [], "save() left its staging copy"
    # The stored files are the ones Accelerate writes; the weights file byte for byte.
    plain = Path(run.accelerator.save_state(str(tmp_path / "plain")))
    stored = write_checkpoint_dir(state.store.load(RUN, "latest"), tmp_path / "stored")
    assert sorted(p.name for p in stored.iterdir()) == sorted(p.name for p in plain.iterdir())
    weights_file = "model.safetensors"
    assert (stored / weights_file).read_bytes() == (plain / weights_file).read_bytes()
    state.close()

    workers.train(run, start=7, stop=12)  # moves weights, moments, lr and RNG on
    assert not torch.equal(run.model[0].weight, saved["model"]["0.weight"])
    other = fresh()
    random.seed(1)  # every RNG elsewhere: load() must bring the saved streams back
    np.random.seed(1)
    torch.manual_seed(1)
    loaded = castore_state(other, tmp_path)
    assert loaded.load() == 7
    assert_same(snapshot(other), saved)
    assert leftovers(tmp_path) == [], "load() left its staging copy"
    loaded.close()


def test_with_dropout_castores_resume_is_accelerates_own_resume(tmp_path: Path) -> None:
    """With dropout a resume is not bitwise equal to an uninterrupted run, through
    Accelerate's own save_state/load_state either (workers.prepare says why); castore
    changes nothing of what Accelerate restores: both resumes end bit for bit alike.
    The dropout masks come from the restored RNG, so this also fails if castore
    loses an RNG state."""
    run = fresh(dropout=True)
    state = castore_state(run, tmp_path)

    def save_both(step: int) -> None:
        if step == 10:
            state.save(step)
            run.accelerator.save_state(str(tmp_path / "plain"))

    workers.train(run, stop=10, after_step=save_both)
    state.close()

    through_castore = fresh(dropout=True)
    reader = castore_state(through_castore, tmp_path)
    workers.train(through_castore, start=reader.load())
    reader.close()
    through_accelerate = fresh(dropout=True)
    through_accelerate.accelerator.load_state(str(tmp_path / "plain"))
    workers.train(through_accelerate, start=10)
    assert_same_weights(workers.weights(through_castore), workers.weights(through_accelerate))


# -- retention --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total_limit", "keep", "tagged"),
    [(2, None, [15, 20]), (None, 2, [15, 20]), (2, 3, [10, 15, 20]), (None, None, [])],
    ids=["total_limit", "keep", "keep-over-total_limit", "neither"],
)
def test_the_newest_saves_are_tagged_as_the_retention_limit_says(
    tmp_path: Path, total_limit: int | None, keep: int | None, tagged: list[int]
) -> None:
    run = fresh(project_config=ProjectConfiguration(total_limit=total_limit))
    state = castore_state(run, tmp_path, keep=keep)
    generations = {step: state.save(step) for step in (5, 10, 15, 20)}
    tags = state.store.refs.tags(RUN)
    assert sorted(tags) == sorted(f"state-{step}" for step in tagged)
    for step in tagged:
        generation = generations[step]
        assert generation is not None
        assert tags[f"state-{step}"].root.hex == generation.root
    state.close()


# -- refusals ---------------------------------------------------------------------


class Opaque:
    """An object only pickle can store."""


class Registered:
    """An object for ``register_for_checkpointing``: Accelerate pickles its state_dict."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


@pytest.mark.parametrize(
    ("held", "error", "names"),
    [
        (Opaque(), ImportSourceError, ["custom_checkpoint_0.pkl", "test_accelerate.Opaque"]),
        # weights_only loads a dtype; castore stores no torch.dtype without pickle.
        (torch.bfloat16, UnsupportedValueError, ["custom_checkpoint_0.pkl", "torch.dtype"]),
    ],
    ids=["object-weights_only-refuses", "dtype-castore-cannot-encode"],
)
def test_a_registered_object_castore_cannot_store_is_refused_before_anything_is_stored(
    tmp_path: Path, held: Any, error: type[Exception], names: list[str]
) -> None:
    run = fresh()
    state = castore_state(run, tmp_path)
    state.save(5)
    run.accelerator.register_for_checkpointing(Registered({"kind": held}))
    with pytest.raises(error) as raised:
        state.save(10)
    assert type(raised.value) is error
    for name in names:
        assert name in str(raised.value)
    if error is UnsupportedValueError:  # where in the stored tree: the file and the key
        assert raised.value.key_path == "files/custom_checkpoint_0.pkl/value/kind"
    assert [g.step for g in state.store.generations(RUN)] == [5]
    assert leftovers(tmp_path) == [], "a refused save left its staging copy"
    state.close()


def test_loading_a_run_with_no_such_generation_is_a_castore_error(tmp_path: Path) -> None:
    run = fresh()
    state = castore_state(run, tmp_path)
    with pytest.raises(GenerationNotFoundError, match="has no generations"):
        state.load()
    state.save(5)
    with pytest.raises(GenerationNotFoundError):
        state.load(7)
    assert leftovers(tmp_path) == []
    state.close()


def test_a_state_missing_a_process_rng_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process whose files land where the main process does not look (several nodes,
    a staging directory that is not shared) would lose its RNG state: refused by name."""
    run = fresh()
    state = castore_state(run, tmp_path)
    state.save(5)
    save_state = run.accelerator.save_state

    def elsewhere(directory: str, **options: Any) -> Any:
        written = save_state(directory, **options)
        (Path(written) / "random_states_0.pkl").unlink()
        return written

    monkeypatch.setattr(run.accelerator, "save_state", elsewhere)
    with pytest.raises(ImportSourceError, match=r"lacks random_states_0\.pkl.*staging_dir="):
        state.save(10)
    assert [g.step for g in state.store.generations(RUN)] == [5]
    assert leftovers(tmp_path) == []
    state.close()


def test_two_states_on_one_machine_stage_apart(tmp_path: Path) -> None:
    """Each save stages in a directory of its own: a second job with the same run name
    and the same staging root never deletes or mixes the first one's files."""
    run = fresh()
    first, second = (
        castore_state(run, tmp_path),
        CastoreState(
            run.accelerator, tmp_path / "store2", run=RUN, staging_dir=tmp_path / "staging"
        ),
    )
    seen: list[str] = []
    save_state = run.accelerator.save_state

    def record(directory: str, **options: Any) -> Any:
        seen.append(directory)
        return save_state(directory, **options)

    run.accelerator.save_state = record  # type: ignore[method-assign]
    try:
        first.save(5)
        second.save(5)
        first.save(10)
    finally:
        del run.accelerator.save_state
    assert len(set(seen)) == 3 and all(Path(d).parent == tmp_path / "staging" for d in seen)
    assert [g.step for g in first.store.generations(RUN)] == [5, 10]
    assert leftovers(tmp_path) == []
    first.close()
    second.close()


def test_async_saves_publish_in_order_and_a_failure_surfaces_at_the_next_call(
    tmp_path: Path,
) -> None:
    """``blocking=False``: each save is stored on a thread while training goes on; the
    next call waits for it, so the run's generations are the saves in order, tagged as
    with blocking saves, and a save that fails there raises at the next call."""
    run = fresh()
    state = castore_state(run, tmp_path, blocking=False, keep=2)
    for step in (5, 10, 15):
        workers.train(run, start=step - 5, stop=step)
        assert state.save(step) is None  # stored on the thread, not yet published
    generation = state.finish()
    assert generation is not None and generation.step == 15
    assert state.finish() is None  # nothing left in flight
    assert [g.step for g in state.store.generations(RUN)] == [5, 10, 15]
    assert set(state.store.refs.tags(RUN)) == {"state-10", "state-15"}
    assert leftovers(tmp_path) == []

    run.accelerator.register_for_checkpointing(Registered({"kind": Opaque()}))
    state.save(20)  # refused on the thread: raised by the next call
    with pytest.raises(ImportSourceError, match="custom_checkpoint_0.pkl"):
        state.close()
    assert [g.step for g in state.store.generations(RUN)] == [5, 10, 15]
    assert leftovers(tmp_path) == []
    state.close()
