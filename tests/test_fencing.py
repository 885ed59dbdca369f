"""One writer per run: a newer job fences an older one, steps never go back unasked.

Each writer is a real process (tests/helpers/fence_workers.py) on a real store: a
local LMDB store, a shared directory, or S3 (moto). The parent drives them
line by line, so the interleavings are exact, not left to timing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
from blob_places import Place, s3_place, shared_place

import castore
from castore.repo.records import RefValue
from castore.repo.reffile import encode_ref, replace_file
from castore.testing.zygote import TORCH_PRELOAD, ForkedProcess, ZygoteMismatch
from castore.testing.zygote import shared as shared_zygote

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
WORKER = HERE / "helpers" / "fence_workers.py"
RUN = "r"


class Writer:
    """A writer process on one store, obeying one command at a time.

    Forked from the zygote (torch imported once: the dist, train and dcp saves
    need it) and driven over a Unix socket; a fresh interpreter on pipes where
    there is no zygote.
    """

    def __init__(self, place: Place, job: str) -> None:
        env = {**os.environ, **place.env, "CASTORE_JOB_ID": job}
        argv = [str(WORKER), place.address, json.dumps(place.options)]
        self.process: subprocess.Popen[str] | ForkedProcess
        self._folder = tempfile.TemporaryDirectory(prefix="fence-")  # a short socket path
        self.log = Path(self._folder.name, "stderr")
        self.process, (self._in, self._out) = self._forked(argv, env) or self._fresh(argv, env)
        self.pid = json.loads(self._line())["ready"]

    def _forked(
        self, argv: list[str], env: dict[str, str]
    ) -> tuple[ForkedProcess, tuple[IO[str], IO[str]]] | None:
        zygote = shared_zygote(TORCH_PRELOAD, env)
        if zygote is None:
            return None
        where = str(Path(self._folder.name, "socket"))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(where)
            listener.listen(1)
            try:
                process = zygote.fork([*argv, where], env=env, cwd=HERE, stderr=self.log)
            except ZygoteMismatch:
                return None
            listener.settimeout(1.0)
            deadline = time.monotonic() + 120
            while True:
                try:
                    connection, _ = listener.accept()
                    break
                except TimeoutError:
                    assert process.poll() is None, f"writer exited: {self._log_tail()}"
                    assert time.monotonic() < deadline, "writer did not connect in 120 s"
        connection.settimeout(None)
        return process, (connection.makefile("w"), connection.makefile("r"))

    def _fresh(
        self, argv: list[str], env: dict[str, str]
    ) -> tuple[subprocess.Popen[str], tuple[IO[str], IO[str]]]:
        process = subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=HERE,
        )
        assert process.stdin is not None and process.stdout is not None
        return process, (process.stdin, process.stdout)

    def _log_tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""

    def _line(self) -> str:
        line = self._out.readline()
        assert line, f"writer exited with {self.process.wait(timeout=30)}: {self._log_tail()}"
        return line

    def __call__(self, op: str, **fields: Any) -> dict[str, Any]:
        self._in.write(json.dumps({"op": op, **fields}) + "\n")
        self._in.flush()
        answer: dict[str, Any] = json.loads(self._line())
        return answer

    def save(self, step: int, mode: str = "store") -> dict[str, Any]:
        return self("save", step=step, mode=mode)

    def close(self) -> None:
        self._in.write(json.dumps({"op": "quit"}) + "\n")
        self._in.close()
        assert self.process.wait(timeout=60) == 0
        self._folder.cleanup()


@contextmanager
def writers(place: Place, *jobs: str) -> Iterator[list[Writer]]:
    started: list[Writer] = []
    try:
        for job in jobs:
            started.append(Writer(place, job))
        yield started
    finally:
        for writer in started:
            if writer.process.poll() is None:
                writer.close()


@pytest.fixture(params=["local", "shared", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "local":
        return Place("local", str(tmp_path / "local"))
    if request.param == "shared":
        return shared_place(tmp_path / "shared")
    return s3_place(request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket"))


def ref(place: Place) -> RefValue:
    with castore.open(place.address, **place.options) as store:
        value = store.refs.read(RUN)
    assert value is not None
    return value


def steps(place: Place) -> list[int]:
    with castore.open(place.address, **place.options) as store:
        return [generation.step for generation in store.generations(RUN)]


# -- the zombie job: fenced on every backend --------------------------------------------


def test_a_restarted_job_fences_the_old_one_on_every_backend(place: Place) -> None:
    with writers(place, "old", "new") as (old, new):
        assert old.save(5)["ok"] and old.save(10)["ok"]
        assert ref(place).epoch == 1
        # The scheduler restarts the job; the old one's node is partitioned, not dead.
        assert new("load")["step"] == 10
        assert new.save(15)["ok"]
        assert ref(place).epoch == 2
        fenced = old.save(15)
        assert fenced["error"] == "FencedError"
        # The message names the writer that took over: its host, pid and job.
        assert f"pid {new.pid}" in fenced["message"] and "CASTORE_JOB_ID=new" in fenced["message"]
        assert "nothing of step 15 is published" in fenced["message"]
        assert new.save(20)["ok"]
    assert steps(place) == [5, 10, 15, 20]
    latest = ref(place)
    assert (latest.step, latest.epoch) == (20, 2)
    assert latest.writer is not None and latest.writer.job == "CASTORE_JOB_ID=new"


def test_a_fenced_process_that_loads_the_run_again_resumes_it(tmp_path: Path) -> None:
    place = Place("local", str(tmp_path / "store"))
    with writers(place, "first", "second") as (first, second):
        assert first.save(1)["ok"]
        assert second("load")["step"] == 1 and second.save(2)["ok"]
        assert first.save(3)["error"] == "FencedError"
        assert first("load")["step"] == 2  # a resume: its next save claims the run again
        assert first.save(3)["ok"]
        assert second.save(4)["error"] == "FencedError"
    assert steps(place) == [1, 2, 3]
    assert ref(place).epoch == 3


@pytest.mark.parametrize("mode", ["async", "dist", "train", "dcp"])
def test_every_save_path_is_fenced(tmp_path: Path, mode: str) -> None:
    place = Place("local", str(tmp_path / "store"))
    with writers(place, "old", "new") as (old, new):
        assert old.save(1, mode)["ok"]
        new("load") if mode != "dcp" else None
        taken = new.save(2, mode)
        assert taken["ok"], taken
        fenced = old.save(3, mode)
        assert fenced["ok"] is False and "FencedError" in fenced["error"] + fenced["message"]
        assert "taken over by a newer writer" in fenced["message"]
    latest = ref(place)
    assert (latest.generation, latest.step, latest.epoch) == (2, 2, 2)


def test_a_zombie_cannot_amend_the_run_a_newer_writer_took(tmp_path: Path) -> None:
    """castore.amend publishes through the same fence: the old job, taken over, is
    refused; the writer that took the run over amends it."""
    place = Place("local", str(tmp_path / "store"))
    with writers(place, "old", "new") as (old, new):
        assert old.save(5)["ok"]
        assert new("load")["step"] == 5 and new.save(10)["ok"]
        fenced = old("amend", to="w2")
        assert fenced["error"] == "FencedError", fenced
        assert new("amend", to="w3")["generation"] == 3
    assert steps(place) == [5, 10, 10]
    assert ref(place).epoch == 2


# -- the interleaving of two copies of one job ---------------------------------------------


def test_two_copies_of_a_job_never_interleave(tmp_path: Path) -> None:
    # The log: 5, 10, 15, 10, 20, 15, 20. Now the second copy's first save,
    # a step below the run's latest, is refused, and the run's steps only grow.
    place = Place("local", str(tmp_path / "store"))
    with writers(place, "first", "second") as (first, second):
        assert first.save(5)["ok"] and first.save(10)["ok"] and first.save(15)["ok"]
        refused = second.save(10)
        assert refused["error"] == "StepOrderError"
        assert "step 10 is below step 15" in refused["message"]
        assert f"pid {first.pid}" in refused["message"]
        assert first.save(20)["ok"]
    assert steps(place) == [5, 10, 15, 20]


def test_a_second_copy_that_passes_the_step_takes_over_and_the_first_is_told(
    tmp_path: Path,
) -> None:
    place = Place("local", str(tmp_path / "store"))
    with writers(place, "first", "second") as (first, second):
        assert first.save(5)["ok"]
        assert second.save(10)["ok"]  # no load: a claim all the same, at a higher step
        fenced = first.save(10)
        assert fenced["error"] == "FencedError" and "CASTORE_JOB_ID=second" in fenced["message"]
    assert steps(place) == [5, 10]


def test_a_resumed_job_saves_below_the_zombies_steps_and_says_whom_it_fenced(
    tmp_path: Path,
) -> None:
    place = Place("local", str(tmp_path / "store"))
    with writers(place, "zombie", "restarted") as (zombie, restarted):
        assert zombie.save(15)["ok"]
        assert restarted("load")["step"] == 15
        assert zombie.save(20)["ok"] and zombie.save(25)["ok"]  # still running, unseen
        taken = restarted.save(20)  # below the zombie's 25, after its own resume point
        assert taken["ok"], taken
        (warning,) = taken["warnings"]
        assert warning.startswith("ConcurrentWriterWarning")
        assert f"pid {zombie.pid}" in warning and "CASTORE_JOB_ID=zombie" in warning
        assert "step 25" in warning
        assert zombie.save(30)["error"] == "FencedError"
    assert steps(place) == [15, 20, 25, 20]
    assert ref(place).epoch == 2


def test_the_common_resume_needs_no_argument_and_warns_nothing(tmp_path: Path) -> None:
    place = Place("local", str(tmp_path / "store"))
    with writers(place, "job") as (first,):
        assert first.save(1)["ok"] and first.save(2)["ok"]
    with writers(place, "job") as (again,):  # the job, restarted after a crash
        assert again("load")["step"] == 2
        answers = [again.save(3), again.save(4)]
        assert all(a["ok"] and not a["warnings"] for a in answers), answers
    assert ref(place).epoch == 2


def test_a_job_resumed_from_an_older_generation_than_its_crashed_run_warns_nothing(
    tmp_path: Path,
) -> None:
    # The crashed job published generations after the checkpoint the restart loads
    # (Lightning's last.ckpt one save behind, a tiers restore from the durable tier):
    # they were published before this process loaded the run, so no other writer.
    place = Place("local", str(tmp_path / "store"))
    with writers(place, "job") as (first,):
        assert all(first.save(step)["ok"] for step in (1, 2, 3))
    with writers(place, "job") as (again,):
        assert again("load", generation=2)["step"] == 2
        answers = [again.save(3), again.save(4)]
        assert all(a["ok"] and not a["warnings"] for a in answers), answers
    assert steps(place) == [1, 2, 3, 3, 4]
    assert ref(place).epoch == 2


def test_a_writer_that_advances_the_run_after_an_older_load_is_warned_of(
    tmp_path: Path,
) -> None:
    # The control: the old job is alive (a zombie) and saves after the restart loaded.
    place = Place("local", str(tmp_path / "store"))
    with writers(place, "zombie", "restarted") as (zombie, restarted):
        assert all(zombie.save(step)["ok"] for step in (1, 2, 3))
        assert restarted("load", generation=2)["step"] == 2
        assert zombie.save(4)["ok"]  # after the load: a writer this process never saw
        taken = restarted.save(3)
        assert taken["ok"], taken
        (warning,) = taken["warnings"]
        assert warning.startswith("ConcurrentWriterWarning")
        assert f"pid {zombie.pid}" in warning and "generation 4, step 4" in warning
        assert "when its newest generation was 3" in warning
        assert zombie.save(5)["error"] == "FencedError"


# -- two fresh jobs racing the first save of a run -------------------------------------


def test_two_jobs_racing_the_first_save_the_loser_is_told_another_job_saves(
    place: Place,
) -> None:
    with writers(place, "first", "second") as (first, second):
        assert first("hold", step=1)["ok"]  # it read "no ref" and waits at the swap
        assert second.save(1)["ok"]
        lost = first("release")
        assert lost["error"] == "RefConflictError", lost
        message = lost["message"]
        assert "another job is saving to run 'r'" in message
        assert f"pid {second.pid}" in message and "CASTORE_JOB_ID=second" in message
        assert "nothing of this save (generation 1) was published" in message
        assert "Save to another run" in message and "store.claim_run()" in message
        assert "reload and retry" not in message
        assert second.save(2)["ok"]  # the winner goes on, unfenced
    assert steps(place) == [1, 2]


# -- the step rule ---------------------------------------------------------------------


def test_a_step_below_the_latest_is_refused_unless_claimed(tmp_path: Path) -> None:
    place = Place("local", str(tmp_path / "store"))
    with writers(place, "job") as (job,):
        assert job.save(10)["ok"]
        again = job.save(10)  # the same step twice is no step back
        assert again["ok"]
        refused = job.save(9)
        assert refused["error"] == "StepOrderError" and "claim_run" in refused["message"]
        assert job("claim")["ok"]
        assert job.save(0)["ok"]  # a restart of the run, on purpose
        assert job.save(1)["ok"]
    assert steps(place) == [10, 10, 0, 1]
    assert ref(place).epoch == 2  # the claim took a new epoch


def test_a_run_saved_before_epochs_is_claimed_by_its_first_save(store_path: Path) -> None:
    store = castore.open(store_path, chunk_size=1024)
    store.save({"w": np.arange(8.0)}, run=RUN, step=7)
    # Rewrite the ref as a castore before epochs wrote it: no step, epoch or writer.
    current = store.refs.read(RUN)
    assert current is not None
    legacy = RefValue(RUN, current.generation, current.root, current.time)
    replace_file(store_path / "refs" / RUN, encode_ref(legacy), phase="writing an old ref")
    assert store.refs.read(RUN) == legacy
    store.close()

    place = Place("local", str(store_path))
    with writers(place, "job") as (job,):
        refused = job.save(6)  # the step comes from the root when the ref has none
        assert refused["error"] == "StepOrderError" and "below step 7" in refused["message"]
        assert job.save(8)["ok"]
    latest = ref(place)
    assert (latest.step, latest.epoch) == (8, 1)


def test_a_ref_records_its_writer_and_the_root_agrees(store_path: Path) -> None:
    with castore.open(store_path) as store:
        generation = store.save({"w": np.arange(4.0)}, run=RUN, step=3)
        value = store.refs.read(RUN)
    assert value is not None and value.writer is not None
    assert (value.step, value.epoch, value.writer.pid) == (3, 1, os.getpid())
    assert generation.writer["epoch"] == 1 and generation.writer["pid"] == os.getpid()
