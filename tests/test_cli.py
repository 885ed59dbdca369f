"""The real ``castore`` console script, run as a subprocess on stores the tests made."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cli_runner import CLI, run_cli

import castore
from castore.errors import GenerationNotFoundError
from castore.verify import verify_store


def make_state() -> dict[str, object]:
    return {
        "model": {
            "w": np.arange(512, dtype=np.float32).reshape(32, 16),
            "b": np.ones(16, dtype=np.float64),
        },
        "opt": {"lr": 0.1, "betas": (0.9, 0.99)},
        "epoch": 3,
        "name": "exp",
    }


@pytest.fixture(scope="module")
def cli_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """exp1@1 and an identical exp1@2 (fully deduplicated), plus run `other`."""
    path = tmp_path_factory.mktemp("cli") / "store"
    with castore.open(path, chunk_size=1024) as store:
        store.save(make_state(), run="exp1", step=100)
        store.save(make_state(), run="exp1", step=200)
        store.save({"x": np.zeros(4, dtype=np.int8)}, run="other", step=5)
    return path


@pytest.fixture
def store_copy(cli_store: Path, tmp_path: Path) -> Path:
    """A private copy of ``cli_store`` that a test may damage."""
    return Path(shutil.copytree(cli_store, tmp_path / "copy"))


def rows(stdout: str) -> list[list[str]]:
    """Table body rows (after tabulate's dashed rule), split on runs of 2+ spaces."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if set(line.replace(" ", "")) == {"-"})
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start + 1 :] if line.strip()]


def test_cli_is_the_installed_console_script() -> None:
    assert CLI.is_file() and os.access(CLI, os.X_OK)
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"castore {castore.__version__}"


# -- log --------------------------------------------------------------------------


def test_log_lists_every_generation_of_every_run(cli_store: Path) -> None:
    result = run_cli("log", cli_store)
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0].split()
    assert header[:8] == ["run", "id", "step", "time", "logical", "new", "stored", "written"]
    assert header[8:] == ["dedup", "held", "root", "tags"]
    table = rows(result.stdout)
    assert [(r[0], r[1], r[2]) for r in table] == [
        ("exp1", "1", "100"),
        ("exp1", "2", "200"),
        ("other", "1", "5"),
    ]
    dedup = [r[8] for r in table]
    assert dedup == ["0.0%", "100.0%", "0.0%"]  # the identical second save wrote nothing
    assert table[1][5] == "0 B"
    with castore.open(cli_store, create=False) as store:
        second = store.resolve("exp1", 2).stats
    # written: no chunk, only the shard manifest (a few hundred bytes)
    assert 0 < second.written_bytes < 4096 and second.new_bytes == 0


def test_log_of_one_run(cli_store: Path) -> None:
    result = run_cli("log", cli_store, "--run", "exp1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split()[0] == "id"  # no run column
    table = rows(result.stdout)
    assert [(r[0], r[1], r[7]) for r in table] == [("1", "100", "0.0%"), ("2", "200", "100.0%")]
    assert "other" not in result.stdout
    with castore.open(cli_store, create=False) as store:
        roots = [g.root[:12] for g in store.generations("exp1")]
    assert [r[-1] for r in table] == roots


def test_log_of_an_empty_store(tmp_path: Path) -> None:
    castore.open(tmp_path / "empty").close()
    result = run_cli("log", tmp_path / "empty")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "no generations\n"  # a whole line: the prompt starts on the next


def test_messages_of_nothing_to_show_end_their_line(cli_store: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    castore.open(empty).close()
    assert run_cli("log", empty).stdout == "no generations\n"
    assert re.search(r" in \d+\.\d\ds\n\Z", run_cli("gc", empty, "--keep", "1").stdout)
    assert run_cli("du", empty).stdout.endswith("\n")
    assert run_cli("verify", empty).stdout.endswith("--deep re-hashes them)\nOK\n")
    copied = tmp_path / "copied"
    assert run_cli("copy", cli_store, copied).returncode == 0
    again = run_cli("copy", cli_store, copied)
    assert again.stdout.endswith(f"nothing to copy: 2 generation(s) already in {copied}\n")


def _sigint_at_its_default() -> None:
    """In the child before exec: SIGINT as at a terminal.

    A suite started in the background (``nohup make test &``) ignores SIGINT, an
    ignored signal stays ignored across exec, and Python then installs no
    KeyboardInterrupt handler: the Ctrl-C below would never land.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_at_the_gc_question_starts_the_error_on_its_own_line(tmp_path: Path) -> None:
    path = tmp_path / "gc"
    with castore.open(path, chunk_size=1024) as store:
        for step in (1, 2):
            store.save({"w": np.full(512, step, dtype=np.float32)}, run="r", step=step)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    master, slave = os.openpty()
    process = subprocess.Popen(
        [str(CLI), "gc", str(path), "--keep", "1"], stdin=slave, stdout=slave, stderr=slave,
        env=env, preexec_fn=_sigint_at_its_default,
    )  # fmt: skip
    os.close(slave)
    output = b""
    try:
        while b"[y/N]" not in output:
            assert select.select([master], [], [], 60)[0], output
            output += os.read(master, 4096)
        code = None
        for _ in range(6):
            process.send_signal(signal.SIGINT)  # Ctrl-C at the question
            try:
                code = process.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                # It landed after readline wrote the prompt but before its select():
                # Python noted it, and handles it when select next wakes, at the next
                # signal. (A person is never that quick; a test sees the prompt and
                # signals within microseconds.)
                continue
        assert code == 130
        while select.select([master], [], [], 1)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()
    text = output.decode().replace("\r\n", "\n")
    assert "[y/N] \ncastore: error: interrupted\n" in text, text
    assert ids(path, "r") == [1, 2]


# -- show -------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["exp1@2", "exp1", "exp1@latest"])
def test_show_lists_tensors_and_values(cli_store: Path, target: str) -> None:
    result = run_cli("show", cli_store, target)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("generation exp1@2  step 200")
    tensors = {r[0]: r[1:] for r in rows(out.split("\n\n")[1])}
    assert tensors == {
        "model/w": ["float32", "32x16", "2.0 KiB", "1", "2"],
        "model/b": ["float64", "16", "128 B", "1", "1"],
    }
    values = {r[0]: r[1:] for r in rows(out.split("\n\n")[2])}
    assert values == {
        "opt/lr": ["float", "0.1"],
        "opt/betas/0": ["float", "0.9"],
        "opt/betas/1": ["float", "0.99"],
        "epoch": ["int", "3"],
        "name": ["str", "'exp'"],
    }


def test_show_prints_the_data_order_record(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with castore.open(path, chunk_size=1024) as store:
        store.save(make_state(), run="r", step=1, data_order={"seed": 7, "consumed_samples": 96})
        store.save(make_state(), run="r", step=2)
    with_order = run_cli("show", path, "r@1")
    assert with_order.returncode == 0, with_order.stderr
    assert "data order consumed_samples 96, seed 7" in with_order.stdout
    assert "data order" not in run_cli("show", path, "r@2").stdout


def test_show_by_id_and_by_root_prefix(cli_store: Path) -> None:
    with castore.open(cli_store, create=False) as store:
        first = store.resolve("exp1", 1)
    by_id = run_cli("show", cli_store, "exp1@1")
    by_root = run_cli("show", cli_store, f"exp1@{first.root[:10]}")
    assert by_id.returncode == by_root.returncode == 0
    assert by_id.stdout == by_root.stdout
    assert "generation exp1@1  step 100" in by_id.stdout
    assert f"root       {first.root}" in by_id.stdout
    assert "parent     -" in by_id.stdout


def show_values(stdout: str) -> dict[str, list[str]]:
    """The value table of ``castore show``: key -> [type, value]."""
    return {r[0]: r[1:] for r in rows(stdout.split("\n\n")[2])}


def test_show_collapses_long_lists_of_plain_values(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with castore.open(path, chunk_size=1024) as store:
        mixed = [1, 2.5, "a", None, np.ones(3, dtype=np.float32), 7]
        store.save({"ids": list(range(100)), "few": [1, 2, 3], "mixed": mixed}, run="r", step=9)
    result = run_cli("show", path, "r")
    assert result.returncode == 0, result.stderr
    assert show_values(result.stdout) == {
        "ids/[0..99]": ["100 int", "0, 1, ..., 99"],
        "few/0": ["int", "1"],  # short lists stay one row per item
        "few/1": ["int", "2"],
        "few/2": ["int", "3"],
        "mixed/[0..3]": ["4 values", "1, 2.5, ..., None"],  # the tensor ends the run
        "mixed/5": ["int", "7"],
    }
    assert result.stdout.splitlines()[-1] == (
        f"total      1 tensor(s), 12 B in 1 chunk(s); 108 value(s) (104 collapsed: --all "
        f"lists them); r@1 step 9, {result.stdout.splitlines()[0].split('  ')[-1]}"
    )
    every = run_cli("show", path, "r", "--all")
    assert every.returncode == 0, every.stderr
    values = show_values(every.stdout)
    assert len(values) == 108 and values["ids/57"] == ["int", "57"]
    assert values["mixed/3"] == ["NoneType", "None"]
    assert "collapsed" not in every.stdout.splitlines()[-1]


def test_show_of_a_real_training_state_is_short(tmp_path: Path) -> None:
    """A TrainState with Adam: the optimizer's parameter-name list is one row, not 40."""
    import torch
    from torch import nn

    from castore.train import TrainState

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with castore.open(tmp_path / "store") as store:
        TrainState(model, optimizer).save(store, run="train")

    result = run_cli("show", tmp_path / "store", "train")
    assert result.returncode == 0, result.stderr
    values = show_values(result.stdout)
    assert values["optimizer/param_groups/0/params/[0..39]"] == [
        "40 str",
        "'0.weight', '0.bias', ..., '19.bias'",
    ]
    assert not any("/params/" in key and "[" not in key for key in values)
    assert len(values) < 25
    tensors = rows(result.stdout.split("\n\n")[1])
    assert len(tensors) == 40 + 3 * 40  # each tensor keeps its row: weights and Adam's slots
    total = result.stdout.splitlines()[-1]
    assert total.startswith("total      160 tensor(s), ")
    assert "(40 collapsed: --all lists them); train@1 step 0" in total

    every = run_cli("show", tmp_path / "store", "train", "--all")
    assert every.returncode == 0, every.stderr
    listed = show_values(every.stdout)
    for index in range(40):
        name = f"{index // 2}.{'weight' if index % 2 == 0 else 'bias'}"
        assert listed[f"optimizer/param_groups/0/params/{index}"] == ["str", repr(name)]
    assert not any("[" in key for key in listed)
    assert len(every.stdout.splitlines()) == len(result.stdout.splitlines()) + 39


def read_one_line_and_close(args: list[object], env: dict[str, str]) -> tuple[str, int, str]:
    """Run the CLI into a real pipe, read its first line, close the pipe as ``head -1``
    does: (that line, the exit status, everything on stderr)."""
    process = subprocess.Popen(
        [str(CLI), *map(str, args)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stdout is not None and process.stderr is not None
    first = process.stdout.readline().decode()
    process.stdout.close()
    err = process.stderr.read().decode()
    return first, process.wait(timeout=60), err


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_show_into_a_pipe_closed_after_one_line_exits_141_quietly(
    tmp_path: Path, buffered: bool
) -> None:
    path = tmp_path / "store"
    with castore.open(path, chunk_size=1024) as store:
        # --all prints a row per value: far more than a pipe holds, so the write must fail.
        store.save({"ids": [{"n": i} for i in range(5000)]}, run="r", step=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CASTORE_", "PYTHONUNBUF"))}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    first, status, err = read_one_line_and_close(["show", path, "r", "--all"], env)
    assert first.startswith("generation r@1  step 1")
    assert err == ""  # no traceback, no "Exception ignored ... BrokenPipeError"
    assert status == 141  # 128 + SIGPIPE, as a shell reports `yes | head -1`


@pytest.mark.parametrize("args", [["--version"], ["show", "--help"]], ids=["version", "help"])
def test_version_and_help_into_a_closed_pipe_exit_141_quietly(args: list[object]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CASTORE_", "PYTHONUNBUF"))}
    process = subprocess.Popen(
        [str(CLI), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # before it writes: it is still importing castore
    err = process.stderr.read().decode()
    assert (process.wait(timeout=60), err) == (141, "")


# -- verify -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, summary",
    [
        ([], "verified 2 run(s), 3 generation(s), 6 object(s)"),
        (["--deep"], "deep (every chunk re-hashed)"),
        (["exp1"], "verified 1 run(s), 2 generation(s)"),
        (["exp1@1"], "verified 1 run(s), 1 generation(s)"),
    ],
)
def test_verify_passes(cli_store: Path, args: list[str], summary: str) -> None:
    result = run_cli("verify", cli_store, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary in result.stdout
    assert result.stdout.splitlines()[-1] == "OK"
    assert "PROBLEM" not in result.stdout


def test_verify_of_a_garbled_ref_reports_a_problem(store_copy: Path) -> None:
    ref = store_copy / "refs" / "exp1"
    data = bytearray(ref.read_bytes())
    data[-5] ^= 0x10
    ref.write_bytes(bytes(data))
    result = run_cli("verify", store_copy)
    assert result.returncode == 1
    assert "PROBLEM exp1: CorruptRefError" in result.stdout
    assert "FAILED: 1 problem(s); damaged: exp1" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("target", ["exp1", "exp1@latest"])
def test_verify_of_a_damaged_target_reports_a_problem(store_copy: Path, target: str) -> None:
    """Only "no such run or generation" is an error line; damage stays a PROBLEM report."""
    ref = store_copy / "refs" / "exp1"
    data = bytearray(ref.read_bytes())
    data[-5] ^= 0x10
    ref.write_bytes(bytes(data))
    result = run_cli("verify", store_copy, target)
    assert result.returncode == 1
    assert "PROBLEM exp1: CorruptRefError" in result.stdout
    assert "damaged: exp1" in result.stdout
    assert result.stderr == ""


def test_a_sampled_verify_says_how_many_of_how_many_chunks_it_re_hashed(tmp_path: Path) -> None:
    """``--sample 50`` draws each chunk with chance 1/2: the figure printed is what was drawn."""
    path = tmp_path / "sampled"
    with castore.open(path, chunk_size=64) as store:
        state = {"w": np.random.default_rng(0).standard_normal(16 * 16).astype(np.float32)}
        store.save(state, run="r", step=1)  # 16 chunks of 64 bytes
    result = run_cli("verify", path, "--sample", "50")
    assert result.returncode == 0, result.stderr
    found = re.search(r"sampled \((\d+) of 16 chunk\(s\) re-hashed, (\d+)%;", result.stdout)
    assert found, result.stdout
    hashed, percent = int(found[1]), int(found[2])
    assert percent == round(100 * hashed / 16)
    assert "each drawn with chance 50%" in result.stdout


def test_a_mistyped_run_is_named_alike_by_load_verify_and_every_command(
    cli_store: Path,
) -> None:
    """One message, from one helper: the store's runs, and the nearest to the name typed."""
    with castore.open(cli_store, create=False) as store:
        with pytest.raises(GenerationNotFoundError) as loading:
            store.load("exp2")
        with pytest.raises(GenerationNotFoundError) as verifying:
            verify_store(store, run="exp2")
        with pytest.raises(GenerationNotFoundError) as unlike:
            store.load("zzz")
    message = str(loading.value)
    assert message == str(verifying.value)
    assert message == (
        f"no run 'exp2' in the store at {cli_store}, whose runs are exp1, other: "
        "did you mean 'exp1'? (run=exp2)"
    )
    assert "did you mean" not in str(unlike.value)  # nothing near: the runs alone
    assert "whose runs are exp1, other" in str(unlike.value)
    commands = [
        ["verify", cli_store, "exp2"],
        ["show", cli_store, "exp2@1"],
        ["log", cli_store, "--run", "exp2"],
        ["gc", cli_store, "--run", "exp2", "--keep", "1", "--dry-run"],
        ["du", cli_store, "--run", "exp2"],
        ["diff", cli_store, "exp2@1", "exp1@2"],
    ]
    for args in commands:
        result = run_cli(*args)
        assert (result.returncode, result.stdout) == (1, ""), args
        assert result.stderr == f"castore: error: GenerationNotFoundError: {message}\n", args


# -- gc: the plan, then a question on a terminal --------------------------------------


@pytest.fixture
def gc_store(tmp_path: Path) -> Path:
    """exp1@1..4 (different bytes each) and other@1."""
    path = tmp_path / "gc"
    with castore.open(path, chunk_size=1024) as store:
        for step in (1, 2, 3, 4):
            store.save({"w": np.full(512, step, dtype=np.float32)}, run="exp1", step=step)
        store.save({"x": np.zeros(4, dtype=np.int8)}, run="other", step=5)
    return path


def ids(path: Path, run: str = "exp1") -> list[int]:
    with castore.open(path, create=False) as store:
        return [g.id for g in store.generations(run)]


def run_in_terminal(
    *args: object, answer: str | None, at_prompt: Callable[[], None] | None = None
) -> tuple[int, str]:
    """Run the CLI on a pseudo-terminal; type ``answer`` when it asks [y/N]."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    master, slave = os.openpty()
    process = subprocess.Popen(
        [str(CLI), *map(str, args)], stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    output = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1)[0]:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the process closed the terminal (exited)
                break
            if not chunk:
                break
            output += chunk
            if answer is not None and output.rstrip().endswith(b"[y/N]"):
                if at_prompt is not None:
                    at_prompt()
                os.write(master, answer.encode() + b"\n")
                answer = None
        else:
            raise AssertionError(f"no exit within 60 s: {output.decode()!r}")
        return process.wait(timeout=60), output.decode().replace("\r\n", "\n")
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()
            process.wait()


def test_gc_on_a_terminal_shows_the_plan_and_no_deletes_nothing(gc_store: Path) -> None:
    before = sorted(p.name for p in gc_store.rglob("*"))
    code, out = run_in_terminal("gc", gc_store, "--keep", "2", answer="n")
    assert code == 1, out
    question = out.index("Delete 2 generation(s)? [y/N] n")
    assert [(r[0], r[1], r[4]) for r in rows(out[:question])[:4]] == [
        ("exp1", "1", "drop"),
        ("exp1", "2", "drop"),
        ("exp1", "3", "keep"),
        ("exp1", "4", "keep"),
    ]
    assert out[question:].splitlines()[1:] == ["nothing deleted"]
    assert ids(gc_store) == [1, 2, 3, 4]
    assert sorted(p.name for p in gc_store.rglob("*")) == before


def test_gc_on_a_terminal_collects_after_yes(gc_store: Path) -> None:
    code, out = run_in_terminal("gc", gc_store, "--keep", "2", answer="y")
    assert code == 0, out
    assert "Delete 2 generation(s)? [y/N] y" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("2 generation(s) dropped; freed ")
    assert "(2 chunk(s), 4 object(s))" in summary
    assert ids(gc_store) == [3, 4] and ids(gc_store, "other") == [1]


def test_gc_on_a_terminal_takes_end_of_input_as_no(gc_store: Path) -> None:
    code, out = run_in_terminal("gc", gc_store, "--keep", "1", answer="\x04")
    assert code == 1, out
    assert out.strip().splitlines()[-1] == "nothing deleted"
    assert ids(gc_store) == [1, 2, 3, 4]


def test_gc_yes_skips_the_question_on_a_terminal(gc_store: Path) -> None:
    code, out = run_in_terminal("gc", gc_store, "--keep", "3", "-y", answer=None)
    assert code == 0, out
    assert "[y/N]" not in out
    assert [(r[1], r[4]) for r in rows(out)[:4]] == [
        ("1", "dropped"),
        ("2", "keep"),
        ("3", "keep"),
        ("4", "keep"),
    ]
    assert ids(gc_store) == [2, 3, 4]


def test_gc_on_a_terminal_asks_nothing_when_nothing_is_dropped(gc_store: Path) -> None:
    code, out = run_in_terminal("gc", gc_store, "--keep", "4", answer=None)
    assert code == 0, out
    assert "[y/N]" not in out
    assert out.strip().splitlines()[-1].startswith("0 generation(s) dropped; freed ")
    assert ids(gc_store) == [1, 2, 3, 4]


def test_gc_refuses_a_plan_that_changed_after_the_answer(gc_store: Path) -> None:
    """A save while the question waits makes --keep 2 drop one more: yes did not cover it."""

    def save_another() -> None:
        with castore.open(gc_store, create=False) as store:
            store.save({"w": np.full(512, 5, dtype=np.float32)}, run="exp1", step=5)

    code, out = run_in_terminal("gc", gc_store, "--keep", "2", answer="y", at_prompt=save_another)
    assert code == 1, out
    error = out.strip().splitlines()[-1]
    assert error.startswith("castore: error: GcAbortedError: gc aborted, nothing deleted: ")
    assert "would now also drop exp1@3" in error
    assert ids(gc_store) == [1, 2, 3, 4, 5]


def test_gc_without_a_terminal_or_a_policy_deletes_nothing_and_says_what_to_pass(
    gc_store: Path,
) -> None:
    refused = run_cli("gc", gc_store)  # stdin is /dev/null: a notebook's !castore gc, cron
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert "--keep K" in refused.stderr and "--yes" in refused.stderr
    assert ids(gc_store) == [1, 2, 3, 4] and ids(gc_store, "other") == [1]
    dry = run_cli("gc", gc_store, "--dry-run")
    assert dry.returncode == 0 and "dry run: would drop 1 generation(s)" in dry.stdout
    assert ids(gc_store) == [1, 2, 3, 4]
    yes = run_cli("gc", gc_store, "--yes")  # asked for: the default policy, --keep 3
    assert yes.returncode == 0, yes.stderr
    assert ids(gc_store) == [2, 3, 4]
    every = run_cli("gc", gc_store, "--every-steps", "1")  # a policy given: no --yes needed
    assert every.returncode == 0, every.stderr
    assert ids(gc_store) == [2, 3, 4]


def test_gc_refused_from_a_script_says_what_the_default_policy_would_drop(
    gc_store: Path,
) -> None:
    """The refusal is the CLI's own, not a ValueError: it names what --yes would delete."""
    refused = run_cli("gc", gc_store)
    assert refused.returncode == 1
    line = refused.stderr.strip()
    assert line.startswith("castore: error: castore gc would delete without asking")
    assert "Error:" not in line  # no exception class: nothing went wrong but a missing choice
    assert "the default policy (--keep 3) would drop 1 generation(s) (exp1@1);" in line
    assert ids(gc_store) == [1, 2, 3, 4]


def test_a_dry_run_says_what_it_would_drop_and_free(gc_store: Path) -> None:
    dry = run_cli("gc", gc_store, "--keep", "1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    summary = dry.stdout.strip().splitlines()[-1]
    assert summary.startswith("dry run: would drop 3 generation(s); would free "), summary
    assert "dropped" not in dry.stdout
    assert ids(gc_store) == [1, 2, 3, 4]


def test_gc_on_a_terminal_without_a_policy_still_asks(gc_store: Path) -> None:
    code, out = run_in_terminal("gc", gc_store, answer="n")
    assert code == 1 and "Delete 1 generation(s)? [y/N]" in out and "nothing deleted" in out
    assert ids(gc_store) == [1, 2, 3, 4]
    code, out = run_in_terminal("gc", gc_store, answer="y")
    assert code == 0, out
    assert ids(gc_store) == [2, 3, 4]


def test_gc_without_a_terminal_does_not_ask(gc_store: Path) -> None:
    result = run_cli("gc", gc_store, "--keep", "2")  # stdin is /dev/null, as in cron or CI
    assert result.returncode == 0, result.stderr
    assert "[y/N]" not in result.stdout
    table = rows(result.stdout.split("\n\n")[0])
    assert [r[4] for r in table] == ["dropped", "dropped", "keep", "keep", "keep"]
    assert ids(gc_store) == [3, 4]


# -- errors: one line on stderr, no traceback, non-zero exit ----------------------


def _garble_ref(path: Path) -> Path:
    ref = path / "refs" / "exp1"
    ref.write_bytes(ref.read_bytes()[:-1])
    return path


def _foreign_dir(path: Path) -> Path:
    path.mkdir()
    (path / "data.txt").write_text("not a store")
    return path


ERRORS = [
    # (id, args builder, exit code, words in the message)
    ("missing-store", lambda s, t: ["log", t / "nowhere"], 1, "StoreNotFoundError"),
    ("missing-store-show", lambda s, t: ["show", t / "nowhere", "exp1"], 1, "StoreNotFoundError"),
    ("file-not-store", lambda s, t: ["log", s / "castore.json"], 1, "NotAStoreError"),
    ("foreign-dir", lambda s, t: ["verify", _foreign_dir(t / "f")], 1, "NotAStoreError"),
    ("bad-run-show", lambda s, t: ["show", s, "../x"], 1, "InvalidNameError"),
    ("bad-run-log", lambda s, t: ["log", s, "--run", "a b"], 1, "InvalidNameError"),
    ("unknown-generation", lambda s, t: ["show", s, "exp1@99"], 1, "GenerationNotFoundError"),
    ("bad-generation-spec", lambda s, t: ["show", s, "exp1@zz"], 1, "GenerationNotFoundError"),
    # RUN@ with nothing after the @ is refused, never read as the newest.
    ("empty-gen-show", lambda s, t: ["show", s, "exp1@"], 1, "names no generation after '@'"),
    ("empty-gen-verify", lambda s, t: ["verify", s, "exp1@"], 1, "InvalidNameError: 'exp1@'"),
    ("empty-gen-tag", lambda s, t: ["tag", s, "exp1@", "x"], 1, "write exp1 (or exp1@latest)"),
    ("empty-gen-diff", lambda s, t: ["diff", s, "exp1@2", "exp1@"], 1, "InvalidNameError"),
    ("empty-gen-export", lambda s, t: ["export", s, "exp1@", t / "o"], 1, "InvalidNameError"),
    ("empty-run", lambda s, t: ["show", s, "@2"], 1, "names no run before '@'"),
    ("unknown-run", lambda s, t: ["show", s, "nobody"], 1, "GenerationNotFoundError"),
    ("unknown-run-log", lambda s, t: ["log", s, "--run", "nobody"], 1, "GenerationNotFoundError"),
    ("unknown-subcommand", lambda s, t: ["frobnicate", s], 2, "invalid choice"),
    ("no-subcommand", lambda s, t: [], 2, "required"),
    ("missing-argument", lambda s, t: ["show", s], 2, "required"),
    ("garbled-ref-show", lambda s, t: ["show", _garble_ref(s), "exp1"], 1, "CorruptRefError"),
    ("garbled-ref-log", lambda s, t: ["log", _garble_ref(s)], 1, "CorruptRefError"),
    # An unknown run or generation is not damage to report: one line, as in show and log.
    ("unknown-run-verify", lambda s, t: ["verify", s, "nobody"], 1, "no run 'nobody'"),
    ("unknown-gen-verify", lambda s, t: ["verify", s, "exp1@99"], 1, "GenerationNotFoundError"),
    ("bad-gen-verify", lambda s, t: ["verify", s, "exp1@zz"], 1, "GenerationNotFoundError"),
    ("bad-run-verify", lambda s, t: ["verify", s, "../x"], 1, "InvalidNameError"),
    # Bad options name the option, in the CLI's words (exit 2, argparse's usage status).
    ("sample-over-100", lambda s, t: ["verify", s, "--sample", "150"], 2, "--sample: the percent"),
    ("sample-zero", lambda s, t: ["verify", s, "--sample", "0"], 2, "in (0, 100]"),
    ("sample-nan", lambda s, t: ["verify", s, "--sample", "nan"], 2, "--sample"),
    ("deep-and-sample", lambda s, t: ["verify", s, "--deep", "--sample", "5"], 2, "not allowed"),
    ("keep-zero", lambda s, t: ["gc", s, "--keep", "0"], 2, "--keep: must be a whole number"),
    ("keep-word", lambda s, t: ["gc", s, "--keep", "all"], 2, "--keep: must be a whole number"),
    ("every-steps-zero", lambda s, t: ["gc", s, "--every-steps", "0"], 2, "--every-steps: must"),
    ("every-garbage", lambda s, t: ["gc", s, "--every", "soon"], 2, "--every: not a duration"),
    ("every-zero", lambda s, t: ["gc", s, "--every", "0s"], 2, "--every: a duration must"),
    ("wait-negative", lambda s, t: ["gc", s, "--wait", "-1"], 2, "--wait: must be a number"),
]


@pytest.mark.parametrize("build, code, words", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_are_one_line(
    store_copy: Path, tmp_path: Path, build: object, code: int, words: str
) -> None:
    args = build(store_copy, tmp_path)  # type: ignore[operator]
    result = run_cli(*args)
    assert result.returncode == code, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("castore: ")
    assert words in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert "keep_last" not in lines[0] and "fraction" not in lines[0]  # the API's words
    assert result.stdout == ""


def test_debug_env_adds_the_traceback(store_copy: Path) -> None:
    env = {**os.environ, "CASTORE_DEBUG": "1"}
    result = subprocess.run(
        [str(CLI), "show", str(store_copy), "exp1@99"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1
    assert "Traceback" in result.stderr  # the control for "no traceback" above
    assert result.stderr.splitlines()[-1].startswith("castore: error: GenerationNotFoundError")


def test_text_columns_print_as_given_even_when_they_look_like_numbers() -> None:
    # A root prefix that reads as 1.05768e+17 and a run named with digits: a generation's
    # root in `castore log` was once printed as a float (its digest decided when).
    from castore.cli.output import text_table

    rows = [["0123", 4, "1057676782e8", ""], ["7", 12, "000000000001", "best"]]
    table = text_table(rows, ["run", "id", "root", "tags"], text=("run", "root", "tags"))
    assert "1057676782e8" in table and "000000000001" in table and "0123" in table
    assert "e+17" not in table
