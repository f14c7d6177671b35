"""Scale from zero end to end: a model with `autoscaling.minReplicas: 0` goes to zero after idling
(the autoscaler), Argo CD's health check says Suspended; a request arrives at the activator (in the
session operator's process, where the model's Service points while it is at zero), is held while
one replica starts (Argo CD: Progressing), then answered; the model is Ready again.

There is no kube-proxy in the harness, so the test sends the request the way the Service would
deliver it: to the activator's port, with the Service's host name (`<model>.<namespace>.svc`).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from kubernetes import client

from e2e.demo import ARTIFACT_BUCKET

from tests.unit.test_argocd_health import health

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]
# One fp8-dynamic artifact for the routing and scale-from-zero tests: the second is a cache hit.
SHARED_ARTIFACTS = f"s3://{ARTIFACT_BUCKET}/routing-and-scale-from-zero"

DELAY = 6  # scaleDownDelaySeconds: idle this long, then down to zero


def test_a_request_at_zero_replicas_is_held_then_served(cluster, gpu_pool, namespace, models, model_spec, operator):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    models.apply(namespace, "sleepy", model_spec(
        quantization={"format": "fp8-dynamic"}, storage={"uri": SHARED_ARTIFACTS},
        autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 2, "scaleDownDelaySeconds": DELAY}))
    models.wait_condition(namespace, "sleepy", "Ready", timeout=600)
    apps = client.AppsV1Api(cluster.api_client())
    core = client.CoreV1Api(cluster.api_client())
    (dep,) = models.deployments(namespace, "sleepy")
    name = dep.metadata.name

    # Idle (the simulator reports no load): down to zero after the delay, no pod serving any more.
    def serving() -> list[tuple[str, bool, bool]]:
        pods = core.list_namespaced_pod(namespace, label_selector="fewerbits.io/model=sleepy,"
                                                                  "app.kubernetes.io/component=server").items
        return [(p.metadata.name, bool(p.metadata.deletion_timestamp),
                 any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])) for p in pods]

    deadline = time.monotonic() + DELAY + 90
    # A Scale at 0 replicas leaves spec.replicas out (omitempty): None here.
    while not ((apps.read_namespaced_deployment_scale(name, namespace).spec.replicas or 0) == 0
               and not [p for p in serving() if not p[1] and p[2]]):
        assert time.monotonic() < deadline, f"not scaled to zero: replicas " \
            f"{apps.read_namespaced_deployment_scale(name, namespace).spec.replicas}, pods {serving()}"
        time.sleep(0.5)
    suspended = models.wait("Argo CD health Suspended", lambda: (h := health(models.get(namespace, "sleepy")))[0]
                            == "Suspended" and h, timeout=30)
    assert "Scaled to zero" in suspended[1]

    # A request arrives: held, one replica starts, then it is answered.
    answer: dict = {}

    def call() -> None:
        body = json.dumps({"model": "sleepy", "messages": [{"role": "user", "content": "wake up"}],
                           "max_tokens": 4}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{operator.activator_port}/v1/chat/completions", data=body,
                                     method="POST", headers={"Content-Type": "application/json",
                                                             "Host": f"sleepy.{namespace}.svc:8000"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=300) as r:
            answer.update(status=r.status, body=json.loads(r.read()), endpoint=r.headers.get("X-Fewerbits-Endpoint"),
                          seconds=time.monotonic() - t0)

    caller = threading.Thread(target=call)
    caller.start()
    healths: list[tuple[str, str]] = []
    models.wait("one replica asked", lambda: apps.read_namespaced_deployment_scale(name, namespace).spec.replicas == 1,
                timeout=30)
    assert not answer, "answered before any replica was ready"
    while caller.is_alive():
        healths.append(health(models.get(namespace, "sleepy")))
        caller.join(0.2)
    assert answer.get("status") == 200 and answer["body"]["choices"], answer
    print("SCALE FROM ZERO", json.dumps({"held_seconds": round(answer["seconds"], 1), "endpoint": answer["endpoint"]}))
    assert any(e.reason == "ScaledFromZero" for e in models.events(namespace, "sleepy"))
    assert ("Progressing" in {h for h, _ in healths}) or not healths, healths

    # Ready again, and Argo CD says Healthy.
    models.wait_condition(namespace, "sleepy", "Ready", timeout=60)
    assert health(models.get(namespace, "sleepy"))[0] == "Healthy"
