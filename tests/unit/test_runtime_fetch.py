"""The fetcher against an in-memory S3 stand-in: parts, resume, verification, markers, messages.

The real-server tests are in tests/integration/test_fetch*.py; these cover the logic fast and
the failure injections a real server cannot easily produce (a read dying mid-part, a torn state
file).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
from botocore.exceptions import ClientError, NoCredentialsError

from fewerbits_api.artifact import FILES_DIR, MANIFEST_NAME, artifact_prefix
from fewerbits_api.formats import QuantFormat
from fewerbits_runtime import fetch as fetch_mod
from fewerbits_runtime import partfile
from fewerbits_runtime.partfile import PartFile
from fewerbits_runtime.cli import main, parse_size
from fewerbits_runtime.errors import (
    EXIT_ACCESS_DENIED,
    EXIT_ARTIFACT_MISSING,
    EXIT_INTEGRITY,
    AccessDenied,
    ArtifactMissing,
    DiskFull,
    IntegrityError,
    ManifestInvalid,
    termination_message,
)
from fewerbits_runtime.fetch import DEST_MANIFEST_NAME, MARKER_NAME, STAGING_DIR, FetchOptions, Fetcher
from fewerbits_runtime.testing import build_manifest, manifest_json, publish_bytes

URI = "s3://models/fewerbits"
PART = 256 * 1024


class _Body:
    def __init__(self, data: bytes, fail_after: int | None = None) -> None:
        self.data, self.pos, self.fail_after = data, 0, fail_after

    def read(self, n: int = -1) -> bytes:
        if self.fail_after is not None and self.pos >= self.fail_after:
            raise ConnectionResetError("connection reset by peer")
        n = len(self.data) - self.pos if n < 0 else n
        if self.fail_after is not None:
            n = min(n, self.fail_after - self.pos)
        b = self.data[self.pos:self.pos + n]
        self.pos += len(b)
        return b

    def close(self) -> None:
        pass


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


class FakeS3:
    """get_object with Range, put_object; counts GETs; failure hooks."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], bytes] = {}
        self.gets: list[tuple[str, str | None]] = []
        self.lock = threading.Lock()
        self.deny = False
        self.fail_reads: dict[str, int] = {}  # key -> number of range GETs that die mid-body

    def put_object(self, Bucket, Key, Body):  # noqa: N803 - boto3's names
        self.objects[(Bucket, Key)] = bytes(Body)

    def get_object(self, Bucket, Key, Range=None):  # noqa: N803
        with self.lock:
            self.gets.append((Key, Range))
        if self.deny:
            raise _client_error("InvalidAccessKeyId", 403)
        if (Bucket, Key) not in self.objects:
            raise _client_error("NoSuchKey", 404)
        data = self.objects[(Bucket, Key)]
        resp = {}
        if Range:
            a, b = (int(x) for x in Range.removeprefix("bytes=").split("-"))
            if a >= len(data):
                raise _client_error("InvalidRange", 416)
            resp["ContentRange"] = f"bytes {a}-{min(b, len(data) - 1)}/{len(data)}"
            data = data[a:b + 1]
        fail_after = None
        with self.lock:
            if self.fail_reads.get(Key, 0) > 0:
                self.fail_reads[Key] -= 1
                fail_after = len(data) // 2
        resp["Body"] = _Body(data, fail_after)
        return resp

    def file_gets(self) -> list:
        return [g for g in self.gets if f"/{FILES_DIR}/" in g[0]]


def _files() -> dict[str, bytes]:
    rnd = hashlib.sha256(b"seed").digest()
    big = (rnd * (3 * PART // 32 + 1000))[: 3 * PART + 12345]
    return {
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
        "model-00001-of-00002.safetensors": big,
        "model-00002-of-00002.safetensors": bytes(reversed(big))[: 2 * PART],
        "tokenizer/tokenizer.json": b"{}" * 100,
        "empty.txt": b"",
    }


@pytest.fixture
def s3():
    return FakeS3()


@pytest.fixture
def published(s3):
    files = _files()
    manifest = publish_bytes(s3, URI, files)
    return manifest, files


def _opts(dest: Path, key: str, **kw) -> FetchOptions:
    return FetchOptions(storage_uri=URI, key=key, dest=dest, part_size=PART, concurrency=4,
                        progress_interval=0.1, **kw)


def _assert_copy(dest: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        assert (dest / path).read_bytes() == data, path
    assert not (dest / STAGING_DIR).exists()


def test_round_trip(s3, published, tmp_path):
    manifest, files = published
    dest = tmp_path / manifest.key
    stats = Fetcher(_opts(dest, manifest.key), client=s3).run()
    _assert_copy(dest, files)
    assert stats.bytesDownloaded == manifest.totalBytes
    assert stats.filesDownloaded == len(files) and not stats.cacheHit
    # ranged GETs: 4 parts + 2 parts + one each for the two small files; none for the empty one
    assert stats.fileGets == 4 + 2 + 1 + 1
    marker = json.loads((dest / MARKER_NAME).read_text())
    raw = s3.objects[artifact_prefix(URI, manifest.key)[0], artifact_prefix(URI, manifest.key)[1] + MANIFEST_NAME]
    assert marker["manifestSha256"] == hashlib.sha256(raw).hexdigest()
    assert json.loads((dest / DEST_MANIFEST_NAME).read_text())["format"] == "fp8-dynamic"


def test_cache_hit_downloads_nothing(s3, published, tmp_path):
    manifest, files = published
    dest = tmp_path / manifest.key
    Fetcher(_opts(dest, manifest.key), client=s3).run()
    s3.gets.clear()
    stats = Fetcher(_opts(dest, manifest.key), client=s3).run()
    assert stats.cacheHit and stats.bytesDownloaded == 0
    assert s3.file_gets() == []


def test_cache_hit_with_rehash_catches_a_silently_changed_file(s3, published, tmp_path):
    manifest, files = published
    dest = tmp_path / manifest.key
    Fetcher(_opts(dest, manifest.key), client=s3).run()
    target = dest / "model-00002-of-00002.safetensors"
    data = bytearray(target.read_bytes())
    data[100] ^= 0xFF  # same size: only a re-hash can see it
    target.write_bytes(bytes(data))
    assert Fetcher(_opts(dest, manifest.key), client=s3).run().cacheHit  # sizes trusted
    s3.gets.clear()
    stats = Fetcher(_opts(dest, manifest.key, rehash=True), client=s3).run()
    assert not stats.cacheHit
    assert stats.bytesDownloaded == len(files["model-00002-of-00002.safetensors"])
    _assert_copy(dest, files)


def test_size_change_invalidates_the_marker(s3, published, tmp_path):
    manifest, files = published
    dest = tmp_path / manifest.key
    Fetcher(_opts(dest, manifest.key), client=s3).run()
    (dest / "config.json").write_bytes(b"{}")
    stats = Fetcher(_opts(dest, manifest.key), client=s3).run()
    assert stats.bytesDownloaded == len(files["config.json"])
    assert stats.filesReused == len(files) - 1
    _assert_copy(dest, files)


def test_resume_downloads_only_missing_parts(s3, published, tmp_path):
    manifest, files = published
    dest = tmp_path / manifest.key
    big = "model-00001-of-00002.safetensors"
    # Simulate an interrupted run: parts 0 and 2 of the big file done and recorded.
    stage = dest / STAGING_DIR / big
    stage.parent.mkdir(parents=True)
    part_path = stage.with_name(big + ".part")
    data = files[big]
    with open(part_path, "wb") as f:
        f.truncate(len(data))
        f.seek(0)
        f.write(data[:PART])
        f.seek(2 * PART)
        f.write(data[2 * PART:3 * PART])
    mf = next(m for m in manifest.files if m.path == big)
    job = PartFile(mf, dest / big, part_path, stage.with_name(big + ".state"), PART)
    stage.with_name(big + ".state").write_bytes(job.header() + b"0\n2\n1")  # "1" torn: not done
    stats = Fetcher(_opts(dest, manifest.key), client=s3).run()
    _assert_copy(dest, files)
    assert stats.partsResumed == 2
    assert stats.bytesDownloaded == manifest.totalBytes - 2 * PART
    ranges = [r for k, r in s3.file_gets() if k.endswith(big)]
    assert sorted(ranges) == [f"bytes={PART}-{2 * PART - 1}", f"bytes={3 * PART}-{len(data) - 1}"]


def test_resumed_file_with_bad_parts_is_downloaded_again(s3, published, tmp_path):
    manifest, files = published
    dest = tmp_path / manifest.key
    big = "model-00001-of-00002.safetensors"
    stage = dest / STAGING_DIR / big
    stage.parent.mkdir(parents=True)
    part_path = stage.with_name(big + ".part")
    part_path.write_bytes(b"\0" * len(files[big]))  # recorded as done, but the data never hit the disk
    mf = next(m for m in manifest.files if m.path == big)
    job = PartFile(mf, dest / big, part_path, stage.with_name(big + ".state"), PART)
    stage.with_name(big + ".state").write_bytes(job.header() + b"0\n1\n")
    stats = Fetcher(_opts(dest, manifest.key), client=s3).run()
    _assert_copy(dest, files)
    assert stats.filesRestarted == 1


def test_state_from_another_part_size_is_ignored(s3, published, tmp_path):
    manifest, files = published
    dest = tmp_path / manifest.key
    big = "model-00001-of-00002.safetensors"
    stage = dest / STAGING_DIR / big
    stage.parent.mkdir(parents=True)
    stage.with_name(big + ".part").write_bytes(b"\0" * len(files[big]))
    mf = next(m for m in manifest.files if m.path == big)
    other = PartFile(mf, dest / big, stage, stage, 2 * PART)
    stage.with_name(big + ".state").write_bytes(other.header() + b"0\n1\n")
    stats = Fetcher(_opts(dest, manifest.key), client=s3).run()
    assert stats.partsResumed == 0 and stats.bytesDownloaded == manifest.totalBytes
    _assert_copy(dest, files)


def test_verified_files_left_by_an_interrupted_run_are_rehashed_not_downloaded(s3, published, tmp_path):
    manifest, files = published
    dest = tmp_path / manifest.key
    dest.mkdir()
    (dest / "config.json").write_bytes(files["config.json"])
    (dest / "model-00002-of-00002.safetensors").write_bytes(b"x" * len(files["model-00002-of-00002.safetensors"]))
    stats = Fetcher(_opts(dest, manifest.key), client=s3).run()
    _assert_copy(dest, files)
    assert stats.filesReused == 1
    assert stats.bytesDownloaded == manifest.totalBytes - len(files["config.json"])


def test_read_error_mid_part_is_retried(s3, published, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch_mod.time, "sleep", lambda s: None)
    manifest, files = published
    dest = tmp_path / manifest.key
    bucket, prefix = artifact_prefix(URI, manifest.key)
    s3.fail_reads[f"{prefix}{FILES_DIR}/model-00001-of-00002.safetensors"] = 2
    stats = Fetcher(_opts(dest, manifest.key), client=s3).run()
    _assert_copy(dest, files)
    # The retry continues where the read died: no byte is fetched (or written) twice.
    assert stats.bytesDownloaded == manifest.totalBytes
    ranges = [r for k, r in s3.file_gets() if k.endswith("model-00001-of-00002.safetensors")]
    assert len(ranges) == 4 + 2
    assert sum(1 for r in ranges if int(r.removeprefix("bytes=").split("-")[0]) % PART != 0) == 2  # mid-part


def test_corrupt_object_names_the_file_and_leaves_no_verified_copy(s3, published, tmp_path):
    manifest, files = published
    bucket, prefix = artifact_prefix(URI, manifest.key)
    name = "model-00002-of-00002.safetensors"
    data = bytearray(files[name])
    data[PART + 7] ^= 0x01
    s3.objects[(bucket, f"{prefix}{FILES_DIR}/{name}")] = bytes(data)
    dest = tmp_path / manifest.key
    with pytest.raises(IntegrityError) as e:
        Fetcher(_opts(dest, manifest.key), client=s3).run()
    msg = e.value.message
    assert name in msg and files and hashlib.sha256(files[name]).hexdigest() in msg
    assert hashlib.sha256(bytes(data)).hexdigest() in msg
    assert not (dest / MARKER_NAME).exists()
    assert not (dest / name).exists()


def test_object_size_differs_from_manifest(s3, published, tmp_path):
    manifest, files = published
    bucket, prefix = artifact_prefix(URI, manifest.key)
    s3.objects[(bucket, f"{prefix}{FILES_DIR}/config.json")] += b" "
    with pytest.raises(IntegrityError, match="size mismatch for config.json"):
        Fetcher(_opts(tmp_path / "d", manifest.key), client=s3).run()


def test_missing_manifest_message(s3, tmp_path):
    key = "b" * 64
    with pytest.raises(ArtifactMissing) as e:
        Fetcher(_opts(tmp_path / "d", key), client=s3).run()
    assert e.value.message == (f"no artifact {key} at {URI}: manifest.json missing — the quantization Job "
                               "has not published it")


def test_files_without_manifest_are_no_artifact(s3, tmp_path):
    files = _files()
    manifest = build_manifest([(p, len(b), hashlib.sha256(b).hexdigest()) for p, b in files.items()])
    bucket, prefix = artifact_prefix(URI, manifest.key)
    for p, b in files.items():
        s3.put_object(Bucket=bucket, Key=f"{prefix}{FILES_DIR}/{p}", Body=b)
    with pytest.raises(ArtifactMissing):
        Fetcher(_opts(tmp_path / "d", manifest.key), client=s3).run()
    assert s3.file_gets() == []


def test_access_denied_message(s3, published, tmp_path):
    manifest, _ = published
    s3.deny = True
    with pytest.raises(AccessDenied) as e:
        Fetcher(_opts(tmp_path / "d", manifest.key), client=s3).run()
    assert "InvalidAccessKeyId" in e.value.message and "AWS_ACCESS_KEY_ID" in e.value.message


def test_no_credentials_message(published, tmp_path):
    manifest, _ = published

    class NoCreds(FakeS3):
        def get_object(self, **kw):
            raise NoCredentialsError()

    with pytest.raises(AccessDenied, match="no storage credentials"):
        Fetcher(_opts(tmp_path / "d", manifest.key), client=NoCreds()).run()


def test_manifest_for_another_key_is_refused(s3, published, tmp_path):
    manifest, _ = published
    other = "c" * 64
    bucket, prefix = artifact_prefix(URI, other)
    s3.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=manifest_json(manifest))
    with pytest.raises(ManifestInvalid, match="not the expected"):
        Fetcher(_opts(tmp_path / "d", other), client=s3).run()


@pytest.mark.parametrize("bad", ["../escape", "a/../../b", "a//b", ".fewerbits-verified", "./x"])
def test_unsafe_paths_are_refused(s3, tmp_path, bad):
    # A hostile manifest in storage: built around the model's own path check, as an attacker would.
    manifest = build_manifest([("placeholder", 1, "0" * 64)])
    manifest.files[0].__dict__["path"] = bad
    bucket, prefix = artifact_prefix(URI, manifest.key)
    s3.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=manifest_json(manifest))
    with pytest.raises(ManifestInvalid):
        Fetcher(_opts(tmp_path / "d", manifest.key), client=s3).run()


def test_disk_full_before_download(s3, published, tmp_path, monkeypatch):
    manifest, _ = published
    monkeypatch.setattr(fetch_mod, "free_bytes", lambda p: 1000)
    with pytest.raises(DiskFull) as e:
        Fetcher(_opts(tmp_path / "d", manifest.key), client=s3).run()
    assert e.value.details == {"neededBytes": manifest.totalBytes, "freeBytes": 1000}
    assert s3.file_gets() == []


def test_disk_full_while_writing(s3, published, tmp_path, monkeypatch):
    # The free-space check passed (another writer filled the volume meanwhile): ENOSPC from pwrite.
    manifest, _ = published
    real_pwrite = fetch_mod.os.pwrite

    def enospc(fd, data, off):
        if off > 0:
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, data, off)

    monkeypatch.setattr(fetch_mod.os, "pwrite", enospc)
    with pytest.raises(DiskFull, match="disk full writing") as e:
        Fetcher(_opts(tmp_path / "d", manifest.key), client=s3).run()
    assert e.value.details["freeBytes"] > 0 and e.value.details["neededBytes"] > 0
    assert not (tmp_path / "d" / MARKER_NAME).exists()


def test_offline_start_uses_the_verified_copy(s3, published, tmp_path):
    manifest, files = published
    dest = tmp_path / manifest.key
    Fetcher(_opts(dest, manifest.key), client=s3).run()
    from botocore.exceptions import EndpointConnectionError

    class Down(FakeS3):
        def get_object(self, **kw):
            raise EndpointConnectionError(endpoint_url="http://s3.invalid")

    stats = Fetcher(_opts(dest, manifest.key), client=Down()).run()
    assert stats.offline and stats.cacheHit
    with pytest.raises(Exception, match="cannot reach storage"):
        Fetcher(_opts(tmp_path / "empty", manifest.key), client=Down()).run()


def test_rate_limit_paces_the_download(s3, published, tmp_path):
    import time

    manifest, _ = published
    t0 = time.monotonic()
    Fetcher(_opts(tmp_path / "d", manifest.key, rate_limit=manifest.totalBytes * 2), client=s3).run()
    assert time.monotonic() - t0 >= 0.45


def test_progress_lines_are_logged(s3, published, tmp_path, caplog):
    manifest, _ = published
    caplog.set_level("INFO", logger="fewerbits.fetch")
    Fetcher(_opts(tmp_path / "d", manifest.key, rate_limit=manifest.totalBytes * 2), client=s3).run()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("progress:", "downloaded:"))]
    assert any(line.startswith("progress: files") and "MB/s" in line and "ETA" in line for line in lines)
    assert lines[-1].startswith(f"downloaded: files {len(manifest.files)}/{len(manifest.files)}")


@pytest.mark.parametrize("text,value", [("33554432", 32 << 20), ("32Mi", 32 << 20), ("32M", 32 << 20),
                                        ("1Gi", 1 << 30), ("256k", 256 << 10), ("1.5Gi", 3 << 29)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_termination_message_is_one_line_and_bounded():
    line = termination_message("fetch", "DigestMismatch", "x" * 10000, EXIT_INTEGRITY, file="a" * 100)
    assert "\n" not in line and len(line.encode()) <= 4096
    doc = json.loads(line)
    assert doc["reason"] == "DigestMismatch" and doc["file"] == "a" * 100 and doc["message"].endswith("...")


def test_cli_usage_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("FEWERBITS_TERMINATION_LOG", str(tmp_path / "t"))
    for k in ("FEWERBITS_STORAGE_URI", "FEWERBITS_ARTIFACT_KEY", "FEWERBITS_DEST"):
        monkeypatch.delenv(k, raising=False)
    assert main(["fetch", "--storage-uri", URI, "--dest", str(tmp_path)]) == 2
    assert "FEWERBITS_ARTIFACT_KEY" in json.loads((tmp_path / "t").read_text())["message"]
    assert main(["fetch", "--storage-uri", URI, "--key", "nothex", "--dest", str(tmp_path)]) == 2
    assert main(["fetch", "--storage-uri", "gs://x", "--key", "a" * 64, "--dest", str(tmp_path)]) == 2


def test_cli_reads_env_and_reports(s3, published, tmp_path, monkeypatch):
    manifest, files = published
    monkeypatch.setattr(fetch_mod, "make_client", lambda *a: s3)
    term, stats_file = tmp_path / "t", tmp_path / "stats.json"
    monkeypatch.setenv("FEWERBITS_TERMINATION_LOG", str(term))
    monkeypatch.setenv("FEWERBITS_STORAGE_URI", URI)
    monkeypatch.setenv("FEWERBITS_ARTIFACT_KEY", manifest.key)
    monkeypatch.setenv("FEWERBITS_DEST", str(tmp_path / "m"))
    monkeypatch.setenv("FEWERBITS_FETCH_PART_SIZE", "256Ki")
    monkeypatch.setenv("FEWERBITS_FETCH_STATS_FILE", str(stats_file))
    monkeypatch.setenv("FEWERBITS_LAUNCHER_DIR", str(tmp_path / "launcher"))
    assert main(["fetch"]) == 0
    _assert_copy(tmp_path / "m", files)
    assert (tmp_path / "launcher" / "fewerbits_runtime" / "launch.py").exists()
    assert (tmp_path / "launcher" / "fewerbits_api" / "formats.py").exists()
    assert json.loads(stats_file.read_text())["fileGets"] == 8
    assert json.loads(term.read_text())["reason"] == "Fetched"
    s3.deny = True
    assert main(["fetch"]) == EXIT_ACCESS_DENIED
    assert json.loads(term.read_text())["reason"] == "StorageAccessDenied"
    s3.deny = False
    monkeypatch.setenv("FEWERBITS_ARTIFACT_KEY", "d" * 64)
    assert main(["fetch"]) == EXIT_ARTIFACT_MISSING
    assert "manifest.json missing" in json.loads(term.read_text())["message"]


def test_memory_is_bounded_by_chunks_not_parts():
    # A part is streamed in CHUNK-sized reads; a 32 MiB part never sits in memory whole.
    assert partfile.CHUNK <= 1 << 20 < fetch_mod.DEFAULT_PART_SIZE
    assert os.path  # keep the import honest


def test_cli_fetches_each_adapter_after_the_artifact_and_verifies_it(s3, published, tmp_path, monkeypatch):
    """Issue 43: a pool's adapters (published by the Job like an artifact of format none) are fetched
    after the artifact into the adapters' folder, verified against their manifest; one missing fails
    the container with the fetcher's own reason, never reporting success."""
    manifest, files = published
    adapter_files = {"adapter_config.json": b'{"peft_type": "LORA", "r": 8}', "adapter_model.safetensors": b"w" * 999}
    adapter = publish_bytes(s3, URI, adapter_files, name="plays", fmt=QuantFormat.NONE)
    monkeypatch.setattr(fetch_mod, "make_client", lambda *a: s3)
    term = tmp_path / "t"
    monkeypatch.setenv("FEWERBITS_TERMINATION_LOG", str(term))
    base = ["fetch", "--storage-uri", URI, "--key", manifest.key, "--dest", str(tmp_path / "m")]
    assert main([*base, "--adapter", adapter.key]) == 2  # nowhere to put it
    assert "--adapters-dir" in json.loads(term.read_text())["message"]
    assert main([*base, "--adapter", "nothex", "--adapters-dir", str(tmp_path / "a")]) == 2
    assert main([*base, "--adapter", adapter.key, "--adapters-dir", str(tmp_path / "a")]) == 0
    _assert_copy(tmp_path / "a" / adapter.key, adapter_files)
    _assert_copy(tmp_path / "m", files)
    assert json.loads(term.read_text())["reason"] == "Fetched"
    assert main([*base, "--adapter", "e" * 64, "--adapters-dir", str(tmp_path / "a")]) == EXIT_ARTIFACT_MISSING
    assert "manifest.json missing" in json.loads(term.read_text())["message"]


def test_cli_puts_adapters_in_the_node_cache_with_the_artifact_and_reuses_them(s3, published, tmp_path, monkeypatch):
    manifest, files = published
    adapter_files = {"adapter_config.json": b'{"peft_type": "LORA", "r": 8}', "adapter_model.safetensors": b"w" * 999}
    adapter = publish_bytes(s3, URI, adapter_files, name="plays", fmt=QuantFormat.NONE)
    monkeypatch.setattr(fetch_mod, "make_client", lambda *a: s3)
    monkeypatch.setenv("FEWERBITS_TERMINATION_LOG", str(tmp_path / "t"))
    root = tmp_path / "node-cache"
    argv = ["fetch", "--storage-uri", URI, "--key", manifest.key, "--node-cache", str(root), "--adapter", adapter.key]
    assert main(argv) == 0
    _assert_copy(root / "artifacts" / adapter.key, adapter_files)
    _assert_copy(root / "artifacts" / manifest.key, files)
    s3.gets.clear()
    assert main(argv) == 0  # a second pod on the node: both verified copies are hits, nothing is read
    assert s3.gets == []
