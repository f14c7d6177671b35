"""The artifact key names the calibration data's bytes (issue 16, item 3), on the real control plane
with MinIO: the operator HEADs the S3 calibration object and hashes its ETag into the key. The same
bytes uploaded again keep the key (no new Job); changed bytes are a new key and one new Job.

Simulator: the verdict is the key and the Jobs (the ETag the operator reads, the Jobs it creates);
once quantized, each model is served with the operator's default vLLM image, played by
llm-d-inference-sim, and nothing it answers is looked at."""

from __future__ import annotations

import pytest

from tests.integration.test_operator import model_reconciles

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

LINES = [f'{{"text": "Calibration paragraph {i}: the quick brown fox jumps over the lazy dog, again and again."}}'
         for i in range(16)]


def quantized_key(models, namespace: str, name: str, not_key: str | None = None) -> str:
    def check():
        status = models.get(namespace, name).get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions") or []}
        q = conds.get("Quantized") or {}
        arts = status.get("artifacts") or []
        if q.get("status") == "True" and len(arts) == 1 and arts[0]["key"] != not_key:
            return arts[0]["key"]
        return None
    return models.wait(f"{namespace}/{name} quantized" + (" at a new key" if not_key else ""), check, timeout=600,
                       namespace=namespace, name=name)


def test_changed_calibration_data_is_a_new_key_and_the_same_bytes_are_not(cluster, gpu_pool, namespace, models,
                                                                           model_spec):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    s3 = cluster.s3.client()
    data_key = f"{namespace}/calibration.jsonl"
    body = ("\n".join(LINES) + "\n").encode()
    s3.put_object(Bucket="base-models", Key=data_key, Body=body)
    uri = f"s3://base-models/{data_key}"
    models.apply(namespace, "calib", model_spec(quantization={
        "format": "w4a16-gptq", "calibration": {"dataset": uri, "samples": 16, "maxSeqLength": 64}}))
    first = quantized_key(models, namespace, "calib")
    status = models.get(namespace, "calib")["status"]
    etag = s3.head_object(Bucket="base-models", Key=data_key)["ETag"].strip('"')
    assert status["calibrationData"] == {"dataset": uri, "pinned": True, "etag": etag}
    assert len(models.jobs(namespace)) == 1

    # The same bytes again: the same ETag, the same key; two more reconciles start nothing.
    s3.put_object(Bucket="base-models", Key=data_key, Body=body)
    seen = model_reconciles(models, namespace, "calib")
    models.wait("two more reconciles", lambda: model_reconciles(models, namespace, "calib") >= seen + 2, timeout=60,
                namespace=namespace, name="calib")
    assert len(models.jobs(namespace)) == 1
    assert models.get(namespace, "calib")["status"]["artifacts"][0]["key"] == first

    # Changed bytes: a new key, exactly one new Job, and its manifest names the new ETag.
    s3.put_object(Bucket="base-models", Key=data_key, Body=("\n".join(reversed(LINES)) + "\n").encode())
    second = quantized_key(models, namespace, "calib", not_key=first)
    jobs = models.jobs(namespace)
    assert len(jobs) == 2
    assert {j.metadata.annotations["fewerbits.io/artifact-key"] for j in jobs} == {first, second}
    new_etag = s3.head_object(Bucket="base-models", Key=data_key)["ETag"].strip('"')
    assert models.get(namespace, "calib")["status"]["calibrationData"]["etag"] == new_etag != etag


def test_unreadable_calibration_data_is_named_before_any_job(gpu_pool, namespace, models, model_spec):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    models.apply(namespace, "nodata", model_spec(quantization={
        "format": "w4a16-gptq",
        "calibration": {"dataset": f"s3://base-models/{namespace}/missing.jsonl", "samples": 16, "maxSeqLength": 64}}))
    c = models.wait_condition(namespace, "nodata", "Quantized", status="False", reason="CalibrationDataUnavailable",
                              timeout=120)
    assert "spec.quantization.calibration.dataset" in c["message"] and "missing.jsonl" in c["message"]
    assert models.jobs(namespace) == []
