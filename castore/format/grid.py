"""The chunk grid of a tensor: cells in global coordinates, from the tensor alone.

Today a chunk is a byte range of one rank's box, so where chunks start
depends on where the box starts, and the same bytes cut by another rank
count share no chunk (issue 38). A grid derived from the tensor's global
shape, its itemsize and the chunk size alone, never from a box, gives every
rank, job and layout the same cells, so a cell held whole is the same chunk
whoever holds it. The rule and why it was chosen are in docs/design/grid.md.

Pure arithmetic on frozen dataclasses and small numpy arrays: no I/O, no
scan over all cells. :func:`writer_cell` is the grid every save writes
(docs/FORMAT.md, "Chunks"); :func:`box_chunk_starts` is where a box's chunks
start in its own buffer, for writers and readers alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

import numpy as np

from castore.format.layout import Box

# The writer's cell target: about CELLS_PER_TENSOR cells per tensor, never smaller
# than MIN_CELL bytes, never larger than the store's chunk size. Small enough
# that a change of rank count cuts few cells (each cut costs at most one cell),
# large enough that a tensor's chunk count stays bounded (docs/FORMAT.md, "Chunks").
# A tensor that would get fewer than MIN_CELLS cells of MIN_CELL is not cut finer
# than the chunk size: any change of rank count cuts most of its few cells anyway,
# and every chunk costs a save and a load a fixed amount of work.
CELLS_PER_TENSOR = 128
MIN_CELL = 64 << 10
MIN_CELLS = 64
# A format-3 tensor entry's cell dimension that means "no grid": chunks are the
# box's own buffer cut every chunk_size bytes (the format-2 rule).
RUNS = 255
MAX_CELL_BYTES = 1 << 30


@dataclass(frozen=True)
class ChunkGrid:
    """The cells of one tensor: ``cell_shape`` repeated from the origin, clipped at the edge.

    ``counts[d]`` is how many cells lie along dimension ``d``; cells are
    numbered row-major over ``counts``. A 0-d or empty tensor has one cell,
    the whole (possibly empty) tensor.
    """

    shape: tuple[int, ...]
    itemsize: int
    chunk_size: int
    cell_shape: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def cell_count(self) -> int:
        return math.prod(self.counts)


@dataclass(frozen=True)
class CellSpan:
    """The cells a box overlaps: per dimension, the half-open range of cell positions.

    Kept as ranges so a box over millions of cells costs nothing until its
    cells are listed.
    """

    starts: tuple[int, ...]
    stops: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(max(0, b - a) for a, b in zip(self.starts, self.stops, strict=True))


@dataclass(frozen=True)
class CellPart:
    """The part of one cell a box holds, in global coordinates.

    ``whole`` says the box holds every element of the cell: that part is
    stored as the cell's own chunk, the one every holder of the cell shares.
    """

    cell: int
    box: Box
    whole: bool


def chunk_grid(shape: tuple[int, ...], itemsize: int, chunk_size: int) -> ChunkGrid:
    """The grid of a tensor of ``shape`` and ``itemsize`` for chunks of ``chunk_size`` bytes.

    Cells are 1 along the leading dimensions until the slab behind one index
    (the product of the later dimensions times the itemsize) fits in
    ``chunk_size``; along that dimension a cell takes as many indices as fit;
    the later dimensions are whole. So a tensor whose row fits gets bands of
    whole rows, and a wider one is cut along its trailing dimensions.
    """
    if itemsize <= 0 or chunk_size <= 0:
        raise ValueError(f"itemsize {itemsize} and chunk_size {chunk_size} must be positive")
    if any(size < 0 for size in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    cell_shape = _cell_shape(tuple(shape), itemsize, chunk_size)
    if math.prod(shape) == 0:
        counts = (1,) * len(shape)
    else:
        counts = tuple(-(-size // cell) for size, cell in zip(shape, cell_shape, strict=True))
    return ChunkGrid(tuple(shape), itemsize, chunk_size, cell_shape, counts)


def _cell_shape(shape: tuple[int, ...], itemsize: int, chunk_size: int) -> tuple[int, ...]:
    if math.prod(shape) == 0 or not shape:
        return shape  # one empty cell, or the one element of a 0-d tensor
    dim, take = _split(shape, itemsize, chunk_size)
    return (1,) * dim + (take,) + shape[dim + 1 :]


def _split(shape: tuple[int, ...], itemsize: int, chunk_size: int) -> tuple[int, int]:
    """(k, take): cells are 1 before dimension k, ``take`` along it, whole after it."""
    # slab[d]: bytes of one index along dimension d (its later dimensions whole).
    slab = [itemsize * math.prod(shape[d + 1 :]) for d in range(len(shape))]
    for dim, size in enumerate(shape):
        if slab[dim] <= chunk_size or dim == len(shape) - 1:
            # max(1, ..): one element larger than a chunk is its own cell.
            return dim, min(size, max(1, chunk_size // slab[dim]))
    raise AssertionError("the last dimension always returns")


def cell_count(grid: ChunkGrid) -> int:
    """How many cells the tensor has (1 for a 0-d or empty tensor)."""
    return grid.cell_count


def cell_position(grid: ChunkGrid, index: int) -> tuple[int, ...]:
    """The per-dimension position of cell ``index`` (row-major over ``grid.counts``)."""
    if not 0 <= index < grid.cell_count:
        raise IndexError(f"cell {index} of a grid of {grid.cell_count} cells")
    position = []
    for count in reversed(grid.counts):
        index, at = divmod(index, count)
        position.append(at)
    return tuple(reversed(position))


def cell_index(grid: ChunkGrid, position: tuple[int, ...]) -> int:
    """The row-major number of the cell at ``position``."""
    index = 0
    for at, count in zip(position, grid.counts, strict=True):
        index = index * count + at
    return index


def cell_box(grid: ChunkGrid, index: int) -> Box:
    """Cell ``index``'s box in global coordinates (clipped at the tensor's edge)."""
    position = cell_position(grid, index)
    offsets = tuple(at * cell for at, cell in zip(position, grid.cell_shape, strict=True))
    sizes = tuple(
        min(cell, size - offset)
        for cell, size, offset in zip(grid.cell_shape, grid.shape, offsets, strict=True)
    )
    return Box(offsets, sizes)


def cell_nbytes(grid: ChunkGrid, index: int) -> int:
    """The bytes of cell ``index``: the length of its chunk when held whole."""
    return cell_box(grid, index).numel * grid.itemsize


def cells_overlapping(grid: ChunkGrid, box: Box) -> CellSpan:
    """The cells that share at least one element with ``box``, as ranges per dimension.

    An empty box overlaps no cell, so an empty tensor's one cell is never
    stored (as today, a zero-byte tensor has no chunks).
    """
    if len(box.shape) != len(grid.shape):
        raise ValueError(f"box of {len(box.shape)} dimensions on a grid of {len(grid.shape)}")
    if box.numel == 0 and box.shape:
        zeros = (0,) * len(box.shape)
        return CellSpan(zeros, zeros)
    starts = tuple(o // c for o, c in zip(box.offsets, grid.cell_shape, strict=True))
    stops = tuple(-(-hi // c) for hi, c in zip(box.stops, grid.cell_shape, strict=True))
    return CellSpan(starts, stops)


def span_cells(grid: ChunkGrid, span: CellSpan) -> Iterator[int]:
    """The cell numbers in ``span``, ascending (row-major order)."""
    if span.count == 0:
        return
    yield from _walk(grid, span, 0, 0)


def _walk(grid: ChunkGrid, span: CellSpan, dim: int, prefix: int) -> Iterator[int]:
    if dim == len(grid.counts):
        yield prefix
        return
    for at in range(span.starts[dim], span.stops[dim]):
        yield from _walk(grid, span, dim + 1, prefix * grid.counts[dim] + at)


def cell_part(grid: ChunkGrid, index: int, box: Box) -> CellPart | None:
    """The part of cell ``index`` that ``box`` holds, or None when they share no element."""
    cell = cell_box(grid, index)
    if cell.numel == 0 or box.numel == 0:
        return None
    common = cell.intersect(box)
    if common is None:
        return None
    return CellPart(index, common, common == cell)


def cell_parts(grid: ChunkGrid, box: Box) -> tuple[CellPart, ...]:
    """Every part of a cell that ``box`` holds, in cell order: what a rank stores for its box."""
    parts = []
    for index in span_cells(grid, cells_overlapping(grid, box)):
        part = cell_part(grid, index, box)
        if part is not None:  # never None for an overlapping cell; kept for the type
            parts.append(part)
    return tuple(parts)


# -- the grid as a tensor entry records it: (dimension, extent) -------------------------
#
# The cells of :func:`chunk_grid` are 1 along the dimensions before one dimension
# ``k``, ``extent`` along ``k`` and whole after it ("bands"). So the part of a cell any
# box holds is a fixed index along the dimensions before ``k``, a range along ``k`` and
# the box's whole extent after it: one contiguous byte run of the box's own buffer.
# A box's chunks are therefore byte ranges of its buffer, as before the grid, only cut
# where the cells are instead of every chunk_size bytes.


def cell_target(nbytes: int, chunk_size: int) -> int:
    """The cell size (bytes) the writer aims at for a tensor of ``nbytes`` global bytes."""
    if nbytes < MIN_CELLS * MIN_CELL:
        return chunk_size
    return min(chunk_size, max(MIN_CELL, nbytes // CELLS_PER_TENSOR))


@lru_cache(maxsize=4096)
def writer_cell(shape: tuple[int, ...], itemsize: int, chunk_size: int) -> tuple[int, int]:
    """The grid a save writes for a tensor, as (dimension, extent); (0, 1) for a 0-d one.

    Derived from the global shape, the itemsize and the store's chunk size
    alone: every rank and every job cuts the same cells.
    """
    if not shape:
        return (0, 1)
    if 0 in shape:
        return (0, max(1, shape[0]))  # nothing to cut: no box of it has a byte
    target = cell_target(math.prod(shape) * itemsize, chunk_size)
    return _split(tuple(shape), itemsize, target)


def cell_shape_of(shape: tuple[int, ...], cell: tuple[int, int]) -> tuple[int, ...]:
    """The cell shape of the (dimension, extent) grid over ``shape``."""
    if not shape:
        return ()
    dim, extent = cell
    return (1,) * dim + (extent,) + tuple(shape[dim + 1 :])


def cell_problem(shape: tuple[int, ...], itemsize: int, cell: tuple[int, int]) -> str | None:
    """Why (dimension, extent) is not a grid a reader accepts for ``shape``, or None."""
    dim, extent = cell
    if not shape:
        return None if cell == (0, 1) else f"has cell {list(cell)} for a 0-d tensor, not [0, 1]"
    if not 0 <= dim < len(shape):
        return f"has cell dimension {dim} for a tensor of {len(shape)} dimensions"
    if not 1 <= extent <= max(1, shape[dim]):
        return f"has cell extent {extent} along a dimension of {shape[dim]}"
    if extent * math.prod(shape[dim + 1 :]) * itemsize > MAX_CELL_BYTES:
        return f"has cells of more than {MAX_CELL_BYTES} bytes"
    return None


def box_chunk_count(
    offsets: tuple[int, ...], local_shape: tuple[int, ...], cell: tuple[int, int]
) -> int:
    """How many chunks a box stores on the grid: one per cell it overlaps (0 when empty)."""
    if not local_shape:
        return 1
    if 0 in local_shape:
        return 0
    dim, extent = cell
    lo, size = offsets[dim], local_shape[dim]
    return math.prod(local_shape[:dim]) * (-(-(lo + size) // extent) - lo // extent)


# Shared, never written to: a box of one chunk, a box of none.
_ONE_CHUNK = np.zeros(1, dtype=np.int64)
_ONE_CHUNK.flags.writeable = False
_NO_CHUNK = np.zeros(0, dtype=np.int64)
_NO_CHUNK.flags.writeable = False


def box_chunk_starts(
    offsets: tuple[int, ...],
    local_shape: tuple[int, ...],
    itemsize: int,
    cell: tuple[int, int],
) -> np.ndarray:
    """Where each chunk of a box starts in the box's own row-major buffer (int64, ascending).

    Chunk ``i`` ends where chunk ``i + 1`` starts (the last at the box's byte
    count). Cells are cut at the multiples of ``extent`` along ``dim`` in global
    coordinates, once for every index of the dimensions before it.
    """
    if not local_shape:
        return _ONE_CHUNK
    if 0 in local_shape:
        return _NO_CHUNK
    dim, extent = cell
    lo, size = offsets[dim], local_shape[dim]
    inner = math.prod(local_shape[dim + 1 :]) * itemsize
    first = lo // extent + 1
    last = -(-(lo + size) // extent)
    lead = math.prod(local_shape[:dim])
    if lead == 1 and last - first < 256:  # the common case, without numpy's per-call cost
        if last <= first:
            return _ONE_CHUNK
        return np.array([0, *((m * extent - lo) * inner for m in range(first, last))], np.int64)
    cuts = np.concatenate(
        [np.zeros(1, dtype=np.int64), np.arange(first, last, dtype=np.int64) * extent - lo]
    )
    if lead == 1:
        return cuts * inner
    rows = np.arange(lead, dtype=np.int64) * (size * inner)
    return (rows[:, None] + cuts[None, :] * inner).ravel()


def cut_at(flat: memoryview, starts: np.ndarray) -> list[memoryview]:
    """``flat`` (a box's byte buffer) cut into its chunks: views from each start to the next."""
    return [flat[a:b] for a, b in pairwise([*starts.tolist(), flat.nbytes])]
