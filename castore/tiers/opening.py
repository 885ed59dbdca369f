"""Opening a tiered store: ``castore.open_tiered(fast, durable, ...)``.

Checks the options, opens both tiers (closing what it opened if anything
fails), lets the fast tier hold compressed chunks, and says how promotions
will run: in the uploader process (castore.tiers.uploader) when the durable
tier can be opened again there by its address, else on a thread.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from castore.errors import CastoreWarning
from castore.gc import RetentionPolicy
from castore.opening.directory import open_address, upgrade_for_frames
from castore.opening.location import parse_location
from castore.store import Store
from castore.tiers.policy import TierPolicy
from castore.tiers.store import TieredStore


def _allow_frames(fast: Store) -> None:
    """A fast tier may receive chunks stored as frames (castore.format.codec): a peer
    node's copies, a compressed save. One older than frames (format 2) is upgraded to
    format 4 first, saying so once, so that an older castore refuses it whole instead of
    reporting those chunks as damage; a read-only one is left as it is (it receives
    nothing)."""
    if fast.readonly or not isinstance(fast.path, Path):
        return
    was = upgrade_for_frames(fast.path)
    if was is not None:
        warnings.warn(
            f"castore: the fast tier {fast.path} was a format {was} store; it is now format "
            "4 (it may hold compressed chunks), which a castore older than chunk compression "
            "refuses to open",
            CastoreWarning,
            stacklevel=3,
        )


def open_tiered(
    fast: str | os.PathLike[str],
    durable: str | os.PathLike[str] | Store,
    *,
    durable_every: int | None = None,
    durable_every_s: float | None = None,
    promote: Callable[[str, int], bool] | None = None,
    fast_keep: int = 2,
    durable_retention: RetentionPolicy | None = None,
    durable_rate: float | None = None,
    promote_on_exit: bool = True,
    uploader: str = "process",
    chunk_size: int | None = None,
    replicas: int = 1,
    node: str | None = None,
    upload_wait_s: float = 600.0,
    durable_stagger_s: float = 0.0,
    uploader_priority: str = "low",
    durable_step_budget: float = 0.02,
    **durable_options: Any,
) -> TieredStore:
    """A :class:`TieredStore`: ``fast`` (a local directory) in front of ``durable``.

    ``durable`` is anything :func:`castore.open` takes (options in
    ``durable_options``) or an open Store (closed with the tiered store).
    Every generation is promoted unless ``durable_every`` (ids divisible by
    it), ``durable_every_s`` (the first generation that long after the last
    promotion, or one ``durable_every`` also selects) or ``promote`` says
    otherwise. ``durable_rate``: bytes per second for uploads.

    ``uploader="process"`` (the default) promotes in a process of its own
    (castore.tiers.uploader), so that the copy does not compete with training
    for this process's GIL; where the durable tier cannot be opened again by
    address there (an open Store, options that are not plain values), and with
    ``uploader="thread"``, on a thread of this process. The process runs at
    ``nice`` 10 (``uploader_priority="low"``), or, with ``"idle"``, under
    Linux's SCHED_IDLE: only on CPU time training leaves unused (measured: a
    smaller step-time cost; a node whose cores training keeps busy all the
    time would starve its promotions).

    A job whose ranks are on several nodes (each node's ranks open their own
    ``fast`` directory; ``node`` names it, by default the host name and the
    directory's real path) keeps each node's shards in its fast tier, and with
    ``replicas=2`` (or more) copies of the next node's (castore.tiers.nodes).
    Its promotions are uploaded by each node (on a thread) and published by
    the coordinator once all of a generation's chunks are in the durable tier,
    waiting at most ``upload_wait_s`` seconds for them; node i of N starts
    its upload ``durable_stagger_s * i / N`` seconds late, each node within
    ``durable_rate``.

    A job that reports its steps (``store.report_step()`` after each step, on
    every rank) sends a promoted generation's chunks from the async save's
    staging buffers (castore.tiers.staged), on a thread of each rank, using
    at most ``durable_step_budget`` of each step's time (and ``durable_rate``);
    the promotion then copies from the fast tier only what was not sent.
    """
    if uploader not in ("process", "thread"):
        raise ValueError(f"uploader must be 'process' or 'thread', got {uploader!r}")
    if uploader_priority not in ("low", "idle"):
        raise ValueError(f"uploader_priority must be 'low' or 'idle', got {uploader_priority!r}")
    policy = TierPolicy(
        durable_every=durable_every,
        durable_every_s=durable_every_s,
        promote=promote,
        fast_keep=fast_keep,
        durable_retention=durable_retention,
        durable_rate=durable_rate,
        promote_on_exit=promote_on_exit,
        replicas=replicas,
        upload_wait_s=upload_wait_s,
        durable_stagger_s=durable_stagger_s,
        durable_step_budget=durable_step_budget,
    )
    location = parse_location(os.fspath(fast))
    if location.scheme != "file":
        raise ValueError(f"the fast tier is a local directory, not {os.fspath(fast)!r}")
    durable_store = (
        durable
        if isinstance(durable, Store)
        else open_address(durable, chunk_size=chunk_size, **durable_options)
    )
    try:
        fast_store = open_address(fast, chunk_size=chunk_size)
    except BaseException:
        if not isinstance(durable, Store):
            durable_store.close()
        raise
    try:
        _allow_frames(fast_store)
    except BaseException:
        fast_store.close()
        if not isinstance(durable, Store):
            durable_store.close()
        raise
    spec: dict[str, Any] | None = None
    if uploader == "process" and not isinstance(durable, Store):
        spec = {
            "fast": os.fspath(fast),
            "durable": os.fspath(durable),
            "options": durable_options,
            "chunk_size": chunk_size,
            "priority": uploader_priority,
        }
        try:
            json.dumps(spec)
        except (TypeError, ValueError):
            spec = None  # options that are objects: promote on a thread here
    try:
        return TieredStore(fast_store, durable_store, policy, uploader=spec, node=node)
    except BaseException:
        fast_store.close()
        if not isinstance(durable, Store):
            durable_store.close()
        raise
