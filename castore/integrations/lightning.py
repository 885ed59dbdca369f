"""Lightning's checkpoints as castore generations: ``Trainer(plugins=[CastoreCheckpointIO(...)])``.

Lightning decides when to save and which checkpoints to keep (``ModelCheckpoint``:
``save_top_k``, ``save_last``, ``every_n_*``) and names each by a file path;
this plugin stores the checkpoint dict as a generation of one run of a
castore store, deduplicated against every earlier one, and leaves at the path
a small **pointer file** (JSON, no pickle) naming the generation. So every
path Lightning knows still exists as a file: ``ckpt_path="last"``, a path to
a given checkpoint, ``ModelCheckpoint``'s own bookkeeping and a restart that
finds the files all work unchanged, and loading a pointer reads the
generation (every byte verified) instead of a ``.ckpt`` file.

One checkpoint event is one generation. Lightning saves the same state twice
when an epoch's end writes both a top-k file and ``last.ckpt`` (``save_last``);
the second save, finding the state unchanged since the first (same tensors at
the same version counters, same values, only ``ModelCheckpoint``'s
``last_model_path`` moved), publishes nothing new: its file points at the
first's generation, as ``save_last="link"`` links the file in Lightning. So
``last.ckpt`` holds the checkpoint dict of the top-k save, whose
``last_model_path`` is the one before (empty after the first epoch).

Each pointer's generation is tagged by the file's name, so retention keeps
it; ``remove_checkpoint`` (``save_top_k`` dropping one) deletes the pointer
and the tag, never a chunk: ``castore gc`` frees what no kept generation
names. A checkpoint value castore cannot store without pickle (an
``argparse.Namespace`` in ``hyper_parameters``, an object in a callback's
state) raises :class:`~castore.errors.UnsupportedValueError` naming its key
path before anything is written: convert it to plain values (a dict) first.

A ``CheckpointIO`` sees saves and loads, not training steps: the callback
:class:`CastoreStepReporter` tells the plugin's store when each optimizer step
ends (``Store.report_step``), so that a tiered store paces its promotions by
the steps (docs/TIERS.md, "Promotion paced by training steps").
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback

import castore
from castore import gc as castore_gc
from castore.core.background import PendingSave
from castore.core.history import Generation
from castore.errors import GenerationNotFoundError, NotAPointerError
from castore.store import Store
from castore.support.safefs import fsync_dir, write_all

POINTER_FORMAT = "castore-lightning-pointer"
_MAX_POINTER = 1 << 16
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_ROOT = re.compile(r"[0-9a-f]{64}")
# Tensors up to this size are compared by their bytes, larger ones by where they lie
# and their version counter (see _marks).
_SMALL_TENSOR = 64 << 10
# ModelCheckpoint sets it between the top-k save and last.ckpt's, "before saving
# because it will be part of the state": the one value a checkpoint event's saves differ in.
_MOVED_BETWEEN_NAMES = "last_model_path"


class CastoreCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that stores checkpoints in a castore store.

    ``store``: a path or URL for :func:`castore.open` (opened on first use, in
    the process that saves or loads) or an open :class:`~castore.Store`.
    ``run``: the run every checkpoint becomes a generation of. ``codec`` and
    ``open_options`` go to :func:`castore.open`.

    ``blocking=False``: each save returns once castore has snapshotted the
    checkpoint (``Store.save(..., blocking=False)``), and is written and
    published on castore's writer thread while training runs on. That thread
    tags the generation and writes its pointer file (atomically: a rename)
    right after it publishes, so a process killed any time later resumes from
    it; the plugin waits for the save at the next save, load, removal or
    teardown, and raises its error there. A save that never publishes (the
    process killed) leaves no pointer: ``last.ckpt`` still names the one before.
    A second name for the same state (``last.ckpt`` after the top-k file) starts
    no save: it follows the first save's publish, on that thread if it is still
    in flight.
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        *,
        run: str = "lightning",
        codec: str | None = None,
        blocking: bool = True,
        **open_options: Any,
    ) -> None:
        super().__init__()
        self._given = store if isinstance(store, Store) else None
        self._address = store.path if isinstance(store, Store) else os.fspath(store)
        self._store: Store | None = self._given
        self.run = run
        self.blocking = blocking
        self._open_options = {**open_options, **({"codec": codec} if codec else {})}
        self._pending: PendingSave | None = None  # the async save in flight
        self._event: _Event | None = None  # the last save, and the files that name it

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = castore.open(self._address, **self._open_options)
        return self._store

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Save ``checkpoint`` as the next generation; tag it and point ``path`` at it.

        A checkpoint whose state is the last save's (a checkpoint event's second
        file) names that save's generation instead (see the module text)."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} takes no storage_options: the store's settings "
                "are castore.open's (codec=, ...)"
            )
        target, marks = Path(path), _marks(checkpoint)
        if marks is not None and self._event is not None and self._event.marks == marks:
            if self._pending is not None and self._pending.done():
                self.finish()  # its error now, if it failed (and this saves nothing)
            self._event.name(target)
            return
        self.finish()
        self._event = event = _Event(marks, self._point)
        event.name(target)
        step = int(checkpoint.get("global_step", 0))
        try:
            if not self.blocking:
                self._pending = self.store.save(
                    checkpoint, run=self.run, step=step, blocking=False, on_publish=event.published
                )
                return
            self.store.save(checkpoint, run=self.run, step=step, on_publish=event.published)
        except BaseException:
            self._event = None
            raise

    def report_step(self, *, opening: bool = True) -> None:
        """An optimizer step ended: :meth:`Store.report_step` on the store (a tiered store
        paces its promotions by it; another store ignores it). ``opening=False``: only
        if the store is open already (a process that never saves opens none)."""
        if self._store is not None or opening:
            self.store.report_step()

    def finish(self) -> None:
        """Wait for the async save in flight (tagged, its pointers written, once published);
        raise its error, if it failed."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except BaseException:
            self._event = None  # a later save of the same state saves again
            raise

    def _point(self, generation: Generation, target: Path) -> None:
        castore_gc.tag(self.store, self.run, generation.id, tag_name(target))
        target.parent.mkdir(parents=True, exist_ok=True)
        pointer = {
            "format": POINTER_FORMAT,
            "version": 1,
            "store": str(self._address),
            "run": self.run,
            "generation": generation.id,
            "root": generation.root,
        }
        _write_atomically(target, (json.dumps(pointer, indent=2) + "\n").encode())

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint ``path``'s pointer names, as Lightning's dict of torch tensors."""
        self.finish()
        self._event = None  # what follows a load is a new start
        pointer = read_pointer(Path(path))
        loaded: dict[str, Any] = self.store.load(pointer["run"], pointer["root"], framework="torch")
        device = _device(map_location)
        if device is not None and device.type != "cpu":
            loaded = _to_device(loaded, device)
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        """Delete ``path``'s pointer and the tag that kept its generation (never a chunk)."""
        self.finish()
        target = Path(path)
        if not target.exists():
            return
        pointer = read_pointer(target)
        try:
            castore_gc.untag(self.store, pointer["run"], tag_name(target))
        except GenerationNotFoundError:
            pass  # untagged already
        target.unlink()

    def teardown(self) -> None:
        self.finish()
        self._event = None
        if self._store is not None and self._given is None:
            self._store.close()
            self._store = None


class CastoreStepReporter(Callback):  # type: ignore[misc]
    """Reports each optimizer step to a :class:`CastoreCheckpointIO`'s store.

    ``Trainer(plugins=[io], callbacks=[CastoreStepReporter(io), ...])``. At the end of
    each batch that ended an optimizer step (the trainer's ``global_step`` moved: a
    batch that only accumulated gradients reports nothing), every process whose
    plugin saves, or has its store open, calls ``store.report_step()``: a tiered store
    sends the chunks of a promoted async save (``blocking=False``) from its staging
    buffers within ``durable_step_budget`` of each step's time (docs/TIERS.md); a
    plain store does nothing. Under ``ddp`` rank 0 saves, so rank 0 reports.
    """

    def __init__(self, checkpoint_io: CastoreCheckpointIO) -> None:
        self.checkpoint_io = checkpoint_io
        self._step: int | None = None  # the trainer's global_step at the last report

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self._step:
            return  # gradients accumulated: no optimizer step ended
        self._step = trainer.global_step
        self.checkpoint_io.report_step(opening=trainer.is_global_zero)


class _Event:
    """One save and the files that name its generation: pointed once it is published."""

    def __init__(self, marks: list[object] | None, point: Callable[[Generation, Path], None]):
        self.marks = marks
        self._point = point
        self._lock = threading.Lock()
        self._targets: list[Path] = []
        self._generation: Generation | None = None

    def name(self, target: Path) -> None:
        """Point ``target`` at the generation: now if it is published, else when it is."""
        with self._lock:  # either published() sees the target, or this sees the generation
            self._targets.append(target)
            generation = self._generation
        if generation is not None:
            self._point(generation, target)

    def published(self, generation: Generation) -> None:
        """The save's ``on_publish``: point every name given so far (on the writer, if async)."""
        with self._lock:
            self._generation = generation
            targets = list(self._targets)
        for target in targets:
            self._point(generation, target)


def _marks(checkpoint: dict[str, Any]) -> list[object] | None:
    """What tells ``checkpoint``'s state from another's, leaf by leaf; None: cannot tell.

    A small tensor is marked by its bytes; a larger one by where it lies and its
    version counter (every in-place change bumps it), which live weights and
    optimizer moments keep between two saves that nothing trained between.
    (A large tensor made afresh for each save could pass for the last one only
    if its successor landed at the same address, with the same version counter
    and other bytes, at the same step and loop state.) Callbacks'
    ``last_model_path`` is left out (see _MOVED_BETWEEN_NAMES).
    """
    marks: list[object] = []
    try:
        for key, value in checkpoint.items():
            marks.append(key)
            if not _mark(value, marks, callbacks=key == "callbacks"):
                return None
    except (RuntimeError, NotImplementedError):  # a tensor without storage, bytes or version
        return None
    return marks


def _mark(value: Any, marks: list[object], *, callbacks: bool) -> bool:
    if isinstance(value, torch.Tensor):
        where = (value.device, value.dtype, tuple(value.shape), value.stride())
        if value.nbytes <= _SMALL_TENSOR:
            flat = value.detach().cpu().reshape(-1).view(torch.uint8)
            marks.append((*where, flat.numpy().tobytes()))
        else:
            marks.append((*where, value.storage_offset(), value.data_ptr(), value._version))
        return True
    if isinstance(value, dict):
        marks.append((type(value), len(value)))
        for key, item in value.items():
            if callbacks and key == _MOVED_BETWEEN_NAMES:
                continue
            marks.append(key)
            if not _mark(item, marks, callbacks=callbacks):
                return False
        return True
    if isinstance(value, (list, tuple)):
        marks.append((type(value), len(value)))
        return all(_mark(item, marks, callbacks=callbacks) for item in value)
    marks.append((type(value), value))
    return value is None or isinstance(value, (bool, int, float, str, bytes))


def tag_name(path: Path) -> str:
    """The castore tag a checkpoint file's generation is kept under: its file name made safe
    (``epoch=1-step=20.ckpt`` -> ``ckpt-epoch_1-step_20``)."""
    stem = _UNSAFE.sub("_", path.name.removesuffix(".ckpt")).strip("._-") or "checkpoint"
    return f"ckpt-{stem}"[:128].replace("..", "_")


def read_pointer(path: Path) -> dict[str, Any]:
    """The pointer file at ``path``, checked; NotAPointerError for anything else."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(_MAX_POINTER + 1)
        pointer = json.loads(data) if len(data) <= _MAX_POINTER else None
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise NotAPointerError(
            f"{path} is not a castore checkpoint pointer: {exc}", path=str(path)
        ) from None
    fields = {"run": str, "generation": int, "root": str}
    if (
        not isinstance(pointer, dict)
        or pointer.get("format") != POINTER_FORMAT
        or any(not isinstance(pointer.get(k), t) for k, t in fields.items())
        or not _ROOT.fullmatch(pointer["root"])  # a root digest, never a tag or "latest"
    ):
        raise NotAPointerError(
            f"{path} is not a castore checkpoint pointer (a .ckpt file from another "
            "CheckpointIO? load it with that plugin, or castore import it)",
            path=str(path),
        )
    return pointer


def _write_atomically(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)
    fsync_dir(path.parent)  # the rename is durable: the pointer names what was just published


def _device(map_location: Any) -> torch.device | None:
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    return None  # a function or a mapping: tensors load on the CPU, where castore puts them


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value
