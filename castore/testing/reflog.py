"""The reflog contract: append records, read them forwards, incrementally and backwards."""

from __future__ import annotations

import pytest

from castore.errors import InvalidNameError
from castore.repo.base import Reflog
from castore.repo.records import Record, make_reflog_record
from castore.testing._values import root, value
from castore.testing.refs import BAD_NAMES


def published(run: str, generation: int, *, action: str = "advance") -> Record:
    parent = root(f"{run}@{generation - 1}") if generation > 1 else None
    return make_reflog_record(run, value(run, generation), parent=parent, action=action)


def collected(run: str, generation: int) -> Record:
    return make_reflog_record(run, value(run, generation), parent=None, action="collect")


class ReflogTests:
    """Subclass and override the ``reflog`` fixture with a fresh, empty Reflog."""

    @pytest.fixture
    def reflog(self) -> Reflog:
        raise NotImplementedError("override the reflog fixture to build the implementation")

    def test_a_run_without_records_reads_empty(self, reflog: Reflog) -> None:
        assert reflog.read("never") == ([], [])
        assert list(reflog.records_backwards("never")) == []
        assert reflog.last_published("never") is None
        assert list(reflog.published_newest_first("never")) == []
        assert reflog.view("never").records == []
        assert "never" not in reflog.runs()

    def test_records_read_back_equal_and_in_append_order(self, reflog: Reflog) -> None:
        records = [published("r", g) for g in range(1, 6)]
        for record in records:
            reflog.append("r", record)
        assert reflog.read("r") == (records, [])
        assert reflog.view("r").records == records
        assert reflog.view("r", fresh=True).records == records
        assert "r" in reflog.runs()

    def test_records_backwards_are_newest_first(self, reflog: Reflog) -> None:
        records = [published("r", g) for g in range(1, 40)]
        for record in records:
            reflog.append("r", record)
        assert list(reflog.records_backwards("r")) == records[::-1]
        newest = next(iter(reflog.records_backwards("r")))
        assert newest == records[-1]

    def test_a_kept_view_sees_later_appends(self, reflog: Reflog) -> None:
        reflog.append("r", published("r", 1))
        before = reflog.view("r")
        assert [r["generation"] for r in before.records] == [1]
        reflog.append("r", published("r", 2))
        reflog.append("r", collected("r", 1))
        after = reflog.view("r")
        assert [(r["action"], r["generation"]) for r in after.records] == [
            ("advance", 1),
            ("advance", 2),
            ("collect", 1),
        ]
        assert after.listed == {root("r@2").hex: 2}
        assert after.collected == {root("r@1").hex}
        assert [pair for pair in reflog.published_newest_first("r")] == [(root("r@2").hex, 2)]

    def test_last_published_skips_collect_records(self, reflog: Reflog) -> None:
        for g in (1, 2, 3):
            reflog.append("r", published("r", g, action="recovered" if g == 2 else "advance"))
        for g in (1, 2):
            reflog.append("r", collected("r", g))
        assert reflog.last_published("r") == published("r", 3)
        reflog.append("r", published("r", 4, action="recovered"))
        assert reflog.last_published("r") == published("r", 4, action="recovered")

    def test_collect_records_cancel_their_generations(self, reflog: Reflog) -> None:
        for g in range(1, 6):
            reflog.append("r", published("r", g))
        for g in (1, 3):
            reflog.append("r", collected("r", g))
        expected = [(root(f"r@{g}").hex, g) for g in (5, 4, 2)]
        # Read backwards (a new handle) and from a kept view: the same answer.
        backwards = reflog.published_newest_first("r")
        assert list(backwards) == expected
        assert backwards.collected == {root("r@1").hex, root("r@3").hex}
        view = reflog.view("r")
        assert view.listed == {h: g for h, g in expected}
        assert list(reflog.published_newest_first("r")) == expected

    def test_listed_with_id_answers_what_the_view_lists(self, reflog: Reflog) -> None:
        """Long enough for an implementation to index it; asked before any view is kept."""
        for g in range(1, 121):
            reflog.append("r", published("r", g))
        for g in (3, 50, 118):
            reflog.append("r", collected("r", g))
        reflog.append("r", published("r", 121))
        reflog.append("r", published("r", 50))  # a collected root logged again: not listed
        reflog.append("r", published("r", 7, action="recovered"))  # listed once, as before
        answers = {g: reflog.listed_with_id("r", g) for g in range(0, 124)}
        listed = reflog.view("r").listed
        for g, roots in answers.items():
            assert roots == [hex_root for hex_root, i in listed.items() if i == g], g
        assert answers[7] == [root("r@7").hex] and answers[50] == answers[122] == []

    def test_runs_are_kept_apart(self, reflog: Reflog) -> None:
        reflog.append("a", published("a", 1))
        reflog.append("b", published("b", 1))
        reflog.append("b", published("b", 2))
        assert [r["run"] for r in reflog.read("a")[0]] == ["a"]
        assert [r["generation"] for r in reflog.read("b")[0]] == [1, 2]
        assert sorted(reflog.runs()) == ["a", "b"]

    def test_invalid_run_names_raise(self, reflog: Reflog) -> None:
        for name in BAD_NAMES:
            with pytest.raises(InvalidNameError):
                reflog.view(name)
            with pytest.raises(InvalidNameError):
                list(reflog.records_backwards(name))
            with pytest.raises(InvalidNameError):
                reflog.append(name, published("r", 1))

    def test_a_view_is_not_changed_by_the_caller_holding_a_read(self, reflog: Reflog) -> None:
        reflog.append("r", published("r", 1))
        records, _ = reflog.read("r")
        records.clear()
        assert reflog.read("r")[0] == [published("r", 1)]

    def test_location_names_the_run(self, reflog: Reflog) -> None:
        assert "r" in reflog.location("r")
