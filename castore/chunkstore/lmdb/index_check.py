"""Cross-checking the chunk index against the packs it names.

A collection decides which packs are live by *iterating* the index, while
loads and verify find chunks by *point lookup*. A damaged B-tree can make the
two disagree (iteration skips a leaf that lookups still reach), and an entry
can name the wrong place. Either way the packs a collection would delete are
not the packs nothing needs. This check finds every such disagreement from
the packs' own record headers, before anything is deleted:

* every entry iterated names a record whose digest and length match it, and
  a point lookup of its key returns the same location;
* the index's own entry count equals the number of entries iterated;
* every record digest that iteration does not list is absent by point lookup
  too (otherwise iteration is missing entries).

Records no entry names are garbage, not a problem. Entries whose bytes a
pack no longer holds (the pack is gone, or truncated: cut short by a full disk
or a bad copy) are notes, not problems: the index still says where they were,
and ``verify`` names the generations that need them.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from castore.chunkstore.base import IndexCheck
from castore.chunkstore.packfile import (
    PackRecord,
    PackScan,
    read_chunk,
    read_record,
    scan_pack,
)
from castore.format.codec import stored_matches

LOCATION_SIZE = 24  # length, pack id, offset: three u64
_SHOWN = 20  # problems listed one by one; the rest are counted

Lookup = Callable[[bytes], "tuple[int, int, int] | None"]


@dataclass(frozen=True)
class IndexEntry:
    """One entry as iteration listed it: key and decoded (length, pack, offset)."""

    key: bytes
    length: int
    pack: int
    offset: int


@dataclass
class _Findings:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    records: int = 0

    def problem(self, text: str) -> None:
        self.problems.append(text)


def cross_check(
    entries: Sequence[IndexEntry],
    stat_entries: int,
    lookup: Lookup,
    packs: dict[int, Path],
    *,
    hash_bytes: bool = False,
) -> IndexCheck:
    """Check iterated ``entries`` against the ``packs`` on disk and point ``lookup``s."""
    found = _Findings()
    if len(entries) != stat_entries:
        found.problem(
            f"the chunk index says it holds {stat_entries} entries but iteration lists "
            f"{len(entries)}: its B-tree is damaged"
        )
    by_pack: dict[int, list[IndexEntry]] = defaultdict(list)
    for entry in entries:
        by_pack[entry.pack].append(entry)
        again = lookup(entry.key)
        if again != (entry.length, entry.pack, entry.offset):
            found.problem(
                f"entry {entry.key.hex()[:16]}: iteration says (length, pack, offset) "
                f"{(entry.length, entry.pack, entry.offset)}, a lookup says {again}"
            )
    listed = {entry.key for entry in entries}
    for pack in sorted(set(packs) | set(by_pack)):
        named = by_pack.get(pack, [])
        if pack not in packs:
            # Missing chunks, which verify reports per generation; nothing for gc to misjudge.
            found.notes.append(
                f"{len(named)} entr(ies) (first {named[0].key.hex()[:16]}) name pack "
                f"{pack:016x}, which does not exist"
            )
            continue
        scan = scan_pack(packs[pack], pack, tuple(e.offset + e.length for e in named))
        found.records += len(scan.records)
        found.notes.extend(f"pack {pack:016x}: {note}" for note in scan.notes)
        _check_named(scan, named, packs[pack], found, hash_bytes)
        _check_unlisted(scan, listed, lookup, found)
    return IndexCheck(
        entries=len(entries),
        records=found.records,
        packs=len(packs),
        problems=tuple(_summarised(found.problems)),
        notes=tuple(_summarised(found.notes)),
    )


def _check_named(
    scan: PackScan, named: list[IndexEntry], path: Path, found: _Findings, hash_bytes: bool
) -> None:
    """Each entry naming this pack points at a record with its digest and length."""
    at = {record.offset: record for record in scan.records}
    for entry in named:
        record = at.get(entry.offset) or _header_at(path, entry.offset, scan.size)
        where = f"pack {scan.pack:016x} offset {entry.offset}"
        if record is None and entry.offset > scan.size:
            # A truncated pack: missing chunks, which verify reports per generation (as a
            # pack that is gone), not an index that disagrees with what is there.
            found.notes.append(
                f"chunk {entry.key.hex()[:16]} at {where} lies past the end of the pack "
                f"({scan.size} bytes): the pack is truncated"
            )
        elif record is None:
            found.problem(f"entry {entry.key.hex()[:16]} names {where}, where no record starts")
        elif record.digest == entry.key and record.offset + record.length > scan.size:
            found.notes.append(f"chunk {entry.key.hex()[:16]} at {where} is cut short")
        elif record.digest != entry.key or record.length != entry.length:
            found.problem(
                f"entry {entry.key.hex()[:16]} ({entry.length} bytes) names {where}, which "
                f"holds {record.digest.hex()[:16]} ({record.length} bytes)"
            )
        elif hash_bytes and not stored_matches(entry.key, read_chunk(path, record)):
            found.problem(f"entry {entry.key.hex()[:16]}: the bytes at {where} are damaged")


def _header_at(path: Path, offset: int, size: int) -> PackRecord | None:
    """The record header just before ``offset`` (the scan may have stopped short of it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_record(fd, offset, size)
    finally:
        os.close(fd)


def _check_unlisted(scan: PackScan, listed: set[bytes], lookup: Lookup, found: _Findings) -> None:
    """A record iteration does not list must not be found by lookup either."""
    for record in _unlisted(scan.records, listed):
        where = lookup(record.digest)
        if where is not None:
            found.problem(
                f"chunk {record.digest.hex()[:16]} is indexed (a lookup finds it at pack "
                f"{where[1]:016x} offset {where[2]}) but iteration does not list it: the "
                "index's B-tree is damaged"
            )


def _unlisted(records: list[PackRecord], listed: set[bytes]) -> list[PackRecord]:
    return [r for r in records if r.digest not in listed]


def _summarised(lines: list[str]) -> list[str]:
    if len(lines) <= _SHOWN:
        return lines
    return lines[:_SHOWN] + [f"... and {len(lines) - _SHOWN} more"]
