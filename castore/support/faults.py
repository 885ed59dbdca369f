"""Named fault points for crash tests: off, and free, unless switched on.

Set ``CASTORE_FAULTS`` to a comma-separated list of ``point=action`` before the
process starts (``action`` is ``kill`` for SIGKILL or ``raise``), for example
``CASTORE_FAULTS=save.before_ref_advance=kill``, or call :func:`arm` in the
process. Code calls
``fault_point("save.before_ref_advance")`` where a crash must be survivable.
"""

from __future__ import annotations

import os
import signal

from castore.errors import InjectedFault

POINTS = (
    "save.mid_chunks",
    "save.pack_unindexed",
    "save.before_objects",
    "save.before_ref_advance",
    "save.after_ref_advance",
    "dist.worker_mid_shard",
    "dist.worker_before_ack",
    "dist.coordinator_before_root",
    "dist.coordinator_before_ref_advance",
    "dist.coordinator_after_ref_advance",
    "async.mid_snapshot",
    "async.mid_write",
    "async.before_ref_advance",
    "gc.before_sweep",
    "gc.mid_sweep",
    "gc.mid_chunks",
    "gc.reclaim_rewritten",
    "blob.create_before_link",
    "blob.swap_before_rename",
    "blob.mid_multipart",
    "copy.mid_chunks",
    "copy.before_root",
    "copy.before_ref_advance",
    "copy.after_ref_advance",
    "lineage.mid_chunks",
    "lineage.before_root",
    "lineage.before_ref_advance",
    "lineage.after_ref_advance",
    "tiers.node_before_ref_advance",
)


def _parse(spec: str) -> dict[str, str]:
    armed = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, action = item.partition("=")
        armed[point] = action or "kill"
    return armed


_ARMED = _parse(os.environ.get("CASTORE_FAULTS", ""))


def arm(point: str, action: str = "kill") -> None:
    """Switch a fault point on in this process (``kill`` or ``raise``)."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    if action not in ("kill", "raise"):
        raise ValueError(f"fault action must be 'kill' or 'raise', got {action!r}")
    _ARMED[point] = action


def disarm(point: str | None = None) -> None:
    """Switch one fault point (or all of them) off."""
    if point is None:
        _ARMED.clear()
    else:
        _ARMED.pop(point, None)


def fault_point(name: str) -> None:
    """Crash here if the fault point ``name`` is armed."""
    if not _ARMED:
        return
    action = _ARMED.get(name)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise InjectedFault(f"injected fault at {name}", point=name)
