"""Proving an export bitwise the generation its statement names: ``castore verify-export``.

An export written with a statement (castore.format.statement) names its files'
sha256 digests and the generation root they came from. Verifying it reads each
file once, front to back, in blocks; each block is hashed with sha256 on a
thread of its own (the statement's digest) while this thread checks the same
bytes against the store:

- the safetensors header must be byte for byte the one the export of that
  generation, with the options the statement records, writes;
- every tensor kept in its saved dtype is cut where its saved chunks lie in
  the file, and each chunk's bytes must hash (blake3) to the chunk's name, the
  digest the generation's manifests give: no chunk is read from the store. A
  chunk of a box that is not whole rows lies in several runs of the file: its
  runs are hashed in order as the blocks pass;
- a tensor converted by the export (``--dtype``) is compared with its saved
  chunks, read from the store (verified as every read is) and converted as the
  export converts them;
- the index, when there is one, must be the bytes the export writes.

The root is read by its digest and must record the run, id and step the
statement gives; the directory must hold exactly the statement's files (the
statement and a ``model.sig`` beside them aside). Any difference raises
:class:`~castore.errors.ExportMismatchError` naming the file and the tensor;
a malformed statement raises :class:`~castore.errors.StatementError`.
"""

from __future__ import annotations

import hashlib
import os
import stat
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from castore.errors import (
    CorruptObjectError,
    ExportMismatchError,
    GenerationNotFoundError,
    ObjectMissingError,
    StatementError,
    TensorNotFoundError,
)
from castore.export import (
    DEFAULT_BUFFER_SIZE,
    ExportTensor,
    header_bytes,
    index_bytes,
    parse_renames,
    read_stripe,
    saved_tensors,
    select_tensors,
    stripes,
    target_dtype,
)
from castore.format import dtypes
from castore.format.hashing import Digest, digest_here, hasher_here
from castore.format.objects import TYPE_ROOT, GenerationRoot, TensorEntry
from castore.format.statement import (
    IGNORED,
    MAX_STATEMENT_BYTES,
    STATEMENT_FILE,
    Statement,
    parse_statement,
)
from castore.repo.records import validate_run_name
from castore.store import Store
from castore.support.progress import NO_BAR, Bar, progress_bar

BLOCK_SIZE = 16 << 20


@dataclass
class FileCheck:
    """One verified file: its bytes, tensors, the chunks hashed in place and the tensors
    compared converted (exported with ``--dtype``)."""

    name: str
    bytes: int
    tensors: int = 0
    chunks: int = 0
    converted: int = 0


@dataclass
class ExportCheck:
    """A verified export: the generation it is (root, run, id, step), whether the run's
    history still lists that root, and each file checked."""

    out_dir: Path
    root: str
    run: str
    generation: int
    step: int
    published: bool
    files: list[FileCheck] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)


def verify_export(
    out_dir: Path | str,
    store: Store,
    *,
    progress: bool = False,
    block_size: int = BLOCK_SIZE,
) -> ExportCheck:
    """Prove that ``out_dir`` is bitwise the export of the generation its statement names.

    Raises StatementError (no statement, or a malformed one), GenerationNotFoundError
    (``store`` does not hold the root it names) or ExportMismatchError (a file missing,
    added or different: the message names the file and the tensor); returns the
    check when every file is what the generation gives.
    """
    out_dir = Path(out_dir)
    statement = read_statement(out_dir)
    root = held_root(store, statement)
    where: dict[str, Any] = {"run": root.run, "generation": root.generation}
    files = planned_files(store, root, statement, where)
    check_listing(out_dir, statement)
    check = ExportCheck(
        out_dir,
        statement.root,
        root.run,
        root.generation,
        root.step,
        statement.root in store.published(root.run, tolerate_bad_ref=True),
    )
    total = sum(len(header_bytes(g)) + sum(t.nbytes for t in g) for g in files.values())
    with progress_bar(progress, "verify", total) as bar:
        for name in sorted(statement.digests):
            want = statement.digests[name]
            if name == statement.index:
                check.files.append(check_index(out_dir / name, index_bytes(files), want))
            else:
                group = files[name]
                check.files.append(
                    check_file(store, out_dir / name, group, want, where, block_size, bar)
                )
    return check


# -- the statement and the generation it names -----------------------------------------


def read_statement(out_dir: Path) -> Statement:
    path = out_dir / STATEMENT_FILE
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise StatementError(
            f"no statement {STATEMENT_FILE} in {out_dir}: export with --statement"
        ) from None
    except OSError as exc:
        raise StatementError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StatementError(f"{path} is not a regular file")
        data = handle.read(MAX_STATEMENT_BYTES + 1)
    return parse_statement(data, str(path))


def held_root(store: Store, statement: Statement) -> GenerationRoot:
    """The root the statement names, read by its digest, recording what the statement says."""
    validate_run_name(statement.run)
    named = f"{statement.run}@{statement.generation}"
    try:
        root: GenerationRoot = store.read_object(
            Digest.from_hex(statement.root).raw, expect=TYPE_ROOT, run=statement.run
        )
    except ObjectMissingError:
        raise GenerationNotFoundError(
            f"the store does not hold root {statement.root[:12]}, the generation the "
            f"statement names ({named}): verify against the store it was exported from, "
            "or a copy of it"
        ) from None
    except CorruptObjectError as exc:  # an object, but not a root
        raise ExportMismatchError(f"the statement's root {statement.root[:12]}: {exc}") from None
    recorded = (root.run, root.generation, root.step)
    if recorded != (statement.run, statement.generation, statement.step):
        raise ExportMismatchError(
            f"the statement says root {statement.root[:12]} is {named} at step "
            f"{statement.step}; the root records {root.run}@{root.generation} at step {root.step}"
        )
    return root


def planned_files(
    store: Store, root: GenerationRoot, statement: Statement, where: dict[str, Any]
) -> dict[str, list[ExportTensor]]:
    """Each file's tensors as the export of ``root`` with the statement's options names,
    chooses and converts them, in the order the statement lists them."""
    options = statement.options
    try:
        tensors = select_tensors(
            saved_tensors(store, root),
            prefix=options.prefix,
            strip_prefix=options.strip_prefix,
            renames=parse_renames(options.rename),
            dtype=target_dtype(options.dtype),
            where=where,
        )
    except (ValueError, TensorNotFoundError) as exc:
        raise StatementError(f"the statement's export options do not apply: {exc}") from None
    by_name = {t.name: t for t in tensors}
    files: dict[str, list[ExportTensor]] = {}
    for listed in statement.files:
        group = files[listed.name] = []
        for name in listed.tensors:
            tensor = by_name.pop(name, None)
            if tensor is None:
                raise ExportMismatchError(
                    f"the statement puts tensor {name!r} in {listed.name}, but the export "
                    "of the generation has no such tensor (or lists it twice)",
                    file=listed.name,
                    tensor=name,
                    **where,
                )
            group.append(tensor)
    if by_name:
        name = sorted(by_name)[0]
        raise ExportMismatchError(
            f"the export of the generation holds tensor {name!r}, which no file of the "
            f"statement lists ({len(by_name)} such)",
            tensor=name,
            **where,
        )
    return files


def check_listing(out_dir: Path, statement: Statement) -> None:
    """The directory holds the statement's files, each a regular file, and nothing else."""
    present = {entry.name: entry for entry in os.scandir(out_dir)}
    for name in sorted(statement.digests):
        entry = present.get(name)
        if entry is None:
            raise ExportMismatchError(
                f"{name}, which the statement names, is missing from {out_dir}", file=name
            )
        if not entry.is_file(follow_symlinks=False):
            raise ExportMismatchError(f"{out_dir / name} is not a regular file", file=name)
    extra = sorted(set(present) - set(statement.digests) - set(IGNORED))
    if extra:
        raise ExportMismatchError(
            f"{extra[0]} is in {out_dir} but not in its statement (a file added)", file=extra[0]
        )


# -- checking one file -------------------------------------------------------------------


class _Region(Protocol):
    def feed(self, at: int, view: memoryview) -> None:
        """Check ``view``, the region's bytes from ``at`` on (each byte once, in order)."""


def check_index(path: Path, expected: bytes, want: str) -> FileCheck:
    with open(path, "rb") as handle:
        data = handle.read(len(expected) + 1)
    if data != expected:
        raise ExportMismatchError(f"{path.name} is not the index the export writes", file=path.name)
    if hashlib.sha256(data).hexdigest() != want:
        raise ExportMismatchError(f"{path.name}'s sha256 is not the statement's", file=path.name)
    return FileCheck(path.name, len(data))


def check_file(
    store: Store,
    path: Path,
    tensors: list[ExportTensor],
    want: str,
    where: dict[str, Any],
    block_size: int,
    bar: Bar = NO_BAR,
) -> FileCheck:
    """Read ``path`` once: sha256 over it on a second thread, and every region checked."""
    name = path.name
    header = header_bytes(tensors)
    check = FileCheck(name, len(header), len(tensors))
    regions: list[tuple[int, int, _Region]] = [(0, len(header), _Bytes(header, name))]
    for tensor in tensors:
        start = check.bytes
        check.bytes += tensor.nbytes
        if tensor.nbytes == 0:
            continue
        if tensor.dtype == tensor.boxes[0].dtype:
            chunks = _Chunks(tensor, start, name, where)
            check.chunks += len(chunks.digests)
            regions.append((start, check.bytes, chunks))
        else:
            check.converted += 1
            regions.append((start, check.bytes, _Converted(store, tensor, name, where)))
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        size = os.fstat(fd).st_size
        if size != check.bytes:
            raise ExportMismatchError(
                f"{name} is {size} bytes; the export of the generation is {check.bytes}",
                file=name,
                **where,
            )
        got = _read_once(fd, check.bytes, regions, block_size, name, bar)
    finally:
        os.close(fd)
    if got != want:
        raise ExportMismatchError(
            f"{name}'s sha256 is {got[:16]}…, the statement says {want[:16]}… (its bytes "
            "are the generation's: the statement is not this export's)",
            file=name,
        )
    return check


def _read_once(
    fd: int,
    size: int,
    regions: list[tuple[int, int, _Region]],
    block_size: int,
    name: str,
    bar: Bar,
) -> str:
    """Read the file in blocks into two buffers by turns: sha256 hashes block N on its
    thread while block N+1 is read and both are checked here; the sha256 hex digest."""
    sha = hashlib.sha256()
    buffers = [np.empty(min(block_size, size), dtype=np.uint8) for _ in range(2)]
    pending: Future[None] | None = None
    at, turn, first = 0, 0, 0
    with ThreadPoolExecutor(1, thread_name_prefix="castore-sha256") as thread:
        try:
            while at < size:
                view = memoryview(buffers[turn].data)[: min(block_size, size - at)]
                _read_fully(fd, view, at, name)
                if pending is not None:
                    pending.result()  # the other buffer is free again
                pending = thread.submit(sha.update, view)
                end = at + len(view)
                while first < len(regions) and regions[first][1] <= at:
                    first += 1
                for start, stop, region in regions[first:]:
                    if start >= end:
                        break
                    lo, hi = max(start, at), min(stop, end)
                    region.feed(lo - start, view[lo - at : hi - at])
                bar.update(len(view))
                at, turn = end, turn ^ 1
        finally:
            if pending is not None:
                pending.result()
    return sha.hexdigest()


def _read_fully(fd: int, view: memoryview, at: int, name: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], at + done)
        if got == 0:
            raise ExportMismatchError(f"{name} ended at byte {at + done} while read", file=name)
        done += got


class _Bytes:
    """A region that must be these exact bytes (the header)."""

    def __init__(self, expected: bytes, file: str) -> None:
        self.expected = np.frombuffer(expected, dtype=np.uint8)
        self.file = file

    def feed(self, at: int, view: memoryview) -> None:
        got = np.frombuffer(view, dtype=np.uint8)
        if not np.array_equal(got, self.expected[at : at + len(got)]):
            raise ExportMismatchError(
                f"{self.file}'s safetensors header is not the one the export of the "
                "generation writes (names, dtypes, shapes or offsets differ)",
                file=self.file,
            )


def box_runs(entry: TensorEntry) -> tuple[int, np.ndarray]:
    """Where a box's row-major bytes lie in its tensor's: runs of equal length (returned),
    starting at the offsets returned (int64), in the box's order."""
    shape, local, offsets = entry.shape, entry.local_shape, entry.offsets
    itemsize = dtypes.numpy_dtype(entry.dtype).itemsize
    last = len(shape) - 1
    while last >= 0 and local[last] == shape[last]:
        last -= 1
    if last < 0:  # the whole tensor (or a 0-d one)
        return entry.nbytes, np.zeros(1, dtype=np.int64)
    strides = [itemsize * int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(len(shape))]
    starts = np.array([sum(offsets[d] * strides[d] for d in range(last + 1))], dtype=np.int64)
    for dim in range(last):  # each index of the dimensions before the last partial one
        steps = np.arange(local[dim], dtype=np.int64) * strides[dim]
        starts = (starts[:, None] + steps[None, :]).ravel()
    return local[last] * strides[last], starts


class _Chunks:
    """A tensor kept in its saved dtype: each saved chunk's bytes, where they lie in the
    file, must hash to the chunk's name."""

    def __init__(self, tensor: ExportTensor, offset: int, file: str, where: dict[str, Any]) -> None:
        self.tensor, self.offset, self.file, self.where = tensor, offset, file, where
        self.digests: list[bytes] = []
        self.lengths: list[int] = []
        parts = [self._segments(entry) for entry in tensor.boxes if entry.nbytes]
        starts, lengths, chunks = (np.concatenate(p) for p in zip(*parts, strict=True))
        order = np.argsort(starts, kind="stable")
        self.starts: list[int] = starts[order].tolist()
        self.ends: list[int] = (starts[order] + lengths[order]).tolist()
        self.chunk: list[int] = chunks[order].tolist()
        pieces = np.bincount(chunks, minlength=len(self.digests))
        self.whole: list[bool] = (pieces == 1).tolist()
        self.left = list(self.lengths)
        self.hashers: dict[int, Any] = {}
        self.next = 0

    def _segments(self, entry: TensorEntry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start in the tensor, length, chunk number) of each piece of the box's chunks."""
        first = len(self.digests)
        self.digests += entry.chunks
        ends = [*entry.chunk_starts.tolist()[1:], entry.nbytes]
        self.lengths += [b - a for a, b in zip(entry.chunk_starts.tolist(), ends, strict=True)]
        run, run_starts = box_runs(entry)
        cuts = np.union1d(entry.chunk_starts, np.arange(0, entry.nbytes, run, dtype=np.int64))
        lengths = np.diff(np.append(cuts, entry.nbytes))
        chunk = np.searchsorted(entry.chunk_starts, cuts, side="right") - 1 + first
        starts = run_starts[cuts // run] + cuts % run
        return starts, lengths, chunk

    def feed(self, at: int, view: memoryview) -> None:
        end = at + len(view)
        i = self.next
        while i < len(self.starts) and self.starts[i] < end:
            lo, hi, chunk = max(self.starts[i], at), min(self.ends[i], end), self.chunk[i]
            piece = view[lo - at : hi - at]
            if self.whole[chunk] and hi - lo == self.lengths[chunk]:
                self._check(chunk, digest_here(piece))
            else:
                hasher = self.hashers.get(chunk)
                if hasher is None:
                    hasher = self.hashers[chunk] = hasher_here()
                hasher.update(piece)
                self.left[chunk] -= hi - lo
                if self.left[chunk] == 0:
                    self._check(chunk, self.hashers.pop(chunk).digest())
            if hi < self.ends[i]:
                break  # the piece goes on in the next block
            i += 1
        self.next = i

    def _check(self, chunk: int, got: bytes) -> None:
        if got != self.digests[chunk]:
            name = self.tensor.name
            start = self.offset + self.starts[self.chunk.index(chunk)]
            raise ExportMismatchError(
                f"{self.file}: tensor {name!r} differs from the generation: its bytes from "
                f"file offset {start} on do not hash to saved chunk "
                f"{self.digests[chunk].hex()[:12]}",
                file=self.file,
                tensor=name,
                **self.where,
            )


class _Converted:
    """A tensor the export converted (``--dtype``): compared with its saved stripes, read
    from the store and converted the same way."""

    def __init__(
        self, store: Store, tensor: ExportTensor, file: str, where: dict[str, Any]
    ) -> None:
        self.store, self.tensor, self.file, self.where = store, tensor, file, where
        saved = dtypes.numpy_dtype(tensor.boxes[0].dtype)
        itemsize = max(saved.itemsize, dtypes.numpy_dtype(tensor.dtype).itemsize)
        self.stripes = stripes(tensor.shape, itemsize, DEFAULT_BUFFER_SIZE)
        self.scratch = np.empty(0, dtype=np.uint8)
        self.expected = np.empty(0, dtype=np.uint8)
        self.base = 0  # where ``expected`` starts in the tensor's bytes

    def _next_stripe(self) -> None:
        stripe = next(self.stripes)
        saved = dtypes.numpy_dtype(self.tensor.boxes[0].dtype)
        if self.scratch.nbytes < stripe.numel * saved.itemsize:
            self.scratch = np.empty(stripe.numel * saved.itemsize, dtype=np.uint8)
        data = read_stripe(self.store, self.tensor, stripe, self.where, self.scratch)
        converted = np.ascontiguousarray(data.astype(dtypes.numpy_dtype(self.tensor.dtype)))
        self.base += self.expected.nbytes
        self.expected = converted.reshape(-1).view(np.uint8)

    def feed(self, at: int, view: memoryview) -> None:
        got = np.frombuffer(view, dtype=np.uint8)
        while got.size:
            if at >= self.base + self.expected.nbytes:
                self._next_stripe()
            off = at - self.base
            take = min(got.size, self.expected.nbytes - off)
            if not np.array_equal(got[:take], self.expected[off : off + take]):
                raise ExportMismatchError(
                    f"{self.file}: tensor {self.tensor.name!r} differs from the generation's, "
                    f"converted to {self.tensor.dtype} as the export converts it",
                    file=self.file,
                    tensor=self.tensor.name,
                    **self.where,
                )
            got, at = got[take:], at + take
