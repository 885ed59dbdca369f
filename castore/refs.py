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
import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from castore.errors import CorruptRefError, InvalidNameError, RefConflictError, StoreLockedError
from castore.hashing import DIGEST_SIZE, Digest, digest_bytes

REF_MAGIC = b"CASTREF\n"
REF_VERSION = 1
_HEADER = struct.Struct("<8sHI")
_MAX_PAYLOAD = 1 << 16
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DEFAULT_LOCK_TIMEOUT = 30.0


def validate_run_name(run: str) -> str:
    """Return ``run`` if it is a safe run name, else raise InvalidNameError."""
    if not isinstance(run, str) or not _RUN_NAME.fullmatch(run) or ".." in run:
        raise InvalidNameError(
            f"invalid run name {run!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit, without '..'",
            run=run if isinstance(run, str) else repr(run),
        )
    return run


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
    except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
        raise CorruptRefError(f"ref payload does not decode: {exc}", run=run) from exc
    if value.run != run:
        raise CorruptRefError(f"ref file names run {value.run!r}", run=run)
    return value


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RefStore:
    """The ref files, locks and reflogs of one store directory."""

    def __init__(self, root: Path, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        self.refs_dir = root / "refs"
        self.locks_dir = root / "locks"
        self.logs_dir = root / "logs"
        self.lock_timeout = lock_timeout

    def ensure_dirs(self) -> None:
        for directory in (self.refs_dir, self.locks_dir, self.logs_dir):
            directory.mkdir(parents=True, exist_ok=True)

    def runs(self) -> list[str]:
        if not self.refs_dir.is_dir():
            return []
        return sorted(p.name for p in self.refs_dir.iterdir() if _RUN_NAME.fullmatch(p.name))

    def read(self, run: str) -> RefValue | None:
        """The current ref of ``run``, or None if the run has none."""
        validate_run_name(run)
        try:
            data = (self.refs_dir / run).read_bytes()
        except FileNotFoundError:
            return None
        return decode_ref(data, run=run)

    @contextmanager
    def locked(self, run: str) -> Iterator[None]:
        """Hold the run's exclusive ref lock, waiting at most ``lock_timeout``."""
        validate_run_name(run)
        self.ensure_dirs()
        fd = os.open(self.locks_dir / f"{run}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    if time.monotonic() >= deadline:
                        raise StoreLockedError(
                            f"ref lock busy for {self.lock_timeout:.0f}s", run=run
                        ) from None
                    time.sleep(0.01)
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
            self.append_reflog(run, new, parent=current_root, action="advance")

    def _replace_ref(self, run: str, value: RefValue) -> None:
        temp = self.refs_dir / f".{run}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, encode_ref(value))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(temp, self.refs_dir / run)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        fsync_dir(self.refs_dir)

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
        path = self.reflog_path(run)
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # end a torn record so this one stays whole
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            fsync_dir(self.logs_dir)

    def reflog(self, run: str) -> list[dict[str, Any]]:
        """Every intact reflog record of ``run``, oldest first (torn lines skipped)."""
        validate_run_name(run)
        try:
            lines = self.reflog_path(run).read_bytes().splitlines()
        except FileNotFoundError:
            return []
        records = []
        for line in lines:
            text, _, check = line.decode("utf-8", "replace").rpartition("\t")
            if text and digest_bytes(text.encode()).hex()[:32] == check:
                records.append(json.loads(text))
        return records

    def _reconcile_reflog(self, run: str, current: RefValue | None) -> None:
        # A writer killed between the ref replace and its reflog append leaves the
        # ref ahead of the log; record that advance before adding the next one.
        if current is None:
            return
        records = self.reflog(run)
        if not records or records[-1]["root"] != current.root.hex:
            parent = Digest.from_hex(records[-1]["root"]) if records else None
            self.append_reflog(run, current, parent=parent, action="recovered")
