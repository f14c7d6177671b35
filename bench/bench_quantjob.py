"""The quantization Job against the bare minimum: a plain ``oneshot`` script, and a plain boto3 upload.

    python bench/bench_quantjob.py [--format w4a16-gptq] [--hidden 512] [--layers 4] [--samples 32]
                                   [--seq 128] [--upload-gib 1] [--repeat 1] [--endpoint URL]

1. Job overhead. One Llama (random weights, the test model's tokenizer; cached under
   ``${FEWERBITS_CACHE:-~/.cache/fewerbits}/bench-quantjob/``) is quantized twice, each in a fresh
   process so both pay the same imports:
   * bare: load, ``oneshot`` with the same recipe and calibration samples, ``save_pretrained(save_compressed=True)``;
   * job: ``python -m fewerbits_quantjob`` with a contract for the same format and samples, publishing to S3.
   Ratio = (job wall time - its evaluate stage) / bare wall time. Goal: < 1.05. The job's upload
   is inside that figure (the bare script publishes nothing), and reported on its own too.
2. Upload throughput. ~N GiB of checkpoint-like files (4 shards + small files, random bytes made
   once and cached) go to S3 twice: ``fewerbits_quantjob.storage.upload_directory`` (sha256 of
   every file, parallel files and multipart parts) and plain boto3 ``upload_file`` per file,
   sequentially, default TransferConfig. Ratio = fewerbits MiB/s / boto3 MiB/s.

S3: MinIO on loopback started through the e2e harness (``e2e.cluster.start_s3``, built from its Go
module if missing), or ``--endpoint`` (credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "crds", REPO / "quantjob"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from fewerbits_api.artifact import MANIFEST_NAME, ArtifactKeyInputs, artifact_prefix  # noqa: E402
from fewerbits_api.formats import FORMAT_FACTS, QuantFormat  # noqa: E402
from fewerbits_api.jobcontract import QuantJobContract  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


def cache_root() -> Path:
    return Path(os.environ.get("FEWERBITS_CACHE") or Path.home() / ".cache" / "fewerbits") / "bench-quantjob"


def bench_model(hidden: int, layers: int) -> Path:
    """A random-weight Llama of the given size with the test model's tokenizer (timing needs no training)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.testmodel import build_tokenizer

    path = cache_root() / f"llama-h{hidden}-l{layers}"
    if (path / "config.json").exists():
        return path
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=1024, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


BARE_SCRIPT = r"""
import json, sys, time
t0 = time.monotonic()
from datasets import Dataset
from llmcompressor import oneshot
from transformers import AutoModelForCausalLM, AutoTokenizer
from fewerbits_api.formats import QuantFormat
from fewerbits_quantjob import recipes
from fewerbits_quantjob.textdata import load_texts
from fewerbits_quantjob.quantize import cpu_awq_pin_memory_guard
src, out, fmt, samples, seq = sys.argv[1], sys.argv[2], QuantFormat(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
tok = AutoTokenizer.from_pretrained(src)
kwargs = {}
if recipes.needs_calibration_data(fmt):
    texts = load_texts("general-en", {}, limit=samples).texts
    kwargs = dict(dataset=Dataset.from_dict({"text": texts}), num_calibration_samples=len(texts), max_seq_length=seq,
                  shuffle_calibration_samples=False)
with cpu_awq_pin_memory_guard(fmt):
    oneshot(model=model, processor=tok, recipe=recipes.instantiate(recipes.build_recipe_spec(fmt, ["lm_head"])), **kwargs)
model.save_pretrained(out, save_compressed=True)
tok.save_pretrained(out)
print(json.dumps({"inner_seconds": time.monotonic() - t0}))
"""


def child_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "FEWERBITS_CACHE")}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "crds"), str(REPO / "quantjob")]),
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def run_bare(model: Path, fmt: QuantFormat, samples: int, seq: int) -> float:
    out = Path(tempfile.mkdtemp(prefix="bench-bare-"))
    try:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", BARE_SCRIPT, str(model), str(out), fmt.value, str(samples), str(seq)],
                       env=child_env(), check=True, capture_output=True, text=True)
        return time.monotonic() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_job(model: Path, fmt: QuantFormat, samples: int, seq: int, server, bucket: str, eval_samples: int = 8,
            gate: float = 1000.0) -> dict:
    needs = FORMAT_FACTS[fmt].needs_calibration_data
    # A fresh storage prefix each run: never a cache hit.
    storage_uri = f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}"
    ki = ArtifactKeyInputs(sourceUri=f"pvc://bench/{model.name}", format=fmt, ignore=["lm_head"],
                           calibrationDataset="general-en" if needs else None, calibrationSamples=samples if needs else None,
                           calibrationMaxSeqLength=seq if needs else None)
    contract = QuantJobContract(key=ki.key(), keyInputs=ki, source={"mountPath": str(model.parent)},
                                qualityGate={"maxPerplexityIncreasePercent": gate, "evalSamples": eval_samples},
                                evalMaxSeqLength=seq, storage={"uri": storage_uri, "endpoint": server.endpoint},
                                device="cpu")
    term = Path(tempfile.mkdtemp(prefix="bench-term-")) / "termination"
    env = child_env({"FEWERBITS_JOB_CONTRACT": contract.to_json(), "FEWERBITS_TERMINATION_LOG": str(term),
                     "AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key})
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fewerbits_quantjob"], env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the Job failed: {term.read_text() if term.exists() else ''}\n{proc.stderr[-3000:]}")
    b, prefix = artifact_prefix(storage_uri, contract.key)
    manifest = json.loads(server.client().get_object(Bucket=b, Key=prefix + MANIFEST_NAME)["Body"].read())
    return {"wall": wall, "timings": manifest["timings"], "summary": json.loads(term.read_text())}


# ----------------------------------------------------------------------------------------- upload
def upload_data(size_gib: float) -> Path:
    root = cache_root() / f"upload-{size_gib:g}gib"
    if (root / ".complete").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shard = int(size_gib * GiB / 4)
    for i in range(4):
        with open(root / f"model-{i + 1:05d}-of-00004.safetensors", "wb") as f:
            left = shard
            while left:
                n = min(left, 64 * MiB)
                f.write(os.urandom(n))
                left -= n
    for name, size in {"config.json": 2000, "tokenizer.json": 9 * MiB, "tokenizer_config.json": 50_000,
                       "model.safetensors.index.json": 60_000, "generation_config.json": 200}.items():
        (root / name).write_bytes(os.urandom(size))
    (root / ".complete").touch()
    return root


def bench_upload(server, bucket: str, size_gib: float) -> dict:
    from boto3.s3.transfer import TransferConfig

    from fewerbits_quantjob import storage
    from fewerbits_quantjob.report import Progress

    root = upload_data(size_gib)
    files = storage.list_artifact_files(root)
    total = sum((root / f).stat().st_size for f in files)
    client = storage.s3_client(server.endpoint, None, server.access_key, server.secret_key, max_pool=64)

    t0 = time.monotonic()
    plain = server.client()
    for f in files:
        plain.upload_file(str(root / f), bucket, f"plain/{f.as_posix()}", Config=TransferConfig())
    boto_s = time.monotonic() - t0

    progress = Progress()
    key = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
    with progress.stage("upload") as st:
        t0 = time.monotonic()
        result = storage.upload_directory(client, root, f"s3://{bucket}/ours", key, st, env={})
        ours_s = time.monotonic() - t0
    assert result.skipped_files == 0
    return {"bytes": total, "boto3_s": boto_s, "fewerbits_s": ours_s}


def format_table(server, bucket: str, args) -> int:
    from tests.testmodel import build_test_model

    model = build_test_model()
    print(f"test model {model.name}: {args.samples} calibration samples x {args.seq} tokens, 32 eval windows "
          f"(general-en-heldout), gate 3%")
    print("| format | compressed-tensors format | baseline ppl | quantized ppl | increase | gate | Job wall s | quantize s | evaluate s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in [f for f in QuantFormat if f.value not in ("auto", "none")]:
        j = run_job(model, fmt, args.samples, args.seq, server, bucket, eval_samples=32, gate=3.0)
        q, t = j["summary"]["quality"], j["timings"]
        print(f"| {fmt.value} | {FORMAT_FACTS[fmt].compressed_tensors_format} | {q['baselinePerplexity']:.3f} | "
              f"{q['perplexity']:.3f} | {q['increasePercent']:+.3f}% | {'pass' if q['passed'] else 'FAIL'} | "
              f"{j['wall']:.1f} | {t.get('quantize', 0):.1f} | {t.get('evaluate', 0):.1f} |", flush=True)
    return 0


def start_s3(args):
    if args.endpoint:
        from types import SimpleNamespace

        import boto3
        from botocore.config import Config

        ak, sk = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
        ns = SimpleNamespace(endpoint=args.endpoint, access_key=ak, secret_key=sk)
        ns.client = lambda: boto3.client("s3", endpoint_url=args.endpoint, aws_access_key_id=ak, aws_secret_access_key=sk,
                                         region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
        return ns, None, None
    from e2e import cluster, procs

    state = Path(tempfile.mkdtemp(prefix="bench-quantjob-s3-"))
    server, proc = cluster.start_s3(state)
    return server, (lambda: procs.stop_group(proc.pid, 10, proc)), state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="w4a16-gptq", choices=[f.value for f in QuantFormat if f.value not in ("auto", "none")])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--upload-gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--endpoint", default=None)
    ap.add_argument("--skip-upload", action="store_true")
    ap.add_argument("--table", action="store_true",
                    help="instead: run the Job for every format on the trained test model (tests/testmodel) and print "
                         "perplexity increase and time per format")
    args = ap.parse_args()
    fmt = QuantFormat(args.format)

    server, stop, state = start_s3(args)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    server.client().create_bucket(Bucket=bucket)
    try:
        if args.table:
            return format_table(server, bucket, args)
        model = bench_model(args.hidden, args.layers)
        size = sum(p.stat().st_size for p in model.iterdir() if p.is_file())
        print(f"model: {model.name} ({size / MiB:.1f} MiB), format {fmt.value}, {args.samples} samples x {args.seq} tokens")
        bare, jobs = [], []
        for i in range(args.repeat):
            bare.append(run_bare(model, fmt, args.samples, args.seq))
            jobs.append(run_job(model, fmt, args.samples, args.seq, server, bucket))
            j = jobs[-1]
            print(f"  run {i + 1}: bare {bare[-1]:.1f}s | job {j['wall']:.1f}s (evaluate {j['timings'].get('evaluate', 0):.1f}s,"
                  f" upload {j['timings'].get('upload', 0):.1f}s, quantize {j['timings'].get('quantize', 0):.1f}s)")
        bare_s = min(bare)
        job_best = min(jobs, key=lambda j: j["wall"] - j["timings"].get("evaluate", 0))
        job_s = job_best["wall"] - job_best["timings"].get("evaluate", 0)
        job_no_upload = job_s - job_best["timings"].get("upload", 0)
        print(f"job overhead: (job - evaluate) / bare = {job_s:.1f}s / {bare_s:.1f}s = {job_s / bare_s:.3f}  (goal < 1.05)")
        print(f"              without the upload too  = {job_no_upload:.1f}s / {bare_s:.1f}s = {job_no_upload / bare_s:.3f}")
        q = job_best["summary"].get("quality", {})
        print(f"              evaluation took {job_best['timings'].get('evaluate', 0):.1f}s "
              f"(baseline ppl {q.get('baselinePerplexity')}, quantized {q.get('perplexity')})")
        if not args.skip_upload:
            up = bench_upload(server, bucket, args.upload_gib)
            mibs = up["bytes"] / MiB
            b_rate, o_rate = mibs / up["boto3_s"], mibs / up["fewerbits_s"]
            print(f"upload {mibs:.0f} MiB: boto3 upload_file sequential {b_rate:.0f} MiB/s | fewerbits {o_rate:.0f} MiB/s "
                  f"(incl. sha256) | ratio {o_rate / b_rate:.2f}")
    finally:
        if stop:
            stop()
        if state:
            shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
