"""The tiers drill of issue 25: nodes lost, chunks damaged, uploaders killed; RPO and RTO.

Run from the repository root::

    .venv/bin/python benchmarks/bench_tiers_drill.py [--ranks 4] [--nodes 2] [--state-mib 32]
        [--tensors 40] [--changed 4] [--steps 12] [--every 5] [--step-s 0.5] [--repeats 7]
        [--kills 6] [--kill-window 2] [--kill-rate 16] [--seed 25] [--workdir bench-tiers-drill]

``--ranks`` gloo processes on this machine form ``--nodes`` simulated nodes (consecutive
ranks, one fast-tier directory per node, in ``/dev/shm`` where there is one); the durable
tier is a shared-directory store on disk under ``--workdir``. The job's state is
``--state-mib`` MiB of fp32 in ``--tensors`` row-sharded tensors; every step after the first
gives ``--changed`` of them new values (``--changed / --tensors`` of the bytes) and
computes for ``--step-s`` seconds (a sleep: the machine has two cores). Four jobs run the
same ``--steps`` steps, each saving its own way:

  tiered F=2      castore.open_tiered(fast=NODE_DIR, durable=DIR, durable_every=--every,
                  replicas=2): castore.dist.save(blocking=False) every step (K=1) into
                  the fast tiers; every --every-th generation is uploaded by the node
                  leaders and published in the durable store by the coordinator, in
                  the background
  tiered F=1      the same with replicas=1: each node holds its own ranks' shards only
  durable only    castore.open(DIR): castore.dist.save(blocking=False) every --every
                  steps, straight to the durable store (today's castore)
  DCP async_save  torch.distributed.checkpoint.async_save of Shard(0) DTensors every
                  --every steps, one FileSystemWriter folder per save, in DIR

Each job is killed (SIGKILL, node 1's ranks first) at a random moment of the step after its
last, as a node failure takes a job down. Then one more job, the restore job, restores
each scenario ``--repeats`` times, in rotating order, each time from a fresh copy of the
killed job's directories, after dropping the page cache where this process may:

  all local             tiered F=2, every node's fast tier intact (the baseline)
  all local, plain      the same copies, each node's fast tier opened as a plain store
                        (castore.open): the same generation from the same place, the
                        speed the tiered restore must reach
  node loss             node 1's fast tier deleted; its ranks start on an empty one
                        (tiered F=2, tiered F=1); durable only and DCP lose nothing
                        on the node and restore from the durable directory
  damaged fast chunk    tiered F=2, a byte flipped in one chunk on node 0 that rank 0
                        needs (of a tensor changed at the last step)

Every restore is checked bitwise against the state of the step it restored. Last,
``--kills`` times in a row, a tiered F=2 job (promoting every generation, each node leader
uploading at ``--kill-rate`` MiB/s so that the uploads last) resumes from its stores,
trains, and is killed: first the coordinator (it uploads node 0's shards and publishes) or
node 1's leader (it uploads node 1's), at a random moment within ``--kill-window`` seconds
of the trial's first save, then the others 0.3 s later.
After each kill the durable store must verify (``verify_store(deep=True)``) and every
generation it lists must have all its chunks. A last job resumes, saves and closes, which
finishes the promotion it owes.

Columns (what bench_tiers_drill prints and docs/TIERS_DRILL.md explains):
RPO = the steps completed before the failure that the restored state lacks, and the
seconds from the moment the restored step's state existed to the failure; RTO = the
seconds from the restore's start (opening the store) until every rank holds its state
(the slowest rank, median over --repeats; below the table, each phase of it: the open,
the load's own timings, the rest of the load); bytes read by source, summed over ranks;
upload / new = the durable directory's growth for one durable generation over the bytes
of the chunks of that generation the durable store lacked before (DCP: the same new
bytes, those of castore's durable-only store at the same step).

Output: the table on stdout and in ``WORKDIR/drill-<R>ranks.md``, every raw number in
``WORKDIR/drill-<R>ranks.json``; the scratch directories are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PipedRanks, drop_caches  # noqa: E402
from _drill_ranks import Layout, worker  # noqa: E402
from _drill_stores import (  # noqa: E402
    check_durable,
    damage_one_chunk,
    fast_tiers,
    mark,
    new_chunk_bytes,
    uploads,
)

import castore  # noqa: E402

MIB = 1 << 20
JOBS = ("tiered-f2", "tiered-f1", "castore", "dcp")
WAY_NAMES = {
    "tiered-f2": "tiered F=2",
    "tiered-f1": "tiered F=1",
    "castore": "durable only",
    "dcp": "DCP async_save",
}


class Job(PipedRanks):
    """One launch of the job's ranks; killed as a node failure kills it, or finished."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout.world, worker, (layout,), "drill")
        self.layout = layout

    def kill(self, first: list[int] | tuple[int, ...] = (), pause: float = 0.0) -> None:
        """SIGKILL the ranks ``first``, wait ``pause`` seconds, then SIGKILL the rest."""
        for rank in first:
            self.procs[rank].kill()  # our own child, by its handle
        time.sleep(pause)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()

    def finish(self) -> list[dict[str, Any]]:
        """Stop every rank the orderly way: each closes its store first."""
        for conn in self.conns:
            conn.send(("stop",))
        replies = self.collect("stop")
        for proc in self.procs:
            proc.join(60)
        return replies


@dataclass
class Places:
    """Where the drill writes: the durable directories on disk, the fast tiers in memory."""

    disk: Path
    memory: Path

    def way(self, job: str, layout: Layout, every: int, replicas: int = 1) -> dict[str, Any]:
        kind = "tiered" if job.startswith(("tiered", "killed")) else job
        way: dict[str, Any] = {"way": kind, "every": every, "durable": str(self.disk / job)}
        if kind == "tiered":
            way["fast"] = [str(self.memory / job / f"fast{n}") for n in range(layout.nodes)]
            way["replicas"] = replicas
        if kind in ("castore", "dcp"):
            way["warmup"] = str(self.disk / f"{job}-warmup")
        for key in ("durable", "warmup"):
            if key not in way:
                continue
            if kind == "dcp":
                Path(way[key]).mkdir(parents=True)
            else:
                castore.open(way[key], shared=True).close()  # the ranks must not race
        return way


# -- the training jobs, killed -------------------------------------------------------


def train(way: dict[str, Any], layout: Layout, steps: int, fail_after: float) -> dict[str, Any]:
    """Run ``steps`` steps of a job saving its way; ``fail_after`` seconds into the next
    step's compute, kill it, node 1's ranks first."""
    record: dict[str, Any] = {"steps": [], "marks": {}, "publish_s": {}}
    job = Job(layout)
    try:
        job.command("open", way, False)
        for step in range(1, steps + 1):
            if step % way["every"] == 0:
                record["marks"][str(step)] = mark(way)
            replies = job.command("step", step)
            record["steps"].append(
                {
                    "step": step,
                    "state_at": min(r["state_at"] for r in replies),
                    "save_s": max(r["save_s"] for r in replies),
                    "saved": replies[0]["saved"],
                }
            )
            for key, seconds in replies[0]["publish_s"].items():  # rank 0's async saves
                record["publish_s"][str(key)] = seconds
        time.sleep(fail_after)
        record["failure_at"] = time.time()
        job.kill(first=[r for r in range(layout.world) if layout.node_of(r) == 1])
    except BaseException:
        job.kill()
        raise
    record["marks"]["failure"] = mark(way)
    if "fast" in way:
        record["fast_at_failure"] = fast_tiers(way)
    return record


# -- restores ------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    job: str
    lose: int | None = None  # the node whose fast tier is gone
    damage: bool = False
    plain: bool = False  # each node's fast tier opened as a plain store (castore.open)

    @property
    def way_name(self) -> str:
        return PLAIN_WAY if self.plain else WAY_NAMES[self.job]

    @property
    def key(self) -> str:
        return f"{self.name} | {self.way_name}"


PLAIN_WAY = "castore.open(node's fast dir)"
SCENARIOS = (
    Scenario("all local (nothing lost)", "tiered-f2"),
    Scenario("all local (nothing lost)", "tiered-f2", plain=True),
    Scenario("node loss", "tiered-f2", lose=1),
    Scenario("node loss", "tiered-f1", lose=1),
    Scenario("damaged fast chunk", "tiered-f2", damage=True),
    Scenario("node loss", "castore"),
    Scenario("node loss", "dcp"),
)


def stage(scenario: Scenario, way: dict[str, Any], places: Places, layout: Layout) -> dict:
    """A fresh copy of the killed job's directories for one restore; its way and damage."""
    staged = dict(way)
    shutil.rmtree(places.disk / "restore", ignore_errors=True)
    shutil.rmtree(places.memory / "restore", ignore_errors=True)
    staged["durable"] = str(places.disk / "restore" / "durable")
    shutil.copytree(way["durable"], staged["durable"])
    if "fast" in way:
        staged["fast"] = [str(places.memory / "restore" / f"fast{n}") for n in range(layout.nodes)]
        for node, (source, target) in enumerate(zip(way["fast"], staged["fast"], strict=True)):
            if node != scenario.lose:
                shutil.copytree(source, target)
    if scenario.damage:
        staged["damaged"] = damage_one_chunk(staged["fast"][0], layout)
    if scenario.plain:  # the same generation from the same place, without the tiers
        staged["way"] = "plain"
    return staged


def restore_all(
    ways: dict[str, dict[str, Any]], places: Places, layout: Layout, args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    """Every scenario ``--repeats`` times, in rotating order, by one restore job."""
    results: dict[str, list[dict[str, Any]]] = {s.key: [] for s in SCENARIOS}
    job = Job(layout)
    try:
        for rep in range(-1, args.repeats):  # rep -1 warms every path up and is not kept
            order = SCENARIOS[rep % len(SCENARIOS) :] + SCENARIOS[: rep % len(SCENARIOS)]
            for scenario in order:
                staged = stage(scenario, ways[scenario.job], places, layout)
                shutil.rmtree(os.environ["CASTORE_CACHE_DIR"], ignore_errors=True)
                drop_caches()
                time.sleep(args.quiet)
                replies = job.command("restore", staged)
                if rep < 0:
                    continue
                results[scenario.key].append(
                    {"per_rank": replies, "damaged": staged.get("damaged")}
                )
        job.finish()
    except BaseException:
        job.kill()
        raise
    return results


# -- the uploader killed ------------------------------------------------------------


def kill_trials(places: Places, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    """``--kills`` launches of a tiered F=2 job, each killed while it promotes."""
    if not args.kills:  # --kills 0: the restores alone
        nothing = {"listed": [], "ok": True, "complete": 0}
        last = {"resumed": 0, "closed": [], "fast": {"newest": [], "pins": []}, "durable": nothing}
        return {"trials": [], "last": last}
    rng = random.Random(args.seed + 1)
    way = places.way("killed", layout, every=1, replicas=2)
    way["rate"] = args.kill_rate * MIB  # per node leader: uploads last, the kills land in them
    trials = []
    for trial in range(args.kills):
        victim = rng.choice([0, layout.per_node])  # the coordinator, or node 1's leader
        delay = rng.uniform(0.0, args.kill_window)
        outcome = run_until_killed(way, layout, trial > 0, victim, delay)
        outcome.update(fast=fast_tiers(way), durable=check_durable(way["durable"]))
        trials.append(outcome)
    job = Job(layout)  # the job comes back once more, and ends the orderly way
    try:
        resumed = job.command("open", way, True)[0]["step"]
        job.command("step", resumed + 1)
        closed = job.finish()
    except BaseException:
        job.kill()
        raise
    last = {
        "resumed": resumed,
        "closed": closed,
        "fast": fast_tiers(way),
        "durable": check_durable(way["durable"]),
    }
    return {"trials": trials, "last": last}


def run_until_killed(
    way: dict[str, Any], layout: Layout, resume: bool, victim: int, delay: float
) -> dict[str, Any]:
    """Train until a thread kills ``victim``, ``delay`` s after the first save, then the rest."""
    job = Job(layout)
    outcome: dict[str, Any] = {"victim": victim, "delay": delay, "steps": []}
    killer: threading.Thread | None = None

    def kill() -> None:
        time.sleep(delay)
        outcome["killed_at"] = time.time()
        job.kill(first=[victim], pause=0.3)

    started = time.monotonic()
    try:
        step = job.command("open", way, resume)[0]["step"]
        outcome["resumed"] = step
        while killer is None or killer.is_alive():
            step += 1
            try:
                job.command("step", step)
            except (RuntimeError, OSError, EOFError):
                break  # the victim died mid-step
            outcome["steps"].append(step)
            if killer is None:
                killer = threading.Thread(target=kill)
                killer.start()
    finally:
        if killer is not None:
            killer.join()
        else:
            job.kill()
    outcome["seconds"] = time.monotonic() - started
    return outcome


# -- the table -----------------------------------------------------------------------


def summarize(
    records: dict[str, dict[str, Any]],
    restores: dict[str, list[dict[str, Any]]],
    upload_rows: dict[str, list[dict[str, Any]]],
    steps: int,
) -> list[dict[str, Any]]:
    """One row per scenario: what was restored, RPO, RTO, the bytes by source."""
    rows = []
    for scenario in SCENARIOS:
        reps = restores[scenario.key]
        record = records[scenario.job]
        first = reps[0]["per_rank"]
        restored = first[0]["step"]
        state_at = {s["step"]: s["state_at"] for s in record["steps"]}
        sources: dict[str, int] = {}
        for reply in first:
            for source, n in reply["sources"].items():
                sources[source] = sources.get(source, 0) + n
        wrong = sorted({w for rep in reps for r in rep["per_rank"] for w in r["wrong"]})
        ratios = [u["ratio"] for u in upload_rows[scenario.job] if u["ratio"] is not None]
        saves = [s["save_s"] for s in record["steps"] if s["saved"] and s["step"] > 1]
        phases: dict[str, float] = {}
        for name in sorted({k for rep in reps for r in rep["per_rank"] for k in r["phases"]}):
            phases[name] = statistics.median(
                max(r["phases"].get(name, 0.0) for r in rep["per_rank"]) for rep in reps
            )
        rows.append(
            {
                "scenario": scenario.name,
                "way": scenario.way_name,
                "phases": phases,
                "restored_step": restored,
                "steps_same": all(r["step"] == restored for rep in reps for r in rep["per_rank"]),
                "rpo_steps": steps - restored,
                "rpo_s": record["failure_at"] - state_at[restored],
                "rto_s": statistics.median(
                    max(r["seconds"] for r in rep["per_rank"]) for rep in reps
                ),
                "rto_all_s": [max(r["seconds"] for r in rep["per_rank"]) for rep in reps],
                "sources": sources,
                "skipped": sorted(
                    {g for rep in reps for r in rep["per_rank"] for g in r.get("skipped", [])}
                ),
                "wrong": wrong,
                "upload_ratio": max(ratios) if ratios else None,
                "save_s": statistics.median(saves) if saves else None,
                "damaged": reps[0]["damaged"],
                "durable_newest": record["marks"]["failure"]["newest"],
                "restored_generation": first[0].get("generation"),
                "fast_newest": max(
                    (
                        n
                        for n in record.get("fast_at_failure", {}).get("newest", [])
                        if n is not None
                    ),
                    default=None,
                ),
                "publish_s": statistics.median(record["publish_s"].values())
                if record["publish_s"]
                else None,
            }
        )
    return rows


def mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def markdown(rows: list[dict[str, Any]], kills: dict[str, Any]) -> str:
    base = next(r["rto_s"] for r in rows if r["scenario"].startswith("all local"))
    lines = [
        "| scenario | way | restored step | RPO steps | RPO s | RTO s | RTO / all local "
        "| read fast / peer / durable MiB | upload / new chunk bytes | save: stall / published s "
        "| check |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        s = r["sources"]
        check = "bitwise" if not r["wrong"] and r["steps_same"] else f"WRONG {r['wrong']}"
        if r["skipped"]:
            check += f", skipped {r['skipped']}"
        upload = "–" if r["upload_ratio"] is None else f"{r['upload_ratio']:.3f}"
        stall = "–" if r["save_s"] is None else f"{r['save_s']:.3f}"
        stall += "" if r["publish_s"] is None else f" / {r['publish_s']:.2f}"
        lines.append(
            f"| {r['scenario']} | {r['way']} | {r['restored_step']} | {r['rpo_steps']} "
            f"| {r['rpo_s']:.2f} | {r['rto_s']:.3f} | {r['rto_s'] / base:.2f}x "
            f"| {mib(s.get('fast', 0))} / {mib(s.get('peer', 0))} / {mib(s.get('durable', 0))} "
            f"| {upload} | {stall} | {check} |"
        )
    k = kill_summary(kills)
    lines.append(
        f"| uploader killed ({k['kills']} times) | tiered F=2 | – | – | – | – | – | – | – | – "
        f"| durable store sound after {k['sound']}/{k['kills']} kills "
        f"({k['mid_promotion']} mid-promotion); never promoted: {k['never_promoted'] or 'none'} |"
    )
    return "\n".join(lines)


def mid_promotion(trial: dict[str, Any], pinned_before: list[list[int]]) -> bool:
    """Was a promotion unfinished when the job died: the fast tiers' newest generation not
    in the durable store (every one is selected), or a pin the trial left?"""
    durable_newest = max(trial["durable"]["listed"], default=0)
    pinned_before = pinned_before or [[] for _ in trial["fast"]["pins"]]
    fast_newest = max((n for n in trial["fast"]["newest"] if n is not None), default=0)
    new_pins = any(
        set(now) - set(before)
        for now, before in zip(trial["fast"]["pins"], pinned_before, strict=True)
    )
    return durable_newest < fast_newest or new_pins


def kill_summary(kills: dict[str, Any]) -> dict[str, Any]:
    trials = kills["trials"]
    sound = [
        t["durable"]["ok"] and t["durable"]["complete"] == len(t["durable"]["listed"])
        for t in trials
    ]
    last = kills["last"]
    listed = set(last["durable"]["listed"])
    return {
        # every generation is selected (durable_every=1): one missing below the newest
        # durable one was cut off and never retried
        "never_promoted": sorted(set(range(1, max(listed, default=0))) - listed),
        "kills": len(trials),
        "sound": sum(sound),
        "mid_promotion": sum(
            mid_promotion(t, trials[i - 1]["fast"]["pins"] if i else [])
            for i, t in enumerate(trials)
        ),
        "last_sound": last["durable"]["ok"]
        and last["durable"]["complete"] == len(last["durable"]["listed"]),
        "last_caught_up": max(last["durable"]["listed"], default=0)
        == max((n for n in last["fast"]["newest"] if n is not None), default=0),
        "pins_left": last["fast"]["pins"],
    }


def goals(rows: list[dict[str, Any]], kills: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    by = {(r["scenario"], r["way"]): r for r in rows}
    local = by[("all local (nothing lost)", "tiered F=2")]
    plain = by[("all local (nothing lost)", PLAIN_WAY)]
    f2, f1 = by[("node loss", "tiered F=2")], by[("node loss", "tiered F=1")]
    damaged = by[("damaged fast chunk", "tiered F=2")]
    ratio = f2["rto_s"] / local["rto_s"]
    durable_read = f2["sources"].get("durable", 0)
    ratios = [r["upload_ratio"] for r in (f2, f1) if r["upload_ratio"] is not None]
    k = kill_summary(kills)
    return [
        {
            "goal": "all local, tiered: at least 1.0x the speed of a plain store's restore "
            "of the same generation from the same place",
            "measured": f"{plain['rto_s'] / local['rto_s']:.2f}x ({local['rto_s']:.3f} s "
            f"tiered, {plain['rto_s']:.3f} s plain)",
            "met": local["rto_s"] <= plain["rto_s"],
        },
        {
            "goal": "node loss, F=2: RTO <= 1.3x all local's, 0 bytes from the durable tier",
            "measured": f"{ratio:.2f}x, {durable_read} bytes from the durable tier",
            "met": ratio <= 1.3 and durable_read == 0,
        },
        {
            "goal": "node loss, F=2: the newest fast-tier generation (RPO = the fast cadence)",
            "measured": f"generation {f2['restored_generation']}; the fast tiers' newest at "
            f"the failure: {f2['fast_newest']} (step {steps}'s save was called)",
            "met": f2["restored_generation"] == f2["fast_newest"] and not f2["wrong"],
        },
        {
            "goal": "node loss, F=1: the newest durable generation",
            "measured": f"step {f1['restored_step']}; the durable tier's newest at the "
            f"failure: {f1['durable_newest']}",
            "met": f1["restored_step"] == f1["durable_newest"] and not f1["wrong"],
        },
        {
            "goal": "damaged fast chunk: the same generation, the chunk from a peer or durable",
            "measured": f"generation {damaged['restored_generation']} (all local: "
            f"{local['restored_generation']}), skipped {damaged['skipped']}, "
            f"peer {damaged['sources'].get('peer', 0)} B, "
            f"durable {damaged['sources'].get('durable', 0)} B",
            "met": damaged["restored_generation"] == local["restored_generation"]
            and not damaged["skipped"]
            and not damaged["wrong"],
        },
        {
            "goal": "durable upload bytes per generation <= 1.02x its new chunk bytes",
            "measured": ", ".join(f"{u:.3f}x" for u in ratios) or "no promotion measured",
            "met": bool(ratios) and max(ratios) <= 1.02,
        },
        {
            "goal": "uploader killed: the durable store holds complete generations only",
            "measured": f"{k['sound']}/{k['kills']} kills ({k['mid_promotion']} mid-promotion); "
            f"after the last, orderly close: sound {k['last_sound']}, "
            f"caught up {k['last_caught_up']}",
            "met": k["sound"] == k["kills"] and k["last_sound"] and k["last_caught_up"],
        },
    ]


def report(
    header: str,
    table: str,
    upload_rows: dict[str, list[dict[str, Any]]],
    verdicts: list[dict[str, Any]],
    scenario_rows: list[dict[str, Any]],
) -> str:
    """What the drill prints and writes: the table, each durable save's bytes, the goals."""
    lines = [header, "", table, ""]
    for job, rows in upload_rows.items():
        shown = ", ".join(
            f"step {u['step']}: {mib(u['grown'])} MiB grown / {mib(u['new'] or 0)} MiB new"
            + ("" if u["landed"] else " (not landed)")
            for u in rows
        )
        lines.append(f"uploads, {WAY_NAMES[job]}: {shown}")
    lines += ["", "restore phases, s (the slowest rank's, median of the repetitions):"]
    for row in scenario_rows:
        shown = ", ".join(f"{name} {seconds:.3f}" for name, seconds in row["phases"].items())
        lines.append(f"  {row['scenario']} | {row['way']}: {shown}")
    lines += ["", "goals:"]
    for verdict in verdicts:
        mark = "MET" if verdict["met"] else "NOT MET"
        lines.append(f"  [{mark:7}] {verdict['goal']}: {verdict['measured']}")
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------


def make_layout(args: argparse.Namespace) -> Layout:
    if args.ranks % args.nodes:
        raise SystemExit(f"--ranks {args.ranks} is not a multiple of --nodes {args.nodes}")
    rows = args.state_mib * MIB // args.tensors // (1024 * 4)
    rows -= rows % args.ranks
    return Layout(
        world=args.ranks,
        nodes=args.nodes,
        tensors=args.tensors,
        rows=rows,
        changed=args.changed,
        step_s=args.step_s,
        seed=args.seed,
    )


def memory_dir() -> Path:
    shm = Path("/dev/shm")
    where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="castore-drill-", dir=where))


STARTED = time.monotonic()


def clock() -> str:
    return f"[{time.monotonic() - STARTED:5.0f} s]"


def drill(args: argparse.Namespace, layout: Layout, places: Places) -> dict[str, Any]:
    # The failure strikes every job at the same random moment of the step after its last.
    fail_after = random.Random(args.seed).uniform(0.1, 0.9) * layout.step_s
    ways, records = {}, {}
    for job in JOBS:
        ways[job] = places.way(job, layout, args.every, replicas=2 if job == "tiered-f2" else 1)
        records[job] = train(ways[job], layout, args.steps, fail_after)
        print(f"  {clock()} trained and killed: {WAY_NAMES[job]}", flush=True)
    castore_new = new_chunk_bytes(ways["castore"]["durable"])
    upload_rows = {job: uploads(ways[job], records[job], castore_new) for job in JOBS}
    restores = restore_all(ways, places, layout, args)
    print(f"  {clock()} restored every scenario", flush=True)
    kills = kill_trials(places, layout, args)
    print(f"  {clock()} killed the uploaders", flush=True)
    return {"records": records, "uploads": upload_rows, "restores": restores, "kills": kills}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--state-mib", type=int, default=32)
    parser.add_argument("--tensors", type=int, default=40)
    parser.add_argument("--changed", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--kill-window", type=float, default=2.0)
    parser.add_argument("--kill-rate", type=float, default=16.0)
    parser.add_argument("--quiet", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--workdir", type=Path, default=Path("bench-tiers-drill"))
    args = parser.parse_args(argv)
    layout = make_layout(args)
    args.workdir.mkdir(parents=True, exist_ok=True)
    places = Places(args.workdir / "scratch", memory_dir())
    shutil.rmtree(places.disk, ignore_errors=True)
    places.disk.mkdir()
    os.environ["CASTORE_CACHE_DIR"] = str(places.disk / "cache")  # the ranks inherit it
    started = time.monotonic()
    try:
        raw = drill(args, layout, places)
    finally:
        shutil.rmtree(places.disk, ignore_errors=True)
        shutil.rmtree(places.memory, ignore_errors=True)
    rows = summarize(raw["records"], raw["restores"], raw["uploads"], args.steps)
    verdicts = goals(rows, raw["kills"], args.steps)
    header = (
        f"{layout.world} ranks on {layout.nodes} nodes; {layout.state_bytes / MIB:.1f} MiB of "
        f"fp32 in {layout.tensors} row-sharded tensors, {layout.changed} of them new per step; "
        f"{args.steps} steps of {layout.step_s} s, killed during step "
        f"{args.steps + 1}; fast tier every step, durable every {args.every}; RTO median of "
        f"{args.repeats}; page cache dropped before each restore: {drop_caches()}; "
        f"{time.monotonic() - started:.0f} s"
    )
    text = report(header, markdown(rows, raw["kills"]), raw["uploads"], verdicts, rows)
    print("\n" + text)
    name = f"drill-{layout.world}ranks"
    (args.workdir / f"{name}.md").write_text(text + "\n")
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "layout": vars(layout),
               "rows": rows, "goals": verdicts, "raw": raw}  # fmt: skip
    (args.workdir / f"{name}.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(f"\nwrote {args.workdir / (name + '.md')} and {args.workdir / (name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
