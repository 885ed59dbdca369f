"""The store a DCP writer or reader works on: a :class:`~castore.Store`, or one opened
from a path or a checkpoint id ``castore://STORE/RUN[@GEN]`` and closed after each step.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from castore.core.history import split_address
from castore.errors import InvalidNameError
from castore.opening.directory import open_address
from castore.repo.records import validate_run_name
from castore.store import Store

SCHEME = "castore://"


def parse_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> tuple[str, str, str]:
    """``castore://STORE/RUN[@GEN]`` -> (store path, run, generation)."""
    text = str(checkpoint_id)
    if not text.startswith(SCHEME):
        raise InvalidNameError(f"not a castore checkpoint id: {text!r} (castore://STORE/RUN[@GEN])")
    path, _, target = text[len(SCHEME) :].rpartition("/")
    if not path or not target:
        raise InvalidNameError(f"castore checkpoint id {text!r} needs a store path and a run")
    run, generation = split_address(target)
    validate_run_name(run)
    return path, run, generation


def open_store(store: Store | str | os.PathLike[str]) -> Store:
    if isinstance(store, Store):
        return store
    # As given: Path() would fold an s3:// address into a local directory "s3:".
    return open_address(store)


def closes_store(method: Any) -> Any:
    """Close a store opened from a path when the step returns (futures are done by then)."""

    @functools.wraps(method)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self._release()

    return step


class StoreUser:
    """The store a writer or reader works on; one opened from a path is closed after
    each step (see :func:`closes_store`)."""

    _store_arg: Store | str | os.PathLike[str] | None
    _opened: Store | None
    run: str | None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return str(checkpoint_id).startswith(SCHEME)

    @property
    def store(self) -> Store:
        if self._store_arg is None or self.run is None:
            raise InvalidNameError(
                f"{type(self).__name__} needs a store and a run (or a castore:// id)"
            )
        if isinstance(self._store_arg, Store):
            return self._store_arg
        if self._opened is None:
            self._opened = open_store(self._store_arg)
        return self._opened

    def _release(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None
