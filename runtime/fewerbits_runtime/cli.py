"""``python -m fewerbits_runtime fetch|launch``: the serving pod's two entrypoints.

Every option can also come from an environment variable (the flag wins), so the operator can
render either form. Storage credentials are never options: boto3's default chain reads
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (from the storage Secret) or the pod's identity.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

from .errors import (
    EXIT_OK,
    EXIT_USAGE,
    RuntimeFailure,
    UsageError,
    termination_message,
    write_termination_message,
)

log = logging.getLogger("fewerbits.runtime")

# Option -> environment variable (documented in runtime/README.md).
ENV = {
    "storage_uri": "FEWERBITS_STORAGE_URI",
    "key": "FEWERBITS_ARTIFACT_KEY",
    "dest": "FEWERBITS_DEST",
    "endpoint": "FEWERBITS_STORAGE_ENDPOINT",
    "region": "FEWERBITS_STORAGE_REGION",
    "concurrency": "FEWERBITS_FETCH_CONCURRENCY",
    "part_size": "FEWERBITS_FETCH_PART_SIZE",
    "rate_limit": "FEWERBITS_FETCH_RATE_LIMIT",
    "rehash": "FEWERBITS_FETCH_REHASH",
    "progress_interval": "FEWERBITS_FETCH_PROGRESS_INTERVAL",
    "stats_file": "FEWERBITS_FETCH_STATS_FILE",
    "format": "FEWERBITS_FORMAT",
    "node_cc": "FEWERBITS_NODE_GPU_CC",
    "manifest": "FEWERBITS_MANIFEST",
    "require_gpu_info": "FEWERBITS_REQUIRE_GPU_INFO",
    "launcher_dir": "FEWERBITS_LAUNCHER_DIR",
    "node_cache": "FEWERBITS_NODE_CACHE",
    "node_cache_budget": "FEWERBITS_NODE_CACHE_BUDGET",
    "referenced_keys": "FEWERBITS_REFERENCED_KEYS",
    "manifest_only": "FEWERBITS_MANIFEST_ONLY",
    "adapters": "FEWERBITS_ADAPTER_KEYS",
    "adapters_dir": "FEWERBITS_ADAPTERS_DIR",
}

_SIZE_SUFFIX = {"": 1, "k": 1024, "ki": 1024, "m": 1024**2, "mi": 1024**2, "g": 1024**3, "gi": 1024**3}


def parse_size(text: str) -> int:
    """'33554432', '32Mi', '32M', '1Gi' -> bytes (binary multiples either way)."""
    t = text.strip().lower().removesuffix("b")
    num = t.rstrip("kmgi")
    suffix = t[len(num):]
    if not num or suffix not in _SIZE_SUFFIX:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 33554432, 32Mi, 1Gi)")
    try:
        return int(float(num) * _SIZE_SUFFIX[suffix])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None


def _bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def _env_default(dest: str, conv=str):
    raw = os.environ.get(ENV[dest])
    if raw is None or raw == "":
        return None
    try:
        return conv(raw)
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise UsageError(f"{ENV[dest]}={raw!r}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fewerbits_runtime",
                                description="fewerbits serving-pod runtime: fetch an artifact, launch vLLM")
    p.add_argument("--log-level", default=os.environ.get("FEWERBITS_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fetch", help="download and verify one artifact into a local directory")
    f.add_argument("--storage-uri", help=f"s3://bucket/prefix the artifact was published under [{ENV['storage_uri']}]")
    f.add_argument("--key", help=f"artifact key, sha256 hex [{ENV['key']}]")
    f.add_argument("--dest", type=Path, help=f"local directory, e.g. /models/<key> [{ENV['dest']}]")
    f.add_argument("--endpoint", help=f"S3 endpoint URL for S3-compatible stores [{ENV['endpoint']}]")
    f.add_argument("--region", help=f"bucket region [{ENV['region']}, else AWS_REGION]")
    f.add_argument("--concurrency", type=int, help=f"parts in flight (default 16) [{ENV['concurrency']}]")
    f.add_argument("--part-size", type=parse_size, help=f"bytes per ranged GET (default 32Mi) [{ENV['part_size']}]")
    f.add_argument("--rate-limit", type=parse_size,
                   help=f"bytes per second over all threads, e.g. 200Mi (default unlimited) [{ENV['rate_limit']}]")
    f.add_argument("--rehash", action="store_true", default=None,
                   help=f"re-hash a cached copy instead of trusting marker + sizes [{ENV['rehash']}=true]")
    f.add_argument("--progress-interval", type=float,
                   help=f"seconds between progress lines (default 10) [{ENV['progress_interval']}]")
    f.add_argument("--stats-file", type=Path, help=f"write the fetch statistics here as JSON [{ENV['stats_file']}]")
    f.add_argument("--launcher-dir", type=Path,
                   help="after a successful fetch, copy the launch wrapper (standard library only) here, for "
                        f"the vLLM container's PYTHONPATH [{ENV['launcher_dir']}]")
    f.add_argument("--node-cache", type=Path,
                   help="fetch into this node-local cache (ROOT/artifacts/<key>, verified once per node) "
                        f"instead of --dest [{ENV['node_cache']}]")
    f.add_argument("--node-cache-budget", type=parse_size,
                   help=f"evict least recently used artifacts above this size, e.g. 500Gi [{ENV['node_cache_budget']}]")
    f.add_argument("--referenced-keys", type=Path,
                   help="file of artifact keys (one a line) still referenced by a QuantizedModel: evicted "
                        f"only when the disk cannot hold the new artifact otherwise [{ENV['referenced_keys']}]")
    f.add_argument("--manifest-only", action="store_true", default=None,
                   help="read and check the manifest only (a streamed load): storage reachable, credentials "
                        f"accepted, artifact published; writes the manifest to --dest [{ENV['manifest_only']}=true]")

    f.add_argument("--adapter", dest="adapters", action="append", metavar="KEY",
                   help="also fetch this published LoRA adapter (its key, as the quality report gives it), "
                        "verified like the artifact, into --adapters-dir/KEY or the node cache; repeatable "
                        f"[{ENV['adapters']}: keys separated by commas]")
    f.add_argument("--adapters-dir", type=Path,
                   help=f"where adapters go without --node-cache, e.g. /adapters [{ENV['adapters_dir']}]")

    la = sub.add_parser("launch", help="check the GPU against the artifact format, then run the command after -- (its root cause becomes the termination message)")
    la.add_argument("--format", help=f"artifact format (default: read from the fetched manifest) [{ENV['format']}]")
    la.add_argument("--manifest", help=f"path of the fetched manifest [{ENV['manifest']}]")
    la.add_argument("--node-cc", help=f"compute capability the variant was planned for, e.g. 9.0 [{ENV['node_cc']}]")
    la.add_argument("--require-gpu-info", action="store_true", default=None,
                    help=f"refuse to start when no compute capability is known [{ENV['require_gpu_info']}=true]")
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- vllm serve MODEL ...")
    return p


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S")


def _run_fetch(a: argparse.Namespace) -> int:
    for key in _adapter_keys(a):  # usage errors before anything is read
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise UsageError(f"--adapter must be a sha256 hex digest (64 lowercase hex characters), got {key!r}")
    if _adapter_keys(a) and not (a.node_cache or _env_default("node_cache", Path)) \
            and not (a.adapters_dir or _env_default("adapters_dir", Path)):
        raise UsageError("--adapter needs --adapters-dir (or --node-cache)")
    return _fetch_artifact(a)


def _adapter_keys(a: argparse.Namespace) -> list[str]:
    return a.adapters or [k.strip() for k in (_env_default("adapters") or "").split(",") if k.strip()]


def _fetch_adapters(a: argparse.Namespace) -> None:
    """The adapters, after the artifact (they are small, and room made for them in the node cache
    goes to the least recently used entries, the artifact just verified last), before the container
    reports success."""
    for key in _adapter_keys(a):
        _fetch_adapter(a, key)


def _fetch_adapter(a: argparse.Namespace, key: str) -> None:
    """One LoRA adapter published under ``key`` (the Job's ``adapterKey``): into the node cache when
    the artifact goes there (verified once per node, evicted by the same rules), else into
    ``--adapters-dir/KEY``."""
    from .fetch import FetchOptions, fetch

    storage_uri = a.storage_uri or _env_default("storage_uri")
    node_cache = a.node_cache or _env_default("node_cache", Path)
    endpoint = a.endpoint or _env_default("endpoint")
    adapters_dir = a.adapters_dir or _env_default("adapters_dir", Path)
    opts = FetchOptions(storage_uri=storage_uri, key=key,
                        dest=Path(node_cache) / "artifacts" / key if node_cache else Path(adapters_dir) / key,
                        endpoint=endpoint, region=a.region or _env_default("region") or os.environ.get("AWS_REGION") or None)
    if node_cache:
        from .nodecache import NodeCache, read_referenced

        cache = NodeCache(Path(node_cache), a.node_cache_budget or _env_default("node_cache_budget", parse_size),
                          read_referenced(a.referenced_keys or _env_default("referenced_keys", Path)))
        stats = cache.hit(key, storage_uri, endpoint) or cache.fetch(opts).to_dict()
    else:
        stats = fetch(opts).to_dict()
    log.info("adapter %s ready: %s", key, " ".join(f"{k}={v}" for k, v in stats.items()))


def _fetch_artifact(a: argparse.Namespace) -> int:
    storage_uri = a.storage_uri or _env_default("storage_uri")
    key = a.key or _env_default("key")
    node_cache = a.node_cache or _env_default("node_cache", Path)
    rehash = a.rehash if a.rehash is not None else bool(_env_default("rehash", _bool))
    if node_cache and storage_uri and key and not rehash and len(key) == 64 \
            and all(c in "0123456789abcdef" for c in key):
        # The node cache's hit needs the standard library only: no boto3, no pydantic to import,
        # so a scale-up onto a node that holds the artifact spends well under a second here.
        from .nodecache import NodeCache

        hit = NodeCache(Path(node_cache)).hit(key, storage_uri, a.endpoint or _env_default("endpoint"))
        if hit is not None:
            return _fetch_done(a, key, Path(node_cache) / "artifacts" / key, hit, True)

    from .fetch import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, MIN_PART_SIZE, FetchOptions, fetch

    dest = a.dest or _env_default("dest", Path) or (Path(node_cache) / "artifacts" / key if node_cache and key else None)
    missing = [n for n, v in (("--storage-uri", storage_uri), ("--key", key), ("--dest", dest)) if not v]
    if missing:
        raise UsageError(f"missing {', '.join(missing)} (or {', '.join(ENV[m.strip('-').replace('-', '_')] for m in missing)})")
    if not storage_uri.startswith("s3://") or len(storage_uri) <= 5:
        raise UsageError(f"--storage-uri must be s3://bucket[/prefix], got {storage_uri!r}")
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise UsageError(f"--key must be a sha256 hex digest (64 lowercase hex characters), got {key!r}")
    concurrency = a.concurrency or _env_default("concurrency", int) or DEFAULT_CONCURRENCY
    part_size = a.part_size or _env_default("part_size", parse_size) or DEFAULT_PART_SIZE
    if concurrency < 1 or concurrency > 256:
        raise UsageError(f"--concurrency must be 1..256, got {concurrency}")
    if part_size < MIN_PART_SIZE:
        raise UsageError(f"--part-size must be at least {MIN_PART_SIZE} bytes, got {part_size}")
    interval = a.progress_interval or _env_default("progress_interval", float) or 10.0
    opts = FetchOptions(
        storage_uri=storage_uri, key=key, dest=Path(dest),
        endpoint=a.endpoint or _env_default("endpoint"),
        region=a.region or _env_default("region") or os.environ.get("AWS_REGION") or None,
        concurrency=concurrency, part_size=part_size, rehash=rehash,
        rate_limit=a.rate_limit or _env_default("rate_limit", parse_size),
        progress_interval=max(0.1, interval),
    )
    manifest_only = a.manifest_only if a.manifest_only is not None else bool(_env_default("manifest_only", _bool))
    if manifest_only:
        return _check_manifest(opts, a)
    if node_cache:
        from .nodecache import NodeCache, read_referenced

        budget = a.node_cache_budget or _env_default("node_cache_budget", parse_size)
        refs = read_referenced(a.referenced_keys or _env_default("referenced_keys", Path))
        stats = NodeCache(Path(node_cache), budget, refs).fetch(opts)
        dest = opts.dest
    else:
        stats = fetch(opts)
    return _fetch_done(a, key, dest, stats.to_dict(), stats.cacheHit)


def _fetch_done(a: argparse.Namespace, key: str, dest: Path, summary: dict, cache_hit: bool) -> int:
    _fetch_adapters(a)
    log.info("fetch done: %s", " ".join(f"{k}={v}" for k, v in summary.items()))
    stats_file = a.stats_file or _env_default("stats_file", Path)
    if stats_file:
        Path(stats_file).write_text(json.dumps(summary, sort_keys=True) + "\n")
    launcher_dir = a.launcher_dir or _env_default("launcher_dir", Path)
    if launcher_dir:
        from .install import install_launcher

        install_launcher(Path(launcher_dir))
        log.info("launch wrapper installed in %s (PYTHONPATH for the vLLM container)", launcher_dir)
    write_termination_message(termination_message(
        "fetch", "CacheHit" if cache_hit else "Fetched",
        f"artifact {key} ready in {dest}", EXIT_OK,
        **{k: summary[k] for k in ("filesTotal", "bytesTotal", "bytesDownloaded", "seconds", "mbPerSecond")}))
    return EXIT_OK


def _check_manifest(opts, a: argparse.Namespace) -> int:
    """A streamed load's init container: the manifest answers for storage, credentials and the
    artifact; the launcher reads the format from the copy written here."""
    import time

    from .fetch import Fetcher
    from .layout import DEST_MANIFEST_NAME
    from .partfile import atomic_write

    t0 = time.monotonic()
    fetcher = Fetcher(opts)
    manifest, raw = fetcher.read_manifest()
    opts.dest.mkdir(parents=True, exist_ok=True)
    atomic_write(opts.dest / DEST_MANIFEST_NAME, raw)
    _fetch_adapters(a)
    launcher_dir = a.launcher_dir or _env_default("launcher_dir", Path)
    if launcher_dir:
        from .install import install_launcher

        install_launcher(Path(launcher_dir))
    write_termination_message(termination_message(
        "fetch", "ManifestChecked", f"artifact {opts.key} published at {fetcher.where}: vLLM streams it",
        EXIT_OK, filesTotal=len(manifest.files), bytesTotal=manifest.totalBytes,
        seconds=round(time.monotonic() - t0, 3)))
    return EXIT_OK


def _run_launch(a: argparse.Namespace) -> int:
    from .launch import (check_stream_source, detect_gpu, hold_in_use, lora_paths, model_dir_from_args, prepare,
                         resolve_format, supervise)

    cmd = list(a.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("nothing to launch: give the command after '--', e.g. -- vllm serve /models/<key>")
    fmt = resolve_format(a.format or _env_default("format"), a.manifest or _env_default("manifest"), cmd)
    gpu = detect_gpu(a.node_cc)
    require = a.require_gpu_info if a.require_gpu_info is not None else bool(_env_default("require_gpu_info", _bool))
    prepare(fmt, gpu, allow_unknown_gpu=not require)
    check_stream_source(cmd)
    hold_in_use(model_dir_from_args(cmd))
    for path in lora_paths(cmd):  # the adapters vLLM loads stay in the node cache while it runs
        fetched = re.fullmatch(r"[0-9a-f]{64}", os.path.basename(path.rstrip("/"))) is not None
        if hold_in_use(path) is None and fetched:  # one the fetcher put there (a content key): must be verified
            from .errors import ArtifactMissing

            raise ArtifactMissing(f"LoRA adapter {path}: no verified copy there (evicted from the node cache since "
                                  "the fetch, or never fetched): delete the pod, its fetch runs again")
    return supervise(cmd)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
    except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
        return int(e.code or 0)
    _setup_logging(a.log_level)
    component = a.command
    try:
        return _run_fetch(a) if component == "fetch" else _run_launch(a)
    except RuntimeFailure as e:
        log.error("%s", e.message)
        write_termination_message(termination_message(component, e.reason, e.message, e.exit_code,
                                                      **{k: v for k, v in e.details.items() if k != "transient"}))
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a last resort keeps the termination message useful
        log.exception("unexpected failure")
        msg = f"unexpected {type(e).__name__}: {e}"
        write_termination_message(termination_message(component, "InternalError", msg, 1))
        return 1


__all__ = ["main", "ENV", "parse_size", "EXIT_USAGE"]
