"""The ``castore`` command: inspect, check, tag, collect, compact, copy, import stores.

Every failure prints one line to stderr and exits non-zero; set
``CASTORE_DEBUG=1`` to get the traceback as well.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

import castore
from castore import diffing, export, gc
from castore.chunkstore.blobpacks import BlobPackBackend
from castore.cli.args import COLLAPSE_AT, build_parser
from castore.copying import CopyRecord, copies_logged
from castore.core.history import Generation, SaveStats, split_address
from castore.core.holdings import held_shards
from castore.errors import (
    CastoreError,
    GcAbortedError,
    ReadOnlyStoreError,
    ReadOnlyWarning,
    StoreNotFoundError,
)
from castore.format.hashing import Digest
from castore.format.tree import decode_tree
from castore.importer import check_source, import_checkpoint
from castore.repair import rebuild_index, repair_store
from castore.store import Store
from castore.support.progress import format_size as format_bytes
from castore.tiers import TierRow, recovery_points, tier_report
from castore.tiers.selection import RestoreChoice, restore_choice

EXIT_PROBLEMS = 1
# A closed stdout (`castore log ... | head -1`): what a shell reports for a tool SIGPIPE
# (13) killed. Not 0: `verify | head -1` may have cut off its PROBLEM lines; not 1, verify's.
EXIT_BROKEN_PIPE = 128 + 13
DIFF_VALUE_ROWS = 50
# What a plain verify did, and what it left to --deep.
STRUCTURAL = (
    "structural (manifests checked, chunks looked up, pack sizes checked against the index; "
    "the chunks' bytes were not read: --deep re-hashes them)"
)  # value changes a diff lists before it only counts the rest


def _format_time(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def _open(path: str) -> Store:
    return castore.open(path, create=False)


def text_table(rows: list[list[Any]], headers: list[str], *, text: tuple[str, ...]) -> str:
    """A table whose ``text`` columns print as given: tabulate would read a root prefix
    such as ``1057676782e8``, or a run named ``123``, as a number and reformat it."""
    keep = [index for index, name in enumerate(headers) if name in text]
    return str(tabulate(rows, headers=headers, disable_numparse=keep or False))


def cmd_log(args: argparse.Namespace) -> int:
    with _open(args.store) as store:
        runs = [args.run] if args.run else store.runs()
        rows = []
        for run in runs:
            tags: dict[str, list[str]] = {}
            for name, value in store.refs.tags(run).items():
                tags.setdefault(value.root.hex, []).append(name)
            listed = store.generations(run, last=args.max_count)
            copies = copies_logged(store, run, {g.root for g in listed})  # what copies wrote
            for gen in listed:
                row = _log_row(gen, len(runs) > 1, copies.get(gen.root))
                row += [",".join(tags.get(gen.root, []))]
                rows.append(row + [_shards_here(store, gen)])
        if not rows:
            print("no generations")
            return 0
        headers = [
            "id", "step", "time", "logical", "new", "stored", "written", "dedup", "held", "root"
        ]
        headers = (["run"] if len(runs) > 1 else []) + headers + ["tags", "here"]
        if all(row[-1] == "all" for row in rows):  # no tier holds a part elsewhere
            rows, headers = [row[:-1] for row in rows], headers[:-1]
        print(text_table(rows, headers, text=("run", "root", "tags", "here")))
    return 0


def _shards_here(store: Store, gen: Generation) -> str:
    """Which of a generation's shards this store holds: "all", "K/N shards" (a node's fast
    tier: the rest are on other nodes) or "none" (its chunks are in another tier)."""
    if not isinstance(store.path, Path):
        return "all"
    held = held_shards(store.path, gen.run, gen.id, Digest.from_hex(gen.root))
    if held is None or len(held) >= gen.world_size:
        return "all"
    return f"{len(held)}/{gen.world_size} shards" if held else "none"


def _log_row(gen: Generation, with_run: bool, copied: CopyRecord | None = None) -> list[Any]:
    stats = gen.stats if copied is None else _copy_stats(gen.stats, copied)
    row = [
        gen.id,
        gen.step,
        _format_time(gen.time),
        format_bytes(stats.logical_bytes),
        format_bytes(stats.new_bytes),
        _stored(stats),
        format_bytes(stats.written_bytes),
        f"{100 * stats.dedup_ratio:.1f}%",
        _format_seconds(stats.held_seconds) if copied is None else "-",  # no caller held
        gen.root[:12],
    ]
    return [gen.run, *row] if with_run else row


def _copy_stats(saved: SaveStats, copied: CopyRecord) -> SaveStats:
    """A copied or promoted generation's figures in this store: what the copy wrote."""
    return SaveStats(
        logical_bytes=saved.logical_bytes,
        new_bytes=copied.bytes,
        new_chunks=copied.chunks,
        reused_chunks=0,
        seconds=0.0,
        tensors=saved.tensors,
        written_bytes=copied.stored + copied.objects,
        stored_bytes=copied.stored,
    )


def _stored(stats: SaveStats) -> str:
    """The new chunks' bytes as stored, with their ratio to raw where a codec shrank them."""
    if stats.stored_bytes == stats.new_bytes or not stats.new_bytes:
        return format_bytes(stats.stored_bytes)
    return f"{format_bytes(stats.stored_bytes)} ({_ratio(stats.compression)})"


def _format_seconds(seconds: float) -> str:
    """How long a save held its caller: milliseconds below 10 s."""
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def cmd_show(args: argparse.Namespace) -> int:
    run, generation = split_address(args.target)
    with _open(args.store) as store:
        digest, root = store.resolve_root(run, generation)
        gen = Generation.from_root(digest, root)
        print(f"generation {run}@{gen.id}  step {gen.step}  {_format_time(gen.time)}")
        print(f"root       {gen.root}")
        print(f"parent     {gen.parent or '-'}")
        print(f"ranks      {gen.world_size}")
        if gen.writer:
            writer = gen.writer
            job = f"  job {writer['job']}" if writer.get("job") else ""
            print(
                f"writer     host {writer.get('host')}  pid {writer.get('pid')}{job}  "
                f"epoch {writer.get('epoch')}"
            )
        print("versions   " + ", ".join(f"{k} {v}" for k, v in sorted(gen.frameworks.items())))
        if gen.metadata:
            print(f"metadata   {gen.metadata}")
        if gen.data_order:
            order = ", ".join(f"{k} {v}" for k, v in sorted(gen.data_order.items()))
            print(f"data order {order}")
        rows = []
        total_bytes = total_chunks = 0
        for name, boxes in store.tensor_entries(root).items():
            first = boxes[0]
            nbytes = sum(b.nbytes for b in boxes)
            chunks = sum(len(b.chunks) for b in boxes)
            total_bytes += nbytes
            total_chunks += chunks
            shape = "x".join(map(str, first.shape)) or "()"
            rows.append([name, first.dtype, shape, format_bytes(nbytes), len(boxes), chunks])
        print()
        print(tabulate(rows, headers=["tensor", "dtype", "shape", "size", "boxes", "chunks"]))
        tree = decode_tree(
            root.state, lambda name, fw: _TensorMark(), lambda path: _RankLocalMark()
        )
        values = _plain_values(tree, collapse=not args.all)
        if values:
            print()
            print(tabulate([v.row for v in values], headers=["key", "type", "value"]))
    collapsed = sum(v.count for v in values if v.count > 1)
    print()
    print(
        f"total      {len(rows)} tensor(s), {format_bytes(total_bytes)} in {total_chunks} "
        f"chunk(s); {sum(v.count for v in values)} value(s)"
        + (f" ({collapsed} collapsed: --all lists them)" if collapsed else "")
        + f"; {run}@{gen.id} step {gen.step}, {_format_time(gen.time)}"
    )
    return 0


class _TensorMark:
    """Stands in for a tensor when listing a state's non-tensor values."""


class _RankLocalMark:
    """Stands in for a RankLocal value (one per rank, in the shard manifests)."""

    def __repr__(self) -> str:
        return "<saved per rank>"


@dataclass(frozen=True)
class _Value:
    """One row of show's value table: a value, or a collapsed run of list items."""

    key: str
    kind: str
    text: str
    count: int = 1

    @property
    def row(self) -> list[str]:
        return [self.key, self.kind, self.text]


def _is_plain(node: Any) -> bool:
    return not isinstance(node, (_TensorMark, _RankLocalMark, dict, list, tuple))


def _shorten(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _plain_values(node: Any, path: str = "", *, collapse: bool = True) -> list[_Value]:
    if isinstance(node, _TensorMark):
        return []
    if isinstance(node, dict):
        return [
            value
            for k, v in node.items()
            for value in _plain_values(v, f"{path}/{k}" if path else str(k), collapse=collapse)
        ]
    if isinstance(node, (list, tuple)):
        found: list[_Value] = []
        index = 0
        while index < len(node):
            end = index
            while collapse and end < len(node) and _is_plain(node[end]):
                end += 1
            if end - index >= COLLAPSE_AT:
                found.append(_collapsed(node[index:end], path, index))
                index = end
                continue
            item_path = f"{path}/{index}" if path else str(index)
            found.extend(_plain_values(node[index], item_path, collapse=collapse))
            index += 1
        return found
    return [_Value(path or ".", type(node).__name__, _shorten(repr(node)))]


def _collapsed(items: Sequence[Any], path: str, start: int) -> _Value:
    """Sibling list items ``start..`` as one row: their count, type, and first and last."""
    key = f"[{start}..{start + len(items) - 1}]"
    types = sorted({type(item).__name__ for item in items})
    kind = f"{len(items)} {types[0]}" if len(types) == 1 else f"{len(items)} values"
    text = ", ".join([repr(items[0]), repr(items[1]), "...", repr(items[-1])])
    return _Value(f"{path}/{key}" if path else key, kind, _shorten(text), len(items))


def cmd_verify(args: argparse.Namespace) -> int:
    from castore.verify import verify_store

    run, generation = (None, None)
    if args.target:
        run, generation = split_address(args.target)
        generation = None if generation == "latest" and "@" not in args.target else generation
    with _open(args.store) as store:
        sample = None if args.sample is None else args.sample / 100
        report = verify_store(
            store, run=run, generation=generation, deep=args.deep, progress=True, sample=sample
        )
    mode = (
        f"sampled ({report.chunks_hashed} chunk(s) re-hashed, {args.sample:g}%)"
        if args.sample is not None
        else "deep (every chunk re-hashed)"
        if report.deep
        else STRUCTURAL
    )
    print(
        f"verified {report.runs} run(s), {report.generations} generation(s), "
        f"{report.objects} object(s), {report.chunks} chunk(s): {mode}"
    )
    if report.held_elsewhere:
        print(
            f"{len(report.held_elsewhere)} generation(s) listed here keep some or all of "
            "their chunks on other nodes or in another tier (castore.tiers): those chunks "
            "were not looked for here"
        )
    for problem in report.problems:
        print(f"PROBLEM {problem}")
    if report.problems:
        damaged = ", ".join(
            f"{r}@{g}" if g is not None else r for r, g in report.damaged_generations
        )
        print(f"FAILED: {len(report.problems)} problem(s); damaged: {damaged}")
        return EXIT_PROBLEMS
    print("OK")
    return 0


def cmd_tag(args: argparse.Namespace) -> int:
    run, generation = split_address(args.target)
    with _open(args.store) as store:
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


def cmd_untag(args: argparse.Namespace) -> int:
    with _open(args.store) as store:
        gc.untag(store, args.run, args.name)
    print(f"removed tag {args.name} of run {args.run}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    chosen = args.keep is not None or args.every_steps is not None or args.every is not None
    asking = sys.stdin.isatty()
    if not (chosen or args.yes or args.dry_run or asking):
        # A notebook's `!castore gc`, a task runner, cron: nobody to ask, so deleting
        # by the default policy must be asked for.
        raise ValueError(
            "castore gc would delete without asking (stdin is not a terminal): pass the "
            "policy (--keep K, --every-steps N, --every DURATION), or --yes for the "
            f"default (--keep {gc.RetentionPolicy.keep_last}); --dry-run shows the plan"
        )
    policy = gc.RetentionPolicy(
        keep_last=args.keep or gc.RetentionPolicy.keep_last,
        every_steps=args.every_steps,
        every_seconds=args.every,
    )
    runs = [args.run] if args.run else None
    with _open(args.store) as store:
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
                [plan.run, gen.id, gen.step, _format_time(gen.time), verdict, "; ".join(reasons)]
            )
    if rows:
        print(text_table(rows, ["run", "id", "step", "time", "", "kept by"], text=("run",)))
        print()


def _print_gc_summary(report: gc.GcReport) -> None:
    dropped = sum(len(ids) for ids in report.dropped.values())
    verb = "would free" if report.dry_run else "freed"
    print(
        f"{'dry run: ' if report.dry_run else ''}{dropped} generation(s) dropped; {verb} "
        f"{format_bytes(report.bytes_freed)} ({report.chunks_freed} chunk(s), "
        f"{report.objects_freed} object(s)) in {report.seconds:.2f}s"
        + (
            f"; gave back {format_bytes(report.file_bytes_freed)} of pack files"
            if report.file_bytes_freed
            else ""
        )
    )


def cmd_tiers(args: argparse.Namespace) -> int:
    paths = [args.store, *args.node]
    with contextlib.ExitStack() as stack:
        nodes = {}  # index in ``paths`` -> the fast tier there; a lost node has none
        for index, path in enumerate(paths):
            try:
                nodes[index] = stack.enter_context(_open(path))
            except StoreNotFoundError:
                pass  # a lost node: its directory is gone (said below)
        durable = stack.enter_context(_open(args.durable))
        live = list(nodes.values())
        rows = tier_report(live, durable, [args.run] if args.run else None)
        runs = sorted({row.run for row in rows})
        choices = {run: restore_choice(live, durable, run) for run in runs}
    _print_tier_rows(rows)
    for index in sorted(set(range(len(paths))) - set(nodes)):
        print(
            f"node {paths[index]}: lost (no store there): the fast column counts the other "
            "nodes' fast tiers only"
        )
    ages = recovery_points(rows)
    for run in runs:
        print(_restore_line(run, choices[run], [paths[index] for index in nodes]))
        said = ", ".join(f"{tier} {_format_age(s)}" for tier, s in ages.get(run, {}).items())
        print(f"{run}: newest generation per tier: {said or 'none held whole'}")
    return 0


def _print_tier_rows(rows: list[TierRow]) -> None:
    if not rows:
        print("no generations")
        return
    table = [
        [
            row.run,
            row.id,
            row.step,
            _format_time(row.time),
            row.fast or "-",
            "yes" if row.durable else ("pending" if row.pinned else "-"),
            row.root[:12],
        ]
        for row in rows
    ]
    print(text_table(table, ["run", "id", "step", "time", "fast", "durable", "root"],
                     text=("run", "root")))  # fmt: skip


def _restore_line(run: str, choice: RestoreChoice | None, paths: list[str]) -> str:
    """Which generation a restore selects now (castore.tiers.selection), from where, and
    how far behind the newest generation any tier lists."""
    if choice is None:
        return f"{run}: a restore now finds no generation complete in the tiers given"
    sources = [
        paths[index] + ("" if len(held) == choice.world_size else f" (shards {_spans(held)})")
        for index, held in sorted(choice.nodes.items())
    ]
    said = ("the fast tier of " if len(sources) == 1 else "the fast tiers of ") + ", ".join(sources)
    said = said if sources else ""
    if choice.durable:
        said = f"{said} and the durable tier" if said else "the durable tier"
    behind = (
        "the newest"
        if choice.generations_behind == 0
        else f"{choice.generations_behind} generation(s), {choice.steps_behind} step(s) behind "
        f"the newest ({choice.newest_id}, step {choice.newest_step})"
    )
    return (
        f"{run}: a restore now selects generation {choice.id} (step {choice.step}), "
        f"{behind}, from {said}"
    )


def _spans(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    spans: list[list[int]] = []
    for number in sorted(numbers):
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _format_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def cmd_du(args: argparse.Namespace) -> int:
    with _open(args.store) as store:
        usage = gc.disk_usage(store, [args.run] if args.run else None)
        here = {
            (gen.run, gen.id): _shards_here(store, gen)
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
            [kind, name, format_bytes(raw), format_bytes(stored), _ratio(stored / (raw or 1))]
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
        f"{format_bytes(usage.raw_bytes)} of raw chunk bytes ({_ratio(usage.compression)}; "
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


def _ratio(fraction: float) -> str:
    """Stored over raw bytes, as ``0.66x``."""
    return f"{fraction:.2f}x"


def cmd_repair(args: argparse.Namespace) -> int:
    if args.rebuild_index:
        if args.dry_run:
            raise ValueError("--rebuild-index cannot be a dry run (castore verify --deep reports)")
        _rebuild(args.store)
    with _open(args.store) as store:
        report = repair_store(store, dry_run=args.dry_run, lock_timeout=args.wait, progress=True)
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"checked {report.chunks_checked} chunk(s) and {report.objects_checked} object(s); "
        f"{verb} {len(report.corrupt_chunks)} corrupt chunk(s), "
        f"{len(report.missing_chunks)} index entr(ies) without bytes, "
        f"{len(report.corrupt_objects)} corrupt object(s)"
    )
    for run, generation in sorted(report.refs_restored.items()):
        verb = "would restore" if args.dry_run else "restored"
        print(f"{verb} the lost ref of run {run} from its reflog: it names generation {generation}")
    for run in report.reflog_indexes_rebuilt:
        verb = "would rewrite" if args.dry_run else "rewrote"
        print(f"{verb} the reflog index of run {run}: it disagreed with the reflog")
    if not report.damaged:
        print("OK: every generation is whole")
        return 0
    for where, lost in sorted(report.damaged.items()):
        print(f"DAMAGED {where}: {len(lost)} problem(s), first: {lost[0]}")
    print(
        "data lost: the chunks and objects above; a later save of the same content "
        "re-supplies chunks and heals those generations. Generations missing a root or "
        "shard manifest cannot be healed: load an earlier one (fallback='previous')."
    )
    return EXIT_PROBLEMS


def _rebuild(path: str) -> None:
    report = rebuild_index(path, progress=True)
    print(
        f"rebuilt the LMDB file: indexed {report.chunks_indexed} chunk(s) from "
        f"{report.packs} pack(s) ({report.records_damaged} damaged record(s) skipped), "
        f"kept {report.objects_kept} object(s)"
        + (f"; the old file is kept as {report.old_file}" if report.old_file else "")
    )
    for lost in report.lost[:10]:
        print(f"LOST {lost}")
    if len(report.lost) > 10:
        print(f"LOST ... and {len(report.lost) - 10} more")


def cmd_compact(args: argparse.Namespace) -> int:
    report = gc.compact(args.store, progress=True)
    print(
        f"compacted {args.store}: {format_bytes(report.bytes_before)} -> "
        f"{format_bytes(report.bytes_after)} in {report.seconds:.2f}s"
    )
    return 0


def cmd_copy(args: argparse.Namespace) -> int:
    if args.generation is not None and args.run is None:
        raise ValueError("--generation needs --run: which run's generation to copy")
    report = castore.copy(
        args.store,
        args.dst,
        run=args.run,
        generation=args.generation,
        all_generations=args.all_generations,
        progress=True,
        codec=args.codec,
    )
    for gen in report.generations:
        if not gen.copied:
            print(f"{gen.run}@{gen.id} {gen.root[:12]}: already in {args.dst}")
            continue
        print(
            f"{gen.run}@{gen.id} {gen.root[:12]}: copied {gen.chunks_copied} chunk(s) "
            f"({format_bytes(gen.bytes_copied)}), {gen.chunks_skipped} already there, "
            f"of {format_bytes(gen.logical_bytes)}"
            + ("; its parent is not copied" if gen.parent_marked else "")
        )
    if not report.copied:
        print(f"nothing to copy: {len(report.present)} generation(s) already in {args.dst}")
        return 0
    print(
        f"copied {len(report.copied)} generation(s), {len(report.present)} already there: "
        f"{format_bytes(report.bytes_copied)} transferred of {format_bytes(report.logical_bytes)}"
    )
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    run_a, gen_a = split_address(args.a)
    if args.each is not None:
        if args.b:
            raise ValueError(
                "--each compares each generation with the one before it: name no RUN@B"
            )
        with _open(args.store) as store:
            for generation, each in diffing.diff_history(
                store, run_a, gen_a, last=args.each or None
            ):
                if each is None:
                    print(f"{run_a}@{generation}: its parent was garbage-collected; not compared")
                else:
                    print(each.stat_line())
        return 0
    run_b, gen_b = split_address(args.b) if args.b else (None, None)
    with _open(args.store) as store:
        diff = diffing.diff_generations(store, run_a, gen_a, run_b, gen_b)
    if not args.stat:
        _print_diff(diff)
    print(diff.stat_line())
    return 0


def _print_diff(diff: diffing.GenerationDiff) -> None:
    rows = [
        ["added", n, "", format_bytes(size), format_bytes(size)] for n, size in diff.added.items()
    ]
    rows += [["removed", n, "", format_bytes(size), ""] for n, size in diff.removed.items()]
    rows += [
        ["changed", c.name, c.kind, format_bytes(c.nbytes), format_bytes(c.new_chunk_bytes)]
        for c in diff.changed
    ]
    sections = [
        (rows, ["change", "tensor", "what", "size", "new bytes"]),
        (_change_rows(diff.values), ["value", "old", "new"]),
        (_change_rows(diff.data_order), ["data order", "old", "new"]),
    ]
    for table, headers in sections:
        if table:
            print(text_table(table, headers, text=("tensor", "old", "new")))
            print()


def _change_rows(changes: list[diffing.ValueChange]) -> list[list[str]]:
    """Rows of path, old, new; past DIFF_VALUE_ROWS, one row says how many more."""
    rows = [[v.path, v.old or "-", v.new or "-"] for v in changes[:DIFF_VALUE_ROWS]]
    if len(changes) > DIFF_VALUE_ROWS:
        rows.append([f"... {len(changes) - DIFF_VALUE_ROWS} more", "", ""])
    return rows


def cmd_export(args: argparse.Namespace) -> int:
    run, generation = split_address(args.target)
    chosen: dict[str, Any] = {
        "prefix": args.prefix,
        "strip_prefix": args.strip_prefix,
        "dtype": args.dtype,
        "rename": args.rename,
    }
    if args.format == "torch":
        if args.max_shard_size is not None or args.index_from is not None:
            raise ValueError("--max-shard-size and --index-from are for --format safetensors")
        with _open(args.store) as store:
            report = export.to_torch(store, run, generation, args.out, progress=True, **chosen)
    else:
        with _open(args.store) as store:
            report = export.to_safetensors(
                store,
                run,
                generation,
                args.out,
                max_shard_size=args.max_shard_size,
                index_from=args.index_from,
                progress=True,
                **chosen,
            )
    for file in report.files:
        print(f"wrote {report.out_dir / file}")
    print(
        f"exported {report.tensors} tensor(s), {format_bytes(report.bytes)} in "
        f"{len(report.files)} file(s) to {args.out}; held at most "
        f"{format_bytes(report.peak_buffer)}"
    )
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    for source in args.sources:  # every source checked before the store is opened or created
        check_source(Path(source))
    with castore.open(args.store) as store:
        for offset, source in enumerate(args.sources):
            step = None if args.step is None else args.step + offset
            report = import_checkpoint(store, args.run, source, step=step, progress=True)
            print(
                f"{source}: {report.kind} as {report.run}@{report.generation}, "
                f"{report.tensors} tensor(s) of {format_bytes(report.logical_bytes)}, "
                f"wrote {format_bytes(report.new_bytes)}, "
                f"saved {format_bytes(report.saved_bytes)} by dedup"
            )
    return 0


COMMANDS = {
    "log": cmd_log,
    "show": cmd_show,
    "verify": cmd_verify,
    "du": cmd_du,
    "tiers": cmd_tiers,
    "tag": cmd_tag,
    "untag": cmd_untag,
    "gc": cmd_gc,
    "repair": cmd_repair,
    "compact": cmd_compact,
    "copy": cmd_copy,
    "diff": cmd_diff,
    "export": cmd_export,
    "import": cmd_import,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. ``castore show ... | head -1``: when the reader
    closes the pipe, exit 141 (as a Unix tool killed by SIGPIPE) with nothing on stderr."""
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:  # --help, --version, a usage error: argparse printed it
            sys.stdout.flush()  # here, so that a closed pipe is caught below
            raise
        return _run(args)
    except BrokenPipeError:
        # The reader has what it wanted: no error line, and no "Exception ignored"
        # from the interpreter flushing stdout into the closed pipe at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _run(args: argparse.Namespace) -> int:
    read_only: list[str] = []
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _held_read_only_warnings(warnings.showwarning, read_only)
            code = COMMANDS[args.command](args)
        sys.stdout.flush()  # here, so that a closed pipe is caught in main
        _print_warnings(read_only)
        return code
    except ReadOnlyStoreError as exc:
        return _fail(f"{type(exc).__name__}: {exc}")  # says read-only itself: one line
    except BrokenPipeError:
        raise  # main's: an OSError, but not a failure to report
    except CastoreError as exc:
        return _fail(f"{type(exc).__name__}: {exc}", read_only)
    except (OSError, ValueError) as exc:
        return _fail(f"{type(exc).__name__}: {exc}", read_only)
    except KeyboardInterrupt:
        return _fail("interrupted", read_only, code=130)
    except Exception as exc:  # noqa: BLE001 - the CLI promises one line, never a traceback
        return _fail(f"internal error: {type(exc).__name__}: {exc}", read_only, code=70)


def _held_read_only_warnings(shown: Callable[..., None], held: list[str]) -> Callable[..., None]:
    """Keep each ReadOnlyWarning's text in ``held``; show any other warning as before.

    Held, not printed: a refused write then prints only its error, which says
    read-only already; any other outcome prints each held one as one line.
    """

    def show(message: Warning | str, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if issubclass(category, ReadOnlyWarning):
            held.append(str(message).removeprefix("castore: "))
        else:
            shown(message, category, *rest, **kw)

    return show


def _print_warnings(held: list[str]) -> None:
    for text in held:
        print(f"castore: warning: {text}", file=sys.stderr)


def _fail(message: str, held: Sequence[str] = (), code: int = EXIT_PROBLEMS) -> int:
    _print_warnings(list(held))
    if os.environ.get("CASTORE_DEBUG"):
        traceback.print_exc()
    print(f"castore: error: {message}", file=sys.stderr)
    return code
