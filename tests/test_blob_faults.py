"""Bad input and faults on stores laid out as blobs: each a typed error, nothing published.

S3 faults are real HTTP answers from moto's server on the loopback, or answers
injected on the boto3 client's ``before-send`` event (a 503 storm): castore
sees exactly what botocore would hand it from a real endpoint. Damaged blobs
are rewritten beneath castore. After each fault a fresh handle finds the
previous generation intact and nothing new published.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from _helpers import process_context
from blob_places import Place, s3_place, shared_place
from s3_server import DUMMY_KEY, DUMMY_SECRET, REGION, SlowDown, store_arguments

import castore
from castore.chunkstore.bloblayout import encode_index, index_blob_name
from castore.errors import (
    IntegrityError,
    StoreAccessDeniedError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from castore.store import FallbackWarning
from castore.verify import verify_store

CHUNK = 1024


@pytest.fixture(params=["shared", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "shared":
        return shared_place(tmp_path / "shared")
    return s3_place(request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket"))


def state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((32, 16), dtype=np.float32), "seed": seed}


def saved(place: Place, generations: int = 1) -> Place:
    with place.open(chunk_size=CHUNK) as store:
        for seed in range(generations):
            store.save(state(seed), run="r", step=seed)
    return place


def assert_intact(place: Place, newest: int) -> None:
    """A fresh handle: run r ends at generation ``newest``, which loads as saved."""
    with place.open(create=False) as store:
        assert store.resolve("r").id == newest
        loaded = store.load("r")
        assert np.array_equal(loaded["w"], state(newest - 1)["w"]) and loaded["seed"] == newest - 1
        assert len(list(store.refs.records_backwards("r"))) == newest


def one_line(error: BaseException) -> None:
    assert "\n" not in str(error) and str(error)


# -- S3: the bucket, the credentials, the endpoint --------------------------------------


def test_a_missing_bucket_is_store_not_found_in_the_api_and_in_one_cli_line(
    s3_endpoint: str, s3_bucket: str
) -> None:
    missing = s3_place(s3_endpoint, "no-such-bucket-here")
    with pytest.raises(StoreNotFoundError, match="'no-such-bucket-here' does not exist") as raised:
        missing.open()
    one_line(raised.value)
    empty = s3_place(s3_endpoint, s3_bucket, prefix="nothing")
    (log, bad_name) = missing.cli(["log", missing.address], ["log", "s3://Bad_Bucket/x"])
    with pytest.raises(StoreNotFoundError):
        empty.open(create=False)
    for result, words in ((log, "StoreNotFoundError"), (bad_name, "UnsupportedBackendError")):
        assert result.code == 1 and result.out == ""
        assert len(result.err.splitlines()) == 1 and words in result.err, result.err
        assert result.err.startswith("castore: error: ")


def test_wrong_credentials_are_access_denied_and_publish_nothing(
    s3_endpoint: str, s3_bucket: str
) -> None:
    place = saved(s3_place(s3_endpoint, s3_bucket))
    wrong = s3_place(s3_endpoint, s3_bucket)
    wrong.options["s3_options"] = {"access_key": "AKIAWRONGWRONGWRONG1", "secret_key": "wrong"}
    wrong.env.update(AWS_ACCESS_KEY_ID="AKIAWRONGWRONGWRONG1", AWS_SECRET_ACCESS_KEY="wrong")
    previous = requests.post(f"{s3_endpoint}/moto-api/reset-auth", data=b"0").json()
    try:
        with pytest.raises(StoreAccessDeniedError, match="refused the credentials") as raised:
            wrong.open()
        (cli,) = wrong.cli(["log", wrong.address])
    finally:
        requests.post(
            f"{s3_endpoint}/moto-api/reset-auth",
            data=str(previous["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]).encode(),
        )
    one_line(raised.value)
    assert isinstance(raised.value, PermissionError)
    assert cli.code == 1 and len(cli.err.splitlines()) == 1, cli.err
    assert cli.err.startswith("castore: error: StoreAccessDeniedError")
    assert_intact(place, 1)


def test_an_endpoint_that_is_down_is_unavailable_within_a_bounded_wait() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again before the store connects
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="cannot reach") as raised:
        castore.open(
            "s3://bucket/ckpt",
            endpoint_url=f"http://127.0.0.1:{port}",
            region=REGION,
            s3_options={
                "access_key": DUMMY_KEY,
                "secret_key": DUMMY_SECRET,
                "connect_timeout": 0.5,
                "max_attempts": 2,
            },
        )
    assert time.monotonic() - started < 10
    one_line(raised.value)


# -- a 503 storm, injected on the client ---------------------------------------------------


def stormy_place(endpoint: str, bucket: str, storm: SlowDown) -> Place:
    """The store at s3://bucket/ckpt through a client of 3 attempts whose writes meet ``storm``."""
    import boto3
    from botocore.config import Config

    arguments = store_arguments(endpoint)
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=arguments["access_key"],
        aws_secret_access_key=arguments["secret_key"],
        config=Config(retries={"mode": "standard", "total_max_attempts": 3}),
    )
    client.meta.events.register("before-send.s3.PutObject", storm)
    place = s3_place(endpoint, bucket)
    place.options = {"s3_options": {"client": client}}
    return place


def test_a_short_503_storm_is_retried_and_the_save_publishes(
    s3_endpoint: str, s3_bucket: str
) -> None:
    saved(s3_place(s3_endpoint, s3_bucket))
    storm = SlowDown(2, after=2)  # a write meets two 503s, the third attempt passes
    stormy = stormy_place(s3_endpoint, s3_bucket, storm)
    with stormy.open() as store:
        store.save(state(1), run="r", step=1)
    assert storm.answered == 2
    assert_intact(s3_place(s3_endpoint, s3_bucket), 2)


@pytest.mark.parametrize("after", [0, 3])
def test_a_503_storm_that_never_stops_is_unavailable_and_publishes_nothing(
    s3_endpoint: str, s3_bucket: str, after: int
) -> None:
    place = saved(s3_place(s3_endpoint, s3_bucket))
    refs_before = place.names("refs/")
    storm = SlowDown(10_000, after=after)  # from the first write, or from the middle of the save
    with stormy_place(s3_endpoint, s3_bucket, storm).open() as store:
        with pytest.raises(StoreUnavailableError, match="kept failing .*SlowDown") as raised:
            store.save(state(1), run="r", step=1)
    one_line(raised.value)
    assert storm.answered >= 3
    assert place.names("refs/") == refs_before
    assert_intact(place, 1)


# -- damaged blobs ------------------------------------------------------------------------


def newest_blobs(place: Place, prefix: str, before: list[str]) -> list[str]:
    return [name for name in place.names(prefix) if name not in before]


def two_saved(place: Place) -> tuple[list[str], list[str]]:
    """r@1 and r@2; the pack and object blobs r@2 wrote."""
    saved(place)
    packs, objects = place.names("packs/"), place.names("objects/")
    with place.open() as store:
        store.save(state(1), run="r", step=1)
    return newest_blobs(place, "packs/", packs), newest_blobs(place, "objects/", objects)


def assert_damage_found_and_fallen_back(place: Place) -> None:
    with place.open(create=False) as store:
        with pytest.raises(IntegrityError) as raised:
            store.load("r")
        one_line(raised.value)
        with pytest.warns(FallbackWarning, match="after skipping 2"):
            loaded = store.load("r", fallback="previous")
        assert np.array_equal(loaded["w"], state(0)["w"])
        report = verify_store(store, deep=True)
        damaged = report.damaged_generations  # a damaged index is the store's problem too
        assert ("r", 2) in damaged and ("r", 1) not in damaged, report.problems
        ref = store.refs.read("r")
        assert ref is not None and ref.generation == 2  # nothing moved


def test_a_truncated_pack(place: Place) -> None:
    packs, _ = two_saved(place)
    for name in packs:
        place.rewrite(name, place.read(name)[: -CHUNK // 2])
    assert_damage_found_and_fallen_back(place)


def test_a_garbled_object_blob(place: Place) -> None:
    _, objects = two_saved(place)
    for name in objects:  # r@2's root and shard manifest
        data = bytearray(place.read(name))
        data[len(data) // 2] ^= 0x01
        place.rewrite(name, bytes(data))
    assert_damage_found_and_fallen_back(place)


def test_an_index_blob_that_disagrees_with_its_pack(place: Place) -> None:
    """A well-formed index blob, its name checking its bytes, giving two chunks' offsets swapped."""
    packs, _ = two_saved(place)
    (pack,) = packs
    pack_id = pack.removeprefix("packs/").removesuffix(".pack")
    (index,) = [n for n in place.names("index/") if n.startswith(f"index/{pack_id}.")]
    data = place.read(index)
    header = struct.Struct("<8sIIQ")
    _, _, count, pack_size = header.unpack_from(data)
    entries = list(struct.iter_unpack("<32sQQ", data[header.size :]))
    assert count == len(entries) >= 2 and entries[0][2] == entries[1][2]  # two 1 KiB chunks
    (a, a_at, size), (b, b_at, _) = entries[:2]
    entries[:2] = [(a, b_at, size), (b, a_at, size)]
    forged = encode_index(pack_size, entries)
    place.rewrite(index_blob_name(pack_id, forged), forged)
    _delete(place, index)
    assert_damage_found_and_fallen_back(place)
    # verify --deep reports r@2's chunks as damaged (above); the record check names the cause.
    with place.open(create=False) as store:
        check = store.backend.check_index(hash_bytes=True)
    assert len(check.problems) == 2 and all("lists chunk" in p for p in check.problems), check


def _delete(place: Place, name: str) -> None:
    if place.kind == "shared":
        (Path(place.address) / name).unlink()
    else:
        place.client.delete_object(Bucket=place.bucket, Key=place.prefix + name)


# -- two coordinators racing for one ref ---------------------------------------------------


def race_to_advance(address: str, options: dict[str, Any], barrier: Any, results: Any) -> None:
    """Save r@2 from r@1; pause before the ref's compare-and-swap until the other racer is there.

    Both have read r@1 as the parent and written every chunk and manifest; only the
    swap decides.
    """
    import os

    store = castore.open(address, **options)
    advance = store.refs.advance

    def advance_together(*args: Any, **kwargs: Any) -> Any:
        barrier.wait(60)
        return advance(*args, **kwargs)

    store.refs.advance = advance_together  # type: ignore[method-assign]
    try:
        generation = store.save(state(10 + os.getpid() % 1000), run="r", step=2)
        results.put(("won", generation.root))
    except Exception as exc:  # the test inspects which error
        results.put((type(exc).__name__, str(exc)))
    finally:
        store.close()


def test_two_coordinators_racing_for_one_ref_exactly_one_wins(place: Place) -> None:
    saved(place)
    context = process_context()
    barrier, results = context.Barrier(2), context.Queue()
    racers = [
        context.Process(
            target=race_to_advance, args=(place.address, place.options, barrier, results)
        )
        for _ in range(2)
    ]
    for racer in racers:
        racer.start()
    outcomes = sorted(results.get(timeout=120) for _ in racers)
    for racer in racers:
        racer.join(30)
        assert racer.exitcode == 0
    (lost, why), (won, root) = outcomes
    assert won == "won" and lost == "RefConflictError", outcomes
    assert "ref moved" in why and "reload and retry" in why
    with place.open(create=False) as store:
        assert store.resolve("r").id == 2 and store.resolve("r").root == root
        records = list(store.refs.records_backwards("r"))
        assert [(r["generation"], r["root"]) for r in records][0] == (2, root)
        assert len(records) == 2  # one record per advance: the loser logged nothing
        assert verify_store(store, deep=True).ok
