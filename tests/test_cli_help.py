"""``castore --help`` and each command's: positionals, defaults and examples that parse."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from castore.cli import COMMANDS
from castore.cli.args import build_parser

CLI = Path(sys.executable).parent / "castore"


def help_of(*command: str) -> str:
    env = {**os.environ, "COLUMNS": "80"}  # argparse wraps to the terminal's width
    result = subprocess.run(
        [str(CLI), *command, "--help"], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def examples(text: str) -> list[list[str]]:
    """The argument lists of the example lines after "examples:" (comments dropped)."""
    lines = text.split("\nexamples:\n", 1)[1].splitlines()
    return [shlex.split(line, comments=True)[1:] for line in lines if line.strip()]


def test_top_level_help_lists_every_command_with_a_line_and_examples() -> None:
    text = help_of()
    for name in COMMANDS:
        assert any(
            line.split()[:1] == [name] and len(line.split()) > 1 for line in text.splitlines()
        )
    assert "STORE is the store's directory" in text
    assert len(examples(text)) >= 2


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_describes_store_and_has_examples_that_parse(command: str) -> None:
    text = help_of(command)
    assert "the store's directory (the path given to castore.open)" in " ".join(text.split())
    found = examples(text)
    assert found, text
    for args in found:
        assert args[0] == command
        parsed = build_parser().parse_args(args)  # an example that does not parse exits 2
        assert parsed.command == command


@pytest.mark.parametrize("command", ["show", "verify", "tag"])
def test_generation_forms_are_spelled_out(command: str) -> None:
    text = help_of(command)
    for form in ("RUN@latest", "RUN@7", "RUN@release", "RUN@3fa2c1", "always an id"):
        assert form in text


def test_defaults_and_non_interactive_behaviour_are_in_gc_help() -> None:
    text = " ".join(help_of("gc").split())
    assert "keep the newest K generations of each run, K >= 1 (default: 3)" in text
    assert "(default: 30)" in text
    assert (
        "When stdin is not a terminal (scripts, cron, CI, a notebook's !castore gc) it does "
        "not ask: it deletes only when the policy is given (--keep, --every-steps, --every) "
        "or --yes is passed" in text
    )
    assert "-y, --yes" in text


def test_verify_help_says_sample_is_a_percent_and_excludes_deep() -> None:
    text = help_of("verify")
    assert "usage: castore verify [-h] [--deep | --sample P]" in text
    assert "a percent, not a fraction" in " ".join(text.split())
