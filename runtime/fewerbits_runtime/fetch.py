"""The artifact fetcher: the serving pod's init container copies one artifact to local disk.

Model loading dominates cold start, so the fetch is built for throughput and for trust. This
module orchestrates (the manifest, the plan of parts, retries, verification, the destination's
layout); ``partfile`` does the I/O of one file (ranged writes, in-order hashing, state, fsync).

* one shared pool of download threads works through the parts of all files (ranged GETs), so
  small files never wait behind large ones and one slow connection never idles the others;
* a file is hashed in order while later parts still download, then compared with the manifest's
  sha256, fsync'ed and renamed into place: a file at its final name has always been verified;
* a restarted fetch (the pod was evicted, the node rebooted, the container was killed) downloads
  only the parts it lacks; the whole file is still verified at the end, and a resumed file that
  fails verification is downloaded once more from scratch before the fetch gives up;
* a verified copy is recorded by ``.fewerbits-verified`` (the manifest's digest); a later start
  with the same manifest and the same file sizes downloads nothing (``--rehash`` re-reads every
  file instead of trusting the sizes).

Layout (``fewerbits_api.artifact``): ``<uri>/<key>/files/<path>`` and ``<uri>/<key>/manifest.json``,
written last. No manifest means no artifact.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

from fewerbits_api.artifact import FILES_DIR, MANIFEST_NAME, Manifest, ManifestError, ManifestFile, artifact_prefix
from fewerbits_api.s3errors import S3ErrorKind, classify_s3_error, s3_error_code

from .errors import AccessDenied, ArtifactMissing, DiskFull, IntegrityError, ManifestInvalid, RuntimeFailure, StorageError
from .layout import DEST_MANIFEST_NAME, MARKER_NAME, RESERVED_NAMES, STAGING_DIR  # noqa: F401 - re-exported
from .partfile import (
    MiB,
    PartFile,
    RateLimiter,
    atomic_write,
    disk_full,
    fmt_bytes,
    free_bytes,
    fsync_dir,
    hash_file,
)
from .storage import make_client, translate

log = logging.getLogger("fewerbits.fetch")

DEFAULT_CONCURRENCY = 16
DEFAULT_PART_SIZE = 32 * MiB
MIN_PART_SIZE = 256 * 1024
PART_ATTEMPTS = 5


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
        self.limiter = RateLimiter(opts.rate_limit) if opts.rate_limit else None
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
            raise translate(e, what=MANIFEST_NAME, where=self.where, key=self.opts.key,
                            missing=self._missing()) from None
        return self.parse_manifest(raw), raw

    def parse_manifest(self, raw: bytes) -> Manifest:
        """``Manifest.parse`` (every check a reader needs), then the fetcher's own: no file may take
        a name the fetcher keeps for itself in the destination."""
        try:
            manifest = Manifest.parse(raw, self.opts.key)
        except ManifestError as e:
            raise ManifestInvalid(f"{self.where}/{MANIFEST_NAME} {e.message}") from None
        for f in manifest.files:
            if f.path.split("/")[0] in RESERVED_NAMES:
                raise ManifestInvalid(f"{self.where}/{MANIFEST_NAME} lists a file path {f.path!r} that collides "
                                      "with the fetcher's own names")
        return manifest

    # ---- the verified-copy marker -----------------------------------------------------------

    def _final(self, mf: ManifestFile) -> Path:
        return self.dest.joinpath(*mf.path.split("/"))  # Manifest.parse: relative, no '..'

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
        atomic_write(self.dest / DEST_MANIFEST_NAME, manifest_raw)
        marker = {"key": self.opts.key, "manifestSha256": manifest_sha, "files": len(manifest.files),
                  "totalBytes": manifest.totalBytes, "format": manifest.format.value,
                  "verifiedAt": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "source": f"{self.where}/"}
        atomic_write(self.dest / MARKER_NAME, (json.dumps(marker, sort_keys=True) + "\n").encode())
        fsync_dir(self.dest)

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
                 len(manifest.files), fmt_bytes(manifest.totalBytes), self.where, self.dest)

        if self._marker_valid(manifest, manifest_sha) and (not self.opts.rehash or self._rehash_all(manifest)):
            if not (self.dest / DEST_MANIFEST_NAME).exists():
                atomic_write(self.dest / DEST_MANIFEST_NAME, raw)
            self.stats.cacheHit = True
            self.stats.filesReused = len(manifest.files)
            self.stats.bytesReused = manifest.totalBytes
            self.stats.seconds = time.monotonic() - t0
            log.info("cache hit: %s already holds a verified copy of %s (%s)%s; nothing downloaded",
                     self.dest, self.opts.key, fmt_bytes(manifest.totalBytes),
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
                    lambda m: hash_file(self._final(m), m.sizeBytes), manifest.files)):
                if digest != mf.sha256:
                    log.warning("cached copy in %s: %s has sha256 %s, manifest says %s; fetching again",
                                self.dest, mf.path, digest, mf.sha256)
                    ok = False
        return ok

    def _warn_unexpected(self, manifest: Manifest) -> None:
        listed = {f.path.split("/")[0] for f in manifest.files} | RESERVED_NAMES
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
        jobs = self._open_parts(self._still_to_fetch(manifest))
        if jobs:
            self._fetch_parts(jobs)

    def _still_to_fetch(self, manifest: Manifest) -> list[ManifestFile]:
        """The manifest's files not already in place. Files at their final name (a run interrupted
        after renaming them, or a marker that did not match) are kept when their content verifies."""
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
                digests = list(pool.map(lambda m: hash_file(self._final(m), m.sizeBytes), existing))
            for mf, digest in zip(existing, digests):
                if digest == mf.sha256:
                    self.stats.add(filesReused=1, bytesReused=mf.sizeBytes)
                else:
                    log.warning("%s in %s does not match the manifest; fetching it again", mf.path, self.dest)
                    self._final(mf).unlink()
                    todo.append(mf)
        return todo

    def _open_parts(self, todo: list[ManifestFile]) -> list[PartFile]:
        """A part file per file to fetch, resumed where a previous run left its state; refuses
        (DiskFull) when the fresh ones do not fit."""
        jobs = []
        for mf in todo:
            stage = self.staging.joinpath(*mf.path.split("/"))
            jobs.append(PartFile(mf, self._final(mf), stage.with_name(stage.name + ".part"),
                                 stage.with_name(stage.name + ".state"), self.opts.part_size))
        resumable = [j for j in jobs if j.load_state()]
        resumable_ids = {id(j) for j in resumable}
        fresh = [j for j in jobs if id(j) not in resumable_ids]
        self.staging.mkdir(parents=True, exist_ok=True)
        needed = sum(j.mf.sizeBytes for j in fresh)
        free = free_bytes(self.staging)
        if needed > free:
            raise DiskFull(
                f"not enough space in {self.dest}: the artifact needs {fmt_bytes(needed)} ({needed} bytes) "
                f"more, {fmt_bytes(free)} ({free} bytes) free — give the model volume (emptyDir sizeLimit "
                "or the cache PVC) room for the whole artifact", neededBytes=needed, freeBytes=free)
        for j in resumable:
            j.open(fresh=False)
            done_bytes = j.done_bytes()
            self.stats.add(partsResumed=len(j.done), bytesReused=done_bytes)
            log.info("resuming %s: %d of %d parts already downloaded (%s)", j.mf.path, len(j.done),
                     j.nparts, fmt_bytes(done_bytes))
        try:
            for j in fresh:
                j.open(fresh=True)
        except DiskFull:
            for j in jobs:
                j.close()
            raise
        return jobs

    def _fetch_parts(self, jobs: list[PartFile]) -> None:
        """Download every missing part on the thread pool, report progress, fsync the folders."""
        self._pending_files = len(jobs)
        start = time.monotonic()
        progress = threading.Thread(target=self._report_progress, args=(start,), daemon=True)
        pool = self._pool = ThreadPoolExecutor(max_workers=self.opts.concurrency, thread_name_prefix="fetch")
        try:
            # Largest files first: the small ones then fill the threads while the last large file's
            # hash and fsync finish, instead of those running alone at the end.
            for j in sorted(jobs, key=lambda j: -j.mf.sizeBytes):
                missing = j.missing_parts()
                if not missing:  # every part was done before the interruption: just verify
                    pool.submit(self._guard, j.advance_hash, self._finalize)
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
            fsync_dir(d)

    def _guard(self, fn, *args) -> None:
        if self._stop.is_set():
            return
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - the first failure stops the fetch
            self._fail(e)

    def _object_key(self, mf: ManifestFile) -> str:
        return f"{self.prefix}{FILES_DIR}/{mf.path}"

    def _download_part(self, job: PartFile, i: int) -> None:
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
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise disk_full(job.part_path, job.mf.sizeBytes) from None
                if isinstance(e, (ConnectionError, TimeoutError)) and attempt < PART_ATTEMPTS:
                    self._backoff(job, i, attempt, e)
                    continue
                raise
            except Exception as e:  # noqa: BLE001 - S3 errors and botocore/urllib3 read errors
                self._part_failed(job, i, attempt, e, where)
        else:
            return
        job.mark_done(i)
        job.advance_hash(self._finalize)

    def _part_failed(self, job: PartFile, i: int, attempt: int, e: Exception, where: str) -> None:
        """Raise what a failed GET of part ``i`` means, or back off before the next attempt."""
        kind = classify_s3_error(e).kind
        if kind is S3ErrorKind.NOT_FOUND:
            raise IntegrityError(f"{job.mf.path} is listed in the manifest but missing from storage "
                                 f"({where}): the artifact is incomplete", file=job.mf.path) from None
        if s3_error_code(e) == "InvalidRange":
            raise IntegrityError(f"size mismatch for {job.mf.path}: the object at {where} is shorter "
                                 f"than the manifest's {job.mf.sizeBytes} bytes", file=job.mf.path) from None
        failure = translate(e, what=job.mf.path, where=where)
        if isinstance(failure, AccessDenied) or attempt == PART_ATTEMPTS:
            raise failure from None
        self._backoff(job, i, attempt, e)

    def _backoff(self, job: PartFile, i: int, attempt: int, e: Exception) -> None:
        log.warning("part %d of %s failed (%s), retrying (attempt %d of %d)", i, job.mf.path,
                    type(e).__name__, attempt + 1, PART_ATTEMPTS)
        time.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))

    def _get_range(self, job: PartFile, obj: str, start: int, end: int, progress: list[int]) -> bool:
        """GET the rest of one part (from progress[0]) and stream it into place; False when the
        fetch is stopping (part incomplete)."""
        resp = self.client.get_object(Bucket=self.bucket, Key=obj, Range=f"bytes={progress[0]}-{end}")
        self.stats.add(fileGets=1)
        total = str(resp.get("ContentRange", "")).rpartition("/")[2]
        if total.isdigit() and int(total) != job.mf.sizeBytes:
            resp["Body"].close()
            raise IntegrityError(
                f"size mismatch for {job.mf.path}: expected {job.mf.sizeBytes} bytes, the object at "
                f"s3://{self.bucket}/{obj} has {total}", file=job.mf.path, expectedBytes=job.mf.sizeBytes,
                actualBytes=int(total))
        return job.write_stream(resp["Body"], start, progress, end, self._stop, self.limiter,
                                lambda n: self.stats.add(bytesDownloaded=n))

    def _finalize(self, job: PartFile) -> None:
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
        job.commit()
        self.stats.add(filesDownloaded=1)
        log.debug("verified %s", mf.path)
        self._file_finished()

    def _restart(self, job: PartFile) -> None:
        job.reopen_fresh()
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
                 fmt_bytes(done_bytes), fmt_bytes(s.bytesTotal), pct, rate / 1e6, avg / 1e6,
                 "0s" if final else eta)


def fetch(opts: FetchOptions, client=None) -> FetchStats:
    return Fetcher(opts, client=client).run()
