"""Blobs in an S3-protocol bucket (AWS S3, MinIO, Ceph RGW), through boto3.

Each primitive is one request, or one multipart upload, as AWS documents the
S3 API (docs/FORMAT_BLOBS.md, "S3"):

* **create** is ``PutObject`` with ``If-None-Match: *``; data larger than
  ``multipart_threshold``, and iterables that fill more than one part, go up
  as a multipart upload of ``part_size`` parts (AWS: at least 5 MiB except
  the last, at most 10,000) finished by ``CompleteMultipartUpload`` with
  ``If-None-Match: *``. At most one part is held in memory; any failure
  aborts the upload, so neither an object nor a pending upload is left.
* **swap** is ``PutObject`` with ``If-Match: <etag>`` (``If-None-Match: *``
  when creating); 412 means another version is there.
* **get** is ``GetObject`` with ``Range``; the ``Content-Range`` total checks
  that the range lay inside the object. **list** is ``ListObjectsV2``, paged.
  **delete** is ``HeadObject`` (did it exist?) then ``DeleteObject``.

Versions are ETags. A 409 ``ConditionalRequestConflict`` (a concurrent
conditional write; nothing written) on ``PutObject`` is retried as AWS
advises, and past ``CONFLICT_RETRIES`` raised as BlobConflictError (by create
too). On ``CompleteMultipartUpload`` AWS asks for a new upload of every part,
which a stream cannot replay: the upload is aborted and BlobConflictError
raised. Throttling and 5xx are retried with backoff by botocore's standard
mode, within ``max_attempts`` and bounded connect/read timeouts. A retried
conditional write whose first attempt did land answers 412 to the retry; the
store then counts the write as its own when the object holds the bytes it
wrote (PutObject), or when its upload is gone as completed (an abort answers
NoSuchUpload; CompleteMultipartUpload). A GetObject whose body comes short
or whose connection breaks mid-body is sent again (botocore retries a request
only until its answer's headers arrive), as many times as the client's retry
policy allows; a connection that keeps breaking is StoreUnavailableError.

boto3 is imported only when a store is built: ``import castore`` needs no boto3.

One idea, about 640 lines because each primitive's request, its retries and
the mapping of S3's answers to castore's errors sit together, as
``blob/base.py`` maps each primitive to its request.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from castore.blob.base import (
    MAX_MUTABLE_BLOB,
    BlobStore,
    Version,
    check_expected,
    check_mutable_size,
    check_range,
    pieces_of,
    validate_blob_name,
    validate_blob_prefix,
)
from castore.blob.s3_errors import (
    CONFLICT_RETRIES,
    error_code,
    never_sent,
    retry_attempts,
    still_conflicting,
    translate,
)
from castore.errors import (
    BlobConflictError,
    BlobExistsError,
    BlobNotFoundError,
    BlobTooLargeError,
    CastoreError,
    InvalidNameError,
    StoreError,
    StoreUnavailableError,
    UnsupportedBackendError,
)
from castore.format.hashing import Buffer
from castore.support.faults import fault_point

MIB = 1 << 20
AWS_MIN_PART = 5 * MIB  # every part but the last (AWS multipart limits)
AWS_MAX_PARTS = 10_000
AWS_MAX_PUT = 5 << 30  # the largest object one PutObject writes

_Fetched = TypeVar("_Fetched")


class S3BlobStore(BlobStore):
    """Blobs as the objects under ``prefix`` in ``bucket``; versions are ETags.

    ``client`` is a ready boto3 S3 client (its own settings then apply);
    otherwise one is built from the standard boto3 chain (environment,
    ``AWS_ENDPOINT_URL``, config files, instance roles), with the arguments
    given here taking precedence. The bucket is checked once, here.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        part_size: int = 16 * MIB,
        min_part_size: int = AWS_MIN_PART,
        multipart_threshold: int = 64 * MIB,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_attempts: int = 5,
        list_page_size: int = 1000,
        check_bucket: bool = True,
    ) -> None:
        if part_size < min_part_size:
            raise ValueError(f"part_size {part_size} is below the minimum part {min_part_size}")
        if not part_size <= multipart_threshold <= AWS_MAX_PUT:
            raise ValueError(
                f"multipart_threshold {multipart_threshold} must lie between part_size "
                f"{part_size} and {AWS_MAX_PUT} (the largest single PutObject)"
            )
        self.bucket = bucket
        self.prefix = _key_prefix(prefix)
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold
        self.list_page_size = list_page_size
        self.client = client or _build_client(
            endpoint_url=endpoint_url,
            region=region,
            access_key=access_key,
            secret_key=secret_key,
            session_token=session_token,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_attempts=max_attempts,
        )
        self._errors = _errors_module()
        # After each attempt of a PutObject: could its request have reached the server?
        self.client.meta.events.register(
            "response-received.s3.PutObject", _note_put_attempt, unique_id=_NOTE_ID
        )
        if check_bucket:
            self._call("HeadBucket", None, self.client.head_bucket, Bucket=bucket)

    def __repr__(self) -> str:
        return f"S3BlobStore({self.bucket!r}, {self.prefix!r})"

    # -- create ----------------------------------------------------------------------

    def create(self, name: str, data: Buffer | Iterable[Buffer]) -> Version:
        validate_blob_name(name)
        candidate: Any = data
        try:
            whole = memoryview(candidate).cast("B")
        except TypeError:
            return self._create_streamed(name, pieces_of(data))
        if whole.nbytes <= self.multipart_threshold:
            return self._put_new(name, whole)
        if -(-whole.nbytes // self.part_size) > AWS_MAX_PARTS:
            raise self._too_many_parts(name)  # before a single request
        return self._multipart(name, _slices(whole, self.part_size))

    def _create_streamed(self, name: str, pieces: Iterator[memoryview]) -> Version:
        parts = _parts(pieces, self.part_size)
        first, last = next(parts)
        if last:  # it fits in one part: one request
            return self._put_new(name, memoryview(first))
        return self._multipart(name, itertools.chain([first], (part for part, _ in parts)))

    def _put_new(self, name: str, body: memoryview) -> Version:
        try:
            response = self._conditional_put(name, body, IfNoneMatch="*")
        except _Precondition as failed:
            if failed.retried and self._holds(name, body):
                return Version(self._head_etag(name))
            raise BlobExistsError(
                f"blob {name!r} exists in {self}; it keeps its content", name=name
            ) from None
        return Version(response["ETag"])

    def _multipart(self, name: str, parts: Iterator[bytearray | memoryview]) -> Version:
        key = self._key(name)
        started = self._call(
            "CreateMultipartUpload",
            name,
            self.client.create_multipart_upload,
            Bucket=self.bucket,
            Key=key,
        )
        upload = started["UploadId"]
        try:
            done = self._upload_parts(name, key, upload, parts)
            response = self._complete(name, key, upload, done)
        except BaseException:
            self._abort(key, upload)
            raise
        return Version(response["ETag"])

    def _upload_parts(
        self, name: str, key: str, upload: str, parts: Iterator[bytearray | memoryview]
    ) -> list[dict[str, Any]]:
        done: list[dict[str, Any]] = []
        for number, body in enumerate(parts, start=1):
            if number > AWS_MAX_PARTS:
                raise self._too_many_parts(name)
            answer = self._call(
                "UploadPart",
                name,
                self.client.upload_part,
                Bucket=self.bucket,
                Key=key,
                UploadId=upload,
                PartNumber=number,
                Body=_body(body),
            )
            done.append({"ETag": answer["ETag"], "PartNumber": number})
            if number == 1:
                fault_point("blob.mid_multipart")  # a part stored, the upload incomplete
        return done

    def _too_many_parts(self, name: str) -> StoreError:
        return StoreError(
            f"blob {name!r} needs more than {AWS_MAX_PARTS} parts of {self.part_size} bytes "
            "(the S3 limit): build the store with a larger part_size",
            name=name,
        )

    def _complete(self, name: str, key: str, upload: str, done: list[dict[str, Any]]) -> Any:
        try:
            return self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload,
                MultipartUpload={"Parts": done},
                IfNoneMatch="*",
            )
        except self._errors.ClientError as error:
            code = error_code(error)
            if code in ("PreconditionFailed", "412"):
                if retry_attempts(error) > 0 and self._was_completed(key, upload):
                    return {"ETag": self._head_etag(name)}  # our first attempt landed
                raise BlobExistsError(
                    f"blob {name!r} exists in {self}; it keeps its content", name=name
                ) from None
            if code == "ConditionalRequestConflict":
                # AWS: start a new upload and send every part again; the parts
                # are gone from memory, so the caller retries the create.
                raise still_conflicting(name, 1) from None
            raise self._translate(error, "CompleteMultipartUpload", name) from None
        except self._errors.BotoCoreError as error:
            raise self._translate(error, "CompleteMultipartUpload", name) from None

    def _was_completed(self, key: str, upload: str) -> bool:
        """Whether our upload is gone because it completed: aborting it says NoSuchUpload.

        Only this writer completes or aborts its upload; a lifecycle rule that
        aborts incomplete uploads acts after days, not within one retry.
        """
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        except self._errors.ClientError as error:
            return error_code(error) == "NoSuchUpload"
        return False

    def _abort(self, key: str, upload: str) -> None:
        # Best effort: the failure being raised matters more than a failed cleanup.
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        except Exception:
            pass

    # -- reads -----------------------------------------------------------------------

    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        validate_blob_name(name)
        if not _plain_range(start, end) or start == end:
            return self._get_checked(name, start, end)  # no GetObject: a head says the size
        return self._again_if_short(name, lambda: self._get_once(name, start, end))

    def _get_once(self, name: str, start: int, end: int | None) -> bytes:
        ranged = {} if (start, end) == (0, None) else {"Range": _range_header(start, end)}
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(name), **ranged)
        except self._errors.ClientError as error:
            if error_code(error) in ("InvalidRange", "416"):
                return self._get_checked(name, start, end)
            raise self._translate(error, "GetObject", name) from None
        except self._errors.BotoCoreError as error:
            raise self._translate(error, "GetObject", name) from None
        size = _total_size(response)
        span = check_range(name, size, start, end)  # a range past the end came back short
        body = self._read_body(name, response)
        if len(body) != span.length:
            raise StoreError(
                f"blob {name!r}: S3 returned {len(body)} bytes for a range of {span.length}",
                name=name,
            )
        return body

    def _get_checked(self, name: str, start: int, end: int | None) -> bytes:
        size = self.head(name)
        if size is None:
            raise BlobNotFoundError(f"no blob {name!r} in {self}", name=name)
        span = check_range(name, size, start, end)
        return b"" if span.length == 0 else self.get(name, span.start, span.end)

    def head(self, name: str) -> int | None:
        validate_blob_name(name)
        found = self._head(name)
        return None if found is None else int(found["ContentLength"])

    def read_versioned(self, name: str) -> tuple[bytes, Version] | None:
        validate_blob_name(name)
        return self._again_if_short(name, lambda: self._read_versioned_once(name))

    def _read_versioned_once(self, name: str) -> tuple[bytes, Version] | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
        except self._errors.ClientError as error:
            if error_code(error) in ("NoSuchKey", "404"):
                return None
            raise self._translate(error, "GetObject", name) from None
        except self._errors.BotoCoreError as error:
            raise self._translate(error, "GetObject", name) from None
        if int(response["ContentLength"]) > MAX_MUTABLE_BLOB:
            response["Body"].close()
            raise BlobTooLargeError(
                f"blob {name!r} is {response['ContentLength']} bytes, more than any swap writes",
                name=name,
            )
        return self._read_body(name, response), Version(response["ETag"])

    # -- compare-and-swap ------------------------------------------------------------

    def swap(self, name: str, data: Buffer, expected: Version | None) -> Version:
        validate_blob_name(name)
        body = memoryview(data).cast("B")
        check_mutable_size(name, body.nbytes)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected.token}
        _PUTS.reached, _PUTS.refused = False, 0
        try:
            response = self._conditional_put(name, body, **condition)
        except StoreUnavailableError as lost:
            # A swap is a commit point: its caller may say "not written" only on proof,
            # that is attempts seen (botocore told of them) and none of them sent.
            if _PUTS.reached or not _PUTS.refused:
                raise
            raise never_sent(lost) from None
        except _Precondition as failed:
            if failed.retried and self._holds(name, body):
                return Version(self._head_etag(name))
            found = self._head(name)
            current = None if found is None else Version(found["ETag"])
            check_expected(name, current, expected)
            raise BlobConflictError(  # it changed, then changed back, while we were refused
                f"compare-and-swap of blob {name!r} lost a race: another writer changed it",
                name=name,
            ) from None
        return Version(response["ETag"])

    def _conditional_put(self, name: str, body: memoryview, **condition: str) -> Any:
        """PutObject under ``condition``; _Precondition on 412, or on 404 against an ETag."""
        for attempt in range(CONFLICT_RETRIES):
            try:
                return self.client.put_object(
                    Bucket=self.bucket, Key=self._key(name), Body=_body(body), **condition
                )
            except self._errors.ClientError as error:
                code = error_code(error)
                retried = retry_attempts(error) > 0
                if code in ("PreconditionFailed", "412"):
                    raise _Precondition(retried) from None
                if code in ("NoSuchKey", "404") and "IfMatch" in condition:
                    raise _Precondition(retried) from None  # AWS: If-Match on no object is 404
                if code != "ConditionalRequestConflict":
                    raise self._translate(error, "PutObject", name) from None
                if attempt == CONFLICT_RETRIES - 1:
                    raise still_conflicting(name, CONFLICT_RETRIES) from None
                _backoff(attempt)
            except self._errors.BotoCoreError as error:
                raise self._translate(error, "PutObject", name) from None
        raise AssertionError("unreachable")

    def _holds(self, name: str, body: memoryview) -> bool:
        """Whether the blob holds exactly ``body`` (a retried write that did land)."""
        try:
            return self.get(name) == body
        except BlobNotFoundError:
            return False

    # -- list and delete -------------------------------------------------------------

    def list(self, prefix: str = "") -> Iterator[str]:
        for name, _ in self.list_sizes(prefix):
            yield name

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        validate_blob_prefix(prefix)
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket,
            Prefix=self.prefix + prefix,
            PaginationConfig={"PageSize": self.list_page_size},
        )
        try:
            for page in pages:
                for entry in page.get("Contents", ()):
                    name = entry["Key"][len(self.prefix) :]
                    if _is_blob_name(name):  # foreign keys under the prefix are not blobs
                        yield name, int(entry["Size"])
        except (self._errors.ClientError, self._errors.BotoCoreError) as error:
            raise self._translate(error, "ListObjectsV2", None) from None

    def delete(self, name: str) -> bool:
        validate_blob_name(name)
        existed = self._head(name) is not None
        self._call(
            "DeleteObject", name, self.client.delete_object, Bucket=self.bucket, Key=self._key(name)
        )
        return existed

    # -- requests and their errors ---------------------------------------------------

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _head(self, name: str) -> Any:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except self._errors.ClientError as error:
            if error_code(error) in ("NoSuchKey", "404"):
                return None
            raise self._translate(error, "HeadObject", name) from None
        except self._errors.BotoCoreError as error:
            raise self._translate(error, "HeadObject", name) from None

    def _head_etag(self, name: str) -> str:
        found = self._head(name)
        if found is None:
            raise BlobNotFoundError(f"no blob {name!r} in {self}", name=name)
        return str(found["ETag"])

    def _read_body(self, name: str, response: Any) -> bytes:
        try:
            return bytes(response["Body"].read())
        except self._errors.BotoCoreError as error:  # IncompleteRead, a broken connection
            raise _ShortBody(error) from None

    def _again_if_short(self, name: str, fetch: Callable[[], _Fetched]) -> _Fetched:
        """``fetch()`` (a GetObject and the read of its body), sent again when the body
        came short or the connection broke mid-body: botocore retries a request only
        until its answer's headers arrive. As many attempts as the client's retry
        policy allows, with castore's backoff; then StoreUnavailableError.
        """
        attempts = _total_attempts(self.client)
        for attempt in range(attempts):
            try:
                return fetch()
            except _ShortBody as short:
                if attempt == attempts - 1:
                    raise self._translate(short.error, "GetObject", name) from None
                _backoff(attempt)
        raise AssertionError("unreachable")

    def _call(self, operation: str, name: str | None, method: Any, **arguments: Any) -> Any:
        try:
            return method(**arguments)
        except (self._errors.ClientError, self._errors.BotoCoreError) as error:
            raise self._translate(error, operation, name) from None

    def _translate(self, error: Exception, operation: str, name: str | None) -> CastoreError:
        return translate(
            error,
            self._errors,
            store=repr(self),
            bucket=self.bucket,
            where=f"s3://{self.bucket}/{self.prefix}{name or ''}",
            endpoint=str(getattr(self.client.meta, "endpoint_url", "?")),
            operation=operation,
            name=name,
        )


class _ShortBody(Exception):
    """A GetObject's body could not be read whole (``error``: botocore's)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _Precondition(Exception):
    """A conditional write was refused (412); ``retried``: botocore had resent it."""

    def __init__(self, retried: bool) -> None:
        super().__init__("precondition failed")
        self.retried = retried


# This thread's PutObject attempts since a swap began: .reached (one may have been
# sent) and .refused (how many were never sent).
_PUTS = threading.local()
_NOTE_ID = "castore-put-attempts"


def _note_put_attempt(exception: Exception | None = None, **_: Any) -> None:
    """botocore's ``response-received`` event, after every attempt of a PutObject.

    An answer, a read timeout or a broken connection all leave the server free to
    apply the write (now, or later); only a connection never made proves it was not
    sent: refused, or timed out connecting.
    """
    import botocore.exceptions as errors

    if isinstance(exception, (errors.EndpointConnectionError, errors.ConnectTimeoutError)):
        _PUTS.refused = getattr(_PUTS, "refused", 0) + 1
    else:
        _PUTS.reached = True


def _build_client(
    *,
    endpoint_url: str | None,
    region: str | None,
    access_key: str | None,
    secret_key: str | None,
    session_token: str | None,
    connect_timeout: float,
    read_timeout: float,
    max_attempts: int,
) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise UnsupportedBackendError("S3 stores need boto3: pip install 'castore[s3]'") from None
    session = boto3.session.Session(
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        aws_session_token=session_token,
        region_name=region,
    )
    config = Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"mode": "standard", "total_max_attempts": max_attempts},
        max_pool_connections=32,
    )
    # endpoint_url None leaves boto3 to read AWS_ENDPOINT_URL(_S3) and its config files.
    return session.client("s3", endpoint_url=endpoint_url, config=config)


def _errors_module() -> Any:
    import botocore.exceptions

    return botocore.exceptions


def _key_prefix(prefix: str) -> str:
    stripped = prefix.strip("/")
    if not stripped:
        return ""
    validate_blob_name(stripped)
    return stripped + "/"


def _is_blob_name(name: str) -> bool:
    try:
        validate_blob_name(name)
    except InvalidNameError:
        return False
    return True


def _total_attempts(client: Any) -> int:
    """The attempts per request the client's retry policy allows (botocore's default: 5)."""
    retries = getattr(client.meta.config, "retries", None) or {}
    if "total_max_attempts" in retries:
        return max(1, int(retries["total_max_attempts"]))
    if "max_attempts" in retries:  # botocore's older spelling counts retries only
        return max(1, int(retries["max_attempts"]) + 1)
    return 5


def _backoff(attempt: int) -> None:
    time.sleep(min(0.05 * 2**attempt, 1.0))


def _plain_range(start: object, end: object) -> bool:
    """A range that may lie inside the blob: non-negative ints, not inverted."""
    if not isinstance(start, int) or not (end is None or isinstance(end, int)):
        return False
    return start >= 0 and (end is None or end >= start)


def _range_header(start: int, end: int | None) -> str:
    return f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"


def _total_size(response: Any) -> int:
    """The object's size: the total of ``Content-Range``, or the length of a whole GET."""
    content_range = response.get("ContentRange")
    if content_range:
        return int(str(content_range).rsplit("/", 1)[1])
    return int(response["ContentLength"])


def _body(data: bytes | bytearray | memoryview) -> bytes | bytearray:
    """A request body for ``data``, without a copy where botocore can take it as it is."""
    if isinstance(data, (bytes, bytearray)):
        return data
    whole = data.obj
    if isinstance(whole, (bytes, bytearray)) and data.nbytes == len(whole):
        return whole
    return bytes(data)


def _slices(whole: memoryview, size: int) -> Iterator[memoryview]:
    for at in range(0, whole.nbytes, size):
        yield whole[at : at + size]


def _parts(pieces: Iterator[memoryview], size: int) -> Iterator[tuple[bytearray, bool]]:
    """Regroup ``pieces`` into parts of ``size`` bytes (the last may be shorter), each
    with whether it is the last. One part is filled at a time, in place; to tell the
    last part, at most one piece beyond it is read.
    """
    part, filled = bytearray(size), 0
    pending: memoryview | None = memoryview(b"")
    while pending is not None:
        if not pending.nbytes:
            pending = next(pieces, None)
            continue
        take = min(size - filled, pending.nbytes)
        part[filled : filled + take] = pending[:take]
        filled, pending = filled + take, pending[take:]
        if filled == size:
            while pending is not None and not pending.nbytes:
                pending = next(pieces, None)
            yield part, pending is None
            if pending is None:
                return
            part, filled = bytearray(size), 0
    del part[filled:]  # in place: no second buffer
    yield part, True
