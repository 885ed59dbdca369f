"""The ref table contract: read, list, and compare-and-swap advance (the commit point)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from castore.errors import InvalidNameError, RefConflictError
from castore.format.hashing import Digest
from castore.repo.base import RefTable
from castore.repo.records import RefValue
from castore.testing._values import race, root, value

BAD_NAMES = ["", ".hidden", "a/b", "../x", "a..b", "x" * 129, "tab\tname", "é"]


class RefTableTests:
    """Subclass and override the ``refs`` fixture with a fresh, empty RefTable."""

    racers = 8
    rounds = 10

    @pytest.fixture
    def refs(self) -> RefTable:
        raise NotImplementedError("override the refs fixture to build the implementation")

    def test_an_unknown_run_reads_none(self, refs: RefTable) -> None:
        assert refs.read("never-saved") is None
        assert "never-saved" not in refs.runs()

    def test_the_first_advance_expects_no_ref(self, refs: RefTable) -> None:
        first = value("r", 1)
        assert refs.advance("r", expected=None, new=first) is None
        assert refs.read("r") == first
        assert "r" in refs.runs()

    def test_an_advance_returns_what_the_ref_named(self, refs: RefTable) -> None:
        first, second = value("r", 1), value("r", 2)
        refs.advance("r", expected=None, new=first)
        assert refs.advance("r", expected=first.root, new=second) == first
        assert refs.read("r") == second

    def test_a_value_round_trips_exactly(self, refs: RefTable) -> None:
        exact = RefValue("r", 2**40 + 3, root("exact"), 1_712_345_678.123456)
        refs.advance("r", expected=None, new=exact)
        assert refs.read("r") == exact

    def test_a_conflicting_expected_value_raises_and_leaves_the_ref(self, refs: RefTable) -> None:
        first, second = value("r", 1), value("r", 2)
        refs.advance("r", expected=None, new=first)
        refs.advance("r", expected=first.root, new=second)
        with pytest.raises(RefConflictError):
            refs.advance("r", expected=first.root, new=value("r", 3))  # stale
        with pytest.raises(RefConflictError):
            refs.advance("r", expected=None, new=value("r", 3))  # the ref exists
        with pytest.raises(RefConflictError):
            refs.advance("other", expected=second.root, new=value("other", 1))  # it does not
        assert refs.read("r") == second
        assert refs.read("other") is None

    def test_generation_ids_must_increase(self, refs: RefTable) -> None:
        fifth = value("r", 5)
        refs.advance("r", expected=None, new=fifth)
        for generation in (5, 4, 1):
            with pytest.raises(RefConflictError, match="must increase"):
                refs.advance("r", expected=fifth.root, new=value("r", generation, "later"))
        assert refs.read("r") == fifth
        refs.advance("r", expected=fifth.root, new=value("r", 9))
        assert refs.read("r") == value("r", 9)

    def test_invalid_run_names_raise(self, refs: RefTable) -> None:
        for name in BAD_NAMES:
            with pytest.raises(InvalidNameError):
                refs.read(name)
            with pytest.raises(InvalidNameError):
                refs.advance(name, expected=None, new=value(name, 1))
        assert refs.runs() == []

    def test_a_value_of_another_run_is_refused(self, refs: RefTable) -> None:
        with pytest.raises(ValueError):
            refs.advance("a", expected=None, new=value("b", 1))
        assert refs.read("a") is None and refs.read("b") is None

    def test_runs_are_kept_apart(self, refs: RefTable) -> None:
        refs.advance("a", expected=None, new=value("a", 1))
        refs.advance("b", expected=None, new=value("b", 7))
        assert (refs.read("a"), refs.read("b")) == (value("a", 1), value("b", 7))
        assert sorted(refs.runs()) == ["a", "b"]

    def test_racing_advances_from_one_expected_value_exactly_one_wins(self, refs: RefTable) -> None:
        current, stale = value("r", 2), value("r", 1)
        refs.advance("r", expected=None, new=stale)
        refs.advance("r", expected=stale.root, new=current)
        for round_ in range(self.rounds):
            # Even racers read the current ref, odd ones a stale one; the stale ones
            # propose the higher ids, so whichever of them runs first would get
            # through an advance that skipped the compare, in any schedule.
            base = current.generation
            expected = [current.root if i % 2 == 0 else stale.root for i in range(self.racers)]
            proposals = [
                value("r", base + 1 + i // 2 + (self.racers if i % 2 else 0), f"{round_}/{i}")
                for i in range(self.racers)
            ]

            def attempt(
                i: int, e: list[Digest] = expected, p: list[RefValue] = proposals
            ) -> RefValue | None:
                return refs.advance("r", expected=e[i], new=p[i])

            outcomes = race(self.racers, attempt)
            winners = [i for i, outcome in enumerate(outcomes) if outcome == current]
            assert len(winners) == 1, f"round {round_}: racers {winners} won: {outcomes}"
            assert winners[0] % 2 == 0, f"round {round_}: a racer with a stale ref won"
            others = [o for i, o in enumerate(outcomes) if i != winners[0]]
            assert all(isinstance(o, RefConflictError) for o in others), outcomes
            stale, current = current, proposals[winners[0]]
            assert refs.read("r") == current

    def test_around_wraps_the_write_with_the_current_value(self, refs: RefTable) -> None:
        first, second = value("r", 1), value("r", 2)
        refs.advance("r", expected=None, new=first)
        seen: list[object] = []

        @contextmanager
        def around(current: RefValue | None) -> Iterator[None]:
            seen.append(current)
            seen.append(refs.read("r"))  # not yet moved
            yield
            seen.append(refs.read("r"))  # moved

        refs.advance("r", expected=first.root, new=second, around=around)
        assert seen == [first, first, second]

    def test_a_refused_advance_never_enters_around(self, refs: RefTable) -> None:
        refs.advance("r", expected=None, new=value("r", 1))
        entered: list[object] = []

        @contextmanager
        def around(current: RefValue | None) -> Iterator[None]:
            entered.append(current)
            yield

        with pytest.raises(RefConflictError):
            refs.advance("r", expected=root("elsewhere"), new=value("r", 2), around=around)
        assert entered == []

    def test_an_error_in_around_before_the_write_leaves_the_ref(self, refs: RefTable) -> None:
        first = value("r", 1)
        refs.advance("r", expected=None, new=first)

        @contextmanager
        def around(current: RefValue | None) -> Iterator[None]:
            raise RuntimeError("the reflog could not be reconciled")
            yield  # pragma: no cover

        with pytest.raises(RuntimeError, match="reconciled"):
            refs.advance("r", expected=first.root, new=value("r", 2), around=around)
        assert refs.read("r") == first
        # and the ref is free again: the next advance is not blocked by the failed one
        refs.advance("r", expected=first.root, new=value("r", 2), timeout=5)
