"""Start Python scripts in milliseconds: forked from one interpreter that imported torch.

A test suite or a drill that starts hundreds of rank processes pays, in each,
the seconds that importing torch takes. A *zygote* pays it once: it is a
process that imports the slow modules (``preload``) and then, on request,
forks a child that runs ``python SCRIPT ARGS...`` as a fresh interpreter would:

- its own session and process group (``killpg`` and SIGKILL work as usual);
- the given environment, working directory, stdin/stdout/stderr files and
  ``sys.argv``; ``sys.path`` as ``python SCRIPT`` builds it (the script's
  directory, then ``PYTHONPATH``, then the site paths);
- the script run as ``__main__``; at its end, what an interpreter does at exit
  (``threading``'s exit hooks and non-daemon threads, ``atexit``), and the
  exit status an interpreter would give (an uncaught exception: traceback, 1;
  ``SystemExit``: its code);
- random streams of its own, as in a new process: ``random``, ``tempfile``'s
  names and numpy's global generator reseed themselves after a fork
  (tests/test_zygote.py checks numpy's).

What a fork cannot give: settings the interpreter or the preloaded modules
read at start-up. A launch whose environment differs from the zygote's in one
of those (``OMP_NUM_THREADS``, ``PYTHONHASHSEED``, ``PYTHONWARNINGS``,
``TORCH_*``, ...; and ``CASTORE_FAULTS`` where castore is preloaded, as the
``castore`` command's zygote does) is refused with :class:`ZygoteMismatch`,
and the caller starts a fresh interpreter instead.

The parent side is :class:`Zygote` (``fork`` returns a :class:`ForkedProcess`
with the part of ``subprocess.Popen``'s interface launchers use), or
:func:`shared`, one zygote per preload list and import-time settings for the
whole process. ``CASTORE_ZYGOTE=0`` in the environment turns it off:
:func:`shared` gives None and launchers start fresh interpreters. The zygote
itself runs this file as a script, so it imports nothing of castore.
Protocol, one JSON object per line: requests ``{"id", "argv", "env", "cwd",
"stdin", "stdout", "stderr"}``; answers ``{"id", "pid"}`` or ``{"id",
"error"}``, and ``{"exit": PID, "code": C}`` once the zygote reaped a child
(``C`` negative: killed by that signal, as ``Popen.returncode``).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Environment variables a preloaded module may have read at import: a child must
# match the zygote in these, or be started fresh.
# The interpreter reads the PYTHON* ones at start-up.
_IMPORT_TIME_EXACT = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "LD_PRELOAD",
    "PYTHONHASHSEED",
    "PYTHONWARNINGS",
    "PYTHONUNBUFFERED",
    "PYTHONIOENCODING",
    "PYTHONUTF8",
    "PYTHONOPTIMIZE",
    "PYTHONDEVMODE",
    "PYTHONFAULTHANDLER",
    "PYTHONMALLOC",
)
_IMPORT_TIME_PREFIXES = (
    "TORCH_",
    "TORCHINDUCTOR_",
    "TORCHDYNAMO_",
    "PYTORCH_",
    "CUDA_",
    "NCCL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
)
# castore reads this one at import (castore.support.faults): a setting of a zygote
# that preloads castore, and only of such a one, so that the rank launchers' zygote
# (torch, no castore) forks ranks armed with different faults.
_CASTORE_IMPORT_TIME = ("CASTORE_FAULTS",)
_FORK_ANSWER_S = 120.0

# What a torch rank imports anyway, and takes seconds: the preload of the suite's
# and the tools' rank launchers.
TORCH_PRELOAD = (
    "numpy",
    "ml_dtypes",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.nn",
    "torch.optim",
    # torch.use_deterministic_algorithms imports it at its first call (1.3 s of
    # CPU in every rank of tools/resume_parity.py and tools/crashdrill.py).
    "torch._dynamo",
)  # the first fork waits for the zygote's imports


class ZygoteMismatch(RuntimeError):
    """This launch needs a fresh interpreter (an import-time setting differs, or no zygote)."""


def _import_time_settings(env: Mapping[str, str], preload: Sequence[str]) -> dict[str, str]:
    exact: tuple[str, ...] = _IMPORT_TIME_EXACT
    if any(name == "castore" or name.startswith("castore.") for name in preload):
        exact += _CASTORE_IMPORT_TIME
    return {
        key: value
        for key, value in env.items()
        if key in exact or key.startswith(_IMPORT_TIME_PREFIXES)
    }


class ForkedProcess:
    """A child of the zygote, with ``pid``, ``returncode``, ``poll``, ``wait``, ``kill``."""

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = code
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The parent's handle on one zygote process (started at construction)."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        environment = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        self.preload = tuple(preload)
        self.settings = _import_time_settings(environment, self.preload)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=environment,
            start_new_session=True,  # a Ctrl-C at the terminal is the parent's to handle
        )
        self._cond = threading.Condition()
        self._pids: dict[int, int | str] = {}  # request id -> pid, or why it failed
        self._exits: dict[int, int] = {}
        self._alive = True
        self._next_id = 0
        threading.Thread(target=self._read_answers, name="zygote-answers", daemon=True).start()
        atexit.register(self.close)

    @property
    def alive(self) -> bool:
        return self._alive

    def _read_answers(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self._cond:
                if "exit" in answer:
                    self._exits[int(answer["exit"])] = int(answer["code"])
                else:
                    self._pids[int(answer["id"])] = answer.get("pid") or str(answer.get("error"))
                self._cond.notify_all()
        with self._cond:
            self._alive = False
            self._cond.notify_all()

    def fork(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | os.PathLike[str] | None = None,
        stdin: str | os.PathLike[str] | None = None,
        stdout: str | os.PathLike[str] | None = None,
        stderr: str | os.PathLike[str] | None = None,
    ) -> ForkedProcess:
        """Start ``python *argv`` (argv[0]: a script's path) as a child of the zygote.

        ``stdin``/``stdout``/``stderr``: file paths (None: ``os.devnull``), opened
        for appending (truncate a log first); ``stderr`` may equal ``stdout``.
        Raises :class:`ZygoteMismatch` when the launch needs a fresh interpreter.
        """
        if _import_time_settings(env, self.preload) != self.settings:
            raise ZygoteMismatch("an import-time setting differs from the zygote's")
        request: dict[str, Any] = {
            "argv": [str(a) for a in argv],
            "env": dict(env),
            "cwd": str(cwd or os.getcwd()),
            "stdin": str(stdin or os.devnull),
            "stdout": str(stdout or os.devnull),
            "stderr": str(stderr or os.devnull),
        }
        with self._cond:
            if not self._alive:
                raise ZygoteMismatch("the zygote has exited")
            self._next_id += 1
            request["id"] = ident = self._next_id
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise ZygoteMismatch(f"the zygote has exited: {exc}") from exc
            deadline = time.monotonic() + _FORK_ANSWER_S
            while ident not in self._pids and self._alive and time.monotonic() < deadline:
                self._cond.wait(1.0)
            answer = self._pids.pop(ident, None)
        if not isinstance(answer, int):
            raise ZygoteMismatch(f"the zygote could not fork: {answer or 'no answer'}")
        return ForkedProcess(self, answer, request["argv"])

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while pid not in self._exits:
                if not self._alive:
                    # Orphaned with the zygote gone: its status is lost. Make sure it is gone.
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    self._exits[pid] = -signal.SIGKILL
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(1.0 if left is None else min(left, 1.0))
            return self._exits[pid]

    def close(self) -> None:
        """End the zygote (its children live on; their launchers reap or kill them)."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


_shared: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], Zygote | None] = {}
_shared_guard = threading.Lock()


def shared(preload: Sequence[str], env: Mapping[str, str]) -> Zygote | None:
    """This process's zygote for ``preload`` and ``env``'s import-time settings.

    Started at the first call; None when ``CASTORE_ZYGOTE=0`` or it could not start
    (or has died): the caller then starts a fresh interpreter.
    """
    if os.environ.get("CASTORE_ZYGOTE") == "0":
        return None
    key = (tuple(preload), tuple(sorted(_import_time_settings(env, preload).items())))
    with _shared_guard:
        zygote = _shared.get(key)
        if zygote is not None and not zygote.alive:
            zygote = _shared[key] = None  # died: fresh interpreters from now on
        elif key not in _shared:
            try:
                zygote = _shared[key] = Zygote(preload, env)
            except OSError:
                zygote = _shared[key] = None
        return zygote


# -- the zygote process ------------------------------------------------------------


def _serve(preload: Sequence[str]) -> int:
    """Import ``preload``, then fork a child per request until stdin closes."""
    import importlib

    requests_fd = sys.stdin.fileno()
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, sys.stdout.fileno())  # a stray print must not corrupt the answers
    os.close(devnull)
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # What the imports made lives as long as the child: the child's collections
    # (run_child's gc.collect(), each automatic full one) need not walk it again
    # (0.4 s each with torch), nor touch its pages (copy-on-write).
    gc.freeze()
    if threading.active_count() != 1:  # forking a process with threads is not safe
        print(f"zygote: {threading.active_count()} threads after preloading", file=sys.stderr)
        return 2
    # The preloaded modules' objects live as long as a child does: out of the
    # collector's sight, a child's full collection does not walk them (torch's
    # hundreds of thousands took half a second a collection) nor write to their
    # pages, which then stay shared with the zygote.
    gc.collect()
    gc.freeze()
    site_paths = sys.path[1:]  # without this file's directory

    def send(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message).encode() + b"\n")

    children: set[int] = set()
    pending = b""
    while True:
        ready, _, _ = select.select([requests_fd], [], [], 0.02)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        data = os.read(requests_fd, 1 << 16)
        if not data:
            return 0  # the parent is done (or gone); children live on
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            try:
                pid = os.fork()
            except OSError as exc:
                send({"id": request["id"], "error": f"fork: {exc}"})
                continue
            if pid == 0:
                answers.close()
                os.close(requests_fd)
                _become(request, site_paths)  # never returns
            children.add(pid)
            send({"id": request["id"], "pid": pid})


def _become(request: dict[str, Any], site_paths: list[str]) -> None:
    """In a fresh child: become ``python ARGV...`` and exit as it would."""
    code = 1
    try:
        os.setsid()
        for fd, path, flags in (
            (0, request["stdin"], os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
        ):
            opened = os.open(path, flags, 0o644)
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = os.path.abspath(request["argv"][0])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = list(dict.fromkeys([os.path.dirname(script), *extra, *site_paths]))
        sys.argv = [script, *request["argv"][1:]]
        code = _run_as_main(script)
    finally:
        os._exit(code)


def _run_as_main(script: str) -> int:
    import runpy
    import traceback

    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does at exit: threading's hooks (castore's exit wait for
    # async saves registers there) and non-daemon threads, then atexit, then flush.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream at exit
            pass
    return code


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
