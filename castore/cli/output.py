"""How the commands print: times, durations, ages, ratios, spans of ids, tables."""

from __future__ import annotations

import time
from typing import Any

from tabulate import tabulate


def format_time(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def text_table(rows: list[list[Any]], headers: list[str], *, text: tuple[str, ...]) -> str:
    """A table whose ``text`` columns print as given: tabulate would read a root prefix
    such as ``1057676782e8``, or a run named ``123``, as a number and reformat it."""
    keep = [index for index, name in enumerate(headers) if name in text]
    return str(tabulate(rows, headers=headers, disable_numparse=keep or False))


def format_seconds(seconds: float) -> str:
    """How long a save held its caller: milliseconds below 10 s."""
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def format_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def ratio(fraction: float) -> str:
    """Stored over raw bytes, as ``0.66x``."""
    return f"{fraction:.2f}x"


def spans(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    spans: list[list[int]] = []
    for number in sorted(numbers):
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
