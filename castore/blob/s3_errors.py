"""How S3 answers map onto castore's typed errors (for :mod:`castore.blob.s3`).

Every botocore error becomes one error in one line that says what to do: a
missing bucket StoreNotFoundError, refused credentials StoreAccessDeniedError
(PermissionError), an endpoint that is down, silent, kept answering
5xx/throttling or kept breaking connections (closed, reset, a body cut short)
past the retries StoreUnavailableError (ConnectionError), a
missing key BlobNotFoundError; anything else a StoreError with S3's code.
botocore is never imported here: the caller passes ``botocore.exceptions``.
"""

from __future__ import annotations

from typing import Any

from castore.errors import (
    BlobConflictError,
    BlobNotFoundError,
    CastoreError,
    StoreAccessDeniedError,
    StoreError,
    StoreNotFoundError,
    StoreUnavailableError,
)

CONFLICT_RETRIES = 5  # 409 ConditionalRequestConflict on PutObject: AWS says retry the write

_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "ExpiredToken",
        "InvalidToken",
        "InvalidClientTokenId",
        "403",
    }
)
_UNAVAILABLE_CODES = frozenset(
    {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling"}
)


def translate(
    error: Exception,
    errors: Any,
    *,
    store: str,
    bucket: str,
    where: str,
    endpoint: str,
    operation: str,
    name: str | None,
) -> CastoreError:
    """One typed castore error, in one line, for a botocore error.

    ``errors`` is ``botocore.exceptions`` (imported by the caller, lazily);
    ``where`` the ``s3://`` address of the blob or prefix, ``store`` its store.
    """
    if not isinstance(error, errors.ClientError):
        return _transport_error(error, errors, bucket, where, endpoint, operation)
    code = error_code(error)
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    message = error.response.get("Error", {}).get("Message", "")
    if code == "NoSuchBucket" or (operation == "HeadBucket" and code in ("404", "NotFound")):
        return StoreNotFoundError(
            f"S3 bucket {bucket!r} does not exist at {endpoint}: create it, "
            "or check the bucket name and the endpoint",
            bucket=bucket,
        )
    if code in ("NoSuchKey", "404") and name is not None:
        return BlobNotFoundError(f"no blob {name!r} in {store}", name=name)
    if code in _CREDENTIAL_CODES or status == 403:
        return StoreAccessDeniedError(
            f"S3 refused the credentials for {operation} on {where} ({code}): check "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, the profile, or the arguments",
            bucket=bucket,
        )
    attempts = retry_attempts(error) + 1
    if code in _UNAVAILABLE_CODES or (isinstance(status, int) and status >= 500):
        return StoreUnavailableError(
            f"S3 {operation} on {where} kept failing ({code}, HTTP {status}) after "
            f"{attempts} attempts: the endpoint is overloaded or down, retry later",
            bucket=bucket,
        )
    return StoreError(
        f"S3 {operation} on {where} failed: {code} (HTTP {status}) {message}".rstrip(),
        bucket=bucket,
    )


def _transport_error(
    error: Exception, errors: Any, bucket: str, where: str, endpoint: str, operation: str
) -> CastoreError:
    if isinstance(error, errors.NoCredentialsError):
        return StoreAccessDeniedError(
            f"no AWS credentials found for {operation} on {where}: set AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY, a profile, or pass them",
            bucket=bucket,
        )
    if isinstance(error, (errors.EndpointConnectionError, errors.ConnectTimeoutError)):
        return StoreUnavailableError(
            f"cannot reach the S3 endpoint {endpoint} for {operation} on {where}: "
            "is it up, and is the endpoint URL right?",
            bucket=bucket,
        )
    if isinstance(error, errors.ReadTimeoutError):
        return StoreUnavailableError(
            f"the S3 endpoint {endpoint} did not answer {operation} on {where} in time",
            bucket=bucket,
        )
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    # A connection closed or reset, a body cut short: past the retries, the endpoint
    # (or the network to it) is failing, which is what StoreUnavailableError says.
    if isinstance(
        error, (errors.ConnectionError, errors.HTTPClientError, errors.IncompleteReadError)
    ):
        return StoreUnavailableError(
            f"the connection to the S3 endpoint {endpoint} kept breaking during {operation} "
            f"on {where} ({first}), past the retries: the endpoint or the network is "
            "failing, retry later",
            bucket=bucket,
        )
    return StoreError(f"S3 {operation} on {where} failed: {first}", bucket=bucket)


def still_conflicting(name: str, times: int) -> BlobConflictError:
    return BlobConflictError(
        f"blob {name!r}: a concurrent write conflicted (S3 409 ConditionalRequestConflict, "
        f"{times} times); nothing was written: read it again and retry",
        name=name,
    )


def error_code(error: Any) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def retry_attempts(error: Any) -> int:
    return int(error.response.get("ResponseMetadata", {}).get("RetryAttempts", 0))


def never_sent(lost: StoreUnavailableError) -> StoreUnavailableError:
    """``lost``, marked as proven unsent: no attempt's request reached the endpoint."""
    return StoreUnavailableError(
        f"{lost.message}; no attempt's request reached it, so nothing was written",
        **lost.context,
        unsent=True,
    )
