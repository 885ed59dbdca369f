"""One promotion: a fast-tier generation copied to the durable tier, and its outcome.

On one node a promotion is one copy (:func:`promote_generation`): only the
chunks the durable store lacks, each verified as it is read, within a rate,
then published there with the same root digest through the durable store's
own publish sequence (castore.copying.copy_generation). On several nodes it
is two steps: each node uploads its own ranks' shards (:func:`upload_shards`),
and the coordinator publishes once the durable tier holds every chunk
(:func:`publish_uploaded`). The promotion thread and the uploader process
(castore.tiers.uploader) both run these.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from castore.chunkstore.base import Namespace
from castore.copying import CopiedGeneration, copy_generation, copy_shard_chunks
from castore.core.background import Throttle
from castore.errors import CastoreError, ChunkMissingError
from castore.gc import RetentionPolicy, collect_garbage
from castore.store import Store


@dataclass
class Promoted:
    """One promotion's outcome: the copy's report, or the error that stopped it."""

    run: str
    generation: int
    copied: CopiedGeneration | None = None
    error: BaseException | None = None
    seconds: float = 0.0


def promote_generation(
    fast: Store,
    durable: Store,
    run: str,
    generation: int,
    *,
    rate: float | None = None,
    retention: RetentionPolicy | None = None,
    after_uploads: bool = False,
) -> CopiedGeneration | None:
    """Copy ``run@generation`` from ``fast`` to ``durable`` (None: it is there already).

    Only the chunks ``durable`` lacks, each verified as read, at most ``rate``
    bytes per second in batches of a tenth of a second's bytes (so the reads,
    hashing and writes spread out, not one burst); then ``retention`` collects
    the durable tier's run. The durable publish's reflog record says what the
    promotion wrote there (castore.copying.CopyRecord: ``castore log`` shows it),
    unless ``after_uploads`` (the nodes' uploads wrote the chunks before).
    """
    held = durable.published(run, tolerate_bad_ref=True) if run in durable.runs() else {}
    digest, root = fast.resolve_root(run, generation)
    if digest.hex in held:
        return None
    latest = durable.refs.read(run)
    if latest is not None and latest.generation >= generation:
        raise CastoreError(
            f"the durable tier {durable.path} already has {run}@{latest.generation}: "
            f"{run}@{generation} is not promoted"
        )
    copied = copy_generation(
        fast,
        durable,
        digest,
        root,
        throttle=Throttle(rate).take,
        batch_bytes=None if rate is None else max(1, int(rate / 10)),
        after_uploads=after_uploads,
    )
    if retention is not None:
        collect_garbage(durable, retention, runs=[run])
    return copied


def upload_shards(
    fast: Store,
    durable: Store,
    run: str,
    generation: int,
    shards: Sequence[int],
    rate: float | None = None,
) -> int:
    """Copy the chunks of some shards of ``run@generation`` that ``durable`` lacks (a
    node's part of a promotion on several nodes); the bytes sent. Publishes nothing."""
    _, root = fast.resolve_root(run, generation)
    wanted = [index for index in shards if index < len(root.shards)]
    if not wanted:
        return 0
    return copy_shard_chunks(
        fast,
        durable,
        root,
        wanted,
        throttle=Throttle(rate).take,
        batch_bytes=None if rate is None else max(1, int(rate / 10)),
    )


def publish_uploaded(
    fast: Store,
    durable: Store,
    run: str,
    generation: int,
    wait_s: float,
    retention: RetentionPolicy | None = None,
) -> CopiedGeneration | None:
    """Wait (at most ``wait_s``) until ``durable`` holds every chunk of ``run@generation``
    (the nodes' uploads), then publish it there with the same root digest."""
    _, root = fast.resolve_root(run, generation)
    shards = fast.read_shards(root)
    chunks = sorted({c for s in shards for c in s.chunk_digests()})
    wait_for_chunks(durable, chunks, timeout=wait_s)
    return promote_generation(
        fast, durable, run, generation, retention=retention, after_uploads=True
    )


def wait_for_chunks(
    durable: Any, chunks: list[bytes], *, timeout: float, poll: float = 0.2, most: float = 5.0
) -> None:
    """Wait until the durable tier holds every chunk (the nodes' uploads have landed).

    Each look costs a presence check (on a store on blobs, a refresh of its index
    listing): the wait between looks doubles from ``poll`` to at most ``most`` seconds.
    """
    deadline = time.monotonic() + timeout
    left = list(chunks)
    while True:
        left = _missing(durable, left)
        if not left:
            return
        if time.monotonic() >= deadline:
            raise ChunkMissingError(
                f"{len(left)} chunk(s) of the generation did not reach the durable tier within "
                f"{timeout:g}s (a node's upload failed or its node is gone); the durable tier "
                "keeps its previous generation"
            )
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        poll = min(poll * 2, most)


def wait_while_arriving(
    durable: Any, chunks: list[bytes], *, idle_s: float, poll: float = 0.25
) -> int:
    """Wait while the durable tier keeps receiving ``chunks`` (other ranks sending their
    staged chunks, castore.tiers.staged): until it holds all of them, or none arrived
    for ``idle_s`` seconds. The number still missing (the promotion copies those)."""
    left = list(chunks)
    last_progress = time.monotonic()
    while left:
        still = _missing(durable, left)
        now = time.monotonic()
        if len(still) < len(left):
            last_progress = now
        left = still
        if not left or now - last_progress >= idle_s:
            break
        time.sleep(poll)
    return len(left)


def _missing(durable: Any, chunks: list[bytes]) -> list[bytes]:
    """The ``chunks`` the durable tier does not hold yet (one presence check)."""
    present = durable.backend.has_many(Namespace.CHUNKS, chunks) if chunks else []
    return [c for c, here in zip(chunks, present, strict=True) if not here]
