"""Upgrading the operator over models the previous release (wave 1) reconciled.

Wave 1 kept no typed failure memory, published no effective autoscaling and no
`gpuMemoryUtilization` in the plan, and ran on kopf, which left its bookkeeping annotations on
every model. A model in that state, serving, whose quantization Job its TTL already removed, must
keep serving under the new operator: no Job re-run, no Deployment rolled, the new status fields
filled in.

Simulator: the verdict is that the new operator keeps the wave-1 model serving (no Job re-run, no
Deployment rolled, new status fields); that serving pod runs the operator's default vLLM image,
played by llm-d-inference-sim, and nothing it answers is judged.
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from tests.integration.test_operator import model_reconciles

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

GROUP, VERSION, PLURAL = "fewerbits.io", "v1alpha1", "quantizedmodels"
NEW_STATUS_FIELDS = ("autoscaling",)
NEW_ARTIFACT_FIELDS = ("failure",)
NEW_VARIANT_FIELDS = ("gpuMemoryUtilization",)
KOPF_ANNOTATIONS = {"fewerbits.io/kopf-managed": "yes",
                    "fewerbits.io/last-handled-configuration": '{"spec":{}}'}


def wave1_status(status: dict) -> dict:
    """The status as the previous release wrote it: the same facts without the fields it lacked."""
    old = {k: v for k, v in status.items() if k not in NEW_STATUS_FIELDS}
    old["artifacts"] = [{k: v for k, v in a.items() if k not in NEW_ARTIFACT_FIELDS} for a in status["artifacts"]]
    old["plan"] = {**status["plan"], "variants": [{k: v for k, v in pv.items() if k not in NEW_VARIANT_FIELDS}
                                                  for pv in status["plan"]["variants"]]}
    return old


def test_a_model_from_the_previous_release_keeps_serving_without_a_new_job(
        cluster, gpu_pool, namespace, models, model_spec, operator):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    models.apply(namespace, "legacy", model_spec(quantization={"format": "fp8-dynamic"},
                                                 autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 2}))
    models.wait_condition(namespace, "legacy", "Ready", timeout=600)
    (job,) = models.jobs(namespace)
    (dep,) = models.deployments(namespace, "legacy")

    # Put the model in the state the previous release leaves: its status shape, kopf's annotations,
    # and the finished Job gone (its TTL).
    operator.stop()
    custom = client.CustomObjectsApi(cluster.api_client())
    current = models.get(namespace, "legacy")
    old = wave1_status(current["status"])
    body = {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
            "status": {**old, **{k: None for k in NEW_STATUS_FIELDS}}}
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "legacy", body)
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "legacy",
                                          {"metadata": {"annotations": KOPF_ANNOTATIONS}})
    stored = models.get(namespace, "legacy")["status"]
    assert "autoscaling" not in stored and all("failure" not in a for a in stored["artifacts"])
    assert all("gpuMemoryUtilization" not in v for v in stored["plan"]["variants"])
    models.batch.delete_namespaced_job(job.metadata.name, namespace, propagation_policy="Background")
    models.wait("the finished Job removed", lambda: not models.jobs(namespace), timeout=60)

    operator.start()
    models.wait("two reconciles by the new operator", lambda: model_reconciles(models, namespace, "legacy") >= 2,
                timeout=180, namespace=namespace, name="legacy")

    assert models.jobs(namespace) == []  # no quantization re-run
    (after,) = models.deployments(namespace, "legacy")
    assert after.metadata.generation == dep.metadata.generation  # nothing rolled
    assert after.metadata.annotations["fewerbits.io/spec-hash"] == dep.metadata.annotations["fewerbits.io/spec-hash"]
    status = models.get(namespace, "legacy")["status"]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    assert status["autoscaling"]["maxReplicas"] == 2
    assert status["plan"]["variants"][0]["gpuMemoryUtilization"] == 0.9
    (artifact,) = status["artifacts"]
    assert artifact["job"] == job.metadata.name and "cacheHit" in artifact and "failure" not in artifact
    assert json.dumps(status).count(job.metadata.name) >= 1
