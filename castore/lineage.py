"""Generations made from other generations, in O(metadata): branch.

A generation is a root over shard manifests over chunks named by their hash,
so a new generation that holds what an old one holds costs only new
manifests and a root: no chunk is read, hashed or written. :func:`branch`
starts a run whose first generation is an existing one of any run (ten
fine-tunes from one base cost one base plus their changes). Its manifests and
root are the source's with the new run's name and generation id (a manifest
names its run and generation, so it cannot be shared as is); they go through
the normal publish: the store's save lock, the coordinator's checks (every
box of every tensor tiles it once, every chunk named is present), the writer
epoch and the ref's compare-and-swap, and the reflog. The root records where
it came from (``lineage``: ``op`` and ``from``, run, generation and root), which
``castore log`` shows. Garbage collection needs nothing new: the chunks are
held by every root that names them.
"""

from __future__ import annotations

from typing import Any

from castore.core.commit import (
    PublishFaults,
    claim_writer,
    commit_objects,
    make_root,
    publish_shards,
)
from castore.core.history import Generation, GenerationSpec
from castore.errors import RefConflictError
from castore.format.hashing import digest_bytes
from castore.format.objects import GenerationRoot, ShardManifest, encode_object
from castore.repo.records import validate_run_name
from castore.store import Store

BRANCH_FAULTS = PublishFaults(
    before_root="lineage.before_root",
    before_ref_advance="lineage.before_ref_advance",
    after_ref_advance="lineage.after_ref_advance",
)


def branch(store: Store, run: str, generation: GenerationSpec, new_run: str) -> Generation:
    """Start ``new_run`` with ``run@generation`` as its generation 1 (a new run: one
    that exists is refused with RefConflictError). Writes two objects per rank of the
    source and a root; no chunk."""
    validate_run_name(new_run)
    digest, source = store.resolve_root(run, generation)
    shards = store.read_shards(source)
    with store.save_lock():
        if store.refs.read(new_run) is not None:
            raise RefConflictError(
                f"run {new_run!r} exists: a branch starts a new run", run=new_run
            )
        objects = []
        for shard in shards:
            renamed = ShardManifest(
                run=new_run,
                generation=1,
                rank=shard.rank,
                tensors=tuple(shard.tensors),
                local_state=shard.local_state,
                writer=dict(shard.writer),
                local_tensors=tuple(shard.local_tensors),
            )
            data = encode_object(renamed)
            objects.append((digest_bytes(data), data))
        commit_objects(store, objects)
        writer = claim_writer(store, new_run, None, source.step)
        lineage = {
            "op": "branch",
            "from": [{"run": run, "generation": source.generation, "root": digest.hex}],
        }

        def build_root(checked: Any) -> GenerationRoot:
            return make_root(
                run=new_run,
                generation=1,
                step=source.step,
                parent=None,
                world_size=source.world_size,
                shards=checked.digests,
                state=source.state,
                metadata=source.metadata,
                stats={
                    **source.stats,
                    "new_bytes": 0,
                    "new_chunks": 0,
                    "written_bytes": sum(len(data) for _, data in objects),
                },
                frameworks=dict(source.frameworks),
                writer=writer,
                data_order=dict(source.data_order),
                layouts=dict(source.layouts),
                whole=source.whole,
                lineage=lineage,
            )

        new_digest, root = publish_shards(
            store,
            run=new_run,
            generation=1,
            parent=None,
            shards=[key for key, _ in objects],
            build_root=build_root,
            faults=BRANCH_FAULTS,
            skeleton=source.state,
        )
    return Generation.from_root(new_digest, root)
