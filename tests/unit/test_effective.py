"""Effective spec = spec ∘ policy defaults; rule violations name the rule and the field."""

from __future__ import annotations

import pytest

from fewerbits_api.policy import QuantizationPolicy
from fewerbits_api.quantizedmodel import StorageSpec
from fewerbits_operator.artifacts.effective import deep_merge, effective_spec, matching_policies

SPEC = {"source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "abc123"},
        "storage": {"uri": "s3://bkt/q"}}


def policy(name: str, spec: dict, priority: int = 0) -> QuantizationPolicy:
    return QuantizationPolicy.model_validate(
        {"metadata": {"name": name}, "spec": {"priority": priority, **spec}})


def test_deep_merge_spec_wins_nested():
    assert deep_merge({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": 3}, "l": [2]}) == {"a": {"b": 3, "c": 2}, "l": [2]}


def test_policy_defaults_fill_only_what_the_spec_leaves_out():
    p = policy("p", {"defaults": {"autoscaling": {"maxReplicas": 9, "scaleDownDelaySeconds": 60},
                                  "storage": {"uri": "s3://policy/bucket"}}})
    eff = effective_spec({**SPEC, "autoscaling": {"maxReplicas": 3}}, p)
    assert eff.accepted, eff.errors + eff.violations
    assert eff.spec.autoscaling.maxReplicas == 3          # the model's own value wins
    assert eff.spec.autoscaling.scaleDownDelaySeconds == 60  # the policy fills the gap
    assert eff.spec.storage.uri == "s3://bkt/q"


def test_policy_model_defaults_do_not_override_spec():
    # The policy author wrote only maxReplicas: pydantic defaults of other fields must not leak in.
    p = policy("p", {"defaults": {"autoscaling": {"maxReplicas": 9}}})
    eff = effective_spec({**SPEC, "autoscaling": {"targetKVCacheUsage": 0.5}}, p)
    assert eff.spec.autoscaling.targetKVCacheUsage == 0.5 and eff.spec.autoscaling.maxReplicas == 9


def test_storage_from_operator_default():
    spec = {k: v for k, v in SPEC.items() if k != "storage"}
    eff = effective_spec(spec, None, StorageSpec(uri="s3://default/x"))
    assert eff.accepted and eff.spec.storage.uri == "s3://default/x"
    eff = effective_spec(spec, None, None)
    assert not eff.accepted and eff.errors[0].startswith("spec.storage:")


def test_invalid_merged_spec_names_field():
    eff = effective_spec({**SPEC, "serving": {"maxModelLen": 5}}, None)
    assert eff.errors == ["spec.serving.maxModelLen: Input should be greater than or equal to 128"]


def test_policy_defaults_that_break_the_spec_are_reported():
    p = policy("p", {"defaults": {"autoscaling": {"minReplicas": 6}}})
    eff = effective_spec({**SPEC, "autoscaling": {"maxReplicas": 2}}, p)
    assert not eff.accepted
    assert eff.errors == ["spec.autoscaling: minReplicas (6) must be less than or equal to maxReplicas (2)"]


@pytest.mark.parametrize("rules, patch, expected", [
    ({"allowedFormats": ["fp8-dynamic"]}, {"quantization": {"format": "w4a16-awq"}},
     "policy p rule allowedFormats: spec.quantization.format w4a16-awq is not one of fp8-dynamic"),
    ({"allowedSources": ["hf://Qwen/*"]}, {}, "policy p rule allowedSources: spec.source.uri hf://meta-llama/Llama-3.1-8B"),
    ({"requireRevisionPin": True}, {"source": {"uri": "hf://a/b", "revision": None}}, "policy p rule requireRevisionPin"),
    ({"requireQualityGate": True}, {}, "policy p rule requireQualityGate: spec.quantization.qualityGate must be set"),
    ({"maxPerplexityIncreasePercent": 2}, {"quantization": {"qualityGate": {"maxPerplexityIncreasePercent": 5}}},
     "policy p rule maxPerplexityIncreasePercent: spec.quantization.qualityGate.maxPerplexityIncreasePercent 5 exceeds the ceiling 2"),
    ({"maxReplicas": 2}, {"autoscaling": {"maxReplicas": 3}}, "policy p rule maxReplicas: spec.autoscaling.maxReplicas 3 exceeds 2"),
    ({}, {"source": {"uri": "hf://a/b", "trustRemoteCode": True}}, "policy p rule allowTrustRemoteCode"),
    ({}, {"serving": {"extraArgs": ["--enforce-eager", "--quantization=awq"]}},
     "policy p rule allowedExtraArgs: spec.serving.extraArgs[1]: --quantization overrides the plan"),
    ({}, {"serving": {"extraArgs": ["--trust-remote-code"]}},
     "spec.serving.extraArgs[0]: --trust-remote-code changes what the server trusts"),
])
def test_rule_violations_name_rule_and_field(rules, patch, expected):
    eff = effective_spec(deep_merge(SPEC, patch), policy("p", {"rules": rules}))
    assert not eff.accepted
    assert any(expected in v for v in eff.violations), eff.violations


def test_allowed_extra_args_and_remote_code_pass_when_policy_allows():
    p = policy("p", {"rules": {"allowedExtraArgs": ["--trust-remote-code"], "allowTrustRemoteCode": True}})
    eff = effective_spec(deep_merge(SPEC, {"source": {"trustRemoteCode": True},
                                           "serving": {"extraArgs": ["--trust-remote-code", "--enforce-eager"]}}), p)
    assert eff.accepted, eff.violations


def test_without_policy_trust_flags_are_refused():
    eff = effective_spec(deep_merge(SPEC, {"serving": {"extraArgs": ["--kv-cache-dtype=fp8"]}}), None)
    assert eff.violations == ["spec.serving.extraArgs[0]: --kv-cache-dtype overrides the plan; a policy must list "
                              "it in rules.allowedExtraArgs"]


def test_matching_policies_by_namespace_then_priority():
    low = policy("a-low", {"namespaceSelector": {}}, priority=1)
    high = policy("z-high", {"namespaceSelector": {"matchLabels": {"team": "ml"}}}, priority=10)
    tie = policy("b-tie", {"namespaceSelector": {}}, priority=10)
    names = lambda ps: [p.metadata.name for p in ps]  # noqa: E731
    assert names(matching_policies([low, high, tie], {"team": "ml"})) == ["b-tie", "z-high", "a-low"]  # ties: name
    assert names(matching_policies([low, high], {"team": "web"})) == ["a-low"]
    assert matching_policies([high], {}) == []


def test_gate_falls_back_to_default():
    eff = effective_spec(SPEC, None)
    assert eff.gate().maxPerplexityIncreasePercent == 3.0


def test_extra_args_are_checked_against_vllm_rules():
    eff = effective_spec(deep_merge(SPEC, {"serving": {"extraArgs": ["--enforce-eager", "--max-num-seqs", "many",
                                                                     "--no-such-flag"]}}), None)
    assert not eff.accepted
    assert "spec.serving.extraArgs: --max-num-seqs 'many': must be an integer" in eff.errors
    assert any(e.startswith("spec.serving.extraArgs: --no-such-flag: not an option of vLLM") for e in eff.errors)


def test_unknown_builtin_dataset_is_named():
    eff = effective_spec(deep_merge(SPEC, {"quantization": {"calibration": {"dataset": "wikitext"}}}), None)
    assert eff.errors[0].startswith("spec.quantization.calibration.dataset: 'wikitext' is not a built-in dataset")


def test_namespace_patterns_include_and_exclude():
    from fewerbits_operator.base.kube import namespace_watched

    assert namespace_watched("t-abc", ["t-*"]) and not namespace_watched("demo", ["t-*"])
    assert namespace_watched("anything", [])
    assert not namespace_watched("team-test", ["team-*", "!team-test"]) and namespace_watched("team-a", ["team-*", "!team-test"])
    assert namespace_watched("prod", ["!dev"])


@pytest.mark.parametrize("args, flag", [
    (["--trust_remote_code"], "--trust_remote_code"),
    (["-tp", "8"], "-tp"),
    (["--tensor_parallel_size=8"], "--tensor_parallel_size"),
    (["--api_key", "x"], "--api_key"),
    (["--no-trust-remote-code"], "--no-trust-remote-code"),
])
def test_flag_spellings_and_aliases_cannot_slip_past_the_policy(args, flag):
    eff = effective_spec(deep_merge(SPEC, {"serving": {"extraArgs": args}}), policy("p", {}))
    assert not eff.accepted
    assert any(f"spec.serving.extraArgs[0]: {flag} " in v for v in eff.violations), eff.violations


def test_allowed_flag_covers_its_other_spellings():
    p = policy("p", {"rules": {"allowedExtraArgs": ["--tensor-parallel-size"]}})
    assert effective_spec(deep_merge(SPEC, {"serving": {"extraArgs": ["-tp", "2"]}}), p).accepted


def test_default_gate_is_lowered_to_the_policy_ceiling():
    eff = effective_spec(SPEC, policy("p", {"rules": {"maxPerplexityIncreasePercent": 1.0}}))
    assert eff.accepted and eff.gate().maxPerplexityIncreasePercent == 1.0
    eff = effective_spec(SPEC, policy("p", {"rules": {"maxPerplexityIncreasePercent": 5.0}}))
    assert eff.gate().maxPerplexityIncreasePercent == 3.0


def test_reported_errors_are_bounded_however_hostile_the_spec():
    # 32 pairs of a plan-owned flag with a 256-character value: 32 errors and 32 violations.
    args = ["--kv-cache-dtype", "a" * 256] * 32
    eff = effective_spec(deep_merge(SPEC, {"serving": {"extraArgs": args}}), None)
    assert not eff.accepted
    assert len(eff.errors) == 17 and eff.errors[-1] == "... and 16 more"
    assert len(eff.violations) == 17 and all(len(line) <= 600 for line in eff.errors + eff.violations)
    assert len("; ".join(eff.errors + eff.violations)) < 32768  # metav1.Condition message limit
