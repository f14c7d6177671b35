"""The chart, installed with the real Helm into the real control plane, takes a sample to Ready.

The operator's pod is run by the pod runner as `python -m fewerbits_operator` with a token of the
chart's ServiceAccount (TokenRequest, bound to the pod): it has exactly the chart's RBAC, so a
missing rule shows up here as a model that never gets Ready. Along the way the Argo CD health check
(Lua) runs against the live status objects, and the objects are saved for the Lua fixtures when
FEWERBITS_CAPTURE_STATUS names a folder.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from e2e import demo

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]


def lua_health(obj: dict) -> tuple[str, str]:
    from tests.unit.test_argocd_health import health

    return health(obj)


VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")
SUBRESOURCES = {  # (group, resource): subresources worth asking about (the rest are covered by their parent)
    ("fewerbits.io", "quantizedmodels"): ("status", "finalizers"),
    ("fewerbits.io", "quantizationpolicies"): ("status",),
    ("apps", "deployments"): ("scale", "status"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): ("scale", "status"),
    ("batch", "jobs"): ("status",),
    ("", "pods"): ("exec", "log", "attach", "portforward", "eviction", "ephemeralcontainers"),
    ("", "serviceaccounts"): ("token",),
    ("", "services"): ("proxy",),
    ("", "nodes"): ("proxy", "status"),
}
NAMESPACED = {  # in the watched namespace only (a Role there)
    ("fewerbits.io", "quantizedmodels", ""): {"get", "list", "watch"},
    ("fewerbits.io", "quantizedmodels", "status"): {"patch"},
    ("fewerbits.io", "quantizedmodels", "finalizers"): {"update"},
    ("", "secrets", ""): {"get"},
    ("batch", "jobs", ""): {"get", "list", "watch", "create", "patch", "delete"},  # delete: the canary's evaluation Job
    ("", "pods", ""): {"list", "watch"},
    ("apps", "deployments", ""): {"list", "watch", "create", "update", "delete"},
    # The autoscaler's writes; the wake from zero (update) is the activator's, under its own account.
    ("apps", "deployments", "scale"): {"get", "patch"},
    # The model's Service at zero (atzero.py): one extra EndpointSlice to the activator per model.
    ("discovery.k8s.io", "endpointslices", ""): {"list", "watch", "create", "update", "delete"},
    # Asked only where the LeaderWorkerSet CRD is installed (discovery lists it): see the comparison.
    ("leaderworkerset.x-k8s.io", "leaderworkersets", ""): {"list", "watch", "create", "update", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "scale"): {"get", "patch"},
    ("", "services", ""): {"get", "list", "watch", "create", "patch"},
    ("", "events", ""): {"create"},
    ("inference.networking.k8s.io", "inferencepools", ""): {"get", "create", "patch"},
    # spec.serving.gateway: the model's HTTPRoute, read by name, created, replaced when its backend
    # switches (runtime/atzero.py); never listed, watched or deleted.
    ("gateway.networking.k8s.io", "httproutes", ""): {"get", "create", "update"},
    # Each inferencePool model's endpoint picker (picker.py), and the node cache's references ConfigMap
    # (created under the same grant; update and delete by its name only, asked for below); `bind` is
    # asked for separately below.
    ("", "serviceaccounts", ""): {"get", "create"},
    ("", "configmaps", ""): {"get", "create", "patch"},
    ("rbac.authorization.k8s.io", "rolebindings", ""): {"get", "create", "patch"},
}
CLUSTER = {  # cluster-scoped (ClusterRole "-cluster-reads"), so allowed in every namespace and cluster-wide
    ("fewerbits.io", "quantizationpolicies", ""): {"list", "watch"},
    ("fewerbits.io", "quantizationpolicies", "status"): {"patch"},
    ("", "nodes", ""): {"list", "watch"},
    ("", "namespaces", ""): {"get"},
    # Granted to every authenticated user by the API server's default system:basic-user role.
    ("authorization.k8s.io", "selfsubjectaccessreviews", ""): {"create"},
    ("authorization.k8s.io", "selfsubjectrulesreviews", ""): {"create"},
    ("authentication.k8s.io", "selfsubjectreviews", ""): {"create"},
}


OWN = {  # in the release namespace only (the leader election's Role, leader.py); get and update are
    # limited to the Lease's name (asked by name below), create cannot be
    ("coordination.k8s.io", "leases", ""): {"create"},
    # The activator Service's ready endpoints, copied into each model's EndpointSlice at zero (atzero.py).
    ("discovery.k8s.io", "endpointslices", ""): {"list", "watch"},
}


def _expected() -> set[tuple[str, str, str, str, str]]:
    out = {("operator's own", g, r, sub, v) for (g, r, sub), verbs in OWN.items() for v in verbs}
    for (g, r, sub), verbs in NAMESPACED.items():
        out |= {("watched", g, r, sub, v) for v in verbs}
    for (g, r, sub), verbs in CLUSTER.items():
        out |= {("cluster", g, r, sub, v) for v in verbs}
    return out


EXPECTED_GRANTS = _expected()
ACTIVATOR_GRANTS = {  # the activator's own ServiceAccount (activator.py): one request's needs, in the watched namespace only
    ("watched", "fewerbits.io", "quantizedmodels", "", "get"),
    # list and watch: the activator's own caches of what a request reads (activator_cache.py)
    ("watched", "fewerbits.io", "quantizedmodels", "", "list"),
    ("watched", "fewerbits.io", "quantizedmodels", "", "watch"),
    ("watched", "", "pods", "", "list"),
    ("watched", "", "pods", "", "watch"),
    ("watched", "apps", "deployments", "", "list"),
    ("watched", "apps", "deployments", "", "watch"),
    ("watched", "apps", "deployments", "scale", "get"),
    ("watched", "apps", "deployments", "scale", "update"),
    ("watched", "", "events", "", "create"),
    # A model header is served only when the model's own route sets it (its token): that route, by name.
    ("watched", "gateway.networking.k8s.io", "httproutes", "", "get"),
} | {("cluster", g, r, sub, v) for (g, r, sub), verbs in CLUSTER.items() for v in verbs
     if g in ("authorization.k8s.io", "authentication.k8s.io")}  # every authenticated user's


def rbac_matrix(cluster, user: str, namespaces: dict[str, str]) -> set[tuple[str, str, str, str, str]]:
    """(scope, group, resource, subresource, verb) the API server allows `user`, over every resource
    it serves (discovery) and every verb; namespaced resources asked in each of `namespaces`
    (scope = its label), cluster-scoped ones cluster-wide."""
    authz = client.AuthorizationV1Api(cluster.api_client())
    # The groups the API server gives a ServiceAccount token: what other bindings grant to all
    # ServiceAccounts or all authenticated users counts too.
    sa_ns = user.split(":")[2]
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{sa_ns}", "system:authenticated"]

    def resources(namespaced: bool) -> list[tuple[str, str]]:
        names = cluster.kubectl("api-resources", "-o", "name", f"--namespaced={str(namespaced).lower()}").stdout.split()
        served = [(n.split(".", 1)[1] if "." in n else "", n.split(".", 1)[0]) for n in names]
        # RBAC grants on a CRD's resource hold whether or not the CRD is installed (the routing
        # tests install the InferencePool and HTTPRoute CRDs on the shared cluster, maybe after this test).
        optional = [("inference.networking.k8s.io", "inferencepools"),
                    ("gateway.networking.k8s.io", "httproutes")] if namespaced else []
        return served + [r for r in optional if r not in served]

    def allowed(verb, group, resource, sub, ns) -> bool:
        attrs = {"verb": verb, "resource": resource, "group": group, "subresource": sub or None, "namespace": ns}
        return authz.create_subject_access_review({"spec": {"user": user, "groups": groups,
                                                            "resourceAttributes": attrs}}).status.allowed

    granted = set()
    for namespaced in (True, False):
        for group, resource in resources(namespaced):
            for sub in ("", *SUBRESOURCES.get((group, resource), ())):
                for verb in VERBS:
                    scopes = namespaces.items() if namespaced else [("cluster", None)]
                    for label, ns in scopes:
                        if allowed(verb, group, resource, sub, ns):
                            granted.add((label, group, resource, sub, verb))
    return granted


def test_chart_install_takes_a_sample_to_ready_under_the_charts_rbac(cluster, gpu_pool):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    cluster.add_cpu_node("cpu-chart")
    suffix = uuid.uuid4().hex[:6]
    release_ns, model_ns = f"fb-system-{suffix}", f"fb-demo-{suffix}"
    demo.create_namespace_with_secret(cluster, model_ns, "s3-credentials")  # its Role lands there
    demo.install_chart(cluster, release_ns, [model_ns])
    api = cluster.api_client()
    core = client.CoreV1Api(api)
    try:
        [op_pod] = core.list_namespaced_pod(release_ns, label_selector="app.kubernetes.io/name=fewerbits,"
                                                                       "app.kubernetes.io/component=operator").items
        assert op_pod.spec.service_account_name == "fewerbits"
        assert op_pod.status.phase == "Running"  # admitted under the `restricted` Pod Security Standard
        [act_pod] = core.list_namespaced_pod(release_ns, label_selector="app.kubernetes.io/name=fewerbits,"
                                                                        "app.kubernetes.io/component=activator").items
        assert act_pod.spec.service_account_name == "fewerbits-activator"
        assert act_pod.status.phase == "Running"  # the activator's pod too (its own Deployment)

        # The activator's own ServiceAccount: exactly its least-privilege grants, in the watched
        # namespace only (nothing in another namespace, the release namespace or cluster-wide).
        act_sa = f"system:serviceaccount:{release_ns}:fewerbits-activator"
        act_granted = rbac_matrix(cluster, act_sa, {"watched": model_ns, "other": "default",
                                                    "operator's own": release_ns})
        assert act_granted == ACTIVATOR_GRANTS, (
            f"granted but not expected: {sorted(act_granted - ACTIVATOR_GRANTS)}; "
            f"expected but not granted: {sorted(ACTIVATOR_GRANTS - act_granted)}")

        # Everything the chart's ServiceAccount may do, asked of the API server itself for every
        # resource it serves × every verb, in the watched namespace, in another one, and cluster-wide:
        # exactly the expected set, nothing more (a new rule fails this until it is listed).
        sa = f"system:serviceaccount:{release_ns}:fewerbits"
        granted = rbac_matrix(cluster, sa, {"watched": model_ns, "other": "default", "operator's own": release_ns})
        # LeaderWorkerSet grants are seen only when an earlier test installed its CRD on this cluster.
        lws_served = "leaderworkersets.leaderworkerset.x-k8s.io" in cluster.kubectl("api-resources", "-o", "name").stdout
        expected = {g for g in EXPECTED_GRANTS if g[1] != "leaderworkerset.x-k8s.io" or lws_served}
        assert granted == expected, (
            f"granted but not expected: {sorted(granted - expected)}; "
            f"expected but not granted: {sorted(expected - granted)}")
        authz = client.AuthorizationV1Api(api)

        # The named ConfigMap grant (nodecache.py's referenced keys): replace and delete that name
        # only, in the watched namespace only.
        def may_cm(verb: str, name: str, ns: str) -> bool:
            attrs = {"verb": verb, "resource": "configmaps", "name": name, "namespace": ns}
            return authz.create_subject_access_review({"spec": {
                "user": sa, "groups": ["system:serviceaccounts", "system:authenticated"],
                "resourceAttributes": attrs}}).status.allowed
        for verb in ("update", "delete"):
            assert may_cm(verb, "fewerbits-node-cache-references", model_ns), verb
            assert not may_cm(verb, "kube-root-ca.crt", model_ns), verb
            assert not may_cm(verb, "fewerbits-node-cache-references", "default"), verb

        # `bind` (not in VERBS): on the picker's ClusterRole only, in the watched namespace only; never
        # `escalate`, never another role.
        def may(verb: str, name: str | None, ns: str | None) -> bool:
            attrs = {"verb": verb, "group": "rbac.authorization.k8s.io", "resource": "clusterroles", "name": name,
                     "namespace": ns}
            return authz.create_subject_access_review({"spec": {"user": sa, "resourceAttributes": attrs}}).status.allowed

        # The Lease: get and update by its name only, in the release namespace only.
        def may_lease(verb: str, name: str, ns: str) -> bool:
            attrs = {"verb": verb, "group": "coordination.k8s.io", "resource": "leases", "name": name, "namespace": ns}
            return authz.create_subject_access_review({"spec": {
                "user": sa, "groups": ["system:serviceaccounts", "system:authenticated"],
                "resourceAttributes": attrs}}).status.allowed
        for verb in ("get", "update"):
            assert may_lease(verb, "fewerbits", release_ns), verb
            assert not may_lease(verb, "kube-controller-manager", release_ns), verb
            assert not may_lease(verb, "fewerbits", model_ns), verb
        assert not may_lease("delete", "fewerbits", release_ns)

        assert may("bind", "fewerbits-epp", model_ns)
        assert not may("bind", "fewerbits-epp", "default") and not may("bind", "fewerbits-epp", None)
        assert not any(may("bind", other, model_ns) for other in ("admin", "edit", "cluster-admin", "fewerbits", None))
        assert not may("escalate", "fewerbits-epp", model_ns)

        source = demo.upload_test_model(cluster)
        cluster.apply(demo.model_manifest(cluster, model_ns, "chart-sample", source, "s3-credentials"))
        seen: list[dict] = []

        def capture(line: str) -> None:
            obj = client.CustomObjectsApi(api).get_namespaced_custom_object(
                "fewerbits.io", "v1alpha1", model_ns, "quantizedmodels", "chart-sample")
            seen.append(obj)
            print(line)

        ready = demo.wait_ready(cluster, model_ns, "chart-sample", timeout=900, out=capture)
        status, message = lua_health(ready)
        assert status == "Healthy", message
        # Earlier live states were Progressing (quantizing, rolling out), never Degraded.
        assert {lua_health(o)[0] for o in seen[:-1]} <= {"Progressing", "Healthy"}
        assert any(lua_health(o)[0] == "Progressing" for o in seen)

        # kubectl: printer columns filled, explain text present, wait works.
        out = cluster.kubectl("get", "qm", "-n", model_ns).stdout
        assert "fp8-dynamic" in out and "True" in out
        cluster.kubectl("wait", "--for=condition=Ready", "qm/chart-sample", "-n", model_ns, "--timeout=30s")
        assert "maxPerplexityIncreasePercent" in cluster.kubectl("explain", "qm.spec.quantization.qualityGate").stdout

        url, answer = demo.completion(cluster, model_ns, "chart-sample")
        assert answer["choices"] and answer["model"] == "chart-sample"

        capture_dir = os.environ.get("FEWERBITS_CAPTURE_STATUS")
        if capture_dir:
            for label, obj in (("captured-progressing", next(o for o in seen if lua_health(o)[0] == "Progressing")),
                               ("captured-ready", ready)):
                h = lua_health(obj)
                Path(capture_dir, f"{label}.json").write_text(json.dumps({
                    "description": f"captured from the e2e chart install ({label})",
                    "expected": {"status": h[0], "messageContains": h[1][:40]},
                    "object": obj}, indent=1))
    finally:
        cluster.helm("uninstall", "fewerbits", "-n", release_ns, "--wait", check=False)
        for ns in (model_ns, release_ns):
            try:
                core.delete_namespace(ns)
            except client.exceptions.ApiException:
                pass
