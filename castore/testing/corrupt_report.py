"""What castore does with each damaged store of :mod:`castore.testing.corrupt`.

Four outcomes are recorded per case:

* load: ``Store.load(run)``: the error type and message, or the generation it
  loaded (checked bitwise against what was saved);
* targets: ``castore.dist.load`` (a group of one) into preallocated numpy
  targets filled with a sentinel: on failure every target must still hold it;
* verify: ``verify_store(store, deep=True)``: which generations it reports,
  and that each intact generation verifies clean on its own;
* fallback: ``Store.restore(run, fallback="previous")`` and
  ``castore.dist.load(..., fallback="previous")``: the generation loaded (which
  must be the newest undamaged one, bitwise) and the generations skipped, each
  with its error type.

Each is compared with the case's :class:`~castore.testing.corrupt.Expect`: a
case is PASS, FAIL, XFAIL (a known gap, ``Case.gaps``) or XPASS (a known gap
closed: strict, so the gap list cannot go stale).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

from castore.errors import CastoreError, FallbackWarning, IntegrityError
from castore.testing.corrupt import (
    ASPECTS,
    OTHER,
    RUN,
    Case,
    Expect,
    Fixture,
    bitwise_differences,
    damaged_store,
    fmt,
    load_into,
    make_targets,
    modified_targets,
    targets_equal,
)
from castore.verify import verify_store


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Outcome:
    """What castore did with one damaged store, and how that compares with the case."""

    case: str
    what: str
    load: str = ""
    load_error: str | None = None
    load_message: str = ""
    load_generation: int | None = None
    targets: str = ""
    dist_error: str | None = None
    targets_modified: list[str] = field(default_factory=list)
    verify: str = ""
    verify_damaged: list[list[Any]] = field(default_factory=list)
    verify_first_problem: str = ""
    verify_problems: list[str] = field(default_factory=list)
    verify_intact: dict[int, str] = field(default_factory=dict)  # generation -> "ok" or problem
    fallback: str = ""
    fallback_generation: int | None = None
    fallback_skipped: list[list[Any]] = field(default_factory=list)
    fallback_warned: bool = False
    dist_fallback_generation: int | None = None
    dist_fallback_skipped: list[list[Any]] = field(default_factory=list)
    failures: dict[str, list[str]] = field(default_factory=dict)  # aspect -> what was wrong
    status: str = ""
    seconds: float = 0.0


def observe(fixture: Fixture, case: Case) -> Outcome:
    """Run load, a targeted restore, verify and both fallbacks on a damaged store."""
    store, expect, facts = fixture.store, case.expect, fixture.facts
    outcome = Outcome(case.name, case.what)
    failures: dict[str, list[str]] = {aspect: [] for aspect in ASPECTS}

    # load, failing closed
    try:
        state = store.load(RUN)
    except CastoreError as exc:
        outcome.load_error, outcome.load_message = type(exc).__name__, str(exc)
        outcome.load = error_text(exc)
        failures["load"] += _check_error(exc, expect, facts)
    else:
        generation = store.resolve(RUN).id
        outcome.load_generation = generation
        outcome.load = f"loaded @{generation}"
        if expect.error is not None:
            failures["load"].append(f"loaded @{generation}; expected {expect.error.__name__}")
        elif generation != expect.loads:
            failures["load"].append(f"loaded @{generation}; expected @{expect.loads}")
        differences = bitwise_differences(state, fixture.expected_state(generation))
        if differences:
            failures["load"].append(f"loaded state differs from @{generation}: {differences[:3]}")

    # live targets
    targets = make_targets(fixture)
    try:
        result = load_into(store, targets)
    except CastoreError as exc:
        outcome.dist_error = type(exc).__name__
        outcome.targets_modified = modified_targets(targets)
        touched = outcome.targets_modified
        outcome.targets = (
            f"untouched ({outcome.dist_error})"
            if not touched
            else f"MODIFIED {touched} ({outcome.dist_error})"
        )
        if touched:
            failures["targets"].append(f"targets {touched} changed by a failed load")
        if expect.error is None:
            failures["targets"].append(f"dist.load raised {error_text(exc)}")
        elif not isinstance(exc, IntegrityError):
            failures["targets"].append(f"dist.load raised {type(exc).__name__}, not damage")
    else:
        generation = result.report.generation.id
        differences = targets_equal(targets, fixture.expected_state(generation))
        outcome.targets = f"hold @{generation}" + (" (DIFFER)" if differences else "")
        if expect.error is not None:
            failures["targets"].append(f"dist.load loaded @{generation} into the targets")
        elif generation != expect.loads or differences:
            failures["targets"].append(f"targets hold @{generation}: {differences[:3]}")

    # verify
    report = verify_store(store, deep=True)
    damaged = [[run, gen] for run, gen in report.damaged_generations]
    outcome.verify_damaged = damaged
    outcome.verify_problems = [str(problem) for problem in report.problems]
    outcome.verify_first_problem = outcome.verify_problems[0] if report.problems else ""
    wanted = sorted(([RUN, g] for g in expect.damaged), key=str)
    if damaged != wanted:
        failures["verify"].append(f"verify reports {damaged or 'no damage'}; expected {wanted}")
    for words in expect.verify_words:
        if not any(fmt(words, facts) in problem for problem in outcome.verify_problems):
            failures["verify"].append(f"no problem says {fmt(words, facts)!r}")
    for generation in expect.intact:
        one = verify_store(store, run=RUN, generation=generation, deep=True)
        outcome.verify_intact[generation] = "ok" if one.ok else str(one.problems[0])
        if not one.ok:
            failures["verify_intact"].append(f"@{generation}: {one.problems[0]}")
    if not verify_store(store, run=OTHER, deep=True).ok:
        failures["verify_intact"].append(f"run {OTHER!r} does not verify")
    problems = "ok" if report.ok else f"{len(report.problems)} problem(s): {report.problems[0]}"
    outcome.verify = f"damaged {_gens(report.damaged_generations)}; {problems}"

    # fallback
    _observe_fallback(fixture, expect, outcome, failures)
    _observe_dist_fallback(fixture, expect, outcome, failures)

    outcome.failures = {aspect: found for aspect, found in failures.items() if found}
    outcome.status = _status(case, outcome.failures)
    return outcome


def _gens(damaged: list[tuple[str, int | None]]) -> str:
    return ", ".join(f"{r}@{g}" if g is not None else r for r, g in damaged) or "none"


def _check_error(exc: CastoreError, expect: Expect, facts: dict[str, Any]) -> list[str]:
    if expect.error is None:
        return [f"raised {error_text(exc)}; expected @{expect.loads} to load"]
    found = []
    if type(exc) is not expect.error:
        found.append(f"raised {type(exc).__name__}; expected {expect.error.__name__}")
    for words in expect.words:
        if fmt(words, facts) not in str(exc):
            found.append(f"message lacks {fmt(words, facts)!r}")
    for name, value in expect.context:
        wanted = fmt(value, facts) if isinstance(value, str) else value
        if getattr(exc, name, None) != wanted:
            found.append(f"error.{name} is {getattr(exc, name, None)!r}; expected {wanted!r}")
    return found


def _skipped_pairs(skipped: list[Any]) -> list[list[Any]]:
    return [[s.generation, s.error] for s in skipped]


def _observe_fallback(
    fixture: Fixture, expect: Expect, outcome: Outcome, failures: dict[str, list[str]]
) -> None:
    store = fixture.store
    wanted_skips = [[g, expect.skipped_error] for g in expect.skipped]
    try:
        restored = store.restore(RUN, fallback="previous")
    except CastoreError as exc:
        outcome.fallback = f"raised {error_text(exc)}"
        failures["fallback"].append(outcome.fallback)
        return
    generation = restored.generation.id
    outcome.fallback_generation = generation
    outcome.fallback_skipped = _skipped_pairs(restored.skipped)
    differences = bitwise_differences(restored.state, fixture.expected_state(generation))
    skips = ", ".join(f"@{g} {e}" for g, e in outcome.fallback_skipped) or "nothing"
    outcome.fallback = f"@{generation}, skipped {skips}" + (" (DIFFERS)" if differences else "")
    if generation != expect.fallback:
        failures["fallback"].append(f"loaded @{generation}; expected @{expect.fallback}")
    if differences:
        failures["fallback"].append(f"@{generation} differs from what was saved: {differences[:3]}")
    if outcome.fallback_skipped != wanted_skips:
        failures["fallback"].append(f"skipped {outcome.fallback_skipped}; expected {wanted_skips}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.load(RUN, fallback="previous")
    outcome.fallback_warned = any(issubclass(w.category, FallbackWarning) for w in caught)
    if outcome.fallback_warned != bool(expect.skipped):
        failures["fallback"].append(f"FallbackWarning given: {outcome.fallback_warned}")


def _observe_dist_fallback(
    fixture: Fixture, expect: Expect, outcome: Outcome, failures: dict[str, list[str]]
) -> None:
    wanted_skips = [[g, expect.skipped_error] for g in expect.skipped]
    targets = make_targets(fixture)
    try:
        result = load_into(fixture.store, targets, fallback="previous")
    except CastoreError as exc:
        failures["dist_fallback"].append(f"dist.load(fallback) raised {error_text(exc)}")
        return
    generation = result.report.generation.id
    outcome.dist_fallback_generation = generation
    outcome.dist_fallback_skipped = _skipped_pairs(result.report.skipped)
    if generation != expect.fallback:
        failures["dist_fallback"].append(f"loaded @{generation}; expected @{expect.fallback}")
    differences = targets_equal(targets, fixture.expected_state(generation))
    if differences:
        failures["dist_fallback"].append(f"targets differ from @{generation}: {differences[:3]}")
    if outcome.dist_fallback_skipped != wanted_skips:
        failures["dist_fallback"].append(
            f"skipped {outcome.dist_fallback_skipped}; expected {wanted_skips}"
        )


def _status(case: Case, failures: dict[str, list[str]]) -> str:
    unexpected = [aspect for aspect in failures if aspect not in case.gaps]
    if unexpected:
        return "FAIL"
    if case.gaps and all(aspect in failures for aspect in case.gaps):
        return "XFAIL"
    if case.gaps:
        return "XPASS"  # a known gap closed: strict, so the gap list cannot go stale
    return "PASS"


def run_case(case: Case, path: Path) -> Outcome:
    started = time.perf_counter()
    with damaged_store(case, path) as fixture:
        outcome = observe(fixture, case)
    outcome.seconds = round(time.perf_counter() - started, 3)
    return outcome


def expected_text(case: Case) -> str:
    expect = case.expect
    first = expect.error.__name__ if expect.error else f"loads @{expect.loads}"
    return f"{first}; fallback @{expect.fallback}"


def table(cases: list[Case], outcomes: list[Outcome]) -> str:
    rows = [
        [
            outcome.case,
            _clip(outcome.load, 70),
            _clip(outcome.targets, 34),
            _clip(outcome.verify, 60),
            outcome.fallback,
            expected_text(case),
            outcome.status,
        ]
        for case, outcome in zip(cases, outcomes, strict=True)
    ]
    headers = ["case", "load", "targets", "verify --deep", "fallback", "expected", "result"]
    return tabulate(rows, headers=headers, tablefmt="github")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
