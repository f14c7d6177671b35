"""KV-aware routing with real parts: a model served on two GPU pools (H100 and L4, one
llm-d-inference-sim pod each, played by the pod runner), `spec.serving.routing: inferencePool`, the
Gateway API Inference Extension's endpoint picker (EPP, built from its Go module) picking for the
InferencePool the operator keeps, and requests sent through a gateway that speaks Envoy's ext_proc
protocol to it (e2e/gateway; no Envoy binary can be fetched here). The picker is the one the
operator deploys for the model (picker.py: Deployment, Service, ConfigMap, ServiceAccount bound to
the chart's pickers' ClusterRole, `fewerbits-e2e-epp` here), run by the pod runner from its image rule with its own
ServiceAccount's token, so the chart's role is what it reads the pool and pods with.

One model, in order: without the InferencePool CRD the option is refused on the model while the
Service serves; once the CRD is installed the operator creates the pool; a pool of another model's
name that it does not own is a conflict, left untouched; the EPP sends requests to the less loaded
pod; under a load whose per-pod queue follows what each pool received and drains at the pool's
speed, the slow pool gets a smaller share than the Service's even split; a pod that exposes no
metrics is still routed to, never dropped: the autoscaler finds it, the model says
`MetricsUnavailable`, and the operator turns the picker to an even spread (step 6).

Simulator: one llm-d-inference-sim pod per pool (the operator's default vLLM image), because the
picker's choice depends on each pod's KV usage and waiting requests, which the test must set per pod
(`POST /admin/config` fake metrics) to judge the share each pool gets; the simulator's
real-metrics mode cannot be given different speeds per pool here, so the queue model that turns
"requests received" into "KV usage and waiting requests" is in this test (`QueueModel`), and the
EPP reads it from the pods' /metrics like it reads vLLM's.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field

import pytest
from kubernetes import client

from e2e.addons.epp import PICKER_ROLE, install_crds
from e2e.demo import ARTIFACT_BUCKET

from e2e.tests.test_harness import wait_for
from fewerbits_operator.serving import picker as epp

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]
# One fp8-dynamic artifact for the routing and scale-from-zero tests: the second is a cache hit.
SHARED_ARTIFACTS = f"s3://{ARTIFACT_BUCKET}/routing-and-scale-from-zero"

IP_GROUP = "inference.networking.k8s.io"
H100_SPEED, L4_SPEED = 0.9, 0.3
"""Requests each pool's pod finishes per arrival (H100 three times the L4): together 1.2 per arrival."""


def pods_by_pool(core: client.CoreV1Api, namespace: str, model: str) -> dict[str, client.V1Pod]:
    pods = core.list_namespaced_pod(namespace, label_selector=f"fewerbits.io/model={model}").items
    # Variants are named after their pool (e.g. `h100-80gb-hbm3-x8`, `l4-x1`): keyed by GPU here.
    return {p.metadata.labels["fewerbits.io/variant"].split("-", 1)[0]: p for p in pods
            if p.status.pod_ip and not p.metadata.deletion_timestamp
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])}


def report(pod_ip: str, kv: float, waiting: int) -> None:
    body = json.dumps({"fake-metrics": {"kv-cache-usage": kv, "waiting-requests": waiting,
                                        "running-requests": 0}}).encode()
    req = urllib.request.Request(f"http://{pod_ip}:8000/admin/config", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5):
        pass


def wait_until(what: str, check, timeout: float = 60):
    return wait_for(what, check, timeout=timeout, interval=0.05)


@dataclass
class QueueModel:
    """Each pod's backlog: +1 for each request it is sent, minus its speed per arrival. It reports
    waiting = the whole backlog and KV usage = backlog / 10 (capped at 0.99)."""

    speed: dict[str, float]
    backlog: dict[str, float] = field(default_factory=dict)

    def arrive(self, pool: str | None) -> None:
        for p, s in self.speed.items():
            self.backlog[p] = max(0.0, self.backlog.get(p, 0.0) + (1.0 if p == pool else 0.0) - s)

    def waiting(self, pool: str) -> int:
        return int(self.backlog.get(pool, 0.0))

    def kv(self, pool: str) -> float:
        return min(0.99, self.waiting(pool) / 10)


def test_inference_pool_routing_follows_kv_and_queue(request, cluster, gpu_pool, namespace, models, model_spec):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    gpu_pool("l4", "NVIDIA-L4")
    api = cluster.api_client()
    ext = client.ApiextensionsV1Api(api)
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    crd = "inferencepools.inference.networking.k8s.io"
    if any(c.metadata.name == crd for c in ext.list_custom_resource_definition().items):
        ext.delete_custom_resource_definition(crd)  # an earlier test installed it: this part needs it absent
        wait_until("the CRD gone", lambda: crd not in [c.metadata.name for c in ext.list_custom_resource_definition().items])

    # 1. Without the CRD: refused on the model, served through the Service all the same.
    spec = model_spec(quantization={"format": "fp8-dynamic"}, serving={"maxModelLen": 256, "routing": "inferencePool"},
                      storage={"uri": SHARED_ARTIFACTS},
                      # The autoscaler reads every serving pod's metrics (step 6) but never scales: 1..1.
                      autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 1})
    models.apply(namespace, "routed", spec)
    models.wait_condition(namespace, "routed", "Ready", timeout=600)
    deployed = models.wait_condition(namespace, "routed", "Deployed", status="False", timeout=60)
    assert deployed["reason"] == "RoutingUnavailable", deployed
    assert "spec.serving.routing" in deployed["message"] and crd in deployed["message"]
    # Served through the Service only: each variant scales on its own load.
    assert models.get(namespace, "routed")["status"]["autoscaling"]["placement"] == "perVariant"

    # 2. The CRD installed (the add-on starts here): the operator notices and creates the pool.
    gateway = request.getfixturevalue("inference_gateway")
    install_crds(cluster)  # the session's add-on may predate step 1's deletion (another test started it)
    models.wait_condition(namespace, "routed", "Deployed", timeout=60)
    pool = custom.get_namespaced_custom_object(IP_GROUP, "v1", namespace, "inferencepools", "routed")
    assert pool["spec"]["selector"]["matchLabels"] == {"fewerbits.io/model": "routed",
                                                       "app.kubernetes.io/component": "server"}
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "QuantizedModel"
    # Routing now follows capacity: the autoscaler places extra replicas on the cheapest pool per token.
    models.wait("placement cheapestPool", lambda: models.get(namespace, "routed")["status"]["autoscaling"]
                ["placement"] == "cheapestPool", timeout=30)

    # 3. Someone else's InferencePool with a model's name: a conflict, never overwritten.
    foreign = {"apiVersion": f"{IP_GROUP}/v1", "kind": "InferencePool", "metadata": {"name": "other"},
               "spec": {"selector": {"matchLabels": {"app": "theirs"}}, "targetPorts": [{"number": 1234}],
                        "endpointPickerRef": {"name": "their-epp", "port": {"number": 9002}}}}
    custom.create_namespaced_custom_object(IP_GROUP, "v1", namespace, "inferencepools", foreign)
    models.apply(namespace, "other", spec)  # same artifact: a cache hit
    conflict = models.wait_condition(namespace, "other", "Deployed", status="False", timeout=300)
    models.wait("the conflict reported", lambda: models.condition(namespace, "other", "Deployed")["reason"]
                == "InferencePoolConflict", timeout=120)
    still = custom.get_namespaced_custom_object(IP_GROUP, "v1", namespace, "inferencepools", "other")
    assert still["spec"]["targetPorts"] == [{"number": 1234}] and not still["metadata"].get("ownerReferences"), conflict

    # 4. The operator's EPP for the model's pool, and a gateway in front of it.
    apps, rbac = client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    binding = wait_until("the picker's RoleBinding", lambda: _get(rbac.read_namespaced_role_binding, "routed-epp",
                                                                 namespace), timeout=60)
    assert binding.role_ref.name == PICKER_ROLE and binding.role_ref.kind == "ClusterRole"
    assert [(s.kind, s.name) for s in binding.subjects] == [("ServiceAccount", "routed-epp")]
    assert pool["spec"]["endpointPickerRef"]["name"] == core.read_namespaced_service("routed-epp", namespace).metadata.name
    picker_ip = wait_until("the picker's pod ready", lambda: picker_pod_ip(core, namespace, "routed"), timeout=120)
    picker = gateway.front(namespace, picker_ip)
    pods = pods_by_pool(core, namespace, "routed")
    assert set(pods) == {"h100", "l4"}, pods
    ip_pool = {p.status.pod_ip: pool for pool, p in pods.items()}
    names = {pool: p.metadata.name for pool, p in pods.items()}

    def shown(load: dict[str, int]) -> bool:
        seen = picker.queue_sizes()
        return all(seen.get(names[p]) == q for p, q in load.items())

    def set_load(kv: dict[str, float], waiting: dict[str, int]) -> None:
        for p, pod in pods.items():
            report(pod.status.pod_ip, kv[p], waiting[p])
        wait_until(f"the EPP to read queues {waiting}", lambda: shown(waiting), timeout=30)

    # The L4 pod is busy (KV 0.9, 8 waiting), the H100 pod is not: every request goes to the H100.
    set_load({"h100": 0.2, "l4": 0.9}, {"h100": 0, "l4": 8})
    picks = []
    for _ in range(20):
        status, endpoint, body = picker.chat("routed")
        assert status == 200, (status, body, picker.log_text()[-2000:])
        picks.append(ip_pool[endpoint.rsplit(":", 1)[0]])
    assert picks.count("h100") == 20, picks
    # And the other way round.
    set_load({"h100": 0.9, "l4": 0.1}, {"h100": 8, "l4": 0})
    assert {ip_pool[picker.chat("routed")[1].rsplit(":", 1)[0]] for _ in range(10)} == {"l4"}

    # 5. Under load: each pod's queue follows what it was sent, drained at its pool's speed.
    n = 120
    routed = QueueModel({"h100": H100_SPEED, "l4": L4_SPEED})
    set_load({p: 0.0 for p in pods}, {p: 0 for p in pods})
    sent = {"h100": 0, "l4": 0}
    for _ in range(n):
        status, endpoint, _ = picker.chat("routed")
        assert status == 200
        pool_name = ip_pool[endpoint.rsplit(":", 1)[0]]
        sent[pool_name] += 1
        routed.arrive(pool_name)
        set_load({p: routed.kv(p) for p in pods}, {p: routed.waiting(p) for p in pods})
    # The Service's split: kube-proxy spreads connections evenly over the pods, one per pool here.
    even = QueueModel({"h100": H100_SPEED, "l4": L4_SPEED})
    for i in range(n):
        even.arrive("h100" if i % 2 == 0 else "l4")
    share = {p: sent[p] / n for p in sent}
    figures = {"requests": n, "epp_share": share, "service_share": {"h100": 0.5, "l4": 0.5},
               "epp_backlog_at_end": {p: routed.waiting(p) for p in pods},
               "service_backlog_at_end": {p: even.waiting(p) for p in pods}}
    print("ROUTING FIGURES", json.dumps(figures))
    assert share["l4"] < 0.4 and share["h100"] > share["l4"], figures
    assert share["l4"] > 0, f"the slow pool is never starved: {figures}"
    assert even.waiting("l4") > 10 * max(1, routed.waiting("l4")), figures  # the even split saturates the L4

    # 6. A pod whose server exposes no metrics (an old image) in the L4 variant: never dropped. The
    # autoscaler finds it, the model says MetricsUnavailable, and the operator turns its picker to
    # an even spread (with scoring, v1.1.0 would take the pod for idle and send it everything).
    set_load({p: 0.5 for p in pods}, {p: 3 for p in pods})
    bare = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "no-metrics", "labels": {
                "fewerbits.io/model": "routed", "app.kubernetes.io/component": "server",
                "fewerbits.io/variant": pods["l4"].metadata.labels["fewerbits.io/variant"]}},
            "spec": {"containers": [{
                "name": "server", "image": "fewerbits-test/python",
                "env": [{"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                "command": ["python", "-m", "http.server", "8000", "--bind", "$(MY_IP)"],
                "ports": [{"containerPort": 8000, "name": "http"}],
                "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1}}],
                "tolerations": [{"operator": "Exists"}]}}
    core.create_namespaced_pod(namespace, bare)
    bare_ip = wait_until("the bare pod ready", lambda: (p := core.read_namespaced_pod("no-metrics", namespace)).status.pod_ip
                         and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
                         and p.status.pod_ip, timeout=120)
    models.wait("Deployed says MetricsUnavailable", lambda: models.condition(namespace, "routed", "Deployed")["reason"]
                == "MetricsUnavailable", timeout=60)
    assert "l4" in models.condition(namespace, "routed", "Deployed")["message"]
    # The event is posted after the status write that carries the condition: wait for it.
    wait_until("a MetricsUnavailable Warning event", lambda: any(
        e.reason == "MetricsUnavailable" and e.type == "Warning" for e in models.events(namespace, "routed")),
        timeout=30)
    wait_until("the picker's config turned to an even spread", lambda: "random-picker" in
               core.read_namespaced_config_map("routed-epp", namespace).data[epp.CONFIG_FILE], timeout=30)
    new_ip = wait_until("the picker restarted with it", lambda: (ip := picker_pod_ip(core, namespace, "routed",
                                                                                    not_ip=picker_ip)) and ip, timeout=120)
    even_picker = gateway.front(namespace, new_ip)
    wait_until("the new picker to list the three pods", lambda: len(even_picker.queue_sizes()) == 3, timeout=30)
    hits = []
    for _ in range(30):
        status, endpoint, body = even_picker.chat("routed")
        hits.append(endpoint.rsplit(":", 1)[0])
    share = {"bare": hits.count(bare_ip) / len(hits),
             **{p: hits.count(pod.status.pod_ip) / len(hits) for p, pod in pods.items()}}
    print("NO-METRICS POD SHARE (even spread)", json.dumps(share))
    # Every pod is routed to (the bare one answers with http.server's 501 for a POST: routed, not
    # dropped); none takes everything.
    assert all(v > 0 for v in share.values()) and max(share.values()) < 0.7, (share, hits)

    # Its pods report again (the pod goes): the model and the picker's profile come back.
    core.delete_namespaced_pod("no-metrics", namespace, grace_period_seconds=0)
    models.wait("Deployed back to DeploymentsCreated", lambda: models.condition(namespace, "routed", "Deployed")
                ["reason"] == "DeploymentsCreated", timeout=60)
    wait_until("the picker's scoring profile back", lambda: "kv-cache-utilization-scorer" in
               core.read_namespaced_config_map("routed-epp", namespace).data[epp.CONFIG_FILE], timeout=30)

    # 7. Capacity-aware placement in the operator's autoscaler loop: both pools at KV 0.9 (target
    # 0.7) each want 2 replicas on their own; the model's extra capacity goes to the H100 pool, the
    # cheaper per token (equal cost weights, the plan's higher throughput per GPU), the L4 stays.
    deps = {d.metadata.labels["fewerbits.io/variant"].split("-", 1)[0]: d.metadata.name
            for d in models.deployments(namespace, "routed")}
    models.patch_spec(namespace, "routed", {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3}})
    models.wait("maxReplicas 3 published", lambda: models.get(namespace, "routed")["status"]["autoscaling"]
                ["maxReplicas"] == 3, timeout=30)
    for pod in pods.values():
        report(pod.status.pod_ip, 0.9, 0)

    def scale(pool: str) -> int:
        return apps.read_namespaced_deployment_scale(deps[pool], namespace).spec.replicas

    wait_until("the H100 pool scaled for both", lambda: scale("h100") == 3, timeout=60)
    assert scale("l4") == 1
    # The autoscaler writes the scale before it posts its event: wait for the event, then there is one.
    (up,) = wait_until("the ScaledUp event", lambda: [e for e in models.events(namespace, "routed")
                                                      if e.reason == "ScaledUp"], timeout=30)
    assert "capacity-aware" in up.message and deps["h100"] in up.message, up.message

    # 8. Back to the Service: placement per variant again, and the picker's Deployment goes.
    models.patch_spec(namespace, "routed", {"serving": {"maxModelLen": 256, "routing": "service"}})
    models.wait("placement perVariant", lambda: models.get(namespace, "routed")["status"]["autoscaling"]
                ["placement"] == "perVariant", timeout=30)
    wait_until("the picker's Deployment gone", lambda: not apps.list_namespaced_deployment(
        namespace, label_selector=f"{epp.LABEL_PICKER}=routed").items, timeout=30)


def _get(read, name: str, namespace: str):
    try:
        return read(name, namespace)
    except client.exceptions.ApiException as e:
        if e.status == 404:
            return None
        raise


def picker_pod_ip(core: client.CoreV1Api, namespace: str, model: str, not_ip: str | None = None) -> str | None:
    """The IP of the operator's ready picker pod for the model (its label, never the model label)."""
    for p in core.list_namespaced_pod(namespace, label_selector=f"{epp.LABEL_PICKER}={model}").items:
        ready = any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        if ready and p.status.pod_ip and p.status.pod_ip != not_ip and not p.metadata.deletion_timestamp:
            return p.status.pod_ip
    return None
