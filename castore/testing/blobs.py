"""The blob contract: create-if-absent, compare-and-swap, ranges, listing, delete, names."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import pytest

from castore.blob.base import MAX_MUTABLE_BLOB, BlobStore, Version
from castore.errors import (
    BlobConflictError,
    BlobExistsError,
    BlobNotFoundError,
    BlobRangeError,
    BlobTooLargeError,
    InvalidNameError,
    RefConflictError,
)
from castore.testing._values import race

HOSTILE_NAMES = [
    "",
    "/etc/passwd",
    "trailing/",
    "a//b",
    "../escape",
    "a/../../escape",
    "a/..",
    "..",
    ".hidden",
    "a/.b.lock",
    "-dash",
    "x" * 129,
    "a/" * 256 + "b",
    "tab\tname",
    "new\nline",
    "nul\x00byte",
    "back\\slash",
    "é",
    "a b",
]
HOSTILE_PREFIXES = ["/", "/a", "../", "a/../", "a//", ".", "a/.", "a/.x", "é", "a b", "x" * 600]


class BlobStoreTests:
    """Subclass and override the ``blobs`` fixture with a fresh, empty BlobStore.

    Give the implementation a small list page (fewer names than ``many``) so
    that listing crosses pages. ``streamed_peak_limit`` is the most Python
    memory a streamed create of ``streamed_size`` bytes may hold at once; None
    skips that check (a store that keeps blobs in memory holds them whole).
    """

    racers = 8
    rounds = 10
    many = 50
    streamed_size = 8 << 20
    streamed_piece = 64 << 10
    streamed_peak_limit: int | None = 2 << 20

    @pytest.fixture
    def blobs(self) -> BlobStore:
        raise NotImplementedError("override the blobs fixture to build the implementation")

    # -- create-if-absent ------------------------------------------------------------

    def test_a_created_blob_reads_back(self, blobs: BlobStore) -> None:
        version = blobs.create("packs/p1.pack", b"hello, blob")
        assert isinstance(version, Version)
        assert blobs.get("packs/p1.pack") == b"hello, blob"
        assert blobs.head("packs/p1.pack") == len(b"hello, blob")

    def test_a_second_create_raises_and_keeps_the_first(self, blobs: BlobStore) -> None:
        blobs.create("n", b"first")
        with pytest.raises(BlobExistsError) as refused:
            blobs.create("n", b"second")
        assert isinstance(refused.value, FileExistsError)
        assert blobs.get("n") == b"first"
        assert list(blobs.list()) == ["n"]

    def test_an_empty_blob_exists(self, blobs: BlobStore) -> None:
        blobs.create("empty", b"")
        assert blobs.head("empty") == 0
        assert blobs.get("empty") == b""
        with pytest.raises(BlobExistsError):
            blobs.create("empty", b"")

    def test_create_takes_any_buffers_and_iterables_of_them(self, blobs: BlobStore) -> None:
        blobs.create("one", bytearray(b"abc"))
        blobs.create("view", memoryview(b"xabcx")[1:4])
        blobs.create("list", [b"a", bytearray(b"b"), memoryview(b"c")])
        blobs.create("gen", (bytes([c]) for c in b"abc"))
        blobs.create("none", iter([]))
        assert [blobs.get(n) for n in ("one", "view", "list", "gen")] == [b"abc"] * 4
        assert blobs.get("none") == b""

    def test_racing_creates_exactly_one_wins(self, blobs: BlobStore) -> None:
        for round_ in range(self.rounds):
            name = f"race/{round_}"

            def attempt(i: int, n: str = name) -> Version:
                return blobs.create(n, f"racer {i}".encode())

            outcomes = race(self.racers, attempt)
            winners = [i for i, o in enumerate(outcomes) if isinstance(o, Version)]
            assert len(winners) == 1, f"round {round_}: {outcomes}"
            others = [o for i, o in enumerate(outcomes) if i != winners[0]]
            assert all(isinstance(o, BlobExistsError) for o in others), outcomes
            assert blobs.get(name) == f"racer {winners[0]}".encode()

    def test_a_create_whose_data_fails_leaves_no_blob(self, blobs: BlobStore) -> None:
        def failing() -> Iterator[bytes]:
            yield b"x" * 1000
            raise RuntimeError("the source broke")

        with pytest.raises(RuntimeError, match="source broke"):
            blobs.create("half", failing())
        assert blobs.head("half") is None
        assert list(blobs.list()) == []
        blobs.create("half", b"whole")
        assert blobs.get("half") == b"whole"

    def test_a_large_create_streams_its_pieces(self, blobs: BlobStore) -> None:
        count = self.streamed_size // self.streamed_piece
        consumed: list[int] = []

        def pieces() -> Iterator[bytes]:
            for k in range(count):
                consumed.append(k)
                yield _piece(k, self.streamed_piece)  # a fresh object each time

        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            blobs.create("big.pack", pieces())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert consumed == list(range(count))
        if self.streamed_peak_limit is not None:
            assert peak < self.streamed_peak_limit, (
                f"creating {self.streamed_size} bytes from {self.streamed_piece}-byte pieces "
                f"held {peak} bytes at once: it collected the pieces instead of streaming them"
            )
        assert blobs.head("big.pack") == count * self.streamed_piece
        for k in (0, count // 2, count - 1):
            start = k * self.streamed_piece
            assert blobs.get("big.pack", start, start + self.streamed_piece) == _piece(
                k, self.streamed_piece
            )

    # -- ranged reads ----------------------------------------------------------------

    def test_ranges_read_exactly_those_bytes(self, blobs: BlobStore) -> None:
        data = bytes(range(256)) * 4
        blobs.create("r", data)
        assert blobs.get("r") == data
        assert blobs.get("r", 0, len(data)) == data
        assert blobs.get("r", 100, 356) == data[100:356]
        assert blobs.get("r", 1000) == data[1000:]
        assert blobs.get("r", end=7) == data[:7]
        for at in (0, 500, len(data)):
            assert blobs.get("r", at, at) == b""
        assert blobs.get("r", len(data)) == b""

    def test_ranges_outside_the_blob_raise(self, blobs: BlobStore) -> None:
        blobs.create("r", b"0123456789")
        for start, end in [(11, None), (11, 12), (5, 11), (0, 1 << 40), (6, 5), (-1, 3), (0, -1)]:
            with pytest.raises(BlobRangeError) as refused:
                blobs.get("r", start, end)
            assert isinstance(refused.value, IndexError)
            assert "'r'" in str(refused.value)

    def test_an_absent_blob(self, blobs: BlobStore) -> None:
        with pytest.raises(BlobNotFoundError) as refused:
            blobs.get("packs/absent")
        assert isinstance(refused.value, FileNotFoundError)
        with pytest.raises(BlobNotFoundError):
            blobs.get("absent", 0, 0)
        assert blobs.head("packs/absent") is None
        assert blobs.read_versioned("packs/absent") is None

    # -- compare-and-swap ------------------------------------------------------------

    def test_swap_from_none_creates_only_if_absent(self, blobs: BlobStore) -> None:
        version = blobs.swap("refs/r", b"one", None)
        assert blobs.read_versioned("refs/r") == (b"one", version)
        with pytest.raises(BlobConflictError) as refused:
            blobs.swap("refs/r", b"two", None)
        assert isinstance(refused.value, RefConflictError)
        assert blobs.read_versioned("refs/r") == (b"one", version)

    def test_swap_from_the_current_version_replaces_the_blob(self, blobs: BlobStore) -> None:
        first = blobs.swap("refs/r", b"one", None)
        second = blobs.swap("refs/r", b"two", first)
        assert second != first
        assert blobs.read_versioned("refs/r") == (b"two", second)
        assert blobs.get("refs/r") == b"two"
        third = blobs.swap("refs/r", b"three!", second)
        assert blobs.read_versioned("refs/r") == (b"three!", third)
        assert blobs.head("refs/r") == 6

    def test_a_stale_or_wrong_version_raises_and_leaves_the_blob(self, blobs: BlobStore) -> None:
        first = blobs.swap("refs/r", b"one", None)
        second = blobs.swap("refs/r", b"two", first)
        with pytest.raises(BlobConflictError):
            blobs.swap("refs/r", b"three", first)  # stale
        with pytest.raises(BlobConflictError):
            blobs.swap("refs/other", b"x", second)  # absent, but a version was expected
        assert blobs.read_versioned("refs/r") == (b"two", second)
        assert blobs.head("refs/other") is None

    def test_a_created_blob_can_be_swapped_from_its_version(self, blobs: BlobStore) -> None:
        created = blobs.create("refs/r", b"made by create")
        assert blobs.read_versioned("refs/r") == (b"made by create", created)
        swapped = blobs.swap("refs/r", b"swapped", created)
        assert blobs.read_versioned("refs/r") == (b"swapped", swapped)

    def test_racing_swaps_from_one_version_exactly_one_wins(self, blobs: BlobStore) -> None:
        stale = blobs.swap("refs/r", b"initial", None)
        current = blobs.swap("refs/r", b"round -1", stale)
        for round_ in range(self.rounds):
            # Even racers hold the current version, odd ones a stale one: a swap
            # that skipped its compare would let several through, stale ones too.
            expected = [current if i % 2 == 0 else stale for i in range(self.racers)]
            proposals = [f"round {round_} racer {i}".encode() for i in range(self.racers)]

            def attempt(i: int, e: list[Version] = expected, p: list[bytes] = proposals) -> Version:
                return blobs.swap("refs/r", p[i], e[i])

            outcomes = race(self.racers, attempt)
            winners = [i for i, o in enumerate(outcomes) if isinstance(o, Version)]
            assert len(winners) == 1, f"round {round_}: racers {winners} won: {outcomes}"
            assert winners[0] % 2 == 0, f"round {round_}: a racer with a stale version won"
            others = [o for i, o in enumerate(outcomes) if i != winners[0]]
            assert all(isinstance(o, BlobConflictError) for o in others), outcomes
            stale, current = current, outcomes[winners[0]]
            assert blobs.read_versioned("refs/r") == (proposals[winners[0]], current)

    def test_racing_create_and_swap_from_none_exactly_one_wins(self, blobs: BlobStore) -> None:
        for round_ in range(self.rounds):
            name = f"refs/{round_}"

            def attempt(i: int, n: str = name) -> Version:
                mine = f"racer {i}".encode()
                return blobs.create(n, mine) if i % 2 else blobs.swap(n, mine, None)

            outcomes = race(self.racers, attempt)
            winners = [i for i, o in enumerate(outcomes) if isinstance(o, Version)]
            assert len(winners) == 1, f"round {round_}: {outcomes}"
            assert all(
                isinstance(o, (BlobExistsError, BlobConflictError))
                for i, o in enumerate(outcomes)
                if i != winners[0]
            ), outcomes
            assert blobs.get(name) == f"racer {winners[0]}".encode()

    def test_swap_refuses_more_than_a_mutable_blob_holds(self, blobs: BlobStore) -> None:
        with pytest.raises(ValueError, match="at most"):
            blobs.swap("refs/r", bytes(MAX_MUTABLE_BLOB + 1), None)
        assert blobs.head("refs/r") is None
        blobs.swap("refs/r", bytes(MAX_MUTABLE_BLOB), None)  # the bound itself is allowed

    def test_a_blob_over_the_mutable_bound_does_not_read_as_mutable(self, blobs: BlobStore) -> None:
        blobs.create("packs/large", bytes(MAX_MUTABLE_BLOB + 1))
        with pytest.raises(BlobTooLargeError):
            blobs.read_versioned("packs/large")

    # -- listing ---------------------------------------------------------------------

    def test_list_returns_only_the_prefix_in_key_order(self, blobs: BlobStore) -> None:
        names = ["packs/b.pack", "packs/a.pack", "packs/a.idx", "packsX", "pack", "refs/main"]
        names += ["a/b", "a.c", "a-c/d", "a0", "refs/main.old", "refs/mainline/x"]
        for name in names:
            blobs.create(name, name.encode())
        assert list(blobs.list()) == sorted(names)
        assert list(blobs.list("packs/")) == ["packs/a.idx", "packs/a.pack", "packs/b.pack"]
        assert list(blobs.list("packs")) == [
            "packs/a.idx",
            "packs/a.pack",
            "packs/b.pack",
            "packsX",
        ]
        assert list(blobs.list("packs/a")) == ["packs/a.idx", "packs/a.pack"]
        assert list(blobs.list("refs/main")) == ["refs/main", "refs/main.old", "refs/mainline/x"]
        assert list(blobs.list("a")) == ["a-c/d", "a.c", "a/b", "a0"]
        assert list(blobs.list("a/b")) == ["a/b"]
        assert list(blobs.list("nothing/")) == [] and list(blobs.list("z")) == []

    def test_list_crosses_pages(self, blobs: BlobStore) -> None:
        names = [f"many/{i:04d}" for i in range(self.many)]
        for name in reversed(names):
            blobs.create(name, b"")
        blobs.create("other/0", b"")
        blobs.create("manz", b"")
        assert list(blobs.list("many/")) == names
        assert list(blobs.list()) == [*names, "manz", "other/0"]

    # -- delete ----------------------------------------------------------------------

    def test_delete_is_idempotent(self, blobs: BlobStore) -> None:
        version = blobs.swap("refs/r", b"one", None)
        blobs.create("packs/p", b"pack")
        assert blobs.delete("refs/r") is True
        assert blobs.delete("refs/r") is False
        assert blobs.delete("never/there") is False
        assert blobs.head("refs/r") is None and blobs.read_versioned("refs/r") is None
        with pytest.raises(BlobNotFoundError):
            blobs.get("refs/r")
        with pytest.raises(BlobConflictError):
            blobs.swap("refs/r", b"two", version)  # it is gone: a version cannot match
        assert list(blobs.list()) == ["packs/p"]
        blobs.swap("refs/r", b"again", None)
        assert blobs.get("refs/r") == b"again"
        assert blobs.delete("packs/p") is True
        blobs.create("packs/p", b"new pack")
        assert blobs.get("packs/p") == b"new pack"

    # -- names -----------------------------------------------------------------------

    def test_hostile_names_are_refused(self, blobs: BlobStore) -> None:
        for name in HOSTILE_NAMES:
            for attempt in (
                lambda n=name: blobs.create(n, b"x"),
                lambda n=name: blobs.swap(n, b"x", None),
                lambda n=name: blobs.get(n),
                lambda n=name: blobs.head(n),
                lambda n=name: blobs.read_versioned(n),
                lambda n=name: blobs.delete(n),
            ):
                with pytest.raises(InvalidNameError) as refused:
                    attempt()
                assert isinstance(refused.value, ValueError)
        assert list(blobs.list()) == []

    def test_hostile_prefixes_are_refused(self, blobs: BlobStore) -> None:
        for prefix in HOSTILE_PREFIXES:
            with pytest.raises(InvalidNameError):
                list(blobs.list(prefix))

    def test_the_longest_names_are_accepted(self, blobs: BlobStore) -> None:
        longest_segment = "s" * 128
        deep = "/".join(["d" * 127] * 4)[:511] + "e"
        for name in (longest_segment, deep):
            blobs.create(name, b"x")
            assert blobs.get(name) == b"x"
        assert sorted(blobs.list()) == sorted([longest_segment, deep])

    def test_a_name_under_a_blob_is_refused_or_kept_apart(self, blobs: BlobStore) -> None:
        # A directory cannot also be a file: a shared directory refuses the pair;
        # an object store may keep both. Either way nothing is lost or mixed up.
        blobs.create("a", b"blob a")
        try:
            blobs.create("a/b", b"blob a/b")
        except InvalidNameError:
            assert list(blobs.list("a")) == ["a"]
        else:
            assert blobs.get("a/b") == b"blob a/b"
        assert blobs.get("a") == b"blob a"
        blobs.create("c/d", b"blob c/d")
        try:
            blobs.swap("c", b"blob c", None)
        except InvalidNameError:
            assert blobs.head("c") is None
        assert blobs.get("c/d") == b"blob c/d"


def _piece(index: int, size: int) -> bytes:
    return index.to_bytes(4, "little") * (size // 4)
