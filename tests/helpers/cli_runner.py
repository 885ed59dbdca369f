"""The ``castore`` console script, run as a process, for tests: fast.

``run_cli(*args)`` runs the installed ``castore`` script in a process of its
own and returns what ``subprocess.run(..., capture_output=True, text=True)``
would. The process is forked from a zygote (castore.testing.zygote) that has
imported castore's command and its libraries once, so a call costs
milliseconds, not the ~0.7 s of CPU an interpreter takes to import them; the
child still runs the script as ``__main__`` and exits as a fresh interpreter
would (status, stdout, stderr, atexit). A call whose environment differs from
the zygote's in a start-up setting (``CASTORE_FAULTS``, ``PYTHONWARNINGS``, ...)
runs in a fresh interpreter instead, as does every call with ``CASTORE_ZYGOTE=0``
(in this process's environment or in ``env``).
Tests of the script's own start-up (``castore --help`` on a fresh install, a
closed pipe, a terminal) start it themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from castore.testing.zygote import ZygoteMismatch, shared

CLI = Path(sys.executable).parent / "castore"

# What `castore` imports, castore's command first: forked children find it imported.
CLI_PRELOAD = (
    "numpy",
    "ml_dtypes",
    "lmdb",
    "blake3",
    "msgpack",
    "tabulate",
    "tqdm",
    "castore",
    "castore.cli",
    "castore.blob.s3",
    "boto3",
    "botocore.client",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without castore's settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    env.update(extra)
    return env


def run_cli(
    *args: object,
    env: Mapping[str, str] | None = None,
    input: str | None = None,  # noqa: A002 - subprocess.run's name
    timeout: float = 60,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``castore ARGS...`` with ``env`` (default: :func:`clean_env`) and ``input`` on stdin.

    Without ``input`` stdin is ``/dev/null``: not a terminal, so ``gc`` never asks.
    On a timeout the process is killed and ``subprocess.TimeoutExpired`` raised.
    """
    argv = [str(CLI), *map(str, args)]
    environment = dict(clean_env() if env is None else env)
    fresh = environment.get("CASTORE_ZYGOTE") == "0"
    zygote = None if fresh else shared(CLI_PRELOAD, environment)
    if zygote is not None:
        with tempfile.TemporaryDirectory(prefix="castore-cli-") as scratch:
            stdin = os.devnull
            if input is not None:
                stdin = os.path.join(scratch, "stdin")
                Path(stdin).write_text(input)
            out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
            try:
                child = zygote.fork(
                    argv, env=environment, cwd=cwd, stdin=stdin, stdout=out, stderr=err
                )
            except ZygoteMismatch:
                pass
            else:
                try:
                    code = child.wait(timeout)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                    raise
                return subprocess.CompletedProcess(argv, code, _read(out), _read(err))
    return subprocess.run(
        argv,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        cwd=cwd,
    )


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:  # the child never opened it
        return ""
