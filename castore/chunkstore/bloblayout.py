"""Format 3's layout on a BlobStore: the blob names, and the index blob's bytes.

The layout (docs/FORMAT.md, "Format 3"):

* ``packs/<pack>.pack`` -- an immutable pack in format 2's pack format (a
  header, then ``digest | length | bytes`` records). ``<pack>`` is the blake3
  of the record list (each digest and length, in order), which fixes every
  byte of the pack: the name is the content's.
* ``index/<pack>.<check>.idx`` -- an index blob: the pack's size and each
  listed chunk's digest, offset and length. ``<check>`` is 128 bits (32 hex
  digits) of the blake3 of the index blob's bytes, so a garbled or truncated
  index blob is recognised.
  A pack may have several index blobs for a moment (a collection writes the
  smaller one before it deletes the larger); a chunk is present only if
  **every** index blob of its pack lists it, so deleting a chunk from a pack
  that stays is one small create and one delete.
* ``objects/<2 hex>/<64 hex>`` -- manifests and roots, one blob each,
  named by their digest.

:class:`~castore.chunkstore.blobpacks.BlobPackBackend` keeps chunks and
objects in this layout.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from castore.chunkstore.packfile import PACK_HEADER, RECORD_HEADER
from castore.errors import IndexCorruptError
from castore.format.hashing import digest_bytes

PACK_PREFIX = "packs/"
INDEX_PREFIX = "index/"
OBJECT_PREFIX = "objects/"
PACK_SUFFIX = ".pack"
INDEX_SUFFIX = ".idx"

INDEX_MAGIC = b"CASTIDX\0"
INDEX_VERSION = 1
_INDEX_HEADER = struct.Struct("<8sIIQ")  # magic, version, entry count, pack size
_INDEX_ENTRY = struct.Struct("<32sQQ")  # digest, offset of the chunk's bytes, length
_PACK_NAME_TAG = b"castore-pack-v1\0"


@dataclass(frozen=True)
class BlobLocation:
    """Where one chunk's bytes lie: ``offset`` is that of its first byte in the pack."""

    pack: str
    offset: int
    length: int


@dataclass(frozen=True)
class IndexBlob:
    """One parsed index blob."""

    name: str
    pack: str
    pack_size: int
    entries: tuple[tuple[bytes, int, int], ...]  # digest, offset, length


def object_blob(key: bytes) -> str:
    text = bytes(key).hex()
    return f"{OBJECT_PREFIX}{text[:2]}/{text}"


def pack_blob(pack: str) -> str:
    return f"{PACK_PREFIX}{pack}{PACK_SUFFIX}"


def pack_name(records: Sequence[tuple[bytes, int]]) -> str:
    """A pack's name: the blake3 of its record list, which fixes its bytes."""
    listing = b"".join(digest + length.to_bytes(8, "little") for digest, length in records)
    return digest_bytes(_PACK_NAME_TAG + listing).hex()


def encode_index(pack_size: int, entries: Sequence[tuple[bytes, int, int]]) -> bytes:
    header = _INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, len(entries), pack_size)
    return header + b"".join(_INDEX_ENTRY.pack(*entry) for entry in entries)


def index_blob_name(pack: str, data: bytes) -> str:
    return f"{INDEX_PREFIX}{pack}.{_index_check(data)}{INDEX_SUFFIX}"


def _index_check(data: bytes) -> str:
    """The check part of an index blob's name: 128 bits of the bytes' blake3 (32 hex)."""
    return digest_bytes(data).hex()[:32]


def parse_index(name: str, data: bytes) -> IndexBlob:
    """Check an index blob against its name and parse it; IndexCorruptError says what is wrong."""
    stem = name[len(INDEX_PREFIX) : -len(INDEX_SUFFIX)]
    pack, _, expected = stem.partition(".")
    if _index_check(data) != expected:
        raise IndexCorruptError(
            f"index blob {name!r} does not hash to its name: it is garbled or cut short"
        )
    if len(data) < _INDEX_HEADER.size:
        raise IndexCorruptError(f"index blob {name!r} is {len(data)} bytes: too short")
    magic, version, count, pack_size = _INDEX_HEADER.unpack_from(data)
    if magic != INDEX_MAGIC or version != INDEX_VERSION:
        raise IndexCorruptError(f"index blob {name!r} has magic {magic!r} version {version}")
    if len(data) != _INDEX_HEADER.size + count * _INDEX_ENTRY.size:
        raise IndexCorruptError(f"index blob {name!r} is {len(data)} bytes for {count} entries")
    entries = tuple(_INDEX_ENTRY.iter_unpack(data[_INDEX_HEADER.size :]))
    for digest, offset, length in entries:
        if offset < PACK_HEADER.size + RECORD_HEADER.size or offset + length > pack_size:
            raise IndexCorruptError(
                f"index blob {name!r} places chunk {digest.hex()[:16]} at {offset}+{length}, "
                f"outside its pack of {pack_size} bytes"
            )
    return IndexBlob(name, pack, pack_size, entries)


def is_object_name(name: str) -> bool:
    tail = name.rsplit("/", 1)[-1]
    return len(tail) == 64 and all(c in "0123456789abcdef" for c in tail)


def pack_of(index_name: str) -> str:
    return index_name[len(INDEX_PREFIX) :].split(".", 1)[0]


def is_index_name(name: str) -> bool:
    if not (name.startswith(INDEX_PREFIX) and name.endswith(INDEX_SUFFIX)):
        return False
    parts = name[len(INDEX_PREFIX) : -len(INDEX_SUFFIX)].split(".")
    return len(parts) == 2 and len(parts[0]) == 64 and len(parts[1]) == 32
