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
line; the number of its last record).

The index is a few *segments*, each summarising consecutive records, oldest
first, so that a writer extending it summarises only the new records: it
adds a segment, then merges the newest two while the older one is less than
twice the size of the newer (a binary counter: a record is rewritten about
log2(n) times in all, and there are about log2(n) segments). A lookup by id
reads, in the one segment whose id range holds it, the page keys and the
page they point to (and in each segment that collects anything, the same
for each root found); the caller checks every record a hit names against
that record's own line checksum, id and root, and reads the records after
``covered`` itself. Nothing here touches storage: callers hand
in a function that reads the index's bytes.

Layout, little-endian::

    segment    header: magic "CSRLXSEG" | u32 version | u32 entries per page
               | u64 listed | u64 collected | u64 lowest and u64 highest id listed
               (0 and 0 when none) | 16 bytes: blake3 of the rest of the segment
               | 16 bytes: blake3 of the header before them
               page keys: the u64 id of each listed page's last entry, the root
               of each collected page's last entry, then a 16-byte check
               listed pages: up to 64 entries of (u64 id, u64 listing position,
               u64 record position, 32-byte root), then a 16-byte check
               collected pages: up to 64 sorted 32-byte roots, then a 16-byte check
    ...        more segments
    directory  per segment: u64 offset, u64 size
    footer     magic "CSRLXIDX" | u32 version | u32 segments | u64 covered
               | 32 ASCII hex digits: the checksum of the log's last covered record
               | 16 bytes: blake3 of the directory and the footer before them

A page's check is the first 16 bytes of blake3(table letter | u64 page
number | entries). Damage anywhere makes the index unusable
(IndexCorruptError), never wrong: the reader then reads the whole log, and
the next rewrite replaces it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from castore.errors import IndexCorruptError
from castore.format.hashing import digest_bytes
from castore.repo.records import Record

VERSION = 1
PAGE_ENTRIES = 64
CHECK_SIZE = 16
_SEGMENT = struct.Struct("<8sIIQQQQ16s")
_FOOTER = struct.Struct("<8sIIQ32s")
_PLACE = struct.Struct("<QQ")
SEGMENT_HEADER = _SEGMENT.size + CHECK_SIZE
FOOTER_SIZE = _FOOTER.size + CHECK_SIZE
MAX_SEGMENTS = 64  # a binary counter of 2**64 records has fewer
# Roots as raw void: numpy's bytes type would drop a digest's trailing zero bytes.
LISTED = np.dtype([("id", "<u8"), ("order", "<u8"), ("line", "<u8"), ("root", "V32")])
COLLECTED = np.dtype("V32")
_LISTED, _COLLECTED = b"L", b"C"
# More roots under one id is damage: castore publishes one root per id (a lost ref's
# repair can log a second), so a lookup never checks more records than this.
MAX_SAME_ID = 64

Read = Callable[[int, int], bytes]  # (offset, length) -> the bytes there
Tables = tuple[np.ndarray, np.ndarray]  # (listed, collected)


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

    def tables(self) -> Tables:
        """(listed, collected) sorted as a segment stores them."""
        listed = np.array(
            [(e.generation, e.order, e.line, e.root) for e in self.listed.values()], dtype=LISTED
        )
        return _by_id(listed), np.array(sorted(self.collected), dtype=COLLECTED)


def _by_id(listed: np.ndarray) -> np.ndarray:
    return listed[np.lexsort((listed["order"], listed["id"]))]


def merge(older: Tables, newer: Tables) -> Tables:
    """The tables of two runs of records, ``older`` just before ``newer``.

    A root is listed after both if either lists it and neither collected it;
    where both list it, the newer gives its id and record, the older its position.
    """
    (listed, collected), (later, dropped) = older, newer
    listed = listed[~np.isin(listed["root"], dropped)].copy()
    by_root = later[np.argsort(later["root"], kind="stable")]
    again = np.flatnonzero(np.isin(listed["root"], by_root["root"]))
    found = by_root[np.searchsorted(by_root["root"], listed["root"][again])]
    listed["id"][again], listed["line"][again] = found["id"], found["line"]
    fresh = ~np.isin(later["root"], listed["root"]) & ~np.isin(later["root"], collected)
    combined = np.concatenate([listed, later[fresh]])
    return _by_id(combined), np.union1d(collected, dropped).astype(COLLECTED)


def same_tables(tables: Tables, others: Tables) -> bool:
    """Whether two (listed, collected) pairs say the same."""
    return all(np.array_equal(a, b) for a, b in zip(tables, others, strict=True))


def _contains(sorted_roots: np.ndarray, root: bytes) -> bool:
    at = int(np.searchsorted(sorted_roots, np.void(root)))
    return at < len(sorted_roots) and sorted_roots[at].tobytes() == root


# -- writing --------------------------------------------------------------------------


def encode_segment(tables: Tables) -> bytes:
    """One segment holding ``tables`` (sorted)."""
    listed, collected = tables
    fences = _last_of_pages(listed["id"]).tobytes() + _last_of_pages(collected).tobytes()
    pages = [fences, _check(fences)]
    for table, rows in ((_LISTED, listed), (_COLLECTED, collected)):
        raw = rows.tobytes()
        step = PAGE_ENTRIES * rows.dtype.itemsize
        for number, start in enumerate(range(0, len(raw), step)):
            page = raw[start : start + step]
            pages += [page, _page_check(table, number, page)]
    body = b"".join(pages)
    ids = (int(listed["id"][0]), int(listed["id"][-1])) if len(listed) else (0, 0)
    fields = _SEGMENT.pack(
        b"CSRLXSEG", VERSION, PAGE_ENTRIES, len(listed), len(collected), *ids, _check(body)
    )
    return fields + _check(fields) + body


def encode_index(segments: list[bytes], covered: int, anchor: str) -> bytes:
    """The index of a prefix that ends at ``covered``, its last record's checksum ``anchor``."""
    places, offset = [], 0
    for segment in segments:
        places.append(_PLACE.pack(offset, len(segment)))
        offset += len(segment)
    directory = b"".join(places)
    footer = _FOOTER.pack(b"CSRLXIDX", VERSION, len(segments), covered, anchor.encode())
    return b"".join([*segments, directory, footer, _check(directory + footer)])


def build(summary: Summary, covered: int, anchor: str) -> bytes:
    """An index of one segment: the first, or one written afresh from the whole log."""
    return encode_index([encode_segment(summary.tables())], covered, anchor)


def extend(index: ReflogIndex, tail: Summary, covered: int, anchor: str) -> bytes:
    """``index`` with a segment of the records ``tail`` summarises (those up to ``covered``).

    Segments are copied as they are (each checked whole first), then the
    newest two merged while the older holds less than twice the newer's entries.
    """
    pieces: list[tuple[int, bytes | None, Tables | None]] = [
        (segment.entries, segment.whole(), None) for segment in index.segments
    ]
    listed, collected = tail.tables()
    pieces.append((len(listed) + len(collected), None, (listed, collected)))
    while len(pieces) > 1 and (pieces[-2][0] < 2 * pieces[-1][0] or len(pieces) > MAX_SEGMENTS):
        newer, older = pieces.pop(), pieces.pop()
        merged = merge(_tables_of(older), _tables_of(newer))
        pieces.append((len(merged[0]) + len(merged[1]), None, merged))
    segments = [piece[1] or encode_segment(_tables_of(piece)) for piece in pieces]
    return encode_index(segments, covered, anchor)


def _tables_of(piece: tuple[int, bytes | None, Tables | None]) -> Tables:
    _, raw, tables = piece
    if tables is not None:
        return tables
    assert raw is not None
    return _Segment(lambda at, n: raw[at : at + n], 0, len(raw)).tables()


def _last_of_pages(keys: np.ndarray) -> np.ndarray:
    """The key of each page's last entry: where a lookup finds its page in one read."""
    pages = -(-len(keys) // PAGE_ENTRIES)
    return keys[np.minimum(np.arange(1, pages + 1) * PAGE_ENTRIES, len(keys)) - 1]


def _page_check(table: bytes, number: int, page: bytes) -> bytes:
    return _check(table + number.to_bytes(8, "little") + page)


def _check(data: bytes) -> bytes:
    return digest_bytes(data)[:CHECK_SIZE]


def _table_bytes(count: int, width: int) -> int:
    return count * width + -(-count // PAGE_ENTRIES) * CHECK_SIZE


# -- reading --------------------------------------------------------------------------


class _Segment:
    """One segment at ``offset`` of ``size`` bytes; its pages checked when first read."""

    def __init__(self, read: Read, offset: int, size: int) -> None:
        head = read(offset, SEGMENT_HEADER)
        if len(head) != SEGMENT_HEADER:
            raise _unusable("a segment is shorter than its header")
        fields, check = head[: _SEGMENT.size], head[_SEGMENT.size :]
        magic, version, per_page, listed, collected, low, high, body = _SEGMENT.unpack(fields)
        if magic != b"CSRLXSEG" or version != VERSION or per_page != PAGE_ENTRIES:
            raise _unusable("a segment is not one of this version")
        if _check(fields) != check:
            raise _unusable("a segment's header fails its checksum")
        listed_pages, collected_pages = -(-listed // PAGE_ENTRIES), -(-collected // PAGE_ENTRIES)
        fences = listed_pages * 8 + collected_pages * COLLECTED.itemsize + CHECK_SIZE
        listed_bytes = _table_bytes(listed, LISTED.itemsize)
        tables = listed_bytes + _table_bytes(collected, COLLECTED.itemsize)
        if size != SEGMENT_HEADER + fences + tables:
            raise _unusable("a segment's size does not match its header")
        self._read, self._offset, self._size, self._body = read, offset, size, body
        self._ids = range(low, high + 1) if listed else range(0)
        self.entries = listed + collected
        self._fence_place = (offset + SEGMENT_HEADER, fences, listed_pages)
        self._fences: dict[bytes, np.ndarray] = {}
        start = offset + SEGMENT_HEADER + fences
        self._tables = {
            _LISTED: (start, listed, LISTED),
            _COLLECTED: (start + listed_bytes, collected, COLLECTED),
        }
        self._pages: dict[tuple[bytes, int], np.ndarray] = {}

    def _fence(self, table: bytes) -> np.ndarray:
        """The key of each page's last entry in ``table`` (one read for both tables)."""
        if not self._fences:
            offset, length, listed_pages = self._fence_place
            data = self._read(offset, length)
            body, check = data[:-CHECK_SIZE], data[-CHECK_SIZE:]
            if len(data) != length or _check(body) != check:
                raise _unusable("a segment's page keys fail their checksum")
            self._fences[_LISTED] = np.frombuffer(body[: listed_pages * 8], dtype="<u8")
            self._fences[_COLLECTED] = np.frombuffer(body[listed_pages * 8 :], dtype=COLLECTED)
        return self._fences[table]

    def _page(self, table: bytes, number: int) -> np.ndarray:
        rows = self._pages.get((table, number))
        if rows is not None:
            return rows
        start, count, dtype = self._tables[table]
        length = min(PAGE_ENTRIES, count - number * PAGE_ENTRIES) * dtype.itemsize
        offset = start + number * (PAGE_ENTRIES * dtype.itemsize + CHECK_SIZE)
        data = self._read(offset, length + CHECK_SIZE)
        page, check = data[:length], data[length:]
        if len(data) != length + CHECK_SIZE or _page_check(table, number, page) != check:
            raise _unusable(f"page {number} of a {table.decode()} table fails its checksum")
        rows = np.frombuffer(page, dtype=dtype)
        if table == _LISTED and not bool(np.all(rows["id"][1:] >= rows["id"][:-1])):
            raise _unusable(f"page {number} of a listed table is not sorted")
        self._pages[table, number] = rows
        return rows

    def _count_pages(self, table: bytes) -> int:
        return -(-self._tables[table][1] // PAGE_ENTRIES)

    def _first_page(self, table: bytes, key: int | np.void) -> int:
        """The first page whose last entry is at least ``key`` (the page count if none)."""
        return int(np.searchsorted(self._fence(table), key, side="left"))

    def with_id(self, generation: int) -> list[Listing]:
        """What the segment lists under id ``generation``."""
        found: list[Listing] = []
        if generation not in self._ids:
            return found  # by its header: most segments, since ids grow with the log
        number = self._first_page(_LISTED, generation)
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
        return found

    def collects(self, root: bytes) -> bool:
        """Whether the segment's records collect ``root``."""
        if not self._tables[_COLLECTED][1]:
            return False
        number = self._first_page(_COLLECTED, np.void(root))
        if number == self._count_pages(_COLLECTED):
            return False
        return _contains(self._page(_COLLECTED, number), root)

    def whole(self) -> bytes:
        """The segment's bytes, its body checked whole (one hash, not one a page)."""
        data = self._read(self._offset, self._size)
        if len(data) != self._size or _check(data[SEGMENT_HEADER:]) != self._body:
            raise _unusable("a segment fails its checksum")
        return data

    def tables(self) -> Tables:
        """Both tables (the segment checked whole), checked sorted."""
        data = self.whole()
        whole = []
        for start, count, dtype in self._tables.values():  # past the page keys
            region = data[start - self._offset :][: _table_bytes(count, dtype.itemsize)]
            step = PAGE_ENTRIES * dtype.itemsize + CHECK_SIZE
            entries = b"".join(
                region[at : at + step - CHECK_SIZE] for at in range(0, len(region), step)
            )
            whole.append(np.frombuffer(entries[: count * dtype.itemsize], dtype=dtype))
        listed, collected = whole
        ids, orders = listed["id"], listed["order"]
        ascending = (ids[1:] > ids[:-1]) | ((ids[1:] == ids[:-1]) & (orders[1:] >= orders[:-1]))
        if not bool(np.all(ascending)) or (len(ids) and range(ids[0], ids[-1] + 1) != self._ids):
            raise _unusable("a listed table is not sorted, or not as its header says")
        if not np.array_equal(np.unique(collected), collected):
            raise _unusable("a collected table is not sorted")
        return listed, collected


class ReflogIndex:
    """An index of ``size`` bytes read through ``read``.

    Raises IndexCorruptError (from the constructor or any lookup) when the
    bytes are not an index of this version, are damaged, or claim more
    entries than ``max_entries`` (a bound the caller takes from the log's
    size, so that no count read here is used before it is checked).
    """

    def __init__(self, read: Read, size: int, *, max_entries: int) -> None:
        first = max(0, size - FOOTER_SIZE - MAX_SEGMENTS * _PLACE.size)
        tail = read(first, size - first)  # the footer and any directory, in one read
        if size < FOOTER_SIZE or len(tail) != size - first:
            raise _unusable("it is shorter than its footer")
        fields = tail[-FOOTER_SIZE:-CHECK_SIZE]
        magic, version, count, covered, anchor = _FOOTER.unpack(fields)
        if magic != b"CSRLXIDX" or version != VERSION or not 0 < count <= MAX_SEGMENTS:
            raise _unusable("it is not a reflog index of this version")
        start = size - FOOTER_SIZE - count * _PLACE.size  # where the directory begins
        if start < 0:
            raise _unusable("it is shorter than its directory")
        directory = tail[start - first : -FOOTER_SIZE]
        if _check(directory + fields) != tail[-CHECK_SIZE:]:
            raise _unusable("its footer fails its checksum")
        if covered == 0 or not anchor.isalnum():
            raise _unusable("it covers no records")
        self.covered, self.anchor = covered, anchor.decode("ascii")
        self.segments: list[_Segment] = []
        expected = 0
        for offset, length in _PLACE.iter_unpack(directory):
            if offset != expected or offset + length > start:
                raise _unusable("its segments do not tile it")
            self.segments.append(_Segment(read, offset, length))
            expected = offset + length
        if expected != start:
            raise _unusable("its segments do not tile it")
        if sum(segment.entries for segment in self.segments) > max_entries:
            raise _unusable("it claims more entries than its log has records")

    def tables(self) -> Tables:
        """What the whole prefix says (every page checked): the segments merged."""
        tables = self.segments[0].tables()
        for segment in self.segments[1:]:
            tables = merge(tables, segment.tables())
        return tables


def _unusable(why: str) -> IndexCorruptError:
    return IndexCorruptError(f"the reflog index is unusable: {why}")


def lookup(index: ReflogIndex, tail: Summary, generation: int) -> list[Listing]:
    """The roots listed under id ``generation`` by the index's prefix, then by ``tail``.

    In listing order, as :func:`merge` would list them: a root that any
    segment or the tail collects is not listed. A listing with ``from_index``
    is the index's word: the caller checks the record it names. (Where a
    crafted log lists one root under two ids, a root listed under
    ``generation`` by a segment and under another id by a later one counts.)
    """
    found: dict[bytes, Listing] = {}
    for segment in index.segments:
        for listing in segment.with_id(generation):
            found.setdefault(listing.root, listing)
    for listing in tail.listed.values():
        if listing.generation == generation:
            found.setdefault(listing.root, listing)
    kept = []
    for root, listing in found.items():
        later = tail.listed.get(root)
        if root in tail.collected or (later is not None and later.generation != generation):
            continue
        if not any(segment.collects(root) for segment in index.segments):
            kept.append(listing)
    return sorted(kept, key=lambda listing: listing.order)
