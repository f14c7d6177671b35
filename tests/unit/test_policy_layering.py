"""Layered QuantizationPolicies (docs/policies.md): every matching policy applies; defaults are laid
over one another by priority, rules combine so the most restrictive wins; conflicts name both
policies. Plus the allow-list modes (PlanAndTrust, Strict) and allowedImages."""

from __future__ import annotations

from typing import Any

import pytest

from fewerbits_api.policy import QuantizationPolicy
from fewerbits_operator.artifacts.effective import combine_policies, deep_merge, effective_spec, effective_values, matching_policies

SPEC = {"source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "abc123"},
        "storage": {"uri": "s3://bkt/q"}}


def qp(name: str, priority: int = 0, rules: dict | None = None, defaults: dict | None = None,
       families: dict | None = None) -> QuantizationPolicy:
    return QuantizationPolicy.model_validate({"metadata": {"name": name}, "spec": {
        "priority": priority, "rules": rules or {}, "defaults": defaults or {}, "formatByGPUFamily": families or {}}})


def judge(policies: list[QuantizationPolicy], **patch: Any):
    return effective_spec(deep_merge(SPEC, patch), combine_policies(matching_policies(policies, {})))


BASE = qp("platform", 0, rules={"allowedSources": ["hf://meta-llama/*"], "maxPerplexityIncreasePercent": 3,
                                "maxGPUsPerReplica": 4, "maxReplicas": 8, "allowedFormats": ["fp8-dynamic", "w4a16-awq"]},
          defaults={"serving": {"replicas": 1, "maxModelLen": 8192}, "autoscaling": {"maxReplicas": 4}})
TEAM = qp("team", 10, rules={"maxPerplexityIncreasePercent": 5, "maxGPUsPerReplica": 2, "maxReplicas": 20,
                             "allowedFormats": ["w4a16-awq", "nvfp4"]},
          defaults={"serving": {"replicas": 2}})


# ---------------------------------------------------------------- combining


@pytest.mark.parametrize("rule, value, source", [
    ("maxPerplexityIncreasePercent", 3, "platform"),   # minimum of ceilings
    ("maxGPUsPerReplica", 2, "team"),                  # minimum of caps
    ("maxReplicas", 8, "platform"),
    ("allowedFormats", ["w4a16-awq"], "team, platform"),  # intersection of allow-lists
])
def test_rules_combine_most_restrictive_first(rule, value, source):
    c = combine_policies(matching_policies([BASE, TEAM], {}))
    got = getattr(c.rules, rule)
    assert ([f.value for f in got] if rule == "allowedFormats" else got) == value
    assert c.rule_sources[rule] == source


def test_defaults_layer_by_priority_with_sources():
    c = combine_policies(matching_policies([BASE, TEAM], {}))
    assert c.names == ("team", "platform")
    assert c.defaults == {"serving": {"replicas": 2, "maxModelLen": 8192}, "autoscaling": {"maxReplicas": 4}}
    assert c.default_sources == {("serving", "replicas"): "team", ("serving", "maxModelLen"): "platform",
                                 ("autoscaling", "maxReplicas"): "platform"}


def test_equal_priority_defaults_go_to_the_first_name():
    a, b = qp("a", 5, defaults={"serving": {"replicas": 3}}), qp("b", 5, defaults={"serving": {"replicas": 4}})
    c = combine_policies(matching_policies([b, a], {}))
    assert c.defaults["serving"]["replicas"] == 3 and c.default_sources[("serving", "replicas")] == "a"


def test_job_placement_layers_field_by_field_and_label_keys_keep_their_dots():
    low = qp("low", 0, rules={"quantizationJob": {"nodeSelector": {"pool.example.com/calib": "yes"}, "gpus": 2}})
    high = qp("high", 9, rules={"quantizationJob": {"gpus": 1}})
    c = combine_policies(matching_policies([low, high], {}))
    assert c.rules.quantizationJob.nodeSelector == {"pool.example.com/calib": "yes"}
    assert c.rules.quantizationJob.gpus == 1
    eff = effective_spec(SPEC, c)
    values = {v.path: (v.value, v.source) for v in effective_values(eff).values}
    assert values["rules.quantizationJob.nodeSelector.pool.example.com/calib"] == ("yes", "low")
    assert values["rules.quantizationJob.gpus"] == ("1", "high")


@pytest.mark.parametrize("settings, allowed", [
    ([{"allowTrustRemoteCode": True}], True),
    ([{"allowTrustRemoteCode": True}, {}], True),                       # unset: no say
    ([{"allowTrustRemoteCode": True}, {"allowTrustRemoteCode": False}], False),  # false beats true
    ([{}], False),
])
def test_permissions_false_beats_true(settings, allowed):
    policies = [qp(f"p{i}", i, rules=r) for i, r in enumerate(settings)]
    eff = judge(policies, source={"trustRemoteCode": True})
    assert eff.accepted is allowed, eff.violations


def test_both_policies_constrain_the_model():
    eff = judge([BASE, TEAM], source={"uri": "hf://Qwen/Qwen2-7B"}, quantization={"format": "nvfp4"},
                autoscaling={"enabled": True, "maxReplicas": 10})
    assert any(v.startswith("policy platform rule allowedSources") for v in eff.violations)
    assert any(v.startswith("policy team, platform rule allowedFormats") for v in eff.violations)
    assert any(v.startswith("policy platform rule maxReplicas") for v in eff.violations)


def test_disjoint_allow_lists_allow_nothing_and_name_both():
    a, b = qp("a", 1, rules={"allowedFormats": ["nvfp4"]}), qp("b", 2, rules={"allowedFormats": ["fp8-dynamic"]})
    eff = judge([a, b])
    assert not eff.accepted
    assert eff.violations[0].startswith("policies b and a conflict: rules.allowedFormats: b allows fp8-dynamic; "
                                        "a allows nvfp4: no format in common")


def test_format_by_family_conflict_only_at_equal_priority():
    a = qp("a", 5, families={"hopper": "fp8-dynamic"})
    b = qp("b", 5, families={"hopper": "w4a16-awq"})
    c = combine_policies(matching_policies([a, b], {}))
    assert [(x.policies, x.message) for x in c.conflicts] == [
        (("a", "b"), "formatByGPUFamily.hopper: a sets fp8-dynamic, b sets w4a16-awq, both at priority 5")]
    assert not judge([a, b]).accepted
    higher = qp("b", 6, families={"hopper": "w4a16-awq"})
    c = combine_policies(matching_policies([a, higher], {}))
    assert c.conflicts == () and c.format_by_gpu_family["hopper"].value == "w4a16-awq"
    assert c.policy_spec().formatByGPUFamily["hopper"].value == "w4a16-awq"


def test_no_policy_is_no_policy():
    c = combine_policies([])
    assert not c.governed and effective_values(effective_spec(SPEC, c)) is None


# ---------------------------------------------------------------- extraArgs modes

STRICT = qp("strict", rules={"extraArgsMode": "Strict", "allowedExtraArgs": ["--max-num-seqs", "--kv-cache-dtype"]})
LISTED = qp("listed", rules={"allowedExtraArgs": ["--max-num-seqs"]})


@pytest.mark.parametrize("args", [
    ["--enforce-eager"], ["--enforce_eager"], ["--max-num-seqs", "8", "--enforce-eager"],
    ["--swap-space=4"], ["--swap_space", "4"],
])
def test_strict_refuses_every_unlisted_flag_in_every_spelling(args):
    eff = judge([STRICT], serving={"extraArgs": args})
    assert not eff.accepted
    assert any("rule allowedExtraArgs" in v and "extraArgsMode Strict" in v for v in eff.violations), eff.violations


@pytest.mark.parametrize("args", [
    ["--max-num-seqs", "8"], ["--max-num-seqs=8"], ["--max_num_seqs", "8"], ["--kv-cache-dtype=fp8"],
])
def test_strict_passes_listed_flags_in_every_spelling(args):
    eff = judge([STRICT], serving={"extraArgs": args})
    assert eff.accepted, eff.errors + eff.violations


@pytest.mark.parametrize("args, ok", [
    (["--enforce-eager"], True),                   # neither plan- nor trust-changing: passes
    (["--max-num-seqs=8"], True),
    (["--kv-cache-dtype", "fp8"], False),          # plan-owned, not listed
    (["--kv_cache_dtype=fp8"], False),
    (["--trust-remote-code"], False),
])
def test_plan_and_trust_mode_lists_only_plan_and_trust_flags(args, ok):
    eff = judge([LISTED], serving={"extraArgs": args})
    assert eff.accepted is ok, eff.violations


def test_strict_without_a_list_allows_no_flag_and_lists_intersect():
    assert not judge([qp("s", rules={"extraArgsMode": "Strict"})], serving={"extraArgs": ["--enforce-eager"]}).accepted
    # A plan-owned flag listed by one policy but not another that keeps a list: refused, by that one.
    a = qp("a", 1, rules={"allowedExtraArgs": ["--kv-cache-dtype"]})
    b = qp("b", 2, rules={"allowedExtraArgs": ["--max-num-seqs"]})
    eff = judge([a, b], serving={"extraArgs": ["--kv-cache-dtype=fp8"]})
    assert eff.violations == ["policy b rule allowedExtraArgs: spec.serving.extraArgs[0]: --kv-cache-dtype overrides "
                              "the plan and is not listed in rules.allowedExtraArgs"]
    # A Strict baseline makes the team's flags strict too.
    eff = judge([qp("base", 0, rules={"extraArgsMode": "Strict", "allowedExtraArgs": ["--max-num-seqs"]}),
                 qp("team", 9, rules={"allowedExtraArgs": ["--max-num-seqs", "--enforce-eager"]})],
                serving={"extraArgs": ["--enforce-eager"]})
    assert eff.violations == ["policy base rule allowedExtraArgs: spec.serving.extraArgs[0]: --enforce-eager is not "
                              "listed in rules.allowedExtraArgs (extraArgsMode Strict: only listed flags pass)"]


# ---------------------------------------------------------------- allowedImages

IMAGES = qp("images", rules={"allowedImages": ["registry.example.com/vllm/*", "vllm/vllm-openai@sha256:*"]})


@pytest.mark.parametrize("image, ok", [
    (None, True),                                        # the operator's own image
    ("registry.example.com/vllm/vllm-openai:v0.11.0", True),
    ("vllm/vllm-openai@sha256:" + "a" * 64, True),
    ("vllm/vllm-openai:latest", False),
    ("evil.example.com/registry.example.com/vllm/x", False),
])
def test_allowed_images(image, ok):
    eff = judge([IMAGES], serving={"image": image} if image else {})
    assert eff.accepted is ok, eff.violations
    if not ok:
        assert eff.violations == [f"policy images rule allowedImages: spec.serving.image {image} matches none of "
                                  "registry.example.com/vllm/*, vllm/vllm-openai@sha256:*"]


def test_images_must_pass_every_policy_with_a_list():
    other = qp("other", 5, rules={"allowedImages": ["registry.example.com/vllm/vllm-openai:v0.11.*"]})
    assert judge([IMAGES, other], serving={"image": "registry.example.com/vllm/vllm-openai:v0.11.0"}).accepted
    eff = judge([IMAGES, other], serving={"image": "registry.example.com/vllm/vllm-openai:v0.10.0"})
    assert [v.split(":")[0] for v in eff.violations] == ["policy other rule allowedImages"]


def test_status_effective_stays_within_the_crd_limits_however_long_the_label_key():
    key = "a" * 63 + "." + "b" * 189 + "/" + "c" * 63  # a label key as long as Kubernetes allows
    p = qp("p" * 253, rules={"quantizationJob": {"nodeSelector": {key: "v" * 63}},
                             "allowedSources": ["hf://" + "x" * 500]})
    eff = effective_spec(deep_merge(SPEC, {"source": {"uri": "hf://" + "x" * 500}}), combine_policies([p]))
    values = effective_values(eff).values
    assert all(len(v.path) <= 256 and len(v.value) <= 256 and len(v.source) <= 512 for v in values)


def test_pool_cost_weights_combine_per_key_highest_priority_first():
    low = qp("platform", 0, rules={"poolCostWeights": {"NVIDIA-L4": 0.3, "NVIDIA-A100-SXM4-80GB": 0.6}})
    high = qp("team", 10, rules={"poolCostWeights": {"NVIDIA-L4": 0.25}})
    c = combine_policies(matching_policies([low, high], {}))
    assert c.rules.poolCostWeights == {"NVIDIA-L4": 0.25, "NVIDIA-A100-SXM4-80GB": 0.6}
    assert c.rule_sources["poolCostWeights.NVIDIA-L4"] == "team"
    assert c.rule_sources["poolCostWeights.NVIDIA-A100-SXM4-80GB"] == "platform"
