"""Refs: the one commit point of a generation, plus a durable reflog.

A ref file names the newest published root of a run. It is self-checking:

    magic "CASTREF\\n" | u16 version | u32 payload length | msgpack payload | blake3(all before)

Advancing it is a compare-and-swap under an exclusive ``flock``: re-read the
current value while holding the lock, refuse if it is not what the writer
based its generation on, then write a temp file, fsync it, ``os.replace`` it
over the ref and fsync the directory. Each advance is then appended to the
run's reflog (one JSON line with its own checksum) and fsynced.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import socket
import struct
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from castore.errors import (
    CastoreError,
    CorruptRefError,
    InvalidNameError,
    RefConflictError,
    StoreLockedError,
)
from castore.hashing import DIGEST_SIZE, Digest, digest_bytes
from castore.safefs import (
    is_store_dir,
    make_store_dir,
    open_store_file,
    read_store_file,
    regular_file_size,
    write_all,
    write_error,
    writing,
)

REF_MAGIC = b"CASTREF\n"
REF_VERSION = 1
_HEADER = struct.Struct("<8sHI")
_MAX_PAYLOAD = 1 << 16
# No valid ref or tag file is longer; reading stops there, so a file cannot pick a huge read.
_MAX_REF_FILE = _HEADER.size + _MAX_PAYLOAD + DIGEST_SIZE
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TAG_NAME = _RUN_NAME
PUBLISH_ACTIONS = ("advance", "recovered")  # reflog records that name a published root
_CHECK_CHARS = 32  # hex digits of blake3 after each reflog line's tab
_TAIL_PIECE = 1 << 12  # first bytes read from a reflog's end (doubling when not enough)
DEFAULT_LOCK_TIMEOUT = 30.0
# How long a save waits for a running garbage collection to finish.
DEFAULT_SAVE_WAIT = 600.0
STORE_LOCK = "store.lock"  # saves and tags: shared; garbage collection: exclusive
OPEN_LOCK = "open.lock"  # every open Store: shared; compaction: exclusive


def validate_run_name(run: str) -> str:
    """Return ``run`` if it is a safe run name, else raise InvalidNameError."""
    if not isinstance(run, str) or not _RUN_NAME.fullmatch(run) or ".." in run:
        raise InvalidNameError(
            f"invalid run name {run!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit, without '..'",
            run=run if isinstance(run, str) else repr(run),
        )
    return run


def validate_tag_name(name: str) -> str:
    """Return ``name`` if it is a safe tag name (the rules of run names)."""
    if not isinstance(name, str) or not _TAG_NAME.fullmatch(name) or ".." in name:
        raise InvalidNameError(
            f"invalid tag name {name!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit, without '..'"
        )
    return name


@dataclass(frozen=True)
class RefValue:
    """What a ref names: the newest root of ``run`` and its generation id."""

    run: str
    generation: int
    root: Digest
    time: float


def encode_ref(value: RefValue) -> bytes:
    payload = msgpack.packb(
        {
            "generation": value.generation,
            "root": value.root.raw,
            "run": value.run,
            "time": value.time,
        },
        use_bin_type=True,
    )
    body = _HEADER.pack(REF_MAGIC, REF_VERSION, len(payload)) + payload
    return body + digest_bytes(body)


def decode_ref(data: bytes, *, run: str) -> RefValue:
    """Parse and check a ref file's bytes; raise CorruptRefError on any damage."""
    if len(data) < _HEADER.size + DIGEST_SIZE:
        raise CorruptRefError(f"ref file is truncated ({len(data)} bytes)", run=run)
    magic, version, length = _HEADER.unpack_from(data)
    if magic != REF_MAGIC:
        raise CorruptRefError("ref file has a bad magic number", run=run)
    if version > REF_VERSION:
        from castore.errors import FormatVersionError

        raise FormatVersionError(
            f"ref written by format version {version}; upgrade castore", run=run
        )
    end = _HEADER.size + length
    if length > _MAX_PAYLOAD or len(data) != end + DIGEST_SIZE:
        raise CorruptRefError("ref file length does not match its header", run=run)
    if digest_bytes(data[:end]) != data[end:]:
        raise CorruptRefError("ref file fails its checksum", run=run)
    try:
        wire = msgpack.unpackb(data[_HEADER.size : end], raw=False)
        value = RefValue(
            wire["run"], int(wire["generation"]), Digest(wire["root"]), float(wire["time"])
        )
    except (ValueError, KeyError, TypeError, OverflowError, msgpack.ExtraData) as exc:
        raise CorruptRefError(f"ref payload does not decode: {exc}", run=run) from exc
    if value.generation < 1 or not math.isfinite(value.time):
        raise CorruptRefError(
            f"ref names generation {value.generation} at time {value.time}", run=run
        )
    if value.run != run:
        raise CorruptRefError(f"ref file names run {value.run!r}", run=run)
    return value


def _flock(fd: int, operation: int, timeout: float, busy: str) -> None:
    """``flock`` with a deadline, polling (flock itself cannot time out)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            if time.monotonic() >= deadline:
                raise StoreLockedError(busy) from None
            time.sleep(0.01)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReflogWarning(UserWarning):
    """A generation was published but its reflog record could not be written.

    The ref is the commit point, so the save stands; the next advance of the
    run appends the missing record (action ``recovered``).
    """


class DurabilityWarning(UserWarning):
    """A ref or tag was replaced (readers see it) but its directory could not be synced."""


def _replace_file(path: Path, data: bytes, *, phase: str) -> None:
    """Write ``data`` to a synced temp file ``.NAME.PID.NS.tmp`` and rename it over ``path``.

    The caller has checked ``path.parent`` is a real directory. ``O_EXCL``
    never follows a symlink, and ``rename`` replaces a symlink at ``path``
    rather than writing through it: nothing lands outside the store. On any
    failure before the rename the temp file is removed and the error names
    ``phase``; after it, a failure only warns (``DurabilityWarning``).
    """
    temp = path.parent / f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        fd = open_store_file(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except OSError as exc:
        raise write_error(phase, temp, exc) from exc
    try:
        with writing(phase, path):
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    try:
        fsync_dir(path.parent)
    except OSError as exc:
        # The rename is done and readers already see the new file: raising would tell
        # the caller "not published" when it is. Say what is uncertain instead.
        warnings.warn(
            f"{path} is replaced, but syncing its directory failed while {phase} "
            f"({exc.strerror or exc}): it may not survive a crash",
            DurabilityWarning,
            stacklevel=3,
        )


_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
REFLOG_ACTIONS = (*PUBLISH_ACTIONS, "collect")


def _is_reflog_record(record: Any, run: str) -> bool:
    """A checksummed line is only trusted if it has the shape castore writes."""
    if not isinstance(record, dict):
        return False
    generation, stamp, parent = record.get("generation"), record.get("time"), record.get("parent")
    return (
        record.get("action") in REFLOG_ACTIONS
        and record.get("run") == run
        and isinstance(generation, int)
        and not isinstance(generation, bool)
        and generation >= 1
        and isinstance(record.get("root"), str)
        and bool(_HEX_DIGEST.fullmatch(record["root"]))
        and (parent is None or (isinstance(parent, str) and bool(_HEX_DIGEST.fullmatch(parent))))
        and isinstance(stamp, (int, float))
        and not isinstance(stamp, bool)
        and math.isfinite(stamp)
    )


def _names_in(directory: Path, run_of: Any) -> list[str]:
    """Run names ``run_of(entry name)`` gives for the entries of ``directory``.

    Names only, nothing followed: a symlinked ref is listed and refused when read.
    """
    if not is_store_dir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        run = run_of(name)
        if run and _RUN_NAME.fullmatch(run) and ".." not in run:
            found.append(run)
    return found


class RefStore:
    """The ref files, locks and reflogs of one store directory."""

    def __init__(self, root: Path, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        self.refs_dir = root / "refs"
        self.locks_dir = root / "locks"
        self.logs_dir = root / "logs"
        self.tags_dir = root / "tags"
        self.lock_timeout = lock_timeout
        self.save_wait = DEFAULT_SAVE_WAIT
        self._views: dict[str, ReflogView] = {}
        self._views_lock = threading.Lock()

    def ensure_dirs(self) -> None:
        for directory in (self.refs_dir, self.locks_dir, self.logs_dir):
            with writing(f"creating {directory.name}/", directory):
                make_store_dir(directory)

    def _open_lock_file(self, name: str) -> int:
        """Open (creating) ``locks/NAME`` for ``flock``; never through a symlink."""
        self.ensure_dirs()
        path = self.locks_dir / name
        try:
            return open_store_file(path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise write_error(f"creating the lock file {name}", path, exc) from exc

    # -- store-wide locks ---------------------------------------------------

    @contextmanager
    def store_lock(self, *, exclusive: bool, timeout: float, busy: str) -> Iterator[None]:
        """Hold ``locks/store.lock``: shared by saves and tags, exclusive for GC.

        Waits at most ``timeout`` seconds, then raises StoreLockedError(``busy``).
        """
        fd = self._open_lock_file(STORE_LOCK)
        try:
            _flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, timeout, busy)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def hold_open(self, *, exclusive: bool = False, busy: str = "") -> int:
        """Take ``locks/open.lock`` without waiting; the caller closes the returned fd.

        Every open store holds it shared; compaction needs it exclusive.
        """
        fd = self._open_lock_file(OPEN_LOCK)
        try:
            _flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, 0.0, busy)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def runs(self) -> list[str]:
        """Every run any durable record names: a ref, a reflog or a tag directory.

        A run whose ref was lost still has history that garbage collection must
        see (and refuse to collect), so refs alone are not enough.
        """
        return sorted(set(self.ref_runs()) | set(self._logged_runs()) | set(self._tagged_runs()))

    def ref_runs(self) -> list[str]:
        """The runs that have a ref file."""
        return _names_in(self.refs_dir, lambda name: name)

    def _logged_runs(self) -> list[str]:
        suffix = ".reflog"
        return _names_in(
            self.logs_dir, lambda name: name[: -len(suffix)] if name.endswith(suffix) else None
        )

    def _tagged_runs(self) -> list[str]:
        # An untagged run leaves its empty directory behind: that names nothing.
        def tagged(name: str) -> str | None:
            directory = self.tags_dir / name
            return name if is_store_dir(directory) and os.listdir(directory) else None

        return _names_in(self.tags_dir, tagged)

    def read(self, run: str) -> RefValue | None:
        """The current ref of ``run``, or None if the run has none."""
        validate_run_name(run)
        if not is_store_dir(self.refs_dir):
            return None
        return _read_ref_file(self.refs_dir / run, run=run)

    @contextmanager
    def locked(self, run: str) -> Iterator[None]:
        """Hold the run's exclusive ref lock, waiting at most ``lock_timeout``."""
        validate_run_name(run)
        fd = self._open_lock_file(f"{run}.lock")
        try:
            _flock(
                fd,
                fcntl.LOCK_EX,
                self.lock_timeout,
                f"ref lock of run {run!r} busy for {self.lock_timeout:.0f}s",
            )
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def advance(self, run: str, *, expected: Digest | None, new: RefValue) -> None:
        """Compare-and-swap the ref of ``run`` from ``expected`` to ``new``."""
        validate_run_name(run)
        if new.run != run:
            raise ValueError(f"ref value names run {new.run!r}, not {run!r}")
        with self.locked(run):
            current = self.read(run)
            current_root = current.root if current else None
            if current_root != expected:
                raise RefConflictError(
                    f"ref moved: expected {expected.short if expected else 'no ref'}, "
                    f"found {current_root.short if current_root else 'no ref'}; reload and retry",
                    run=run,
                )
            if current is not None and new.generation <= current.generation:
                raise RefConflictError(
                    f"generation ids must increase: {new.generation} after {current.generation}",
                    run=run,
                )
            self._reconcile_reflog(run, current)
            self._replace_ref(run, new)
            # Published: readers see the new root now, so the caller must hear success.
            # A missing record is appended by the next advance (_reconcile_reflog).
            try:
                self.append_reflog(run, new, parent=current_root, action="advance")
            except CastoreError as exc:
                warnings.warn(
                    f"generation {new.generation} of run {run!r} is published, but its reflog "
                    f"record was not written ({exc}); the next save of the run records it",
                    ReflogWarning,
                    stacklevel=2,
                )

    def _replace_ref(self, run: str, value: RefValue) -> None:
        self.ensure_dirs()
        _replace_file(
            self.refs_dir / run, encode_ref(value), phase=f"writing the ref of run {run!r}"
        )

    # -- tags ---------------------------------------------------------------

    def _tag_path(self, run: str, name: str) -> Path:
        validate_run_name(run)
        validate_tag_name(name)
        return self.tags_dir / run / name

    def write_tag(self, run: str, name: str, value: RefValue) -> None:
        """Point tag ``name`` of ``run`` at a generation (replacing what it named)."""
        path = self._tag_path(run, name)
        with writing(f"creating the tag directory of run {run!r}", path.parent):
            make_store_dir(self.tags_dir)
            make_store_dir(path.parent)
        _replace_file(path, encode_ref(value), phase=f"writing tag {name!r} of run {run!r}")

    def delete_tag(self, run: str, name: str) -> bool:
        """Remove a tag; False when there was none."""
        path = self._tag_path(run, name)
        # Checked, or a symlinked tags/RUN/ would have us delete a file outside the store.
        if not (is_store_dir(self.tags_dir) and is_store_dir(path.parent)):
            return False
        if regular_file_size(path) is None:  # refuses a directory or a device in its place
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        fsync_dir(path.parent)
        return True

    def tag(self, run: str, name: str) -> RefValue | None:
        """The generation tag ``name`` of ``run`` names; None when there is no such tag."""
        validate_run_name(run)
        if not _TAG_NAME.fullmatch(name):
            return None
        directory = self.tags_dir / run
        if not (is_store_dir(self.tags_dir) and is_store_dir(directory)):
            return None
        return _read_ref_file(directory / name, run=run)

    def tags(self, run: str) -> dict[str, RefValue]:
        """Every tag of ``run``: name -> the generation it names (damage raises)."""
        validate_run_name(run)
        directory = self.tags_dir / run
        if not (is_store_dir(self.tags_dir) and is_store_dir(directory)):
            return {}
        found = {}
        for name in sorted(os.listdir(directory)):
            if _TAG_NAME.fullmatch(name):
                value = _read_ref_file(directory / name, run=run)
                if value is not None:  # deleted since the listing
                    found[name] = value
        return found

    # -- reflog -----------------------------------------------------------

    def reflog_path(self, run: str) -> Path:
        return self.logs_dir / f"{run}.reflog"

    def append_reflog(
        self, run: str, value: RefValue, *, parent: Digest | None, action: str
    ) -> None:
        record = {
            "action": action,
            "generation": value.generation,
            "host": socket.gethostname(),
            "parent": parent.hex if parent else None,
            "pid": os.getpid(),
            "root": value.root.hex,
            "run": run,
            "time": value.time,
        }
        text = json.dumps(record, sort_keys=True, separators=(",", ":"))
        line = f"{text}\t{digest_bytes(text.encode()).hex()[:32]}\n".encode()
        with writing("creating logs/", self.logs_dir):
            make_store_dir(self.logs_dir)
        path = self.reflog_path(run)
        created = not os.path.lexists(path)
        phase = f"appending to the reflog of run {run!r}"
        try:
            fd = open_store_file(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        except OSError as exc:
            raise write_error(phase, path, exc) from exc
        try:
            with writing(phase, path):
                _append_line(fd, line)
        finally:
            os.close(fd)
        if created:
            with writing(phase, path):
                fsync_dir(self.logs_dir)

    def reflog(self, run: str) -> list[dict[str, Any]]:
        """Every intact reflog record of ``run``, oldest first (torn lines skipped)."""
        return self.read_reflog(run)[0]

    def read_reflog(self, run: str) -> tuple[list[dict[str, Any]], list[int]]:
        """Intact records, and the line numbers (1-based) of damaged ones, read afresh.

        A line cut short by a crash mid-append (no tab, or fewer than 32
        characters after it) is torn, not damaged: the advance it recorded is
        recovered by the next one. Any other line whose checksum fails is
        damage. ``verify`` and ``gc`` call this: they read every line from disk.
        """
        view = self.reflog_view(run, fresh=True)
        return list(view.records), list(view.damaged)

    def reflog_view(self, run: str, *, fresh: bool = False) -> ReflogView:
        """What the reflog of ``run`` says, parsing only the lines appended since last time.

        The reflog only grows (appends under the run's ref lock; a failed append
        truncates back to where it began), so this Store keeps what it parsed and
        reads from where it stopped: a save or a lookup costs the same at the
        10,000th generation as at the first. A file that shrank or was replaced
        is read from its start. ``fresh``: read every line again (integrity tools).
        Do not modify the view; it is shared by later calls.
        """
        validate_run_name(run)
        if not is_store_dir(self.logs_dir):
            return ReflogView()
        try:
            fd = open_store_file(self.reflog_path(run), os.O_RDONLY)
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
                    view = ReflogView(identity=(info.st_dev, info.st_ino))
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

    def last_published(self, run: str) -> dict[str, Any] | None:
        """The newest intact publish record of ``run``'s reflog, reading from the end.

        What a ref advance needs to know (was the previous advance logged?),
        at a cost that does not grow with the run's history.
        """
        for record in self.records_backwards(run):
            if record["action"] in PUBLISH_ACTIONS:
                return record
        return None

    def records_backwards(self, run: str) -> Iterator[dict[str, Any]]:
        """Intact reflog records of ``run``, newest first, read from the file's end in
        growing pieces: the cost is what the caller consumes, not the history."""
        validate_run_name(run)
        if not is_store_dir(self.logs_dir):
            return
        try:
            fd = open_store_file(self.reflog_path(run), os.O_RDONLY)
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

    def published_newest_first(self, run: str) -> PublishedStream:
        """The published, uncollected generations the reflog names, newest first.

        From the parsed view when this RefStore has one, else read backwards
        from the file's end, so a new process listing the newest few
        generations reads only the end of a long log.
        """
        view = self._views.get(run)
        if view is not None:
            view = self.reflog_view(run)  # bring it up to date (appended lines only)
            return PublishedStream(reversed(list(view.listed.items())), set(view.collected))
        return PublishedStream.from_records(self.records_backwards(run))

    def record_collected(self, run: str, generation: int, root: Digest) -> None:
        """Log that garbage collection dropped a generation (before deleting it)."""
        value = RefValue(run, generation, root, time.time())
        self.append_reflog(run, value, parent=None, action="collect")

    def _reconcile_reflog(self, run: str, current: RefValue | None) -> None:
        # A writer killed between the ref replace and its reflog append leaves the
        # ref ahead of the log; record that advance before adding the next one.
        if current is None:
            return
        last = self.last_published(run)
        if last is None or last["root"] != current.root.hex:
            parent = Digest.from_hex(last["root"]) if last else None
            self.append_reflog(run, current, parent=parent, action="recovered")


class PublishedStream:
    """(root hex, id) pairs, newest first, and the collected roots seen so far.

    Read backwards, a collect record comes before (is newer than) the publish
    record it cancels, so ``collected`` holds every root collected after the
    last pair yielded.
    """

    def __init__(self, pairs: Iterator[tuple[str, int]], collected: set[str]) -> None:
        self._pairs = pairs
        self.collected = collected

    @classmethod
    def from_records(cls, records: Iterator[dict[str, Any]]) -> PublishedStream:
        stream = cls(iter(()), set())
        stream._pairs = stream._from(records)
        return stream

    def _from(self, records: Iterator[dict[str, Any]]) -> Iterator[tuple[str, int]]:
        seen: set[str] = set()
        for record in records:
            root = record["root"]
            if record["action"] == "collect":
                self.collected.add(root)
            elif root not in self.collected and root not in seen:
                seen.add(root)
                yield root, record["generation"]

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return self._pairs


class ReflogView:
    """The records of one reflog, and what they say, parsed line by line."""

    def __init__(self, identity: tuple[int, int] | None = None) -> None:
        self.identity = identity  # (st_dev, st_ino) of the file parsed
        self.offset = 0  # bytes parsed: the end of the last whole line
        self.lines = 0
        self.records: list[dict[str, Any]] = []
        self.damaged: list[int] = []  # 1-based line numbers
        self.listed: dict[str, int] = {}  # root hex -> id: published and not collected
        self.collected: set[str] = set()  # root hexes garbage collection dropped

    def feed(self, line: bytes, run: str) -> None:
        self.lines += 1
        record, damaged = _parse_reflog_line(line, run)
        if damaged:
            self.damaged.append(self.lines)
        if record is None:
            return
        self.records.append(record)
        root = record["root"]
        if record["action"] == "collect":
            self.collected.add(root)
            self.listed.pop(root, None)
        elif root not in self.collected:
            self.listed[root] = record["generation"]

    def copy(self) -> ReflogView:
        other = ReflogView(self.identity)
        other.offset, other.lines = self.offset, self.lines
        other.records, other.damaged = list(self.records), list(self.damaged)
        other.listed, other.collected = dict(self.listed), set(self.collected)
        return other


def _parse_reflog_line(line: bytes, run: str) -> tuple[dict[str, Any] | None, bool]:
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
        if _is_reflog_record(record, run):
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


def _read_ref_file(path: Path, *, run: str) -> RefValue | None:
    """Decode a ref or tag file; None when it is absent."""
    try:
        data = read_store_file(path, limit=_MAX_REF_FILE)
    except FileNotFoundError:
        return None
    if len(data) > _MAX_REF_FILE:
        raise CorruptRefError(
            f"{path} is larger than any ref file ({_MAX_REF_FILE} bytes)", run=run
        )
    return decode_ref(data, run=run)


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
