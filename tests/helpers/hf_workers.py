"""Hugging Face Trainer runs for tests/test_huggingface.py, as their own processes.

    python tests/helpers/hf_workers.py kill STORE OUT BLOCKING STEP

trains the tests' tiny GPT-2 with a :class:`CastoreCallback` on STORE
(``blocking=BLOCKING``, 1 or 0) and SIGKILLs the process inside castore's save
of the checkpoint at STEP, before its ref advances (castore's fault point
``save.before_ref_advance``, reached on the training thread or, with
``blocking=False``, on the callback's own); it never returns.

    python tests/helpers/hf_workers.py crash STORE OUT REFUSE

trains with ``blocking=False`` and fails by an exception in the step after the
save at step 4, that save still in flight (REFUSE=1: one castore refuses).

    python tests/helpers/hf_workers.py published STORE OUT

trains with ``blocking=False`` where hard links fail (castore's async writer
stores each checkpoint) and, as the step after the save at step 4 begins, waits
for that save to publish and SIGKILLs the process.

    python tests/helpers/hf_workers.py restore STORE OUT GENERATION

restores RUN@GENERATION of STORE as OUT/checkpoint-STEP, as an earlier attempt
of a job would have, and exits.

    python tests/helpers/hf_workers.py ddp WORKDIR

is one rank of a 2-rank DDP run on gloo (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set by the test; the Trainer joins the group). It
trains with the callback on WORKDIR/store, a checkpoint every 2 steps; rank 0
removes the whole output directory (the node is lost); every rank restores the
checkpoint of step 4 from castore (``args.main_process_first()``: rank 0
writes it, rank 1 finds it there) and resumes from it. Rank 0 writes the final
weights of both runs to WORKDIR/whole.npz and WORKDIR/resumed.npz.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from transformers import TrainerCallback

from castore.integrations import huggingface
from castore.integrations.huggingface import CastoreCallback, restore_checkpoint
from castore.support import faults

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_huggingface
from test_huggingface import RUN, train, weights  # noqa: E402


class KillInsideSaveAt(TrainerCallback):  # type: ignore[misc]
    """Placed before the CastoreCallback (callbacks run in order): at ``step``'s save it
    arms the kill that castore's save of that checkpoint then reaches."""

    def __init__(self, step: int, castore_callback: CastoreCallback) -> None:
        self.step = step
        self.castore_callback = castore_callback

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step != self.step:
            return
        if self.castore_callback.blocking:
            faults.arm("save.before_ref_advance", "kill")
        else:
            # The previous checkpoint's save may still be in flight: let it publish,
            # so the one killed is this step's.
            self.castore_callback.finish()
            faults.arm("save.before_ref_advance", "kill")  # on the callback's thread


def kill(store: str, out: str, blocking: str, step: str) -> int:
    callback = CastoreCallback(store, run=RUN, blocking=blocking == "1")
    train(Path(out), [KillInsideSaveAt(int(step), callback), callback])
    return 1  # not reached: the save of STEP kills the process


def restore(store: str, out: str, generation: str) -> int:
    restore_checkpoint(store, out, run=RUN, generation=generation)
    return 0


def ddp(workdir: str) -> int:
    work = Path(workdir)
    store = work / "store"
    whole = train(work / "split", [CastoreCallback(store, run=RUN)], save_steps=2)
    if whole.args.process_index == 0:
        shutil.rmtree(work / "split")
    dist.barrier()
    with whole.args.main_process_first():
        path = restore_checkpoint(store, work / "resumed", run=RUN, generation="checkpoint-4")
    resumed = train(work / "resumed", [CastoreCallback(store, run=RUN)], path, save_steps=2)
    if whole.args.process_index == 0:
        np.savez(work / "whole.npz", **weights(whole))
        np.savez(work / "resumed.npz", **weights(resumed))
    dist.barrier()
    return 0


class CrashAfterSave(TrainerCallback):  # type: ignore[misc]
    """Training fails in the step after the save of ``step``: on_train_end never runs."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError("training failed")


def crash(store: str, out: str, refuse: str) -> int:
    """A blocking=False run that dies of an exception right after the save at step 4,
    its store still in flight: refuse=1 makes that store fail (a pickle the
    weights_only loader refuses in the optimizer's state)."""
    from test_huggingface import Note, noted_sgd

    callback = CastoreCallback(store, run=RUN, blocking=False)
    optimizer = noted_sgd(Note()) if refuse == "1" else None
    train(Path(out), [callback, CrashAfterSave(4)], optimizer=optimizer)
    return 1  # not reached: train raises


class KillOncePublished(TrainerCallback):  # type: ignore[misc]
    """As the step after ``step``'s save begins: that save published, then SIGKILL."""

    def __init__(self, step: int, castore_callback: CastoreCallback) -> None:
        self.step = step
        self.castore_callback = castore_callback

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step != self.step:
            return
        background = self.castore_callback.store.background
        assert background.counters["started"] == 1  # stored by castore's async writer
        if (pending := background.in_flight()) is not None:
            pending.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def published(store: str, out: str) -> int:
    def cross_device(source: Any, target: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(target))

    huggingface._hard_link = cross_device  # no hard links: castore's writer stores it
    callback = CastoreCallback(store, run=RUN, blocking=False)
    train(Path(out), [callback, KillOncePublished(4, callback)])
    return 1  # not reached: killed after the save at step 4


def main(argv: list[str]) -> int:
    mode, *args = argv
    modes = {"kill": kill, "restore": restore, "ddp": ddp, "crash": crash, "published": published}
    return modes[mode](*args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
