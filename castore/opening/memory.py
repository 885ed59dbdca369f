"""A whole ``Store`` in memory, for tests: every part of it lost when it is dropped.

Its repository parts (refs, reflog, tags, locks) are
:class:`castore.repo.memory.MemoryRefStore`, its chunks and objects
:class:`castore.chunkstore.memory.MemoryBackend`; this module puts them
together, as :mod:`castore.opening.directory` does for a store directory.
"""

from __future__ import annotations

from pathlib import Path

from castore.chunkstore.memory import MemoryBackend
from castore.core.chunkio import DEFAULT_CHUNK_SIZE
from castore.format.objects import MAX_CHUNK_SIZE
from castore.repo.memory import MemoryRefStore
from castore.store import Store


def memory_store(chunk_size: int | None = None, *, name: str = "memory") -> Store:
    """A new, empty ``Store`` whose chunks, objects, refs, reflog, tags and locks are in memory.

    Everything a store on disk does through its handle works on it (save,
    load, generations, tags, gc, verify, repair, du); it is lost when the
    store is dropped. ``name`` appears in messages (``memory:NAME``).
    """
    size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_CHUNK_SIZE:
        raise ValueError(
            f"chunk_size must be a positive int of at most {MAX_CHUNK_SIZE} bytes, "
            f"got {chunk_size!r}"
        )
    return Store(Path(f"memory:{name}"), MemoryBackend(), size, refs=MemoryRefStore())
