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

from fewerbits_api.endpoints import EndpointRefused, allow_private_from_env, guard_endpoint
from fewerbits_api.s3errors import S3ErrorKind, classify_s3_error

from .errors import AccessDenied, ArtifactMissing, RuntimeFailure, StorageError, UsageError

for _name in ("botocore", "boto3", "urllib3", "s3transfer"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def make_client(endpoint: str | None, region: str | None, max_connections: int, resolve=None):
    """One thread-safe client shared by all download threads (its pool sized to the threads). A
    link-local or cloud metadata endpoint, or a private one unless the operator allows them (the
    name as resolved here), is refused before any connection, and what was checked is pinned for
    every connection (fewerbits_api.endpoints.guard_endpoint). ``resolve``: tests."""
    try:
        guard_endpoint(endpoint, "--endpoint (FEWERBITS_STORAGE_ENDPOINT)", allow_private_from_env(), resolve)
    except EndpointRefused as e:
        raise UsageError(str(e)) from None
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


def translate(e: Exception, *, what: str, where: str, key: str | None = None,
              missing: RuntimeFailure | None = None) -> RuntimeFailure:
    """Map a boto error to a failure whose message names the object and the fix, never a secret
    (``fewerbits_api.s3errors`` decides the kind). ``details["transient"]``: a retry may succeed."""
    if isinstance(e, RuntimeFailure):
        return e
    failure = classify_s3_error(e)
    kind, code = failure.kind, failure.code
    if kind is S3ErrorKind.ACCESS_DENIED and code.endswith("CredentialsError"):
        return AccessDenied(
            f"no storage credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "from the storage credentials Secret, or give the pod an identity with read access")
    if kind is S3ErrorKind.ACCESS_DENIED:
        return AccessDenied(
            f"storage refused the credentials reading {what} at {where} ({code}): check "
            "the storage credentials Secret (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or the "
            "pod identity's read permission on the bucket", code=code)
    if kind is S3ErrorKind.BUCKET_NOT_FOUND:
        return ArtifactMissing(f"no artifact {key} at {where}: the bucket does not exist", code=code)
    if kind is S3ErrorKind.NOT_FOUND and missing is not None:
        return missing
    if kind is S3ErrorKind.TRANSIENT:
        return StorageError(f"cannot reach storage reading {what} at {where}: {code}", code=code, transient=True)
    return StorageError(f"storage error reading {what} at {where}: {code}", code=code, transient=False)
