"""Round trips through Store.save / Store.load on a real LMDB store, and generation records.

Tensors are compared bitwise (uint8 views), so NaN payloads, signed zeros and
float8/bfloat16 bit patterns must survive exactly.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

import castore
from castore import Generation, GenerationNotFoundError, Store, UnsupportedValueError
from castore.format.dtypes import SUPPORTED_DTYPES, numpy_dtype
from castore.format.grid import writer_cell

DTYPES = sorted(SUPPORTED_DTYPES)
HEX64 = re.compile(r"[0-9a-f]{64}")

# -- helpers ---------------------------------------------------------------------


def random_array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """An array of random bit patterns (NaNs and all) of a castore dtype; bools are 0/1."""
    rng = np.random.default_rng(seed)
    nptype = numpy_dtype(dtype)
    raw = rng.integers(0, 256, size=math.prod(shape) * nptype.itemsize, dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    return raw.view(nptype).reshape(shape)


def random_tensor(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    raw = random_array(dtype, shape, seed).reshape(-1).view(np.uint8).copy()
    return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)


def numpy_bytes(array: np.ndarray) -> bytes:
    """Little-endian, row-major bytes of an array (independent of its memory layout)."""
    return np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"))).tobytes()


def torch_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_tensor(actual: Any, expected: Any) -> None:
    """Same framework as ``actual``'s, same dtype name, shape and bytes."""
    if isinstance(expected, torch.Tensor):
        dtype, shape, data = str(expected.dtype)[6:], tuple(expected.shape), torch_bytes(expected)
    else:
        dtype, shape, data = expected.dtype.name, expected.shape, numpy_bytes(expected)
    if isinstance(actual, torch.Tensor):
        assert str(actual.dtype) == f"torch.{dtype}"
        assert tuple(actual.shape) == shape
        assert actual.is_contiguous()
        assert torch_bytes(actual) == data
    else:
        assert isinstance(actual, np.ndarray)
        assert actual.dtype == numpy_dtype(dtype)
        assert actual.shape == shape
        assert actual.flags.c_contiguous and actual.flags.writeable
        assert numpy_bytes(actual) == data


def assert_same_tree(actual: Any, expected: Any) -> None:
    """Structural equality with exact types; tensors bitwise, floats NaN-aware."""
    if isinstance(expected, (np.ndarray, torch.Tensor)):
        assert_same_tensor(actual, expected)
        return
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, dict):
        assert list(actual) == list(expected)  # keys and their order
        for key in expected:
            assert_same_tree(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same_tree(a, e)
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype
        assert actual.tobytes() == expected.tobytes()
    elif isinstance(expected, float):
        assert (math.isnan(actual) and math.isnan(expected)) or (
            actual == expected and math.copysign(1, actual) == math.copysign(1, expected)
        )
    else:
        assert actual == expected


def save_load(store: Store, state: Any, *, framework: str = "numpy", run: str = "rt") -> Any:
    store.save(state, run=run, step=0)
    return store.load(run, framework=framework)


def tensor_entries(store: Store, run: str, generation: int | str = "latest") -> dict[str, Any]:
    _, root = store.resolve_root(run, generation)
    return {name: boxes[0] for name, boxes in store.tensor_entries(root).items()}


def letter_prefix(root: str) -> str:
    """The shortest prefix of at least 8 characters that holds a hex letter."""
    length = max(8, next(i for i, c in enumerate(root) if c in "abcdef") + 1)
    return root[:length]


# -- tensors: every dtype ----------------------------------------------------------

SHAPES: dict[str, tuple[int, ...]] = {
    "zero_d": (),
    "empty": (0, 3),
    "matrix": (5, 7),
    "cube": (2, 3, 4),
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_every_dtype_roundtrip(store: Store, dtype: str) -> None:
    state = {
        name: random_array(dtype, shape, seed=i) for i, (name, shape) in enumerate(SHAPES.items())
    }
    loaded = save_load(store, state)
    assert_same_tree(loaded, state)
    assert loaded["zero_d"].shape == () and isinstance(loaded["zero_d"], np.ndarray)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_every_dtype_roundtrip(store: Store, dtype: str) -> None:
    state = {
        name: random_tensor(dtype, shape, seed=i) for i, (name, shape) in enumerate(SHAPES.items())
    }
    matrix = random_tensor(dtype, (6, 9), seed=9)
    state["transposed"] = matrix.t()
    state["strided"] = matrix[::2, 1::3]
    state["offset_view"] = matrix[2:4]  # contiguous, but not at its storage's start
    loaded = save_load(store, state, framework="torch")
    assert_same_tree(loaded, state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_saved_loads_as_numpy(store: Store, dtype: str) -> None:
    state = {"t": random_tensor(dtype, (4, 5)), "s": random_tensor(dtype, ())}
    loaded = save_load(store, state, framework="numpy")
    assert isinstance(loaded["t"], np.ndarray) and isinstance(loaded["s"], np.ndarray)
    assert_same_tensor(loaded["t"], state["t"])
    assert_same_tensor(loaded["s"], state["s"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_saved_loads_as_torch(store: Store, dtype: str) -> None:
    state = {"a": random_array(dtype, (4, 5)), "e": random_array(dtype, (0, 3))}
    loaded = save_load(store, state, framework="torch")
    assert isinstance(loaded["a"], torch.Tensor) and isinstance(loaded["e"], torch.Tensor)
    assert_same_tensor(loaded["a"], state["a"])
    assert_same_tensor(loaded["e"], state["e"])


def test_auto_framework_gives_each_tensor_back_as_saved(store: Store) -> None:
    state = {"np": random_array("float32", (3, 4)), "pt": random_tensor("bfloat16", (2, 5))}
    loaded = save_load(store, state, framework="auto")
    assert isinstance(loaded["np"], np.ndarray) and isinstance(loaded["pt"], torch.Tensor)
    assert_same_tree(loaded, state)


def assert_owns_its_memory(tensor: torch.Tensor) -> None:
    """Alone on its storage, from its start: saving it saves only it, and no other
    tensor's bytes change when it is written."""
    assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    assert tensor.storage_offset() == 0 and tensor.is_contiguous()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e5m2", "bool", "int64"])
def test_torch_load_gives_each_tensor_its_own_writable_memory(store: Store, dtype: str) -> None:
    """Two tensors of the same bytes (one chunk list, each chunk verified once and
    copied), a tensor of many chunks and a scalar: each loads on memory of its own,
    writable, and writing one changes neither the other nor what is stored."""
    twin = random_tensor(dtype, (40, 30), seed=1)  # 1,200 elements: several 1 KiB chunks
    state = {"a": twin, "b": twin.clone(), "c": random_tensor(dtype, (3,)), "s": twin[0, 0]}
    loaded = save_load(store, state, framework="torch")
    assert_same_tree(loaded, state)
    for tensor in loaded.values():
        assert_owns_its_memory(tensor)
    assert len({t.data_ptr() for t in loaded.values()}) == len(loaded)
    for name in ("a", "s"):
        loaded[name].zero_()  # all bits zero, whatever the dtype
        assert torch_bytes(loaded[name]) == bytes(len(torch_bytes(state[name])))
    assert torch_bytes(loaded["b"]) == torch_bytes(state["b"])
    assert_same_tree(store.load("rt", framework="torch"), state)


def test_owns_its_memory_catches_tensors_sharing_a_buffer() -> None:
    """Broken control: views into one buffer, as an arena of tensors would give, fail it."""
    arena = torch.zeros(8)
    assert_owns_its_memory(arena)
    for part in (arena[:4], arena[4:]):
        with pytest.raises(AssertionError):
            assert_owns_its_memory(part)


def test_assert_same_tensor_catches_one_flipped_bit() -> None:
    """Broken control: the bitwise comparison used above notices a single-bit difference."""
    a = random_array("float32", (3, 3))
    b = a.copy()
    b.reshape(-1).view(np.uint8)[5] ^= 1
    assert_same_tensor(a.copy(), a)
    with pytest.raises(AssertionError):
        assert_same_tensor(b, a)


def test_nan_payloads_and_signed_zeros_survive(store: Store) -> None:
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0], dtype=np.float32)
    special.view(np.uint32)[0] = 0x7FC0_1234  # a NaN with a payload
    loaded = save_load(store, {"x": special, "bf": special.astype(ml_dtypes.bfloat16)})
    assert loaded["x"].view(np.uint32).tolist() == special.view(np.uint32).tolist()
    assert_same_tensor(loaded["bf"], special.astype(ml_dtypes.bfloat16))


# -- memory layouts ------------------------------------------------------------------


def test_numpy_non_contiguous_and_fortran_inputs(store: Store) -> None:
    base = random_array("float64", (6, 8))
    cube = random_array("int16", (3, 4, 5))
    state = {
        "transposed": base.T,
        "strided": base[::2, 1::3],
        "reversed": base[::-1, ::-2],
        "fortran": np.asfortranarray(base),
        "permuted": cube.transpose(2, 0, 1),
        "column": base[:, 3],
    }
    assert not any(v.flags.c_contiguous for v in state.values())
    loaded = save_load(store, state)
    for name, value in state.items():
        np.testing.assert_array_equal(loaded[name], value)
        assert_same_tensor(loaded[name], value)


@pytest.mark.parametrize(
    "dtype",
    [
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "bfloat16",
    ],
)
def test_big_endian_numpy_input(store: Store, dtype: str) -> None:
    little = random_array(dtype, (3, 5))
    big = little.astype(little.dtype.newbyteorder(">"))
    assert big.dtype.byteorder == ">"
    loaded = save_load(store, {"big": big})["big"]
    assert loaded.dtype == numpy_dtype(dtype)
    assert loaded.tobytes() == little.tobytes()


def test_big_and_little_endian_copies_dedup(store: Store) -> None:
    little = random_array("float64", (16, 16))  # 2 KiB: two chunks
    first = store.save({"x": little}, run="le", step=0)
    second = store.save({"x": little.astype(">f8")}, run="be", step=0)
    assert first.stats.new_chunks == 2
    assert second.stats.new_chunks == 0  # same logical values, same little-endian bytes


def test_torch_conjugate_view_is_resolved(store: Store) -> None:
    z = random_tensor("complex64", (4,)).nan_to_num()
    view = z.conj()
    assert view.is_conj()
    loaded = save_load(store, {"z": view}, framework="torch")["z"]
    assert torch_bytes(loaded) == torch_bytes(view.resolve_conj())


def test_torch_requires_grad_tensor(store: Store) -> None:
    weight = torch.randn(3, 4, requires_grad=True)
    loaded = save_load(store, {"w": weight * 2}, framework="torch")["w"]
    assert not loaded.requires_grad
    assert torch.equal(loaded, (weight * 2).detach())


# -- containers and plain values -------------------------------------------------------


def test_container_types_roundtrip(store: Store) -> None:
    state = {
        "zeta": 1,  # insertion order, not sorted order, must survive
        "alpha": OrderedDict([("b", 1), ("a", [1, (2, 3)])]),
        "list": [1, "two", [3.0, None], {"k": (4,)}],
        "tuple": (1, (2, (3, ())), [], {}),
        "empty": {"d": {}, "l": [], "t": (), "o": OrderedDict()},
        "nested": {"a": {"b": {"c": [np.arange(3), (np.ones((2, 2)),)]}}},
    }
    loaded = save_load(store, state)
    assert_same_tree(loaded, state)
    assert type(loaded["alpha"]) is OrderedDict
    assert type(loaded["tuple"][1][1]) is tuple


def test_dict_with_int_keys(store: Store) -> None:
    state = {0: np.arange(4), 1: {"exp_avg": np.zeros(2)}, -5: "neg", 2**40: "big", "s": 3}
    loaded = save_load(store, state)
    assert_same_tree(loaded, state)
    assert set(loaded) == {0, 1, -5, 2**40, "s"}


def test_keys_with_separators_do_not_collide(store: Store) -> None:
    state = {
        "a/b": np.array([1]),
        "a": {"b": np.array([2])},
        "a%2Fb": np.array([3]),
        "%": np.array([4]),
    }
    loaded = save_load(store, state)
    assert_same_tree(loaded, state)
    assert len(tensor_entries(store, "rt")) == 4


def test_empty_string_key_does_not_collide(store: Store) -> None:
    state = {"": {"x": np.array([1.0])}, "x": np.array([2.0])}
    loaded = save_load(store, state)
    assert_same_tree(loaded, state)


def test_bare_tensor_state(store: Store) -> None:
    array = random_array("float32", (10, 3))
    assert_same_tree(save_load(store, array, run="bare"), array)


INTS = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 10**40, -(10**40)]


def test_python_scalars(store: Store) -> None:
    state = {
        "ints": INTS,
        "floats": [0.0, -0.0, 1.5, -1e300, 5e-324, math.inf, -math.inf, math.nan, 0.1],
        "bools": [True, False],
        "str": ["", "ascii", "ünïcødé ✓", "a\x00b"],
        "bytes": [b"", b"\x00\xff" * 10],
        "none": None,
    }
    loaded = save_load(store, state)
    assert_same_tree(loaded, state)
    assert all(type(v) is int for v in loaded["ints"])
    assert loaded["ints"] == INTS
    assert all(type(v) is bool for v in loaded["bools"])


def test_bytearray_and_memoryview_load_as_bytes(store: Store) -> None:
    loaded = save_load(store, {"a": bytearray(b"xy"), "m": memoryview(b"z")})
    assert loaded == {"a": b"xy", "m": b"z"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_scalar_keeps_its_type(store: Store, dtype: str) -> None:
    scalar = random_array(dtype, (3,), seed=5)[1]
    assert isinstance(scalar, np.generic)
    loaded = save_load(store, {"s": scalar, "in_list": [scalar]})
    assert type(loaded["s"]) is type(scalar)
    assert loaded["s"].tobytes() == scalar.tobytes()
    assert_same_tree(loaded["in_list"], [scalar])


def test_numpy_float64_scalar_is_not_downgraded_to_float(store: Store) -> None:
    loaded = save_load(store, {"lr": np.float64(0.1), "f": 0.1, "i": np.int64(7)})
    assert type(loaded["lr"]) is np.float64 and type(loaded["f"]) is float
    assert type(loaded["i"]) is np.int64 and loaded["i"] == 7


@pytest.mark.parametrize(
    "value",
    [
        {"obj": np.array([object()], dtype=object)},
        {"dt": np.array(["2020-01-01"], dtype="datetime64[D]")},
        {"s": np.array(["a"])},
        {"set": {1, 2}},
        {"custom": object()},
        {(1, 2): "tuple key"},
        {1.5: "float key"},
        {"longdouble": np.longdouble(1)},
        {"sparse": torch.eye(2).to_sparse()},
    ],
)
def test_unsupported_values_are_rejected(store: Store, value: Any) -> None:
    with pytest.raises(UnsupportedValueError):
        store.save(value, run="bad", step=0)
    assert store.runs() == []  # nothing was published


def test_two_tensors_mapping_to_one_name_are_rejected(store: Store) -> None:
    with pytest.raises(UnsupportedValueError, match="two tensors"):
        store.save({1: np.zeros(1), "1": np.ones(1)}, run="dup", step=0)


# -- chunking --------------------------------------------------------------------------


def grid_chunk_lengths(shape: tuple[int, ...], itemsize: int, chunk_size: int) -> list[int]:
    """A whole tensor's chunk lengths on its grid: cells 1 along the dimensions before the
    cell dimension, ``extent`` along it (the last band short), whole after it."""
    dim, extent = writer_cell(shape, itemsize, chunk_size)
    slab = math.prod(shape[dim + 1 :]) * itemsize
    band = [min(extent, shape[dim] - at) * slab for at in range(0, shape[dim], extent)]
    return band * math.prod(shape[:dim])


def test_tensor_spanning_chunks_with_partial_last_chunk(store: Store) -> None:
    array = random_array("float32", (1000,))  # 4000 bytes: full 1 KiB chunks and a short one
    tensor = random_tensor("int16", (3, 700), seed=2)  # 1400-byte rows: each cut in two
    gen = store.save({"a": array, "t": tensor}, run="chunks", step=1)
    entries = tensor_entries(store, "chunks")
    lengths = {
        name: [entries[name].chunk_length(i) for i in range(len(entries[name].chunks))]
        for name in ("a", "t")
    }
    # "a": bands of 256 items, a full chunk each, then the short rest.
    assert lengths["a"] == grid_chunk_lengths((1000,), 4, 1024)
    assert lengths["a"][:-1] == [1024] * (4000 // 1024) and 0 < lengths["a"][-1] < 1024
    # "t": a row exceeds a chunk, so cells cut each row: a full chunk, then the row's rest.
    assert writer_cell((3, 700), 2, 1024)[0] == 1
    assert lengths["t"] == grid_chunk_lengths((3, 700), 2, 1024)
    assert lengths["t"] == [1024, 1400 - 1024] * 3
    assert (entries["a"].nbytes, entries["t"].nbytes) == (4000, 4200)
    assert entries["a"].chunk_size == entries["t"].chunk_size == 1024
    assert gen.stats.logical_bytes == 8200
    count = len(lengths["a"]) + len(lengths["t"])
    assert gen.stats.new_chunks == count and gen.stats.new_bytes == 8200
    loaded = store.load("chunks")
    assert_same_tensor(loaded["a"], array)
    assert_same_tensor(loaded["t"], tensor)
    as_torch = store.load("chunks", framework="torch")
    assert_same_tensor(as_torch["t"], tensor)


def test_exact_multiple_of_chunk_size(store: Store) -> None:
    array = random_array("uint8", (3, 1024))
    store.save({"a": array}, run="exact", step=0)
    assert len(tensor_entries(store, "exact")["a"].chunks) == 3
    assert_same_tensor(store.load("exact")["a"], array)


def test_realistic_state_roundtrip(store: Store, make_state: Any) -> None:
    state = make_state(seed=3)
    assert_same_tree(save_load(store, state), state)


# -- metadata ----------------------------------------------------------------------------


def test_metadata_roundtrip(store: Store) -> None:
    metadata = {
        "lr": 3e-4,
        "tags": ["baseline", "bf16"],
        "config": OrderedDict([("layers", 12), ("dims", (768, 3072))]),
        "loss": np.float32(2.5),
        "huge": 2**70,
        "note": None,
    }
    gen = store.save({"w": np.ones(3)}, run="meta", step=10, metadata=metadata)
    assert_same_tree(gen.metadata, metadata)
    assert_same_tree(store.resolve("meta").metadata, metadata)
    assert_same_tree(store.resolve("meta", gen.id).metadata, metadata)


def test_metadata_defaults_to_empty_and_rejects_tensors(store: Store) -> None:
    assert store.save({}, run="meta", step=0).metadata == {}
    with pytest.raises(UnsupportedValueError):
        store.save({}, run="meta", step=1, metadata={"w": np.zeros(2)})
    assert [g.id for g in store.generations("meta")] == [1]


# -- generations ---------------------------------------------------------------------------


def test_generation_fields_and_parent_links(store: Store) -> None:
    gens = [store.save({"w": np.full(4, i)}, run="train", step=100 * i) for i in range(1, 4)]
    assert [g.id for g in gens] == [1, 2, 3]
    assert [g.step for g in gens] == [100, 200, 300]
    assert all(g.run == "train" and g.world_size == 1 for g in gens)
    assert all(HEX64.fullmatch(g.root) for g in gens)
    assert len({g.root for g in gens}) == 3
    assert gens[0].parent is None
    assert gens[1].parent == gens[0].root and gens[2].parent == gens[1].root
    assert gens[0].time <= gens[1].time <= gens[2].time
    assert gens[0].stats.tensors == 1 and gens[0].logical_bytes == 32
    assert {"castore", "python", "numpy"} <= set(gens[0].frameworks)
    assert gens[0].frameworks["castore"] == castore.__version__
    # What save returned is what the store reads back.
    assert [store.resolve("train", g.id) for g in gens] == gens


def test_generation_ids_are_independent_per_run(store: Store) -> None:
    a = [store.save({"x": 1}, run="run-a", step=i).id for i in range(3)]
    b = [store.save({"x": 1}, run="run_b", step=i).id for i in range(2)]
    a.append(store.save({"x": 1}, run="run-a", step=9).id)
    assert a == [1, 2, 3, 4]
    assert b == [1, 2]
    assert store.resolve("run_b").parent == store.resolve("run_b", 1).root
    assert store.runs() == ["run-a", "run_b"]


def test_generations_lists_oldest_first(store: Store) -> None:
    saved = [store.save({"v": i}, run="hist", step=s) for i, s in enumerate([5, 10, 10, 40])]
    listed = store.generations("hist")
    assert [g.id for g in listed] == [1, 2, 3, 4]
    assert [g.step for g in listed] == [5, 10, 10, 40]
    assert [g.root for g in listed] == [g.root for g in saved]


def test_resolve_by_id_digits_prefix_and_latest(store: Store) -> None:
    gens = [store.save({"v": i}, run="res", step=i) for i in range(4)]
    second = gens[1]
    assert store.resolve("res", 2) == second
    assert store.resolve("res", "2") == second
    assert store.resolve("res", second.root) == second
    assert store.resolve("res", letter_prefix(second.root)) == second
    assert store.resolve("res") == gens[-1]
    assert store.resolve("res", "latest") == gens[-1]
    for missing in (0, 5, "99", "zz", "abc", "-1"):
        with pytest.raises(GenerationNotFoundError):
            store.resolve("res", missing)
    with pytest.raises(GenerationNotFoundError):
        store.resolve("no-such-run")
    with pytest.raises(GenerationNotFoundError):
        store.load("no-such-run")


def test_resolve_by_all_digit_root_prefix(store: Store) -> None:
    # About 6% of roots start with 6 decimal digits; save until one does (and is unambiguous).
    roots: list[str] = []
    for step in range(2000):
        gen = store.save({"step": step}, run="digits", step=step)
        prefix = gen.root[:6]
        if prefix.isdigit() and not any(r.startswith(prefix) for r in roots):
            break
        roots.append(gen.root)
    else:
        pytest.fail("no root began with 6 decimal digits")  # p < 1e-50
    assert store.resolve("digits", prefix).root == gen.root


def test_loading_older_generation_returns_its_data(store: Store, make_state: Any) -> None:
    states = [make_state(seed=s) for s in range(3)]
    for step, state in enumerate(states):
        store.save(state, run="hist", step=step)
    for gen_id, state in enumerate(states, start=1):
        assert_same_tree(store.load("hist", gen_id), state)
        assert_same_tree(store.load("hist", str(gen_id), framework="numpy"), state)
    assert_same_tree(store.load("hist"), states[-1])


def test_state_survives_reopening_the_store(
    store_path: Any, open_store: Any, make_state: Any
) -> None:
    state = make_state(seed=11)
    first = open_store(store_path, chunk_size=1024)
    gen = first.save(state, run="persist", step=1, metadata={"k": "v"})
    first.close()
    again = open_store(store_path)
    assert again.chunk_size == 1024  # the store's default was recorded at creation
    assert again.resolve("persist") == gen
    assert_same_tree(again.load("persist"), state)


def test_load_rejects_unknown_framework(store: Store) -> None:
    store.save({"w": np.zeros(2)}, run="fw", step=0)
    with pytest.raises(ValueError, match="framework"):
        store.load("fw", framework="jax")


def test_step_must_be_int(store: Store) -> None:
    with pytest.raises(TypeError):
        store.save({}, run="s", step=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.save({}, run="s", step=True)
    assert store.runs() == []


def test_generation_dataclass_is_frozen(store: Store) -> None:
    gen: Generation = store.save({}, run="f", step=0)
    with pytest.raises(AttributeError):
        gen.id = 5  # type: ignore[misc]
