"""castore as a storage backend for ``torch.distributed.checkpoint`` (DCP).

``dcp.save(state_dict, storage_writer=CastoreWriter(store, run="r", step=100))``
and ``dcp.load(state_dict, storage_reader=CastoreReader(store, run="r"))`` use
DCP's own planners (DTensor and FSDP resharding included); castore stores the
bytes:

* every tensor write item is one box of its global tensor, chunked into the
  CAS like every castore tensor (so unchanged chunks are never written twice,
  and every read is verified); a bytes item (a non-tensor value, which DCP's
  planner pickles) is unpickled with ``weights_only=True`` and stored as
  castore's msgpack encoding in a uint8 box, so no pickle reaches the store;
* DCP's ``Metadata`` is kept without pickle, as plain values in the root's
  metadata (``{"dcp": ...}``: dtypes by name, sizes and chunk boxes as lists);
  the layout is :mod:`castore.format.dcplayout` (docs/INTEROP.md);
* ``finish`` publishes through castore's compare-and-swap ref advance, after
  re-reading every rank's shard manifest and checking coverage and chunk
  presence: a DCP save is a castore generation (``castore log``, ``verify``,
  ``gc``), and nothing is visible before ``finish`` succeeds;
* a read item fetches only the chunks that overlap its element range; every
  rank verifies all it reads where it lies in the store's memory map, the
  ranks agree, and only then are the bytes copied once into the planner's
  tensors (invariant 4).

On a tiered store whose ranks span several nodes (castore.tiers.nodes) the
save and the load take castore.dist's path instead (:mod:`castore.dcp.nodes`).

A checkpoint id ``castore://STORE/RUN[@GEN]`` is accepted by ``reset`` and
``validate_checkpoint_id``. torch 2.13 picks a backend from ``checkpoint_id``
alone only among its own (file system, fsspec), so pass the writer or reader
explicitly: ``storage_writer=CastoreWriter.from_checkpoint_id("castore://...")``.

Behind this face: :mod:`castore.dcp.writer`, :mod:`castore.dcp.reader`,
:mod:`castore.dcp.metadata` (DCP's metadata and values without pickle),
:mod:`castore.dcp.nodes` (tiered stores on several nodes),
:mod:`castore.dcp.stores` (checkpoint ids, the store a step works on) and
:mod:`castore.dcp.importing` (``castore import`` of a DCP directory).
"""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import MetadataIndex

from castore.dcp.reader import CastoreReader
from castore.dcp.stores import parse_checkpoint_id
from castore.dcp.writer import CastoreWriter

__all__ = ["CastoreReader", "CastoreWriter", "MetadataIndex", "parse_checkpoint_id"]
