"""Chunk codecs (castore.format.codec): every dtype round-trips bitwise through every
setting, a frame is written only where it saves, and a damaged or hostile frame is
refused with a typed error before anything is allocated from a size it claims."""

from __future__ import annotations

import functools
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from castore.format import codec
from castore.format.codec import (
    MIN_CHUNK,
    MIN_SAVING,
    SAMPLE_BYTES,
    CodecError,
    Encoder,
    UnknownCodecError,
)
from castore.format.dtypes import SUPPORTED_DTYPES, numpy_dtype
from castore.format.hashing import digest_bytes

# The frame layout as the module docstring documents it, written out here so the
# tests pin the on-disk format rather than reuse the module's own structs.
_HEADER = struct.Struct("<4sBBBBQ")  # magic, codec, width, streams, reserved, raw length
_ENTRY = struct.Struct("<BQ")  # kind, stored length
RAW, ZSTD = 0, 1
ZSTD_ID, BYTEGROUP_ID = 1, 2

SETTINGS = ("zstd", "bytegroup", "auto")
SIZES = {  # by what each size tests
    "below MIN_CHUNK": MIN_CHUNK - 8,
    "MIN_CHUNK": MIN_CHUNK,
    "not a multiple of any width": MIN_CHUNK + 3,
    "4 MiB + 2": (4 << 20) + 2,
}
KINDS = ("normal", "zeros", "constant", "random", "specials")
# The chunks the hostile-frame tests damage, and the special values: large enough
# for every special bit pattern and for a frame longer than a compressed bomb.
BASE_BYTES = 128 << 10
# The big chunk with the kinds that cost the most to encode; the rest at the small sizes.
BIG_KINDS = ("normal", "random")


# -- data ------------------------------------------------------------------------------


def _elements(dtype: str, size: int) -> int:
    width = numpy_dtype(dtype).itemsize
    return -(-size // width)


@functools.cache
def _random(size: int) -> bytes:
    return np.random.default_rng(size).bytes(size)


def _specials(width: int, count: int) -> np.ndarray:
    """Bit patterns floats treat specially: NaNs with payloads, infinities, -0, subnormals.

    One- and two-byte elements count through every pattern; wider ones cycle
    their top sixteen bits through {0, the exponent's bits, the sign, both}
    over a counter in the bits below (0 there: the infinities).
    """
    kind = np.dtype(f"<u{width}")
    counter = np.arange(count, dtype=kind)
    if width <= 2:
        return counter
    exponent = {4: 0x7F80, 8: 0x7FF0}[width]
    tops = np.array([0, exponent, 0x8000, 0x8000 | exponent], dtype=kind)
    tops <<= kind.type(width * 8 - 16)
    low = kind.type((1 << (width * 8 - 16)) - 1)
    return ((counter >> kind.type(2)) & low) | tops[np.arange(count) % 4]


@functools.cache
def _chunk(dtype: str, kind: str, size: int) -> bytes:
    """``size`` bytes of realistic ``dtype`` data (cut mid-element where size says so)."""
    if kind == "random":
        return _random(size)
    if kind == "zeros":
        return bytes(size)
    np_dtype = numpy_dtype(dtype)
    count = _elements(dtype, size)
    rng = np.random.default_rng(count)
    if kind == "specials":
        width = min(np_dtype.itemsize, 8)
        values: np.ndarray = _specials(width, count * np_dtype.itemsize // width)
    elif kind == "constant":
        fill: Any = {"b": True, "i": 7, "u": 7, "c": 1.5 - 0.5j}.get(np_dtype.kind, 1.5)
        values = np.full(count, fill, dtype=np_dtype)
    elif np_dtype.kind == "b":
        values = rng.random(count) < 0.1
    elif np_dtype.kind in "iu":
        low = -8 if np_dtype.kind == "i" else 0
        values = rng.integers(low, low + 16, count).astype(np_dtype)
    elif np_dtype.kind == "c":
        pairs = rng.standard_normal((count, 2)) * 0.02
        values = (pairs[:, 0] + 1j * pairs[:, 1]).astype(np_dtype)
    else:  # float16/32/64, bfloat16, float8_*
        values = (rng.standard_normal(count) * 0.02).astype(np_dtype)
    return values.tobytes()[:size]


# -- frames, parsed and forged by the documented layout ---------------------------------


@dataclass(frozen=True)
class Frame:
    codec: int
    width: int
    raw_length: int
    streams: tuple[tuple[int, bytes], ...]
    reserved: int = 0
    magic: bytes = b"CSZ1"
    count: int | None = None  # what the header says, where it lies about len(streams)
    table: tuple[tuple[int, int], ...] | None = None  # what the table says, where it lies

    def pack(self) -> bytes:
        count = len(self.streams) if self.count is None else self.count
        table = self.table or tuple((kind, len(data)) for kind, data in self.streams)
        header = _HEADER.pack(
            self.magic, self.codec, self.width, count, self.reserved, self.raw_length
        )
        entries = b"".join(_ENTRY.pack(kind, size) for kind, size in table)
        return header + entries + b"".join(data for _, data in self.streams)


def parse(frame: bytes) -> Frame:
    magic, number, width, count, reserved, raw_length = _HEADER.unpack_from(frame)
    at = _HEADER.size + _ENTRY.size * count
    streams = []
    for i in range(count):
        kind, size = _ENTRY.unpack_from(frame, _HEADER.size + _ENTRY.size * i)
        streams.append((kind, frame[at : at + size]))
        at += size
    assert at == len(frame)
    return Frame(number, width, raw_length, tuple(streams), reserved, magic)


def _with_stream(frame: Frame, index: int, kind: int, data: bytes) -> Frame:
    streams = list(frame.streams)
    streams[index] = (kind, data)
    return replace(frame, streams=tuple(streams))


@dataclass(frozen=True)
class Base:
    """A valid frame an encoder wrote, and the chunk it holds."""

    name: str
    raw: bytes
    frame: bytes

    @property
    def length(self) -> int:
        return len(self.raw)

    @property
    def key(self) -> bytes:
        return digest_bytes(self.raw)

    @property
    def parsed(self) -> Frame:
        return parse(self.frame)

    def zstd_index(self) -> int:
        return next(i for i, (kind, _) in enumerate(self.parsed.streams) if kind == ZSTD)


@functools.cache
def bases() -> dict[str, Base]:
    """A bf16 bytegroup frame (one raw and one zstd stream) and an int64 zstd frame."""
    found = {}
    for name, dtype, encoder in (
        ("bytegroup", "bfloat16", Encoder("bytegroup", 2)),
        ("zstd", "int64", Encoder("zstd")),
    ):
        raw = _chunk(dtype, "normal", BASE_BYTES)
        frame = encoder(raw)
        assert isinstance(frame, bytes) and frame is not raw
        found[name] = Base(name, raw, frame)
    return found


BASE_NAMES = ("bytegroup", "zstd")


def test_the_bases_are_what_the_hostile_tests_need() -> None:
    group, zstd = bases()["bytegroup"].parsed, bases()["zstd"].parsed
    # bf16 normals: the low byte (mantissa and sign) stays raw, the exponent byte shrinks.
    assert (group.codec, group.width, [k for k, _ in group.streams]) == (
        BYTEGROUP_ID,
        2,
        [RAW, ZSTD],
    )
    assert (zstd.codec, zstd.width, [k for k, _ in zstd.streams]) == (ZSTD_ID, 0, [ZSTD])
    for base in bases().values():
        assert base.parsed.pack() == base.frame  # the documented layout, byte for byte
        assert bytes(codec.decode(base.frame, base.length)) == base.raw


# -- round trips -----------------------------------------------------------------------


def _encoders(dtype: str) -> dict[Encoder, list[str]]:
    """The distinct encoders the settings give ``dtype``, with the settings that give each."""
    found: dict[Encoder, list[str]] = {}
    for setting in SETTINGS:
        encoder = codec.encoder_for(setting, dtype)
        assert encoder is not None
        found.setdefault(encoder, []).append(setting)
    return found


def _check_round_trip(raw: bytes, encoder: Encoder, dtype: str, kind: str) -> None:
    size = len(raw)
    stored = encoder(raw)
    what = f"{dtype} {kind} {size} bytes by {encoder}"
    if stored is raw:
        assert not codec.is_frame(stored, size), what
        assert codec.raw_bytes(stored, size) is raw, what
    else:
        assert isinstance(stored, bytes), what
        assert len(stored) <= size * (1 - MIN_SAVING), what
        assert codec.is_frame(stored, size), what
        assert codec.raw_length(stored) == size, what
        grouped = encoder.codec == "bytegroup" and size % encoder.width == 0
        assert codec.frame_codec(stored) == ("bytegroup" if grouped else "zstd"), what
        assert bytes(codec.decode(stored, size)) == raw, what
        assert bytes(codec.raw_bytes(stored, size)) == raw, what
    assert codec.stored_matches(digest_bytes(raw), stored), what
    # Where a frame must be (or must not be) written:
    if size < MIN_CHUNK or kind == "random":
        assert stored is raw, what
    elif kind in ("zeros", "constant"):
        assert stored is not raw, what
    elif encoder.codec == "bytegroup" and size % encoder.width == 0:
        assert codec.frame_codec(stored) == "bytegroup", what


@pytest.mark.parametrize("dtype", sorted(SUPPORTED_DTYPES))
def test_every_dtype_round_trips_bitwise_through_every_setting(dtype: str) -> None:
    assert codec.encoder_for("none", dtype) is None
    for encoder in _encoders(dtype):
        for size in SIZES.values():
            kinds = BIG_KINDS if size > 4 * MIN_CHUNK else KINDS
            for kind in kinds:
                _check_round_trip(_chunk(dtype, kind, size), encoder, dtype, kind)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_bytegroup_keeps_every_special_bit_pattern(dtype: str) -> None:
    raw = _chunk(dtype, "specials", BASE_BYTES)
    with np.errstate(invalid="ignore"):
        values = np.frombuffer(raw, dtype=numpy_dtype(dtype)).astype(np.float64)
    assert np.isnan(values).any() and np.isinf(values).any()
    assert np.signbit(values).any() and (values == 0).any()
    frame = codec.encoder_for("auto", dtype)(raw)  # type: ignore[misc]
    assert codec.frame_codec(frame) == "bytegroup"
    assert bytes(codec.decode(frame, len(raw))) == raw


def test_encode_takes_any_buffer_and_returns_a_small_one_as_itself() -> None:
    raw = _chunk("float32", "normal", 2 * MIN_CHUNK)
    encoder = codec.encoder_for("auto", "float32")
    assert encoder is not None
    frame = encoder(raw)
    assert encoder(memoryview(raw)) == frame
    assert encoder(bytearray(raw)) == frame
    assert encoder(np.frombuffer(raw, dtype=np.float32)) == frame
    small = memoryview(raw)[: MIN_CHUNK - 4]
    assert encoder(small) is small


class _CountingCompressor:
    """The real compressor, recording how many bytes each compress call was given."""

    def __init__(self, real: Any) -> None:
        self.real, self.sizes = real, []

    def compress(self, data: Any) -> bytes:
        self.sizes.append(memoryview(data).nbytes)
        return self.real.compress(data)  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", ["uint8", "float32", "bfloat16"])
def test_random_bytes_are_stored_raw_after_compressing_only_samples(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _CountingCompressor(codec._compressor())
    monkeypatch.setattr(codec, "_compressor", lambda: counting)
    raw = _random(4 << 20)
    encoder = codec.encoder_for("auto", dtype)
    assert encoder is not None
    assert encoder(raw) is raw
    streams = encoder.width or 1
    assert len(counting.sizes) == streams
    assert max(counting.sizes) <= SAMPLE_BYTES


# -- codec choice ----------------------------------------------------------------------


def test_auto_groups_wide_floats_and_zstds_the_rest() -> None:
    auto = functools.partial(codec.encoder_for, "auto")
    assert auto("bfloat16") == Encoder("bytegroup", 2)
    assert auto("float16") == Encoder("bytegroup", 2)
    assert auto("float32") == Encoder("bytegroup", 4)
    assert auto("float64") == Encoder("bytegroup", 8)
    for dtype in ("int64", "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "complex64"):
        assert auto(dtype) == Encoder("zstd"), dtype
    assert codec.encoder_for("bytegroup", "int32") == Encoder("zstd")
    assert codec.encoder_for("bytegroup", "float32") == Encoder("bytegroup", 4)
    assert codec.encoder_for("zstd", "bfloat16") == Encoder("zstd")
    for dtype in SUPPORTED_DTYPES:
        assert codec.encoder_for("none", dtype) is None


def test_check_setting_names_the_choices() -> None:
    for setting in ("none", "auto", "zstd", "bytegroup"):
        assert codec.check_setting(setting) == setting
    with pytest.raises(ValueError) as caught:
        codec.check_setting("lz5")
    message = str(caught.value)
    assert "'lz5'" in message
    assert all(name in message for name in ("none", "auto", "zstd", "bytegroup"))


# -- hostile frames --------------------------------------------------------------------


def _refused(stored: bytes, length: int, error: type[CodecError] = CodecError) -> CodecError:
    """The typed error decoding ``stored`` raises, having allocated no more than it holds."""
    tracemalloc.start()
    try:
        with pytest.raises(error) as caught:
            codec.decode(stored, length)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * length + len(stored) + (1 << 20), peak
    return caught.value


def _hostile(base: Base) -> dict[str, bytes]:
    """Damaged and lying variants of ``base``'s frame, each to be refused with CodecError."""
    frame, parsed, length = base.frame, base.parsed, base.length
    width = parsed.width or 1
    index = base.zstd_index()
    stream_length = length // len(parsed.streams)
    other = zstandard.ZstdCompressor().compress(bytes(stream_length + 1))
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(stream_length))
    data = parsed.streams[index][1]
    table_cut = _HEADER.size + _ENTRY.size * len(parsed.streams) - 3
    raw_stream = bytes(stream_length - 1)
    return {
        "flipped magic": replace(parsed, magic=b"CSZ2").pack(),
        "raw length bigger": replace(parsed, raw_length=length + width).pack(),
        "raw length smaller": replace(parsed, raw_length=length - width).pack(),
        "raw length 2**40": replace(parsed, raw_length=1 << 40).pack(),
        "one stream too many": replace(parsed, count=len(parsed.streams) + 1).pack(),
        "one stream too few": replace(parsed, count=len(parsed.streams) - 1).pack(),
        "stream table cut off": frame[:table_cut],
        "frame cut short by a byte": frame[:-1],
        "frame padded by a byte": frame + b"\0",
        "frame only a header": frame[: _HEADER.size],
        "frame shorter than a header": frame[: _HEADER.size - 1],
        "zstd stream of another length": _with_stream(parsed, index, ZSTD, other).pack(),
        "zstd stream without a content size": _with_stream(parsed, index, ZSTD, unsized).pack(),
        "zstd stream with bytes after it": _with_stream(parsed, index, ZSTD, data + b"\0").pack(),
        "zstd stream cut short": _with_stream(parsed, index, ZSTD, data[:-1]).pack(),
        "zstd stream empty": _with_stream(parsed, index, ZSTD, b"").pack(),
        "stream of kind 7": _with_stream(parsed, index, 7, data).pack(),
        "raw stream one byte short": _with_stream(parsed, index, RAW, raw_stream).pack(),
        "table lengths off by one": replace(
            parsed,
            table=tuple((k, len(d) + (i == index)) for i, (k, d) in enumerate(parsed.streams)),
        ).pack(),
        "table length 2**63": replace(
            parsed,
            table=tuple(
                (k, (1 << 63) if i == index else len(d)) for i, (k, d) in enumerate(parsed.streams)
            ),
        ).pack(),
    }


HOSTILE_NAMES = sorted(_hostile(bases()["zstd"]))


@pytest.mark.parametrize("case", HOSTILE_NAMES)
@pytest.mark.parametrize("base_name", BASE_NAMES)
def test_a_hostile_frame_is_refused_with_a_codec_error(base_name: str, case: str) -> None:
    base = bases()[base_name]
    stored = _hostile(base)[case]
    _refused(stored, base.length)
    assert not codec.stored_matches(base.key, stored)


@pytest.mark.parametrize("base_name", BASE_NAMES)
def test_bytegroup_frames_of_odd_widths_are_refused(base_name: str) -> None:
    base = bases()[base_name]
    parsed = replace(bases()[base_name].parsed, codec=BYTEGROUP_ID)
    data = parsed.streams[0][1]
    for width in (0, 1, 3, 5, 16):
        forged = replace(parsed, width=width, streams=((RAW, data),) * width)
        error = _refused(forged.pack(), base.length)
        assert "width" in str(error) or "streams" in str(error)


@pytest.mark.parametrize("base_name", BASE_NAMES)
def test_an_unknown_codec_says_a_newer_castore_wrote_it(base_name: str) -> None:
    base = bases()[base_name]
    for number in (0, 3, 7, 255):
        forged = replace(base.parsed, codec=number).pack()
        error = _refused(forged, base.length, UnknownCodecError)
        assert "newer castore" in str(error)
        assert codec.frame_codec(forged) == f"unknown codec #{number}"
        assert not codec.stored_matches(base.key, forged)


@pytest.mark.parametrize("base_name", BASE_NAMES)
def test_a_huge_declared_length_is_refused_before_any_allocation(base_name: str) -> None:
    base = bases()[base_name]
    forged = replace(base.parsed, raw_length=1 << 40).pack()
    assert "1099511627776" in str(_refused(forged, base.length))
    assert codec.raw_length(forged) == 1 << 40
    assert not codec.stored_matches(base.key, forged)
    # Within stored_matches' limit, but a lie all the same: its decode is still bounded.
    lying = replace(base.parsed, raw_length=base.length * 1024).pack()
    assert not codec.stored_matches(base.key, lying)


_BOMB_SIZE = 256 << 20
_RSS_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    from castore.format import codec
    frame, length = sys.stdin.buffer.read(), int(sys.argv[1])
    key = bytes.fromhex(sys.argv[2])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        codec.decode(frame, length)
        outcome = "decoded"
    except codec.CodecError as exc:
        outcome = type(exc).__name__
    matches = codec.stored_matches(key, frame)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(outcome, matches, (after - before) * 1024)
    """
)


@functools.cache
def _bomb(*, content_size: bool) -> bytes:
    """A zstd stream of 256 MiB of zeros (8 KiB of it), written a MiB at a time."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=content_size)
    stream = compressor.compressobj(size=_BOMB_SIZE if content_size else -1)
    zeros = bytes(1 << 20)
    parts = [stream.compress(zeros) for _ in range(_BOMB_SIZE // len(zeros))]
    return b"".join([*parts, stream.flush()])


def test_a_decompression_bomb_is_refused_without_allocating_it() -> None:
    base = bases()["zstd"]
    bomb = _bomb(content_size=True)
    assert zstandard.frame_content_size(bomb) == _BOMB_SIZE
    # The table is consistent; only the stream's own header gives it away.
    forged = _with_stream(base.parsed, 0, ZSTD, bomb).pack()
    assert len(forged) < base.length
    done = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(base.length), base.key.hex()],
        input=forged,
        capture_output=True,
        check=True,
        timeout=60,
    )
    outcome, matches, grown = done.stdout.decode().split()
    assert (outcome, matches) == ("CodecError", "False")
    assert int(grown) < 64 << 20, f"peak RSS grew {int(grown) >> 20} MiB decoding the bomb"


@pytest.mark.parametrize("base_name", BASE_NAMES)
def test_a_bomb_without_a_content_size_is_refused_without_allocating_it(base_name: str) -> None:
    base = bases()[base_name]
    bomb = _bomb(content_size=False)
    assert zstandard.frame_content_size(bomb) == -1
    forged = _with_stream(base.parsed, base.zstd_index(), ZSTD, bomb).pack()
    assert "declares -1 bytes" in str(_refused(forged, base.length))
    assert not codec.stored_matches(base.key, forged)


@pytest.mark.parametrize("base_name", BASE_NAMES)
def test_a_flipped_byte_in_a_zstd_stream_is_refused_or_fails_the_digest(base_name: str) -> None:
    base = bases()[base_name]
    parsed, index = base.parsed, base.zstd_index()
    data = parsed.streams[index][1]
    outcomes = {"refused": 0, "wrong bytes": 0, "same bytes": 0}
    for at in sorted({*range(0, len(data), max(1, len(data) // 150)), len(data) - 1}):
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        stored = _with_stream(parsed, index, ZSTD, bytes(flipped)).pack()
        try:
            out = codec.decode(stored, base.length)
        except CodecError:
            outcomes["refused"] += 1
            assert not codec.stored_matches(base.key, stored)
            continue
        assert len(out) == base.length
        same = bytes(out) == base.raw
        outcomes["same bytes" if same else "wrong bytes"] += 1
        assert codec.stored_matches(base.key, stored) == same
        assert (digest_bytes(out) == base.key) == same
    assert outcomes["refused"] > 0, outcomes


def _fragile_offsets(base: Base) -> list[int]:
    """Where a frame's bytes are parsed rather than copied: its header and table, each
    stream's first bytes (a zstd stream's own header) and the frame's last bytes."""
    parsed = base.parsed
    at = _HEADER.size + _ENTRY.size * len(parsed.streams)
    offsets = set(range(at))
    for _, data in parsed.streams:
        offsets |= set(range(at, at + min(len(data), 24)))
        at += len(data)
    offsets |= set(range(len(base.frame) - 4, len(base.frame)))
    return sorted(offsets)


@pytest.mark.parametrize("base_name", BASE_NAMES)
def test_every_parsed_byte_changed_gives_a_typed_error_or_exact_bytes(base_name: str) -> None:
    base = bases()[base_name]
    for at in _fragile_offsets(base):
        for value in {0, 1, 7, 0xFF, base.frame[at] ^ 1} - {base.frame[at]}:
            stored = bytearray(base.frame)
            stored[at] = value
            _typed_error_or_exact(base, bytes(stored))


# -- stored_matches --------------------------------------------------------------------


@pytest.mark.parametrize("base_name", BASE_NAMES)
def test_stored_matches_accepts_the_chunk_and_its_frame_only(base_name: str) -> None:
    base = bases()[base_name]
    assert codec.stored_matches(base.key, base.raw)
    assert codec.stored_matches(base.key, base.frame)
    assert codec.stored_matches(base.key, memoryview(base.frame))
    other = bases()["zstd" if base_name == "bytegroup" else "bytegroup"]
    assert not codec.stored_matches(base.key, other.raw)
    assert not codec.stored_matches(base.key, other.frame)
    assert not codec.stored_matches(base.key, _random(len(base.frame)))
    assert not codec.stored_matches(base.key, b"")
    assert not codec.stored_matches(base.key, b"CSZ1")
    assert not codec.stored_matches(base.key, replace(base.parsed, codec=9).pack())
    assert not codec.stored_matches(base.key, replace(base.parsed, raw_length=0).pack())


# -- the property: typed errors only ---------------------------------------------------


def _typed_error_or_exact(base: Base, stored: bytes) -> None:
    """``stored`` decodes to exactly ``length`` bytes or raises CodecError; nothing else."""
    try:
        out = codec.decode(stored, base.length)
    except CodecError:
        out = None
    if out is not None:
        assert len(out) == base.length
    matches = codec.stored_matches(base.key, stored)
    assert matches == (out is not None and bytes(out) == base.raw)


@st.composite
def _damage(draw: Callable[..., Any]) -> tuple[str, bytes]:
    name = draw(st.sampled_from(BASE_NAMES))
    base = bases()[name]
    frame = bytearray(base.frame)
    fragile = st.sampled_from(_fragile_offsets(base))
    anywhere = st.integers(0, len(frame) - 1)
    for at, value in draw(
        st.lists(
            st.tuples(st.one_of(fragile, anywhere), st.integers(0, 255)), min_size=1, max_size=4
        )
    ):
        frame[at] = value
    # Most damage keeps the length: a frame cut or padded stops at its table's sum.
    resize = draw(st.sampled_from(["keep", "keep", "keep", "cut", "pad"]))
    if resize == "cut":
        frame = frame[: draw(st.integers(0, len(frame) - 1))]
    elif resize == "pad":
        frame += draw(st.binary(min_size=1, max_size=3))
    return name, bytes(frame)


@settings(max_examples=200, deadline=None)
@given(damaged=_damage())
def test_random_damage_to_a_frame_gives_a_typed_error_or_exact_bytes(
    damaged: tuple[str, bytes],
) -> None:
    name, stored = damaged
    _typed_error_or_exact(bases()[name], stored)


def test_reserved_header_bytes_must_be_zero() -> None:
    """The reserved byte, and a zstd frame's width, are refused unless 0: a later format
    may give them a meaning an older reader must not ignore."""
    for name, at in (("bytegroup", 7), ("zstd", 7), ("zstd", 5)):
        base = bases()[name]
        forged = bytearray(base.frame)
        forged[at] = 1
        with pytest.raises(CodecError, match="reserved byte"):
            codec.decode(bytes(forged), base.length)
        assert not codec.stored_matches(base.key, bytes(forged))
