"""The corruption fixture (castore.testing.corrupt): every kind of damage, every outcome.

Each case builds a real LMDB store (three generations of ``run``; for the rank
cases generation 3 is a 2-rank generation), damages the newest generation in
one way, and then checks, each in its own test:

* ``Store.load`` fails closed with the exact error type, naming what is wrong;
* ``castore.dist.load`` into live targets leaves every target byte untouched;
* ``verify_store(deep=True)`` reports the damage, and every intact generation
  verifies clean on its own;
* ``fallback="previous"`` (``Store.restore``/``load`` and ``castore.dist.load``)
  loads the newest undamaged generation bitwise and lists what it skipped.

Where castore mishandles a case the test is ``xfail(strict=True)`` with the
reason kept in the fixture's case table (``Case.gaps``), so the printed table
of tools/corrupt.py and these tests agree. The damaged stores are read-only once built and
are shared by the tests of one case.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from castore.errors import (
    CastoreError,
    ChecksumMismatchError,
    ChunkMissingError,
    CodecError,
    CorruptObjectError,
    CorruptRefError,
    IntegrityError,
    ObjectMissingError,
)
from castore.store import FallbackWarning
from castore.testing import corrupt
from castore.verify import verify_store

TOOLS = Path(__file__).resolve().parents[1] / "tools"

RUN = corrupt.RUN
NEWEST = corrupt.NEWEST

# What each case must do, spelled out here so the tool's own table is pinned:
# case -> (the exact error Store.load raises, or None when it loads the newest
# complete generation; the generation a fallback loads; the generations it skips).
EXPECTED: dict[str, tuple[type[CastoreError] | None, int, tuple[int, ...]]] = {
    "chunk-missing": (ChunkMissingError, 2, (3,)),
    "chunk-truncated": (ChecksumMismatchError, 2, (3,)),
    # A cut pack: a load reads the cut chunks as damaged; verify names the pack truncated.
    "pack-truncated": (ChecksumMismatchError, 2, (3,)),
    "chunk-checksum": (ChecksumMismatchError, 2, (3,)),
    # A compressed frame that claims 2**60 raw bytes: refused before anything is allocated.
    "chunk-hostile-frame": (CodecError, 2, (3,)),
    "shard-stale-generation": (CorruptObjectError, 2, (3,)),
    "shard-stale-run": (CorruptObjectError, 2, (3,)),
    "shard-bytes-swapped": (ChecksumMismatchError, 2, (3,)),
    "manifest-garbled": (ChecksumMismatchError, 2, (3,)),
    "manifest-truncated": (ChecksumMismatchError, 2, (3,)),
    "manifest-truncated-named": (CorruptObjectError, 2, (3,)),
    # A damaged ref damages no generation: the reflog still names @3, which is intact;
    # the fallback reports the ref itself (as "generation 0") so it is never silent.
    "ref-garbled": (CorruptRefError, 3, (0,)),
    "ref-truncated": (CorruptRefError, 3, (0,)),
    # The ref's own root @3 is skipped; the reflog's root of @3 is intact.
    "ref-substituted": (CorruptObjectError, 3, (3,)),
    "root-missing": (ObjectMissingError, 2, (3,)),
    "shard-duplicated": (CorruptObjectError, 2, (3,)),
    "shard-duplicated-in-place": (CorruptObjectError, 2, (3,)),
    "rank-count-high": (CorruptObjectError, 2, (3,)),
    "rank-count-low": (CorruptObjectError, 2, (3,)),
    "rank-order": (CorruptObjectError, 2, (3,)),
    # Acks without a root (or a root without the ref advance) publish nothing.
    "coordinator-lost": (None, 3, ()),
    "coordinator-lost-after-root": (None, 3, ()),
}


def cases_for(aspect: str) -> list[Any]:
    """Every case, marked xfail(strict=True) where castore is known to mishandle ``aspect``."""
    params = []
    for case in corrupt.CASES:
        marks = []
        if aspect in case.gaps:
            marks.append(pytest.mark.xfail(strict=True, reason=case.gaps[aspect]))
        params.append(pytest.param(case, id=case.name, marks=marks))
    return params


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Any]]:
    """``damaged(case)``: the case's damaged store, built once per module."""
    built: dict[str, Any] = {}
    base = tmp_path_factory.mktemp("corrupt")

    def get(case: corrupt.Case) -> corrupt.Fixture:
        if case.name not in built:
            fixture = corrupt.build(base / case.name, case.layout)
            built[case.name] = fixture
            case.damage(fixture)
        return built[case.name]

    yield get
    for fixture in built.values():
        fixture.close()


def words(texts: tuple[str, ...], fixture: corrupt.Fixture) -> list[str]:
    return [corrupt.fmt(text, fixture.facts) for text in texts]


def assert_bitwise(actual: Any, expected: Any) -> None:
    differences = corrupt.bitwise_differences(actual, expected)
    assert not differences, differences


def assert_untouched(targets: dict[str, Any]) -> None:
    modified = corrupt.modified_targets(targets)
    assert not modified, f"live targets modified: {modified}"


# -- the case table ------------------------------------------------------------


def test_every_case_has_a_pinned_expectation() -> None:
    assert [case.name for case in corrupt.CASES] == list(EXPECTED)
    for case in corrupt.CASES:
        error, fallback, skipped = EXPECTED[case.name]
        assert (case.expect.error, case.expect.fallback, case.expect.skipped) == (
            error,
            fallback,
            skipped,
        ), case.name
        assert error is None or issubclass(error, IntegrityError), case.name
        assert set(case.gaps) <= set(corrupt.ASPECTS), case.name
        if error is None:
            assert case.expect.loads == NEWEST and not case.expect.damaged


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_control_the_undamaged_store_passes_every_check(tmp_path: Path, layout: str) -> None:
    fixture = corrupt.build(tmp_path / "store", layout)  # itself checks verify and every load
    try:
        assert fixture.ranks[NEWEST] == (corrupt.RANKS if layout == "sharded" else 1)
        assert_bitwise(fixture.store.load(RUN), fixture.expected_state(NEWEST))
        targets = corrupt.make_targets(fixture)
        assert corrupt.load_into(fixture.store, targets).report.generation.id == NEWEST
        assert corrupt.targets_equal(targets, fixture.expected_state(NEWEST)) == []
        restored = fixture.store.restore(RUN, fallback="previous")
        assert restored.generation.id == NEWEST and restored.skipped == []
    finally:
        fixture.close()


# -- load fails closed ---------------------------------------------------------


@pytest.mark.parametrize("case", cases_for("load"))
def test_load_raises_the_exact_error_naming_what_is_wrong(
    damaged: Callable[..., Any], case: corrupt.Case
) -> None:
    fixture = damaged(case)
    error, _, _ = EXPECTED[case.name]
    if error is None:
        assert_bitwise(fixture.store.load(RUN), fixture.expected_state(case.expect.loads))
        assert fixture.store.resolve(RUN).id == case.expect.loads
        return
    with pytest.raises(CastoreError) as info:
        fixture.store.load(RUN)
    exc = info.value
    assert type(exc) is error, f"{type(exc).__name__}: {exc}"
    assert isinstance(exc, IntegrityError)
    for text in words(case.expect.words, fixture):
        assert text in str(exc)
    for name, value in case.expect.context:
        wanted = corrupt.fmt(value, fixture.facts) if isinstance(value, str) else value
        assert getattr(exc, name, None) == wanted, name


# -- live state ----------------------------------------------------------------


@pytest.mark.parametrize("case", cases_for("targets"))
def test_a_failed_restore_leaves_every_live_target_untouched(
    damaged: Callable[..., Any], case: corrupt.Case
) -> None:
    fixture = damaged(case)
    error, _, _ = EXPECTED[case.name]
    targets = corrupt.make_targets(fixture)
    assert_untouched(targets)  # the sentinel is in place before the load
    if error is None:
        result = corrupt.load_into(fixture.store, targets)
        assert result.report.generation.id == case.expect.loads
        assert corrupt.targets_equal(targets, fixture.expected_state(case.expect.loads)) == []
        return
    with pytest.raises(CastoreError) as info:
        corrupt.load_into(fixture.store, targets)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert_untouched(targets)


def test_broken_control_the_untouched_check_sees_a_modified_target(tmp_path: Path) -> None:
    """The sentinel check is not vacuous: a load that writes the targets fails it."""
    fixture = corrupt.build(tmp_path / "store")
    try:
        targets = corrupt.make_targets(fixture)
        assert_untouched(targets)
        corrupt.load_into(fixture.store, targets, NEWEST - 1)  # the intact previous generation
        assert sorted(corrupt.modified_targets(targets)) == sorted(corrupt.tensors_of(targets))
        with pytest.raises(AssertionError, match="live targets modified"):
            assert_untouched(targets)
        # One byte of one target is enough.
        targets = corrupt.make_targets(fixture)
        targets["model"]["counts"].reshape(-1).view(np.uint8)[13] ^= 1
        assert corrupt.modified_targets(targets) == ["model/counts"]
        # ...and the bitwise comparison sees a single flipped bit as well.
        state = fixture.expected_state(NEWEST)
        state["model"]["w"].reshape(-1).view(np.uint8)[0] ^= 1
        assert corrupt.bitwise_differences(state, fixture.expected_state(NEWEST)) == [
            "./model/w: bytes differ"
        ]
    finally:
        fixture.close()


# -- verify --------------------------------------------------------------------


@pytest.mark.parametrize("case", cases_for("verify"))
def test_deep_verify_reports_the_damaged_generation(
    damaged: Callable[..., Any], case: corrupt.Case
) -> None:
    fixture = damaged(case)
    report = verify_store(fixture.store, deep=True)
    wanted = sorted(((RUN, g) for g in case.expect.damaged), key=str)
    assert report.damaged_generations == wanted, [str(p) for p in report.problems]
    assert report.ok == (not wanted)
    problems = [str(problem) for problem in report.problems]
    for text in words(case.expect.verify_words, fixture):
        assert any(text in problem for problem in problems), (text, problems)


@pytest.mark.parametrize("case", cases_for("verify_intact"))
def test_every_intact_generation_verifies_clean_on_its_own(
    damaged: Callable[..., Any], case: corrupt.Case
) -> None:
    fixture = damaged(case)
    for generation in case.expect.intact:
        report = verify_store(fixture.store, run=RUN, generation=generation, deep=True)
        assert report.ok, (generation, [str(p) for p in report.problems])
    assert verify_store(fixture.store, run=corrupt.OTHER, deep=True).ok


# -- fallback ------------------------------------------------------------------


@pytest.mark.parametrize("case", cases_for("fallback"))
def test_fallback_loads_the_newest_undamaged_generation_bitwise(
    damaged: Callable[..., Any], case: corrupt.Case
) -> None:
    fixture = damaged(case)
    error, fallback, skipped = EXPECTED[case.name]
    restored = fixture.store.restore(RUN, fallback="previous")
    assert restored.generation.id == fallback
    assert_bitwise(restored.state, fixture.expected_state(fallback))
    assert [(s.generation, s.error) for s in restored.skipped] == [
        (g, error.__name__ if error else "") for g in skipped
    ]
    for skip in restored.skipped:
        for text in words(case.expect.words, fixture):
            assert text in skip.reason
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_bitwise(fixture.store.load(RUN, fallback="previous"), restored.state)
    warned = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(warned) == (1 if skipped else 0)
    if skipped:
        assert f"loaded {RUN}@{fallback} after skipping {skipped[0]}" in str(warned[0].message)


@pytest.mark.parametrize("case", cases_for("dist_fallback"))
def test_dist_load_fallback_fills_the_targets_with_the_newest_undamaged_generation(
    damaged: Callable[..., Any], case: corrupt.Case
) -> None:
    fixture = damaged(case)
    error, fallback, skipped = EXPECTED[case.name]
    targets = corrupt.make_targets(fixture)
    result = corrupt.load_into(fixture.store, targets, fallback="previous")
    assert result.report.generation.id == fallback
    assert corrupt.targets_equal(targets, fixture.expected_state(fallback)) == []
    assert [(s.generation, s.error) for s in result.report.skipped] == [
        (g, error.__name__ if error else "") for g in skipped
    ]


# -- the tool ------------------------------------------------------------------


def _table_rows(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in corrupt.CASES_BY_NAME:
            rows[cells[0]] = cells
    return rows


@pytest.mark.slow
def test_the_tool_prints_a_pass_row_per_case_and_exits_zero(tmp_path: Path) -> None:
    out = tmp_path / "outcomes.json"
    result = subprocess.run(
        [sys.executable, str(TOOLS / "corrupt.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _table_rows(result.stdout)
    assert list(rows) == list(EXPECTED)
    for case in corrupt.CASES:
        # A known castore gap is XFAIL (and would be XPASS, exit 1, once fixed).
        assert rows[case.name][-1] == ("XFAIL" if case.gaps else "PASS"), rows[case.name]
        error, fallback, _ = EXPECTED[case.name]
        load = rows[case.name][1]
        if not case.gaps:
            assert load.startswith(error.__name__) if error else load == f"loaded @{NEWEST}"
            assert rows[case.name][4].startswith(f"@{fallback}")
    assert "FAILED" not in result.stdout and "XPASS" not in result.stdout
    outcomes = {o["case"]: o for o in json.loads(out.read_text())}
    assert list(outcomes) == list(EXPECTED)
    for case in corrupt.CASES:
        outcome = outcomes[case.name]
        assert set(outcome["failures"]) == set(case.gaps), outcome["failures"]
        if not case.gaps:
            assert outcome["fallback_generation"] == EXPECTED[case.name][1]
            assert outcome["targets_modified"] == []


@pytest.mark.slow
def test_the_tool_runs_chosen_cases_in_a_given_directory(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(TOOLS / "corrupt.py"),
            "--store",
            str(tmp_path),
            "--case",
            "chunk-missing",
            "rank-order",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _table_rows(result.stdout)
    assert {name: cells[-1] for name, cells in rows.items()} == {
        "chunk-missing": "PASS",
        "rank-order": "PASS",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunk-missing", "rank-order"]
