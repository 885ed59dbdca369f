"""Checking a store: structure always, every chunk's bytes with ``deep``.

The structural check reads every ref, root and shard manifest (each verified
against its digest and decoded), checks that each generation's tensors cover
their shapes exactly and match what its state refers to, that every chunk
it names is present in the chunk index, and that the pack the index places
it in is there and long enough to hold it (one stat per pack: a truncated
pack is named as such). It reads no chunk byte: ``deep`` also re-hashes
every chunk, once per store even when many generations share it, and checks
the chunk pieces each tensor entry records (docs/FORMAT.md, "Chunk pieces")
against the chunk's own, computed in that same pass. Wrong pieces are a
problem of their own kind (:data:`PIECES`), not damage: readers check them
against the chunk's name before using them and read the whole chunk
otherwise, so they cost reads but never a wrong byte; they point at a
writer's fault.

Every generation's manifests are read before any chunk is checked, so the
progress bar's total (the bytes of every distinct chunk) is known from its
start: it never grows and reaches 100% once.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from castore.chunkstore.base import Namespace
from castore.core.chunkread import expected_length
from castore.core.hashpool import shared_pool
from castore.core.history import unknown_run
from castore.core.holdings import held_shards
from castore.core.reading import check_coverage, check_rank_local
from castore.errors import CastoreError, GenerationNotFoundError
from castore.format.codec import held_hashed
from castore.format.hashing import Digest, digest_here
from castore.format.objects import GenerationRoot, TensorEntry
from castore.format.pieces import CV_SIZE, hash_chunk, piece_ends
from castore.format.tree import decode_tree, tensor_names
from castore.repo.records import validate_run_name
from castore.support.progress import NO_BAR, Bar, progress_bar, progress_wanted

if TYPE_CHECKING:
    from castore.store import Store

_DEEP_BATCH = 64

DAMAGE = "damage"  # the store lacks what a generation names, or holds it wrong
PIECES = "pieces"  # an entry records chunk pieces that are not its chunk's own

# A generation's chunks: digest -> (a tensor entry naming it, its index there).
Users = dict[bytes, tuple[TensorEntry, int]]
# What verify checks of one generation: the root, its chunks, the entries that record
# chunk pieces, and how many problems were found up to it.
Planned = tuple[GenerationRoot, Users, list[TensorEntry], int]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the store, and where."""

    run: str
    generation: int | None
    what: str
    kind: str = DAMAGE  # or PIECES

    def __str__(self) -> str:
        where = self.run if self.generation is None else f"{self.run}@{self.generation}"
        return f"{where}: {self.what}"


@dataclass
class VerifyReport:
    """What a verify looked at and what it found."""

    runs: int = 0
    generations: int = 0
    objects: int = 0
    chunks: int = 0
    chunks_hashed: int = 0
    deep: bool = False
    sample: float | None = None  # the fraction of chunks re-hashed, when sampling
    problems: list[Problem] = field(default_factory=list)
    # Chunks (each use by an entry) whose recorded pieces were compared with their own,
    # and those that could not be: castore.format._b3tree is not built here.
    pieces_checked: int = 0
    pieces_unchecked: int = 0
    # Generations a fast tier lists with their chunks in another tier (castore.tiers):
    # their manifests are checked, their chunks are not looked for here.
    held_elsewhere: list[tuple[str, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged_generations(self) -> list[tuple[str, int | None]]:
        """The generations with a problem of kind DAMAGE (the store lacks or holds wrong
        what they name)."""
        return self._generations(DAMAGE)

    @property
    def pieces_generations(self) -> list[tuple[str, int | None]]:
        """The generations whose entries record chunk pieces that are not their chunks'
        own (kind PIECES: nothing is lost)."""
        return self._generations(PIECES)

    def _generations(self, kind: str) -> list[tuple[str, int | None]]:
        return sorted({(p.run, p.generation) for p in self.problems if p.kind == kind}, key=str)


class _ChunkStatus:
    """Per-store cache: each chunk is checked (or re-hashed) once."""

    def __init__(self, store: Store, deep: bool, sample: float | None = None) -> None:
        self.store = store
        self.deep = deep or sample is not None
        self.sample = sample
        self.random = random.Random()
        self.hashed = 0
        # "ok", "missing", "damaged", or what truncated_chunks says ("truncated: ...")
        self.status: dict[bytes, str] = {}
        self.lengths: dict[bytes, int] = {}  # of each chunk re-hashed intact
        # Of each chunk re-hashed intact that is longer than a piece: the digest of its
        # pieces' chaining values (absent without castore.format._b3tree).
        self.piece_digests: dict[bytes, bytes] = {}
        self.sizes: dict[bytes, int] = {}  # what each chunk counts on the bar
        self.bar: Bar = NO_BAR

    def start_bar(self, progress: bool, planned: list[Users]) -> Bar:
        """A bar of the bytes of every distinct chunk of every generation to check."""
        if progress_wanted(progress):
            for users in planned:
                for chunk, (entry, index) in users.items():
                    if chunk not in self.sizes:
                        self.sizes[chunk] = expected_length(entry, index)
        desc = "verify (re-hash)" if self.deep else "verify"
        self.bar = progress_bar(progress, desc, sum(self.sizes.values()))
        return self.bar

    def _settle(self, verdicts: dict[bytes, str]) -> None:
        """Record verdicts of chunks not checked before; the bar counts each chunk once."""
        self.status.update(verdicts)
        if self.bar and verdicts:
            self.bar.update(sum(self.sizes.get(key, 0) for key in verdicts))

    def check(self, digests: Users) -> None:
        todo = [d for d in digests if d not in self.status]
        present = self.store.backend.has_many(Namespace.CHUNKS, todo)
        self._settle({d: "missing" for d, found in zip(todo, present, strict=True) if not found})
        hashed = [d for d, found in zip(todo, present, strict=True) if found]
        # Indexed is not enough: the pack must reach as far as the index says (one stat
        # per pack), or a load finds the chunk cut short. Hashing those would say only
        # "damaged"; this says why.
        cut = self.store.backend.truncated_chunks(hashed) if hashed else {}
        self._settle(cut)
        hashed = [d for d in hashed if d not in cut]
        if not self.deep:
            self._settle(dict.fromkeys(hashed, "ok"))
            return
        if self.sample is not None:
            chosen = [d for d in hashed if self.random.random() < self.sample]
            self._settle(dict.fromkeys(set(hashed) - set(chosen), "ok"))
            hashed = chosen
        self.hashed += len(hashed)
        for start in range(0, len(hashed), _DEEP_BATCH):
            self._rehash(hashed[start : start + _DEEP_BATCH])

    def _rehash(self, keys: list[bytes]) -> None:
        def one(key: bytes, value: memoryview | None) -> tuple[str, int, bytes]:
            if value is None:
                return "missing", 0, b""
            length, cvs = held_hashed(key, value, hash_chunk)
            if length is None:
                return "damaged", len(value), b""
            return "ok", length, digest_here(cvs) if cvs else b""

        def visit(values: Iterator[memoryview | None]) -> None:
            pool = shared_pool()
            futures = [pool.submit(one, k, v) for k, v in zip(keys, values, strict=True)]
            wait(futures)  # every worker is done before the transaction ends
            verdicts = {key: f.result() for key, f in zip(keys, futures, strict=True)}
            self.lengths.update((k, n) for k, (v, n, _) in verdicts.items() if v == "ok")
            self.piece_digests.update((k, c) for k, (v, _, c) in verdicts.items() if c)
            self._settle({key: verdict for key, (verdict, _, _) in verdicts.items()})

        self.store.backend.read_many(Namespace.CHUNKS, keys, visit)


def verify_store(
    store: Store,
    *,
    run: str | None = None,
    generation: int | str | None = None,
    deep: bool = False,
    progress: bool = False,
    sample: float | None = None,
) -> VerifyReport:
    """Check ``run`` (or every run), one generation or all of them.

    ``sample`` (a fraction in (0, 1]) re-hashes that random share of the
    chunks instead of all of them: a cheap periodic check. A ``run`` or
    ``generation`` that does not exist raises GenerationNotFoundError, as
    everywhere else; one that exists but cannot be read is a problem reported.
    """
    if sample is not None and not 0 < sample <= 1:
        raise ValueError(f"sample must be a fraction in (0, 1], got {sample!r}")
    if run is not None:
        _check_target(store, run, generation)
    report = VerifyReport(deep=deep or sample is not None, sample=sample)
    chunks = _ChunkStatus(store, deep, sample)
    if deep:  # first: a damaged LMDB file is reported before its trees are walked
        _check_index(store, report)
    # Every generation's structure first, so the bar's total is known before any chunk.
    planned = _check_structures(store, run, generation, report)
    # Each generation's chunk problems go right after its structural ones.
    structural, taken = report.problems, 0
    merged: list[Problem] = []
    with chunks.start_bar(progress, [users for _, users, _, _ in planned]):
        for root, users, recording, at in planned:
            merged += structural[taken:at]
            taken = at
            merged += _check_chunks(root, users, chunks)
            merged += _check_pieces(root, recording, chunks, report)
    report.problems = merged + structural[taken:]
    report.chunks = len(chunks.status)
    report.chunks_hashed = chunks.hashed
    return report


def _check_target(store: Store, run: str, generation: int | str | None) -> None:
    """Raise for a target that does not exist; leave one that exists but is damaged."""
    validate_run_name(run)
    if run not in store.runs():
        raise unknown_run(store, run)
    if generation is not None:
        try:
            store.resolve_root(run, generation)
        except GenerationNotFoundError:
            raise
        except CastoreError:
            pass  # damage: reported as a problem by the checks


def _check_structures(
    store: Store, run: str | None, generation: int | str | None, report: VerifyReport
) -> list[Planned]:
    """Each readable generation, its chunks, the entries that record chunk pieces, and how
    many problems were found up to it."""
    planned: list[Planned] = []
    for name in [run] if run is not None else store.runs():
        report.runs += 1
        _check_reflog(store, name, report)
        for digest, root in _roots(store, name, generation, report):
            checked = _check_structure(store, root, report)
            if checked is None:
                continue
            users, recording = checked
            held = _held_shards(store, root, digest, report)
            if held is not None:
                report.held_elsewhere.append((root.run, root.generation))
                users = _users_of_shards(store, root, users, held)
                if not users:
                    continue
            planned.append((root, users, recording, len(report.problems)))
    return planned


def _held_shards(
    store: Store, root: GenerationRoot, digest: Digest, report: VerifyReport
) -> set[int] | None:
    """The shards this store holds of a generation whose chunks are partly or wholly in
    another tier or on other nodes, by its record (None: held whole, no record)."""
    if not isinstance(store.path, Path):
        return None  # a store on blobs is never a fast tier
    try:
        held = held_shards(store.path, root.run, root.generation, digest)
    except CastoreError as exc:
        report.problems.append(Problem(root.run, root.generation, f"{type(exc).__name__}: {exc}"))
        return None
    if held is not None and held >= set(range(len(root.shards))):
        return None  # every shard: nothing is elsewhere
    return held


def _users_of_shards(store: Store, root: GenerationRoot, users: Users, held: set[int]) -> Users:
    """The chunks of ``users`` that the shards ``held`` name: what this store must hold."""
    if not held:
        return {}
    shards = store.read_shards(root)
    named = {
        chunk
        for index in held
        if index < len(shards)
        for entry in shards[index].tensors + shards[index].local_tensors
        for chunk in entry.chunks
    }
    return {chunk: use for chunk, use in users.items() if chunk in named}


def _check_reflog(store: Store, run: str, report: VerifyReport) -> None:
    """Damaged reflog lines are damage: gc refuses to run past them, so verify names them."""
    try:
        _, damaged = store.refs.read_reflog(run)
    except CastoreError as exc:
        report.problems.append(Problem(run, None, f"reflog: {type(exc).__name__}: {exc}"))
        return
    if damaged:
        report.problems.append(
            Problem(
                run,
                None,
                f"reflog {store.refs.reflog_location(run)} has {len(damaged)} damaged "
                f"line(s) {damaged[:10]}: complete but failing their checksum or not a "
                "castore record",
            )
        )
    try:
        disagreement = store.refs.reflog_index_problem(run)  # the derived index lookups use
    except CastoreError as exc:
        disagreement = f"reflog index: {type(exc).__name__}: {exc}"
    if disagreement is not None:
        report.problems.append(Problem(run, None, disagreement))


STORE = "(store)"  # the Problem.run of damage that belongs to no run


def _check_index(store: Store, report: VerifyReport) -> None:
    """The chunk index against the packs, and the LMDB file's pages: store-level problems."""
    try:
        check = store.backend.check_index(hash_bytes=False)  # the chunks were just re-hashed
    except CastoreError as exc:
        report.problems.append(Problem(STORE, None, f"{type(exc).__name__}: {exc}"))
        return
    report.problems.extend(Problem(STORE, None, f"chunk index: {p}") for p in check.problems)


def _roots(
    store: Store, run: str, generation: int | str | None, report: VerifyReport
) -> list[tuple[Digest, GenerationRoot]]:
    """The generations to check; one that cannot be read is a problem, not a stop."""
    found: list[tuple[Digest, GenerationRoot]] = []
    if generation is not None:
        try:
            found.append(store.resolve_root(run, generation))
        except CastoreError as exc:
            report.problems.append(Problem(run, None, f"{type(exc).__name__}: {exc}"))
        return found
    try:
        store.resolve_root(run, "latest")  # checks the ref against its root
    except CastoreError as exc:
        report.problems.append(Problem(run, None, f"{type(exc).__name__}: {exc}"))
    try:
        candidates = store.candidates(run)
    except CastoreError as exc:
        report.problems.append(Problem(run, None, f"{type(exc).__name__}: {exc}"))
        return found
    _, collected = store.logged(run)
    queue: list[tuple[int | None, Digest]] = list(candidates)
    seen: set[bytes] = set()
    while queue:
        gen_id, digest = queue.pop(0)
        if digest.raw in seen:
            continue
        seen.add(digest.raw)
        try:
            root = store.read_root(digest, run=run)
        except CastoreError as exc:
            report.generations += 1
            report.problems.append(Problem(run, gen_id, f"root: {type(exc).__name__}: {exc}"))
            continue
        found.append((digest, root))
        if root.parent is not None and root.parent.hex() not in collected:
            queue.append((None, Digest(root.parent)))
    return sorted(found, key=lambda item: -item[1].generation)


def _check_structure(
    store: Store, root: GenerationRoot, report: VerifyReport
) -> tuple[Users, list[TensorEntry]] | None:
    """Check a generation's manifests; its chunks and the entries naming them, and the
    entries that record chunk pieces (None: unreadable)."""
    report.generations += 1
    report.objects += 1 + len(root.shards)
    problems = report.problems
    where = {"run": root.run, "generation": root.generation}
    try:
        shards = store.read_shards(root)
        entries = store.tensor_entries(root, shards)
        if root.metadata:
            decode_tree(root.metadata)  # listings decode it: it must decode here too
        for shard in shards:  # a load decodes every rank's values: so must verify
            check_rank_local(shard, where)
        referenced = {name for name, _ in tensor_names(root.state)}
        for name in sorted(referenced - entries.keys()):
            problems.append(
                Problem(root.run, root.generation, f"tensor {name!r} has no shard entry")
            )
        for boxes in entries.values():
            check_coverage(boxes, where)
        for entry in root.whole:  # the root's copies: a restore may read them instead
            if entries.get(entry.name) != [entry]:
                problems.append(
                    Problem(
                        root.run,
                        root.generation,
                        f"the root's entry of tensor {entry.name!r} is not the shards' entry",
                    )
                )
    except CastoreError as exc:
        problems.append(Problem(root.run, root.generation, f"{type(exc).__name__}: {exc}"))
        return None
    users: Users = {}
    per_rank = [entry for shard in shards for entry in shard.local_tensors]
    every = [e for boxes in entries.values() for e in boxes] + per_rank
    for entry in every:
        for index, chunk in enumerate(entry.chunks):
            first = users.setdefault(chunk, (entry, index))
            # A load checks each use's length (chunkread.verify_chunk); verify re-hashes a
            # chunk once and checks its length against the first use: all uses must agree.
            if expected_length(entry, index) != expected_length(*first):
                problems.append(
                    Problem(
                        root.run,
                        root.generation,
                        f"chunk {index} of tensor {entry.name!r} ({chunk.hex()[:16]}) is named "
                        f"with {expected_length(entry, index)} bytes, and with "
                        f"{expected_length(*first)} as chunk {first[1]} of {first[0].name!r}",
                    )
                )
    return users, [entry for entry in every if entry.pieces]


def _check_chunks(root: GenerationRoot, users: Users, chunks: _ChunkStatus) -> list[Problem]:
    """The problems of a generation's chunks (each chunk checked once per store)."""
    problems: list[Problem] = []
    try:
        chunks.check(users)
    except CastoreError as exc:  # a damaged index page: these chunks cannot be looked up
        return [Problem(root.run, root.generation, f"{type(exc).__name__}: {exc}")]
    for chunk, (entry, index) in users.items():
        verdict = chunks.status.get(chunk, "ok")
        length = chunks.lengths.get(chunk)
        if verdict == "ok" and length is not None and length != expected_length(entry, index):
            # Its bytes match its name but not the entry: a load refuses it as damaged.
            verdict = f"{length} bytes where its entry expects {expected_length(entry, index)}"
        if verdict != "ok":
            problems.append(
                Problem(
                    root.run,
                    root.generation,
                    f"chunk {index} of tensor {entry.name!r} is {verdict} ({chunk.hex()[:16]})",
                )
            )
    return problems


def _check_pieces(
    root: GenerationRoot, recording: list[TensorEntry], chunks: _ChunkStatus, report: VerifyReport
) -> list[Problem]:
    """Each recorded chunk pieces' value against the chunk's own, for the chunks re-hashed
    intact (a chunk missing or damaged is reported as such; one not sampled is skipped)."""
    problems: list[Problem] = []
    for entry in recording:
        ends = piece_ends(entry)
        if int(ends[-1]) != len(entry.pieces):
            what = (
                f"tensor {entry.name!r} records {len(entry.pieces)} bytes of chunk pieces "
                f"where its chunks have {int(ends[-1])}"
            )
            problems.append(_pieces_problem(root, what))
            continue
        for index, chunk in enumerate(entry.chunks):
            start, end = int(ends[index]), int(ends[index + 1])
            # Only chunks re-hashed intact, of the length the entry names (a chunk of
            # another length is reported by _check_chunks).
            if end == start or chunks.lengths.get(chunk) != expected_length(entry, index):
                continue
            own = chunks.piece_digests.get(chunk)
            if own is None:
                report.pieces_unchecked += 1  # hashed without castore.format._b3tree
                continue
            report.pieces_checked += 1
            if digest_here(entry.pieces[start:end]) != own:
                what = (
                    f"chunk {index} of tensor {entry.name!r} ({chunk.hex()[:16]}) records "
                    f"{(end - start) // CV_SIZE} piece values that are not its own"
                )
                problems.append(_pieces_problem(root, what))
    return problems


def _pieces_problem(root: GenerationRoot, what: str) -> Problem:
    return Problem(
        root.run,
        root.generation,
        f"wrong chunk pieces: {what} (a writer's fault; its chunks are intact and reads "
        "verify them whole)",
        PIECES,
    )
