"""The ``castore`` command's entry point: parse the arguments, run the command asked for."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from castore.cli.args import build_parser
from castore.cli.checks import cmd_repair, cmd_verify
from castore.cli.collection import (
    cmd_amend,
    cmd_branch,
    cmd_compact,
    cmd_du,
    cmd_gc,
    cmd_tag,
    cmd_untag,
)
from castore.cli.failures import run_command
from castore.cli.inspection import cmd_diff, cmd_log, cmd_show
from castore.cli.tiers import cmd_tiers
from castore.cli.transfer import cmd_copy, cmd_export, cmd_import, cmd_verify_export

# A closed stdout (`castore log ... | head -1`): what a shell reports for a tool SIGPIPE
# (13) killed. Not 0: `verify | head -1` may have cut off its PROBLEM lines; not 1, verify's.
EXIT_BROKEN_PIPE = 128 + 13


COMMANDS = {
    "log": cmd_log,
    "show": cmd_show,
    "verify": cmd_verify,
    "du": cmd_du,
    "tiers": cmd_tiers,
    "tag": cmd_tag,
    "untag": cmd_untag,
    "branch": cmd_branch,
    "amend": cmd_amend,
    "gc": cmd_gc,
    "repair": cmd_repair,
    "compact": cmd_compact,
    "copy": cmd_copy,
    "diff": cmd_diff,
    "export": cmd_export,
    "verify-export": cmd_verify_export,
    "import": cmd_import,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. ``castore show ... | head -1``: when the reader
    closes the pipe, exit 141 (as a Unix tool killed by SIGPIPE) with nothing on stderr."""
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:  # --help, --version, a usage error: argparse printed it
            sys.stdout.flush()  # here, so that a closed pipe is caught below
            raise
        return run_command(COMMANDS[args.command], args)
    except BrokenPipeError:
        # The reader has what it wanted: no error line, and no "Exception ignored"
        # from the interpreter flushing stdout into the closed pipe at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
