"""``castore show``'s table of a generation's non-tensor values, long lists collapsed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from castore.cli.args import COLLAPSE_AT
from castore.format.tree import decode_tree


def state_values(state: Any, *, collapse: bool) -> list[Value]:
    """The plain values of a root's encoded state tree, tensors and per-rank values left out."""
    tree = decode_tree(state, lambda name, fw: _TensorMark(), lambda path: _RankLocalMark())
    return _plain_values(tree, collapse=collapse)


class _TensorMark:
    """Stands in for a tensor when listing a state's non-tensor values."""


class _RankLocalMark:
    """Stands in for a RankLocal value (one per rank, in the shard manifests)."""

    def __repr__(self) -> str:
        return "<saved per rank>"


@dataclass(frozen=True)
class Value:
    """One row of show's value table: a value, or a collapsed run of list items."""

    key: str
    kind: str
    text: str
    count: int = 1

    @property
    def row(self) -> list[str]:
        return [self.key, self.kind, self.text]


def _is_plain(node: Any) -> bool:
    return not isinstance(node, (_TensorMark, _RankLocalMark, dict, list, tuple))


def _shorten(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _plain_values(node: Any, path: str = "", *, collapse: bool = True) -> list[Value]:
    if isinstance(node, _TensorMark):
        return []
    if isinstance(node, dict):
        return [
            value
            for k, v in node.items()
            for value in _plain_values(v, f"{path}/{k}" if path else str(k), collapse=collapse)
        ]
    if isinstance(node, (list, tuple)):
        found: list[Value] = []
        index = 0
        while index < len(node):
            end = index
            while collapse and end < len(node) and _is_plain(node[end]):
                end += 1
            if end - index >= COLLAPSE_AT:
                found.append(_collapsed(node[index:end], path, index))
                index = end
                continue
            item_path = f"{path}/{index}" if path else str(index)
            found.extend(_plain_values(node[index], item_path, collapse=collapse))
            index += 1
        return found
    return [Value(path or ".", type(node).__name__, _shorten(repr(node)))]


def _collapsed(items: Sequence[Any], path: str, start: int) -> Value:
    """Sibling list items ``start..`` as one row: their count, type, and first and last."""
    key = f"[{start}..{start + len(items) - 1}]"
    types = sorted({type(item).__name__ for item in items})
    kind = f"{len(items)} {types[0]}" if len(types) == 1 else f"{len(items)} values"
    text = ", ".join([repr(items[0]), repr(items[1]), "...", repr(items[-1])])
    return Value(f"{path}/{key}" if path else key, kind, _shorten(text), len(items))
