"""What the operator reads outside the API server: artifact manifests in object storage, the
base model's ``config.json`` (to know its shape before planning) and its adapters'
``adapter_config.json`` (their rank and modules).

Credentials come from the Secrets a model names, are used for the request, and are never logged
or stored. Errors carry messages a person can act on; none includes a credential.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import timezone
from typing import Any

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from fewerbits_api.endpoints import EndpointRefused, guard_endpoint
from fewerbits_api.artifact import MANIFEST_NAME, Manifest, ManifestError, artifact_prefix, split_s3_uri
from fewerbits_api.names import SECRET_ACCESS_KEY_ID, SECRET_HF_TOKEN, SECRET_SECRET_ACCESS_KEY
from fewerbits_api.adapters import AdapterSourceSpec
from fewerbits_api.quantizedmodel import SourceSpec, StorageSpec
from fewerbits_api.s3errors import S3ErrorClass, S3ErrorKind, classify_s3_error

from fewerbits_operator.base.claims import CLAIM_NAME

log = logging.getLogger("fewerbits.storage")
CONFIG_MAX_BYTES = 4 * 2**20
"""A config.json is a few KiB; more is not read (a hostile source can't fill memory)."""


class StorageError(RuntimeError):
    """Object storage could not be read (unreachable, denied, malformed manifest). ``kind`` says
    which (``fewerbits_api.s3errors.S3ErrorKind``; None for a manifest that is there but unusable),
    so callers decide on data, not on the message."""

    def __init__(self, message: str, kind: S3ErrorKind | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class ModelConfigError(RuntimeError):
    """The base model's config.json could not be read."""


@dataclass(frozen=True)
class S3Credentials:
    access_key: str | None = None
    secret_key: str | None = None

    @classmethod
    def from_secret(cls, data: dict[str, str] | None) -> S3Credentials:
        if not data:
            return cls()
        return cls(data.get(SECRET_ACCESS_KEY_ID), data.get(SECRET_SECRET_ACCESS_KEY))

    def __repr__(self) -> str:  # never print a secret by accident
        return f"S3Credentials(access_key={'***' if self.access_key else None})"


class ObjectStore:
    """Cached boto3 clients per (endpoint, region, access key). Every endpoint is guarded before
    its client is built: resolved, checked and pinned (fewerbits_api.endpoints), so the client
    connects to the address that was checked; ``allow_private``: the operator's
    allowPrivateEndpoints setting."""

    def __init__(self, timeout: float = 20.0, allow_private: bool = False):
        self.timeout = timeout
        self.allow_private = allow_private
        self._clients: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self._config_cache: dict[tuple, dict[str, Any]] = {}
        # Published manifests never change (content-addressed, written last): once found, one is
        # not fetched again. Misses are not cached: the Job may publish at any moment.
        self._manifests: dict[tuple, Manifest] = {}

    def _client(self, endpoint: str | None, region: str | None, creds: S3Credentials,
                field: str = "spec.storage.endpoint"):
        try:  # on every use, not once per cached client: a pin expires and is checked again
            guard_endpoint(endpoint, field, self.allow_private)
        except EndpointRefused as e:
            raise StorageError(str(e), S3ErrorKind.OTHER) from None
        key = (endpoint, region, creds.access_key, creds.secret_key)
        with self._lock:
            c = self._clients.get(key)
            if c is None:
                c = boto3.session.Session().client(
                    "s3",
                    endpoint_url=endpoint,
                    region_name=region or "us-east-1",
                    aws_access_key_id=creds.access_key,
                    aws_secret_access_key=creds.secret_key,
                    config=BotoConfig(
                        connect_timeout=self.timeout, read_timeout=self.timeout,
                        retries={"max_attempts": 2, "mode": "standard"},
                        s3={"addressing_style": "path" if endpoint else "auto"},
                    ),
                )
                self._clients[key] = c
            return c

    # ------------------------------------------------------------ artifacts

    def get_quality_result(self, storage: StorageSpec, key: str, identity: str, creds: S3Credentials):
        """``<key>/quality/<identity>.json`` (an evaluation-only Job's result), or None when absent.
        Raises StorageError when it cannot be read or parsed."""
        from fewerbits_api.artifact import QualityReport
        from fewerbits_api.quality import quality_result_key

        return self._get_result(storage, key, lambda prefix: quality_result_key(prefix, identity), creds,
                                QualityReport, "a quality result")

    def get_serving_result(self, storage: StorageSpec, key: str, config_hash: str, creds: S3Credentials):
        """``<key>/serving/<configHash>.json`` (a serving canary's verdict, canary.py), or None when
        absent. Raises StorageError when it cannot be read or parsed."""
        from fewerbits_api.canary import ServingQualityResult, serving_result_key

        return self._get_result(storage, key, lambda prefix: serving_result_key(prefix, config_hash), creds,
                                ServingQualityResult, "a serving verdict")

    def _get_result(self, storage: StorageSpec, key: str, object_key: Any, creds: S3Credentials, model: Any,
                    what: str):
        """A typed JSON result beside an artifact (``object_key(prefix)``), or None when absent."""
        bucket, prefix = artifact_prefix(storage.uri, key)
        obj_key = object_key(prefix)
        s3 = self._client(storage.endpoint, storage.region, creds)
        try:
            body = s3.get_object(Bucket=bucket, Key=obj_key)["Body"].read()
        except (ClientError, BotoCoreError) as e:
            failure = classify_s3_error(e)
            if failure.kind is S3ErrorKind.NOT_FOUND:
                return None
            raise StorageError(_storage_message(failure.kind, failure.code, f"s3://{bucket}/{obj_key}",
                                                storage.endpoint), failure.kind) from None
        try:
            return model.model_validate_json(body)
        except ValueError as e:
            raise StorageError(f"s3://{bucket}/{obj_key}: not {what} ({str(e).splitlines()[0]})") from None

    def get_manifest(self, storage: StorageSpec, key: str, creds: S3Credentials) -> Manifest | None:
        """The artifact's manifest, or None when it has not been published (no manifest, no artifact)."""
        # Keyed by the credentials too: a model that cannot read the bucket learns nothing from another's read.
        cache_key = (storage.uri, storage.endpoint, key, _identity(creds.access_key))
        if cache_key in self._manifests:
            return self._manifests[cache_key]
        bucket, prefix = artifact_prefix(storage.uri, key)
        s3 = self._client(storage.endpoint, storage.region, creds)
        where = f"s3://{bucket}/{prefix}{MANIFEST_NAME}"
        try:
            body = s3.get_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)["Body"].read()
        except (ClientError, BotoCoreError) as e:
            failure = classify_s3_error(e)
            if failure.kind is S3ErrorKind.NOT_FOUND:
                return None
            raise StorageError(_storage_message(failure.kind, failure.code, where, storage.endpoint),
                               failure.kind) from None
        try:
            manifest = Manifest.parse(body, key)
        except ManifestError as e:
            raise StorageError(f"{where}: {e.message}") from None
        with self._lock:
            if len(self._manifests) >= 4096:  # bounded: drop the oldest
                self._manifests.pop(next(iter(self._manifests)))
            self._manifests[cache_key] = manifest
        return manifest

    # ------------------------------------------------------------ claims (claims.py)

    def get_claim(self, storage: StorageSpec, key: str, creds: S3Credentials) -> tuple[bool, bytes | None]:
        """(whether ``<key>/.claim`` exists, its body). Never cached."""
        bucket, prefix = artifact_prefix(storage.uri, key)
        s3 = self._client(storage.endpoint, storage.region, creds)
        try:
            return True, s3.get_object(Bucket=bucket, Key=prefix + CLAIM_NAME)["Body"].read(65536)
        except (ClientError, BotoCoreError) as e:
            failure = classify_s3_error(e)
            if failure.kind is S3ErrorKind.NOT_FOUND:
                return False, None
            raise StorageError(_storage_message(failure.kind, failure.code, f"s3://{bucket}/{prefix}{CLAIM_NAME}",
                                                storage.endpoint), failure.kind) from None

    def put_claim(self, storage: StorageSpec, key: str, creds: S3Credentials, body: bytes, take_over: bool) -> bool:
        """Write ``<key>/.claim`` create-only (`If-None-Match: *`); ``take_over`` deletes a stale one
        first. False when another writer holds it (412, or 409 for a concurrent conditional write)."""
        bucket, prefix = artifact_prefix(storage.uri, key)
        s3 = self._client(storage.endpoint, storage.region, creds)
        where = f"s3://{bucket}/{prefix}{CLAIM_NAME}"
        try:
            if take_over:
                s3.delete_object(Bucket=bucket, Key=prefix + CLAIM_NAME)
            s3.put_object(Bucket=bucket, Key=prefix + CLAIM_NAME, Body=body, IfNoneMatch="*",
                          ContentType="application/json")
            return True
        except ClientError as e:
            status = (e.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if status in (409, 412) or e.response.get("Error", {}).get("Code") in ("PreconditionFailed",
                                                                                   "ConditionalRequestConflict"):
                return False
            failure = classify_s3_error(e)
            raise StorageError(_storage_message(failure.kind, failure.code, where, storage.endpoint), failure.kind) from None
        except BotoCoreError as e:
            failure = classify_s3_error(e)
            raise StorageError(_storage_message(failure.kind, failure.code, where, storage.endpoint), failure.kind) from None

    # ------------------------------------------------------------ retention (retention.py)

    def _raise(self, e: Exception, where: str, storage: StorageSpec) -> None:
        failure = classify_s3_error(e)
        raise StorageError(_storage_message(failure.kind, failure.code, where, storage.endpoint), failure.kind) from None

    def list_location(self, storage: StorageSpec, creds: S3Credentials) -> tuple[str, list[tuple[str, str]]]:
        """(key prefix, [(object key, LastModified RFC 3339)]) of everything under the location."""
        bucket, prefix = split_s3_uri(storage.uri)
        prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        s3 = self._client(storage.endpoint, storage.region, creds)
        out: list[tuple[str, str]] = []
        try:
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                out += [(o["Key"], o["LastModified"].astimezone(timezone.utc).replace(microsecond=0)
                         .isoformat().replace("+00:00", "Z")) for o in page.get("Contents", [])]
        except (ClientError, BotoCoreError) as e:
            self._raise(e, f"s3://{bucket}/{prefix}", storage)
        return prefix, out

    def put_object(self, storage: StorageSpec, creds: S3Credentials, key: str, body: bytes) -> None:
        bucket, _ = split_s3_uri(storage.uri)
        try:
            self._client(storage.endpoint, storage.region, creds).put_object(Bucket=bucket, Key=key, Body=body)
        except (ClientError, BotoCoreError) as e:
            self._raise(e, f"s3://{bucket}/{key}", storage)

    def delete_object(self, storage: StorageSpec, creds: S3Credentials, key: str) -> None:
        """One object; deleting what is not there is success (S3 semantics)."""
        bucket, _ = split_s3_uri(storage.uri)
        try:
            self._client(storage.endpoint, storage.region, creds).delete_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as e:
            self._raise(e, f"s3://{bucket}/{key}", storage)
        with self._lock:  # a deleted manifest is no longer a cached hit
            for k in [k for k in self._manifests if key.endswith(f"{k[2]}/{MANIFEST_NAME}")]:
                self._manifests.pop(k, None)

    # ------------------------------------------------------------ calibration data

    def head_object(self, storage: StorageSpec, uri: str, creds: S3Credentials) -> tuple[str, str | None]:
        """(ETag without quotes, VersionId or None) of ``uri`` on the storage endpoint (where the
        Job reads S3 datasets from, with the same credentials). One HEAD; not cached here: the
        ETag is what tells changed data (observe reuses it for a bounded time, pincache.py).
        Raises StorageError naming the object."""
        bucket, key = split_s3_uri(uri)
        s3 = self._client(storage.endpoint, storage.region, creds)
        try:
            head = s3.head_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as e:
            failure = classify_s3_error(e)
            raise StorageError(_storage_message(failure.kind, failure.code, uri, storage.endpoint,
                                                secret="spec.storage.credentialsSecret"), failure.kind) from None
        version = head.get("VersionId")
        return str(head.get("ETag") or "").strip('"'), (str(version) if version and version != "null" else None)

    def unreadable(self, storage: StorageSpec, uri: str, creds: S3Credentials) -> S3ErrorClass | None:
        """Why ``uri`` cannot be read on the storage endpoint with the storage credentials (where
        and how the Job reads S3 datasets), or None when it can. One HEAD, no body, never cached."""
        bucket, key = split_s3_uri(uri)
        try:
            self._client(storage.endpoint, storage.region, creds).head_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as e:
            return classify_s3_error(e)
        return None

    # ------------------------------------------------------------ base model config

    def model_config(self, source: SourceSpec, secret: dict[str, str] | None, hf_endpoint: str) -> dict[str, Any]:
        """The base model's config.json, cached per (uri, revision)."""
        if source.scheme not in ("s3", "hf"):
            raise ModelConfigError(
                f"spec.source.uri: {source.scheme}:// sources are read by the quantization Job only; the operator cannot read "
                "their config.json to plan (use an hf:// or s3:// source)")
        return self.source_json(source, "config.json", "spec.source", secret, hf_endpoint)

    def adapter_config(self, source: AdapterSourceSpec, field: str, secret: dict[str, str] | None,
                       hf_endpoint: str) -> dict[str, Any]:
        """A LoRA adapter's adapter_config.json (``field``: its `spec.adapters[i].source`), cached
        per (uri, revision)."""
        return self.source_json(source, "adapter_config.json", field, secret, hf_endpoint)

    def source_json(self, source: SourceSpec | AdapterSourceSpec, filename: str, field: str,
                    secret: dict[str, str] | None, hf_endpoint: str) -> dict[str, Any]:
        """A small JSON file beside the weights of an hf:// or s3:// source (``field`` names the
        source in messages), cached per (uri, revision, file, credential)."""
        cache_key = (source.uri, source.revision, source.endpoint, filename,
                     _identity((secret or {}).get(SECRET_ACCESS_KEY_ID) or (secret or {}).get(SECRET_HF_TOKEN)))
        if cache_key in self._config_cache:
            return self._config_cache[cache_key]
        if source.scheme == "s3":
            cfg = self._s3_json(source, filename, field, S3Credentials.from_secret(secret))
        else:
            cfg = self._hf_json(source, filename, field, (secret or {}).get(SECRET_HF_TOKEN), hf_endpoint)
        self._config_cache[cache_key] = cfg
        return cfg

    def _s3_json(self, source: SourceSpec | AdapterSourceSpec, filename: str, field: str,
                 creds: S3Credentials) -> dict[str, Any]:
        bucket, prefix = split_s3_uri(source.uri)
        key = f"{prefix.strip('/')}/{filename}" if prefix.strip("/") else filename
        try:
            s3 = self._client(source.endpoint, source.region, creds, f"{field}.endpoint")
        except StorageError as e:
            raise ModelConfigError(str(e)) from None
        try:
            body = s3.get_object(Bucket=bucket, Key=key)["Body"].read(CONFIG_MAX_BYTES + 1)
        except (ClientError, BotoCoreError) as e:
            failure = classify_s3_error(e)
            raise ModelConfigError(_storage_message(failure.kind, failure.code, f"s3://{bucket}/{key}",
                                                    source.endpoint, secret=f"{field}.credentialsSecret")) from None
        if len(body) > CONFIG_MAX_BYTES:
            raise ModelConfigError(f"s3://{bucket}/{key} is larger than {CONFIG_MAX_BYTES // 2**20} MiB; "
                                   f"a {filename} is a few KiB")
        return _parse_config(body, f"s3://{bucket}/{key}")

    def _hf_json(self, source: SourceSpec | AdapterSourceSpec, filename: str, field: str, token: str | None,
                 hf_endpoint: str) -> dict[str, Any]:
        repo = source.uri.removeprefix("hf://")
        url = f"{hf_endpoint.rstrip('/')}/{repo}/resolve/{source.revision or 'main'}/{filename}"
        req = urllib.request.Request(url, headers={"User-Agent": "fewerbits-operator"})
        if token:
            req.add_unredirected_header("Authorization", f"Bearer {token}")  # never sent on to a redirect target
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read(CONFIG_MAX_BYTES)
        except urllib.error.HTTPError as e:
            hint = f" (gated or private: set {field}.credentialsSecret with HF_TOKEN)" if e.code in (401, 403) else ""
            raise ModelConfigError(f"cannot read {filename} of {source.uri}: HTTP {e.code}{hint}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ModelConfigError(f"cannot reach {hf_endpoint} for {source.uri}: {getattr(e, 'reason', e)}") from None
        return _parse_config(body, url)


def _storage_message(kind: S3ErrorKind, code: str, where: str, endpoint: str | None,
                     secret: str = "the storage credentials Secret") -> str:
    """One line a person can act on, per kind of S3 failure (never a credential)."""
    store = endpoint or "AWS S3"
    if kind is S3ErrorKind.NOT_FOUND:
        return f"{where} does not exist"
    if kind is S3ErrorKind.BUCKET_NOT_FOUND:
        return f"{where}: the bucket does not exist at {store}"
    if kind is S3ErrorKind.ACCESS_DENIED:
        return f"{where}: access denied ({code}): check {secret}"
    if kind is S3ErrorKind.TRANSIENT:
        return f"{where}: object storage {store} unreachable or busy ({code})"
    return f"reading {where} failed: {code}"


def _identity(credential: str | None) -> str | None:
    """A one-way tag of a credential, for cache keys (the value itself is never kept)."""
    return hashlib.sha256(credential.encode()).hexdigest()[:16] if credential else None


def _parse_config(body: bytes, where: str) -> dict[str, Any]:
    try:
        cfg = json.loads(body)
    except ValueError:
        raise ModelConfigError(f"{where} is not JSON") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{where} is not a JSON object")
    return cfg
