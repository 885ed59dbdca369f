"""Named fault points for crash tests: off, and free, unless switched on.

Set ``CASTORE_FAULTS`` to a comma-separated list of ``point=action`` before the
process starts (``action`` is ``kill`` for SIGKILL or ``raise``), for example
``CASTORE_FAULTS=save.before_ref_advance=kill``. Code calls
``fault_point("save.before_ref_advance")`` where a crash must be survivable.
"""

from __future__ import annotations

import os
import signal

from castore.errors import CastoreError

POINTS = (
    "save.mid_chunks",
    "save.before_objects",
    "save.before_ref_advance",
    "save.after_ref_advance",
)


class InjectedFault(CastoreError):
    """Raised by a fault point switched to ``raise``."""


def _parse(spec: str) -> dict[str, str]:
    armed = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, action = item.partition("=")
        armed[point] = action or "kill"
    return armed


_ARMED = _parse(os.environ.get("CASTORE_FAULTS", ""))


def fault_point(name: str) -> None:
    """Crash here if the fault point ``name`` is armed."""
    if not _ARMED:
        return
    action = _ARMED.get(name)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise InjectedFault(f"injected fault at {name}", point=name)
