"""Multi-rank save and restore over torch.distributed (gloo, NCCL, ...).

Save is a two-phase commit (invariants 1, 2): the coordinator proposes the
generation id; every rank commits its chunks and shard manifest and
acknowledges; the coordinator re-reads every shard manifest, checks that the
sharded tensors cover their global shapes exactly once, and only then commits
the root and advances the ref; the outcome is broadcast. Any failure or dead
rank means nothing is published.

Restore (invariants 4, 5) is exported here as ``load``: each rank verifies
only the chunks its target boxes overlap, all ranks agree, and only then does
any rank write into its live tensors.

Every collective wait is bounded by ``timeout`` seconds. Behind this face:
:mod:`castore.dist.saver` (``save``, blocking and async; DCP's
``state_dict_saver``, not named ``save``, which is the function),
:mod:`castore.dist.groupcommit` (the two-phase commit),
:mod:`castore.dist.restore` (``load``), :mod:`castore.dist.replicas`
(replicated values compared across ranks), :mod:`castore.dist.holders`
(which ranks hold which parts of a state some ranks pass as empty dicts) and
:mod:`castore.dist.comm` (the collectives and their failures).
"""

from __future__ import annotations

from castore.core.background import PendingSave
from castore.dist.restore import LoadReport, LoadResult, load
from castore.dist.saver import save

__all__ = ["LoadReport", "LoadResult", "PendingSave", "load", "save"]
