"""Hugging Face ``Trainer`` checkpoints as castore generations, through a ``TrainerCallback``.

The Trainer decides when to save (``save_strategy``, ``save_steps``) and
writes each checkpoint as ``OUTPUT_DIR/checkpoint-STEP``: safetensors weights,
the optimizer, scheduler, scaler and RNG states (``torch.save`` files), and
``trainer_state.json``. :class:`CastoreCallback` stores that directory, once
the Trainer has written it, as the next generation of one castore run,
deduplicated against every earlier save: a fine-tune with a frozen backbone
stores the backbone once, where the Trainer writes it again in every
``checkpoint-*`` directory. Each generation is tagged ``checkpoint-STEP``;
``save_total_limit`` keeps the tags of the newest checkpoints (and of the
best one), as the Trainer keeps their directories, and ``castore gc`` frees
what no kept generation names. At each optimizer step's end the world's
first process reports the step to the store (``Store.report_step``): a tiered
store paces its promotions by it (docs/TIERS.md).

The way back is the Trainer's own: :func:`restore_checkpoint` materialises a
stored generation (every byte verified) as the ``checkpoint-STEP``
directory the Trainer expects, and ``trainer.train(resume_from_checkpoint=path)``
resumes from it. Only a published generation is ever materialised: a save
killed half-way, by the Trainer or by castore, is never taken for a checkpoint.

The pickled files are read only with ``torch.load(weights_only=True)`` and the
safe globals the Trainer itself allows (numpy's RNG state); a file that loader
refuses stops the save with :class:`~castore.errors.ImportSourceError` naming
it (leave it out with ``skip=``). ``training_args.bin`` (a pickle of the
``TrainingArguments`` object, which the Trainer writes for reference and never
reads to resume) is not stored: its values are in the generation, as plain
values under ``training_args``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import castore
from castore import gc as castore_gc
from castore.core import fencing
from castore.core.background import PendingSave
from castore.errors import GenerationNotFoundError, ImportSourceError
from castore.format.hashing import Digest
from castore.integrations.checkpoint_dirs import (
    Background,
    holds_marked,
    read_checkpoint_dir,
    write_checkpoint_dir,
)
from castore.store import Store

TRAINING_ARGS_FILE = "training_args.bin"
# blocking=False: a checkpoint's files hard-linked aside, under OUTPUT_DIR, while stored.
_ASIDE = ".castore-storing-"
_hard_link = os.link  # the tests replace it to take the path without hard links
_STEP = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")


def trainer_safe_globals() -> list[Any]:
    """The globals the Trainer allows ``torch.load(weights_only=True)`` when it reads its
    RNG state (numpy's ``_reconstruct``, ``ndarray``, ``dtype``, ``UInt32DType``)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


class CastoreCallback(TrainerCallback):  # type: ignore[misc]
    """A ``TrainerCallback`` that stores every checkpoint the Trainer writes in a castore store.

    ``store``: a path or URL for :func:`castore.open` (opened on first use, in
    the process that saves) or an open :class:`~castore.Store`. ``run``: the run
    every checkpoint becomes a generation of. ``codec`` and ``open_options`` go
    to :func:`castore.open`.

    ``keep_local``: how many of the newest ``checkpoint-*`` directories to leave
    on local disk once castore holds them; ``None`` (the default) leaves them
    as the Trainer does, ``0`` removes each once stored (the store is then the
    only copy; :func:`restore_checkpoint` brings one back). The best
    checkpoint's directory (``load_best_model_at_end``) is always left.

    ``blocking=False``: the callback hard-links the directory's files aside
    (the Trainer's rotation may delete the directory meanwhile; the Trainer
    writes a new file, never into an old one) and training goes on while a
    thread of the callback reads, stores and publishes them; the callback
    waits for it at the next save and at the end of training. Where hard
    links are not possible, it reads the files on the training thread and
    castore's async writer stores them. Either way the thread that publishes
    the save tags it (and applies ``save_total_limit`` and ``keep_local``)
    right after, so a process that dies later, by an exception or a
    SIGKILL, leaves it published and kept.

    ``skip``: relative file names (``"scaler.pt"``) not to store.

    Multi-process training (DDP): every rank's RNG file is in the directory the
    Trainer writes, so the world's first process stores it, after a barrier;
    the output directory must be one all ranks write (one node, or a shared
    file system), as the Trainer itself assumes.
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        *,
        run: str = "hf-trainer",
        codec: str | None = None,
        blocking: bool = True,
        keep_local: int | None = None,
        skip: Iterable[str] = (),
        **open_options: Any,
    ) -> None:
        if keep_local is not None and keep_local < 0:
            raise ValueError(f"keep_local must be None or at least 0, got {keep_local!r}")
        self._given = store if isinstance(store, Store) else None
        self._address = store.path if isinstance(store, Store) else os.fspath(store)
        self._store: Store | None = self._given
        self.run = run
        self.blocking = blocking
        self.keep_local = keep_local
        self.skip = frozenset(skip) | {TRAINING_ARGS_FILE}
        self._open_options = {**open_options, **({"codec": codec} if codec else {})}
        self._pending: PendingSave | Background | None = None  # the async save in flight

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = castore.open(self._address, **self._open_options)
        return self._store

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _barrier()  # every rank has written its RNG file
        if not state.is_world_process_zero:
            return
        self.finish()
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            raise ImportSourceError(
                f"the Trainer's checkpoint {folder} is not there to store (a "
                "hyper-parameter search writes elsewhere: castore stores output_dir's)"
            )
        if args.world_size > 1 and not args.save_only_model:
            missing = [
                name
                for name in (f"rng_state_{i}.pth" for i in range(args.world_size))
                if not (folder / name).is_file()
            ]
            if missing:
                raise ImportSourceError(
                    f"{folder} lacks {', '.join(missing)}: the ranks that write them do not "
                    "see this output_dir (several nodes? castore stores a checkpoint every "
                    "rank wrote into one directory, on a file system every node shares)"
                )
        metadata = {"framework": "transformers.Trainer", "checkpoint": folder.name}
        arguments = json.loads(args.to_json_string())  # secrets masked, as the Trainer logs them
        step = int(state.global_step)
        store = self.store  # opened here, on the training thread
        if self.blocking:
            tree = self._read(folder, arguments)
            generation = store.save(tree, run=self.run, step=step, metadata=metadata)
            self._published(generation, folder, args, state)
            return
        # Tagged and pruned on the thread that publishes it: a process whose training
        # ends by an exception (no on_train_end), or is killed, leaves it published and kept.
        linked = _link_aside(folder)
        if linked is None:  # no hard links here: read now, castore's writer stores it
            self._pending = store.save(
                self._read(folder, arguments),
                run=self.run,
                step=step,
                metadata=metadata,
                blocking=False,
                on_publish=lambda generation: self._published(generation, folder, args, state),
            )
        else:
            self._pending = Background(
                lambda: self._store_linked(
                    linked, arguments, step, metadata, (folder, args, state)
                ),
                f"castore's store of {folder.name}",
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An optimizer step ended (the Trainer calls on_substep_end for the others): tell
        the store, on the process that stores (a plain store ignores it; a tiered one
        sends a promoted async save's chunks within a share of each step's time)."""
        if state.is_world_process_zero:
            self.store.report_step()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.finish()  # a save an earlier train() left in flight (it ended by an error)
            if Path(args.output_dir).is_dir():
                for stale in Path(args.output_dir).glob(f"{_ASIDE}*"):  # a killed run's
                    shutil.rmtree(stale, ignore_errors=True)

    def _read(self, folder: Path, arguments: dict[str, Any]) -> dict[str, Any]:
        """The directory as a state, with the ``TrainingArguments`` as plain values
        (``training_args.bin``, their pickle, is not stored)."""
        tree = read_checkpoint_dir(
            folder, safe_globals=trainer_safe_globals(), skip=self.skip.__contains__
        )
        tree["training_args"] = arguments
        return tree

    def _store_linked(
        self,
        linked: Path,
        arguments: dict[str, Any],
        step: int,
        metadata: dict[str, Any],
        then: tuple[Path, Any, Any],
    ) -> Any:
        try:
            tree = self._read(linked, arguments)
            generation = self.store.save(tree, run=self.run, step=step, metadata=metadata)
        finally:
            shutil.rmtree(linked, ignore_errors=True)
        self._published(generation, *then)
        return generation

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.finish()
            if self._store is not None and self._given is None:
                self._store.close()
                self._store = None

    def finish(self) -> None:
        """Wait for the async save in flight (tagged, and retention applied, once published)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()  # raises the writer's error, if it failed

    def _published(self, generation: Any, folder: Path, args: Any, state: Any) -> None:
        castore_gc.tag(self.store, self.run, generation.id, folder.name)
        best = Path(state.best_model_checkpoint).name if state.best_model_checkpoint else None
        if args.save_total_limit is not None and args.save_total_limit > 0:  # as the Trainer
            _keep_newest_tags(self.store, self.run, args.save_total_limit, best)
        if self.keep_local is not None:
            _prune_local(folder.parent, self.keep_local, best, stored_up_to=generation.step)


def _link_aside(folder: Path) -> Path | None:
    """``folder``'s files hard-linked into a new hidden directory beside it; None where
    the file system has no hard links."""
    aside = folder.with_name(f"{_ASIDE}{folder.name}-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    try:
        for path in folder.rglob("*"):
            target = aside / path.relative_to(folder)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                _hard_link(path, target)
    except OSError as exc:
        shutil.rmtree(aside, ignore_errors=True)
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise
    return aside


def _keep_newest_tags(store: Store, run: str, limit: int, best: str | None) -> None:
    """Untag the checkpoints the Trainer's rotation deletes: it keeps ``limit``
    directories in all, the newest and the best always among them."""
    steps = {
        name: int(found.group(1))
        for name in store.refs.tags(run)
        if (found := _STEP.fullmatch(name))
    }
    tagged = sorted(steps, key=steps.__getitem__)
    protected = {tagged[-1], best} & set(tagged) if tagged else set()
    remaining = len(tagged)
    for name in tagged:
        if remaining <= max(limit, len(protected)):
            break
        if name in protected:
            continue
        remaining -= 1
        try:
            castore_gc.untag(store, run, name)
        except GenerationNotFoundError:
            pass  # untagged meanwhile


def _prune_local(output_dir: Path, keep: int, best: str | None, stored_up_to: int) -> None:
    """Remove all but the newest ``keep`` checkpoint directories castore holds (those
    up to the step just published: a newer one may not be stored yet), and the best."""
    found = sorted(
        (int(m.group(1)), path)
        for path in output_dir.iterdir()
        if path.is_dir() and (m := _STEP.fullmatch(path.name)) and int(m.group(1)) <= stored_up_to
    )
    for _, path in found[: max(len(found) - keep, 0)]:
        if path.name != best:
            shutil.rmtree(path, ignore_errors=True)


def restore_checkpoint(
    store: str | os.PathLike[str] | Store,
    output_dir: str | os.PathLike[str],
    *,
    run: str = "hf-trainer",
    generation: int | str = "latest",
) -> str:
    """Materialise ``run@generation`` as ``OUTPUT_DIR/checkpoint-STEP``; its path, for
    ``trainer.train(resume_from_checkpoint=...)``.

    Every byte is verified before anything is written; the directory appears
    whole (written beside it, then renamed), replacing one of the same name (a
    checkpoint the Trainer had begun to write when it was killed). A directory
    already materialised from the same generation, and holding still the files
    its marker lists as they were written (:func:`holds_marked`), is left as
    it is, so every rank may call this (``with args.main_process_first():
    ...``); one changed, truncated or missing a file since is restored again.
    """
    opened = store if isinstance(store, Store) else castore.open(store)
    try:
        newest = fencing.newest_published(opened.refs, run)  # before resolving: see fencing
        found = opened.resolve(run, generation)
        name = found.metadata.get("checkpoint") or f"{PREFIX_CHECKPOINT_DIR}-{found.step}"
        if not isinstance(name, str) or not _STEP.fullmatch(name):
            name = f"{PREFIX_CHECKPOINT_DIR}-{found.step}"
        destination = Path(output_dir) / name
        marker = {"store": str(opened.path), "run": run, "generation": found.id, "root": found.root}
        if holds_marked(destination, marker):
            # Left as it is, yet a resume all the same, as the load below records: this
            # process's saves continue the run from here (a lower step than the run's
            # latest is not taken for another job's: castore.core.fencing).
            root = Digest.from_hex(found.root)
            fencing.record_loaded(
                opened.refs, run, root, found.step, generation=found.id, newest=newest
            )
            return str(destination)
        tree = opened.load(run, found.root, framework="auto")
        write_checkpoint_dir(tree, destination, marker=marker)
        return str(destination)
    finally:
        if opened is not store:
            opened.close()


def _barrier() -> None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
