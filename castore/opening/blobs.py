"""A format-3 store: every part laid out as blobs (S3, a shared directory, memory).

The marker blob ``castore.json`` holds the same JSON as a format-2 store's
marker file, with ``"format_version": 3``, ``"backend": "blobs"`` and a random
``store_id`` (which names the per-node index cache). It is created with
create-if-absent, so several ranks may create one store at once: one marker
wins and every rank reads it.

A ``Store`` over blobs is built from :class:`castore.chunkstore.blobpacks.BlobPackBackend`
(packs, index blobs, objects) and :func:`castore.repo.blobs.blob_refs` (refs,
reflog records, tags, run and store leases).
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

from castore.blob.base import BlobStore
from castore.blob.counting import CountingBlobStore
from castore.blob.readonly import ReadOnlyBlobStore
from castore.chunkstore.blobcache import IndexCache, default_cache_dir
from castore.chunkstore.blobpacks import DEFAULT_PACK_BYTES, BlobPackBackend
from castore.core.chunkio import DEFAULT_CHUNK_SIZE
from castore.errors import (
    BlobExistsError,
    BlobTooLargeError,
    FormatVersionError,
    NotAStoreError,
    StoreNotFoundError,
    UnsupportedBackendError,
    UnsupportedOperationError,
)
from castore.format.codec import SETTINGS, check_setting
from castore.format.objects import MAX_CHUNK_SIZE  # a marker naming more is refused, like an entry
from castore.repo.blobs import blob_refs
from castore.repo.leases import DEFAULT_STORE_LEASE
from castore.store import Store
from castore.support.readonly import ReadOnly

MARKER = "castore.json"
STORE_FORMAT = "castore-store"
BLOB_VERSION = 4
# Format 3: the same layout, before chunk records could be frames (castore.format.codec).
OLDEST_BLOB_VERSION = 3
# A new store on blobs compresses by default: its writes are network- or disk-bound
# (docs/PERFORMANCE.md "Compression").
DEFAULT_BLOB_CODEC = "auto"
BLOB_BACKEND = "blobs"
_MAX_MARKER = 1 << 16


def open_blob_store(
    blobs: BlobStore,
    where: str,
    *,
    create: bool = True,
    chunk_size: int | None = None,
    cache_dir: str | Path | None = None,
    store_lease: float = DEFAULT_STORE_LEASE,
    pack_bytes: int = DEFAULT_PACK_BYTES,
    readonly: ReadOnly | None = None,
    codec: str | None = None,
) -> Store:
    """Open (or create) the format-3 store laid out on ``blobs``; ``where`` names it in messages.

    ``readonly`` (why the store is read-only): it is read through a view that
    refuses every write (castore.blob.readonly), and never created. Reads take
    no lease; the per-node index cache lives outside the store and is still kept.
    Every request is counted (castore.blob.counting; ``Store.blob_requests``).
    """
    counted = CountingBlobStore(blobs)
    blobs = counted
    if readonly is not None:
        blobs = ReadOnlyBlobStore(blobs, readonly)
        create = False
    if codec is not None:
        check_setting(codec)
    config = marker_or_new_store(
        blobs, where, create=create, chunk_size=chunk_size, codec=codec or DEFAULT_BLOB_CODEC
    )
    size = chunk_size or int(config["chunk_size"])
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache = IndexCache(directory, str(config["store_id"]))
    backend = BlobPackBackend(blobs, cache=cache, pack_bytes=pack_bytes)
    refs = blob_refs(blobs, store_lease=store_lease)
    refs.readonly = readonly
    refs.identity = f"blobs:{config['store_id']}"
    store = Store(
        where,
        backend,
        size,
        refs=refs,
        readonly=readonly,
        blob_requests=counted.requests,
        codec=store_codec(config, codec, where),
    )
    backend.check_lease = refs.check_store_lock
    return store


def marker_or_new_store(
    blobs: BlobStore,
    where: str,
    *,
    create: bool,
    chunk_size: int | None,
    codec: str = DEFAULT_BLOB_CODEC,
) -> dict[str, Any]:
    """The marker's settings; a store is created first where there is nothing at all."""
    found = _read(blobs, where)
    if found is not None:
        return found
    if next(iter(blobs.list("")), None) is not None:
        # Another rank may have created the store since the first look: its marker
        # is the first blob it writes, so a prefix with blobs and no marker now has
        # one if (and only if) it is a store being created.
        found = _read(blobs, where)
        if found is not None:
            return found
        raise NotAStoreError(
            f"{where} holds objects but no {MARKER}: not a castore store", path=where
        )
    if not create:
        raise StoreNotFoundError(f"no castore store at {where}", path=where)
    config = {
        "format": STORE_FORMAT,
        "format_version": BLOB_VERSION,
        "backend": BLOB_BACKEND,
        "chunk_size": chunk_size or DEFAULT_CHUNK_SIZE,
        "codec": codec,
        "store_id": secrets.token_hex(16),
        "created": time.time(),
    }
    try:
        blobs.create(MARKER, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    except BlobExistsError:
        pass  # another rank created the store first: its marker counts
    found = _read(blobs, where)
    assert found is not None  # created just now, by us or another
    return found


def _read(blobs: BlobStore, where: str) -> dict[str, Any] | None:
    try:
        found = blobs.read_versioned(MARKER)
    except BlobTooLargeError as exc:
        raise NotAStoreError(f"store marker of {where} is unreadable: {exc}", path=where) from exc
    if found is None:
        return None
    return check_blob_marker(found[0], where)


def check_blob_marker(data: bytes, where: str) -> dict[str, Any]:
    """A format-3 marker's settings, checked; the errors say what is wrong and where."""
    try:
        config = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise NotAStoreError(f"store marker of {where} is unreadable: {exc}", path=where) from exc
    if not isinstance(config, dict) or config.get("format") != STORE_FORMAT:
        raise NotAStoreError(f"{where}/{MARKER} is not a castore store marker", path=where)
    version = config.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version > BLOB_VERSION:
        raise FormatVersionError(
            f"store written by format version {version}; this castore reads up to "
            f"{BLOB_VERSION}: upgrade castore",
            path=where,
        )
    if version < OLDEST_BLOB_VERSION or config.get("backend") != BLOB_BACKEND:
        raise UnsupportedBackendError(
            f"store marker of {where} names format {version} backend {config.get('backend')!r}; "
            f"a store on object storage or a shared directory is format {OLDEST_BLOB_VERSION} "
            f"or {BLOB_VERSION}, backend {BLOB_BACKEND!r}",
            path=where,
        )
    check_marker_chunk_size(f"{where}/{MARKER}", config.get("chunk_size"))
    marker_codec(f"{where}/{MARKER}", config)
    store_id = config.get("store_id")
    # ASCII only: it names the per-node cache directory (a non-ASCII letter is alnum too).
    if not (
        isinstance(store_id, str)
        and store_id.isascii()
        and store_id.isalnum()
        and len(store_id) <= 64
    ):
        raise NotAStoreError(f"store marker of {where} has no valid store_id", path=where)
    return config


# The first format whose chunk records may be frames (castore.format.codec), local or on blobs.
CODEC_VERSION = 4


def marker_codec(marker: Path | str, config: dict[str, Any]) -> str | None:
    """The codec a marker remembers; None for a store older than chunk frames.

    A marker of format 4 or later must name a codec this castore knows: one it
    does not may write frames it cannot read, so the store is refused whole.
    """
    codec = config.get("codec")
    if config.get("format_version", 0) < CODEC_VERSION:
        return None
    if codec not in SETTINGS:
        raise FormatVersionError(
            f"store marker {marker} names codec {codec!r}; this castore knows "
            f"{', '.join(SETTINGS)}: upgrade castore",
            path=str(marker),
        )
    return str(codec)


def store_codec(config: dict[str, Any], asked: str | None, where: str) -> str:
    """The codec a handle's saves use: ``asked`` (castore.open's ``codec=``), else the
    marker's; a store older than chunk frames is written raw, and refuses another codec."""
    remembered = marker_codec(f"{where}/{MARKER}", config)
    if asked is None:
        return remembered or "none"
    check_setting(asked)
    if asked != "none" and remembered is None:
        raise UnsupportedOperationError(
            f"{where} is a format {config.get('format_version')} store, older than chunk "
            f"compression: it can only be written with codec='none'; to compress, copy it "
            "into a new store (castore copy)",
            path=where,
        )
    return asked


def check_marker_chunk_size(marker: Path | str, chunk_size: Any) -> None:
    # The marker may come from anywhere: a chunk size it names sizes every buffer a save cuts.
    if chunk_size is None:
        raise NotAStoreError(f"store marker {marker} has no chunk size", path=str(marker))
    valid = isinstance(chunk_size, int) and not isinstance(chunk_size, bool)
    if not valid or not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise NotAStoreError(
            f"store marker {marker} has chunk_size {chunk_size!r}: must be a positive "
            f"integer of at most {MAX_CHUNK_SIZE} bytes",
            path=str(marker),
        )
