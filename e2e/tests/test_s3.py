"""The S3 server (MinIO built from its Go module) with a real S3 client."""

from __future__ import annotations

import hashlib
import os

import pytest

pytestmark = pytest.mark.s3


def test_object_round_trips_through_s3(s3, s3_bucket):
    c = s3.client()
    body = os.urandom(3 * 1024 * 1024 + 17)  # spans a multipart-sized body
    c.put_object(Bucket=s3_bucket, Key="art/abc/files/model.safetensors", Body=body)
    c.put_object(Bucket=s3_bucket, Key="art/abc/manifest.json", Body=b'{"ok": true}')
    got = c.get_object(Bucket=s3_bucket, Key="art/abc/files/model.safetensors")["Body"].read()
    assert hashlib.sha256(got).digest() == hashlib.sha256(body).digest()
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=s3_bucket, Prefix="art/abc/")["Contents"]]
    assert keys == ["art/abc/files/model.safetensors", "art/abc/manifest.json"]


def test_wrong_credentials_are_refused(s3, s3_bucket):
    import boto3
    from botocore.exceptions import ClientError

    bad = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                       aws_secret_access_key="not-the-secret", region_name=s3.region)
    with pytest.raises(ClientError) as err:
        bad.list_objects_v2(Bucket=s3_bucket)
    assert err.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
