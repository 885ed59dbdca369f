"""An Accelerate training run for tests/test_accelerate.py, in process or as its own process.

    python tests/helpers/accelerate_workers.py STORE STAGING OUT [--reference FILE] [--probe]
                                       [--resume] [--kill-at STEP]

trains the tests' small regressor for :data:`EPOCHS` epochs on CPU, with castore's
:class:`~castore.integrations.accelerate.CastoreState` saving every :data:`SAVE_EVERY`
steps into STORE (staging in STAGING), and writes the final weights to OUT
(``numpy.savez``, from the main process).

``--reference FILE``: first train the same run from scratch without castore, its
final weights to FILE. ``--probe``: first call ``load()`` on the (empty) store and
record what each process raised (``OUT.probe-RANK.json``). ``--resume``: start from
the run's latest generation (``CastoreState.load``). ``--kill-at STEP``: the save at
STEP is SIGKILLed inside castore, before its ref advances (castore's fault point).

Launched by ``python -m torch.distributed.run --nproc_per_node=2``, every process
runs this script and Accelerate trains on MULTI_CPU (gloo). The tests import
:func:`prepare`, :func:`train` and :func:`weights` to run the same loop in process.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

from castore.integrations.accelerate import CastoreState
from castore.support import faults

EPOCHS = 3
SAVE_EVERY = 5
RUN = "accelerate"


@dataclass
class Training:
    accelerator: Any
    model: Any
    optimizer: Any
    loader: Any
    scheduler: Any


def prepare(dropout: bool = False, **accelerator_options: Any) -> Training:
    """The tests' regressor, AdamW, a StepLR and a shuffled loader, seeded and prepared.

    With ``dropout`` a resume is not bitwise equal to an uninterrupted run, through
    castore or through Accelerate's own ``save_state``/``load_state`` alike: a
    DataLoader's iterator draws its base seed from torch's global RNG when it starts,
    which a resumed run does after ``load_state`` restored that RNG (as it was at the
    save, mid-epoch) and an uninterrupted run did at the epoch's start; the dropout
    masks then come from different points of the stream. So the resume tests run
    without dropout.
    """
    set_seed(0)
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        **accelerator_options,
    )
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 16), torch.nn.ReLU()]
    if dropout:
        layers.append(torch.nn.Dropout(0.2))
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
    return Training(accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def train(
    run: Training,
    *,
    start: int = 0,
    stop: int | None = None,
    after_step: Callable[[int], None] = lambda step: None,
) -> int:
    """Train from step ``start`` (mid-epoch too) to the end of :data:`EPOCHS` epochs, or
    to step ``stop``; ``after_step(step)`` after every optimizer step. The last step."""
    step = start
    start_epoch, skip = divmod(start, len(run.loader))
    for epoch in range(start_epoch, EPOCHS):
        run.loader.set_epoch(epoch)
        loader = run.accelerator.skip_first_batches(run.loader, skip) if skip else run.loader
        skip = 0
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(run.model(xb), yb)
            run.accelerator.backward(loss)
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad()
            step += 1
            after_step(step)
            if step == stop:
                return step
    return step


def weights(run: Training) -> dict[str, np.ndarray]:
    """The model's weights, copied out of the (possibly DDP-wrapped) model."""
    model = run.accelerator.unwrap_model(run.model)
    return {name: value.detach().numpy().copy() for name, value in model.state_dict().items()}


def _probe(state: CastoreState, out: str) -> None:
    """Record what ``load()`` raises on this process (the store has no generation yet)."""
    try:
        state.load()
        found: dict[str, str] = {"raised": ""}
    except Exception as exc:  # noqa: BLE001 - the test asserts the type and message
        found = {"raised": type(exc).__name__, "message": str(exc)}
    with open(f"{out}.probe-{state.accelerator.process_index}.json", "w") as handle:
        json.dump(found, handle)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("staging")
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--reference")
    parser.add_argument("--async", dest="background", action="store_true")
    args = parser.parse_args(argv)
    if args.reference:
        reference = prepare()
        train(reference)
        if reference.accelerator.is_main_process:
            np.savez(args.reference, **weights(reference))
    run = prepare()
    state = CastoreState(
        run.accelerator,
        args.store,
        run=RUN,
        staging_dir=args.staging,
        blocking=not args.background,
    )
    if args.probe:
        _probe(state, args.out)
    start = state.load() if args.resume else 0

    def save(step: int) -> None:
        if step % SAVE_EVERY == 0:
            if step == args.kill_at:
                # Async, the save before may still be in flight: let it publish, so the
                # one killed (on the main process's storing thread) is this step's.
                state.finish()
                faults.arm("save.before_ref_advance", "kill")
            state.save(step)

    train(run, start=start, after_step=save)
    if run.accelerator.is_main_process:
        np.savez(args.out, **weights(run))
    state.close()
    run.accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
