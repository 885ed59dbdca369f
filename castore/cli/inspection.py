"""The commands that read what was saved: ``log``, ``show``, ``diff``."""

from __future__ import annotations

import argparse
from typing import Any

from tabulate import tabulate

from castore import diffing
from castore.cli.graph import cmd_log_graph
from castore.cli.origins import changes, imported, origin
from castore.cli.output import format_seconds, format_time, ratio, text_table
from castore.cli.stores import open_existing, shards_here
from castore.cli.values import state_values
from castore.copying import CopyRecord, copies_logged
from castore.core.history import Generation, SaveStats, split_address
from castore.format.dcplayout import DcpLayout
from castore.support.progress import format_size as format_bytes

DIFF_VALUE_ROWS = 50  # value changes a diff lists before it only counts the rest


def cmd_log(args: argparse.Namespace) -> int:
    if args.graph:
        return cmd_log_graph(args)
    with open_existing(args.store) as store:
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
                row += [",".join(tags.get(gen.root, [])), origin(gen)]
                rows.append(row + [shards_here(store, gen)])
        if not rows:
            print("no generations")
            return 0
        headers = [
            "id", "step", "time", "logical", "new", "stored", "written", "dedup", "held", "root"
        ]
        headers = (["run"] if len(runs) > 1 else []) + headers + ["tags", "from", "here"]
        if all(row[-1] == "all" for row in rows):  # no tier holds a part elsewhere
            rows, headers = [row[:-1] for row in rows], headers[:-1]
        if not any(row[headers.index("from")] for row in rows):  # every one a save
            at = headers.index("from")
            rows = [row[:at] + row[at + 1 :] for row in rows]
            headers = headers[:at] + headers[at + 1 :]
        print(text_table(rows, headers, text=("run", "root", "tags", "from", "here")))
    return 0


def _log_row(gen: Generation, with_run: bool, copied: CopyRecord | None = None) -> list[Any]:
    stats = gen.stats if copied is None else _copy_stats(gen.stats, copied)
    row = [
        gen.id,
        gen.step,
        format_time(gen.time),
        format_bytes(stats.logical_bytes),
        format_bytes(stats.new_bytes),
        _stored(stats),
        format_bytes(stats.written_bytes),
        f"{100 * stats.dedup_ratio:.1f}%",
        # DCP calls castore's writer inside its own save: how long that held its caller
        # (all of dcp.save, or async_save's staging) is not castore's to know.
        # and a copied or promoted generation held no caller of this store.
        "-" if copied or DcpLayout.of(gen.metadata) else format_seconds(stats.held_seconds),
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
    return f"{format_bytes(stats.stored_bytes)} ({ratio(stats.compression)})"


def _metadata_line(gen: Generation, whole: bool) -> str:
    """A generation's metadata; a DCP save's ``dcp`` record (all of DCP's Metadata,
    kilobytes on one line) counted unless ``whole``."""
    layout = DcpLayout.of(gen.metadata)
    if layout is None or whole:
        return str(gen.metadata)
    rest = {key: value for key, value in gen.metadata.items() if key != "dcp"}
    return f"dcp: {layout.summary()}; whole: --all" + (f"; {rest}" if rest else "")


def cmd_show(args: argparse.Namespace) -> int:
    run, generation = split_address(args.target)
    with open_existing(args.store) as store:
        digest, root = store.resolve_root(run, generation)
        gen = Generation.from_root(digest, root)
        print(f"generation {run}@{gen.id}  step {gen.step}  {format_time(gen.time)}")
        print(f"root       {gen.root}")
        print(f"parent     {gen.parent or '-'}")
        if origin(gen):  # made from other generations (castore.lineage)
            print(f"from       {origin(gen)}{changes(gen.lineage)}")
        elif imported(gen):
            print(f"from       {imported(gen)}")
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
            print(f"metadata   {_metadata_line(gen, args.all)}")
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
            if root.layouts:
                rows[-1].append(_layout_text(root.layouts.get(name)))
        headers = ["tensor", "dtype", "shape", "size", "boxes", "chunks"]
        if root.layouts:
            headers.append("saved from (DTensor mesh: placements)")
        print()
        print(tabulate(rows, headers=headers))
        values = state_values(root.state, collapse=not args.all)
        if values:
            print()
            print(tabulate([v.row for v in values], headers=["key", "type", "value"]))
    collapsed = sum(v.count for v in values if v.count > 1)
    print()
    print(
        f"total      {len(rows)} tensor(s), {format_bytes(total_bytes)} in {total_chunks} "
        f"chunk(s); {sum(v.count for v in values)} value(s)"
        + (f" ({collapsed} collapsed: --all lists them)" if collapsed else "")
        + f"; {run}@{gen.id} step {gen.step}, {format_time(gen.time)}"
    )
    return 0


def _layout_text(layout: dict[str, Any] | None) -> str:
    """A DTensor's recorded layout in one cell: ``2x2 (dp, tp): R, S(0)``."""
    if not layout:
        return "-"
    mesh = "x".join(str(n) for n in layout.get("mesh", []))
    names = layout.get("mesh_dims")
    named = f" ({', '.join(map(str, names))})" if names else ""
    return f"{mesh}{named}: {', '.join(map(str, layout.get('placements', [])))}"


def cmd_diff(args: argparse.Namespace) -> int:
    run_a, gen_a = split_address(args.a)
    if args.each is not None:
        if args.b:
            raise ValueError(
                "--each compares each generation with the one before it: name no RUN@B"
            )
        with open_existing(args.store) as store:
            for generation, each in diffing.diff_history(
                store, run_a, gen_a, last=args.each or None
            ):
                if each is None:
                    print(f"{run_a}@{generation}: its parent was garbage-collected; not compared")
                else:
                    print(each.stat_line())
        return 0
    run_b, gen_b = split_address(args.b) if args.b else (None, None)
    with open_existing(args.store) as store:
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
