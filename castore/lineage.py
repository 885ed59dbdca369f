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

:func:`amend` publishes a generation changed, in this order: subtrees dropped
(``drop``: glob patterns over key paths, ``optim/**``: the optimizer state left
out of a release), keys renamed (``rename``: ``model.`` stripped for another
framework), subtrees grafted from other generations (``graft``: a teacher's
encoder in a student; the donor's boxes and chunks, as saved), tensors
replaced by new values (``replace``: only their new chunks written, cut on the
boxes the generation saved them in, so a sharded generation stays sharded),
and user metadata edited. Every other tensor keeps its boxes and chunks; the
result is the next generation of the same run or a new one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as with_fields
from fnmatch import fnmatchcase
from typing import Any

import numpy as np

from castore.core.chunkio import WriteStats, write_leaves
from castore.core.commit import (
    PublishFaults,
    claim_writer,
    commit_objects,
    encode_metadata,
    make_root,
    publish_shards,
    whole_in_root,
)
from castore.core.history import Generation, GenerationSpec, split_address
from castore.errors import AmendError, CorruptObjectError, RefConflictError
from castore.format.dtypes import numpy_dtype
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import GenerationRoot, ShardManifest, TensorEntry, encode_object
from castore.format.tree import (
    TensorLeaf,
    decode_tree,
    dict_items_at,
    drop_paths,
    encode_tree,
    escape_key,
    join_path,
    rename_paths,
    replace_items,
    retarget_tensors,
    tensor_names,
)
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
        edit = _Edit(
            source.state,
            [list(s.tensors) for s in shards],
            dict(source.layouts),
            [_origin(run, source, digest)],
            {},
        )
        lineage = {"op": "branch", "from": edit.origins}
        return _publish(store, source, shards, new_run, None, edit, lineage=lineage)


def amend(
    store: Store,
    run: str,
    generation: GenerationSpec = "latest",
    *,
    drop: Sequence[str] = (),
    rename: Sequence[tuple[str, str]] = (),
    graft: Sequence[str] = (),
    replace: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    to_run: str | None = None,
) -> Generation:
    """Publish ``run@generation`` changed, as the next generation of ``to_run`` (default
    ``run``; a new run starts at 1). In this order:

    * ``drop``: leave out every subtree whose key path matches a pattern (``fnmatch``:
      ``optim/**``, ``model/*.bias``; ``optim/**`` drops ``optim`` itself too);
    * ``rename``: ``(OLD, NEW)`` key path prefixes that end inside one key:
      ``("model.", "")`` turns ``model.layers.0.weight`` into ``layers.0.weight``;
      ``("model/enc.", "model/encoder.")`` works one level down;
    * ``graft``: ``"RUN[@GEN]:OLD=NEW"``: the entries of RUN@GEN whose key path starts
      with OLD (a prefix ending inside one key, like a rename's) take the place of the
      entries here that start with NEW, renamed to start with NEW; a tensor that both
      have must have the same dtype and shape;
    * ``replace``: key path -> a numpy array or torch tensor, the tensor's new value;
      only its new chunks are written (cut on its saved boxes where the shape is kept);
    * ``metadata``: keys set (None removes one) in the user metadata.

    Every other tensor keeps its chunks. AmendError: nothing asked, a pattern, prefix or
    key that matches nothing, a rename or graft that moves a key to another level, two
    keys renamed alike, a per-rank value renamed or grafted, a graft whose tensors differ,
    or no tensor left; nothing is written then."""
    target = run if to_run is None else validate_run_name(to_run)
    replace, metadata = dict(replace or {}), dict(metadata or {})
    if not (drop or rename or graft or replace or metadata):
        raise AmendError(
            "nothing to amend: give a pattern to drop, a key to rename, a graft, a tensor "
            "to replace or metadata to set"
        )
    renames = [_checked_rename(old, new) for old, new in rename]
    grafts = [_parsed_graft(spec) for spec in graft]
    digest, source = store.resolve_root(run, generation)
    where = f"{run}@{source.generation}"
    skeleton, kept = _dropped(source.state, drop, where)
    names: dict[str, str] = {}
    if renames:
        skeleton, names = _renamed(skeleton, renames, where)
    shards = store.read_shards(source)
    edit = _Edit(
        skeleton,
        [[_named(e, names) for e in s.tensors if e.name in kept] for s in shards],
        {names.get(k, k): v for k, v in source.layouts.items() if k in kept},
        [_origin(run, source, digest)],
        {"drop": list(drop), "rename": [list(pair) for pair in rename]},
    )
    with store.save_lock():
        for spec, parsed in zip(graft, grafts, strict=True):
            _graft(store, edit, spec, parsed, where)
        if not tensor_names(edit.skeleton):
            raise AmendError(f"the amend would leave no tensor of {where}")
        if replace:
            _replace(store, edit, replace, where)
        meta = _edited_metadata(source.metadata, metadata, where) if metadata else None
        if meta is not None:
            edit.changes["metadata"] = {
                "set": sorted(k for k, v in metadata.items() if v is not None),
                "unset": sorted(k for k, v in metadata.items() if v is None),
            }
        lineage = {"op": "amend", "from": edit.origins, **edit.changes}
        return _publish(
            store,
            source,
            shards,
            target,
            store.refs.read(target),
            edit,
            lineage=lineage,
            metadata=meta,
        )


@dataclass
class _Edit:
    """An amend's result so far: the state's skeleton, each rank's tensor entries, the
    DTensor layouts by tensor name, the generations it comes from and what changed."""

    skeleton: bytes
    tensors: list[list[TensorEntry]]
    layouts: dict[str, Any]
    origins: list[dict[str, Any]]
    changes: dict[str, Any]
    written: WriteStats = field(default_factory=WriteStats)
    started: float = field(default_factory=time.perf_counter)


def _origin(run: str, root: GenerationRoot, digest: Digest) -> dict[str, Any]:
    return {"run": run, "generation": root.generation, "root": digest.hex}


def _publish(
    store: Store,
    source: GenerationRoot,
    shards: list[ShardManifest],
    run: str,
    parent: RefValue | None,
    edit: _Edit,
    *,
    lineage: dict[str, Any],
    metadata: bytes | None = None,
) -> Generation:
    """Publish ``edit`` (the source's manifests rewritten: per rank, its entries) as the
    next generation of ``run`` (after ``parent``). The caller holds the store's save
    lock and has written every new chunk."""
    generation = 1 if parent is None else parent.generation + 1
    objects = []
    for shard, tensors in zip(shards, edit.tensors, strict=True):
        rewritten = ShardManifest(
            run=run,
            generation=generation,
            rank=shard.rank,
            tensors=tuple(tensors),
            local_state=shard.local_state,
            writer=dict(shard.writer),
            local_tensors=tuple(shard.local_tensors),
        )
        data = encode_object(rewritten)
        objects.append((digest_bytes(data), data))
    commit_objects(store, objects)
    writer = claim_writer(store, run, parent, source.step)
    written = edit.written

    def build_root(checked: Any) -> GenerationRoot:
        return make_root(
            run=run,
            generation=generation,
            step=source.step,
            parent=parent,
            world_size=source.world_size,
            shards=checked.digests,
            state=edit.skeleton,
            metadata=source.metadata if metadata is None else metadata,
            stats={
                **source.stats,
                "logical_bytes": sum(e.nbytes for boxes in checked.entries.values() for e in boxes),
                "tensors": checked.tensors,
                "new_bytes": written.new_bytes,
                "new_chunks": written.new_chunks,
                "reused_chunks": written.reused_chunks,
                "stored_bytes": written.stored,
                "written_bytes": written.stored + sum(len(data) for _, data in objects),
                "seconds": round(time.perf_counter() - edit.started, 6),
                "held_seconds": round(time.perf_counter() - edit.started, 6),
            },
            frameworks=dict(source.frameworks),
            writer=writer,
            data_order=dict(source.data_order),
            layouts={k: v for k, v in edit.layouts.items() if k in checked.entries},
            whole=whole_in_root(checked.entries) if source.world_size > 1 else (),
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
        skeleton=edit.skeleton,
    )
    return Generation.from_root(digest, root)


def _dropped(skeleton: bytes, drop: Sequence[str], where: str) -> tuple[bytes, set[str]]:
    """The skeleton less every subtree a pattern of ``drop`` matches, and the tensors kept."""
    stems = [p[: -len("/**")] if p.endswith("/**") else None for p in drop]

    def matches(path: str) -> bool:
        return any(
            fnmatchcase(path, p) or path == stem for p, stem in zip(drop, stems, strict=True)
        )

    tree, dropped = drop_paths(skeleton, matches) if drop else (skeleton, [])
    for pattern, stem in zip(drop, stems, strict=True):
        if not any(fnmatchcase(p, pattern) or p == stem for p in dropped):
            raise AmendError(f"--drop {pattern!r} matches no key path of {where}")
    kept = {name for name, _ in tensor_names(tree)}
    if not kept:
        raise AmendError(f"dropping {', '.join(drop)} would leave no tensor of {where}")
    return tree, kept


# -- graft ---------------------------------------------------------------------------


def _parsed_graft(spec: str) -> tuple[str, str, tuple[str, str, str], tuple[str, str, str]]:
    """``RUN[@GEN]:OLD=NEW`` -> (run, generation, OLD's and NEW's (path, parent, key start))."""
    address, colon, pair = spec.partition(":")
    old, equals, new = pair.partition("=")
    if not (colon and equals and address):
        raise AmendError(f"--graft {spec!r}: give RUN[@GEN]:OLD=NEW (OLD, NEW: key path prefixes)")
    run, generation = split_address(address)
    parts = []
    for prefix in (old, new):
        parent, _, head = prefix.rpartition("/")
        parts.append((prefix, parent, head))
    return run, generation, parts[0], parts[1]


def _graft(
    store: Store,
    edit: _Edit,
    spec: str,
    parsed: tuple[str, str, tuple[str, str, str], tuple[str, str, str]],
    where: str,
) -> None:
    """Put the entries of the donor ``spec`` names in place of this state's at NEW."""
    run, generation, (old, old_parent, old_head), (new, new_parent, new_head) = parsed
    digest, donor = store.resolve_root(run, generation)
    there = f"{run}@{donor.generation}"
    pairs = dict_items_at(donor.state, old_parent)
    if pairs is None:
        raise AmendError(f"--graft {spec!r}: {there} has no dict at {old_parent or 'the top'!r}")
    chosen = [(k, v) for k, v in pairs if _plain(k) and k.startswith(old_head)]
    if not chosen:
        raise AmendError(f"--graft {spec!r}: no key path of {there} starts with {old!r}")
    if dict_items_at(edit.skeleton, new_parent) is None:
        raise AmendError(f"--graft {spec!r}: {where} has no dict at {new_parent or 'the top'!r}")
    moved, names = [], {}
    for key, node in chosen:
        name = new_head + key[len(old_head) :]
        if not name or not _plain(name):
            raise AmendError(f"--graft {spec!r}: the key {key!r} would become {name!r}")
        node, renamed, local = retarget_tensors(node, old, new)
        if local:
            raise AmendError(f"--graft {spec!r}: the per-rank value {local[0]!r} cannot be grafted")
        moved.append((name, node))
        names.update(renamed)
    before = _entries_by_name(edit.tensors)
    donor_shards = store.read_shards(donor)
    incoming = [[_named(e, names) for e in s.tensors if e.name in names] for s in donor_shards]
    for entry in (e for boxes in incoming for e in boxes):
        held = before.get(entry.name)
        if held and (held[0].dtype, held[0].shape) != (entry.dtype, entry.shape):
            raise AmendError(
                f"--graft {spec!r}: {entry.name!r} is {_kind(entry)} in {there} and "
                f"{_kind(held[0])} in {where}: a graft keeps each tensor's layout"
            )

    def change(items: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        return [(k, v) for k, v in items if not (_plain(k) and k.startswith(new_head))] + moved

    edit.skeleton = replace_items(edit.skeleton, new_parent, change)
    final = {name for name, _ in tensor_names(edit.skeleton)}
    grafted = set(names.values())
    edit.tensors = [[e for e in boxes if e.name in final - grafted] for boxes in edit.tensors]
    world = len(edit.tensors)
    for rank, boxes in enumerate(incoming):
        for entry in boxes:
            whole = entry.local_shape == entry.shape
            at = rank if donor.world_size == world else 0 if whole else rank % world
            edit.tensors[at].append(entry)
    edit.layouts = {k: v for k, v in edit.layouts.items() if k in final - grafted}
    edit.layouts.update((names[k], v) for k, v in donor.layouts.items() if k in names)
    edit.changes.setdefault("graft", []).append(
        {"from": len(edit.origins), "source": old, "target": new}
    )
    edit.origins.append(_origin(run, donor, digest))


def _plain(key: Any) -> bool:
    """A string key that is its own key path component (no '/' or '%' to escape)."""
    return isinstance(key, str) and bool(key) and escape_key(key) == key


def _kind(entry: TensorEntry) -> str:
    return f"{entry.dtype} {list(entry.shape)}"


def _entries_by_name(tensors: list[list[TensorEntry]]) -> dict[str, list[TensorEntry]]:
    found: dict[str, list[TensorEntry]] = {}
    for boxes in tensors:
        for entry in boxes:
            found.setdefault(entry.name, []).append(entry)
    return found


# -- replace and metadata ------------------------------------------------------------


def _replace(store: Store, edit: _Edit, values: dict[str, Any], where: str) -> None:
    """Write each new value's chunks (only those the store lacks) and put its entries in
    place of the old: on the saved boxes where the shape is kept, else one box on rank 0."""
    held: dict[str, list[tuple[int, TensorEntry]]] = {}
    for rank, row in enumerate(edit.tensors):
        for entry in row:
            held.setdefault(entry.name, []).append((rank, entry))
    leaves: list[TensorLeaf] = []
    slots: list[int] = []
    for path, value in values.items():
        if path not in held:
            raise AmendError(
                f"--replace {path!r} is not a tensor of {where} (castore show lists them)"
            )
        new = _single_leaf(value, path)
        boxes = held[path]
        if boxes[0][1].shape != new.shape:
            boxes = [(0, boxes[0][1])]
            edit.layouts.pop(path, None)
        for rank, entry in boxes:
            leaves.append(_box_leaf(new, entry, whole=len(boxes) == 1))
            slots.append(rank)
    edit.tensors = [[e for e in row if e.name not in values] for row in edit.tensors]
    entries, edit.written = write_leaves(
        store.backend,
        leaves,
        store.chunk_size,
        midway_fault="lineage.mid_chunks",
        codec=store.codec,
    )
    for rank, entry in zip(slots, entries, strict=True):
        edit.tensors[rank].append(entry)
    edit.changes["replace"] = sorted(values)


def _single_leaf(value: Any, path: str) -> TensorLeaf:
    _, leaves = encode_tree({"value": value})
    if len(leaves) != 1 or leaves[0].name != "value" or leaves[0].sharded:
        raise AmendError(
            f"--replace {path!r}: give one whole tensor (a numpy array or a torch tensor)"
        )
    return with_fields(leaves[0], name=path)


def _box_leaf(new: TensorLeaf, entry: TensorEntry, *, whole: bool) -> TensorLeaf:
    """The part of ``new`` that ``entry``'s box holds (all of it where ``whole``)."""
    framework = entry.framework
    if whole:
        return with_fields(new, framework=framework, offsets=(), local_shape=())
    itemsize = numpy_dtype(new.dtype).itemsize
    grid = new.data.reshape((*new.shape, itemsize))
    region = tuple(slice(o, o + n) for o, n in zip(entry.offsets, entry.local_shape, strict=True))
    return TensorLeaf(
        name=new.name,
        dtype=new.dtype,
        shape=new.shape,
        data=np.ascontiguousarray(grid[region]).reshape(-1),
        framework=framework,
        offsets=entry.offsets,
        local_shape=entry.local_shape,
        sharded=True,
    )


def _edited_metadata(encoded: bytes, edits: dict[str, Any], where: str) -> bytes:
    current = decode_tree(encoded) if encoded else {}
    if not isinstance(current, dict):
        raise AmendError(f"the metadata of {where} is not a map of keys")
    for key, value in edits.items():
        if key == "dcp":
            raise AmendError("metadata key 'dcp' is castore's own (a DCP layout): not edited")
        if value is not None:
            current[key] = value
        elif current.pop(key, None) is None:
            raise AmendError(f"--unset {key!r}: {where} has no metadata key {key!r}")
    return encode_metadata(current)


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
    return entry if new == entry.name else with_fields(entry, name=new)
