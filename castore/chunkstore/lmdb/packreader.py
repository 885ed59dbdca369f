"""Reading chunks from the embedded backend's packs: ``preadv`` or memory maps.

:class:`PackReader` reads chunks with ``pread`` from packs opened once each (a
load into new tensors, :mod:`castore.core.readplan`); :class:`PackMaps` maps
packs read-only for reads that hand out zero-copy views (``read_many``) and for
a reclaim's rewrite. Neither ever opens a pack through a symlink or a pipe.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from castore.chunkstore.base import ChunkReader
from castore.chunkstore.lmdb.packwriter import PackLocation, pack_name
from castore.errors import StoreError
from castore.support.safefs import open_store_file


class PackSource(Protocol):
    """What a reader needs of its backend: the packs' directory and a fresh look-up."""

    @property
    def pack_dir(self) -> Path: ...

    def locate(self, key: bytes) -> PackLocation | None: ...


class PackReader(ChunkReader):
    """Chunks read with ``preadv`` from packs opened once each (see LmdbBackend.chunk_reader).

    A location that lies past the end of its pack is not read here (``readinto``
    gives nothing): the caller then reads it the ordinary way, which names the damage.
    """

    def __init__(self, pack_dir: Path) -> None:
        self.pack_dir = pack_dir
        self.lengths: list[int | None] = []
        self._fds: list[int] = []  # per key: its pack's descriptor, -1: not read here
        self._offsets: list[int] = []
        self._packs: dict[int, tuple[int, int]] = {}  # pack -> (descriptor or -1, size)

    @classmethod
    def open(
        cls,
        backend: PackSource,
        keys: Sequence[bytes],
        locations: list[tuple[int, int, int] | None],
    ) -> PackReader:
        reader = cls(backend.pack_dir)
        try:
            for key, where in zip(keys, locations, strict=True):
                fd, size = (-1, 0) if where is None else reader._pack(where[1])
                if where is not None and fd < 0:
                    # Moved by a reclaim since this snapshot began? Look again.
                    moved = backend.locate(key)
                    where = None if moved is None else (moved.length, moved.pack, moved.offset)
                    fd, size = (-1, 0) if where is None else reader._pack(where[1])
                    where = where if fd >= 0 else None
                if where is None:
                    reader.lengths.append(None)
                    reader._fds.append(-1)
                    reader._offsets.append(0)
                    continue
                length, _, offset = where
                reader.lengths.append(length)
                # A chunk that runs past the end of its pack is not read here.
                reader._fds.append(fd if offset + length <= size else -1)
                reader._offsets.append(offset)
        except BaseException:
            reader.close()
            raise
        return reader

    def _pack(self, pack: int) -> tuple[int, int]:
        if pack not in self._packs:
            # A symlinked or non-regular pack raises UnsafeStoreFileError (as a map does).
            try:
                fd = open_store_file(self.pack_dir / pack_name(pack), os.O_RDONLY)
            except FileNotFoundError:
                self._packs[pack] = (-1, 0)
            else:
                self._packs[pack] = (fd, -1)  # recorded first: close() closes it if fstat fails
                self._packs[pack] = (fd, os.fstat(fd).st_size)
        return self._packs[pack]

    def readinto(self, position: int, buffer: memoryview, offset: int = 0) -> int:
        fd, length = self._fds[position], self.lengths[position]
        if fd < 0 or length is None:
            return 0
        if offset + buffer.nbytes > length:
            buffer = buffer[: max(0, length - offset)]
        at, size = self._offsets[position] + offset, buffer.nbytes
        try:
            done = got = os.preadv(fd, [buffer], at)
            while got and done < size:  # a short read: the rest, until the file ends
                got = os.preadv(fd, [buffer[done:]], at + done)
                done += got
        except OSError as exc:
            raise StoreError(
                f"cannot read a chunk pack: {exc.strerror or exc}",
                phase="reading chunks",
                path=str(self.pack_dir),
            ) from exc
        return done

    def close(self) -> None:
        packs, self._packs = self._packs, {}
        for fd, _ in packs.values():
            if fd >= 0:
                os.close(fd)


class PackMaps:
    """Read-only memory maps of packs, opened on first use and closed together."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._maps: dict[int, tuple[mmap.mmap | None, memoryview | None]] = {}

    def get(self, pack: int) -> memoryview | None:
        if pack not in self._maps:
            self._maps[pack] = self._open(pack)
        return self._maps[pack][1]

    def _open(self, pack: int) -> tuple[mmap.mmap | None, memoryview | None]:
        # A symlinked or non-regular pack raises UnsafeStoreFileError: never read
        # outside the store, never block on a pipe.
        try:
            fd = open_store_file(self.directory / pack_name(pack), os.O_RDONLY)
        except FileNotFoundError:
            return None, None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return None, memoryview(b"")
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return mapped, memoryview(mapped)

    def close(self) -> None:
        for mapped, view in self._maps.values():
            if view is not None:
                view.release()
            if mapped is not None:
                try:
                    mapped.close()
                except BufferError:
                    pass  # a consumer kept a view; the map goes when it does
        self._maps.clear()
