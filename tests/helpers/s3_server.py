"""A real S3 endpoint on the loopback for tests: moto's threaded server.

``s3_endpoint`` (session-scoped) starts ``ThreadedMotoServer`` on a free port
in a child process and stops it at the end; ``s3_bucket`` makes a fresh, uniquely named bucket
per test. Credentials are dummy values passed as arguments, never put in the
environment.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest

from castore.testing.moto import moto_server

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")

DUMMY_KEY = "testing"
DUMMY_SECRET = "testing"
REGION = "us-east-1"
# moto checks AWS's 5 MiB minimum part unless told a smaller one; the store
# enforces its own min_part_size (5 MiB by default) whatever the server says.
TEST_MIN_PART = 256 << 10
_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    # In a child process (castore.testing.moto): the contract's streamed-create
    # test measures the client's peak memory with tracemalloc.
    with moto_server(min_part_size=TEST_MIN_PART) as endpoint:
        yield endpoint


def s3_client(endpoint: str, **overrides: Any) -> Any:
    """A boto3 client on ``endpoint`` with the dummy credentials (or ``overrides``)."""
    settings: dict[str, Any] = {
        "endpoint_url": endpoint,
        "region_name": REGION,
        "aws_access_key_id": DUMMY_KEY,
        "aws_secret_access_key": DUMMY_SECRET,
    }
    settings.update(overrides)
    return boto3.session.Session().client("s3", **settings)


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    name = f"castore-test-{os.getpid()}-{next(_buckets)}"
    s3_client(s3_endpoint).create_bucket(Bucket=name)
    return name


def store_arguments(endpoint: str) -> dict[str, Any]:
    """The S3BlobStore keyword arguments that reach the test server."""
    return {
        "endpoint_url": endpoint,
        "region": REGION,
        "access_key": DUMMY_KEY,
        "secret_key": DUMMY_SECRET,
    }


def store_options(endpoint: str, cache_dir: str) -> dict[str, Any]:
    """The keyword arguments castore.open("s3://...") takes to reach the test server."""
    keys = store_arguments(endpoint)
    return {
        "endpoint_url": endpoint,
        "region": REGION,
        "cache_dir": cache_dir,
        "s3_options": {"access_key": keys["access_key"], "secret_key": keys["secret_key"]},
    }


def kind_of_store(
    request: Any, tmp_path: Any, kind: str, prefix: str
) -> tuple[str, dict[str, Any]]:
    """(location, options to create it with) of a new store of ``kind``: "lmdb" (a local
    store), "shared" (a shared directory) or "s3" (the test server's bucket, under
    ``prefix``). Reopening takes the options less "shared"."""
    if kind == "s3":
        options = store_options(request.getfixturevalue("s3_endpoint"), str(tmp_path / "cache"))
        return f"s3://{request.getfixturevalue('s3_bucket')}/{prefix}", options
    return str(tmp_path / "store"), {"shared": kind == "shared"}


class SlowDown:
    """A botocore ``before-send`` hook: 503 SlowDown to ``count`` requests once ``after`` passed.

    Register it on a client (``client.meta.events.register("before-send.s3.PutObject",
    storm)``): the answered requests never reach the server. ``left`` and
    ``answered`` may be reset between phases of a test.
    """

    def __init__(self, count: int, after: int = 0) -> None:
        self.left, self.after, self.answered = count, after, 0

    def __call__(self, request: Any, **kwargs: Any) -> Any:
        if self.after > 0:
            self.after -= 1
            return None
        if self.left <= 0:
            return None
        self.left -= 1
        self.answered += 1
        body = b"<Error><Code>SlowDown</Code><Message>Please reduce your rate</Message></Error>"
        return injected_response(request, 503, body, {"Content-Type": "application/xml"})


def injected_response(request: Any, status: int, body: bytes, headers: dict[str, str]) -> Any:
    """An HTTP answer botocore takes as the server's, for a ``before-send`` hook to return."""
    from botocore.awsrequest import AWSResponse

    return AWSResponse(request.url, status, headers, _RawBody(body))


class _RawBody:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **kwargs: Any) -> Iterator[bytes]:
        yield self.body
