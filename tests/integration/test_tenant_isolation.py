"""Tenants kept apart by the activator, on the real control plane (docs/routing.md, "Tenants kept
apart"): a model in namespace B at zero replicas, reached through its own Service and its HTTPRoute
(the gateway), and a client in namespace A that tries every header and Host it can choose, plain and
`stream: true`: A gets the same 404 each time, the same as for a model that does not exist, nothing
is woken, and B's own Service path and route path are then held and answered.

The activator under test is started here as the chart starts it (`python -m
fewerbits_operator.runtime.activator_main` with `FEWERBITS_ACTIVATOR_TENANT_PORTS`, one port for A
and one for B), and its tenant ports are published on the activator's Service as the chart's
Service names them (`atzero.tenant_port_name`), an EndpointSlice added beside the session's: the
session's operator, which knows nothing of this test, then points B's Service at zero at B's port,
found by that name, and keeps B's route with its token. The session's own activator, started without
tenant ports (no tenant kept apart, like `activator.tenantPorts.enabled: false`), is left out of it.

What this proves and what it cannot: the harness enforces no NetworkPolicy (there is no network
plugin, every pod is a local process), so nothing stops A's client from connecting to B's tenant
port, which on a cluster the chart's NetworkPolicy refuses (`tests/unit/test_chart_networkpolicy.py`
checks that policy as rendered). The test proves the activator's own check: through A's port and
the main port, the only ones the policy lets A reach, no Host and no model header (bare, with a
made-up token) gets an answer from B's model; only B's route's token, which only readers of B's
route know, or B's port does. `e2e/serviceproxy.py` plays DNS + kube-proxy and `e2e/routeproxy.py`
the gateway controller (no Envoy here), as in test_scale_from_zero.py.

Simulator: the woken replica runs the operator's default vLLM image, played by llm-d-inference-sim,
because the verdict is who gets an answer (status codes, the 404's body, the wake counted, the
events' framing), never what the model says.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid

import pytest
from kubernetes import client

from e2e.addons.epp import crd_files
from e2e.routeproxy import RouteStandIn, route_backend
from e2e.serviceproxy import host_address, open_service_url, service_endpoints
from fewerbits_operator.runtime.activator import NOT_SERVED
from fewerbits_operator.runtime.atzero import tenant_port_name
from tests.integration.conftest import ACTIVATOR_NAMESPACE, ACTIVATOR_SERVICE, ACTIVATOR_UNPUBLISHED
from tests.integration.operator_harness import OperatorProcess, free_port
from tests.integration.test_scale_from_zero import SHARED_ARTIFACTS, operator_metric

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

MODEL = "tenant-b"


HTTP_ROUTE_CRD = "httproutes.gateway.networking.k8s.io"


@pytest.fixture
def http_route_crd(cluster):
    """Gateway API's HTTPRoute CRD (standard channel, from its module as e2e/addons/epp.py installs
    it), alone: this test needs no InferencePool and no picker."""
    (f,) = [f for f in crd_files() if f.name.startswith("gateway.networking.k8s.io_httproutes")]
    cluster.kubectl("apply", "--server-side", "-f", str(f))
    ext = client.ApiextensionsV1Api(cluster.api_client())
    deadline = time.monotonic() + 60
    while not any(c.type == "Established" and c.status == "True"
                  for c in ext.read_custom_resource_definition(HTTP_ROUTE_CRD).status.conditions or []):
        assert time.monotonic() < deadline, f"CRD {HTTP_ROUTE_CRD} not established after 60s"
        time.sleep(0.2)


@pytest.fixture
def namespace_a(cluster):
    """Tenant A: a `t-` namespace (watched by the session's operator), without a model of its own."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(cluster.api_client())
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture
def tenant_activator(cluster, operator, activator, namespace_a, namespace, tmp_path):
    """An activator with a tenant port for A and one for B, published on the activator's Service
    by port name beside the session's activator (an EndpointSlice of its own, removed after)."""
    assert not ACTIVATOR_UNPUBLISHED, ACTIVATOR_UNPUBLISHED  # the activator must be a Service endpoint
    ports = {namespace_a: free_port(), namespace: free_port()}
    act = OperatorProcess.activator(cluster.kubeconfig, tmp_path / "tenant-activator.log", free_port(),
                                    {"FEWERBITS_ACTIVATOR_TENANT_PORTS": json.dumps(ports)}).start()
    disc = client.DiscoveryV1Api(cluster.api_client())
    name = f"{ACTIVATOR_SERVICE}-tenants-{namespace[-8:]}"
    try:
        act.wait_serving()
        disc.create_namespaced_endpoint_slice(ACTIVATOR_NAMESPACE, {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": ACTIVATOR_SERVICE}},
            "addressType": "IPv4",
            "ports": [{"name": tenant_port_name(ns), "port": p, "protocol": "TCP"} for ns, p in ports.items()],
            "endpoints": [{"addresses": [host_address()], "conditions": {"ready": True}}]})
        act.tenant_ports = ports
        yield act
    finally:
        try:
            disc.delete_namespaced_endpoint_slice(name, ACTIVATOR_NAMESPACE)
        except client.ApiException as e:
            if e.status != 404:
                raise
        act.stop()


def chat(stream: bool, model: str = MODEL) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "stream": stream}).encode()


def answer(r: http.client.HTTPResponse, stream: bool) -> dict:
    out = {"status": r.status, "endpoint": r.getheader("X-Fewerbits-Endpoint"),
           "chunked": r.getheader("Transfer-Encoding")}
    if stream and r.status == 200:
        out["events"] = [ln.strip() for ln in iter(r.readline, b"") if ln.startswith(b"data:")]
    else:
        out["body"] = r.read()
    return out


def direct(port: int, headers: dict[str, str], stream: bool) -> dict:
    """A client's request straight to the activator's port (what a pod of A can connect to)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", chat(stream), {"Content-Type": "application/json", **headers})
    return answer(conn.getresponse(), stream)


def test_a_client_of_another_namespace_gets_no_answer_from_a_model_at_zero(
        cluster, gpu_pool, namespace, namespace_a, models, model_spec, tenant_activator, http_route_crd):
    b, a = namespace, namespace_a
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    models.apply(b, MODEL, model_spec(
        quantization={"format": "fp8-dynamic"}, storage={"uri": SHARED_ARTIFACTS},
        serving={"gateway": {"name": "inference-gw"}},  # routing: service: the route's backend is the Service
        autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 1, "scaleDownDelaySeconds": 300}))
    models.wait_condition(b, MODEL, "Ready", timeout=600)
    models.wait_condition(b, MODEL, "Deployed", timeout=60)
    api = cluster.api_client()
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    (dep,) = models.deployments(b, MODEL)
    apps.patch_namespaced_deployment_scale(dep.metadata.name, b, {"spec": {"replicas": 0}})  # at zero
    models.wait("no serving pod", lambda: not core.list_namespaced_pod(
        b, label_selector=f"fewerbits.io/model={MODEL},app.kubernetes.io/component=server").items, timeout=60)
    port_a, port_b = tenant_activator.tenant_ports[a], tenant_activator.tenant_ports[b]
    # At zero B's Service lists the activator only, on B's tenant port (found on the activator's Service by name).
    eps = models.wait("B's Service at B's tenant port", lambda: (e := service_endpoints(api, b, MODEL, 8000)) and all(
        x.source.startswith(f"slice:{MODEL}-activator") and x.port == port_b for x in e) and e, timeout=30)
    assert eps
    models.wait("the route to the Service", lambda: (r := route_backend(api, b, MODEL)) and r["kind"] == "Service",
                timeout=60)
    stored = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "gateway.networking.k8s.io", "v1", b, "httproutes", MODEL)
    (h,) = stored["spec"]["rules"][0]["filters"][0]["requestHeaderModifier"]["set"]
    assert h["name"] == "X-Fewerbits-Model" and h["value"].startswith(f"{b}/{MODEL}; token=")

    # A's client, through A's port and the main port, naming B's model every way it can choose.
    b_host = {"Host": f"{MODEL}.{b}.svc:8000"}
    attempts = {
        "A's port, B's Host": (port_a, b_host),
        "A's port, B's Host in full": (port_a, {"Host": f"{MODEL}.{b}.svc.cluster.local"}),
        "main port, B's Host": (tenant_activator.activator_port, b_host),
        "A's port, the bare model header": (port_a, {"X-Fewerbits-Model": f"{b}/{MODEL}"}),
        "main port, the bare model header": (tenant_activator.activator_port, {"X-Fewerbits-Model": f"{b}/{MODEL}"}),
        "main port, a made-up token": (tenant_activator.activator_port,
                                       {"X-Fewerbits-Model": f"{b}/{MODEL}; token={'x' * 43}"}),
        "A's port, a made-up token and B's Host": (port_a, {**b_host,
                                                            "X-Fewerbits-Model": f"{b}/{MODEL}; token={'y' * 43}"}),
        "A's port, a model that does not exist": (port_a, {"Host": f"ghost.{b}.svc:8000"}),
        "main port, a model that does not exist": (tenant_activator.activator_port,
                                                   {"X-Fewerbits-Model": f"{b}/ghost; token={'x' * 43}"}),
    }
    refused = {(what, stream): direct(port, headers, stream)
               for what, (port, headers) in attempts.items() for stream in (False, True)}
    assert {r["status"] for r in refused.values()} == {404}, refused
    assert {r["body"] for r in refused.values()} == {json.dumps(
        {"error": {"message": NOT_SERVED, "type": "fewerbits_activator", "code": 404}}).encode()}, refused
    assert not any(r["endpoint"] for r in refused.values())  # never forwarded
    # Nothing was woken by them: the model is still at zero and the activator asked for nothing.
    assert (apps.read_namespaced_deployment_scale(dep.metadata.name, b).spec.replicas or 0) == 0
    assert operator_metric(tenant_activator.metrics_port, "fewerbits_activator_wakes_total", {}) == 0
    assert not any(e.reason == "ScaledFromZero" for e in models.events(b, MODEL))

    # B's own paths at zero: its Service (plain and streamed) and its route through the gateway, held and answered.
    through_gateway = RouteStandIn(api, b, MODEL, lambda: pytest.fail("routing: service has no InferencePool"))
    answers: dict[str, dict] = {}

    def call(kind: str, stream: bool) -> None:
        headers = {"Content-Type": "application/json"}
        if kind.startswith("route"):
            via, r = through_gateway.open("/v1/chat/completions", "POST", chat(stream), headers)
        else:
            ep, r = open_service_url(api, f"http://{MODEL}.{b}.svc:8000/v1/chat/completions", "POST", chat(stream),
                                     headers)
            via = ep.source
        answers[kind] = {**answer(r, stream), "via": via}

    callers = [threading.Thread(target=call, args=(k, k.endswith("streamed")))
               for k in ("service plain", "service streamed", "route streamed")]
    for t in callers:
        t.start()
    for t in callers:
        t.join(300)
    for kind, out in answers.items():
        assert out["status"] == 200 and out["endpoint"], (kind, out)
        assert f"slice:{MODEL}-activator" in out["via"], (kind, out)  # through the activator, on B's port
    assert set(answers) == {"service plain", "service streamed", "route streamed"}
    assert json.loads(answers["service plain"]["body"])["choices"]
    for kind in ("service streamed", "route streamed"):
        assert answers[kind]["chunked"] == "chunked" and answers[kind]["events"][-1] == b"data: [DONE]", answers[kind]
    assert operator_metric(tenant_activator.metrics_port, "fewerbits_activator_wakes_total", {}) == 1
    # And now that B's model runs, A is still refused the same way.
    assert direct(port_a, b_host, True)["status"] == direct(tenant_activator.activator_port, b_host, False)["status"] \
        == 404
    print("TENANTS", json.dumps({"refused": len(refused), "served": sorted(answers)}))
