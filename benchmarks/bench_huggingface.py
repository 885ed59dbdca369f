"""Hugging Face Trainer's and Accelerate's checkpointing against castore's: bytes written,
time held per save.

Run from the repository root (needs the ``huggingface`` extra: transformers, accelerate)::

    .venv/bin/python benchmarks/bench_huggingface.py [--saves 10] [--every 5] [--layers 12]
                                                     [--no-codec-run] [--workdir DIR]
                                                     [--repeats 2] [--json OUT] [--quick]

A fine-tuning run with a frozen backbone on CPU (issue 28: dedup where
frameworks write full copies). The model is a ``GPT2LMHeadModel`` from a
``GPT2Config`` shaped like GPT-2 small scaled down (12 blocks of width 128, 4
heads, vocabulary 8192, 64 positions, dropout 0; the head tied to the token
embedding: 3.44 M fp32 parameters, 13.75 MB), every parameter frozen
(``requires_grad_(False)``) except the last block's; AdamW on those, so only
the last block's weights and its two moments change between saves. The data
is synthetic (random token ids, fixed seed); every run is seeded the same.

Trainer: ``TrainingArguments(max_steps=saves * every, save_strategy="steps",
save_steps=every, save_total_limit=None, use_cpu=True, logging_strategy="no",
report_to="none")``: every ``checkpoint-*`` directory is kept, as a user
keeping history would. The runs:

  trainer         the Trainer alone (its ``checkpoint-*`` directories)
  castore         ``+ CastoreCallback(store, keep_local=0)``: each directory stored as a
                  generation once the Trainer has written it, then deleted
  castore-async   the same with ``blocking=False`` (the directory hard-linked aside and
                  stored on the callback's thread while training goes on; waited for
                  at the next save and at the end)
  castore-auto    the same as castore with ``codec="auto"`` (compression on)

The castore callback does not replace the Trainer's write, it follows it: the
Trainer still writes the whole directory, castore then reads it (the
safetensors memory-mapped, the ``torch.save`` files loaded) and stores what is
new, and ``keep_local=0`` deletes it. So a castore save holds training for the
Trainer's write *plus* the callback, and the time ratio is above 1 by
construction; what castore saves is disk. The time a save holds training runs
from the ``on_step_end`` of a save step (a timing callback placed before
castore's; the Trainer's ``DefaultFlowCallback`` has set ``should_save``) to
the end of ``on_save`` (a timing callback placed after castore's): the
Trainer's ``_save_checkpoint`` and every callback's ``on_save``. Its two parts,
split at the first timing callback's ``on_save``, are reported too. The
async run's wait for its last save happens in ``on_train_end`` (timed the
same way) and is reported apart.

Accelerate: the same model in a plain loop (``Accelerator(cpu=True)``,
AdamW and a ``LinearLR`` schedule prepared), saving every ``every`` steps:

  accelerate      ``accelerator.save_state(DIR/step-N)``, every directory kept
  castore         ``CastoreState(accelerator, store).save(step)`` (Accelerate writes a
                  staging directory, castore stores it and deletes it)
  castore-async   the same with ``blocking=False`` (stored and deleted on a thread while
                  training goes on; waited for at the next save and at the end)
  castore-auto    the same with ``codec="auto"``

each from a fresh ``Accelerator`` and the same seed, timed with
``perf_counter`` around each call; castore's time is split the same way
(Accelerate's ``save_state`` into staging, then castore).

Every run goes ``--repeats`` rounds (default 2; the odd rounds run the
configurations in reverse order, so warm-up and bursts of load from other
processes fall on each side in turn); a time is the median over every round's
saves after its first, a first save's time the median of the rounds'. The
machine's load average is printed with the environment: on a shared machine
the times move between invocations, the bytes do not.

castore's store is opened lazily inside the first save, so that open is part
of the first save's time. Bytes per save are each checkpoint directory's size
for the frameworks and ``Generation.stats.written_bytes`` for castore (new
chunk bytes and manifests as stored). Totals are ``tree_bytes`` of the
frameworks' output directories, or of the store plus whatever the castore
runs left in theirs, after ``os.sync()``: apparent (sum of file sizes) and
allocated (``st_blocks * 512``, as ``du``). Ratios are castore over the
framework alone from the same invocation.

Note: the Trainer and Accelerate write without ``fsync``; castore's saves are
durable (fsynced) when they return. Afterwards each castore run's last
generation is materialised (``restore_checkpoint``; ``CastoreState.load`` into a
freshly initialised model) and compared with the framework run's last
checkpoint: safetensors and JSON byte for byte, ``torch.save`` files and the
loaded states bitwise (``training_args.bin``, which castore keeps as metadata,
aside). The benchmark fails if they differ.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accelerate  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from _common import add_ratios, mb, median_later, same_state, tree_bytes  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import castore  # noqa: E402
from castore.integrations.accelerate import CastoreState  # noqa: E402
from castore.integrations.huggingface import (  # noqa: E402
    TRAINING_ARGS_FILE,
    CastoreCallback,
    restore_checkpoint,
)

VOCAB, WIDTH, HEADS, LAYERS, POSITIONS = 8192, 128, 4, 12, 64
SEQ, BATCH, LR = 64, 8, 1e-3
RUN_TRAINER, RUN_ACCELERATE = "hf-trainer", "accelerate"
PICKLES = (".pt", ".pth", ".bin", ".pkl")


def build_model(layers: int, seed: int = 0) -> Any:
    """GPT-2 with every parameter frozen but the last block's."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=POSITIONS,
        n_embd=WIDTH,
        n_layer=layers,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    model.requires_grad_(False)
    model.transformer.h[-1].requires_grad_(True)
    return model


def _tokens(steps: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (steps * BATCH, SEQ), generator=generator)


class SyntheticTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, steps: int) -> None:
        self.tokens = _tokens(steps)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


# ---- the Trainer ----


class SaveClock:
    """Times each save from ``on_step_end`` to the end of ``on_save``, split at the point
    the Trainer's own write is done (the first timing callback's ``on_save``)."""

    def __init__(self) -> None:
        self.held_s: list[float] = []
        self.framework_s: list[float] = []
        self.castore_s: list[float] = []
        self.end_wait_s = 0.0
        self._began = self._written = self._ending = 0.0

    def callbacks(self, *inner: Any) -> list[Any]:
        """``inner`` between this clock's first and last timing callbacks."""
        return [_ClockFirst(self), *inner, _ClockLast(self)]


class _ClockFirst(TrainerCallback):  # type: ignore[misc]
    def __init__(self, clock: SaveClock) -> None:
        self.clock = clock

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save:
            self.clock._began = time.perf_counter()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock._written = time.perf_counter()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock._ending = time.perf_counter()


class _ClockLast(TrainerCallback):  # type: ignore[misc]
    def __init__(self, clock: SaveClock) -> None:
        self.clock = clock

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        clock, now = self.clock, time.perf_counter()
        clock.held_s.append(now - clock._began)
        clock.framework_s.append(clock._written - clock._began)
        clock.castore_s.append(now - clock._written)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.end_wait_s = time.perf_counter() - self.clock._ending


def _train(output: Path, saves: int, every: int, layers: int, inner: list[Any]) -> Any:
    model = build_model(layers)
    args = TrainingArguments(
        output_dir=str(output),
        max_steps=saves * every,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        save_strategy="steps",
        save_steps=every,
        save_total_limit=None,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    clock = SaveClock()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=SyntheticTokens(saves * every),
        callbacks=clock.callbacks(*inner),
    )
    trainer.remove_callback(PrinterCallback)  # it prints the end-of-training metrics
    start = time.perf_counter()
    trainer.train()
    return clock, time.perf_counter() - start


def _checkpoints(output: Path) -> list[Path]:
    found = [p for p in output.glob("checkpoint-*") if p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.rsplit("-", 1)[1]))


def run_trainer(work: Path, saves: int, every: int, layers: int) -> dict[str, Any]:
    output = work / "trainer-out"
    clock, fit_s = _train(output, saves, every, layers, [])
    os.sync()
    per_save = [tree_bytes(p)[0] for p in _checkpoints(output)]
    apparent, allocated = tree_bytes(output)
    return _result("trainer", clock, per_save, apparent, allocated, fit_s)


def run_trainer_castore(
    work: Path, name: str, saves: int, every: int, layers: int, **options: Any
) -> dict[str, Any]:
    store, output = work / f"{name}-store", work / f"{name}-out"
    callback = CastoreCallback(store, run=RUN_TRAINER, keep_local=0, **options)
    clock, fit_s = _train(output, saves, every, layers, [callback])
    os.sync()
    return _castore_result(name, clock, store, output, RUN_TRAINER, fit_s)


# ---- Accelerate ----


def _prepared(layers: int, total_steps: int, seed: int) -> tuple[Accelerator, Any, Any, Any]:
    model = build_model(layers, seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=total_steps)
    accelerator = Accelerator(cpu=True)
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    return accelerator, model, optimizer, schedule


def _loop(
    saves: int, every: int, layers: int, saver: Callable[[Accelerator], Callable[[int], None]]
) -> tuple[float, dict[str, Any]]:
    """Train ``saves * every`` steps, calling ``saver(accelerator)(step)`` every ``every``;
    the loop's wall time and the final model and optimizer states."""
    accelerator, model, optimizer, schedule = _prepared(layers, saves * every, seed=0)
    save = saver(accelerator)
    model.train()
    start = time.perf_counter()
    for step, batch in enumerate(_tokens(saves * every).split(BATCH), start=1):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % every == 0:
            save(step)
    fit_s = time.perf_counter() - start
    return fit_s, _snapshot(model, optimizer, schedule)


def _snapshot(model: Any, optimizer: Any, schedule: Any) -> dict[str, Any]:
    import copy

    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr": schedule.state_dict(),
        }
    )


def _timed_save_state(accelerator: Accelerator, into: list[float]) -> None:
    """Time ``accelerator.save_state`` (an instance attribute shadows the method)."""
    save_state = accelerator.save_state

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return save_state(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    accelerator.save_state = timed  # type: ignore[method-assign]


def run_accelerate(work: Path, saves: int, every: int, layers: int) -> Any:
    root = work / "accelerate-states"
    clock = SaveClock()

    def saver(accelerator: Accelerator) -> Callable[[int], None]:
        def save(step: int) -> None:
            start = time.perf_counter()
            accelerator.save_state(str(root / f"step-{step}"))
            clock.held_s.append(time.perf_counter() - start)
            clock.framework_s.append(clock.held_s[-1])
            clock.castore_s.append(0.0)

        return save

    fit_s, final = _loop(saves, every, layers, saver)
    os.sync()
    dirs = sorted(root.iterdir(), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    per_save = [tree_bytes(p)[0] for p in dirs]
    apparent, allocated = tree_bytes(root)
    return _result("accelerate", clock, per_save, apparent, allocated, fit_s), final


def run_accelerate_castore(
    work: Path, name: str, saves: int, every: int, layers: int, **options: Any
) -> Any:
    store, staging = work / f"{name}-store", work / f"{name}-staging"
    clock = SaveClock()
    states: list[CastoreState] = []

    def saver(accelerator: Accelerator) -> Callable[[int], None]:
        state = CastoreState(accelerator, store, run=RUN_ACCELERATE, staging_dir=staging, **options)
        states.append(state)
        _timed_save_state(accelerator, clock.framework_s)

        def save(step: int) -> None:
            start = time.perf_counter()
            state.save(step)
            clock.held_s.append(time.perf_counter() - start)
            clock.castore_s.append(clock.held_s[-1] - clock.framework_s[-1])

        return save

    try:
        fit_s, final = _loop(saves, every, layers, saver)
        start = time.perf_counter()
        states[-1].finish()  # blocking=False: the last save, still in flight
        clock.end_wait_s = time.perf_counter() - start
    finally:
        for state in states:
            state.close()
    os.sync()
    return _castore_result(name, clock, store, staging, RUN_ACCELERATE, fit_s), final


# ---- rounds: every run once, checked ----


def trainer_round(
    work: Path, saves: int, every: int, layers: int, codec_runs: list[str], reverse: bool
) -> dict[str, dict[str, Any]]:
    shape = (saves, every, layers)
    runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("trainer", partial(run_trainer, work, *shape)),
        ("castore", partial(run_trainer_castore, work, "castore", *shape)),
        (
            "castore-async",
            partial(run_trainer_castore, work, "castore-async", *shape, blocking=False),
        ),
    ]
    runs += [
        (name, partial(run_trainer_castore, work, name, *shape, codec="auto"))
        for name in codec_runs
    ]
    results = {name: run() for name, run in (runs[::-1] if reverse else runs)}
    check_trainer(work, [name for name, _ in runs[1:]])
    return {name: results[name] for name, _ in runs}


def accelerate_round(
    work: Path, saves: int, every: int, layers: int, codec_runs: list[str], reverse: bool
) -> dict[str, dict[str, Any]]:
    work, shape = work / "accelerate", (saves, every, layers)
    runs: list[tuple[str, Callable[[], Any]]] = [
        ("accelerate", partial(run_accelerate, work, *shape)),
        ("castore", partial(run_accelerate_castore, work, "castore", *shape)),
        (
            "castore-async",
            partial(run_accelerate_castore, work, "castore-async", *shape, blocking=False),
        ),
    ]
    runs += [
        (name, partial(run_accelerate_castore, work, name, *shape, codec="auto"))
        for name in codec_runs
    ]
    done = {name: run() for name, run in (runs[::-1] if reverse else runs)}
    final = done["accelerate"][1]
    for name, (_, castore_final) in done.items():
        if not same_state(final, castore_final):
            raise RuntimeError(f"accelerate {name}: training diverged from the plain run")
    check_accelerate(work, [name for name, _ in runs[1:]], final, layers, saves * every)
    return {name: done[name][0] for name, _ in runs}


# ---- results ----


def _result(
    name: str, clock: SaveClock, per_save: list[int], apparent: int, allocated: int, fit_s: float
) -> dict[str, Any]:
    times = clock.held_s
    if len(times) != len(per_save):
        raise RuntimeError(f"{name}: {len(times)} timed saves but {len(per_save)} checkpoints")
    return {
        "name": name,
        "saves": len(times),
        "fit_s": fit_s,
        "save_s": times,
        "framework_save_s": clock.framework_s,
        "castore_save_s": clock.castore_s,
        "end_wait_s": clock.end_wait_s,
        "first_save_s": times[0],
        "median_later_save_s": median_later(times),
        "median_later_framework_s": median_later(clock.framework_s),
        "median_later_castore_s": median_later(clock.castore_s),
        "bytes_per_save": per_save,
        "first_save_bytes": per_save[0],
        "median_later_save_bytes": median_later([float(b) for b in per_save]),
        "total_apparent": apparent,
        "total_allocated": allocated,
    }


def _merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's rounds as one result: the bytes of the first round (every round writes
    the same), times pooled (medians of every round's saves after its first)."""
    merged = dict(rounds[0])
    for key in ("save_s", "framework_save_s", "castore_save_s"):
        merged[f"{key}_by_round"] = [r[key] for r in rounds]
        merged[key] = [t for r in rounds for t in r[key][1:]]
    merged["median_later_save_s"] = statistics.median(merged["save_s"])
    merged["median_later_framework_s"] = statistics.median(merged["framework_save_s"])
    merged["median_later_castore_s"] = statistics.median(merged["castore_save_s"])
    for key in ("first_save_s", "end_wait_s", "fit_s"):
        merged[key] = statistics.median(r[key] for r in rounds)
    merged["rounds"] = len(rounds)
    return merged


def _castore_result(
    name: str, clock: SaveClock, store: Path, local: Path, run: str, fit_s: float
) -> dict[str, Any]:
    with castore.open(store) as opened:
        generations = opened.generations(run)
    per_save = [g.stats.written_bytes for g in generations]
    store_bytes = tree_bytes(store)
    local_bytes = tree_bytes(local) if local.exists() else (0, 0)
    apparent, allocated = (s + p for s, p in zip(store_bytes, local_bytes, strict=True))
    result = _result(name, clock, per_save, apparent, allocated, fit_s)
    result["store_bytes"] = {"apparent": store_bytes[0], "allocated": store_bytes[1]}
    result["left_local_bytes"] = {"apparent": local_bytes[0], "allocated": local_bytes[1]}
    result["logical_bytes_per_save"] = generations[-1].stats.logical_bytes
    result["castore_held_s_per_save"] = [g.stats.held_seconds for g in generations]
    return result


# ---- checks: the last checkpoint comes back as the framework wrote it ----


def _files(directory: Path) -> dict[str, Path]:
    return {
        p.relative_to(directory).as_posix(): p
        for p in directory.rglob("*")
        if p.is_file() and not p.name.startswith(".") and p.name != TRAINING_ARGS_FILE
    }


def _same_checkpoint(reference: Path, restored: Path) -> str | None:
    """None when ``restored`` holds ``reference``'s files; else the first difference."""
    expected, got = _files(reference), _files(restored)
    if expected.keys() != got.keys():
        return f"files {sorted(expected)} != {sorted(got)}"
    for name, path in expected.items():
        if path.suffix in PICKLES:
            same = same_state(
                torch.load(path, weights_only=False), torch.load(got[name], weights_only=False)
            )
        else:
            same = path.read_bytes() == got[name].read_bytes()
        if not same:
            return f"{name} differs"
    return None


def check_trainer(work: Path, names: list[str]) -> None:
    reference = _checkpoints(work / "trainer-out")[-1]
    for name in names:
        path = restore_checkpoint(
            work / f"{name}-store", work / f"{name}-restored", run=RUN_TRAINER
        )
        if Path(path).name != reference.name:
            raise RuntimeError(
                f"{name}: restored {Path(path).name}, the Trainer's last is {reference.name}"
            )
        difference = _same_checkpoint(reference, Path(path))
        if difference:
            raise RuntimeError(f"{name}: last checkpoint's {difference} from the Trainer's")


def check_accelerate(
    work: Path, names: list[str], final: dict[str, Any], layers: int, steps: int
) -> None:
    for name in names:
        accelerator, model, optimizer, schedule = _prepared(layers, steps, seed=1)
        state = CastoreState(
            accelerator,
            work / f"{name}-store",
            run=RUN_ACCELERATE,
            staging_dir=work / f"{name}-load",
        )
        try:
            step = state.load()
        finally:
            state.close()
        if step != steps or not same_state(final, _snapshot(model, optimizer, schedule)):
            raise RuntimeError(
                f"{name}: the state loaded from the last save differs from Accelerate's"
            )


# ---- output ----


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def print_table(results: list[dict[str, Any]], framework: str) -> None:
    base = results[0]
    print(
        "| run | saves | total on disk (allocated) | total (apparent) | first save bytes "
        "| later save bytes (median) | first save time | later save time (median) "
        f"| of which {framework} + castore (medians) | end-of-training wait "
        "| bytes ratio | save time ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ratio_b = r["total_allocated"] / base["total_allocated"]
        ratio_t = r["median_later_save_s"] / base["median_later_save_s"]
        castore_part = "" if r is base else f" + {_ms(r['median_later_castore_s'])}"
        end_wait = _ms(r["end_wait_s"]) if r is not base and r["end_wait_s"] else "-"
        print(
            f"| {r['name']} | {r['saves']} | {mb(r['total_allocated'])} "
            f"| {mb(r['total_apparent'])} | {mb(r['first_save_bytes'])} "
            f"| {mb(r['median_later_save_bytes'])} | {_ms(r['first_save_s'])} "
            f"| {_ms(r['median_later_save_s'])} "
            f"| {_ms(r['median_later_framework_s'])}{castore_part} | {end_wait} "
            f"| {ratio_b:.3f} | {ratio_t:.2f} |"
        )
    left = [f"{r['name']} {r['left_local_bytes']['allocated']} B" for r in results[1:]]
    print(f"\nleft on local disk by the castore runs besides the store: {', '.join(left)}")


def _quiet() -> None:
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=10, help="checkpoints per run (default 10)")
    parser.add_argument("--every", type=int, default=5, help="train steps between saves (5)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="GPT-2 blocks (12)")
    parser.add_argument("--no-codec-run", action="store_true", help="skip castore codec=auto")
    parser.add_argument("--workdir", type=Path, default=None, help="where the scratch dir goes")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument(
        "--repeats", type=int, default=2, help="rounds of every run, medians pooled (2)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="3 saves every 2 steps, 2 blocks, 1 round"
    )
    args = parser.parse_args()
    if args.quick:
        args.saves, args.every, args.layers, args.repeats = 3, 2, 2, 1
    if args.saves < 2 or min(args.every, args.layers, args.repeats) < 1:
        parser.error("--saves must be at least 2, --every, --layers and --repeats at least 1")
    _quiet()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    saves, every, layers = args.saves, args.every, args.layers
    codec_runs = [] if args.no_codec_run else ["castore-auto"]
    work = Path(tempfile.mkdtemp(prefix="castore-bench-hf-", dir=args.workdir))
    start, load = time.perf_counter(), os.getloadavg()
    trainer_rounds, acc_rounds = [], []
    try:
        for index in range(args.repeats):
            # Odd rounds run the configurations in reverse: warm-up and bursts of load
            # from other processes fall on each side in turn.
            reverse = index % 2 == 1
            here = work / f"round-{index}"
            trainer_rounds.append(trainer_round(here, saves, every, layers, codec_runs, reverse))
            acc_rounds.append(accelerate_round(here, saves, every, layers, codec_runs, reverse))
            shutil.rmtree(here, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    trainer = [_merge([r[name] for r in trainer_rounds]) for name in trainer_rounds[0]]
    acc = [_merge([r[name] for r in acc_rounds]) for name in acc_rounds[0]]
    elapsed = time.perf_counter() - start

    model = build_model(layers)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"GPT2LMHeadModel ({layers} blocks, width {WIDTH}, vocabulary {VOCAB}): "
        f"{params / 1e6:.2f} M fp32 parameters ({mb(params * 4)}), all frozen but the last "
        f"block ({trainable / 1e6:.2f} M); {saves} saves every {every} steps; "
        f"{args.repeats} round(s) of each run, medians of the later saves of all rounds"
    )
    print(
        f"environment: Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
        f"castore {getattr(castore, '__version__', '?')}, {os.cpu_count()} CPUs, "
        f"{platform.machine()} {platform.system()}; load average {load[0]:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end"
    )
    print("\nTrainer (ratios against the Trainer alone):\n")
    print_table(trainer, "Trainer")
    print("\nAccelerate (ratios against save_state alone):\n")
    print_table(acc, "save_state")
    print(f"\nlast checkpoints equal bitwise; ran {elapsed:.1f} s")
    if args.json:
        payload = {
            "benchmark": "bench_huggingface",
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": {
                "layers": layers,
                "width": WIDTH,
                "vocab": VOCAB,
                "parameters": params,
                "trainable": trainable,
            },
            "platform": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "accelerate": accelerate.__version__,
                "castore": getattr(castore, "__version__", "?"),
                "cpus": os.cpu_count(),
            },
            "elapsed_s": elapsed,
            "trainer": add_ratios(trainer),
            "accelerate": add_ratios(acc),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
