"""Prefix-cache-aware routing, measured on real vLLM: one variant of two real vLLM pods (the CPU
build, the stand-in for a GPU node: image `fewerbits-test/vllm-cpu`, e2e/vllm_cpu.py), routed through
the InferencePool whose endpoint picker the operator deploys (its default profile scores the
queue, the free KV cache and the prompt's cached prefix: picker.SCORING_CONFIG), and through the
model's Service (kube-proxy's random pick, e2e/serviceproxy.py) as the baseline, in the same run on
the same pods.

The workload: GROUPS prompts' shared prefixes (a long system prompt each, several of vLLM's
128-token KV blocks), each asked PER_GROUP times with a different question, groups interleaved, one
request at a time. Each phase uses prefixes of its own, so neither is helped by the other's cache.
Figures, per phase: the prefix-cache hit rate of the two pods together (vLLM's own
`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`, in prompt tokens), how many requests went
to the pod their group's first request went to, and the time to the first token: vLLM's own
(`vllm:time_to_first_token_seconds`, the mean over the phase) and the client's (a one-token
completion's latency through the gateway or the Service stand-in); reported, never asserted. Set
FEWERBITS_RESULTS_DIR to have them written as `prefix-routing.json` (bench/results/ keeps the
committed run that docs/routing.md's table comes from).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client

from e2e.demo import ARTIFACT_BUCKET
from e2e.serviceproxy import open_service_url
from e2e.tests.test_harness import wait_for
from fewerbits_operator.serving import picker as epp

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

IMAGE = "fewerbits-test/vllm-cpu:1"
MODEL = "prefixed"
SHARED_ARTIFACTS = f"s3://{ARTIFACT_BUCKET}/routing-and-scale-from-zero"
"""The fp8-dynamic artifact the routing tests share: a cache hit when one of them ran first."""
GROUPS, PER_GROUP = 8, 6
PREFIX_WORDS = 105
"""About 400 prompt tokens of the test model's tokenizer: three full 128-token KV blocks of vLLM
(its CPU default), one 512-character block of the picker's hash (vLLM's block size x 4)."""
SUFFIX_WORDS = 15
WORDS = ("harvest", "river", "ledger", "copper", "meadow", "signal", "lantern", "orchard", "granite",
         "harbor", "thistle", "compass", "ember", "willow", "quarry", "falcon", "saddle", "prism")


def text(seed: int, words: int) -> str:
    """Deterministic words, different for every seed (a system prompt, a question)."""
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1) + i // 3) % len(WORDS)] for i in range(words))


def prompts(phase: int) -> list[tuple[int, str]]:
    """(group, prompt), the groups interleaved: no two requests in a row share a prefix."""
    prefixes = [f"System {phase}-{g}: " + text(1000 * phase + g, PREFIX_WORDS) for g in range(GROUPS)]
    return [(g, f"{prefixes[g]}\nQuestion {r}: {text(97 * g + r + 1, SUFFIX_WORDS)}\nAnswer:")
            for r in range(PER_GROUP) for g in range(GROUPS)]


def counters(ip: str) -> dict[str, float]:
    """The pod's request and prefix-cache counters (summed over label sets)."""
    names = ("vllm:request_success_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
             "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")
    out = dict.fromkeys(names, 0.0)
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _ready(p) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])


def serving_pods(core: client.CoreV1Api, namespace: str) -> list[str]:
    return sorted(p.status.pod_ip for p in core.list_namespaced_pod(
        namespace, label_selector=f"fewerbits.io/model={MODEL},app.kubernetes.io/component=server").items
        if _ready(p) and p.status.pod_ip and not p.metadata.deletion_timestamp)


def picker_ip(core: client.CoreV1Api, namespace: str) -> str | None:
    for p in core.list_namespaced_pod(namespace, label_selector=f"{epp.LABEL_PICKER}={MODEL}").items:
        if _ready(p) and p.status.pod_ip and not p.metadata.deletion_timestamp:
            return p.status.pod_ip
    return None


def body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()


def run_phase(send, pods: list[str], phase: int) -> dict:
    """Send the phase's prompts one at a time with ``send(body) -> (endpoint ip, answer)``; the
    figures once both pods counted every request (waiting on vLLM's counter, never a sleep)."""
    before = {ip: counters(ip) for ip in pods}
    first: dict[int, str] = {}
    same, latencies, prompt_tokens = 0, [], []
    for g, prompt in prompts(phase):
        t0 = time.monotonic()
        ip, answer = send(body(prompt))
        latencies.append(time.monotonic() - t0)
        prompt_tokens.append(answer["usage"]["prompt_tokens"])
        same += first.setdefault(g, ip) == ip and len(latencies) > GROUPS
    sent = len(latencies)
    after = wait_for("both pods to count every request", lambda: (
        c := {ip: counters(ip) for ip in pods}) and sum(c[ip]["vllm:request_success_total"] - before[ip][
            "vllm:request_success_total"] for ip in pods) >= sent and c, timeout=60, interval=0.1)
    delta = {k: sum(after[ip][k] - before[ip][k] for ip in pods) for k in after[pods[0]]}
    return {"requests": sent, "follow_ups_on_first_pod": f"{same}/{sent - GROUPS}",
            "prefix_cache_hit_rate": round(delta["vllm:prefix_cache_hits_total"]
                                           / delta["vllm:prefix_cache_queries_total"], 3),
            "ttft_ms_in_vllm_mean": round(1000 * delta["vllm:time_to_first_token_seconds_sum"]
                                          / delta["vllm:time_to_first_token_seconds_count"], 1),
            "ttft_ms_median": round(1000 * statistics.median(latencies), 1),
            "ttft_ms_median_follow_ups": round(1000 * statistics.median(latencies[GROUPS:]), 1),
            "prompt_tokens_min": min(prompt_tokens), "prompt_tokens_max": max(prompt_tokens), "same": same}


def test_prefix_aware_routing_reaches_the_pod_with_the_prefix(request, cluster, gpu_pool, namespace, models,
                                                              model_spec, inference_gateway):
    (node,) = gpu_pool("h100-prefix", "NVIDIA-H100-80GB-HBM3")
    models.apply(namespace, MODEL, model_spec(
        quantization={"format": "fp8-dynamic"}, storage={"uri": SHARED_ARTIFACTS},
        serving={"image": IMAGE, "maxModelLen": 512, "replicas": 2, "routing": "inferencePool",
                 "targets": [{"nodeSelector": {"kubernetes.io/hostname": node}}]}))
    models.wait_condition(namespace, MODEL, "Ready", timeout=900)
    api = cluster.api_client()
    core = client.CoreV1Api(api)
    pods = models.wait("two vLLM pods ready", lambda: len(ips := serving_pods(core, namespace)) == 2 and ips,
                       timeout=300, namespace=namespace, name=MODEL)
    config = core.read_namespaced_config_map(epp.name_of(MODEL), namespace).data[epp.CONFIG_FILE]
    assert "pluginRef: prefix-cache-scorer" in config, config  # on by default
    ip = wait_for("the picker's pod ready", lambda: picker_ip(core, namespace), timeout=120, interval=0.2)
    gateway = inference_gateway.front(namespace, ip)
    # Both pods in the picker's datastore (it lists them before their first scrape; it scrapes every
    # 50 ms, and the Service phase below runs first). Until a scrape gives vLLM's block size the
    # prefix scorer hashes 64-character blocks: a finer match, the same routing.
    wait_for("the picker to list both pods", lambda: len(gateway.queue_sizes()) == 2, timeout=60, interval=0.2)
    service = models.get(namespace, MODEL)["status"]["endpoint"]

    def through_service(data: bytes) -> tuple[str, dict]:
        ep, resp = open_service_url(api, f"{service}/v1/completions", "POST", data,
                                    {"Content-Type": "application/json"}, timeout=60)
        assert resp.status == 200, resp.read()[:500]
        return ep.ip, json.loads(resp.read())

    def through_gateway(data: bytes) -> tuple[str, dict]:
        req = urllib.request.Request(f"{gateway.gateway_url}/v1/completions", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.headers["X-Fewerbits-Endpoint"].rsplit(":", 1)[0], json.loads(r.read())

    service_figures = run_phase(through_service, pods, phase=1)
    pool_figures = run_phase(through_gateway, pods, phase=2)
    figures = {"pods": 2, "groups": GROUPS, "requests_per_group": PER_GROUP, "concurrency": 1,
               "service": service_figures, "inference_pool": pool_figures,
               "cpu": os.environ.get("FEWERBITS_CPU_CAPABILITY") or "native"}
    print("PREFIX ROUTING FIGURES", json.dumps(figures))
    if os.environ.get("FEWERBITS_RESULTS_DIR"):
        Path(os.environ["FEWERBITS_RESULTS_DIR"], "prefix-routing.json").write_text(json.dumps(figures, indent=2) + "\n")
    assert pool_figures["prompt_tokens_max"] < 512 and pool_figures["prompt_tokens_max"] > 3 * 128, figures
    # Through the picker every follow-up reaches the pod its prefix went to; the Service cannot know.
    assert pool_figures["same"] == GROUPS * (PER_GROUP - 1), figures
    assert pool_figures["prefix_cache_hit_rate"] > service_figures["prefix_cache_hit_rate"], figures
