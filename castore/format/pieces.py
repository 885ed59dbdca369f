"""Chunk pieces: a read of part of a chunk verifies only the 64 KiB pieces it reads.

blake3 is a tree over 1 KiB chunks of its input. In a chunk longer than one
piece (``PIECE``, 64 KiB), every aligned 64 KiB piece, and the short piece at
its end, is a node of that tree, so the chunk's digest (its name) is its
pieces' chaining values merged as blake3 merges them. A save records those
chaining values beside each tensor entry (docs/FORMAT.md, "Chunk pieces"):
a reader that needs bytes [lo, hi) of a chunk checks first that the recorded
values merge to the chunk's name, then hashes only the pieces that hold
[lo, hi) and compares each with its recorded value. Every byte read is still
verified against the name, and a chunk's name is still its blake3 digest.

The chaining values come from castore's extension ``castore.format._b3tree`` (the
BLAKE3 team's C implementation). Where it is not built, saves record no
pieces and reads verify whole chunks, as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from castore.format.hashing import Buffer, digest_bytes

_b3tree: Any
try:
    from castore.format import _b3tree
except ImportError:  # built without the extension (setup.py)
    _b3tree = None

PIECE = 1 << 16
CV_SIZE = 32
# Whether this castore records and checks pieces (castore.format._b3tree is built).
AVAILABLE = _b3tree is not None


def piece_count(length: int) -> int:
    """How many pieces a chunk of ``length`` bytes records: 0 for one of a piece or less."""
    return 0 if length <= PIECE else -(-length // PIECE)


def hash_chunk(view: Buffer) -> tuple[bytes, bytes]:
    """A chunk's digest and its pieces' chaining values, on the calling thread (no GIL).

    The values are empty for a chunk of one piece or less, or without the extension.
    """
    if _b3tree is None or memoryview(view).nbytes <= PIECE:
        return digest_bytes(view, threads=1), b""
    digest, cvs = _b3tree.tree(view)
    return digest, cvs


def chunk_cvs(entry: Any, index: int) -> bytes | None:
    """The recorded chaining values of chunk ``index`` of ``entry``, or None where it has none.

    ``entry.pieces`` holds every chunk's values in chunk order (none for chunks of a
    piece or less); values of the wrong total length are as good as none.
    """
    pieces: bytes = entry.pieces
    if not pieces or _b3tree is None:
        return None
    ends = piece_ends(entry)
    if int(ends[-1]) != len(pieces):
        return None
    start, end = int(ends[index]), int(ends[index + 1])
    return pieces[start:end] if end > start else None


def piece_ends(entry: Any) -> np.ndarray:
    """Where each chunk's values end in ``entry.pieces`` if it records them (int64, one
    more than the chunks, from 0): the last is the length the field must have."""
    ends: np.ndarray | None = entry.__dict__.get("_piece_ends")
    if ends is None:  # computed once per entry, every chunk's length at once
        lengths = np.diff(np.append(entry.chunk_starts, entry.nbytes))
        counts = np.where(lengths > PIECE, -(-lengths // PIECE), 0)
        ends = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64) * CV_SIZE
        entry.__dict__["_piece_ends"] = ends
    return ends


def piece_span(lo: int, hi: int, length: int) -> tuple[int, int]:
    """The byte range of the whole pieces that hold bytes [lo, hi) of a chunk of ``length``."""
    return lo - lo % PIECE, min(length, -(-hi // PIECE) * PIECE)


def names_chunk(cvs: bytes, key: bytes) -> bool:
    """Whether recorded chaining values merge to the chunk's name ``key``."""
    assert _b3tree is not None
    return bool(_b3tree.root(cvs) == key)


def pieces_match(cvs: bytes, data: Buffer, start: int) -> bool:
    """Whether ``data``, a chunk's bytes from ``start`` (a piece boundary) on, whole pieces
    up to the chunk's end or to a piece boundary, hashes to the recorded values there."""
    assert _b3tree is not None
    first = start // PIECE
    view = memoryview(data)
    count = -(-view.nbytes // PIECE)
    found: bytes = _b3tree.piece_cvs(view, first)
    return found == cvs[first * CV_SIZE : (first + count) * CV_SIZE]
