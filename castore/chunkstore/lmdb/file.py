"""The LMDB file as bytes on disk: its header, its page accounting, its errors.

LMDB trusts its file. A ``data.mdb`` shorter than its header says is mapped
anyway, and the first read of a page past the end kills the process with
SIGBUS; a damaged page surfaces as one of a dozen ``lmdb.Error`` subclasses;
a damaged free list is not noticed by readers at all, and the next write
transaction reuses a live page for new data, silently destroying whatever the
page held (the mechanism behind a "harmless" collection that made every
generation unloadable). This module turns each of these into a castore error
before LMDB acts on the damage:

* :func:`check_data_file` reads the two meta pages before ``lmdb.open`` and
  refuses a file that is too short for the pages its header says it uses;
  :func:`pad_data_file` keeps zeros past the last page for damaged pointers.
* :func:`audit_pages` walks every page (py-lmdb's offline verifier) and
  reports a free list that overlaps live pages, before a collection writes.
* :func:`translate` maps every ``lmdb.Error`` to the castore tree:
  damage -> ``IndexCorruptError``, a full disk or map -> ``StoreFullError``,
  anything else -> ``StoreError``.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import lmdb

from castore.errors import CastoreError, IndexCorruptError, StoreError, StoreFullError

DATA_FILE = "data.mdb"
_MAGIC = 0xBEEFC0DE
# LMDB 0.9 (64-bit) meta page: a 16-byte page header, then MDB_meta. Offsets
# from the page start; checked against files written by py-lmdb.
_MAGIC_AT = 16
_PAGE_SIZE_AT = 40  # mm_dbs[0].md_pad holds the page size
_LAST_PAGE_AT = 136
_TXNID_AT = 144
_META_END = 152
_MIN_PAGE, _MAX_PAGE = 512, 1 << 16
# A node sits at a u16 offset in its page and has a u16 key size: a damaged
# pointer or key size reaches at most this far past the page's start.
_NODE_REACH = 2 * (1 << 16) + 64
REPAIR_HINT = "castore repair --rebuild-index rebuilds the chunk index from the packs"

# Errors that mean the file's pages do not say what LMDB wrote.
_DAMAGE: tuple[type[lmdb.Error], ...] = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.BadTxnError,  # a transaction poisoned by a page it could not read
    lmdb.InvalidError,
    lmdb.BadValsizeError,
    lmdb.IncompatibleError,
    lmdb.VersionMismatchError,
)


@dataclass(frozen=True)
class Meta:
    """What the committed meta page of ``data.mdb`` says."""

    page_size: int
    last_page: int
    txnid: int

    @property
    def needed_bytes(self) -> int:
        return (self.last_page + 1) * self.page_size


def _read_meta(page: bytes, path: Path, which: int) -> Meta:
    (magic,) = struct.unpack_from("<I", page, _MAGIC_AT)
    if magic != _MAGIC:
        raise IndexCorruptError(
            f"{path} meta page {which} has magic {magic:#x}, not {_MAGIC:#x}: the LMDB "
            f"file is damaged; {REPAIR_HINT}",
            path=str(path),
        )
    (page_size,) = struct.unpack_from("<I", page, _PAGE_SIZE_AT)
    last_page, txnid = struct.unpack_from("<QQ", page, _LAST_PAGE_AT)
    return Meta(page_size, last_page, txnid)


def read_committed_meta(path: Path) -> Meta | None:
    """The meta page LMDB would pick (larger txnid), checked; None for an absent or empty file.

    Raises ``IndexCorruptError`` for a bad magic, an absurd page size, or a
    file shorter than two pages.
    """
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            first = handle.read(_META_END)
            if size == 0:
                return None
            meta0 = _read_meta(_long_enough(first, size, path, _META_END), path, 0)
            _check_page_size(meta0.page_size, path)
            handle.seek(meta0.page_size)
            second = handle.read(_META_END)
    except FileNotFoundError:
        return None
    meta1 = _read_meta(_long_enough(second, size, path, meta0.page_size + _META_END), path, 1)
    return meta1 if meta1.txnid > meta0.txnid else meta0


def _long_enough(data: bytes, size: int, path: Path, needed: int) -> bytes:
    if len(data) < _META_END:
        raise IndexCorruptError(
            f"{path} is {size} bytes, shorter than its two meta pages ({needed}+ bytes): "
            f"the LMDB file is truncated; {REPAIR_HINT}",
            path=str(path),
        )
    return data


def _check_page_size(page_size: int, path: Path) -> None:
    if not _MIN_PAGE <= page_size <= _MAX_PAGE or page_size & (page_size - 1):
        raise IndexCorruptError(
            f"{path} says its page size is {page_size}: the LMDB file is damaged; {REPAIR_HINT}",
            path=str(path),
        )


def check_data_file(path: Path) -> None:
    """Refuse a ``data.mdb`` shorter than the pages its header says it uses.

    LMDB maps the whole range and would touch the missing pages: SIGBUS.
    """
    meta = read_committed_meta(path)
    if meta is None:
        return
    size = path.stat().st_size
    if size < 2 * meta.page_size or size < meta.needed_bytes:
        raise IndexCorruptError(
            f"{path} is {size} bytes, its header says it uses {meta.needed_bytes} "
            f"({meta.last_page + 1} pages of {meta.page_size}): the LMDB file is truncated; "
            f"{REPAIR_HINT} (objects in the lost pages cannot be recovered)",
            path=str(path),
        )


def pad_data_file(path: Path) -> None:
    """Keep zeros past the last page, so a damaged node pointer still lands inside the file.

    A node pointer or key size read from a damaged page reaches at most
    ``_NODE_REACH`` bytes past its page; past the end of the file that read is
    SIGBUS, inside LMDB where nothing can catch it. LMDB never reads the padding
    of a sound file. Best effort (a full disk, a read-only store): the padding
    only narrows what damage can do. ``posix_fallocate`` never shrinks a file
    or changes its bytes, so a writer extending it at the same moment loses nothing.
    """
    try:
        meta = read_committed_meta(path)
        fd = os.open(path, os.O_RDWR)
    except (OSError, CastoreError):
        return
    try:
        length = (meta.needed_bytes if meta else 0) + _NODE_REACH
        if os.fstat(fd).st_size < length:
            os.posix_fallocate(fd, 0, length)
    except OSError:
        pass
    finally:
        os.close(fd)


def audit_pages(directory: Path) -> list[str]:
    """Every structural problem of the LMDB file in ``directory`` (empty: sound).

    Reads the file, never through LMDB: safe on any damage. The file must be
    at rest (no writer): callers hold the store lock exclusively.
    """
    from lmdb.verify import VerifyError, verify  # py-lmdb >= 3.0

    path = directory / DATA_FILE
    if not path.exists() or path.stat().st_size == 0:
        return []
    try:
        return list(verify(str(directory), subdir=True))
    except VerifyError as exc:
        return [str(exc)]


# -- error translation ---------------------------------------------------------------


def translate(exc: lmdb.Error, path: Path, operation: str) -> CastoreError:
    """The castore error for an ``lmdb.Error`` raised while doing ``operation``."""
    where = {"path": str(path)}
    if isinstance(exc, _DAMAGE):
        return IndexCorruptError(
            f"the LMDB file is damaged ({type(exc).__name__}: {exc}) while trying to "
            f"{operation}; {REPAIR_HINT}",
            **where,
        )
    if isinstance(exc, lmdb.MapFullError):
        return StoreFullError(
            f"the LMDB map is full while trying to {operation}: open the store with a "
            "larger map_size= (or none: the map then grows on demand)",
            phase=operation,
            **where,
        )
    if isinstance(exc, lmdb.DiskError) or "No space left" in str(exc):
        return StoreFullError(
            f"the disk is full while trying to {operation} ({exc}); nothing was committed",
            phase=operation,
            **where,
        )
    return StoreError(f"LMDB failed to {operation}: {type(exc).__name__}: {exc}", **where)


F = TypeVar("F", bound=Callable[..., Any])


def lmdb_guarded(operation: str) -> Callable[[F], F]:
    """Decorate a backend method so no ``lmdb.Error`` leaves it untranslated.

    The method's object must have a ``path`` attribute (the environment's
    directory) by the time an error can be raised.
    """

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except lmdb.Error as exc:
                raise translate(exc, Path(getattr(self, "path", "?")), operation) from exc

        return cast(F, guarded)

    return decorate
