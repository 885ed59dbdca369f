"""Damaged stores, each damaged in one known way: the fixture of the corruption tests.

For every case a fresh store is built: run ``run`` with three generations of a
small numpy training state (multi-chunk tensors at a 256-byte chunk size, a
tensor that never changes, plain values and a per-rank ``RankLocal`` value),
plus one generation of a second run ``other``. For the cases about ranks,
generation 3 is written as a 2-rank generation in this one process, the way
``castore.dist.save`` does it: each rank's chunks and shard manifest
(``castore.core.commit.write_shard``), then the coordinator's checks and the root
(``castore.core.commit.publish_shards``). The newest generation is then damaged
(:data:`CASES`, each with the outcome it must have, :class:`Expect`).

A case whose outcome is wrong in a way castore is known to mishandle lists
the reason in ``Case.gaps``. :mod:`castore.testing.corrupt_report` observes
what castore does with each damaged store; ``tools/corrupt.py`` prints it,
and ``tests/test_corrupt.py`` asserts it.

One idea, about 880 lines because ``CASES`` (270 lines) lists every known
damage beside the store it damages and the outcome it must have: the point of
the fixture is that one table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import castore
from castore import RankLocal, Shard, Store
from castore.chunkstore.base import Namespace
from castore.chunkstore.lmdb.backend import LmdbBackend
from castore.core.commit import (
    COORDINATOR_FAULTS,
    ShardWrite,
    commit_objects,
    publish_writes,
    write_shard,
)
from castore.errors import (
    CastoreError,
    ChecksumMismatchError,
    ChunkMissingError,
    CodecError,
    CorruptObjectError,
    CorruptRefError,
    InjectedFault,
    ObjectMissingError,
)
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import GenerationRoot, TensorEntry, encode_object
from castore.format.tree import encode_state
from castore.repo.reffile import encode_ref
from castore.support import faults
from castore.verify import verify_store

RUN = "run"
OTHER = "other"
CHUNK_SIZE = 256
GENERATIONS = 3
NEWEST = GENERATIONS
SENTINEL = 0xA5
RANKS = 2
# Which rank writes each replicated tensor of the 2-rank generation (one rank each,
# as castore.dist.save assigns them); model/w is sharded by rows.
OWNERS = {"model/b": 0, "model/frozen": 0, "model/counts": 1}
DAMAGED_TENSOR = "model/w"
RANK_KEY = "rank"  # the state's per-rank value (a RankLocal)
DAMAGED_CHUNK = 5  # model/w is 64x16 float32 = 4 KiB = 16 chunks of 256 bytes

_FROZEN = np.random.default_rng(1000).standard_normal((32, 16)).astype(np.float16)


# -- the states ------------------------------------------------------------------


def make_state(generation: int, *, seed: int = 0, rank: int = 0) -> dict[str, Any]:
    """The state saved as ``generation`` (numpy only; equal arguments give equal bytes).

    ``model/frozen`` is the same in every generation (its chunks are shared);
    every other tensor differs. ``rank`` picks the per-rank value.
    """
    rng = np.random.default_rng(seed * 1000 + generation)
    return {
        "model": {
            "w": rng.standard_normal((64, 16), dtype=np.float32),  # 16 chunks
            "b": rng.standard_normal(96, dtype=np.float32),  # 2 chunks
            "frozen": _FROZEN.copy(),  # 4 chunks, shared by all generations
            "counts": rng.integers(0, 1 << 40, size=(10, 10), dtype=np.int64),  # 4 chunks
        },
        "optimizer": {"step": 10 * generation, "lr": 1e-3 / generation, "betas": (0.9, 0.999)},
        "note": f"generation {generation}",
        RANK_KEY: RankLocal(_rank_value(generation, seed, rank)),
    }


def _rank_value(generation: int, seed: int, rank: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, generation, rank])
    return {"seed": 100 * rank + generation, "noise": rng.standard_normal(40)}  # 2 chunks


def loaded_form(generation: int, ranks: int, *, seed: int = 0) -> dict[str, Any]:
    """What ``Store.load`` gives back for a generation saved by ``ranks`` ranks.

    Without a process group a RankLocal comes back as every rank's value by rank.
    """
    state = make_state(generation, seed=seed)
    state[RANK_KEY] = {r: _rank_value(generation, seed, r) for r in range(ranks)}
    return state


def tensors_of(state: Any, path: str = "") -> dict[str, np.ndarray]:
    """Every global tensor of a state by its key path (the per-rank values excluded)."""
    found: dict[str, np.ndarray] = {}
    if isinstance(state, np.ndarray):
        found[path] = state
    elif isinstance(state, dict):
        for key, value in state.items():
            if not (path == "" and key == RANK_KEY):
                found.update(tensors_of(value, f"{path}/{key}" if path else str(key)))
    return found


def bitwise_differences(actual: Any, expected: Any, path: str = ".") -> list[str]:
    """Where two states differ: container types, keys, dtypes, shapes, bytes, values."""
    if type(actual) is not type(expected):
        return [f"{path}: {type(actual).__name__} != {type(expected).__name__}"]
    if isinstance(expected, dict):
        if list(actual) != list(expected):
            return [f"{path}: keys {list(actual)} != {list(expected)}"]
        return [
            d for k in expected for d in bitwise_differences(actual[k], expected[k], f"{path}/{k}")
        ]
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            return [f"{path}: length {len(actual)} != {len(expected)}"]
        pairs = enumerate(zip(actual, expected, strict=True))
        return [d for i, (a, e) in pairs for d in bitwise_differences(a, e, f"{path}/{i}")]
    if isinstance(expected, np.ndarray):
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return [f"{path}: {actual.dtype}{actual.shape} != {expected.dtype}{expected.shape}"]
        return [] if actual.tobytes() == expected.tobytes() else [f"{path}: bytes differ"]
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


# -- building a store ------------------------------------------------------------


@dataclass
class Fixture:
    """A built store: its handle, what each generation holds, and facts for messages."""

    path: Path
    store: Store
    layout: str  # "single" or "sharded" (generation 3 written by 2 ranks)
    ranks: dict[int, int]  # generation -> ranks that wrote it
    facts: dict[str, Any] = field(default_factory=dict)

    def expected_state(self, generation: int) -> dict[str, Any]:
        return loaded_form(generation, self.ranks[generation])

    def root(self, generation: int) -> tuple[Digest, GenerationRoot]:
        return self.store.resolve_root(RUN, generation)

    def close(self) -> None:
        self.store.close()


def build(path: Path, layout: str = "single") -> Fixture:
    """A fresh store at ``path``: ``run`` @1..3 and ``other`` @1, checked intact."""
    if layout not in ("single", "sharded"):
        raise ValueError(f"layout must be 'single' or 'sharded', got {layout!r}")
    store = castore.open(path, chunk_size=CHUNK_SIZE)
    fixture = Fixture(path, store, layout, {})
    try:
        store.save(make_state(1, seed=7), run=OTHER, step=1)
        for generation in range(1, GENERATIONS + 1):
            if layout == "sharded" and generation == GENERATIONS:
                save_sharded(store, generation)
                fixture.ranks[generation] = RANKS
            else:
                store.save(make_state(generation), run=RUN, step=10 * generation)
                fixture.ranks[generation] = 1
        _check_intact(fixture)
    except BaseException:
        store.close()
        raise
    return fixture


def _check_intact(fixture: Fixture) -> None:
    """The control before any damage: everything verifies and loads bitwise."""
    report = verify_store(fixture.store, deep=True)
    if not report.ok or report.generations != GENERATIONS + 1:
        raise AssertionError(f"fresh store does not verify: {report.problems}")
    for generation in fixture.ranks:
        state = fixture.store.load(RUN, generation)
        differences = bitwise_differences(state, fixture.expected_state(generation))
        if differences:
            raise AssertionError(f"fresh store @{generation} differs: {differences[:3]}")


def rank_state(generation: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s view of a 2-rank generation: its rows of model/w as a Shard."""
    state = make_state(generation, rank=rank)
    rows = state["model"]["w"].shape[0] // RANKS
    block = state["model"]["w"][rank * rows : (rank + 1) * rows]
    state["model"]["w"] = Shard(block, (rows * RANKS, 16), (rank * rows, 0))
    return state


def write_rank_shards(store: Store, generation: int) -> tuple[list[ShardWrite], bytes]:
    """Every rank's chunks and committed shard manifest (the acknowledged part of a save).

    Returns the writes in rank order and the coordinator's (rank 0's) state skeleton.
    """
    writes: list[ShardWrite] = []
    skeleton = b""
    for rank in range(RANKS):
        encoded = encode_state(rank_state(generation, rank))
        skeleton = skeleton or encoded.skeleton
        own = {leaf.name for leaf in encoded.leaves if leaf.sharded}
        own |= {name for name, owner in OWNERS.items() if owner == rank}
        shard = write_shard(store, encoded, run=RUN, generation=generation, rank=rank, own=own)
        commit_objects(store, [(shard.digest, shard.data)])
        writes.append(shard)
    return writes, skeleton


def publish_sharded(
    store: Store, generation: int, writes: list[ShardWrite], skeleton: bytes
) -> tuple[Digest, GenerationRoot]:
    """The coordinator's checks, root and publish, through the sequence castore.dist uses."""
    return publish_writes(
        store,
        run=RUN,
        generation=generation,
        step=10 * generation,
        parent=store.refs.read(RUN),
        writes=writes,
        skeleton=skeleton,
    )


def save_sharded(store: Store, generation: int) -> None:
    """Publish a 2-rank generation from this one process."""
    writes, skeleton = write_rank_shards(store, generation)
    publish_sharded(store, generation, writes, skeleton)


# -- damage helpers --------------------------------------------------------------


def flipped(data: bytes, at: int) -> bytes:
    damaged = bytearray(data)
    damaged[at] ^= 0xFF
    return bytes(damaged)


def raw_put(store: Store, namespace: Namespace, key: bytes, value: bytes) -> None:
    """Overwrite one stored value in place (LMDB's test hook: no digest check)."""
    backend = store.backend
    if not isinstance(backend, LmdbBackend):
        raise TypeError(f"damaging values in place needs the LMDB backend, not {backend!r}")
    backend.raw_put(namespace, key, value)


def newest_entry(fixture: Fixture, name: str) -> TensorEntry:
    _, root = fixture.root(NEWEST)
    boxes = fixture.store.tensor_entries(root)[name]
    return boxes[0]


def chunk_to_damage(fixture: Fixture) -> bytes:
    """A chunk of the newest generation that no other generation or run uses."""
    key = newest_entry(fixture, DAMAGED_TENSOR).chunks[DAMAGED_CHUNK]
    for run, generation in [(RUN, g) for g in range(1, NEWEST)] + [(OTHER, 1)]:
        _, root = fixture.store.resolve_root(run, generation)
        for boxes in fixture.store.tensor_entries(root).values():
            if any(key in entry.chunks for entry in boxes):
                raise AssertionError(f"chunk to damage is shared with {run}@{generation}")
    fixture.facts.update(tensor=DAMAGED_TENSOR, chunk=DAMAGED_CHUNK, chunk_hex=key.hex())
    return key


def write_ref_file(store: Store, run: str, data: bytes) -> None:
    """Replace ``refs/RUN`` with ``data`` (atomically, as a ref advance would)."""
    path = Path(store.path) / "refs" / run  # the LMDB layout: a local directory
    temp = path.with_name(f".{run}.corrupt.tmp")
    temp.write_bytes(data)
    os.replace(temp, path)


def rewrite_reflog(store: Store, run: str, old: str, new: str) -> None:
    """Make the reflog record that named root ``old`` name ``new`` (re-checksummed)."""
    path = store.refs.reflog_path(run)
    lines = []
    for line in path.read_text().splitlines():
        record = json.loads(line.rpartition("\t")[0])
        for key in ("root", "parent"):
            if record.get(key) == old:
                record[key] = new
        text = json.dumps(record, sort_keys=True, separators=(",", ":"))
        lines.append(f"{text}\t{digest_bytes(text.encode()).hex()[:32]}\n")
    temp = path.with_name(f".{path.name}.corrupt.tmp")
    temp.write_text("".join(lines))
    os.replace(temp, path)


def substitute_root(fixture: Fixture, **changes: Any) -> Digest:
    """Replace the newest root by one with ``changes``, as if that one had been published.

    Objects are named by their content, so a root naming other shards is a new
    object: it is committed, the ref and the reflog record of the newest
    generation are made to name it, and the original root is deleted. The
    store is then what a coordinator that published the bad root leaves.
    """
    store = fixture.store
    old_digest, old_root = fixture.root(NEWEST)
    new_root = dataclasses.replace(old_root, **changes)
    data = encode_object(new_root)
    digest = Digest(digest_bytes(data))
    commit_objects(store, [(digest.raw, data)])
    ref = store.refs.read(RUN)
    assert ref is not None and ref.root == old_digest
    write_ref_file(store, RUN, encode_ref(dataclasses.replace(ref, root=digest)))
    rewrite_reflog(store, RUN, old_digest.hex, digest.hex)
    store.backend.delete_many(Namespace.OBJECTS, [old_digest.raw])
    fixture.facts.update(root_hex=digest.hex)
    return digest


def newest_shards(fixture: Fixture) -> tuple[bytes, ...]:
    shards = fixture.root(NEWEST)[1].shards
    fixture.facts.update(shard_hex=[s.hex() for s in shards])
    return shards


# -- the damage cases ------------------------------------------------------------


def damage_chunk_missing(fixture: Fixture) -> None:
    key = chunk_to_damage(fixture)
    assert fixture.store.backend.delete_many(Namespace.CHUNKS, [key]) == 1


def damage_chunk_truncated(fixture: Fixture) -> None:
    key = chunk_to_damage(fixture)
    value = fixture.store.backend.get(Namespace.CHUNKS, key)
    assert value is not None and len(value) == CHUNK_SIZE
    raw_put(fixture.store, Namespace.CHUNKS, key, value[: CHUNK_SIZE // 2])


def damage_pack_truncated(fixture: Fixture) -> None:
    """The pack holding @3's new chunks cut in the middle of a chunk of model/w (a full
    disk, a copy cut short): the chunk index still names every chunk in it."""
    key = chunk_to_damage(fixture)
    backend = fixture.store.backend
    assert isinstance(backend, LmdbBackend)
    where = backend.locate(key)
    assert where is not None
    size = where.offset + where.length // 2
    os.truncate(backend.pack_path(where.pack), size)
    fixture.facts.update(pack=backend.pack_path(where.pack).name, pack_size=size)


def damage_chunk_checksum(fixture: Fixture) -> None:
    key = chunk_to_damage(fixture)
    value = fixture.store.backend.get(Namespace.CHUNKS, key)
    assert value is not None
    raw_put(fixture.store, Namespace.CHUNKS, key, flipped(value, 17))


def damage_chunk_hostile_frame(fixture: Fixture) -> None:
    """A chunk's record replaced by a compressed frame (castore.format.codec) that claims
    2**60 raw bytes: a reader must refuse it before allocating anything."""
    key = chunk_to_damage(fixture)
    header = struct.pack("<4sBBBBQ", b"CSZ1", 1, 0, 1, 0, 1 << 60)  # zstd, one stream
    stream = struct.pack("<BQ", 1, 16) + bytes(16)  # a zstd stream of 16 bytes
    raw_put(fixture.store, Namespace.CHUNKS, key, header + stream)


def damage_shard_stale_generation(fixture: Fixture) -> None:
    stale = fixture.root(NEWEST - 1)[1].shards[0]
    substitute_root(fixture, shards=(stale,))


def damage_shard_stale_run(fixture: Fixture) -> None:
    stale = fixture.store.resolve_root(OTHER)[1].shards[0]
    substitute_root(fixture, shards=(stale,))


def damage_shard_bytes_swapped(fixture: Fixture) -> None:
    """The bytes under the newest shard's digest are another (valid) shard's bytes."""
    (key,) = newest_shards(fixture)
    other = fixture.store.backend.get(Namespace.OBJECTS, fixture.root(NEWEST - 1)[1].shards[0])
    assert other is not None
    raw_put(fixture.store, Namespace.OBJECTS, key, other)


def damage_manifest_garbled(fixture: Fixture) -> None:
    (key,) = newest_shards(fixture)
    value = fixture.store.backend.get(Namespace.OBJECTS, key)
    assert value is not None
    raw_put(fixture.store, Namespace.OBJECTS, key, flipped(value, len(value) // 2))


def damage_manifest_truncated(fixture: Fixture) -> None:
    (key,) = newest_shards(fixture)
    value = fixture.store.backend.get(Namespace.OBJECTS, key)
    assert value is not None
    raw_put(fixture.store, Namespace.OBJECTS, key, value[: len(value) // 2])


def damage_manifest_truncated_named(fixture: Fixture) -> None:
    """A truncated manifest committed under its own digest, named by the root."""
    (key,) = newest_shards(fixture)
    value = fixture.store.backend.get(Namespace.OBJECTS, key)
    assert value is not None
    cut = value[: len(value) // 2]
    digest = digest_bytes(cut)
    commit_objects(fixture.store, [(digest, cut)])
    fixture.facts.update(shard_hex=[digest.hex()])
    substitute_root(fixture, shards=(digest,))


def damage_ref_garbled(fixture: Fixture) -> None:
    path = fixture.path / "refs" / RUN
    write_ref_file(fixture.store, RUN, flipped(path.read_bytes(), 20))


def damage_ref_truncated(fixture: Fixture) -> None:
    path = fixture.path / "refs" / RUN
    data = path.read_bytes()
    write_ref_file(fixture.store, RUN, data[: len(data) - 10])


def damage_ref_substituted(fixture: Fixture) -> None:
    """Only the ref is moved to a substitute root: the reflog and the old root stay."""
    digest, root = fixture.root(NEWEST)
    stale = fixture.root(NEWEST - 1)[1].shards[0]
    data = encode_object(dataclasses.replace(root, shards=(stale,)))
    substitute = Digest(digest_bytes(data))
    commit_objects(fixture.store, [(substitute.raw, data)])
    ref = fixture.store.refs.read(RUN)
    assert ref is not None and ref.root == digest
    write_ref_file(fixture.store, RUN, encode_ref(dataclasses.replace(ref, root=substitute)))
    fixture.facts.update(root_hex=substitute.hex, reflog_root_hex=digest.hex)


def damage_root_missing(fixture: Fixture) -> None:
    digest, _ = fixture.root(NEWEST)
    fixture.facts.update(root_hex=digest.hex)
    assert fixture.store.backend.delete_many(Namespace.OBJECTS, [digest.raw]) == 1


def damage_shard_duplicated(fixture: Fixture) -> None:
    """The 2-rank root lists rank 1's manifest twice (world size 3 to match the list)."""
    s0, s1 = newest_shards(fixture)
    substitute_root(fixture, shards=(s0, s1, s1), world_size=RANKS + 1)


def damage_shard_duplicated_in_place(fixture: Fixture) -> None:
    """The 2-rank root lists rank 0's manifest where rank 1's should be."""
    s0, _ = newest_shards(fixture)
    substitute_root(fixture, shards=(s0, s0))


def damage_rank_count_high(fixture: Fixture) -> None:
    newest_shards(fixture)
    substitute_root(fixture, world_size=RANKS + 1)


def damage_rank_count_low(fixture: Fixture) -> None:
    newest_shards(fixture)
    substitute_root(fixture, world_size=1)


def damage_rank_order(fixture: Fixture) -> None:
    """The root lists the shards out of rank order: rank 1's manifest first."""
    s0, s1 = newest_shards(fixture)
    substitute_root(fixture, shards=(s1, s0))


def damage_coordinator_lost(fixture: Fixture) -> None:
    """Generation 4's ranks committed and acknowledged; the coordinator died before the root."""
    writes, _ = write_rank_shards(fixture.store, NEWEST + 1)
    fixture.facts.update(shard_hex=[w.digest.hex() for w in writes])


def damage_coordinator_lost_after_root(fixture: Fixture) -> None:
    """The coordinator committed generation 4's root and died before the ref advance."""
    writes, skeleton = write_rank_shards(fixture.store, NEWEST + 1)
    point = COORDINATOR_FAULTS.before_ref_advance
    faults.arm(point, "raise")
    try:
        publish_sharded(fixture.store, NEWEST + 1, writes, skeleton)
    except InjectedFault:
        pass  # where the coordinator died: its root committed, the ref not advanced
    else:
        raise AssertionError(f"the publish did not stop at {point}")
    finally:
        faults.disarm(point)


# -- expected outcomes -----------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """The outcome a case must have. Strings are formatted with the fixture's facts."""

    error: type[CastoreError] | None  # what Store.load(run) raises; None: it loads
    words: tuple[str, ...] = ()  # each in the error message
    context: tuple[tuple[str, Any], ...] = ()  # error attributes and their values
    loads: int | None = None  # the generation a load without error gives
    damaged: tuple[int | None, ...] = (NEWEST,)  # generations of `run` verify reports
    verify_words: tuple[str, ...] = ()  # each in one of the problems verify reports
    intact: tuple[int, ...] = (1, 2)  # generations that must verify clean on their own
    fallback: int = NEWEST - 1  # the newest undamaged generation
    skipped: tuple[int, ...] = (NEWEST,)  # generations a fallback passes over

    @property
    def skipped_error(self) -> str:
        """The error type each skipped generation is reported with."""
        return self.error.__name__ if self.error else ""


@dataclass(frozen=True)
class Case:
    name: str
    layout: str
    what: str
    damage: Callable[[Fixture], None]
    expect: Expect
    gaps: dict[str, str] = field(default_factory=dict)  # aspect -> why castore fails it


ASPECTS = ("load", "targets", "verify", "verify_intact", "fallback", "dist_fallback")

_CHUNK_CONTEXT = (("tensor", "{tensor}"), ("run", RUN), ("generation", NEWEST))

CASES: tuple[Case, ...] = (
    Case(
        "chunk-missing",
        "single",
        "a chunk of model/w @3 deleted (with its chunk_index entry)",
        damage_chunk_missing,
        Expect(
            ChunkMissingError,
            ("chunk {chunk} of tensor '{tensor}' is missing",),
            _CHUNK_CONTEXT,
            verify_words=("chunk {chunk} of tensor '{tensor}' is missing",),
        ),
    ),
    Case(
        "chunk-truncated",
        "single",
        "a chunk of model/w @3 cut to half its length (chunk_index still says 256)",
        damage_chunk_truncated,
        Expect(
            ChecksumMismatchError,
            ("chunk {chunk} of tensor '{tensor}' is damaged",),
            (*_CHUNK_CONTEXT, ("expected", "{chunk_hex}")),
            verify_words=("chunk {chunk} of tensor '{tensor}' is damaged",),
        ),
    ),
    Case(
        "pack-truncated",
        "single",
        "the pack of @3's new chunks cut in the middle of a chunk of model/w",
        damage_pack_truncated,
        Expect(
            ChecksumMismatchError,
            ("of tensor", "is damaged"),
            (("run", RUN), ("generation", NEWEST)),
            verify_words=(
                "chunk {chunk} of tensor '{tensor}' is truncated: its pack {pack} is "
                "{pack_size} bytes",
            ),
        ),
    ),
    Case(
        "chunk-checksum",
        "single",
        "one byte of a chunk of model/w @3 flipped (length unchanged)",
        damage_chunk_checksum,
        Expect(
            ChecksumMismatchError,
            ("chunk {chunk} of tensor '{tensor}' is damaged",),
            (*_CHUNK_CONTEXT, ("expected", "{chunk_hex}")),
            verify_words=("chunk {chunk} of tensor '{tensor}' is damaged",),
        ),
    ),
    Case(
        "chunk-hostile-frame",
        "single",
        "a chunk of model/w @3 replaced by a 41-byte compressed frame claiming 2**60 raw bytes",
        damage_chunk_hostile_frame,
        Expect(
            CodecError,
            (
                "chunk {chunk} of tensor '{tensor}' cannot be decoded",
                "declares 1152921504606846976",
            ),
            _CHUNK_CONTEXT,
            verify_words=("chunk {chunk} of tensor '{tensor}' is damaged",),
        ),
    ),
    Case(
        "shard-stale-generation",
        "single",
        "root @3 republished naming @2's shard manifest",
        damage_shard_stale_generation,
        Expect(
            CorruptObjectError,
            (f"shard 0 belongs to {RUN}@{NEWEST - 1}",),
            (("run", RUN), ("generation", NEWEST)),
            verify_words=(f"shard 0 belongs to {RUN}@{NEWEST - 1}",),
        ),
    ),
    Case(
        "shard-stale-run",
        "single",
        f"root @3 republished naming {OTHER}@1's shard manifest",
        damage_shard_stale_run,
        Expect(
            CorruptObjectError,
            (f"shard 0 belongs to {OTHER}@1",),
            (("run", RUN), ("generation", NEWEST)),
            verify_words=(f"shard 0 belongs to {OTHER}@1",),
        ),
    ),
    Case(
        "shard-bytes-swapped",
        "single",
        "@2's shard manifest bytes put under @3's shard digest",
        damage_shard_bytes_swapped,
        Expect(
            ChecksumMismatchError,
            ("shard object is damaged",),
            (("run", RUN), ("generation", NEWEST), ("shard", 0), ("expected", "{shard_hex[0]}")),
            verify_words=("shard object is damaged",),
        ),
    ),
    Case(
        "manifest-garbled",
        "single",
        "one byte of @3's shard manifest flipped",
        damage_manifest_garbled,
        Expect(
            ChecksumMismatchError,
            ("shard object is damaged",),
            (("run", RUN), ("generation", NEWEST), ("shard", 0), ("expected", "{shard_hex[0]}")),
            verify_words=("shard object is damaged",),
        ),
    ),
    Case(
        "manifest-truncated",
        "single",
        "@3's shard manifest cut to half its length",
        damage_manifest_truncated,
        Expect(
            ChecksumMismatchError,
            ("shard object is damaged",),
            (("run", RUN), ("generation", NEWEST), ("shard", 0), ("expected", "{shard_hex[0]}")),
            verify_words=("shard object is damaged",),
        ),
    ),
    Case(
        "manifest-truncated-named",
        "single",
        "half of @3's manifest committed under its own digest; root @3 names it",
        damage_manifest_truncated_named,
        Expect(
            CorruptObjectError,
            ("shard object {shard_hex[0]:.16}", "not valid msgpack"),
            (("run", RUN), ("generation", NEWEST), ("shard", 0)),
            verify_words=("not valid msgpack",),
        ),
    ),
    Case(
        "ref-garbled",
        "single",
        "one byte of refs/run's payload flipped",
        damage_ref_garbled,
        Expect(
            CorruptRefError,
            ("ref file fails its checksum",),
            (("run", RUN),),
            damaged=(None,),
            verify_words=("CorruptRefError", "ref file fails its checksum"),
            intact=(1, 2, 3),
            fallback=NEWEST,
            skipped=(0,),  # the damaged ref itself is reported
        ),
    ),
    Case(
        "ref-truncated",
        "single",
        "refs/run cut short by 10 bytes",
        damage_ref_truncated,
        Expect(
            CorruptRefError,
            ("ref file length does not match its header",),
            (("run", RUN),),
            damaged=(None,),
            verify_words=("CorruptRefError", "ref file length does not match its header"),
            intact=(1, 2, 3),
            fallback=NEWEST,
            skipped=(0,),  # the damaged ref itself is reported
        ),
    ),
    Case(
        "ref-substituted",
        "single",
        "refs/run names a new root @3 naming @2's manifest; the reflog still names the old",
        damage_ref_substituted,
        Expect(
            CorruptObjectError,
            (f"shard 0 belongs to {RUN}@{NEWEST - 1}",),
            (("run", RUN), ("generation", NEWEST)),
            verify_words=(f"shard 0 belongs to {RUN}@{NEWEST - 1}",),
            fallback=NEWEST,  # the reflog's own root of @3 is intact
        ),
    ),
    Case(
        "root-missing",
        "single",
        "@3's root object deleted (the ref and reflog still name it)",
        damage_root_missing,
        Expect(
            ObjectMissingError,
            ("root object {root_hex:.16} is missing",),
            (("run", RUN),),
            damaged=(None, NEWEST),
            verify_words=("ObjectMissingError: root object {root_hex:.16} is missing",),
        ),
    ),
    Case(
        "shard-duplicated",
        "sharded",
        "2-rank root @3 lists rank 1's manifest twice (world_size 3)",
        damage_shard_duplicated,
        Expect(
            CorruptObjectError,
            ("shard 2 is rank 1's manifest",),
            (("run", RUN), ("generation", NEWEST)),
            verify_words=("shard 2 is rank 1's manifest",),
        ),
    ),
    Case(
        "shard-duplicated-in-place",
        "sharded",
        "2-rank root @3 lists rank 0's manifest in rank 1's place",
        damage_shard_duplicated_in_place,
        Expect(
            CorruptObjectError,
            ("shard 1 is rank 0's manifest",),
            (("run", RUN), ("generation", NEWEST)),
            verify_words=("shard 1 is rank 0's manifest",),
        ),
    ),
    Case(
        "rank-count-high",
        "sharded",
        "2-rank root @3 says world_size 3",
        damage_rank_count_high,
        Expect(
            CorruptObjectError,
            ("rank(s) wrote it but lists",),
            (("run", RUN), ("generation", NEWEST)),
            verify_words=("rank(s) wrote it but lists",),
        ),
    ),
    Case(
        "rank-count-low",
        "sharded",
        "2-rank root @3 says world_size 1",
        damage_rank_count_low,
        Expect(
            CorruptObjectError,
            ("rank(s) wrote it but lists",),
            (("run", RUN), ("generation", NEWEST)),
            verify_words=("rank(s) wrote it but lists",),
        ),
    ),
    Case(
        "rank-order",
        "sharded",
        "2-rank root @3 lists rank 1's manifest first",
        damage_rank_order,
        Expect(
            CorruptObjectError,
            ("shard 0 is rank 1's manifest",),
            (("run", RUN), ("generation", NEWEST)),
            verify_words=("shard 0 is rank 1's manifest",),
        ),
    ),
    Case(
        "coordinator-lost",
        "sharded",
        "both ranks of @4 committed chunks and manifests; no root, no ref advance",
        damage_coordinator_lost,
        Expect(None, loads=NEWEST, damaged=(), intact=(1, 2, 3), fallback=NEWEST, skipped=()),
    ),
    Case(
        "coordinator-lost-after-root",
        "sharded",
        "@4's manifests and root committed; the ref never advanced",
        damage_coordinator_lost_after_root,
        Expect(None, loads=NEWEST, damaged=(), intact=(1, 2, 3), fallback=NEWEST, skipped=()),
    ),
)

CASES_BY_NAME = {case.name: case for case in CASES}


def fmt(text: str, facts: dict[str, Any]) -> str:
    return text.format(**facts)


# -- live targets ----------------------------------------------------------------


def make_targets(fixture: Fixture, generation: int = NEWEST) -> dict[str, Any]:
    """Preallocated numpy targets for every global tensor, filled with the sentinel."""
    targets: dict[str, Any] = {}
    for name, tensor in tensors_of(fixture.expected_state(generation)).items():
        node = targets
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        array = np.empty_like(tensor)
        array.reshape(-1).view(np.uint8)[:] = SENTINEL
        node[leaf] = array
    return targets


def modified_targets(targets: dict[str, Any]) -> list[str]:
    """Names of the targets that no longer hold the sentinel in every byte."""
    return [
        name
        for name, array in tensors_of(targets).items()
        if not bool(np.all(array.reshape(-1).view(np.uint8) == SENTINEL))
    ]


def load_into(
    store: Store, targets: dict[str, Any], generation: int | str = "latest", **options: Any
) -> Any:
    """``castore.dist.load`` as a group of one; each rank takes its own per-rank value."""
    import castore.dist  # here: it imports torch, which the rest of the fixture never needs

    return castore.dist.load(
        store, RUN, targets, generation, rank_local=lambda rank: rank, **options
    )


def targets_equal(targets: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    return bitwise_differences(tensors_of(targets), tensors_of(expected))


# -- running cases ---------------------------------------------------------------


@contextmanager
def damaged_store(case: Case, path: Path) -> Iterator[Fixture]:
    """A fresh store at ``path`` with ``case``'s damage applied; closed afterwards."""
    if path.exists():
        shutil.rmtree(path)
    fixture = build(path, case.layout)
    try:
        case.damage(fixture)
        yield fixture
    finally:
        fixture.close()
