"""The artifact fetcher: the serving pod's init container copies one artifact to local disk.

Model loading dominates cold start, so the fetch is built for throughput and for trust:

* one shared pool of download threads works through the parts of all files (ranged GETs), so
  small files never wait behind large ones and one slow connection never idles the others;
* each thread streams its part in 1 MiB chunks straight into a preallocated temporary file with
  ``os.pwrite``: memory stays at about ``concurrency x 1 MiB`` whatever the artifact size;
* a file is hashed in order while later parts still download (read back from the page cache),
  then compared with the manifest's sha256, fsync'ed and renamed into place: a file at its final
  name has always been verified;
* every completed part is appended to a state file beside the temporary file, so a restarted
  fetch (the pod was evicted, the node rebooted, the container was killed) downloads only the
  parts it lacks; the whole file is still verified at the end, and a resumed file that fails
  verification is downloaded once more from scratch before the fetch gives up;
* a verified copy is recorded by ``.fewerbits-verified`` (the manifest's digest); a later start
  with the same manifest and the same file sizes downloads nothing (``--rehash`` re-reads every
  file instead of trusting the sizes).

Layout (DESIGN.md "Artifacts", ``fewerbits_api.artifact``): ``<uri>/<key>/files/<path>`` and
``<uri>/<key>/manifest.json``, written last. No manifest means no artifact.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import math
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

from botocore.exceptions import ClientError
from pydantic import ValidationError

from fewerbits_api.artifact import FILES_DIR, MANIFEST_NAME, Manifest, ManifestFile, artifact_prefix

from .errors import (
    AccessDenied,
    ArtifactMissing,
    DiskFull,
    IntegrityError,
    ManifestInvalid,
    RuntimeFailure,
    StorageError,
)
from .layout import DEST_MANIFEST_NAME, MARKER_NAME, RESERVED_NAMES, STAGING_DIR  # noqa: F401 - re-exported
from .storage import TRANSIENT_ERRORS, error_code, make_client, translate

log = logging.getLogger("fewerbits.fetch")


MiB = 1024 * 1024
GiB = 1024 * MiB
DEFAULT_CONCURRENCY = 16
DEFAULT_PART_SIZE = 32 * MiB
MIN_PART_SIZE = 256 * 1024
CHUNK = 1 * MiB
HASH_READ = 1 * MiB
"""Read-back size for hashing: measured ~1.0 GB/s of CPU at 1 MiB against ~0.7 GB/s at 8 MiB
(the block stays in the CPU cache between the copy and the hash)."""
PART_ATTEMPTS = 5
STATE_VERSION = 1


@dataclass
class FetchOptions:
    storage_uri: str
    key: str
    dest: Path
    endpoint: str | None = None
    region: str | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    part_size: int = DEFAULT_PART_SIZE
    rehash: bool = False
    rate_limit: int | None = None
    """Bytes per second over all threads (None: unlimited)."""
    progress_interval: float = 10.0


@dataclass
class FetchStats:
    key: str = ""
    cacheHit: bool = False
    offline: bool = False
    filesTotal: int = 0
    filesDownloaded: int = 0
    filesReused: int = 0
    bytesTotal: int = 0
    bytesDownloaded: int = 0
    """Payload bytes received for file objects (retries included): 0 on a cache hit."""
    bytesReused: int = 0
    """Bytes already on disk and verified (whole files, or parts of a resumed file)."""
    fileGets: int = 0
    """GET requests for file objects (the manifest's GET is not counted)."""
    partsResumed: int = 0
    filesRestarted: int = 0
    seconds: float = 0.0
    mbPerSecond: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def to_dict(self) -> dict:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _safe_relpath(path: str) -> tuple[str, ...]:
    """The manifest's path as components, refused when it could leave dest or hit our own names.
    (ManifestFile's pattern allows '..' components; the fetcher is where that would matter.)"""
    parts = tuple(path.split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise ManifestInvalid(f"manifest lists an unsafe file path {path!r} (empty, '.' or '..' component)")
    if parts[0] in RESERVED_NAMES:
        raise ManifestInvalid(f"manifest lists a file path {path!r} that collides with the fetcher's own names")
    return parts


class _RateLimiter:
    """Paces all threads together to ``rate`` bytes per second."""

    def __init__(self, rate: int) -> None:
        self.rate = float(rate)
        self.lock = threading.Lock()
        self.next_time = time.monotonic()

    def acquire(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(self.next_time, now)
            self.next_time = start + n / self.rate
        if start > now:
            time.sleep(start - now)


class _FileJob:
    """One file being downloaded: its temporary file, its part state and its running hash."""

    def __init__(self, mf: ManifestFile, final: Path, part_path: Path, state_path: Path,
                 part_size: int) -> None:
        self.mf = mf
        self.final = final
        self.part_path = part_path
        self.state_path = state_path
        self.part_size = part_size
        self.nparts = math.ceil(mf.sizeBytes / part_size) if mf.sizeBytes else 0
        self.fd = -1
        self.state_fd = -1
        self.done: set[int] = set()
        self.resumed = False
        self.lock = threading.Lock()
        self.hash_lock = threading.Lock()
        self.hasher = hashlib.sha256()
        self.hashed_off = 0
        """Bytes hashed so far (in order)."""
        self.finished = False

    def part_range(self, i: int) -> tuple[int, int]:
        start = i * self.part_size
        return start, min(self.mf.sizeBytes, start + self.part_size) - 1

    def header(self) -> bytes:
        return (json.dumps({"v": STATE_VERSION, "size": self.mf.sizeBytes, "sha256": self.mf.sha256,
                            "partSize": self.part_size}, sort_keys=True) + "\n").encode()

    def load_state(self) -> bool:
        """Adopt the parts a previous run completed, if its state matches this file exactly."""
        try:
            raw = self.state_path.read_bytes()
            st = os.stat(self.part_path)
        except FileNotFoundError:
            return False
        lines = raw.split(b"\n")
        if not lines or (lines[0] + b"\n") != self.header() or st.st_size != self.mf.sizeBytes:
            return False
        done = set()
        for line in lines[1:-1]:  # only newline-terminated lines: a torn last write is not done
            if line.isdigit():
                i = int(line)
                if 0 <= i < self.nparts:
                    done.add(i)
        self.done = done
        self.resumed = bool(done)
        return True

    def open(self, fresh: bool) -> None:
        self.part_path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            self.done = set()
            self.resumed = False
            for p in (self.part_path, self.state_path):
                p.unlink(missing_ok=True)
        self.fd = os.open(self.part_path, os.O_RDWR | os.O_CREAT, 0o644)
        if fresh and self.mf.sizeBytes:
            _preallocate(self.fd, self.mf.sizeBytes, self.part_path)
        self.state_fd = os.open(self.state_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if fresh:
            os.write(self.state_fd, self.header())

    def mark_done(self, i: int) -> None:
        # Record first, then publish: the file is finalized (its fds closed) only once every part
        # is in `done`, so the state fd is still open here. O_APPEND: one short write per part; a
        # kill leaves at worst a torn last line.
        os.write(self.state_fd, f"{i}\n".encode())
        with self.lock:
            self.done.add(i)

    def close(self) -> None:
        for fd in (self.fd, self.state_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.state_fd = -1

    def discard(self) -> None:
        self.close()
        for p in (self.part_path, self.state_path):
            p.unlink(missing_ok=True)


def _preallocate(fd: int, size: int, path: Path) -> None:
    """Size the temporary file (sparse) so parts can be written anywhere with pwrite.

    Deliberately not posix_fallocate: on ext4, buffered writes into fallocated (unwritten)
    extents measured ~9x slower here (1 GiB from 16 threads: 6.1 s and 2.4 s of system time,
    against 0.7 s and 0.4 s into a sparse file) because every page maps and converts an unwritten
    extent under the inode's lock. Free space is checked for the whole artifact before the
    download starts instead, and ENOSPC while writing is reported the same way."""
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            raise _disk_full(path, size) from None
        raise


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
WRITEBACK_EVERY = 8 * MiB


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing this range to disk now (Linux sync_file_range, async).

    Without it the pages stay dirty until the fsync before the rename (dirty_expire is 30 s and
    the background threshold is a tenth of RAM), so the disk idles while the network works and
    then the network idles while the disk catches up. Starting writeback as parts land overlaps
    the two, keeps dirty memory (which counts against the init container's memory limit) small,
    and blocks only when the disk queue is full: natural backpressure at the disk's speed."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # best effort: errors surface at fsync


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _disk_full(path: Path, needed: int) -> DiskFull:
    try:
        free = _free_bytes(path.parent if not path.is_dir() else path)
    except OSError:
        free = -1
    return DiskFull(f"disk full writing {path}: needs {_fmt_bytes(needed)} ({needed} bytes), "
                    f"{_fmt_bytes(free)} ({free} bytes) free — give the model volume (emptyDir sizeLimit "
                    "or the cache PVC) room for the whole artifact", neededBytes=needed, freeBytes=free)


def _hash_file(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        remaining = size
        while remaining > 0:
            b = f.read(min(HASH_READ, remaining))
            if not b:
                break
            h.update(b)
            remaining -= len(b)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _disk_full(path, len(data)) from None
        raise


def read_marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


class Fetcher:
    def __init__(self, opts: FetchOptions, client=None) -> None:
        if opts.part_size < MIN_PART_SIZE:
            raise ValueError(f"part size must be at least {MIN_PART_SIZE} bytes")
        if opts.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.opts = opts
        self.bucket, self.prefix = artifact_prefix(opts.storage_uri, opts.key)
        self.where = f"s3://{self.bucket}/{self.prefix.rstrip('/')}"
        self.client = client or make_client(opts.endpoint, opts.region, opts.concurrency)
        self.dest = opts.dest
        self.staging = self.dest / STAGING_DIR
        self.stats = FetchStats(key=opts.key)
        self.limiter = _RateLimiter(opts.rate_limit) if opts.rate_limit else None
        self._stop = threading.Event()
        self._all_done = threading.Event()
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._pending_files = 0
        self._pending_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # ---- manifest ---------------------------------------------------------------------------

    def _missing(self) -> ArtifactMissing:
        return ArtifactMissing(
            f"no artifact {self.opts.key} at {self.opts.storage_uri}: {MANIFEST_NAME} missing — the "
            "quantization Job has not published it", key=self.opts.key)

    def read_manifest(self) -> tuple[Manifest, bytes]:
        obj = self.prefix + MANIFEST_NAME
        try:
            raw = self.client.get_object(Bucket=self.bucket, Key=obj)["Body"].read()
        except Exception as e:  # noqa: BLE001 - translated to a clear failure
            failure = translate(e, what=MANIFEST_NAME, where=self.where, key=self.opts.key,
                                missing=self._missing())
            failure.details["transient"] = isinstance(e, TRANSIENT_ERRORS)
            raise failure from None
        return self.parse_manifest(raw), raw

    def parse_manifest(self, raw: bytes) -> Manifest:
        try:
            manifest = Manifest.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first.get("loc", ()))
            raise ManifestInvalid(f"{self.where}/{MANIFEST_NAME} is not a valid manifest: {loc}: "
                                  f"{first.get('msg')} ({e.error_count()} error(s))") from None
        if manifest.key != self.opts.key:
            raise ManifestInvalid(f"{self.where}/{MANIFEST_NAME} is for key {manifest.key}, not the "
                                  f"requested {self.opts.key}")
        try:
            manifest.verify_key()
        except ValueError as e:
            raise ManifestInvalid(f"{self.where}/{MANIFEST_NAME}: {e}") from None
        seen: set[tuple[str, ...]] = set()
        for f in manifest.files:
            parts = _safe_relpath(f.path)
            if parts in seen:
                raise ManifestInvalid(f"manifest lists {f.path!r} twice")
            seen.add(parts)
        if sum(f.sizeBytes for f in manifest.files) != manifest.totalBytes:
            raise ManifestInvalid(f"manifest totalBytes {manifest.totalBytes} is not the sum of its file sizes")
        return manifest

    # ---- the verified-copy marker -----------------------------------------------------------

    def _final(self, mf: ManifestFile) -> Path:
        return self.dest.joinpath(*_safe_relpath(mf.path))

    def _sizes_match(self, manifest: Manifest) -> bool:
        for mf in manifest.files:
            try:
                st = os.stat(self._final(mf))
            except OSError:
                return False
            if st.st_size != mf.sizeBytes:
                log.warning("cached copy in %s: %s is %d bytes, manifest says %d; fetching again",
                            self.dest, mf.path, st.st_size, mf.sizeBytes)
                return False
        return True

    def _marker_valid(self, manifest: Manifest, manifest_sha: str) -> bool:
        marker = read_marker(self.dest)
        return bool(marker and marker.get("key") == self.opts.key
                    and marker.get("manifestSha256") == manifest_sha
                    and self._sizes_match(manifest))

    def _write_results(self, manifest_raw: bytes, manifest_sha: str, manifest: Manifest) -> None:
        _atomic_write(self.dest / DEST_MANIFEST_NAME, manifest_raw)
        marker = {"key": self.opts.key, "manifestSha256": manifest_sha, "files": len(manifest.files),
                  "totalBytes": manifest.totalBytes, "format": manifest.format.value,
                  "verifiedAt": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "source": f"{self.where}/"}
        _atomic_write(self.dest / MARKER_NAME, (json.dumps(marker, sort_keys=True) + "\n").encode())
        _fsync_dir(self.dest)

    # ---- the fetch --------------------------------------------------------------------------

    def run(self) -> FetchStats:
        t0 = time.monotonic()
        self.dest.mkdir(parents=True, exist_ok=True)
        try:
            manifest, raw = self.read_manifest()
        except StorageError as e:
            if e.details.get("transient") and self._offline_copy_ok():
                log.warning("%s; using the verified copy already in %s (artifacts are content-addressed)",
                            e.message, self.dest)
                self.stats.offline = self.stats.cacheHit = True
                self.stats.seconds = time.monotonic() - t0
                return self.stats
            raise
        manifest_sha = hashlib.sha256(raw).hexdigest()
        self.stats.filesTotal = len(manifest.files)
        self.stats.bytesTotal = manifest.totalBytes
        log.info("artifact %s: format %s, %d files, %s at %s -> %s", self.opts.key, manifest.format.value,
                 len(manifest.files), _fmt_bytes(manifest.totalBytes), self.where, self.dest)

        if self._marker_valid(manifest, manifest_sha) and (not self.opts.rehash or self._rehash_all(manifest)):
            if not (self.dest / DEST_MANIFEST_NAME).exists():
                _atomic_write(self.dest / DEST_MANIFEST_NAME, raw)
            self.stats.cacheHit = True
            self.stats.filesReused = len(manifest.files)
            self.stats.bytesReused = manifest.totalBytes
            self.stats.seconds = time.monotonic() - t0
            log.info("cache hit: %s already holds a verified copy of %s (%s)%s; nothing downloaded",
                     self.dest, self.opts.key, _fmt_bytes(manifest.totalBytes),
                     ", every file re-hashed" if self.opts.rehash else "")
            return self.stats

        (self.dest / MARKER_NAME).unlink(missing_ok=True)
        self._warn_unexpected(manifest)
        self._download(manifest)
        self._write_results(raw, manifest_sha, manifest)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.stats.seconds = time.monotonic() - t0
        self.stats.mbPerSecond = round(self.stats.bytesDownloaded / 1e6 / max(self.stats.seconds, 1e-9), 1)
        return self.stats

    def _offline_copy_ok(self) -> bool:
        marker = read_marker(self.dest)
        if not marker or marker.get("key") != self.opts.key:
            return False
        try:
            raw = (self.dest / DEST_MANIFEST_NAME).read_bytes()
            if hashlib.sha256(raw).hexdigest() != marker.get("manifestSha256"):
                return False
            manifest = self.parse_manifest(raw)
        except (OSError, RuntimeFailure):
            return False
        if not self._sizes_match(manifest):
            return False
        return not self.opts.rehash or self._rehash_all(manifest)

    def _rehash_all(self, manifest: Manifest) -> bool:
        ok = True
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            for mf, digest in zip(manifest.files, pool.map(
                    lambda m: _hash_file(self._final(m), m.sizeBytes), manifest.files)):
                if digest != mf.sha256:
                    log.warning("cached copy in %s: %s has sha256 %s, manifest says %s; fetching again",
                                self.dest, mf.path, digest, mf.sha256)
                    ok = False
        return ok

    def _warn_unexpected(self, manifest: Manifest) -> None:
        listed = {_safe_relpath(f.path)[0] for f in manifest.files} | RESERVED_NAMES
        extra = sorted(p.name for p in self.dest.iterdir() if p.name not in listed) if self.dest.exists() else []
        if extra:
            log.warning("%s holds entries the manifest does not list (left alone): %s", self.dest,
                        ", ".join(extra[:10]))

    def _fail(self, e: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = e
        self._stop.set()
        self._all_done.set()

    def _file_finished(self) -> None:
        with self._pending_lock:
            self._pending_files -= 1
            if self._pending_files == 0:
                self._all_done.set()

    def _download(self, manifest: Manifest) -> None:
        # Files already at their final name (a run interrupted after renaming them, or a marker that
        # did not match): keep the ones whose content verifies.
        todo: list[ManifestFile] = []
        existing: list[ManifestFile] = []
        for mf in manifest.files:
            final = self._final(mf)
            if final.is_file() and not final.is_symlink() and final.stat().st_size == mf.sizeBytes:
                existing.append(mf)
            else:
                if final.is_symlink() or final.is_file():
                    final.unlink()
                todo.append(mf)
        if existing:
            log.info("verifying %d file(s) already in %s", len(existing), self.dest)
            with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
                digests = list(pool.map(lambda m: _hash_file(self._final(m), m.sizeBytes), existing))
            for mf, digest in zip(existing, digests):
                if digest == mf.sha256:
                    self.stats.add(filesReused=1, bytesReused=mf.sizeBytes)
                else:
                    log.warning("%s in %s does not match the manifest; fetching it again", mf.path, self.dest)
                    self._final(mf).unlink()
                    todo.append(mf)

        jobs = []
        for mf in todo:
            rel = _safe_relpath(mf.path)
            stage = self.staging.joinpath(*rel)
            jobs.append(_FileJob(mf, self._final(mf), stage.with_name(stage.name + ".part"),
                                 stage.with_name(stage.name + ".state"), self.opts.part_size))
        resumable = [j for j in jobs if j.load_state()]
        resumable_ids = {id(j) for j in resumable}
        fresh = [j for j in jobs if id(j) not in resumable_ids]
        self.staging.mkdir(parents=True, exist_ok=True)
        needed = sum(j.mf.sizeBytes for j in fresh)
        free = _free_bytes(self.staging)
        if needed > free:
            raise DiskFull(
                f"not enough space in {self.dest}: the artifact needs {_fmt_bytes(needed)} ({needed} bytes) "
                f"more, {_fmt_bytes(free)} ({free} bytes) free — give the model volume (emptyDir sizeLimit "
                "or the cache PVC) room for the whole artifact", neededBytes=needed, freeBytes=free)
        for j in resumable:
            j.open(fresh=False)
            done_bytes = sum(j.part_range(i)[1] - j.part_range(i)[0] + 1 for i in j.done)
            self.stats.add(partsResumed=len(j.done), bytesReused=done_bytes)
            log.info("resuming %s: %d of %d parts already downloaded (%s)", j.mf.path, len(j.done),
                     j.nparts, _fmt_bytes(done_bytes))
        try:
            for j in fresh:
                j.open(fresh=True)
        except DiskFull:
            for j in jobs:
                j.close()
            raise

        if not jobs:
            return
        self._pending_files = len(jobs)
        workers = self.opts.concurrency
        start = time.monotonic()
        progress = threading.Thread(target=self._report_progress, args=(start,), daemon=True)
        pool = self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fetch")
        try:
            # Largest files first: the small ones then fill the threads while the last large file's
            # hash and fsync finish, instead of those running alone at the end.
            for j in sorted(jobs, key=lambda j: -j.mf.sizeBytes):
                missing = [i for i in range(j.nparts) if i not in j.done]
                if not missing:  # every part was done before the interruption: just verify
                    pool.submit(self._guard, self._advance_hash, j)
                for i in missing:
                    pool.submit(self._guard, self._download_part, j, i)
            progress.start()
            self._all_done.wait()
        finally:
            self._stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            for j in jobs:
                j.close()
        if self._error is not None:
            raise self._error
        self._report_line(start, final=True)
        dirs = {j.final.parent for j in jobs}
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            _fsync_dir(d)

    def _guard(self, fn, *args) -> None:
        if self._stop.is_set():
            return
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - the first failure stops the fetch
            self._fail(e)

    def _object_key(self, mf: ManifestFile) -> str:
        return f"{self.prefix}{FILES_DIR}/{mf.path}"

    def _download_part(self, job: _FileJob, i: int) -> None:
        start, end = job.part_range(i)
        obj = self._object_key(job.mf)
        where = f"s3://{self.bucket}/{obj}"
        # A retry continues where the failed attempt stopped: bytes already written (and perhaps
        # already hashed from memory) are never written a second time, so what was hashed is
        # exactly what is on disk even if the object changed between attempts.
        progress = [start]
        for attempt in range(1, PART_ATTEMPTS + 1):
            if self._stop.is_set():
                return
            try:
                if not self._get_range(job, obj, start, end, progress):
                    return  # stopping: the part is not done
                break
            except RuntimeFailure:
                raise
            except ClientError as e:
                code = error_code(e)
                if code in ("NoSuchKey", "404"):
                    raise IntegrityError(f"{job.mf.path} is listed in the manifest but missing from storage "
                                         f"({where}): the artifact is incomplete", file=job.mf.path) from None
                if code == "InvalidRange":
                    raise IntegrityError(f"size mismatch for {job.mf.path}: the object at {where} is shorter "
                                         f"than the manifest's {job.mf.sizeBytes} bytes", file=job.mf.path) from None
                failure = translate(e, what=job.mf.path, where=where)
                if isinstance(failure, AccessDenied) or attempt == PART_ATTEMPTS:
                    raise failure from None
                self._backoff(job, i, attempt, e)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise _disk_full(job.part_path, job.mf.sizeBytes) from None
                if isinstance(e, (ConnectionError, TimeoutError)) and attempt < PART_ATTEMPTS:
                    self._backoff(job, i, attempt, e)
                    continue
                raise
            except Exception as e:  # noqa: BLE001 - botocore/urllib3 read errors: retry the part
                if attempt == PART_ATTEMPTS:
                    raise translate(e, what=job.mf.path, where=where) from None
                self._backoff(job, i, attempt, e)
        else:
            return
        job.mark_done(i)
        self._advance_hash(job)

    def _backoff(self, job: _FileJob, i: int, attempt: int, e: Exception) -> None:
        log.warning("part %d of %s failed (%s), retrying (attempt %d of %d)", i, job.mf.path,
                    type(e).__name__, attempt + 1, PART_ATTEMPTS)
        time.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))

    def _get_range(self, job: _FileJob, obj: str, start: int, end: int, progress: list[int]) -> bool:
        """Stream the rest of one part (from progress[0]) into place, keeping progress[0] at the
        first byte not yet written; False when the fetch is stopping (part incomplete)."""
        resp = self.client.get_object(Bucket=self.bucket, Key=obj, Range=f"bytes={progress[0]}-{end}")
        self.stats.add(fileGets=1)
        total = str(resp.get("ContentRange", "")).rpartition("/")[2]
        if total.isdigit() and int(total) != job.mf.sizeBytes:
            resp["Body"].close()
            raise IntegrityError(
                f"size mismatch for {job.mf.path}: expected {job.mf.sizeBytes} bytes, the object at "
                f"s3://{self.bucket}/{obj} has {total}", file=job.mf.path, expectedBytes=job.mf.sizeBytes,
                actualBytes=int(total))
        body = resp["Body"]
        off = progress[0]
        flushed = off
        try:
            while off <= end:
                if self._stop.is_set():
                    return False
                chunk = body.read(min(CHUNK, end + 1 - off))
                if not chunk:
                    raise ConnectionError(f"short read at byte {off} of {job.mf.path}")
                if self.limiter:
                    self.limiter.acquire(len(chunk))
                view = memoryview(chunk)
                while view:
                    n = os.pwrite(job.fd, view, off)
                    off += n
                    view = view[n:]
                progress[0] = off
                self.stats.add(bytesDownloaded=len(chunk))
                self._hash_inline(job, start, off - len(chunk), chunk)
                if off - flushed >= WRITEBACK_EVERY or off > end:
                    _start_writeback(job.fd, flushed, off - flushed)
                    flushed = off
        finally:
            body.close()
        return True

    def _hash_range(self, job: _FileJob, start: int, end: int) -> None:
        """Hash bytes [start, end) read back from the temporary file (page cache); hash_lock held."""
        off = start
        while off < end:
            b = os.pread(job.fd, min(HASH_READ, end - off), off)
            if not b:
                raise IntegrityError(f"{job.part_path} is shorter than expected")
            job.hasher.update(b)
            off += len(b)
        job.hashed_off = end

    def _complete(self, job: _FileJob) -> bool:
        """Every byte hashed and every part recorded: ready to verify (inline hashing can reach the
        end before the last part's thread has recorded it)."""
        if job.finished or job.hashed_off < job.mf.sizeBytes:
            return False
        with job.lock:
            return len(job.done) == job.nparts

    def _next_ready(self, job: _FileJob) -> bool:
        """Whether the byte at the hash frontier lies in a completed part."""
        if job.hashed_off >= job.mf.sizeBytes:
            return False
        with job.lock:
            return job.hashed_off // job.part_size in job.done

    def _hash_inline(self, job: _FileJob, part_start: int, chunk_start: int, chunk: bytes) -> None:
        """Hash a chunk straight from memory while it is still in the CPU cache, when the hash
        frontier has reached this part (so everything before it is hashed): the frontier part's
        thread keeps the file's hash current and most bytes are never read back. Best effort:
        whatever is skipped is read back when the part completes."""
        if not job.hash_lock.acquire(blocking=False):
            return
        try:
            if job.finished or not part_start <= job.hashed_off <= chunk_start:
                return
            if job.hashed_off < chunk_start:  # catch up on this part's earlier chunks (just written)
                self._hash_range(job, job.hashed_off, chunk_start)
            job.hasher.update(chunk)
            job.hashed_off = chunk_start + len(chunk)
        finally:
            job.hash_lock.release()

    def _advance_hash(self, job: _FileJob) -> None:
        """Hash forward through completed parts; the thread that hashes the last byte verifies,
        fsyncs and renames. Only one thread hashes a file at a time; a thread that finds it busy
        leaves, and the holder re-checks after releasing so no completed part is missed."""
        while True:
            if not job.hash_lock.acquire(blocking=False):
                return
            try:
                if job.finished:
                    return
                while self._next_ready(job):
                    _, e = job.part_range(job.hashed_off // job.part_size)
                    self._hash_range(job, job.hashed_off, e + 1)
                if self._complete(job):
                    job.finished = True
                    self._finalize(job)
                    return
            finally:
                job.hash_lock.release()
            if not (self._next_ready(job) or self._complete(job)):
                return

    def _finalize(self, job: _FileJob) -> None:
        actual = job.hasher.hexdigest()
        mf = job.mf
        if actual != mf.sha256:
            resumed = job.resumed
            job.discard()
            if resumed:
                # The parts a previous run left may be the culprit (a node crash can lose page-cache
                # writes that the state file already recorded): download the whole file once more.
                log.warning("%s: sha256 mismatch after resuming; downloading the whole file again", mf.path)
                self.stats.add(filesRestarted=1)
                self._restart(job)
                return
            raise IntegrityError(
                f"digest mismatch for {mf.path}: expected sha256 {mf.sha256}, got {actual} (object "
                f"s3://{self.bucket}/{self._object_key(mf)}); the stored artifact is corrupt or was "
                "changed after publishing — re-run its quantization Job",
                file=mf.path, expected=mf.sha256, actual=actual)
        try:
            os.fsync(job.fd)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise _disk_full(job.part_path, mf.sizeBytes) from None
            raise
        job.close()
        job.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(job.part_path, job.final)
        job.state_path.unlink(missing_ok=True)
        self.stats.add(filesDownloaded=1)
        log.debug("verified %s", mf.path)
        self._file_finished()

    def _restart(self, job: _FileJob) -> None:
        job.hasher = hashlib.sha256()
        job.hashed_off = 0
        job.finished = False
        job.open(fresh=True)
        if job.nparts == 0:
            raise IntegrityError(f"digest mismatch for empty file {job.mf.path}")
        for i in range(job.nparts):
            self._pool.submit(self._guard, self._download_part, job, i)

    # ---- progress ---------------------------------------------------------------------------

    def _report_progress(self, start: float) -> None:
        self._last = (start, 0)
        while not self._all_done.wait(self.opts.progress_interval):
            self._report_line(start)

    def _report_line(self, start: float, final: bool = False) -> None:
        s = self.stats
        now = time.monotonic()
        elapsed = max(now - start, 1e-9)
        done_bytes = s.bytesReused + s.bytesDownloaded
        avg = s.bytesDownloaded / elapsed
        last_t, last_b = getattr(self, "_last", (start, 0))
        rate = (s.bytesDownloaded - last_b) / max(now - last_t, 1e-9)
        self._last = (now, s.bytesDownloaded)
        left = max(0, s.bytesTotal - done_bytes)
        eta = f"{left / avg:.0f}s" if avg > 0 else "?"
        pct = 100.0 * done_bytes / s.bytesTotal if s.bytesTotal else 100.0
        log.info("%s files %d/%d, %s/%s (%.1f%%), %.1f MB/s (avg %.1f MB/s), ETA %s",
                 "downloaded:" if final else "progress:", s.filesDownloaded + s.filesReused, s.filesTotal,
                 _fmt_bytes(done_bytes), _fmt_bytes(s.bytesTotal), pct, rate / 1e6, avg / 1e6,
                 "0s" if final else eta)


def fetch(opts: FetchOptions, client=None) -> FetchStats:
    return Fetcher(opts, client=client).run()
