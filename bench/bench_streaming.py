"""Loading weights from object storage: the fewerbits fetcher, boto3 and the Run:ai model streamer.

    pip install -e ".[bench]"   # the Run:ai streamer (runai-model-streamer 0.17.0, -s3 0.17.1)
    python bench/bench_streaming.py [--size-gib 1] [--repeat 2]

One ~N GiB safetensors artifact (4 shards of 64 MiB bfloat16-sized tensors, random bytes, built once
and cached in ${FEWERBITS_CACHE:-~/.cache/fewerbits}/bench-streaming/) is published with its
manifest to MinIO on loopback (``e2e.cluster.start_s3``; its data in /dev/shm when there is room,
so the server's disk reads do not compete with the readers). In one run, each contender reads
the same artifact into this process's memory, on CPU:

* fewerbits: ``fewerbits_runtime.fetch`` into a tmpfs folder (/dev/shm: memory), every file
  sha256-verified against the manifest, fsync'ed and renamed: what ``loadFormat: fetch`` does
  before vLLM starts (vLLM then reads the files from the node's disk, not timed here);
* boto3: ``download_fileobj`` of each shard into a ``BytesIO``, default ``TransferConfig``
  (10 threads of 8 MiB parts), one shard after the other;
* runai: ``runai_model_streamer.SafetensorsStreamer.stream_files`` over the shards' ``s3://``
  URIs, every tensor yielded to CPU memory (``RUNAI_STREAMER_CONCURRENCY``, default 16): what
  ``loadFormat: stream`` does inside vLLM (``--load-format runai_streamer``), minus the copy to
  the GPU. The streamer's GPU path (straight into device memory, distributed across ranks) is
  documented by vLLM and Run:ai, not measured here: there is no GPU on this machine.

Only the streamer skips the integrity check: it trusts storage and TLS; the fetcher compares
every byte with the manifest's sha256 before vLLM sees it. Ratios are printed; the default load
format follows from them (docs/cache.md).
"""

from __future__ import annotations

import argparse
import hashlib
import io
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

MiB, GiB = 1 << 20, 1 << 30
SHARDS = 4
TENSOR = 64 * MiB


def cache_root() -> Path:
    return Path(os.environ.get("FEWERBITS_CACHE", Path.home() / ".cache" / "fewerbits")) / "bench-streaming"


def ensure_data(size_gib: float) -> tuple[Path, dict[str, str]]:
    """Safetensors shards of random uint8 tensors, built once per size; digests beside them."""
    import numpy as np
    from safetensors.numpy import save_file

    root = cache_root() / f"safetensors-{size_gib:g}gib"
    digests_file = root.parent / f"safetensors-{size_gib:g}gib.digests.json"
    if root.is_dir() and digests_file.exists():
        return root, json.loads(digests_file.read_text())
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=root.parent))
    per_shard = max(1, int(size_gib * GiB) // SHARDS // TENSOR)
    print(f"building {SHARDS} safetensors shards of {per_shard} x {TENSOR // MiB} MiB in {root} (once)", flush=True)
    for s in range(SHARDS):
        tensors = {f"model.layers.{s * per_shard + i}.weight": np.frombuffer(os.urandom(TENSOR), dtype=np.uint8)
                   for i in range(per_shard)}
        save_file(tensors, str(tmp / f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"))
        del tensors
    (tmp / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    digests = {}
    for f in sorted(tmp.iterdir()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while b := fh.read(8 * MiB):
                h.update(b)
        digests[f.name] = h.hexdigest()
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    digests_file.write_text(json.dumps(digests, indent=1))
    return root, digests


def bench_fetcher(storage_uri: str, key: str, endpoint: str, out: Path, total: int) -> float:
    from fewerbits_runtime.fetch import FetchOptions, fetch

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.monotonic()
    stats = fetch(FetchOptions(storage_uri=storage_uri, key=key, dest=out, endpoint=endpoint, progress_interval=30))
    dt = time.monotonic() - t0
    assert stats.bytesDownloaded == total and not stats.cacheHit
    shutil.rmtree(out, ignore_errors=True)
    return total / dt


def bench_boto3(client, bucket: str, keys: list[str], total: int) -> float:
    t0 = time.monotonic()
    got = 0
    for k in keys:
        buf = io.BytesIO()
        client.download_fileobj(bucket, k, buf)
        got += buf.getbuffer().nbytes
        del buf
    dt = time.monotonic() - t0
    assert got == total, (got, total)
    return total / dt


def bench_runai(uris: list[str], total_tensor_bytes: int) -> float:
    from runai_model_streamer import SafetensorsStreamer

    t0 = time.monotonic()
    got = 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(uris)
        for _name, tensor in streamer.get_tensors():
            got += tensor.numel() * tensor.element_size()
    dt = time.monotonic() - t0
    assert got == total_tensor_bytes, (got, total_tensor_bytes)
    return total_tensor_bytes / dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    from e2e import cluster as harness
    from e2e import procs
    from fewerbits_runtime.testing import publish_dir

    src, digests = ensure_data(a.size_gib)
    shards = sorted(n for n in digests if n.endswith(".safetensors"))
    shard_bytes = sum((src / n).stat().st_size for n in shards)
    tensor_bytes = SHARDS * (shard_bytes // SHARDS // TENSOR) * TENSOR
    total = sum((src / n).stat().st_size for n in digests)
    shm = Path("/dev/shm")
    server_dir = shm if shutil.disk_usage(shm).free > 3.5 * total else cache_root()
    state = Path(tempfile.mkdtemp(prefix="bench-stream-s3-", dir=server_dir))
    out = Path(tempfile.mkdtemp(prefix="bench-stream-out-", dir=shm if shutil.disk_usage(shm).free > 2.5 * total
                                else cache_root()))
    server, proc = harness.start_s3(state)
    results: dict[str, list[float]] = {"fewerbits": [], "boto3": [], "runai": []}
    try:
        os.environ.update({"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key,
                           "AWS_REGION": server.region, "AWS_ENDPOINT_URL": server.endpoint,
                           "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"})
        client = server.client()
        client.create_bucket(Bucket="bench-stream")
        m = publish_dir(client, "s3://bench-stream/artifacts", src, name=f"bench-stream-{a.size_gib:g}", digests=digests)
        prefix = f"artifacts/{m.key}/files/"
        keys = [prefix + n for n in shards]
        uris = [f"s3://bench-stream/{k}" for k in keys]
        contenders = {
            "fewerbits": lambda: bench_fetcher("s3://bench-stream/artifacts", m.key, server.endpoint, out / "m", total),
            "boto3": lambda: bench_boto3(client, "bench-stream", keys, shard_bytes),
            "runai": lambda: bench_runai(uris, tensor_bytes),
        }
        order = list(contenders)
        for r in range(a.repeat):
            for name in order[r % 3:] + order[:r % 3]:
                results[name].append(contenders[name]())
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] / 1e6:.0f} MB/s" for k, v in results.items()), flush=True)
    finally:
        procs.stop_group(proc.pid, 10, proc)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    print()
    print(f"artifact: {len(digests)} files, {total / GiB:.2f} GiB ({len(shards)} safetensors shards); MinIO on "
          f"loopback; {os.cpu_count()} CPUs shared with the server; load average {os.getloadavg()[0]:.1f}; "
          f"median of {a.repeat}")
    print(f"  fewerbits fetch -> tmpfs   {med['fewerbits'] / 1e6:8.1f} MB/s  (sha256-verified, fsync, rename)")
    print(f"  boto3 download_fileobj    {med['boto3'] / 1e6:8.1f} MB/s  (to memory, default TransferConfig)")
    print(f"  runai streamer -> CPU     {med['runai'] / 1e6:8.1f} MB/s  (tensors to memory, no digest check)")
    print(f"  runai / fewerbits         {med['runai'] / med['fewerbits']:8.2f}x")
    print(f"  runai / boto3             {med['runai'] / med['boto3']:8.2f}x")
    print(f"  fewerbits / boto3         {med['fewerbits'] / med['boto3']:8.2f}x")
    print(json.dumps({"bytes": total, "MBps": {k: round(v / 1e6, 1) for k, v in med.items()},
                      "runaiVsFewerbits": round(med["runai"] / med["fewerbits"], 2),
                      "runaiVsBoto3": round(med["runai"] / med["boto3"], 2),
                      "fewerbitsVsBoto3": round(med["fewerbits"] / med["boto3"], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
