"""The uploader killed: a promotion cut off by SIGKILL at each of its steps.

A process saves generations 3 and 4 through a tiered store whose durable tier
(a shared directory) already holds generation 2; the promotion of 4 runs in
the uploader process (the default) or on the saving process's own thread, and
whichever process runs it is SIGKILLed at one of the copy's fault points
(castore.support.faults). A killed uploader process leaves the saving process
running: its promotion fails, is retried at close, and fails again there.
A fresh reader of the durable tier then finds only complete generations: 2,
or 4 when the kill came after the ref advance, and every listed generation
verifies deep and loads. The next handle retries
the promotion from where it stopped and the durable tier ends with 4.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tier_workers
from _helpers import assert_state_equal
from cli_runner import clean_env

import castore
from castore.chunkstore.base import Namespace
from castore.errors import ChunkMissingError
from castore.tiers import PIN_PREFIX, open_tiered
from castore.verify import verify_store

WORKER = Path(tier_workers.__file__)

# fault point -> the generation a fresh reader of the durable tier must find newest
KILLED_AT = {
    "copy.mid_chunks": 2,
    "copy.before_root": 2,
    "copy.before_ref_advance": 2,
    "copy.after_ref_advance": 4,
}


def run_worker(
    tmp_path: Path, first: int, last: int, faults: str = "", uploader: str = "process"
) -> int:
    env = clean_env(**({"CASTORE_FAULTS": faults} if faults else {}))
    args = [str(tmp_path / "fast"), str(tmp_path / "durable"), str(first), str(last), uploader]
    done = subprocess.run(
        [sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert faults or done.returncode == 0, done.stderr
    return done.returncode


@pytest.mark.parametrize("uploader", ["process", "thread"])
@pytest.mark.parametrize("point", sorted(KILLED_AT))
def test_a_killed_promotion_leaves_complete_generations_and_is_finished_later(
    tmp_path: Path, point: str, uploader: str
) -> None:
    castore.open(tmp_path / "durable", shared=True).close()
    run_worker(tmp_path, 1, 2)  # the durable tier holds 2
    code = run_worker(tmp_path, 3, 4, f"{point}=kill", uploader)  # killed promoting 4
    # The uploader process dies and the saver lives on; a thread dies with its saver.
    assert code == (0 if uploader == "process" else -9)
    # A saver that lived retried at close in a new uploader: past copy.mid_chunks
    # (every chunk already there, no batch left to reach it) that retry finished.
    finished_at_close = uploader == "process" and point == "copy.mid_chunks"
    with castore.open(tmp_path / "durable") as durable:  # a fresh reader
        assert durable.resolve("r").id == (4 if finished_at_close else KILLED_AT[point])
        assert verify_store(durable, deep=True).ok
        for gen in durable.generations("r"):
            assert_state_equal(durable.load("r", gen.id), tier_workers.state(gen.id))
    with castore.open(tmp_path / "fast") as fast:
        owed = set() if finished_at_close else {f"{PIN_PREFIX}4"}
        assert set(fast.refs.tags("r")) == owed  # a pin while the promotion is owed
    with open_tiered(tmp_path / "fast", tmp_path / "durable") as store:
        promoted = store.wait_promotions()
        assert [(p.generation, p.error) for p in promoted] == (
            [] if finished_at_close else [(4, None)]
        )
        retried = promoted[0].copied if promoted else None
        if point == "copy.after_ref_advance":
            assert retried is None  # already published: the pin is only dropped
        elif promoted:
            assert retried is not None and retried.bytes_copied <= 4 * 2048 + 1024
        assert store.fast.refs.tags("r") == {}
    with castore.open(tmp_path / "durable") as durable:
        assert [g.id for g in durable.generations("r")] == [2, 4]
        assert verify_store(durable, deep=True).ok
        assert_state_equal(durable.load("r"), tier_workers.state(4))


def test_broken_control_a_published_generation_missing_a_chunk_fails_the_checks(
    tmp_path: Path,
) -> None:
    """Had a promotion published before its chunks were all there, the checks above fail."""
    castore.open(tmp_path / "durable", shared=True).close()
    run_worker(tmp_path, 1, 2)
    with castore.open(tmp_path / "durable") as durable:
        entry = durable.tensor_entries(durable.resolve_root("r")[1])["weight"][0]
        assert durable.backend.delete_many(Namespace.CHUNKS, [entry.chunks[0]]) == 1
        assert not verify_store(durable, deep=True).ok
        with pytest.raises(ChunkMissingError):
            durable.load("r")


UNCLOSED = """
import sys, numpy as np, castore
store = castore.open_tiered(sys.argv[1], sys.argv[2], durable_rate=4096, chunk_size=1024)
store.save({"w": np.arange(8192, dtype=np.float32)}, run="r", step=1)  # 32 KiB: 8 s at the cap
"""


def test_a_job_that_exits_without_closing_says_which_promotions_are_owed(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", UNCLOSED, str(tmp_path / "fast"), str(tmp_path / "durable")],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "1 promotion(s) to" in done.stderr and "(r@1;" in done.stderr, done.stderr
    assert "the next castore.open_tiered" in done.stderr
    with open_tiered(tmp_path / "fast", tmp_path / "durable") as store:  # retried
        assert [(p.generation, p.error) for p in store.wait_promotions()] == [(1, None)]
        assert store.durable.resolve("r").id == 1 and store.fast.refs.tags("r") == {}
