"""castore: a content-addressed checkpoint store for multi-rank ML training.

>>> import castore
>>> store = castore.open("./ckpt")
>>> gen = store.save({"w": weights}, run="exp1", step=100)
>>> state = store.load("exp1")
"""

from __future__ import annotations

import os
from typing import Any

from castore import errors
from castore.copying import CopyReport, copy
from castore.core.background import AsyncOptions, PendingSave, SaveBytes
from castore.core.history import Generation, SaveStats
from castore.errors import (
    CastoreError,
    ChecksumMismatchError,
    ChunkMissingError,
    CodecError,
    FormatVersionError,
    GenerationNotFoundError,
    IntegrityError,
    InvalidNameError,
    RefConflictError,
    StoreError,
    UnsupportedValueError,
)
from castore.export_verify import ExportCheck, verify_export
from castore.format.shard import NotLoaded, RankLocal, Shard
from castore.lineage import amend, branch
from castore.opening import open_address
from castore.store import Store
from castore.tiers import TieredStore, open_tiered
from castore.version import __version__

__all__ = [
    "AsyncOptions",
    "CastoreError",
    "ChecksumMismatchError",
    "ChunkMissingError",
    "CodecError",
    "CopyReport",
    "ExportCheck",
    "FormatVersionError",
    "Generation",
    "GenerationNotFoundError",
    "IntegrityError",
    "InvalidNameError",
    "NotLoaded",
    "PendingSave",
    "RankLocal",
    "RefConflictError",
    "SaveBytes",
    "SaveStats",
    "Shard",
    "Store",
    "StoreError",
    "TieredStore",
    "UnsupportedValueError",
    "__version__",
    "amend",
    "branch",
    "copy",
    "errors",
    "open",
    "open_tiered",
    "verify_export",
]


def open(  # noqa: A001 - the public name the API promises
    path: str | os.PathLike[str],
    *,
    create: bool = True,
    chunk_size: int | None = None,
    readonly: bool | None = None,
    **options: Any,
) -> Store:
    """Open the castore store at ``path``, creating it (when ``create``) if absent.

    ``path`` is a local directory (a string or path-like), a ``file://`` URL or
    ``s3://BUCKET/PREFIX``; any other URL scheme raises UnsupportedBackendError,
    never a directory named after the URL. The embedded default backend keeps
    chunk bytes in pack files and their index and the manifests in LMDB, all
    inside the store directory: one node. ``shared=True`` (or a directory
    created so) lays the store out as blobs in a directory several nodes share
    (NFS, Lustre); ``s3://`` lays it out as objects (format 3, docs/FORMAT_BLOBS.md).

    Options of stores on blobs: ``cache_dir`` (the per-node index cache;
    default ``$CASTORE_CACHE_DIR`` or ``~/.cache/castore``), ``store_lease``
    (seconds before a dead holder's store lease is broken, default 60),
    ``pack_bytes`` (the size packs are cut at). Of S3 stores: ``endpoint_url``
    and ``region`` (default: boto3's chain, ``AWS_ENDPOINT_URL``), and
    ``s3_options`` (keyword arguments of castore.blob.s3.S3BlobStore, e.g.
    credentials). ``map_size`` applies to local LMDB stores only.
    ``chunk_size`` (bytes) sets the default for a new store, or overrides it
    for this handle's saves; dedup works between saves of equal chunk size.

    ``readonly=True`` opens the store read-only: loads, slices, listings,
    verify and export work, and every write (save, tag, gc, repair, a copy or
    an import into it) raises ReadOnlyStoreError; nothing in the store is
    created or changed, not even a lock file. The default (None) opens a
    directory that is not writable (a read-only mount, another user's
    directory) read-only on its own, saying so once with a ReadOnlyWarning;
    ``readonly=False`` never does. An S3 store is read-only only when asked:
    reads need no write, so credentials that only read work either way.
    """
    return open_address(path, create=create, chunk_size=chunk_size, readonly=readonly, **options)
