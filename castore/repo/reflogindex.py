"""A derived index of one run's reflog: which records list a generation id.

The reflog stays the truth (docs/FORMAT.md, "Reflog"). Reading it whole costs
about 12 us a record, so without help a new process's first lookup by id
grows with the run's history. The index summarises a prefix of the log as
:class:`~castore.repo.records.ReflogView` would after reading it:

* the roots the prefix lists (published and not collected), each with its
  generation id, its listing position (where the prefix first lists it) and
  the position of the record that gave it that id, sorted by (id, listing
  position);
* the roots the prefix collected, sorted.

A position is a byte offset in a local reflog file and a record number in a
store on blobs; ``covered`` is where the prefix ends (the end of its last
line; the number of its last record). A lookup by id reads a few pages of
each table (O(log n)), the records the hits name (the caller checks each
against its own line checksum, id and root) and the records after the
prefix (writers rewrite the index before many pile up). Nothing here touches
storage: callers hand in a function that reads the index's bytes.

Layout, little-endian::

    header           magic "CSRLXIDX" | u32 version | u32 entries per page
                     | u64 covered | u64 listed | u64 collected | 32 ASCII hex
                     digits: the checksum of the log's last covered record
                     | 16 bytes: blake3 of the header before them
    listed pages     up to 64 entries of (u64 id, u64 listing position,
                     u64 record position, 32-byte root), then a 16-byte check
    collected pages  up to 64 sorted 32-byte roots, then a 16-byte check

A page's check is the first 16 bytes of blake3(header check | table letter |
u64 page number | entries). Damage anywhere makes the index unusable
(IndexCorruptError), never wrong: the reader then reads the whole log, and
the next append rewrites the index.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from castore.errors import IndexCorruptError
from castore.format.hashing import digest_bytes
from castore.repo.records import Record

MAGIC = b"CSRLXIDX"
VERSION = 1
PAGE_ENTRIES = 64
CHECK_SIZE = 16
_HEADER = struct.Struct("<8sIIQQQ32s")
HEADER_SIZE = _HEADER.size + CHECK_SIZE
# Roots as raw void: numpy's bytes type would drop a digest's trailing zero bytes.
LISTED = np.dtype([("id", "<u8"), ("order", "<u8"), ("line", "<u8"), ("root", "V32")])
COLLECTED = np.dtype("V32")
_LISTED, _COLLECTED = b"L", b"C"
# More roots under one id is damage: castore publishes one root per id (a lost ref's
# repair can add a second), so a lookup never reads more records than this.
MAX_SAME_ID = 64

Read = Callable[[int, int], bytes]  # (offset, length) -> the bytes there


@dataclass(frozen=True)
class Listing:
    """A root a log lists under an id, where it was first listed, and by which record."""

    root: bytes  # the raw digest
    generation: int
    order: int
    line: int
    from_index: bool = False  # the index's word: check it against the record at ``line``


@dataclass
class Summary:
    """What consecutive records say: the roots they list and the roots they collect.

    :meth:`add` follows :meth:`ReflogView.add`: a collect record drops a root
    for good, a publish record of a collected root lists nothing, and a later
    publish record of a listed root gives it its id and keeps its position.
    """

    listed: dict[bytes, Listing] = field(default_factory=dict)
    collected: set[bytes] = field(default_factory=set)

    def add(self, record: Record, position: int) -> None:
        root = bytes.fromhex(record["root"])
        if record["action"] == "collect":
            self.collected.add(root)
            self.listed.pop(root, None)
        elif root not in self.collected:
            earlier = self.listed.get(root)
            order = position if earlier is None else earlier.order
            self.listed[root] = Listing(root, record["generation"], order, position)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(listed, collected) sorted as the index stores them."""
        listed = np.array(
            [(e.generation, e.order, e.line, e.root) for e in self.listed.values()], dtype=LISTED
        )
        return _by_id(listed), _roots(self.collected)


def _by_id(listed: np.ndarray) -> np.ndarray:
    return listed[np.lexsort((listed["order"], listed["id"]))]


def _roots(roots: set[bytes]) -> np.ndarray:
    return np.array(sorted(roots), dtype=COLLECTED)


def merge(
    listed: np.ndarray, collected: np.ndarray, tail: Summary
) -> tuple[np.ndarray, np.ndarray]:
    """The tables of a prefix (``listed``, ``collected``) extended by the records of ``tail``.

    A root is listed after both if either lists it and neither collected it;
    where both list it, the tail gives its id and the prefix its position.
    """
    listed = listed[~np.isin(listed["root"], _roots(tail.collected))].copy()
    relisted = np.flatnonzero(np.isin(listed["root"], _roots(set(tail.listed))))
    for index in relisted:
        later = tail.listed[listed["root"][index].tobytes()]
        listed["id"][index], listed["line"][index] = later.generation, later.line
    known = {listed["root"][index].tobytes() for index in relisted}
    fresh = np.array(
        [
            (e.generation, e.order, e.line, e.root)
            for e in tail.listed.values()
            if e.root not in known and not _contains(collected, e.root)
        ],
        dtype=LISTED,
    )
    merged = np.union1d(collected, _roots(tail.collected)).astype(COLLECTED)
    return _by_id(np.concatenate([listed, fresh])), merged


def same_tables(tables: tuple[np.ndarray, ...], others: tuple[np.ndarray, ...]) -> bool:
    """Whether two (listed, collected) pairs say the same."""
    return all(np.array_equal(a, b) for a, b in zip(tables, others, strict=True))


def _contains(sorted_roots: np.ndarray, root: bytes) -> bool:
    at = int(np.searchsorted(sorted_roots, np.void(root)))
    return at < len(sorted_roots) and sorted_roots[at].tobytes() == root


# -- writing --------------------------------------------------------------------------


def encode(covered: int, anchor: str, listed: np.ndarray, collected: np.ndarray) -> bytes:
    """The index of a prefix that ends at ``covered``, its last record's checksum ``anchor``."""
    header = _HEADER.pack(
        MAGIC, VERSION, PAGE_ENTRIES, covered, len(listed), len(collected), anchor.encode()
    )
    check = digest_bytes(header)[:CHECK_SIZE]
    pieces = [header, check]
    for table, rows in ((_LISTED, listed), (_COLLECTED, collected)):
        raw = rows.tobytes()
        step = PAGE_ENTRIES * rows.dtype.itemsize
        for number, start in enumerate(range(0, len(raw), step)):
            page = raw[start : start + step]
            pieces += [page, _page_check(check, table, number, page)]
    return b"".join(pieces)


def _page_check(header_check: bytes, table: bytes, number: int, page: bytes) -> bytes:
    return digest_bytes(header_check + table + number.to_bytes(8, "little") + page)[:CHECK_SIZE]


def _table_bytes(count: int, width: int) -> int:
    return count * width + -(-count // PAGE_ENTRIES) * CHECK_SIZE


# -- reading --------------------------------------------------------------------------


class ReflogIndex:
    """An index of ``size`` bytes read through ``read``; each page checked when first used.

    Raises IndexCorruptError (from the constructor or any lookup) when the
    bytes are not an index of this version, are damaged, or claim more
    entries than ``max_entries`` (a bound the caller takes from the log's
    size, so that no count read here is used before it is checked).
    """

    def __init__(self, read: Read, size: int, *, max_entries: int) -> None:
        head = read(0, HEADER_SIZE)
        if len(head) != HEADER_SIZE:
            raise _unusable("it is shorter than its header")
        fields, check = head[: _HEADER.size], head[_HEADER.size :]
        magic, version, per_page, covered, listed, collected, anchor = _HEADER.unpack(fields)
        if magic != MAGIC or version != VERSION or per_page != PAGE_ENTRIES:
            raise _unusable("it is not a reflog index of this version")
        if digest_bytes(fields)[:CHECK_SIZE] != check:
            raise _unusable("its header fails its checksum")
        if covered == 0 or listed + collected > max_entries:
            raise _unusable("it claims more entries than its log has records")
        listed_bytes = _table_bytes(listed, LISTED.itemsize)
        if size != HEADER_SIZE + listed_bytes + _table_bytes(collected, COLLECTED.itemsize):
            raise _unusable("its size does not match its header")
        try:
            self.anchor = anchor.decode("ascii")
        except UnicodeDecodeError:
            raise _unusable("its anchor is not a checksum") from None
        self.covered = covered
        self._read, self._check = read, check
        self._tables = {
            _LISTED: (HEADER_SIZE, listed, LISTED),
            _COLLECTED: (HEADER_SIZE + listed_bytes, collected, COLLECTED),
        }
        self._pages: dict[tuple[bytes, int], np.ndarray] = {}

    def _page(self, table: bytes, number: int) -> np.ndarray:
        rows = self._pages.get((table, number))
        if rows is not None:
            return rows
        start, count, dtype = self._tables[table]
        length = min(PAGE_ENTRIES, count - number * PAGE_ENTRIES) * dtype.itemsize
        offset = start + number * (PAGE_ENTRIES * dtype.itemsize + CHECK_SIZE)
        data = self._read(offset, length + CHECK_SIZE)
        page, check = data[:length], data[length:]
        if (
            len(data) != length + CHECK_SIZE
            or _page_check(self._check, table, number, page) != check
        ):
            raise _unusable(f"page {number} of its {table.decode()} table fails its checksum")
        rows = np.frombuffer(page, dtype=dtype)
        if table == _LISTED and not bool(np.all(rows["id"][1:] >= rows["id"][:-1])):
            raise _unusable(f"page {number} of its listed table is not sorted")
        self._pages[table, number] = rows
        return rows

    def _count_pages(self, table: bytes) -> int:
        return -(-self._tables[table][1] // PAGE_ENTRIES)

    def _first_page(self, table: bytes, reaches: Callable[[np.void], bool]) -> int:
        """The first page whose last entry ``reaches`` the key sought (the count if none)."""
        low, high = 0, self._count_pages(table)
        while low < high:
            middle = (low + high) // 2
            if reaches(self._page(table, middle)[-1]):
                high = middle
            else:
                low = middle + 1
        return low

    def with_id(self, generation: int) -> list[Listing]:
        """What the prefix lists under id ``generation``, in listing order."""
        found: list[Listing] = []
        number = self._first_page(_LISTED, lambda row: int(row["id"]) >= generation)
        while number < self._count_pages(_LISTED):
            rows = self._page(_LISTED, number)
            start = int(np.searchsorted(rows["id"], generation, side="left"))
            stop = int(np.searchsorted(rows["id"], generation, side="right"))
            found += [
                Listing(
                    row["root"].tobytes(), generation, int(row["order"]), int(row["line"]), True
                )
                for row in rows[start:stop]
            ]
            if len(found) > MAX_SAME_ID:
                raise _unusable(f"it lists more than {MAX_SAME_ID} roots under id {generation}")
            if stop < len(rows):
                break
            number += 1
        return sorted(found, key=lambda listing: listing.order)

    def collects(self, root: bytes) -> bool:
        """Whether the prefix collected ``root``."""
        number = self._first_page(_COLLECTED, lambda row: row.tobytes() >= root)
        if number == self._count_pages(_COLLECTED):
            return False
        return _contains(self._page(_COLLECTED, number), root)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Both tables whole, every page checked: what a writer extends."""
        listed, collected = self._whole(_LISTED), self._whole(_COLLECTED)
        ids, orders = listed["id"], listed["order"]
        ascending = (ids[1:] > ids[:-1]) | ((ids[1:] == ids[:-1]) & (orders[1:] >= orders[:-1]))
        if not bool(np.all(ascending)):
            raise _unusable("its listed table is not sorted")
        if not np.array_equal(np.unique(collected), collected):
            raise _unusable("its collected table is not sorted")
        return listed, collected

    def _whole(self, table: bytes) -> np.ndarray:
        """One table in one read, each page's check verified."""
        start, count, dtype = self._tables[table]
        data = self._read(start, _table_bytes(count, dtype.itemsize))
        step = PAGE_ENTRIES * dtype.itemsize + CHECK_SIZE
        entries = bytearray()
        for number, offset in enumerate(range(0, len(data), step)):
            page = data[offset : offset + step]
            if _page_check(self._check, table, number, page[:-CHECK_SIZE]) != page[-CHECK_SIZE:]:
                raise _unusable(f"page {number} of its {table.decode()} table fails its checksum")
            entries += page[:-CHECK_SIZE]
        if len(entries) != count * dtype.itemsize:
            raise _unusable(f"its {table.decode()} table is short")
        return np.frombuffer(bytes(entries), dtype=dtype)


def _unusable(why: str) -> IndexCorruptError:
    return IndexCorruptError(f"the reflog index is unusable: {why}")


def lookup(index: ReflogIndex, tail: Summary, generation: int) -> list[Listing]:
    """The roots listed under id ``generation`` by the index's prefix, then by ``tail``.

    In listing order, as :func:`merge` would list them. A listing with
    ``from_index`` is the index's word: the caller checks the record it names.
    (Where a crafted log lists one root under two ids, the position of a
    root that only the tail lists under ``generation`` may differ.)
    """
    found: dict[bytes, Listing] = {}
    for listing in index.with_id(generation):
        later = tail.listed.get(listing.root)
        if listing.root in tail.collected or (later is not None and later.generation != generation):
            continue
        found.setdefault(listing.root, listing)
    for listing in tail.listed.values():
        if listing.generation != generation or listing.root in found:
            continue
        if not index.collects(listing.root):
            found[listing.root] = listing
    return sorted(found.values(), key=lambda listing: listing.order)
