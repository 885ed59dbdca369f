"""Retention and garbage collection, under a name that does not shadow Python's ``gc``.

``from castore import gc`` hides the standard library's ``gc`` module in the
importing file; ``from castore import retention`` gives the same API
(:mod:`castore.gc` stays, and is where it lives).
"""

from __future__ import annotations

from castore.gc import (
    CompactReport,
    GcAbortedError,
    GcReport,
    GenerationUsage,
    RetentionPolicy,
    RunPlan,
    TagChange,
    Usage,
    collect_garbage,
    compact,
    disk_usage,
    parse_duration,
    plan_retention,
    set_tag,
    tag,
    untag,
)

__all__ = [
    "CompactReport",
    "GcAbortedError",
    "GcReport",
    "GenerationUsage",
    "RetentionPolicy",
    "RunPlan",
    "TagChange",
    "Usage",
    "collect_garbage",
    "compact",
    "disk_usage",
    "parse_duration",
    "plan_retention",
    "set_tag",
    "tag",
    "untag",
]
