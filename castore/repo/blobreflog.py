"""Format 3's reflog: one create-only blob per record, and the records' derived index.

Names (docs/FORMAT_BLOBS.md, "Refs, reflog records and tags as blobs")::

    logs/RUN/NNNNNNNNNNNN        create-only: one reflog record, NNN... its 12-digit
                                 sequence number (1, 2, ...), in log order
    logs/RUN/index.NNNNNNNNNNNN  create-only, derived: the index of records 1 to NNN...
                                 (castore.repo.reflogindex), so that a new handle finds
                                 a generation by id without reading every record

A reflog record is created only if absent, under the next sequence number; a
writer that finds its number taken tries the next one, so no record is ever
overwritten. Record numbers are dense (records are never deleted), which is
what lets a handle that keeps its view read only what was appended since:
it probes the next number until one is absent.

The index is written by appends (under the run's lease) once REINDEX_RECORDS
records lie past the newest index's, as a new blob named by the last record
it covers; the older ones are then deleted. A reader lists ``index.`` names
(one request), reads the newest, checks it against its last record, reads
the records after it and the records its hits name (each checked against
its own checksum, id and root): a lookup costs a handful of requests however
long the log. An index that is absent, damaged or disagrees with the records
is not used: the reader reads every record, as before.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from castore.blob.base import BlobStore
from castore.errors import (
    BlobExistsError,
    BlobNotFoundError,
    BlobTooLargeError,
    CastoreError,
    IndexCorruptError,
)
from castore.format.hashing import digest_bytes
from castore.repo.base import Reflog
from castore.repo.records import (
    PUBLISH_ACTIONS,
    Record,
    ReflogView,
    is_reflog_record,
    is_valid_name,
    validate_run_name,
)
from castore.repo.reflogindex import (
    Listing,
    ReflogIndex,
    Summary,
    build,
    extend,
    lookup,
    same_tables,
)

SEQUENCE_DIGITS = 12
_SEQUENCE = re.compile(f"[0-9]{{{SEQUENCE_DIGITS}}}")
_CHECK_CHARS = 32  # hex digits of blake3(JSON) after the record's tab, as in a local reflog
_READ_THREADS = 8  # record GETs in flight when a handle reads a run's whole log
# Records past the newest index that make an append write the next one: a lookup by
# id reads at most about this many records besides the index and the ones it names.
REINDEX_RECORDS = 16
MAX_INDEX_BLOB = 64 << 20  # about a million records: a larger index is not read


def record_blob(run: str, sequence: int) -> str:
    return f"logs/{validate_run_name(run)}/{sequence:0{SEQUENCE_DIGITS}d}"


def index_blob(run: str, covered: int) -> str:
    return f"logs/{validate_run_name(run)}/index.{covered:0{SEQUENCE_DIGITS}d}"


def runs_under(blobs: BlobStore, prefix: str, *, nested: bool) -> list[str]:
    """The run segments of names ``PREFIX RUN`` (``PREFIX RUN/...`` when ``nested``)."""
    found: set[str] = set()
    for name in blobs.list(prefix):
        run, slash, _ = name[len(prefix) :].partition("/")
        if bool(slash) == nested and is_valid_name(run):
            found.add(run)
    return sorted(found)


def encode_record(record: Record) -> bytes:
    """A record blob: ``JSON <TAB> 32 hex digits of blake3(JSON) <LF>`` (a local reflog line)."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return f"{text}\t{digest_bytes(text.encode()).hex()[:_CHECK_CHARS]}\n".encode()


def decode_record(data: bytes, run: str) -> Record | None:
    """The record a blob holds, or None when it is damaged (create is atomic: nothing is torn)."""
    text, tab, rest = data.decode("utf-8", "replace").rpartition("\t")
    if not tab or rest != digest_bytes(text.encode()).hex()[:_CHECK_CHARS] + "\n":
        return None
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return record if is_reflog_record(record, run) else None


class BlobReflogView(ReflogView):
    """A view and the sequence number of the next record it has not read."""

    def __init__(self) -> None:
        super().__init__()
        self.next = 1


class BlobReflog(Reflog):
    """``logs/RUN/NNNNNNNNNNNN`` record blobs, created once each, read in number order.

    ``damaged`` positions are sequence numbers (the blob name's only variable
    part): a record blob that fails its checksum or shape, or a number missing
    below the highest one (records are never deleted, so a gap is damage).

    Costs, for a log of n records: a fresh view lists the run's names (on S3,
    one request per 1,000) and reads every record (n GETs, 8 in flight); a kept view probes
    one GET per record appended since, plus one that finds none. Reading from
    the end (``records_backwards``, ``last_published`` on a new handle) lists
    every name, because a list is ascending only and the blob interface has no
    start-after, then reads only the records consumed. An append costs one
    create when this handle knows the end, else that listing first. ``runs``
    lists every record of every run (the interface lists no "directories").
    """

    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs
        self._views: dict[str, BlobReflogView] = {}
        self._next_append: dict[str, int] = {}
        self._guard = threading.Lock()
        self._indexed_to: dict[str, int] = {}  # the last record the newest index covers
        self._unindexed: set[str] = set()  # runs whose index this handle failed to write

    def location(self, run: str) -> str:
        return f"the reflog blobs logs/{run}/ (positions are record numbers)"

    def runs(self) -> list[str]:
        return runs_under(self.blobs, "logs/", nested=True)

    def _sequences(self, run: str) -> list[int]:
        """The record numbers present, ascending (other names under the prefix are ignored)."""
        prefix = f"logs/{validate_run_name(run)}/"
        tails = (name[len(prefix) :] for name in self.blobs.list(prefix))
        return [int(tail) for tail in tails if _SEQUENCE.fullmatch(tail)]

    def _load(self, run: str, sequence: int) -> tuple[Record | None, bool]:
        """(the record, whether the blob exists)."""
        data = self._load_bytes(run, sequence)
        return (None, False) if data is None else (decode_record(data, run), True)

    def _load_bytes(self, run: str, sequence: int) -> bytes | None:
        """A record blob's bytes (None: absent; empty: too large to be a record)."""
        try:
            found = self.blobs.read_versioned(record_blob(run, sequence))
        except BlobTooLargeError:
            return b""
        return None if found is None else found[0]

    def append(self, run: str, record: Record) -> None:
        validate_run_name(run)
        if not is_reflog_record(record, run):
            raise ValueError(f"not a reflog record of run {run!r}: {record!r}")
        data = encode_record(record)
        with self._guard:
            sequence = self._next_append.get(run)
        relisted = sequence is None
        if sequence is None:
            sequence = self._end(run) + 1
        while True:
            try:
                self.blobs.create(record_blob(run, sequence), data)
                break
            except BlobExistsError:
                # Another writer took this number: never overwrite, take a later one.
                if relisted:
                    sequence += 1
                else:
                    sequence, relisted = max(sequence + 1, self._end(run) + 1), True
        with self._guard:
            self._next_append[run] = sequence + 1
        self._keep_index(run, sequence)

    def _end(self, run: str) -> int:
        sequences = self._sequences(run)
        return sequences[-1] if sequences else 0

    def view(self, run: str, *, fresh: bool = False) -> ReflogView:
        validate_run_name(run)
        with self._guard:
            view = None if fresh else self._views.get(run)
            if view is None:
                view = self._read_all(run)
            else:
                self._extend(run, view)
            self._views[run] = view
            return view

    def _read_all(self, run: str) -> BlobReflogView:
        view = BlobReflogView()
        present = self._sequences(run)
        have = set(present)
        numbers = range(1, (present[-1] if present else 0) + 1)

        def load(sequence: int) -> Record | None:
            return self._load(run, sequence)[0] if sequence in have else None

        # One GET per record: several in flight (on S3 a fresh view of a long log
        # would otherwise wait one round trip per record).
        if len(numbers) > 1:
            with ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
                records = list(pool.map(load, numbers))
        else:
            records = [load(sequence) for sequence in numbers]
        for sequence, record in zip(numbers, records, strict=True):
            if record is None:
                view.damaged.append(sequence)  # a gap or a damaged blob
            else:
                view.add(record)
        view.next = (present[-1] if present else 0) + 1
        return view

    def _extend(self, run: str, view: BlobReflogView) -> None:
        while True:
            record, exists = self._load(run, view.next)
            if not exists:
                return
            if record is None:
                view.damaged.append(view.next)
            else:
                view.add(record)
            view.next += 1

    def cached_view(self, run: str) -> ReflogView | None:
        with self._guard:
            kept = run in self._views
        return self.view(run) if kept else None

    def records_backwards(self, run: str) -> Iterator[Record]:
        validate_run_name(run)
        return self._backwards(run, self._sequences(run))

    def _backwards(self, run: str, sequences: list[int]) -> Iterator[Record]:
        for sequence in reversed(sequences):
            record = self._load(run, sequence)[0]
            if record is not None:
                yield record

    def last_published(self, run: str) -> Record | None:
        view = self.cached_view(run)
        if view is None:
            return super().last_published(run)
        for record in reversed(view.records):
            if record["action"] in PUBLISH_ACTIONS:
                return dict(record)
        return None

    # -- the derived index (castore.repo.reflogindex) -----------------------------

    def listed_with_id(self, run: str, generation: int) -> list[str]:
        """Through the newest index when this handle keeps no view: a listing, the index,
        its last record, the records after it and the records its hits name; else (no
        usable index) every record, as :meth:`view` reads them."""
        validate_run_name(run)
        with self._guard:
            kept = run in self._views
        found = None if kept else self._indexed(run, generation)
        return super().listed_with_id(run, generation) if found is None else found

    def _indexed(self, run: str, generation: int) -> list[str] | None:
        index = self._newest_index(run)
        if index is None:
            return None
        tail, _ = _summarize(self._records_after(run, index.covered), run)
        try:
            found = lookup(index, tail, generation)
        except IndexCorruptError:
            return None
        if not all(self._confirms(run, listing) for listing in found if listing.from_index):
            return None  # the index disagrees with the records, which are the truth
        return [listing.root.hex() for listing in found]

    def _index_names(self, run: str) -> list[tuple[int, str]]:
        """(last record covered, name) of every index blob of ``run``, ascending."""
        prefix = f"logs/{validate_run_name(run)}/index."
        names = ((name[len(prefix) :], name) for name in self.blobs.list(prefix))
        return sorted((int(tail), name) for tail, name in names if _SEQUENCE.fullmatch(tail))

    def _newest_index(self, run: str) -> ReflogIndex | None:
        """The newest index blob, if it is whole and ends as its last record does."""
        names = self._index_names(run)
        if not names:
            return None
        covered, name = names[-1]
        size = self.blobs.head(name)
        if size is None or size > MAX_INDEX_BLOB:
            return None  # deleted since the listing (a newer one replaced it), or absurd
        try:
            data = self.blobs.get(name)
            index = ReflogIndex(lambda at, n: data[at : at + n], len(data), max_entries=covered)
        except (BlobNotFoundError, IndexCorruptError):
            return None
        last = self._load_bytes(run, covered)
        if (
            index.covered != covered
            or last is None
            or not last.endswith(f"\t{index.anchor}\n".encode())
        ):
            return None
        return index

    def _records_after(self, run: str, covered: int) -> list[tuple[int, bytes]]:
        """(number, bytes) of the records after ``covered``, up to the first number absent:
        one GET, then several in flight while records keep coming."""
        found: list[tuple[int, bytes]] = []
        with ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
            batch = 1
            while True:
                first = covered + len(found) + 1
                numbers = range(first, first + batch)
                blobs = pool.map(lambda sequence: self._load_bytes(run, sequence), numbers)
                for sequence, data in zip(numbers, blobs, strict=True):
                    if data is None:
                        return found
                    found.append((sequence, data))
                batch = _READ_THREADS

    def _confirms(self, run: str, listing: Listing) -> bool:
        """Whether record ``listing.line`` lists its root under its id: a hit, checked."""
        data = self._load_bytes(run, listing.line)
        record = decode_record(data, run) if data else None
        return (
            record is not None
            and record["action"] in PUBLISH_ACTIONS
            and record["generation"] == listing.generation
            and record["root"] == listing.root.hex()
        )

    def _keep_index(self, run: str, sequence: int) -> None:
        """After appending record ``sequence`` (under the run's lease): write the next index
        once REINDEX_RECORDS records lie past the newest one's. Failure costs only
        speed: the index is derived, so an error here is dropped."""
        if run in self._unindexed:
            return
        try:
            with self._guard:
                covered = self._indexed_to.get(run)
            if covered is None:
                names = self._index_names(run)
                covered = names[-1][0] if names else 0
            if sequence - covered >= REINDEX_RECORDS:
                covered = self._write_index(run, sequence)
            with self._guard:
                self._indexed_to[run] = covered
        except CastoreError:
            self._unindexed.add(run)

    def index_problem(self, run: str) -> str | None:
        index = self._newest_index(run)
        if index is None:
            return None  # absent, or fails its checks: never used
        try:
            tables = index.tables()
        except IndexCorruptError:
            return None
        summary, end = _summarize(self._records(run, up_to=index.covered), run)
        if end == (index.covered, index.anchor) and same_tables(tables, summary.tables()):
            return None
        return (
            f"the reflog index {index_blob(run, index.covered)} disagrees with the records "
            "it indexes: lookups by id would trust it; castore repair writes it afresh"
        )

    def rebuild_index(self, run: str) -> None:
        validate_run_name(run)
        self._write_index(run, 0, full=True)

    def _records(self, run: str, *, up_to: int | None = None) -> list[tuple[int, bytes | None]]:
        """(number, bytes) of every record present (up to ``up_to``), several GETs in flight."""
        present = [n for n in self._sequences(run) if up_to is None or n <= up_to]
        with ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
            blobs = pool.map(lambda number: self._load_bytes(run, number), present)
            return list(zip(present, blobs, strict=True))

    def _write_index(self, run: str, sequence: int, *, full: bool = False) -> int:
        """Write the index of records 1 to about ``sequence``; delete the older ones.
        Returns the last record it covers. ``full``: from every record, not the last index."""
        index = None if full else self._newest_index(run)
        built = None
        if index is not None:
            tail, end = _summarize(self._records_after(run, index.covered), run)
            if end is not None and end[0] >= sequence:  # else a gap: read every record
                try:
                    built = end, extend(index, tail, *end)
                except IndexCorruptError:
                    built = None
        if built is None:
            summary, end = _summarize(self._records(run), run)
            if end is None:
                return 0
            built = end, build(summary, *end)
        (covered, _), data = built
        name = index_blob(run, covered)
        if full:
            self.blobs.delete(name)  # repair: the index of these records may be a wrong one
        try:
            self.blobs.create(name, data)
        except BlobExistsError:
            pass  # another writer indexed the same records
        for older, other in self._index_names(run):
            if older < covered:
                self.blobs.delete(other)
        return covered


def _summarize(
    records: Iterable[tuple[int, bytes | None]], run: str
) -> tuple[Summary, tuple[int, str] | None]:
    """What record blobs ``(number, bytes)`` say, and the number and checksum of the last
    intact one (None if none)."""
    summary, end = Summary(), None
    for sequence, data in records:
        record = decode_record(data, run) if data else None
        if data and record is not None:
            summary.add(record, sequence)
            end = (sequence, data[-1 - _CHECK_CHARS : -1].decode("ascii"))
    return summary, end
