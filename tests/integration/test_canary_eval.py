"""The serving canary's evaluation against a real server: `transformers serve` on this CPU serving
the tiny test model's fp8-dynamic artifact, published by the real quantization Job (its manifest
holds the base model's scores under the test's gate), and a DAMAGED copy of it (every weight but
the norms zeroed: the recipe of tests/unit/test_quality_eval.py) whose manifest claims the same
Job figures, as a broken kernel or KV cache would leave them.

The evaluation runs as in its pod (`python -m fewerbits_quantjob canary`, the contract in
FEWERBITS_CANARY_CONTRACT) for the unreachable endpoint; the two verdicts call the same entry
point in-process (`canary.run(env)`) to keep the imports of lm-eval and transformers to one.
`transformers serve` offers no prompt logprobs: perplexity is skipped with that reason here. That
is why this test keeps a text-only server (the branch a server without prompt logprobs takes); the
prompt-logprobs branch runs against real vLLM (its CPU build) in tests/integration/test_canary.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fewerbits_api.artifact import FILES_DIR, MANIFEST_NAME, ArtifactKeyInputs, Manifest, ManifestFile, artifact_prefix
from fewerbits_api.canary import (CanaryContract, CanaryTermination, ServingQualityResult, serving_config_hash,
                                  serving_result_key)
from fewerbits_api.formats import QuantFormat
from tests.integration.test_quantjob import make_contract, read_manifest, run_job
from tests.testmodel import build_test_model

pytestmark = [pytest.mark.s3, pytest.mark.quantize]

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "lmeval"
SERVED = "canary-test"
GATE = {"maxPerplexityIncreasePercent": 50, "evalSamples": 4,
        "customEval": {"dataset": "", "metric": "rougeL", "minRecoveryPercent": 50, "limit": 6, "maxNewTokens": 8}}
LIMITS = {"maxRequests": 64, "concurrency": 2, "requestTimeoutSeconds": 60}


def worktree_env(extra: dict) -> dict:
    """This checkout's packages first (the venv may hold an editable install of another)."""
    paths = [str(ROOT / p) for p in ("crds", "operator", "quantjob", "runtime")] + [str(ROOT)]
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "FEWERBITS_CACHE")}
    env.update({"PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", **extra})
    return env


class TransformersServe:
    """One `transformers serve --device cpu` process in a folder where each served model name is a
    link to a model directory: a request naming it loads exactly that directory (on first use).
    Started before the artifacts exist, so its imports overlap the quantization Job."""

    def __init__(self, work: Path, port: int):
        from e2e import procs

        self.work = work
        (work / "hf").mkdir(parents=True, exist_ok=True)
        exe = Path(sys.executable).parent / "transformers"
        env = worktree_env({"HF_HOME": str(work / "hf"), "HF_HUB_OFFLINE": "1"})
        self.url = f"http://127.0.0.1:{port}"
        self.proc = procs.spawn([str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
                                work / "serve.log", env=env, cwd=work)

    def add(self, name: str, model_dir: Path) -> None:
        (self.work / name).symlink_to(model_dir, target_is_directory=True)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.work / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"transformers serve not ready in {timeout}s: {(self.work / 'serve.log').read_text()[-3000:]}")

    def stop(self) -> None:
        from e2e import procs

        procs.stop_group(self.proc.pid, 5, self.proc)


def damage(s3, storage_uri: str, sound: Manifest, work: Path) -> str:
    """Publish a copy of ``sound`` with every weight but the norms zeroed, under its own key, with
    the sound artifact's quality report (the Job's figures the broken copy claims)."""
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file

    from tests.integration.test_quantjob import download_artifact

    local = download_artifact(s3, storage_uri, sound, work / "damaged")
    weights = load_file(str(local / "model.safetensors"))
    save_file({k: (v if "norm" in k else torch.zeros_like(v)) for k, v in weights.items()},
              str(local / "model.safetensors"), metadata={"format": "pt"})
    ki = ArtifactKeyInputs(**{**sound.keyInputs.model_dump(), "recipe": {"test": "damaged-copy"}})
    key = ki.key()
    bucket, prefix = artifact_prefix(storage_uri, key)
    client = s3.client()
    files = []
    for f in sound.files:
        body = (local / f.path).read_bytes()
        client.put_object(Bucket=bucket, Key=f"{prefix}{FILES_DIR}/{f.path}", Body=body)
        files.append(ManifestFile(path=f.path, sizeBytes=len(body), sha256=hashlib.sha256(body).hexdigest()))
    manifest = sound.model_copy(update={"key": key, "keyInputs": ki, "files": files,
                                        "totalBytes": sum(f.sizeBytes for f in files)})
    client.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=json.dumps(manifest.to_wire()).encode())
    return key


@pytest.fixture(scope="module")
def published(server, s3, tmp_path_factory):
    """(storage uri, gate, sound key, damaged key): one real Job, one damaged copy."""
    work = tmp_path_factory.mktemp("canary")
    bucket = f"canary-{os.getpid()}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="evals/custom-eval.jsonl", Body=(FIXTURES / "custom-eval.jsonl").read_bytes())
    gate = {**GATE, "customEval": {**GATE["customEval"], "dataset": f"s3://{bucket}/evals/custom-eval.jsonl"}}
    storage_uri = f"s3://{bucket}/artifacts"
    contract = make_contract(QuantFormat.FP8_DYNAMIC, storage_uri, s3.endpoint, build_test_model())
    contract = contract.model_copy(update={"qualityGate": contract.qualityGate.model_validate(gate)})
    run = run_job(contract, s3, work)
    assert run.returncode == 0 and run.summary["result"] == "published", run
    sound = read_manifest(s3, storage_uri, contract.key)
    assert {m.name for m in sound.quality.metrics} == {"perplexity", "custom:rougeL"}
    assert next(m for m in sound.quality.metrics if m.name == "custom:rougeL").base > 0
    return storage_uri, gate, contract.key, damage(s3, storage_uri, sound, work)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from e2e import procs

    srv = TransformersServe(tmp_path_factory.mktemp("serve"), procs.free_port())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def served(server, s3, published, tmp_path_factory):
    """The server, serving each artifact from the files the pod's fetcher would have written,
    under the served model names `canary-sound` and `canary-damaged`."""
    from tests.integration.test_quantjob import download_artifact

    storage_uri, _, sound_key, damaged_key = published
    for name, key in (("sound", sound_key), ("damaged", damaged_key)):
        manifest = read_manifest(s3, storage_uri, key)
        server.add(f"{SERVED}-{name}", download_artifact(s3, storage_uri, manifest, tmp_path_factory.mktemp(name)))
    server.wait_ready()
    return server


def canary_contract(s3, published, key: str, endpoint: str, kv: str = "fp8", name: str = "sound") -> CanaryContract:
    storage_uri, gate, _, _ = published
    config_hash = serving_config_hash({"key": key, "kvCacheDtype": kv, "endpoint": endpoint})
    return CanaryContract(key=key, configHash=config_hash, variant="h100",
                          kvCacheDtype=kv, endpoint=endpoint, servedModelName=f"{SERVED}-{name}",
                          storage={"uri": storage_uri, "endpoint": s3.endpoint}, qualityGate=gate, evalMaxSeqLength=64,
                          limits=LIMITS)


def run_in_process(s3, contract: CanaryContract, tmp_path: Path) -> tuple[int, CanaryTermination, float]:
    from fewerbits_quantjob import canary

    term = tmp_path / "termination-log"
    env = {"FEWERBITS_CANARY_CONTRACT": contract.to_json(), "FEWERBITS_TERMINATION_LOG": str(term),
           "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    t0 = time.monotonic()
    code = canary.run(env)
    return code, CanaryTermination.model_validate_json(term.read_text()), time.monotonic() - t0


def stored(s3, contract: CanaryContract) -> ServingQualityResult:
    bucket, prefix = artifact_prefix(contract.storage.uri, contract.key)
    body = s3.client().get_object(Bucket=bucket, Key=serving_result_key(prefix, contract.configHash))["Body"].read()
    return ServingQualityResult.model_validate_json(body)


def test_sound_artifact_passes_through_the_served_api(s3, published, served, tmp_path):
    contract = canary_contract(s3, published, published[2], served.url, kv="auto")
    code, term, seconds = run_in_process(s3, contract, tmp_path)
    assert code == 0 and term.outcome == "passed", term
    result = stored(s3, contract)
    assert result.passed and result.kvCacheDtype == "auto" and result.configHash == contract.configHash == term.configHash
    (m,) = result.metrics
    assert m.name == "custom:rougeL" and m.samples == 6 and m.passed and m.served > 0 and m.base > 0, m
    assert m.jobQuantized is not None and m.method == "lm-eval local-completions"
    assert [s.name for s in result.skipped] == ["perplexity"] and "prompt_logprobs" in result.skipped[0].reason
    # One probe, one request per custom record; within the budget.
    assert result.requests == 1 + 6 <= LIMITS["maxRequests"]
    assert result.seconds > 0 and "uvicorn" in result.server
    print(f"\ncanary sound: {seconds:.1f}s in process, {result.requests} requests, evaluation {result.seconds:.1f}s")


def test_damaged_artifact_fails_naming_the_metric_and_kv_cache(s3, published, served, tmp_path):
    contract = canary_contract(s3, published, published[3], served.url, kv="fp8", name="damaged")
    code, term, _ = run_in_process(s3, contract, tmp_path)
    assert code == 0 and term.outcome == "failed", term
    assert term.reason.startswith("custom:rougeL ") and "of base (min 50%" in term.reason, term.reason
    assert term.reason.endswith("with KV cache fp8"), term.reason
    result = stored(s3, contract)
    assert not result.passed and result.reason == term.reason
    (m,) = result.metrics
    assert not m.passed and m.recoveryPercent < 50 and m.jobQuantized > 0, m


def test_unreachable_canary_is_an_error_naming_the_endpoint(s3, published, tmp_path):
    from e2e import procs

    endpoint = f"http://127.0.0.1:{procs.free_port()}"
    contract = canary_contract(s3, published, published[2], endpoint)
    term_file = tmp_path / "termination-log"
    env = worktree_env({"FEWERBITS_CANARY_CONTRACT": contract.to_json(), "FEWERBITS_TERMINATION_LOG": str(term_file),
                        "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key})
    proc = subprocess.run([sys.executable, "-m", "fewerbits_quantjob", "canary"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    term = CanaryTermination.model_validate_json(term_file.read_text())
    assert term.outcome == "error" and term.configHash == contract.configHash
    assert endpoint in term.reason and "Connection refused" in term.reason, term.reason
    assert s3.secret_key not in proc.stdout + proc.stderr
    # No verdict object: the operator sees no result, and the canary takes no traffic.
    bucket, prefix = artifact_prefix(contract.storage.uri, contract.key)
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}serving/{contract.configHash}")
    assert not listed.get("Contents"), listed


def test_a_vllm_like_server_gets_the_jobs_windows_and_token_id_prompts(s3, published, tmp_path):
    """The whole evaluation against the STAND-IN for vLLM of tests/unit/test_canary_eval.py (vLLM
    needs a GPU): with prompt logprobs offered, perplexity is measured on exactly the Job's windows
    (cut from the artifact's own tokenizer) and the custom set goes as token-id prompts encoded as
    the Job's HF model encodes them (BOS first), greedy, seed 1234, stop at a newline."""
    from transformers import AutoTokenizer

    from fewerbits_quantjob import evaluate, textdata
    from tests.unit.test_canary_eval import VLLMStandIn

    stand_in = VLLMStandIn()
    try:
        contract = canary_contract(s3, published, published[2], stand_in.url, kv="fp8")
        code, term, _ = run_in_process(s3, contract, tmp_path)
    finally:
        stand_in.close()
    assert code == 0 and term.outcome in ("passed", "failed"), term
    result = stored(s3, contract)
    assert [m.name for m in result.metrics] == ["perplexity", "custom:rougeL"] and not result.skipped
    ppl = result.metrics[0]
    assert ppl.method == "prompt_logprobs" and ppl.samples == GATE["evalSamples"] and ppl.jobQuantized

    model = build_test_model()
    tok = AutoTokenizer.from_pretrained(model)
    windows = evaluate.build_windows(tok, textdata.load_texts("general-en-heldout", {}).texts,
                                     evaluate.window_length(64, type("C", (), {"max_position_embeddings": 512})), 4)
    sent = [r for r in stand_in.requests[1:] if "prompt_logprobs" in r]
    assert sorted(r["prompt"] for r in sent) == sorted(windows.tolist())
    gen = [r for r in stand_in.requests if "prompt_logprobs" not in r]
    records = [json.loads(line) for line in (FIXTURES / "custom-eval.jsonl").read_text().splitlines()[:6]]
    assert sorted(r["prompt"][0] for r in gen) == sorted(tok(x["prompt"])["input_ids"] for x in records)
    assert tok(records[0]["prompt"])["input_ids"][0] == tok.bos_token_id
    for r in gen:
        assert (r["temperature"], r["seed"], r["max_tokens"]) == (0, 1234, 8) and "\n" in r["stop"], r
    assert result.requests == len(stand_in.requests) == 1 + 4 + 6
