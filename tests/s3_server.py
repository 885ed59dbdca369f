"""A real S3 endpoint on the loopback for tests: moto's threaded server.

``s3_endpoint`` (session-scoped) starts ``ThreadedMotoServer`` on a free port
in a child process and stops it at the end; ``s3_bucket`` makes a fresh, uniquely named bucket
per test. Credentials are dummy values passed as arguments, never put in the
environment.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")

DUMMY_KEY = "testing"
DUMMY_SECRET = "testing"
REGION = "us-east-1"
# moto checks AWS's 5 MiB minimum part unless told a smaller one; the store
# enforces its own min_part_size (5 MiB by default) whatever the server says.
TEST_MIN_PART = 256 << 10
_buckets = itertools.count()


# Run in a child process so that the server's memory is not the client's: the
# contract's streamed-create test measures the client's peak with tracemalloc.
# moto answers on threads and checks If-None-Match / If-Match, then writes,
# without a lock: under load two racers could both win, where S3 documents a
# conditional write as atomic. One lock around each request gives the emulator
# S3's atomicity; the client's requests still race each other on the wire.
_SERVE = """
import sys, threading
from moto.moto_server import threaded_moto_server

SERIALIZE = True
one_at_a_time = threading.Lock()

class Atomic(threaded_moto_server.DomainDispatcherApplication):
    def __call__(self, environ, start_response):
        with one_at_a_time:
            return super().__call__(environ, start_response)

if SERIALIZE:
    threaded_moto_server.DomainDispatcherApplication = Atomic
server = threaded_moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("%s:%d" % server.get_host_and_port(), flush=True)
sys.stdin.read()  # until the parent closes it
server.stop()
"""


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    env = dict(os.environ, S3_UPLOAD_PART_MIN_SIZE=str(TEST_MIN_PART))
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        assert server.stdout is not None
        address = server.stdout.readline().strip()
        if not address:
            raise RuntimeError("the moto server did not start")
        yield f"http://{address}"
    finally:
        assert server.stdin is not None
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


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
