"""Reading a run's history while a writer publishes its first generation.

A reader that finds no ref then looks for history (the reflog, the listing
of runs) to tell an empty run from one that lost its ref. A publish landing
between those reads makes the run look damaged: history, no ref. These tests
put a real publish in that gap, on a local store and a shared directory,
and check that the reader loads the generation just published instead of
raising LostRunError; a ref really lost is still LostRunError.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import castore
from castore import Store
from castore.errors import GenerationNotFoundError, LostRunError
from castore.repo.records import RefValue

STATE = {"w": np.arange(256, dtype=np.float32), "epoch": 1}


def open_kind(kind: str, path: Path) -> Store:
    return castore.open(path, shared=True) if kind == "shared" else castore.open(path)


def publish_in_the_gap(reader: Store, writer: Store, run: str) -> list[int]:
    """Make ``reader``'s first ref read of ``run`` see no ref, then let ``writer`` publish.

    The ref, the reflog and the publish are real; only the timing is forced:
    the publish lands after the reader's ref read and before it looks for history.
    """
    real: Callable[[str], RefValue | None] = reader.refs.read
    reads = [0]

    def read(name: str) -> RefValue | None:
        reads[0] += 1
        found = real(name)
        if reads[0] == 1:
            assert found is None  # the premise: nothing published yet
            writer.save(STATE, run=run, step=1)
        return found

    reader.refs.read = read  # type: ignore[method-assign]
    return reads


@pytest.mark.parametrize("kind", ["local", "shared"])
@pytest.mark.parametrize(
    "operation",
    [
        lambda store: store.load("r")["w"],
        lambda store: store.resolve("r").id,
        lambda store: [g.id for g in store.generations("r")],
    ],
    ids=["load", "resolve", "generations"],
)
def test_a_first_generation_published_after_the_ref_read_is_found_not_lost(
    kind: str, operation: Callable[[Store], Any], tmp_path: Path
) -> None:
    with open_kind(kind, tmp_path / "s") as writer, open_kind(kind, tmp_path / "s") as reader:
        writer.save(STATE, run="other", step=1)  # a store that is not empty
        reads = publish_in_the_gap(reader, writer, "r")
        got = operation(reader)
        assert reads[0] == 2  # the second read found the ref the publish wrote
        if isinstance(got, np.ndarray):
            assert got.tobytes() == STATE["w"].tobytes()
        else:
            assert got in (1, [1])


def test_a_ref_really_lost_is_still_lost_run_error(tmp_path: Path) -> None:
    with castore.open(tmp_path / "s") as store:
        store.save(STATE, run="r", step=1)
        (tmp_path / "s" / "refs" / "r").unlink()
        with pytest.raises(LostRunError, match="castore repair"):
            store.load("r")
        with pytest.raises(GenerationNotFoundError, match="no run 'never' in the store"):
            store.load("never")


WRITER = """
import sys, time
import numpy as np, castore
store = castore.open(sys.argv[1], shared=True)
deadline = time.monotonic() + float(sys.argv[2])
count = 0
while time.monotonic() < deadline:
    store.save({"w": np.arange(8.0)}, run=f"run{count}", step=1)
    count += 1
print(count)
"""


@pytest.mark.slow
def test_a_reader_racing_first_publishes_never_sees_a_lost_run(tmp_path: Path) -> None:
    """A writer process publishes the first generation of run after run; a reader polls each.

    Statistical: the reader's ref read and history read must straddle a
    publish for the old bug to show, which happens on some runs, not all.
    """
    path = tmp_path / "s"
    castore.open(path, shared=True).close()
    seconds = 6.0
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), str(path), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    found = 0
    with castore.open(path, shared=True) as reader:
        run, deadline = 0, time.monotonic() + seconds + 30
        while writer.poll() is None and time.monotonic() < deadline:
            try:
                reader.resolve(f"run{run}")
            except GenerationNotFoundError:
                continue  # not published yet: poll again
            found += 1
            run += 1
    out, _ = writer.communicate(timeout=60)
    assert writer.returncode == 0
    assert found >= 1 and int(out) >= found
