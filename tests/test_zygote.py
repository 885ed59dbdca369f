"""castore.testing.zygote: a forked child is what ``python SCRIPT ARGS`` would be.

The suite's rank launcher (tests/helpers/dist_harness.py) and the tools' (crash drill,
resume parity) fork their processes from a zygote that imported torch; these
tests hold the promise that a forked child cannot tell the difference in what
the tests rely on. The zygote here preloads numpy only, so it starts fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from castore.testing.zygote import Zygote, ZygoteMismatch

PRELOAD = ("numpy",)


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    made = Zygote(PRELOAD, env)
    yield made
    made.close()


def script(tmp_path: Path, body: str, name: str = "child.py") -> Path:
    path = tmp_path / "scripts" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def fork(zygote: Zygote, path: Path, *args: str, tmp_path: Path, **env: str) -> tuple[int, str]:
    """Run ``path`` forked; its exit code and what it printed (stdout and stderr)."""
    log = tmp_path / f"{path.stem}-{time.monotonic_ns()}.log"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    environment.update(env)
    child = zygote.fork([str(path), *args], env=environment, cwd=tmp_path, stdout=log, stderr=log)
    code = child.wait(60)
    return code, log.read_text()


def test_a_forked_child_has_the_argv_env_cwd_path_and_streams_of_a_fresh_one(
    zygote: Zygote, tmp_path: Path
) -> None:
    extra = tmp_path / "on-pythonpath"
    extra.mkdir()
    (extra / "helper_mod.py").write_text("VALUE = 42\n")
    child = script(
        tmp_path,
        """
        import json, os, sys
        import helper_mod
        print(json.dumps({
            "argv": sys.argv[1:],
            "path0": sys.path[0],
            "cwd": os.getcwd(),
            "mine": os.environ.get("ONLY_MINE"),
            "castore_loaded": "castore" in sys.modules,
            "numpy_preloaded": "numpy" in sys.modules,
            "value": helper_mod.VALUE,
            "session_leader": os.getsid(0) == os.getpid(),
            "name": __name__,
            "stdin": sys.stdin.read(),
        }))
        print("to stderr", file=sys.stderr)
        """,
    )
    code, out = fork(
        zygote, child, "a", "b c", tmp_path=tmp_path, ONLY_MINE="yes", PYTHONPATH=str(extra)
    )
    assert code == 0, out
    report = json.loads(out.splitlines()[0])
    assert report == {
        "argv": ["a", "b c"],
        "path0": str(child.parent),
        "cwd": str(tmp_path),
        "mine": "yes",
        "castore_loaded": False,  # castore's import-time settings are the child's own
        "numpy_preloaded": True,
        "value": 42,
        "session_leader": True,  # killpg(pid) reaches all of it
        "name": "__main__",
        "stdin": "",
    }
    assert "to stderr" in out


@pytest.mark.parametrize(
    ("body", "expected", "printed"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("raise SystemExit('bad input')", 1, "bad input"),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("pass", 0, ""),
    ],
)
def test_exit_status_is_what_an_interpreter_gives(
    zygote: Zygote, tmp_path: Path, body: str, expected: int, printed: str
) -> None:
    code, out = fork(zygote, script(tmp_path, body), tmp_path=tmp_path)
    assert code == expected, out
    assert printed in out


def test_threads_and_atexit_run_at_the_end_as_in_an_interpreter(
    zygote: Zygote, tmp_path: Path
) -> None:
    """A non-daemon thread is joined and atexit runs: castore's exit wait relies on both."""
    marks = tmp_path / "marks"
    child = script(
        tmp_path,
        f"""
        import atexit, threading, time
        from pathlib import Path
        marks = Path({str(marks)!r})
        def late():
            time.sleep(0.3)
            with marks.open("a") as f:
                f.write("thread\\n")
        threading.Thread(target=late).start()
        threading._register_atexit(lambda: marks.open("a").write("threading-hook\\n"))
        atexit.register(lambda: marks.open("a").write("atexit\\n"))
        """,
    )
    code, out = fork(zygote, child, tmp_path=tmp_path)
    assert code == 0, out
    assert marks.read_text().splitlines() == ["threading-hook", "thread", "atexit"]


def test_sigkill_and_killpg_reach_a_forked_child(zygote: Zygote, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    child = script(
        tmp_path,
        f"""
        import time
        from pathlib import Path
        Path({str(ready)!r}).touch()
        time.sleep(60)
        """,
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    first = zygote.fork([str(child)], env=environment)
    second = zygote.fork([str(child)], env=environment)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        first.wait(0.1)
    first.kill()
    os.killpg(second.pid, signal.SIGKILL)
    assert first.wait(30) == -signal.SIGKILL
    assert second.wait(30) == -signal.SIGKILL


def test_numpy_is_seeded_afresh_in_each_child(zygote: Zygote, tmp_path: Path) -> None:
    child = script(tmp_path, "import numpy; print(numpy.random.randint(0, 2**31))")
    draws = {fork(zygote, child, tmp_path=tmp_path)[1] for _ in range(3)}
    assert len(draws) == 3, draws


def test_an_import_time_setting_that_differs_needs_a_fresh_interpreter(
    zygote: Zygote, tmp_path: Path
) -> None:
    environment = dict(os.environ, OMP_NUM_THREADS="7")
    if os.environ.get("OMP_NUM_THREADS") == "7":
        environment["OMP_NUM_THREADS"] = "5"
    with pytest.raises(ZygoteMismatch, match="import-time setting"):
        zygote.fork([str(script(tmp_path, "pass"))], env=environment)


def test_a_zygote_that_is_gone_refuses_and_its_orphans_are_reported_killed(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    made = Zygote(PRELOAD, env)
    child = made.fork([str(script(tmp_path, "import time; time.sleep(60)"))], env=env)
    made.proc.kill()
    made.proc.wait()
    assert child.wait(30) == -signal.SIGKILL  # its status was lost with the zygote
    with pytest.raises(ZygoteMismatch, match="exited"):
        made.fork([sys.executable], env=env)


def test_the_zygote_script_imports_nothing_of_castore() -> None:
    """Its interpreter must not have read castore's import-time settings (CASTORE_FAULTS)."""
    import ast

    import castore.testing.zygote as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = [
        alias.name if isinstance(node, ast.Import) else f"{node.module}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert imported and not [name for name in imported if name.startswith("castore")]


def test_castore_faults_are_an_import_time_setting_only_where_castore_is_preloaded(
    zygote: Zygote, tmp_path: Path
) -> None:
    """castore reads ``CASTORE_FAULTS`` at import: a zygote that imported castore has them fixed."""
    armed = dict(os.environ, CASTORE_FAULTS="gc.mid_sweep")
    code, printed = fork(
        zygote,
        script(tmp_path, "from castore.support import faults; print(sorted(faults._ARMED))"),
        tmp_path=tmp_path,
        CASTORE_FAULTS="gc.mid_sweep",
    )
    assert code == 0 and "gc.mid_sweep" in printed, printed  # imported fresh in the child
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    with_castore = Zygote(("castore.support.faults",), env)
    try:
        with pytest.raises(ZygoteMismatch, match="import-time setting"):
            with_castore.fork([str(script(tmp_path, "pass"))], env=armed)
        child = with_castore.fork([str(script(tmp_path, "pass"))], env=env)
        assert child.wait(60) == 0
    finally:
        with_castore.close()


def test_the_cli_runner_gives_what_a_fresh_interpreter_gives(tmp_path: Path) -> None:
    """tests/helpers/cli_runner.run_cli, forked or fresh: the same status, stdout and stderr."""
    import numpy as np
    from cli_runner import clean_env, run_cli

    import castore

    with castore.open(tmp_path / "store", chunk_size=1024) as store:
        store.save({"w": np.arange(300, dtype=np.float32)}, run="r", step=1)
    fresh_env = clean_env(CASTORE_ZYGOTE="0")
    for args in (("verify", tmp_path / "store"), ("show", tmp_path / "store", "nope")):
        forked, fresh = run_cli(*args), run_cli(*args, env=fresh_env)
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            fresh.returncode,
            fresh.stdout,
            fresh.stderr,
        )
    assert forked.returncode == 1 and forked.stderr.startswith("castore: error:")
