"""The API models: valid specs pass, invalid ones fail with a message that names the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from fewerbits_api.artifact import QUANTJOB_TOOL_VERSIONS, ArtifactKeyInputs, Manifest, ManifestFile, artifact_prefix
from fewerbits_api.conditions import Condition, set_condition
from fewerbits_api.errors import format_validation_error
from fewerbits_api.formats import FORMAT_FACTS, QuantFormat
from fewerbits_api.jobcontract import QuantJobContract
from fewerbits_api.policy import LabelSelector, QuantizationPolicy, QuantizationPolicySpec
from fewerbits_api.quantizedmodel import QuantizedModel, QuantizedModelSpec

REPO = Path(__file__).resolve().parents[2]
SAMPLES = sorted((REPO / "crds" / "samples").glob("*.yaml"))
MINIMAL = {"source": {"uri": "hf://meta-llama/Llama-3.1-8B"}}


def spec_errors(patch: dict) -> list[str]:
    """Validate MINIMAL deep-merged with patch; return the formatted error lines."""

    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
        return out

    with pytest.raises(ValidationError) as exc:
        QuantizedModelSpec.model_validate(merge(MINIMAL, patch))
    return format_validation_error(exc.value, prefix="spec")


def test_samples_exist_for_every_required_case():
    names = {p.stem for p in SAMPLES}
    assert {"fp8-on-hopper", "heterogeneous", "awq-on-ampere", "platform-policy"} <= names


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_sample_loads_through_the_models(path: Path):
    for doc in yaml.safe_load_all(path.read_text()):
        model = {"QuantizedModel": QuantizedModel, "QuantizationPolicy": QuantizationPolicy}[doc["kind"]]
        obj = model.model_validate(doc)
        # Round trip: what we would write back is what was read (no field lost or renamed).
        again = model.model_validate(obj.to_wire())
        assert again == obj


def test_minimal_spec_gets_documented_defaults():
    spec = QuantizedModelSpec.model_validate(MINIMAL)
    assert spec.quantization.format is QuantFormat.AUTO
    assert spec.quantization.ignore == ["lm_head"]
    assert spec.quantization.calibration.samples == 512
    assert spec.serving.gpuMemoryUtilization == 0.9
    assert spec.autoscaling.targetKVCacheUsage == 0.7
    assert spec.autoscaling.scaleDownDelaySeconds == 300


@pytest.mark.parametrize(
    "patch, field, words",
    [
        ({"source": {"uri": "ftp://x/y"}}, "spec.source.uri", "pattern"),
        ({"source": {"uri": "s3://bucket/a/../../etc"}}, "spec.source.uri", "'..'"),
        ({"source": {"uri": "hf://org/name", "revision": "main;rm -rf /"}}, "spec.source.revision", "pattern"),
        ({"source": {"uri": "hf://org/name", "credentialsSecret": "Bad_Name"}}, "spec.source.credentialsSecret", "pattern"),
        ({"quantization": {"format": "int3"}}, "spec.quantization.format", "fp8-dynamic"),
        ({"quantization": {"kvCache": "int8"}}, "spec.quantization.kvCache", "'fp8'"),
        ({"quantization": {"calibration": {"samples": 0}}}, "spec.quantization.calibration.samples", "greater than or equal to 1"),
        ({"quantization": {"calibration": {"dataset": "s3://b/x.csv"}}}, "spec.quantization.calibration.dataset", "pattern"),
        ({"quantization": {"qualityGate": {"maxPerplexityIncreasePercent": 0}}},
         "spec.quantization.qualityGate.maxPerplexityIncreasePercent", "greater than 0"),
        ({"quantization": {"ignore": ["lm_head; echo"]}}, "spec.quantization.ignore[0]", "pattern"),
        ({"storage": {"uri": "hf://org/name"}}, "spec.storage.uri", "pattern"),
        ({"storage": {"uri": "s3://bkt/p", "endpoint": "file:///etc/passwd"}}, "spec.storage.endpoint", "pattern"),
        ({"serving": {"maxModelLen": 10}}, "spec.serving.maxModelLen", "greater than or equal to 128"),
        ({"serving": {"gpuMemoryUtilization": 1.5}}, "spec.serving.gpuMemoryUtilization", "less than or equal to 0.98"),
        ({"serving": {"targets": [{"family": "hopper", "product": "NVIDIA-L4"}]}}, "spec.serving.targets[0]", "exactly one"),
        ({"serving": {"targets": [{}]}}, "spec.serving.targets[0]", "got none"),
        ({"serving": {"targets": [{"family": "volta"}]}}, "spec.serving.targets[0].family", "hopper"),
        ({"serving": {"extraArgs": ["--foo bar"]}}, "spec.serving.extraArgs[0]", "pattern"),
        ({"serving": {"extraArgs": ["--x\n--trust-remote-code"]}}, "spec.serving.extraArgs[0]", "pattern"),
        ({"autoscaling": {"targetKVCacheUsage": 0}}, "spec.autoscaling.targetKVCacheUsage", "greater than 0"),
        ({"autoscaling": {"targetKVCacheUsage": 1.2}}, "spec.autoscaling.targetKVCacheUsage", "less than or equal to 1"),
        ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling", "minReplicas (5) must be less than or equal to maxReplicas (2)"),
        ({"autoscaling": {"minReplicas": 5}}, "spec", "autoscaling.minReplicas (5) must be less than or equal to autoscaling.maxReplicas (4)"),
        ({"autoscaling": {"minReplicas": "many"}}, "spec.autoscaling.minReplicas", "integer"),
        ({"serving": {"replicass": 2}}, "spec.serving.replicass", "Extra inputs are not permitted"),
    ],
)
def test_invalid_spec_names_the_field(patch, field, words):
    lines = spec_errors(patch)
    assert any(line.startswith(f"{field}: ") and words in line for line in lines), lines


def test_missing_source_names_the_field():
    with pytest.raises(ValidationError) as exc:
        QuantizedModelSpec.model_validate({})
    assert format_validation_error(exc.value, prefix="spec") == ["spec.source: Field required"]


def test_long_name_refused_with_field():
    body = {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
            "metadata": {"name": "x" * 41, "namespace": "d"}, "spec": MINIMAL}
    with pytest.raises(ValidationError) as exc:
        QuantizedModel.model_validate(body)
    assert any(ln.startswith("metadata: name:") for ln in format_validation_error(exc.value)), exc.value


def test_policy_rejects_auto_in_format_by_family():
    with pytest.raises(ValidationError) as exc:
        QuantizationPolicySpec.model_validate({"formatByGPUFamily": {"ampere": "auto"}})
    assert "formatByGPUFamily.ampere" in str(exc.value)


@pytest.mark.parametrize(
    "selector, labels, expected",
    [
        ({}, {}, True),
        ({"matchLabels": {"team": "a"}}, {"team": "a"}, True),
        ({"matchLabels": {"team": "a"}}, {"team": "b"}, False),
        ({"matchExpressions": [{"key": "env", "operator": "In", "values": ["prod"]}]}, {"env": "prod"}, True),
        ({"matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["prod"]}]}, {"env": "prod"}, False),
        ({"matchExpressions": [{"key": "env", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "env", "operator": "DoesNotExist"}]}, {}, True),
    ],
)
def test_label_selector(selector, labels, expected):
    assert LabelSelector.model_validate(selector).matches(labels) is expected


def test_policy_source_globs():
    p = QuantizationPolicySpec.model_validate({"rules": {"allowedSources": ["hf://meta-llama/*"]}})
    assert p.rules.source_allowed("hf://meta-llama/Llama-3.1-8B")
    assert not p.rules.source_allowed("hf://evil/Llama")


def test_artifact_key_is_stable_and_sensitive_to_every_input():
    base = ArtifactKeyInputs(sourceUri="hf://a/b", sourceRevision="abc", format="w4a16-gptq",
                             ignore=["lm_head"], calibrationDataset="general-en", calibrationSamples=8,
                             calibrationMaxSeqLength=64)
    assert base.key() == ArtifactKeyInputs.model_validate(base.to_wire()).key()
    assert len(base.key()) == 64
    variants = [
        base.model_copy(update={"sourceRevision": "abd"}),
        base.model_copy(update={"format": QuantFormat.W4A16_AWQ}),
        base.model_copy(update={"ignore": []}),
        base.model_copy(update={"calibrationSamples": 9}),
        base.model_copy(update={"calibrationDatasetHash": "ff"}),
        base.model_copy(update={"tools": {**QUANTJOB_TOOL_VERSIONS, "transformers": "9.9"}}),
    ]
    assert len({v.key() for v in variants} | {base.key()}) == len(variants) + 1


def test_manifest_key_verification():
    inputs = ArtifactKeyInputs(sourceUri="hf://a/b", format="fp8-dynamic")
    m = Manifest(key=inputs.key(), keyInputs=inputs, format="fp8-dynamic", files=[], totalBytes=0,
                 createdAt="2026-11-21T00:00:00Z")
    m.verify_key()
    forged = m.model_copy(update={"key": "0" * 64})
    with pytest.raises(ValueError, match="does not match"):
        forged.verify_key()


def test_artifact_prefix():
    assert artifact_prefix("s3://bkt/quantized/", "k") == ("bkt", "quantized/k/")
    assert artifact_prefix("s3://bkt", "k") == ("bkt", "k/")


def test_job_contract_refuses_auto_and_wrong_key():
    inputs = ArtifactKeyInputs(sourceUri="hf://a/b", format="fp8-dynamic")
    ok = QuantJobContract(key=inputs.key(), keyInputs=inputs, storage={"uri": "s3://bkt/p"})
    assert QuantJobContract.model_validate_json(ok.to_json()) == ok
    with pytest.raises(ValidationError, match="key"):
        QuantJobContract(key="1" * 64, keyInputs=inputs, storage={"uri": "s3://bkt/p"})
    auto = ArtifactKeyInputs(sourceUri="hf://a/b", format="auto")
    with pytest.raises(ValidationError, match="never 'auto'"):
        QuantJobContract(key=auto.key(), keyInputs=auto, storage={"uri": "s3://bkt/p"})


def test_tool_versions_match_the_quantjob_pins():
    import tomllib

    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["quantjob"]
    pinned = dict(p.split("==") for p in pins if "==" in p)
    for tool, ver in QUANTJOB_TOOL_VERSIONS.items():
        assert pinned.get(tool) == ver, f"{tool}: key says {ver}, pyproject pins {pinned.get(tool)}"


def test_every_concrete_format_has_facts():
    assert set(FORMAT_FACTS) == {f for f in QuantFormat if f is not QuantFormat.AUTO}
    for facts in FORMAT_FACTS.values():
        if facts.fallback_min_cc:
            assert facts.fallback_min_cc < facts.native_min_cc


def test_set_condition_keeps_transition_time_when_status_unchanged():
    conds = set_condition([], "Ready", False, "RollingOut", "0/1", 1, now="2026-01-01T00:00:00Z")
    conds = set_condition(conds, "Ready", False, "RollingOut", "0/2", 2, now="2026-01-02T00:00:00Z")
    assert conds[0].lastTransitionTime == "2026-01-01T00:00:00Z" and conds[0].message == "0/2"
    assert conds[0].observedGeneration == 2
    conds = set_condition(conds, "Ready", True, "AllVariantsReady", "", 2, now="2026-01-03T00:00:00Z")
    assert conds[0].lastTransitionTime == "2026-01-03T00:00:00Z"
    conds = set_condition(conds, "Accepted", True, "Valid", "", 2, now="2026-01-03T00:00:00Z")
    assert [c.type for c in conds] == ["Accepted", "Ready"]
    with pytest.raises(ValidationError):
        Condition(type="Ready", status="Maybe", reason="X", lastTransitionTime="t")


@pytest.mark.parametrize("path", ["../x", "a/../../b", "/etc/passwd", "a//b", "./a"])
def test_manifest_paths_stay_inside_the_artifact(path):
    with pytest.raises(ValidationError):
        ManifestFile(path=path, sizeBytes=1, sha256="0" * 64)


def test_manifest_from_a_newer_writer_still_parses():
    inputs = ArtifactKeyInputs(sourceUri="hf://a/b", format="fp8-dynamic")
    raw = Manifest(key=inputs.key(), keyInputs=inputs, format="fp8-dynamic", files=[], totalBytes=0,
                   createdAt="2026-11-21T00:00:00Z").to_wire()
    raw["signature"] = "future-field"
    assert Manifest.model_validate(raw).key == inputs.key()


def test_a_capitalised_unknown_field_is_named():
    lines = spec_errors({"Serving": {"replicas": 2}})
    assert "spec.Serving: Extra inputs are not permitted" in lines, lines


@pytest.mark.parametrize("toleration, words", [
    ({"key": "gpu", "operator": "Exists", "value": "x"}, "value must be empty when operator is Exists"),
    ({"operator": "Equal", "value": "x"}, "operator must be Exists when key is empty"),
    ({"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 5}, "effect must be NoExecute"),
    ({"key": "a;b", "operator": "Exists"}, "pattern"),
])
def test_policy_tolerations_follow_kubernetes_rules(toleration, words):
    # The Job's pod would be refused by the API server otherwise (a traceback, no condition).
    with pytest.raises(ValidationError) as exc:
        QuantizationPolicySpec.model_validate({"rules": {"quantizationJob": {"tolerations": [toleration]}}})
    assert any(ln.startswith("rules.quantizationJob.tolerations[0]") and words in ln
               for ln in format_validation_error(exc.value)), format_validation_error(exc.value)


@pytest.mark.parametrize("placement, field", [
    ({"priorityClassName": "high; rm -rf /"}, "rules.quantizationJob.priorityClassName"),
    ({"nodeSelector": {"example.com/" + "k" * 64: "v"}}, "rules.quantizationJob.nodeSelector"),
])
def test_policy_job_placement_the_api_server_would_refuse_is_refused(placement, field):
    with pytest.raises(ValidationError) as exc:
        QuantizationPolicySpec.model_validate({"rules": {"quantizationJob": placement}})
    assert any(ln.startswith(field) for ln in format_validation_error(exc.value)), format_validation_error(exc.value)


def test_policies_the_models_refuse_are_refused_by_the_crd_too():
    """The operator can only ignore a policy its models refuse (failing open): the CRD's CEL
    rules refuse such policies at admission."""
    import json

    from fewerbits_api.crdgen import quantizationpolicy_crd

    spec = quantizationpolicy_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    fam = spec["properties"]["formatByGPUFamily"]["x-kubernetes-validations"]
    assert {"rule": "self.all(k, self[k] != 'auto')",
            "message": "formatByGPUFamily must name a concrete format, not 'auto'"} in fam
    assert any(r["rule"].startswith("self.all(k, k in ") and "volta" not in r["rule"] and "hopper" in r["rule"]
               for r in fam)
    uri = spec["properties"]["defaults"]["properties"]["storage"]["properties"]["uri"]
    assert "'..'" in json.dumps(uri["x-kubernetes-validations"])
