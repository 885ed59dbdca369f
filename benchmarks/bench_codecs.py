"""castore's chunk codecs on realistic tensors: stored/raw ratio and single-core speed, with peers.

Run from the repository root::

    .venv/bin/python benchmarks/bench_codecs.py [--quick] [--reps 3] [--refresh]
                                                [--json benchmarks/results/codecs.json]

Two states (built by ``_codec_states.py``, which says exactly how; cached in
the system's temp directory, so only the first run trains):

trained  a 4-layer GPT (width 256, 4 heads, vocab 4096, sequences of 64; 5.3 M
         parameters) trained here for 300 steps in fp32 with AdamW (lr 1e-3,
         weight decay 0.1) on a fixed random Markov chain. Groups: its fp32
         weights, fp32 ``exp_avg``, fp32 ``exp_avg_sq``, and the same weights
         cast to bf16 after training. "full training state" is the fp32 run's
         checkpoint: fp32 weights + both moments.
llm      one Llama-shaped decoder layer, scaled down to keep the state under
         300 MiB (hidden 1536, intermediate 4096, 12 heads; 28.3 M parameters),
         initialised as a real init (normal std 0.02, norms 1), then 5 AdamW
         steps (lr 3e-4, betas 0.9/0.95) on fp32 master weights with random data.
         Groups: the weights cast to bf16, fp32 ``exp_avg``, fp32 ``exp_avg_sq``;
         "full training state" is all three (a mixed-precision checkpoint).

Every tensor's bytes are cut into 4 MiB chunks as castore cut them before the
chunk grid (every ``DEFAULT_CHUNK_SIZE`` bytes; the figures recorded were
measured so, and a grid cell is never larger; a tensor's last chunk may be
short, and most of the trained GPT's tensors are one short chunk). Each chunk
goes through each codec on the calling thread alone:

castore none       stored as is (ratio 1; not timed)
castore zstd       ``codec.Encoder("zstd")``
castore bytegroup  ``codec.encoder_for("bytegroup", dtype)``
castore auto       ``codec.encoder_for("auto", dtype)``: the same encoder as
                   bytegroup for every tensor here (all are 2- or 4-byte floats)
zstd-1, zstd-3     ``zstandard.ZstdCompressor(level=N)`` on the raw chunk
lz4                ``lz4.frame.compress`` with its defaults
ZipNN              ``zipnn.ZipNN(input_format="byte", bytearray_dtype=..., threads=1)``;
                   its ``compress`` rewrites the buffer it is given in place
                   (even a ``bytes``), so it gets a fresh copy of the chunk
                   each time, made outside the timed region

Compress times the encoder call; decompress times ``codec.decode(frame,
length)`` for castore (a chunk the encoder returned as itself is stored raw: it
counts its raw bytes and no time, as castore's reader does nothing for it) and
the peer's decompress call for the others. Every round trip is checked to give
back the chunk bit for bit. Each repetition runs every codec over every chunk
(the codecs' order rotates from one repetition to the next, after one untimed
warm-up pass over a sample); a group's time is the sum over its chunks of each
chunk's median over ``--reps`` repetitions. GB/s is raw bytes (10^9) per second
of one core. The table is markdown; ``--json`` writes every figure, with each
repetition's summed times.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from _codec_states import (
    QUICK_GPT,
    QUICK_LLAMA,
    GPTConfig,
    LlamaConfig,
    Tensor,
    llm_state,
    trained_state,
)
from _common import print_goals

from castore.core.chunkio import DEFAULT_CHUNK_SIZE
from castore.format import codec

MIB = 1 << 20
FULL = "full training state"
ZIPNN_DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}
GOAL_COMPRESS_GBPS = 1.0
GOAL_DECOMPRESS_GBPS = 2.0
GOAL_BF16_RATIO = 0.70
GOAL_FP32_RATIO = 0.87


# -- codecs ----------------------------------------------------------------------------

Compress = Callable[[memoryview, str], Any]
Decompress = Callable[[Any, int, str], Any]  # None: stored raw, nothing to decode


@dataclass
class Codec:
    name: str
    compress: Compress | None  # None: not timed (castore none)
    decompress: Decompress | None = None
    castore: bool = False  # an encoder that may keep a chunk raw
    fresh_input: bool = False  # compress rewrites its input: hand it a copy


def _castore(setting: str) -> Codec:
    encoders: dict[str, codec.Encoder | None] = {}

    def compress(chunk: memoryview, dtype: str) -> Any:
        if dtype not in encoders:
            encoders[dtype] = codec.encoder_for(setting, dtype)
        encoder = encoders[dtype]
        assert encoder is not None
        return encoder(chunk)

    def decompress(stored: Any, length: int, dtype: str) -> Any:
        if not codec.is_frame(stored, length):
            return None
        return codec.decode(stored, length)

    return Codec(f"castore {setting}", compress, decompress, castore=True)


def _zstd(level: int) -> Codec:
    compressor = zstandard.ZstdCompressor(level=level)
    decompressor = zstandard.ZstdDecompressor()
    return Codec(
        f"zstd-{level}",
        lambda chunk, dtype: compressor.compress(chunk),
        lambda stored, length, dtype: decompressor.decompress(stored),
    )


def _lz4() -> Codec | None:
    try:
        import lz4.frame
    except ImportError:
        print("lz4 not installed")
        return None
    return Codec(
        "lz4",
        lambda chunk, dtype: lz4.frame.compress(chunk),
        lambda stored, length, dtype: lz4.frame.decompress(stored),
    )


def _zipnn() -> Codec | None:
    try:
        import zipnn
    except ImportError:
        print("ZipNN not installed")
        return None
    coders = {
        dtype: zipnn.ZipNN(input_format="byte", bytearray_dtype=name, threads=1)
        for dtype, name in ZIPNN_DTYPES.items()
    }
    return Codec(
        "ZipNN",
        lambda chunk, dtype: coders[dtype].compress(chunk),
        lambda stored, length, dtype: coders[dtype].decompress(stored),
        fresh_input=True,
    )


def all_codecs() -> list[Codec]:
    found = [Codec("castore none", None)]
    found += [_castore(setting) for setting in ("zstd", "bytegroup", "auto")]
    found += [_zstd(1), _zstd(3)]
    found += [peer for peer in (_lz4(), _zipnn()) if peer is not None]
    return found


# -- measuring -------------------------------------------------------------------------


@dataclass
class Chunk:
    group: str
    tensor: str
    dtype: str
    view: memoryview


@dataclass
class Measured:
    """One codec's figures on every chunk of a state: sizes, and times per repetition."""

    stored: list[int] = field(default_factory=list)
    kept_raw: list[bool] = field(default_factory=list)
    compress_ns: list[list[int]] = field(default_factory=list)  # [chunk][rep]
    decompress_ns: list[list[int]] = field(default_factory=list)


def cut_chunks(data: Any, chunk_size: int) -> list[memoryview]:
    flat = memoryview(data).cast("B")
    return [flat[at : at + chunk_size] for at in range(0, flat.nbytes, chunk_size)]


def chunks_of(groups: dict[str, list[Tensor]]) -> list[Chunk]:
    return [
        Chunk(group, tensor.name, tensor.dtype, view)
        for group, tensors in groups.items()
        for tensor in tensors
        for view in cut_chunks(tensor.data, DEFAULT_CHUNK_SIZE)
    ]


def _same(out: Any, chunk: memoryview) -> bool:
    got = np.frombuffer(out, dtype=np.uint8)
    return got.nbytes == chunk.nbytes and bool(
        np.array_equal(got, np.frombuffer(chunk, dtype=np.uint8))
    )


def run_one(peer: Codec, chunk: Chunk) -> tuple[int, bool, int, int]:
    """(stored bytes, kept raw, compress ns, decompress ns) of one chunk; the round trip checked."""
    assert peer.compress is not None and peer.decompress is not None
    given: Any = bytearray(chunk.view) if peer.fresh_input else chunk.view
    start = time.perf_counter_ns()
    stored = peer.compress(given, chunk.dtype)
    middle = time.perf_counter_ns()
    out = peer.decompress(stored, chunk.view.nbytes, chunk.dtype)
    end = time.perf_counter_ns()
    size = memoryview(stored).nbytes
    kept_raw = out is None
    if kept_raw:  # castore kept the chunk as itself: the reader uses it as is
        assert peer.castore and size == chunk.view.nbytes, (peer.name, chunk.tensor)
        out, end = stored, middle
    if not _same(out, chunk.view):
        raise AssertionError(f"{peer.name}: round trip of a chunk of {chunk.tensor} differs")
    return size, kept_raw, middle - start, end - middle


def measure(codecs: list[Codec], chunks: list[Chunk], reps: int) -> dict[str, Measured]:
    timed = [peer for peer in codecs if peer.compress is not None]
    results = {peer.name: Measured() for peer in timed}
    for peer in timed:  # warm-up: imports, per-thread contexts, first-touch of buffers
        for chunk in chunks[:: max(1, len(chunks) // 8)]:
            run_one(peer, chunk)
    gc.collect()
    gc.disable()
    try:
        for rep in range(reps):
            shift = rep % len(timed)
            for peer in timed[shift:] + timed[:shift]:
                _record(results[peer.name], peer, chunks, rep)
    finally:
        gc.enable()
    return results


def _record(measured: Measured, peer: Codec, chunks: list[Chunk], rep: int) -> None:
    for i, chunk in enumerate(chunks):
        size, kept_raw, compress_ns, decompress_ns = run_one(peer, chunk)
        if rep == 0:
            measured.stored.append(size)
            measured.kept_raw.append(kept_raw)
            measured.compress_ns.append([])
            measured.decompress_ns.append([])
        elif measured.stored[i] != size:
            raise AssertionError(f"{peer.name} stored a chunk of {chunk.tensor} in two sizes")
        measured.compress_ns[i].append(compress_ns)
        measured.decompress_ns[i].append(decompress_ns)


# -- summing ---------------------------------------------------------------------------


def summarize(
    chunks: list[Chunk], picks: list[int], peer: Codec, measured: Measured | None
) -> dict[str, Any]:
    raw = sum(chunks[i].view.nbytes for i in picks)
    if measured is None:  # castore none
        return {"raw_bytes": raw, "stored_bytes": raw, "ratio": 1.0, "kept_raw_chunks": len(picks)}
    stored = sum(measured.stored[i] for i in picks)
    compress_s = sum(statistics.median(measured.compress_ns[i]) for i in picks) / 1e9
    decompress_s = sum(statistics.median(measured.decompress_ns[i]) for i in picks) / 1e9
    reps = len(measured.compress_ns[picks[0]])
    figures: dict[str, Any] = {
        "raw_bytes": raw,
        "stored_bytes": stored,
        "ratio": stored / raw,
        "compress_s": compress_s,
        "decompress_s": decompress_s,
        "compress_gbps": raw / compress_s / 1e9,
        "decompress_gbps": raw / decompress_s / 1e9 if decompress_s else None,
        "compress_s_reps": [
            sum(measured.compress_ns[i][r] for i in picks) / 1e9 for r in range(reps)
        ],
        "decompress_s_reps": [
            sum(measured.decompress_ns[i][r] for i in picks) / 1e9 for r in range(reps)
        ],
    }
    if peer.castore:
        figures["kept_raw_chunks"] = sum(measured.kept_raw[i] for i in picks)
    return figures


def group_figures(
    chunks: list[Chunk], codecs: list[Codec], results: dict[str, Measured], full: list[str]
) -> dict[str, Any]:
    members: dict[str, list[int]] = {}
    for i, chunk in enumerate(chunks):
        members.setdefault(chunk.group, []).append(i)
    members[FULL] = [i for i, chunk in enumerate(chunks) if chunk.group in full]
    out = {}
    for group, picks in members.items():
        out[group] = {
            "chunks": len(picks),
            "tensors": len({chunks[i].tensor for i in picks}),
            "members": full if group == FULL else [group],
            "codecs": {
                peer.name: summarize(chunks, picks, peer, results.get(peer.name)) for peer in codecs
            },
        }
    return out


# -- reporting -------------------------------------------------------------------------


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _decompress_rate(row: dict[str, Any]) -> str:
    if row["decompress_gbps"] is None:  # every chunk kept raw: nothing to decode
        return "(all raw)"
    return f"{row['decompress_gbps']:.2f}"


def table(title: str, groups: dict[str, Any]) -> str:
    lines = [
        f"**{title}**",
        "",
        "| group | raw MiB | chunks | codec | stored/raw | compress GB/s | decompress GB/s "
        "| chunks kept raw |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for group, figures in groups.items():
        for name, row in figures["codecs"].items():
            timed = "compress_gbps" in row
            kept = row.get("kept_raw_chunks")
            lines.append(
                f"| {group} | {row['raw_bytes'] / MIB:.1f} | {figures['chunks']} | {name} "
                f"| {row['ratio']:.3f} | {_rate(row['compress_gbps']) if timed else '—'} "
                f"| {_decompress_rate(row) if timed else '—'} "
                f"| {'' if kept is None else kept} |"
            )
    return "\n".join(lines)


def notes(label: str, groups: dict[str, Any]) -> list[str]:
    """Where castore auto's ratio stands against the best peer, group by group."""
    out = []
    for group, figures in groups.items():
        rows = figures["codecs"]
        auto = rows["castore auto"]["ratio"]
        peers = {n: r["ratio"] for n, r in rows.items() if not n.startswith("castore")}
        best = min(peers, key=lambda n: peers[n])
        verdict = "auto wins" if auto <= peers[best] else f"{best} wins"
        out.append(
            f"{label} / {group}: auto {auto:.3f}, best peer {best} {peers[best]:.3f} "
            f"({verdict}; auto/best = {auto / peers[best]:.3f})"
        )
    return out


def goals(states: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    verdicts = []
    for state, found in states.items():
        bf16 = found["groups"]["bf16 weights"]["codecs"]["castore auto"]
        verdicts += [
            {
                "goal": f"{state}: castore auto compresses bf16 weights at >= "
                f"{GOAL_COMPRESS_GBPS} GB/s per core",
                "measured": f"{bf16['compress_gbps']:.2f} GB/s",
                "met": bf16["compress_gbps"] >= GOAL_COMPRESS_GBPS,
            },
            {
                "goal": f"{state}: castore auto decompresses bf16 weights at >= "
                f"{GOAL_DECOMPRESS_GBPS} GB/s per core",
                "measured": f"{_rate(bf16['decompress_gbps'])} GB/s",
                "met": (bf16["decompress_gbps"] or 0.0) >= GOAL_DECOMPRESS_GBPS,
            },
            {
                "goal": f"{state}: bf16 weights stored at <= {GOAL_BF16_RATIO}x (castore auto)",
                "measured": f"{bf16['ratio']:.3f}x",
                "met": bf16["ratio"] <= GOAL_BF16_RATIO,
            },
        ]
        fp32 = found["groups"].get("fp32 weights")
        if fp32 is not None:
            ratio = fp32["codecs"]["castore auto"]["ratio"]
            verdicts.append(
                {
                    "goal": f"{state}: fp32 weights stored at <= {GOAL_FP32_RATIO}x (castore auto)",
                    "measured": f"{ratio:.3f}x",
                    "met": ratio <= GOAL_FP32_RATIO,
                }
            )
    return verdicts


def _versions() -> dict[str, str]:
    found = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "zstandard": zstandard.__version__,
        "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
    }
    for package in ("lz4", "zipnn"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "absent"
    return found


# -- main ------------------------------------------------------------------------------


def run_state(
    label: str,
    build: Callable[[], tuple[dict[str, list[Tensor]], dict]],
    full: list[str],
    codecs: list[Codec],
    reps: int,
) -> dict[str, Any]:
    start = time.perf_counter()
    groups, info = build()
    built = time.perf_counter() - start
    chunks = chunks_of(groups)
    total = sum(chunk.view.nbytes for chunk in chunks)
    print(
        f"{label}: built in {built:.1f} s ({'from cache' if info.get('cached') else 'trained'}), "
        f"{total / MIB:.1f} MiB in {len(chunks)} chunks; measuring {reps} reps ...",
        flush=True,
    )
    start = time.perf_counter()
    results = measure(codecs, chunks, reps)
    print(f"{label}: measured in {time.perf_counter() - start:.1f} s", flush=True)
    info["build_s"] = built
    return {"info": info, "groups": group_figures(chunks, codecs, results, full)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller states (a < 1 min smoke run)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    parser.add_argument("--refresh", action="store_true", help="retrain; ignore the cache")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path("benchmarks/results/codecs.json"),
        help="write figures here",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    # Training on one thread: on this shared 2-core machine two OpenMP threads ran 2.5x
    # slower than one whenever other work held a core. The codecs never use torch.
    torch.set_num_threads(1)
    gpt, llama = (QUICK_GPT, QUICK_LLAMA) if args.quick else (GPTConfig(), LlamaConfig())
    codecs = all_codecs()
    states = {
        "trained": run_state(
            "trained",
            lambda: trained_state(gpt, args.refresh),
            ["fp32 weights", "fp32 exp_avg", "fp32 exp_avg_sq"],
            codecs,
            args.reps,
        ),
        "llm": run_state(
            "llm",
            lambda: llm_state(llama, args.refresh),
            ["bf16 weights", "fp32 exp_avg", "fp32 exp_avg_sq"],
            codecs,
            args.reps,
        ),
    }
    titles = {
        "trained": f"trained: {gpt.layers}-layer GPT (width {gpt.width}, vocab {gpt.vocab}), "
        f"{gpt.steps} AdamW steps in fp32; bf16 = the trained weights cast",
        "llm": f"llm: one Llama-shaped layer (hidden {llama.hidden}, intermediate "
        f"{llama.intermediate}), init + {llama.steps} AdamW steps; bf16 weights, fp32 moments",
    }
    print()
    for state, found in states.items():
        print(table(titles[state], found["groups"]))
        print()
    remarks = [line for state, found in states.items() for line in notes(state, found["groups"])]
    print("ratio, castore auto against the best peer:")
    for line in remarks:
        print("  " + line)
    verdicts = goals(states)
    print_goals(verdicts)
    elapsed = time.perf_counter() - started
    print(f"ran {elapsed:.0f} s")
    if args.json:
        report = {
            "quick": args.quick,
            "reps": args.reps,
            "chunk_size": DEFAULT_CHUNK_SIZE,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "versions": _versions(),
            "codecs": [peer.name for peer in codecs],
            "states": states,
            "notes": remarks,
            "goals": verdicts,
            "run_s": elapsed,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
