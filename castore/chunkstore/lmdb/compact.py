"""``castore compact``'s work on a local store: rewrite every pack with dead space,
then the LMDB file without its free pages.

:func:`castore.gc.compact` finds the store and checks its marker; this module
does the rest, on a directory it is handed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import lmdb

from castore.chunkstore.lmdb import env as lmdb_env
from castore.chunkstore.lmdb.backend import LmdbBackend
from castore.errors import IntegrityError
from castore.repo.local import RefStore
from castore.support.progress import Phases, format_size
from castore.support.readonly import refuse_unwritable
from castore.support.safefs import fsync_dir


def compact_lmdb_store(root: Path, *, merge_below: int, progress: bool = False) -> tuple[int, int]:
    """Compact the local store at ``root`` (its marker checked): its bytes on disk before and after.

    Offline: refused (``StoreLockedError``) while any process has the store
    open. Packs are rewritten first (see ``LmdbBackend.reclaim``; packs under
    ``merge_below`` bytes are merged). Then the compacted LMDB copy is checked
    entry by entry against the original's counts before it replaces
    ``chunks/data.mdb`` with one ``rename``.
    """
    refuse_unwritable(root, "compact")
    hold = RefStore(root).hold_open(
        exclusive=True,
        busy=f"store {root} is open (in this or another process): close every user "
        "before compacting",
    )
    try:
        chunks_dir = root / "chunks"
        lmdb_env.refuse_if_open(chunks_dir, store=root, doing="compacting")
        data_file = chunks_dir / "data.mdb"
        before = _bytes_on_disk(chunks_dir)  # before an open pads data.mdb's tail
        phases = Phases(progress, "compact", 3)
        phases.start(f"rewrite every pack with dead space ({format_size(before)} on disk)")
        backend = LmdbBackend(chunks_dir)
        try:
            # No process has the store open: no pack in flight.
            backend.reclaim(min_live=1.0, merge_below=merge_below)
        finally:
            backend.close()
        # A fresh name (mkdir fails on anything already there, a symlink included):
        # the compacted copy is never written through an entry the store brought.
        work = Path(tempfile.mkdtemp(prefix=f".compact-{os.getpid()}-", dir=chunks_dir))
        try:
            size = format_size(data_file.stat().st_size)
            phases.start(f"copy the LMDB file without its free pages ({size})")
            env = lmdb.open(str(chunks_dir), readonly=True, max_dbs=4, lock=False)
            try:
                expected = _entry_counts(env)
                env.copy(str(work), compact=True)
            finally:
                env.close()
            phases.start("check the copy's entry counts and swap it in")
            copy = lmdb.open(str(work), readonly=True, max_dbs=4, lock=False)
            try:
                if _entry_counts(copy) != expected:
                    raise IntegrityError(
                        "compaction produced a copy whose entry counts differ; the store is "
                        "unchanged",
                        path=str(root),
                    )
            finally:
                copy.close()
            new_file = work / "data.mdb"
            with open(new_file, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(new_file, data_file)  # the atomic swap
            fsync_dir(chunks_dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        after = _bytes_on_disk(chunks_dir)  # unpadded until the next open
    finally:
        hold.release()
    return before, after


def _bytes_on_disk(chunks_dir: Path) -> int:
    """The LMDB data file plus every pack file, by stat alone (no LMDB open)."""
    data_file = chunks_dir / "data.mdb"
    size = data_file.stat().st_size if data_file.exists() else 0
    packs = chunks_dir / "packs"
    return size + sum(p.stat().st_size for p in packs.glob("*.pack") if p.is_file())


def _entry_counts(env: Any) -> dict[bytes, int]:
    """Entries of every named database of an environment."""
    counts = {}
    with env.begin() as txn:
        names = [bytes(key) for key, _ in txn.cursor()]
        for name in names:
            db = env.open_db(name, txn=txn, create=False)
            counts[name] = txn.stat(db)["entries"]
    return counts
