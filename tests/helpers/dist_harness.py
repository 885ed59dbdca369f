"""Run a function on N real processes joined in a gloo process group.

``run_ranks(world_size, fn, *args)`` starts ``world_size`` processes, each what
``python tests/helpers/dist_harness.py SPEC_DIR RANK`` would be (forked from a zygote,
below), each of which:

1. imports ``fn`` by its module and qualified name (so ``fn`` must be a
   module-level function of an importable module, e.g. ``tests/helpers/dist_workers.py``),
2. joins ``torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT")``,
3. calls ``fn(rank, world_size, *args)`` and pickles what it returned (or what it
   raised) into SPEC_DIR,
4. waits until every rank has finished (or died), then destroys the group and exits.

The parent collects one :class:`RankOutcome` per rank. Nothing can hang it: a
rank that dies (a real SIGKILL included) shows as a negative ``exitcode``; past
``timeout`` every remaining process is SIGKILLed (``timed_out``). A free port is
picked per launch; a launch whose rendezvous lost its port to another process
is retried with a fresh one.

Children get the parent's environment minus ``CASTORE_*`` variables, plus
``env`` (all ranks) and ``rank_env[rank]`` (one rank), e.g. ``CASTORE_FAULTS``.

A rank is forked from a zygote that has imported torch (castore.testing.zygote):
it starts in milliseconds, not the seconds importing torch takes, and is
otherwise what ``python tests/helpers/dist_harness.py SPEC_DIR RANK`` would be (its own
session, environment, output file; castore imported fresh). ``CASTORE_ZYGOTE=0``
starts fresh interpreters instead.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from castore.testing.zygote import TORCH_PRELOAD, ForkedProcess, ZygoteMismatch
from castore.testing.zygote import shared as shared_zygote

HERE = Path(__file__).resolve().parent
RELEASE = "release"
# Seconds a rank that has finished waits for the others before tearing down.
_TEARDOWN_GRACE = 10.0
_POLL = 0.05


@dataclass
class RankOutcome:
    """What happened to one rank."""

    rank: int
    exitcode: int | None  # negative: killed by that signal (-9: SIGKILL); None: never exited
    value: Any = None  # what fn returned (when ok)
    error_type: str | None = None  # type(exc).__name__ when fn (or setup) raised
    error_message: str | None = None
    error_mro: tuple[str, ...] = ()  # names of the exception's classes, most derived first
    error_traceback: str | None = None
    phase: str | None = None  # "init", "fn" or "teardown" for an error; None when ok
    seconds: float | None = None  # wall time fn ran (when it finished)
    timed_out: bool = False  # the harness SIGKILLed it at the launch timeout
    killed_by_harness: bool = False  # SIGKILLed by the harness (timeout or stuck teardown)
    output: str = ""  # the rank's stdout and stderr

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error_type is None and not self.timed_out

    @property
    def raised(self) -> bool:
        return self.error_type is not None and self.phase == "fn"

    def raised_a(self, name: str) -> bool:
        """fn raised an exception that is (a subclass of) the class called ``name``."""
        return self.raised and name in self.error_mro

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok -> {self.value!r}"[:400]
        parts = [f"rank {self.rank}: exit {self.exitcode}"]
        if self.timed_out:
            parts.append("timed out")
        if self.error_type:
            parts.append(f"{self.phase} raised {self.error_type}: {self.error_message}")
        if self.error_traceback:
            parts.append(self.error_traceback)
        if self.output.strip():
            parts.append("output:\n" + self.output[-3000:])
        return "\n".join(parts)


@dataclass
class _Child:
    rank: int
    proc: subprocess.Popen[bytes] | ForkedProcess
    log: Path
    result: Path
    killed: bool = False
    timed_out: bool = False
    init_failed: bool | None = None  # None: no result yet


@dataclass
class RankGroup:
    """A launched group of ranks; :meth:`wait` collects their outcomes."""

    world_size: int
    timeout: float
    workdir: Path
    children: list[_Child] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def _finished(self, child: _Child) -> bool:
        return child.result.exists() or child.proc.poll() is not None

    def _failed_to_join(self) -> bool:
        """Some rank reported that it could not join the group (the others never will)."""
        for child in self.children:
            if child.init_failed is None and child.result.exists():
                try:
                    data = pickle.loads(child.result.read_bytes())
                except Exception:
                    data = {}
                child.init_failed = data.get("phase") == "init"
            if child.init_failed:
                return True
        return False

    def wait(self) -> list[RankOutcome]:
        deadline = self.started + self.timeout
        try:
            # 1. Until every rank reported its result or died (or the deadline).
            while not all(self._finished(c) for c in self.children):
                if self._failed_to_join():
                    # The rest would wait for the rendezvous until the timeout: stop now.
                    for child in self.children:
                        if not self._finished(child):
                            self._kill(child)
                    break
                if time.monotonic() > deadline:
                    for child in self.children:
                        if not self._finished(child):
                            child.timed_out = True
                            self._kill(child)
                    break
                time.sleep(_POLL)
            # 2. Let the survivors tear down, then kill whatever is stuck there.
            (self.workdir / RELEASE).touch()
            teardown_deadline = time.monotonic() + _TEARDOWN_GRACE
            for child in self.children:
                try:
                    child.proc.wait(max(0.0, teardown_deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._kill(child)
                    child.proc.wait()
            return [self._outcome(c) for c in self.children]
        finally:
            self.kill()
            if self._tmp is not None:
                self._tmp.cleanup()

    def kill(self) -> None:
        """SIGKILL every rank still running (and its process group)."""
        for child in self.children:
            if child.proc.poll() is None:
                self._kill(child)
                child.proc.wait()

    @staticmethod
    def _kill(child: _Child) -> None:
        child.killed = True
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                child.proc.kill()
            except ProcessLookupError:
                pass

    def _outcome(self, child: _Child) -> RankOutcome:
        outcome = RankOutcome(rank=child.rank, exitcode=child.proc.returncode)
        if child.result.exists():
            try:
                data = pickle.loads(child.result.read_bytes())
            except Exception as exc:  # a torn result file: report it, do not crash
                data = {"error_type": "HarnessError", "error_message": f"bad result: {exc}"}
            for key, value in data.items():
                setattr(outcome, key, value)
        outcome.timed_out = child.timed_out
        outcome.killed_by_harness = child.killed
        outcome.output = child.log.read_text(errors="replace") if child.log.exists() else ""
        return outcome


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    base.update(env or {})
    # Tiny tensors, two cores: one intra-op thread per rank keeps N ranks from thrashing.
    base.setdefault("OMP_NUM_THREADS", "1")
    base.setdefault("PYTHONUNBUFFERED", "1")
    paths = [str(HERE), *(p for p in sys.path if p)]
    if base.get("PYTHONPATH"):
        paths.append(base["PYTHONPATH"])
    base["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return base


def start_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    pg_timeout: float | None = None,
) -> RankGroup:
    """Start ``world_size`` ranks running ``fn(rank, world_size, *args)``; do not wait.

    ``pg_timeout`` (seconds, default ``timeout``) is the process group's own timeout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    module, qualname = fn.__module__, fn.__qualname__
    if module == "__main__" or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"fn must be a module-level function of an importable module: {fn!r}")
    tmp = tempfile.TemporaryDirectory(prefix="castore-ranks-")
    workdir = Path(tmp.name)
    spec = {
        "module": module,
        "qualname": qualname,
        "args": args,
        "world_size": world_size,
        "port": free_port(),
        "pg_timeout": float(pg_timeout if pg_timeout is not None else timeout),
        "release_wait": float(timeout) + _TEARDOWN_GRACE,
    }
    (workdir / "spec.pkl").write_bytes(pickle.dumps(spec))
    group = RankGroup(world_size=world_size, timeout=timeout, workdir=workdir, _tmp=tmp)
    try:
        for rank in range(world_size):
            environment = child_env({**(env or {}), **((rank_env or {}).get(rank) or {})})
            log = workdir / f"rank{rank}.log"
            proc = _launch(workdir, rank, environment, log)
            group.children.append(
                _Child(rank=rank, proc=proc, log=log, result=workdir / f"rank{rank}.pkl")
            )
    except BaseException:
        group.kill()
        tmp.cleanup()
        raise
    return group


def _launch(
    workdir: Path, rank: int, environment: dict[str, str], log: Path
) -> subprocess.Popen[bytes] | ForkedProcess:
    """Start one rank: forked from the zygote, or a fresh interpreter."""
    argv = [str(Path(__file__).resolve()), str(workdir), str(rank)]
    zygote = shared_zygote(TORCH_PRELOAD, child_env())
    if zygote is not None:
        try:
            return zygote.fork(argv, env=environment, cwd=HERE.parents[1], stdout=log, stderr=log)
        except ZygoteMismatch:
            pass
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=str(HERE.parents[1]),
            start_new_session=True,  # its own process group: killpg takes all of it
        )


def _lost_the_port(outcomes: Sequence[RankOutcome]) -> bool:
    return any(
        o.phase == "init"
        and o.error_message is not None
        and ("address already in use" in o.error_message.lower() or "EADDRINUSE" in o.error_message)
        for o in outcomes
    )


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    pg_timeout: float | None = None,
    attempts: int = 3,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; one outcome per rank.

    Returns once every rank exited (or was killed at ``timeout`` seconds).
    """
    for attempt in range(attempts):
        group = start_ranks(
            world_size,
            fn,
            *args,
            timeout=timeout,
            env=env,
            rank_env=rank_env,
            pg_timeout=pg_timeout,
        )
        outcomes = group.wait()
        if not _lost_the_port(outcomes) or attempt == attempts - 1:
            return outcomes
    raise AssertionError("unreachable")


def run_groups(
    launches: Sequence[tuple[int, Callable[..., Any], tuple[Any, ...], Mapping[str, Any]]],
) -> list[list[RankOutcome]]:
    """Run several independent groups at once: ``(world_size, fn, args, options)`` each.

    Worth it when the groups mostly wait (for a timeout, a dead peer); each launch
    is tried once (no port retry).
    """
    groups = [start_ranks(n, fn, *args, **dict(options)) for n, fn, args, options in launches]
    try:
        return [group.wait() for group in groups]
    finally:
        for group in groups:
            group.kill()


def describe(outcomes: Sequence[RankOutcome]) -> str:
    """Every rank's outcome, for an assertion message."""
    return "\n\n".join(o.describe() for o in outcomes)


# -- the child side ------------------------------------------------------------------------


def _error_fields(exc: BaseException, phase: str) -> dict[str, Any]:
    return {
        "error_type": type(exc).__name__,
        "error_message": str(exc),
        "error_mro": tuple(c.__name__ for c in type(exc).__mro__),
        "error_traceback": "".join(traceback.format_exception(exc)),
        "phase": phase,
    }


def _write_result(path: Path, data: dict[str, Any]) -> bool:
    """Publish a rank's result atomically; False if it had to be replaced by an error."""
    written = True
    try:
        payload = pickle.dumps(data)
    except Exception as exc:
        written = False
        payload = pickle.dumps(
            {
                "error_type": "UnpicklableResult",
                "error_message": f"{type(exc).__name__}: {exc}",
                "phase": "fn",
                "seconds": data.get("seconds"),
            }
        )
    temp = path.with_suffix(".tmp")
    temp.write_bytes(payload)
    os.replace(temp, path)  # the parent never sees a torn result
    return written


def _child_main(workdir: Path, rank: int) -> int:
    import datetime
    import importlib

    result_path = workdir / f"rank{rank}.pkl"
    try:
        spec = pickle.loads((workdir / "spec.pkl").read_bytes())
        world_size = spec["world_size"]
        import torch.distributed as dist

        obj: Any = importlib.import_module(spec["module"])
        for part in spec["qualname"].split("."):
            obj = getattr(obj, part)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec['port']}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=spec["pg_timeout"]),
        )
        # Every rank through init before any runs its function: a rank that dies as soon
        # as its own init returned (a test's SIGKILL) could otherwise cut a peer's gloo
        # connectFullMesh short, and that peer would fail in init instead.
        dist.barrier()
    except BaseException as exc:
        _write_result(result_path, _error_fields(exc, "init"))
        return 3
    started = time.monotonic()
    try:
        value = obj(rank, world_size, *spec["args"])
    except BaseException as exc:
        data = _error_fields(exc, "fn")
        data["seconds"] = time.monotonic() - started
        code = 1
    else:
        data = {"value": value, "seconds": time.monotonic() - started}
        code = 0
    if not _write_result(result_path, data):
        code = 1
    # Rank 0 hosts the rendezvous store: keep every rank up until all are done.
    release = workdir / RELEASE
    deadline = time.monotonic() + spec["release_wait"]
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(_POLL)
    try:
        dist.destroy_process_group()
    except BaseException:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: torch/gloo threads can stall it


if __name__ == "__main__":
    sys.exit(_child_main(Path(sys.argv[1]), int(sys.argv[2])))
