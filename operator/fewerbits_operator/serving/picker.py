"""The endpoint picker (EPP) the operator deploys for a model with ``spec.serving.routing:
inferencePool``: the pure half (docs/routing.md). observe reads the objects, execute writes them.

The EPP of the Gateway API Inference Extension v1.1.0 serves one InferencePool per process, so each
model gets its own, as the extension's ``inferencepool`` chart deploys it, all named ``<model>-epp``
and owned by the model:

- a ServiceAccount, and a RoleBinding in the model's namespace to the ClusterRole the chart ships
  (``FEWERBITS_EPP_CLUSTER_ROLE``: read pods, InferencePools and InferenceObjectives, upstream's
  Role). The operator holds ``bind`` on that one ClusterRole only, so it can hand out nothing else;
- a ConfigMap with the EndpointPickerConfig (``epp_config``);
- a Deployment running ``FEWERBITS_EPP_IMAGE`` (one replica, Recreate: the picker keeps per-pod
  state), its own metrics endpoint unauthenticated (the token and access reviews that guard it need
  cluster-wide grants a namespaced RoleBinding cannot give);
- a Service on the ext-proc gRPC port, which the InferencePool's ``endpointPickerRef`` names.

Pods without metrics. The EPP v1.1.0 keeps a pod whose scrape fails with zero queue and zero KV
usage, so its scorers rate it the idlest pod and the max-score picker sends it every request; it
has no filter plugin that could leave such pods out of scoring (its in-tree plugins: the queue,
KV-cache, LoRA and prefix scorers, the max-score, random and weighted-random pickers). While any
variant reports ready pods without vLLM metrics (``status.serving[].podsWithoutMetrics``, written
by the autoscaler, which scrapes the same endpoints), the picker therefore runs the
``random-picker`` alone: every ready pod of every variant gets an even share, like the Service,
none is dropped; the scoring profile comes back when every pod reports again. The Deployment's
pod template carries the config's hash, so a change of profile restarts the picker (it reads its
config at start only).
"""

from __future__ import annotations

from typing import Any, Sequence

from fewerbits_operator.base.actions import CreatePickerObject, UpdatePickerObject  # noqa: F401  (the picker's writes)
from fewerbits_operator.base.observed import PickerFacts  # noqa: F401  (what observe reads of the picker)
from fewerbits_operator.serving.render import CONTAINER_SECURITY, LABEL_COMPONENT, MANAGED_BY, POD_SECURITY, Owner, spec_hash

LABEL_PICKER = "fewerbits.io/endpoint-picker"
"""On the picker's objects and pods: the model it picks for. Never the model label: the model's
Service, InferencePool and autoscaler select serving pods by that one."""
ANNOTATION_HASH = "fewerbits.io/spec-hash"
GRPC_PORT = 9002
HEALTH_PORT = 9003
METRICS_PORT = 9090
KV_METRIC = "vllm:kv_cache_usage_perc"
"""vLLM >= 0.10 publishes this name; the EPP v1.1.0 reads vllm:gpu_cache_usage_perc by default."""
CONFIG_FILE = "epp.yaml"
KINDS = ("ServiceAccount", "RoleBinding", "ConfigMap", "Service", "Deployment")

SCORING_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: prefix-cache-scorer
    weight: 1
  - pluginRef: max-score-picker
"""
"""Free KV cache, a short queue and the longest cached prompt prefix, equal weights (the extension's
``inferencepool`` chart's default profile), the best pod wins (ties at random). The prefix scorer
remembers which pod each prompt's blocks went to (blocks of vLLM's ``block_size`` x 4 characters,
read from ``vllm:cache_config_info``) and rates a pod by the share of the prompt's leading blocks it
was sent before: requests sharing a system prompt or a conversation's history reach the pod that
holds its KV cache (docs/routing.md, with the figures of tests/integration/test_prefix_routing.py)."""

ROUND_ROBIN_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
"""
"""Every ready pod alike: while some pods expose no metrics, scoring would send them everything."""


def name_of(model: str) -> str:
    return f"{model}-epp"


def epp_config(unmetered: Sequence[str]) -> str:
    return ROUND_ROBIN_CONFIG if unmetered else SCORING_CONFIG


def unmetered_variants(serving: Sequence[Any]) -> list[str]:
    """Variants whose ready pods the autoscaler found without vLLM metrics at its last pass."""
    return sorted(s.variant for s in serving if (getattr(s, "podsWithoutMetrics", None) or 0) > 0)


def _labels(model: str) -> dict[str, str]:
    return {**MANAGED_BY, "app.kubernetes.io/name": "fewerbits-epp", LABEL_COMPONENT: "endpoint-picker",
            LABEL_PICKER: model}


def _meta(owner: Owner, body: Any) -> dict[str, Any]:
    return {"name": name_of(owner.name), "namespace": owner.namespace, "labels": _labels(owner.name),
            "annotations": {ANNOTATION_HASH: spec_hash(body)}, "ownerReferences": [owner.reference()]}


def picker_args(owner: Owner) -> list[str]:
    return ["--pool-name", owner.name, "--pool-namespace", owner.namespace,
            "--pool-group", "inference.networking.k8s.io",
            "--config-file", f"/config/{CONFIG_FILE}",
            "--kv-cache-usage-percentage-metric", KV_METRIC,
            "--grpc-port", str(GRPC_PORT), "--grpc-health-port", str(HEALTH_PORT),
            "--metrics-port", str(METRICS_PORT),
            "--metrics-endpoint-auth=false", "--tracing=false", "--enable-pprof=false"]


def render_picker(owner: Owner, image: str, cluster_role: str, config: str) -> dict[str, dict[str, Any]]:
    """The picker's five objects, by kind."""
    name = name_of(owner.name)
    selector = {LABEL_PICKER: owner.name, LABEL_COMPONENT: "endpoint-picker"}
    binding = {"roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]}
    data = {CONFIG_FILE: config}
    service_spec = {"selector": selector, "ports": [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT, "protocol": "TCP", "appProtocol": "http2"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT, "protocol": "TCP"}]}
    pod_spec = {
        "serviceAccountName": name,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {k: v for k, v in POD_SECURITY.items() if k != "fsGroup"},
        "containers": [{
            "name": "epp",
            "image": image,
            "args": picker_args(owner),
            "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
            "ports": [{"name": "grpc", "containerPort": GRPC_PORT}, {"name": "grpc-health", "containerPort": HEALTH_PORT},
                      {"name": "metrics", "containerPort": METRICS_PORT}],
            "readinessProbe": {"grpc": {"port": HEALTH_PORT, "service": "inference-extension"}, "periodSeconds": 2},
            "livenessProbe": {"grpc": {"port": HEALTH_PORT, "service": "inference-extension"},
                              "initialDelaySeconds": 5, "periodSeconds": 10},
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
            "securityContext": dict(CONTAINER_SECURITY),
            "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}],
        }],
        "volumes": [{"name": "config", "configMap": {"name": name}}],
    }
    deployment_spec = {
        "replicas": 1,
        "strategy": {"type": "Recreate"},
        "selector": {"matchLabels": selector},
        # The config's hash in the template: the picker reads its config at start only.
        "template": {"metadata": {"labels": _labels(owner.name), "annotations": {ANNOTATION_HASH: spec_hash(data)}},
                     "spec": pod_spec},
    }
    return {
        "ServiceAccount": {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(owner, name),
                           "automountServiceAccountToken": True},
        "RoleBinding": {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                        "metadata": _meta(owner, binding), **binding},
        "ConfigMap": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(owner, data), "data": data},
        "Service": {"apiVersion": "v1", "kind": "Service", "metadata": _meta(owner, service_spec), "spec": service_spec},
        "Deployment": {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(owner, deployment_spec),
                       "spec": deployment_spec},
    }


def picker_actions(facts: PickerFacts | None, owner: Owner, image: str, cluster_role: str,
                   unmetered: Sequence[str]) -> tuple[list[CreatePickerObject | UpdatePickerObject], str | None]:
    """Create the missing objects, rewrite the ones whose rendered form changed (the hash annotation
    says so: a hand edit that left it is not chased, as with the serving Deployments). Returns the
    actions and, when an object of the picker's name belongs to someone else, a message (that
    object is never written; the rest are)."""
    if facts is None:
        return [], None
    desired = render_picker(owner, image, cluster_role, epp_config(unmetered))
    actions: list[CreatePickerObject | UpdatePickerObject] = []
    foreign = []
    for kind in KINDS:
        want, cur = desired[kind], facts.objects.get(kind)
        if cur is None:
            actions.append(CreatePickerObject(want))
            continue
        md = cur.get("metadata") or {}
        if not any(r.get("uid") == owner.uid for r in md.get("ownerReferences") or []):
            foreign.append(f"{kind} {owner.namespace}/{name_of(owner.name)}")
            continue
        if (md.get("annotations") or {}).get(ANNOTATION_HASH) == want["metadata"]["annotations"][ANNOTATION_HASH]:
            continue
        if kind == "RoleBinding" and (cur.get("roleRef") or {}) != want["roleRef"]:
            continue  # roleRef is immutable; a changed ClusterRole name needs the binding recreated by hand
        actions.append(UpdatePickerObject({**want, "metadata": {**want["metadata"],
                                                                "resourceVersion": md.get("resourceVersion")}}))
    problem = None
    if foreign:
        problem = (f"the endpoint picker's {', '.join(foreign)} exist(s) and are not owned by this QuantizedModel; "
                   "left untouched: remove them or rename the model")
    return actions, problem


def leftover(facts: PickerFacts | None, owner: Owner) -> tuple[str, str] | None:
    """(namespace, name) of the picker's Deployment when the model no longer routes through an
    InferencePool and still owns one: it goes (the ServiceAccount, RoleBinding, ConfigMap and
    Service, inert without it, stay until the model is deleted)."""
    dep = facts.objects.get("Deployment") if facts is not None else None
    if dep is None:
        return None
    md = dep.get("metadata") or {}
    if md.get("name") != name_of(owner.name) or (md.get("labels") or {}).get(LABEL_PICKER) != owner.name:
        return None
    if not any(r.get("uid") == owner.uid for r in md.get("ownerReferences") or []):
        return None
    return owner.namespace, name_of(owner.name)
