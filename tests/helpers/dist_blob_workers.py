"""Per-rank functions for tests/test_dist_blobs.py, run by tests/helpers/dist_harness.py.

Each rank stands for one node: it opens the store on blobs (a shared
directory or S3) with its own index cache directory, so no two ranks share an
LMDB environment. The state is tests/helpers/dist_workers.py's (uneven, 2-D and 3-D
sharding, replicated tensors, a RankLocal) plus ``big/rows``: a row-sharded
tensor whose rows are one chunk each, so every box a rank restores at 4, 2 or
3 ranks (5, 10, or 7/7/6 rows) is whole chunks, and the bytes a restore needs are known exactly.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import dist_workers as w
import numpy as np

# Chunks larger than blobreader.MERGE_GAP (64 KiB): a ranged request never spans
# a chunk nobody asked for (a re-save leaves stale chunks between live ones).
CHUNK_SIZE = 128 << 10
ROWS, ROW_ELEMENTS = 20, CHUNK_SIZE // 4  # float32: a row is a chunk size (two grid cells)
PACK_BYTES = 256 << 10  # a rank's rows of big/rows span several packs
ALIGNED = "big/rows"


def big_rows(seed: int, changed_seed: int | None = None) -> np.ndarray:
    """The whole ``big/rows``; with ``changed_seed``, every tenth row drawn anew."""
    rows = np.random.default_rng([seed, 99]).standard_normal((ROWS, ROW_ELEMENTS))
    rows = rows.astype(np.float32)
    if changed_seed is not None:
        fresh = np.random.default_rng([changed_seed, 98]).standard_normal((ROWS, ROW_ELEMENTS))
        rows[changed_rows()] = fresh[changed_rows()].astype(np.float32)
    return rows


def changed_rows() -> list[int]:
    return list(range(0, ROWS, 10))


def rows_box(rank: int, world_size: int) -> tuple[int, int]:
    """(first row, row count) of ``rank``'s block of ``big/rows``."""
    return w.split(ROWS, world_size)[rank]


def open_node_store(location: str, options: dict[str, Any], rank: int) -> Any:
    """The store as node ``rank`` opens it: its own index cache directory."""
    import castore

    cache = Path(options["cache_root"], f"node{rank}")
    settings = {k: v for k, v in options.items() if k != "cache_root"}
    return castore.open(location, cache_dir=cache, pack_bytes=PACK_BYTES, **settings)


def _fetches(store: Any) -> tuple[int, int, int]:
    counters = store.backend.fetches
    return counters.requests, counters.bytes, counters.chunk_bytes


def _save(rank: int, world_size: int, store: Any, op: dict[str, Any]) -> dict[str, Any]:
    import castore
    import castore.dist

    state = w.make_state(rank, world_size, op["seed"], op["step"])
    start, count = rows_box(rank, world_size)
    rows = big_rows(op["seed"], op.get("changed_seed"))[start : start + count]
    state["big"] = {
        "rows": castore.Shard(w.to_framework(rows, "torch"), (ROWS, ROW_ELEMENTS), (start, 0))
    }
    generation = castore.dist.save(store, state, run=op["run"], step=op["step"])
    return {"generation": generation}


def _load(
    rank: int, world_size: int, store: Any, op: dict[str, Any], group: Any = None
) -> dict[str, Any]:
    """Restore ``op["names"]`` (dist_workers.py names, or ``big/rows``) of ``op["run"]``."""
    import castore
    import castore.dist

    names = op["names"]
    plain = [n for n in names if n != ALIGNED]
    targets = w.make_targets(rank, world_size, plain)
    start, count = rows_box(rank, world_size)
    rows = np.full((count, ROW_ELEMENTS), w.SENTINEL, dtype=np.float32)
    if ALIGNED in names:
        target = castore.Shard(w.to_framework(rows, "torch"), (ROWS, ROW_ELEMENTS), (start, 0))
        targets["big"] = {"rows": target}
    before = _fetches(store)
    started = time.monotonic()
    result = castore.dist.load(
        store,
        op["run"],
        targets,
        op.get("generation", "latest"),
        rank_local=op["rank_local"],
        group=group,
    )
    after = _fetches(store)
    boxes = {
        name: (w.box_of(name, rank, world_size)[0], w.to_numpy(w.target_buffer(targets, name)))
        for name in plain
    }
    if ALIGNED in names:
        boxes[ALIGNED] = ((start, 0), w.to_numpy(targets["big"]["rows"].local))
    report = result.report
    stored_needed = None
    if ALIGNED in names:
        stored_needed = _stored_rows(store, op["run"], report.generation.id, start, count)
    return {
        "seconds": time.monotonic() - started,
        "generation": report.generation.id,
        "bytes_needed": report.bytes_needed,
        "stored_needed": stored_needed,
        "boxes": boxes,
        "rank_local": w.summarize(result.state.get("rng")),
        "fetch": {
            "requests": after[0] - before[0],
            "bytes": after[1] - before[1],
            "chunk_bytes": after[2] - before[2],
        },
    }


def _stored_rows(store: Any, run: str, generation: int, start: int, count: int) -> int:
    """The stored bytes (frames where compressed) of the chunks holding rows
    ``start..start+count`` of ``big/rows``: what a restore of them must fetch."""
    row_bytes = ROW_ELEMENTS * 4
    low, high = start * row_bytes, (start + count) * row_bytes
    _, root = store.resolve_root(run, generation)
    keys = []
    for entry in store.tensor_entries(root)[ALIGNED]:
        base = entry.offsets[0] * row_bytes
        for index, key in enumerate(entry.chunks):
            first = base + entry.chunk_start(index)
            last = first + entry.chunk_length(index)
            if first < high and last > low:
                keys.append(key)
    return sum(where.length for where in store.backend.locate(keys))


def _stored_bytes(store: Any) -> dict[str, int]:
    """Chunk bytes the index lists, and the packs' bytes on the blob store."""
    from castore.chunkstore.base import Namespace

    blobs = store.backend.blobs
    store.backend.refresh()
    chunks = sum(size for _, size in store.backend.value_sizes(Namespace.CHUNKS))
    packs = sum(blobs.head(name) or 0 for name in blobs.list("packs/"))
    return {"chunks": chunks, "packs": packs}


def node_script(
    rank: int, world_size: int, location: str, options: dict[str, Any], ops: list[dict[str, Any]]
) -> list[Any]:
    """Run ``ops`` in order on this node's store handle; one result per op.

    Ops: {"op": "save", run, seed, step, [changed_seed]}; {"op": "load", run, names,
    rank_local, [generation, group]}: with ``group`` (global ranks), the others skip it;
    {"op": "stored"}: rank 0 reports the store's chunk and pack bytes; {"op": "move",
    cache_root}: this rank becomes another node (a new handle, another index cache).
    """
    import torch.distributed as dist

    results: list[Any] = []
    store = open_node_store(location, options, rank)
    try:
        for op in ops:
            kind = op["op"]
            if kind == "save":
                results.append(_save(rank, world_size, store, op))
            elif kind == "load" and "group" in op:
                group = dist.new_group(op["group"])  # every rank calls it
                if rank not in op["group"]:
                    results.append({"skipped": True})
                    continue
                me, size = op["group"].index(rank), len(op["group"])
                results.append(_load(me, size, store, op, group))
            elif kind == "load":
                results.append(_load(rank, world_size, store, op))
            elif kind == "stored":
                dist.barrier()
                results.append(_stored_bytes(store) if rank == 0 else None)
            elif kind == "move":
                store.close()
                store = open_node_store(location, {**options, "cache_root": op["cache_root"]}, rank)
                results.append(None)
            else:
                raise ValueError(f"unknown op {kind!r}")
    finally:
        store.close()
    return results
