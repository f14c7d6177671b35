"""Scale from zero end to end, through the model's own URL: a model with
`autoscaling.minReplicas: 0` goes to zero after idling (the autoscaler), Argo CD's health check
says Suspended, and its Service then lists the activator (the operator's EndpointSlice, atzero.py).
Requests to the URL in `status.endpoint` (plain and `stream: true`) are held by the activator while
one replica starts (Argo CD: Progressing), then answered, the streamed one as server-sent events;
requests past the activator's bound get 503 with Retry-After; the wake, the hold and the overflow
are counted in the activator's Prometheus metrics (its own process, as the chart's activator
Deployment runs it).

The model is also routed through an InferencePool behind a Gateway (`spec.serving.gateway`): the
operator's HTTPRoute points at the model's Service while the model is at zero or on its last pod
(so a request through the gateway reaches the activator too, held and answered like the others),
and at the InferencePool once a second pod is Ready (its endpoint picker then chooses the pod).

There is no DNS and no kube-proxy in the harness: `e2e/serviceproxy.py` plays both (it reads the
Service and its EndpointSlices from the API server and picks an endpoint as kube-proxy would),
`e2e/routeproxy.py` stands in for a gateway controller's route resolution (no Envoy here): per
request it follows the HTTPRoute's backend to the ext_proc gateway (InferencePool) or to
serviceproxy (Service). The serving pods are the simulator (below); nothing else stands in.

Simulator: the woken replicas run the operator's default vLLM image, played by
llm-d-inference-sim, because the verdict is the activator's hold, wake, forward and overflow, the
route's switch and Argo CD's health, judged on status codes, the server-sent events' framing and
metrics, not on the text; a real vLLM start takes about a minute here, and the switch back to the
InferencePool waits for a second replica Ready.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from kubernetes import client

from e2e.demo import ARTIFACT_BUCKET
from e2e.routeproxy import RouteStandIn, route_backend
from e2e.serviceproxy import open_service_url, service_endpoints
from tests.integration.conftest import ACTIVATOR_QUEUE, ACTIVATOR_UNPUBLISHED

from fewerbits_operator.serving import gatewayroute
from fewerbits_operator.serving.render import Owner
from tests.integration.test_routing import picker_pod_ip
from tests.unit.test_argocd_health import health

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]
# One fp8-dynamic artifact for the routing and scale-from-zero tests: the second is a cache hit.
SHARED_ARTIFACTS = f"s3://{ARTIFACT_BUCKET}/routing-and-scale-from-zero"

DELAY = 6  # scaleDownDelaySeconds: idle this long, then down to zero


def test_a_request_at_zero_replicas_is_held_then_served(cluster, gpu_pool, namespace, models, model_spec, activator,
                                                        inference_gateway):
    assert not ACTIVATOR_UNPUBLISHED, ACTIVATOR_UNPUBLISHED  # the activator must be a Service endpoint
    (node,) = gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    models.apply(namespace, "sleepy", model_spec(
        quantization={"format": "fp8-dynamic"}, storage={"uri": SHARED_ARTIFACTS},
        serving={"routing": "inferencePool", "gateway": {"name": "inference-gw"}},
        autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 2, "scaleDownDelaySeconds": DELAY}))
    models.wait_condition(namespace, "sleepy", "Ready", timeout=600)
    models.wait_condition(namespace, "sleepy", "Deployed", timeout=60)  # the pool and the route: no refusal
    # What reconcile resolved for the route's writer: the Gateway, and the pool usable as its backend.
    assert models.get(namespace, "sleepy")["status"]["route"] == {"gateway": {"name": "inference-gw"},
                                                                  "inferencePool": True}
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
    # The gateway's route at zero: the Service (the InferencePool's picker would answer with an error).
    api = cluster.api_client()
    route = models.wait("the HTTPRoute to the Service at zero", lambda: (r := route_backend(api, namespace, "sleepy"))
                        and r["kind"] == "Service" and r, timeout=30)
    assert route == {"group": "", "kind": "Service", "name": "sleepy", "port": 8000, "weight": 1}
    # As the API server stored it (its CRD's defaults applied), the route is what the operator renders:
    # nothing to write at rest.
    stored = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "gateway.networking.k8s.io", "v1", namespace, "httproutes", "sleepy")
    uid = models.get(namespace, "sleepy")["metadata"]["uid"]
    token = gatewayroute.route_token(stored, uid)  # the route's own, made once (the activator checks it)
    assert token, stored
    desired = gatewayroute.render_http_route(Owner("sleepy", namespace, uid), {"name": "inference-gw"},
                                             gatewayroute.SERVICE, token)
    assert gatewayroute.route_change(desired, stored, uid) == gatewayroute.RouteChange(), (stored, desired)
    pickers: list = []

    def pool_gateway_url() -> str:  # the ext_proc gateway in front of the model's picker, once needed
        if not pickers:
            ip = models.wait("the picker's pod ready", lambda: picker_pod_ip(core, namespace, "sleepy"), timeout=120)
            pickers.append(inference_gateway.front(namespace, ip))
        return pickers[0].gateway_url
    through_gateway = RouteStandIn(api, namespace, "sleepy", pool_gateway_url)

    def metric(name: str, **labels: str) -> float:
        return operator_metric(activator.metrics_port, name, labels)  # the activator's own process

    wakes0, queue0 = metric("fewerbits_activator_wakes_total"), metric("fewerbits_activator_rejected_total", reason="queue")
    holds0 = metric("fewerbits_activator_hold_seconds_count")

    # Requests to the user's URL: one plain, one streamed; both held while one replica starts.
    answers: dict[str, dict] = {}

    def call(kind: str, stream: bool) -> None:
        body = json.dumps({"model": "sleepy", "messages": [{"role": "user", "content": "wake up"}],
                           "max_tokens": 8, "stream": stream}).encode()
        headers = {"Content-Type": "application/json"}
        if kind == "gateway":
            via, r = through_gateway.open("/v1/chat/completions", "POST", body, headers)
        else:
            ep, r = open_service_url(cluster.api_client(), url + "/v1/chat/completions", "POST", body, headers)
            via = ep.source
        out = {"status": r.status, "via": via, "retry_after": r.getheader("Retry-After"),
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
    callers = [threading.Thread(target=call, args=(k, k == "streamed")) for k in ("plain", "streamed", "gateway")]
    for t in callers:
        t.start()
    models.wait("three requests held", lambda: metric("fewerbits_activator_waiting") >= 3, timeout=30)
    # A burst past the bound: ACTIVATOR_QUEUE may wait, the rest get 503 with Retry-After at once.
    burst = [threading.Thread(target=call, args=(f"burst-{i}", False)) for i in range(ACTIVATOR_QUEUE - 1)]
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

    plain, streamed, gateway = answers["plain"], answers["streamed"], answers["gateway"]
    assert plain["status"] == 200 and json.loads(plain["body"])["choices"], plain
    assert plain["via"].startswith("slice:sleepy-activator") and plain["endpoint"], plain  # through the activator
    assert streamed["status"] == 200 and streamed["chunked"] == "chunked", streamed
    assert streamed["events"][-1] == b"data: [DONE]" and len(streamed["events"]) >= 3, streamed
    assert json.loads(streamed["events"][0][5:])["object"] == "chat.completion.chunk"
    # Through the gateway: the route's backend (the Service) reached the activator, which held it.
    assert gateway["status"] == 200 and json.loads(gateway["body"])["choices"], gateway
    assert gateway["via"].startswith("Service:slice:sleepy-activator") and gateway["endpoint"], gateway
    served = [a for k, a in answers.items() if k.startswith("burst-") and a["status"] == 200]
    assert len(served) == ACTIVATOR_QUEUE - 3, answers  # the one that found room was held and answered
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

    route_back_to_the_pool(models, apps, namespace, name, serving, through_gateway, gateway["via"])


def route_back_to_the_pool(models, apps, namespace: str, name: str, serving, through_gateway: RouteStandIn,
                           at_zero_via: str) -> None:
    """The HTTPRoute stays on the Service with one ready pod and returns to the InferencePool once a
    second is Ready; a request through it is then answered through the picker."""
    api = through_gateway.api
    # One ready pod: the route stays on the Service (the activator shares the path of the last pod).
    assert route_backend(api, namespace, "sleepy")["kind"] == "Service"
    # A second replica, as the autoscaler adds one under load (kept: no scale-down within the delay,
    # raised first so the idle simulators do not take it away while the test looks).
    models.patch_spec(namespace, "sleepy", {"autoscaling": {"scaleDownDelaySeconds": 300}})
    models.wait("the longer delay published", lambda: models.get(namespace, "sleepy")["status"]["autoscaling"]
                ["scaleDownDelaySeconds"] == 300, timeout=30)
    apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": 2}})
    models.wait("the HTTPRoute to the InferencePool", lambda: route_backend(api, namespace, "sleepy")["kind"]
                == "InferencePool", timeout=120)
    assert len([p for p in serving() if not p[1] and p[2]]) == 2, serving()  # switched only with two Ready
    via, status, body = through_gateway.chat("sleepy")
    assert (via, status) == ("InferencePool", 200) and body["choices"], (via, status, body)
    print("GATEWAY ROUTE", json.dumps({"at_zero": at_zero_via, "two_ready": via}))


def operator_metric(port: int, name: str, labels: dict[str, str]) -> float:
    """One sample of the operator's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
                return smp.value
    return 0.0
