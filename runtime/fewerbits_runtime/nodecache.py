"""The node-local artifact cache: one verified copy of an artifact per node, shared read-only.

Without it every new serving pod downloads the whole artifact into its own emptyDir, on every
scale-up, even on a node that served the same artifact an hour ago. With it (``fetch
--node-cache ROOT``, rendered when ``spec.serving.artifactCache`` is ``Node``) the fetch init
container works on a directory of the node (``ROOT``, a hostPath: see docs/cache.md for why and
for the Pod Security level that implies) instead:

    ROOT/artifacts/<key>/          the fetcher's destination: files only at their final name once
                                   their sha256 matched; ``.fewerbits-verified`` written last
    ROOT/state/<key>.json          the fingerprint of the verified copy (size, mtime, ctime and
                                   inode of every file) and when it was last used
    ROOT/locks/<key>.lock          held (exclusive) while one pod fetches, verifies or evicts it

* **Verified once per node.** The first pod on a node downloads and hashes every file; later pods
  of the same artifact take the key's lock, compare the fingerprint (one ``stat`` per file) and
  read the small manifest once from storage (the fetcher's cache hit): well under a second
  whatever the artifact's size. Artifacts are content-addressed (the key is a digest of
  everything that produced them), so a verified copy never goes stale.
* **A changed file is never served.** Any write to a cached file, a truncation or a ``touch``
  changes its ctime, which nobody can set back: the fingerprint no longer matches, the marker is
  withdrawn, the changed files are deleted and the fetcher downloads them again (the others are
  re-hashed, not trusted). Files are read-only (0444) and the serving container mounts the entry
  read-only. Silent corruption below the file system (bit rot that changes no metadata) is not
  seen by the fingerprint; ``--rehash`` re-reads every file instead.
* **In use means locked.** The launcher holds a shared ``flock`` on the entry's marker for the
  life of vLLM (it runs vLLM as its child); eviction needs the exclusive lock, so an artifact
  a running pod reads is never evicted under it, and a crashed pod releases it with its process.
* **Eviction** (before a download, and after one when the cache is over its budget): entries
  not in use and not referenced by a QuantizedModel (``--referenced-keys``, one key a line: the
  operator's ConfigMap, mounted into the fetch container) go first, least recently used first;
  then, only while the cache is still over its budget or the disk cannot hold the new artifact,
  referenced entries not in use, least recently used first. An entry in use is never evicted. If the disk still cannot hold it, the fetch fails with ``DiskFull`` and both figures in
  the termination message: a partial artifact has no marker and is never served.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import DiskFull
from .layout import MARKER_NAME, STAGING_DIR

# Standard library only at import time (the fetcher, boto3 and pydantic come in only when there is
# something to download): the hit path of a scale-up must not pay seconds of imports.

log = logging.getLogger("fewerbits.nodecache")

ARTIFACTS = "artifacts"
STATE = "state"
LOCKS = "locks"
TRASH = "trash"
READ_ONLY = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    bytes: int
    last_used: float
    verified: bool


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fmt_bytes(n: float) -> str:
    from .partfile import fmt_bytes as fmt

    return fmt(n)


def _fingerprint(path: Path) -> list[int]:
    st = os.stat(path, follow_symlinks=False)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


@contextlib.contextmanager
def _flock(path: Path, mode: int, blocking: bool = True) -> Iterator[bool]:
    """Yields whether the lock was taken (always True when blocking)."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT if mode == fcntl.LOCK_EX else os.O_RDONLY, 0o644)
    try:
        try:
            fcntl.flock(fd, mode | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


class NodeCache:
    def __init__(self, root: Path, budget_bytes: int | None = None, referenced: Iterable[str] | None = None,
                 reserve_bytes: int = 0) -> None:
        self.root = root
        self.budget = budget_bytes
        self.referenced = frozenset(referenced) if referenced is not None else None
        self.reserve = reserve_bytes
        for d in (ARTIFACTS, STATE, LOCKS, TRASH):
            (root / d).mkdir(parents=True, exist_ok=True)

    # ---- paths and state --------------------------------------------------------------------

    def entry(self, key: str) -> Path:
        return self.root / ARTIFACTS / key

    def _state_path(self, key: str) -> Path:
        return self.root / STATE / f"{key}.json"

    def _lock_path(self, key: str) -> Path:
        return self.root / LOCKS / f"{key}.lock"

    def _read_state(self, key: str) -> dict:
        try:
            return json.loads(self._state_path(key).read_text())
        except (OSError, ValueError):
            return {}

    def _write_state(self, key: str, doc: dict) -> None:
        p = self._state_path(key)
        tmp = p.with_name(f"{p.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(json.dumps(doc, sort_keys=True) + "\n")
        os.replace(tmp, p)

    def _files(self, key: str) -> list[Path]:
        base = self.entry(key)
        out = []
        for dirpath, dirs, files in os.walk(base):
            if Path(dirpath) == base and STAGING_DIR in dirs:
                dirs.remove(STAGING_DIR)
            out += [Path(dirpath) / f for f in files]
        return sorted(out)

    def entries(self) -> list[Entry]:
        out = []
        for p in sorted((self.root / ARTIFACTS).iterdir()):
            if not p.is_dir():
                continue
            state = self._read_state(p.name)
            last = float(state.get("lastUsed") or 0) or p.stat().st_mtime
            out.append(Entry(p.name, p, _dir_bytes(p), last, (p / MARKER_NAME).exists()))
        return out

    # ---- integrity --------------------------------------------------------------------------

    def changed_files(self, key: str) -> list[str] | None:
        """Files of a verified entry whose fingerprint changed since verification (relative
        paths; an unexpected or missing file counts), or None when there is no fingerprint."""
        recorded = self._read_state(key).get("files")
        if not isinstance(recorded, dict):
            return None
        base = self.entry(key)
        changed = []
        seen = set()
        for f in self._files(key):
            rel = f.relative_to(base).as_posix()
            if rel == MARKER_NAME:
                continue
            seen.add(rel)
            try:
                if _fingerprint(f) != recorded.get(rel):
                    changed.append(rel)
            except OSError:
                changed.append(rel)
        changed += sorted(set(recorded) - seen)
        return changed

    def _withdraw(self, key: str, changed: list[str] | None) -> None:
        """Take a changed entry out of service: marker first, then the changed files (the fetcher
        re-hashes the rest and downloads what is missing)."""
        base = self.entry(key)
        with contextlib.suppress(FileNotFoundError):
            (base / MARKER_NAME).unlink()
        for rel in changed or []:
            p = base / rel
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        if changed is None:  # no fingerprint at all: trust nothing that was verified elsewhere
            for f in self._files(key):
                f.chmod(0o644)
        st = self._read_state(key)
        st.pop("files", None)
        self._write_state(key, st)

    def hit(self, key: str, storage_uri: str, endpoint: str | None) -> dict | None:
        """The fetch statistics of a hit, or None: under the key's lock, an entry whose marker is
        present, that was verified from this same storage location (URI and endpoint: a pod never
        gets a copy through another store's credentials), and whose every file still matches its
        fingerprint. Storage is not contacted: the copy is content-addressed and was verified
        against the manifest when it was filled."""
        t0 = time.monotonic()
        base = self.entry(key)
        with _flock(self._lock_path(key), fcntl.LOCK_EX):
            try:
                marker = json.loads((base / MARKER_NAME).read_text())
            except (OSError, ValueError):
                return None
            state = self._read_state(key)
            if marker.get("key") != key or state.get("source") != {"uri": storage_uri, "endpoint": endpoint or ""}:
                return None
            if self.changed_files(key) != []:
                return None  # the full path withdraws and repairs it
            state["lastUsed"] = time.time()
            self._write_state(key, state)
        total = int(marker.get("totalBytes") or 0)
        log.info("node cache hit: %s holds a verified copy of %s (%d files); nothing downloaded", base, key,
                 int(marker.get("files") or 0))
        return {"key": key, "cacheHit": True, "offline": False, "filesTotal": int(marker.get("files") or 0),
                "filesDownloaded": 0, "filesReused": int(marker.get("files") or 0), "bytesTotal": total,
                "bytesDownloaded": 0, "bytesReused": total, "fileGets": 0, "partsResumed": 0, "filesRestarted": 0,
                "seconds": round(time.monotonic() - t0, 3), "mbPerSecond": 0.0}

    def _seal(self, key: str, source: dict | None = None) -> None:
        """Make the verified files read-only and record their fingerprint (after the chmod, which
        changes the ctime)."""
        base = self.entry(key)
        files = {}
        for f in self._files(key):
            rel = f.relative_to(base).as_posix()
            if rel == MARKER_NAME:
                continue
            if f.stat().st_mode & 0o777 != READ_ONLY:
                f.chmod(READ_ONLY)
            files[rel] = _fingerprint(f)
        self._write_state(key, {"key": key, "files": files, "verifiedAt": time.time(), "lastUsed": time.time(),
                                **({"source": source} if source else {})})

    # ---- eviction ---------------------------------------------------------------------------

    def _evict(self, e: Entry) -> bool:
        """Remove one entry if nobody fetches it and no pod holds it. True when removed."""
        with _flock(self._lock_path(e.key), fcntl.LOCK_EX, blocking=False) as got:
            if not got:
                return False
            marker = e.path / MARKER_NAME
            if marker.exists():
                with _flock(marker, fcntl.LOCK_EX, blocking=False) as free:
                    if not free:
                        return False
                    trash = self.root / TRASH / f"{e.key}.{uuid.uuid4().hex[:8]}"
                    os.rename(e.path, trash)
            else:
                trash = self.root / TRASH / f"{e.key}.{uuid.uuid4().hex[:8]}"
                os.rename(e.path, trash)
            self._state_path(e.key).unlink(missing_ok=True)
        for d, _dirs, _files in os.walk(trash):
            os.chmod(d, 0o755)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("evicted %s from the node cache (%s, last used %s)", e.key, fmt_bytes(e.bytes),
                 time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(e.last_used)))
        return True

    def eviction_order(self, keep: str | None = None) -> list[Entry]:
        """Candidates in the order they go: unreferenced least recently used first, then (only
        while the cache is still over its budget or the disk cannot hold the new artifact)
        referenced ones, least recently used first. Entries in use are skipped by ``_evict``."""
        cands = [e for e in self.entries() if e.key != keep]
        refs = self.referenced or frozenset()
        unref = sorted((e for e in cands if e.key not in refs), key=lambda e: e.last_used)
        ref = sorted((e for e in cands if e.key in refs), key=lambda e: e.last_used)
        return unref + ref

    def make_room(self, key: str, needed: int) -> list[str]:
        """Evict until the budget and the disk hold ``needed`` more bytes; returns evicted keys."""
        evicted = []
        total = sum(e.bytes for e in self.entries() if e.key != key) + _dir_bytes(self.entry(key))
        for e in self.eviction_order(keep=key):
            over_budget = self.budget is not None and total + needed > self.budget
            short = free_bytes(self.root) < needed + self.reserve
            if not (over_budget or short):
                break
            if self._evict(e):  # False for an entry in use (a pod holds it) or being fetched: never evicted
                evicted.append(e.key)
                total -= e.bytes
        return evicted

    # ---- the fetch --------------------------------------------------------------------------

    def fetch(self, opts, client=None):
        """Fetch ``opts.key`` into its entry (``FetchOptions``; its dest is replaced), repairing a
        changed copy, evicting for room; returns the fetcher's ``FetchStats``."""
        key = opts.key
        source = {"uri": opts.storage_uri, "endpoint": opts.endpoint or ""}
        opts.dest = self.entry(key)
        with _flock(self._lock_path(key), fcntl.LOCK_EX):
            base = self.entry(key)
            if (base / MARKER_NAME).exists():
                changed = self.changed_files(key)
                if changed is None or changed:
                    log.warning("node cache: %s changed since it was verified (%s): withdrawn, fetching again",
                                key, ", ".join(changed[:5]) if changed else "no fingerprint")
                    self._withdraw(key, changed)
            stats = _cache_fetcher(self, opts, client).run()
            st = self._read_state(key)
            if not stats.cacheHit or not st.get("files"):
                self._seal(key, source)
            else:
                st["lastUsed"] = time.time()
                st["source"] = source  # this location's manifest matched the verified copy
                self._write_state(key, st)
        if self.budget is not None:
            self.make_room(key, 0)
        return stats


def _cache_fetcher(cache: NodeCache, opts, client=None):
    from .fetch import Fetcher

    class _CacheFetcher(Fetcher):
        def _download(self, manifest) -> None:
            _make_room_for(cache, self, manifest)
            super()._download(manifest)

    return _CacheFetcher(opts, client=client)


def _make_room_for(cache: NodeCache, fetcher, manifest) -> None:
    """Before a download: refuse an artifact larger than the budget, evict for the rest."""
    key = fetcher.opts.key
    if cache.budget is not None and manifest.totalBytes > cache.budget:
        raise DiskFull(f"artifact {key} ({fmt_bytes(manifest.totalBytes)}) is larger than the node cache's budget "
                       f"({fmt_bytes(cache.budget)}): raise the budget or serve it with artifactCache: Pod",
                       neededBytes=manifest.totalBytes, budgetBytes=cache.budget)
    needed = max(0, manifest.totalBytes - _dir_bytes(fetcher.dest))
    evicted = cache.make_room(key, needed)
    if evicted:
        log.info("node cache: evicted %d artifact(s) to make room for %s", len(evicted), fmt_bytes(needed))


def read_referenced(path: Path | None) -> list[str] | None:
    """Keys listed in a file (one a line, '#' comments), or None when there is no such file."""
    if path is None:
        return None
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


__all__ = ["NodeCache", "Entry", "read_referenced"]
