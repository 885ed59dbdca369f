"""Opening a store: the front door that builds a ``Store`` from its parts.

One floor above ``castore.store`` (docs/DEVELOPMENT.md, "Where things live"):
nothing in the engine (``castore.core``) uses it.

=================================  ==================================================
module                             holds
=================================  ==================================================
:mod:`castore.opening.location`    an address parsed once: a path, ``file://``, ``s3://``
:mod:`castore.opening.directory`   ``open_address``; a store directory: its marker,
                                   creating, recognising and opening it (LMDB or shared)
:mod:`castore.opening.blobs`       a format-3 store, every part laid out as blobs
:mod:`castore.opening.memory`      ``memory_store``: a whole store in memory, for tests
=================================  ==================================================
"""

from castore.opening.blobs import open_blob_store
from castore.opening.directory import (
    MARKER,
    local_lmdb_store,
    open_address,
    open_s3_store,
    open_store,
    read_marker,
    upgrade_for_frames,
)
from castore.opening.location import Location, parse_location
from castore.opening.memory import memory_store

__all__ = [
    "MARKER",
    "Location",
    "local_lmdb_store",
    "memory_store",
    "open_address",
    "open_blob_store",
    "open_s3_store",
    "open_store",
    "parse_location",
    "read_marker",
    "upgrade_for_frames",
]
