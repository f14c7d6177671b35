"""The effective spec of a QuantizedModel: its spec laid over the matching policy's defaults, then
judged by that policy's rules. Pure functions.

The effective spec is the spec laid over the policy's defaults; a rule violation is
Accepted=False with the rule named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from fewerbits_api.datasets import BUILTIN_DATASETS
from fewerbits_api.errors import format_validation_error
from fewerbits_api.formats import QuantFormat
from fewerbits_api.policy import QuantizationPolicy
from fewerbits_api.quantizedmodel import QualityGateSpec, QuantizedModelSpec, StorageSpec

from .planner import check_vllm_args, vllm_arg_spec

DEFAULT_GATE_PERCENT = 3.0
MAX_REPORTED = 16
"""Errors (and, separately, violations) reported per spec; the rest are counted."""
MAX_REPORTED_CHARS = 600
"""Characters per reported error. Together these keep the Accepted message far below the
32768 characters a condition message may hold (metav1.Condition), however hostile the spec."""

# vLLM flags a model may not pass in serving.extraArgs unless a policy allows them: the plan owns
# the first group; the second changes what code runs or what the server trusts.
PLAN_OWNED_FLAGS = {
    "--model", "--dtype", "--kv-cache-dtype", "--tensor-parallel-size", "--max-model-len",
    "--gpu-memory-utilization", "--served-model-name", "--quantization", "--port", "--host",
    "--pipeline-parallel-size", "--load-format", "--revision", "--tokenizer",
}
TRUST_FLAGS = {
    "--trust-remote-code", "--allowed-local-media-path", "--enable-auto-tool-choice-unsafe",
    "--tool-parser-plugin", "--chat-template", "--api-key", "--ssl-keyfile", "--ssl-certfile",
    "--allow-credentials", "--middleware", "--download-dir", "--hf-token",
}


@dataclass
class Effective:
    """The outcome: a valid spec and the policy that shaped it, or the reasons it is refused."""

    spec: QuantizedModelSpec | None
    policy: QuantizationPolicy | None
    errors: list[str] = field(default_factory=list)
    """Spec errors, each naming its field."""
    violations: list[str] = field(default_factory=list)
    """Policy rule violations, each naming the rule."""

    @property
    def accepted(self) -> bool:
        return self.spec is not None and not self.errors and not self.violations

    def gate(self) -> QualityGateSpec:
        """The model's gate; without one, the default 3% lowered to the policy's ceiling."""
        assert self.spec is not None
        if self.spec.quantization.qualityGate is not None:
            return self.spec.quantization.qualityGate
        ceiling = self.policy.spec.rules.maxPerplexityIncreasePercent if self.policy else None
        default = QualityGateSpec()
        if ceiling is not None and ceiling < default.maxPerplexityIncreasePercent:
            return QualityGateSpec(maxPerplexityIncreasePercent=ceiling)
        return default


def bounded(lines: list[str]) -> list[str]:
    """At most MAX_REPORTED lines of at most MAX_REPORTED_CHARS each, then how many were left out."""
    out = [line if len(line) <= MAX_REPORTED_CHARS else line[: MAX_REPORTED_CHARS - 3] + "..."
           for line in lines[:MAX_REPORTED]]
    if len(lines) > MAX_REPORTED:
        out.append(f"... and {len(lines) - MAX_REPORTED} more")
    return out


def flag_dest(arg: str) -> str:
    """What a vLLM flag sets, as vLLM's own parser names it (pinned release), else a name derived
    the way vLLM derives it."""
    flag = arg.split("=", 1)[0]
    if flag.startswith("--"):
        flag = "--" + flag[2:].partition(".")[0].replace("_", "-")
    options = vllm_arg_spec()["options"]
    opt = options.get(flag)
    if opt is None and flag.startswith("--no-"):
        opt = options.get("--" + flag[5:])
    if opt is not None:
        return opt["dest"]
    return flag.lstrip("-").removeprefix("no-").replace("-", "_")


def select_policy(policies: list[QuantizationPolicy], namespace_labels: dict[str, str]) -> QuantizationPolicy | None:
    """The matching policy with the highest priority; ties go to the first name in order."""
    matching = [p for p in policies if p.spec.namespaceSelector.matches(namespace_labels)]
    if not matching:
        return None
    return sorted(matching, key=lambda p: (-p.spec.priority, p.metadata.name))[0]


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` wins; nested objects merge; lists and scalars replace."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def effective_spec(
    raw_spec: dict[str, Any],
    policy: QuantizationPolicy | None,
    default_storage: StorageSpec | None = None,
) -> Effective:
    """Merge, validate, then judge by the policy's rules."""
    defaults: dict[str, Any] = {}
    if policy is not None:
        # Only what the policy author wrote: exclude_unset keeps model defaults from overriding.
        defaults = policy.spec.defaults.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)
    if default_storage is not None and "storage" not in defaults:
        defaults["storage"] = default_storage.to_wire()
    merged = deep_merge(defaults, raw_spec or {})
    try:
        spec = QuantizedModelSpec.model_validate(merged)
    except ValidationError as e:
        return Effective(None, policy, errors=bounded(format_validation_error(e, prefix="spec")))
    errors = []
    if spec.storage is None:
        errors.append("spec.storage: no artifact storage: set spec.storage.uri, or a policy default, "
                      "or the operator's FEWERBITS_DEFAULT_STORAGE_URI")
    if spec.source.scheme != "s3" and (spec.source.endpoint or spec.source.region):
        errors.append("spec.source.endpoint: only s3:// sources take an endpoint or region")
    for field_name, dataset in (("spec.quantization.calibration.dataset", spec.quantization.calibration.dataset),
                                ("spec.quantization.qualityGate.evalDataset",
                                 spec.quantization.qualityGate.evalDataset if spec.quantization.qualityGate else None)):
        if dataset and "://" not in dataset and dataset not in BUILTIN_DATASETS:
            errors.append(f"{field_name}: {dataset!r} is not a built-in dataset (built-in: "
                          f"{', '.join(BUILTIN_DATASETS)}); use s3://bucket/path.jsonl or hf://datasets/org/name")
    # vLLM's own argument rules (its parser's flags, types and choices, pinned release).
    errors += [f"spec.serving.extraArgs: {e}" for e in check_vllm_args(spec.serving.extraArgs)]
    return Effective(spec, policy, errors=bounded(errors), violations=bounded(check_rules(spec, raw_spec or {}, policy)))


def check_rules(spec: QuantizedModelSpec, raw_spec: dict[str, Any], policy: QuantizationPolicy | None) -> list[str]:
    """Every broken rule, each message naming the rule, the policy and the offending field."""
    out: list[str] = []
    pname = policy.metadata.name if policy else None
    rules = policy.spec.rules if policy else None

    def broke(rule: str, what: str) -> None:
        out.append(f"policy {pname} rule {rule}: {what}")

    # extraArgs are checked with or without a policy: no policy means no such flag is allowed.
    # Flags are compared by what they set in vLLM's parser (its `dest`), so `--trust_remote_code`,
    # `-tp` or `--no-...` spellings name the same setting as the canonical flag.
    allowed = {flag_dest(f) for f in (rules.allowedExtraArgs if rules else [])}
    plan_owned = {flag_dest(f) for f in PLAN_OWNED_FLAGS}
    trust = {flag_dest(f) for f in TRUST_FLAGS}
    for i, arg in enumerate(spec.serving.extraArgs):
        if not arg.startswith("-") or arg.lstrip("-")[:1].isdigit():
            continue  # a value
        dest = flag_dest(arg)
        if dest in (plan_owned | trust) and dest not in allowed:
            flag = arg.split("=", 1)[0]
            kind = "overrides the plan" if dest in plan_owned else "changes what the server trusts"
            msg = (f"spec.serving.extraArgs[{i}]: {flag} {kind}; a policy must list it in "
                   f"rules.allowedExtraArgs")
            out.append(f"policy {pname} rule allowedExtraArgs: {msg}" if policy else msg)
    if spec.source.trustRemoteCode and not (rules and rules.allowTrustRemoteCode):
        msg = "spec.source.trustRemoteCode is true; a policy must set rules.allowTrustRemoteCode"
        out.append(f"policy {pname} rule allowTrustRemoteCode: {msg}" if policy else msg)
    if rules is None:
        return out
    fmt = spec.quantization.format
    if rules.allowedFormats and fmt is not QuantFormat.AUTO and fmt not in rules.allowedFormats:
        broke("allowedFormats", f"spec.quantization.format {fmt.value} is not one of "
                                f"{', '.join(f.value for f in rules.allowedFormats)}")
    if not rules.source_allowed(spec.source.uri):
        broke("allowedSources", f"spec.source.uri {spec.source.uri} matches none of {', '.join(rules.allowedSources or [])}")
    if rules.requireRevisionPin and not spec.source.revision:
        broke("requireRevisionPin", "spec.source.revision must pin the revision to quantize")
    explicit_gate = ((raw_spec.get("quantization") or {}).get("qualityGate")) is not None
    if rules.requireQualityGate and not explicit_gate:
        broke("requireQualityGate", "spec.quantization.qualityGate must be set")
    gate = spec.quantization.qualityGate
    if rules.maxPerplexityIncreasePercent is not None and gate is not None \
            and gate.maxPerplexityIncreasePercent > rules.maxPerplexityIncreasePercent:
        broke("maxPerplexityIncreasePercent",
              f"spec.quantization.qualityGate.maxPerplexityIncreasePercent {gate.maxPerplexityIncreasePercent:g} "
              f"exceeds the ceiling {rules.maxPerplexityIncreasePercent:g}")
    if rules.maxReplicas is not None and spec.autoscaling.enabled and spec.autoscaling.maxReplicas > rules.maxReplicas:
        broke("maxReplicas", f"spec.autoscaling.maxReplicas {spec.autoscaling.maxReplicas} exceeds {rules.maxReplicas}")
    if rules.maxReplicas is not None and not spec.autoscaling.enabled and spec.serving.replicas > rules.maxReplicas:
        broke("maxReplicas", f"spec.serving.replicas {spec.serving.replicas} exceeds {rules.maxReplicas}")
    return out
