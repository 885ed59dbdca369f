"""What changed between two generations, from their manifests alone.

Tensors are compared by their boxes and chunk digests, never by reading chunk
bytes: a tensor whose boxes and digests are identical is unchanged; one whose
boxes differ but whose dtype and shape agree is *resharded*: only then are
both sides read (every chunk verified) and their bytes compared, up to
``compare_limit`` bytes per side in all; past it, the layout change is
reported with the bytes not compared. Non-tensor values are compared by key
path in the decoded state skeletons, with tensors replaced by placeholders.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from castore.errors import GenerationNotFoundError, ObjectMissingError
from castore.format.hashing import Digest
from castore.format.objects import GenerationRoot, TensorEntry
from castore.format.tree import decode_tree
from castore.store import Store
from castore.support.progress import format_size

VALUE_WIDTH = 40
COMPARE_LIMIT = 64 << 20  # bytes per side a diff may read to compare resharded tensors
_RESHARDED = {
    True: "resharded, same bytes",
    False: "resharded, values changed",
    None: "resharded (layout changed; bytes not compared)",
}


@dataclass(frozen=True)
class TensorChange:
    """One tensor present in both generations whose boxes or chunks differ."""

    name: str
    old_dtype: str
    new_dtype: str
    old_shape: tuple[int, ...]
    new_shape: tuple[int, ...]
    nbytes: int
    new_chunk_bytes: int
    resharded: bool = False
    same_bytes: bool | None = None  # resharded only: None when not compared

    @property
    def kind(self) -> str:
        parts = []
        if self.old_dtype != self.new_dtype:
            parts.append(f"dtype {self.old_dtype} -> {self.new_dtype}")
        if self.old_shape != self.new_shape:
            parts.append(f"shape {_shape(self.old_shape)} -> {_shape(self.new_shape)}")
        if self.resharded:
            parts.append(_RESHARDED[self.same_bytes])
        return ", ".join(parts) or "values"


@dataclass(frozen=True)
class ValueChange:
    """A plain (non-tensor) value that differs; ``None`` text: absent on that side."""

    path: str
    old: str | None
    new: str | None


@dataclass
class GenerationDiff:
    """Generation A compared with B (B is ``None``: A is a first generation)."""

    run_a: str
    gen_a: int
    step_a: int
    run_b: str | None
    gen_b: int | None
    step_b: int | None
    added: dict[str, int] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)
    changed: list[TensorChange] = field(default_factory=list)
    unchanged_count: int = 0
    unchanged_bytes: int = 0
    values: list[ValueChange] = field(default_factory=list)
    data_order: list[ValueChange] = field(default_factory=list)

    @property
    def label_a(self) -> str:
        return f"{self.run_a}@{self.gen_a}"

    @property
    def label_b(self) -> str:
        return "nothing" if self.gen_b is None else f"{self.run_b}@{self.gen_b}"

    @property
    def new_chunk_bytes(self) -> int:
        return sum(c.new_chunk_bytes for c in self.changed)

    def stat_line(self) -> str:
        """One line, like git's ``--stat`` summary: counts, new bytes, step."""
        step = (
            f"step {self.step_a}" if self.step_b is None else f"step {self.step_b} -> {self.step_a}"
        )
        extras = []
        if self.values:
            extras.append(f"{len(self.values)} value(s) changed")
        if self.data_order:
            extras.append(f"data order: {len(self.data_order)} key(s) changed")
        return (
            f"{self.label_a} vs {self.label_b}: {len(self.changed)} changed "
            f"({format_size(self.new_chunk_bytes)} new), {len(self.added)} added, "
            f"{len(self.removed)} removed, {self.unchanged_count} unchanged "
            f"({format_size(self.unchanged_bytes)}); " + "; ".join([step, *extras])
        )


def diff_generations(
    store: Store,
    run_a: str,
    gen_a: int | str = "latest",
    run_b: str | None = None,
    gen_b: int | str | None = None,
    *,
    compare_limit: int = COMPARE_LIMIT,
) -> GenerationDiff:
    """Compare generation ``run_a@gen_a`` with ``run_b@gen_b``.

    Without ``gen_b``, B is A's parent (``run_b`` defaults to ``run_a``), or, for a
    generation made by ``castore branch`` or ``amend`` (castore.lineage), the one it was
    made from; a first generation is compared with nothing, so everything in it is added.
    Chunks are read only for resharded tensors, ``compare_limit`` bytes per
    side at most (0: none).
    """
    _, root_a = store.resolve_root(run_a, gen_a)
    root_b = _other_root(store, root_a, run_a, run_b, gen_b)
    tensors_a = store.tensor_entries(root_a)
    tensors_b = store.tensor_entries(root_b) if root_b is not None else {}
    diff = GenerationDiff(
        run_a=run_a,
        gen_a=root_a.generation,
        step_a=root_a.step,
        run_b=None if root_b is None else root_b.run,
        gen_b=None if root_b is None else root_b.generation,
        step_b=None if root_b is None else root_b.step,
        values=_value_changes(root_a, root_b),
        data_order=_mapping_changes(root_a.data_order, {} if root_b is None else root_b.data_order),
    )
    _compare_tensors(diff, tensors_a, tensors_b)
    budget = compare_limit if root_b is not None else 0
    for index, change in enumerate(diff.changed):
        if root_b is not None and change.resharded and change.nbytes <= budget:
            budget -= change.nbytes
            same = _same_bytes(store, (root_a, tensors_a), (root_b, tensors_b), change.name)
            diff.changed[index] = replace(change, same_bytes=same)
    return diff


def diff_history(
    store: Store, run: str, up_to: int | str = "latest", *, last: int | None = None
) -> Iterator[tuple[int, GenerationDiff | None]]:
    """(id, diff) for each stored generation of ``run`` up to ``up_to``, oldest first,
    each against the one stored before it (``last=N``: only the newest N).

    Comparing with the previous *stored* generation, not the parent, keeps a
    history that garbage collection thinned readable. The oldest one listed is
    compared with its parent, with nothing if it is the run's first, and not at
    all (``None``) if its parent was collected.
    """
    _, top = store.resolve_root(run, up_to)
    kept = [g.id for g in store.generations(run) if g.id <= top.generation]
    if last is not None:
        kept = kept[-last:] if last > 0 else []
    for index, generation in enumerate(kept):
        if index:
            yield generation, diff_generations(store, run, generation, run, kept[index - 1])
            continue
        try:
            yield generation, diff_generations(store, run, generation)
        except GenerationNotFoundError:
            _, root = store.resolve_root(run, generation)
            if root.parent is None:
                raise
            yield generation, None


def _same_bytes(
    store: Store,
    side_a: tuple[GenerationRoot, Mapping[str, list[TensorEntry]]],
    side_b: tuple[GenerationRoot, Mapping[str, list[TensorEntry]]],
    name: str,
) -> bool:
    """Whether tensor ``name`` holds the same bytes on both sides (every chunk verified)."""
    contents = []
    for root, tensors in (side_a, side_b):
        where = {"run": root.run, "generation": root.generation, "tensor": name}
        contents.append(store.read_tensor(tensors[name], "numpy", where).tobytes())
    return contents[0] == contents[1]


def _other_root(
    store: Store, root_a: GenerationRoot, run_a: str, run_b: str | None, gen_b: int | str | None
) -> GenerationRoot | None:
    if gen_b is not None or (run_b is not None and run_b != run_a):
        return store.resolve_root(run_b or run_a, "latest" if gen_b is None else gen_b)[1]
    made_from = _made_from(root_a)
    if made_from is not None:
        run, generation, digest = made_from
        try:
            return store.read_root(digest, run=run)
        except ObjectMissingError:
            raise GenerationNotFoundError(
                f"{run_a}@{root_a.generation} was made from {run}@{generation} "
                f"({digest.short}), which is not in the store; name the generation to "
                "compare with",
                run=run_a,
            ) from None
    if root_a.parent is None:
        return None
    parent = Digest(root_a.parent)
    try:
        return store.read_root(parent, run=run_a)
    except ObjectMissingError:
        if parent.hex not in store.logged(run_a)[1]:
            raise  # not collected: the store is damaged, and verify should say so
        raise GenerationNotFoundError(
            f"the parent of {run_a}@{root_a.generation} ({parent.short}) was garbage-collected; "
            f"name the generation to compare with (castore log {run_a} lists those kept)",
            run=run_a,
        ) from None


def _made_from(root: GenerationRoot) -> tuple[str, int, Digest] | None:
    """(run, generation, root) of the generation a branch or amend was made from, where
    the root's ``lineage`` names it well formed (an informative field: else None)."""
    sources = root.lineage.get("from")
    first = sources[0] if isinstance(sources, list) and sources else None
    if not isinstance(first, dict):
        return None
    run, generation, digest = first.get("run"), first.get("generation"), first.get("root")
    if not (isinstance(run, str) and isinstance(generation, int) and isinstance(digest, str)):
        return None
    try:
        return run, generation, Digest.from_hex(digest)
    except ValueError:
        return None


def _compare_tensors(
    diff: GenerationDiff,
    tensors_a: Mapping[str, list[TensorEntry]],
    tensors_b: Mapping[str, list[TensorEntry]],
) -> None:
    for name, boxes in sorted(tensors_a.items()):
        if name not in tensors_b:
            diff.added[name] = _nbytes(boxes)
            continue
        old = tensors_b[name]
        if _layout(boxes) == _layout(old):
            diff.unchanged_count += 1
            diff.unchanged_bytes += _nbytes(boxes)
            continue
        diff.changed.append(_tensor_change(name, boxes, old))
    for name, boxes in sorted(tensors_b.items()):
        if name not in tensors_a:
            diff.removed[name] = _nbytes(boxes)


def _tensor_change(name: str, new: list[TensorEntry], old: list[TensorEntry]) -> TensorChange:
    first_new, first_old = new[0], old[0]
    same_kind = first_new.dtype == first_old.dtype and first_new.shape == first_old.shape
    resharded = same_kind and _boxes(new) != _boxes(old)
    return TensorChange(
        name=name,
        old_dtype=first_old.dtype,
        new_dtype=first_new.dtype,
        old_shape=first_old.shape,
        new_shape=first_new.shape,
        nbytes=_nbytes(new),
        new_chunk_bytes=new_chunk_bytes(new, old),
        resharded=resharded,
    )


def new_chunk_bytes(new: list[TensorEntry], old: list[TensorEntry]) -> int:
    """Bytes of the chunks of ``new`` whose digests no box of ``old`` holds (each counted once)."""
    held = {digest for box in old for digest in box.chunks}
    seen: set[bytes] = set()
    total = 0
    for box in new:
        for index, digest in enumerate(box.chunks):
            if digest in held or digest in seen:
                continue
            seen.add(digest)
            total += box.chunk_length(index)
    return total


def _boxes(boxes: list[TensorEntry]) -> list[tuple[Any, ...]]:
    return sorted((b.offsets, b.local_shape) for b in boxes)


def _layout(boxes: list[TensorEntry]) -> list[tuple[Any, ...]]:
    return sorted((b.dtype, b.shape, b.offsets, b.local_shape, b.chunks) for b in boxes)


def _nbytes(boxes: list[TensorEntry]) -> int:
    return sum(b.nbytes for b in boxes)


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "()"


class _TensorPlaceholder:
    """Stands in for a tensor: tensors are compared by their manifests, not here."""


class _RankLocalPlaceholder:
    """Stands in for a per-rank value (held in the shard manifests)."""


def _value_changes(root_a: GenerationRoot, root_b: GenerationRoot | None) -> list[ValueChange]:
    return _mapping_changes(
        plain_values(root_a.state), {} if root_b is None else plain_values(root_b.state)
    )


def plain_values(state: bytes) -> dict[str, Any]:
    """Key path -> plain value of a state skeleton (tensors and per-rank values left out)."""
    tree = decode_tree(
        state, lambda name, framework: _TensorPlaceholder(), lambda path: _RankLocalPlaceholder()
    )
    found: dict[str, Any] = {}
    _flatten(tree, "", found)
    return found


def _flatten(node: Any, path: str, found: dict[str, Any]) -> None:
    if isinstance(node, (_TensorPlaceholder, _RankLocalPlaceholder)):
        return
    if isinstance(node, dict):
        for key, value in node.items():
            _flatten(value, f"{path}/{key}" if path else str(key), found)
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            _flatten(value, f"{path}/{index}" if path else str(index), found)
    else:
        found[path or "."] = node


def _mapping_changes(new: dict[str, Any], old: dict[str, Any]) -> list[ValueChange]:
    changes = []
    # In the state's own order (list items by index), then what only ``old`` has.
    for key in [*new, *(k for k in old if k not in new)]:
        in_new, in_old = key in new, key in old
        if in_new and in_old and _same(new[key], old[key]):
            continue
        changes.append(
            ValueChange(
                str(key),
                _text(old[key]) if in_old else None,
                _text(new[key]) if in_new else None,
            )
        )
    return changes


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and repr(a) == repr(b)


def _text(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= VALUE_WIDTH else text[: VALUE_WIDTH - 3] + "..."
