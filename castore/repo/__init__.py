"""A repository built from parts: chunks and objects, refs, reflog, tags, locks.

A ``Store`` is a facade over a chunk backend (:mod:`castore.chunkstore`) and
the mutable parts defined here, each an interface with a local-directory
implementation, an in-memory one, and a contract suite in
:mod:`castore.testing` that every implementation passes:

=====================  ===========================  =======================
interface              local directory              memory
=====================  ===========================  =======================
``base.RefTable``      ``local.LocalRefTable``      ``memory.MemoryRefTable``
``base.Reflog``        ``localreflog.LocalReflog``  ``memory.MemoryReflog``
``base.TagTable``      ``local.LocalTagTable``      ``memory.MemoryTagTable``
``base.StoreLocks``    ``local.LocalLocks``         ``memory.MemoryLocks``
=====================  ===========================  =======================

:class:`castore.repo.refstore.ComposedRefStore` composes one of each under the
method names ``Store`` calls (``store.refs``); ``local.RefStore`` and
``memory.MemoryRefStore`` are its two compositions, and
:func:`castore.opening.memory.memory_store` builds a whole ``Store`` in memory
(also found as ``castore.repo.memory.memory_store``, its documented path).

Format 3 (``castore.open("s3://...")``, ``castore.open(path, shared=True)``):
:mod:`castore.repo.blobs` implements the same interfaces over a blob store
(``BlobRefTable``, ``BlobTagTable``; ``BlobStoreLocks``: run leases and store
leases across nodes, :mod:`castore.repo.leases`; the open lock in one
process only; ``BlobReflog`` from :mod:`castore.repo.blobreflog`), composed
by ``blobs.blob_refs(blobs)``.

Both reflogs keep a derived index (:mod:`castore.repo.reflogindex`) so that a
new handle finds a generation by id reading a few records, not all of them.

Only names that carry no storage are imported here, so ``castore.store`` can
import this package without a cycle.
"""

from castore.repo.base import LockHold, Reflog, RefTable, StoreLocks, TagTable
from castore.repo.records import ReflogView, RefValue
from castore.repo.refstore import ComposedRefStore, RepoParts

__all__ = [
    "ComposedRefStore",
    "LockHold",
    "RefTable",
    "RefValue",
    "Reflog",
    "ReflogView",
    "RepoParts",
    "StoreLocks",
    "TagTable",
]
