"""S3 answers lost or cut short after the server acted: saves, loads and leases stay truthful.

A fault proxy (tests/s3_fault_proxy.py) sits between castore and moto's server:
it drops the answer to a request the server *applied* (a write that happened,
its reply never arriving) or cuts a GET's body short. castore must tell what
happened from the store itself: a save whose ref swap landed returns normally
and logs once; one whose outcome cannot be learned raises CommitUnknownError;
a short body is read again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from blob_places import Place, s3_place
from s3_fault_proxy import ALWAYS, FaultProxy

from castore.errors import StoreUnavailableError

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
