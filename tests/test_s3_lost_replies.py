"""S3 answers lost or cut short after the server acted: saves, loads and leases stay truthful.

A fault proxy (tests/helpers/s3_fault_proxy.py) sits between castore and moto's server:
it drops the answer to a request the server *applied* (a write that happened,
its reply never arriving) or cuts a GET's body short. castore must tell what
happened from the store itself: a save whose ref swap landed returns normally
and logs once; one whose outcome cannot be learned raises CommitUnknownError;
a short body is read again.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from blob_places import Place, s3_place
from s3_fault_proxy import ALWAYS, FaultProxy
from s3_server import s3_client, store_arguments

import castore
from castore.blob.s3 import S3BlobStore
from castore.errors import (
    CommitUnknownError,
    RefConflictError,
    StoreUnavailableError,
)
from castore.format.hashing import Digest, digest_bytes
from castore.gc import tag
from castore.repo.blobs import BlobRefTable
from castore.repo.records import RefValue
from castore.repo.reffile import encode_ref

CHUNK = 1024
ATTEMPTS = 2  # botocore's attempts per request: a failing request gives up quickly


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(s3_endpoint) as running:
        yield running


@pytest.fixture
def place(proxy: FaultProxy, s3_bucket: str) -> Place:
    """The store s3://BUCKET/ckpt, reached through the proxy with few attempts per request."""
    place = s3_place(proxy.endpoint, s3_bucket)
    place.options["s3_options"] = {**place.options["s3_options"], "max_attempts": ATTEMPTS}
    return place


def state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((32, 16), dtype=np.float32), "seed": seed}


def saved(place: Place, generations: int = 1) -> None:
    with place.open(chunk_size=CHUNK) as store:
        for seed in range(generations):
            store.save(state(seed), run="r", step=seed)


def history(place: Place) -> list[tuple[int, str]]:
    """(generation, root) of every reflog record of run r, oldest first, read afresh."""
    with place.open(create=False) as store:
        return [(r["generation"], r["root"]) for r in store.refs.reflog("r")]


def one_line(error: BaseException) -> None:
    assert "\n" not in str(error) and str(error)


# -- short bodies -------------------------------------------------------------------------


def test_a_body_cut_short_once_is_read_again_and_the_load_is_exact(
    place: Place, proxy: FaultProxy
) -> None:
    saved(place)
    cut = proxy.add("GET", "/ckpt/packs/", "truncate")
    with place.open(create=False) as store:
        loaded = store.load("r")
    assert cut.hits == 1
    assert np.array_equal(loaded["w"], state(0)["w"]) and loaded["seed"] == 0


def test_a_body_always_cut_short_is_unavailable_typed_and_one_cli_line(
    place: Place, proxy: FaultProxy
) -> None:
    saved(place)
    cut = proxy.add("GET", "/ckpt/objects/", "truncate", times=ALWAYS)
    with place.open(create=False) as store:
        with pytest.raises(StoreUnavailableError, match="kept breaking during GetObject") as raised:
            store.load("r")
    one_line(raised.value)
    assert cut.hits >= ATTEMPTS
    (shown,) = place.cli(["show", place.address, "r"])
    assert shown.code == 1 and shown.out == "", shown
    assert len(shown.err.splitlines()) == 1, shown.err
    assert shown.err.startswith("castore: error: StoreUnavailableError"), shown.err


# -- the commit's reply lost --------------------------------------------------------------


def test_a_ref_swap_whose_replies_are_all_lost_is_a_published_save(
    place: Place, proxy: FaultProxy
) -> None:
    """Every attempt's answer to the PUT of refs/r is dropped: the first was applied,
    the retries met it (412), and castore never heard either. Re-reading the ref
    shows this save's root: the save returns, and logs its advance once."""
    saved(place)
    lost = proxy.add("PUT", "/ckpt/refs/r", "drop_reply", times=ALWAYS)
    with place.open() as store:
        generation = store.save(state(1), run="r", step=1)
    assert lost.hits == ATTEMPTS
    proxy.clear()
    with place.open(create=False) as store:
        assert store.resolve("r").root == generation.root and generation.id == 2
        assert np.array_equal(store.load("r")["w"], state(1)["w"])
    assert [g for g, _ in history(place)] == [1, 2]


def test_a_commit_whose_outcome_cannot_be_learned_is_commit_unknown(
    place: Place, proxy: FaultProxy
) -> None:
    saved(place)
    lost = proxy.add("PUT", "/ckpt/refs/r", "drop_reply", times=ALWAYS)
    # Once the swap's answers are lost, reading the ref fails too.
    proxy.add("GET", "/ckpt/refs/r", "drop_reply", times=ALWAYS, when=lambda: lost.hits > 0)
    with place.open() as store:
        with pytest.raises(CommitUnknownError) as raised:
            store.save(state(1), run="r", step=1)
    one_line(raised.value)
    message = str(raised.value)
    assert "may or may not be published" in message
    assert "castore log STORE --run r" in message and "before saving again" in message
    proxy.clear()
    with place.open(create=False) as store:
        assert store.resolve("r").id == 2  # it had landed: the log tells the truth
    assert [g for g, _ in history(place)] == [1]  # the next save of r records it


def test_a_ref_swap_held_past_the_read_timeout_is_commit_unknown_and_lands_later(
    place: Place, proxy: FaultProxy
) -> None:
    """A slow server: every attempt of the PUT of refs/r is held past the client's read
    timeout, so the re-read still shows generation 1; the server applies the write
    afterwards. "Not published" would be false: the save raises CommitUnknownError."""
    saved(place)
    slow = proxy.add("PUT", "/ckpt/refs/r", "hold", times=ALWAYS)
    hurried = {**place.options["s3_options"], "read_timeout": 1}
    with castore_open(place, s3_options=hurried) as store:
        with pytest.raises(CommitUnknownError) as raised:
            store.save(state(1), run="r", step=1)
    one_line(raised.value)
    message = str(raised.value)
    assert "generation 2 of run 'r' may or may not be published" in message
    assert "may apply the swap later" in message and "castore log STORE --run r" in message
    assert slow.hits == ATTEMPTS and slow.applied == 0
    slow.release()  # the server gets to it
    deadline = time.monotonic() + 60
    while slow.applied < ATTEMPTS and time.monotonic() < deadline:
        time.sleep(0.05)
    proxy.clear()
    with place.open(create=False) as store:
        assert store.resolve("r").id == 2  # it landed after the save had been answered


def test_a_ref_swap_that_never_reached_the_store_is_not_published(
    place: Place, s3_bucket: str
) -> None:
    """Every attempt's connection refused: the store proves the swap was never sent,
    so the re-read ref naming the previous generation is the last word."""
    saved(place)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    arguments = {**store_arguments(closed), "max_attempts": ATTEMPTS, "connect_timeout": 1}
    refused = S3BlobStore(s3_bucket, "ckpt", check_bucket=False, **arguments)
    with pytest.raises(StoreUnavailableError) as raised:
        refused.swap("refs/r", b"never sent", None)
    assert raised.value.unsent and "nothing was written" in str(raised.value)
    with place.open(create=False) as store:
        before = store.refs.read("r")
        assert before is not None
        blobs = store.refs.blobs
        blobs.swap = refused.swap  # type: ignore[method-assign]  # reads reach the store
        new = RefValue("r", 2, Digest(digest_bytes(b"a root")), time.time(), step=1, epoch=1)
        with pytest.raises(StoreUnavailableError) as raised:
            BlobRefTable(blobs).advance("r", expected=before.root, new=new)
    assert not isinstance(raised.value, CommitUnknownError)
    one_line(raised.value)
    assert "generation 2 of run 'r' was not published" in str(raised.value)
    assert "never reached the store" in str(raised.value)
    with place.open(create=False) as store:
        assert store.refs.read("r") == before


def castore_open(place: Place, **options: Any) -> Any:
    return castore.open(place.address, **{**place.options, **options})


def test_a_lost_reply_with_the_ref_moved_by_another_is_a_conflict(
    place: Place, proxy: FaultProxy, s3_endpoint: str, s3_bucket: str
) -> None:
    """Another node's advance lands right before this save's swap reaches the server
    (written raw, as a node whose run lease had been taken over would): the swap is
    refused (412) and its answers lost. The ref names another root: a clear
    conflict, and nothing of this save logged."""
    saved(place)
    theirs = RefValue("r", 2, Digest(digest_bytes(b"another node's root")), time.time())

    direct = s3_client(s3_endpoint)  # not through the proxy

    def another_node_advances() -> None:
        direct.put_object(Bucket=s3_bucket, Key="ckpt/refs/r", Body=encode_ref(theirs))

    proxy.add("PUT", "/ckpt/refs/r", "drop_reply", times=ALWAYS, before=another_node_advances)
    with place.open() as store:
        with pytest.raises(RefConflictError, match="ref moved") as raised:
            store.save(state(1), run="r", step=1)
    one_line(raised.value)
    proxy.clear()
    with place.open(create=False) as store:
        assert store.refs.read("r") == theirs
    assert [g for g, _ in history(place)] == [1]


# -- the run lease around the commit -----------------------------------------------------


def test_a_run_lease_whose_release_answers_are_lost_leaves_the_save_published(
    place: Place, proxy: FaultProxy
) -> None:
    """The lease blob is freed after the ref swap: losing that answer must not make a
    published save raise, and the next save finds the lease free (no stale wait)."""
    saved(place)
    swapped = proxy.add("PUT", "/ckpt/refs/r", "count", times=ALWAYS)
    lost = proxy.add(
        "PUT", "/ckpt/locks/runs/r", "drop_reply", times=ALWAYS, when=lambda: swapped.hits > 0
    )
    with place.open() as store:
        generation = store.save(state(1), run="r", step=1)
    assert lost.hits == ATTEMPTS
    proxy.clear()
    started = time.monotonic()
    with place.open() as store:
        assert store.resolve("r").root == generation.root
        store.save(state(2), run="r", step=2)
    assert time.monotonic() - started < 10  # the lease was free: no 20 s takeover
    assert [g for g, _ in history(place)] == [1, 2, 3]


def test_a_run_lease_taken_with_its_answers_lost_is_held(place: Place, proxy: FaultProxy) -> None:
    """Every answer to the swap that takes the run lease is lost (the first landed):
    the lease holds this writer's record, so the save goes on instead of raising
    and leaving the lease taken until another writer waits it out."""
    saved(place)
    lost = proxy.add("PUT", "/ckpt/locks/runs/r", "drop_reply", times=ATTEMPTS)
    with place.open() as store:
        generation = store.save(state(1), run="r", step=1)
    assert lost.hits == ATTEMPTS
    with place.open(create=False) as store:
        assert store.resolve("r").root == generation.root
    assert place.read("locks/runs/r") == b'{"free":true}'


def test_a_tag_whose_answers_are_lost_is_written(place: Place, proxy: FaultProxy) -> None:
    saved(place)
    lost = proxy.add("PUT", "/ckpt/tags/r/best", "drop_reply", times=ALWAYS)
    with place.open() as store:
        tag(store, "r", 1, "best")
    assert lost.hits == ATTEMPTS
    proxy.clear()
    with place.open(create=False) as store:
        assert store.refs.tag("r", "best") is not None
