"""The commands that decide what a store keeps and what it costs: ``tag``, ``untag``,
``branch``, ``amend``, ``gc``, ``du``, ``compact``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tabulate import tabulate

from castore import gc
from castore.chunkstore.blobpacks import BlobPackBackend
from castore.cli.failures import EXIT_PROBLEMS, refuse
from castore.cli.output import format_time, ratio, spans, text_table
from castore.cli.stores import open_existing, shards_here
from castore.core.history import Generation, split_address
from castore.errors import AmendError, GcAbortedError
from castore.importer import map_safetensors
from castore.lineage import amend, branch
from castore.support.progress import format_size as format_bytes

_RUNS_NAMED = 5  # runs an unasked gc's refusal names before it only counts them


def cmd_tag(args: argparse.Namespace) -> int:
    run, generation = split_address(args.target)
    with open_existing(args.store) as store:
        change = gc.set_tag(store, run, generation, args.name)
        others = sorted(
            name
            for name, value in store.refs.tags(run).items()
            if change.previous is not None and value.root == change.previous.root
        )
    gen, old = change.generation, change.previous
    if old is None or not change.moved:
        print(f"tagged {run}@{gen.id} ({gen.root[:12]}) as {args.name}")
        return 0
    still = (
        f"tag {others[0]} still pins it"
        if len(others) == 1
        else f"tags {', '.join(others)} still pin it"
        if others
        else "castore gc may now drop it"
    )
    print(
        f"moved tag {args.name} from {run}@{old.generation} ({old.root.hex[:12]}) to "
        f"{run}@{gen.id} ({gen.root[:12]}); {run}@{old.generation} is no longer pinned "
        f"by it ({still})"
    )
    return 0


def cmd_branch(args: argparse.Namespace) -> int:
    run, generation = split_address(args.target)
    with open_existing(args.store) as store:
        made = branch(store, run, generation, args.new_run)
    source = made.lineage["from"][0]
    print(
        f"started run {made.run} at {source['run']}@{source['generation']} "
        f"(step {made.step}, root {made.root[:12]}): no chunk written"
    )
    return 0


def cmd_amend(args: argparse.Namespace) -> int:
    run, generation = split_address(args.target)
    renames = [_pair(pair, "--rename", "OLD=NEW (NEW may be empty)") for pair in args.rename]
    replace = {}
    for pair in args.replace:
        path, file = _pair(pair, "--replace", "KEY_PATH=FILE (.npy or .safetensors[:NAME])")
        replace[path] = read_tensor_file(file, f"--replace {pair!r}")
    metadata: dict[str, Any] = dict(_pair(p, "--set", "KEY=VALUE") for p in args.set)
    for key, value in metadata.items():
        metadata[key] = _metadata_value(value)
    metadata.update((key, None) for key in args.unset)
    with open_existing(args.store) as store:
        made = amend(
            store,
            run,
            generation,
            drop=args.drop,
            rename=renames,
            graft=args.graft,
            replace=replace,
            metadata=metadata,
            to_run=args.to,
        )
    source = made.lineage["from"][0]
    changes = [f"without {', '.join(args.drop)}"] if args.drop else []
    changes += [f"with {len(renames)} rename(s)"] if renames else []
    changes += [f"with {len(args.graft)} graft(s)"] if args.graft else []
    changes += [f"with {', '.join(replace)} replaced"] if replace else []
    changes += [f"with {len(metadata)} metadata key(s) edited"] if metadata else []
    written = (
        f"{format_bytes(made.stats.new_bytes)} of new chunks written"
        if made.stats.new_bytes
        else "no chunk written"
    )
    print(
        f"published {made.run}@{made.id} from {source['run']}@{source['generation']} "
        f"{' and '.join(changes)}: {made.stats.tensors} tensor(s), "
        f"{format_bytes(made.stats.logical_bytes)}; {written}"
    )
    return 0


def _pair(text: str, option: str, form: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise AmendError(f"{option} {text!r}: give {form}")
    return key, value


def _metadata_value(text: str) -> Any:
    """A --set value: JSON where it parses as JSON (3, 0.1, true, [1, 2]), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_tensor_file(spec: str, what: str) -> np.ndarray:
    """The tensor a file holds: a ``.npy`` file (no pickled objects), or one tensor of a
    ``.safetensors`` file (``FILE:NAME``; NAME may be left out where it holds one)."""
    file, _, name = spec.partition(".safetensors:")
    path = Path(file + ".safetensors" if name else spec)
    if not path.is_file():
        raise AmendError(f"{what}: no file {str(path)!r}")
    if path.suffix == ".npy":
        with path.open("rb") as handle:
            if handle.read(6) != b"\x93NUMPY":
                raise AmendError(f"{what}: {path.name} is not a .npy file (no NumPy header)")
        try:
            return np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise AmendError(f"{what}: {path} is not a .npy file of numbers ({exc})") from None
    if path.suffix != ".safetensors":
        raise AmendError(f"{what}: give a .npy or .safetensors file, not {path.name!r}")
    tensors = map_safetensors(path)
    if not name and len(tensors) != 1:
        raise AmendError(
            f"{what}: {path.name} holds {len(tensors)} tensors: name one as "
            f"{path.name}:NAME"
        )
    if name and name not in tensors:
        raise AmendError(f"{what}: {path.name} has no tensor {name!r}")
    return tensors[name] if name else next(iter(tensors.values()))


def cmd_untag(args: argparse.Namespace) -> int:
    with open_existing(args.store) as store:
        gc.untag(store, args.run, args.name)
    print(f"removed tag {args.name} of run {args.run}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    chosen = args.keep is not None or args.every_steps is not None or args.every is not None
    asking = sys.stdin.isatty()
    policy = gc.RetentionPolicy(
        keep_last=args.keep or gc.RetentionPolicy.keep_last,
        every_steps=args.every_steps,
        every_seconds=args.every,
    )
    runs = [args.run] if args.run else None
    with open_existing(args.store) as store:
        if not (chosen or args.yes or args.dry_run or asking):
            # A notebook's `!castore gc`, a task runner, cron: nobody to ask, so deleting
            # by the default policy must be asked for.
            return refuse(_unasked(gc.plan_retention(store, policy, runs)))
        if args.dry_run or args.yes or not asking:
            report = gc.collect_garbage(
                store,
                policy,
                runs=runs,
                dry_run=args.dry_run,
                lock_timeout=args.wait,
                progress=True,
            )
            _print_plans(report.plans, "drop" if args.dry_run else "dropped")
            _print_gc_summary(report)
            return 0
        # A person at a terminal: show the plan, ask, then collect only that plan.
        plans = gc.plan_retention(store, policy, runs)
        _print_plans(plans, "drop")
        dropping = sum(len(plan.dropped) for plan in plans)
        if dropping and not _confirm(f"Delete {dropping} generation(s)? [y/N] "):
            print("nothing deleted")
            return EXIT_PROBLEMS
        confirmed = {plan.run: frozenset(plan.dropped) for plan in plans}
        report = gc.collect_garbage(
            store,
            _ConfirmedPolicy(policy.keep_last, policy.every_steps, policy.every_seconds, confirmed),
            runs=runs,
            lock_timeout=args.wait,
            progress=True,
        )
    _print_gc_summary(report)
    return 0


def _unasked(plans: list[gc.RunPlan]) -> str:
    """Why gc refuses to run unasked, and what the default policy would drop if asked."""
    dropping = [(plan.run, plan.dropped) for plan in plans if plan.dropped]
    count = sum(len(ids) for _, ids in dropping)
    named = " and ".join(f"{run}@{spans(ids)}" for run, ids in dropping[:_RUNS_NAMED])
    if len(dropping) > _RUNS_NAMED:
        named += f" and {len(dropping) - _RUNS_NAMED} more run(s)"
    would = f"{count} generation(s) ({named})" if count else "no generation"
    return (
        "castore gc would delete without asking (stdin is not a terminal): the default "
        f"policy (--keep {gc.RetentionPolicy.keep_last}) would drop {would}; pass the policy "
        "(--keep K, --every-steps N, --every DURATION), or --yes for the default; "
        "--dry-run shows the plan"
    )


@dataclass(frozen=True)
class _ConfirmedPolicy(gc.RetentionPolicy):
    """The policy, refusing to drop a generation the person did not agree to drop.

    Collection re-plans under its lock; a save or untag between the question
    and the lock can change the plan, and a yes covers only what was shown.
    """

    confirmed: Mapping[str, frozenset[int]] = field(default_factory=dict)

    def decide(self, generations: list[Generation], tags: dict[str, int]) -> dict[int, list[str]]:
        reasons = super().decide(generations, tags)
        for gen in generations:
            if not reasons[gen.id] and gen.id not in self.confirmed.get(gen.run, frozenset()):
                raise GcAbortedError(
                    f"gc aborted, nothing deleted: the plan changed after you answered "
                    f"(a save or untag since?); it would now also drop {gen.run}@{gen.id}; "
                    "run castore gc again"
                )
        return reasons


def _confirm(question: str) -> bool:
    try:
        answer = input(question)
    except EOFError:
        print()
        return False
    except KeyboardInterrupt:
        print(flush=True)  # so that "castore: error: interrupted" starts its own line
        raise
    return answer.strip().lower() in ("y", "yes")


def _print_plans(plans: list[gc.RunPlan], dropped_verdict: str) -> None:
    rows = []
    for plan in plans:
        for gen in plan.generations:
            reasons = plan.reasons[gen.id]
            verdict = "keep" if reasons else dropped_verdict
            rows.append(
                [plan.run, gen.id, gen.step, format_time(gen.time), verdict, "; ".join(reasons)]
            )
    if rows:
        print(text_table(rows, ["run", "id", "step", "time", "", "kept by"], text=("run",)))
        print()


def _print_gc_summary(report: gc.GcReport) -> None:
    dropped = sum(len(ids) for ids in report.dropped.values())
    said = (
        f"dry run: would drop {dropped} generation(s); would free"
        if report.dry_run
        else f"{dropped} generation(s) dropped; freed"
    )
    print(
        f"{said} {format_bytes(report.bytes_freed)} ({report.chunks_freed} chunk(s), "
        f"{report.objects_freed} object(s)) in {report.seconds:.2f}s"
        + (
            f"; gave back {format_bytes(report.file_bytes_freed)} of pack files"
            if report.file_bytes_freed
            else ""
        )
    )


def cmd_du(args: argparse.Namespace) -> int:
    with open_existing(args.store) as store:
        usage = gc.disk_usage(store, [args.run] if args.run else None)
        here = {
            (gen.run, gen.id): shards_here(store, gen)
            for gen in (
                g for run in {u.run for u in usage.generations} for g in store.generations(run)
            )
        }
    rows = [
        [
            u.run,
            u.id,
            u.step,
            format_bytes(u.logical_bytes),
            format_bytes(u.referenced_bytes),
            format_bytes(u.exclusive_bytes),
            here.get((u.run, u.id), "all"),
        ]
        for u in usage.generations
    ]
    headers = ["run", "id", "step", "logical", "references", "only it (freed if dropped)"]
    if any(row[-1] != "all" for row in rows):  # a node's fast tier: the rest is elsewhere
        headers.append("held here")
    else:
        rows = [row[:-1] for row in rows]
    if rows:
        print(tabulate(rows, headers=headers))
        print()
        sizes = [("run", run, *bytes_) for run, bytes_ in usage.by_run.items()]
        sizes += [("dtype", dtype, *bytes_) for dtype, bytes_ in usage.by_dtype.items()]
        table = [
            [kind, name, format_bytes(raw), format_bytes(stored), ratio(stored / (raw or 1))]
            for kind, name, raw, stored in sizes
        ]
        print(tabulate(table, headers=["of", "", "raw chunks", "stored", "stored/raw"]))
        print()
    print(f"logical   {format_bytes(usage.logical_bytes)} in {len(rows)} generation(s)")
    print(
        f"stored    {format_bytes(usage.referenced_bytes)} of chunks they reference "
        f"(dedup {usage.dedup_ratio:.2f}x of raw chunk bytes)"
    )
    print(
        f"physical  {format_bytes(usage.physical_bytes)} of chunks and objects, "
        f"{format_bytes(usage.garbage_bytes)} of it garbage (castore gc frees it)"
    )
    print(
        f"codec     {format_bytes(usage.referenced_bytes)} stored for "
        f"{format_bytes(usage.raw_bytes)} of raw chunk bytes ({ratio(usage.compression)}; "
        f"new saves use codec {store.codec!r})"
    )
    if isinstance(store.backend, BlobPackBackend):
        print(
            f"blobs     {format_bytes(usage.file_bytes)} stored: packs, index blobs and "
            "objects (gc rewrites sparse packs)"
        )
    else:
        print(
            f"files     {format_bytes(usage.file_bytes)} on disk: LMDB file and chunk packs "
            "(gc rewrites sparse packs; castore compact rewrites every pack and the LMDB file)"
        )
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    report = gc.compact(args.store, progress=True)
    print(
        f"compacted {args.store}: {format_bytes(report.bytes_before)} -> "
        f"{format_bytes(report.bytes_after)} in {report.seconds:.2f}s"
    )
    return 0
