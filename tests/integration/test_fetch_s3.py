"""The fetcher against a real S3 server (MinIO built from its Go module, fixture `s3` from
e2e/pytest_plugin.py), run as the init container runs it: a separate process, its exit code,
its logs, its termination message."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fewerbits_api.artifact import FILES_DIR, MANIFEST_NAME, artifact_prefix
from fewerbits_runtime.errors import (
    EXIT_ACCESS_DENIED,
    EXIT_ARTIFACT_MISSING,
    EXIT_INTEGRITY,
)
from fewerbits_runtime.fetch import DEST_MANIFEST_NAME, MARKER_NAME, STAGING_DIR
from fewerbits_runtime.testing import key_inputs, publish_bytes

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parents[2]
KiB, MiB = 1024, 1024 * 1024


def _files(seed: bytes, big: int = 3 * MiB + 4321) -> dict[str, bytes]:
    block = hashlib.sha512(seed).digest() * (64 * KiB // 64)  # 64 KiB, cheap and distinct per seed
    def blob(n: int, salt: int) -> bytes:
        out = (block[salt % 64:] + block[: salt % 64]) * (n // len(block) + 1)
        return out[:n]
    return {
        "config.json": b'{"architectures": ["LlamaForCausalLM"], "quantization_config": {}}',
        "generation_config.json": b"{}",
        "model-00001-of-00003.safetensors": blob(big, 1),
        "model-00002-of-00003.safetensors": blob(big - 1000, 2),
        "model-00003-of-00003.safetensors": blob(MiB // 2, 3),
        "tokenizer/tokenizer.json": b'{"model": {}}' * 50,
    }


def _env(s3, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FEWERBITS_"))}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(REPO / "crds"), str(REPO / "runtime")]),
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_REGION": s3.region,
        "FEWERBITS_TERMINATION_LOG": str(tmp_path / "termination-log"),
    })
    env.update(extra)
    return env


def _cmd(s3, bucket: str, key: str, dest: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "fewerbits_runtime", "fetch", "--storage-uri", f"s3://{bucket}/artifacts",
            "--key", key, "--dest", str(dest), "--endpoint", s3.endpoint, *more]


def _fetch(s3, bucket, key, dest, tmp_path, *more, env=None) -> tuple[subprocess.CompletedProcess, dict | None]:
    stats = tmp_path / f"stats-{time.monotonic_ns()}.json"
    r = subprocess.run(_cmd(s3, bucket, key, dest, "--stats-file", str(stats), "--progress-interval", "0.2", *more),
                       env=env or _env(s3, tmp_path), capture_output=True, text=True, timeout=300)
    return r, (json.loads(stats.read_text()) if stats.exists() else None)


def _termination(tmp_path: Path) -> dict:
    text = (tmp_path / "termination-log").read_text()
    assert text.count("\n") == 1 and len(text.encode()) <= 4096
    return json.loads(text)


def _publish(s3, bucket: str, files: dict[str, bytes], name: str):
    return publish_bytes(s3.client(), f"s3://{bucket}/artifacts", files, name=name)


def _assert_copy(dest: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        got = (dest / path).read_bytes()
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), path
    assert not (dest / STAGING_DIR).exists()


def test_round_trip_then_cache_hit_without_reading_objects(s3, s3_bucket, tmp_path):
    files = _files(b"round-trip")
    manifest = _publish(s3, s3_bucket, files, "round-trip")
    dest = tmp_path / "models" / manifest.key
    r, stats = _fetch(s3, s3_bucket, manifest.key, dest, tmp_path, "--part-size", "1Mi", "--concurrency", "8")
    assert r.returncode == 0, r.stderr
    _assert_copy(dest, files)
    assert stats["bytesDownloaded"] == manifest.totalBytes and not stats["cacheHit"]
    assert stats["fileGets"] == 4 + 4 + 1 + 3  # ranged parts of the three weight files + three small files
    assert json.loads((dest / DEST_MANIFEST_NAME).read_text())["key"] == manifest.key
    assert json.loads((dest / MARKER_NAME).read_text())["key"] == manifest.key
    assert "fetch done:" in r.stderr and "downloaded: files 6/6" in r.stderr
    assert _termination(tmp_path)["reason"] == "Fetched"

    # Cache hit: with the file objects gone from storage, only a fetch that reads none of them succeeds.
    client = s3.client()
    bucket, prefix = artifact_prefix(f"s3://{s3_bucket}/artifacts", manifest.key)
    for path in files:
        client.delete_object(Bucket=bucket, Key=f"{prefix}{FILES_DIR}/{path}")
    r, stats = _fetch(s3, s3_bucket, manifest.key, dest, tmp_path)
    assert r.returncode == 0, r.stderr
    assert stats["cacheHit"] and stats["bytesDownloaded"] == 0 and stats["fileGets"] == 0
    assert "cache hit" in r.stderr
    assert _termination(tmp_path)["reason"] == "CacheHit"


def test_corrupted_object_is_detected_and_named(s3, s3_bucket, tmp_path):
    files = _files(b"corrupt")
    manifest = _publish(s3, s3_bucket, files, "corrupt")
    victim = "model-00002-of-00003.safetensors"
    bad = bytearray(files[victim])
    bad[len(bad) // 2] ^= 0x40  # same size: only the digest can tell
    bucket, prefix = artifact_prefix(f"s3://{s3_bucket}/artifacts", manifest.key)
    s3.client().put_object(Bucket=bucket, Key=f"{prefix}{FILES_DIR}/{victim}", Body=bytes(bad))
    dest = tmp_path / manifest.key
    r, stats = _fetch(s3, s3_bucket, manifest.key, dest, tmp_path, "--part-size", "1Mi")
    assert r.returncode == EXIT_INTEGRITY, r.stderr
    term = _termination(tmp_path)
    expected, actual = hashlib.sha256(files[victim]).hexdigest(), hashlib.sha256(bad).hexdigest()
    assert term["reason"] == "DigestMismatch" and term["file"] == victim
    assert term["expected"] == expected and term["actual"] == actual
    assert victim in term["message"] and expected in term["message"] and actual in term["message"]
    assert stats is None
    assert not (dest / MARKER_NAME).exists()
    assert not (dest / victim).exists()


def _recorded(dest: Path, manifest, part_size: int) -> int:
    """Bytes a restarted fetch may reuse: whole files already renamed into place, plus the parts
    recorded (newline-terminated) in the state files beside the temporary files."""
    total = 0
    for mf in manifest.files:
        if (dest / mf.path).exists():
            total += mf.sizeBytes
            continue
        state = dest / STAGING_DIR / (mf.path + ".state")
        if not state.exists():
            continue
        for line in state.read_bytes().split(b"\n")[1:-1]:
            i = int(line)
            total += min(mf.sizeBytes, (i + 1) * part_size) - i * part_size
    return total


def test_killed_fetch_resumes_with_only_the_missing_parts(s3, s3_bucket, tmp_path):
    files = _files(b"resume", big=6 * MiB + 999)
    manifest = _publish(s3, s3_bucket, files, "resume")
    dest = tmp_path / manifest.key
    part = 256 * KiB
    # Throttled to ~4 MiB/s so the kill lands mid-download: a real process, SIGKILL, no cleanup.
    proc = subprocess.Popen(_cmd(s3, s3_bucket, manifest.key, dest, "--part-size", str(part), "--concurrency", "4",
                                 "--rate-limit", "4Mi", "--progress-interval", "0.2"),
                            env=_env(s3, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while _recorded(dest, manifest, part) < manifest.totalBytes // 3:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the fetch made no progress"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (dest / MARKER_NAME).exists()
    reusable = _recorded(dest, manifest, part)
    assert 0 < reusable < manifest.totalBytes

    r, stats = _fetch(s3, s3_bucket, manifest.key, dest, tmp_path, "--part-size", str(part), "--concurrency", "4")
    assert r.returncode == 0, r.stderr
    _assert_copy(dest, files)
    assert stats["bytesDownloaded"] == manifest.totalBytes - reusable
    assert stats["bytesReused"] == reusable
    assert stats["partsResumed"] > 0 and "resuming" in r.stderr
    assert (dest / MARKER_NAME).exists()


def test_missing_manifest_says_the_job_has_not_published(s3, s3_bucket, tmp_path):
    # The files are there, the manifest is not: no manifest means no artifact.
    key = key_inputs("never-published").key()
    bucket, prefix = artifact_prefix(f"s3://{s3_bucket}/artifacts", key)
    s3.client().put_object(Bucket=bucket, Key=f"{prefix}{FILES_DIR}/config.json", Body=b"{}")
    r, _ = _fetch(s3, s3_bucket, key, tmp_path / key, tmp_path)
    assert r.returncode == EXIT_ARTIFACT_MISSING, r.stderr
    message = (f"no artifact {key} at s3://{s3_bucket}/artifacts: manifest.json missing — the quantization Job "
               "has not published it")
    assert _termination(tmp_path) == {"component": "fetch", "reason": "ArtifactMissing", "exitCode": 10,
                                      "key": key, "message": message}
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("access_key,secret_key,code", [
    ("fewerbits-no-such-user", "whatever-secret-1", "InvalidAccessKeyId"),
    (None, "wrong-secret-for-the-user", "SignatureDoesNotMatch"),
])
def test_bad_credentials_are_named_and_never_logged(s3, s3_bucket, tmp_path, access_key, secret_key, code):
    manifest = _publish(s3, s3_bucket, {"config.json": b"{}"}, f"creds-{code}")
    env = _env(s3, tmp_path, AWS_ACCESS_KEY_ID=access_key or s3.access_key, AWS_SECRET_ACCESS_KEY=secret_key)
    r, _ = _fetch(s3, s3_bucket, manifest.key, tmp_path / "d", tmp_path, env=env)
    assert r.returncode == EXIT_ACCESS_DENIED, r.stderr
    term = _termination(tmp_path)
    assert term["reason"] == "StorageAccessDenied" and term["code"] == code
    assert code in term["message"] and "AWS_ACCESS_KEY_ID" in term["message"]
    for secret in (secret_key, s3.secret_key):
        assert secret not in r.stderr and secret not in json.dumps(term)
    assert "Traceback" not in r.stderr


def test_manifest_is_read_last_and_only_once_published(s3, s3_bucket, tmp_path):
    """Publishing order: files first, manifest last; the fetcher's view flips from 'no artifact'
    to a complete copy exactly when the manifest lands."""
    files = _files(b"order", big=MiB)
    manifest = _publish(s3, s3_bucket, files, "order")
    bucket, prefix = artifact_prefix(f"s3://{s3_bucket}/artifacts", manifest.key)
    client = s3.client()
    raw = client.get_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)["Body"].read()
    client.delete_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)
    dest = tmp_path / manifest.key
    r, _ = _fetch(s3, s3_bucket, manifest.key, dest, tmp_path)
    assert r.returncode == EXIT_ARTIFACT_MISSING
    client.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=raw)
    r, stats = _fetch(s3, s3_bucket, manifest.key, dest, tmp_path)
    assert r.returncode == 0, r.stderr
    _assert_copy(dest, files)
