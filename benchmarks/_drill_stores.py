"""The stores of benchmarks/bench_tiers_drill.py seen from outside the job: what the
durable places hold, how much each durable save added, whether a store is sound, what the
fast tiers list and pin, and a damaged chunk. Every function opens the stores itself,
read-only but for the damage; ``mark`` runs while the job's promotions may be writing to
the durable store, which a shared-directory store allows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _common import tree_bytes
from _drill_ranks import RUN, Layout

import castore
from castore.chunkstore.base import Namespace
from castore.chunkstore.lmdb.backend import LmdbBackend
from castore.errors import GenerationNotFoundError
from castore.format.hashing import Digest
from castore.tiers import PIN_PREFIX
from castore.verify import verify_store


def durable_newest(way: dict[str, Any]) -> int | None:
    """The newest step the durable place holds whole (DCP: a folder with its .metadata)."""
    folder = Path(way["durable"])
    if way["way"] == "dcp":
        steps = [int(p.parent.name.split("-")[1]) for p in folder.glob("step-*/.metadata")]
        return max(steps, default=None)
    with castore.open(folder, readonly=True) as store:
        try:
            return store.resolve(RUN).step
        except GenerationNotFoundError:
            return None


def mark(way: dict[str, Any]) -> dict[str, Any]:
    return {"bytes": tree_bytes(Path(way["durable"]))[0], "newest": durable_newest(way)}


def new_chunk_bytes(path: str) -> dict[int, dict[str, int]]:
    """Per durable generation (by step): its chunk bytes, and those of them the store did
    not hold before it (no retention runs in the drill: it held the earlier generations')."""
    out: dict[int, dict[str, int]] = {}
    held: set[bytes] = set()
    with castore.open(path, readonly=True) as store:
        for gen in store.generations(RUN):
            root = store.read_root(Digest.from_hex(gen.root), run=RUN)
            sizes: dict[bytes, int] = {}
            for shard in store.read_shards(root):
                for entry in shard.tensors + shard.local_tensors:
                    for index, chunk in enumerate(entry.chunks):
                        start = index * entry.chunk_size
                        sizes[bytes(chunk)] = min(entry.chunk_size, entry.nbytes - start)
            new = sum(size for chunk, size in sizes.items() if chunk not in held)
            out[gen.step] = {"all": sum(sizes.values()), "new": new}
            held.update(sizes)
    return out


def uploads(
    way: dict[str, Any], record: dict[str, Any], castore_new: dict[int, dict[str, int]] | None
) -> list[dict[str, Any]]:
    """Per durable save: the directory's growth for it over the chunk bytes it lacked.

    The growth between the marks taken before the save of step g and before the next
    durable save (or after the failure) is g's alone when g was the newest durable step
    at the later mark; otherwise the row says so and has no ratio.
    """
    marks = record["marks"]
    steps = sorted(int(k) for k in marks if k != "failure")
    folder = Path(way["durable"])
    new = castore_new if way["way"] == "dcp" else new_chunk_bytes(way["durable"])
    rows = []
    for i, step in enumerate(steps):
        after = marks[str(steps[i + 1])] if i + 1 < len(steps) else marks["failure"]
        if way["way"] == "dcp":
            landed = (folder / f"step-{step:06d}" / ".metadata").exists()
            grown = tree_bytes(folder / f"step-{step:06d}")[0]
        else:
            landed = after["newest"] == step
            grown = after["bytes"] - marks[str(step)]["bytes"]
        lacked = (new or {}).get(step, {}).get("new")
        ratio = grown / lacked if landed and lacked else None
        rows.append({"step": step, "landed": landed, "grown": grown, "new": lacked, "ratio": ratio})
    return rows


def check_durable(path: str) -> dict[str, Any]:
    """Does the durable store verify deep, and does every listed generation have every chunk?"""
    with castore.open(path, readonly=True) as store:
        report = verify_store(store, deep=True)
        listed = [g.id for g in store.generations(RUN)] if RUN in store.runs() else []
        complete = 0
        for gen_id in listed:
            root = store.read_root(Digest.from_hex(store.resolve(RUN, gen_id).root), run=RUN)
            chunks = sorted(
                {bytes(c) for s in store.read_shards(root) for e in s.tensors for c in e.chunks}
            )
            complete += all(store.backend.has_many(Namespace.CHUNKS, chunks))
    return {
        "ok": report.ok,
        "problems": [str(p) for p in report.problems],
        "listed": listed,
        "complete": complete,
    }


def fast_tiers(way: dict[str, Any]) -> dict[str, Any]:
    """The newest generation of each node's fast tier and the promotions pinned there."""
    newest, pins = [], []
    for fast in way["fast"]:
        if not Path(fast).exists():
            continue
        with castore.open(fast, readonly=True) as store:
            ref = store.refs.read(RUN) if RUN in store.runs() else None
            newest.append(None if ref is None else ref.generation)
            tags = store.refs.tags(RUN) if ref is not None else {}
            pins.append(sorted(v.generation for k, v in tags.items() if k.startswith(PIN_PREFIX)))
    return {"newest": newest, "pins": pins}


def damage_one_chunk(fast: str, layout: Layout) -> str:
    """Flip a byte of the chunk of rank 0's block of a tensor its newest step changed."""
    with castore.open(fast) as store:
        gen = store.resolve(RUN)
        root = store.read_root(Digest.from_hex(gen.root), run=RUN)
        wanted = layout.name(layout.changed_at(gen.step)[0])
        entry = next(e for e in store.read_shards(root)[0].tensors if e.name == wanted)
        chunk = bytes(entry.chunks[0])
        value = bytearray(store.backend.get(Namespace.CHUNKS, chunk) or b"")
        value[len(value) // 2] ^= 0xFF
        backend = store.backend
        assert isinstance(backend, LmdbBackend), backend  # a fast tier is a local store
        backend.raw_put(Namespace.CHUNKS, chunk, bytes(value))
    return f"{wanted} rank 0 chunk {chunk.hex()[:16]}"
