"""What every repository implementation agrees on: names, ref values, reflog records.

Nothing here touches storage. The rules a run or tag name follows, the value a
ref or tag holds (:class:`RefValue`), the checks of a compare-and-swap
(:func:`check_advance`), the shape of a reflog record and what a sequence of
records says (:class:`ReflogView`, :class:`PublishedStream`) are the same for
the local directory, memory and any later backend, so they live once, here.
"""

from __future__ import annotations

import copy
import math
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from castore.errors import FencedError, InvalidNameError, RefConflictError
from castore.errors import ReflogWarning as ReflogWarning  # importable here, where it was defined
from castore.format.hashing import Digest

DEFAULT_LOCK_TIMEOUT = 30.0
# How long a save waits for a running garbage collection to finish.
DEFAULT_SAVE_WAIT = 600.0

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_NAME_RULES = (
    "use 1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit, without '..'"
)
LATEST = "latest"  # RUN@latest: the newest generation, whatever a tag is named
PUBLISH_ACTIONS = ("advance", "recovered")  # reflog records that name a published root
REFLOG_ACTIONS = (*PUBLISH_ACTIONS, "collect")
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")

Record = dict[str, Any]
_View = TypeVar("_View", bound="ReflogView")


def is_valid_name(name: object) -> bool:
    """True for a safe run or tag name (it becomes a file or key name in every backend)."""
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and ".." not in name


def validate_run_name(run: str) -> str:
    """Return ``run`` if it is a safe run name, else raise InvalidNameError."""
    if not is_valid_name(run):
        raise InvalidNameError(
            f"invalid run name {run!r}: {_NAME_RULES}",
            run=run if isinstance(run, str) else repr(run),
        )
    return run


def validate_stored_tag_name(name: str, *, run: str | None = None) -> str:
    """Return ``name`` if a tag may be stored, read or removed under it: a safe name (the
    rules of run names). Untag takes any such name, so a tag named before the rules of
    :func:`validate_tag_name` (``123``, ``latest``) can still be removed."""
    if not is_valid_name(name):
        raise InvalidNameError(f"invalid tag name {name!r}: {_NAME_RULES}", run=run)
    return name


def validate_tag_name(name: str, *, run: str | None = None) -> str:
    """Return ``name`` if a tag may be written under it: a safe name that ``RUN@NAME``
    can address. There an all-digit name is always a generation id and ``latest``
    always the newest generation, so a tag of either name could never be named."""
    validate_stored_tag_name(name, run=run)
    if name.isdigit():
        raise InvalidNameError(
            f"invalid tag name {name!r}: it is all digits, and RUN@{name} always means "
            f"generation id {int(name)}, so the tag could never be named; add a letter "
            f"(e.g. 'step-{name}' or 'v{name}')",
            run=run,
        )
    if name == LATEST:
        raise InvalidNameError(
            f"invalid tag name {name!r}: RUN@latest always means the run's newest "
            "generation, so the tag could never be named; choose another name "
            "(e.g. 'latest-good')",
            run=run,
        )
    return name


@dataclass(frozen=True)
class Writer:
    """Who published a generation: host, process and job (a scheduler's job id, if any)."""

    host: str
    pid: int
    job: str | None = None

    def describe(self) -> str:
        job = f" job {self.job}" if self.job else ""
        return f"host {self.host} pid {self.pid}{job}"


@dataclass(frozen=True)
class RefValue:
    """What a ref names: the newest root of ``run`` and its generation id.

    A ref written by a save also says the generation's ``step``, the writer
    epoch of the process that published it and who that was
    (:mod:`castore.core.fencing`); refs written before epochs existed have epoch 0,
    no step and no writer. Tags leave them at their defaults.
    """

    run: str
    generation: int
    root: Digest
    time: float
    step: int | None = None
    epoch: int = 0
    writer: Writer | None = None

    def describe_writer(self) -> str:
        """Who published what this ref names, for messages."""
        who = self.writer.describe() if self.writer else "a writer that recorded no identity"
        step = f", step {self.step}" if self.step is not None else ""
        return f"generation {self.generation}{step}, by {who} (writer epoch {self.epoch})"


def check_advance(
    run: str, current: RefValue | None, *, expected: Digest | None, new: RefValue
) -> None:
    """Raise RefConflictError unless ``current`` names ``expected`` and ``new`` is newer,
    and FencedError (first) when ``new`` comes from an older writer epoch than ``current``.

    Every ref implementation calls this with the value it holds still (under a
    lock, or before a conditional write), so the refusals read the same on all.
    """
    if current is not None and new.epoch < current.epoch:
        raise FencedError(
            f"run {run!r} was taken over by a newer writer: its ref names "
            f"{current.describe_writer()}, and this save's writer epoch is {new.epoch}; "
            "nothing was published. Another job saves to this run: stop this one, or call "
            "store.claim_run() before saving if this job should own the run",
            run=run,
        )
    current_root = current.root if current else None
    if current_root != expected:
        if expected is None and current is not None and not _by_this_process(current):
            raise _first_save_lost(run, current, new)
        raise RefConflictError(
            f"ref moved: expected {expected.short if expected else 'no ref'}, "
            f"found {current_root.short if current_root else 'no ref'}; reload and retry",
            run=run,
        )
    if current is not None and new.generation <= current.generation:
        raise RefConflictError(
            f"generation ids must increase: {new.generation} after {current.generation}",
            run=run,
        )


def _by_this_process(value: RefValue) -> bool:
    """Whether this process published ``value`` (another of its threads, say)."""
    return value.writer is not None and (value.writer.host, value.writer.pid) == (
        socket.gethostname(),
        os.getpid(),
    )


def _first_save_lost(run: str, current: RefValue, new: RefValue) -> RefConflictError:
    """The first save of a fresh run found that another writer published first.

    "Reload and retry" would be wrong advice: a retry publishes on top of the
    other job's generation, taking the run over from it.
    """
    return RefConflictError(
        f"another job is saving to run {run!r}: this save began when the run had no "
        f"generation, and {current.describe_writer()} was published first; nothing of "
        f"this save (generation {new.generation}) was published. Save to another run, "
        "or, if this job should own the run, call store.claim_run() and save again",
        run=run,
    )


def check_new_value(run: str, new: RefValue) -> None:
    """The arguments of an advance: a safe run name, and a value of that run."""
    validate_run_name(run)
    if new.run != run:
        raise ValueError(f"ref value names run {new.run!r}, not {run!r}")


def run_lock_busy(run: str, timeout: float) -> str:
    return f"ref lock of run {run!r} busy for {timeout:.0f}s"


def make_reflog_record(
    run: str,
    value: RefValue,
    *,
    parent: Digest | None,
    action: str,
    wrote: dict[str, int] | None = None,
) -> Record:
    """The record of one ref advance (or collection) of ``run``, as every backend stores it.

    ``wrote``: what a copy that publishes here (``castore copy``, a tier's
    promotion) wrote into this store (docs/FORMAT.md, "Reflog": an optional
    key that readers which do not know it ignore).
    """
    if action not in REFLOG_ACTIONS:
        raise ValueError(f"reflog action must be one of {REFLOG_ACTIONS}, got {action!r}")
    record: Record = {
        "action": action,
        "generation": value.generation,
        "host": socket.gethostname(),
        "parent": parent.hex if parent else None,
        "pid": os.getpid(),
        "root": value.root.hex,
        "run": run,
        "time": value.time,
    }
    if wrote is not None:
        record["wrote"] = dict(wrote)
    return record


def is_reflog_record(record: Any, run: str) -> bool:
    """A record is only trusted if it has the shape castore writes (see docs/FORMAT.md)."""
    if not isinstance(record, dict):
        return False
    generation, stamp, parent = record.get("generation"), record.get("time"), record.get("parent")
    return (
        record.get("action") in REFLOG_ACTIONS
        and record.get("run") == run
        and isinstance(generation, int)
        and not isinstance(generation, bool)
        and generation >= 1
        and isinstance(record.get("root"), str)
        and bool(_HEX_DIGEST.fullmatch(record["root"]))
        and (parent is None or (isinstance(parent, str) and bool(_HEX_DIGEST.fullmatch(parent))))
        and isinstance(stamp, (int, float))
        and not isinstance(stamp, bool)
        and math.isfinite(stamp)
    )


class ReflogView:
    """The records of one reflog, oldest first, and what they say.

    Built record by record (:meth:`add`), so an implementation can extend a
    view with the records appended since it was built instead of starting over.
    ``damaged`` holds the positions of entries that are not intact records
    (1-based line numbers in a local reflog file).
    """

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.damaged: list[int] = []
        self.listed: dict[str, int] = {}  # root hex -> id: published and not collected
        self.collected: set[str] = set()  # root hexes garbage collection dropped

    def add(self, record: Record) -> None:
        self.records.append(record)
        root = record["root"]
        if record["action"] == "collect":
            self.collected.add(root)
            self.listed.pop(root, None)
        elif root not in self.collected:
            self.listed[root] = record["generation"]

    def copy(self: _View) -> _View:
        """An independent copy (a subclass's scalar fields included)."""
        other = copy.copy(self)
        other.records, other.damaged = list(self.records), list(self.damaged)
        other.listed, other.collected = dict(self.listed), set(self.collected)
        return other


class PublishedStream:
    """(root hex, id) pairs, newest first, and the collected roots seen so far.

    Read backwards, a collect record comes before (is newer than) the publish
    record it cancels, so ``collected`` holds every root collected after the
    last pair yielded.
    """

    def __init__(self, pairs: Iterator[tuple[str, int]], collected: set[str]) -> None:
        self._pairs = pairs
        self.collected = collected

    @classmethod
    def from_records(cls, records: Iterator[Record]) -> PublishedStream:
        """From records newest first."""
        stream = cls(iter(()), set())
        stream._pairs = stream._from(records)
        return stream

    @classmethod
    def from_view(cls, view: ReflogView) -> PublishedStream:
        return cls(reversed(list(view.listed.items())), set(view.collected))

    def _from(self, records: Iterator[Record]) -> Iterator[tuple[str, int]]:
        seen: set[str] = set()
        for record in records:
            root = record["root"]
            if record["action"] == "collect":
                self.collected.add(root)
            elif root not in self.collected and root not in seen:
                seen.add(root)
                yield root, record["generation"]

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return self._pairs
