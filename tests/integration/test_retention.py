"""Retention that works (issue 16, item 8), on the real control plane with MinIO and a short period:
under `rules.artifactRetention: Delete` an artifact no model references is marked, then deleted
once unreferenced for the period (manifest first: the order itself is proven in
tests/unit/test_retention.py on the executor), with an `ArtifactDeleted` event and the
`fewerbits_artifacts_deleted_total` metric; the artifact the model references survives every
sweep.

Simulator: the verdict is which artifacts the sweep marks and deletes; the referenced model is
served with the operator's default vLLM image, played by llm-d-inference-sim, and what it answers
does not enter the verdict."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.integration.faults import ARTIFACT_BUCKET, artifact_objects, assert_manifest_complete
from tests.integration.test_storage_identity import FP8, ready_at

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

PERIOD = 2


def deleted_total(models) -> float:
    for line in models.operator.metrics().splitlines():
        if line.startswith("fewerbits_artifacts_deleted_total "):
            return float(line.split()[1])
    return 0.0


def test_an_unreferenced_artifact_is_deleted_after_the_period_and_a_referenced_one_never(cluster, gpu_pool, namespace,
                                                                                          models, model_spec):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    policy = {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizationPolicy",
              "metadata": {"name": f"retention-{namespace}"},
              "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                       "rules": {"artifactRetention": "Delete", "artifactRetentionPeriodSeconds": PERIOD}}}
    cluster.apply(policy)
    try:
        models.apply(namespace, "kept", model_spec(quantization=FP8))
        (kept,) = ready_at(models, namespace, "kept", 1)["artifacts"]
        before = deleted_total(models)

        # An artifact of the same location that no model references (a deleted model's, say).
        s3 = cluster.s3.client()
        orphan = hashlib.sha256(f"orphan-{namespace}".encode()).hexdigest()
        s3.put_object(Bucket=ARTIFACT_BUCKET, Key=f"{namespace}/{orphan}/files/model.safetensors", Body=b"x" * 64)
        s3.put_object(Bucket=ARTIFACT_BUCKET, Key=f"{namespace}/{orphan}/manifest.json", Body=json.dumps({}).encode())

        models.wait("the orphan marked unreferenced",
                    lambda: f"{namespace}/{orphan}/.unreferenced" in artifact_objects(cluster, namespace, orphan),
                    timeout=60, namespace=namespace, name="kept")
        models.wait("the orphan deleted", lambda: artifact_objects(cluster, namespace, orphan) == {},
                    timeout=60, namespace=namespace, name="kept")
        event = models.wait("an ArtifactDeleted event", lambda: next(
            (e for e in models.events(namespace, "kept") if e.reason == "ArtifactDeleted"), None), timeout=30)
        assert orphan[:12] in event.message and "rules.artifactRetention" in event.message
        assert deleted_total(models) >= before + 1

        # The referenced artifact: complete, never marked.
        assert_manifest_complete(cluster, namespace, kept["key"])
        assert f"{namespace}/{kept['key']}/.unreferenced" not in artifact_objects(cluster, namespace, kept["key"])
        assert models.condition(namespace, "kept", "Ready")["status"] == "True"
    finally:
        cluster.kubectl("delete", "quantizationpolicy", policy["metadata"]["name"], "--wait=false")
