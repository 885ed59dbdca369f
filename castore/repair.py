"""Repair: remove what is corrupt so that later saves can supply it again.

Every chunk and object is re-hashed; only those whose bytes do not hash to
their name are deleted (with a chunk's ``chunk_index`` entry), as are index
entries whose chunk is gone. An intact object is never deleted. Afterwards a
save of the same content writes the removed chunks again (a save skips only
chunks the index says are present), which heals every generation that needed
them: the store is content-addressed.

What cannot be healed that way is reported plainly: the generations still
damaged, and per generation the tensors and bytes that are lost.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from castore.chunkstore.base import Namespace
from castore.chunkstore.lmdb.rebuild import RebuildReport, rebuild_lmdb_index
from castore.core.fencing import ref_for_root
from castore.core.hashpool import shared_pool
from castore.errors import IntegrityError, StoreNotFoundError
from castore.format.codec import stored_matches
from castore.format.hashing import digest_bytes
from castore.opening.directory import MARKER, local_lmdb_store, read_marker
from castore.repo.records import DEFAULT_LOCK_TIMEOUT
from castore.support.progress import NO_BAR, Bar, progress_bar
from castore.verify import PIECES, verify_store

if TYPE_CHECKING:
    from castore.store import Store

_BATCH = 64


@dataclass
class RepairReport:
    chunks_checked: int = 0
    objects_checked: int = 0
    corrupt_chunks: list[bytes] = field(default_factory=list)
    missing_chunks: list[bytes] = field(default_factory=list)  # indexed, but no bytes
    corrupt_objects: list[bytes] = field(default_factory=list)
    refs_restored: dict[str, int] = field(default_factory=dict)  # run -> generation its ref names
    reflog_indexes_rebuilt: list[str] = field(default_factory=list)  # runs: see verify
    damaged: dict[str, list[str]] = field(default_factory=dict)  # "run@gen" -> what is lost

    @property
    def removed(self) -> int:
        return len(self.corrupt_chunks) + len(self.missing_chunks) + len(self.corrupt_objects)


def _check(
    store: Store, namespace: Namespace, sizes: list[tuple[bytes, int]], bar: Bar = NO_BAR
) -> dict[bytes, str]:
    """Each key's verdict: "ok", "corrupt" (bytes do not hash to it) or "missing".

    ``sizes``: each key and its stored length, as ``value_sizes`` lists them (the bar's unit).
    """
    verdicts: dict[bytes, str] = {}
    keys = [key for key, _ in sizes]

    def one(key: bytes, value: memoryview | None) -> str:
        if value is None:
            return "missing"
        # A chunk's record may be a frame (castore.format.codec); objects never are.
        intact = stored_matches(key, value) if namespace is Namespace.CHUNKS else (
            digest_bytes(value, threads=1) == key
        )
        return "ok" if intact else "corrupt"

    for start in range(0, len(keys), _BATCH):
        batch = keys[start : start + _BATCH]

        def visit(values: Iterator[memoryview | None], batch: list[bytes] = batch) -> None:
            pool = shared_pool()
            futures = [pool.submit(one, k, v) for k, v in zip(batch, values, strict=True)]
            wait(futures)  # every worker is done before the read transaction ends
            for key, future in zip(batch, futures, strict=True):
                verdicts[key] = future.result()

        store.backend.read_many(namespace, batch, visit)
        if bar:
            bar.update(sum(size for _, size in sizes[start : start + _BATCH]))
    return verdicts


def repair_store(
    store: Store,
    *,
    dry_run: bool = False,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    progress: bool = False,
) -> RepairReport:
    """Delete corrupt chunks and objects; report the generations that stay damaged.

    ``progress=True``: bars on stderr (a terminal) for the re-hash and the verify after it.
    """
    # Even a dry run holds the store lock exclusively: verify reads without it.
    store.refuse_if_readonly("repair", "castore verify --deep reports damage without writing")
    report = RepairReport()
    # Exclusive, like garbage collection: no save dedups against a chunk being removed.
    with store.refs.store_lock(
        exclusive=True,
        timeout=lock_timeout,
        busy=f"store busy: a save or tag held {store.path} for {lock_timeout:g}s; "
        "nothing was changed",
    ):
        chunk_sizes = list(store.backend.value_sizes(Namespace.CHUNKS))
        object_sizes = list(store.backend.value_sizes(Namespace.OBJECTS))
        total = sum(size for _, size in chunk_sizes + object_sizes)
        with progress_bar(progress, "repair (re-hash)", total) as bar:
            chunks = _check(store, Namespace.CHUNKS, chunk_sizes, bar)
            objects = _check(store, Namespace.OBJECTS, object_sizes, bar)
        report.chunks_checked, report.objects_checked = len(chunk_sizes), len(object_sizes)
        report.corrupt_chunks = [k for k, v in chunks.items() if v == "corrupt"]
        report.missing_chunks = [k for k, v in chunks.items() if v == "missing"]
        report.corrupt_objects = [k for k, v in objects.items() if v == "corrupt"]
        if not dry_run:
            store.backend.delete_many(
                Namespace.CHUNKS, report.corrupt_chunks + report.missing_chunks
            )
            store.backend.delete_many(Namespace.OBJECTS, report.corrupt_objects)
        report.refs_restored = restore_lost_refs(store, dry_run=dry_run)
        report.reflog_indexes_rebuilt = rebuild_reflog_indexes(store, dry_run=dry_run)
    # A dry run removed nothing: hash to see it.
    after = verify_store(store, deep=dry_run, progress=progress)
    for problem in after.problems:
        if problem.kind == PIECES:
            continue  # wrong chunk pieces lose nothing (reads verify whole chunks): verify's
        where = problem.run if problem.generation is None else f"{problem.run}@{problem.generation}"
        report.damaged.setdefault(where, []).append(problem.what)
    return report


def restore_lost_refs(store: Store, *, dry_run: bool = False) -> dict[str, int]:
    """Point each run whose ref file is gone at the newest logged generation whose root reads.

    The reflog records every root a ref named, so the ref can be rebuilt from
    it; the generation chosen is then checked by the verify that follows.
    """
    restored: dict[str, int] = {}
    with_ref = set(store.refs.ref_runs())
    for run in store.runs():
        if run in with_ref:
            continue
        for gen_id, digest in store.candidates(run):
            try:
                root = store.read_root(digest, run=run)
            except IntegrityError:
                continue
            if root.generation != gen_id:
                continue
            if not dry_run:
                store.refs.advance(run, expected=None, new=ref_for_root(digest, root))
            restored[run] = root.generation
            break
    return restored


def rebuild_reflog_indexes(store: Store, *, dry_run: bool = False) -> list[str]:
    """Write afresh each reflog index that disagrees with its reflog (verify names them).

    The index is derived (castore.repo.reflogindex): a damaged one is never
    used, but one that passes its checks yet summarises other records (a
    reflog edited in place) would be trusted by lookups by id.
    """
    rebuilt = []
    for run in store.runs():
        if store.refs.reflog_index_problem(run) is None:
            continue
        if not dry_run:
            with store.refs.locked(run):  # as an append, which also writes it
                store.refs.rebuild_reflog_index(run)
        rebuilt.append(run)
    return rebuilt


def rebuild_index(path: str | os.PathLike[str], *, progress: bool = False) -> RebuildReport:
    """Write a fresh ``chunks/data.mdb``: salvaged objects and an index built from the packs.

    ``castore repair --rebuild-index``: offline, on a local store only.
    ``progress=True``: phase lines and a bar of the pack bytes re-hashed, on
    stderr (a terminal).
    """
    root = local_lmdb_store(
        path,
        "castore repair --rebuild-index",
        "its chunk index is the index blobs, which every process reads afresh; "
        "castore verify --deep checks them against the packs",
    )
    if not (root / MARKER).is_file():
        raise StoreNotFoundError(f"no castore store at {root}", path=str(root))
    read_marker(root / MARKER)
    return rebuild_lmdb_index(root, progress=progress)
