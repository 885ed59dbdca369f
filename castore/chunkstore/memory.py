"""An in-memory backend for tests: the same contract, no durability."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence

from castore.chunkstore.base import ChunkBackend, Namespace, PutResult, ReadSink
from castore.format.hashing import Buffer


class MemoryBackend(ChunkBackend):
    """Keeps every value in a dict; thread-safe, lost when the process ends."""

    def __init__(self) -> None:
        self._data: dict[Namespace, dict[bytes, bytes]] = {ns: {} for ns in Namespace}
        self._lock = threading.Lock()
        self._closed = False

    def _space(self, namespace: Namespace) -> dict[bytes, bytes]:
        if self._closed:
            raise ValueError("backend is closed")
        return self._data[Namespace(namespace)]

    def has_many(self, namespace: Namespace, keys: Sequence[bytes]) -> list[bool]:
        space = self._space(namespace)
        return [bytes(k) in space for k in keys]

    def read_many(self, namespace: Namespace, keys: Sequence[bytes], sink: ReadSink) -> None:
        space = self._space(namespace)
        values = (space.get(bytes(key)) for key in keys)
        sink(None if v is None else memoryview(v) for v in values)

    def put_many(self, namespace: Namespace, items: Iterable[tuple[bytes, Buffer]]) -> PutResult:
        space = self._space(namespace)
        written = written_bytes = present = 0
        with self._lock:
            for key, value in items:
                key = bytes(key)
                if key in space:
                    present += 1
                    continue
                data = bytes(memoryview(value).cast("B"))
                space[key] = data
                written += 1
                written_bytes += len(data)
        return PutResult(written, written_bytes, present)

    def delete_many(self, namespace: Namespace, keys: Iterable[bytes]) -> int:
        space = self._space(namespace)
        with self._lock:
            return sum(space.pop(bytes(k), None) is not None for k in keys)

    def iter_keys(self, namespace: Namespace) -> Iterator[bytes]:
        yield from list(self._space(namespace))

    def value_sizes(self, namespace: Namespace) -> Iterator[tuple[bytes, int]]:
        yield from [(k, len(v)) for k, v in self._space(namespace).items()]

    def close(self) -> None:
        self._closed = True
