"""The quality gate end to end on the real control plane: a QuantizedModel with `benchmarks` (a
task YAML and its JSON data brought from S3, tests/fixtures/lmeval) and `customEval` (an S3 JSON
Lines set) goes Ready with every number in status and in the manifest; then a changed evaluation
set runs an evaluation-only Job on the existing artifact: the artifact's bytes are not rewritten
and the result lands at `<key>/quality/<identity>.json`.

The Job is the real `python -m fewerbits_quantjob` (run by the pod runner), lm-eval included.

Simulator: the quality figures are the Job's (transformers and lm-eval on the base and quantized
model); the model is then served with the operator's default vLLM image, played by
llm-d-inference-sim, whose answers nothing here judges. Quality measured through vLLM's serving
API is the canary's, on real vLLM (test_canary.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fewerbits_api.artifact import MANIFEST_NAME, Manifest, artifact_prefix
from fewerbits_api.quality import QUALITY_DIR

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lmeval"
BUCKET = "artifacts"


def upload_fixtures(s3, prefix: str) -> tuple[str, str]:
    client = s3.client()
    for name in ("fewerbits_cloze.yaml", "fewerbits_cloze.jsonl"):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/tasks/cloze/{name}", Body=(FIXTURES / name).read_bytes())
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/custom-eval.jsonl",
                      Body=(FIXTURES / "custom-eval.jsonl").read_bytes())
    return f"s3://{BUCKET}/{prefix}/tasks/cloze/", f"s3://{BUCKET}/{prefix}/custom-eval.jsonl"


def test_benchmarks_and_custom_eval_reach_ready_then_a_changed_gate_only_re_evaluates(
        cluster, gpu_pool, namespace, models, model_spec):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    task_source, custom = upload_fixtures(cluster.s3, f"{namespace}-evals")
    gate = {"maxPerplexityIncreasePercent": 50, "evalSamples": 8,
            "benchmarks": [{"task": "fewerbits_cloze", "taskSource": task_source, "limit": 12, "metric": "acc",
                            "minRecoveryPercent": 50}],
            "customEval": {"dataset": custom, "metric": "rougeL", "minRecoveryPercent": 10, "limit": 3,
                           "maxNewTokens": 4}}
    models.apply(namespace, "q", model_spec(quantization={"format": "fp8-dynamic", "qualityGate": gate}))
    models.wait_condition(namespace, "q", "Quantized", timeout=900)
    passed = models.wait_condition(namespace, "q", "QualityGatePassed", timeout=120)
    assert "benchmark:fewerbits_cloze/acc" in passed["message"] and "custom:rougeL" in passed["message"]

    status = models.get(namespace, "q")["status"]
    (artifact,) = status["artifacts"]
    metrics = {m["name"]: m for m in artifact["quality"]["metrics"]}
    assert set(metrics) == {"perplexity", "benchmark:fewerbits_cloze/acc", "custom:rougeL"}
    for m in metrics.values():
        assert m["passed"] is True and m["seconds"] > 0 and m["samples"] > 0, m
        assert {"base", "quantized", "recoveryPercent", "minRecoveryPercent"} <= set(m), m
    assert metrics["benchmark:fewerbits_cloze/acc"]["minRecoveryPercent"] == 50
    assert status["worstRecovery"].endswith(min(metrics.values(), key=lambda m: m["recoveryPercent"])["name"])

    client = cluster.s3.client()
    bucket, prefix = artifact_prefix(model_spec()["storage"]["uri"], artifact["key"])
    head = client.head_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)
    manifest = Manifest.parse(client.get_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)["Body"].read(),
                              artifact["key"])
    assert {m.name for m in manifest.quality.metrics} == set(metrics)
    assert manifest.quality.noiseFloorPercent is not None and manifest.quality.evalIdentity

    # A changed custom set limit changes the evaluation identity: one evaluation-only Job, no re-quantization.
    gate2 = {**gate, "customEval": {**gate["customEval"], "limit": 2}}
    models.patch_spec(namespace, "q", {"quantization": {"qualityGate": gate2}})
    models.wait(
        "the re-evaluation's figures in status",
        lambda: (a := models.get(namespace, "q")["status"].get("artifacts") or [{}])[0].get("quality", {}).get(
            "evalIdentity") not in (None, manifest.quality.evalIdentity) and a[0],
        timeout=900, namespace=namespace, name="q")
    models.wait_condition(namespace, "q", "QualityGatePassed", timeout=120)
    jobs = models.jobs(namespace)
    assert sorted(j.metadata.name.split("-")[1] for j in jobs) == ["evaluate", "quantize"], \
        [j.metadata.name for j in jobs]
    after = client.head_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)
    assert after["ETag"] == head["ETag"], "the artifact's manifest was rewritten"
    results = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}{QUALITY_DIR}/").get("Contents", [])
    assert len(results) == 1, results
    stored = json.loads(client.get_object(Bucket=bucket, Key=results[0]["Key"])["Body"].read())
    assert results[0]["Key"].endswith(f"{stored['evalIdentity']}.json")
    assert stored["metrics"][2]["samples"] == 2
    # The Deployment rolled out for the first verdict kept serving through the re-evaluation.
    models.wait_condition(namespace, "q", "Ready", timeout=600)
