"""Keys that name the calibration data's bytes (issue 16, item 3): an S3 object's ETag, read by
observe, is part of the key; a Hub dataset is pinned by its revision; a policy may refuse unpinned
data; unreadable data is named before any Job starts. Pure: ``decide`` on hand-built facts."""

from __future__ import annotations

import json
from dataclasses import replace

from fewerbits_operator.artifacts.keys import planned_artifacts
from fewerbits_operator.base.datapins import DataPin, unpinned_data
from fewerbits_operator.base.observed import ArtifactFacts
from fewerbits_operator.core.decide import CreateJob, decide
from fewerbits_api.quantizedmodel import QuantizedModelSpec

from tests.unit.test_decide import SETTINGS, World, base_spec, policy

DATA = "s3://data/calib.jsonl"


def gptq_world(dataset: str = DATA) -> World:
    return World(spec=base_spec(quantization={"format": "w4a16-gptq", "calibration": {"dataset": dataset}}))


def decided(w: World, pin: DataPin | None = None, error: str | None = None):
    acc, the_plan, _ = w.planned()
    obs = replace(w.observed(), data_pin=pin, data_error=error)
    # observe keyed the facts by the key the pin gives: nothing published, no Job
    obs = replace(obs, artifacts={a.key: ArtifactFacts() for a in planned_artifacts(acc.spec, the_plan, pin)})
    return decide(obs, SETTINGS)


def jobs(out) -> list[CreateJob]:
    return [a for a in out.actions if isinstance(a, CreateJob)]


def test_the_etag_is_part_of_the_key():
    a = decided(gptq_world(), DataPin(DATA, "etag-a"))
    b = decided(gptq_world(), DataPin(DATA, "etag-b"))
    again = decided(gptq_world(), DataPin(DATA, "etag-a", version_id="v2"))  # same bytes, uploaded again
    (ka,), (kb,), (kc,) = ([x.key for x in o.status.artifacts] for o in (a, b, again))
    assert ka != kb and ka == kc
    (job,) = jobs(a)
    env = {e["name"]: e.get("value") for e in job.job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env["FEWERBITS_JOB_CONTRACT"])["keyInputs"]["calibrationDatasetHash"] == "etag-a"
    cal = again.status.calibrationData
    assert (cal.dataset, cal.pinned, cal.etag, cal.versionId) == (DATA, True, "etag-a", "v2")


def test_unreadable_data_is_named_before_any_job():
    out = decided(gptq_world(), None, f"{DATA} does not exist")
    assert jobs(out) == []
    q = {c.type: c for c in out.status.conditions}["Quantized"]
    assert q.status == "False" and q.reason == "CalibrationDataUnavailable"
    assert "spec.quantization.calibration.dataset" in q.message and "does not exist" in q.message
    assert out.status.calibrationData.pinned is False


def test_formats_without_calibration_data_do_not_read_it():
    w = World(spec=base_spec(quantization={"format": "fp8-dynamic", "calibration": {"dataset": DATA}}))
    out = decided(w, None, "never read")
    assert len(jobs(out)) == 1 and out.status.calibrationData is None


def test_a_policy_requiring_pins_refuses_an_unpinned_hub_dataset():
    w = gptq_world("hf://datasets/org/calib")
    w.policies = [policy(rules={"requirePinnedData": True})]
    out = decided(w)
    a = {c.type: c for c in out.status.conditions}["Accepted"]
    assert a.status == "False" and a.reason == "PolicyViolation"
    assert "rule requirePinnedData" in a.message and "spec.quantization.calibration.dataset" in a.message
    assert "hf://datasets/org/calib@<commit>" in a.message
    pinned = gptq_world("hf://datasets/org/calib@0123abcd")
    pinned.policies = w.policies
    out = decided(pinned)
    assert {c.type: c for c in out.status.conditions}["Accepted"].status == "True"
    assert out.status.calibrationData.revision == "0123abcd" and len(jobs(out)) == 1


def test_unpinned_lists_each_field():
    spec = QuantizedModelSpec.model_validate(base_spec(quantization={
        "calibration": {"dataset": "hf://datasets/a/b"},
        "qualityGate": {"evalDataset": "hf://datasets/c/d"}}))
    assert [u.split(" ")[0] for u in unpinned_data(spec)] == [
        "spec.quantization.calibration.dataset", "spec.quantization.qualityGate.evalDataset"]


# ------------------------------------------------------------------ evaluation sets by content (issue 31)
EVAL = "s3://data/eval.jsonl"


def decided_with_eval(w: World, eval_pin: DataPin | None):
    acc, the_plan, _ = w.planned()
    obs = replace(w.observed(), eval_pin=eval_pin,
                  artifacts={a.key: ArtifactFacts() for a in planned_artifacts(acc.spec, the_plan)})
    return decide(obs, SETTINGS)


def eval_world() -> World:
    return World(spec=base_spec(quantization={"format": "fp8-dynamic", "qualityGate": {
        "maxPerplexityIncreasePercent": 5, "evalDataset": EVAL}}))


def test_an_s3_evaluation_set_enters_the_evaluation_identity_by_its_etag():
    from fewerbits_api.quality import eval_identity
    from fewerbits_api.quantizedmodel import QualityGateSpec

    gate = QualityGateSpec(evalDataset=EVAL)
    a, b = gate.pinned("etag-a"), gate.pinned("etag-b")
    assert len({eval_identity(gate), eval_identity(a), eval_identity(b)}) == 3
    assert eval_identity(gate.pinned("etag-a")) == eval_identity(a)  # same bytes, same identity
    # The pin is no part of the spec: a built-in set's identity is what it was before pins existed.
    builtin = QualityGateSpec()
    assert eval_identity(builtin.pinned(None)) == eval_identity(builtin)
    assert "etag" not in a.model_dump_json()


def test_the_job_contract_carries_the_pin_and_both_sides_compute_one_identity():
    from fewerbits_api.jobcontract import QuantJobContract
    from fewerbits_api.quality import eval_identity

    out = decided_with_eval(eval_world(), DataPin(EVAL, "etag-a"))
    (job,) = jobs(out)
    env = {e["name"]: e.get("value") for e in job.job["spec"]["template"]["spec"]["containers"][0]["env"]}
    contract = QuantJobContract.model_validate_json(env["FEWERBITS_JOB_CONTRACT"])
    assert contract.evalDatasetEtag == "etag-a"
    operator_gate = QuantizedModelSpec.model_validate(eval_world().spec).quantization.qualityGate.pinned("etag-a")
    assert eval_identity(contract.qualityGate) == eval_identity(operator_gate)


def test_changed_evaluation_data_needs_a_new_evaluation():
    from fewerbits_api.artifact import QualityReport
    from fewerbits_api.quality import eval_identity
    from fewerbits_operator.artifacts.quality_gate import needs_evaluation

    gate = QuantizedModelSpec.model_validate(eval_world().spec).quantization.qualityGate
    measured = QualityReport(baselinePerplexity=10.0, perplexity=10.1, increasePercent=1.0, maxIncreasePercent=5,
                             passed=True, evalDataset=EVAL, evalWindows=8, evalTokens=1024,
                             evalIdentity=eval_identity(gate.pinned("etag-a")))
    assert not needs_evaluation(measured, gate.pinned("etag-a"))
    assert needs_evaluation(measured, gate.pinned("etag-b"))


def test_the_job_refuses_an_evaluation_set_that_changed_since_the_operator_read_it():
    import pytest

    from fewerbits_quantjob import errors
    from fewerbits_quantjob.errors import JobError
    from fewerbits_quantjob.job import verify_eval_etag
    from fewerbits_quantjob.textdata import TextSet

    loaded = TextSet(texts=["x"], source=EVAL, sha256="0" * 64, details={"etag": "etag-b"})
    verify_eval_etag(None, loaded, EVAL)
    verify_eval_etag('"etag-b"', loaded, EVAL)
    with pytest.raises(JobError) as e:
        verify_eval_etag("etag-a", loaded, EVAL)
    assert e.value.reason == errors.DATASET_CHANGED and e.value.message.startswith(f"qualityGate.evalDataset {EVAL}:")
