"""Quantization Jobs sized from the plan, and their resource failures, on the real control plane
(issue 16: jobs sized from the plan; bad input: evicted, OOM-killed, out of disk).

The model is Llama-3.1-70B's real config.json in MinIO (the planner reads only config.json): the
operator plans it on an H100 pool and creates its Job asking for what 70B needs. That Job's pod
never runs here: its work volume is a generic ephemeral volume (a PVC) and the test cluster has no
StorageClass provisioner, so the scheduler leaves it Pending and neither kwok nor the pod runner
touches it. The kubelet's verdicts (OOMKilled, Evicted for ephemeral-storage) are then written into
the pod's status through the API server, as a kubelet writes them: the Job controller, the operator
and the API server are the real ones, only the kubelet's decision is the test's.

Simulator: none starts. No model here gets an artifact (its Job's pod never runs, is failed by the
test's kubelet verdict, or is refused before a Job), so no serving pod of the default vLLM image
(llm-d-inference-sim in this harness) is created.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client

from e2e.demo import MODEL_BUCKET
from fewerbits_operator.artifacts.jobresources import quantity_bytes
from tests.integration.faults import enforce_pod_security

pytestmark = [pytest.mark.cluster]

CONFIGS = Path(__file__).resolve().parents[1] / "unit" / "fixtures" / "model_configs"
GROUP, VERSION = "fewerbits.io", "v1alpha1"


def upload_config(cluster, namespace: str, fixture: str) -> str:
    prefix = f"{namespace}/{fixture.removesuffix('.json')}"
    cluster.s3.client().put_object(Bucket=MODEL_BUCKET, Key=f"{prefix}/config.json",
                                   Body=(CONFIGS / fixture).read_bytes())
    return f"s3://{MODEL_BUCKET}/{prefix}"


@pytest.fixture
def no_retries(cluster, namespace):
    """A policy for this namespace only: a failed Job pod is not retried (one verdict fails the
    Job), so the test writes one pod's status."""
    custom = client.CustomObjectsApi(cluster.api_client())
    name = f"no-retries-{namespace}"
    custom.create_cluster_custom_object(GROUP, VERSION, "quantizationpolicies", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "QuantizationPolicy", "metadata": {"name": name},
        "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                 "rules": {"quantizationJob": {"backoffLimit": 0}}}})
    yield name
    custom.delete_cluster_custom_object(GROUP, VERSION, "quantizationpolicies", name)


def the_job_and_its_pod(models, namespace: str, model: str):
    def check():
        jobs = models.jobs(namespace)
        if not jobs:
            return None
        pods = models.core.list_namespaced_pod(namespace, label_selector=f"job-name={jobs[0].metadata.name}").items
        return (jobs[0], pods[0]) if pods else None
    return models.wait("the quantization Job and its pod", check, timeout=120, namespace=namespace, name=model)


def fail_pod(models, namespace: str, pod: str, status: dict) -> None:
    """Write the kubelet's verdict into the pod's status (the status subresource)."""
    models.core.patch_namespaced_pod_status(pod, namespace, {"status": {"phase": "Failed", **status}})


def test_a_70b_job_asks_for_its_memory_and_disk_and_an_oom_kill_says_so(cluster, gpu_pool, namespace, models,
                                                                         model_spec, no_retries):
    # The sized Job (its generic ephemeral volume included) is admitted under `restricted`.
    enforce_pod_security(cluster, namespace, "restricted")
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    source = upload_config(cluster, namespace, "llama-3.1-70b.json")
    models.apply(namespace, "llama70b", model_spec(source={"uri": source}, quantization={"format": "fp8-dynamic"}))
    job, pod = the_job_and_its_pod(models, namespace, "llama70b")

    status = models.get(namespace, "llama70b")["status"]
    (size,) = status["plan"]["quantizationJobs"]
    assert size["format"] == "fp8-dynamic" and size["memoryGiB"] >= 140 and size["ephemeralStorageGiB"] >= 200
    # The Job as the API server stored it asks for exactly that.
    spec = job.spec.template.spec
    res = spec.containers[0].resources
    assert res.requests["memory"] == res.limits["memory"] == f"{size['memoryGiB']}Gi"
    assert quantity_bytes(res.limits["memory"]) >= 140 * 2**30
    assert res.requests["nvidia.com/gpu"] == res.limits["nvidia.com/gpu"] == str(size["gpus"]) == "2"
    work = next(v for v in spec.volumes if v.name == "work")
    claim = work.ephemeral.volume_claim_template.spec
    assert quantity_bytes(claim.resources.requests["storage"]) >= 200 * 2**30
    assert spec.node_selector.get("nvidia.com/gpu.product") == "NVIDIA-H100-80GB-HBM3"
    assert job.spec.active_deadline_seconds == max(3600, 3 * size["estimatedMinutes"] * 60)
    # The kube-controller-manager made the pod's claim from the template; with no provisioner the
    # pod waits, unscheduled.
    models.wait("the work volume's PVC", lambda: models.core.list_namespaced_persistent_volume_claim(namespace).items,
                timeout=60, namespace=namespace, name="llama70b")
    assert not pod.spec.node_name

    fail_pod(models, namespace, pod.metadata.name, {"containerStatuses": [{
        "name": "quantize", "image": spec.containers[0].image, "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                 "startedAt": "2026-11-23T10:00:00Z", "finishedAt": "2026-11-23T10:30:00Z"}}}]})
    cond = models.wait_condition(namespace, "llama70b", "Quantized", "False", reason="JobOOMKilled", timeout=120)
    assert f"exceeded its memory limit of {size['memoryGiB']}Gi" in cond["message"]
    assert "FEWERBITS_JOB_MEMORY_REQUEST" in cond["message"]
    (artifact,) = models.get(namespace, "llama70b")["status"]["artifacts"]
    assert artifact["failure"]["reason"] == "JobOOMKilled" and artifact["failure"]["job"] == job.metadata.name


def test_an_eviction_for_disk_is_job_out_of_disk_with_the_figure(cluster, gpu_pool, namespace, models, model_spec,
                                                                no_retries):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    source = upload_config(cluster, namespace, "llama-3.1-70b.json")
    models.apply(namespace, "evicted", model_spec(source={"uri": source}, quantization={"format": "fp8-dynamic"}))
    job, pod = the_job_and_its_pod(models, namespace, "evicted")
    fail_pod(models, namespace, pod.metadata.name, {
        "reason": "Evicted",
        "message": "Pod ephemeral local storage usage exceeds the total limit of containers 10Gi. "})
    cond = models.wait_condition(namespace, "evicted", "Quantized", "False", reason="JobOutOfDisk", timeout=120)
    assert f"pod {pod.metadata.name} was evicted" in cond["message"]
    assert "asks for ephemeral-storage 10Gi" in cond["message"]
    events = [e for e in models.events(namespace, "evicted") if e.reason == "JobOutOfDisk"]
    assert events and events[0].type == "Warning"


def test_an_evaluation_set_that_cannot_be_read_is_named_before_any_job(cluster, gpu_pool, namespace, models,
                                                                       model_spec):
    # (An S3 calibration object is read earlier, for its ETag: test_calibration_keys.py.)
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    missing = f"s3://artifacts/{namespace}/no-such-eval.jsonl"
    models.apply(namespace, "noeval", model_spec(quantization={
        "format": "fp8-dynamic", "qualityGate": {"evalDataset": missing}}))
    cond = models.wait_condition(namespace, "noeval", "Quantized", "False", reason="DatasetUnreadable", timeout=120)
    assert f"spec.quantization.qualityGate.evalDataset: {missing} does not exist" in cond["message"]
    assert models.jobs(namespace) == []
