"""Ref and tag files of a store directory: their format, reading, and atomic replacement.

A ref (or tag) file is self-checking::

    magic "CASTREF\\n" | u16 version | u32 payload length | msgpack payload | blake3(all before)

It is replaced whole: a temp file is written and synced, renamed over the old
one, and the directory is synced (docs/FORMAT.md, "Refs").
"""

from __future__ import annotations

import math
import os
import struct
import time
import warnings
from pathlib import Path

import msgpack

from castore.errors import CorruptRefError, DurabilityWarning, FormatVersionError
from castore.format.hashing import DIGEST_SIZE, Digest, digest_bytes
from castore.repo.records import RefValue, Writer
from castore.support.safefs import (
    fsync_dir,
    open_store_file,
    read_store_file,
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


def encode_ref(value: RefValue) -> bytes:
    wire: dict[str, object] = {
        "generation": value.generation,
        "root": value.root.raw,
        "run": value.run,
        "time": value.time,
    }
    # Written only when set, so a tag's file and a ref of before epochs read the same.
    if value.step is not None:
        wire["step"] = value.step
    if value.epoch:
        wire["epoch"] = value.epoch
    if value.writer is not None:
        wire["writer"] = {
            "host": value.writer.host,
            "job": value.writer.job,
            "pid": value.writer.pid,
        }
    payload = msgpack.packb(wire, use_bin_type=True)
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
            wire["run"],
            int(wire["generation"]),
            Digest(wire["root"]),
            float(wire["time"]),
            step=_optional_count(wire, "step"),
            epoch=_optional_count(wire, "epoch") or 0,
            writer=_writer(wire.get("writer")),
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


def _optional_count(wire: dict[str, object], key: str) -> int | None:
    value = wire.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
        raise ValueError(f"{key} is {value!r}, not a non-negative int64")
    return value


def _writer(wire: object) -> Writer | None:
    if wire is None:
        return None
    if not isinstance(wire, dict):
        raise TypeError("writer is not a map")
    host, pid, job = wire.get("host"), wire.get("pid"), wire.get("job")
    if not isinstance(host, str) or not isinstance(pid, int) or isinstance(pid, bool):
        raise TypeError("writer needs a host string and an int pid")
    if job is not None and not isinstance(job, str):
        raise TypeError("writer job is not a string")
    return Writer(host, pid, job)


def replace_file(path: Path, data: bytes, *, phase: str) -> None:
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


def read_ref_file(path: Path, *, run: str) -> RefValue | None:
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
