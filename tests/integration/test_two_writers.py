"""Two operator replicas on one Lease, with the chart's RBAC and timings, each under a ServiceAccount
of its own on a control plane of its own with an audit log (e2e ``Cluster(audit=True)``), so every
API request says which replica sent it (issue 44, "one writer at a time"): while one leads, the
standby writes nothing, though both watch a model that may reach zero and the leader keeps that
model's activator EndpointSlice (runtime/atzero.py, which before ran on every replica); after a
clean hand-over (SIGTERM: the Lease released) the new leader keeps it.

Simulator: none of its models reaches serving: the one model names a Secret that does not exist,
so it stays Accepted=False (its status.autoscaling published, which is all the activator path
reads) and no Job or serving pod is ever created; the control plane runs without the simulator."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from kubernetes import client

from e2e import cluster as cluster_mod
from e2e import demo
from tests.integration.operator_harness import REPO, OperatorProcess

pytestmark = pytest.mark.cluster

NS = "tw"
GROUP, VERSION, PLURAL = "fewerbits.io", "v1alpha1", "quantizedmodels"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
SLICES = "endpointslice.kubernetes.io/managed-by=activator.fewerbits.io"


def _load_models_module() -> Any:
    """bench/load_models.py: its CRD install, the operator's identity under the chart's RBAC, the audit reader."""
    spec = importlib.util.spec_from_file_location("load_models", REPO / "bench" / "load_models.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["load_models"] = mod
    spec.loader.exec_module(mod)
    return mod


def wait_for(what: str, done: Callable[[], Any], timeout: float, logs: Callable[[], str] = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    while not (value := done()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}\n{logs()}"
        time.sleep(0.2)
    return value


def second_identity(c: cluster_mod.Cluster, load: Any, workdir: Path, name: str) -> tuple[Path, str]:
    """Another ServiceAccount, bound wherever the first operator's is (the chart's RBAC), with a
    token and kubeconfig of its own."""
    api = c.api_client()
    rbac, core = client.RbacAuthorizationV1Api(api), client.CoreV1Api(api)
    core.create_namespaced_service_account(load.OPERATOR_NS, {"metadata": {"name": name}})
    first = f"{load.RELEASE}-fewerbits"
    added = {"kind": "ServiceAccount", "name": name, "namespace": load.OPERATOR_NS}
    bindings = [(b, rbac.patch_cluster_role_binding) for b in rbac.list_cluster_role_binding().items] + [
        (b, lambda n, body: rbac.patch_namespaced_role_binding(n, load.OPERATOR_NS, body))
        for b in rbac.list_namespaced_role_binding(load.OPERATOR_NS).items]
    for binding, patch in bindings:
        subjects = [api.sanitize_for_serialization(s) for s in binding.subjects or []]
        if any(s.get("kind") == "ServiceAccount" and s.get("name") == first for s in subjects):
            patch(binding.metadata.name, {"subjects": [*subjects, added]})
    token = core.create_namespaced_service_account_token(name, load.OPERATOR_NS, {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600}}).status.token
    kubeconfig = workdir / f"{name}.kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "e2e", "cluster": {"server": c.server,
                                                 "certificate-authority": str(c.state_dir / "pki" / "ca.crt")}}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "e2e", "user": "operator"}}],
    }))
    return kubeconfig, f"system:serviceaccount:{load.OPERATOR_NS}:{name}"


def activator_service(load: Any) -> tuple[str, list[dict[str, Any]]]:
    """The activator's Service as the operator reads it: a Service and one EndpointSlice with a
    ready endpoint (no activator process: nothing here sends it a request)."""
    name = f"{load.RELEASE}-fewerbits-activator"
    return f"{load.OPERATOR_NS}/{name}", [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": load.OPERATOR_NS},
         "spec": {"ports": [{"name": "http", "port": 8082, "protocol": "TCP"}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": f"{name}-1", "namespace": load.OPERATOR_NS,
                      "labels": {"kubernetes.io/service-name": name}},
         "addressType": "IPv4", "ports": [{"name": "http", "port": 8082, "protocol": "TCP"}],
         "endpoints": [{"addresses": ["10.0.0.8"], "conditions": {"ready": True}}]}]


def writes(load: Any, audit_log: Path, user: str, offset: int = 0) -> dict[str, int]:
    _, by_resource, _ = load.audit_requests(audit_log, offset, user)
    return {k: v for k, v in by_resource.items() if k.split(" ", 1)[0] in WRITE_VERBS}


def lease_reads(load: Any, audit_log: Path, user: str) -> int:
    return load.audit_requests(audit_log, 0, user)[1].get("get leases", 0)


def test_the_standby_writes_nothing_and_the_leader_keeps_the_activator_path(tmp_path):
    load = _load_models_module()
    c = cluster_mod.Cluster(tmp_path / "cluster", audit=True, with_s3=False, with_sim=False,
                            kwok_cidr="127.180.0.0/16", pod_cidr="127.181.0.0/16")
    a: OperatorProcess | None = None
    b: OperatorProcess | None = None
    try:
        c.start()
        load.install_crds(c)
        kube_a, user_a = load.operator_identity(c, tmp_path)
        kube_b, user_b = second_identity(c, load, tmp_path, "replica-b")
        service, objects = activator_service(load)
        c.apply(objects)
        c.core().create_namespace({"metadata": {"name": NS}})
        lease = f"{load.RELEASE}-fewerbits"
        env = {"FEWERBITS_NAMESPACES": f'["{NS}"]', "FEWERBITS_LEADER_ELECTION": "true",
               "FEWERBITS_LEADER_ELECTION_NAMESPACE": load.OPERATOR_NS, "FEWERBITS_LEADER_ELECTION_LEASE": lease,
               "FEWERBITS_ACTIVATOR_SERVICE": service,
               # The chart's timings and periods, not the harness's test-speed ones.
               "FEWERBITS_LEADER_LEASE_SECONDS": "15", "FEWERBITS_LEADER_RENEW_DEADLINE_SECONDS": "10",
               "FEWERBITS_LEADER_RENEW_SECONDS": "5", "FEWERBITS_LEADER_RETRY_SECONDS": "2",
               "FEWERBITS_RESYNC_SECONDS": "30", "FEWERBITS_RETENTION_SWEEP_SECONDS": "600",
               "FEWERBITS_AUTOSCALER_PERIOD_SECONDS": "15", "FEWERBITS_AUTOSCALER_STATUS_INTERVAL_SECONDS": "60"}
        coordination = client.CoordinationV1Api(c.api_client())
        holder = lambda: coordination.read_namespaced_lease(lease, load.OPERATOR_NS).spec.holder_identity  # noqa: E731
        a = OperatorProcess(kube_a, tmp_path / "a.log", env_extra={**env, "POD_NAME": "replica-a"}).start()
        wait_for("replica a to take the Lease", lambda: _holder(holder) == "replica-a", 90, a.log_tail)
        b = OperatorProcess(kube_b, tmp_path / "b.log", env_extra={**env, "POD_NAME": "replica-b"}).start()
        wait_for("replica b to campaign", lambda: lease_reads(load, c.audit_log, user_b) >= 2, 90, b.log_tail)

        # A model that may reach zero: reconcile (the leader's) publishes status.autoscaling though
        # its Secret is missing, and the activator path then adds the activator's slice to its Service.
        spec = demo.test_model_spec("http://s3.invalid:9000", "s3://models/tiny", "absent", "tw",
                                    autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 1})
        client.CustomObjectsApi(c.api_client()).create_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, {"apiVersion": f"{GROUP}/{VERSION}", "kind": "QuantizedModel",
                                         "metadata": {"name": "m"}, "spec": spec})
        discovery = client.DiscoveryV1Api(c.api_client())
        slices = lambda: discovery.list_namespaced_endpoint_slice(NS, label_selector=SLICES).items  # noqa: E731
        wait_for("the leader to put the activator in the model's Service", slices, 60, a.log_tail)
        # The standby watched all this: five more polls of the Lease (10 s, five passes of an
        # activator path every 2 s, had it one) and still not one write.
        seen = lease_reads(load, c.audit_log, user_b)
        wait_for("replica b's next five polls", lambda: lease_reads(load, c.audit_log, user_b) >= seen + 5, 30)
        assert writes(load, c.audit_log, user_b) == {}, b.log_tail()
        by_a = writes(load, c.audit_log, user_a)
        assert by_a.get("create endpointslices", 0) >= 1 and by_a.get("patch quantizedmodels/status", 0) >= 1, by_a
        assert by_a.get("update leases", 0) >= 1, by_a

        # A clean hand-over: a releases the Lease on SIGTERM; b takes it at its next poll and
        # keeps the activator path (a slice deleted by hand comes back, written by b).
        a.stop()
        wait_for("replica b to take the Lease", lambda: _holder(holder) == "replica-b", 30, b.log_tail)
        for s in slices():
            discovery.delete_namespaced_endpoint_slice(s.metadata.name, NS)
        wait_for("the new leader to put the activator back", slices, 60, b.log_tail)
        by_b = writes(load, c.audit_log, user_b)
        assert by_b.get("create endpointslices", 0) >= 1 and by_b.get("update leases", 0) >= 1, by_b
    finally:
        for op in (a, b):
            if op is not None:
                op.stop()
        c.stop()


def _holder(read: Callable[[], str | None]) -> str | None:
    try:
        return read()
    except client.ApiException:
        return None  # not created yet
