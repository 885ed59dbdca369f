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
from castore.errors import (
    CastoreError,
    ChecksumMismatchError,
    ChunkMissingError,
    FormatVersionError,
    GenerationNotFoundError,
    IntegrityError,
    InvalidNameError,
    RefConflictError,
    StoreError,
    UnsupportedValueError,
)
from castore.history import Generation, SaveStats
from castore.shard import NotLoaded, RankLocal, Shard
from castore.store import Store

__version__ = "0.1.0"

__all__ = [
    "CastoreError",
    "ChecksumMismatchError",
    "ChunkMissingError",
    "CopyReport",
    "FormatVersionError",
    "Generation",
    "GenerationNotFoundError",
    "IntegrityError",
    "InvalidNameError",
    "NotLoaded",
    "RankLocal",
    "RefConflictError",
    "SaveStats",
    "Shard",
    "Store",
    "StoreError",
    "UnsupportedValueError",
    "__version__",
    "copy",
    "errors",
    "open",
]


def open(  # noqa: A001 - the public name the API promises
    path: str | os.PathLike[str],
    *,
    create: bool = True,
    chunk_size: int | None = None,
    **options: Any,
) -> Store:
    """Open the castore store at ``path``, creating it (when ``create``) if absent.

    ``path`` is a local directory (a string or path-like) or a ``file://`` URL;
    any other URL scheme raises UnsupportedBackendError, never a directory
    named after the URL. The embedded default backend keeps chunk bytes in pack
    files and their index and the manifests in LMDB, all inside the store
    directory.
    ``chunk_size`` (bytes) sets the default for a new store, or overrides it
    for this handle's saves; dedup works between saves of equal chunk size.
    """
    from castore.location import parse_location
    from castore.storedir import open_store

    location = parse_location(path)
    return open_store(location.path, create=create, chunk_size=chunk_size, **options)
