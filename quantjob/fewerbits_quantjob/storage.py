"""Object storage: the S3 clients, the cache check and content-addressed publishing.

Layout (``fewerbits_api.artifact``): every file goes to ``<storage uri>/<key>/files/<path>`` first,
then ``<key>/manifest.json`` LAST, so a manifest is only ever seen next to complete files. A Job
killed mid-upload leaves files but no manifest; the rerun finds the files already there (same size
and the sha256 stored in the object's metadata) and uploads only what is missing.

No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from fewerbits_api.artifact import (
    FILES_DIR,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    ManifestFile,
    artifact_prefix,
    split_s3_uri,
)
from fewerbits_api.jobcontract import (
    ENV_SOURCE_ACCESS_KEY,
    ENV_SOURCE_SECRET_KEY,
    ENV_STORAGE_ACCESS_KEY,
    ENV_STORAGE_SECRET_KEY,
    JobSource,
)
from fewerbits_api.quantizedmodel import StorageSpec
from fewerbits_api.s3errors import S3ErrorKind, classify_s3_error

from . import errors
from .errors import JobError
from .report import StageHandle, human_bytes

SHA256_METADATA = "sha256"
"""Object metadata key (``x-amz-meta-sha256``) holding the file's sha256: how a rerun knows a file
is already there, complete and unchanged."""

MiB = 1024 * 1024
MULTIPART_CHUNK = 64 * MiB
# Files in flight at once, and parts in flight per file. Safetensors shards are 2-10 GiB, so the
# per-file part concurrency is what fills the pipe on large models; small models are many files.
FILE_CONCURRENCY = int(os.environ.get("FEWERBITS_UPLOAD_FILE_CONCURRENCY", "4"))
PART_CONCURRENCY = int(os.environ.get("FEWERBITS_UPLOAD_PART_CONCURRENCY", "8"))
DEBUG_PAUSE_ENV = "FEWERBITS_DEBUG_PAUSE_AFTER_FILES"
"""Test hook: after this many files are uploaded, log a line and stop until killed (the tests kill
the process there, like a node going away mid-upload). Never set in a real Job."""
DEBUG_PAUSE_SECONDS_ENV = "FEWERBITS_DEBUG_PAUSE_SECONDS"
"""Test hook, with the one above: pause this long once, then go on uploading (the fault tests stop
the S3 server during the pause). Unset: pause until killed."""


def s3_client(endpoint: str | None, region: str | None, access_key: str | None, secret_key: str | None,
              max_pool: int = 32, unsigned: bool = False):
    """A boto3 S3 client. Path-style addressing when an endpoint is given (MinIO, Ceph: bucket
    names as DNS labels rarely resolve there). Without keys, boto3's default chain applies (IRSA,
    workload identity, instance profile), unless ``unsigned``: anonymous requests (a LoRA adapter
    without a Secret never borrows the Job's other credentials)."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(
        signature_version=UNSIGNED if unsigned else None,
        s3={"addressing_style": "path"} if endpoint else {},
        retries={"max_attempts": 8, "mode": "standard"},
        max_pool_connections=max_pool,
        connect_timeout=10, read_timeout=120,
    )
    kwargs: dict[str, object] = {"config": config}
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    if region:
        kwargs["region_name"] = region
    elif endpoint:
        kwargs["region_name"] = "us-east-1"
    if access_key and secret_key:
        kwargs["aws_access_key_id"] = access_key
        kwargs["aws_secret_access_key"] = secret_key
    return boto3.client("s3", **kwargs)


def storage_client(storage: StorageSpec, env: Mapping[str, str]):
    return s3_client(storage.endpoint, storage.region, env.get(ENV_STORAGE_ACCESS_KEY),
                     env.get(ENV_STORAGE_SECRET_KEY), max_pool=max(32, FILE_CONCURRENCY * PART_CONCURRENCY + 4))


def source_client(source: JobSource, storage: StorageSpec, env: Mapping[str, str]):
    """Client for an ``s3://`` source: the source's own endpoint and region when it names them,
    else the storage's (bases and artifacts in the same store); the source's own credentials when
    its Secret provided them, else the default chain."""
    endpoint = source.endpoint or env.get("FEWERBITS_SOURCE_S3_ENDPOINT") or storage.endpoint
    region = source.region or storage.region
    return s3_client(endpoint, region, env.get(ENV_SOURCE_ACCESS_KEY), env.get(ENV_SOURCE_SECRET_KEY))


def classify_client_error(exc: BaseException, what: str) -> JobError:
    """Turn a botocore error into a JobError with a reason the operator can show
    (``fewerbits_api.s3errors`` decides what kind of failure it is)."""
    failure = classify_s3_error(exc)
    kind, code = failure.kind, failure.code
    if kind in (S3ErrorKind.BUCKET_NOT_FOUND,):
        return JobError(errors.STORAGE_BUCKET_NOT_FOUND, f"{what}: the bucket does not exist", permanent=True)
    if kind is S3ErrorKind.ACCESS_DENIED:
        if code.endswith("CredentialsError"):
            return JobError(errors.STORAGE_ACCESS_DENIED,
                            f"{what}: no credentials found (set the storage Secret or a pod identity)", permanent=True)
        return JobError(errors.STORAGE_ACCESS_DENIED, f"{what}: access denied ({code}); check the storage credentials",
                        permanent=True)
    if kind is S3ErrorKind.TRANSIENT:
        return JobError(errors.STORAGE_UNAVAILABLE, f"{what}: the S3 endpoint is unreachable or busy ({code})")
    return JobError(errors.STORAGE_UNAVAILABLE, f"{what}: {type(exc).__name__} {code}".strip())


def read_manifest(client, storage_uri: str, key: str) -> tuple[Manifest | None, str]:
    """The artifact's manifest if one exists and is valid for ``key``; else None and why not."""
    bucket, prefix = artifact_prefix(storage_uri, key)
    where = f"s3://{bucket}/{prefix}{MANIFEST_NAME}"
    try:
        body = client.get_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)["Body"].read()
    except Exception as e:  # noqa: BLE001 — classified, never a traceback
        if classify_s3_error(e).kind is S3ErrorKind.NOT_FOUND:
            return None, "no manifest"
        raise classify_client_error(e, f"reading {where}") from e
    try:
        manifest = Manifest.parse(body, key)
    except ManifestError as e:  # an unusable manifest is no artifact; publishing replaces it
        return None, f"manifest present but unusable ({e.message}); it will be replaced"
    return manifest, "valid manifest"


def check_bucket(client, storage_uri: str) -> None:
    """Fail fast (before fetching a model for an hour) when the bucket is missing or forbidden."""
    bucket, _ = split_s3_uri(storage_uri)
    try:
        client.head_bucket(Bucket=bucket)
    except Exception as e:  # noqa: BLE001
        # HeadBucket has no body: a missing bucket is a bare 404.
        if classify_s3_error(e).kind in (S3ErrorKind.NOT_FOUND, S3ErrorKind.BUCKET_NOT_FOUND):
            raise JobError(errors.STORAGE_BUCKET_NOT_FOUND, f"storage bucket {bucket!r} does not exist",
                           permanent=True) from e
        raise classify_client_error(e, f"checking bucket {bucket!r}") from e


def sha256_file(path: Path, chunk: int = 8 * MiB) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def list_artifact_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` (relative paths, sorted), skipping dot-files."""
    files = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            files.append(rel)
    return files


@dataclass
class UploadResult:
    files: list[ManifestFile]
    uploaded_bytes: int
    skipped_files: int
    seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(f.sizeBytes for f in self.files)


class _Meter:
    """Bytes-sent counter shared by the upload threads; logs a progress line every few seconds."""

    def __init__(self, stage: StageHandle, total: int, interval: float = 2.0):
        self.stage, self.total, self.interval = stage, max(total, 1), interval
        self.sent = 0
        self.started = self.last = time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self.lock:
            self.sent += n
            now = time.monotonic()
            if now - self.last < self.interval:
                return
            self.last = now
            sent = self.sent
        rate = sent / max(now - self.started, 1e-6)
        self.stage.report(sent / self.total, bytes=f"{human_bytes(sent)}/{human_bytes(self.total)}",
                          rate=f"{human_bytes(rate)}/s")


def upload_directory(client, root: Path, storage_uri: str, key: str, stage: StageHandle,
                     env: Mapping[str, str] | None = None) -> UploadResult:
    """Upload every file under ``root`` to ``<key>/files/``: large files in parallel multipart
    parts, several files at once; files already present with the same size and sha256 are skipped.
    """
    from boto3.s3.transfer import TransferConfig

    env = env if env is not None else os.environ
    bucket, prefix = artifact_prefix(storage_uri, key)
    rel_paths = list_artifact_files(root)
    if not rel_paths:
        raise JobError(errors.SAVE_FAILED, "nothing to upload: the output directory is empty")
    sizes = {rel: (root / rel).stat().st_size for rel in rel_paths}
    total = sum(sizes.values())
    meter = _Meter(stage, total)
    transfer = TransferConfig(multipart_threshold=MULTIPART_CHUNK, multipart_chunksize=MULTIPART_CHUNK,
                              max_concurrency=PART_CONCURRENCY, use_threads=True)
    pause_after = int(env.get(DEBUG_PAUSE_ENV, "0") or 0)
    once = threading.Event()
    done_lock = threading.Lock()
    done_count = [0]
    skipped = [0]
    uploaded = [0]

    def one(rel: Path) -> ManifestFile:
        path = root / rel
        digest = sha256_file(path)
        object_key = f"{prefix}{FILES_DIR}/{rel.as_posix()}"
        size = sizes[rel]
        try:
            head = client.head_object(Bucket=bucket, Key=object_key)
            if head.get("ContentLength") == size and head.get("Metadata", {}).get(SHA256_METADATA) == digest:
                with done_lock:
                    skipped[0] += 1
                meter(size)
                return ManifestFile(path=rel.as_posix(), sizeBytes=size, sha256=digest)
        except Exception as e:  # noqa: BLE001 — only "not there yet" means upload it
            if classify_s3_error(e).kind is not S3ErrorKind.NOT_FOUND:
                raise
        client.upload_file(str(path), bucket, object_key, Config=transfer, Callback=meter,
                           ExtraArgs={"Metadata": {SHA256_METADATA: digest}})
        with done_lock:
            uploaded[0] += size
            done_count[0] += 1
            count = done_count[0]
        if pause_after and count >= pause_after:
            _debug_pause(stage, count, float(env.get(DEBUG_PAUSE_SECONDS_ENV, "0") or 0), once)
        return ManifestFile(path=rel.as_posix(), sizeBytes=size, sha256=digest)

    started = time.monotonic()
    results: dict[Path, ManifestFile] = {}
    # Largest first: the long multipart uploads start early and small files fill in around them.
    order = sorted(rel_paths, key=lambda r: -sizes[r])
    with ThreadPoolExecutor(max_workers=1 if pause_after else FILE_CONCURRENCY,
                            thread_name_prefix="upload") as pool:
        futures = {pool.submit(one, rel): rel for rel in order}
        for fut in as_completed(futures):
            try:
                results[futures[fut]] = fut.result()
            except JobError:
                raise
            except Exception as e:  # noqa: BLE001
                for f in futures:
                    f.cancel()
                raise classify_client_error(e, f"uploading {futures[fut].as_posix()}") if hasattr(e, "response") \
                    else JobError(errors.UPLOAD_FAILED, f"uploading {futures[fut].as_posix()}: {type(e).__name__}: {e}") from e
    seconds = time.monotonic() - started
    files = [results[rel] for rel in rel_paths]
    stage.summary.update(files=len(files), skipped=skipped[0], bytes=human_bytes(total),
                         rate=f"{human_bytes(uploaded[0] / max(seconds, 1e-6))}/s")
    return UploadResult(files=files, uploaded_bytes=uploaded[0], skipped_files=skipped[0], seconds=seconds)


def _debug_pause(stage: StageHandle, count: int, seconds: float = 0, once: threading.Event | None = None) -> None:
    if seconds > 0:
        if once is not None and once.is_set():
            return
        stage.progress.note(f"debug pause after {count} uploaded files ({DEBUG_PAUSE_ENV}) for {seconds:g}s")
        time.sleep(seconds)
        if once is not None:
            once.set()
        return
    stage.progress.note(f"debug pause after {count} uploaded files ({DEBUG_PAUSE_ENV}); waiting to be killed")
    while True:  # the test sends SIGKILL; SIGTERM ends it too
        signal.pause() if hasattr(signal, "pause") else time.sleep(3600)


def write_manifest(client, storage_uri: str, manifest: Manifest) -> None:
    """Write ``<key>/manifest.json``: the single act that makes the artifact exist."""
    bucket, prefix = artifact_prefix(storage_uri, manifest.key)
    body = json.dumps(manifest.to_wire(), indent=2, sort_keys=True).encode()
    client.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=body, ContentType="application/json")


def download_prefix(client, bucket: str, prefix: str, dest: Path,
                    on_progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Download every object under ``prefix`` (a "directory") into ``dest``, in parallel."""
    from boto3.s3.transfer import TransferConfig

    prefix = prefix.strip("/")
    prefix = prefix + "/" if prefix else ""
    objects: list[tuple[str, int]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            if not obj["Key"].endswith("/"):
                objects.append((obj["Key"], obj["Size"]))
    total = sum(s for _, s in objects)
    transfer = TransferConfig(multipart_threshold=MULTIPART_CHUNK, multipart_chunksize=MULTIPART_CHUNK,
                              max_concurrency=PART_CONCURRENCY)
    got = [0]
    lock = threading.Lock()

    def one(obj_key: str, size: int) -> Path:
        rel = obj_key[len(prefix):]
        if not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise JobError(errors.SOURCE_FETCH_FAILED, f"refusing object name {obj_key!r} (path escapes the prefix)",
                           permanent=True)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, obj_key, str(target), Config=transfer)
        with lock:
            got[0] += size
            if on_progress:
                on_progress(got[0], total)
        return target

    with ThreadPoolExecutor(max_workers=FILE_CONCURRENCY) as pool:
        return [f.result() for f in [pool.submit(one, k, s) for k, s in objects]]
