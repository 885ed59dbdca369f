"""The snapshot an async save takes: tensor bytes copied into reused, bounded buffers.

``Store.save(..., blocking=False)`` (and its multi-rank forms) hands the write
to a background thread (:mod:`castore.core.background`), so the caller may change
every tensor as soon as the call returns. Before it returns, the caller copies
the bytes the save needs into *staging buffers*; the writer hashes and writes
them and gives each buffer back.

- **Bounded.** A :class:`StagingPool` never holds more than its limit in
  buffers, in use or free. When a state is larger, the snapshot proceeds in
  pieces as the writer frees buffers, and the caller is held meanwhile.
- **Reused.** A freed buffer goes on a free list by size; the next save of the
  same state finds one of each size it needs, so steady-state saves allocate
  nothing. Buffers of sizes a save did not use are dropped after it.
- **Pieces.** A tensor's bytes are cut into pieces of whole chunks (the last
  may be short), so a piece's chunks are exactly the chunks of the tensor.
- **Changed-chunk staging** (``staging="changed"``): the caller hashes each
  chunk in place and copies only chunks whose digest this store handle did not
  see in its previous save; the others travel as digests alone, and the
  writer checks they are still present before the save may publish.
- **CUDA tensors** are copied into pinned host buffers with non-blocking
  copies; each piece carries an event the writer waits on before reading it.
  They are always staged whole (hashing them needs their bytes on the host).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from castore.core.chunkio import cut_leaf, hashed_in_order, leaf_chunk_starts
from castore.errors import SaveAborted
from castore.format.tree import TensorLeaf
from castore.support.faults import fault_point

# The largest piece: big tensors are staged and handed on this many bytes at a
# time (rounded down to whole chunks), so a writer can start on a tensor early.
PIECE_BYTES = 64 << 20
STAGING_MODES = ("full", "changed")


@dataclass
class StagingBuffer:
    """One host buffer: a numpy view of it, and the pinned torch tensor it is, if pinned.

    ``epoch`` counts the saves that took it from the pool; it changes (under
    ``lock``) before a save writes into it again, so a reader that noted the
    epoch when the bytes were hashed (a promotion sending staged chunks,
    castore.tiers.staged) reads them under ``lock`` while the epoch is the same,
    and knows they are the bytes that were hashed.
    """

    array: np.ndarray
    pinned: Any = None
    epoch: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclass(frozen=True)
class StagedChunk:
    """A chunk a save staged and hashed: its name and its bytes in a staging buffer,
    valid while the buffer's epoch is still ``epoch`` (no later save took it)."""

    digest: bytes
    buffer: StagingBuffer
    epoch: int
    view: memoryview
    dtype: str = ""  # its tensor's (a store that compresses encodes by it)

    def copy_if_intact(self) -> bytes | None:
        """The chunk's bytes, copied out under the buffer's lock, or None once a later
        save took the buffer (its bytes may no longer be the ones hashed)."""
        with self.buffer.lock:
            if self.buffer.epoch != self.epoch:
                return None
            return bytes(self.view)


@dataclass
class Piece:
    """A run of whole chunks of one staged tensor, in order.

    ``buffer`` holds their bytes, or is None when every chunk's digest is known
    and none was copied (changed-chunk staging). ``digests`` are known when the
    caller hashed them; otherwise the writer hashes ``buffer``.
    """

    leaf: int
    nbytes: int
    buffer: StagingBuffer | None = None
    digests: list[bytes] | None = None
    ready: Any = None  # a torch.cuda.Event to wait on before reading ``buffer``
    cuts: list[int] | None = None  # where each chunk starts in ``buffer`` (one chunk: None)
    cvs: list[bytes] | None = None  # with ``digests``: their pieces' values (castore.format.pieces)


class StagingPool:
    """Host buffers for snapshots, reused across saves, never more than ``limit`` bytes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._free: dict[tuple[int, bool], list[StagingBuffer]] = {}
        self._taken: Counter[tuple[int, bool]] = Counter()
        self.limit = 0
        self.allocated = 0  # bytes of every buffer this pool holds, in use or free
        self.peak = 0  # the most ``allocated`` has been since reset_peak
        self.waited = 0.0  # seconds callers of take() spent waiting for a buffer

    def configure(self, limit: int) -> None:
        with self._cond:
            self.limit = limit
            self._drop_free_until(lambda: self.allocated <= limit)

    def reset_peak(self) -> None:
        with self._cond:
            self.peak = self.allocated
            self.waited = 0.0
            self._taken.clear()

    def take(self, nbytes: int, *, pinned: bool, aborted: Callable[[], bool]) -> StagingBuffer:
        """A buffer of exactly ``nbytes``: a free one, a new one, or one freed meanwhile."""
        if nbytes > self.limit:
            raise ValueError(f"a piece of {nbytes} bytes exceeds staging_bytes={self.limit}")
        key = (nbytes, pinned)
        started = time.perf_counter()
        with self._cond:
            while True:
                if aborted():
                    raise SaveAborted("the background write failed while this save was staging")
                free = self._free.get(key)
                if free:
                    buffer = free.pop()
                    break
                self._drop_free_until(lambda: self.allocated + nbytes <= self.limit)
                if self.allocated + nbytes <= self.limit:
                    buffer = _allocate(nbytes, pinned)
                    self.allocated += nbytes
                    self.peak = max(self.peak, self.allocated)
                    break
                self._cond.wait(timeout=0.1)
            self._taken[key] += 1
        with buffer.lock:  # waits for a reader of its last save's bytes (a promotion)
            buffer.epoch += 1
        self.waited += time.perf_counter() - started
        return buffer

    def give(self, buffer: StagingBuffer) -> None:
        with self._cond:
            self._free.setdefault((buffer.nbytes, buffer.pinned is not None), []).append(buffer)
            self._cond.notify_all()

    def trim(self) -> None:
        """Drop free buffers beyond what the last save took of each size."""
        with self._cond:
            for key, free in self._free.items():
                extra = len(free) - self._taken.get(key, 0)
                for _ in range(max(0, extra)):
                    self.allocated -= free.pop().nbytes

    def clear(self) -> None:
        with self._cond:
            for free in self._free.values():
                self.allocated -= sum(buffer.nbytes for buffer in free)
            self._free.clear()

    def _drop_free_until(self, enough: Callable[[], bool]) -> None:
        for free in self._free.values():
            while free and not enough():
                self.allocated -= free.pop().nbytes


def _allocate(nbytes: int, pinned: bool) -> StagingBuffer:
    if not pinned:
        return StagingBuffer(np.empty(nbytes, dtype=np.uint8))
    import torch

    tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return StagingBuffer(tensor.numpy(), tensor)


# -- taking the snapshot --------------------------------------------------------


@dataclass
class Snapshot:
    """What the caller staged: the leaves (bytes now in pieces) and counters."""

    leaves: list[TensorLeaf]
    staged_bytes: int = 0
    hashed_bytes: int = 0
    pieces: int = 0
    seconds: float = 0.0
    seen: set[bytes] = field(default_factory=set)


def piece_bytes(chunk_size: int, limit: int) -> int:
    """Bytes per piece: whole chunks, at most PIECE_BYTES, at most half the bound.

    Half the bound, so the caller fills one piece while the writer drains another.
    """
    whole = max(1, min(PIECE_BYTES, limit // 2) // chunk_size)
    return whole * chunk_size


def stage_leaves(
    leaves: Sequence[TensorLeaf],
    *,
    chunk_size: int,
    pool: StagingPool,
    mode: str,
    known: set[bytes],
    hand: Callable[[Piece], None],
    aborted: Callable[[], bool],
) -> Snapshot:
    """Copy ``leaves``' bytes into staging and hand each piece to the writer, in order.

    ``known``: digests the previous save of this handle stored (changed mode
    skips copying those). Returns the snapshot; ``hand`` has had every piece.
    """
    started = time.perf_counter()
    snapshot = Snapshot(list(leaves))
    step = piece_bytes(chunk_size, pool.limit)
    for index, leaf in enumerate(leaves):
        device = _device_source(leaf)
        if mode == "changed" and device is None:
            _stage_changed(index, leaf, chunk_size, pool, known, hand, aborted, snapshot)
        else:
            _stage_whole(index, leaf, device, step, chunk_size, pool, hand, aborted, snapshot)
        fault_point("async.mid_snapshot")
    snapshot.seconds = time.perf_counter() - started
    return snapshot


def _device_source(leaf: TensorLeaf) -> Any:
    """The flat uint8 device tensor of a leaf deferred off a GPU, else None."""
    return leaf.device_bytes


def _stage_whole(
    index: int,
    leaf: TensorLeaf,
    device: Any,
    step: int,
    chunk_size: int,
    pool: StagingPool,
    hand: Callable[[Piece], None],
    aborted: Callable[[], bool],
    snapshot: Snapshot,
) -> None:
    nbytes = leaf_nbytes(leaf)
    if nbytes == 0:
        hand(Piece(index, 0, None, []))
        return
    for start, end, cuts in whole_pieces(leaf_chunk_starts(leaf, chunk_size), nbytes, step):
        buffer = pool.take(end - start, pinned=device is not None, aborted=aborted)
        ready = None
        if device is None:
            np.copyto(buffer.array, leaf.data[start:end])
        else:
            import torch

            buffer.pinned.copy_(device[start:end], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        snapshot.staged_bytes += end - start
        snapshot.pieces += 1
        hand(Piece(index, end - start, buffer, None, ready, cuts))


def whole_pieces(starts: Any, nbytes: int, step: int) -> list[tuple[int, int, list[int]]]:
    """A tensor's bytes as pieces of whole chunks, each at most ``step`` bytes (or one
    chunk): (start, end, where each chunk starts within the piece)."""
    pieces: list[tuple[int, int, list[int]]] = []
    bounds = [*starts.tolist(), nbytes]
    start, cuts = bounds[0], [0]
    for at, after in zip(bounds[1:-1], bounds[2:], strict=True):
        if after - start > step:  # the next chunk would not fit: close the piece at `at`
            pieces.append((start, at, cuts))
            start, cuts = at, [0]
        else:
            cuts.append(at - start)
    pieces.append((start, nbytes, cuts))
    return pieces


def _stage_changed(
    index: int,
    leaf: TensorLeaf,
    chunk_size: int,
    pool: StagingPool,
    known: set[bytes],
    hand: Callable[[Piece], None],
    aborted: Callable[[], bool],
    snapshot: Snapshot,
) -> None:
    """Hash every chunk in place; copy only those whose digest is not ``known``."""
    views = cut_leaf(leaf, chunk_size)
    if not views:
        hand(Piece(index, 0, None, []))
        return
    unchanged: list[bytes] = []
    unchanged_cvs: list[bytes] = []
    unchanged_bytes = 0
    for view, (digest, cvs) in zip(views, hashed_in_order(views), strict=True):
        snapshot.hashed_bytes += view.nbytes
        snapshot.seen.add(digest)
        if digest in known:
            unchanged.append(digest)
            unchanged_cvs.append(cvs)
            unchanged_bytes += view.nbytes
            continue
        if unchanged:
            hand(Piece(index, unchanged_bytes, None, unchanged, cvs=unchanged_cvs))
            unchanged, unchanged_cvs, unchanged_bytes = [], [], 0
        buffer = pool.take(view.nbytes, pinned=False, aborted=aborted)
        buffer.array[:] = np.frombuffer(view, dtype=np.uint8)
        snapshot.staged_bytes += view.nbytes
        snapshot.pieces += 1
        hand(Piece(index, view.nbytes, buffer, [digest], cvs=[cvs]))
    if unchanged:
        hand(Piece(index, unchanged_bytes, None, unchanged, cvs=unchanged_cvs))


def leaf_nbytes(leaf: TensorLeaf) -> int:
    device = _device_source(leaf)
    return int(device.numel()) if device is not None else int(leaf.data.nbytes)


def state_bytes(leaves: Iterable[TensorLeaf]) -> int:
    return sum(leaf_nbytes(leaf) for leaf in leaves)
