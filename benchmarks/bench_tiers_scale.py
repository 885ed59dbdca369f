"""Tiers on several nodes: a model of how saves, promotions and restores grow with scale.

Run from the repository root::

    .venv/bin/python benchmarks/bench_tiers_scale.py [--ranks 2 4 8 16] [--replicas 1 2]
                                                     [--generations 4] [--workdir DIR]
                                                     [--json OUT]

For each rank count R and replica count F, R gloo ranks on this machine form
N = R/2 simulated nodes (each pair of ranks opens its own fast directory and
index cache) with a shared-directory durable store behind them. Each rank
holds a tiny state (one row-sharded float32 tensor, C = 4 chunks of 256 bytes
of its own). The job

1. opens its tiered stores,
2. saves G generations, every chunk new each time; every second one is
   promoted (each node leader uploads its ranks' chunks, the coordinator
   publishes the generation in the durable tier) and the ranks wait for it;
3. restores the newest generation with every node present,
4. closes, deletes one node's fast directory and index cache (node 1's; the
   only node's when N = 1), reopens and restores again.

castore counts itself: collective calls and the bytes each rank received
(castore.dist.comm.collective_counts), requests to the durable store by
primitive and area (Store.blob_requests, castore.blob.counting) and objects
read and verified (castore.core.reading.object_reads). A save's counts include
its background work (collection, promotion); its collectives and seconds are
its own. The model (benchmarks/_scale_model.py; docs/SCALE.md, "A model
of scale") gives each count as a function of R, N, F, C and the generation.
The run prints predicted against measured, the durable requests of the second
promotion by kind, and the model at 1,000 and 10,000 ranks (its CPU rows read
from benchmarks/results/metadata-scale.json, bench_metadata_scale.py's
results, beside DCP's reported plan check); it exits non-zero
unless every count agrees exactly (those that hang on timing: at least their
floor) and every byte figure within BYTE_TOLERANCE. Byte figures are predicted
from message sizes read off the first job on several nodes (R = 4). Times are
wall seconds on this machine (every rank shares its 2 cores): the trend only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _scale_model as model  # noqa: E402
from _common import PipedRanks, join_gloo  # noqa: E402

import castore  # noqa: E402
import castore.dist  # noqa: E402
from castore.chunkstore.base import Namespace  # noqa: E402
from castore.core.reading import object_reads  # noqa: E402
from castore.dist.comm import collective_counts  # noqa: E402
from castore.format.hashing import Digest  # noqa: E402

RUN = "job"
CHUNK = 256  # bytes: tiny chunks, so a tiny state still has several per rank
COLUMNS = 64  # float32 columns of the one tensor: a row is 256 bytes, one chunk
ROWS = 4  # rows each rank holds: C = ROWS chunks of its own
GENERATIONS = 4
EVERY = 2  # generations 2 and 4 are promoted
TIMEOUT = 300.0


@dataclass(frozen=True)
class Job:
    ranks: int
    replicas: int
    work: str
    generations: int = GENERATIONS

    @property
    def nodes(self) -> int:
        return max(1, self.ranks // 2)

    def fast(self, node: int) -> str:
        return os.path.join(self.work, f"fast{node}")

    def node_of(self, rank: int) -> int:
        return rank * self.nodes // self.ranks


# -- the ranks ------------------------------------------------------------------------


def state_of(rank: int, ranks: int, generation: int) -> dict[str, Any]:
    rng = np.random.default_rng([generation, rank])
    block = rng.standard_normal((ROWS, COLUMNS), dtype=np.float32)
    return {"w": castore.Shard(block, (ROWS * ranks, COLUMNS), (ROWS * rank, 0))}


def counts_now(store: Any) -> dict[str, Any]:
    return {
        "comm": collective_counts(),
        "blob": store.durable.blob_requests() if store is not None else None,
        "objects": object_reads(),
        "clock": time.perf_counter(),
    }


def span(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    comm = after["comm"] - before["comm"]
    objects = after["objects"] - before["objects"]
    out: dict[str, Any] = {
        "calls": dict(comm.calls),
        "phases": dict(comm.phases),
        "sent": comm.sent,
        "received": comm.received,
        "received_by_phase": dict(comm.received_by_phase),
        "objects": objects.objects,
        "object_bytes": objects.bytes,
        "seconds": after["clock"] - before["clock"],
    }
    if after["blob"] is not None:
        blob = after["blob"] - (before["blob"] or type(after["blob"])())
        out.update(durable=dict(blob.requests), listed=blob.listed, up=blob.sent, down=blob.fetched)
    return out


def worker(rank: int, port: int, job: Job, conn: Any) -> None:
    import torch.distributed as dist

    try:
        join_gloo(rank, port, job.ranks, TIMEOUT)
    except Exception:  # noqa: BLE001 - the parent must hear about it
        conn.send({"error": traceback.format_exc()})
        return
    conn.send({"ready": True})
    store: Any = None
    while (command := conn.recv())[0] != "stop":
        try:
            store, reply = serve(command, rank, job, store)
        except Exception:  # noqa: BLE001 - the parent must hear about it
            reply = {"error": traceback.format_exc()}
        conn.send(reply)
    if store is not None:
        store.close()
    dist.destroy_process_group()


def serve(command: tuple[Any, ...], rank: int, job: Job, store: Any) -> tuple[Any, dict]:
    """Run one command on this rank (all ranks at once); the store and this rank's counts."""
    import torch.distributed as dist

    kind = command[0]
    dist.barrier()
    if kind == "open":
        before = counts_now(None)
        store = open_store(rank, job)
        after = counts_now(store)
        before["blob"] = type(after["blob"])()
        return store, span(before, after)
    if kind == "save":
        return store, save_once(rank, job, store, command[1])
    if kind == "load":
        return store, load_once(rank, job, store, command[1])
    if kind == "close":
        before = counts_now(store)
        store.close()
        return None, span(before, counts_now(store))
    raise ValueError(f"unknown command {kind!r}")


def open_store(rank: int, job: Job) -> Any:
    node = job.node_of(rank)
    return castore.open_tiered(
        fast=job.fast(node),
        durable=os.path.join(job.work, "durable"),
        durable_every=EVERY,
        replicas=job.replicas,
        chunk_size=CHUNK,
        uploader="thread",  # promotions on this process's thread: counted here
        promote_on_exit=False,
        cache_dir=job.fast(node) + "-cache",  # the node's index cache, lost with the node
    )


def save_once(rank: int, job: Job, store: Any, generation: int) -> dict[str, Any]:
    """Save ``generation`` and wait for its background work; the counts of each part."""
    state = state_of(rank, job.ranks, generation)
    before = counts_now(store)
    saved_as = castore.dist.save(store, state, run=RUN, step=generation, timeout=TIMEOUT)
    saved = counts_now(store)
    store.wait_promotions(TIMEOUT)
    done = counts_now(store)
    out = {"save": span(before, saved), "background": span(saved, done)}
    # Read after the spans, so in no count: this rank's manifest, for the byte model.
    root = store.fast.read_root(Digest.from_hex(saved_as.root), run=RUN)
    manifest = store.fast.backend.get(Namespace.OBJECTS, root.shards[rank]) or b""
    out["save"]["manifest_bytes"] = len(manifest)
    return out


def load_once(rank: int, job: Job, store: Any, generation: int) -> dict[str, Any]:
    """Restore the newest generation into this rank's block; the counts, and whether it
    is ``generation`` and bitwise what was saved."""
    expected = state_of(rank, job.ranks, generation)["w"].local
    block = np.zeros_like(expected)
    target = {"w": castore.Shard(block, (ROWS * job.ranks, COLUMNS), (ROWS * rank, 0))}
    before = counts_now(store)
    result = castore.dist.load(store, RUN, target, timeout=TIMEOUT)
    out = span(before, counts_now(store))
    out["restored"] = result.report.generation.id == generation and bool(
        np.array_equal(block, expected)
    )
    out["sources"] = dict(result.report.bytes_by_source)
    return out


# -- the parent: measure ------------------------------------------------------------------


def run_job(job: Job) -> dict[str, list[dict[str, Any]]]:
    """Every rank's counts of each operation (a save: with its background work)."""
    castore.open(os.path.join(job.work, "durable"), shared=True, chunk_size=CHUNK).close()
    ranks = PipedRanks(job.ranks, worker, (job,), "scale")
    measured: dict[str, list[dict[str, Any]]] = {}
    try:
        measured["open"] = ranks.command("open")
        for generation in range(1, job.generations + 1):
            replies = ranks.command("save", generation)
            measured[f"save {generation}"] = [merged(r["save"], r["background"]) for r in replies]
        measured["restore"] = ranks.command("load", job.generations)
        ranks.command("close")
        lost = job.fast(LOST if job.nodes > 1 else 0)
        shutil.rmtree(lost)
        shutil.rmtree(lost + "-cache", ignore_errors=True)
        measured["reopen"] = ranks.command("open")
        measured["restore, a node lost"] = ranks.command("load", job.generations)
        ranks.command("close")
    finally:
        ranks.close()
    return measured


LOST = 1  # the node whose fast tier is deleted (node 0, the only one, when N = 1)


def merged(save: dict[str, Any], background: dict[str, Any]) -> dict[str, Any]:
    """A save's counts with its background work (collection, promotion) added; the
    collectives and the seconds are the save's own (the caller waits for those)."""
    out = dict(save)
    for key in ("objects", "object_bytes", "listed", "up", "down"):
        out[key] = save[key] + background[key]
    durable = dict(save["durable"])
    for kind, count in background["durable"].items():
        durable[kind] = durable.get(kind, 0) + count
    out["durable"] = durable
    out["background_seconds"] = background["seconds"]
    return out


# -- the parent: predict and compare -----------------------------------------------------

KINDS = {  # each phase castore.dist and castore.tiers.nodes name, and its collective
    "tiers: nodes": "all_gather",
    "save: prepare": "all_gather",
    "save: propose": "broadcast",
    "save: write shards": "all_gather",
    "save: peer copies (ask)": "exchange",
    "save: peer copies (send)": "exchange",
    "save: peer copies": "all_gather",
    "save: publish": "broadcast",
    "save: publish on nodes": "all_gather",
    "load: resolve": "broadcast",
    "load: tiers": "all_gather",
    "load: candidates": "broadcast",
    "load: objects": "all_gather",
    "load: chunks wanted": "all_gather",
    "load: chunks offered": "all_gather",
    "load: chunks from peers": "exchange",
    "load: agree": "all_gather",
}
BYTE_OPS = ("save 3", "restore", "restore, a node lost")  # bytes are checked on these
BYTE_TOLERANCE = 0.02


@dataclass
class Row:
    """One operation of one job: predicted against measured."""

    ranks: int
    replicas: int
    op: str
    checks: list[tuple[str, Any, Any, bool]]  # (what, predicted, measured, agrees)
    kib_rank: tuple[float | None, float]  # bytes received by one rank of node 1
    kib_node: tuple[float | None, float]  # by node 1's ranks together
    seconds: float
    bytes_note: str = ""  # "model": predicted; "calib.": the run the sizes are read off

    @property
    def ok(self) -> bool:
        return all(agrees for *_, agrees in self.checks)

    def value(self, what: str) -> tuple[Any, Any]:
        for name, want, got, _ in self.checks:
            if name == what:
                return want, got
        return "-", "-"


def shape_of(job: Job) -> model.Shape:
    return model.Shape(job.ranks, job.nodes, job.replicas, chunks=ROWS)


def watched_rank(job: Job) -> int:
    """The rank whose bytes are reported: the first of node 1 (rank 1 on one node)."""
    return job.ranks // job.nodes if job.nodes > 1 else 1


def node_ranks(job: Job) -> list[int]:
    node = LOST if job.nodes > 1 else 0
    return [r for r in range(job.ranks) if job.node_of(r) == node]


def predicted_counts(
    job: Job, op: str
) -> tuple[dict[str, int], tuple[int | None, int], dict[str, int]]:
    """(collective calls per rank, (coordinator's, every rank's) objects, durable
    requests) the model gives for ``op``."""
    s = shape_of(job)
    kept = min(job.generations, s.fast_keep)
    if op == "open":
        return {}, (0, 0), model.open_durable(s, None)
    if op.startswith("save "):
        g = int(op.split()[1])
        promoted = g % EVERY == 0
        durable = model.promotion_durable(s, g // EVERY) if promoted else {}
        return model.save_calls(s), model.save_objects(s, g, promoted), durable
    if op == "restore":
        listed = dict.fromkeys(range(s.nodes), kept)
        objects = model.restore_objects(s, listed)
        return model.restore_calls(s), objects, model.restore_durable(s, fresh=False, lost=False)
    if op == "reopen":
        lost = LOST if s.multi else 0
        return {}, (None, model.reopen_objects(s)), model.open_durable(s, lost)
    # The lost node's new fast tier lists the one generation it took at open.
    listed = dict.fromkeys(range(s.nodes), kept) | {LOST if s.multi else 0: 1}
    objects = model.restore_objects(s, listed)
    return (
        model.restore_calls(s, lost=True),
        objects,
        model.restore_durable(s, fresh=True, lost=True),
    )


def p2p_of(job: Job, op: str) -> dict[str, int]:
    s = shape_of(job)
    if op.startswith("save"):
        return model.save_p2p(s, CHUNK)
    return model.restore_p2p(s, CHUNK, lost_rank=op == "restore, a node lost")


def compare(job: Job, op: str, replies: list[dict[str, Any]], sizes: Any) -> Row:
    calls, (coordinator, everyone), durable = predicted_counts(job, op)
    checks: list[tuple[str, Any, Any, bool]] = []
    uniform = all(r["calls"] == replies[0]["calls"] for r in replies)
    measured_calls = replies[0]["calls"] if uniform else "differ by rank"
    checks.append(("collectives per rank", calls, measured_calls, measured_calls == calls))
    if coordinator is not None:  # a reopen: whichever rank of the node locks first reads
        got = replies[0]["objects"]
        checks.append(("objects, coordinator", coordinator, got, got == coordinator))
    total = sum(r["objects"] for r in replies)
    checks.append(("objects, every rank", everyone, total, total == everyone))
    measured: dict[str, int] = {}
    for reply in replies:
        for kind, count in reply.get("durable", {}).items():
            measured[kind] = measured.get(kind, 0) + count
    for kind, want, got, agrees in model.check_durable(durable, measured):
        checks.append((f"durable {kind}", want, got, agrees))
    if op.startswith("restore"):
        restored = all(r["restored"] for r in replies)
        checks.append(("every rank restored the newest, bitwise", True, restored, restored))
        if job.nodes > 1:  # where node 1's ranks read their chunks (one node: not reported)
            source = "fast"
            if op.endswith("lost"):
                source = "peer" if shape_of(job).copies else "durable"
            served = all(set(replies[r]["sources"]) == {source} for r in node_ranks(job))
            checks.append((f"node {LOST}'s chunks all from {source}", True, served, served))
    watched = replies[watched_rank(job)]["received"]
    node = sum(replies[r]["received"] for r in node_ranks(job))
    rank_kib: tuple[float | None, float] = (None, watched / 1024)
    node_kib: tuple[float | None, float] = (None, node / 1024)
    if sizes is not None:
        phases, at = sizes
        phases = model.uncalibrated(phases, shape_of(job), op)
        want = model.predict_received(phases, job.ranks, at, p2p_of(job, op))
        rank_kib = (want / 1024, watched / 1024)
        node_kib = (want * len(node_ranks(job)) / 1024, node / 1024)
        for name, (w, g) in (
            ("KiB received, a rank", rank_kib),
            ("KiB received, a node", node_kib),
        ):
            checks.append((name, round(w, 1), round(g, 1), abs(g - w) <= BYTE_TOLERANCE * w))
    seconds = max(r["seconds"] for r in replies)
    return Row(job.ranks, job.replicas, op, checks, rank_kib, node_kib, seconds)


def byte_model(job: Job, op: str, replies: list[dict[str, Any]]) -> tuple[Any, int]:
    """Each phase's message sizes, read off the watched rank of this (calibration) job."""
    received = replies[watched_rank(job)]["received_by_phase"]
    return model.calibrate(received, KINDS, job.ranks, p2p_of(job, op)), job.ranks


# -- the parent: report ----------------------------------------------------------------------


def cell(pair: tuple[Any, Any], fmt: str = "{}", note: str = "") -> str:
    """ "predicted / measured", or one figure where they agree (or nothing is predicted)."""
    want, got = pair
    if want is None:
        return f"{fmt.format(got)} ({note})" if note else fmt.format(got)
    shown = fmt.format(want)
    return shown if want == got else f"{shown} / {fmt.format(got)}"


def print_table(rows: list[Row]) -> None:
    print(
        "| R | N | F | operation | rounds | objects: coordinator | every rank | "
        "durable requests (exact) | (timing: floor) | KiB in, a rank | KiB in, a node | s |"
    )
    print("| " + " | ".join(["---"] * 12) + " |")  # fmt: skip
    for row in rows:
        exact = [(w, g) for n, w, g, _ in row.checks
                 if n.startswith("durable ") and n[8:] not in model.FLOORS]  # fmt: skip
        timing = [(w, g) for n, w, g, _ in row.checks
                  if n.startswith("durable ") and n[8:] in model.FLOORS]  # fmt: skip
        rounds = row.value("collectives per rank")
        summed = (sum(w for w, _ in exact), sum(g for _, g in exact))
        floor = (sum(w for w, _ in timing), sum(g for _, g in timing))
        nodes = max(1, row.ranks // 2)
        note = "calib." if row.bytes_note == "calib." else ""
        print(
            f"| {row.ranks} | {nodes} | {row.replicas} | {row.op} | "
            f"{cell((_rounds(rounds[0]), _rounds(rounds[1])))} | "
            f"{cell(row.value('objects, coordinator'))} | "
            f"{cell(row.value('objects, every rank'))} | {cell(summed)} | {cell(floor)} | "
            f"{cell(row.kib_rank, '{:.1f}', note)} | {cell(row.kib_node, '{:.1f}', note)} | "
            f"{row.seconds:.2f} |"
        )


def _rounds(calls: Any) -> Any:
    return sum(calls.values()) if isinstance(calls, dict) else calls


def print_failures(rows: list[Row]) -> int:
    failed = [(row, check) for row in rows for check in row.checks if not check[3]]
    for row, (what, want, got, _) in failed:
        print(f"MISMATCH R={row.ranks} F={row.replicas} {row.op}: {what}: "
              f"predicted {want}, measured {got}")  # fmt: skip
    return len(failed)


def print_promotion(rows: list[Row], raw: dict[str, Any], op: str) -> None:
    """The durable requests of one promotion, by kind, predicted against measured."""
    print(f"\ndurable requests of {op} (every rank's; floor: at least; -: not modelled)")
    picked = [row for row in rows if row.op == op]
    kinds = sorted({n[8:] for row in picked for n, *_ in row.checks if n.startswith("durable ")})
    kinds += list(model.UNCHECKED) + ["names listed"]
    print("| R | F | " + " | ".join(kinds) + " |")
    print("| " + " | ".join(["---"] * (len(kinds) + 2)) + " |")
    for row in picked:
        replies = raw[f"R={row.ranks} F={row.replicas}"][op]
        cells = []
        for kind in kinds:
            if kind in model.UNCHECKED or kind == "names listed":
                key = "listed" if kind == "names listed" else None
                got = sum(r[key] if key else r["durable"].get(kind, 0) for r in replies)
                cells.append(f"- / {got}")
            else:
                want, got = row.value(f"durable {kind}")
                floor = " (floor)" if kind in model.FLOORS else ""
                cells.append(cell((want, got)) + floor)
        print(f"| {row.ranks} | {row.replicas} | " + " | ".join(cells) + " |")


REFERENCE = (1000, 10000)  # the rank counts the model is carried to


def print_extrapolation(small: dict[int, tuple[float, float, int]]) -> None:
    """The model at 1,000 and 10,000 ranks (docs/SCALE.md, "A model of scale")."""
    print("\nextrapolated (8 ranks per node, 1 GiB per rank in 4 MiB chunks, every chunk new, "
          "100 promotions held; fixed-size messages as measured here; the CPU rows from "
          f"{model.METADATA_SCALE.name}, bench_metadata_scale.py's results):")  # fmt: skip
    cpu = model.cpu_rows(list(REFERENCE))
    for replicas, (save_small, restore_small, manifest) in sorted(small.items()):
        print(f"F={replicas}: per other rank, {save_small:.0f} bytes in a save besides the "
              f"manifest (here {manifest} bytes), {restore_small:.0f} in a restore")  # fmt: skip
        figures = {r: model.extrapolate(model.Reference(r, replicas=replicas), save_small,
                                        restore_small) for r in REFERENCE}  # fmt: skip
        print(f"| F={replicas} | 1,000 ranks | 10,000 ranks |\n| --- | --- | --- |")
        for what in figures[REFERENCE[0]]:
            shown = "{:,.1f}" if "MiB" in what else "{:,.0f}"
            print(
                f"| {what} | " + " | ".join(shown.format(figures[r][what]) for r in figures) + " |"
            )
        for what, cells in cpu.items():
            print(f"| {what} | " + " | ".join(cells) + " |")


def small_messages(job: Job, sizes: dict[str, Any], measured: dict[str, Any]) -> tuple:
    """Bytes each rank receives per other rank in a save (its manifest aside) and in a
    restore, from the calibration job: what does not grow with the state."""
    manifest = measured["save 3"][watched_rank(job)]["manifest_bytes"]
    save = sum(phase.per_rank for phase in sizes["save 3"][0].values()) - manifest
    restore = sum(phase.per_rank for phase in sizes["restore"][0].values())
    return save, restore, manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--generations", type=int, default=GENERATIONS)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    small: dict[int, tuple[float, float, int]] = {}
    for replicas in args.replicas:
        sizes: dict[str, Any] = {}  # op -> the byte model, from the first job on several nodes
        for ranks in sorted(args.ranks):
            work = tempfile.mkdtemp(prefix="castore-scale-", dir=args.workdir)
            job = Job(ranks, replicas, work, args.generations)
            clock = time.perf_counter()
            try:
                measured = run_job(job)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print(f"R={ranks} F={replicas}: {time.perf_counter() - clock:.1f} s", flush=True)
            raw[f"R={ranks} F={replicas}"] = measured
            for op, replies in measured.items():
                note = ""
                if job.nodes > 1 and op in BYTE_OPS and op not in sizes:
                    sizes[op] = byte_model(job, op, replies)
                    note = "calib."
                elif job.nodes > 1 and op in BYTE_OPS:
                    note = "model"
                rows.append(compare(job, op, replies, sizes.get(op) if note == "model" else None))
                rows[-1].bytes_note = note
            if job.nodes > 1 and replicas not in small and all(o in sizes for o in BYTE_OPS):
                small[replicas] = small_messages(job, sizes, measured)
    print()
    print_table(rows)
    print_promotion(rows, raw, f"save {2 * EVERY}")
    if small:
        print_extrapolation(small)
    mismatches = print_failures(rows)
    print(f"\n{len(rows)} operations, {mismatches} mismatches; "
          f"total {time.perf_counter() - started:.0f} s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1, default=str) + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
