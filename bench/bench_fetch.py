"""Fetch throughput: the fewerbits fetcher vs boto3's default download_file vs the disk itself.

    python bench/bench_fetch.py [--size-gib 2] [--repeat 1] [--concurrency 16] [--part-size 32Mi]

One ~N GiB multi-file artifact (4 large weight shards + small config/tokenizer files, random bytes
generated once and cached outside the repo in ${FEWERBITS_CACHE:-~/.cache/fewerbits}/bench-fetch/)
is published to an S3 server on loopback: MinIO started through the e2e harness
(``e2e.cluster.start_s3``, built from its Go module if missing), or ``--endpoint`` for one already
running. Then, in the same run and on the same filesystem:

* disk: the same bytes written with plain ``write`` + ``fsync`` per file (dd-like, from memory);
* boto3: ``client.download_file`` per file, sequentially, default ``TransferConfig``
  (also reported with an fsync per file, which a trustworthy fetch must pay);
* fewerbits: ``fewerbits_runtime.fetch`` (parallel ranged GETs, sha256 verify, fsync, rename).

Goals (issue 7): fewerbits >= 1.5x boto3 default, and >= 80% of the disk's write speed.
Before each measurement the destination is emptied and ``sync`` flushes earlier dirty pages, so
no run pays for another's writes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "crds", REPO / "runtime"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from fewerbits_runtime.cli import parse_size  # noqa: E402
from fewerbits_runtime.fetch import FetchOptions, fetch  # noqa: E402
from fewerbits_runtime.testing import publish_dir  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SMALL_FILES = {  # name -> size: what sits beside the shards in a real checkpoint
    "config.json": 2_000,
    "generation_config.json": 200,
    "model.safetensors.index.json": 60_000,
    "special_tokens_map.json": 600,
    "tokenizer.json": 9 * MiB,
    "tokenizer_config.json": 50_000,
}
SHARDS = 4


def cache_root() -> Path:
    return Path(os.environ.get("FEWERBITS_CACHE", Path.home() / ".cache" / "fewerbits")) / "bench-fetch"


def ensure_data(size_gib: float) -> tuple[Path, dict[str, str]]:
    """Random shards, generated once per size and cached; digests beside them."""
    root = cache_root() / f"artifact-{size_gib:g}gib"
    digests_file = root.parent / f"artifact-{size_gib:g}gib.digests.json"
    if root.is_dir() and digests_file.exists():
        return root, json.loads(digests_file.read_text())
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=root.parent))
    total = int(size_gib * GiB)
    shard = (total - sum(SMALL_FILES.values())) // SHARDS
    sizes = {f"model-{i:05d}-of-{SHARDS:05d}.safetensors": shard for i in range(1, SHARDS + 1)} | SMALL_FILES
    digests = {}
    print(f"generating {total / GiB:.2f} GiB of random test data in {root} (once)", flush=True)
    for name, size in sizes.items():
        h = hashlib.sha256()
        with open(tmp / name, "wb") as f:
            left = size
            while left:
                b = os.urandom(min(64 * MiB, left))
                f.write(b)
                h.update(b)
                left -= len(b)
        digests[name] = h.hexdigest()
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    digests_file.write_text(json.dumps(digests, indent=1))
    return root, digests


def sync() -> None:
    os.sync()
    time.sleep(0.5)


def fresh(d: Path) -> Path:
    shutil.rmtree(d, ignore_errors=True)
    sync()
    d.mkdir(parents=True)
    return d


def bench_disk(src: Path, out: Path) -> float:
    """Write the artifact's bytes (held in memory) with write + fsync per file: the disk's speed."""
    files = sorted(p for p in src.iterdir() if p.is_file())
    total = 0
    elapsed = 0.0
    for p in files:  # one file in memory at a time; only the write and fsync are timed
        data = p.read_bytes()
        view = memoryview(data)
        t0 = time.monotonic()
        fd = os.open(out / p.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            while off < len(view):
                off += os.write(fd, view[off:off + 8 * MiB])
            os.fsync(fd)
        finally:
            os.close(fd)
        elapsed += time.monotonic() - t0
        total += len(data)
        del data, view
    return total / elapsed


def bench_boto3(client, bucket: str, prefix: str, names: list[str], out: Path, total: int,
                with_fsync: bool) -> float:
    t0 = time.monotonic()
    for name in names:
        dst = out / name
        client.download_file(bucket, f"{prefix}files/{name}", str(dst))  # default TransferConfig
        if with_fsync:
            fd = os.open(dst, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return total / (time.monotonic() - t0)


def bench_fewerbits(storage_uri: str, key: str, endpoint: str, out: Path, concurrency: int, part_size: int,
                    total: int) -> tuple[float, dict]:
    t0 = time.monotonic()
    stats = fetch(FetchOptions(storage_uri=storage_uri, key=key, dest=out, endpoint=endpoint,
                               concurrency=concurrency, part_size=part_size, progress_interval=5.0))
    rate = total / (time.monotonic() - t0)
    assert stats.bytesDownloaded == total and not stats.cacheHit, stats
    return rate, stats.to_dict()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=1, help="measure each contender this many times (median)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--part-size", type=parse_size, default=32 * MiB)
    ap.add_argument("--workdir", type=Path, help="where downloads land (default: a temp dir beside the data)")
    ap.add_argument("--endpoint", help="use this S3 server instead of starting MinIO (with AWS_* credentials)")
    ap.add_argument("--skip-fsync-variant", action="store_true", help="do not also time boto3 + fsync")
    ap.add_argument("--server-data-dir", type=Path,
                    help="where MinIO keeps its objects (default: /dev/shm when it has room, so the server's "
                         "reads do not compete with the destination disk: in a cluster the object store's disks "
                         "are not the node's)")
    a = ap.parse_args()

    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    src, digests = ensure_data(a.size_gib)
    names = sorted(digests)
    total = sum((src / n).stat().st_size for n in names)

    proc = None
    server_dir = a.server_data_dir
    if server_dir is None:
        shm = Path("/dev/shm")
        server_dir = shm if shm.is_dir() and shutil.disk_usage(shm).free > 2.5 * total else cache_root()
    server_dir.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="bench-fetch-s3-", dir=server_dir))
    print(f"S3 server data in {server_dir}; downloads land in {a.workdir or cache_root()}", flush=True)
    try:
        if a.endpoint:
            import boto3
            from botocore.config import Config

            endpoint = a.endpoint
            client = boto3.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))
        else:
            from e2e import cluster as harness

            server, proc = harness.start_s3(state)
            endpoint = server.endpoint
            os.environ.update({"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key,
                               "AWS_REGION": server.region})
            client = server.client()
        bucket = "bench-fetch"
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        storage_uri = f"s3://{bucket}/artifacts"
        t0 = time.monotonic()
        manifest = publish_dir(client, storage_uri, src, name=f"bench-{a.size_gib:g}", digests=digests)
        print(f"published {len(names)} files, {total / GiB:.2f} GiB, in {time.monotonic() - t0:.1f}s", flush=True)
        prefix = f"artifacts/{manifest.key}/"

        work = a.workdir or Path(tempfile.mkdtemp(prefix="bench-fetch-out-", dir=cache_root()))
        results: dict[str, list[float]] = {"disk": [], "boto3": [], "boto3+fsync": [], "fewerbits": []}
        last_stats: dict = {}
        contenders = {
            "disk": lambda d: bench_disk(src, d),
            "boto3": lambda d: bench_boto3(client, bucket, prefix, names, d, total, False),
            "boto3+fsync": lambda d: bench_boto3(client, bucket, prefix, names, d, total, True),
            "fewerbits": lambda d: bench_fewerbits(storage_uri, manifest.key, endpoint, d, a.concurrency,
                                                   a.part_size, total),
        }
        if a.skip_fsync_variant:
            del contenders["boto3+fsync"]
        order = list(contenders)
        for r in range(a.repeat):
            # Rotate the order each round: whoever runs right after a 2 GiB delete (the volume is
            # mounted with `discard`) or another tenant's burst should not always be the same one.
            for name in order[r % len(order):] + order[:r % len(order)]:
                out = fresh(work / "out")
                got = contenders[name](out)
                if name == "fewerbits":
                    got, last_stats = got
                results[name].append(got)
                shutil.rmtree(out, ignore_errors=True)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] / 1e6:.0f} MB/s" for k, v in results.items() if v),
                  flush=True)
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if proc is not None:
            from e2e import procs

            procs.stop_group(proc.pid, 10, proc)
        shutil.rmtree(state, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items() if v}
    fb, b3, disk = med["fewerbits"], med["boto3"], med["disk"]
    print()
    print(f"artifact: {len(names)} files, {total / GiB:.2f} GiB; S3 server on loopback; {os.cpu_count()} CPUs "
          f"(server and client share them); concurrency {a.concurrency}, part size {a.part_size // MiB} MiB; "
          f"median of {a.repeat}")
    print(f"  disk write + fsync         {disk / 1e6:8.1f} MB/s")
    print(f"  boto3 download_file        {b3 / 1e6:8.1f} MB/s   (sequential, default TransferConfig, no fsync)")
    if "boto3+fsync" in med:
        print(f"  boto3 download_file+fsync  {med['boto3+fsync'] / 1e6:8.1f} MB/s")
    print(f"  fewerbits fetch            {fb / 1e6:8.1f} MB/s   (sha256-verified, fsync'ed, renamed)")
    r_b3, r_disk = fb / b3, fb / disk
    print(f"  fewerbits / boto3          {r_b3:8.2f}x   goal >= 1.5x   {'MET' if r_b3 >= 1.5 else 'NOT MET'}")
    if "boto3+fsync" in med:
        print(f"  fewerbits / boto3+fsync    {fb / med['boto3+fsync']:8.2f}x")
    print(f"  fewerbits / disk           {r_disk:8.2f}    goal >= 0.80   {'MET' if r_disk >= 0.8 else 'NOT MET'}")
    print(json.dumps({"bytes": total, "MBps": {k: round(v / 1e6, 1) for k, v in med.items()},
                      "ratioVsBoto3": round(r_b3, 2), "ratioVsDisk": round(r_disk, 2),
                      "fetchStats": {k: last_stats.get(k) for k in ("fileGets", "bytesDownloaded", "seconds")}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
