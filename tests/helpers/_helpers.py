"""Assertions shared by several test files."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from typing import Any

import numpy as np


def assert_state_equal(actual: Any, expected: Any) -> None:
    """Same container types, same keys in order, same arrays (dtype, shape, values)."""
    assert type(actual) is type(expected)
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_state_equal(actual[key], expected[key])
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        np.testing.assert_array_equal(actual, expected)
    else:
        assert actual == expected


# What the racing tests' processes import: their forkserver imports it once.
PROCESS_PRELOAD = ["numpy", "castore", "castore.blob.s3", "castore.repo.blobs", "blob_workers"]


def process_context() -> multiprocessing.context.BaseContext:
    """``multiprocessing`` for tests that race real processes, started in milliseconds.

    Each process is forked from a server process (the ``forkserver`` method) that
    imported castore and its libraries once: a fresh process, with no thread or
    open store of the test's, as ``spawn`` gives, without the second or so an
    interpreter takes to import them. A target in a test module is imported by the
    child.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PROCESS_PRELOAD)
    return context


def rank_values(outcomes: list[Any]) -> list[Any]:
    """What each rank of a dist_harness launch returned, once every rank returned."""
    from dist_harness import describe

    assert all(o.ok for o in outcomes), describe(outcomes)
    return [o.value for o in outcomes]


def assert_bitwise(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """The same names, and for each the same dtype, shape and bytes."""
    assert sorted(actual) == sorted(expected)
    for name, array in expected.items():
        got = actual[name]
        assert (got.dtype, got.shape) == (array.dtype, array.shape), name
        assert got.tobytes() == array.tobytes(), name
