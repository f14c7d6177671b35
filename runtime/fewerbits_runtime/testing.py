"""A minimal artifact publisher for the fetcher's tests and benchmark.

Not the real publisher (that is the quantjob's): it only lays files out the way the contract
says (``<key>/files/<path>``, then ``<key>/manifest.json`` last), so the fetcher can be tested
against a real S3 server without the quantjob package.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

from fewerbits_api.artifact import (
    FILES_DIR,
    MANIFEST_NAME,
    ArtifactKeyInputs,
    Manifest,
    ManifestFile,
    artifact_prefix,
)
from fewerbits_api.formats import QuantFormat


def key_inputs(name: str, fmt: QuantFormat = QuantFormat.FP8_DYNAMIC) -> ArtifactKeyInputs:
    """Distinct names give distinct keys."""
    return ArtifactKeyInputs(sourceUri=f"hf://fewerbits-test/{name}", sourceRevision="0" * 40, format=fmt,
                             ignore=["lm_head"])


def build_manifest(files: Iterable[tuple[str, int, str]], name: str = "test",
                   fmt: QuantFormat = QuantFormat.FP8_DYNAMIC) -> Manifest:
    """files: (path, size, sha256 hex)."""
    entries = [ManifestFile(path=p, sizeBytes=s, sha256=h) for p, s, h in files]
    inputs = key_inputs(name, fmt)
    return Manifest(key=inputs.key(), keyInputs=inputs, format=fmt, files=entries,
                    totalBytes=sum(e.sizeBytes for e in entries),
                    createdAt=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def manifest_json(manifest: Manifest) -> bytes:
    return manifest.model_dump_json(by_alias=True, exclude_none=True, indent=1).encode()


def publish_bytes(client, storage_uri: str, files: dict[str, bytes], name: str = "test",
                  fmt: QuantFormat = QuantFormat.FP8_DYNAMIC) -> Manifest:
    """Upload in-memory files under ``<key>/files/`` then the manifest, last."""
    manifest = build_manifest(((p, len(b), hashlib.sha256(b).hexdigest()) for p, b in files.items()), name, fmt)
    bucket, prefix = artifact_prefix(storage_uri, manifest.key)
    for path, data in files.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}{FILES_DIR}/{path}", Body=data)
    client.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=manifest_json(manifest))
    return manifest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(8 << 20):
            h.update(b)
    return h.hexdigest()


def publish_dir(client, storage_uri: str, root: Path, name: str = "test",
                fmt: QuantFormat = QuantFormat.FP8_DYNAMIC, digests: dict[str, str] | None = None) -> Manifest:
    """Upload every file under ``root`` (multipart for large ones), then the manifest, last.
    ``digests`` (relative path -> sha256) saves re-hashing files whose digest is known."""
    from boto3.s3.transfer import TransferConfig  # noqa: PLC0415

    paths = sorted(p for p in root.rglob("*") if p.is_file())
    rels = [p.relative_to(root).as_posix() for p in paths]
    digests = digests or {}
    manifest = build_manifest(((r, p.stat().st_size, digests.get(r) or sha256_file(p)) for r, p in zip(rels, paths)),
                              name, fmt)
    bucket, prefix = artifact_prefix(storage_uri, manifest.key)
    cfg = TransferConfig(multipart_chunksize=64 << 20)
    for rel, p in zip(rels, paths):
        client.upload_file(str(p), bucket, f"{prefix}{FILES_DIR}/{rel}", Config=cfg)
    client.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=manifest_json(manifest))
    return manifest
