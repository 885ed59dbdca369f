"""Re-saves that skip hashing what did not change: trusting torch's version counters.

Opt in with ``Store.save(..., trust_versions=True)`` (and ``castore.dist.save``).
By default every save hashes every byte: that is what makes a generation's
digests true whatever the caller did to its tensors. A trusting save skips
the hash (and the write) of a plain CPU torch tensor that this store handle
saved before under the same key path of the same run, when it lies in the
same memory (the same storage, still alive, at the same address), has the
same dtype and shape, and its version counter (``tensor._version``) has not
moved since and is not 0: the tensor entry names the chunks of the last save,
after checking that the store still holds every one of them (a collection
since may have removed them). ``model.state_dict()`` returns new tensor
objects each call (``detach``), which share the parameters' storage and
counter, so a training loop that saves ``state_dict()`` each time is covered.
A counter at 0 (a tensor never changed in place since it was made, or an
alias made with ``.data``, whose counter is its own) is never trusted.

The version counter moves with every in-place operation that goes through
PyTorch's dispatcher, on the tensor or on any view of it (optimizer steps,
``copy_``, ``add_``, ``zero_``, ``load_state_dict``, in ``no_grad`` too). It
does not move when memory is written around PyTorch, and then a trusting
save records bytes the tensor no longer holds:

- writes through ``tensor.data`` (``p.data.add_(...)``: ``.data`` is a tensor
  with a counter of its own; ``.detach()`` shares the tensor's, and is safe),
  or a saved ``.data`` alias kept across saves while the tensor it aliases
  changes;
- writes through a NumPy array from ``tensor.numpy()``, a DLPack or buffer
  export, ``ctypes`` or a C/C++ extension writing the pointer;
- another process writing shared memory (``share_memory_()``, a mapped file).

Use it when the training loop changes tensors only through PyTorch operations
(which is what optimizers and ``load_state_dict`` do); ``castore verify`` cannot
catch a wrong trusting save afterwards, because the chunks it names are
intact, only older than the tensor.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from castore.chunkstore.base import ChunkBackend, Namespace
from castore.core.chunkio import leaf_cell
from castore.format.objects import TensorEntry
from castore.format.tree import TensorLeaf


@dataclass(frozen=True)
class _Seen:
    """One tensor as a save wrote it: which memory, at which version, as which chunks."""

    storage: weakref.ref[Any]  # torch keeps one Python object per live storage
    version: int
    address: int
    entry: TensorEntry

    def holds(self, leaf: TensorLeaf, chunk_size: int) -> bool:
        entry, source = self.entry, leaf.source
        return (
            source is not None
            and leaf.version == self.version
            and source._version == self.version  # not moved since it was encoded
            and source.data_ptr() == self.address
            and entry.chunk_size == chunk_size
            and entry.cell == leaf_cell(leaf, chunk_size)  # cut the way this save cuts
            and entry.nbytes == leaf.data.nbytes
            and entry.dtype == leaf.dtype
            and entry.shape == leaf.shape
            and entry.offsets == leaf.offsets
            and entry.local_shape == leaf.local_shape
            and self.storage() is source.untyped_storage()  # not new memory at a freed address
        )


class VersionCache:
    """Per store handle: the chunks each torch tensor of each run was last saved as."""

    def __init__(self) -> None:
        self._runs: dict[str, dict[str, _Seen]] = {}

    def known(
        self, backend: ChunkBackend, run: str, leaves: Sequence[TensorLeaf], chunk_size: int
    ) -> dict[int, TensorEntry]:
        """Leaf index -> the entry it was last saved as (its chunk digests and their
        pieces), for the leaves a trusting save need not hash.

        Only where the store still holds every chunk: the caller holds the save
        lock, so garbage collection cannot remove them before it publishes.
        """
        known = self.unmoved(run, leaves, chunk_size)
        keys = list({key for entry in known.values() for key in entry.chunks})
        present = dict(zip(keys, backend.has_many(Namespace.CHUNKS, keys), strict=True))
        return {i: e for i, e in known.items() if all(present[k] for k in e.chunks)}

    def unmoved(
        self, run: str, leaves: Sequence[TensorLeaf], chunk_size: int
    ) -> dict[int, TensorEntry]:
        """Leaf index -> the entry it was last recorded as, for the leaves that have not
        moved since (whether the store holds its chunks or not)."""
        seen = self._runs.get(run, {})
        return {
            index: record.entry
            for index, leaf in enumerate(leaves)
            if (record := seen.get(leaf.name)) is not None and record.holds(leaf, chunk_size)
        }

    def record(
        self,
        run: str,
        leaves: Sequence[TensorLeaf],
        entries: Sequence[TensorEntry],
        *,
        add: bool = False,
    ) -> None:
        """Remember what a published save wrote for each plain torch tensor of ``run``
        (``add``: beside what was recorded of this save already, e.g. the replicated
        tensors this rank hashed to compare but another rank wrote)."""
        seen: dict[str, _Seen] = self._runs.get(run, {}) if add else {}
        for leaf, entry in zip(leaves, entries, strict=False):
            source = leaf.source
            if source is None or leaf.version < 1 or source._version != leaf.version:
                continue  # never changed in place, or changed while it was saved
            seen[leaf.name] = _Seen(
                weakref.ref(source.untyped_storage()), leaf.version, source.data_ptr(), entry
            )
        self._runs[run] = seen
