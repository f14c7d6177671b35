"""The effective spec of a QuantizedModel: its spec laid over the combined defaults of every
matching policy, then judged by their combined rules (docs/policies.md). Pure functions
(docs/architecture.md, house rule 1): a rule violation or a conflict between policies is
Accepted=False naming the rule and the policies.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from fewerbits_api.adapters import adapter_evaluations
from fewerbits_api.datasets import BUILTIN_DATASETS, CALIBRATION_DATASETS
from fewerbits_api.endpoints import endpoint_matches, endpoint_refusal
from fewerbits_api.errors import format_validation_error
from fewerbits_api.lmeval_tasks import benchmark_problems
from fewerbits_api.formats import QuantFormat
from fewerbits_api.policy import PolicyRules, QuantizationPolicy, QuantizationPolicySpec
from fewerbits_api.quantizedmodel import (
    EffectivePolicies,
    EffectiveValue,
    QualityGateSpec,
    QuantizedModelSpec,
    StorageSpec,
)

from fewerbits_operator.base.datapins import DataPin, unpinned_data
from fewerbits_operator.planner import check_vllm_args, vllm_arg_spec
from fewerbits_operator.planner.vllm_args import PLAN_OWNED_FLAGS

DEFAULT_GATE_PERCENT = 3.0
MAX_REPORTED = 16
"""Errors (and, separately, violations) reported per spec; the rest are counted."""
MAX_REPORTED_CHARS = 600
"""Characters per reported error. Together these keep the Accepted message far below the
32768 characters a condition message may hold (metav1.Condition), however hostile the spec."""

# vLLM flags a model may not pass in serving.extraArgs unless a policy allows them: the plan owns
# the first group (planner/vllm_args.py derives it from plan_args); the second changes what code
# runs or what the server trusts.
TRUST_FLAGS = {
    "--trust-remote-code", "--allowed-local-media-path", "--enable-auto-tool-choice-unsafe",
    "--tool-parser-plugin", "--chat-template", "--api-key", "--ssl-keyfile", "--ssl-certfile",
    "--allow-credentials", "--middleware", "--download-dir", "--hf-token",
}


LORA_FLAGS = ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras")
"""vLLM's LoRA flags: with spec.adapters the operator renders them (render.adapter_args)."""


@dataclass(frozen=True)
class Conflict:
    """Settings of matching policies that cannot be combined: reported on each policy's status and
    refuses the models they govern."""

    policies: tuple[str, ...]
    message: str


@dataclass(frozen=True)
class Combined:
    """Every policy matching a namespace, combined into one (docs/policies.md): defaults and job
    placement laid over one another by priority, rules combined so the most restrictive wins, and
    the source of each value."""

    names: tuple[str, ...] = ()
    """The matching policies, highest priority first (ties: name order)."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """The layered defaults (wire form)."""
    default_sources: dict[tuple[str, ...], str] = field(default_factory=dict)
    """Leaf path under `spec` (e.g. `("serving", "replicas")`) → the policy that set it."""
    rules: PolicyRules = field(default_factory=PolicyRules)
    """The single-valued rules (ceilings, caps, permissions, allowed formats, job placement) as
    combined; the pattern lists are checked per policy (`source_patterns`, `image_patterns`,
    `endpoint_patterns`)."""
    rule_sources: dict[str, str] = field(default_factory=dict)
    """Rule path (e.g. `maxReplicas`, `quantizationJob.nodeSelector`) → the policy (or policies,
    comma-separated) that set its combined value."""
    source_patterns: tuple[tuple[str, tuple[str, ...]], ...] = ()
    image_patterns: tuple[tuple[str, tuple[str, ...]], ...] = ()
    endpoint_patterns: tuple[tuple[str, tuple[str, ...]], ...] = ()
    rule_leaves: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Rule path → its path in the rules as tuple (for job placement leaves, whose keys hold dots)."""
    extra_args: tuple[tuple[str, frozenset[str], bool], ...] = ()
    """(policy, the vLLM dests its allowedExtraArgs list, Strict?) for each policy with a list or
    in Strict mode."""
    format_by_gpu_family: dict[str, QuantFormat] = field(default_factory=dict)
    format_sources: dict[str, str] = field(default_factory=dict)
    conflicts: tuple[Conflict, ...] = ()

    @property
    def governed(self) -> bool:
        return bool(self.names)

    def policy_spec(self) -> QuantizationPolicySpec:
        """The combined policy as one spec, for the planner (allowed formats, GPU cap, formats by
        family)."""
        return QuantizationPolicySpec(rules=self.rules, formatByGPUFamily=dict(self.format_by_gpu_family))


def matching_policies(policies: list[QuantizationPolicy], namespace_labels: dict[str, str]) -> list[QuantizationPolicy]:
    """The policies whose selector matches the namespace, highest priority first (ties: name order)."""
    matching = [p for p in policies if p.spec.namespaceSelector.matches(namespace_labels)]
    return sorted(matching, key=lambda p: (-p.spec.priority, p.metadata.name))


def _explicit(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)


def _layer(layers: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """Deep-merge (policy, dict) layers given lowest first; each leaf's source is the last layer
    that set it (objects merge, lists and scalars replace). Paths are tuples: label keys hold dots."""
    out: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}

    def merge(base: dict[str, Any], over: dict[str, Any], prefix: tuple[str, ...], name: str) -> None:
        for k, v in over.items():
            path = prefix + (k,)
            if isinstance(v, dict) and isinstance(base.get(k), dict):
                merge(base[k], v, path, name)
                continue
            for stale in [p for p in sources if p[:len(path)] == path]:
                del sources[stale]
            if isinstance(v, dict):
                base[k] = {}
                merge(base[k], v, path, name)
            else:
                base[k] = v
                sources[path] = name

    for name, layer in layers:
        merge(out, layer, (), name)
    return out, sources


_LOWEST_WINS = ("maxPerplexityIncreasePercent", "maxGPUsPerReplica", "maxReplicas", "maxQuantizationJobGPUs",
                "maxQuantizationJobMemoryGiB", "maxSourceCopyGiB")
_ANY_REQUIRES = ("requireRevisionPin", "requireQualityGate", "requirePinnedData", "requireServingCanary")


def _bound_rules(matching: list[QuantizationPolicy], rules: dict[str, Any], sources: dict[str, str]) -> None:
    """Limits (the lowest wins), requirements (any policy requires), retention (the longest wins)."""
    for name in _LOWEST_WINS:
        set_by = [(getattr(p.spec.rules, name), p.metadata.name) for p in matching
                  if getattr(p.spec.rules, name) is not None]
        if set_by:
            value = min(v for v, _ in set_by)
            rules[name], sources[name] = value, next(n for v, n in set_by if v == value)
    for name in _ANY_REQUIRES:
        if requiring := [p.metadata.name for p in matching if getattr(p.spec.rules, name)]:
            rules[name], sources[name] = True, requiring[0]
    periods = [(p.spec.rules.artifactRetentionPeriodSeconds, p.metadata.name) for p in matching
               if p.spec.rules.artifactRetentionPeriodSeconds is not None]
    if periods:  # the longest: deleting later is the safe side
        longest = max(v for v, _ in periods)
        rules["artifactRetentionPeriodSeconds"] = longest
        sources["artifactRetentionPeriodSeconds"] = next(n for v, n in periods if v == longest)


def _pool_weights(matching: list[QuantizationPolicy], rules: dict[str, Any],
                  sources: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """Per pool key, the highest-priority policy's weight; returns the leaves it set."""
    weights: dict[str, float] = {}
    leaves: dict[str, tuple[str, ...]] = {}
    for p in matching:  # highest priority first: per key, the first policy that sets it wins
        for key, w in (p.spec.rules.poolCostWeights or {}).items():
            if key not in weights:
                weights[key] = w
                sources[f"poolCostWeights.{key}"] = p.metadata.name
                leaves[f"poolCostWeights.{key}"] = ("poolCostWeights", key)
    if weights:
        rules["poolCostWeights"] = weights
    return leaves


def _permitted(matching: list[QuantizationPolicy], rules: dict[str, Any], sources: dict[str, str],
               field_name: str, yes: Any, no: Any) -> None:
    """Explicit `no` beats `yes`; a policy that leaves the field unset has no say."""
    said = [(getattr(p.spec.rules, field_name), p.metadata.name) for p in matching
            if field_name in p.spec.rules.model_fields_set]
    if refusing := [n for v, n in said if v == no]:
        rules[field_name], sources[field_name] = no, refusing[0]
    elif allowing := [n for v, n in said if v == yes]:
        rules[field_name], sources[field_name] = yes, allowing[0]


def _allowed_formats(matching: list[QuantizationPolicy], rules: dict[str, Any], sources: dict[str, str],
                     conflicts: list[Conflict]) -> None:
    """The formats every listing policy allows; none in common is a conflict."""
    format_lists = [(p.metadata.name, p.spec.rules.allowedFormats) for p in matching if p.spec.rules.allowedFormats]
    if not format_lists:
        return
    common = [f for f in format_lists[0][1] if all(f in fs for _, fs in format_lists[1:])]
    rules["allowedFormats"] = common
    sources["allowedFormats"] = ", ".join(n for n, _ in format_lists)
    if not common:
        conflicts.append(Conflict(tuple(n for n, _ in format_lists), "rules.allowedFormats: " + "; ".join(
            f"{n} allows {', '.join(f.value for f in fs)}" for n, fs in format_lists) + ": no format in common"))


def _extra_args(matching: list[QuantizationPolicy], rules: dict[str, Any], sources: dict[str, str]):
    """Each policy's allowed vLLM flag destinations and whether it is Strict; any Strict makes all so."""
    extra_args = tuple(
        (p.metadata.name, frozenset(flag_dest(f) for f in (p.spec.rules.allowedExtraArgs or [])),
         p.spec.rules.extraArgsMode == "Strict")
        for p in matching if p.spec.rules.allowedExtraArgs is not None or p.spec.rules.extraArgsMode == "Strict")
    if any(strict for _, _, strict in extra_args):
        rules["extraArgsMode"] = "Strict"
        sources["extraArgsMode"] = ", ".join(n for n, _, strict in extra_args if strict)
    return extra_args


def _formats_by_family(matching: list[QuantizationPolicy], conflicts: list[Conflict]):
    """Per GPU family, the highest-priority policy's format; two at the same priority that differ
    conflict."""
    by_family: dict[str, QuantFormat] = {}
    family_sources: dict[str, str] = {}
    family_priority: dict[str, int] = {}
    for p in matching:  # highest priority first: the first entry for a family wins
        for family, fmt in p.spec.formatByGPUFamily.items():
            key = getattr(family, "value", family)
            if key not in by_family:
                by_family[key], family_sources[key], family_priority[key] = fmt, p.metadata.name, p.spec.priority
            elif family_priority[key] == p.spec.priority and by_family[key] != fmt:
                conflicts.append(Conflict(
                    (family_sources[key], p.metadata.name),
                    f"formatByGPUFamily.{key}: {family_sources[key]} sets {by_family[key].value}, {p.metadata.name} "
                    f"sets {fmt.value}, both at priority {p.spec.priority}"))
    return by_family, family_sources


def _patterns(matching: list[QuantizationPolicy], field_name: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((p.metadata.name, tuple(getattr(p.spec.rules, field_name))) for p in matching
                 if getattr(p.spec.rules, field_name) is not None)


def combine_policies(matching: list[QuantizationPolicy]) -> Combined:
    """Combine the policies matching one namespace (given highest priority first, as
    ``matching_policies`` returns them). Pure; see docs/policies.md for the algorithm."""
    if not matching:
        return Combined()
    lowest_first = list(reversed(matching))
    defaults, default_sources = _layer([(p.metadata.name, _explicit(p.spec.defaults)) for p in lowest_first])
    placement, placement_sources = _layer([(p.metadata.name, _explicit(p.spec.rules.quantizationJob))
                                           for p in lowest_first])
    conflicts: list[Conflict] = []
    rule_sources = {".".join(("quantizationJob",) + k): v for k, v in placement_sources.items()}
    placement_leaves = {".".join(("quantizationJob",) + k): ("quantizationJob",) + k for k in placement_sources}
    rules: dict[str, Any] = {"quantizationJob": placement}
    _bound_rules(matching, rules, rule_sources)
    weight_leaves = _pool_weights(matching, rules, rule_sources)
    _permitted(matching, rules, rule_sources, "allowTrustRemoteCode", True, False)
    _permitted(matching, rules, rule_sources, "artifactRetention", "Delete", "Retain")
    _allowed_formats(matching, rules, rule_sources, conflicts)
    extra_args = _extra_args(matching, rules, rule_sources)
    by_family, family_sources = _formats_by_family(matching, conflicts)
    return Combined(
        names=tuple(p.metadata.name for p in matching), defaults=defaults, default_sources=default_sources,
        rules=PolicyRules.model_validate(rules), rule_sources=rule_sources,
        rule_leaves={**placement_leaves, **weight_leaves},
        source_patterns=_patterns(matching, "allowedSources"), image_patterns=_patterns(matching, "allowedImages"),
        endpoint_patterns=_patterns(matching, "allowedEndpoints"),
        extra_args=extra_args, format_by_gpu_family=by_family, format_sources=family_sources,
        conflicts=tuple(conflicts))


@dataclass
class Effective:
    """The outcome: a valid spec and the combined policies that shaped it, or the reasons it is
    refused."""

    spec: QuantizedModelSpec | None
    policy: Combined = field(default_factory=Combined)
    errors: list[str] = field(default_factory=list)
    """Spec errors, each naming its field."""
    violations: list[str] = field(default_factory=list)
    """Policy rule violations, each naming the rule."""
    raw_spec: dict[str, Any] = field(default_factory=dict)
    """The model's own spec, as written (what the policies did not set)."""
    eval_pin: DataPin | None = None
    """The ETag observe read of an S3 evaluation set (datapins): ``gate()`` carries it, so the
    evaluation identity names the set's content."""
    adapter_eval_pins: tuple[DataPin, ...] = ()
    """The same for the adapters' own S3 evaluation sets."""

    @property
    def accepted(self) -> bool:
        return self.spec is not None and not self.errors and not self.violations

    def gate(self) -> QualityGateSpec:
        """The model's gate (without one, the default 3% lowered to the policies' ceiling), with
        the model's LoRA adapters measured beside it (docs/adapters.md)."""
        assert self.spec is not None
        gate = self._model_gate()
        if not self.spec.adapters:
            return gate
        etags = {p.uri: p.etag for p in (*self.adapter_eval_pins, *([self.eval_pin] if self.eval_pin else []))}
        return gate.with_adapters(adapter_evaluations(self.spec.adapters, gate, etags))

    def _model_gate(self) -> QualityGateSpec:
        assert self.spec is not None
        if self.spec.quantization.qualityGate is not None:
            gate = self.spec.quantization.qualityGate
            pin = self.eval_pin
            return gate.pinned(pin.etag if pin is not None and pin.uri == gate.evalDataset else None)
        ceiling = self.policy.rules.maxPerplexityIncreasePercent
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


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` wins; nested objects merge; lists and scalars replace."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def effective_spec(
    raw_spec: dict[str, Any],
    policy: Combined | QuantizationPolicy | None,
    default_storage: StorageSpec | None = None,
) -> Effective:
    """Merge, validate, then judge by the combined policies' rules (a single policy is combined
    alone)."""
    if not isinstance(policy, Combined):
        policy = combine_policies([policy] if policy is not None else [])
    raw = raw_spec or {}
    # Only what the policy authors wrote: exclude_unset keeps model defaults from overriding.
    defaults = dict(policy.defaults)
    if default_storage is not None and "storage" not in defaults:
        defaults["storage"] = default_storage.to_wire()
    merged = deep_merge(defaults, raw)
    try:
        spec = QuantizedModelSpec.model_validate(merged)
    except ValidationError as e:
        return Effective(None, policy, errors=bounded(format_validation_error(e, prefix="spec")), raw_spec=raw)
    errors = []
    if spec.storage is None:
        errors.append("spec.storage: no artifact storage: set spec.storage.uri, or a policy default, "
                      "or the operator's FEWERBITS_DEFAULT_STORAGE_URI")
    if spec.source.scheme != "s3" and (spec.source.endpoint or spec.source.region):
        errors.append("spec.source.endpoint: only s3:// sources take an endpoint or region")
    # Checked here, before observe reads anything from them (literal addresses and known names:
    # no DNS, so deciding stays pure; the Job and the fetcher also check what names resolve to).
    for field_name, endpoint in endpoints(spec):
        if why := endpoint_refusal(endpoint):
            errors.append(f"{field_name}: {endpoint} is refused: {why}")
    gate = spec.quantization.qualityGate
    for field_name, dataset, names in (
            ("spec.quantization.calibration.dataset", spec.quantization.calibration.dataset, CALIBRATION_DATASETS),
            ("spec.quantization.qualityGate.evalDataset", gate.evalDataset if gate else None, BUILTIN_DATASETS)):
        if dataset and "://" not in dataset and dataset not in names:
            errors.append(f"{field_name}: {dataset!r} is not a built-in dataset (built-in: "
                          f"{', '.join(names)}); use s3://bucket/path.jsonl or hf://datasets/org/name")
    # lm-eval's own task registry (pinned release, as data): no GPU Job for an unknown task.
    errors += benchmark_problems(spec.quantization.qualityGate)
    # vLLM's own argument rules (its parser's flags, types and choices, pinned release).
    errors += [f"spec.serving.extraArgs: {e}" for e in check_vllm_args(spec.serving.extraArgs)]
    return Effective(spec, policy, errors=bounded(errors), violations=bounded(check_rules(spec, raw, policy)),
                     raw_spec=raw)


def endpoints(spec: QuantizedModelSpec) -> list[tuple[str, str]]:
    """(field, URL) of each endpoint the operator and its workloads will connect to for a model."""
    out = [("spec.source.endpoint", spec.source.endpoint)]
    if spec.storage is not None:
        out.append(("spec.storage.endpoint", spec.storage.endpoint))
    out += [(f"spec.adapters[{i}].source.endpoint", a.source.endpoint) for i, a in enumerate(spec.adapters)]
    return [(f, e) for f, e in out if e]


def _arg_flags(args: list[str]) -> list[tuple[int, str]]:
    """(index, argument) of each flag in an argument list (values skipped)."""
    return [(i, a) for i, a in enumerate(args) if a.startswith("-") and not a.lstrip("-")[:1].isdigit()]


def extra_args_violations(spec: QuantizedModelSpec, policy: Combined) -> list[str]:
    """What of ``spec.serving.extraArgs`` the policies (or their absence) refuse, each naming its
    argument. Checked with or without a policy: no policy means no plan- or trust-changing flag is
    allowed; with ``spec.adapters`` the LoRA flags are the operator's. Flags are compared by what they
    set in vLLM's parser (its `dest`), so `--trust_remote_code`, `-tp`, `--flag=value` or `--no-...`
    spellings name the same setting."""
    out: list[str] = []
    plan_owned = {flag_dest(f) for f in PLAN_OWNED_FLAGS}
    trust = {flag_dest(f) for f in TRUST_FLAGS}
    lora = {flag_dest(f) for f in LORA_FLAGS} if spec.adapters else set()
    for i, arg in _arg_flags(spec.serving.extraArgs):
        dest, flag = flag_dest(arg), arg.split("=", 1)[0]
        refusing = [n for n, dests, _ in policy.extra_args if dest not in dests]
        if dest in lora:
            out.append(f"spec.serving.extraArgs[{i}]: {flag} is set from spec.adapters (each pool loads the adapters "
                       "that passed there): remove it")
            continue
        if dest in plan_owned | trust and (refusing or not policy.extra_args):
            kind = "overrides the plan" if dest in plan_owned else "changes what the server trusts"
            msg = f"spec.serving.extraArgs[{i}]: {flag} {kind}; a policy must list it in rules.allowedExtraArgs"
            if policy.extra_args:
                msg = f"spec.serving.extraArgs[{i}]: {flag} {kind} and is not listed in rules.allowedExtraArgs"
            out.append(f"policy {', '.join(refusing or policy.names)} rule allowedExtraArgs: {msg}"
                       if policy.governed else msg)
        elif policy.rules.extraArgsMode == "Strict" and refusing:
            out.append(f"policy {', '.join(refusing)} rule allowedExtraArgs: spec.serving.extraArgs[{i}]: {flag} is "
                       "not listed in rules.allowedExtraArgs (extraArgsMode Strict: only listed flags pass)")
    return out


def pattern_violations(spec: QuantizedModelSpec, policy: Combined) -> list[str]:
    """The allowedSources, allowedImages and allowedEndpoints rules: each field that matches none
    of a policy's patterns, naming the policy (every policy's patterns must match)."""
    out: list[str] = []
    sources = [("spec.source.uri", spec.source.uri)] + [
        (f"spec.adapters[{i}].source.uri", a.source.uri) for i, a in enumerate(spec.adapters)]
    for name, patterns in policy.source_patterns:
        out += [f"policy {name} rule allowedSources: {field_name} {uri} matches none of {', '.join(patterns)}"
                for field_name, uri in sources if not any(fnmatch.fnmatchcase(uri, p) for p in patterns)]
    for name, patterns in policy.image_patterns if spec.serving.image is not None else ():
        if not any(fnmatch.fnmatchcase(spec.serving.image, p) for p in patterns):
            out.append(f"policy {name} rule allowedImages: spec.serving.image {spec.serving.image} matches none of "
                       f"{', '.join(patterns)}")
    for name, patterns in policy.endpoint_patterns:
        out += [f"policy {name} rule allowedEndpoints: {field_name} {endpoint} matches none of {', '.join(patterns)}"
                for field_name, endpoint in endpoints(spec) if not any(endpoint_matches(endpoint, p) for p in patterns)]
    return out


def check_rules(spec: QuantizedModelSpec, raw_spec: dict[str, Any], policy: Combined) -> list[str]:
    """Every broken rule, each message naming the rule, the policy (or policies) that set it and
    the offending field; and each conflict between the policies, naming both."""
    out = [f"policies {' and '.join(c.policies)} conflict: {c.message}" for c in policy.conflicts]
    rules, src = policy.rules, policy.rule_sources

    def broke(rule: str, what: str, by: str | None = None) -> None:
        out.append(f"policy {by or src.get(rule)} rule {rule}: {what}")

    out += extra_args_violations(spec, policy)
    if spec.source.trustRemoteCode and not rules.allowTrustRemoteCode:
        msg = "spec.source.trustRemoteCode is true; a policy must set rules.allowTrustRemoteCode"
        if "allowTrustRemoteCode" in src:
            broke("allowTrustRemoteCode", "spec.source.trustRemoteCode is true; the policy sets "
                                          "rules.allowTrustRemoteCode false")
        else:
            out.append(f"policy {', '.join(policy.names)} rule allowTrustRemoteCode: {msg}" if policy.governed else msg)
    fmt = spec.quantization.format
    if rules.allowedFormats and fmt is not QuantFormat.AUTO and fmt not in rules.allowedFormats:
        broke("allowedFormats", f"spec.quantization.format {fmt.value} is not one of "
                                f"{', '.join(f.value for f in rules.allowedFormats)}")
    out += pattern_violations(spec, policy)
    if rules.requireRevisionPin and not spec.source.revision:
        broke("requireRevisionPin", "spec.source.revision must pin the revision to quantize")
    for i, a in enumerate(spec.adapters if rules.requireRevisionPin else []):
        if not a.source.revision:
            broke("requireRevisionPin", f"spec.adapters[{i}].source.revision must pin the adapter's revision")
    if rules.requirePinnedData:
        for what in unpinned_data(spec):
            broke("requirePinnedData", what)
    explicit_gate = ((raw_spec.get("quantization") or {}).get("qualityGate")) is not None
    if rules.requireQualityGate and not explicit_gate:
        broke("requireQualityGate", "spec.quantization.qualityGate must be set")
    if rules.requireServingCanary and not spec.serving.canary.enabled:
        broke("requireServingCanary", "spec.serving.canary.enabled must not be false: every new variant is "
                                      "judged through its serving API before it takes traffic")
    model_gate = spec.quantization.qualityGate
    thresholds = [("spec.quantization.qualityGate", model_gate.maxPerplexityIncreasePercent if model_gate else None)] + [
        (f"spec.adapters[{i}].gate", a.gate.maxPerplexityIncreasePercent) for i, a in enumerate(spec.adapters)]
    ceiling = rules.maxPerplexityIncreasePercent
    for where, value in thresholds if ceiling is not None else []:
        if value is not None and value > ceiling:
            broke("maxPerplexityIncreasePercent", f"{where}.maxPerplexityIncreasePercent {value:g} exceeds the "
                                                  f"ceiling {ceiling:g}")
    if rules.maxReplicas is not None and spec.autoscaling.enabled and spec.autoscaling.maxReplicas > rules.maxReplicas:
        broke("maxReplicas", f"spec.autoscaling.maxReplicas {spec.autoscaling.maxReplicas} exceeds {rules.maxReplicas}")
    if rules.maxReplicas is not None and not spec.autoscaling.enabled and spec.serving.replicas > rules.maxReplicas:
        broke("maxReplicas", f"spec.serving.replicas {spec.serving.replicas} exceeds {rules.maxReplicas}")
    return out


MAX_EFFECTIVE_VALUES = 64
"""Entries of status.effective.values (the CRD's maxItems); a policy rarely sets a tenth of that."""


def _compact(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value(path: str, value: str, source: str) -> EffectiveValue:
    """One entry, cut to the CRD's limits (a label key alone may be 253 characters)."""
    return EffectiveValue(path=_cut(path, 256), value=_cut(value, 256), source=_cut(source, 512))


def _leaf(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = tree
    for part in path:
        node = node[part]
    return node


def _set_in(tree: dict[str, Any], path: tuple[str, ...]) -> bool:
    """Whether the model's own spec sets ``path`` or a value above it that replaces it."""
    node: Any = tree
    for part in path:
        if not isinstance(node, dict) or part not in node or node[part] is None:
            return False
        node = node[part]
        if not isinstance(node, dict):
            return True
    return True


def effective_values(eff: Effective) -> EffectivePolicies | None:
    """What the policies contributed to this model's effective spec, each value with its source
    (status.effective); None when no policy governs the model."""
    pol = eff.policy
    if not pol.governed:
        return None
    values: list[EffectiveValue] = []
    for path, source in sorted(pol.default_sources.items()):
        if not _set_in(eff.raw_spec, path):
            values.append(_value("spec." + ".".join(path), _compact(_leaf(pol.defaults, path)), source))
    if eff.spec is not None and eff.spec.quantization.qualityGate is None \
            and "maxPerplexityIncreasePercent" in pol.rule_sources:
        values.append(_value("spec.quantization.qualityGate.maxPerplexityIncreasePercent",
                             _compact(eff.gate().maxPerplexityIncreasePercent),
                             pol.rule_sources["maxPerplexityIncreasePercent"]))
    rules = pol.rules.model_dump(mode="json")
    for path, source in sorted(pol.rule_sources.items()):
        value = _leaf(rules, pol.rule_leaves.get(path, (path,)))
        values.append(_value(f"rules.{path}", _compact(value), source))
    for name, patterns in pol.source_patterns:
        values.append(_value("rules.allowedSources", _compact(list(patterns)), name))
    for name, patterns in pol.image_patterns:
        values.append(_value("rules.allowedImages", _compact(list(patterns)), name))
    for name, patterns in pol.endpoint_patterns:
        values.append(_value("rules.allowedEndpoints", _compact(list(patterns)), name))
    for name, dests, _strict in pol.extra_args:
        values.append(_value("rules.allowedExtraArgs", _compact(sorted("--" + d.replace("_", "-") for d in dests)),
                             name))
    for family, fmt in sorted(pol.format_by_gpu_family.items()):
        values.append(_value(f"formatByGPUFamily.{family}", fmt.value, pol.format_sources[family]))
    return EffectivePolicies(policies=list(pol.names)[:64], values=values[:MAX_EFFECTIVE_VALUES])
