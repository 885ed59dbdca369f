"""What an option's value may be: counts, sizes, durations, percents, seconds.

Each is an argparse ``type``: it returns the value, or raises
``ArgumentTypeError`` with one line naming what was expected, which the parser
prints after the option's name (exit status 2).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from castore import gc


def at_least_one(meaning: str) -> Any:
    """An argparse type: a whole number >= 1; ``meaning`` says what the number counts."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"must be a whole number, at least 1 ({meaning}), got {text!r}"
            )
        return value

    return parse


def percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 100:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"the percent of chunks to re-hash must be in (0, 100], e.g. 5 for 5%, got {text!r}"
        )
    return value


def duration(text: str) -> float:
    try:
        return gc.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got {text!r}")
    return value


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def count(text: str) -> int:
    """A whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, 1 or more, got {text!r}")
    return value


def size(text: str) -> int:
    """A byte count: 5GB, 500MB, 2GiB or a plain number of bytes (at least 1)."""
    number = text.strip().upper().rstrip("BIKMGT")
    unit = text.strip().upper()[len(number) :]
    try:
        value = int(float(number) * _SIZE_UNITS[unit])
    except (KeyError, ValueError):
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a size such as 5GB, 500MB, 2GiB or a number of bytes, got {text!r}"
        )
    return value
