"""A store directory: creating it, recognising it, opening it.

The marker file ``castore.json`` says a directory is a castore store, which
format version wrote it, and its default chunk size. It is the first thing a
new store gets, and it appears atomically, so several ranks may create the
same store at once.

``open_address`` starts here for every address: a directory (or ``file://``)
is opened here, an ``s3://`` URL through :mod:`castore.opening.blobs`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import operator
import os
import time
from pathlib import Path
from typing import Any

from castore.chunkstore.lmdb.backend import LmdbBackend
from castore.core.chunkio import DEFAULT_CHUNK_SIZE
from castore.errors import (
    FormatVersionError,
    NotAStoreError,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
    UnsupportedBackendError,
    UnsupportedOperationError,
)
from castore.format.codec import check_setting
from castore.format.objects import MAX_CHUNK_SIZE  # a marker naming more is refused, like an entry
from castore.opening.blobs import (
    check_marker_chunk_size,
    marker_codec,
    open_blob_store,
    store_codec,
)
from castore.opening.location import parse_location
from castore.repo.base import LockHold
from castore.repo.local import OPEN_LOCK, RefStore
from castore.store import Store
from castore.support import readonly as readonly_mode
from castore.support.readonly import ReadOnly
from castore.support.safefs import fsync_dir, open_store_file, read_store_file, write_all, writing

MARKER = "castore.json"
STORE_FORMAT = "castore-store"
STORE_VERSION = 4
# Format 1 kept chunk bytes inside LMDB; format 2 keeps them in pack files; format 4
# is format 2 whose chunk records may be frames (castore.format.codec). Format 3 is
# the layout on blobs (castore.opening.blobs), which names its backend.
OLDEST_STORE_VERSION = 2
# A new local store stores chunks raw by default: on this kind of machine
# compression costs a local save throughput (docs/PERFORMANCE.md "Compression").
DEFAULT_LOCAL_CODEC = "none"
_MAX_MARKER = 1 << 16


def open_address(
    path: str | os.PathLike[str],
    *,
    create: bool = True,
    chunk_size: int | None = None,
    readonly: bool | None = None,
    **options: Any,
) -> Store:
    """Open the store ``path`` names: a directory, ``file://`` or ``s3://`` (see castore.open)."""
    location = parse_location(path)
    if location.scheme == "s3":
        return open_s3_store(
            location.bucket,
            location.prefix,
            create=create,
            chunk_size=chunk_size,
            readonly=readonly,
            **options,
        )
    return open_store(
        location.path, create=create, chunk_size=chunk_size, readonly=readonly, **options
    )


def open_store(
    path: str | os.PathLike[str],
    *,
    create: bool = True,
    chunk_size: int | None = None,
    map_size: int | None = None,
    shared: bool = False,
    readonly: bool | None = None,
    codec: str | None = None,
    **blob_options: Any,
) -> Store:
    """Open (or create) the store at ``path``; see :func:`castore.open`.

    A directory whose marker names the ``blobs`` backend, or any directory with
    ``shared=True``, is a format-3 store on a shared directory (no LMDB, no
    ``mmap``, no ``flock``): see :mod:`castore.opening.blobs`. ``readonly``: see
    :mod:`castore.support.readonly` (None: read-only when the directory is not writable).
    """
    root = Path(path)
    if chunk_size is not None:
        chunk_size = _check_chunk_size(chunk_size)
    if root.exists() and not root.is_dir():
        raise NotAStoreError(f"{root} is a file, not a castore store", path=str(root))
    marker = root / MARKER
    # Read once: it says which backend, and (local stores) the chunk size.
    found = _read_config(marker)
    if shared or (found is not None and found.get("backend") == "blobs"):
        if map_size is not None:
            raise ValueError(
                f"map_size sizes a local store's LMDB file; {root} is a shared store (no LMDB)"
            )
        return _open_shared(
            root,
            create=create,
            chunk_size=chunk_size,
            readonly=readonly,
            codec=codec,
            **blob_options,
        )
    if blob_options:
        names = ", ".join(sorted(blob_options))
        raise ValueError(
            f"{names}: options of stores on blobs (shared=True, s3://); {root} is a local "
            "store (LMDB)"
        )
    exists = root.is_dir()
    reason = readonly_mode.choose(
        str(root), readonly, writable=not exists or readonly_mode.is_writable(root)
    )
    if codec is not None:
        check_setting(codec)
    config = _marker_or_new_store(
        root,
        create=create and reason is None,
        chunk_size=chunk_size,
        found=found,
        codec=codec or DEFAULT_LOCAL_CODEC,
    )
    size = chunk_size or int(config["chunk_size"])
    chosen = store_codec(config, codec, str(root))
    if reason is not None:
        return _open_readonly(root, size, reason, chosen)
    refs = RefStore(root)
    try:
        hold = refs.hold_open(busy=f"store {root} is being compacted; try again when it finishes")
    except StoreError as exc:
        # access() said writable, yet the lock file cannot be created (NFS root squashing,
        # a FUSE mount, a read-only locks/): nothing was created, so read-only still holds.
        if readonly is not None or not exists or not readonly_mode.cannot_write(exc):
            raise
        fallback = readonly_mode.choose(str(root), None, writable=False)
        return _open_readonly(root, size, fallback, chosen)
    try:
        backend = LmdbBackend(root / "chunks", map_size=map_size)
    except BaseException:
        hold.release()
        raise
    store = Store(root, backend, size, refs=refs, codec=chosen)
    store.hold_open_lock(hold)
    return store


def _open_readonly(
    root: Path, chunk_size: int, reason: ReadOnly | None, codec: str = "none"
) -> Store:
    """A local store opened read-only: nothing in ``root`` is created or changed."""
    assert reason is not None
    refs = RefStore(root)
    refs.readonly = reason
    hold = _reader_hold(root)
    try:
        backend = LmdbBackend(root / "chunks", readonly=reason)
    except BaseException:
        hold.release()
        raise
    store = Store(root, backend, chunk_size, refs=refs, readonly=reason, codec=codec)
    store.hold_open_lock(hold)
    return store


def _reader_hold(root: Path) -> LockHold:
    """The shared open lock, when its file exists, through a read-only descriptor.

    ``flock`` needs no write access, so a read-only handle still keeps another
    user's ``castore compact`` (which takes the open lock exclusively) from
    replacing the files under it, without creating or changing anything. When
    the file is absent, or cannot be opened, there is nothing to hold.
    """
    try:
        fd = open_store_file(root / "locks" / OPEN_LOCK, os.O_RDONLY)
    except OSError:
        return LockHold(lambda: None)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StoreLockedError(
                f"store {root} is being compacted; try again when it finishes", path=str(root)
            ) from None
        return LockHold(lambda: None)  # a filesystem without flock: nothing to hold
    return LockHold(lambda: os.close(fd))


def _names_blobs(marker: Path) -> bool:
    """Whether the marker names format 3's ``blobs`` backend (a shared-directory store)."""
    config = _read_config(marker)
    return config is not None and config.get("backend") == "blobs"


def _read_config(marker: Path) -> dict[str, Any] | None:
    """The marker's JSON object, or None when it is absent or not one (read_marker says
    what is wrong with it)."""
    try:
        data = read_store_file(marker, limit=_MAX_MARKER)
        config = json.loads(data) if len(data) <= _MAX_MARKER else None
    except (OSError, ValueError, RecursionError):
        return None
    return config if isinstance(config, dict) else None


def _open_shared(
    root: Path,
    *,
    create: bool,
    chunk_size: int | None,
    readonly: bool | None = None,
    **blob_options: Any,
) -> Store:
    from castore.blob.posix import PosixBlobStore

    marker = root / MARKER
    if os.path.lexists(marker) and not _names_blobs(marker):
        read_marker(marker)  # a damaged or foreign marker says so
        raise UnsupportedBackendError(
            f"{root} is a single-node store (LMDB): it cannot be opened shared=True; copy it "
            f"into a shared store with: castore copy {root} NEW_DIR (after creating NEW_DIR "
            "with castore.open(NEW_DIR, shared=True))",
            path=str(root),
        )
    exists = root.is_dir()
    reason = readonly_mode.choose(
        str(root), readonly, writable=not exists or readonly_mode.is_writable(root)
    )
    if not exists:
        if not create or reason is not None:
            raise StoreNotFoundError(f"no castore store at {root}", path=str(root))
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            message = f"cannot create store directory {root}: {exc}"
            raise StoreError(message, path=str(root)) from exc
    blobs = PosixBlobStore(root)
    return open_blob_store(
        blobs, str(root), create=create, chunk_size=chunk_size, readonly=reason, **blob_options
    )


def open_s3_store(
    bucket: str,
    prefix: str,
    *,
    create: bool = True,
    chunk_size: int | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
    s3_options: dict[str, Any] | None = None,
    shared: bool = True,
    readonly: bool | None = None,
    **blob_options: Any,
) -> Store:
    """Open (or create) the store at ``s3://bucket/prefix``; see :func:`castore.open`.

    A store on S3 is always shared: ``shared`` is accepted, so that one call
    with ``shared=True`` opens a directory or a URL alike. A store on S3 is
    read-only only when asked (``readonly=True``): whether the credentials may
    write cannot be learnt without writing. Reads need no write, so credentials
    that only read work without it; a write they are refused raises
    StoreAccessDeniedError from the first request.
    """
    from castore.blob.s3 import S3BlobStore

    if blob_options.pop("map_size", None) is not None:
        raise ValueError("map_size sizes a local store's LMDB file; an S3 store has none")
    if chunk_size is not None:
        chunk_size = _check_chunk_size(chunk_size)
    where = f"s3://{bucket}/{prefix}".rstrip("/")
    blobs = S3BlobStore(
        bucket, prefix, endpoint_url=endpoint_url, region=region, **(s3_options or {})
    )
    reason = ReadOnly(where, readonly_mode.ASKED) if readonly else None
    return open_blob_store(
        blobs, where, create=create, chunk_size=chunk_size, readonly=reason, **blob_options
    )


def local_lmdb_store(path: str | os.PathLike[str], doing: str, why: str) -> Path:
    """The directory of the local (LMDB) store ``path`` names, for an offline tool.

    Raises UnsupportedOperationError, in one line, for a store on blobs (an
    ``s3://`` URL, or a directory whose marker names the ``blobs`` backend):
    ``doing`` is what does not apply and ``why`` says why.
    """
    location = parse_location(path)
    if location.scheme == "s3" or _names_blobs(location.path / MARKER):
        raise UnsupportedOperationError(
            f"{doing} does not apply to {location.url}, a store on object storage or a "
            f"shared directory: {why}"
        )
    return location.path


def _check_chunk_size(chunk_size: int) -> int:
    """A chunk size a caller asks for: positive, and one the marker check accepts later."""
    try:
        size = operator.index(chunk_size)
    except TypeError:
        raise ValueError(f"chunk_size must be an integer, got {chunk_size!r}") from None
    if not 0 < size <= MAX_CHUNK_SIZE:
        raise ValueError(
            f"chunk_size must be positive and at most {MAX_CHUNK_SIZE} bytes, got {size}"
        )
    return size


def _marker_or_new_store(
    root: Path,
    *,
    create: bool,
    chunk_size: int | None,
    found: dict[str, Any] | None = None,
    codec: str = DEFAULT_LOCAL_CODEC,
) -> dict[str, Any]:
    """The marker's settings, creating the store first if the directory is empty.

    ``found``: the marker's JSON as the caller read it (its checks are made here).
    """
    marker = root / MARKER
    if found is not None:
        return check_marker(marker, found)
    if os.path.lexists(marker):  # lexists: a symlinked marker is refused by the read, not skipped
        return read_marker(marker)
    if not root.exists() or _is_empty(root):
        if not create:
            raise StoreNotFoundError(f"no castore store at {root}", path=str(root))
        return _create_store(root, chunk_size or DEFAULT_CHUNK_SIZE, codec)
    # Another process may have created the store since the first look: its marker
    # is the first entry it makes, so a directory with entries and no marker now
    # has one if (and only if) it is a store being created.
    if os.path.lexists(marker):
        return read_marker(marker)
    raise NotAStoreError(
        f"{root} is a non-empty directory without {MARKER}: not a castore store", path=str(root)
    )


def read_marker(marker: Path) -> dict[str, Any]:
    try:
        data = read_store_file(marker, limit=_MAX_MARKER)
        if len(data) > _MAX_MARKER:
            raise ValueError(f"larger than {_MAX_MARKER} bytes")
        config = json.loads(data)
    except (OSError, ValueError, RecursionError) as exc:
        raise NotAStoreError(
            f"store marker {marker} is unreadable: {exc}", path=str(marker)
        ) from exc
    return check_marker(marker, config)


def check_marker(marker: Path, config: Any) -> dict[str, Any]:
    """The settings of the marker ``config`` (its parsed JSON), or the error it deserves."""
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
    check_marker_chunk_size(marker, config.get("chunk_size"))
    marker_codec(marker, config)
    backend = config.get("backend", "lmdb")  # markers of the first stores may lack it
    if backend != "lmdb":
        raise UnsupportedBackendError(
            f"store marker {marker} names backend {backend!r}; this castore opens "
            "'lmdb' stores: upgrade castore",
            path=str(marker.parent),
        )
    return config


def upgrade_for_frames(root: Path) -> int | None:
    """Make a local store older than chunk frames (format 2) format 4, codec "none".

    Its records stay as they are (a raw record is valid format 4); what changes
    is that a frame written afterwards (a peer's copy, a save with a codec) is
    in a store that a castore older than frames refuses whole ("upgrade
    castore") instead of reporting the frame as damage. The marker is replaced
    atomically; processes doing this at once all write the same settings.
    Returns the version it had (None: frames were allowed already). A store on
    blobs older than frames (format 3) is refused: its marker is not rewritten.
    """
    marker = root / MARKER
    config = _read_config(marker)
    if config is None:  # opened a moment ago: its marker was read then
        raise NotAStoreError(f"store marker {marker} is unreadable", path=str(root))
    version = int(config.get("format_version", 0))
    if version >= STORE_VERSION:
        return None
    if config.get("backend") == "blobs":
        raise UnsupportedOperationError(
            f"{root} is a format {version} store on blobs, older than chunk compression: "
            "it cannot be a fast tier (it may receive compressed chunks); copy it into a "
            "new store (castore copy) and use that",
            path=str(root),
        )
    upgraded = {**config, "format_version": STORE_VERSION, "codec": "none"}
    text = json.dumps(upgraded, indent=2, sort_keys=True) + "\n"
    temp = root / f".{MARKER}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    with writing(f"upgrading the store marker {marker}", root):
        try:
            _write_synced(temp, text.encode())
            os.replace(temp, marker)
        finally:
            temp.unlink(missing_ok=True)
        fsync_dir(root)
    return version


def _is_empty(root: Path) -> bool:
    """No entries but other processes' half-written markers (see _create_store)."""
    return all(entry.name.startswith(f".{MARKER}.") for entry in root.iterdir())


def _create_store(root: Path, chunk_size: int, codec: str = DEFAULT_LOCAL_CODEC) -> dict[str, Any]:
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
        "codec": codec,
        "backend": "lmdb",
        "created": time.time(),
    }
    temp = root / f".{MARKER}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    phase = f"creating the store marker {root / MARKER}"
    try:
        with writing(phase, root):
            _write_synced(temp, text.encode())
            try:
                os.link(temp, root / MARKER)
            except FileExistsError:
                return read_marker(root / MARKER)  # another process created it first
    finally:
        temp.unlink(missing_ok=True)
    with writing(phase, root):
        fsync_dir(root)
    RefStore(root).ensure_dirs()
    return config


def _write_synced(path: Path, data: bytes) -> None:
    """Create ``path`` (never through a symlink) holding ``data``, synced."""
    fd = open_store_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
