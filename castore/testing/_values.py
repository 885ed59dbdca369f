"""Values and thread helpers the contract suites share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from castore.format.hashing import Digest, digest_bytes
from castore.repo.records import RefValue


def root(label: str) -> Digest:
    """A root digest that is a pure function of ``label``."""
    return Digest(digest_bytes(label.encode()))


def value(run: str, generation: int, label: str | None = None) -> RefValue:
    """A ref value of ``run`` naming the root of ``label`` (default: the generation)."""
    return RefValue(
        run, generation, root(label or f"{run}@{generation}"), 1_700_000_000.0 + generation
    )


def race(count: int, work: Callable[[int], Any], *, timeout: float = 30.0) -> list[Any]:
    """Run ``work(i)`` for i in range(count) on threads released together.

    Returns, per thread, what ``work`` returned or the exception it raised.
    """
    start = threading.Barrier(count)
    outcomes: list[Any] = [None] * count

    def run(index: int) -> None:
        start.wait()
        try:
            outcomes[index] = work(index)
        except BaseException as exc:  # the caller inspects it
            outcomes[index] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a racing thread did not finish: a deadlock?"
    return outcomes
