"""Shared fixtures: a real on-disk LMDB store and a small, realistic training state."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import castore
from castore import Store

try:  # one moto server for the whole session (tests/helpers/s3_server.py), where boto3 and moto are
    import s3_server

    s3_endpoint = s3_server.s3_endpoint
    s3_bucket = s3_server.s3_bucket
except pytest.skip.Exception:  # without them, the S3 tests skip themselves
    pass

# Small on purpose: tensors of a few KiB then span several chunks.
TEST_CHUNK_SIZE = 1024

StateFactory = Callable[..., dict[str, Any]]
StoreOpener = Callable[..., Store]


@pytest.fixture(autouse=True, scope="session")
def _index_cache_in_a_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Stores on blobs keep a per-node index cache: never in the user's ~/.cache here.

    Set in the environment, so worker processes the tests start use it too.
    """
    previous = os.environ.get("CASTORE_CACHE_DIR")
    os.environ["CASTORE_CACHE_DIR"] = str(tmp_path_factory.mktemp("index-cache"))
    yield
    if previous is None:
        os.environ.pop("CASTORE_CACHE_DIR", None)
    else:
        os.environ["CASTORE_CACHE_DIR"] = previous


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    """Where the ``store`` fixture keeps its store (the directory need not exist yet)."""
    return tmp_path / "store"


@pytest.fixture
def store(store_path: Path) -> Iterator[Store]:
    """A real LMDB-backed store on disk with 1 KiB chunks, closed after the test."""
    opened = castore.open(store_path, chunk_size=TEST_CHUNK_SIZE)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def open_store() -> Iterator[StoreOpener]:
    """Open more stores (``open_store(path, chunk_size=...)``); all are closed after the test.

    A path may be open more than once: the handles share one LMDB environment.
    """
    opened: list[Store] = []

    def _open(path: Path, **options: Any) -> Store:
        handle = castore.open(path, **options)
        opened.append(handle)
        return handle

    yield _open
    for handle in opened:
        handle.close()


def build_state(seed: int = 0) -> dict[str, Any]:
    """A small model + optimizer + RNG state, numpy only; equal seeds give equal bytes.

    ``model/embed.weight`` is 32x16 float32 (2 KiB: two 1 KiB chunks); the rest are
    one chunk or less.
    """
    rng = np.random.default_rng(seed)

    def randn(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    return {
        "model": {
            "embed.weight": randn(32, 16),
            "fc.weight": randn(16, 16),
            "fc.bias": randn(16),
            "norm.weight": randn(16).astype(ml_dtypes.bfloat16),
        },
        "optimizer": {
            "state": {0: {"step": 7, "exp_avg": randn(16, 16), "exp_avg_sq": randn(16, 16) ** 2}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2, 3]}],
        },
        "rng": {"numpy": rng.integers(0, 2**32, size=8, dtype=np.uint32), "seed": seed},
        "epoch": 1,
    }


@pytest.fixture
def make_state() -> StateFactory:
    """Factory for :func:`build_state`: ``make_state(seed=0)``."""
    return build_state
