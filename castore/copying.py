"""Copying generations between two stores: a second copy in another failure domain.

Deduplication makes generations share chunks, so one lost chunk damages every
generation that names it; a copy in another store is the independent recovery
point. :func:`copy` (``castore copy SRC DST``) copies generations oldest first
and, for each one:

1. reads and verifies its root and shard manifests at SRC (their bytes must
   hash to their names);
2. asks DST which of the chunks they name it lacks (``has_many``) and reads
   only those from SRC, re-hashing each (invariant 3) before it is written
   to DST, in bounded batches, each one commit;
3. commits the shard manifests, and, when the generation's parent is not at
   DST, logs that parent as collected in DST's reflog (DST's history then
   says "not held here" rather than "lost");
4. publishes through DST's own publish sequence: the coordinator's checks
   (every shard manifest its rank's, boxes tiling each tensor, every chunk
   present at DST), then the root's bytes, exactly as SRC holds them, and the
   ref's compare-and-swap. The root digest, id, step and parent link are the
   same in both stores.

Only the chunks, objects and reflog records of the generations copied are
written; tags are not copied. A copy killed anywhere leaves DST's ref where
it was (or advanced to a complete generation); chunks already written stay
and a rerun transfers only what is still missing. Everything here goes
through the parts every store has (its chunk backend, refs, reflog and
history), so it works between any two backends.

The module is ``copying``, not ``copy``: ``castore.copy`` is the function.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from castore.chunkstore.base import Namespace
from castore.core.chunkread import expected_length, verify_chunk
from castore.core.commit import PublishFaults, check_shards, publish
from castore.core.hashpool import shared_pool
from castore.core.history import GenerationSpec
from castore.core.reading import verified_object
from castore.errors import CorruptObjectError, RefConflictError
from castore.format.codec import check_setting, encoder_for, is_frame
from castore.format.hashing import Digest
from castore.format.objects import (
    TYPE_ROOT,
    TYPE_SHARD,
    GenerationRoot,
    ShardManifest,
    TensorEntry,
    encode_object,
)
from castore.opening.directory import open_address
from castore.opening.location import parse_location
from castore.repo.records import PUBLISH_ACTIONS, validate_run_name
from castore.store import Store
from castore.support.faults import fault_point
from castore.support.progress import NO_BAR, Bar, progress_bar

# Chunk bytes read from SRC and held before one commit at DST: bounds memory, and
# what an interrupted copy can lose (a rerun copies the batch again).
BATCH_BYTES = 64 * 1024 * 1024

COPY_FAULTS = PublishFaults("copy.before_root", "copy.before_ref_advance", "copy.after_ref_advance")


@dataclass(frozen=True)
class CopiedGeneration:
    """What copying one generation did; ``copied`` is False when DST already held it."""

    run: str
    id: int
    root: str  # hex digest, the same in both stores
    copied: bool
    chunks_copied: int = 0
    chunks_skipped: int = 0  # named by the generation and already at DST
    bytes_copied: int = 0  # chunk bytes read from SRC and written to DST
    bytes_stored: int = 0  # those chunks as DST stores them (compressed where it does)
    logical_bytes: int = 0  # distinct chunk bytes the generation names
    objects_copied: int = 0  # shard manifests and the root
    parent_marked: bool = False  # its parent was logged as not held at DST


@dataclass
class CopyReport:
    """Every generation a copy considered, oldest first within each run."""

    generations: list[CopiedGeneration] = field(default_factory=list)

    @property
    def copied(self) -> list[CopiedGeneration]:
        return [g for g in self.generations if g.copied]

    @property
    def present(self) -> list[CopiedGeneration]:
        return [g for g in self.generations if not g.copied]

    @property
    def chunks_copied(self) -> int:
        return sum(g.chunks_copied for g in self.generations)

    @property
    def chunks_skipped(self) -> int:
        return sum(g.chunks_skipped for g in self.generations)

    @property
    def bytes_copied(self) -> int:
        return sum(g.bytes_copied for g in self.generations)

    @property
    def logical_bytes(self) -> int:
        return sum(g.logical_bytes for g in self.generations)


@dataclass(frozen=True)
class CopyRecord:
    """What a copy wrote into the store it published a generation in (the ``wrote`` of
    its reflog record there, docs/FORMAT.md): ``castore log`` shows it for a copied or
    promoted generation, whose root still says what the save wrote where it was made."""

    chunks: int  # chunks written (the rest the store held already)
    bytes: int  # their raw bytes
    stored: int  # their bytes as stored
    objects: int  # the shard manifests' and root's bytes

    def as_record(self) -> dict[str, int]:
        return {"chunks": self.chunks, "bytes": self.bytes, "stored": self.stored,
                "objects": self.objects}  # fmt: skip

    @classmethod
    def from_record(cls, value: Any) -> CopyRecord | None:
        """From a reflog record's ``wrote``; None unless it is one (a record is read whole,
        so a value of another shape is ignored, not trusted)."""
        if not isinstance(value, dict):
            return None
        numbers = [value.get(name) for name in ("chunks", "bytes", "stored", "objects")]
        counts = [n for n in numbers if type(n) is int and n >= 0]
        return cls(*counts) if len(counts) == len(numbers) else None


def copies_logged(store: Store, run: str, roots: Collection[str]) -> dict[str, CopyRecord]:
    """Root hex -> what the copy that published it in ``store`` wrote there, for those of
    ``roots`` (generations of ``run``) a copy published (a save's record has no ``wrote``).

    Reads the reflog from its end only as far as the oldest of ``roots``' records, so
    that listing the newest generations reads only the reflog's tail.
    """
    wanted, found = set(roots), {}
    for record in store.refs.records_backwards(run):
        if not wanted:
            break
        if record["action"] in PUBLISH_ACTIONS and record["root"] in wanted:
            wanted.discard(record["root"])
            wrote = CopyRecord.from_record(record.get("wrote"))
            if wrote is not None:
                found[record["root"]] = wrote
    return found


StoreOrPath = Store | str | os.PathLike[str]


def copy(
    src: StoreOrPath,
    dst: StoreOrPath,
    *,
    run: str | None = None,
    generation: GenerationSpec | None = None,
    all_generations: bool = False,
    progress: bool = False,
    codec: str | None = None,
) -> CopyReport:
    """Copy generations of ``src`` into ``dst``, publishing each with the same root digest.

    By default the latest generation of each run (or of ``run``);
    ``generation`` (an id, tag, root prefix or ``"latest"``; needs ``run``)
    one generation; ``all_generations`` every stored generation, oldest
    first. A path for ``dst`` that does not exist becomes a new store; a path
    for ``src`` must be a store. Stores passed open stay open.

    Raises :class:`RefConflictError` when DST's history of a run cannot take
    a generation (DST already has a newer one, or a history SRC does not
    know); an :class:`IntegrityError` when SRC's bytes do not match their
    names. Either way, nothing of that generation is published at DST.
    ``progress``: a bar per generation of the chunk bytes it transfers.
    ``codec``: how DST stores the chunks it takes (castore.format.codec): the
    codec of a DST created here, or of this copy into an existing DST; by
    default DST's own (a frame from SRC is kept as it is once verified).
    """
    if generation is not None and all_generations:
        raise ValueError("pass a generation or all_generations, not both")
    if generation is not None and run is None:
        raise ValueError("a generation needs its run: pass run= as well")
    with ExitStack() as stack:
        source = _opened(src, stack, create=False)
        if _address(dst) == _address(source):
            raise ValueError(f"source and destination are the same store ({source.path})")
        target = _opened(dst, stack, create=True, codec=codec)
        target.refuse_if_readonly("copy into it")
        stored_as = codec or target.codec  # an argument: never set on the caller's handle
        report = CopyReport()
        for name in [validate_run_name(run)] if run is not None else source.refs.ref_runs():
            chosen = _choose(source, name, generation, all_generations)
            plan = _plan(source, target, name, chosen)
            for digest, root in chosen:
                if digest.hex in plan:
                    report.generations.append(
                        CopiedGeneration(name, root.generation, digest.hex, copied=False)
                    )
                else:
                    report.generations.append(
                        copy_generation(
                            source, target, digest, root, progress=progress, codec=stored_as
                        )
                    )
        return report


def _address(where: StoreOrPath) -> str:
    """A store's address for comparison: an absolute path, or an s3:// URL."""
    named = where.path if isinstance(where, Store) else where
    location = parse_location(named if isinstance(named, str) else os.fspath(named))
    return location.url if location.scheme == "s3" else str(location.path.resolve())


def _opened(
    where: StoreOrPath, stack: ExitStack, *, create: bool, codec: str | None = None
) -> Store:
    if isinstance(where, Store):
        if codec is not None:
            check_setting(codec)
        return where
    options: dict[str, Any] = {} if codec is None else {"codec": codec}
    return stack.enter_context(open_address(where, create=create, **options))


def _choose(
    source: Store, run: str, generation: GenerationSpec | None, every: bool
) -> list[tuple[Digest, GenerationRoot]]:
    """The generations of ``run`` to copy, oldest first."""
    if every:
        return list(source.iter_chain(run))[::-1]
    return [source.resolve_root(run, "latest" if generation is None else generation)]


def _plan(
    source: Store, target: Store, run: str, chosen: list[tuple[Digest, GenerationRoot]]
) -> set[str]:
    """The root hexes of ``chosen`` DST already holds; raise if DST cannot take the others.

    Checked for the whole run before anything is written, so a refused copy
    leaves nothing half done: DST's ids must keep increasing (the ref's
    compare-and-swap refuses otherwise), and DST's newest generation must be
    one SRC's history names, or the run would mix two histories.
    """
    latest = target.refs.read(run)
    if latest is None:
        return set()
    held = set(target.published(run, tolerate_bad_ref=True))
    _, collected = source.logged(run)
    known = set(source.published(run, tolerate_bad_ref=True)) | collected
    known |= {digest.hex for digest, _ in chosen}
    if latest.root.hex not in known:
        raise RefConflictError(
            f"run {run!r} at {target.path} has a history {source.path} does not have (its "
            f"generation {latest.generation}, root {latest.root.short}, is not in the source's "
            "history): copy into another store",
            run=run,
        )
    for digest, root in chosen:
        if digest.hex not in held and root.generation <= latest.generation:
            raise RefConflictError(
                f"cannot copy {run}@{root.generation} to {target.path}: it already has generation "
                f"{latest.generation} of {run!r}, and a run's generation ids only grow (copy "
                "newer generations only, or into another store)",
                run=run,
                generation=root.generation,
            )
    return {digest.hex for digest, _ in chosen if digest.hex in held}


# -- one generation ---------------------------------------------------------------------


def copy_generation(
    source: Store,
    target: Store,
    digest: Digest,
    root: GenerationRoot,
    *,
    progress: bool = False,
    throttle: Callable[[int], None] | None = None,
    chunks: bool = True,
    batch_bytes: int | None = None,
    codec: str | None = None,
    after_uploads: bool = False,
) -> CopiedGeneration:
    """Copy one generation whose id is newer than DST's latest of its run, and publish it.

    DST's reflog record of the publish says what this copy wrote there
    (:class:`CopyRecord`), as a save's root says what the save wrote at SRC;
    ``after_uploads``: others copied the chunks before (castore.tiers on several
    nodes), so what this copy wrote is not what the generation cost DST, and the
    record says nothing of it.

    ``throttle(nbytes)`` is called before each batch of chunk bytes is read (a
    rate cap sleeps there; ``batch_bytes`` smaller than BATCH_BYTES spreads a capped
    copy's reads, hashing and writes more evenly). ``chunks=False`` copies the root and manifests
    only and publishes them without checking that DST holds the chunks: a
    tier that records the generation as held elsewhere (castore.tiers) seeds
    its history so; anything else needs the chunks. ``codec``: how DST stores
    the chunks it takes (castore.format.codec); None: DST's own.
    """
    run, gen = root.run, root.generation
    where = {"run": run, "generation": gen}
    root_bytes, _ = _verified_object(source, digest.raw, TYPE_ROOT, where)
    if encode_object(root) != root_bytes:
        # publish() writes the root re-encoded: only canonical bytes keep the digest.
        raise CorruptObjectError(
            f"root {digest.short} is not in canonical form; it cannot be copied as is", **where
        )
    read = [
        _verified_object(source, shard, TYPE_SHARD, {**where, "shard": index})
        for index, shard in enumerate(root.shards)
    ]
    shards = [data for data, _ in read]
    named = _named_chunks([manifest for _, manifest in read])
    # The shared store lock, as a save holds it: a collection at DST cannot
    # delete a chunk this copy found present before the generation is published.
    with target.save_lock():
        missing: list[bytes] = []
        if chunks:
            present = target.backend.has_many(Namespace.CHUNKS, list(named))
            missing = [key for key, found in zip(named, present, strict=True) if not found]
        total = sum(expected_length(*named[key]) for key in missing)
        stored = 0
        with progress_bar(progress, f"copy {run}@{gen}", total) as bar:
            for batch in _batches(missing, named, batch_bytes or BATCH_BYTES):
                if throttle is not None:
                    throttle(sum(expected_length(*named[key]) for key in batch))
                stored += _copy_chunks(
                    source, target, batch, named, where, codec or target.codec, bar
                )
                fault_point("copy.mid_chunks")
        target.backend.put_many(Namespace.OBJECTS, list(zip(root.shards, shards, strict=True)))
        marked = _mark_parent_absent(source, target, root)
        parent = target.refs.read(run)
        if chunks:
            # DST's own checks before its commit point: they re-read the manifests
            # just written and find every chunk they name present (has_many).
            check_shards(target, list(root.shards), run=run, generation=gen, skeleton=root.state)
        wrote = CopyRecord(len(missing), total, stored, len(root_bytes) + sum(map(len, shards)))
        publish(
            target,
            parent=parent,
            root=root,
            faults=COPY_FAULTS,
            wrote=None if after_uploads else wrote.as_record(),
        )
    return CopiedGeneration(
        run,
        gen,
        digest.hex,
        copied=True,
        chunks_copied=len(missing),
        chunks_skipped=len(named) - len(missing) if chunks else 0,
        bytes_copied=total,
        bytes_stored=stored,
        logical_bytes=sum(expected_length(*named[key]) for key in named),
        objects_copied=len(shards) + 1,
        parent_marked=marked,
    )


def _verified_object(
    source: Store, digest: bytes, expect: str, where: dict[str, Any]
) -> tuple[bytes, Any]:
    """An object's bytes at SRC, hashed against its name, and the object they decode to."""
    return verified_object(source.backend, digest, expect=expect, **where)


def _named_chunks(manifests: Sequence[ShardManifest]) -> dict[bytes, tuple[TensorEntry, int]]:
    """Every distinct chunk the shards name, with an entry and index that say its length."""
    named: dict[bytes, tuple[TensorEntry, int]] = {}
    for shard in manifests:
        for entry in shard.tensors + shard.local_tensors:
            for index, key in enumerate(entry.chunks):
                named.setdefault(key, (entry, index))
    return named


def _batches(
    keys: list[bytes], named: dict[bytes, tuple[TensorEntry, int]], limit: int
) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    size = 0
    for key in keys:
        batch.append(key)
        size += expected_length(*named[key])
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _copy_chunks(
    source: Store,
    target: Store,
    keys: list[bytes],
    named: dict[bytes, tuple[TensorEntry, int]],
    where: dict[str, Any],
    codec: str,
    bar: Bar = NO_BAR,
) -> int:
    """Read ``keys`` from SRC, verify each against its name and length, write them to DST;
    the bytes DST stores for them.

    DST stores each chunk by ``codec`` (castore.format.codec): raw where it
    has none; SRC's frame as it is, once verified, where both compress (the
    chunk's name is the same whatever the codec); else encoded on the shared pool.
    """
    verified: list[tuple[bytes, Any]] = []
    encode: list[tuple[int, Any, Any]] = []

    def keep(values: Iterator[memoryview | None]) -> None:
        for key, value in zip(keys, values, strict=True):
            entry, index = named[key]
            chunk = verify_chunk(entry, index, value, where)  # raises on missing or damaged
            assert value is not None
            if codec == "none" or is_frame(value, len(chunk)):
                stored: Any = chunk.tobytes() if codec == "none" else bytes(value)
            else:
                stored = chunk.tobytes()
                encoder = encoder_for(codec, entry.dtype)
                if encoder is not None:
                    encode.append((len(verified), encoder, stored))
            verified.append((key, stored))
            if bar:
                bar.update(len(chunk))

    source.backend.read_many(Namespace.CHUNKS, keys, keep)
    if encode:
        frames = shared_pool().map(lambda job: job[1](job[2]), encode)
        for (position, _, _), frame in zip(encode, frames, strict=True):
            verified[position] = (verified[position][0], frame)
    target.backend.put_many(Namespace.CHUNKS, verified)
    return sum(len(stored) for _, stored in verified)


def copy_shard_chunks(
    source: Store,
    target: Store,
    root: GenerationRoot,
    shards: Sequence[int],
    *,
    throttle: Callable[[int], None] | None = None,
    batch_bytes: int | None = None,
) -> int:
    """Copy the chunks of some shards of ``root`` that DST lacks, and their manifests;
    the chunk bytes sent. Publishes nothing.

    Part of a generation several sources hold: each copies the shards it
    holds (castore.tiers: a node uploads its own ranks' shards), and then one
    publishes the whole with :func:`copy_generation`, which finds every chunk
    present and checks the shards at DST before its commit point. Each chunk
    is verified as read; a copy cut off is resumed by copying again (what DST
    has is skipped).
    """
    where = {"run": root.run, "generation": root.generation}
    read = [
        _verified_object(source, root.shards[index], TYPE_SHARD, {**where, "shard": index})
        for index in shards
    ]
    named = _named_chunks([manifest for _, manifest in read])
    sent = 0
    with target.save_lock():
        present = target.backend.has_many(Namespace.CHUNKS, list(named))
        missing = [key for key, found in zip(named, present, strict=True) if not found]
        for batch in _batches(missing, named, batch_bytes or BATCH_BYTES):
            size = sum(expected_length(*named[key]) for key in batch)
            if throttle is not None:
                throttle(size)
            _copy_chunks(source, target, batch, named, where, target.codec)
            sent += size
            fault_point("copy.mid_chunks")
        target.backend.put_many(
            Namespace.OBJECTS,
            [(root.shards[index], data) for index, (data, _) in zip(shards, read, strict=True)],
        )
    return sent


def _mark_parent_absent(source: Store, target: Store, root: GenerationRoot) -> bool:
    """Log the parent of ``root`` as collected at DST when DST does not hold it.

    DST's chain walk follows parent links and treats a listed root that is
    missing as damage; a collect record is what a run's history says of a
    generation that is deliberately not there, so ``log``, ``load``,
    ``verify`` and ``gc`` at DST stop the chain at it. It is written before
    the child is published, so no reader sees the child without it.
    """
    if root.parent is None:
        return False
    parent = Digest(root.parent)
    listed, collected = target.logged(root.run)
    latest = target.refs.read(root.run)
    if parent.hex in listed or parent.hex in collected or (latest and latest.root == parent):
        return False
    gen = _logged_generation(source, root.run, parent) or root.generation - 1
    with target.refs.locked(root.run):  # reflog records are appended under the ref lock
        target.refs.record_collected(root.run, gen, parent)
    return True


def _logged_generation(source: Store, run: str, root: Digest) -> int | None:
    """The id SRC's reflog gives the generation ``root`` (None if it names none)."""
    for record in source.refs.records_backwards(run):
        if record.get("root") == root.hex:
            return int(record["generation"])
    return None


__all__ = [
    "BATCH_BYTES",
    "CopiedGeneration",
    "CopyRecord",
    "CopyReport",
    "copy",
    "copies_logged",
    "copy_generation",
    "copy_shard_chunks",
]
