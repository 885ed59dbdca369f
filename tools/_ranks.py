"""Launching a tool's ranks: N local processes joined in one gloo process group.

Two ways, as the tools need them:

- ``spawn_ranks(context, target, world, *args)`` starts ``world``
  multiprocessing children of ``context`` (``spawn``, ``forkserver``), each
  running ``target(rank, world, port, *args)`` and joining the group at
  ``tcp://127.0.0.1:PORT`` (``join_tcp_group``) on one free port;
  ``stop_ranks`` waits for them, kills what outlives the wait and gives their
  exit codes (tools/demo_dist.py, tools/cadence.py).
- ``start_workers(script, config, ...)`` starts ``world`` processes running
  ``script --worker SPEC RANK``, forked from a zygote that imported torch once
  (castore.testing.zygote; ``CASTORE_ZYGOTE=0``: fresh interpreters); each
  joins the group through a ``file://`` rendezvous and writes its result to
  ``WORKDIR/LABEL-RANK.json``
  (``run_child`` is their side). The parent waits on the returned
  :class:`Workers`, SIGKILLs what is left and reads the results
  (tools/resume_parity.py, tools/crashdrill.py).

``run_script(argv, ...)`` runs one more process of a tool to its end, forked
from the same zygote, with its output captured (crashdrill's fresh reader and
its collector).

This module imports torch only inside the functions that join a group.
tests/helpers/dist_harness.py is the test suite's own launcher (pickled values and
outcomes per rank, a retry when the port is lost); the tools keep to this one.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from castore.testing.zygote import ForkedProcess

# -- multiprocessing children on a TCP rendezvous ---------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def join_tcp_group(rank: int, world: int, port: int) -> None:
    """This process joins the gloo group of ``world`` ranks at ``tcp://127.0.0.1:PORT``."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def spawn_ranks(context: Any, target: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Start ``target(rank, world, port, *args)`` in ``world`` processes of ``context``."""
    port = free_port()
    procs = [context.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for proc in procs:
        proc.start()
    return procs


def stop_ranks(procs: list[Any], timeout: float) -> list[int | None]:
    """Wait up to ``timeout`` seconds in all for every process; kill what still runs.

    Returns the exit codes (negative: killed by that signal).
    """
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()  # our own child, by its handle
            proc.join()
    return [proc.exitcode for proc in procs]


# -- fresh interpreters on a file rendezvous --------------------------------------

# What the tools' processes import anyway, paid once in the zygote rather than in
# each: their ranks call torch.use_deterministic_algorithms(True), which imports
# torch._inductor.config and with it torch._dynamo (seconds of CPU, most of a
# crash drill rank's time before); a store on S3 imports boto3 (a quarter of a
# second). The zygote skips a module that is not installed.
EXTRA_PRELOAD = ("torch._inductor.config", "boto3")


def worker_env(started_env: str, started: float) -> dict[str, str]:
    """The workers' environment: this one without armed fault points, plus the launch time."""
    env = {k: v for k, v in os.environ.items() if k != "CASTORE_FAULTS"}
    env[started_env] = repr(started)
    return env


@dataclass
class Workers:
    """The processes of one launch and the files they write under ``workdir``."""

    workdir: Path
    label: str
    procs: list[subprocess.Popen[bytes] | ForkedProcess]

    @property
    def logs(self) -> list[Path]:
        """Each rank's stderr."""
        return [self.workdir / f"{self.label}-{rank}.log" for rank in range(len(self.procs))]

    def running(self) -> bool:
        return any(proc.poll() is None for proc in self.procs)

    def wait(
        self, timeout: float, *, stop: Callable[[], bool] | None = None, poll: float = 0.05
    ) -> None:
        """Until every process exited, ``stop()`` is true, or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            if stop is not None and stop():
                break
            time.sleep(poll)

    def kill_remaining(self) -> list[int]:
        return kill_remaining(self.procs)

    def results(self) -> list[dict[str, Any] | None]:
        """What each rank wrote (``{"ok": ...}`` or ``{"error": ...}``), None if nothing."""
        found: list[dict[str, Any] | None] = []
        for rank in range(len(self.procs)):
            path = self.workdir / f"{self.label}-{rank}.json"
            found.append(json.loads(path.read_text()) if path.exists() else None)
        return found

    def log_tails(self, limit: int) -> str:
        """The last ``limit`` characters of every rank's non-empty log, one per line."""
        tails = [
            f"{p.name}: {p.read_text(errors='replace')[-limit:]}"
            for p in self.logs
            if p.stat().st_size
        ]
        return "\n".join(tails)


def start_workers(
    script: Path,
    config: dict[str, Any],
    *,
    phase: str,
    label: str,
    world: int,
    env: dict[str, str],
    **spec: Any,
) -> Workers:
    """Start ``script --worker SPEC RANK`` for every rank of one launch.

    SPEC (``WORKDIR/LABEL.json``) holds ``config`` and ``spec`` with the
    ``phase``, ``label``, ``world`` and a fresh ``rendezvous`` file; each rank's
    stderr goes to ``WORKDIR/LABEL-RANK.log``, its result to ``LABEL-RANK.json``.
    """
    workdir = Path(config["workdir"])
    spec_path = workdir / f"{label}.json"
    rendezvous = workdir / f"rendezvous-{label}"
    rendezvous.unlink(missing_ok=True)
    for rank in range(world):
        (workdir / f"{label}-{rank}.json").unlink(missing_ok=True)  # a result of a past launch
    spec_path.write_text(
        json.dumps(
            {
                **config,
                "phase": phase,
                "label": label,
                "world": world,
                "rendezvous": str(rendezvous),
                **spec,
            }
        )
    )
    procs: list[subprocess.Popen[bytes] | ForkedProcess] = []
    for rank in range(world):
        argv = [str(script), "--worker", str(spec_path), str(rank)]
        log = workdir / f"{label}-{rank}.log"
        log.write_bytes(b"")
        procs.append(_start(argv, env, stdout=None, stderr=log))
    return Workers(workdir, label, procs)


def run_script(
    argv: list[str], *, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python *argv`` to its end, as ``subprocess.run`` with its output captured would.

    Forked from the workers' zygote like them (a fresh interpreter without
    one): a new process that imports castore afresh, in milliseconds rather
    than an interpreter's start. On ``timeout`` it is killed and
    ``subprocess.TimeoutExpired`` raised.
    """
    with tempfile.TemporaryDirectory(prefix="castore-run-") as tmp:
        stdout, stderr = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = _start(argv, env, stdout=stdout, stderr=stderr)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_remaining([proc])
            raise
        out, err = (p.read_text(errors="replace") if p.exists() else "" for p in (stdout, stderr))
    return subprocess.CompletedProcess(argv, code, out, err)


def _start(
    argv: list[str], env: dict[str, str], *, stdout: Path | None, stderr: Path
) -> subprocess.Popen[bytes] | ForkedProcess:
    """``python *argv`` forked from the zygote, or a fresh interpreter if it refuses."""
    # Imported here: castore.testing brings pytest, which the other launchers never need.
    from castore.testing.zygote import TORCH_PRELOAD, ZygoteMismatch
    from castore.testing.zygote import shared as shared_zygote

    zygote = shared_zygote((*TORCH_PRELOAD, *EXTRA_PRELOAD), env)
    if zygote is not None:
        try:
            return zygote.fork(argv, env=env, cwd=os.getcwd(), stdout=stdout, stderr=stderr)
        except ZygoteMismatch:
            pass
    with contextlib.ExitStack() as files:
        out = files.enter_context(stdout.open("wb")) if stdout else subprocess.DEVNULL
        err = files.enter_context(stderr.open("wb"))
        return subprocess.Popen([sys.executable, *argv], env=env, stdout=out, stderr=err)


def kill_remaining(procs: list[subprocess.Popen[bytes] | ForkedProcess]) -> list[int]:
    """SIGKILL every process still running and reap all; the indices of those killed.

    Every one is signalled before any is waited for: a rank must not outlive a
    killed peer long enough to notice it and exit by itself.
    """
    killed = [i for i, proc in enumerate(procs) if proc.poll() is None]
    for i in killed:
        procs[i].send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait()
    return killed


def run_child(spec: Path, rank: int, work: Any) -> int:
    """One rank: join the gloo group, run ``work(config, rank, world)``, write its result.

    A failure is written as ``{"error": {type, message, at}}`` for the parent to judge.
    """
    import torch.distributed as dist

    config = json.loads(spec.read_text())
    world = config["world"]
    dist.init_process_group(
        "gloo", init_method=f"file://{config['rendezvous']}", rank=rank, world_size=world
    )
    out = Path(config["workdir"], f"{config['label']}-{rank}.json")
    try:
        result: dict[str, Any] = {"ok": work(config, rank, world)}
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
        error = {"type": type(exc).__name__, "message": str(exc), "at": time.time()}
        result = {"error": error}
    out.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    if "error" in result:
        os._exit(0)  # a peer may be dead: tearing down the group could block
    # The job's DDP module sits in a reference cycle, and its reducer holds the
    # default gloo group: collect it while the interpreter is whole. Left to
    # interpreter finalization, the group's destruction aborted the process now
    # and then ("terminate called without an active exception": 1 run in 6 to 14
    # of the drill's async_published row; none in 47 with the collection).
    gc.collect()
    dist.destroy_process_group()
    return 0
