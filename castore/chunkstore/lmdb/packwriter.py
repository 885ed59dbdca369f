"""Where a chunk lies in the embedded backend's packs, and writing a new pack.

A ``chunk_index`` value is a :class:`PackLocation` (length, pack id, offset of
the chunk's first byte), 24 bytes. A :class:`PackWriter` appends records to one
new pack file and makes it durable (``finish``: its bytes, then its directory
entry) before :class:`~castore.chunkstore.lmdb.backend.LmdbBackend` commits the
index entries that name them. The pack format itself is
:mod:`castore.chunkstore.packfile` (a rebuild reads packs without LMDB).
"""

from __future__ import annotations

import errno
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from castore.chunkstore.lmdb.file import REPAIR_HINT
from castore.chunkstore.packfile import (
    PACK_HEADER,
    PACK_MAGIC,
    PACK_SUFFIX,
    PACK_VERSION,
    RECORD_HEADER,
)
from castore.errors import IndexCorruptError, StoreError
from castore.format.hashing import Buffer
from castore.support.safefs import fsync_dir

# chunk_index value: length, pack id, offset of the chunk's first byte in the pack.
_LOCATION = struct.Struct("<QQQ")
_IOV_MAX = 512  # pieces per writev call (two iovecs per record)
# A pack writer writes its queued records once they hold this many chunk bytes:
# small chunks go out many to one writev, a chunk this large at once.
_QUEUE_BYTES = 1 << 20


@dataclass(frozen=True)
class PackLocation:
    """Where one chunk's bytes lie."""

    length: int
    pack: int
    offset: int

    def encode(self) -> bytes:
        return _LOCATION.pack(self.length, self.pack, self.offset)

    @classmethod
    def decode(cls, value: bytes) -> PackLocation:
        return cls(*unpack_location(value))


def unpack_location(value: bytes) -> tuple[int, int, int]:
    """A chunk_index value as (length, pack, offset), refused unless it has the exact size."""
    if len(value) != _LOCATION.size:
        raise IndexCorruptError(
            f"a chunk_index value is {len(value)} bytes, not {_LOCATION.size}: the LMDB "
            f"file is damaged; {REPAIR_HINT}"
        )
    return _LOCATION.unpack(value)  # type: ignore[no-any-return]


def pack_name(pack: int) -> str:
    return f"{pack:016x}{PACK_SUFFIX}"


# fdatasync flushes the data and the file size, which is all a pack needs;
# platforms without it (macOS) get fsync.
_datasync = getattr(os, "fdatasync", os.fsync)


class PackWriter:
    """One new pack file, written by ``append`` (or ``add``) and made durable by ``finish``.

    Records are queued and written together, one ``writev`` for many small
    chunks, once the queue holds ``_QUEUE_BYTES`` or ``_IOV_MAX`` pieces;
    ``finish`` writes the rest before it syncs. So a queued value's buffer
    must stay unchanged until ``finish`` returns.
    """

    def __init__(self, directory: Path, pack: int, fd: int) -> None:
        self.directory, self.pack, self.fd = directory, pack, fd
        self.offset = PACK_HEADER.size
        self.chunk_bytes = 0  # of every record appended
        self.queued: list[Buffer] = []  # record header, chunk, header, chunk...
        self.queued_bytes = 0
        os.write(fd, PACK_HEADER.pack(PACK_MAGIC, PACK_VERSION, 0))

    @classmethod
    def create(cls, directory: Path) -> PackWriter:
        for _ in range(16):
            pack = secrets.randbits(63)
            try:
                fd = os.open(
                    directory / pack_name(pack), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
                )
            except FileExistsError:
                continue
            return cls(directory, pack, fd)
        raise StoreError("could not pick a new pack name", path=str(directory))

    def append(self, key: bytes, value: Buffer) -> bytes:
        """Queue one record; its chunk_index value (length, pack, offset of its bytes)."""
        view = memoryview(value)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        length = view.nbytes
        start = self.offset + RECORD_HEADER.size
        self.queued += (RECORD_HEADER.pack(key, length), view)
        self.offset = start + length
        self.chunk_bytes += length
        self.queued_bytes += length
        if self.queued_bytes >= _QUEUE_BYTES or len(self.queued) >= _IOV_MAX:
            self.flush()
        return _LOCATION.pack(length, self.pack, start)

    def add(self, key: bytes, value: Buffer) -> PackLocation:
        return PackLocation(*_LOCATION.unpack(self.append(key, value)))

    def flush(self) -> None:
        """Write what is queued."""
        if self.queued:
            _write_all(self.fd, self.queued)
            self.queued, self.queued_bytes = [], 0

    def finish(self) -> None:
        """Make the pack's bytes and its directory entry durable."""
        self.flush()
        _datasync(self.fd)
        os.close(self.fd)
        self.fd = -1
        fsync_dir(self.directory)

    def discard(self) -> None:
        self.queued = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            (self.directory / pack_name(self.pack)).unlink()
        except FileNotFoundError:
            pass


def _write_all(fd: int, buffers: list[Any]) -> None:
    """Write ``buffers`` (each bytes or a flat byte memoryview: len is its size) in order."""
    for at in range(0, len(buffers), _IOV_MAX):
        group = buffers[at : at + _IOV_MAX]
        done = os.writev(fd, group)
        if done < sum(map(len, group)):
            _write_rest(fd, group, done)


def _write_rest(fd: int, buffers: list[Any], done: int) -> None:
    """The rest of a ``writev`` that wrote only ``done`` bytes (a signal, a full disk)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        if done == 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while done and views:
            if done >= views[0].nbytes:
                done -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][done:]
                done = 0
        if views:
            done = os.writev(fd, views[:_IOV_MAX])
