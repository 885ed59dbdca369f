"""A store directory: creating it, recognising it, opening it.

The marker file ``castore.json`` says a directory is a castore store, which
format version wrote it, and its default chunk size. It is the first thing a
new store gets, and it appears atomically, so several ranks may create the
same store at once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from castore.chunkio import DEFAULT_CHUNK_SIZE
from castore.chunkstore.lmdb_backend import LmdbBackend
from castore.errors import FormatVersionError, NotAStoreError, StoreError, StoreNotFoundError
from castore.refs import RefStore, fsync_dir
from castore.store import Store

MARKER = "castore.json"
STORE_FORMAT = "castore-store"
STORE_VERSION = 2
# Format 1 kept chunk bytes inside LMDB; format 2 keeps them in pack files.
OLDEST_STORE_VERSION = 2


def open_store(
    path: str | os.PathLike[str],
    *,
    create: bool = True,
    chunk_size: int | None = None,
    map_size: int | None = None,
) -> Store:
    """Open (or create) the store at ``path``; see :func:`castore.open`."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise NotAStoreError(f"{root} is a file, not a castore store", path=str(root))
    marker = root / MARKER
    if marker.is_file():
        config = _read_marker(marker)
    elif not root.exists() or _is_empty(root):
        if not create:
            raise StoreNotFoundError(f"no castore store at {root}", path=str(root))
        config = _create_store(root, chunk_size or DEFAULT_CHUNK_SIZE)
    else:
        raise NotAStoreError(
            f"{root} is a non-empty directory without {MARKER}: not a castore store", path=str(root)
        )
    size = chunk_size or int(config["chunk_size"])
    if size <= 0:
        raise ValueError(f"chunk_size must be positive, got {size}")
    refs = RefStore(root)
    fd = refs.hold_open(busy=f"store {root} is being compacted; try again when it finishes")
    try:
        backend = LmdbBackend(root / "chunks", map_size=map_size)
    except BaseException:
        os.close(fd)
        raise
    store = Store(root, backend, size)
    store._open_fd = fd
    return store


def _read_marker(marker: Path) -> dict[str, Any]:
    try:
        config = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise NotAStoreError(
            f"store marker {marker} is unreadable: {exc}", path=str(marker)
        ) from exc
    if not isinstance(config, dict) or config.get("format") != STORE_FORMAT:
        raise NotAStoreError(f"{marker} is not a castore store marker", path=str(marker))
    version = config.get("format_version")
    if not isinstance(version, int) or version > STORE_VERSION:
        raise FormatVersionError(
            f"store written by format version {version}; this castore reads up to "
            f"{STORE_VERSION}: upgrade castore",
            path=str(marker.parent),
        )
    if version < OLDEST_STORE_VERSION:
        raise FormatVersionError(
            f"store written by format version {version}, which kept chunk bytes inside LMDB; "
            f"this castore reads formats {OLDEST_STORE_VERSION} to {STORE_VERSION}: "
            "restore it with the castore that wrote it and save into a new store",
            path=str(marker.parent),
        )
    if not isinstance(config.get("chunk_size"), int):
        raise NotAStoreError(f"store marker {marker} has no chunk size", path=str(marker))
    return config


def _is_empty(root: Path) -> bool:
    """No entries but other processes' half-written markers (see _create_store)."""
    return all(entry.name.startswith(f".{MARKER}.") for entry in root.iterdir())


def _create_store(root: Path, chunk_size: int) -> dict[str, Any]:
    """Create a store; safe when several processes (ranks) create it at once.

    The marker is the first thing that appears and it appears atomically
    (``link`` of a complete temp file, which fails if another process won):
    a directory is never seen non-empty without its marker.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create store directory {root}: {exc}", path=str(root)) from exc
    config = {
        "format": STORE_FORMAT,
        "format_version": STORE_VERSION,
        "chunk_size": chunk_size,
        "backend": "lmdb",
        "created": time.time(),
    }
    temp = root / f".{MARKER}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        with open(temp, "w") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.link(temp, root / MARKER)
    except FileExistsError:
        return _read_marker(root / MARKER)  # another process created it first
    finally:
        temp.unlink(missing_ok=True)
    fsync_dir(root)
    RefStore(root).ensure_dirs()
    return config
