"""Scale from zero end to end, through the model's own URL: a model with
`autoscaling.minReplicas: 0` goes to zero after idling (the autoscaler), Argo CD's health check
says Suspended, and its Service then lists the activator (the operator's EndpointSlice, atzero.py).
Requests to the URL in `status.endpoint` (plain and `stream: true`) are held by the activator while
one replica starts (Argo CD: Progressing), then answered, the streamed one as server-sent events;
requests past the activator's bound get 503 with Retry-After; the wake, the hold and the overflow
are counted in the activator's Prometheus metrics (its own process, as the chart's activator
Deployment runs it).

There is no DNS and no kube-proxy in the harness: `e2e/serviceproxy.py` plays both (it reads the
Service and its EndpointSlices from the API server and picks an endpoint as kube-proxy would),
nothing else stands in.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from kubernetes import client

from e2e.demo import ARTIFACT_BUCKET
from e2e.serviceproxy import open_service_url, service_endpoints
from tests.integration.conftest import ACTIVATOR_QUEUE, ACTIVATOR_UNPUBLISHED

from tests.unit.test_argocd_health import health

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]
# One fp8-dynamic artifact for the routing and scale-from-zero tests: the second is a cache hit.
SHARED_ARTIFACTS = f"s3://{ARTIFACT_BUCKET}/routing-and-scale-from-zero"

DELAY = 6  # scaleDownDelaySeconds: idle this long, then down to zero


def test_a_request_at_zero_replicas_is_held_then_served(cluster, gpu_pool, namespace, models, model_spec, activator):
    assert not ACTIVATOR_UNPUBLISHED, ACTIVATOR_UNPUBLISHED  # the activator must be a Service endpoint
    (node,) = gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
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

    # At zero the model's Service lists the activator, and only it.
    url = models.get(namespace, "sleepy")["status"]["endpoint"]
    eps = models.wait("the activator in the Service's path", lambda: (e := service_endpoints(
        cluster.api_client(), namespace, "sleepy", 8000)) and all(x.source.startswith("slice:sleepy-activator") for x in e)
        and e, timeout=30)
    assert eps

    def metric(name: str, **labels: str) -> float:
        return operator_metric(activator.metrics_port, name, labels)  # the activator's own process

    wakes0, queue0 = metric("fewerbits_activator_wakes_total"), metric("fewerbits_activator_rejected_total", reason="queue")
    holds0 = metric("fewerbits_activator_hold_seconds_count")

    # Requests to the user's URL: one plain, one streamed; both held while one replica starts.
    answers: dict[str, dict] = {}

    def call(kind: str, stream: bool) -> None:
        body = json.dumps({"model": "sleepy", "messages": [{"role": "user", "content": "wake up"}],
                           "max_tokens": 8, "stream": stream}).encode()
        ep, r = open_service_url(cluster.api_client(), url + "/v1/chat/completions", "POST", body,
                                 {"Content-Type": "application/json"})
        out = {"status": r.status, "via": ep.source, "retry_after": r.getheader("Retry-After"),
               "endpoint": r.getheader("X-Fewerbits-Endpoint"), "chunked": r.getheader("Transfer-Encoding")}
        if stream and r.status == 200:
            out["events"] = [ln.strip() for ln in iter(r.readline, b"") if ln.startswith(b"data:")]
        else:
            out["body"] = r.read()
        answers[kind] = out

    # The woken pod is kept Pending until the burst below has been answered (a taint the planner does
    # not read, the scheduler does): what is held and what overflows is then not a race with its start.
    hold = client.V1Taint(key="fewerbits.io/test-hold", value="true", effect="NoSchedule")
    core.patch_node(node, {"spec": {"taints": [*(core.read_node(node).spec.taints or []), hold]}})
    callers = [threading.Thread(target=call, args=(k, k == "streamed")) for k in ("plain", "streamed")]
    for t in callers:
        t.start()
    models.wait("two requests held", lambda: metric("fewerbits_activator_waiting") >= 2, timeout=30)
    # A burst past the bound: ACTIVATOR_QUEUE may wait, the rest get 503 with Retry-After at once.
    burst = [threading.Thread(target=call, args=(f"burst-{i}", False)) for i in range(ACTIVATOR_QUEUE)]
    for t in burst:
        t.start()
    healths: list[tuple[str, str]] = []
    models.wait("one replica asked", lambda: apps.read_namespaced_deployment_scale(name, namespace).spec.replicas == 1,
                timeout=30)
    models.wait("the bound reached", lambda: metric("fewerbits_activator_waiting") >= ACTIVATOR_QUEUE
                and metric("fewerbits_activator_rejected_total", reason="queue") >= queue0 + 2, timeout=30)
    # Waking (one replica asked, none ready: it cannot be while the taint holds it): Progressing.
    healths.append(models.wait("Argo CD health Progressing", lambda: (h := health(models.get(namespace, "sleepy")))[0]
                               == "Progressing" and h, timeout=30))
    core.patch_node(node, {"spec": {"taints": [t for t in core.read_node(node).spec.taints or []
                                               if t.key != hold.key]}})
    for t in burst:
        t.join(300)
    rejected = [a for k, a in answers.items() if k.startswith("burst-") and a["status"] == 503]
    assert len(rejected) == 2 and all(a["retry_after"] for a in rejected), answers
    while any(t.is_alive() for t in callers):
        healths.append(health(models.get(namespace, "sleepy")))
        callers[0].join(0.2)
    for t in callers:
        t.join()

    plain, streamed = answers["plain"], answers["streamed"]
    assert plain["status"] == 200 and json.loads(plain["body"])["choices"], plain
    assert plain["via"].startswith("slice:sleepy-activator") and plain["endpoint"], plain  # through the activator
    assert streamed["status"] == 200 and streamed["chunked"] == "chunked", streamed
    assert streamed["events"][-1] == b"data: [DONE]" and len(streamed["events"]) >= 3, streamed
    assert json.loads(streamed["events"][0][5:])["object"] == "chat.completion.chunk"
    served = [a for k, a in answers.items() if k.startswith("burst-") and a["status"] == 200]
    assert len(served) == ACTIVATOR_QUEUE - 2, answers  # the one that found room was held and answered
    print("SCALE FROM ZERO", json.dumps({"plain_endpoint": plain["endpoint"], "events": len(streamed["events"]),
                                         "rejected": len(rejected)}))
    assert any(e.reason == "ScaledFromZero" for e in models.events(namespace, "sleepy"))
    assert "Scaling from zero" in healths[0][1], healths
    assert metric("fewerbits_activator_wakes_total") == wakes0 + 1
    assert metric("fewerbits_activator_rejected_total", reason="queue") == queue0 + 2
    assert metric("fewerbits_activator_hold_seconds_count") == holds0 + ACTIVATOR_QUEUE

    # Ready again, and Argo CD says Healthy.
    models.wait_condition(namespace, "sleepy", "Ready", timeout=60)
    assert health(models.get(namespace, "sleepy"))[0] == "Healthy"


def operator_metric(port: int, name: str, labels: dict[str, str]) -> float:
    """One sample of the operator's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
                return smp.value
    return 0.0
