"""Progress on stderr: bars with a total known up front, phase lines, and silence by default.

Bars are forced on with ``CASTORE_PROGRESS=1`` (stderr is not a terminal under
pytest) and redrawn on every update (``MIN_INTERVAL = 0``), so every state a
bar passes through is in the captured output.
"""

from __future__ import annotations

import fcntl
import io
import os
import re
import struct
import subprocess
import sys
import termios
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cli_runner
import numpy as np
import pytest
from cli_runner import clean_env
from tqdm import tqdm

import castore
from castore import Store, gc
from castore.chunkstore.base import Namespace
from castore.repair import rebuild_index, repair_store
from castore.support import progress
from castore.verify import verify_store

CLI = Path(sys.executable).parent / "castore"
# One drawn state of a tqdm bar: "desc:  42%|####      | 1.00k/2.38k [...]".
FRAME = re.compile(
    r"(?P<desc>[^:\r\n]+): +(?P<percent>\d+)%\|[^|]*\| (?P<count>[^/ ]+)/(?P<total>\S+)"
)


def bar_frames(err: str, desc: str) -> list[tuple[int, str, str]]:
    """(percent, count, total) of every drawn state of the bar called ``desc``."""
    frames = []
    for text in re.split(r"[\r\n]", err):
        found = FRAME.match(text)
        if found and found["desc"] == desc:
            frames.append((int(found["percent"]), found["count"], found["total"]))
    return frames


def assert_reaches_100_once(frames: list[tuple[int, str, str]]) -> None:
    """One total throughout, never going back, at 100% only at the end."""
    assert frames, "no bar was drawn"
    assert len({total for _, _, total in frames}) == 1, f"the total changed: {frames}"
    percents = [percent for percent, _, _ in frames]
    assert percents == sorted(percents), f"the bar went back: {percents}"
    arrivals = sum(
        1 for was, now in zip([0, *percents[:-1]], percents, strict=True) if now == 100 != was
    )
    assert arrivals == 1 and percents[-1] == 100, f"reached 100% {arrivals} time(s): {percents}"


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[progress.Bar]:
    """Bars forced on and redrawn on every update; every bar made is listed here."""
    monkeypatch.setenv(progress.ENV_VAR, "1")
    monkeypatch.setattr(progress, "MIN_INTERVAL", 0)
    made: list[progress.Bar] = []

    class Recorded(progress.Bar):
        def __init__(self, desc: str, total: int, unit: str) -> None:
            super().__init__(desc, total, unit)
            made.append(self)

    monkeypatch.setattr(progress, "Bar", Recorded)
    return made


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.ENV_VAR, raising=False)


def tensor_bytes(node: Any) -> int:
    if isinstance(node, np.ndarray):
        return node.nbytes
    if isinstance(node, castore.RankLocal):
        return tensor_bytes(node.value)
    if isinstance(node, dict):
        return sum(tensor_bytes(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return sum(tensor_bytes(v) for v in node)
    return 0


def stored_chunk_bytes(store: Store) -> int:
    return sum(size for _, size in store.backend.value_sizes(Namespace.CHUNKS))


def save_generations(store: Store, count: int = 5) -> None:
    """``count`` generations of run ``r``: a fixed part and 8 KiB of new chunks each."""
    rng = np.random.default_rng(1)
    fixed = rng.standard_normal(1024, dtype=np.float32)
    for step in range(count):
        moving = rng.standard_normal(2048, dtype=np.float32)
        store.save({"fixed": fixed, "moving": moving}, run="r", step=step)
    store.save({"fixed": fixed}, run="other", step=0)  # shares every chunk with `r`


# -- the check itself -----------------------------------------------------------------------


def test_the_check_catches_a_bar_whose_total_grows() -> None:
    """Broken control: the old verify grew the total per generation, hitting 100% each time."""
    out = io.StringIO()
    bar = tqdm(desc="verify", file=out, mininterval=0, miniters=0)
    for _ in range(3):
        bar.total = (bar.total or 0) + 8
        bar.update(8)
    bar.close()
    with pytest.raises(AssertionError, match="total changed"):
        assert_reaches_100_once(bar_frames(out.getvalue(), "verify"))


# -- verify ---------------------------------------------------------------------------------


def test_verify_deep_knows_its_total_before_hashing(
    store: Store, bars: list[progress.Bar], capsys: pytest.CaptureFixture[str]
) -> None:
    save_generations(store)
    report = verify_store(store, deep=True, progress=True)
    assert report.ok and report.generations == 6
    (bar,) = bars
    assert bar.count == bar.total == stored_chunk_bytes(store)
    frames = bar_frames(capsys.readouterr().err, "verify (re-hash)")
    assert len(frames) > 6  # intermediate states were drawn, not just the first and last
    assert_reaches_100_once(frames)


def test_verify_sample_and_damage_still_end_at_the_total(
    store: Store, bars: list[progress.Bar], capsys: pytest.CaptureFixture[str]
) -> None:
    save_generations(store)
    stored = stored_chunk_bytes(store)
    assert verify_store(store, sample=0.5, progress=True).ok
    victim = next(iter(store.backend.iter_keys(Namespace.CHUNKS)))
    store.backend.delete_many(Namespace.CHUNKS, [victim])
    assert not verify_store(store, deep=True, progress=True).ok
    sampled, damaged = bars
    assert sampled.count == sampled.total == stored
    assert damaged.count == damaged.total == stored  # the missing chunk counts as done
    first, second, _ = capsys.readouterr().err.split("\n")  # a bar ends its line when it closes
    assert_reaches_100_once(bar_frames(first, "verify (re-hash)"))
    assert_reaches_100_once(bar_frames(second, "verify (re-hash)"))


# -- save and load --------------------------------------------------------------------------


def test_save_and_load_count_the_state_tensor_bytes(
    store: Store,
    bars: list[progress.Bar],
    capsys: pytest.CaptureFixture[str],
    make_state: Callable[..., dict[str, Any]],
) -> None:
    state = make_state()
    state["model"]["tied"] = state["model"]["embed.weight"].copy()  # chunks read once, twice used
    state["cursor"] = castore.RankLocal(np.arange(300, dtype=np.int64))  # read after the rest
    total = tensor_bytes(state)
    store.save(state, run="r", step=1, progress=True)
    store.load("r", progress=True)
    store.restore("r", progress=True)
    saved, loaded, restored = bars
    assert (saved.count, saved.total) == (total, total)
    assert (loaded.count, loaded.total) == (total, total)
    assert (restored.count, restored.total) == (total, total)
    save_line, load_line, restore_line, _ = capsys.readouterr().err.split("\n")  # one per bar
    assert_reaches_100_once(bar_frames(save_line, "save r@1"))
    load_frames = bar_frames(load_line, "load r@1")
    assert_reaches_100_once(load_frames)
    assert load_frames[-1][2] == tqdm.format_sizeof(total, divisor=1024)  # shown in the bar
    assert_reaches_100_once(bar_frames(restore_line, "load r@1"))


# -- gc, repair, compact: through the CLI, which asks for progress ---------------------------


def run_cli(*args: object, force: bool = True) -> subprocess.CompletedProcess[str]:
    env = clean_env(**{progress.ENV_VAR: "1"}) if force else clean_env()
    return cli_runner.run_cli(*args, env=env)


@pytest.fixture
def closed_store(store_path: Path) -> Path:
    with castore.open(store_path, chunk_size=1024) as store:
        save_generations(store)
    return store_path


def test_cli_gc_shows_its_phases_and_bars(closed_store: Path) -> None:
    result = run_cli("gc", closed_store, "--keep", "1")
    assert result.returncode == 0, result.stderr
    phases = re.findall(r"^gc \[(\d)/5\]", result.stderr, re.MULTILINE)
    assert phases == ["1", "2", "3", "4", "5"]
    assert_reaches_100_once(bar_frames(result.stderr, "gc mark"))
    assert_reaches_100_once(bar_frames(result.stderr, "gc sweep"))
    assert "gc [" not in result.stdout and "%|" not in result.stdout  # the report is unchanged


def test_cli_repair_and_rebuild_show_bars(closed_store: Path) -> None:
    result = run_cli("repair", closed_store, "--rebuild-index")
    assert result.returncode == 0, result.stderr
    phases = re.findall(r"^rebuild-index \[(\d)/3\]", result.stderr, re.MULTILINE)
    assert phases == ["1", "2", "3"]
    for desc in ("rebuild-index", "repair (re-hash)", "verify"):
        assert_reaches_100_once(bar_frames(result.stderr, desc))


def test_cli_compact_and_verify_show_progress(closed_store: Path) -> None:
    result = run_cli("compact", closed_store)
    assert result.returncode == 0, result.stderr
    assert re.findall(r"^compact \[(\d)/3\]", result.stderr, re.MULTILINE) == ["1", "2", "3"]
    result = run_cli("verify", closed_store, "--deep")
    assert result.returncode == 0, result.stderr
    assert_reaches_100_once(bar_frames(result.stderr, "verify (re-hash)"))


# -- off by default ---------------------------------------------------------------------------


def test_the_api_writes_nothing_to_stderr_by_default(
    store: Store, store_path: Path, quiet: None, capsys: pytest.CaptureFixture[str]
) -> None:
    save_generations(store)
    store.load("r")
    verify_store(store, deep=True)
    verify_store(store, deep=True, progress=True)  # asked for, but stderr is no terminal
    store.load("r", progress=True)
    repair_store(store)
    gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
    store.close()
    gc.compact(store_path)
    rebuild_index(store_path, progress=True)
    assert capsys.readouterr().err == ""


def test_the_cli_writes_nothing_to_a_pipe(closed_store: Path) -> None:
    for args in (
        ("verify", closed_store, "--deep"),
        ("gc", closed_store, "--keep", "1"),
        ("repair", closed_store, "--rebuild-index"),
        ("compact", closed_store),
    ):
        result = run_cli(*args, force=False)
        assert result.returncode == 0, result.stderr
        assert result.stderr == "", args


def read_all(fd: int) -> Iterator[bytes]:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the other side of the terminal is closed
            return
        if not data:
            return
        yield data


@pytest.mark.parametrize("setting", [None, "0"])
def test_a_terminal_gets_a_bar_unless_turned_off(closed_store: Path, setting: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    if setting is not None:
        env[progress.ENV_VAR] = setting
    main, terminal = os.openpty()
    # A new pseudo-terminal is 0 columns wide: tqdm would fit its bar into nothing.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        result = subprocess.run(
            [str(CLI), "verify", str(closed_store), "--deep"],
            stdout=subprocess.PIPE,
            stderr=terminal,
            env=env,
            timeout=60,
        )
    finally:
        os.close(terminal)
    try:
        err = b"".join(read_all(main)).decode()
    finally:
        os.close(main)
    assert result.returncode == 0
    if setting == "0":
        assert err == ""
    else:
        assert_reaches_100_once(bar_frames(err, "verify (re-hash)"))
