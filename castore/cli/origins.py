"""How the commands say where a generation came from: a save, a branch, an amend (its
donors and changes), an import (the source's kind and file name), a copy.

A root's ``lineage`` and ``metadata`` are informative: they are printed, never trusted.
Whatever their shape (a hostile root's fields are any msgpack values), each reads as one
line of printable text, bounded in length, never as a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from castore.core.history import Generation

TEXT_LIMIT = 60  # characters of one value shown; longer ones end in "..."
ITEM_LIMIT = 8  # items of one list shown; the rest counted
CHANGES_LIMIT = 240  # characters of an amend's changes shown
_HEX_ROOT = re.compile(r"[0-9a-f]{64}")
# The fields of an amend this module words itself; any other is shown as "KEY VALUE".
_KNOWN_CHANGES = ("op", "from", "drop", "rename", "replace", "graft", "metadata")


@dataclass(frozen=True)
class Source:
    """One item of a lineage's ``from``: a generation it was made from."""

    name: str  # "base@3", as printed
    run: str | None  # the run it names, when a string
    root: str | None  # its root digest (64 lower-case hex digits), when it names a valid one


def printable(value: Any, limit: int = TEXT_LIMIT) -> str:
    """``value`` as text on one line: a string as it is, anything else as its repr; control
    characters escaped; cut to ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def listed(value: Any) -> str:
    """A list's items as ``a, b, c`` (ITEM_LIMIT at most, then how many more); another
    value as :func:`printable` gives it."""
    if not isinstance(value, list):
        return printable(value)
    shown = [printable(item) for item in value[:ITEM_LIMIT]]
    more = len(value) - ITEM_LIMIT
    return ", ".join(shown + ([f"... {more} more"] if more > 0 else []))


def sources(lineage: Mapping[Any, Any]) -> list[Source]:
    """Every item of ``lineage["from"]``, each a parent of the generation (the first the
    generation amended or branched, the others donors of grafts); [] when there is none."""
    items = lineage.get("from")
    if not isinstance(items, list):
        return []
    return [_source(item) for item in items]


def _source(item: Any) -> Source:
    if not isinstance(item, dict):
        return Source(printable(item), None, None)
    run, root = item.get("run"), item.get("root")
    valid = root if isinstance(root, str) and _HEX_ROOT.fullmatch(root) else None
    if run is None and "source" in item:  # a file, not a generation: an import's lineage
        kind = f" ({printable(item.get('kind'))})" if "kind" in item else ""
        return Source(f"{printable(basename(item['source']))}{kind}", None, None)
    name = f"{printable(run)}@{printable(item.get('generation'))}"
    return Source(name, run if isinstance(run, str) else None, valid)


def origin(gen: Generation) -> str:
    """Where a generation made from others came from (``branch of base@3``,
    ``amend of train@4, teacher@7``), else ""."""
    if not gen.lineage:
        return ""
    made = sources(gen.lineage)
    if not made:
        return ""
    op = gen.lineage.get("op", "made")
    return f"{printable(op)} of {listed([source.name for source in made])}"


def changes(lineage: Mapping[Any, Any]) -> str:
    """``" (drop optim/**; rename model.=)"`` for an amend, "" for a branch: every field of
    the lineage besides ``op`` and ``from``, worded where castore knows it, else shown as
    ``KEY VALUE``."""
    named = [source.name for source in sources(lineage)]
    parts = [
        _plain("drop", lineage.get("drop")),
        _pairs("rename", lineage.get("rename")),
        _plain("replace", lineage.get("replace")),
        _grafts(lineage.get("graft"), named),
        *_metadata(lineage.get("metadata")),
    ]
    others = sorted((key for key in lineage if key not in _KNOWN_CHANGES), key=str)
    parts += [f"{printable(key)} {listed(lineage[key])}" for key in others if lineage[key]]
    text = "; ".join(part for part in parts if part)
    if len(text) > CHANGES_LIMIT:
        text = text[: CHANGES_LIMIT - 3] + "..."
    return f" ({text})" if text else ""


def _plain(word: str, value: Any) -> str:
    return f"{word} {listed(value)}" if value else ""


def _pairs(word: str, value: Any) -> str:
    if not value:
        return ""
    if not isinstance(value, list):
        return f"{word} {printable(value)}"
    pairs = [
        "=".join(map(printable, pair)) if isinstance(pair, list) and len(pair) == 2 else pair
        for pair in value
    ]
    return f"{word} {listed(pairs)}"


def _grafts(value: Any, named: list[str]) -> str:
    """``graft teacher@7:model/encoder.=model/encoder.`` per graft: where from (an index
    into ``from``), the donor's key prefix and where it lands."""
    if not value:
        return ""
    if not isinstance(value, list):
        return f"graft {printable(value)}"
    worded = []
    for graft in value:
        if not isinstance(graft, dict):
            worded.append(printable(graft))
            continue
        index = graft.get("from")
        donor = named[index] if type(index) is int and 0 <= index < len(named) else "?"
        source, target = graft.get("source", "?"), graft.get("target", "?")
        worded.append(f"{donor}:{printable(source)}={printable(target)}")
    return f"graft {listed(worded)}"


def _metadata(value: Any) -> list[str]:
    """``set metadata lr, wd`` and ``unset metadata note`` from ``{"set": [...], "unset":
    [...]}``; a value of another shape as ``metadata VALUE``."""
    if not value:
        return []
    if not isinstance(value, dict):
        return [f"metadata {printable(value)}"]
    return [
        f"{printable(how)} metadata {_keys(what)}"
        for how, what in sorted(value.items(), key=lambda item: str(item[0]))
        if what
    ]


def _keys(value: Any) -> str:
    if isinstance(value, dict):
        return listed([f"{printable(k)}={printable(v)}" for k, v in value.items()])
    return listed(value)


def basename(path: Any) -> str:
    """The last part of a path as a source records it: an import's file or directory name,
    never the machine's path to it."""
    text = path if isinstance(path, str) else printable(path)
    return PurePosixPath(text).name or text


def imported(gen: Generation) -> str:
    """``import safetensors model.safetensors`` for a generation ``castore import`` wrote
    (its metadata names the source and its kind), else ""."""
    metadata = gen.metadata
    if not isinstance(metadata, dict) or "imported_from" not in metadata:
        return ""
    kind = metadata.get("kind")
    kind_text = f"{printable(kind)} " if kind else ""
    return f"import {kind_text}{printable(basename(metadata['imported_from']))}"
