"""Blobs: the primitives a format-3 store is laid out over (S3, a shared directory, memory).

:mod:`castore.blob.base` defines :class:`BlobStore` (create-if-absent,
compare-and-swap, ranged get, head, list a prefix, delete) and its
:class:`Version` token; :mod:`castore.blob.memory` keeps blobs in memory for
tests, :mod:`castore.blob.posix` in a directory several nodes share,
:mod:`castore.blob.s3` in an S3-protocol bucket (boto3, imported only when an
S3 store is built). Every implementation passes :class:`castore.testing.blobs.BlobStoreTests`.
"""

from castore.blob.base import BlobStore, ByteRange, Version, validate_blob_name
from castore.blob.memory import MemoryBlobStore
from castore.blob.posix import PosixBlobStore
from castore.blob.s3 import S3BlobStore

__all__ = [
    "BlobStore",
    "ByteRange",
    "MemoryBlobStore",
    "PosixBlobStore",
    "S3BlobStore",
    "Version",
    "validate_blob_name",
]
