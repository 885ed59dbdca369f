"""The reflog of a store directory: ``logs/RUN.reflog`` and its derived index ``logs/RUN.idx``.

One checksummed JSON line per record (docs/FORMAT.md, "Reflog")::

    JSON <TAB> 32 hex digits of blake3(JSON) <LF>

appended under the run's lock and fsynced; a failed append truncates back to
where it began, and a crash mid-append leaves a torn line the next append ends.
Readers keep what they parsed and read only what was appended since.

``logs/RUN.idx`` (castore.repo.reflogindex) lets a handle that has parsed
nothing find a generation by id reading a few records: appends rewrite it
once REINDEX_BYTES of the log lie past it, and lookups check every record it
points at against the log's own line (docs/FORMAT.md, "Reflog index").
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from castore.errors import CastoreError, IndexCorruptError
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
from castore.support.safefs import (
    fsync_dir,
    is_store_dir,
    make_store_dir,
    open_store_file,
    write_all,
    write_error,
    writing,
)

_CHECK_CHARS = 32  # hex digits of blake3 after each reflog line's tab
_TAIL_PIECE = 1 << 12  # first bytes read from a reflog's end (doubling when not enough)
INDEX_SUFFIX = ".idx"  # logs/RUN.idx: the derived index of logs/RUN.reflog
# Bytes past the index's prefix (about 28 records) that make an append rewrite it: a
# lookup by id parses at most that many (12 us a record) besides the records its hits
# name; until then an append reads at most the index's footer and segment headers.
REINDEX_BYTES = 8 << 10
_MIN_LINE = 64  # no reflog line is shorter: bounds the entries an index may claim
_MAX_LINE = 1 << 12  # no record castore writes is longer (a host name is at most 255)
_LINE_GUESS = 512  # most are about 280 bytes: read this much first
_ANCHOR = 2 + _CHECK_CHARS  # "\t", the checksum, "\n": how an index's prefix must end


def names_in(directory: Path, run_of: Callable[[str], str | None]) -> list[str]:
    """Run names ``run_of(entry name)`` gives for the entries of ``directory``.

    Names only, nothing followed: a symlinked ref is listed and refused when read.
    """
    if not is_store_dir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        run = run_of(name)
        if run and is_valid_name(run):
            found.append(run)
    return found


class FileReflogView(ReflogView):
    """A reflog file's view, and where its parse stopped (to go on from there)."""

    def __init__(self, identity: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.identity = identity  # (st_dev, st_ino) of the file parsed
        self.offset = 0  # bytes parsed: the end of the last whole line
        self.lines = 0

    def feed(self, line: bytes, run: str) -> None:
        self.lines += 1
        record, damaged = _parse_reflog_line(line, run)
        if damaged:
            self.damaged.append(self.lines)
        if record is not None:
            self.add(record)


class LocalReflog(Reflog):
    """``logs/RUN.reflog``: ``JSON <TAB> 32 hex digits of blake3(JSON) <LF>`` per record."""

    def __init__(self, root: Path) -> None:
        self.logs_dir = root / "logs"
        self._views: dict[str, FileReflogView] = {}
        self._views_lock = threading.Lock()
        self._unindexed: set[str] = set()  # runs whose index this handle failed to write
        self._indexed_to: dict[str, int] = {}  # where each run's index ends, as last seen

    def path(self, run: str) -> Path:
        return self.logs_dir / f"{run}.reflog"

    def location(self, run: str) -> str:
        return str(self.path(run))

    def runs(self) -> list[str]:
        suffix = ".reflog"
        return names_in(
            self.logs_dir, lambda name: name[: -len(suffix)] if name.endswith(suffix) else None
        )

    def append(self, run: str, record: Record) -> None:
        validate_run_name(run)
        text = json.dumps(record, sort_keys=True, separators=(",", ":"))
        line = f"{text}\t{digest_bytes(text.encode()).hex()[:_CHECK_CHARS]}\n".encode()
        with writing("creating logs/", self.logs_dir):
            make_store_dir(self.logs_dir)
        path = self.path(run)
        created = not os.path.lexists(path)
        phase = f"appending to the reflog of run {run!r}"
        try:
            fd = open_store_file(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        except OSError as exc:
            raise write_error(phase, path, exc) from exc
        try:
            with writing(phase, path):
                _append_line(fd, line)
            self._keep_index(run, fd)
        finally:
            os.close(fd)
        if created:
            with writing(phase, path):
                fsync_dir(self.logs_dir)

    def view(self, run: str, *, fresh: bool = False) -> ReflogView:
        """Parse only the lines appended since the last call.

        The reflog only grows (appends under the run's ref lock; a failed append
        truncates back to where it began), so this keeps what it parsed and reads
        from where it stopped: a save or a lookup costs the same at the 10,000th
        generation as at the first. A file that shrank or was replaced is read
        from its start.
        """
        validate_run_name(run)
        if not is_store_dir(self.logs_dir):
            return ReflogView()
        try:
            fd = open_store_file(self.path(run), os.O_RDONLY)
        except FileNotFoundError:
            return ReflogView()
        with self._views_lock:
            try:
                info = os.fstat(fd)
                view = None if fresh else self._views.get(run)
                if (
                    view is None
                    or view.identity != (info.st_dev, info.st_ino)
                    or info.st_size < view.offset
                ):
                    view = FileReflogView(identity=(info.st_dev, info.st_ino))
                data = _read_from(fd, view.offset, info.st_size)
            finally:
                os.close(fd)
            whole = data.rfind(b"\n") + 1
            for line in data[:whole].split(b"\n")[:-1]:
                view.feed(line, run)
            view.offset += whole
            self._views[run] = view
            if whole == len(data):
                return view
            # An unfinished last line (a crash mid-append): part of this answer, not
            # kept, since the next append ends it with a newline before its own record.
            answer = view.copy()
            answer.feed(data[whole:], run)
            return answer

    def cached_view(self, run: str) -> ReflogView | None:
        if run not in self._views:
            return None
        return self.view(run)  # bring it up to date (appended lines only)

    def records_backwards(self, run: str) -> Iterator[Record]:
        """Read from the file's end in growing pieces."""
        validate_run_name(run)
        if not is_store_dir(self.logs_dir):
            return
        try:
            fd = open_store_file(self.path(run), os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            end = os.fstat(fd).st_size
            tail, piece = b"", _TAIL_PIECE
            while end > 0:
                start = max(0, end - piece)
                piece = min(2 * piece, 1 << 20)
                tail = _read_from(fd, start, end) + tail
                end = start
                lines = tail.split(b"\n")
                # The first piece may begin mid-line unless it starts the file.
                complete, tail = (lines, b"") if start == 0 else (lines[1:], lines[0])
                for line in reversed(complete):
                    record = _parse_reflog_line(line, run)[0]
                    if record is not None:
                        yield record
        finally:
            os.close(fd)

    # -- the derived index (castore.repo.reflogindex) -----------------------------

    def index_path(self, run: str) -> Path:
        return self.logs_dir / f"{run}{INDEX_SUFFIX}"

    def listed_with_id(self, run: str, generation: int) -> list[str]:
        """Through the index when this handle keeps no view: a page or two of it, the
        records its hits name and the lines past it; else (no usable index) the whole
        log, as :meth:`view` reads it."""
        validate_run_name(run)
        with self._views_lock:
            kept = run in self._views
        found = None if kept else self._indexed(run, generation)
        return super().listed_with_id(run, generation) if found is None else found

    def _indexed(self, run: str, generation: int) -> list[str] | None:
        """None when there is no usable index (or no log): the caller reads the view."""
        if not is_store_dir(self.logs_dir):
            return None
        try:
            fd = open_store_file(self.path(run), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            with self._index(run, fd, size) as index:
                if index is None:
                    return None
                tail, _ = _summarize(_read_from(fd, index.covered, size), index.covered, run)
                found = lookup(index, tail, generation)
            if not all(_names(fd, listing, run) for listing in found if listing.from_index):
                return None  # the index disagrees with the log, which is the truth
            return [listing.root.hex() for listing in found]
        except IndexCorruptError:
            return None
        finally:
            os.close(fd)

    @contextmanager
    def _index(self, run: str, log_fd: int, log_size: int) -> Iterator[ReflogIndex | None]:
        """The run's index if it is whole and its prefix is the log's (else None)."""
        try:
            fd = open_store_file(self.index_path(run), os.O_RDONLY)
        except (OSError, CastoreError):
            yield None  # absent, or not a regular file: it is only ever derived
            return
        try:
            yield _checked_index(fd, log_fd, log_size)
        finally:
            os.close(fd)

    def index_problem(self, run: str) -> str | None:
        validate_run_name(run)
        if not is_store_dir(self.logs_dir):
            return None
        try:
            fd = open_store_file(self.path(run), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            with self._index(run, fd, os.fstat(fd).st_size) as index:
                if index is None:
                    return None  # absent, or fails its checks: never used
                tables = index.tables()
                summary, end = _summarize(_read_from(fd, 0, index.covered), 0, run, whole=True)
                if end == (index.covered, index.anchor) and same_tables(tables, summary.tables()):
                    return None
                return (
                    f"the reflog index {self.index_path(run)} disagrees with the reflog it "
                    "indexes (was the reflog edited in place?): lookups by id would trust it; "
                    "castore repair writes it afresh"
                )
        except IndexCorruptError:
            return None
        finally:
            os.close(fd)

    def rebuild_index(self, run: str) -> None:
        validate_run_name(run)
        try:
            fd = open_store_file(self.path(run), os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            built = self._summarized(run, fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if built is not None:
            with writing(f"writing the reflog index of run {run!r}", self.index_path(run)):
                self._write_index(run, built[0])
            self._indexed_to[run] = built[1]

    def _keep_index(self, run: str, fd: int) -> None:
        """After an append (under the run lock): rewrite the index once REINDEX_BYTES of
        the log lie past its prefix, or build it once the log is that long.

        Failure costs only speed: the index is derived, so an error here is
        dropped and lookups read the log instead. A handle that could not write
        it (a directory it may not write) does not try again.
        """
        if run in self._unindexed:
            return
        try:
            size = os.fstat(fd).st_size
            known = self._indexed_to.get(run)
            if known is not None and size - known < REINDEX_BYTES:
                return  # as this handle last saw or wrote it: no read (a gc appends thousands)
            with self._index(run, fd, size) as index:
                covered = 0 if index is None else index.covered
                if size - covered < REINDEX_BYTES:
                    built = None
                elif index is not None:
                    built = self._extended(run, fd, size, index)
                else:
                    built = self._summarized(run, fd, size)
            if built is not None:
                data, covered = built
                self._write_index(run, data)
            self._indexed_to[run] = covered
        except (OSError, CastoreError):
            self._unindexed.add(run)

    def _extended(
        self, run: str, fd: int, size: int, index: ReflogIndex
    ) -> tuple[bytes, int] | None:
        """The index extended by the records past its prefix, and where it then ends."""
        tail, end = _summarize(_read_from(fd, index.covered, size), index.covered, run, whole=True)
        if end is None:
            return None  # nothing intact past the prefix
        try:
            return extend(index, tail, *end), end[0]
        except IndexCorruptError:
            return self._summarized(run, fd, size)

    def _summarized(self, run: str, fd: int, size: int) -> tuple[bytes, int] | None:
        """An index of the whole log, read from its start (the first, or after damage)."""
        summary, end = _summarize(_read_from(fd, 0, size), 0, run, whole=True)
        return None if end is None else (build(summary, *end), end[0])

    def _write_index(self, run: str, data: bytes) -> None:
        """Replace the index whole (a temp file renamed over it). Not synced: a torn or
        lost index fails its checks and is rebuilt, and the log it summarises is synced."""
        temp = self.logs_dir / f".{run}{INDEX_SUFFIX}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = open_store_file(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
            os.replace(temp, self.index_path(run))
        except BaseException:
            temp.unlink(missing_ok=True)
            raise


def _checked_index(fd: int, log_fd: int, log_size: int) -> ReflogIndex | None:
    """The index open on ``fd``, if it is whole and the log's bytes end its prefix as its
    anchor says (a log replaced or cut short since is not its log)."""
    try:
        index = ReflogIndex(
            lambda offset, length: _read_from(fd, offset, offset + length),
            os.fstat(fd).st_size,
            max_entries=log_size // _MIN_LINE,
        )
    except IndexCorruptError:
        return None
    if not _ANCHOR <= index.covered <= log_size:
        return None
    ending = _read_from(log_fd, index.covered - _ANCHOR, index.covered)
    return index if ending == f"\t{index.anchor}\n".encode() else None


def _summarize(
    data: bytes, start: int, run: str, *, whole: bool = False
) -> tuple[Summary, tuple[int, str] | None]:
    """What the reflog bytes ``data`` (read from offset ``start``) say, and where its last
    intact whole line ends, with that line's checksum (None if it has none).

    An unfinished last line (a crash mid-append) counts, as in :meth:`view`,
    unless ``whole``: an index covers whole lines only.
    """
    *complete, unfinished = data.split(b"\n")
    summary, end, position = Summary(), None, start
    for piece in complete:
        record = _parse_reflog_line(piece, run)[0]
        if record is not None:
            summary.add(record, position)
            end = (position + len(piece) + 1, piece[-_CHECK_CHARS:].decode("ascii"))
        position += len(piece) + 1
    if unfinished and not whole:
        record = _parse_reflog_line(unfinished, run)[0]
        if record is not None:
            summary.add(record, position)
    return summary, end


def _names(fd: int, listing: Listing, run: str) -> bool:
    """Whether the whole line at ``listing.line`` is an intact record listing its root
    under its id: an index's hit, checked against the log."""
    before = 1 if listing.line else 0
    data = _read_from(fd, listing.line - before, listing.line + _LINE_GUESS)
    end = data.find(b"\n", before)
    if end < 0:
        data = _read_from(fd, listing.line - before, listing.line + _MAX_LINE)
        end = data.find(b"\n", before)
    if before and data[:1] != b"\n":
        return False
    record = _parse_reflog_line(data[before:end], run)[0] if end >= 0 else None
    return (
        record is not None
        and record["action"] in PUBLISH_ACTIONS
        and record["generation"] == listing.generation
        and record["root"] == listing.root.hex()
    )


def _parse_reflog_line(line: bytes, run: str) -> tuple[Record | None, bool]:
    """(the record, None if the line holds none; whether the line is damage).

    A tab with a whole checksum after it means the write was complete (JSON
    holds no raw tab, so a torn prefix cannot look like this): a failed check
    there is damage, anything shorter a torn append.
    """
    text, _, check = line.decode("utf-8", "replace").rpartition("\t")
    if text and digest_bytes(text.encode()).hex()[:_CHECK_CHARS] == check:
        try:
            record = json.loads(text)
        except (ValueError, RecursionError):
            record = None
        if is_reflog_record(record, run):
            return record, False
    return None, bool(text) and len(check) >= _CHECK_CHARS


def _read_from(fd: int, start: int, end: int) -> bytes:
    pieces, offset = [], start
    while offset < end:
        piece = os.pread(fd, min(end - offset, 1 << 20), offset)
        if not piece:
            break
        pieces.append(piece)
        offset += len(piece)
    return b"".join(pieces)


def _append_line(fd: int, line: bytes) -> None:
    """Append one whole reflog line and sync it; a failed append leaves no torn record.

    Appends to a run's reflog happen under its ref lock, so the size read
    here is the end this line starts at.
    """
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        line = b"\n" + line  # end a torn record (a crash mid-append) so this one stays whole
    try:
        write_all(fd, line)
        os.fsync(fd)
    except OSError:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass  # the torn tail is skipped by readers and ended by the next append
        raise
