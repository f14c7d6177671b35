"""Quality-gate inputs that mean what they say (issue 31 item 9): one threshold per benchmark task
and metric, and an evaluation set that is not the calibration data. The models refuse them with a
message naming the field; the CRD carries the same rules as CEL (tests/integration/
test_hostile_input.py applies them to the real API server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fewerbits_api.crdgen import quantizedmodel_crd
from fewerbits_api.datasets import AUTO_HUB_DATASET
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
    # One Hub set: only two different named splits are apart. A reader without a named split falls
    # back (evaluation: test, validation, train, then the first; calibration: train, then the first),
    # so on a set with only a `train` split both read it.
    ("hf://datasets/org/set", "hf://datasets/org/set", True),
    ("hf://datasets/org/set#c/train", "hf://datasets/org/set#c", True),  # the train-only set
    ("hf://datasets/org/set#c", "hf://datasets/org/set#c/test", True),  # a set without train: its first split
    ("hf://datasets/org/set#c/train", "hf://datasets/org/set#c/test", False),
    ("hf://datasets/org/set#c/train", "hf://datasets/org/set#c/train", True),
    ("hf://datasets/org/set", "hf://datasets/org/set#default/train", False),  # another configuration name
    ("hf://datasets/org/set#default", "hf://datasets/org/set#default/train", True),
    ("hf://datasets/org/set#c/test", "hf://datasets/org/set#c", True),
    ("hf://datasets/org/set@v1#c/train", "hf://datasets/org/set@v2#c/train", False),  # another revision
    ("hf://datasets/org/set", "hf://datasets/other/set", False),
    # `auto` reads the pinned Hub set's train_sft split (or the built-in general-en).
    ("auto", AUTO_HUB_DATASET, True),
    ("auto", AUTO_HUB_DATASET.rsplit("/", 1)[0], True),  # its set, no split named
    ("auto", AUTO_HUB_DATASET.replace("/train_sft", "/test_sft"), False),
    ("auto", "general-en", True),
])
def test_overlap_is_judged_by_identity(calibration, evaluation, overlaps):
    assert (eval_overlaps_calibration(calibration, evaluation) is not None) == overlaps


def test_a_hub_set_read_without_a_split_is_refused_naming_the_field_and_the_fix():
    """Issue 47: the same Hub set with no split named on the evaluation side (or a set with only a
    train split) was accepted, and the evaluation then read the calibration rows."""
    why = eval_overlaps_calibration("hf://datasets/org/set@abc#c/train", "hf://datasets/org/set@abc#c")
    assert why.startswith("qualityGate.evalDataset 'hf://datasets/org/set@abc#c' and calibration.dataset "
                          "'hf://datasets/org/set@abc#c/train' read the same Hub dataset, and qualityGate.evalDataset "
                          "names no split")
    assert "evaluation: test, validation, train, then the first split" in why
    assert "hf://datasets/org/set@abc#c/train to calibrate and hf://datasets/org/set@abc#c/test to evaluate" in why
    both = eval_overlaps_calibration("hf://datasets/org/set", "hf://datasets/org/set")
    assert "qualityGate.evalDataset and calibration.dataset name no split" in both
    same = eval_overlaps_calibration("hf://datasets/org/set#c/test", "hf://datasets/org/set#c/test")
    assert "both read its split 'test'" in same
    pinned = eval_overlaps_calibration("auto", AUTO_HUB_DATASET.rsplit("/", 1)[0])
    assert "name another split of it in qualityGate.evalDataset (`auto` calibrates on 'train_sft')" in pinned
    with pytest.raises(ValidationError) as e:  # the spec refuses it, naming the field
        QuantizationSpec.model_validate({"calibration": {"dataset": "hf://datasets/org/set@abc#c/train"},
                                         "qualityGate": {"evalDataset": "hf://datasets/org/set@abc#c"}})
    assert "qualityGate.evalDataset 'hf://datasets/org/set@abc#c'" in str(e.value)
    QuantizationSpec.model_validate({"calibration": {"dataset": "hf://datasets/org/set@abc#c/train"},
                                     "qualityGate": {"evalDataset": "hf://datasets/org/set@abc#c/test"}})


def test_the_readers_fall_back_to_the_splits_the_check_names(monkeypatch):
    """The check's split fallbacks are the readers' own (fewerbits_api.datasets): a train-only set
    read for evaluation without a split is its train split."""
    import datasets

    from fewerbits_api.datasets import CALIBRATION_SPLITS, EVALUATION_SPLITS
    from fewerbits_quantjob import textdata

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: {"train": [{"text": "a calibration row"}]})
    evaluated = textdata.load_texts("hf://datasets/org/set@abc", {}, splits=EVALUATION_SPLITS)
    calibrated = textdata.load_texts("hf://datasets/org/set@abc", {}, splits=CALIBRATION_SPLITS)
    assert evaluated.details["split"] == calibrated.details["split"] == "train"
    assert evaluated.texts == calibrated.texts


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
