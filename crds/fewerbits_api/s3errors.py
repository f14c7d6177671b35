"""One reading of an S3 failure, for every process that talks to object storage.

botocore reports an S3 failure as a ``ClientError`` whose ``response`` carries an error code (and
an HTTP status), or as an exception of its own for transport failures (no connection, a timeout,
no credentials). :func:`classify_s3_error` turns either into a :class:`S3ErrorKind`; each caller
decides what that kind means for it (a missing manifest is "not published yet" to the operator,
a missing part is "the artifact is incomplete" to the fetcher). No botocore import here: the
classification reads the exception's ``response`` and class name, so it works for any boto3
version and costs the API package no dependency.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class S3ErrorKind(str, Enum):
    NOT_FOUND = "not-found"
    """The object (or, for HeadBucket, the bucket) does not exist."""
    BUCKET_NOT_FOUND = "bucket-not-found"
    """The bucket does not exist (``NoSuchBucket``)."""
    ACCESS_DENIED = "access-denied"
    """The credentials are missing, wrong or not allowed: retrying cannot help."""
    TRANSIENT = "transient"
    """Throttled, unreachable, timed out or a server error: a retry may succeed."""
    OTHER = "other"
    """Anything else (a bad request, an unexpected code)."""


NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchVersion"})
BUCKET_NOT_FOUND_CODES = frozenset({"NoSuchBucket"})
ACCESS_DENIED_CODES = frozenset({
    "AccessDenied", "Forbidden", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
    "ExpiredToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem",
})
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "429",
    "RequestTimeout", "InternalError", "ServiceUnavailable", "500", "502", "503", "504",
    "XMinioServerNotInitialized",
})
# botocore / urllib3 / builtin exception classes (by name) that mean the request never completed.
TRANSIENT_EXCEPTIONS = frozenset({
    "EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeout", "ReadTimeout", "ResponseStreamingError", "IncompleteReadError", "ProtocolError",
    "ProxyConnectionError", "HTTPClientError", "ConnectionError", "ConnectionResetError",
    "ConnectionRefusedError", "ConnectionAbortedError", "BrokenPipeError", "TimeoutError",
})
CREDENTIAL_EXCEPTIONS = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"})


@dataclass(frozen=True)
class S3ErrorClass:
    kind: S3ErrorKind
    code: str
    """The S3 error code, else the HTTP status, else the exception's class name."""

    @property
    def retryable(self) -> bool:
        return self.kind is S3ErrorKind.TRANSIENT


def s3_error_code(exc: BaseException) -> str:
    """The error code of a botocore ``ClientError`` (the HTTP status when the body had none);
    '' for anything else."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    code = str((response.get("Error") or {}).get("Code") or "")
    if code:
        return code
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(status) if status else ""


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def classify_s3_error(exc: BaseException) -> S3ErrorClass:
    """What kind of S3 failure ``exc`` is (see :class:`S3ErrorKind`)."""
    code = s3_error_code(exc)
    if code:
        status = _status(exc)
        if code in BUCKET_NOT_FOUND_CODES:
            return S3ErrorClass(S3ErrorKind.BUCKET_NOT_FOUND, code)
        if code in NOT_FOUND_CODES:
            return S3ErrorClass(S3ErrorKind.NOT_FOUND, code)
        if code in ACCESS_DENIED_CODES or status == 403:
            return S3ErrorClass(S3ErrorKind.ACCESS_DENIED, code)
        if code in TRANSIENT_CODES or (status is not None and status >= 500):
            return S3ErrorClass(S3ErrorKind.TRANSIENT, code)
        if status == 404:
            return S3ErrorClass(S3ErrorKind.NOT_FOUND, code)
        return S3ErrorClass(S3ErrorKind.OTHER, code)
    names = {cls.__name__ for cls in type(exc).__mro__}
    name = type(exc).__name__
    if names & CREDENTIAL_EXCEPTIONS:
        return S3ErrorClass(S3ErrorKind.ACCESS_DENIED, name)
    if names & TRANSIENT_EXCEPTIONS:
        return S3ErrorClass(S3ErrorKind.TRANSIENT, name)
    return S3ErrorClass(S3ErrorKind.OTHER, name)
