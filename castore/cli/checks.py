"""The commands that check and mend a store: ``verify``, ``repair``."""

from __future__ import annotations

import argparse

from castore.cli.failures import EXIT_PROBLEMS
from castore.cli.stores import open_existing
from castore.core.history import split_address
from castore.repair import rebuild_index, repair_store
from castore.verify import verify_store

# What a plain verify did, and what it left to --deep.
STRUCTURAL = (
    "structural (manifests checked, chunks looked up, pack sizes checked against the index; "
    "the chunks' bytes were not read: --deep re-hashes them)"
)  # value changes a diff lists before it only counts the rest


def cmd_verify(args: argparse.Namespace) -> int:
    run, generation = (None, None)
    if args.target:
        run, generation = split_address(args.target)
        generation = None if generation == "latest" and "@" not in args.target else generation
    with open_existing(args.store) as store:
        sample = None if args.sample is None else args.sample / 100
        report = verify_store(
            store, run=run, generation=generation, deep=args.deep, progress=True, sample=sample
        )
    mode = (
        _sampled(report.chunks_hashed, report.chunks, args.sample)
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
    if report.pieces_unchecked:
        print(
            f"the chunk pieces {report.pieces_unchecked} chunk(s) record were not checked: "
            "castore.format._b3tree is not built here (reads verify those chunks whole)"
        )
    for problem in report.problems:
        print(f"PROBLEM {problem}")
    if report.problems:
        named = [
            f"{label}: " + ", ".join(f"{r}@{g}" if g is not None else r for r, g in found)
            for label, found in (
                ("damaged", report.damaged_generations),
                ("wrong chunk pieces", report.pieces_generations),
            )
            if found
        ]
        print(f"FAILED: {len(report.problems)} problem(s); " + "; ".join(named))
        return EXIT_PROBLEMS
    print("OK")
    return 0


def _sampled(hashed: int, chunks: int, asked: float) -> str:
    """What a sampled verify re-hashed: each chunk is drawn at random with the chance asked,
    so the share drawn is near ``asked`` percent, not it; the line gives both."""
    share = 100 * hashed / chunks if chunks else 0.0
    said = "<1" if 0 < share < 1 else f"{share:.0f}"
    return (
        f"sampled ({hashed} of {chunks} chunk(s) re-hashed, {said}%; "
        f"each drawn with chance {asked:g}%)"
    )


def cmd_repair(args: argparse.Namespace) -> int:
    if args.rebuild_index:
        if args.dry_run:
            raise ValueError("--rebuild-index cannot be a dry run (castore verify --deep reports)")
        _rebuild(args.store)
    with open_existing(args.store) as store:
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
