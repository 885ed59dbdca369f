"""The pack file format, and reading a pack's records without the index.

A pack is self-describing (docs/FORMAT.md): a header, then records of
``digest(32) | length(u64) | bytes``. Scanning the record headers is what lets
the chunk index be checked against the packs, and rebuilt from them when the
LMDB file is damaged. A scan reads only the 40-byte headers (``pread``), so it
costs one small read per chunk, not the chunk's bytes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACK_DIR = "packs"
PACK_SUFFIX = ".pack"
PACK_MAGIC = b"CASTPACK"
PACK_VERSION = 1
PACK_HEADER = struct.Struct("<8sII")  # magic, version, reserved
RECORD_HEADER = struct.Struct("<32sQ")  # digest, length; the chunk's bytes follow


@dataclass(frozen=True)
class PackRecord:
    """One record of a pack: ``offset`` is where the chunk's bytes start."""

    digest: bytes
    length: int
    offset: int


@dataclass
class PackScan:
    """The records a sequential scan of one pack found, and what stopped it."""

    pack: int
    size: int
    records: list[PackRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # damage seen: bad header, cut tail


def read_record(fd: int, offset: int, size: int) -> PackRecord | None:
    """The record whose chunk bytes start at ``offset``, if its header fits in the file."""
    start = offset - RECORD_HEADER.size
    if start < PACK_HEADER.size or offset > size:
        return None
    header = os.pread(fd, RECORD_HEADER.size, start)
    if len(header) < RECORD_HEADER.size:
        return None
    digest, length = RECORD_HEADER.unpack(header)
    return PackRecord(digest, length, offset)


def _chain(fd: int, start: int, size: int, seen: set[int]) -> Iterator[PackRecord | str]:
    """Records from ``start`` to the end of the pack; a note (str) where the chain breaks."""
    position = start
    while position < size and position not in seen:
        seen.add(position)
        record = read_record(fd, position + RECORD_HEADER.size, size)
        if record is None:
            yield f"a record header at offset {position} is cut off by the end of the pack"
            return
        if record.offset + record.length > size:
            yield (
                f"the record at offset {position} ({record.length} bytes) runs past the "
                f"end of the pack ({size} bytes): the pack is truncated"
            )
            return
        yield record
        position = record.offset + record.length


def scan_pack(path: Path, pack: int, resume_at: tuple[int, ...] = ()) -> PackScan:
    """Every record reachable by walking record headers from the start of the pack.

    A damaged length derails the walk; ``resume_at`` (ends of records known
    from elsewhere, e.g. the index) restarts it there so later records are
    still seen.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        scan = PackScan(pack, size)
        magic, version, _ = PACK_HEADER.unpack(os.pread(fd, PACK_HEADER.size, 0).ljust(16, b"\0"))
        if magic != PACK_MAGIC or version != PACK_VERSION:
            scan.notes.append(f"the pack header is damaged (magic {magic!r}, version {version})")
        seen: set[int] = set()
        for start in (PACK_HEADER.size, *sorted(resume_at)):
            for item in _chain(fd, start, size, seen):
                if isinstance(item, str):
                    scan.notes.append(item)
                else:
                    scan.records.append(item)
    finally:
        os.close(fd)
    return scan


def read_chunk(path: Path, record: PackRecord) -> bytes:
    """A record's chunk bytes (for hashing during a check or a rebuild)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, record.length, record.offset)
    finally:
        os.close(fd)


def pack_id(name: str) -> int | None:
    """The number a pack file's name ``<16 hex digits>.pack`` carries; None for any other name."""
    stem = name[: -len(PACK_SUFFIX)] if name.endswith(PACK_SUFFIX) else ""
    if len(stem) != 16:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None
