"""The serving canary end to end on the real control plane, judged against REAL vLLM.

The model's `serving.image` is `fewerbits-test/vllm-cpu:1`: the pod runner runs that container's
own command line (the real launcher from the copy the fetch init container installed, then
`vllm serve` with the operator's argv) under vLLM's CPU build, the stand-in for a GPU node
(e2e/workloads.py rule `vllm-cpu`, translations listed in e2e/vllm_cpu.py). So the canary Job
(`python -m fewerbits_quantjob canary`, real, lm-eval included) measures perplexity through vLLM's
prompt logprobs and generates through vLLM, with the FP8 KV cache applied (`--kv-cache-dtype fp8`)
where this CPU has the kernel (AVX-512 or AMX), else served as the 16-bit cache, as the log says.

One model, four rollouts: (a) the sound artifact passes its canary and takes traffic (events
canary → verdict → traffic); (b) the artifact damaged in place (every weight but the norms
zeroed: the quality-evaluation tests' recipe) behind a new served configuration (the one-field
fallback `quantization.kvCache: none`) fails, never takes traffic, and the sound pods keep
serving; (c) an image without a server is reported with the pod's reason; (d) a setting vLLM
refuses at start is reported with vLLM's own message; the sound pods serve throughout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from kubernetes import client

from e2e import vllm_cpu
from fewerbits_api.artifact import FILES_DIR, MANIFEST_NAME, Manifest, ManifestFile, artifact_prefix
from tests.integration.test_quality import upload_fixtures

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

IMAGE = "fewerbits-test/vllm-cpu:1"
BROKEN_IMAGE = "fewerbits-test/no-vllm:1"
"""Run as its own command (e2e/workloads.py): the runtime launcher checks the artifact and finds no
`vllm` to exec, as an image without the server (or with a broken one) would fail on start."""
BAD_ARGS = ["--monokernel"]
"""A flag of vLLM 0.33 (the parser the operator checks extraArgs against) that the image's vLLM (the
0.32 CPU build) does not have: an image older than the operator's parser. vLLM's own parser refuses
it at start (`error: unrecognized arguments: --monokernel`), in ~20 s and before any weights."""
BUCKET = "artifacts"
HARNESS_CPU = vllm_cpu.this_cpu(dict(os.environ))
"""The CPU level the pods' vLLM acts on in this session (FEWERBITS_CPU_CAPABILITY, else this CPU's)."""

def damage_in_place(s3, storage_uri: str, key: str, work: Path) -> None:
    """Every weight but the norms zeroed, in the artifact's own files, with a manifest that lists the
    new digests and keeps the Job's quality figures: it fetches and verifies like the sound one."""
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file

    bucket, prefix = artifact_prefix(storage_uri, key)
    c = s3.client()
    manifest = Manifest.parse(c.get_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)["Body"].read(), key)
    files = []
    for f in manifest.files:
        body = c.get_object(Bucket=bucket, Key=f"{prefix}{FILES_DIR}/{f.path}")["Body"].read()
        if f.path.endswith(".safetensors"):
            local = work / "w.safetensors"
            local.write_bytes(body)
            weights = load_file(str(local))
            save_file({k: (v if "norm" in k else torch.zeros_like(v)) for k, v in weights.items()}, str(local),
                      metadata={"format": "pt"})
            body = local.read_bytes()
            c.put_object(Bucket=bucket, Key=f"{prefix}{FILES_DIR}/{f.path}", Body=body)
        files.append(ManifestFile(path=f.path, sizeBytes=len(body), sha256=hashlib.sha256(body).hexdigest()))
    damaged = manifest.model_copy(update={"files": files, "totalBytes": sum(f.sizeBytes for f in files)})
    c.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=json.dumps(damaged.to_wire()).encode())


def kv_cache_tokens(cluster, namespace: str, pod) -> int:
    """The KV cache size vLLM reports at start (`KV cache size: 131,072 tokens`)."""
    import re

    log = cluster.pod_logs(namespace, pod.metadata.name, "vllm")
    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert sizes, log[-3000:]
    return int(sizes[-1].replace(",", ""))


def fp8_kv_tokens() -> int:
    """Tokens the harness's KV cache (e2e/vllm_cpu.py) holds for the test model at one byte per value."""
    from e2e.vllm_cpu import DEFAULT_KV_CACHE_BYTES
    from tests.testmodel import MODEL_RECIPE as m

    head_dim = m["hidden_size"] // m["num_attention_heads"]
    return DEFAULT_KV_CACHE_BYTES // (2 * m["num_hidden_layers"] * m["num_key_value_heads"] * head_dim)


def _ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _served_by_service(core, namespace: str, name: str) -> list:
    """The pods the model's Service selects. (Pod IPs here are loopback addresses, which the API
    server keeps out of EndpointSlices, so the Service's selector is checked against pod labels.)"""
    svc = core.read_namespaced_service(name, namespace)
    selector = ",".join(f"{k}={v}" for k, v in svc.spec.selector.items())
    return core.list_namespaced_pod(namespace, label_selector=selector).items


def _canary_pod_ready(models, core, namespace: str, name: str):
    """The model's ready canary pod, or None; a canary the operator found failing (CanaryNotReady: its
    pod failed) stops the wait with the operator's message instead of waiting out the timeout."""
    quality = models.condition(namespace, name, "ServingQualityPassed")
    if quality and quality["reason"] == "CanaryNotReady":
        raise AssertionError(f"the canary pod failed: {quality['message']}")
    return next((p for p in core.list_namespaced_pod(namespace, label_selector=f"fewerbits.io/canary-of={name}").items
                 if _ready(p)), None)


def _verdict(models, namespace: str, name: str, timeout: float) -> dict:
    """ServingQualityPassed once the canary of the current generation has an outcome (passed,
    failed, not ready, error)."""
    def check():
        obj = models.get(namespace, name)
        c = next((c for c in (obj.get("status") or {}).get("conditions") or []
                  if c["type"] == "ServingQualityPassed"), None)
        return c if c and c.get("observedGeneration") == obj["metadata"]["generation"] and \
            c["reason"] in ("CanaryPassed", "CanaryFailed", "CanaryNotReady", "CanaryError") else None
    return models.wait("a canary verdict", check, timeout, namespace, name)


def _verdict_written(s3, spec: dict, canary: dict):
    """When the canary Job wrote its verdict (`<key>/serving/<hash>.json`), to the whole second as
    the API server stamps objects (MinIO runs on the same clock)."""
    from fewerbits_api.canary import serving_result_key

    bucket, prefix = artifact_prefix(spec["storage"]["uri"], canary["artifactKey"])
    head = s3.client().head_object(Bucket=bucket, Key=serving_result_key(prefix, canary["configHash"]))
    return head["LastModified"].replace(microsecond=0)


def _reasons(models, namespace: str, name: str) -> dict:
    """Reason → when it was first posted (Event times have whole seconds: one pass's events tie)."""
    out: dict = {}
    for e in models.events(namespace, name):
        t = e.first_timestamp or e.event_time or e.metadata.creation_timestamp
        out[e.reason] = min(out.get(e.reason, t), t)
    return out


def test_canary_judges_what_is_served_before_it_takes_traffic(cluster, gpu_pool, namespace, models, model_spec,
                                                             tmp_path):
    (node,) = gpu_pool("h100", "NVIDIA-H100-80GB-HBM3", gpus_per_node=4)
    core = client.CoreV1Api(cluster.api_client())
    _, custom = upload_fixtures(cluster.s3, f"{namespace}-evals")
    gate = {"maxPerplexityIncreasePercent": 50, "evalSamples": 4,
            "customEval": {"dataset": custom, "metric": "rougeL", "minRecoveryPercent": 50, "limit": 6,
                           "maxNewTokens": 8}}
    spec = model_spec(quantization={"format": "fp8-dynamic", "qualityGate": gate},
                      serving={"maxModelLen": 256, "image": IMAGE,
                               # This test's node only: a pool another test left on the shared cluster
                               # would be a second variant.
                               "targets": [{"nodeSelector": {"kubernetes.io/hostname": node}}],
                               "canary": {"enabled": True, "limits": {"maxRequests": 32, "concurrency": 2,
                                                                      "requestTimeoutSeconds": 60}}})
    t0 = time.monotonic()
    models.apply(namespace, "c", spec)

    # (a) The sound artifact: canary → verdict → traffic.
    models.wait_condition(namespace, "c", "QualityGatePassed", timeout=900)
    t_gate = time.monotonic()
    canary_pod = models.wait("the canary pod ready", lambda: _canary_pod_ready(models, core, namespace, "c"),
                             timeout=300, namespace=namespace, name="c")
    assert "fewerbits.io/model" not in canary_pod.metadata.labels
    assert canary_pod.metadata.uid not in {p.metadata.uid for p in _served_by_service(core, namespace, "c")}
    passed = _verdict(models, namespace, "c", timeout=600)
    t_verdict = time.monotonic()
    assert passed["reason"] == "CanaryPassed", passed
    models.wait_condition(namespace, "c", "Ready", timeout=300)
    t_ready = time.monotonic()
    steps = ("CanaryStarted", "CanaryEvaluating", "CanaryPassed", "DeploymentCreated")
    models.wait_events(namespace, "c", set(steps))
    at = _reasons(models, namespace, "c")
    assert [at[s] for s in steps] == sorted(at[s] for s in steps), at  # canary → verdict → traffic
    deployments = models.deployments(namespace, "c")
    assert len(deployments) == 1, [(d.metadata.name, d.metadata.labels) for d in deployments]
    (real,) = deployments
    status = models.get(namespace, "c")["status"]
    (entry,) = status["serving"]
    c1 = entry["canary"]
    # The Deployment only after the verdict: created at or after the verdict object was written. (Not
    # against the CanaryPassed event: that pass posts its events after its writes, a second later
    # at a second's boundary.)
    assert real.metadata.creation_timestamp >= _verdict_written(cluster.s3, spec, c1), c1
    assert c1["phase"] == "Passed" and c1["kvCacheDtype"] == "fp8", c1
    (metric,) = [m for m in c1["metrics"] if m["name"] == "custom:rougeL"]
    assert metric["served"] > 0 and metric["base"] > 0 and metric["jobQuantized"] is not None and metric["passed"]
    # Perplexity through vLLM's prompt logprobs, on the Job's own held-out windows.
    (ppl,) = [m for m in c1["metrics"] if m["name"] == "perplexity"]
    assert ppl["passed"] and ppl["served"] > 1 and ppl["jobQuantized"] > 1, ppl
    assert "perplexity" not in {s["name"] for s in c1["skipped"]}, c1["skipped"]
    # The FP8 KV cache applied for real where this CPU has its kernel: vLLM sized its cache at one byte
    # per value. Without AVX-512 or AMX (or FEWERBITS_CPU_CAPABILITY=AVX2) the stand-in serves the
    # 16-bit cache and says so in the pod's log (e2e/vllm_cpu.py).
    canary_log = cluster.pod_logs(namespace, canary_pod.metadata.name, "vllm")
    translated = f"{vllm_cpu.MARK} translated for this CPU: --kv-cache-dtype fp8 served as auto (16-bit)"
    if HARNESS_CPU.fp8_kv_cache:
        assert kv_cache_tokens(cluster, namespace, canary_pod) == fp8_kv_tokens(), "the canary's KV cache is not FP8"
        assert translated not in canary_log
    else:
        assert kv_cache_tokens(cluster, namespace, canary_pod) == fp8_kv_tokens() // 2 and translated in canary_log
    print(f"\nvLLM CPU level {HARNESS_CPU.describe()}: the canary's KV cache "
          f"{'FP8' if HARNESS_CPU.fp8_kv_cache else '16-bit (FP8 translated: no kernel on this CPU)'}")
    served = _served_by_service(core, namespace, "c")
    assert served and all(p.metadata.labels["fewerbits.io/model"] == "c" and _ready(p) for p in served)
    models.wait("the canary and its Job removed", lambda: not core.list_namespaced_pod(
        namespace, label_selector="fewerbits.io/canary-of=c").items and not [
        j for j in models.jobs(namespace) if j.metadata.name.startswith("fewerbits-canary-")],
        timeout=120, namespace=namespace, name="c")
    print(f"\nperplexity: Job (quantized, transformers) {ppl['jobQuantized']:.4f}, served by vLLM "
          f"{ppl['served']:.4f}, base {ppl['base']:.4f}")
    print(f"\ncanary timing: apply→QualityGatePassed {t_gate - t0:.1f}s, canary (pod + evaluation) "
          f"{t_verdict - t_gate:.1f}s, verdict→Ready (the rollout itself) {t_ready - t_verdict:.1f}s, "
          f"evaluation {c1['seconds']:.1f}s, {c1['requests']} requests")
    sound_pods = {p.metadata.uid for p in served}
    (deployment,) = models.deployments(namespace, "c")
    generation = deployment.metadata.generation

    # (b) A damaged artifact behind a new served configuration (the 16-bit KV-cache fallback): it fails.
    key = status["artifacts"][0]["key"]
    damage_in_place(cluster.s3, spec["storage"]["uri"], key, tmp_path)
    models.patch_spec(namespace, "c", {"quantization": {"kvCache": "none"}})
    models.wait("the damaged canary ready", lambda: _canary_pod_ready(models, core, namespace, "c"), timeout=300,
                namespace=namespace, name="c")
    assert sound_pods == {p.metadata.uid for p in _served_by_service(core, namespace, "c")}  # never an endpoint
    damaged_pod = next(p for p in core.list_namespaced_pod(namespace, label_selector="fewerbits.io/canary-of=c").items
                       if _ready(p))
    assert kv_cache_tokens(cluster, namespace, damaged_pod) == fp8_kv_tokens() // 2  # the 16-bit KV cache
    failed = _verdict(models, namespace, "c", timeout=600)
    assert failed["reason"] == "CanaryFailed", failed
    assert "custom:rougeL" in failed["message"] and "KV cache auto" in failed["message"], failed
    deployed = models.condition(namespace, "c", "Deployed")
    assert deployed["status"] == "False" and deployed["reason"] == "Blocked", deployed
    (after,) = models.deployments(namespace, "c")
    assert after.metadata.generation == generation  # the sound Deployment was never touched
    assert sound_pods == {p.metadata.uid for p in _served_by_service(core, namespace, "c")}
    ready = models.condition(namespace, "c", "Ready")
    assert ready["status"] == "True", ready
    # The event is posted after the status write that carries the verdict: waited for, not read once.
    models.wait_events(namespace, "c", {"CanaryFailed"})

    # (c) A server that crashes on start: reported with the pod's reason; the sound pods keep serving.
    models.patch_spec(namespace, "c", {"serving": {"image": BROKEN_IMAGE}})
    not_ready = _verdict(models, namespace, "c", timeout=300)
    assert not_ready["reason"] == "CanaryNotReady", not_ready
    assert "cannot start 'vllm'" in not_ready["message"], not_ready
    assert sound_pods == {p.metadata.uid for p in _served_by_service(core, namespace, "c")}
    ready = models.condition(namespace, "c", "Ready")
    assert ready["status"] == "True", ready
    models.wait("the crashed canary removed", lambda: not core.list_namespaced_pod(
        namespace, label_selector="fewerbits.io/canary-of=c").items, timeout=120, namespace=namespace, name="c")

    # (d) vLLM refuses a setting at start: its own message in the verdict; the sound pods keep serving.
    models.patch_spec(namespace, "c", {"serving": {"image": IMAGE, "extraArgs": BAD_ARGS}})
    refused = _verdict(models, namespace, "c", timeout=300)
    assert refused["reason"] == "CanaryNotReady" and "unrecognized arguments: --monokernel" in refused["message"], \
        refused
    ready = models.condition(namespace, "c", "Ready")
    assert ready["status"] == "True", ready
