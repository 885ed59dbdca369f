"""A process that ends with an async save in flight: the save publishes, or stderr and
the exit status say it did not.

Each test runs tests/helpers/exit_workers.py in a real process and ends it for real:
falling off the end, ``sys.exit``, an exception, a real SIGINT or SIGTERM. Its
chunks are 256 KiB, so the writer hashes on castore's shared pool, which
interpreter exit shuts down; the writer is paced so that the save is still in
flight when the process starts to end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import exit_workers
import pytest
from _helpers import assert_state_equal

import castore

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(exit_workers.__file__)
RUN = exit_workers.RUN
# 3 MiB at 4 MiB/s: in flight for most of a second after save() returns.
PACED = {"rate": str(4 << 20)}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    """A store whose run already has generation 1 (step 1): the one a lost save leaves."""
    store_path = tmp_path / "store"
    with castore.open(store_path, chunk_size=exit_workers.CHUNK) as store:
        store.save(exit_workers.state(1), run=RUN, step=1)
    return store_path


def start(path: Path, how: str, opts: dict[str, str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_FAULTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["PYTHONFAULTHANDLER"] = "1"
    if "faults" in opts:
        env["CASTORE_FAULTS"] = opts.pop("faults")
    args = [f"{key}={value}" for key, value in opts.items()]
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(path), how, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        preexec_fn=_interruptible,
    )


def _interruptible() -> None:
    """In the worker before exec: SIGINT at its default, as at a terminal.

    A suite started in the background (``nohup make test &``) ignores SIGINT, and
    an ignored signal stays ignored across exec: Python would then install no
    KeyboardInterrupt handler, and the Ctrl-C cases would test nothing.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_to_end(
    path: Path,
    how: str,
    opts: dict[str, str],
    *,
    send: int | None = None,
    after: str = "",
    pause: float = 0.0,
) -> tuple[int, str, str]:
    """Run a worker; with ``send``, signal it ``pause`` s after its stdout showed ``after``."""
    child = start(path, how, dict(opts))
    try:
        out = ""
        if send is not None:
            assert child.stdout is not None
            for line in child.stdout:
                out += line
                if after in line:
                    break
            time.sleep(pause)
            child.send_signal(send)
        try:
            rest, err = child.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGABRT)  # faulthandler shows where each thread hangs
            rest, err = child.communicate(timeout=30)
            pytest.fail(f"{how} worker hung; its threads:\n{err}")
    finally:
        child.kill()
    return child.returncode, out + rest, err


def steps(path: Path) -> list[int]:
    with castore.open(path) as store:
        return [generation.step for generation in store.generations(RUN)]


def assert_published(path: Path) -> None:
    """Step 2 is latest, and loads as exactly what the worker saved."""
    assert steps(path) == [1, 2]
    with castore.open(path) as store:
        assert_state_equal(store.load(RUN), exit_workers.state(2))


def assert_previous_intact(path: Path) -> None:
    assert steps(path) == [1]
    with castore.open(path) as store:
        assert_state_equal(store.load(RUN), exit_workers.state(1))


def not_published_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "was NOT published" in line]


# -- the process ends with the save in flight: it publishes --------------------------------


@pytest.mark.parametrize(("how", "code"), [("return", 0), ("sys.exit", 0), ("raise", 1)])
def test_exit_with_a_save_in_flight_on_the_hashing_pool_publishes_it(
    path: Path, how: str, code: int
) -> None:
    rc, out, err = run_to_end(path, how, PACED)
    assert rc == code and "returned" in out, err
    assert not_published_lines(err) == [] and "cannot schedule" not in err, err
    if how == "raise":
        assert "training failed after the save returned" in err
    assert_published(path)


def test_ctrl_c_after_the_save_returned_waits_for_it_to_publish(path: Path) -> None:
    rc, _, err = run_to_end(path, "wait", PACED, send=signal.SIGINT, after="returned")
    # An uncaught KeyboardInterrupt ends Python by SIGINT once it has finalized.
    assert rc == -signal.SIGINT and "KeyboardInterrupt" in err, err
    assert not_published_lines(err) == [], err
    assert_published(path)


def test_sigterm_after_the_save_returned_waits_for_it_then_exits_143(path: Path) -> None:
    rc, _, err = run_to_end(path, "wait", PACED, send=signal.SIGTERM, after="returned")
    assert rc == 143, err
    assert f"castore: SIGTERM: waiting up to 600 s for the save of {RUN} step 2" in err, err
    assert_published(path)


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_multiprocessing_child_waits_for_its_save_as_it_ends(
    path: Path, start_method: str
) -> None:
    # A forked child leaves through os._exit, never running atexit: only the wait
    # inside threading._shutdown(), which Process._bootstrap calls, saves its save.
    rc, out, err = run_to_end(path, start_method, {})
    assert rc == 0 and "child exit 0" in out, out + err
    assert_published(path)


def test_a_child_forked_during_a_save_ends_at_once_and_the_parent_publishes(
    path: Path,
) -> None:
    # The child holds a copy of the handle with the save in flight but no writer:
    # waiting for it would hold the child for exit_wait_s (20 s here).
    rc, out, err = run_to_end(path, "fork-during-save", {**PACED, "exit_wait": "20"})
    assert rc == 0 and "child exit 0 after 0s" in out, out + err
    assert_published(path)


# -- SIGTERM with no save in flight, or a handler of the user's: as before -------------------


def test_sigterm_once_the_save_has_published_kills_as_sigterm_always_did(path: Path) -> None:
    rc, _, err = run_to_end(path, "published", {}, send=signal.SIGTERM, after="returned")
    assert rc == -signal.SIGTERM and "castore: SIGTERM" not in err, err
    assert_published(path)


def test_a_users_sigterm_handler_stays_in_place_and_the_save_still_publishes(
    path: Path,
) -> None:
    rc, out, err = run_to_end(
        path, "user-sigterm", PACED, send=signal.SIGTERM, after="user handler in place"
    )
    assert "user handler in place: True" in out, out + err
    assert rc == 7 and "user handler ran" in out and "castore: SIGTERM" not in err, out + err
    assert_published(path)


# -- interrupted while staging: nothing published, and the interrupt says so ---------------

# 12 MiB through 512 KiB of staging at 2 MiB/s: staging takes about six seconds, and
# the signal lands 1.5 s after the worker's marker, just before its save() call.
SLOW_STAGING = {"mib": "12", "staging": str(512 << 10), "rate": str(2 << 20)}
INTO_STAGING = 1.5


@pytest.mark.parametrize("api", ["store", "dist"])
def test_ctrl_c_while_staging_says_nothing_was_published_and_the_previous_is_intact(
    path: Path, api: str
) -> None:
    rc, _, err = run_to_end(
        path,
        "staging",
        {**SLOW_STAGING, "api": api},
        send=signal.SIGINT,
        after="staging",
        pause=INTO_STAGING,
    )
    last = err.strip().splitlines()[-1]
    assert rc == -signal.SIGINT, err
    note = (
        "castore: save interrupted: nothing was published; "
        f"the previous generation of {RUN!r} (1) is intact"
    )
    assert last == f"KeyboardInterrupt: {note}" + (" (rank 0)" if api == "dist" else ""), err
    assert not_published_lines(err) == [], err
    assert_previous_intact(path)


def test_sigterm_while_staging_exits_143_and_publishes_nothing(path: Path) -> None:
    rc, _, err = run_to_end(
        path, "staging", SLOW_STAGING, send=signal.SIGTERM, after="staging", pause=INTO_STAGING
    )
    assert rc == 143 and "castore: SIGTERM: waiting up to" in err, err
    assert_previous_intact(path)


# -- a save that cannot publish: stderr says so and the status is not 0 ----------------------


def test_a_save_still_in_flight_after_exit_wait_s_is_named_not_published_and_exits_1(
    path: Path,
) -> None:
    rc, out, err = run_to_end(path, "return", {"rate": str(1 << 20), "exit_wait": "0.2"})
    lines = not_published_lines(err)
    assert rc == 1 and "returned" in out, err
    assert len(lines) == 1, err
    assert f"the save of {RUN} step 2 to {path}" in lines[0], lines
    assert "still in flight after exit_wait_s=0.2s" in lines[0], lines
    assert f"the previous generation of {RUN} is intact" in lines[0], lines
    assert_previous_intact(path)


def test_a_save_that_failed_in_the_background_unseen_is_named_at_exit_and_exits_1(
    path: Path,
) -> None:
    rc, _, err = run_to_end(path, "return", {**PACED, "faults": "async.before_ref_advance=raise"})
    lines = not_published_lines(err)
    assert rc == 1 and len(lines) == 1, err
    assert "failed in the background: injected fault at async.before_ref_advance" in lines[0]
    assert_previous_intact(path)
