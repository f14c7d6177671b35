"""Quality-gate inputs that mean what they say (issue 31 item 9): one threshold per benchmark task
and metric, and an evaluation set that is not the calibration data. The models refuse them with a
message naming the field; the CRD carries the same rules as CEL (tests/integration/
test_hostile_input.py applies them to the real API server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fewerbits_api.crdgen import quantizedmodel_crd
from fewerbits_api.quality import eval_overlaps_calibration
from fewerbits_api.quantizedmodel import QualityGateSpec, QuantizationSpec, QuantizedModelSpec


def _spec(quantization: dict) -> dict:
    return {"source": {"uri": "hf://a/b"}, "storage": {"uri": "s3://bkt/q"}, "quantization": quantization}


def test_a_task_listed_twice_with_the_same_metric_is_refused_naming_both_entries():
    with pytest.raises(ValidationError) as e:
        QualityGateSpec.model_validate({"benchmarks": [
            {"task": "arc_easy", "minRecoveryPercent": 99}, {"task": "hellaswag"},
            {"task": "arc_easy", "minRecoveryPercent": 90}]})
    text = str(e.value)
    assert "benchmarks[0] and benchmarks[2] both check task 'arc_easy' metric 'acc'" in text
    assert "minRecoveryPercent 99 and 90" in text


def test_the_same_task_with_two_metrics_is_two_checks():
    gate = QualityGateSpec.model_validate({"benchmarks": [
        {"task": "arc_easy", "metric": "acc"}, {"task": "arc_easy", "metric": "acc_norm"}]})
    assert len(gate.benchmarks) == 2


@pytest.mark.parametrize("calibration, evaluation, overlaps", [
    ("general-en", "general-en", True),
    ("general-en", "general-en-heldout", False),
    ("s3://bkt/data.jsonl", "s3://bkt/data.jsonl", True),
    ("s3://bkt/data.jsonl", "s3://bkt/other.jsonl", False),
    # Hub sets: calibration reads `train`, evaluation `test` when no split is named.
    ("hf://datasets/org/set", "hf://datasets/org/set", False),
    ("hf://datasets/org/set", "hf://datasets/org/set#default/train", False),  # another configuration name
    ("hf://datasets/org/set#default", "hf://datasets/org/set#default/train", True),
    ("hf://datasets/org/set#c/test", "hf://datasets/org/set#c", True),
    ("hf://datasets/org/set@v1#c/train", "hf://datasets/org/set@v2#c/train", False),  # another revision
])
def test_overlap_is_judged_by_identity(calibration, evaluation, overlaps):
    assert (eval_overlaps_calibration(calibration, evaluation) is not None) == overlaps


def test_an_eval_set_equal_to_the_calibration_set_is_refused_naming_the_field():
    with pytest.raises(ValidationError) as e:
        QuantizedModelSpec.model_validate(_spec({"format": "w4a16-gptq", "qualityGate": {"evalDataset": "general-en"}}))
    assert "qualityGate.evalDataset 'general-en' is the calibration data (calibration.dataset 'auto')" in str(e.value)
    with pytest.raises(ValidationError) as e:  # named explicitly, the same
        QuantizedModelSpec.model_validate(_spec({"format": "w4a16-gptq", "qualityGate": {"evalDataset": "general-en"},
                                                 "calibration": {"dataset": "general-en"}}))
    assert "(calibration.dataset 'general-en')" in str(e.value)
    with pytest.raises(ValidationError):  # auto may calibrate on some pool
        QuantizationSpec.model_validate({"calibration": {"dataset": "s3://b/c.jsonl"},
                                         "qualityGate": {"evalDataset": "s3://b/c.jsonl"}})
    # A data-free format reads no calibration data: nothing to overlap.
    QuantizationSpec.model_validate({"format": "fp8-dynamic", "qualityGate": {"evalDataset": "general-en"}})
    # Without a gate the defaults apply, and they do not overlap.
    assert QuantizationSpec().qualityGate is None


def test_the_crd_carries_both_rules_as_cel():
    schema = quantizedmodel_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    quantization = schema["properties"]["spec"]["properties"]["quantization"]
    (rule,) = [r for r in quantization["x-kubernetes-validations"] if "evalDataset" in r["rule"]]
    assert rule["fieldPath"] == ".qualityGate.evalDataset" and "'fp8-dynamic'" in rule["rule"]
    benchmarks = quantization["properties"]["qualityGate"]["properties"]["benchmarks"]
    assert any("exists_one" in r["rule"] for r in benchmarks["x-kubernetes-validations"])
