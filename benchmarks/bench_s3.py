"""castore on S3 against DCP's FsspecWriter/FsspecReader (s3fs), on one moto server.

Run from the repository root (``make bench-s3`` installs what it needs)::

    .venv/bin/python benchmarks/bench_s3.py [--state-mib 512] [--tensors 40] [--repeats 3]
                                            [--warmup 1] [--quiet 3] [--json OUT] [--check]
    .venv/bin/python benchmarks/bench_s3.py --state-mib 64 --repeats 1   # smoke run
    .venv/bin/python benchmarks/bench_s3.py --state-mib 64 --codecs none,auto --dtype bf16

Needs ``moto[server]`` and boto3 (the ``dev`` extra) and s3fs (the ``bench``
extra): ``pip install -e ".[torch,dev,bench]"``, which ``make bench-s3`` runs.
s3fs rides on aiobotocore, which pins botocore to a few patch releases, a
release or so behind the newest boto3's; the ``bench`` extra names the boto3
that matches, so pip downgrades boto3 and botocore together. (``pip install
s3fs`` alone into an environment with a newer boto3 downgrades botocore under
it and leaves boto3 broken.)

One moto S3 server (a child process; requests served one at a time, part-size
floor at the AWS default of 5 MiB) sits behind a counting reverse proxy
(``_s3proxy.py``, threads of this process). Both systems talk to the proxy
only: ``AWS_ENDPOINT_URL`` and dummy credentials are set in the environment
of the ranks, and s3fs is also given the endpoint in its ``client_kwargs``.
The proxy counts, per phase and per HTTP method, requests, request body bytes
(uploaded) and response body bytes (downloaded).

MOTO IS AN EMULATOR: it keeps objects in this machine's memory and answers on
the loopback, one request at a time. Its bytes and request counts are what a
client would send to S3; its times are not S3's (no network latency, no
per-prefix request rates, a server that shares these CPUs with the clients).
moto also answers a ranged GET by copying the whole object and slicing it,
so every ranged request costs server time in proportion to the object's size.
The time ratios compare two clients against the same emulator, nothing more.

``--ranks`` (2) processes join one gloo group and stay alive for the whole run
(driven over pipes, as in bench_dcp.py). The state is bench_dcp.py's:
``--tensors`` fp32 tensors, ``--state-mib`` in all, each split by dim-0 rows
over the ranks, with random values; the re-save state has every 10th tensor
(10% of the bytes) changed. DCP saves DTensors (``Shard(0)`` over a CPU
``DeviceMesh``); castore saves the same blocks as ``castore.Shard`` through
its native ``castore.dist.save`` (not its DCP backend).

Each repetition, with fresh prefixes, runs four phases; in each the two
systems take turns, the order rotating from one repetition to the next:

full save     DCP: ``dcp.save(state, storage_writer=FsspecWriter("s3://B/rep/dcp-1",
              sync_files=False))`` (an S3 upload is durable when it returns; with
              sync_files DCP would call ``os.sync()`` on this machine's disks).
              castore: ``castore.dist.save(store, state, run=..., step=1)`` into
              ``castore.open("s3://B/rep/castore", cache_dir=<this rank's own>)``,
              a store the parent created empty (untimed) so the ranks never race
              to create it. Each rank keeps its own chunk-index cache, as
              separate nodes would.
load          both ranks restore into preallocated NaN-filled blocks:
              ``dcp.load(..., storage_reader=FsspecReader(...))`` /
              ``castore.dist.load(store, run=..., targets=...)``.
re-save       the 10%-changed state. DCP has no dedup: a full save into a new
              prefix. castore: generation 2 in the same store.
2->1 load     rank 0 alone restores the whole re-saved state into full-size
              tensors (DCP: ``dcp.load(..., no_dist=True)`` into plain tensors;
              castore: ``castore.dist.load`` in a one-rank group, with a fresh
              chunk-index cache, as a new node would have).

DCP's reads over s3fs: FileSystemReader hands each stored item to
``torch.load``, which seeks in it (the zip directory at the end first); s3fs's
default read cache (``readahead``, 50 MiB blocks) fetches up to a block past
each miss, so a backward seek costs a block again. With 256 MiB per rank
file (512 MiB state, 2 ranks) DCP fetched 2.9x the state's size on both loads;
with 32 MiB files (the 64 MiB smoke run) a file fits one block and DCP fetched
1.002x. With ``--s3fs-block-mib 256`` (a block as large as a rank's file)
DCP fetched 1.0003x, wrote each file in one PUT instead of a multipart upload,
and both its saves and loads got faster: castore's throughput ratios went
from 1.1-1.2x (save) and 3.3-3.8x (load) under the defaults to 0.70x and
0.59x (3 repetitions, 512 MiB). So the ratios under the defaults measure
s3fs's readahead and part size (and moto's ranged GETs) as much as castore;
against a DCP so tuned, castore is slower on this emulator. The defaults are what DCP users
get from s3fs, so they are the default here; ``--s3fs-cache-type`` and
``--s3fs-block-mib`` set s3fs's
``default_cache_type`` / ``default_block_size`` to look at other trade-offs
(``none`` issues a ranged GET per read call of torch.load, each a
whole-object copy in moto; a 512 MiB run with it had not finished its first
repetition after 6 minutes, where one takes under 3 with s3fs's defaults).

A time is the wall time of the save/load call, the maximum over the ranks
that take part, after a barrier; each rank builds its writer/reader or opens
the store before it. Bytes and requests are everything the proxy saw from the
command being sent to the last rank's answer (store opening included). The
first ``--warmup`` repetitions are untimed; the first one checks every loaded
value. Tables show medians over the timed repetitions; ratios are castore
over DCP, from the same repetitions.

``--codecs LIST`` (e.g. ``none,auto``) runs castore once per chunk codec, each
a system of its own ("castore [auto]") in its own store, created with
``castore.open(url, codec=...)``, taking turns with DCP and the other codecs in
every phase. A codec table gives each codec's bytes uploaded and downloaded and
its throughput over ``none``'s, and, when both ran, goals for the default codec
of stores on blobs (``auto``): a full save uploads <= 0.75x the bytes of the
same save with ``none``, at >= 1.0x its throughput. Without ``--codecs``,
castore runs once with the store's default codec (``auto`` on S3), as before.
``--dtype`` (fp32, the default, or bf16) sets the tensors' dtype: fp32 blocks
are ``randn`` as above; bf16 blocks are ``randn * 0.02`` rounded to bf16 (the
scale of trained weights), ``--state-mib`` in all either way. Random fp32
mantissas do not compress; a bf16 tensor has half as many mantissa bits per
byte, so codecs that keep the mantissa raw and code the exponent save more.

If ``castore.open("s3://...")`` raises UnsupportedBackendError (a castore
without an S3 backend), the DCP half runs alone and the goals say so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import PipedRanks, join_gloo, parse_codecs, print_goals
from _s3proxy import CountingProxy, MotoServer
from bench_dcp import COLS, DELTA, Layout, local_blocks, make_layout, rotate
from tabulate import tabulate

import castore
from castore.errors import UnsupportedBackendError

MIB = 1 << 20
GIB = 1 << 30
RUN = "bench"
BUCKET = "castore-bench"
REGION = "us-east-1"
DUMMY_KEY = "testing"
COLLECTIVE_TIMEOUT = 600.0
SYSTEMS = ["DCP", "castore"]
DTYPES = {"fp32": 4, "bf16": 2}  # --dtype: element size
BF16_SCALE = 0.02  # bf16 blocks: randn * this, the scale of trained weights
PHASES = ["full save", "load", "re-save", "2->1 load"]

# Goals (on medians, castore against DCP/s3fs in the same run)
FULL_SAVE_BYTES_GOAL = 1.02  # castore full-save bytes uploaded <= 1.02x DCP's
RESAVE_BYTES_GOAL = 0.12  # castore 10%-changed re-save bytes uploaded <= 0.12x DCP's
THROUGHPUT_GOAL = 1.0  # castore save and load throughput >= 1.0x DCP's
RESHARD_FETCH_GOAL = 1.01  # castore 2->1 load: bytes fetched / bytes needed <= 1.01
# Goals of the default codec on blobs (auto) against none, both in the same run (--codecs)
CODEC_BYTES_GOAL = 0.75  # auto full-save bytes uploaded <= 0.75x none's
CODEC_THROUGHPUT_GOAL = 1.0  # auto full-save throughput >= 1.0x none's


# -- the ranks ---------------------------------------------------------------


def s3fs_options(endpoint: str, cache: dict[str, Any]) -> dict[str, Any]:
    """fsspec storage options for FsspecWriter/Reader: the endpoint said outright."""
    return {"client_kwargs": {"endpoint_url": endpoint, "region_name": REGION}, **cache}


def open_castore(
    url: str, options: dict[str, Any], rank: int, create: bool = False
) -> castore.Store:
    """``castore.open(url)``, the chunk-index cache folder (if any) made this rank's own."""
    options = dict(options)
    if "cache_dir" in options:
        options["cache_dir"] = options["cache_dir"].format(rank=rank)
    return castore.open(url, create=create, **options)


def is_castore(system: str) -> bool:
    """``castore`` or ``castore [codec]`` (``--codecs``)."""
    return system.split(" ")[0] == "castore"


def system_codec(system: str) -> str | None:
    """The codec of ``castore [codec]``; None for ``castore`` (the store's default)."""
    return system.partition("[")[2].rstrip("]") or None


def as_dtype(block: Any, dtype: str) -> Any:
    """A fp32 randn block as ``dtype``'s (fp32: itself; bf16: scaled and rounded)."""
    import torch

    return block if dtype == "fp32" else (block * BF16_SCALE).to(torch.bfloat16)


def state_blocks(layout: Layout, rank: int, dtype: str) -> list[Any]:
    """This rank's block of every tensor (bench_dcp.py's, as ``dtype``)."""
    return [as_dtype(block, dtype) for block in local_blocks(layout, rank)]


def full_tensor(layout: Layout, index: int, changed: bool, dtype: str) -> Any:
    """Tensor ``index`` whole, as the ranks built it (for checking a 2->1 load)."""
    import torch

    rows = layout.rows // layout.world
    parts = []
    for rank in range(layout.world):
        gen = torch.Generator().manual_seed(1_000_003 * index + rank)
        block = as_dtype(torch.randn((rows, COLS), generator=gen), dtype)
        parts.append(block + DELTA if changed and layout.changed(index) else block)
    return torch.cat(parts)


def worker(
    rank: int,
    port: int,
    layout: Layout,
    endpoint: str,
    cache: dict[str, Any],
    dtype: str,
    conn: Any,
) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import castore.dist

    try:
        join_gloo(rank, port, layout.world, COLLECTIVE_TIMEOUT)
        mesh = init_device_mesh("cpu", (layout.world,))
        solo = dist.new_group([0])  # the 2->1 load's group (every rank must create it)
        base = state_blocks(layout, rank, dtype)
        changed = [block + DELTA if layout.changed(i) else block for i, block in enumerate(base)]
    except Exception:  # noqa: BLE001 - the parent must hear about it
        conn.send({"error": traceback.format_exc()})
        return
    rows = layout.rows // layout.world
    shape = (layout.rows, COLS)
    offsets = (rank * rows, 0)

    def dtensors(blocks: list[Any]) -> dict[str, Any]:
        return {
            layout.name(i): DTensor.from_local(block, mesh, [Shard(0)], run_check=False)
            for i, block in enumerate(blocks)
        }

    def shards(blocks: list[Any]) -> dict[str, Any]:
        return {layout.name(i): castore.Shard(b, shape, offsets) for i, b in enumerate(blocks)}

    states = {
        ("DCP", "base"): dtensors(base),
        ("DCP", "changed"): dtensors(changed),
        ("castore", "base"): shards(base),
        ("castore", "changed"): shards(changed),
    }
    blocks_of = {"base": base, "changed": changed}
    conn.send({"ready": True})

    def timed(call: Any, group: Any = None) -> tuple[float, Any]:
        """(seconds, result) of ``call()``, started together by a barrier of ``group``."""
        gc.collect()
        dist.barrier(group=group)
        started = time.perf_counter()
        result = call()
        return time.perf_counter() - started, result

    def check(loaded: list[Any], expected: Any) -> list[str]:
        return [layout.name(i) for i, t in enumerate(loaded) if not torch.equal(t, expected(i))]

    def save(system: str, url: str, which: str, step: int, options: dict[str, Any]) -> dict:
        state = states[("DCP" if system == "DCP" else "castore", which)]
        if system == "DCP":
            writer = FsspecWriter(url, sync_files=False, **s3fs_options(endpoint, cache))
            seconds, _ = timed(lambda: dcp.save(state, storage_writer=writer))
            return {"seconds": seconds}
        with open_castore(url, options, rank) as store:
            seconds, generation = timed(
                lambda: castore.dist.save(
                    store, state, run=RUN, step=step, timeout=COLLECTIVE_TIMEOUT
                )
            )
        return {"seconds": seconds, "generation": generation.id, "stats": vars(generation.stats)}

    def load(system: str, url: str, which: str, verify: bool, options: dict[str, Any]) -> dict:
        fresh = [torch.full_like(block, float("nan")) for block in base]
        out: dict[str, Any] = {}
        if system == "DCP":
            targets = dtensors(fresh)
            reader = FsspecReader(url, **s3fs_options(endpoint, cache))
            out["seconds"], _ = timed(lambda: dcp.load(targets, storage_reader=reader))
        else:
            blocks = shards(fresh)
            with open_castore(url, options, rank) as store:
                out["seconds"], result = timed(
                    lambda: castore.dist.load(
                        store, run=RUN, targets=blocks, timeout=COLLECTIVE_TIMEOUT
                    )
                )
            out.update(bytes_read=result.report.bytes_read, bytes_needed=result.report.bytes_needed)
        if verify:
            out["bad"] = check(fresh, lambda i: blocks_of[which][i])
        return out

    def load_whole(system: str, url: str, which: str, verify: bool, options: dict) -> dict:
        if rank != 0:
            return {"idle": True}
        fresh = [
            torch.full(shape, float("nan"), dtype=base[0].dtype) for _ in range(layout.tensors)
        ]
        out: dict[str, Any] = {}
        if system == "DCP":
            targets = {layout.name(i): t for i, t in enumerate(fresh)}
            reader = FsspecReader(url, **s3fs_options(endpoint, cache))
            out["seconds"], _ = timed(
                lambda: dcp.load(targets, storage_reader=reader, no_dist=True), solo
            )
        else:
            whole = {layout.name(i): castore.Shard(t, shape, (0, 0)) for i, t in enumerate(fresh)}
            with open_castore(url, options, rank) as store:
                out["seconds"], result = timed(
                    lambda: castore.dist.load(
                        store, run=RUN, targets=whole, group=solo, timeout=COLLECTIVE_TIMEOUT
                    ),
                    solo,
                )
            out.update(bytes_read=result.report.bytes_read, bytes_needed=result.report.bytes_needed)
        if verify:
            out["bad"] = check(fresh, lambda i: full_tensor(layout, i, which == "changed", dtype))
        return out

    handlers = {"save": save, "load": load, "load_whole": load_whole}
    while True:
        command = conn.recv()
        if command[0] == "stop":
            break
        try:
            reply = handlers[command[0]](*command[1:])
        except Exception:  # noqa: BLE001 - the parent must hear about it
            reply = {"error": traceback.format_exc()}
        conn.send(reply)
    dist.destroy_process_group()


class Ranks(PipedRanks):
    def __init__(
        self, layout: Layout, endpoint: str, s3fs_cache: dict[str, Any], dtype: str
    ) -> None:
        super().__init__(layout.world, worker, (layout, endpoint, s3fs_cache, dtype), "bench-s3")


# -- the parent: S3 set-up ---------------------------------------------------


def set_client_environment(endpoint: str) -> None:
    """What boto3, aiobotocore and castore read (the ranks inherit it when spawned)."""
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": DUMMY_KEY,
            "AWS_SECRET_ACCESS_KEY": DUMMY_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }
    )
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE"):
        os.environ.pop(name, None)  # nothing of a real account may leak into the run


def admin_client(moto_address: str) -> Any:
    """A boto3 client straight to moto, bypassing the proxy: set-up is never counted."""
    import boto3

    return boto3.session.Session().client(
        "s3",
        endpoint_url=f"http://{moto_address}",
        region_name=REGION,
        aws_access_key_id=DUMMY_KEY,
        aws_secret_access_key=DUMMY_KEY,
    )


def empty_bucket(client: Any) -> None:
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=BUCKET):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})
    uploads = client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    for upload in uploads:
        client.abort_multipart_upload(Bucket=BUCKET, Key=upload["Key"], UploadId=upload["UploadId"])


def castore_backend_problem() -> str | None:
    """None when this castore opens ``s3://`` stores, else why not (in one line)."""
    try:
        store = castore.open(f"s3://{BUCKET}/probe", create=False)
    except UnsupportedBackendError:
        return "castore S3 backend not available"
    except castore.StoreError:
        return None  # it knows s3:// (no store at the probe prefix, as expected)
    store.close()
    return None


def s3fs_problem() -> str | None:
    try:
        import s3fs  # noqa: F401
    except ImportError as exc:
        return f"s3fs is not installed ({exc}): pip install -e '.[torch,dev,bench]'"
    return None


# -- the parent: the run -----------------------------------------------------


@dataclass
class Phase:
    seconds: float
    counts: dict[str, Any]
    replies: list[dict[str, Any]]


@dataclass
class Results:
    phases: dict[str, list[Phase]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, phase: Phase) -> None:
        self.phases.setdefault(key, []).append(phase)

    def median(self, key: str, what: str) -> float:
        values = [value_of(p, what) for p in self.phases[key]]
        return statistics.median(values)


def value_of(phase: Phase, what: str) -> float:
    if what == "seconds":
        return phase.seconds
    if what.startswith("requests:"):
        method = what.partition(":")[2]
        return float(phase.counts["by_method"].get(method, {}).get("requests", 0))
    return float(phase.counts[what])


@dataclass
class Context:
    ranks: Ranks
    proxy: CountingProxy
    admin: Any
    systems: list[str]
    cache_root: Path
    quiet: float
    verify: bool


def run_phase(ctx: Context, command: tuple[Any, ...], what: str) -> Phase:
    time.sleep(ctx.quiet)
    ctx.proxy.take()  # drop whatever came before (nothing should)
    replies = ctx.ranks.command(*command)
    counts = ctx.proxy.take().as_dict()
    if counts["server_errors"]:
        raise RuntimeError(f"{what}: moto answered {counts['server_errors']} requests with 5xx")
    busy = [r for r in replies if not r.get("idle")]
    for rank, reply in enumerate(busy):
        if reply.get("bad"):
            raise AssertionError(f"{what}: rank {rank} loaded wrong values in {reply['bad']}")
    return Phase(max(r["seconds"] for r in busy), counts, busy)


def one_rep(ctx: Context, label: str, rep: int, results: Results) -> None:
    prefix = f"s3://{BUCKET}/{label}"
    urls = {("DCP", 1): f"{prefix}/dcp-1", ("DCP", 2): f"{prefix}/dcp-2"}
    for system in ctx.systems:
        if is_castore(system):  # one store per codec; generation 2 in the same one
            codec = system_codec(system)
            url = f"{prefix}/castore" + (f"-{codec}" if codec else "")
            urls.update({(system, 1): url, (system, 2): url})
    cache = ctx.cache_root / label

    def options(system: str, node: str) -> dict[str, Any]:
        # The ranks fill in {rank}: each its own chunk-index cache, as on its own node.
        if not is_castore(system):
            return {}
        codec = system_codec(system)
        dirs = {"cache_dir": str(cache / (node if codec is None else f"{codec}-{node}"))}
        return dirs if codec is None else {**dirs, "codec": codec}

    for system in ctx.systems:
        if is_castore(system):  # empty, before the ranks open it
            with open_castore(urls[(system, 1)], options(system, "parent"), 0, True) as store:
                results.notes.setdefault("chunk_size", store.chunk_size)
                results.notes.setdefault(f"{system} store codec", getattr(store, "codec", None))
    order = rotate(ctx.systems, rep)
    plan: list[tuple[str, str, tuple[Any, ...]]] = []
    for system in order:
        args = (urls[(system, 1)], "base", 1, options(system, "rank{rank}"))
        plan.append(("full save", system, ("save", system, *args)))
    for system in order:
        args = (urls[(system, 1)], "base", ctx.verify, options(system, "rank{rank}"))
        plan.append(("load", system, ("load", system, *args)))
    for system in order:
        args = (urls[(system, 2)], "changed", 2, options(system, "rank{rank}"))
        plan.append(("re-save", system, ("save", system, *args)))
    for system in order:  # a new node: a fresh cache
        args = (urls[(system, 2)], "changed", ctx.verify, options(system, "new-node"))
        plan.append(("2->1 load", system, ("load_whole", system, *args)))
    try:
        for phase, system, command in plan:
            outcome = run_phase(ctx, command, f"{system} {phase}")
            results.add(f"{system} {phase}", outcome)
            if is_castore(system) and command[0] == "save":
                results.notes.setdefault(f"{system} {phase} stats", outcome.replies[0]["stats"])
    finally:
        empty_bucket(ctx.admin)
        shutil.rmtree(cache, ignore_errors=True)


def ratio_rows(results: Results, systems: list[str], logical: int) -> list[list[str]]:
    """One row per phase and system: medians of time, bytes and requests."""
    rows = []
    for phase in PHASES:
        for system in systems:
            key = f"{system} {phase}"
            seconds = results.median(key, "seconds")
            methods = sorted({m for p in results.phases[key] for m in p.counts["by_method"]})
            requests = ", ".join(f"{m} {results.median(key, f'requests:{m}'):g}" for m in methods)
            rows.append(
                [
                    key,
                    f"{seconds:.2f}",
                    f"{logical / GIB / seconds:.3f}",
                    f"{results.median(key, 'bytes_up') / MIB:.1f}",
                    f"{results.median(key, 'bytes_down') / MIB:.2f}",
                    f"{results.median(key, 'requests'):g}",
                    requests,
                ]
            )
    return rows


def comparisons(
    results: Results, logical: int, system: str = "castore", reference: str = "DCP"
) -> list[dict[str, Any]]:
    """``system`` over ``reference`` (castore over DCP), from medians of the same repetitions."""

    def med(system: str, phase: str, what: str) -> float:
        return results.median(f"{system} {phase}", what)

    out = []
    for phase in PHASES:
        entry: dict[str, Any] = {"phase": phase}
        if system != "castore":
            entry["system"] = system
        for what in ("bytes_up", "bytes_down", "requests"):
            ref_value = med(reference, phase, what)
            entry[what] = med(system, phase, what) / ref_value if ref_value else None
        entry["throughput"] = med(reference, phase, "seconds") / med(system, phase, "seconds")
        out.append(entry)
    return out


def castore_report_line(results: Results, systems: list[str]) -> str:
    """castore's own account of the 2->1 load (its LoadReport), next to the proxy's."""
    lines = []
    for system in filter(is_castore, systems):
        ratios = [
            p.replies[0]["bytes_read"] / p.replies[0]["bytes_needed"]
            for p in results.phases[f"{system} 2->1 load"]
        ]
        lines.append(
            f"\n{system}'s LoadReport for it: bytes_read / bytes_needed = "
            f"{statistics.median(ratios):.4f} (chunk payloads only, no requests' framing)."
        )
    return "".join(lines)


def codec_table(
    results: Results, systems: list[str], logical: int
) -> tuple[list[list[str]], list[dict]]:
    """Per codec (``castore [codec]`` systems): bytes and throughput over ``none``'s."""
    rows, records = [], []
    coded = [s for s in systems if is_castore(s) and system_codec(s)]
    reference = "castore [none]" if "castore [none]" in coded else None
    for system in coded:
        stats = results.notes.get(f"{system} full save stats", {})
        stored, new = stats.get("stored_bytes"), stats.get("new_bytes")
        record: dict[str, Any] = {
            "codec": system_codec(system),
            "full_save_stored_over_raw": stored / new if stored is not None and new else None,
        }
        cells = [str(record["codec"]), _ratio(record["full_save_stored_over_raw"])]
        for phase, what in (
            ("full save", "bytes_up"),
            ("re-save", "bytes_up"),
            ("load", "bytes_down"),
            ("full save", "throughput"),
            ("re-save", "throughput"),
            ("load", "throughput"),
            ("2->1 load", "throughput"),
        ):
            if what == "throughput":
                mine = results.median(f"{system} {phase}", "seconds")
                value = (
                    results.median(f"{reference} {phase}", "seconds") / mine if reference else None
                )
                cells.append(f"{_ratio(value)} ({logical / GIB / mine:.3f})")
            else:
                mine = results.median(f"{system} {phase}", what)
                value = mine / results.median(f"{reference} {phase}", what) if reference else None
                cells.append(f"{_ratio(value)} ({mine / MIB:.1f})")
            record[f"{phase} {what} over none"] = value
            record[f"{phase} {what}"] = mine
        rows.append(cells)
        records.append(record)
    return rows, records


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def codec_goals(results: Results, systems: list[str]) -> list[dict[str, Any]]:
    """The default codec on blobs (auto) against none, when both ran (``--codecs``)."""
    auto, none = "castore [auto]", "castore [none]"
    if auto not in systems or none not in systems:
        return []
    up = results.median(f"{auto} full save", "bytes_up") / results.median(
        f"{none} full save", "bytes_up"
    )
    speed = results.median(f"{none} full save", "seconds") / results.median(
        f"{auto} full save", "seconds"
    )
    return [
        {
            "goal": f"auto full save: bytes uploaded <= {CODEC_BYTES_GOAL}x none's",
            "measured": f"{up:.3f}x",
            "value": up,
            "met": up <= CODEC_BYTES_GOAL,
        },
        {
            "goal": f"auto full save throughput >= {CODEC_THROUGHPUT_GOAL}x none's",
            "measured": f"{speed:.3f}x",
            "value": speed,
            "met": speed >= CODEC_THROUGHPUT_GOAL,
        },
    ]


def evaluate_goals(
    results: Results, logical: int, problem: str | None, system: str = "castore"
) -> list[dict[str, Any]]:
    goals = [
        ("full save", "bytes_up", "<=", FULL_SAVE_BYTES_GOAL, "full save: bytes uploaded"),
        ("re-save", "bytes_up", "<=", RESAVE_BYTES_GOAL, "10%-changed re-save: bytes uploaded"),
        ("full save", "throughput", ">=", THROUGHPUT_GOAL, "full save throughput"),
        ("load", "throughput", ">=", THROUGHPUT_GOAL, "load throughput (2 ranks)"),
    ]
    verdicts: list[dict[str, Any]] = []
    tag = system[len("castore") :]
    for phase, what, sense, bound, text in goals:
        goal = f"{text} {sense} {bound}x DCP's{tag}"
        if problem:
            verdicts.append({"goal": goal, "measured": problem, "value": None, "met": False})
            continue
        if what == "throughput":
            value = results.median(f"DCP {phase}", "seconds") / results.median(
                f"{system} {phase}", "seconds"
            )
        else:
            value = results.median(f"{system} {phase}", what) / results.median(f"DCP {phase}", what)
        met = value <= bound if sense == "<=" else value >= bound
        verdicts.append({"goal": goal, "measured": f"{value:.3f}x", "value": value, "met": met})
    goal = f"2->1 load: bytes fetched / bytes needed <= {RESHARD_FETCH_GOAL}{tag}"
    if problem:
        verdicts.append({"goal": goal, "measured": problem, "value": None, "met": False})
    else:
        value = results.median(f"{system} 2->1 load", "bytes_down") / logical
        verdicts.append(
            {
                "goal": goal,
                "measured": f"{value:.4f}",
                "value": value,
                "met": value <= RESHARD_FETCH_GOAL,
            }
        )
    return verdicts


def s3fs_read_cache(args: argparse.Namespace) -> dict[str, Any]:
    """The s3fs options the command line sets (none: s3fs's defaults, what DCP users get)."""
    options: dict[str, Any] = {}
    if args.s3fs_cache_type is not None:
        options["default_cache_type"] = args.s3fs_cache_type
    if args.s3fs_block_mib is not None:
        options["default_block_size"] = int(args.s3fs_block_mib * MIB)
    return options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=512, help="state size (default 512)")
    parser.add_argument("--tensors", type=int, default=40, help="tensors (default 40)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (default 3)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed repetitions first (default 1)"
    )
    parser.add_argument(
        "--quiet", type=float, default=3.0, help="pause before each timed phase (s, default 3)"
    )
    parser.add_argument(
        "--s3fs-cache-type",
        default=None,
        help="s3fs's default_cache_type for DCP's reads (default: s3fs's own, readahead)",
    )
    parser.add_argument(
        "--s3fs-block-mib",
        type=float,
        default=None,
        help="s3fs's default_block_size in MiB (default: s3fs's own, 50)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is not met")
    parser.add_argument(
        "--codecs",
        type=parse_codecs,
        default=None,
        help="castore once per codec, e.g. none,auto (default: once, the store's default)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="tensor dtype (default fp32)"
    )
    args = parser.parse_args(argv)
    if args.tensors < 10 or args.ranks < 2 or args.repeats < 1 or args.warmup < 0:
        parser.error("need --tensors >= 10, --ranks >= 2, --repeats >= 1, --warmup >= 0")

    # make_layout sizes fp32 rows: ask for as many elements as --state-mib holds in dtype
    element = DTYPES[args.dtype]
    layout = make_layout(args.state_mib * 4 // element, args.tensors, args.ranks)
    logical = layout.logical_bytes * element // 4
    moto = MotoServer()
    proxy = CountingProxy(moto.address)
    set_client_environment(proxy.endpoint)
    admin = admin_client(moto.address)
    admin.create_bucket(Bucket=BUCKET)
    problems = {"DCP": s3fs_problem(), "castore": castore_backend_problem()}
    systems = [s for s in SYSTEMS if problems[s] is None]
    if args.codecs is not None and "castore" in systems:
        systems.remove("castore")
        systems += [f"castore [{codec}]" for codec in args.codecs]
    print(
        f"{layout.tensors} {args.dtype} tensors of ({layout.rows}, {COLS}), split by rows over "
        f"{layout.world} gloo ranks: {logical / MIB:.1f} MiB in all; the re-save changes "
        f"every 10th tensor\nS3: moto (an emulator, in memory on this machine) at "
        f"{moto.address}, behind the counting proxy at {proxy.endpoint}\n"
        f"systems: {', '.join(systems) or 'none'}"
        + "".join(f"\n  {s}: {p}" for s, p in problems.items() if p)
        + f"\ns3fs options: {s3fs_read_cache(args) or 'its defaults'}"
        + f"\nrepeats: {args.repeats} (+{args.warmup} untimed), quiet {args.quiet:g} s",
        flush=True,
    )
    if not systems:
        proxy.close()
        moto.close()
        return 2

    results = Results()
    cache_root = Path(tempfile.mkdtemp(prefix="castore-bench-s3-"))
    started = time.perf_counter()
    ranks: Ranks | None = None
    try:
        ranks = Ranks(layout, proxy.endpoint, s3fs_read_cache(args), args.dtype)
        print(f"{layout.world} ranks up in {time.perf_counter() - started:.1f} s", flush=True)
        for rep in range(-args.warmup, args.repeats):
            rep_start = time.perf_counter()
            first = rep == -args.warmup
            sink = results if rep >= 0 else Results()
            ctx = Context(
                ranks, proxy, admin, systems, cache_root, args.quiet if rep >= 0 else 0.0, first
            )
            one_rep(ctx, f"rep{rep + args.warmup}", rep, sink)
            results.notes.update({k: v for k, v in sink.notes.items() if k not in results.notes})
            label = f"rep {rep + 1}/{args.repeats}" if rep >= 0 else "warm-up (untimed)"
            checked = ", every load checked" if first else ""
            print(f"{label}: {time.perf_counter() - rep_start:.1f} s{checked}", flush=True)
    finally:
        if ranks is not None:
            ranks.close()
        proxy.close()
        moto.close()
        shutil.rmtree(cache_root, ignore_errors=True)

    print(
        "\nmoto is an emulator: bytes and requests are what a client sends to S3; times are "
        "against an in-memory server on this machine's CPUs, not S3's.\n"
    )
    headers = ["phase", "median s", "GiB/s", "MiB up", "MiB down", "requests", "by method"]
    print(
        tabulate(
            ratio_rows(results, systems, logical),
            headers=headers,
            tablefmt="github",
            disable_numparse=True,
        )
    )
    problem = problems["castore"] or problems["DCP"]
    castores = [s for s in systems if is_castore(s)]
    compared = [] if problem else [c for s in castores for c in comparisons(results, logical, s)]
    if compared:
        print()
        rows = [
            [
                f"{c['system'][len('castore ') :]} {c['phase']}" if "system" in c else c["phase"],
                f"{c['bytes_up']:.3f}x" if c["bytes_up"] is not None else "-",
                f"{c['bytes_down']:.3f}x" if c["bytes_down"] is not None else "-",
                f"{c['requests']:.2f}x",
                f"{c['throughput']:.2f}x",
            ]
            for c in compared
        ]
        print(
            tabulate(
                rows,
                headers=["castore / DCP", "bytes up", "bytes down", "requests", "throughput"],
                tablefmt="github",
                disable_numparse=True,
            )
        )
    print(
        "\ntime: the save/load call, max over the ranks taking part, median over repeats; "
        "GiB/s: the whole state's size over it. Bytes: request/response bodies through the "
        "proxy. throughput: DCP time / castore time (>1: castore faster).\n"
        "2->1 load: rank 0 alone restores the whole re-saved state; "
        + " ".join(
            f"{s} fetched {results.median(f'{s} 2->1 load', 'bytes_down') / logical:.4f}x "
            "the bytes needed (response bodies over the state's size)."
            for s in systems
        )
        + castore_report_line(results, systems)
    )
    codec_rows, codec_records = codec_table(results, systems, logical)
    if codec_rows:
        print()
        print(
            tabulate(
                codec_rows,
                headers=[
                    "codec",
                    "stored/raw",
                    "full save up (MiB)",
                    "re-save up (MiB)",
                    "load down (MiB)",
                    "full save thr. (GiB/s)",
                    "re-save thr. (GiB/s)",
                    "load thr. (GiB/s)",
                    "2->1 load thr. (GiB/s)",
                ],
                tablefmt="github",
                disable_numparse=True,
            )
        )
        print(
            "\nEach codec over none, from medians of the same repetitions (bytes: this "
            "codec's / none's; thr.: none's time / this codec's, >1 = faster); in brackets "
            "this codec's own median. stored/raw: the full save's stats.stored_bytes / "
            "new_bytes (rank 0)."
        )
    verdicts = [v for s in castores for v in evaluate_goals(results, logical, problem, s)]
    if not castores:
        verdicts = evaluate_goals(results, logical, problem)
    verdicts += codec_goals(results, systems)
    print()
    print_goals(verdicts)
    print(f"\ntotal time {time.perf_counter() - started:.0f} s")
    if args.json:
        write_json(
            args, layout, logical, results, systems, problems, compared, codec_records, verdicts
        )
        print(f"wrote {args.json}")
    return 1 if args.check and not all(v["met"] for v in verdicts) else 0


def write_json(
    args: argparse.Namespace,
    layout: Layout,
    logical: int,
    results: Results,
    systems: list[str],
    problems: dict[str, str | None],
    compared: list[dict[str, Any]],
    codecs: list[dict[str, Any]],
    verdicts: list[dict[str, Any]],
) -> None:
    phases = {
        key: {
            "median_s": results.median(key, "seconds"),
            "median_bytes_up": results.median(key, "bytes_up"),
            "median_bytes_down": results.median(key, "bytes_down"),
            "median_requests": results.median(key, "requests"),
            "reps": [
                {"seconds": p.seconds, "counts": p.counts, "ranks": p.replies} for p in phases
            ],
        }
        for key, phases in results.phases.items()
    }
    payload = {
        "server": "moto (emulator), in memory, on this machine",
        "state_mib": args.state_mib,
        "logical_bytes": logical,
        "dtype": args.dtype,
        "codecs": args.codecs,
        "tensors": layout.tensors,
        "tensor_shape": [layout.rows, COLS],
        "ranks": layout.world,
        "repeats": args.repeats,
        "warmup_reps": args.warmup,
        "quiet_s": args.quiet,
        "s3fs_options": s3fs_read_cache(args),
        "systems": systems,
        "unavailable": {s: p for s, p in problems.items() if p},
        "versions": versions(),
        "cpus": os.cpu_count(),
        "phases": phases,
        "castore_over_dcp": compared,
        "codecs_over_none": codecs,
        "notes": results.notes,
        "goals": verdicts,
    }
    args.json.write_text(json.dumps(payload, indent=2) + "\n")


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("castore", "torch", "s3fs", "aiobotocore", "botocore", "boto3", "moto"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
