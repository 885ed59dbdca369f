"""Chunk codecs: lossless compression of one chunk, recorded in the chunk's stored bytes.

A chunk's name is always the blake3 digest of its raw bytes, whatever the
codec, so dedup works across codecs and stores, and every read verifies the
raw bytes against the name as before. What a backend stores under the name
(a pack record's bytes) is either the raw chunk or a *frame*:

    magic "CSZ1" | codec u8 | width u8 | streams u8 | reserved u8 | raw length u64
    then per stream: kind u8 | stored length u64
    then the streams' bytes, in order

A frame is written only when it is shorter than the raw chunk (by
``MIN_SAVING``), so a reader that knows the chunk's length (every read names
the chunk through a tensor entry) tells the two apart by length alone: a
record exactly as long as the chunk is raw, any other is a frame. Readers
without a length (index checks, repair) accept a record when it hashes to its
name as raw bytes or decodes to bytes that do (:func:`stored_matches`).

Codecs (docs/FORMAT.md "Chunk frames"):

- ``zstd``: one zstd stream of the raw bytes.
- ``bytegroup``: for 2-, 4- and 8-byte floating-point elements. Each element
  is rotated left by one bit (the sign moves to the bottom, so the top byte
  holds only exponent bits), then byte ``i`` of every element goes to stream
  ``i``; each stream is zstd-coded where a sample of it shrinks (the exponent
  bytes), and kept raw where it does not (the mantissa bytes, close to
  random), which costs almost nothing to write or read.

Decoding is bounded before anything is allocated: the frame must declare the
length the reader expects, every stream's lengths must add up exactly, and a
zstd stream must declare its decoded size in its own header and produce
exactly that. A damaged or hostile frame raises :class:`CodecError` (or, once
decoded, fails the digest check like any damaged chunk); an unknown codec
raises :class:`UnknownCodecError`.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from castore.errors import CodecError, UnknownCodecError
from castore.format.hashing import Buffer, digest_here

FRAME_MAGIC = b"CSZ1"
_FRAME = struct.Struct("<4sBBBBQ")  # magic, codec, width, streams, reserved, raw length
_STREAM = struct.Struct("<BQ")  # kind, stored length
_RAW, _ZSTD = 0, 1  # stream kinds

CODEC_IDS = {"zstd": 1, "bytegroup": 2}
CODEC_NAMES = {number: name for name, number in CODEC_IDS.items()}
# What a store or a save may ask for: "auto" picks per tensor by dtype.
SETTINGS = ("none", "auto", "zstd", "bytegroup")

# A frame is kept only when it saves at least this fraction of the chunk.
MIN_SAVING = 1 / 32
# Chunks smaller than this are stored raw: a frame's header and zstd's own would
# eat most of what a few hundred bytes could save.
MIN_CHUNK = 4 << 10
# A stream is zstd-coded only when a sample of this many bytes shrinks by
# SAMPLE_SAVING; the sample costs ~1% of coding a 4 MiB chunk's stream.
SAMPLE_BYTES = 16 << 10
SAMPLE_SAVING = 0.1
# The zstd parameters, by measurement on exponent streams of trained weights
# (docs/PERFORMANCE.md "Compression"): the fast strategy with a tiny match
# table, since exponent bytes have few long matches and most of the win is
# zstd's Huffman coding of literals; a 1 MiB window.
_ZSTD_PARAMS = dict(
    window_log=20,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    write_content_size=True,
    write_checksum=False,
)
# The window a decoder accepts: what our writers use, with room; a frame
# asking for more is refused before zstd allocates it.
_MAX_WINDOW = 1 << 24

FLOAT_WIDTHS = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def check_setting(codec: str) -> str:
    """``codec`` if it is a setting a store or a save may ask for; ValueError otherwise."""
    if codec not in SETTINGS:
        raise ValueError(f"codec must be one of {', '.join(SETTINGS)}; got {codec!r}")
    return codec


# -- zstd, one compressor and decompressor per thread --------------------------------

_local = threading.local()


def _zstd() -> Any:
    import zstandard

    return zstandard


def _compressor() -> Any:
    found = getattr(_local, "compressor", None)
    if found is None:
        zstandard = _zstd()
        params = zstandard.ZstdCompressionParameters(
            strategy=zstandard.STRATEGY_FAST, **_ZSTD_PARAMS
        )
        found = _local.compressor = zstandard.ZstdCompressor(compression_params=params)
    return found


def _decompressor() -> Any:
    found = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = _zstd().ZstdDecompressor(max_window_size=_MAX_WINDOW)
    return found


# -- encoding --------------------------------------------------------------------------


@dataclass(frozen=True)
class Encoder:
    """How one tensor's chunks are encoded: a codec, and the element width it groups by."""

    codec: str
    width: int = 0

    def __call__(self, chunk: Buffer) -> Buffer:
        """The chunk's frame, or ``chunk`` itself where a frame would not save enough."""
        return encode(chunk, self)


def encoder_for(setting: str, dtype: str) -> Encoder | None:
    """The encoder a tensor of ``dtype`` gets under a store's or save's ``setting``.

    ``auto``: ``bytegroup`` for 2-, 4- and 8-byte floats, ``zstd`` for the
    rest (integers, bool, bytes, 1-byte floats). ``bytegroup`` asked for a
    dtype it cannot group falls back to ``zstd``.
    """
    if setting == "none":
        return None
    width = FLOAT_WIDTHS.get(dtype, 0)
    if setting in ("auto", "bytegroup") and width:
        return Encoder("bytegroup", width)
    return Encoder("zstd")


def _shrinks(stream: np.ndarray) -> bool:
    """Whether a sample from the middle of ``stream`` compresses by SAMPLE_SAVING."""
    start = (stream.nbytes - SAMPLE_BYTES) // 2
    sample = stream[start : start + SAMPLE_BYTES]
    return len(_compressor().compress(sample)) <= sample.nbytes * (1 - SAMPLE_SAVING)


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _group(chunk: memoryview, width: int) -> list[np.ndarray]:
    """The chunk's elements rotated left one bit, split into one stream per byte position.

    Every step writes into arrays made once (a fresh temporary per numpy
    operation costs its page faults: 4x the time on a 4 MiB chunk).
    """
    kind = _UINT[width]
    values = np.frombuffer(chunk, dtype=kind)
    rotated = np.left_shift(values, 1)
    spare = np.right_shift(values, width * 8 - 1)
    np.bitwise_or(rotated, spare, out=rotated)
    if width == 2:
        low = rotated.astype(np.uint8)
        np.right_shift(rotated, 8, out=rotated)
        return [low, rotated.astype(np.uint8)]
    planes = rotated.view(np.uint8).reshape(-1, width)
    return [np.ascontiguousarray(planes[:, i]) for i in range(width)]


def encode(chunk: Buffer, encoder: Encoder) -> Buffer:
    """``chunk`` as a frame by ``encoder``, or ``chunk`` itself when that saves too little."""
    view = memoryview(chunk).cast("B")
    size = view.nbytes
    if size < MIN_CHUNK:
        return chunk
    if encoder.codec == "bytegroup" and size % encoder.width == 0:
        codec, width, streams = "bytegroup", encoder.width, _group(view, encoder.width)
    else:
        codec, width, streams = "zstd", 0, [np.frombuffer(view, dtype=np.uint8)]
    parts: list[Buffer] = []
    table: list[bytes] = []
    stored = _FRAME.size + _STREAM.size * len(streams)
    limit = size * (1 - MIN_SAVING)
    for stream in streams:
        data: Buffer = stream
        kind = _RAW
        # A stream no larger than a sample is simply compressed: sampling it would be
        # compressing it twice.
        if stream.nbytes <= SAMPLE_BYTES or _shrinks(stream):
            packed = _compressor().compress(stream)
            if len(packed) <= stream.nbytes * (1 - SAMPLE_SAVING):
                data, kind = packed, _ZSTD
        table.append(_STREAM.pack(kind, memoryview(data).nbytes))
        parts.append(data)
        stored += memoryview(data).nbytes
    if stored > limit:
        return chunk
    header = _FRAME.pack(FRAME_MAGIC, CODEC_IDS[codec], width, len(streams), 0, size)
    return b"".join([header, *table, *parts])


# -- decoding --------------------------------------------------------------------------


def is_frame(stored: Buffer, length: int) -> bool:
    """Whether a record of ``stored`` bytes for a chunk of ``length`` bytes is a frame."""
    return memoryview(stored).nbytes != length


def frame_codec(stored: Buffer) -> str | None:
    """The codec a stored record's frame header names (None: not a frame header)."""
    view = memoryview(stored).cast("B")
    if view.nbytes < _FRAME.size or bytes(view[:4]) != FRAME_MAGIC:
        return None
    number = view[4]
    return CODEC_NAMES.get(number, f"unknown codec #{number}")


def decode(stored: Buffer, length: int, where: str = "", out: Buffer | None = None) -> Buffer:
    """The raw bytes a frame holds, which must be ``length`` bytes; CodecError otherwise.

    Nothing larger than ``length`` (plus the frame's own size) is allocated,
    whatever the frame claims. The caller still verifies the digest. ``out``:
    a writable buffer of ``length`` bytes to decode into (returned); it may
    hold anything after a CodecError.
    """
    view = memoryview(stored).cast("B")
    at = f" ({where})" if where else ""
    if view.nbytes < _FRAME.size:
        raise CodecError(f"a stored chunk of {view.nbytes} bytes is too short for a frame{at}")
    magic, number, width, count, reserved, raw_length = _FRAME.unpack_from(view)
    if magic != FRAME_MAGIC:
        raise CodecError(
            f"a stored chunk of {view.nbytes} bytes, where {length} are expected, is not "
            f"a frame (magic {bytes(magic)!r}){at}"
        )
    codec = CODEC_NAMES.get(number)
    if codec is None:
        raise UnknownCodecError(
            f"a chunk was stored with codec #{number}, which this castore does not know "
            f"(written by a newer castore?){at}"
        )
    if raw_length != length:
        raise CodecError(
            f"a {codec} frame declares {raw_length} raw bytes where {length} are expected{at}"
        )
    if reserved or (codec == "zstd" and width):
        # Refused, not ignored: a later format may give these bytes a meaning.
        raise CodecError(
            f"a {codec} frame has reserved byte {reserved} and width {width}; this castore "
            f"writes 0 in both (and a width only for bytegroup){at}"
        )
    expected_count = width if codec == "bytegroup" else 1
    if codec == "bytegroup" and (width not in _UINT or length % width):
        raise CodecError(f"a bytegroup frame has element width {width} for {length} bytes{at}")
    if count != expected_count:
        raise CodecError(f"a {codec} frame has {count} streams where {expected_count} belong{at}")
    table_end = _FRAME.size + _STREAM.size * count
    if view.nbytes < table_end:
        raise CodecError(f"a {codec} frame is cut off inside its stream table{at}")
    streams = [_STREAM.unpack_from(view, _FRAME.size + _STREAM.size * i) for i in range(count)]
    if table_end + sum(size for _, size in streams) != view.nbytes:
        raise CodecError(
            f"a {codec} frame's streams add up to {sum(s for _, s in streams)} bytes, but "
            f"{view.nbytes - table_end} follow its table (truncated or padded){at}"
        )
    stream_length = length // expected_count
    decoded: list[Buffer] = []
    position = table_end
    for kind, size in streams:
        data = view[position : position + size]
        position += size
        decoded.append(_decode_stream(kind, data, stream_length, codec, at))
    if codec == "zstd":
        if out is None:
            return decoded[0]
        memoryview(out).cast("B")[:] = memoryview(decoded[0]).cast("B")
        return out
    return _ungroup(decoded, width, length, out)


def _decode_stream(kind: int, data: memoryview, length: int, codec: str, at: str) -> Buffer:
    if kind == _RAW:
        if data.nbytes != length:
            raise CodecError(
                f"a raw stream of a {codec} frame has {data.nbytes} bytes, not {length}{at}"
            )
        return data
    if kind != _ZSTD:
        raise CodecError(f"a stream of a {codec} frame has unknown kind {kind}{at}")
    zstandard = _zstd()
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CodecError(f"a zstd stream of a {codec} frame is damaged: {exc}{at}") from None
    if declared != length:
        raise CodecError(
            f"a zstd stream of a {codec} frame declares {declared} bytes where {length} "
            f"belong{at}"
        )
    try:
        # Bytes after the zstd frame would go unread: refused like a padded frame.
        out = _decompressor().decompress(data, max_output_size=length, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"a zstd stream of a {codec} frame is damaged: {exc}{at}") from None
    if len(out) != length:
        raise CodecError(
            f"a zstd stream of a {codec} frame decoded to {len(out)} bytes, not {length}{at}"
        )
    return out  # type: ignore[no-any-return]


def _ungroup(streams: list[Buffer], width: int, length: int, out: Buffer | None) -> Buffer:
    """The elements the streams hold, interleaved again and rotated back, in ``out`` (or a
    new buffer): every step in place."""
    kind = _UINT[width]
    if out is None:
        out = bytearray(length)
    rotated = np.frombuffer(out, dtype=np.uint8).view(kind)
    if width == 2:
        np.copyto(rotated, np.frombuffer(streams[0], dtype=np.uint8), casting="unsafe")
        spare = np.frombuffer(streams[1], dtype=np.uint8).astype(np.uint16)
        np.left_shift(spare, 8, out=spare)
        np.bitwise_or(rotated, spare, out=rotated)
    else:
        planes = rotated.view(np.uint8).reshape(-1, width)
        for i, stream in enumerate(streams):
            planes[:, i] = np.frombuffer(stream, dtype=np.uint8)
        spare = np.empty_like(rotated)
    np.right_shift(rotated, 1, out=spare)
    np.left_shift(rotated, width * 8 - 1, out=rotated)
    np.bitwise_or(rotated, spare, out=rotated)
    return out


# -- helpers for readers ---------------------------------------------------------------


def raw_bytes(stored: Buffer, length: int, where: str = "") -> Buffer:
    """A stored record as the chunk's raw bytes: itself when ``length`` long, else decoded."""
    return stored if not is_frame(stored, length) else decode(stored, length, where)


def held_length(key: bytes, stored: Buffer, *, limit: int = 1 << 30) -> int | None:
    """The length of the chunk named ``key`` that a stored record holds (raw, or a frame that
    decodes to it); None when it holds no such chunk.

    For readers that do not know the chunk's length; ``limit`` bounds what a
    frame may declare. The record is hashed once as raw bytes, then decoded
    only if it starts as a frame.
    """
    return held_hashed(key, stored, lambda view: (digest_here(view), b""), limit=limit)[0]


def held_hashed(
    key: bytes,
    stored: Buffer,
    hasher: Callable[[memoryview], tuple[bytes, bytes]],
    *,
    limit: int = 1 << 30,
) -> tuple[int | None, bytes]:
    """:func:`held_length` by ``hasher`` (the chunk's digest and more of its hash, such as its
    pieces' chaining values: castore.format.pieces.hash_chunk), with that more; ``b""``
    where the record holds no such chunk."""
    view = memoryview(stored).cast("B")
    digest, more = hasher(view)
    if digest == key:
        return view.nbytes, more
    if frame_codec(view) is None:
        return None, b""
    declared = int(_FRAME.unpack_from(view)[5])
    if declared > limit:
        return None, b""
    try:
        digest, more = hasher(decode(view, declared))
    except CodecError:
        return None, b""
    return (declared, more) if digest == key else (None, b"")


def stored_matches(key: bytes, stored: Buffer, *, limit: int = 1 << 30) -> bool:
    """Whether a stored record holds the chunk named ``key`` (see :func:`held_length`)."""
    return held_length(key, stored, limit=limit) is not None


def raw_length(stored: Buffer) -> int | None:
    """The raw length a frame declares (None for a record that is not a frame)."""
    view = memoryview(stored).cast("B")
    if frame_codec(view) is None:
        return None
    return int(_FRAME.unpack_from(view)[5])
