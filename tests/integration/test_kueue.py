"""Concurrency of quantization Jobs on the real control plane: Kueue admitting the Jobs of a
policy's LocalQueue against a ClusterQueue's GPU quota, and the operator's own cap on running
Jobs. The Jobs are the real quantjob, run by the pod runner on kwok GPU nodes.

Simulator: the verdict is when Kueue and the operator's cap let each Job run; once quantized, the
models are served with the operator's default vLLM image, played by llm-d-inference-sim, and
judged Ready by their conditions only: three real servers would be about 10 GB here for no verdict."""

from __future__ import annotations

import uuid
from datetime import datetime

import pytest
from kubernetes import client

from e2e import demo
from e2e.addons import kueue as kueue_addon
from tests.integration.operator_harness import Models, OperatorProcess
from tests.integration.test_operator import reconciled_again

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]
H100 = "NVIDIA-H100-80GB-HBM3"
QP_GROUP, QP_VERSION, QP_PLURAL = "fewerbits.io", "v1alpha1", "quantizationpolicies"


def namespace_policy(name: str, namespace: str, quantization_job: dict) -> dict:
    return {"apiVersion": f"{QP_GROUP}/{QP_VERSION}", "kind": "QuantizationPolicy", "metadata": {"name": name},
            "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                     "rules": {"quantizationJob": quantization_job}}}


def policy_status(cluster, name: str) -> dict:
    custom = client.CustomObjectsApi(cluster.api_client())
    return custom.get_cluster_custom_object(QP_GROUP, QP_VERSION, QP_PLURAL, name).get("status") or {}


def queue_of(models: Models, namespace: str, name: str) -> dict | None:
    arts = (models.get(namespace, name).get("status") or {}).get("artifacts") or []
    return arts[0].get("queue") if arts else None


def condition_time(obj: dict, type_: str) -> str | None:
    return next((c["lastTransitionTime"] for c in (obj.get("status") or {}).get("conditions") or []
                 if c["type"] == type_ and c["status"] == "True"), None)


def parse_time(text: str | None) -> datetime:
    assert text is not None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def assert_one_at_a_time(intervals: list[tuple[datetime, datetime]]) -> None:
    """(start, end) pairs: none overlaps another."""
    intervals = sorted(intervals)
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        assert start >= end, f"two ran at once: {intervals}"


def test_kueue_admits_the_jobs_of_three_models_one_at_a_time(cluster, kueue, gpu_pool, namespace, models,
                                                             model_spec):
    """A policy names LocalQueue `gpu`; the ClusterQueue behind it has quota for one GPU. The
    pool's node has 8 GPUs, so only Kueue keeps the three Jobs apart."""
    print(f"Kueue started in {kueue.startup_seconds:.1f}s (CRDs, process ready, webhooks)")
    gpu_pool("h100", H100)
    policy = namespace_policy(f"kueue-{namespace}", namespace, {"kueue": {"localQueueName": "gpu"}})
    flavor, cq, lq = kueue_addon.gpu_queue("gpu", namespace, gpus=1)
    cluster.apply(policy)
    cluster.apply([flavor, cq])
    names = ("m1", "m2", "m3")
    try:
        for n in names:  # three storage locations: three Jobs (one per key and location)
            spec = model_spec(quantization={"format": "fp8-dynamic"})
            spec["storage"]["uri"] += f"/{n}"
            models.apply(namespace, n, spec)
        # No LocalQueue yet: every Job waits suspended, each model says so, the policy counts them.
        for n in names:
            models.wait(f"{n} queued for Kueue", lambda n=n: (queue_of(models, namespace, n) or {}).get("reason")
                        == "Kueue", timeout=120, namespace=namespace, name=n)
            quantized = models.condition(namespace, n, "Quantized")
            assert (quantized["status"], quantized["reason"]) == ("False", "Queued"), quantized
            assert "suspended until Kueue admits it from LocalQueue gpu" in quantized["message"]
        jobs = models.jobs(namespace)
        assert len(jobs) == 3
        assert all(j.spec.suspend and j.metadata.labels["kueue.x-k8s.io/queue-name"] == "gpu" for j in jobs)
        counted = models.wait("the policy counting what it governs", lambda: (
            s := policy_status(cluster, policy["metadata"]["name"])).get("queuedJobs") == 3 and s, timeout=60)
        assert (counted["governedNamespaces"], counted["governedModels"]) == (1, 3)

        cluster.apply(lq)
        for n in names:
            models.wait_condition(namespace, n, "Ready", timeout=600)
            assert queue_of(models, namespace, n) is None

        # The Jobs ran one after the other (Kueue unsuspends a Job when it admits its Workload: its
        # startTime), and each started only once the Workload before it had finished (quota freed).
        # (A model is Ready once the manifest is published; its Job is marked complete just after.)
        jobs = models.wait("every Job complete", lambda: (js := models.jobs(namespace)) and all(
            j.status.completion_time for j in js) and js, timeout=120)
        ran = sorted((j.status.start_time, j.status.completion_time) for j in jobs)
        assert_one_at_a_time(ran)
        workloads = kueue_addon.workloads(cluster, namespace)
        assert len(workloads) == 3
        finished = sorted(parse_time(condition_time(w, "Finished")) for w in workloads)
        for (start, _), freed in zip(ran[1:], finished):
            assert start >= freed, (ran, finished)
        models.wait("the policy's queue empty", lambda: policy_status(cluster, policy["metadata"]["name"]).get(
            "queuedJobs") == 0, timeout=60)
    finally:
        cluster.kubectl("delete", "quantizationpolicy", policy["metadata"]["name"], "--wait=false", check=False)
        cluster.kubectl("delete", "-n", namespace, f"localqueue.{kueue_addon.GROUP}/gpu", "--ignore-not-found",
                        "--wait=false", check=False)
        cluster.kubectl("delete", f"clusterqueue.{kueue_addon.GROUP}/{cq['metadata']['name']}",
                        f"resourceflavor.{kueue_addon.GROUP}/{flavor['metadata']['name']}", "--ignore-not-found",
                        "--wait=false", check=False)


def test_the_operator_cap_queues_the_second_job_until_the_first_is_done(cluster, gpu_pool, model_spec, tmp_path,
                                                                        crds_installed):
    """An operator capped at 1 running quantization Job. The first model's Job cannot be
    scheduled (its policy asks for a node label nobody has yet), so it holds the one slot; the
    second model queues at position 1 with no Job, and starts only once the first has finished."""
    ns = f"qc-{uuid.uuid4().hex[:8]}"
    demo.create_namespace_with_secret(cluster, ns, "s3-credentials")
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", env_extra={
        "FEWERBITS_NAMESPACES": '["qc-*"]', "FEWERBITS_MAX_RUNNING_QUANTIZATION_JOBS": "1"}).start()
    models = Models(cluster.api_client(), op)
    (node,) = gpu_pool("h100", H100)
    policy = namespace_policy(f"cap-{ns}", ns, {"nodeSelector": {"fewerbits.io/test-calibration": "open"}})
    cluster.apply(policy)
    try:
        for n in ("first", "second"):
            spec = model_spec(quantization={"format": "fp8-dynamic"})
            spec["storage"]["uri"] = f"s3://{demo.ARTIFACT_BUCKET}/{ns}/{n}"
            models.apply(ns, n, spec)
            if n == "first":  # its Job first: the order of the queue is the order of wanting
                models.wait("the first Job", lambda: models.jobs(ns), timeout=120, namespace=ns, name=n)
        models.wait("second queued", lambda: (queue_of(models, ns, "second") or {}).get("position") == 1,
                    timeout=120, namespace=ns, name="second")
        queued = models.condition(ns, "second", "Quantized")
        assert (queued["status"], queued["reason"]) == ("False", "Queued")
        assert "queued at position 1: 1 of 1 quantization Jobs running" in queued["message"]
        assert queue_of(models, ns, "second")["reason"] == "OperatorCap"
        reconciled_again(models, ns, "second", times=2)  # it looked again, and still no second Job
        (first_job,) = models.jobs(ns)
        assert "Queued" in {e.reason for e in models.events(ns, "second")}

        cluster.kubectl("label", "node", node, "fewerbits.io/test-calibration=open")
        for n in ("first", "second"):
            models.wait_condition(ns, n, "Ready", timeout=600)
        jobs = {j.metadata.name: j for j in models.jobs(ns)}
        assert len(jobs) == 2
        second_job = next(j for name, j in jobs.items() if name != first_job.metadata.name)
        assert second_job.metadata.creation_timestamp >= jobs[first_job.metadata.name].status.completion_time
    finally:
        op.stop()
        cluster.kubectl("label", "node", node, "fewerbits.io/test-calibration-", check=False)
        cluster.kubectl("delete", "quantizationpolicy", policy["metadata"]["name"], "--wait=false", check=False)
        client.CoreV1Api(cluster.api_client()).delete_namespace(ns)
