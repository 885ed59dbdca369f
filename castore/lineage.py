"""Generations made from other generations, in O(metadata): branch and amend.

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

:func:`amend` publishes a generation with subtrees dropped (``drop``: glob
patterns over key paths, ``optim/**``: the optimizer state left out of a
release) and keys renamed (``rename``: ``model.`` stripped for another
framework): the same manifests less the dropped tensors' entries, renamed,
the same chunks; on the same run (its next generation) or a new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from fnmatch import fnmatchcase
from typing import Any

from castore.core.commit import (
    PublishFaults,
    claim_writer,
    commit_objects,
    make_root,
    publish_shards,
)
from castore.core.history import Generation, GenerationSpec
from castore.errors import AmendError, CorruptObjectError, RefConflictError
from castore.format.hashing import digest_bytes
from castore.format.objects import GenerationRoot, ShardManifest, TensorEntry, encode_object
from castore.format.tree import drop_paths, escape_key, join_path, rename_paths, tensor_names
from castore.repo.records import RefValue, validate_run_name
from castore.store import Store

LINEAGE_FAULTS = PublishFaults(
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
        lineage = {
            "op": "branch",
            "from": [{"run": run, "generation": source.generation, "root": digest.hex}],
        }
        return _publish(store, source, shards, new_run, None, source.state, {}, lineage=lineage)


def amend(
    store: Store,
    run: str,
    generation: GenerationSpec = "latest",
    *,
    drop: Sequence[str] = (),
    rename: Sequence[tuple[str, str]] = (),
    to_run: str | None = None,
) -> Generation:
    """Publish ``run@generation`` less every subtree whose key path matches a pattern of
    ``drop`` (``fnmatch``: ``optim/**``, ``model/*.bias``; ``optim/**`` drops ``optim``
    itself too), then with keys renamed by ``rename`` (``(OLD, NEW)`` key path prefixes
    that end inside one key: ``("model.", "")`` turns ``model.layers.0.weight`` into
    ``layers.0.weight``; ``("model/enc.", "model/encoder.")`` works one level down), as
    the next generation of ``to_run`` (default ``run``; a new run starts at 1). No chunk
    is written. AmendError: nothing asked, a pattern or prefix that matches no key path,
    a rename that moves a key to another level, two keys renamed alike, a renamed
    per-rank value, or no tensor left."""
    target = run if to_run is None else validate_run_name(to_run)
    if not drop and not rename:
        raise AmendError("nothing to amend: give a pattern to drop or a key to rename")
    renames = [_checked_rename(old, new) for old, new in rename]
    digest, source = store.resolve_root(run, generation)
    where = f"{run}@{source.generation}"
    stems = [p[: -len("/**")] if p.endswith("/**") else None for p in drop]

    def matches(path: str) -> bool:
        return any(
            fnmatchcase(path, p) or path == stem for p, stem in zip(drop, stems, strict=True)
        )

    skeleton, dropped = drop_paths(source.state, matches) if drop else (source.state, [])
    for pattern, stem in zip(drop, stems, strict=True):
        if not any(fnmatchcase(p, pattern) or p == stem for p in dropped):
            raise AmendError(f"--drop {pattern!r} matches no key path of {where}")
    kept = {name for name, _ in tensor_names(skeleton)}
    if not kept:
        raise AmendError(f"dropping {', '.join(drop)} would leave no tensor of {where}")
    names: dict[str, str] = {}
    if renames:
        skeleton, names = _renamed(skeleton, renames, where)
    shards = store.read_shards(source)
    with store.save_lock():
        parent = store.refs.read(target)
        lineage = {
            "op": "amend",
            "from": [{"run": run, "generation": source.generation, "root": digest.hex}],
            "drop": list(drop),
            "rename": [list(pair) for pair in rename],
        }
        return _publish(
            store, source, shards, target, parent, skeleton, names, kept=kept, lineage=lineage
        )


def _publish(
    store: Store,
    source: GenerationRoot,
    shards: list[ShardManifest],
    run: str,
    parent: RefValue | None,
    skeleton: bytes,
    names: dict[str, str],
    *,
    lineage: dict[str, Any],
    kept: set[str] | None = None,
) -> Generation:
    """Publish ``source``'s manifests rewritten as the next generation of ``run`` (after
    ``parent``): with the tree ``skeleton``, only the tensors ``kept`` (default all),
    renamed by ``names``; no chunk. The caller holds the store's save lock."""
    generation = 1 if parent is None else parent.generation + 1

    def keeps(entry: TensorEntry) -> bool:
        return kept is None or entry.name in kept

    objects = []
    for shard in shards:
        rewritten = ShardManifest(
            run=run,
            generation=generation,
            rank=shard.rank,
            tensors=tuple(_named(e, names) for e in shard.tensors if keeps(e)),
            local_state=shard.local_state,
            writer=dict(shard.writer),
            local_tensors=tuple(shard.local_tensors),
        )
        data = encode_object(rewritten)
        objects.append((digest_bytes(data), data))
    commit_objects(store, objects)
    writer = claim_writer(store, run, parent, source.step)

    def build_root(checked: Any) -> GenerationRoot:
        return make_root(
            run=run,
            generation=generation,
            step=source.step,
            parent=parent,
            world_size=source.world_size,
            shards=checked.digests,
            state=skeleton,
            metadata=source.metadata,
            stats={
                **source.stats,
                "logical_bytes": sum(e.nbytes for boxes in checked.entries.values() for e in boxes),
                "tensors": checked.tensors,
                "new_bytes": 0,
                "new_chunks": 0,
                "stored_bytes": 0,
                "written_bytes": sum(len(data) for _, data in objects),
            },
            frameworks=dict(source.frameworks),
            writer=writer,
            data_order=dict(source.data_order),
            layouts={
                names.get(k, k): v for k, v in source.layouts.items() if kept is None or k in kept
            },
            whole=[_named(e, names) for e in source.whole if keeps(e)],
            lineage=lineage,
        )

    digest, root = publish_shards(
        store,
        run=run,
        generation=generation,
        parent=parent,
        shards=[key for key, _ in objects],
        build_root=build_root,
        faults=LINEAGE_FAULTS,
        skeleton=skeleton,
    )
    return Generation.from_root(digest, root)


def _checked_rename(old: str, new: str) -> tuple[str, str, str]:
    """(parent key path, OLD's part of the key, NEW's part) of a rename; AmendError where
    it would move keys to another level or leave a key empty."""
    parent, _, head = old.rpartition("/")
    new_parent, _, new_head = new.rpartition("/")
    if not head or parent != new_parent:
        raise AmendError(
            f"--rename {old!r}={new!r}: a rename changes the start of one key (both sides "
            "with the same path before the key's last '/'), not a key's level"
        )
    return parent, head, new_head


def _renamed(
    skeleton: bytes, renames: list[tuple[str, str, str]], where: str
) -> tuple[bytes, dict[str, str]]:
    used = [False] * len(renames)

    def rename(parent: str, key: str) -> str | None:
        if escape_key(key) != key:
            return None  # a key with '/' or '%' is left as it is
        for i, (at, head, new_head) in enumerate(renames):
            if parent == at and key.startswith(head):
                used[i] = True
                name = new_head + key[len(head) :]
                if not name or escape_key(name) != name:
                    raise AmendError(f"renaming {join_path(parent, key)!r} would give key {name!r}")
                return name
        return None

    try:
        tree, names, moved = rename_paths(skeleton, rename)
    except CorruptObjectError as exc:
        raise AmendError(f"renaming keys of {where}: {exc}") from exc
    for (at, head, _), hit in zip(renames, used, strict=True):
        if not hit:
            old = f"{at}/{head}" if at else head
            raise AmendError(f"--rename {old!r} matches no key of {where}")
    if moved:
        raise AmendError(f"renaming the per-rank value {moved[0]!r} is not supported")
    return tree, names


def _named(entry: TensorEntry, names: dict[str, str]) -> TensorEntry:
    new = names.get(entry.name, entry.name)
    return entry if new == entry.name else replace(entry, name=new)
