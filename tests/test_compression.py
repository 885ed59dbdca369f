"""Chunk compression in a real store: codecs per store and per save, reads of every kind,
copies between codecs, damaged frames, and stores older than chunk frames.

The codec module alone (round trips of every dtype, hostile frames) is tested in
tests/test_codec.py; here every chunk goes through real LMDB packs or a real
shared directory.
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

import castore
from castore.chunkstore.base import Namespace
from castore.copying import copy as copy_store
from castore.errors import (
    ChecksumMismatchError,
    FormatVersionError,
    IntegrityError,
    UnsupportedOperationError,
)
from castore.format import codec
from castore.format.codec import CodecError, UnknownCodecError
from castore.format.grid import box_chunk_starts, writer_cell
from castore.testing.corrupt import raw_put
from castore.verify import verify_store

CHUNK = 256 << 10  # small chunks, still above codec.MIN_CHUNK


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    """Trained-looking tensors of several dtypes, a few chunks each, plus a small one."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal(300_000) * 0.02).astype(np.float32)
    return {
        "w32": weights,
        "w16": weights[:200_000].astype(ml_dtypes.bfloat16),
        "h16": weights[:150_000].astype(np.float16),
        "w64": weights[:60_000].astype(np.float64),
        "steps": np.arange(70_000, dtype=np.int64),
        "noise": rng.integers(0, 256, 300_000, dtype=np.uint8),  # incompressible
        "bias": weights[:10].copy(),  # under MIN_CHUNK: stored raw
    }


def _same(loaded: dict[str, np.ndarray], state: dict[str, np.ndarray]) -> None:
    assert set(loaded) == set(state)
    for name, value in state.items():
        got = loaded[name]
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert got.tobytes() == value.tobytes(), name


def _frames(store: castore.Store) -> tuple[int, int]:
    """(framed, raw) chunk records in the store: a record shorter than its chunk is a frame."""
    framed = raw = 0
    for key, size in store.backend.value_sizes(Namespace.CHUNKS):
        value = store.backend.get(Namespace.CHUNKS, key)
        assert value is not None and len(value) == size
        if codec.frame_codec(value) is not None and codec.stored_matches(key, value):
            framed += 1
        else:
            raw += 1
    return framed, raw


@pytest.fixture(params=["local", "shared"])
def where(request: pytest.FixtureRequest, tmp_path) -> dict:
    options = {"shared": True} if request.param == "shared" else {}
    return {"path": tmp_path / "store", "options": options, "kind": request.param}


@pytest.mark.parametrize("setting", ["none", "auto", "zstd", "bytegroup"])
def test_every_codec_round_trips_every_read(where, setting) -> None:
    state = _state()
    with castore.open(where["path"], chunk_size=CHUNK, codec=setting, **where["options"]) as s:
        assert s.codec == setting
        gen = s.save(state, run="r", step=1)
        _same(s.load(run="r"), state)
        # A load into new tensors and a slice of rows read frames alike.
        rows = s.read_slice("r", "latest", "w32", slice(70_000, 70_000 + 100_000))
        assert rows.tobytes() == state["w32"][70_000:170_000].tobytes()
        framed, raw = _frames(s)
    if setting == "none":
        assert framed == 0 and gen.stats.stored_bytes == gen.stats.new_bytes
    else:
        # The floats and the counter shrink; the noise and the small bias stay raw.
        assert framed >= 5 and raw >= 2
        assert gen.stats.stored_bytes < 0.8 * gen.stats.new_bytes
    assert verify_store(castore.open(where["path"], **where["options"]), deep=True).ok


def test_stores_on_blobs_compress_by_default_and_local_stores_do_not(tmp_path) -> None:
    with castore.open(tmp_path / "local") as local, castore.open(
        tmp_path / "shared", shared=True
    ) as shared:
        assert (local.codec, shared.codec) == ("none", "auto")
    marker = json.loads((tmp_path / "local" / "castore.json").read_text())
    assert (marker["format_version"], marker["codec"]) == (4, "none")
    # The marker remembers the setting a store was created with.
    castore.open(tmp_path / "made", codec="zstd").close()
    with castore.open(tmp_path / "made") as again:
        assert again.codec == "zstd"


def test_a_save_may_override_the_store_and_chunks_dedup_across_codecs(where) -> None:
    state = _state()
    with castore.open(where["path"], chunk_size=CHUNK, codec="none", **where["options"]) as s:
        first = s.save(state, run="r", step=1, codec="auto")
        assert first.stats.stored_bytes < first.stats.new_bytes
        # The same bytes under another codec are the same chunks: nothing new.
        again = s.save(state, run="other", step=1, codec="none")
        assert again.stats.new_bytes == 0 and again.stats.new_chunks == 0
        changed = {**state, "w32": state["w32"] + np.float32(1)}
        raw = s.save(changed, run="r", step=2)  # the store's own setting: raw
        assert raw.stats.stored_bytes == raw.stats.new_bytes > 0
        _same(s.load(run="r", generation=1), state)
        _same(s.load(run="r"), changed)
        _same(s.load(run="other"), state)


def test_async_saves_compress_off_the_callers_thread(where) -> None:
    state = _state()
    with castore.open(where["path"], chunk_size=CHUNK, codec="auto", **where["options"]) as s:
        pending = s.save(state, run="r", step=1, blocking=False)
        gen = pending.result()
        assert gen.stats.stored_bytes < gen.stats.new_bytes
        one_thread = castore.AsyncOptions(hash_threads=1)
        changed = {**state, "w16": state["w16"] * 2}
        s.save(changed, run="r", step=2, blocking=False, async_options=one_thread).result()
        _same(s.load(run="r", generation=1), state)
        _same(s.load(run="r"), changed)


def test_a_resave_compresses_only_new_chunks(tmp_path, monkeypatch) -> None:
    state = _state()
    calls: list[int] = []
    real = codec.encode

    def counting(chunk, encoder):
        calls.append(memoryview(chunk).nbytes)
        return real(chunk, encoder)

    monkeypatch.setattr(codec, "encode", counting)
    with castore.open(tmp_path / "s", chunk_size=CHUNK, codec="auto") as s:
        s.save(state, run="r", step=1)
        first = len(calls)
        assert first >= 5
        s.save({**state, "steps": state["steps"] + 1}, run="r", step=2)
        # Only the counter's chunks changed: only they are encoded again (those not
        # under MIN_CHUNK, which are stored raw).
        steps = state["steps"]
        cell = writer_cell(steps.shape, steps.itemsize, CHUNK)
        starts = box_chunk_starts((0,), steps.shape, steps.itemsize, cell).tolist()
        changed = np.diff([*starts, steps.nbytes]).tolist()  # its chunks' lengths, on its grid
        assert len(calls) - first == sum(n >= codec.MIN_CHUNK for n in changed) >= 2
        assert sorted(calls[first:]) == sorted(n for n in changed if n >= codec.MIN_CHUNK)


def test_copy_between_stores_of_different_codecs(tmp_path) -> None:
    state = _state()
    with castore.open(tmp_path / "raw", chunk_size=CHUNK) as raw:
        raw.save(state, run="r", step=1)
    copy_store(castore.open(tmp_path / "raw"), castore.open(tmp_path / "zipped", shared=True))
    with castore.open(tmp_path / "zipped", shared=True) as zipped:
        framed, _ = _frames(zipped)
        assert framed >= 5  # compressed on the way in, by the target's codec
        _same(zipped.load(run="r"), state)
    copy_store(castore.open(tmp_path / "zipped", shared=True), castore.open(tmp_path / "back"))
    with castore.open(tmp_path / "back") as back:
        assert _frames(back)[0] == 0  # raw again: the target stores raw
        _same(back.load(run="r"), state)
    copy_store(
        castore.open(tmp_path / "zipped", shared=True),
        castore.open(tmp_path / "zipped2", shared=True, codec="zstd"),
    )
    with castore.open(tmp_path / "zipped2", shared=True) as kept:
        _same(kept.load(run="r"), state)
        # Frames from the source are kept as they are once verified, not recompressed.
        assert _frames(kept) == _frames(castore.open(tmp_path / "zipped", shared=True))


def _framed_chunk(store: castore.Store, name: str) -> tuple[bytes, bytes]:
    root = store.resolve_root("r")[1]
    entry = store.tensor_entries(root)[name][0]
    key = entry.chunks[0]
    value = store.backend.get(Namespace.CHUNKS, key)
    assert value is not None and codec.is_frame(value, entry.chunk_size)
    return key, value


def _damaged(value: bytes, how: str) -> bytes:
    data = bytearray(value)
    if how == "flipped byte":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncated stream":
        del data[-7:]
    elif how == "lying raw length":
        struct.pack_into("<Q", data, 8, CHUNK * 2)
    elif how == "huge raw length":
        struct.pack_into("<Q", data, 8, 1 << 60)
    elif how == "unknown codec":
        data[4] = 77
    return bytes(data)


@pytest.mark.parametrize(
    "how", ["flipped byte", "truncated stream", "lying raw length", "huge raw length"]
)
def test_a_damaged_frame_is_a_typed_error_on_every_read(tmp_path, how) -> None:
    state = _state()
    with castore.open(tmp_path / "s", chunk_size=CHUNK, codec="auto") as s:
        s.save(state, run="r", step=1)
        key, value = _framed_chunk(s, "w32")
        raw_put(s, Namespace.CHUNKS, key, _damaged(value, how))
        with pytest.raises((ChecksumMismatchError, CodecError)) as raised:
            s.load(run="r")
        assert "w32" in str(raised.value)
        with pytest.raises((ChecksumMismatchError, CodecError)):
            s.read_slice("r", "latest", "w32", slice(0, 0 + 10))
        # The other tensors are intact and still read.
        assert s.read_slice("r", "latest", "w16", slice(0, 0 + 5)).tobytes() == (
            state["w16"][:5].tobytes()
        )
        report = verify_store(s, deep=True)
        assert not report.ok
        assert key.hex()[:16] in " ".join(str(p) for p in report.problems)


def test_an_unknown_codec_says_so(tmp_path) -> None:
    with castore.open(tmp_path / "s", chunk_size=CHUNK, codec="auto") as s:
        s.save(_state(), run="r", step=1)
        key, value = _framed_chunk(s, "w32")
        raw_put(s, Namespace.CHUNKS, key, _damaged(value, "unknown codec"))
        with pytest.raises(UnknownCodecError, match="newer castore"):
            s.load(run="r")


def test_a_store_older_than_frames_reads_unchanged_and_is_written_raw(tmp_path) -> None:
    state = _state()
    with castore.open(tmp_path / "old", chunk_size=CHUNK) as old:
        old.save(state, run="r", step=1)
    marker = tmp_path / "old" / "castore.json"
    config = json.loads(marker.read_text())
    config["format_version"] = 2
    del config["codec"]
    marker.write_text(json.dumps(config))
    with castore.open(tmp_path / "old") as old:
        assert old.codec == "none"
        _same(old.load(run="r"), state)
        old.save(state, run="r", step=2)
    with pytest.raises(UnsupportedOperationError, match="older than chunk compression"):
        castore.open(tmp_path / "old", codec="auto")


def test_a_marker_naming_an_unknown_codec_is_refused(tmp_path) -> None:
    castore.open(tmp_path / "s").close()
    marker = tmp_path / "s" / "castore.json"
    config = json.loads(marker.read_text())
    config["codec"] = "lz9"
    marker.write_text(json.dumps(config))
    with pytest.raises(FormatVersionError, match="lz9"):
        castore.open(tmp_path / "s")
    with pytest.raises(ValueError, match="codec must be one of"):
        castore.open(tmp_path / "t", codec="lz9")


def test_chunk_aligned_rows_read_little_more_than_they_need(tmp_path) -> None:
    """Read amplification of a ranged read: whole compressed chunks are fetched."""
    state = _state()
    with castore.open(tmp_path / "s", chunk_size=CHUNK, codec="auto") as s:
        s.save(state, run="r", step=1)
        rows = CHUNK // 4  # float32 elements per chunk
        before = s.read_counters.bytes
        got = s.read_slice("r", "latest", "w32", slice(rows, rows + rows))
        fetched = s.read_counters.bytes - before
        assert got.tobytes() == state["w32"][rows : 2 * rows].tobytes()
        # One chunk's frame, smaller than the rows it holds.
        assert 0 < fetched <= 1.05 * CHUNK


def test_du_and_log_report_stored_bytes_and_ratios(tmp_path, capsys) -> None:
    from castore.cli import main

    with castore.open(tmp_path / "s", chunk_size=CHUNK, codec="auto") as s:
        s.save(_state(), run="r", step=1)
    assert main(["du", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "bfloat16" in out and "stored/raw" in out and "codec" in out
    ratio = [line for line in out.splitlines() if line.startswith("dtype") and "bfloat16" in line]
    assert float(ratio[0].split()[-1].rstrip("x")) < 0.8
    assert main(["log", str(tmp_path / "s")]) == 0
    assert "stored" in capsys.readouterr().out


def test_integrity_errors_stay_integrity_errors() -> None:
    assert issubclass(CodecError, IntegrityError) and issubclass(UnknownCodecError, CodecError)


def test_castore_copy_takes_a_codec_for_its_destination(tmp_path) -> None:
    from castore.cli import main

    state = _state()
    with castore.open(tmp_path / "raw", chunk_size=CHUNK) as raw:
        raw.save(state, run="r", step=1)
    assert main(["copy", str(tmp_path / "raw"), str(tmp_path / "zipped"), "--codec", "zstd"]) == 0
    with castore.open(tmp_path / "zipped") as zipped:
        assert zipped.codec == "zstd"  # the new store remembers it
        assert _frames(zipped)[0] >= 5
        _same(zipped.load(run="r"), state)
    # A store passed open keeps its own codec after a copy with another.
    with castore.open(tmp_path / "raw") as source, castore.open(tmp_path / "again") as target:
        copy_store(source, target, codec="auto")
        assert target.codec == "none" and _frames(target)[0] >= 5


def test_a_compressing_save_to_blobs_lists_no_more_than_a_raw_one(tmp_path, monkeypatch) -> None:
    """The encoder's presence check per window must not list the store each time."""
    from castore.blob.posix import PosixBlobStore
    from castore.core import encoding

    monkeypatch.setattr(encoding, "WINDOW_CHUNKS", 2)  # many windows in a small save
    listings = {"n": 0}
    for name in ("list", "list_sizes"):
        real = getattr(PosixBlobStore, name)

        def counted(self, *args, _real=real, **kwargs):
            listings["n"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(PosixBlobStore, name, counted)
    state = _state()
    counts = {}
    for setting in ("none", "auto"):
        with castore.open(
            tmp_path / setting, shared=True, chunk_size=CHUNK, codec=setting
        ) as store:
            listings["n"] = 0
            gen = store.save(state, run="r", step=1)
            counts[setting] = listings["n"]
            assert gen.stats.new_chunks >= 10  # several windows of 2 chunks
    assert counts["auto"] == counts["none"], counts


def test_repair_keeps_intact_frames_and_removes_a_damaged_one(tmp_path) -> None:
    from castore.repair import repair_store

    with castore.open(tmp_path / "s", chunk_size=CHUNK, codec="auto") as s:
        s.save(_state(), run="r", step=1)
        framed_before, _ = _frames(s)
        key, value = _framed_chunk(s, "w32")
        raw_put(s, Namespace.CHUNKS, key, _damaged(value, "flipped byte"))
        report = repair_store(s)
        # Only the damaged frame goes: every intact frame decodes to its name.
        assert report.corrupt_chunks == [key]
        assert _frames(s)[0] == framed_before - 1


def test_export_reads_a_compressed_store_bitwise(tmp_path) -> None:
    from safetensors.numpy import load_file

    from castore.export import to_safetensors

    state = {k: v for k, v in _state().items() if k != "w16"}  # numpy safetensors: no bf16
    with castore.open(tmp_path / "s", chunk_size=CHUNK, codec="auto") as s:
        s.save(state, run="r", step=1)
        assert _frames(s)[0] >= 4
        to_safetensors(s, "r", out_dir=tmp_path / "out")
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in state.items():
        assert exported[name].tobytes() == value.tobytes(), name
