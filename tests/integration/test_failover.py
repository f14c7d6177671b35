"""Two operator replicas, one active, on the real control plane (leader.py, runner.py): the active
one is killed (SIGKILL: no hand-over) while one model's quantization Job runs and another model is
being scaled, and while the scale-from-zero activator holds a request for a third model at zero;
the standby takes the Lease and acts within 30 s (the chart's Lease settings: 15 s lease, 5 s renew,
2 s retry), no Job is created twice, no status is lost, each replica's Prometheus metrics say which
one leads, and the held request is answered once the model is up: the activator is its own process
(the chart's activator Deployment), out of the operator's failure domain. The two operators are the
real process (``python -m fewerbits_operator``) started by the harness, as the session's operator
is, and the activator is ``python -m fewerbits_operator.runtime.activator_main``.

Simulator: the serving pods run the operator's default vLLM image, played by llm-d-inference-sim,
because the verdict is the Lease hand-over, one Job per key, the scaled Deployment and the held
request reaching the woken pod (its status 200 and a choice), never what the model says; a real
vLLM start takes about a minute here, and the test starts pods across the 30 s take-over window."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest
from typing import Any

from kubernetes import client

from e2e import demo
from tests.integration.operator_harness import Models, OperatorProcess

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

GROUP, VERSION, PLURAL = "fewerbits.io", "v1alpha1", "quantizedmodels"
TAKEOVER_SECONDS = 30


def leader_gauge(op: OperatorProcess) -> float | None:
    try:
        text = op.metrics()
    except OSError:
        return None
    m = re.search(r'^fewerbits_leader\{identity="[^"]+"\} ([0-9.]+)$', text, re.M)
    return float(m.group(1)) if m else None


def activator_waiting(activator: OperatorProcess) -> float:
    m = re.search(r"^fewerbits_activator_waiting ([0-9.]+)$", activator.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def jobs_created(op: OperatorProcess) -> float:
    m = re.search(r"^fewerbits_quantization_jobs_created_total ([0-9.]+)$", op.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture
def fo_namespace(cluster):
    """An `fo-` namespace, watched by this module's two operators only (the session's watches `t-*`)."""
    name = f"fo-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(cluster.api_client())
    core.create_namespace({"metadata": {"name": name}})
    demo.create_s3_secret(cluster, name, "s3-credentials")
    yield name
    core.delete_namespace(name)


def test_the_standby_takes_over_within_30s_without_doing_anything_twice(cluster, crds_installed, gpu_pool,
                                                                        test_model_uri, fo_namespace, tmp_path,
                                                                        activator):
    (node,) = gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    ns = fo_namespace
    env = {"FEWERBITS_NAMESPACES": f'["{ns}"]', "FEWERBITS_LEADER_ELECTION": "true",
           "FEWERBITS_LEADER_ELECTION_NAMESPACE": ns, "FEWERBITS_LEADER_ELECTION_LEASE": "fewerbits-operator",
           "FEWERBITS_LEADER_LEASE_SECONDS": "15", "FEWERBITS_LEADER_RENEW_SECONDS": "5",
           "FEWERBITS_LEADER_RETRY_SECONDS": "2", "FEWERBITS_AUTOSCALER_ENABLED": "false",
           "FEWERBITS_ACTIVATOR_PORT": "0"}
    a = OperatorProcess(cluster.kubeconfig, tmp_path / "a.log", env_extra={**env, "POD_NAME": "replica-a"}).start()
    b: OperatorProcess | None = None
    held: HeldRequest | None = None
    try:
        models = Models(cluster.api_client(), a)
        models.wait("replica a to lead", lambda: leader_gauge(a) == 1.0, timeout=60)
        b = OperatorProcess(cluster.kubeconfig, tmp_path / "b.log", env_extra={**env, "POD_NAME": "replica-b"}).start()
        models.wait("replica b to stand by", lambda: leader_gauge(b) == 0.0, timeout=60)

        spec = lambda prefix: demo.test_model_spec(cluster.s3.endpoint, test_model_uri, "s3-credentials",  # noqa: E731
                                                   f"{ns}-{prefix}")
        models.apply(ns, "scaling", spec("scaling"))
        # A third model that may reach zero, on the first's artifact (one Job for both).
        models.apply(ns, "waking", {**spec("scaling"), "autoscaling": {"enabled": True, "minReplicas": 0,
                                                                       "maxReplicas": 1}})
        models.wait_condition(ns, "scaling", "Ready", timeout=300)
        waking = to_zero(cluster, models, ns, "waking")
        models.apply(ns, "quantizing", spec("quantizing"))  # its own prefix: a Job of its own
        batch = client.BatchV1Api(cluster.api_client())
        running = models.wait("the second model's Job", lambda: [
            j for j in batch.list_namespaced_job(ns).items
            if any(r.name == "quantizing" for r in j.metadata.owner_references or [])], timeout=120)
        job_uid = running[0].metadata.uid
        core = client.CoreV1Api(cluster.api_client())
        models.wait("the Job's pod scheduled (before the GPU node is tainted)", lambda: [
            p for p in core.list_namespaced_pod(ns, label_selector=f"job-name={running[0].metadata.name}").items
            if p.spec.node_name], timeout=60)
        held = hold_a_request(cluster, models, ns, node, activator, "waking", waking)
        before = models.get(ns, "scaling")["status"]
        created_by_a = jobs_created(a)
        assert leader_gauge(b) == 0.0 and jobs_created(b) == 0  # the standby wrote nothing

        a.kill()  # SIGKILL: no clean release, the lease must expire
        killed = time.monotonic()
        models.patch_spec(ns, "scaling", {"serving": {"replicas": 2}})
        models.operator = b
        models.wait("replica b to lead", lambda: leader_gauge(b) == 1.0, timeout=TAKEOVER_SECONDS)
        apps = client.AppsV1Api(cluster.api_client())
        models.wait("the scaled Deployment", lambda: any(
            (d.spec.replicas or 0) == 2 for d in apps.list_namespaced_deployment(
                ns, label_selector="fewerbits.io/model=scaling").items),
            timeout=max(1.0, TAKEOVER_SECONDS - (time.monotonic() - killed)), namespace=ns, name="scaling")
        acted_after = time.monotonic() - killed
        assert acted_after <= TAKEOVER_SECONDS

        # The request held while the leader died is answered once the woken pod is up: not lost.
        held.release()
        answer = held.answer(timeout=120)
        assert answer["status"] == 200 and json.loads(answer["body"])["choices"], answer
        assert answer["endpoint"], answer  # forwarded by the activator to the woken pod

        # The quantization goes on from where it was: the same Job (same uid), none created again.
        models.wait_condition(ns, "quantizing", "Ready", timeout=300)
        jobs = [j for j in batch.list_namespaced_job(ns).items
                if any(r.name == "quantizing" for r in j.metadata.owner_references or [])]
        assert [j.metadata.uid for j in jobs] == [job_uid]
        assert jobs_created(b) == 0 and created_by_a >= 1
        # No status lost: the scaled model keeps its artifacts and conditions, now at generation 2.
        after = models.get(ns, "scaling")
        assert after["status"]["artifacts"] == before["artifacts"]
        assert {c["type"] for c in before["conditions"]} <= {c["type"] for c in after["status"]["conditions"]}
        models.wait("the scaled model's status at its new generation", lambda: (
            models.get(ns, "scaling")["status"].get("observedGeneration") == after["metadata"]["generation"]),
            timeout=60, namespace=ns, name="scaling")
        lease = client.CoordinationV1Api(cluster.api_client()).read_namespaced_lease("fewerbits-operator", ns)
        assert lease.spec.holder_identity == "replica-b" and lease.spec.lease_transitions >= 1
        print(f"takeover: the new leader acted {acted_after:.1f}s after the leader was killed")
    finally:
        if held is not None:
            held.release()  # the GPU node untainted whatever happened
        a.stop()
        if b is not None:
            b.stop()


class HeldRequest:
    """A chat completion sent to the activator for a model at zero, answered in a thread."""

    def __init__(self, activator: OperatorProcess, ns: str, model: str, release: Any):
        self.out: dict[str, Any] = {}
        self.release = release
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "wake up"}],
                           "max_tokens": 8}).encode()
        # As the model's Service delivers it (its Host): these operators publish no activator slice.
        req = urllib.request.Request(f"http://127.0.0.1:{activator.activator_port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json", "Host": f"{model}.{ns}.svc:8000"})

        def call() -> None:
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    self.out.update(status=r.status, body=r.read(), endpoint=r.getheader("X-Fewerbits-Endpoint"))
            except urllib.error.HTTPError as e:
                self.out.update(status=e.code, body=e.read(), endpoint=None)
        self.thread = threading.Thread(target=call, daemon=True)
        self.thread.start()

    def answer(self, timeout: float) -> dict[str, Any]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the held request was not answered"
        return self.out


def to_zero(cluster, models: Models, ns: str, name: str) -> str:
    """The model (autoscaling ``minReplicas: 0``) Ready, then brought to zero as the autoscaler
    would (the scale subresource; the autoscaler is off here). Returns its Deployment's name."""
    apps, core = client.AppsV1Api(cluster.api_client()), client.CoreV1Api(cluster.api_client())
    models.wait_condition(ns, name, "Ready", timeout=300)
    (dep,) = models.deployments(ns, name)
    apps.patch_namespaced_deployment_scale(dep.metadata.name, ns, {"spec": {"replicas": 0}})
    models.wait("the model at zero", lambda: not core.list_namespaced_pod(
        ns, label_selector=f"fewerbits.io/model={name},app.kubernetes.io/component=server").items, timeout=60)
    return dep.metadata.name


def hold_a_request(cluster, models: Models, ns: str, node: str, activator: OperatorProcess, name: str,
                   deployment: str) -> HeldRequest:
    """A request for the model at zero, held by the activator: the woken pod is kept Pending by a
    taint on the GPU node (the scheduler reads it, the planner does not) until ``release``, so the
    request is still held when the leader is killed."""
    apps, core = client.AppsV1Api(cluster.api_client()), client.CoreV1Api(cluster.api_client())
    taint = client.V1Taint(key="fewerbits.io/test-hold", value="true", effect="NoSchedule")
    core.patch_node(node, {"spec": {"taints": [*(core.read_node(node).spec.taints or []), taint]}})

    def release() -> None:
        core.patch_node(node, {"spec": {"taints": [t for t in core.read_node(node).spec.taints or []
                                                   if t.key != taint.key]}})
    waiting0 = activator_waiting(activator)
    held = HeldRequest(activator, ns, name, release)
    try:
        models.wait("the request held", lambda: activator_waiting(activator) >= waiting0 + 1, timeout=30)
        models.wait("the model woken by the activator", lambda: (
            apps.read_namespaced_deployment_scale(deployment, ns).spec.replicas or 0) == 1, timeout=30)
    except BaseException:
        release()
        raise
    return held
