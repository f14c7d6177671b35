"""Property-based tests of the API models (hypothesis).

* A spec that validates round-trips through to_wire / model_validate unchanged.
* What the models accept, the generated CRD's schema accepts too (types, enums, patterns,
  ranges, lengths, item counts and the path-trick CEL rule, checked offline): otherwise a policy
  or a model could pass the models in a test and be refused by the API server, or — worse — the
  reverse for the rules the CRD carries.
* Whatever is thrown at them, the models raise only ValidationError, and every error line names
  a ``spec.``-prefixed field; the effective spec never raises at all.
* Artifact keys are deterministic, change when any key input changes, and are safe path segments.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fewerbits_api.artifact import ArtifactKeyInputs
from fewerbits_api.errors import format_validation_error
from fewerbits_api.formats import FORMAT_FACTS, QuantFormat
from fewerbits_api.quality import eval_overlaps_calibration
from fewerbits_api.policy import QuantizationPolicySpec
from fewerbits_api.quantizedmodel import QuantizedModelSpec
from fewerbits_operator.artifacts.keys import job_name
from fewerbits_operator.artifacts.effective import effective_spec

REPO = Path(__file__).resolve().parents[2]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _schema(plural: str) -> dict[str, Any]:
    crd = yaml.safe_load((REPO / "crds" / "bases" / f"fewerbits.io_{plural}.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


QM_SCHEMA = _schema("quantizedmodels")
QP_SCHEMA = _schema("quantizationpolicies")
_CEL_MATCHES = re.compile(r"!self\.matches\('((?:[^'\\]|\\.)*)'\)")


def schema_errors(value: Any, schema: dict[str, Any], path: str = "spec") -> list[str]:
    """What the API server's structural-schema validation would say, for the keywords our CRDs use."""
    errs: list[str] = []
    t = schema.get("type")
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool}
    if t == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{path}: not an integer"]
    elif t == "number":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return [f"{path}: not a number"]
    elif t in kinds and not isinstance(value, kinds[t]):
        return [f"{path}: not a {t}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: not in enum")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errs.append(f"{path}: pattern")
        if len(value.encode()) > schema.get("maxLength", 1 << 30) or len(value) < schema.get("minLength", 0):
            errs.append(f"{path}: length")
        for rule in schema.get("x-kubernetes-validations", []):
            # The one string rule our CRDs carry: a conjunction of !self.matches('...').
            for pattern in _CEL_MATCHES.findall(rule["rule"]):
                if re.search(pattern.replace("\\\\", "\\"), value):
                    errs.append(f"{path}: {rule['message']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is not None and (value < lo or (schema.get("exclusiveMinimum") and value == lo)):
            errs.append(f"{path}: below minimum")
        if hi is not None and (value > hi or (schema.get("exclusiveMaximum") and value == hi)):
            errs.append(f"{path}: above maximum")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", 1 << 30) or len(value) < schema.get("minItems", 0):
            errs.append(f"{path}: item count")
        for i, item in enumerate(value):
            errs += schema_errors(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        if len(value) > schema.get("maxProperties", 1 << 30) or len(value) < schema.get("minProperties", 0):
            errs.append(f"{path}: property count")
        props = schema.get("properties")
        for key in schema.get("required", []):
            if key not in value:
                errs.append(f"{path}.{key}: required")
        for key, item in value.items():
            if props is not None and key in props:
                errs += schema_errors(item, props[key], f"{path}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errs += schema_errors(item, schema["additionalProperties"], f"{path}.{key}")
            elif props is not None:
                errs.append(f"{path}.{key}: unknown field")
    return errs


# ---------------------------------------------------------------- strategies of valid specs

NAME = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,10}[a-z0-9])?", fullmatch=True)
BUCKET = st.from_regex(r"[a-z0-9][a-z0-9-]{1,10}[a-z0-9]", fullmatch=True)
SEGMENT = st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,8}", fullmatch=True).filter(lambda s: s not in (".", ".."))
PATH = st.lists(SEGMENT, max_size=3).map("/".join)
HF = st.tuples(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,8}", fullmatch=True),
               st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,8}", fullmatch=True)).map("/".join)


def _s3(bucket: str, path: str) -> str:
    return f"s3://{bucket}/{path}" if path else f"s3://{bucket}"


SOURCE_URI = st.one_of(HF.map(lambda r: f"hf://{r}"), st.builds(_s3, BUCKET, PATH),
                       st.builds(lambda c, p: f"pvc://{c}/{p}" if p else f"pvc://{c}", NAME, PATH))
DATASET = st.one_of(st.just("general-en"), st.builds(lambda b, p: f"s3://{b}/{p or 'x'}.jsonl", BUCKET, PATH),
                    HF.map(lambda r: f"hf://datasets/{r}"))
EXTRA_ARG = st.from_regex(r"--[a-z][a-z-]{0,20}(=[A-Za-z0-9._:-]{1,10})?", fullmatch=True)


def _optional(d: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A dict strategy where every key may be left out."""
    return st.fixed_dictionaries({}, optional=d)


@st.composite
def autoscaling(draw) -> dict[str, Any]:
    a = draw(_optional({"enabled": st.booleans(), "targetKVCacheUsage": st.floats(0.01, 1.0),
                        "maxWaitingRequests": st.integers(0, 100000), "scaleDownDelaySeconds": st.integers(0, 86400)}))
    lo = draw(st.integers(0, 1000))
    hi = draw(st.integers(max(lo, 1), 1000))
    if draw(st.booleans()):
        a |= {"minReplicas": lo, "maxReplicas": hi}
    return a


SPECS = st.fixed_dictionaries(
    {"source": st.fixed_dictionaries({"uri": SOURCE_URI}, optional={
        "revision": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
        "credentialsSecret": NAME, "trustRemoteCode": st.booleans()})},
    optional={
        "quantization": _optional({
            "format": st.sampled_from([f.value for f in QuantFormat]),
            "kvCache": st.sampled_from(["auto", "fp8", "none"]),
            "ignore": st.lists(st.from_regex(r"[A-Za-z0-9_.:*-]{1,12}", fullmatch=True), max_size=4),
            "calibration": _optional({"dataset": DATASET, "samples": st.integers(1, 65536),
                                      "maxSeqLength": st.integers(16, 131072)}),
            "qualityGate": _optional({"maxPerplexityIncreasePercent": st.floats(0.001, 1000),
                                      "evalDataset": DATASET, "evalSamples": st.integers(1, 4096)}),
        }),
        "storage": st.fixed_dictionaries({"uri": st.builds(_s3, BUCKET, PATH)}, optional={
            "endpoint": st.just("http://minio.local:9000"), "credentialsSecret": NAME}),
        "serving": _optional({
            "targets": st.lists(st.one_of(
                st.fixed_dictionaries({"family": st.sampled_from(["ampere", "hopper", "blackwell"])}),
                st.fixed_dictionaries({"product": st.sampled_from(["NVIDIA-L4", "NVIDIA-H100-80GB-HBM3"])}),
                st.fixed_dictionaries({"nodeSelector": st.dictionaries(
                    st.from_regex(r"([a-z0-9]{1,5}\.[a-z]{2,3}/)?[a-z][a-z0-9_.-]{0,10}[a-z0-9]", fullmatch=True),
                    st.from_regex(r"[a-z0-9]{0,8}", fullmatch=True), min_size=1, max_size=3)})), max_size=3),
            "maxModelLen": st.integers(128, 10_485_760),
            "minConcurrentSequences": st.integers(1, 1024),
            "gpuMemoryUtilization": st.floats(0.3, 0.98),
            "servedModelName": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,20}", fullmatch=True),
            "replicas": st.integers(0, 1000),
            "extraArgs": st.lists(EXTRA_ARG, max_size=5),
        }),
        "autoscaling": autoscaling(),
    },
)

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(allow_nan=False),
                         st.text(max_size=30))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=12), inner, max_size=3)),
                    max_leaves=10)
SPEC_KEYS = st.sampled_from(["source", "quantization", "storage", "serving", "autoscaling", "format", "uri"])


@st.composite
def mangled_specs(draw) -> Any:
    """A valid spec with parts replaced by arbitrary JSON, or arbitrary JSON outright."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    spec = draw(SPECS)
    node = spec
    for _ in range(draw(st.integers(1, 3))):
        if not isinstance(node, dict) or not node:
            break
        key = draw(st.sampled_from(sorted(node)))
        if draw(st.booleans()) or not isinstance(node[key], dict):
            node[key] = draw(JSON)
            break
        node = node[key]
    if draw(st.booleans()):
        spec[draw(SPEC_KEYS)] = draw(JSON)
    return spec


# ---------------------------------------------------------------- properties


@SETTINGS
@given(SPECS)
def test_a_valid_spec_round_trips_unchanged(raw):
    try:
        spec = QuantizedModelSpec.model_validate(raw)
    except ValidationError:
        # Only the cross-field rules the strategy does not model may refuse it: replicas, and an
        # evaluation set that is the calibration set of a format that calibrates.
        a = raw.get("autoscaling", {})
        q = raw.get("quantization", {})
        gate = q.get("qualityGate")
        calibrates = FORMAT_FACTS[QuantFormat(q.get("format", "auto"))].needs_calibration_data \
            if q.get("format", "auto") != "auto" else True
        overlap = gate is not None and calibrates and eval_overlaps_calibration(
            q.get("calibration", {}).get("dataset", "general-en"), gate.get("evalDataset", "general-en-heldout"))
        assert a.get("minReplicas", 1) > a.get("maxReplicas", 4) or overlap
        return
    wire = spec.to_wire()
    assert QuantizedModelSpec.model_validate(wire) == spec
    assert QuantizedModelSpec.model_validate(wire).to_wire() == wire


@SETTINGS
@given(SPECS)
def test_what_the_models_accept_the_crd_schema_accepts(raw):
    try:
        QuantizedModelSpec.model_validate(raw)
    except ValidationError:
        return
    assert schema_errors(raw, QM_SCHEMA) == []


@SETTINGS
@given(st.fixed_dictionaries({}, optional={
    "priority": st.integers(0, 1_000_000),
    "namespaceSelector": st.fixed_dictionaries({}, optional={
        "matchLabels": st.dictionaries(st.from_regex(r"[a-z]([a-z0-9.-]{0,8}[a-z0-9])?", fullmatch=True),
                                       st.from_regex(r"[a-z0-9]{0,6}", fullmatch=True), max_size=3)}),
    "rules": _optional({
        "allowedFormats": st.lists(st.sampled_from([f.value for f in QuantFormat]), max_size=4),
        "allowedSources": st.lists(st.text(min_size=1, max_size=20), max_size=3),
        "maxPerplexityIncreasePercent": st.floats(0.001, 1000), "maxReplicas": st.integers(1, 1000),
        "allowedExtraArgs": st.lists(st.from_regex(r"--[a-z0-9][a-z0-9-]{0,12}", fullmatch=True), max_size=3),
        "quantizationJob": _optional({
            "priorityClassName": NAME,
            "tolerations": st.lists(st.one_of(
                st.fixed_dictionaries({"key": NAME, "operator": st.just("Equal"), "value": NAME}),
                st.fixed_dictionaries({"operator": st.just("Exists")}),
                st.fixed_dictionaries({"key": NAME, "effect": st.just("NoExecute"),
                                       "tolerationSeconds": st.integers(0, 3600)})), max_size=2)}),
    }),
    "formatByGPUFamily": st.dictionaries(st.sampled_from(["turing", "ampere", "hopper"]),
                                         st.sampled_from([f.value for f in QuantFormat])),
    "defaults": _optional({"storage": st.fixed_dictionaries({"uri": st.builds(_s3, BUCKET, PATH)}),
                           "autoscaling": autoscaling()}),
}))
def test_a_policy_the_models_refuse_the_crd_refuses_too(raw):
    """The operator ignores a policy its models refuse: such a policy must never be stored."""
    try:
        QuantizationPolicySpec.model_validate(raw)
        accepted = True
    except ValidationError:
        accepted = False
    crd_errors = schema_errors(raw, QP_SCHEMA)
    if accepted:
        assert crd_errors == []
    elif not crd_errors:
        # The only refusals the offline checker cannot see are CEL rules beyond patterns.
        auto = any(v == "auto" for v in (raw.get("formatByGPUFamily") or {}).values())
        a = (raw.get("defaults") or {}).get("autoscaling") or {}
        assert auto or a.get("minReplicas", 0) > a.get("maxReplicas", 1 << 30), raw


@SETTINGS
@given(mangled_specs())
def test_anything_raises_only_validation_errors_that_name_a_spec_field(raw):
    try:
        QuantizedModelSpec.model_validate(raw)
    except ValidationError as e:
        lines = format_validation_error(e, prefix="spec")
        assert lines and all(re.match(r"spec(\.[^:\s]|\[\d+\]|\[\"|: )", line) for line in lines), lines
    eff = effective_spec(raw if isinstance(raw, dict) else {"source": raw}, None)
    assert all(line.startswith("spec") for line in eff.errors), eff.errors
    assert len("; ".join(eff.errors + eff.violations)) < 32768


KEY_INPUTS = st.builds(
    ArtifactKeyInputs,
    sourceUri=SOURCE_URI,
    sourceRevision=st.one_of(st.none(), st.text(max_size=12)),
    format=st.sampled_from([f for f in QuantFormat if f is not QuantFormat.AUTO]),
    ignore=st.lists(st.text(max_size=8), max_size=3),
    calibrationDataset=st.one_of(st.none(), DATASET),
    calibrationDatasetHash=st.one_of(st.none(), st.from_regex(r"[0-9a-f]{8}", fullmatch=True)),
    calibrationSamples=st.one_of(st.none(), st.integers(1, 65536)),
    calibrationMaxSeqLength=st.one_of(st.none(), st.integers(16, 131072)),
)
CHANGES = {
    "sourceUri": lambda v: v + "x",
    "sourceRevision": lambda v: (v or "") + "1",
    "format": lambda v: QuantFormat.FP8_BLOCK if v is not QuantFormat.FP8_BLOCK else QuantFormat.NVFP4,
    "ignore": lambda v: v + ["extra"],
    "calibrationDataset": lambda v: (v or "") + "-other",
    "calibrationDatasetHash": lambda v: (v or "") + "0",
    "calibrationSamples": lambda v: (v or 0) + 1,
    "calibrationMaxSeqLength": lambda v: (v or 0) + 1,
    "tools": lambda v: {**(v or {}), "transformers": (v or {}).get("transformers", "") + ".1"},  # legacy keys
    "rebuild": lambda v: (v or "") + "r",
    "recipe": lambda v: {**v, "group_size": 64},
}


@SETTINGS
@given(KEY_INPUTS, st.sampled_from(sorted(CHANGES)))
def test_artifact_keys_are_deterministic_sensitive_and_safe(inputs, changed):
    key = inputs.key()
    assert key == ArtifactKeyInputs.model_validate(inputs.to_wire()).key()
    assert re.fullmatch(r"[0-9a-f]{64}", key)  # a safe path segment and S3 key part, always
    name = job_name(key, "s3://" + "b" * 60 + "/" + "p" * 400, "https://" + "e" * 500)
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63
    other = inputs.model_copy(update={changed: CHANGES[changed](getattr(inputs, changed))})
    assert other.key() != key


@pytest.mark.parametrize("value, refused", [
    ("s3://b/a/../c", True), ("s3://b/./c", True), ("s3://b/a//c", True), ("s3://b/a/..", True),
    ("s3://b/a/...", False), ("s3://b/a..b/c", False), ("s3://b//a", False), ("s3://b/a/", False),
    ("hf://datasets/org/name@../../x", True), ("hf://datasets/org/name@..", False),
])
def test_path_trick_cel_rule_agrees_with_the_models(value, refused):
    uri_schema = QM_SCHEMA["properties"]["storage"]["properties"]["uri"]
    rule_only = {k: v for k, v in uri_schema.items() if k != "pattern"}
    assert bool(schema_errors(value, rule_only)) is refused
    from fewerbits_api.validation import check_no_path_tricks
    try:
        check_no_path_tricks(value, "uri")
        models_refuse = False
    except ValueError:
        models_refuse = True
    assert models_refuse is refused
