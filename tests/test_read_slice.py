"""Store.read_slice: equals numpy basic indexing, and reads only the chunks it overlaps.

Chunk reads are observed by wrapping the real LMDB backend's ``read_many``
(calls go through unchanged) and by ``store.read_counters``.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from pregrid import pre_grid_saves

import castore
from castore import GenerationNotFoundError, Store
from castore.chunkstore.base import ChunkReader, Namespace, ReadSink
from castore.errors import InvalidIndexError, TensorNotFoundError
from castore.format.grid import writer_cell

# -- helpers ---------------------------------------------------------------------


@dataclass
class ChunkReads:
    """Chunk keys requested from the backend, one list per read_many or chunk_reader call."""

    calls: list[list[bytes]] = field(default_factory=list)

    @property
    def keys(self) -> list[bytes]:
        return [key for call in self.calls for key in call]


def count_chunk_reads(store: Store, monkeypatch: pytest.MonkeyPatch) -> ChunkReads:
    """Record every chunk read of ``store``'s real backend, calling through to it.

    A load reads into new tensors through the backend's ``chunk_reader``; a slice
    and a re-read of a chunk that did not verify go through ``read_many``.
    """
    reads = ChunkReads()
    real, real_reader = store.backend.read_many, store.backend.chunk_reader

    def counting(namespace: Namespace, keys: Any, sink: ReadSink) -> None:
        if Namespace(namespace) is Namespace.CHUNKS:
            reads.calls.append([bytes(k) for k in keys])
        real(namespace, keys, sink)

    def counting_reader(keys: Any) -> ChunkReader | None:
        reads.calls.append([bytes(k) for k in keys])
        return real_reader(keys)

    monkeypatch.setattr(store.backend, "read_many", counting)
    monkeypatch.setattr(store.backend, "chunk_reader", counting_reader)
    return reads


def chunk_digests(store: Store, run: str, name: str) -> tuple[bytes, ...]:
    _, root = store.resolve_root(run)
    (entry,) = store.tensor_entries(root)[name]
    return entry.chunks


def assert_same_result(actual: Any, expected: Any) -> None:
    """``actual`` is ``expected`` (numpy indexing's result): shape, dtype and bytes."""
    actual_arr, expected_arr = np.asarray(actual), np.asarray(expected)
    assert actual_arr.shape == expected_arr.shape
    assert actual_arr.dtype == expected_arr.dtype
    assert actual_arr.tobytes() == expected_arr.tobytes()
    if np.ndim(expected) > 0:
        assert isinstance(actual, np.ndarray)


def grid_chunk_starts(shape: tuple[int, ...], itemsize: int, chunk: int) -> np.ndarray:
    """Where a whole tensor's chunks start in its row-major bytes: its grid's cells.

    Cells are 1 along the dimensions before the cell dimension, ``extent`` along it
    and whole after it (docs/FORMAT.md, "The chunk grid"): for each index of the
    leading dimensions, the bytes along the cell dimension are cut every ``extent`` slabs.
    """
    if not shape:
        return np.zeros(1, dtype=np.int64)
    nbytes = math.prod(shape) * itemsize
    if not nbytes:
        return np.zeros(0, dtype=np.int64)
    dim, extent = writer_cell(shape, itemsize, chunk)
    slab = math.prod(shape[dim + 1 :]) * itemsize
    run = shape[dim] * slab
    starts = [lead + at for lead in range(0, nbytes, run) for at in range(0, run, extent * slab)]
    return np.asarray(starts, dtype=np.int64)


def bounding_box_chunks(shape: tuple[int, ...], index: Any, itemsize: int, chunk: int) -> set[int]:
    """Chunks holding any byte of the bounding box of the elements ``index`` picks (brute force)."""
    flat = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    picked = np.asarray(flat[index]).reshape(-1)
    if picked.size == 0:
        return set()
    if shape:
        coords = np.stack(np.unravel_index(picked, shape), axis=-1)
        lo, hi = coords.min(axis=0), coords.max(axis=0) + 1
        box = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi, strict=True))
        elements = flat[box].reshape(-1)
    else:
        elements = picked
    starts = grid_chunk_starts(shape, itemsize, chunk)
    found: set[int] = set()
    for element in elements.tolist():
        first = int(np.searchsorted(starts, element * itemsize, side="right")) - 1
        last = int(np.searchsorted(starts, element * itemsize + itemsize - 1, side="right")) - 1
        found.update(range(first, last + 1))
    return found


# -- a module-wide store of varied tensors ----------------------------------------------

SLICE_CHUNK = 40  # deliberately unaligned with any row or item size


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "vec": rng.standard_normal(37),
        "mat": rng.integers(-(2**31), 2**31, size=(13, 11), dtype=np.int32),
        "cube": rng.standard_normal((5, 6, 7), dtype=np.float32),
        "scalar": np.array(3.25),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "bf": rng.standard_normal((9, 10), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "c": (rng.standard_normal((4, 5)) + 1j * rng.standard_normal((4, 5))).astype(np.complex64),
    }


TENSORS = _tensors()


@pytest.fixture(scope="module")
def sliced_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    store = castore.open(tmp_path_factory.mktemp("slice") / "store", chunk_size=SLICE_CHUNK)
    store.save(TENSORS, run="s", step=0)
    yield store
    store.close()


CASES: list[tuple[str, Any]] = [
    ("vec", np.s_[5:20]),
    ("vec", np.s_[::-1]),
    ("vec", np.s_[30:2:-5]),
    ("vec", np.s_[7]),
    ("vec", np.s_[-1]),
    ("vec", np.s_[:0]),
    ("vec", np.s_[::7]),
    ("vec", np.s_[-100:100]),
    ("mat", np.s_[2:7]),
    ("mat", np.s_[:, 3:8]),
    ("mat", np.s_[2:7, 3:8]),
    ("mat", np.s_[::-1]),
    ("mat", np.s_[::-2, 1::3]),
    ("mat", np.s_[10:3:-2, ::-3]),
    ("mat", np.s_[3]),
    ("mat", np.s_[-1]),
    ("mat", np.s_[3, 4]),
    ("mat", np.s_[-2, -3]),
    ("mat", np.s_[:, -1]),
    ("mat", np.s_[..., 2]),
    ("mat", np.s_[2, ...]),
    ("mat", np.s_[...]),
    ("mat", np.s_[()]),
    ("mat", np.s_[:]),
    ("mat", np.s_[5:5]),
    ("mat", np.s_[:, 4:2]),
    ("mat", np.s_[100:]),
    ("mat", np.s_[np.int64(2), np.int32(-1)]),
    ("mat", np.s_[1:12:4, -1]),
    ("cube", np.s_[1:4, 2:5, 3:6]),
    ("cube", np.s_[..., 1]),
    ("cube", np.s_[2, ..., ::-1]),
    ("cube", np.s_[:, 0]),
    ("cube", np.s_[::2, ::-2, ::3]),
    ("cube", np.s_[4, 5, 6]),
    ("cube", np.s_[1:2, :, 6]),
    ("cube", np.s_[:, :, :0]),
    ("scalar", np.s_[()]),
    ("empty", np.s_[:]),
    ("empty", np.s_[:, 1]),
    ("empty", np.s_[0:0, 1:2]),
    ("bf", np.s_[3:8, ::-2]),
    ("c", np.s_[1:3, 2]),
]


@pytest.mark.parametrize(("name", "index"), CASES)
def test_read_slice_matches_numpy(sliced_store: Store, name: str, index: Any) -> None:
    expected = TENSORS[name][index]
    actual = sliced_store.read_slice("s", "latest", name, index)
    assert_same_result(actual, expected)


def test_read_slice_of_whole_0d_tensor(sliced_store: Store) -> None:
    value = sliced_store.read_slice("s", 1, "scalar", ())
    assert np.asarray(value).shape == () and float(value) == 3.25


@pytest.mark.parametrize(("name", "index"), [("scalar", np.s_[...]), ("vec", np.s_[3, ...])])
def test_ellipsis_index_returns_an_array_like_numpy(
    sliced_store: Store, name: str, index: Any
) -> None:
    expected = TENSORS[name][index]
    assert isinstance(expected, np.ndarray)
    actual = sliced_store.read_slice("s", "latest", name, index)
    assert isinstance(actual, np.ndarray)


def test_read_slice_as_torch(sliced_store: Store) -> None:
    expected = TENSORS["cube"][1:4, ::-2, 3]
    actual = sliced_store.read_slice("s", "latest", "cube", np.s_[1:4, ::-2, 3], framework="torch")
    assert isinstance(actual, torch.Tensor) and actual.dtype == torch.float32
    np.testing.assert_array_equal(actual.numpy(), expected)
    bf = sliced_store.read_slice("s", "latest", "bf", np.s_[2], framework="torch")
    assert bf.dtype == torch.bfloat16
    assert bf.view(torch.int16).numpy().tobytes() == TENSORS["bf"][2].tobytes()


def test_read_slice_of_an_older_generation(store: Store) -> None:
    store.save({"w": np.arange(10.0)}, run="g", step=0)
    store.save({"w": np.arange(10.0) * -1}, run="g", step=1)
    np.testing.assert_array_equal(store.read_slice("g", 1, "w", np.s_[2:4]), [2.0, 3.0])
    np.testing.assert_array_equal(store.read_slice("g", "latest", "w", np.s_[2:4]), [-2.0, -3.0])


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("mat", (0, 0, 0)),
        ("mat", 13),
        ("mat", -14),
        ("mat", (0, 11)),
        ("mat", 1.5),
        ("mat", (slice(None), 2.0)),
        ("mat", None),
        ("mat", [0, 1]),
        ("mat", True),
        ("mat", (..., ...)),
        ("mat", slice(None, None, 0)),
        ("vec", "3"),
        ("scalar", 0),
    ],
)
def test_bad_index_raises_invalid_index(sliced_store: Store, name: str, index: Any) -> None:
    with pytest.raises(InvalidIndexError):
        sliced_store.read_slice("s", "latest", name, index)


@pytest.mark.parametrize("index", [np.array([0, 2]), (slice(None), np.array([1, 2]))])
def test_array_index_raises_invalid_index(sliced_store: Store, index: Any) -> None:
    with pytest.raises(InvalidIndexError):
        sliced_store.read_slice("s", "latest", "mat", index)


def test_unknown_tensor_and_run(sliced_store: Store) -> None:
    with pytest.raises(TensorNotFoundError, match="nope"):
        sliced_store.read_slice("s", "latest", "nope", 0)
    with pytest.raises(GenerationNotFoundError):
        sliced_store.read_slice("missing", "latest", "vec", 0)
    with pytest.raises(GenerationNotFoundError):
        sliced_store.read_slice("s", 7, "vec", 0)
    with pytest.raises(ValueError, match="framework"):
        sliced_store.read_slice("s", "latest", "vec", 0, framework="jax")


# -- reading only the overlapping chunks --------------------------------------------------

ROWS, COLS = 16, 256  # float32 rows of 1024 bytes: one row per chunk of the `store` fixture


@pytest.fixture
def rows_store(store: Store) -> Store:
    assert store.chunk_size == COLS * 4
    data = np.random.default_rng(0).standard_normal((ROWS, COLS), dtype=np.float32)
    store.save({"w": data, "other": data[:2]}, run="rows", step=0)
    return store


@pytest.mark.parametrize(
    ("index", "expected_chunks"),
    [
        (np.s_[3:7], [3, 4, 5, 6]),
        (np.s_[5], [5]),
        (np.s_[-1], [15]),
        (np.s_[2:9:3], [2, 3, 4, 5, 6, 7, 8]),  # the covering row range
        (np.s_[9:3:-2], [5, 6, 7, 8, 9]),  # picks rows 9, 7, 5
        (np.s_[4:6, 10:20], [4, 5]),
        (np.s_[:, 0:2], list(range(ROWS))),
        (np.s_[7, 255], [7]),
        (np.s_[...], list(range(ROWS))),
        (np.s_[6:6], []),
    ],
)
def test_row_ranges_read_exactly_the_overlapping_chunks(
    rows_store: Store, monkeypatch: pytest.MonkeyPatch, index: Any, expected_chunks: list[int]
) -> None:
    data = rows_store.load("rows")["w"]
    digests = chunk_digests(rows_store, "rows", "w")
    reads = count_chunk_reads(rows_store, monkeypatch)
    before = (rows_store.read_counters.chunks, rows_store.read_counters.bytes)

    result = rows_store.read_slice("rows", "latest", "w", index)

    assert_same_result(result, data[index])
    assert reads.keys == [digests[i] for i in expected_chunks]
    assert len(reads.calls) == (1 if expected_chunks else 0)
    counted = (
        rows_store.read_counters.chunks - before[0],
        rows_store.read_counters.bytes - before[1],
    )
    assert counted == (len(expected_chunks), len(expected_chunks) * 1024)


def test_unaligned_rows_read_the_straddled_chunks(
    open_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation saved before the chunk grid (format 2, every 1 KiB of the buffer):
    rows straddle chunks, and a slice reads every chunk its rows touch, and no other."""
    # 250 float32 = 1000-byte rows in 1024-byte chunks: rows 3..6 are bytes 3000..6999.
    store = open_store(tmp_path / "unaligned", chunk_size=1024)
    data = np.random.default_rng(1).standard_normal((16, 250), dtype=np.float32)
    with pre_grid_saves():
        store.save({"w": data}, run="u", step=0)
    (entry,) = store.tensor_entries(store.resolve_root("u")[1])["w"]
    assert entry.cell is None  # cut every chunk_size bytes, as before the grid
    digests = chunk_digests(store, "u", "w")
    assert len(digests) == 16  # 16000 bytes: 15 full chunks and 640 bytes
    reads = count_chunk_reads(store, monkeypatch)
    np.testing.assert_array_equal(store.read_slice("u", "latest", "w", np.s_[3:7]), data[3:7])
    assert reads.keys == [digests[i] for i in range(2, 7)]  # 3000 // 1024 .. 6999 // 1024
    assert (store.read_counters.chunks, store.read_counters.bytes) == (5, 5 * 1024)
    np.testing.assert_array_equal(store.read_slice("u", "latest", "w", np.s_[15]), data[15])
    assert reads.keys[5:] == [digests[14], digests[15]]  # bytes 15000..15999
    assert store.read_counters.bytes == 5 * 1024 + 1024 + 640  # the last chunk is short


def test_rows_read_the_grid_cells_they_overlap(
    open_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the grid a cell is a band of whole rows: a row range reads the bands it touches,
    whole (a band holds rows the slice did not ask for), and no other."""
    chunk = 3000
    store = open_store(tmp_path / "grid", chunk_size=chunk)
    data = np.random.default_rng(1).standard_normal((16, 250), dtype=np.float32)
    store.save({"w": data}, run="u", step=0)
    row = 250 * 4
    dim, band = writer_cell(data.shape, 4, chunk)
    assert dim == 0 and band > 1 and 16 % band  # bands of several rows, the last one short
    (entry,) = store.tensor_entries(store.resolve_root("u")[1])["w"]
    assert entry.cell == (dim, band)
    digests = chunk_digests(store, "u", "w")
    assert len(digests) == -(-16 // band)
    reads = count_chunk_reads(store, monkeypatch)

    np.testing.assert_array_equal(store.read_slice("u", "latest", "w", np.s_[4:8]), data[4:8])
    bands = list(range(4 // band, 7 // band + 1))  # the bands of rows 4 and 7, and between
    assert len(bands) >= 2 and 4 % band  # the slice starts inside a band and spans two
    assert reads.keys == [digests[i] for i in bands]
    assert (store.read_counters.chunks, store.read_counters.bytes) == (
        len(bands),
        len(bands) * band * row,
    )
    np.testing.assert_array_equal(store.read_slice("u", "latest", "w", np.s_[15]), data[15])
    assert reads.keys[len(bands) :] == [digests[-1]]  # the short last band
    assert store.read_counters.bytes == len(bands) * band * row + (16 % band) * row


def test_counting_wrapper_sees_a_full_read(
    rows_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Broken control: the wrapper does observe reads, so an over-reading slice would show."""
    reads = count_chunk_reads(rows_store, monkeypatch)
    rows_store.load("rows")
    assert len(set(reads.keys)) == ROWS  # "other" shares its two chunks with rows 0 and 1
    # A load reads every tensor in one call and fetches each distinct chunk once.
    assert len(reads.calls) == 1
    assert len(reads.keys) == ROWS


# -- property: random shapes, chunk sizes and indices -----------------------------------------

PROPERTY_DTYPES = [np.uint8, np.int16, np.float32, np.float64, np.complex64]


@st.composite
def slice_cases(draw: Any) -> tuple[np.ndarray, int, Any]:
    dtype = np.dtype(draw(st.sampled_from(PROPERTY_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=7))
    seed = draw(st.integers(0, 2**16))
    raw = np.random.default_rng(seed).integers(
        0, 256, size=math.prod(shape) * dtype.itemsize, dtype=np.uint8
    )
    array = raw.view(dtype).reshape(shape)
    chunk = draw(st.integers(8, 256))
    index = draw(hnp.basic_indices(shape, min_dims=0, allow_newaxis=False, allow_ellipsis=True))
    return array, chunk, index


@settings(max_examples=120, deadline=None)
@given(slice_cases())
def test_read_slice_property(case: tuple[np.ndarray, int, Any]) -> None:
    """Property: read_slice == numpy indexing, reading exactly the covering box's chunks."""
    array, chunk, index = case
    with tempfile.TemporaryDirectory() as tmp, castore.open(Path(tmp), chunk_size=chunk) as store:
        store.save({"x": array}, run="p", step=0)
        digests = chunk_digests(store, "p", "x")
        requested: list[bytes] = []
        real = store.backend.read_many

        def counting(namespace: Namespace, keys: Any, sink: ReadSink) -> None:
            if Namespace(namespace) is Namespace.CHUNKS:
                requested.extend(bytes(k) for k in keys)
            real(namespace, keys, sink)

        store.backend.read_many = counting  # type: ignore[method-assign]
        result = store.read_slice("p", "latest", "x", index)

    assert_same_result(result, array[index])
    expected = sorted(bounding_box_chunks(array.shape, index, array.itemsize, chunk))
    assert requested == [digests[i] for i in expected]
    assert store.read_counters.chunks == len(expected)
