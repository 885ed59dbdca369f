"""The commands that move checkpoints between stores and formats: ``copy``, ``export``,
``verify-export``, ``import``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import castore
from castore import export, export_verify
from castore.cli.stores import open_existing
from castore.core.history import split_address
from castore.importer import check_source, import_checkpoint
from castore.support.progress import format_size as format_bytes


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


def cmd_export(args: argparse.Namespace) -> int:
    run, generation = split_address(args.target)
    chosen: dict[str, Any] = {
        "prefix": args.prefix,
        "strip_prefix": args.strip_prefix,
        "dtype": args.dtype,
        "rename": args.rename,
    }
    if args.format == "torch":
        if args.max_shard_size is not None or args.index_from is not None or args.statement:
            raise ValueError(
                "--max-shard-size, --index-from and --statement are for --format safetensors"
            )
        with open_existing(args.store) as store:
            report = export.to_torch(store, run, generation, args.out, progress=True, **chosen)
    else:
        with open_existing(args.store) as store:
            report = export.to_safetensors(
                store,
                run,
                generation,
                args.out,
                max_shard_size=args.max_shard_size,
                index_from=args.index_from,
                progress=True,
                statement=args.statement,
                **chosen,
            )
    for file in report.files:
        print(f"wrote {report.out_dir / file}")
    if report.statement is not None:
        print(f"wrote {report.out_dir / report.statement} (the statement to sign)")
    print(
        f"exported {report.tensors} tensor(s), {format_bytes(report.bytes)} in "
        f"{len(report.files)} file(s) to {args.out}; held at most "
        f"{format_bytes(report.peak_buffer)}"
    )
    return 0


def cmd_verify_export(args: argparse.Namespace) -> int:
    with castore.open(args.store, create=False, readonly=True) as store:
        check = export_verify.verify_export(args.dir, store, progress=True)
    for file in check.files:
        what = f"{file.tensors} tensor(s), {file.chunks} chunk(s) hashed in place" + (
            f", {file.converted} converted tensor(s) compared" if file.converted else ""
        )
        print(f"ok {file.name}: {format_bytes(file.bytes)}" + (f", {what}" if file.tensors else ""))
    listed = "" if check.published else f"; run {check.run}'s history no longer lists it"
    print(
        f"verified: {args.dir} is bitwise {check.run}@{check.generation} (step {check.step}, "
        f"root {check.root[:12]}): {len(check.files)} file(s), "
        f"{format_bytes(check.bytes)}{listed}"
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
