"""Element types: castore's canonical dtype names and their numpy/torch types.

Bytes are always stored little-endian. Names follow numpy's (``float32``),
with ml_dtypes' names for the types numpy lacks (``bfloat16``, ``float8_*``).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from castore.errors import UnsupportedValueError

_NUMPY_TYPES: dict[str, Any] = {
    "bool": np.bool_,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "uint16": np.uint16,
    "int32": np.int32,
    "uint32": np.uint32,
    "int64": np.int64,
    "uint64": np.uint64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "complex64": np.complex64,
    "complex128": np.complex128,
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}

SUPPORTED_DTYPES = frozenset(_NUMPY_TYPES)
# Looked up once a tensor on every save and load: built once here.
_LITTLE_ENDIAN = {name: np.dtype(kind).newbyteorder("<") for name, kind in _NUMPY_TYPES.items()}
_NAMES = {
    dtype: name
    for name, kind in _NUMPY_TYPES.items()
    for dtype in (np.dtype(kind), np.dtype(kind).newbyteorder(">"))
}
# The types numpy lacks, which ml_dtypes gives it: torch.from_numpy refuses their arrays.
NUMPY_LACKS = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The little-endian numpy dtype for a canonical name."""
    try:
        return _LITTLE_ENDIAN[name]
    except KeyError:
        raise UnsupportedValueError(f"unknown dtype {name!r}") from None


def name_of_numpy_dtype(dtype: np.dtype[Any], key_path: str = "") -> str:
    """The canonical name of a numpy dtype, or UnsupportedValueError."""
    found = _NAMES.get(dtype)
    if found is not None:
        return found
    for name, kind in _NUMPY_TYPES.items():  # a dtype equal to one above, hashed otherwise
        if dtype == np.dtype(kind) or dtype == np.dtype(kind).newbyteorder(">"):
            return name
    raise UnsupportedValueError(
        f"arrays of dtype {dtype} cannot be stored at {key_path or '<root>'}",
        key_path=key_path,
    )


def torch_dtype(name: str) -> Any:
    """The torch dtype for a canonical name (imports torch)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedValueError(f"dtype {name!r} has no torch equivalent")
    return dtype


def name_of_torch_dtype(dtype: Any, key_path: str = "") -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _NUMPY_TYPES:
        raise UnsupportedValueError(
            f"tensors of dtype {dtype} cannot be stored at {key_path or '<root>'}",
            key_path=key_path,
        )
    return name
