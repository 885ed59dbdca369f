"""Accelerate's ``save_state``/``load_state`` into castore: :class:`CastoreState`.

``Accelerator.save_state(dir)`` writes the models (safetensors), optimizers,
schedulers, scaler, samplers, every process's RNG state and the objects
registered with ``register_for_checkpointing`` as a directory, and
``load_state(dir)`` reads one back. Accelerate's hooks
(``register_save_state_pre_hook``) can change what is saved but not where it
goes, so this is a thin wrapper around both calls: ``CastoreState.save()``
has Accelerate write the state to a staging directory, stores it as the next
generation of one castore run (deduplicated against every earlier save) and
removes the staging copy; ``CastoreState.load()`` materialises a generation
(every byte verified) into staging and has Accelerate load it.

The pickled files are read only with ``torch.load(weights_only=True)`` and the
safe globals Accelerate itself allows when it loads them; a file that loader
refuses (a ``custom_checkpoint_N.pkl`` whose ``state_dict`` holds an object,
which Accelerate itself loads with ``weights_only=False``) stops the save
with :class:`~castore.errors.ImportSourceError` naming it, before anything is
stored.

Multi-process runs: every process calls ``save()`` and ``load()`` (as with
``save_state``); the staging directory must be one every process of the job
sees (on several nodes, a shared file system: a state missing a process's RNG
file is refused), and the main process alone stores and materialises it. When
that fails, every process raises: the main process its error, the others the
same castore error type (:class:`~castore.errors.RankFailedError` for any other
kind).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list
from accelerate.utils.constants import RNG_STATE_NAME
from accelerate.utils.other import TORCH_SAFE_GLOBALS

import castore
from castore import errors
from castore import gc as castore_gc
from castore.core.history import Generation
from castore.errors import (
    CastoreError,
    GenerationNotFoundError,
    ImportSourceError,
    RankFailedError,
)
from castore.integrations.checkpoint_dirs import (
    Background,
    read_checkpoint_dir,
    write_checkpoint_dir,
)
from castore.store import Store

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_TAG = re.compile(r"state-(\d+)")


class CastoreState:
    """Save and load an ``Accelerator``'s state as generations of ``run`` in a castore store.

    ``store``: a path or URL for :func:`castore.open` (opened on first use, in
    the main process) or an open :class:`~castore.Store`. ``codec`` and
    ``open_options`` go to :func:`castore.open`. ``keep``: tag the newest
    ``keep`` saves (``state-STEP``) so that ``castore gc`` never drops them,
    untagging older ones; default: the ``total_limit`` of the Accelerator's
    ``ProjectConfiguration``, and no tags when that is unset too.
    ``staging_dir``: where Accelerate writes a state before castore stores it, in
    a new directory each time, removed once stored (default: the system's
    temporary directory); on several nodes, one on a file system every node
    shares, since each process writes its RNG state there.

    ``blocking=False``: ``save`` returns once Accelerate has written the state
    to staging, and the main process stores, publishes and removes it on a
    thread of its own while training goes on; the next ``save``, ``load`` or
    ``close`` (or :meth:`finish`) waits for it and raises its error, if any.
    """

    def __init__(
        self,
        accelerator: Any,
        store: str | os.PathLike[str] | Store,
        *,
        run: str = "accelerate",
        codec: str | None = None,
        keep: int | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
        blocking: bool = True,
        **open_options: Any,
    ) -> None:
        self.accelerator = accelerator
        self.blocking = blocking
        self._pending: Background | None = None
        self._given = store if isinstance(store, Store) else None
        self._address = store.path if isinstance(store, Store) else os.fspath(store)
        self._store: Store | None = self._given
        self.run = run
        total_limit = getattr(accelerator.project_configuration, "total_limit", None)
        self.keep = keep if keep is not None else total_limit
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be at least 1, got {self.keep!r}")
        self._staging_root = Path(staging_dir) if staging_dir is not None else None
        self._open_options = {**open_options, **({"codec": codec} if codec else {})}

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = castore.open(self._address, **self._open_options)
        return self._store

    def save(self, step: int, **save_state_options: Any) -> Generation | None:
        """``accelerator.save_state`` into the store, as the next generation at ``step``
        (the training step: resuming returns it); the generation on the main process
        (None on the others, and with ``blocking=False``: :meth:`finish` gives it).
        ``save_state_options`` go to ``save_state``."""
        accelerator = self.accelerator
        staging = self._staging("save")
        generation = None
        error: BaseException | None = None
        handed_off = False
        try:
            written = Path(accelerator.save_state(str(staging), **save_state_options))
            accelerator.wait_for_everyone()  # every process's RNG file is written
            if accelerator.is_main_process:
                try:
                    self.finish()  # the save before, published (or its error raised)
                    if self.blocking:
                        generation = self._store_dir(written, int(step))
                    else:
                        _ = self.store  # opened here, on the training thread
                        self._pending = Background(
                            lambda: self._store_and_remove(written, int(step), staging),
                            f"castore's store of {self.run} at step {int(step)}",
                        )
                        handed_off = True
                except BaseException as exc:  # every process must reach the barrier below
                    error = exc
            failed = _agree(accelerator, error)
        finally:
            if accelerator.is_main_process and not handed_off:
                shutil.rmtree(staging, ignore_errors=True)
        if error is not None:
            raise error
        if failed is not None:
            raise failed
        return generation

    def finish(self) -> Generation | None:
        """Wait for the save ``blocking=False`` left in flight (main process): its
        generation, or the error that stopped it; None when there is none."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        generation: Generation = pending.result()
        return generation

    def _store_and_remove(self, directory: Path, step: int, staging: Path) -> Generation:
        try:
            return self._store_dir(directory, step)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _staging(self, purpose: str) -> Path:
        """A new directory every process of the job writes to: made by the main process
        (unique, so two jobs on one machine never share one), its path sent to the rest."""
        accelerator = self.accelerator
        made: list[Any] = [None]
        error: BaseException | None = None
        if accelerator.is_main_process:
            try:
                root = self._staging_root or Path(tempfile.gettempdir())
                root.mkdir(parents=True, exist_ok=True)
                prefix = f".castore-accelerate-{_UNSAFE.sub('_', self.run)}-{purpose}-"
                made[0] = tempfile.mkdtemp(prefix=prefix, dir=root)
            except OSError as exc:
                error = exc
        _settle(accelerator, error)
        if accelerator.num_processes > 1:
            broadcast_object_list(made)
        return Path(made[0])

    def _store_dir(self, directory: Path, step: int) -> Generation:
        missing = [
            name
            for name in (f"{RNG_STATE_NAME}_{i}.pkl" for i in range(self.accelerator.num_processes))
            if not (directory / name).is_file()
        ]
        if missing:
            raise ImportSourceError(
                f"{directory} lacks {', '.join(missing)}: the processes that write them do "
                "not see this directory (several nodes? pass staging_dir= on a file system "
                "every node shares)"
            )
        tree = read_checkpoint_dir(directory, safe_globals=TORCH_SAFE_GLOBALS)
        metadata = {"framework": "accelerate"}
        generation = self.store.save(tree, run=self.run, step=int(step), metadata=metadata)
        if self.keep is not None:
            castore_gc.tag(self.store, self.run, generation.id, f"state-{int(step)}")
            tagged = sorted(
                (int(found.group(1)), name)
                for name in self.store.refs.tags(self.run)
                if (found := _TAG.fullmatch(name))
            )
            for _, name in tagged[: max(len(tagged) - self.keep, 0)]:
                try:
                    castore_gc.untag(self.store, self.run, name)
                except GenerationNotFoundError:
                    pass
        return generation

    def load(self, generation: int | str = "latest", **load_state_options: Any) -> int:
        """``accelerator.load_state`` from ``run@generation``; the step it was saved at
        (on every process). ``load_state_options`` go to ``load_state``."""
        accelerator = self.accelerator
        staging = self._staging("load")
        found: list[Any] = [None]
        error: BaseException | None = None
        try:
            if accelerator.is_main_process:
                try:
                    self.finish()
                    resolved = self.store.resolve(self.run, generation)
                    tree = self.store.load(self.run, resolved.root, framework="auto")
                    write_checkpoint_dir(tree, staging)
                    found[0] = resolved.step
                except BaseException as exc:
                    error = exc
            _settle(accelerator, error)
            accelerator.load_state(str(staging), **load_state_options)
            accelerator.wait_for_everyone()
        finally:
            if accelerator.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
        if accelerator.num_processes > 1:
            broadcast_object_list(found)
        return int(found[0])

    def close(self) -> None:
        """Finish the save in flight (raising its error) and close a store this opened."""
        try:
            self.finish()
        finally:
            if self._store is not None and self._given is None:
                self._store.close()
                self._store = None


def _settle(accelerator: Any, error: BaseException | None) -> None:
    """Raise on every process what the main process raised (``error`` there), if it did;
    every process waits here."""
    failed = _agree(accelerator, error)
    if error is not None:
        raise error
    if failed is not None:
        raise failed


def _agree(accelerator: Any, error: BaseException | None) -> CastoreError | None:
    """On the other processes, the main process's error (the only one that can fail) as
    the same castore type, so that ``except GenerationNotFoundError`` holds on every
    process (RankFailedError for an error of another kind); None where there was none.
    Every process waits here."""
    if accelerator.num_processes == 1:
        return None
    described = [None if error is None else (type(error).__name__, str(error))]
    broadcast_object_list(described)
    if error is not None or described[0] is None:
        return None
    name, message = described[0]
    message = f"the main process failed: {message}"
    kind = getattr(errors, name, None)
    if isinstance(kind, type) and issubclass(kind, CastoreError):
        return kind.from_remote(message, failed_rank=0)
    return RankFailedError.from_remote(f"{message} ({name})", failed_rank=0)
