"""Chunk backends: the ABC, LMDB (the embedded default) and an in-memory one."""

from castore.chunkstore.base import ChunkBackend, Namespace, PutResult, ReadSink, ReclaimStats
from castore.chunkstore.lmdb.backend import LmdbBackend
from castore.chunkstore.memory import MemoryBackend

__all__ = [
    "ChunkBackend",
    "LmdbBackend",
    "MemoryBackend",
    "Namespace",
    "PutResult",
    "ReadSink",
    "ReclaimStats",
]
