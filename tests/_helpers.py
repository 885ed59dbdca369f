"""Assertions shared by several test files."""

from __future__ import annotations

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
