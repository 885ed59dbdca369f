"""The promotion's own process: ``python -m castore.tiers.uploader``.

A promotion reads, re-hashes and writes a generation's new chunks; in the
training process that work competes with training for the GIL (measured:
step p99 1.25x the baseline's against 1.06x with promotions off). A tiered
store whose durable tier it can open again by address hands each promotion
to this process instead, one per tiered store, started at its first
promotion, at a lower CPU priority than training's (``nice`` 10, or
SCHED_IDLE with ``uploader_priority="idle"``).

Protocol, one JSON object per line. The first line on stdin says what to open:
``{"fast": PATH, "durable": ADDRESS, "options": {...}, "chunk_size": N|null,
"priority": "low"|"idle"}``;
then each line is a job ``{"kind", "run", "generation", "rate": bytes/s|null,
"retention": {keep_last, every_steps, every_seconds}|null}``, answered on stdout
with ``{"copied": {...}|null}`` (null: the durable tier had it) or
``{"error": "Type: message"}``. ``kind`` is "promote" (the default: copy and
publish the generation), or, for a job on several nodes (castore.tiers.nodes),
"upload" (``"shards": [...]``: copy those shards' missing chunks, publish
nothing) or "publish" (``"wait_s"``: wait until the durable tier holds every
chunk, then publish). The process ends when stdin closes; it ends at once,
quietly, when stdin closes before the first line (the job died before it sent
work), and with one line on stderr, never a traceback, when a store cannot be
opened (a lost node's fast tier).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any


def main() -> int:
    """Serve jobs until stdin closes. A job that died before it sent anything (stdin closed
    at once): exit 0, silently. A store that cannot be opened (the node's fast tier is
    gone): one line on stderr, exit 1 (the job says the promotion failed and retries it)."""
    from castore.errors import CastoreError

    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the job is gone before it asked for anything: nothing to do
    try:
        return _serve(json.loads(line))
    except (CastoreError, OSError, ValueError) as exc:
        print(f"castore uploader: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _serve(spec: dict[str, Any]) -> int:
    from castore.opening import open_address

    _lower_priority(spec.get("priority", "low"))
    options = dict(spec.get("options") or {})
    with open_address(spec["fast"], create=False, chunk_size=spec.get("chunk_size")) as fast:
        with open_address(spec["durable"], create=False, **options) as durable:
            for line in sys.stdin:
                reply: dict[str, Any]
                try:
                    reply = _run(fast, durable, json.loads(line))
                except Exception as exc:  # noqa: BLE001 - answered to the parent, typed by name
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                try:
                    sys.stdout.write(json.dumps(reply) + "\n")
                    sys.stdout.flush()
                except BrokenPipeError:  # the job that asked is gone (killed): so is this
                    os._exit(0)
    return 0


def _lower_priority(priority: str) -> None:
    """A background copy: the kernel gives training's processes the CPU first.

    "low": ``nice`` 10 (the copy still gets a share of a CPU that training
    keeps busy); "idle": Linux's SCHED_IDLE where there is one (the copy runs
    only on CPU time nothing else wants: measured, it keeps training's step
    times closer to no checkpointing, and it can starve while training keeps
    every core busy).
    """
    try:
        os.nice(10)
    except OSError:
        pass
    idle = getattr(os, "SCHED_IDLE", None)
    if priority == "idle" and idle is not None:
        try:
            os.sched_setscheduler(0, idle, os.sched_param(0))
        except OSError:
            pass  # nice 10 stays


def _run(fast: Any, durable: Any, job: dict[str, Any]) -> dict[str, Any]:
    """One job: "promote" (the default), "upload" (a node's shards) or "publish"."""
    from castore.gc import RetentionPolicy
    from castore.tiers.promotion import promote_generation, publish_uploaded, upload_shards

    run, generation = job["run"], int(job["generation"])
    kept = job.get("retention")
    retention = None if kept is None else RetentionPolicy(**kept)
    kind = job.get("kind", "promote")
    if kind == "upload":
        sent = upload_shards(fast, durable, run, generation, job["shards"], job.get("rate"))
        return {"copied": None, "sent": sent}
    if kind == "publish":
        copied = publish_uploaded(fast, durable, run, generation, job["wait_s"], retention)
    elif kind == "promote":
        copied = promote_generation(
            fast, durable, run, generation, rate=job.get("rate"), retention=retention
        )
    else:
        raise ValueError(f"unknown job kind {kind!r}")
    return {"copied": None if copied is None else asdict(copied)}


if __name__ == "__main__":
    sys.exit(main())
