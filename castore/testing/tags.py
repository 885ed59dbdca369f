"""The tag table contract: write (replacing), get, list, delete."""

from __future__ import annotations

import pytest

from castore.errors import InvalidNameError
from castore.repo.base import TagTable
from castore.testing._values import value
from castore.testing.refs import BAD_NAMES


class TagTableTests:
    """Subclass and override the ``tags`` fixture with a fresh, empty TagTable."""

    @pytest.fixture
    def tags(self) -> TagTable:
        raise NotImplementedError("override the tags fixture to build the implementation")

    def test_an_absent_tag_reads_none(self, tags: TagTable) -> None:
        assert tags.get("r", "best") is None
        assert tags.all("r") == {}
        assert tags.runs() == []

    def test_write_then_get_and_list_sorted(self, tags: TagTable) -> None:
        tags.write("r", "zeta", value("r", 3))
        tags.write("r", "alpha", value("r", 1))
        assert tags.get("r", "alpha") == value("r", 1)
        assert list(tags.all("r").items()) == [("alpha", value("r", 1)), ("zeta", value("r", 3))]
        assert tags.runs() == ["r"]

    def test_writing_a_tag_again_replaces_it(self, tags: TagTable) -> None:
        tags.write("r", "best", value("r", 1))
        tags.write("r", "best", value("r", 2))
        assert tags.get("r", "best") == value("r", 2)
        assert tags.all("r") == {"best": value("r", 2)}

    def test_delete_says_whether_there_was_a_tag(self, tags: TagTable) -> None:
        tags.write("r", "best", value("r", 1))
        tags.write("r", "other", value("r", 2))
        assert tags.delete("r", "best") is True
        assert tags.delete("r", "best") is False
        assert tags.delete("never", "best") is False
        assert tags.get("r", "best") is None
        assert tags.all("r") == {"other": value("r", 2)}

    def test_a_run_whose_last_tag_is_deleted_is_not_listed(self, tags: TagTable) -> None:
        tags.write("r", "best", value("r", 1))
        tags.delete("r", "best")
        assert tags.runs() == []
        assert tags.all("r") == {}

    def test_runs_are_kept_apart(self, tags: TagTable) -> None:
        tags.write("a", "best", value("a", 1))
        tags.write("b", "best", value("b", 5))
        assert tags.get("a", "best") == value("a", 1)
        assert tags.get("b", "best") == value("b", 5)
        assert sorted(tags.runs()) == ["a", "b"]

    def test_names_run_at_name_cannot_address_are_refused_on_write(self, tags: TagTable) -> None:
        # RUN@123 is always generation id 123 and RUN@latest the newest: such a tag
        # could never be named where a generation is asked for.
        for name in ("123", "0", "007", "latest"):
            with pytest.raises(InvalidNameError, match="could never be named"):
                tags.write("r", name, value("r", 1))
            assert tags.get("r", name) is None
            assert tags.delete("r", name) is False  # removing one is allowed: there is none
        assert tags.runs() == []

    def test_invalid_names(self, tags: TagTable) -> None:
        for name in BAD_NAMES:
            with pytest.raises(InvalidNameError):
                tags.write("r", name, value("r", 1))
            with pytest.raises(InvalidNameError):
                tags.write(name, "best", value("r", 1))
            with pytest.raises(InvalidNameError):
                tags.all(name)
            with pytest.raises(InvalidNameError):
                tags.get(name, "best")
            # Lookups by a string that cannot be a tag (a root prefix, say) find nothing.
            assert tags.get("r", name) is None
        assert tags.runs() == []
