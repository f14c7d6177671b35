"""A quantization Job is named by the artifact key and where it publishes (issue 16, item 2).

The same bytes asked for in two storage locations are two Jobs, each publishing its own manifest:
neither model waits on, or fails by, the other's Job. The operator re-quantizes for the second
location rather than copying between locations (artifacts.job_name says why a name, not a copy).

Simulator: the verdict is the Jobs and manifests per storage location; both models are then served
with the operator's default vLLM image, played by llm-d-inference-sim, and judged Ready by their
conditions only.
"""

from __future__ import annotations

import pytest

from tests.integration.faults import ARTIFACT_BUCKET, assert_manifest_complete, manifests

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

FP8 = {"format": "fp8-dynamic", "qualityGate": {"maxPerplexityIncreasePercent": 50, "evalSamples": 8}}


def ready_at(models, namespace: str, name: str, generation: int, timeout: float = 600):
    """Quantized=True and Ready=True as observed for ``generation`` (a model keeps serving its
    earlier artifact while the new one is made, so Ready alone is not the new artifact)."""
    def check():
        status = models.get(namespace, name).get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions") or []}
        done = all(t in conds and conds[t]["status"] == "True" and conds[t].get("observedGeneration") == generation
                   for t in ("Quantized", "Ready"))
        return status if done and status.get("observedGeneration") == generation else None
    return models.wait(f"Quantized and Ready at generation {generation} on {namespace}/{name}", check,
                       timeout=timeout, namespace=namespace, name=name)


def test_same_bytes_in_two_storage_locations_are_two_jobs(cluster, gpu_pool, namespace, models, model_spec):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    for name in ("left", "right"):
        models.apply(namespace, name, model_spec(quantization=FP8,
                                                 storage={"uri": f"s3://{ARTIFACT_BUCKET}/{namespace}/{name}"}))
    left = ready_at(models, namespace, "left", 1)
    right = ready_at(models, namespace, "right", 1)

    (a,), (b,) = left["artifacts"], right["artifacts"]
    assert a["key"] == b["key"]  # the same bytes...
    assert a["uri"] == f"s3://{ARTIFACT_BUCKET}/{namespace}/left/{a['key']}/"
    assert b["uri"] == f"s3://{ARTIFACT_BUCKET}/{namespace}/right/{b['key']}/"
    jobs = {j.metadata.name: j for j in models.jobs(namespace)}
    assert len(jobs) == 2 and {a["job"], b["job"]} == set(jobs)  # ...quantized once per location
    assert {j.metadata.annotations["fewerbits.io/artifact-key"] for j in jobs.values()} == {a["key"]}
    assert all(len(n) <= 63 and n.startswith("fewerbits-quantize-" + a["key"][:24]) for n in jobs)
    assert sorted(manifests(cluster, namespace)) == sorted(
        f"{namespace}/{side}/{a['key']}/manifest.json" for side in ("left", "right"))
    for side in ("left", "right"):
        assert_manifest_complete(cluster, f"{namespace}/{side}", a["key"])


def test_a_ready_model_whose_storage_moves_is_ready_again_at_the_new_location(cluster, gpu_pool, namespace, models,
                                                                              model_spec):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    models.apply(namespace, "mover", model_spec(quantization=FP8,
                                                storage={"uri": f"s3://{ARTIFACT_BUCKET}/{namespace}/old"}))
    before = ready_at(models, namespace, "mover", 1)
    (old,) = before["artifacts"]

    models.patch_spec(namespace, "mover", {"storage": {"uri": f"s3://{ARTIFACT_BUCKET}/{namespace}/new"}})
    after = ready_at(models, namespace, "mover", 2)

    (new,) = after["artifacts"]
    assert new["key"] == old["key"] and "failure" not in new
    assert new["uri"] == f"s3://{ARTIFACT_BUCKET}/{namespace}/new/{new['key']}/"
    assert new["job"] != old["job"] and not new.get("cacheHit")
    assert {j.metadata.name for j in models.jobs(namespace)} == {old["job"], new["job"]}
    assert_manifest_complete(cluster, f"{namespace}/new", new["key"])
    # Serving fetches from the new location.
    (dep,) = models.deployments(namespace, "mover")
    fetch = next(c for c in dep.spec.template.spec.init_containers if "fetch" in (c.args or []))
    assert fetch.args[fetch.args.index("--storage-uri") + 1] == f"s3://{ARTIFACT_BUCKET}/{namespace}/new"
    models.wait("the Deployment rolled out at the new location",
                lambda: (d := models.deployments(namespace, "mover")[0]).status.ready_replicas == 1
                and d.status.updated_replicas == 1 and d.status.observed_generation == d.metadata.generation,
                timeout=300, namespace=namespace, name="mover")
