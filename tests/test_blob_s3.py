"""The blob contract over S3 (moto's HTTP server on the loopback), and S3's own failures.

The contract runs with 256 KiB parts so that its streamed create crosses many
parts; the test server's minimum part is lowered to match (AWS's is 5 MiB: the
store's ``min_part_size`` defaults to it, and one test uploads real 5 MiB parts).
Faults are real HTTP answers: a closed port, refused credentials, a missing
bucket, and 503s injected on the client's ``before-send`` event.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from s3_server import TEST_MIN_PART, SlowDown, injected_response, s3_client, store_arguments

from castore.blob.s3 import S3BlobStore
from castore.errors import (
    BlobConflictError,
    BlobExistsError,
    StoreAccessDeniedError,
    StoreError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from castore.testing import BlobStoreTests

SMALL_PART = TEST_MIN_PART


@pytest.fixture
def small_parts() -> int:
    return SMALL_PART


def _store(endpoint: str, bucket: str, **extra: Any) -> S3BlobStore:
    return S3BlobStore(bucket, "stores/test", **store_arguments(endpoint), **extra)


def _small_part_store(endpoint: str, bucket: str, part: int) -> S3BlobStore:
    """A store that goes multipart at one part and uploads parts of that size."""
    return _store(endpoint, bucket, part_size=part, min_part_size=part, multipart_threshold=part)


class TestS3Blobs(BlobStoreTests):
    # A few parts' worth (the part being filled, its bytes, botocore's request
    # and checksum buffers): a bound that does not grow with the blob's 32 parts.
    streamed_peak_limit = 8 * SMALL_PART

    @pytest.fixture
    def blobs(self, s3_endpoint: str, s3_bucket: str, small_parts: int) -> S3BlobStore:
        return _store(
            s3_endpoint,
            s3_bucket,
            part_size=small_parts,
            min_part_size=small_parts,
            multipart_threshold=4 * small_parts,
            list_page_size=7,
        )


def _uploads(endpoint: str, bucket: str) -> list[Any]:
    return list(s3_client(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def _keys(endpoint: str, bucket: str) -> list[str]:
    listed = s3_client(endpoint).list_objects_v2(Bucket=bucket)
    return [entry["Key"] for entry in listed.get("Contents", [])]


# -- the mapping onto S3 ---------------------------------------------------------------


def test_blobs_are_objects_under_the_prefix_and_versions_are_etags(
    s3_endpoint: str, s3_bucket: str
) -> None:
    blobs = _store(s3_endpoint, s3_bucket)
    version = blobs.swap("refs/main", b"ref bytes", None)
    head = s3_client(s3_endpoint).head_object(Bucket=s3_bucket, Key="stores/test/refs/main")
    assert version.token == head["ETag"]
    s3_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="stores/test/with space", Body=b"")
    s3_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="elsewhere/x", Body=b"")
    assert list(blobs.list()) == ["refs/main"]  # foreign keys are not blobs


def test_real_5_mib_parts_stream_lazily(s3_endpoint: str, s3_bucket: str) -> None:
    part = 5 << 20
    blobs = _store(s3_endpoint, s3_bucket, part_size=part, multipart_threshold=part)
    piece, count = 1 << 20, 11
    consumed: list[int] = []
    seen_uploads: list[int] = []

    def pieces() -> Iterator[bytes]:
        for k in range(count):
            consumed.append(k)
            seen_uploads.append(len(_uploads(s3_endpoint, s3_bucket)))
            yield bytes([k]) * piece

    version = blobs.create("packs/big.pack", pieces())
    assert consumed == list(range(count))
    assert seen_uploads[0] == 0 and seen_uploads[-1] == 1  # a part went up before the end
    assert version.token.strip('"').endswith("-3")  # three parts: 5 + 5 + 1 MiB
    assert blobs.head("packs/big.pack") == count * piece
    assert blobs.get("packs/big.pack", 5 * piece - 2, 5 * piece + 2) == b"\x04\x04\x05\x05"
    assert _uploads(s3_endpoint, s3_bucket) == []


def test_a_failed_multipart_leaves_no_object_and_no_upload(
    s3_endpoint: str, s3_bucket: str, small_parts: int
) -> None:
    blobs = _small_part_store(s3_endpoint, s3_bucket, small_parts)

    def failing() -> Iterator[bytes]:
        yield bytes(3 * small_parts)  # three parts are up when the source breaks
        raise RuntimeError("the source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        blobs.create("packs/p", failing())
    assert _keys(s3_endpoint, s3_bucket) == [] and _uploads(s3_endpoint, s3_bucket) == []
    blobs.create("packs/p", b"first")
    with pytest.raises(BlobExistsError):  # refused at CompleteMultipartUpload
        blobs.create("packs/p", bytes(3 * small_parts))
    assert blobs.get("packs/p") == b"first"
    assert _uploads(s3_endpoint, s3_bucket) == []


def test_the_mid_multipart_fault_point_fires_after_the_first_part(
    s3_endpoint: str, s3_bucket: str, small_parts: int
) -> None:
    import castore.support.faults

    blobs = _small_part_store(s3_endpoint, s3_bucket, small_parts)
    blobs.create("packs/single", b"one request, no parts")  # no multipart: no fault
    castore.support.faults.arm("blob.mid_multipart", "raise")
    try:
        with pytest.raises(castore.support.faults.InjectedFault):
            blobs.create("packs/p", bytes(2 * small_parts))
    finally:
        castore.support.faults.disarm()
    # Raised (not killed), the upload is aborted: nothing of it is left.
    assert _keys(s3_endpoint, s3_bucket) == ["stores/test/packs/single"]
    assert _uploads(s3_endpoint, s3_bucket) == []


def test_a_buffer_past_the_threshold_goes_up_in_parts(
    s3_endpoint: str, s3_bucket: str, small_parts: int
) -> None:
    blobs = _small_part_store(s3_endpoint, s3_bucket, small_parts)
    data = bytes(range(256)) * (small_parts * 5 // 2 // 256)
    version = blobs.create("packs/p", memoryview(data))
    assert version.token.strip('"').endswith("-3")
    assert blobs.get("packs/p") == data


def test_part_sizes_respect_the_s3_limits() -> None:
    with pytest.raises(ValueError, match="minimum part"):
        S3BlobStore("b", part_size=1 << 20, client=object(), check_bucket=False)
    with pytest.raises(ValueError, match="largest single PutObject"):
        S3BlobStore("b", multipart_threshold=6 << 30, client=object(), check_bucket=False)


# -- faults ----------------------------------------------------------------------------


def test_a_missing_bucket_is_named(s3_endpoint: str) -> None:
    with pytest.raises(StoreNotFoundError, match="'no-such-bucket' does not exist") as refused:
        _store(s3_endpoint, "no-such-bucket")
    assert "\n" not in str(refused.value)
    unchecked = _store(s3_endpoint, "no-such-bucket", check_bucket=False)
    with pytest.raises(StoreNotFoundError, match="no-such-bucket"):
        unchecked.create("x", b"x")


def test_refused_credentials_say_so(s3_endpoint: str, s3_bucket: str) -> None:
    # moto checks signatures only when told to (its documented reset-auth endpoint).
    previous = requests.post(f"{s3_endpoint}/moto-api/reset-auth", data=b"0").json()
    try:
        with pytest.raises(StoreAccessDeniedError, match="refused the credentials") as refused:
            S3BlobStore(s3_bucket, endpoint_url=s3_endpoint, region="us-east-1",
                        access_key="AKIAWRONGWRONGWRONG1", secret_key="wrong")  # fmt: skip
        assert "\n" not in str(refused.value)
        assert isinstance(refused.value, PermissionError)
    finally:
        requests.post(
            f"{s3_endpoint}/moto-api/reset-auth",
            data=str(previous["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]).encode(),
        )


def test_an_endpoint_that_is_down_fails_within_the_bounded_wait() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again before the store connects
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="cannot reach") as refused:
        S3BlobStore("bucket", **store_arguments(f"http://127.0.0.1:{port}"),
                    connect_timeout=1.0, max_attempts=3)  # fmt: skip
    assert time.monotonic() - started < 15
    assert "\n" not in str(refused.value) and isinstance(refused.value, ConnectionError)


def test_an_endpoint_that_never_answers_fails_within_the_bounded_wait() -> None:
    with socket.socket() as silent:  # accepts connections (the kernel does), answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="did not answer") as refused:
            S3BlobStore("bucket", **store_arguments(endpoint),
                        read_timeout=0.5, max_attempts=2)  # fmt: skip
        elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 10, elapsed  # two attempts of 0.5 s, and a backoff
    assert "\n" not in str(refused.value)


def test_a_503_storm_is_retried_then_refused_in_one_line(s3_endpoint: str, s3_bucket: str) -> None:
    blobs = _store(s3_endpoint, s3_bucket, max_attempts=4)
    storm = SlowDown(3)  # fewer than max_attempts: the fourth gets through
    blobs.client.meta.events.register("before-send.s3.PutObject", storm)
    blobs.swap("refs/r", b"one", None)
    assert storm.answered == 3 and blobs.get("refs/r") == b"one"

    storm.left, storm.answered = 100, 0  # more than max_attempts: the store gives up, typed
    with pytest.raises(StoreUnavailableError, match="after 4 attempts") as refused:
        blobs.create("packs/p", b"never")
    assert storm.answered == 4  # the attempts are bounded: 4 in all
    assert "\n" not in str(refused.value)
    storm.left = 0
    assert blobs.head("packs/p") is None


def test_errors_are_store_errors(s3_endpoint: str) -> None:
    assert issubclass(StoreUnavailableError, StoreError)
    assert issubclass(StoreAccessDeniedError, StoreError)


# -- broken control --------------------------------------------------------------------


class _SwapWithoutIfMatch(S3BlobStore):
    """Overwrites whatever is there when a version is expected: no compare."""

    def _conditional_put(self, name: str, body: memoryview, **condition: str) -> Any:
        condition.pop("IfMatch", None)
        return super()._conditional_put(name, body, **condition)


def test_the_race_test_fails_a_swap_without_if_match(s3_endpoint: str, s3_bucket: str) -> None:
    broken = _SwapWithoutIfMatch(s3_bucket, "broken", **store_arguments(s3_endpoint))
    with pytest.raises(AssertionError) as failed:
        BlobStoreTests().test_racing_swaps_from_one_version_exactly_one_wins(broken)
    print(f"broken control: {str(failed.value).splitlines()[0]}")
    sound = S3BlobStore(s3_bucket, "sound", **store_arguments(s3_endpoint))
    BlobStoreTests().test_racing_swaps_from_one_version_exactly_one_wins(sound)
    with pytest.raises(BlobConflictError):
        sound.swap("refs/r", b"x", None)


def test_castore_imports_without_boto3_and_an_s3_store_says_what_is_missing() -> None:
    code = (
        "import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
        "import castore, castore.blob\n"
        "from castore.blob import S3BlobStore\n"
        "from castore.errors import UnsupportedBackendError\n"
        "try:\n"
        "    S3BlobStore('bucket')\n"
        "except UnsupportedBackendError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "pip install 'castore[s3]'" in result.stdout


class _Answers:
    """Answers the first requests with canned HTTP errors; ``first`` runs before each."""

    def __init__(self, status: int, code: str, count: int, first: Any = None) -> None:
        self.status, self.code, self.left, self.first = status, code, count, first

    def __call__(self, request: Any, **kwargs: Any) -> Any:
        if self.left <= 0:
            return None
        self.left -= 1
        if self.first is not None:
            self.first()
        body = f"<Error><Code>{self.code}</Code><Message>injected</Message></Error>".encode()
        return injected_response(request, self.status, body, {})


def test_a_conditional_request_conflict_is_retried(s3_endpoint: str, s3_bucket: str) -> None:
    blobs = _store(s3_endpoint, s3_bucket)
    conflicts = _Answers(409, "ConditionalRequestConflict", 2)
    blobs.client.meta.events.register("before-send.s3.PutObject", conflicts)
    first = blobs.swap("refs/r", b"one", None)
    assert conflicts.left == 0 and blobs.read_versioned("refs/r") == (b"one", first)
    conflicts.left = 100  # it never settles: a conflict, nothing written
    with pytest.raises(BlobConflictError):
        blobs.swap("refs/r", b"two", first)
    conflicts.left = 0
    assert blobs.read_versioned("refs/r") == (b"one", first)


def test_a_retried_write_that_had_landed_is_still_ours(s3_endpoint: str, s3_bucket: str) -> None:
    # The first attempt reaches S3 and is applied, but its answer is lost (a 503
    # in its place); the retry then meets its own object and gets 412.
    blobs = _store(s3_endpoint, s3_bucket)
    first = blobs.swap("refs/r", b"one", None)
    other = s3_client(s3_endpoint)

    def lands() -> None:
        other.put_object(
            Bucket=s3_bucket, Key="stores/test/refs/r", Body=b"two", IfMatch=first.token
        )

    lost = _Answers(503, "ServiceUnavailable", 1, first=lands)
    blobs.client.meta.events.register("before-send.s3.PutObject", lost)
    second = blobs.swap("refs/r", b"two", first)
    assert blobs.read_versioned("refs/r") == (b"two", second)

    def someone_else() -> None:  # another writer's bytes: a real conflict
        other.put_object(
            Bucket=s3_bucket, Key="stores/test/refs/r", Body=b"x", IfMatch=second.token
        )

    lost.left, lost.first = 1, someone_else
    with pytest.raises(BlobConflictError):
        blobs.swap("refs/r", b"three", second)
    assert blobs.get("refs/r") == b"x"


def test_a_conflict_at_complete_aborts_the_upload(
    s3_endpoint: str, s3_bucket: str, small_parts: int
) -> None:
    blobs = _small_part_store(s3_endpoint, s3_bucket, small_parts)
    conflict = _Answers(409, "ConditionalRequestConflict", 1)
    blobs.client.meta.events.register("before-send.s3.CompleteMultipartUpload", conflict)
    with pytest.raises(BlobConflictError, match="nothing was written"):
        blobs.create("packs/p", bytes(3 * small_parts))
    assert _keys(s3_endpoint, s3_bucket) == [] and _uploads(s3_endpoint, s3_bucket) == []
    blobs.create("packs/p", bytes(3 * small_parts))  # a new create goes through
    assert blobs.head("packs/p") == 3 * small_parts


def test_a_retried_completion_that_had_landed_is_still_ours(
    s3_endpoint: str, s3_bucket: str, small_parts: int
) -> None:
    # The first completion is applied but its answer lost (a 503); the retry is
    # answered 412, as the object now exists (moto replays a completed upload
    # with 200 instead, so the 412 is injected too).
    blobs = _small_part_store(s3_endpoint, s3_bucket, small_parts)
    calls: list[int] = []

    def lands(request: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            sent = requests.post(request.url, data=request.body, headers=dict(request.headers))
            assert sent.status_code == 200, sent.text
            return injected_response(request, 503, b"<Error><Code>SlowDown</Code></Error>", {})
        if len(calls) == 2:
            body = b"<Error><Code>PreconditionFailed</Code><Message>exists</Message></Error>"
            return injected_response(request, 412, body, {})
        return None

    blobs.client.meta.events.register("before-send.s3.CompleteMultipartUpload", lands)
    data = bytes(range(256)) * (3 * small_parts // 256)
    version = blobs.create("packs/p", data)
    assert len(calls) == 2
    assert blobs.get("packs/p") == data and version.token == blobs._head_etag("packs/p")
    assert _uploads(s3_endpoint, s3_bucket) == []
    with pytest.raises(BlobExistsError):  # without a lost answer, a 412 is a 412
        blobs.create("packs/p", data)


def test_more_than_10000_parts_is_refused_before_any_upload(
    s3_endpoint: str, s3_bucket: str
) -> None:
    blobs = _store(s3_endpoint, s3_bucket)
    # 1-byte parts, set past the constructor's checks, stand in for a 160 GB buffer.
    blobs.part_size = blobs.multipart_threshold = 1
    with pytest.raises(StoreError, match="more than 10000 parts"):
        blobs.create("packs/p", bytes(10_001))
    assert _uploads(s3_endpoint, s3_bucket) == [] and blobs.head("packs/p") is None
