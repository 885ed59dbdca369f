"""Progress on stderr for long work: bars with a known total, and phase lines.

Work that can take minutes (save, load, ``verify --deep``, ``repair``, ``gc``,
``compact``) takes ``progress=True`` to report on stderr. The Python API
defaults to ``False``; the CLI passes ``True``. Even when asked, nothing is
drawn unless stderr is a terminal, so logs and pipes stay clean. The
environment variable ``CASTORE_PROGRESS`` overrides that: ``1`` draws the
requested bars on any stderr (tests, CI logs), ``0`` never draws any.

A bar's total is known before its first update and never changes, so it
reaches 100% once, at the end. Updates may come from several threads (chunk
work runs in a pool). When progress is off, :func:`progress_bar` returns
:data:`NO_BAR`, which is falsy: hot loops test ``if bar:`` and do nothing
else.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from tqdm import tqdm

ENV_VAR = "CASTORE_PROGRESS"
# Seconds between redraws; tests set 0 to see every update.
MIN_INTERVAL = 0.1


def progress_wanted(progress: bool) -> bool:
    """Whether a bar asked for with ``progress`` is drawn (see the module docstring)."""
    forced = os.environ.get(ENV_VAR, "").strip()
    if not progress or forced == "0":
        return False
    if forced == "1":
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Bar:
    """A tqdm bar on stderr with a fixed total; ``update`` may be called from any thread."""

    def __init__(self, desc: str, total: int, unit: str) -> None:
        in_bytes = unit == "B"
        self._lock = threading.Lock()
        self._bar: Any = tqdm(
            desc=desc,
            total=total,
            unit=unit,
            unit_scale=in_bytes,
            unit_divisor=1024 if in_bytes else 1000,
            file=sys.stderr,
            mininterval=MIN_INTERVAL,
            miniters=0 if MIN_INTERVAL == 0 else None,
            dynamic_ncols=True,
        )

    def __bool__(self) -> bool:
        return True

    @property
    def count(self) -> int:
        """Units done so far."""
        return int(self._bar.n)

    @property
    def total(self) -> int:
        """Units in all, fixed when the bar is made."""
        return int(self._bar.total)

    def update(self, count: int) -> None:
        # tqdm's own counter is a plain `n += count`: not atomic across threads.
        with self._lock:
            self._bar.update(count)

    def close(self) -> None:
        with self._lock:
            self._bar.close()

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _NoBar(Bar):
    """Progress off: every method does nothing, and the bar is falsy."""

    def __init__(self) -> None:
        pass

    def __bool__(self) -> bool:
        return False

    @property
    def count(self) -> int:
        return 0

    @property
    def total(self) -> int:
        return 0

    def update(self, count: int) -> None:
        pass

    def close(self) -> None:
        pass


NO_BAR: Bar = _NoBar()


def progress_bar(progress: bool, desc: str, total: int, *, unit: str = "B") -> Bar:
    """A bar counting ``total`` units (``"B"``: bytes, shown in KiB/MiB/GiB), or NO_BAR.

    Work of no units gets no bar: there is nothing to show.
    """
    if total <= 0 or not progress_wanted(progress):
        return NO_BAR
    return Bar(desc, total, unit)


class Phases:
    """Numbered phase lines of one command on stderr: ``gc [2/5] mark ...``."""

    def __init__(self, progress: bool, name: str, count: int) -> None:
        self.shown = progress_wanted(progress)
        self.name = name
        self.count = count
        self.done = 0

    def start(self, text: str) -> None:
        self.done += 1
        if self.shown:
            print(f"{self.name} [{self.done}/{self.count}] {text}", file=sys.stderr, flush=True)


def format_size(count: float) -> str:
    """``count`` bytes as a short text (``1.5 GiB``), for phase lines and the CLI's tables."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"
