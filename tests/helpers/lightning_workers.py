"""A Lightning training run for tests/test_lightning.py, as its own process (SIGKILL tests).

    python tests/helpers/lightning_workers.py STORE CKPT_DIR EPOCHS KILL_AT_EPOCH RESUME OUT [RANKS]

trains the tests' small regressor for EPOCHS epochs with castore as its CheckpointIO
and a checkpoint at every epoch's end (and ``last.ckpt``); with KILL_AT_EPOCH >= 0
the castore save at the end of that epoch is SIGKILLed before its ref advances
(castore's fault point); RESUME=1 starts from ``ckpt_path="last"``. At the end, the
weights go to OUT (``numpy.savez``, from rank 0). RANKS > 1 trains with Lightning's
``ddp`` strategy on CPU (gloo), which starts the other ranks by running this script again.

    python tests/helpers/lightning_workers.py published STORE CKPT_DIR EPOCH

trains with ``CastoreCheckpointIO(blocking=False)`` and, as epoch EPOCH starts, waits
for the async save in flight (the epoch before's file and ``last.ckpt``) to publish and
SIGKILLs the process: nothing on the training thread has touched the save since.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from castore.integrations.lightning import CastoreCheckpointIO
from castore.support import faults

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_lightning
from test_lightning import Regressor, _data  # noqa: E402


class KillAtEpoch(Callback):  # type: ignore[misc]
    """Arms the kill as epoch ``epoch`` ends: ModelCheckpoint (always the last callback)
    then saves, and the castore save dies before it publishes (``KILL_POINT`` in the
    environment: at that fault point instead, ``save.after_ref_advance``: once it has
    published, before Lightning writes any pointer to it)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch == self.epoch:
            faults.arm(os.environ.get("KILL_POINT", "save.before_ref_advance"), "kill")


class KillOncePublished(Callback):  # type: ignore[misc]
    """As epoch ``epoch`` starts: the save in flight published, then SIGKILL."""

    def __init__(self, epoch: int, io: CastoreCheckpointIO) -> None:
        self.epoch = epoch
        self.io = io

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch != self.epoch:
            return
        background = self.io.store.background
        assert background.counters["started"] == self.epoch  # one per epoch: its file and last
        if (pending := background.in_flight()) is not None:
            pending.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def published(store: str, ckpt_dir: str, epoch: str) -> int:
    L.seed_everything(0, verbose=False)
    io = CastoreCheckpointIO(store, blocking=False)
    callbacks = [
        KillOncePublished(int(epoch), io),
        ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, save_last=True),
    ]
    trainer = L.Trainer(
        max_epochs=int(epoch) + 1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        plugins=[io],
        callbacks=callbacks,
    )
    trainer.fit(Regressor(), _data())
    return 1  # not reached: killed as EPOCH starts


def main(argv: list[str]) -> int:
    if argv[0] == "published":
        return published(*argv[1:])
    store, ckpt_dir, epochs, kill_at, resume, out, *rest = argv
    ranks = int(rest[0]) if rest else 1
    L.seed_everything(0, verbose=False)
    model = Regressor()
    callbacks: list[Any] = [ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, save_last=True)]
    if int(kill_at) >= 0:
        callbacks.insert(0, KillAtEpoch(int(kill_at)))
    trainer = L.Trainer(
        max_epochs=int(epochs),
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        plugins=[CastoreCheckpointIO(store)],
        callbacks=callbacks,
        devices=ranks,
        strategy="ddp" if ranks > 1 else "auto",
    )
    trainer.fit(model, _data(), ckpt_path="last" if resume == "1" else None)
    if trainer.global_rank == 0:
        np.savez(out, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
