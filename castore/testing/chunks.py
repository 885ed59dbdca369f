"""The chunk backend contract: immutable values under digests, in two namespaces."""

from __future__ import annotations

import pytest

from castore.chunkstore.base import ChunkBackend, Namespace
from castore.format.hashing import digest_bytes


def items(count: int, size: int = 100) -> list[tuple[bytes, bytes]]:
    """``count`` distinct (digest, value) pairs of about ``size`` bytes."""
    values = [bytes([i % 256]) * size + i.to_bytes(4, "little") for i in range(count)]
    return [(digest_bytes(v), v) for v in values]


class ChunkBackendTests:
    """Subclass and override the ``backend`` fixture (yield a fresh backend, close it after)."""

    @pytest.fixture
    def backend(self) -> ChunkBackend:
        raise NotImplementedError("override the backend fixture to build the implementation")

    def test_put_then_read_returns_the_same_bytes(self, backend: ChunkBackend) -> None:
        pairs = items(10)
        result = backend.put_many(Namespace.CHUNKS, pairs)
        assert (result.written, result.already_present) == (10, 0)
        assert result.written_bytes == sum(len(v) for _, v in pairs)
        got: list[bytes | None] = []
        backend.read_many(
            Namespace.CHUNKS,
            [k for k, _ in pairs],
            lambda values: got.extend(None if v is None else bytes(v) for v in values),
        )
        assert got == [v for _, v in pairs]

    def test_put_of_present_key_writes_nothing_and_keeps_the_first_value(
        self, backend: ChunkBackend
    ) -> None:
        key, value = items(1)[0]
        backend.put_many(Namespace.CHUNKS, [(key, value)])
        again = backend.put_many(Namespace.CHUNKS, [(key, b"something else")])
        assert (again.written, again.already_present, again.written_bytes) == (0, 1, 0)
        assert backend.get(Namespace.CHUNKS, key) == value

    def test_known_chunks_never_claims_an_absent_chunk(self, backend: ChunkBackend) -> None:
        pairs = items(4)
        backend.put_many(Namespace.CHUNKS, pairs[:2])
        backend.put_many(Namespace.OBJECTS, pairs[2:3])  # an object is not a chunk
        known = backend.known_chunks([k for k, _ in pairs])
        assert known[2:] == [False, False]
        # What it claims is present is present (it may not know of all that is).
        present = backend.has_many(Namespace.CHUNKS, [k for k, _ in pairs])
        assert all(p for k, p in zip(known, present, strict=True) if k)

    def test_namespaces_are_separate(self, backend: ChunkBackend) -> None:
        key, value = items(1)[0]
        backend.put_many(Namespace.OBJECTS, [(key, value)])
        assert backend.has_many(Namespace.OBJECTS, [key]) == [True]
        assert backend.has_many(Namespace.CHUNKS, [key]) == [False]
        assert backend.get(Namespace.CHUNKS, key) is None

    def test_missing_keys_read_as_none_in_order(self, backend: ChunkBackend) -> None:
        pairs = items(3)
        backend.put_many(Namespace.CHUNKS, pairs[:1] + pairs[2:])
        seen: list[bool] = []
        backend.read_many(
            Namespace.CHUNKS,
            [k for k, _ in pairs],
            lambda vs: seen.extend(v is not None for v in vs),
        )
        assert seen == [True, False, True]
        assert backend.has_many(Namespace.CHUNKS, [k for k, _ in pairs]) == [True, False, True]

    def test_delete_listing_and_sizes(self, backend: ChunkBackend) -> None:
        pairs = items(5, size=10)
        backend.put_many(Namespace.CHUNKS, pairs)
        assert sorted(backend.iter_keys(Namespace.CHUNKS)) == sorted(k for k, _ in pairs)
        assert dict(backend.value_sizes(Namespace.CHUNKS)) == {k: len(v) for k, v in pairs}
        assert backend.delete_many(Namespace.CHUNKS, [pairs[0][0], pairs[0][0], b"\0" * 32]) == 1
        assert len(list(backend.iter_keys(Namespace.CHUNKS))) == 4
        assert backend.get(Namespace.CHUNKS, pairs[0][0]) is None

    def test_values_can_be_memoryviews_of_larger_buffers(self, backend: ChunkBackend) -> None:
        buffer = bytearray(range(256)) * 4
        view = memoryview(buffer)[100:300]
        key = digest_bytes(view)
        backend.put_many(Namespace.CHUNKS, [(key, view)])
        buffer[100:300] = bytes(200)  # the backend kept its own copy
        assert backend.get(Namespace.CHUNKS, key) == bytes(range(100, 256)) + bytes(range(44))

    def test_a_deleted_key_can_be_put_again(self, backend: ChunkBackend) -> None:
        key, value = items(1)[0]
        backend.put_many(Namespace.CHUNKS, [(key, value)])
        backend.delete_many(Namespace.CHUNKS, [key])
        again = backend.put_many(Namespace.CHUNKS, [(key, value)])
        assert again.written == 1
        assert backend.get(Namespace.CHUNKS, key) == value

    def test_an_index_check_of_a_sound_backend_finds_no_problems(
        self, backend: ChunkBackend
    ) -> None:
        backend.put_many(Namespace.CHUNKS, items(4))
        assert backend.check_index(hash_bytes=True).ok

    def test_a_chunk_reader_copies_exactly_what_read_many_reads(
        self, backend: ChunkBackend
    ) -> None:
        """Where a backend offers a reader (``chunk_reader`` is not None)."""
        pairs = items(3, size=300)
        backend.put_many(Namespace.CHUNKS, pairs[:1] + pairs[2:])
        keys = [k for k, _ in pairs]
        reader = backend.chunk_reader(keys)
        if reader is None:
            pytest.skip("this backend reads chunks through read_many only")
        with reader:
            assert reader.lengths == [len(pairs[0][1]), None, len(pairs[2][1])]
            value = pairs[2][1]
            whole = bytearray(len(value))
            assert reader.readinto(2, memoryview(whole)) == len(value)
            assert bytes(whole) == value
            first = pairs[0][1]  # stored before the other: something follows it
            tail = bytearray(100)
            assert reader.readinto(0, memoryview(tail), len(first) - 40) == 40
            assert bytes(tail[:40]) == first[-40:]  # never past the stored value
            assert bytes(tail[40:]) == bytes(60)
            assert reader.readinto(1, memoryview(bytearray(10))) == 0  # absent: nothing read
