"""Rebuilding the LMDB file from what survives: the chunk index from the packs.

Packs are self-describing, so the chunk index can always be rebuilt: every
record whose bytes hash to its digest is indexed (the first intact copy, in
pack-name order, wins). Objects (roots and shard manifests) live only in
LMDB: every object that can still be read and hashes to its name is copied;
the rest are lost, and the generations that needed them stay damaged.

The rebuild writes a **fresh** environment and never writes into the damaged
one: a damaged free list would make LMDB reuse live pages. It is offline
(``locks/open.lock`` exclusive, like ``castore compact``). The old file is
kept beside the new one as ``data.mdb.damaged-TIME`` for forensics; the swap is
a hard link of the old name, then one ``rename`` of the new file over it, so
a crash at any point leaves a usable ``data.mdb``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from castore.chunkstore.base import Namespace
from castore.chunkstore.lmdb import env as lmdb_env
from castore.chunkstore.lmdb.env import DEFAULT_MAP_SIZE, INDEX_DB
from castore.chunkstore.lmdb.file import DATA_FILE, read_committed_meta
from castore.chunkstore.lmdb.packwriter import PackLocation
from castore.chunkstore.packfile import PACK_DIR, pack_id, read_chunk, scan_pack
from castore.errors import CastoreError
from castore.format.codec import stored_matches
from castore.format.hashing import digest_bytes
from castore.repo.local import RefStore
from castore.support.progress import NO_BAR, Bar, Phases, format_size, progress_bar
from castore.support.readonly import refuse_unwritable
from castore.support.safefs import fsync_dir

_OBJECTS_DB = Namespace.OBJECTS.value.encode()


@dataclass
class RebuildReport:
    """What a rebuild kept, indexed and could not save."""

    objects_kept: int = 0
    chunks_indexed: int = 0
    records_damaged: int = 0  # pack records whose bytes do not hash to their digest
    packs: int = 0
    lost: list[str] = field(default_factory=list)  # what could not be read, and why
    old_file: Path | None = None
    seconds: float = 0.0


def rebuild_lmdb_index(root: Path, *, progress: bool = False) -> RebuildReport:
    """Write a fresh ``chunks/data.mdb`` of the local store at ``root`` (its marker checked).

    Salvaged objects and an index built from the packs. ``progress=True``:
    phase lines and a bar of the pack bytes re-hashed, on stderr (a terminal).
    """
    started = time.perf_counter()
    refuse_unwritable(root, "rebuilding the chunk index")
    hold = RefStore(root).hold_open(
        exclusive=True,
        busy=f"store {root} is open (in this or another process): close every user "
        "before rebuilding its index",
    )
    try:
        report = RebuildReport()
        chunks_dir = root / "chunks"
        lmdb_env.refuse_if_open(chunks_dir, store=root, doing="rebuilding its index")
        work = chunks_dir / f".rebuild-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        phases = Phases(progress, "rebuild-index", 3)
        try:
            phases.start("salvage the objects of the old LMDB file")
            objects = _salvage_objects(chunks_dir, work, report)
            packs = _pack_paths(chunks_dir / PACK_DIR)
            sizes = {path: _file_size(path) for _, path in packs}
            phases.start(
                f"index {len(packs)} pack(s), {format_size(sum(sizes.values()))}, from their bytes"
            )
            with progress_bar(progress, "rebuild-index", sum(sizes.values())) as bar:
                index = _index_from_packs(packs, sizes, report, bar)
            phases.start(
                f"write a fresh LMDB file: {len(objects)} object(s), {len(index)} chunk(s)"
            )
            _write_env(work, objects, index)
            report.old_file = _swap_in(chunks_dir, work / DATA_FILE)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        hold.release()
    report.seconds = time.perf_counter() - started
    return report


def _salvage_objects(chunks_dir: Path, work: Path, report: RebuildReport) -> dict[bytes, bytes]:
    """Every object that reads and hashes to its name, from a private copy of the old file."""
    source = chunks_dir / DATA_FILE
    if not source.exists():
        report.lost.append(f"{source} does not exist: every object (manifest) is lost")
        return {}
    copy = work / "salvage"
    copy.mkdir()
    shutil.copyfile(source, copy / DATA_FILE)
    try:
        meta = read_committed_meta(copy / DATA_FILE)
    except CastoreError as exc:
        report.lost.append(f"the LMDB header is unreadable, every object is lost: {exc}")
        return {}
    if meta is None:
        return {}
    if (copy / DATA_FILE).stat().st_size < meta.needed_bytes:
        # Pad the copy so LMDB never maps past its end (SIGBUS); lost pages read as zeros.
        os.truncate(copy / DATA_FILE, meta.needed_bytes)
        report.lost.append(f"{source} was truncated: objects on its missing pages are lost")
    try:
        env = lmdb.open(str(copy), readonly=True, lock=False, max_dbs=4, subdir=True)
    except lmdb.Error as exc:
        report.lost.append(f"the LMDB file cannot be opened, every object is lost: {exc}")
        return {}
    try:
        return _read_objects(env, report)
    finally:
        env.close()


def _read_objects(env: Any, report: RebuildReport) -> dict[bytes, bytes]:
    found: dict[bytes, bytes] = {}
    try:
        db = env.open_db(_OBJECTS_DB, create=False)
    except lmdb.Error as exc:
        report.lost.append(f"the objects database cannot be opened, every object is lost: {exc}")
        return found
    # One walk per first key byte, each in its own transaction (an error poisons a
    # transaction): a damaged page loses its own range, not the rest.
    unreadable: list[str] = []
    for first in range(256):
        for key, value in _walk_range(env, db, first, unreadable):
            if digest_bytes(value) == key:
                found[key] = value
            else:
                report.lost.append(f"object {key.hex()[:16]} is damaged")
    if unreadable:
        report.lost.append(
            f"objects in {len(unreadable)} of 256 key ranges are unreadable "
            f"(first: {unreadable[0]}); those objects are lost"
        )
    report.objects_kept = len(found)
    return found


def _walk_range(
    env: Any, db: Any, first: int, unreadable: list[str]
) -> Iterator[tuple[bytes, bytes]]:
    found: list[tuple[bytes, bytes]] = []
    try:
        with env.begin(db=db) as txn:
            cursor = txn.cursor(db=db)
            more = cursor.set_range(bytes([first]))
            while more and bytes(cursor.key())[:1] == bytes([first]):
                found.append((bytes(cursor.key()), bytes(cursor.value())))
                more = cursor.next()
    except lmdb.Error as exc:
        unreadable.append(f"keys {first:02x}..: {type(exc).__name__}")
    yield from found


def _pack_paths(pack_dir: Path) -> list[tuple[int, Path]]:
    """Every file named like a pack, in pack-name order."""
    named = ((pack_id(entry.name), Path(entry.path)) for entry in os.scandir(pack_dir))
    return sorted((pack, path) for pack, path in named if pack is not None)


def _file_size(path: Path) -> int:
    """A regular file's size; 0 for anything else (it is not read)."""
    return path.stat().st_size if path.is_file() and not path.is_symlink() else 0


def _index_from_packs(
    packs: list[tuple[int, Path]], sizes: dict[Path, int], report: RebuildReport, bar: Bar = NO_BAR
) -> dict[bytes, PackLocation]:
    """Every intact record of every pack; the first copy of a digest wins.

    ``bar`` counts each pack's file size (``sizes``) as its records are read.
    """
    index: dict[bytes, PackLocation] = {}
    for pack, path in packs:
        if path.is_symlink() or not path.is_file():
            report.lost.append(f"{path} is not a regular file: not read")
            continue
        report.packs += 1
        size, counted = sizes[path], 0
        for record in scan_pack(path, pack).records:
            reached = min(record.offset + record.length, size)  # a damaged record may run past
            if bar and reached > counted:
                bar.update(reached - counted)
                counted = reached
            if record.digest in index:
                continue
            if not stored_matches(record.digest, read_chunk(path, record)):
                report.records_damaged += 1
                continue
            index[record.digest] = PackLocation(record.length, pack, record.offset)
        bar.update(size - counted)  # what no record covers
    report.chunks_indexed = len(index)
    return index


def _write_env(work: Path, objects: dict[bytes, bytes], index: dict[bytes, PackLocation]) -> None:
    payload = sum(len(v) + 64 for v in objects.values()) + 96 * len(index)
    env = lmdb.open(
        str(work),
        map_size=max(DEFAULT_MAP_SIZE, 4 * payload),
        subdir=True,
        max_dbs=4,
        sync=True,
        metasync=True,
        writemap=False,
    )
    try:
        object_db = env.open_db(_OBJECTS_DB, create=True)
        index_db = env.open_db(INDEX_DB, create=True)
        with env.begin(write=True) as txn:
            for key, value in sorted(objects.items()):
                txn.put(key, value, db=object_db)
            for key, where in sorted(index.items()):
                txn.put(key, where.encode(), db=index_db)
        env.sync(True)
    finally:
        env.close()


def _swap_in(chunks_dir: Path, new_file: Path) -> Path | None:
    """Keep the old file under a new name, then rename the new one over ``data.mdb``."""
    target = chunks_dir / DATA_FILE
    kept = None
    if target.exists():
        kept = chunks_dir / f"{DATA_FILE}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        os.link(target, kept)
    with open(new_file, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(new_file, target)
    fsync_dir(chunks_dir)
    return kept
