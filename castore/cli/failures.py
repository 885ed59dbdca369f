"""How a command fails: one line on stderr and a non-zero exit, never a traceback.

``CASTORE_DEBUG=1`` prints the traceback as well. A ReadOnlyWarning is held
while the command runs and printed after it as one line, unless the command
failed on a write, whose error says read-only already.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from castore.errors import CastoreError, ReadOnlyStoreError, ReadOnlyWarning

EXIT_PROBLEMS = 1

Command = Callable[[argparse.Namespace], int]


def run_command(command: Command, args: argparse.Namespace) -> int:
    """Run ``command``; its exit status, or, when it fails, ``fail``'s."""
    read_only: list[str] = []
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _held_read_only_warnings(warnings.showwarning, read_only)
            code = command(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught in main
        _print_warnings(read_only)
        return code
    except ReadOnlyStoreError as exc:
        return fail(f"{type(exc).__name__}: {exc}")  # says read-only itself: one line
    except BrokenPipeError:
        raise  # main's: an OSError, but not a failure to report
    except CastoreError as exc:
        return fail(f"{type(exc).__name__}: {exc}", read_only)
    except (OSError, ValueError) as exc:
        return fail(f"{type(exc).__name__}: {exc}", read_only)
    except KeyboardInterrupt:
        return fail("interrupted", read_only, code=130)
    except Exception as exc:  # noqa: BLE001 - the CLI promises one line, never a traceback
        return fail(f"internal error: {type(exc).__name__}: {exc}", read_only, code=70)


def _held_read_only_warnings(shown: Callable[..., None], held: list[str]) -> Callable[..., None]:
    """Keep each ReadOnlyWarning's text in ``held``; show any other warning as before.

    Held, not printed: a refused write then prints only its error, which says
    read-only already; any other outcome prints each held one as one line.
    """

    def show(message: Warning | str, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if issubclass(category, ReadOnlyWarning):
            held.append(str(message).removeprefix("castore: "))
        else:
            shown(message, category, *rest, **kw)

    return show


def _print_warnings(held: list[str]) -> None:
    for text in held:
        print(f"castore: warning: {text}", file=sys.stderr)


def refuse(message: str) -> int:
    """A command that will not go on, for a reason of its own (no exception): its one line."""
    print(f"castore: error: {message}", file=sys.stderr)
    return EXIT_PROBLEMS


def fail(message: str, held: Sequence[str] = (), code: int = EXIT_PROBLEMS) -> int:
    _print_warnings(list(held))
    if os.environ.get("CASTORE_DEBUG"):
        traceback.print_exc()
    print(f"castore: error: {message}", file=sys.stderr)
    return code
