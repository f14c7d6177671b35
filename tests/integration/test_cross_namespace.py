"""One quantization Job per artifact key and storage location across namespaces (issue 16, item 6),
on the real control plane with MinIO: two namespaces publish the same key to the same storage; the
first to claim `<key>/.claim` (create-only) runs the one Job, the other waits and finds the
manifest as a cache hit. Both end Ready; exactly one Job ever existed.

Simulator: the verdict is the claim, the one Job and the cache hit; both models then serve with
the operator's default vLLM image, played by llm-d-inference-sim, and are judged Ready by their
conditions only: what vLLM would answer does not enter it, and two real servers are 6.8 GB here."""

from __future__ import annotations

import json
import uuid

import pytest
from kubernetes import client

from e2e import demo
from tests.integration.faults import ARTIFACT_BUCKET, assert_manifest_complete

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

FP8 = {"format": "fp8-dynamic", "qualityGate": {"maxPerplexityIncreasePercent": 50, "evalSamples": 8}}


@pytest.fixture
def second_namespace(cluster):
    api = client.CoreV1Api(cluster.api_client())
    name = f"t-{uuid.uuid4().hex[:8]}"
    api.create_namespace({"metadata": {"name": name}})
    demo.create_s3_secret(cluster, name, "s3-credentials")
    yield name
    api.delete_namespace(name)


def all_jobs(models, namespaces) -> list:
    return [j for ns in namespaces for j in models.jobs(ns)]


def test_two_namespaces_publishing_one_key_to_one_storage_run_one_job(cluster, gpu_pool, namespace, second_namespace,
                                                                       models, model_spec):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    shared = {"uri": f"s3://{ARTIFACT_BUCKET}/{namespace}/shared"}  # one location for both namespaces
    spaces = (namespace, second_namespace)
    jobs_seen: set[tuple[str, str]] = set()

    def ready_watching_jobs(ns: str):
        jobs_seen.update((j.metadata.namespace, j.metadata.name) for j in all_jobs(models, spaces))
        c = models.condition(ns, "m", "Ready")
        return c if c and c["status"] == "True" else None

    for ns in spaces:  # applied back to back: both are reconciled while neither Job exists yet
        models.apply(ns, "m", model_spec(quantization=FP8, storage=shared))
    for ns in spaces:
        models.wait(f"{ns}/m Ready", lambda ns=ns: ready_watching_jobs(ns), timeout=600, namespace=ns, name="m")

    jobs_seen.update((j.metadata.namespace, j.metadata.name) for j in all_jobs(models, spaces))
    assert len(jobs_seen) == 1, f"more than one quantization Job: {sorted(jobs_seen)}"
    ((holder_ns, job),) = jobs_seen
    a, b = (models.get(ns, "m")["status"]["artifacts"][0] for ns in spaces)
    assert a["key"] == b["key"] and a["uri"] == b["uri"]
    by_ns = {namespace: a, second_namespace: b}
    assert by_ns[holder_ns]["job"] == job and not by_ns[holder_ns].get("cacheHit")
    waiter = next(ns for ns in spaces if ns != holder_ns)
    assert by_ns[waiter]["cacheHit"] is True and "job" not in by_ns[waiter]
    assert_manifest_complete(cluster, f"{namespace}/shared", a["key"])
    claim = json.loads(cluster.s3.client().get_object(
        Bucket=ARTIFACT_BUCKET, Key=f"{namespace}/shared/{a['key']}/.claim")["Body"].read())
    assert claim["holder"] == f"{holder_ns}/{job}"
