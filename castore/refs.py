"""Refs, the reflog, tags and locks: the names the rest of castore imports.

A ref names the newest published root of a run; advancing it is a
compare-and-swap and the one commit point of a generation (invariant 2).
Each advance, and each generation garbage collection drops, is recorded in
the run's reflog. The interfaces of these parts and their implementations
live in :mod:`castore.repo` (``base``: the ABCs; ``local``: a store directory,
with :class:`RefStore` composing its parts; ``memory``: in one process); this
module keeps the names other modules have always imported from here.
"""

from castore.repo.local import OPEN_LOCK, STORE_LOCK, RefStore
from castore.repo.records import (
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_SAVE_WAIT,
    PUBLISH_ACTIONS,
    REFLOG_ACTIONS,
    PublishedStream,
    ReflogView,
    ReflogWarning,
    RefValue,
    validate_run_name,
    validate_tag_name,
)
from castore.repo.reffile import (
    REF_MAGIC,
    REF_VERSION,
    DurabilityWarning,
    decode_ref,
    encode_ref,
    fsync_dir,
)
from castore.repo.refstore import ComposedRefStore

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_SAVE_WAIT",
    "OPEN_LOCK",
    "PUBLISH_ACTIONS",
    "REFLOG_ACTIONS",
    "REF_MAGIC",
    "REF_VERSION",
    "STORE_LOCK",
    "ComposedRefStore",
    "DurabilityWarning",
    "PublishedStream",
    "RefStore",
    "RefValue",
    "ReflogView",
    "ReflogWarning",
    "decode_ref",
    "encode_ref",
    "fsync_dir",
    "validate_run_name",
    "validate_tag_name",
]
