"""The S3 client of the serving pod and the translation of storage errors into clear failures.

Credentials come only from boto3's default chain: the environment (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, set by the operator from the storage Secret, see
``fewerbits_api.jobcontract``) or the pod's own identity (IRSA web identity, instance profile).
They are never taken from arguments and never logged: botocore's own loggers are kept at WARNING
(at DEBUG they print signed headers), and messages are built from error codes, not from raw
responses.
"""

from __future__ import annotations

import logging

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from .errors import AccessDenied, ArtifactMissing, RuntimeFailure, StorageError

for _name in ("botocore", "boto3", "urllib3", "s3transfer"):
    logging.getLogger(_name).setLevel(logging.WARNING)

# Error codes that mean "these credentials are not allowed" (bad key, bad secret, no policy).
ACCESS_DENIED_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
    "ExpiredToken", "TokenRefreshRequired", "AllAccessDisabled", "403",
})
NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
NO_BUCKET_CODES = frozenset({"NoSuchBucket"})
TRANSIENT_ERRORS = (EndpointConnectionError, ConnectionClosedError, ReadTimeoutError)


def make_client(endpoint: str | None, region: str | None, max_connections: int):
    """One thread-safe client shared by all download threads (its pool sized to the threads)."""
    config = Config(
        max_pool_connections=max(10, max_connections + 2),
        retries={"max_attempts": 5, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
        # S3-compatible stores (MinIO, Ceph) usually serve path-style only.
        s3={"addressing_style": "path"} if endpoint else {},
        # Integrity is checked end to end against the manifest's sha256; no per-response CRC.
        response_checksum_validation="when_required",
        request_checksum_calculation="when_required",
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint or None,
                                          region_name=region or None, config=config)


def error_code(e: ClientError) -> str:
    err = e.response.get("Error", {}) if hasattr(e, "response") else {}
    code = str(err.get("Code") or "")
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") if hasattr(e, "response") else None
    return code or (str(status) if status else "")


def translate(e: Exception, *, what: str, where: str, key: str | None = None,
              missing: RuntimeFailure | None = None) -> RuntimeFailure:
    """Map a boto error to a failure whose message names the object and the fix, never a secret."""
    if isinstance(e, RuntimeFailure):
        return e
    if isinstance(e, NoCredentialsError):
        return AccessDenied(
            f"no storage credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "from the storage credentials Secret, or give the pod an identity with read access")
    if isinstance(e, ClientError):
        code = error_code(e)
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ACCESS_DENIED_CODES or status == 403:
            return AccessDenied(
                f"storage refused the credentials reading {what} at {where} ({code or status}): check "
                "the storage credentials Secret (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or the "
                "pod identity's read permission on the bucket", code=code)
        if code in NO_BUCKET_CODES:
            return ArtifactMissing(f"no artifact {key} at {where}: the bucket does not exist", code=code)
        if (code in NOT_FOUND_CODES or status == 404) and missing is not None:
            return missing
        return StorageError(f"storage error reading {what} at {where}: {code or status}", code=code)
    if isinstance(e, TRANSIENT_ERRORS):
        return StorageError(f"cannot reach storage reading {what} at {where}: {type(e).__name__}")
    if isinstance(e, BotoCoreError):
        return StorageError(f"storage error reading {what} at {where}: {type(e).__name__}: {e}")
    return StorageError(f"error reading {what} at {where}: {type(e).__name__}: {e}")
