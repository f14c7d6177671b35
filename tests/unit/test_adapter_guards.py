"""LoRA adapters never widen what a model may reach or leak (docs/adapters.md): their endpoints are
guarded at admission and in the Job, their Secrets are masked in the Job's output, and an adapter
without a Secret is read anonymously, never with the Job's other credentials. And a model without
adapters is judged as before when it shares an artifact with one that has them."""

from __future__ import annotations

import pytest

from fewerbits_api.adapters import AdapterEvaluation, adapter_env
from fewerbits_api.artifact import ArtifactKeyInputs, QualityReport
from fewerbits_api.formats import QuantFormat
from fewerbits_api.jobcontract import QuantJobContract
from fewerbits_api.quality import answers, base_eval_identity, eval_identity
from fewerbits_api.quantizedmodel import QualityGateSpec
from fewerbits_operator.artifacts.quality_gate import needs_evaluation
from tests.unit.test_decide import PLAYS, SETTINGS, World, base_spec, decide

PLAYS_EVAL = AdapterEvaluation(name="plays", uri="s3://adapters/plays", evalDataset="general-en-heldout", evalSamples=8,
                               maxIncreasePercent=3.0, endpoint="http://169.254.169.254")


def contract(**over) -> QuantJobContract:
    ki = ArtifactKeyInputs(sourceUri="s3://models/m", format=QuantFormat.FP8_DYNAMIC)
    return QuantJobContract(key=ki.key(), keyInputs=ki, storage={"uri": "s3://bucket/p"}, **over)


def test_an_adapters_endpoint_is_refused_at_admission_naming_its_field():
    w = World(spec=base_spec(adapters=[{**PLAYS, "source": {**PLAYS["source"], "uri": "s3://adapters/plays",
                                                            "endpoint": "http://169.254.169.254"}}]))
    accepted = next(c for c in decide(w.observed(), SETTINGS).status.conditions if c.type == "Accepted")
    assert accepted.status == "False"
    assert "spec.adapters[0].source.endpoint: http://169.254.169.254 is refused" in accepted.message


def test_the_job_refuses_an_adapters_endpoint_before_connecting():
    from fewerbits_quantjob import errors, job
    from fewerbits_quantjob.errors import JobError

    with pytest.raises(JobError) as e:
        job.verify_endpoints(contract(adapters=[PLAYS_EVAL]), {})
    assert e.value.reason == errors.ENDPOINT_REFUSED and e.value.message.startswith("adapters[0].endpoint:")


def test_adapter_secrets_are_masked_in_the_jobs_output():
    from fewerbits_quantjob.report import redact, secret_values

    env = {adapter_env(3, "AWS_SECRET_ACCESS_KEY"): "s3cr3t-adapter", "PATH": "/bin"}
    assert secret_values(env) == {adapter_env(3, "AWS_SECRET_ACCESS_KEY"): "s3cr3t-adapter"}
    assert "s3cr3t-adapter" not in redact("failed with s3cr3t-adapter", secret_values(env))


def test_an_adapter_without_a_secret_is_read_anonymously():
    from botocore import UNSIGNED

    from fewerbits_quantjob.storage import s3_client

    assert s3_client("http://127.0.0.1:9", None, None, None, unsigned=True).meta.config.signature_version is UNSIGNED


def test_a_report_measured_with_adapters_answers_a_gate_without_them_and_not_the_reverse():
    plain = QualityGateSpec()
    with_adapters = plain.with_adapters([PLAYS_EVAL])
    measured = QualityReport(baselinePerplexity=10, perplexity=10.1, increasePercent=1, maxIncreasePercent=3, passed=True,
                             evalDataset="general-en-heldout", evalWindows=64, evalTokens=1000,
                             evalIdentity=eval_identity(with_adapters), baseEvalIdentity=base_eval_identity(with_adapters))
    assert base_eval_identity(with_adapters) == eval_identity(plain) == base_eval_identity(plain)
    assert answers(measured, plain) and answers(measured, with_adapters)
    assert not needs_evaluation(measured, plain)  # the model without adapters starts no Job
    without = measured.model_copy(update={"evalIdentity": eval_identity(plain), "baseEvalIdentity": None})
    assert not answers(without, with_adapters) and needs_evaluation(without, with_adapters)


def test_an_adapter_on_a_16_bit_pool_has_nothing_to_be_judged_against():
    from fewerbits_operator.planner.lora import AdapterFacts

    w = World(spec=base_spec(quantization={"format": "none"}, adapters=[PLAYS]),
              adapters=(AdapterFacts("plays", 16, ("q_proj",)),))
    w.publish()
    out = decide(w.observed(), SETTINGS)
    (pool,) = out.status.adapters[0].pools
    assert (pool.state, pool.increasePercent) == ("Passed", 0.0) and "16-bit base it was trained on" in pool.reason
    served = next(c for c in out.status.conditions if c.type == "AdaptersServed")
    assert served.reason == "AdaptersJudged"


def test_a_policys_source_rules_apply_to_each_adapter():
    from tests.unit.test_decide import policy

    w = World(spec=base_spec(adapters=[{"name": "plays", "source": {"uri": "hf://elsewhere/plays"}}]),
              policies=[policy(rules={"allowedSources": ["s3://models/*"], "requireRevisionPin": True})])
    accepted = next(c for c in decide(w.observed(), SETTINGS).status.conditions if c.type == "Accepted")
    assert accepted.status == "False"
    assert "spec.adapters[0].source.uri hf://elsewhere/plays matches none of s3://models/*" in accepted.message
    assert "spec.adapters[0].source.revision must pin the adapter's revision" in accepted.message


def test_removing_the_adapters_removes_their_condition_and_status():
    from fewerbits_operator.planner.lora import AdapterFacts

    w = World(spec=base_spec(adapters=[PLAYS]), adapters=(AdapterFacts("plays", 16, ("q_proj",)),))
    w.publish()
    w.settle()
    assert any(c["type"] == "AdaptersServed" for c in w.status["conditions"]) and w.status["adapters"]
    w.spec = base_spec()
    w.adapters = ()
    out = decide(w.observed(), SETTINGS)
    assert out.status.adapters is None and all(c.type != "AdaptersServed" for c in out.status.conditions)


def test_a_policys_quality_ceiling_caps_each_adapters_own_threshold():
    from tests.unit.test_decide import policy

    w = World(spec=base_spec(adapters=[{**PLAYS, "gate": {"maxPerplexityIncreasePercent": 8}},
                                       {**PLAYS, "name": "chat", "gate": {"maxPerplexityIncreasePercent": 1}}]),
              policies=[policy(rules={"maxPerplexityIncreasePercent": 2})])
    accepted = next(c for c in decide(w.observed(), SETTINGS).status.conditions if c.type == "Accepted")
    assert accepted.status == "False"
    assert "spec.adapters[0].gate.maxPerplexityIncreasePercent 8 exceeds the ceiling 2" in accepted.message
    assert "spec.adapters[1]" not in accepted.message


def test_an_adapters_s3_evaluation_set_is_pinned_by_its_etag():
    """Its ETag enters the evaluation identity (a changed set is measured again) and the Job refuses
    other content; unpinned, the identity is the one made before pins existed."""
    from fewerbits_api.adapters import adapter_evaluations
    from fewerbits_api.quantizedmodel import QuantizedModelSpec

    spec = QuantizedModelSpec.model_validate({**base_spec(), "adapters": [
        {**PLAYS, "gate": {"evalDataset": "s3://evals/plays.jsonl"}}]})
    gate = QualityGateSpec()
    (unpinned,) = adapter_evaluations(spec.adapters, gate)
    (pinned,) = adapter_evaluations(spec.adapters, gate, {"s3://evals/plays.jsonl": "e1"})
    (other,) = adapter_evaluations(spec.adapters, gate, {"s3://evals/plays.jsonl": "e2"})
    assert "evalDatasetEtag" not in unpinned.identity_doc() and pinned.evalDatasetEtag == "e1"
    identities = {eval_identity(gate.with_adapters([e])) for e in (unpinned, pinned, other)}
    assert len(identities) == 3


def test_the_job_refuses_an_adapters_evaluation_set_changed_since_the_operator_read_it(tmp_path, monkeypatch):
    from fewerbits_quantjob import adapters, fetch, textdata

    monkeypatch.setattr(fetch, "fetch_adapter", lambda a, i, c, env, dest: dest)
    monkeypatch.setattr(textdata, "load_texts", lambda *a, **k: textdata.TextSet(
        ["text"], "s3://evals/plays.jsonl", "0" * 64, details={"etag": "now"}))
    evaluation = PLAYS_EVAL.model_copy(update={"endpoint": None, "evalDataset": "s3://evals/plays.jsonl"})
    specs, failures = adapters.prepare(contract(adapters=[evaluation.model_copy(update={"evalDatasetEtag": '"then"'})]),
                                       {}, tmp_path, lambda: None)
    assert specs == [] and "differs from the ETag the operator read" in failures["plays"]
    specs, failures = adapters.prepare(contract(adapters=[evaluation.model_copy(update={"evalDatasetEtag": '"now"'})]),
                                       {}, tmp_path, lambda: None)
    assert [s.name for s in specs] == ["plays"] and failures == {}


def test_the_etag_observe_read_reaches_the_jobs_contract():
    from dataclasses import replace

    from fewerbits_operator.base.datapins import DataPin
    from fewerbits_operator.planner.lora import AdapterFacts
    from tests.unit.test_decide import _contract

    w = World(spec=base_spec(adapters=[{**PLAYS, "gate": {"evalDataset": "s3://evals/plays.jsonl"}}]),
              adapters=(AdapterFacts("plays", 16, ("q_proj",)),))
    w.publish()
    obs = replace(w.observed(), adapter_eval_pins=(DataPin("s3://evals/plays.jsonl", "e1"),))
    job = next(a.job for a in decide(obs, SETTINGS).actions if hasattr(a, "job"))
    assert [a["evalDatasetEtag"] for a in _contract(job)["adapters"]] == ["e1"]


def test_lora_flags_in_extra_args_are_refused_when_the_operator_sets_them_from_the_adapters():
    w = World(spec=base_spec(adapters=[PLAYS], serving={"extraArgs": ["--lora-modules", "x=/tmp/x", "--max-loras=4"],
                                                         "canary": {"enabled": False}}))
    accepted = next(c for c in decide(w.observed(), SETTINGS).status.conditions if c.type == "Accepted")
    assert accepted.status == "False"
    assert "spec.serving.extraArgs[0]: --lora-modules is set from spec.adapters" in accepted.message
    assert "spec.serving.extraArgs[2]: --max-loras is set from spec.adapters" in accepted.message
    without = World(spec=base_spec(serving={"extraArgs": ["--max-loras=4"], "canary": {"enabled": False}}))
    assert "spec.adapters" not in next(c for c in decide(without.observed(), SETTINGS).status.conditions
                                       if c.type == "Accepted").message


def test_adapters_served_once_the_pods_that_load_them_are_rolled_out():
    from tests.unit.test_decide import CreateDeployment, _adapter_results
    from fewerbits_operator.planner.lora import AdapterFacts

    w = World(spec=base_spec(adapters=[PLAYS]), adapters=(AdapterFacts("plays", 16, ("q_proj",)),))
    w.publish()
    _adapter_results({"plays": 0.4}, published=True)(w)
    first = decide(w.observed(), SETTINGS)
    served = next(c for c in first.status.conditions if c.type == "AdaptersServed")
    assert (served.status, served.reason) == ("False", "AdaptersJudged")
    d = dict(next(a.deployment for a in first.actions if isinstance(a, CreateDeployment)))
    d["metadata"] = {**d["metadata"], "resourceVersion": "5", "generation": 1}
    d["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
    w.deployments[d["metadata"]["name"]] = d
    second = decide(w.observed(), SETTINGS)
    served = next(c for c in second.status.conditions if c.type == "AdaptersServed")
    assert (served.status, served.reason) == ("True", "AdaptersJudged") and "served: plays" in served.message
    assert not [a for a in second.actions if isinstance(a, CreateDeployment)]
    assert second.status.adapters[0].pools[0].served
