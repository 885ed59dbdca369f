"""castore as Lightning's CheckpointIO, with the real package training a small model on CPU.

Skipped only when the ``lightning`` extra is not installed (``make test`` installs it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning", reason="the lightning extra is not installed")
torch = pytest.importorskip("torch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import castore  # noqa: E402
from castore.errors import NotAPointerError, UnsupportedValueError  # noqa: E402
from castore.integrations.lightning import CastoreCheckpointIO, tag_name  # noqa: E402

RUN = "lightning"


class Regressor(L.LightningModule):  # type: ignore[misc, name-defined]
    def __init__(self, hparams: Any = None) -> None:
        super().__init__()
        layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)]
        self.net = torch.nn.Sequential(*layers)
        self.save_hyperparameters(hparams or {"width": 16})

    def training_step(self, batch: Any, index: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _data() -> Any:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16
    )


def _trainer(epochs: int, plugins: list[Any], callbacks: list[Any]) -> Any:
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        plugins=plugins,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
    )


def _fit(
    epochs: int, tmp_path: Path, ckpt_path: Any = None, top_k: int = 2, blocking: bool = True
) -> Any:
    L.seed_everything(0, verbose=False)
    model = Regressor()
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", save_top_k=top_k, monitor="train_loss", save_last=True
    )
    io = CastoreCheckpointIO(tmp_path / "store", blocking=blocking)
    _trainer(epochs, [io], [checkpoints]).fit(model, _data(), ckpt_path=ckpt_path)
    return model, checkpoints


def _uninterrupted(epochs: int) -> Any:
    L.seed_everything(0, verbose=False)
    model = Regressor()
    _trainer(epochs, [], []).fit(model, _data())
    return model


def _same_weights(a: Any, b: Any) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_checkpoints_are_generations_and_top_k_removal_is_an_untag(
    tmp_path: Path, blocking: bool
) -> None:
    _, checkpoints = _fit(4, tmp_path, blocking=blocking)
    files = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    kept = {Path(p).name for p in checkpoints.best_k_models} | {"last.ckpt"}
    assert set(files) == kept and len(files) == 3  # top 2 and last: the others were removed
    with castore.open(tmp_path / "store") as store:
        generations = store.generations(RUN)
        assert len(generations) == 4  # one per epoch's end, whether a top-k file named it or not
        tags = store.refs.tags(RUN)
        # Each file still there keeps its generation by a tag; removed files left none.
        assert set(tags) == {tag_name(Path(name)) for name in files}
        for name in files:
            pointer = json.loads((tmp_path / "ckpts" / name).read_text())
            assert tags[tag_name(Path(name))].root.hex == pointer["root"]
        # Saves after the first write only what changed (the optimizer's step counters,
        # weights, moments): nothing of a save that repeats a step.
        assert generations[-1].stats.logical_bytes > 0


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_resume_from_last_matches_an_uninterrupted_run_bitwise(
    tmp_path: Path, blocking: bool
) -> None:
    _fit(2, tmp_path, blocking=blocking)
    resumed, _ = _fit(4, tmp_path, ckpt_path="last", blocking=blocking)
    assert _same_weights(resumed, _uninterrupted(4))


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_checkpoint_event_is_one_generation_named_by_both_files(
    tmp_path: Path, blocking: bool
) -> None:
    """Each epoch's end writes its top-k file, then last.ckpt of the same state: one
    generation, both pointers and both tags naming it (it was two, the second 0 B new)."""
    _fit(3, tmp_path, top_k=-1, blocking=blocking)
    ckpts = tmp_path / "ckpts"
    with castore.open(tmp_path / "store") as store:
        generations = store.generations(RUN)
        tags = store.refs.tags(RUN)
    assert [g.step for g in generations] == [4, 8, 12]
    for epoch, generation in enumerate(generations):
        names = [p.name for p in ckpts.glob(f"epoch={epoch}-*.ckpt")]
        names += ["last.ckpt"] if epoch == 2 else []
        assert len(names) == (2 if epoch == 2 else 1), names
        for name in names:
            pointer = json.loads((ckpts / name).read_text())
            assert (pointer["generation"], pointer["root"]) == (generation.id, generation.root)
            assert tags[tag_name(Path(name))].root.hex == generation.root, name


def _checkpoint(weights: Any, step: int = 4, last: str = "") -> dict[str, Any]:
    callback = {"best_k_models": {"a.ckpt": torch.tensor(0.5)}, "last_model_path": last}
    return {"global_step": step, "state_dict": {"w": weights}, "callbacks": {"MC": callback}}


def _pointed(path: Path) -> int:
    return int(json.loads(path.read_text())["generation"])


def test_a_second_name_follows_the_save_in_flight_and_starts_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """blocking=False: last.ckpt's save comes while the epoch file's save has not yet
    published; it starts no save, and the writer points both once it publishes."""
    import threading

    from castore.core import background

    gate, real = threading.Event(), background.follow_publish

    def held(*args: Any) -> Any:
        gate.wait(20)  # opened by the test; by itself after 20 s where a save waits on this one
        return real(*args)

    monkeypatch.setattr(background, "follow_publish", held)
    weights = torch.randn(1 << 16)  # 256 KiB: marked by where it lies and its version
    with castore.open(tmp_path / "store") as store:
        io = CastoreCheckpointIO(store, blocking=False)
        io.save_checkpoint(_checkpoint(weights), tmp_path / "epoch=0.ckpt")
        io.save_checkpoint(_checkpoint(weights, last="last.ckpt"), tmp_path / "last.ckpt")
        assert not (tmp_path / "last.ckpt").exists()  # follows the publish, not before it
        gate.set()
        io.finish()
        assert store.background.counters["started"] == 1
        assert _pointed(tmp_path / "epoch=0.ckpt") == _pointed(tmp_path / "last.ckpt") == 1
        assert set(store.refs.tags(RUN)) == {"ckpt-epoch_0", "ckpt-last"}
        io.teardown()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_state_that_changed_at_the_same_step_is_a_generation_of_its_own(
    tmp_path: Path, blocking: bool
) -> None:
    """Only the same state shares a generation: weights changed in place (a bumped
    version counter), a small tensor's bytes or another callback value make a new one."""
    weights = torch.randn(1 << 16)
    with castore.open(tmp_path / "store") as store:
        io = CastoreCheckpointIO(store, blocking=blocking)

        def save(name: str, checkpoint: dict[str, Any]) -> int:
            io.save_checkpoint(checkpoint, tmp_path / name)
            io.finish()
            return _pointed(tmp_path / name)

        assert save("a.ckpt", _checkpoint(weights)) == 1
        assert save("last.ckpt", _checkpoint(weights, last="last.ckpt")) == 1
        weights.add_(1)  # in place: same storage, version bumped
        assert save("b.ckpt", _checkpoint(weights)) == 2
        small = _checkpoint(weights)
        small["callbacks"]["MC"]["best_k_models"]["a.ckpt"] = torch.tensor(0.25)
        assert save("c.ckpt", small) == 3
        other = _checkpoint(weights)
        other["callbacks"]["MC"]["best_k_models"]["b.ckpt"] = torch.tensor(0.25)
        assert save("d.ckpt", other) == 4
        assert save("e.ckpt", _checkpoint(weights.clone())) == 5  # same bytes, another tensor
        assert [g.id for g in store.generations(RUN)] == [1, 2, 3, 4, 5]
        io.teardown()


def test_resume_from_a_given_checkpoint_path(tmp_path: Path) -> None:
    _, checkpoints = _fit(2, tmp_path, top_k=-1)  # every epoch's checkpoint kept
    first = sorted((tmp_path / "ckpts").glob("epoch=0*.ckpt"))[0]
    resumed, _ = _fit(3, tmp_path, ckpt_path=str(first), top_k=-1)
    # From the end of epoch 0, two more epochs: the uninterrupted 3-epoch run.
    assert _same_weights(resumed, _uninterrupted(3))


def test_a_value_castore_cannot_store_is_refused_naming_its_key(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    model = Regressor({"width": 16, "activation": torch.nn.ReLU()})  # an object: pickle only
    io = CastoreCheckpointIO(tmp_path / "store")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    with pytest.raises(UnsupportedValueError, match="hyper_parameters"):
        _trainer(1, [io], [checkpoints]).fit(model, _data())
    with castore.open(tmp_path / "store") as store:
        assert RUN not in store.runs()  # nothing published
    assert not (tmp_path / "ckpts" / "last.ckpt").exists()


def test_a_file_that_is_not_a_pointer_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, other)
    io = CastoreCheckpointIO(tmp_path / "store")
    with pytest.raises(NotAPointerError, match="not a castore checkpoint pointer"):
        io.load_checkpoint(other)
    # A pointer naming "latest" (or a tag) instead of a root digest is refused too.
    forged = tmp_path / "forged.ckpt"
    forged.write_text(
        json.dumps(
            {"format": "castore-lightning-pointer", "run": RUN, "generation": 1, "root": "latest"}
        )
    )
    with pytest.raises(NotAPointerError):
        io.load_checkpoint(forged)
    io.teardown()


@pytest.mark.slow
def test_a_run_killed_mid_save_resumes_from_last_bitwise(tmp_path: Path) -> None:
    """SIGKILL inside the castore save at the end of epoch 2 (before its ref advances):
    last.ckpt still names epoch 1's generation, and resuming from it through Lightning's
    own ``ckpt_path="last"`` ends where an uninterrupted run ends, bit for bit."""
    import subprocess
    import sys

    import numpy as np

    worker = Path(__file__).resolve().parent / "helpers" / "lightning_workers.py"
    store, ckpts = tmp_path / "store", tmp_path / "ckpts"

    def run(epochs: int, kill_at: int, resume: bool) -> subprocess.CompletedProcess[str]:
        out = tmp_path / f"weights-{kill_at}-{int(resume)}.npz"
        args = [str(store), str(ckpts), str(epochs), str(kill_at), str(int(resume)), str(out)]
        return subprocess.run(
            [sys.executable, str(worker), *args], capture_output=True, text=True, timeout=300
        )

    killed = run(5, 2, False)
    assert killed.returncode == -9, killed.stdout + killed.stderr  # died by SIGKILL mid-save
    with castore.open(store) as opened:
        steps = [g.step for g in opened.generations(RUN)]
    pointer = json.loads((ckpts / "last.ckpt").read_text())
    assert steps == sorted(steps) and pointer["generation"] == len(steps)
    # Every published save is epoch 0's or 1's (one each, named by epoch=N and last).
    assert max(steps) == 2 * 4  # 4 batches an epoch: the end of epoch 1
    resumed = run(5, -1, True)
    assert resumed.returncode == 0, resumed.stderr
    # The dead job is no other writer: the resume's saves warn of none.
    assert "ConcurrentWriterWarning" not in resumed.stderr, resumed.stderr
    got = np.load(tmp_path / "weights--1-1.npz")
    want = _uninterrupted(5).state_dict()
    for name, value in want.items():
        assert got[name].tobytes() == value.detach().numpy().tobytes(), name


@pytest.mark.slow
def test_an_async_save_killed_right_after_it_published_is_what_last_names(
    tmp_path: Path,
) -> None:
    """blocking=False, SIGKILL as epoch 3 starts, once the save in flight (epoch 2's
    file and last.ckpt, generation 3) has published and before anything on the training
    thread waited for it: both files and their tags name generation 3 (last.ckpt named
    2 when pointers were written only at the next save, and ``ckpt_path="last"`` redid
    an epoch)."""
    import subprocess
    import sys

    worker = Path(__file__).resolve().parent / "helpers" / "lightning_workers.py"
    store, ckpts = tmp_path / "store", tmp_path / "ckpts"
    killed = subprocess.run(
        [sys.executable, str(worker), "published", str(store), str(ckpts), "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stdout + killed.stderr
    with castore.open(store) as opened:
        generations = opened.generations(RUN)
        tags = opened.refs.tags(RUN)
    assert [g.step for g in generations] == [4, 8, 12]  # the epoch file and last: one each
    named = {"last.ckpt": generations[2], "epoch=2-step=12.ckpt": generations[2]}
    for name, published in named.items():
        pointer = json.loads((ckpts / name).read_text())
        assert (pointer["generation"], pointer["root"]) == (published.id, published.root), name
        assert tags[tag_name(Path(name))].root.hex == published.root, name
    # Resumed through Lightning's own path: from step 12, so the next saves are step 16's.
    _fit(4, tmp_path, ckpt_path="last", blocking=False)
    with castore.open(store) as opened:
        assert [g.step for g in opened.generations(RUN)][3:] == [16]


@pytest.mark.slow
def test_a_run_killed_after_a_publish_resumes_from_last_without_a_writer_warning(
    tmp_path: Path,
) -> None:
    """SIGKILL right after epoch 2's first save published, before any pointer names it:
    last.ckpt is a generation behind the run's newest, which the dead job published.
    The resume from last is no other writer's business: no ConcurrentWriterWarning,
    and it ends where an uninterrupted run ends, bit for bit."""
    import os
    import subprocess
    import sys

    import numpy as np

    worker = Path(__file__).resolve().parent / "helpers" / "lightning_workers.py"
    store, ckpts = tmp_path / "store", tmp_path / "ckpts"
    env = {**os.environ, "KILL_POINT": "save.after_ref_advance"}

    def run(kill_at: int, resume: bool) -> subprocess.CompletedProcess[str]:
        out = tmp_path / f"weights-{kill_at}-{int(resume)}.npz"
        args = [str(store), str(ckpts), "5", str(kill_at), str(int(resume)), str(out)]
        return subprocess.run(
            [sys.executable, str(worker), *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )

    killed = run(2, False)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    with castore.open(store) as opened:
        newest = opened.resolve(RUN)
    pointer = json.loads((ckpts / "last.ckpt").read_text())
    assert newest.id == pointer["generation"] + 1  # published, never pointed at
    resumed = run(-1, True)
    assert resumed.returncode == 0, resumed.stderr
    assert "ConcurrentWriterWarning" not in resumed.stderr, resumed.stderr
    got = np.load(tmp_path / "weights--1-1.npz")
    for name, value in _uninterrupted(5).state_dict().items():
        assert got[name].tobytes() == value.detach().numpy().tobytes(), name


def test_async_saves_go_through_castores_writer_and_publish_before_fit_returns(
    tmp_path: Path,
) -> None:
    with castore.open(tmp_path / "store") as store:
        L.seed_everything(0, verbose=False)
        io = CastoreCheckpointIO(store, blocking=False)
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, save_last=True)
        _trainer(3, [io], [checkpoints]).fit(Regressor(), _data())
        saves = len(store.generations(RUN))
        # Every save was an async one, and every one was published by teardown.
        # One save per epoch's end: last.ckpt followed the epoch file's save, starting none.
        assert store.background.counters["started"] == saves == 3
        assert store.background.counters["published"] == saves
        pointer = json.loads((tmp_path / "ckpts" / "last.ckpt").read_text())
        assert pointer["generation"] == saves


@pytest.mark.slow
def test_two_ddp_ranks_on_gloo_save_once_and_resume_bitwise(tmp_path: Path) -> None:
    """Lightning's ddp strategy on CPU: rank 0 saves each checkpoint (one generation),
    both ranks load it through the pointer on resume; 2 + 2 epochs end where 4 do."""
    import subprocess
    import sys

    import numpy as np

    worker = Path(__file__).resolve().parent / "helpers" / "lightning_workers.py"

    def run(name: str, epochs: int, resume: bool) -> Any:
        out = tmp_path / f"{name}.npz"
        args = [str(tmp_path / name), str(tmp_path / f"{name}-ckpts"), str(epochs), "-1"]
        done = subprocess.run(
            [sys.executable, str(worker), *args, str(int(resume)), str(out), "2"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return np.load(out)

    run("split", 2, False)
    with castore.open(tmp_path / "split") as store:
        first = store.generations(RUN)
    assert len(first) == 2  # one per epoch (its file and last): rank 0 alone saved
    resumed = run("split", 4, True)
    whole = run("whole", 4, False)
    for name in whole.files:
        assert resumed[name].tobytes() == whole[name].tobytes(), name


# -- steps reported to the store (CastoreStepReporter) -------------------------------


@pytest.mark.parametrize("reported", [True, False], ids=["reported", "broken-control"])
def test_each_optimizer_step_is_reported_and_a_tiered_store_sends_promotions_from_memory(
    tmp_path: Path, reported: bool
) -> None:
    """4 batches an epoch, 2 accumulated per optimizer step, 2 epochs: 4 optimizer steps
    reported, and each epoch's async save promoted from its staging buffers, not read
    back from the fast tier. The control, without the reporter, reads them back."""
    from castore.integrations.lightning import CastoreStepReporter
    from castore.tiers import open_tiered

    L.seed_everything(0, verbose=False)
    with open_tiered(
        tmp_path / "fast", tmp_path / "durable", durable_every=1, uploader="thread",
        promote_on_exit=False, chunk_size=1024,
    ) as store:  # fmt: skip
        io = CastoreCheckpointIO(store, blocking=False)
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1)
        callbacks = [checkpoints, *([CastoreStepReporter(io)] if reported else [])]
        trainer = _trainer(2, [io], callbacks)
        trainer.accumulate_grad_batches = 2
        trainer.fit(Regressor(), _data())
        assert trainer.global_step == 4
        promoted = store.wait_promotions()
        assert [(p.generation, p.error) for p in promoted] == [(1, None), (2, None)]
        read_back = sum(p.copied.chunks_copied for p in promoted if p.copied is not None)
        sends = store.staged_sends
        if not reported:
            assert sends == {} and read_back > 0
            return
        assert store._pacer is not None and store._pacer.steps == 3  # the first starts the clock
        assert sends["sent_chunks"] > 0 and read_back == 0, (sends, read_back)
    with castore.open(tmp_path / "durable") as durable:
        assert [g.id for g in durable.generations(RUN)] == [1, 2]
