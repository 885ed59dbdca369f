"""castore as a Hugging Face ``Trainer`` callback, the real package training a tiny GPT-2 on CPU.

Skipped only when the ``transformers`` extra is not installed (``make test`` installs it).
"""

from __future__ import annotations

import errno
import filecmp
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
torch = pytest.importorskip("torch")

from dist_harness import free_port  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
)

import castore  # noqa: E402
from castore.errors import (  # noqa: E402
    GenerationNotFoundError,
    ImportSourceError,
    UnsupportedValueError,
)
from castore.gc import RetentionPolicy, collect_garbage  # noqa: E402
from castore.integrations import huggingface  # noqa: E402
from castore.integrations.checkpoint_dirs import MARKER  # noqa: E402
from castore.integrations.huggingface import CastoreCallback, restore_checkpoint  # noqa: E402
from castore.testing.zygote import TORCH_PRELOAD, ForkedProcess, ZygoteMismatch  # noqa: E402
from castore.testing.zygote import shared as shared_zygote  # noqa: E402

pytestmark = pytest.mark.xdist_group("huggingface")

RUN = "hf-trainer"
WORKERS = Path(__file__).resolve().parent / "helpers" / "hf_workers.py"
# 32 samples, 4 a batch, 2 epochs: 16 steps, a checkpoint every 4.
STEPS = [4, 8, 12, 16]


class Tokens(torch.utils.data.Dataset):  # type: ignore[misc]
    """32 fixed sequences of 16 tokens; each is its own label (a language model's task)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 64, (32, 16), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.x[index], "labels": self.x[index]}


def train(
    output_dir: Path,
    callbacks: list[Any],
    resume: str | None = None,
    optimizer: Any = None,
    eval_dataset: Any = None,
    **options: Any,
) -> Any:
    """Train the tiny GPT-2 (2 layers, width 32, dropout on: its RNG matters) and return
    the Trainer; ``options`` override the TrainingArguments below."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    arguments = {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "per_device_train_batch_size": 4,
        "num_train_epochs": 2,
        "save_steps": 4,
        "report_to": "none",
        "logging_steps": 100,
        "seed": 0,
        "disable_tqdm": True,
        **options,
    }
    optimizers = (optimizer(model.parameters()) if optimizer else None, None)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**arguments),
        train_dataset=Tokens(),
        eval_dataset=eval_dataset,
        callbacks=callbacks,
        optimizers=optimizers,
    )
    # One intra-op thread in every process (the workers' too, so their float sums are
    # this one's): on two busy cores, two threads made a run 5x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        torch.set_num_threads(threads)
    return trainer


def weights(trainer: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in trainer.model.state_dict().items()}


def assert_same_weights(got: Any, want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].tobytes() == value.tobytes(), name


def checkpoint_dirs(output_dir: Path) -> list[str]:
    """The ``checkpoint-STEP`` directories in ``output_dir``, oldest first."""
    return sorted((p.name for p in output_dir.glob("checkpoint-*")), key=lambda n: int(n[11:]))


def assert_same_checkpoint(restored: Path, written: Path) -> None:
    """Every file the Trainer wrote (but training_args.bin) is there, byte for byte."""
    want = sorted(p.name for p in written.iterdir() if p.name != "training_args.bin")
    got = sorted(p.name for p in restored.iterdir() if p.name != MARKER)
    assert got == want
    for name in want:
        assert filecmp.cmp(restored / name, written / name, shallow=False), name


@dataclass(frozen=True)
class Reference:
    """An uninterrupted run with the callback: its final weights, its store, its directories."""

    weights: dict[str, np.ndarray]
    store: Path
    output_dir: Path


# What tests/helpers/hf_workers.py imports: a zygote imports it once, and each worker is forked
# from it in milliseconds instead of the seconds importing transformers takes.
WORKER_PRELOAD = (
    *TORCH_PRELOAD,
    "transformers",
    "transformers.trainer",
    "transformers.models.gpt2.modeling_gpt2",
    "pytest",
    "castore",
    "castore.integrations.huggingface",
)


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CASTORE_FAULTS"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def start_worker(log: Path, *args: Any, **env: str) -> subprocess.Popen[bytes] | ForkedProcess:
    """``python tests/helpers/hf_workers.py ARGS...``, forked from the zygote where there is one."""
    argv, environment = [str(WORKERS), *map(str, args)], worker_env(**env)
    zygote = shared_zygote(WORKER_PRELOAD, worker_env())
    if zygote is not None:
        try:
            return zygote.fork(argv, env=environment, cwd=WORKERS.parent, stdout=log, stderr=log)
        except ZygoteMismatch:
            pass
    with log.open("ab") as output:
        return subprocess.Popen(
            [sys.executable, *argv], env=environment, stdout=output, stderr=subprocess.STDOUT
        )


def finished(process: subprocess.Popen[bytes] | ForkedProcess, timeout: float = 120) -> int:
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(30)
        raise


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    root = tmp_path_factory.mktemp("reference")
    trainer = train(root / "out", [CastoreCallback(root / "store", run=RUN)])
    return Reference(weights(trainer), root / "store", root / "out")


def test_every_checkpoint_comes_back_byte_for_byte(reference: Reference, tmp_path: Path) -> None:
    assert checkpoint_dirs(reference.output_dir) == [f"checkpoint-{s}" for s in STEPS]
    with castore.open(reference.store) as store:
        generations = store.generations(RUN)
        assert [g.step for g in generations] == STEPS
        assert store.refs.tags(RUN).keys() == {f"checkpoint-{s}" for s in STEPS}
        for generation in generations:
            path = restore_checkpoint(store, tmp_path / "out", run=RUN, generation=generation.id)
            assert path == str(tmp_path / "out" / f"checkpoint-{generation.step}")
            assert_same_checkpoint(Path(path), reference.output_dir / Path(path).name)
            assert (Path(path) / MARKER).is_file()


def test_a_restored_checkpoint_is_left_alone_and_a_partial_one_replaced(
    reference: Reference, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    written = reference.output_dir / "checkpoint-16"
    path = Path(restore_checkpoint(reference.store, out, run=RUN))  # latest: step 16
    assert path == out / "checkpoint-16"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.iterdir()}
    assert restore_checkpoint(reference.store, out, run=RUN) == str(path)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.iterdir()} == before

    # A checkpoint the Trainer had begun to write when it was killed: a truncated
    # optimizer.pt and no marker. Restoring the same step replaces it whole.
    shutil.rmtree(path)
    shutil.copytree(written, path)
    with (path / "optimizer.pt").open("r+b") as handle:
        handle.truncate(100)
    assert restore_checkpoint(reference.store, out, run=RUN) == str(path)
    assert_same_checkpoint(path, written)
    assert (path / MARKER).is_file()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-16"]  # no temporary left


def flip_last_byte(path: Path) -> None:
    """Change ``path`` in place, its size and modification time kept."""
    before = path.stat()
    with path.open("r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


EDITS = {
    # Under 1 MiB (this model's weights too): its digest is in the marker.
    "changed": lambda path: flip_last_byte(path / "model.safetensors"),
    "truncated": lambda path: os.truncate(path / "optimizer.pt", 100),
    "removed": lambda path: (path / "rng_state.pth").unlink(),
    "added": lambda path: (path / "pytorch_model.bin").write_bytes(b"not the Trainer's"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_restored_checkpoint_edited_since_is_restored_again(
    reference: Reference, tmp_path: Path, edit: str
) -> None:
    """The marker promises the files as they were written: a directory that no longer
    holds them (a file changed, truncated, removed or added) is not handed to the
    Trainer as it is, but restored again, whole."""
    out = tmp_path / "out"
    path = Path(restore_checkpoint(reference.store, out, run=RUN, generation="checkpoint-8"))
    EDITS[edit](path)
    assert restore_checkpoint(reference.store, out, run=RUN, generation="checkpoint-8") == str(path)
    assert_same_checkpoint(path, reference.output_dir / "checkpoint-8")


@pytest.mark.slow
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_run_killed_inside_a_save_resumes_from_castore_bitwise(
    reference: Reference, tmp_path: Path, blocking: bool
) -> None:
    """SIGKILL inside castore's save of checkpoint-12 (before its ref advances); the
    node's disk is lost too. The store's latest is checkpoint-8, and the Trainer resumed
    from it through restore_checkpoint ends where an uninterrupted run ends, bit for bit."""
    store, out, log = tmp_path / "store", tmp_path / "out", tmp_path / "log"
    killed = start_worker(log, "kill", store, out, int(blocking), 12)
    assert finished(killed) == -signal.SIGKILL, log.read_text()[-3000:]
    assert (out / "checkpoint-12").is_dir()  # the Trainer wrote it; castore never published it
    with castore.open(store) as opened:
        assert [g.step for g in opened.generations(RUN)] == [4, 8]
        assert opened.refs.tags(RUN).keys() == {"checkpoint-4", "checkpoint-8"}
    shutil.rmtree(out)

    path = restore_checkpoint(store, tmp_path / "elsewhere", run=RUN)
    assert path == str(tmp_path / "elsewhere" / "checkpoint-8")
    callback = CastoreCallback(store, run=RUN, blocking=blocking)
    resumed = train(tmp_path / "elsewhere", [callback], resume=path)
    assert_same_weights(weights(resumed), reference.weights)
    with castore.open(store) as opened:
        assert [g.step for g in opened.generations(RUN)] == STEPS


def test_save_total_limit_keeps_the_newest_tags_and_gc_frees_the_rest(tmp_path: Path) -> None:
    store_path = tmp_path / "store"
    train(tmp_path / "out", [CastoreCallback(store_path, run=RUN)], save_total_limit=2)
    assert checkpoint_dirs(tmp_path / "out") == ["checkpoint-12", "checkpoint-16"]
    with castore.open(store_path) as store:
        assert store.refs.tags(RUN).keys() == {"checkpoint-12", "checkpoint-16"}
        generations = store.generations(RUN)
        assert [g.step for g in generations] == STEPS  # untagged, not dropped yet
        for generation in generations:
            assert store.load(RUN, generation.id)["files"].keys() >= {"optimizer.pt"}
        collect_garbage(store, RetentionPolicy(keep_last=1), runs=[RUN])
        assert [g.step for g in store.generations(RUN)] == [12, 16]
        with pytest.raises(GenerationNotFoundError):
            store.load(RUN, generations[0].id)
        for generation in store.generations(RUN):
            restore_checkpoint(store, tmp_path / "back", run=RUN, generation=generation.id)
    assert checkpoint_dirs(tmp_path / "back") == ["checkpoint-12", "checkpoint-16"]


def test_the_best_checkpoint_keeps_its_tag(tmp_path: Path) -> None:
    # The loss falls: "greater is better" makes the first checkpoint the best one.
    trainer = train(
        tmp_path / "out",
        [CastoreCallback(tmp_path / "store", run=RUN)],
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=4,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        eval_dataset=torch.utils.data.Subset(Tokens(), range(8)),
    )
    assert Path(trainer.state.best_model_checkpoint).name == "checkpoint-4"
    kept = checkpoint_dirs(tmp_path / "out")
    with castore.open(tmp_path / "store") as store:
        tags = store.refs.tags(RUN).keys()
    # The Trainer keeps the best and the newest (2 in all); castore keeps their tags.
    assert kept == ["checkpoint-4", "checkpoint-16"]
    assert tags == set(kept)


@pytest.mark.parametrize(
    ("keep_local", "blocking", "links"),
    [(0, True, True), (0, False, True), (1, False, True), (0, False, False)],
    ids=["none-kept", "none-kept-async", "newest-kept-async", "none-kept-async-no-links"],
)
def test_keep_local_removes_only_directories_castore_holds(
    reference: Reference,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    keep_local: int,
    blocking: bool,
    links: bool,
) -> None:
    """Async, the directory of the save in flight is not stored yet: it must survive
    until castore published it (removing it made that save fail: "not there to store").
    Without hard links, async saves read on the training thread and castore's writer
    stores them; with them, nothing is left linked aside."""
    if not links:

        def cross_device(source: Any, target: Any) -> None:
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(target))

        monkeypatch.setattr(huggingface, "_hard_link", cross_device)
    store_path, out = tmp_path / "store", tmp_path / "out"
    callback = CastoreCallback(store_path, run=RUN, keep_local=keep_local, blocking=blocking)
    trainer = train(out, [callback])
    assert_same_weights(weights(trainer), reference.weights)
    assert checkpoint_dirs(out) == ["checkpoint-16"][:keep_local]
    assert not list(out.glob(".castore-*")), "a checkpoint was left linked aside"
    with castore.open(store_path) as store:
        generations = store.generations(RUN)
        assert [g.step for g in generations] == STEPS
        for generation in generations:
            path = restore_checkpoint(store, tmp_path / "back", run=RUN, generation=generation.id)
            assert_same_checkpoint(Path(path), reference.output_dir / Path(path).name)


def test_each_optimizer_step_is_reported_and_a_tiered_store_sends_promotions_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 batches, 2 accumulated per optimizer step: 8 steps reported (on_step_end), and
    each async save (no hard links: castore's async writer stores it, from its staging
    buffers) promoted without reading its chunks back from the fast tier. The broken
    control (no report) is tests/test_lightning.py's."""
    from castore.tiers import open_tiered

    def cross_device(source: Any, target: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(target))

    monkeypatch.setattr(huggingface, "_hard_link", cross_device)
    with open_tiered(
        tmp_path / "fast", tmp_path / "durable", durable_every=1, uploader="thread",
        promote_on_exit=False,
    ) as store:  # fmt: skip
        callback = CastoreCallback(store, run=RUN, blocking=False)
        trainer = train(tmp_path / "out", [callback], gradient_accumulation_steps=2)
        assert trainer.state.global_step == 8
        promoted = store.wait_promotions()
        assert [(p.generation, p.error) for p in promoted] == [(1, None), (2, None)]
        assert store._pacer is not None and store._pacer.steps == 7  # the first starts the clock
        read_back = sum(p.copied.chunks_copied for p in promoted if p.copied is not None)
        assert store.staged_sends["sent_chunks"] > 0 and read_back == 0
    with castore.open(tmp_path / "durable") as durable:
        assert [g.step for g in durable.generations(RUN)] == [4, 8]


class Note:
    """An object of the test's own: torch's weights_only loader refuses to unpickle it."""


class NotedSGD(torch.optim.SGD):  # type: ignore[misc]
    """SGD whose state carries one more value, ``note``."""

    note: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "note": self.note}


def noted_sgd(note: Any) -> Any:
    def make(parameters: Any) -> Any:
        optimizer = NotedSGD(parameters, lr=0.01)
        optimizer.note = note
        return optimizer

    return make


def test_a_pickle_weights_only_refuses_stops_the_save(tmp_path: Path) -> None:
    callback = CastoreCallback(tmp_path / "store", run=RUN)
    with pytest.raises(ImportSourceError, match=r"optimizer\.pt is not loadable with weights_only"):
        train(tmp_path / "out", [callback], optimizer=noted_sgd(Note()), max_steps=4)
    with castore.open(tmp_path / "store") as store:
        assert RUN not in store.runs()  # nothing published


def test_a_value_castore_cannot_encode_is_refused_naming_file_and_key(tmp_path: Path) -> None:
    callback = CastoreCallback(tmp_path / "store", run=RUN)
    # A set: torch's weights_only loader accepts it, castore's state tree does not.
    with pytest.raises(UnsupportedValueError, match=r"optimizer\.pt") as refused:
        train(tmp_path / "out", [callback], optimizer=noted_sgd({1, 2}), max_steps=4)
    assert refused.value.key_path == "files/optimizer.pt/value/note"
    with castore.open(tmp_path / "store") as store:
        assert RUN not in store.runs()


@pytest.mark.parametrize("refuse", [False, True], ids=["published", "refused"])
def test_an_async_save_in_flight_when_training_dies_is_published_or_said(
    tmp_path: Path, refuse: bool
) -> None:
    """Training ends by an exception (no on_train_end) while the save of checkpoint-4 is
    on the callback's thread: the process waits for it at exit, and it is published and
    tagged; or, when it fails, stderr says that it was not published."""
    log = tmp_path / "log"
    process = start_worker(log, "crash", tmp_path / "store", tmp_path / "out", int(refuse))
    assert finished(process) == 1, log.read_text()
    said = log.read_text()
    assert "training failed" in said
    with castore.open(tmp_path / "store") as store:
        if refuse:
            assert RUN not in store.runs()
            assert "castore's store of checkpoint-4 failed and was not published" in said
            assert "optimizer.pt is not loadable with weights_only" in said
        else:
            assert [g.step for g in store.generations(RUN)] == [4]
            assert set(store.refs.tags(RUN)) == {"checkpoint-4"}
            assert "was not published" not in said


@pytest.mark.slow
def test_an_async_save_killed_right_after_it_published_is_tagged(tmp_path: Path) -> None:
    """No hard links (castore's async writer stores the checkpoint): SIGKILL once the
    save of checkpoint-4 has published, before the training thread waited for it. Its
    tag is there (it was written only at the next save or the end of training, and an
    untagged generation is one ``castore gc`` past ``keep_last`` drops)."""
    log = tmp_path / "log"
    process = start_worker(log, "published", tmp_path / "store", tmp_path / "out")
    assert finished(process) == -signal.SIGKILL, log.read_text()[-3000:]
    with castore.open(tmp_path / "store") as store:
        generations = store.generations(RUN)
        assert [g.step for g in generations] == [4]
        tags = store.refs.tags(RUN)
        assert set(tags) == {"checkpoint-4"}
        assert tags["checkpoint-4"].root.hex == generations[0].root


def test_skip_leaves_a_file_out(tmp_path: Path) -> None:
    callback = CastoreCallback(tmp_path / "store", run=RUN, skip=("optimizer.pt",))
    train(tmp_path / "out", [callback], optimizer=noted_sgd(Note()), max_steps=4)
    path = Path(restore_checkpoint(tmp_path / "store", tmp_path / "back", run=RUN))
    written = tmp_path / "out" / "checkpoint-4"
    assert (written / "optimizer.pt").is_file() and not (path / "optimizer.pt").exists()
    (written / "optimizer.pt").unlink()
    assert_same_checkpoint(path, written)


def test_a_rank_rng_file_missing_from_the_checkpoint_is_refused(
    reference: Reference, tmp_path: Path
) -> None:
    """Ranks on other nodes writing to their own disks: the directory rank 0 sees lacks
    their RNG files, and a checkpoint stored without them would not resume those ranks.
    Refused by name before anything is stored."""
    from types import SimpleNamespace

    out = tmp_path / "out"
    shutil.copytree(reference.output_dir / "checkpoint-4", out / "checkpoint-4")
    (out / "checkpoint-4" / "rng_state.pth").rename(out / "checkpoint-4" / "rng_state_0.pth")
    args = SimpleNamespace(
        output_dir=str(out),
        world_size=2,
        save_only_model=False,
        save_total_limit=None,
        to_json_string=lambda: "{}",
    )
    state = SimpleNamespace(is_world_process_zero=True, global_step=4, best_model_checkpoint=None)
    callback = CastoreCallback(tmp_path / "store", run=RUN)
    with pytest.raises(ImportSourceError, match=r"lacks rng_state_1\.pth"):
        callback.on_save(args, state, None)
    assert callback.store.runs() == []
    (out / "checkpoint-4" / "rng_state_1.pth").write_bytes(
        (out / "checkpoint-4" / "rng_state_0.pth").read_bytes()
    )
    callback.on_save(args, state, None)  # every rank's file there: stored
    assert [g.step for g in callback.store.generations(RUN)] == [4]
    callback.store.close()


@pytest.mark.slow
def test_two_ddp_ranks_on_gloo_store_both_rng_files_and_resume_bitwise(tmp_path: Path) -> None:
    """The Trainer's DDP on CPU (gloo), 2 ranks: rank 0 stores each checkpoint after every
    rank wrote its RNG file; both ranks resume from castore's checkpoint-4 (the output
    directory removed) and end where the uninterrupted run ended, bit for bit."""
    port = str(free_port())
    ranks = [
        start_worker(
            tmp_path / f"log-{rank}",
            "ddp",
            tmp_path,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for rank in range(2)
    ]
    codes = [finished(process) for process in ranks]
    logs = "\n".join((tmp_path / f"log-{rank}").read_text()[-3000:] for rank in range(2))
    assert codes == [0, 0], logs
    with castore.open(tmp_path / "store") as store:
        generations = store.generations(RUN)
        # 32 samples, 4 a rank a step: 4 steps an epoch. The uninterrupted run saved
        # steps 2-8; the resumed one (from 4) saved 6 and 8 again.
        assert [g.step for g in generations] == [2, 4, 6, 8, 6, 8]
        for generation in generations:
            files = store.load(RUN, generation.id)["files"]
            assert {"rng_state_0.pth", "rng_state_1.pth"} <= files.keys()
            assert "rng_state.pth" not in files
    whole, resumed = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    assert_same_weights(resumed, dict(whole))


@pytest.mark.slow
def test_a_checkpoint_an_earlier_attempt_restored_still_resumes_the_run(
    reference: Reference, tmp_path: Path
) -> None:
    """Back to checkpoint-8 of a run that reached step 16, in a job whose earlier attempt
    (another process) restored it already: restore_checkpoint leaves the directory as it
    is, and this process resumes the run from there all the same (its saves of steps 12
    and 16 are a resume, not another job's lower steps: no StepOrderError)."""
    store, out = tmp_path / "store", tmp_path / "out"
    shutil.copytree(reference.store, store)
    earlier = start_worker(tmp_path / "log", "restore", store, out, "checkpoint-8")
    assert finished(earlier) == 0, (tmp_path / "log").read_text()[-3000:]
    marker = (out / "checkpoint-8" / MARKER).stat()
    path = restore_checkpoint(store, out, run=RUN, generation="checkpoint-8")
    assert path == str(out / "checkpoint-8")
    assert (Path(path) / MARKER).stat().st_ino == marker.st_ino  # left as it was
    resumed = train(out, [CastoreCallback(store, run=RUN)], resume=path)
    assert_same_weights(weights(resumed), reference.weights)
    with castore.open(store) as opened:
        assert [g.step for g in opened.generations(RUN)] == [*STEPS, 12, 16]
