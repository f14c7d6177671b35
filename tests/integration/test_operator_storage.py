"""The operator's look-ups in object storage, against the real S3 server."""

from __future__ import annotations

import pytest

from fewerbits_api.artifact import ArtifactKeyInputs, Manifest, artifact_prefix
from fewerbits_api.quantizedmodel import StorageSpec
from fewerbits_operator.base.storage import ObjectStore, S3Credentials, StorageError

pytestmark = pytest.mark.s3


def publish(s3, storage: StorageSpec, body: bytes, key: str) -> None:
    bucket, prefix = artifact_prefix(storage.uri, key)
    s3.client().put_object(Bucket=bucket, Key=prefix + "manifest.json", Body=body)


def test_manifest_lookup_found_missing_cached_and_invalid(s3, s3_bucket):
    storage = StorageSpec(uri=f"s3://{s3_bucket}/q", endpoint=s3.endpoint)
    creds = S3Credentials(s3.access_key, s3.secret_key)
    store = ObjectStore(timeout=5)
    inputs = ArtifactKeyInputs(sourceUri="hf://a/b", format="fp8-dynamic")
    key = inputs.key()
    assert store.get_manifest(storage, key, creds) is None  # not published: no artifact

    m = Manifest(key=key, keyInputs=inputs, format="fp8-dynamic", files=[], totalBytes=0,
                 createdAt="2026-11-21T00:00:00Z")
    publish(s3, storage, m.model_dump_json(by_alias=True).encode(), key)
    assert store.get_manifest(storage, key, creds).key == key
    # Published manifests are immutable: a later look-up is served without asking storage again.
    bucket, prefix = artifact_prefix(storage.uri, key)
    s3.client().delete_object(Bucket=bucket, Key=prefix + "manifest.json")
    assert store.get_manifest(storage, key, creds).key == key
    assert ObjectStore(timeout=5).get_manifest(storage, key, creds) is None

    other = ArtifactKeyInputs(sourceUri="hf://a/c", format="fp8-dynamic").key()
    publish(s3, storage, b"{not json", other)
    with pytest.raises(StorageError, match="not a valid manifest"):
        store.get_manifest(storage, other, creds)
    with pytest.raises(StorageError, match="denied"):
        ObjectStore(timeout=5).get_manifest(storage, other, S3Credentials(s3.access_key, "wrong-secret-key"))


def test_a_named_loopback_store_works_with_private_addresses_refused(s3, s3_bucket):
    """Issue 31: the operator resolves a named endpoint, checks and pins it, with the default
    setting (private ranges refused); MinIO on loopback, reached by name, still serves."""
    from fewerbits_api.endpoints import PINS

    named = s3.endpoint.replace("127.0.0.1", "localhost")
    assert named != s3.endpoint
    storage = StorageSpec(uri=f"s3://{s3_bucket}/q", endpoint=named)
    key = ArtifactKeyInputs(sourceUri="hf://a/named", format="fp8-dynamic").key()
    assert ObjectStore(timeout=5, allow_private=False).get_manifest(
        storage, key, S3Credentials(s3.access_key, s3.secret_key)) is None
    assert {a.split("%")[0] for a in PINS.table["localhost"][0]} <= {"127.0.0.1", "::1"}
