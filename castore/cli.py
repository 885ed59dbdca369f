"""The ``castore`` command: inspect, check, tag, collect and compact a store.

Every failure prints one line to stderr and exits non-zero; set
``CASTORE_DEBUG=1`` to get the traceback as well.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from tabulate import tabulate

import castore
from castore import gc
from castore.errors import CastoreError
from castore.repair import repair_store
from castore.store import Generation, Store
from castore.tree import decode_tree

EXIT_PROBLEMS = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block plus the message.
        self.exit(EXIT_USAGE, f"castore: {message} (see {self.prog} --help)\n")


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _format_time(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def _split_target(target: str) -> tuple[str, str]:
    run, _, generation = target.partition("@")
    return run, generation or "latest"


def _open(path: str) -> Store:
    return castore.open(path, create=False)


def cmd_log(args: argparse.Namespace) -> int:
    with _open(args.store) as store:
        runs = [args.run] if args.run else store.runs()
        rows = []
        for run in runs:
            tags: dict[str, list[str]] = {}
            for name, value in store.refs.tags(run).items():
                tags.setdefault(value.root.hex, []).append(name)
            for gen in store.generations(run):
                rows.append(_log_row(gen, len(runs) > 1) + [",".join(tags.get(gen.root, []))])
        if not rows:
            print("no generations")
            return 0
        headers = ["id", "step", "time", "logical", "new", "dedup", "root", "tags"]
        print(tabulate(rows, headers=(["run"] if len(runs) > 1 else []) + headers))
    return 0


def _log_row(gen: Generation, with_run: bool) -> list[Any]:
    stats = gen.stats
    row = [
        gen.id,
        gen.step,
        _format_time(gen.time),
        format_bytes(stats.logical_bytes),
        format_bytes(stats.new_bytes),
        f"{100 * stats.dedup_ratio:.1f}%",
        gen.root[:12],
    ]
    return [gen.run, *row] if with_run else row


def cmd_show(args: argparse.Namespace) -> int:
    run, generation = _split_target(args.target)
    with _open(args.store) as store:
        digest, root = store.resolve_root(run, generation)
        gen = Generation.from_root(digest, root)
        print(f"generation {run}@{gen.id}  step {gen.step}  {_format_time(gen.time)}")
        print(f"root       {gen.root}")
        print(f"parent     {gen.parent or '-'}")
        print(f"ranks      {gen.world_size}")
        print("versions   " + ", ".join(f"{k} {v}" for k, v in sorted(gen.frameworks.items())))
        if gen.metadata:
            print(f"metadata   {gen.metadata}")
        if gen.data_order:
            order = ", ".join(f"{k} {v}" for k, v in sorted(gen.data_order.items()))
            print(f"data order {order}")
        rows = []
        for name, boxes in store.tensor_entries(root).items():
            first = boxes[0]
            nbytes = sum(b.nbytes for b in boxes)
            chunks = sum(len(b.chunks) for b in boxes)
            shape = "x".join(map(str, first.shape)) or "()"
            rows.append([name, first.dtype, shape, format_bytes(nbytes), len(boxes), chunks])
        print()
        print(tabulate(rows, headers=["tensor", "dtype", "shape", "size", "boxes", "chunks"]))
        tree = decode_tree(root.state, lambda name, fw: _TensorMark(), lambda path: RankLocal())
        values = _plain_values(tree)
        if values:
            print()
            print(tabulate(values, headers=["key", "type", "value"]))
    return 0


class _TensorMark:
    """Stands in for a tensor when listing a state's non-tensor values."""


class RankLocal:
    """Stands in for a RankLocal value (one per rank, in the shard manifests)."""

    def __repr__(self) -> str:
        return "<saved per rank>"


def _plain_values(node: Any, path: str = "") -> list[list[str]]:
    if isinstance(node, _TensorMark):
        return []
    if isinstance(node, dict):
        return [
            row
            for k, v in node.items()
            for row in _plain_values(v, f"{path}/{k}" if path else str(k))
        ]
    if isinstance(node, (list, tuple)):
        return [
            row
            for i, v in enumerate(node)
            for row in _plain_values(v, f"{path}/{i}" if path else str(i))
        ]
    text = repr(node)
    return [[path or ".", type(node).__name__, text if len(text) <= 60 else text[:57] + "..."]]


def cmd_verify(args: argparse.Namespace) -> int:
    from castore.verify import verify_store

    run, generation = (None, None)
    if args.target:
        run, generation = _split_target(args.target)
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
        else "structural"
    )
    print(
        f"verified {report.runs} run(s), {report.generations} generation(s), "
        f"{report.objects} object(s), {report.chunks} chunk(s): {mode}"
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
    run, generation = _split_target(args.target)
    with _open(args.store) as store:
        gen = gc.tag(store, run, generation, args.name)
    print(f"tagged {run}@{gen.id} ({gen.root[:12]}) as {args.name}")
    return 0


def cmd_untag(args: argparse.Namespace) -> int:
    with _open(args.store) as store:
        gc.untag(store, args.run, args.name)
    print(f"removed tag {args.name} of run {args.run}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    policy = gc.RetentionPolicy(
        keep_last=args.keep,
        every_steps=args.every_steps,
        every_seconds=gc.parse_duration(args.every) if args.every else None,
    )
    with _open(args.store) as store:
        report = gc.collect_garbage(
            store,
            policy,
            runs=[args.run] if args.run else None,
            dry_run=args.dry_run,
            lock_timeout=args.wait,
            progress=True,
        )
    rows = []
    for plan in report.plans:
        for gen in plan.generations:
            reasons = plan.reasons[gen.id]
            verdict = "keep" if reasons else ("drop" if args.dry_run else "dropped")
            rows.append(
                [plan.run, gen.id, gen.step, _format_time(gen.time), verdict, "; ".join(reasons)]
            )
    if rows:
        print(tabulate(rows, headers=["run", "id", "step", "time", "", "kept by"]))
        print()
    dropped = sum(len(ids) for ids in report.dropped.values())
    verb = "would free" if args.dry_run else "freed"
    print(
        f"{'dry run: ' if args.dry_run else ''}{dropped} generation(s) dropped; {verb} "
        f"{format_bytes(report.bytes_freed)} ({report.chunks_freed} chunk(s), "
        f"{report.objects_freed} object(s)) in {report.seconds:.2f}s"
        + (
            f"; gave back {format_bytes(report.file_bytes_freed)} of pack files"
            if report.file_bytes_freed
            else ""
        )
    )
    return 0


def cmd_du(args: argparse.Namespace) -> int:
    with _open(args.store) as store:
        usage = gc.disk_usage(store, [args.run] if args.run else None)
    rows = [
        [
            u.run,
            u.id,
            u.step,
            format_bytes(u.logical_bytes),
            format_bytes(u.referenced_bytes),
            format_bytes(u.exclusive_bytes),
        ]
        for u in usage.generations
    ]
    if rows:
        print(
            tabulate(
                rows,
                headers=[
                    "run",
                    "id",
                    "step",
                    "logical",
                    "references",
                    "only it (freed if dropped)",
                ],
            )
        )
        print()
    print(f"logical   {format_bytes(usage.logical_bytes)} in {len(rows)} generation(s)")
    print(
        f"stored    {format_bytes(usage.referenced_bytes)} of chunks they reference "
        f"(dedup {usage.dedup_ratio:.2f}x)"
    )
    print(
        f"physical  {format_bytes(usage.physical_bytes)} of chunks and objects, "
        f"{format_bytes(usage.garbage_bytes)} of it garbage (castore gc frees it)"
    )
    print(
        f"files     {format_bytes(usage.file_bytes)} on disk: LMDB file and chunk packs "
        "(gc rewrites sparse packs; castore compact rewrites every pack and the LMDB file)"
    )
    return 0


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
    from castore.rebuild import rebuild_index

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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="castore", description="Inspect, check, tag, collect and compact a castore store."
    )
    parser.add_argument("--version", action="version", version=f"castore {castore.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    log = commands.add_parser("log", help="table of generations with sizes and dedup")
    log.add_argument("store")
    log.add_argument("--run", help="only this run")
    log.set_defaults(handler=cmd_log)
    show = commands.add_parser("show", help="tensors and values of one generation")
    show.add_argument("store")
    show.add_argument("target", metavar="RUN[@GEN]")
    show.set_defaults(handler=cmd_show)
    verify = commands.add_parser("verify", help="check objects and chunks; non-zero on problems")
    verify.add_argument("store")
    verify.add_argument("target", nargs="?", metavar="RUN[@GEN]")
    verify.add_argument("--deep", action="store_true", help="re-hash every chunk")
    verify.add_argument(
        "--sample", type=float, metavar="P", help="re-hash a random P%% of the chunks"
    )
    verify.set_defaults(handler=cmd_verify)
    tag = commands.add_parser("tag", help="pin a generation under a name (retention keeps it)")
    tag.add_argument("store")
    tag.add_argument("target", metavar="RUN@GEN")
    tag.add_argument("name")
    tag.set_defaults(handler=cmd_tag)
    untag = commands.add_parser("untag", help="remove a tag")
    untag.add_argument("store")
    untag.add_argument("run")
    untag.add_argument("name")
    untag.set_defaults(handler=cmd_untag)
    collect = commands.add_parser("gc", help="apply the retention policy and free garbage")
    collect.add_argument("store")
    collect.add_argument("--run", help="apply the policy to this run only (others keep all)")
    collect.add_argument("--keep", type=int, default=3, help="newest generations kept per run")
    collect.add_argument("--every-steps", type=int, help="also keep the first of every N steps")
    collect.add_argument(
        "--every",
        metavar="DURATION",
        help="also keep the newest of every interval (90s, 30m, 6h, 1d, 2w)",
    )
    collect.add_argument(
        "--dry-run", action="store_true", help="show what each rule keeps and what would be freed"
    )
    collect.add_argument(
        "--wait", type=float, default=30.0, help="seconds to wait for running saves (default 30)"
    )
    collect.set_defaults(handler=cmd_gc)
    du = commands.add_parser("du", help="logical and physical bytes, per generation")
    du.add_argument("store")
    du.add_argument("--run", help="only this run's generations")
    du.set_defaults(handler=cmd_du)
    repair = commands.add_parser(
        "repair", help="remove corrupt chunks and objects; list what stays damaged"
    )
    repair.add_argument("store")
    repair.add_argument("--dry-run", action="store_true", help="report, change nothing")
    repair.add_argument("--wait", type=float, default=30.0, help="seconds to wait for saves")
    repair.add_argument(
        "--rebuild-index",
        action="store_true",
        help="first write a fresh LMDB file: the chunk index rebuilt from the packs, every "
        "readable object copied (offline: no other process may have the store open)",
    )
    repair.set_defaults(handler=cmd_repair)
    compact = commands.add_parser(
        "compact", help="rewrite packs and the LMDB file without dead space (offline)"
    )
    compact.add_argument("store")
    compact.set_defaults(handler=cmd_compact)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except CastoreError as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    except (OSError, ValueError) as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        return _fail("interrupted", code=130)
    except Exception as exc:  # noqa: BLE001 - the CLI promises one line, never a traceback
        return _fail(f"internal error: {type(exc).__name__}: {exc}", code=70)


def _fail(message: str, code: int = EXIT_PROBLEMS) -> int:
    if os.environ.get("CASTORE_DEBUG"):
        traceback.print_exc()
    print(f"castore: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
