"""Read-only stores: when a store is opened so, and how a refused write is told.

A released checkpoint, a snapshot or a dataset mount is often read-only. A store
there is opened read-only (``castore.open(path, readonly=True)``, or on its own
when its directory is not writable): every read works, and every write (save,
tag, garbage collection, repair, a copy or an import into it) raises
:class:`~castore.errors.ReadOnlyStoreError` before it touches anything. Such an
open creates and changes nothing in the store: no lock file, no LMDB lock
file, no padding of the LMDB file.

Each part refuses its own writes (the refs, the chunk backend, the blobs), so
a write path nobody thought of still cannot write; the public operations also
refuse up front, so the message names what the caller asked for.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from castore.errors import ReadOnlyStoreError, ReadOnlyWarning

NOT_WRITABLE = "its directory is not writable"
ASKED = "opened with readonly=True"
# What an open that tried to create a file in the store got when the store cannot be written.
UNWRITABLE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


@dataclass(frozen=True)
class ReadOnly:
    """Why a store is read-only, and its name: enough to refuse a write in one line."""

    store: str
    why: str

    def refuse(self, what: str, hint: str = "") -> ReadOnlyStoreError:
        """The error for a refused write: ``what`` is the operation ("save", "tag")."""
        return ReadOnlyStoreError.refusing(self.store, self.why, what, hint)


def is_writable(directory: Path) -> bool:
    """Whether this process may create files in ``directory``.

    ``os.access(W_OK)``, not a probe file: a probe would write into a store a
    reader must leave as it found it. ``access`` answers for both causes that
    matter: a read-only mount (EROFS, for root too) and permission bits or ACLs
    the caller lacks (root passes those, and can indeed write). Filesystems
    where ``access`` is not the whole truth (NFS with root squashing, some FUSE
    mounts) are caught later: ``castore.open`` also falls back to read-only when
    creating the open lock fails with EROFS, EACCES or EPERM.
    """
    return os.access(directory, os.W_OK)


def choose(store: str, readonly: bool | None, writable: bool) -> ReadOnly | None:
    """How to open ``store``: None for read-write, else why it is read-only.

    ``readonly`` is the caller's choice: True, False, or None (decide by
    ``writable``, saying so once with a :class:`ReadOnlyWarning`).
    """
    if readonly is False:
        return None
    if not writable:
        reason = ReadOnly(store, NOT_WRITABLE)
        if readonly is None:
            announce(reason)
        return reason
    return ReadOnly(store, ASKED) if readonly else None


def announce(reason: ReadOnly) -> None:
    """Say once, in one line, that a store was opened read-only without being asked to."""
    warnings.warn(
        f"castore: store {reason.store} opened read-only ({reason.why}): reads work, "
        "writes are refused",
        ReadOnlyWarning,
        stacklevel=_outside_castore(),
    )


def _outside_castore() -> int:
    """The stacklevel of the first caller outside castore (the open is a few calls deep)."""
    package = os.path.dirname(os.path.dirname(__file__)) + os.sep  # castore/, not support/
    frame, level = sys._getframe(2), 2  # the caller of announce's caller
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def refuse_unwritable(root: Path, what: str) -> None:
    """For an offline tool given a path (compact, rebuild): refuse ``what`` up front
    when ``root`` is not writable, instead of failing on its first lock file."""
    if not is_writable(root):
        raise ReadOnly(str(root), NOT_WRITABLE).refuse(what)


def cannot_write(exc: BaseException) -> bool:
    """Whether ``exc`` (or the OSError it was raised from) says the store cannot be written."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in UNWRITABLE_ERRNOS:
            return True
        seen = seen.__cause__
    return False
