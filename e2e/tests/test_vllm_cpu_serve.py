"""The pod runner's real CPU server: a vLLM container of the `fewerbits-test/vllm-cpu` image, with
the command the operator renders (launch wrapper, `vllm serve <model dir>`), runs
`transformers serve` on the directory vLLM would load, at the pod IP and vLLM's port, and turns
Ready through its `/health` readiness probe; `/v1/completions` under the served model name answers
with the tiny test model's real (greedy, deterministic) text."""

from __future__ import annotations

import json
import urllib.request

import pytest
from kubernetes import client

from tests.testmodel import build_test_model

from e2e.tests.test_harness import PY, pods, wait_for

pytestmark = pytest.mark.cluster


def test_cpu_vllm_image_serves_the_fetched_model_for_real(cluster, gpu_pool, namespace):
    gpu_pool("l4-cpu-serve", "NVIDIA-L4")
    model = build_test_model()
    api = client.CoreV1Api(cluster.api_client())
    apps = client.AppsV1Api(cluster.api_client())
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1}
    spec = {
        "volumes": [{"name": "models", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
        "terminationGracePeriodSeconds": 2,
        # The fetcher's part: the artifact's files into the models volume.
        "initContainers": [{"name": "fetch", "image": PY, "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                            "command": ["python", "-c", f"import shutil; shutil.copytree({str(model)!r}, '/models/k')"]}],
        "containers": [{
            "name": "vllm", "image": "fewerbits-test/vllm-cpu:1",
            "command": ["python3", "-m", "fewerbits_runtime", "launch", "--manifest", "/models/k/m.json", "--",
                        "vllm", "serve", "/models/k", "--host", "0.0.0.0", "--port", "8000",
                        "--served-model-name", "tiny", "--kv-cache-dtype", "fp8"],
            "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"}],
            "ports": [{"name": "http", "containerPort": 8000}],
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
            "readinessProbe": probe,
            "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                             {"name": "tmp", "mountPath": "/tmp"}],
        }],
    }
    apps.create_namespaced_deployment(namespace, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "cpu"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "cpu"}},
                 "template": {"metadata": {"labels": {"app": "cpu"}}, "spec": spec}}})
    wait_for("Deployment available", lambda: (apps.read_namespaced_deployment("cpu", namespace).status.ready_replicas
                                              or 0) == 1, timeout=180)
    [pod] = pods(api, namespace, "app=cpu")
    body = json.dumps({"model": "tiny", "prompt": "It was the best of times, it was the worst of times,",
                       "max_tokens": 6, "temperature": 0, "stop": ["\n"]}).encode()
    answers = []
    for _ in range(2):
        req = urllib.request.Request(f"http://{pod.status.pod_ip}:8000/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answers.append(json.loads(r.read())["choices"][0]["text"])
    assert answers[0] and answers[0] == answers[1], answers  # greedy: real text, the same twice
    with urllib.request.urlopen(f"http://{pod.status.pod_ip}:8000/v1/models", timeout=30) as r:
        assert r.status == 200  # the cache folder is writable (HF_HOME on the pod's tmp volume)
