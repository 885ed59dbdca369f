"""The DCP writer and reader on a tiered store whose ranks span several nodes.

Each node has a fast tier of its own (castore.tiers.nodes), and no process
can look into another node's store, so DCP's own sequence (every rank writes,
then the coordinator re-reads every manifest and chunk in ``finish``) cannot
publish there. The writer and reader take castore.dist's path instead, inside
the DCP steps that every rank runs:

* ``write_data``: castore.dist's two-phase commit
  (:func:`castore.dist.groupcommit.publish_in_group`). Lagging nodes are caught
  up, the coordinator proposes, every rank writes its shard (empty when DCP
  gave it no item) into its node's fast tier and attests it, the peer copies
  are made, the coordinator checks every manifest and publishes on its node,
  every other node's leader on its own, and the promotion is queued. The
  root's DCP metadata is the planner's global ``Metadata``, which
  ``DefaultSavePlanner`` (every planner torch ships) keeps as
  ``planner.metadata``; ``finish`` checks that DCP hands it the same.
* ``read_metadata``: the generation ``castore.dist.load`` would read (the newest
  complete in the live nodes' fast tiers or in the durable tier), its root and
  manifests sent to every node that lacks them.
* ``read_data``: each rank's chunks from its node, a peer node or the durable
  tier (``NodeSession.fetch``); when the ranks agree that the read failed only
  for damage, once more with the damaged copies fetched from elsewhere.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from castore.core.commit import check_data_order, encode_metadata, write_shard
from castore.dcp.metadata import metadata_to_wire, state_tree
from castore.dist.comm import Group, describe, raise_failures
from castore.dist.groupcommit import RootContent, commit_shard, propose, publish_in_group
from castore.errors import UnsupportedOperationError
from castore.format.hashing import Digest
from castore.format.tree import EncodedTree
from castore.store import Store


def planned_metadata(planner: Any) -> Metadata:
    """The global Metadata of this save, as the coordinator's planner made it."""
    metadata = getattr(planner, "metadata", None)
    if not isinstance(metadata, Metadata):
        raise UnsupportedOperationError(
            "on several nodes the DCP writer publishes in write_data and needs the global "
            "Metadata there, which DefaultSavePlanner and its subclasses keep as "
            f"planner.metadata; {type(planner).__name__} does not"
        )
    return metadata


def root_content(metadata: Metadata) -> RootContent:
    """What a DCP generation's root holds (castore.format.dcplayout)."""
    wire = metadata_to_wire(metadata)
    return RootContent(state_tree(metadata), encode_metadata({"dcp": wire}), check_data_order(None))


def save_on_nodes(
    store: Store,
    comm: Group,
    run: str,
    step: int,
    encoded: EncodedTree | None,
    content: RootContent | None,
    failure: BaseException | None,
    started: float,
) -> Digest:
    """Publish every rank's ``encoded`` items as one generation of ``run`` (a collective
    call); ``content``: the coordinator's root content. Returns the root's digest on
    every rank, or raises on every rank."""
    session = store.node_session(comm, run)
    if session is not None:
        session.catch_up(run)
    infos = comm.all_gather({"error": describe(failure)}, "dcp.save: prepare")
    raise_failures(infos, comm, failure)
    assert encoded is not None
    proposal = propose(store, run, step, comm)

    def write() -> dict[str, Any]:
        shard = write_shard(
            store,
            encoded,
            run=run,
            generation=proposal["generation"],
            rank=comm.rank,
            midway_fault="dist.worker_mid_shard",
        )
        return commit_shard(store, shard, started)

    return publish_in_group(store, comm, run, step, proposal, session, write, content, started)
