"""The end of a process with an async save in flight: wait for it, or say it was lost.

An async save (:mod:`castore.core.background`) is written by a daemon thread; if
the process ended under it, the save would be cut off silently. So:

- **Exit waits.** Interpreter exit (the main thread returning, ``sys.exit``,
  an exception or Ctrl-C unwinding it) waits for each store handle's save in
  flight, at most its ``exit_wait_s``. The wait runs inside
  ``threading._shutdown()``, before ``concurrent.futures`` stops its pools,
  which the writer needs; a process started by ``multiprocessing`` runs it
  too, though it leaves through ``os._exit`` and never runs ``atexit``.
- **A lost save is loud.** A save that did not publish (still in flight when
  the wait ran out, or failed with nobody told) gets one line on stderr
  saying it was NOT published, and the process exits 1 (143 after SIGTERM)
  instead of 0, unless ``multiprocessing`` owns the exit status.
- **SIGTERM.** Left at its default, SIGTERM ends a process without running
  any Python, losing the save. At its first async save, a main thread whose
  SIGTERM is at the default installs :func:`_on_sigterm` (a handler the user
  installed is never replaced): with a save in flight, it raises
  ``SystemExit(143)`` in the main thread, so ``finally`` blocks run and the
  exit hook waits; with none, SIGTERM does what it did before.
"""

from __future__ import annotations

import atexit

# Imported for its side effect, before castore's exit hook is registered below: it
# registers concurrent.futures' pool shutdown with threading._register_atexit, whose
# callbacks run in reverse order of registration, so castore's wait runs first.
import concurrent.futures.thread  # noqa: F401
import os
import signal
import sys
import threading
import weakref
from types import FrameType
from typing import NamedTuple, Protocol

SIGTERM_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process SIGTERM ended


class InFlight(NamedTuple):
    """A save this process has in flight: its run, step and how long exit waits for it."""

    run: str
    step: int
    exit_wait_s: float


class SaveOwner(Protocol):
    """A store handle's async saves, as the end of the process sees them."""

    def in_flight_here(self) -> InFlight | None:
        """The save this process's writer has in flight, if any."""

    def wait_for_exit(self) -> str | None:
        """Wait for the save in flight (bounded); the line to print if a save was lost."""


class _Ending:
    """What this process has learnt while ending."""

    def __init__(self) -> None:
        self.exiting = False  # the exit hook has started waiting
        self.lost = False  # a save was not published: the exit status says so
        self.status = 1
        self.sigterm_pid: int | None = None  # the process that installed the handler


_OWNERS: weakref.WeakSet[SaveOwner] = weakref.WeakSet()
_ENDING = _Ending()


def track(owner: SaveOwner) -> None:
    """Wait for ``owner``'s save in flight at exit (held weakly)."""
    _OWNERS.add(owner)


def in_flight() -> InFlight | None:
    """A save this process has in flight, on any store handle."""
    for owner in list(_OWNERS):
        if (found := owner.in_flight_here()) is not None:
            return found
    return None


def wait_for_saves() -> None:
    """The exit hook: wait for every save in flight; remember any that was lost."""
    _ENDING.exiting = True
    for owner in list(_OWNERS):
        line = owner.wait_for_exit()
        if line is not None:
            print(line, file=sys.stderr, flush=True)
            _ENDING.lost = True


def _exit_if_lost() -> None:
    """Turn a lost save into a non-zero exit status (the last word of the process).

    ``os._exit``: after ``atexit`` nothing can change the status Python exits
    with. It skips the ``atexit`` handlers registered before castore's import,
    so the standard streams are flushed here.
    """
    if not _ENDING.lost:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass  # closed or replaced: nothing more to save of it
    os._exit(_ENDING.status)


def guard_sigterm() -> None:
    """Let SIGTERM wait for this process's saves, if SIGTERM is still at its default.

    Called at each async save: only the main thread may set a handler, and a
    handler the user installed (or one set outside Python) stays.
    """
    if _ENDING.sigterm_pid == os.getpid():
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _ENDING.sigterm_pid = os.getpid()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Exit through Python, so the exit hook waits; never wait here.

    Waiting in a handler would wait on the main thread, which may hold a lock
    the writer needs (a staging pool's condition, say). A forked child has the
    handler but none of the saves: it ends as SIGTERM's default would.
    """
    if _ENDING.exiting:
        # Raising now would cut the exit hook short and lose the save it waits for.
        _say("castore: SIGTERM while exit waits for a save in flight: still waiting\n")
        return
    found = in_flight()
    if found is None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _say(
        f"castore: SIGTERM: waiting up to {found.exit_wait_s:g} s for the save of "
        f"{found.run} step {found.step} to publish before exiting\n"
    )
    _ENDING.status = SIGTERM_STATUS
    raise SystemExit(SIGTERM_STATUS)


def _say(line: str) -> None:
    # os.write, not print: the handler may interrupt the main thread inside a print,
    # and a buffered stream refuses a reentrant write.
    try:
        os.write(2, line.encode())
    except OSError:
        pass


def _register() -> None:
    # atexit runs last in, first out: registered at castore's import, the status check
    # runs after every handler registered later (the user's included), and, on the
    # fallback, after the wait registered next.
    atexit.register(_exit_if_lost)
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython 3.9+, whose concurrent.futures used atexit too:
        atexit.register(wait_for_saves)  # registered after its hook, so run before it
        return
    try:
        register(wait_for_saves)
    except RuntimeError:  # imported while the interpreter is already shutting down
        pass


_register()
