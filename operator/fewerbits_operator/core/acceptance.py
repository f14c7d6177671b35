"""Decide's first steps, pure: Accepted (the effective spec under the matching policies, the
Secrets it names), Planned (the plan and what changed since the last one) and the Job sizing the
plan asks for. decide.py composes them; they read ``Observed`` only."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from fewerbits_api.conditions import Reason
from fewerbits_api.formats import QuantFormat
from fewerbits_api.names import SECRET_ACCESS_KEY_ID, SECRET_HF_TOKEN, SECRET_SECRET_ACCESS_KEY
from fewerbits_api.quantizedmodel import (
    EffectiveAutoscaling,
    EffectivePolicies,
    PlanStatus,
    QuantizedModelSpec,
    RejectedPool,
    StorageSpec,
)
from fewerbits_api.validation import DNS1123_LABEL

from fewerbits_operator.base.datapins import EVAL_FIELD
from fewerbits_operator.artifacts.effective import Effective, combine_policies, effective_spec, matching_policies
from fewerbits_operator.planner import PlanRequest, plan, unmatched_targets
from fewerbits_operator.planner.jobsize import cap_violations, inputs_from, plan_job_sizes
from fewerbits_operator.serving.render import (
    LABEL_VARIANT,
    deployment_name,
)
from fewerbits_operator.base.observed import Observed, PlanVerdict
from fewerbits_operator.serving.routing import capacity_placement
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.core.outcome import StatusBuilder

EFFECTIVE_SPEC_CHANGED = "EffectiveSpecChanged"
"""Event reason: a policy change altered a value of the model's effective spec."""
MAX_CHANGE_EVENTS = 8
"""EffectiveSpecChanged events per pass; one policy edit rarely changes more values."""
MAX_NAME = 40
"""A model's name prefixes Deployment names (`<name>-<pool>`): at most 40 characters."""


# ------------------------------------------------------------------ Accepted


@dataclass(frozen=True)
class Acceptance:
    effective: Effective
    missing_secrets: tuple[str, ...] = ()

    @property
    def spec(self) -> QuantizedModelSpec | None:
        return self.effective.spec

    @property
    def accepted(self) -> bool:
        return self.effective.accepted and not self.missing_secrets


def secret_refs(spec: QuantizedModelSpec) -> list[tuple[str, str, str]]:
    """(the field that names it, Secret name, the scheme it is read for) for each Secret the spec names."""
    out = []
    if spec.source.credentialsSecret:
        out.append(("spec.source.credentialsSecret", spec.source.credentialsSecret, spec.source.scheme))
    if spec.storage is not None and spec.storage.credentialsSecret:
        out.append(("spec.storage.credentialsSecret", spec.storage.credentialsSecret, "s3"))
    for i, a in enumerate(spec.adapters):
        if a.source.credentialsSecret:
            out.append((f"spec.adapters[{i}].source.credentialsSecret", a.source.credentialsSecret, a.source.scheme))
    return out


SECRET_KEYS = {
    "hf": (SECRET_HF_TOKEN,),
    "s3": (SECRET_ACCESS_KEY_ID, SECRET_SECRET_ACCESS_KEY),
}
"""The keys each Secret must have, by the scheme it is read for."""


def missing_secrets(spec: QuantizedModelSpec, namespace: str, secrets: Mapping[str, frozenset[str] | None]
                     ) -> tuple[str, ...]:
    out = []
    for field_name, secret, scheme in secret_refs(spec):
        keys = secrets.get(secret)
        if keys is None:
            out.append(f"{field_name}: Secret {secret} not found in namespace {namespace}")
            continue
        need = SECRET_KEYS.get(scheme, ())
        if lacking := [k for k in need if k not in keys]:
            out.append(f"{field_name}: Secret {secret} has no key {', '.join(lacking)}")
    return tuple(out)


def effective_for(obs: Observed, settings: OperatorSettings) -> Acceptance:
    """The effective spec under every matching policy, combined, judged by their rules and, once
    the Secrets were read, by the Secrets it names."""
    if not re.fullmatch(DNS1123_LABEL.strip("^$"), obs.name) or len(obs.name) > MAX_NAME:
        return Acceptance(Effective(None, errors=[
            f"metadata.name: {obs.name!r} must be a DNS label of at most {MAX_NAME} characters "
            "(it names the Service and prefixes Deployment names)"]))
    broken = [f"QuantizationPolicy {b.name} applies to namespace {obs.namespace} but is invalid ({b.error}); "
              "fix the policy" for b in obs.broken_policies if b.may_select]
    if broken:
        # Fail closed: a policy meant for this namespace that can't be read must not leave the
        # namespace ungoverned (stored before a stricter CRD, or written by a client that skipped
        # validation).
        return Acceptance(Effective(None, violations=broken))
    # Every matching policy applies, combined (docs/policies.md); observe read them all at once,
    # so one pass sees one consistent set.
    policy = combine_policies(matching_policies(list(obs.policies), dict(obs.namespace_labels)))
    default_storage = None
    if settings.default_storage_uri:
        default_storage = StorageSpec(uri=settings.default_storage_uri, endpoint=settings.default_storage_endpoint,
                                      region=settings.default_storage_region,
                                      credentialsSecret=settings.default_storage_credentials_secret)
    eff = effective_spec(dict(obs.spec), policy, default_storage)
    eff.eval_pin = obs.eval_pin
    eff.adapter_eval_pins = obs.adapter_eval_pins
    if not eff.accepted or obs.secrets is None:
        return Acceptance(eff)
    assert eff.spec is not None
    return Acceptance(eff, missing_secrets(eff.spec, obs.namespace, obs.secrets))


def effective_autoscaling(acc: Acceptance, obs: Observed | None = None,
                          settings: OperatorSettings | None = None) -> EffectiveAutoscaling | None:
    if acc.spec is None:
        return None
    cap = acc.effective.policy.rules.maxReplicas
    placement, weights = capacity_placement(acc.spec.serving, obs.routing if obs is not None else None,
                                            settings.cost_weights if settings is not None else {},
                                            acc.effective.policy.rules.poolCostWeights)
    return EffectiveAutoscaling(**acc.spec.autoscaling.model_dump(), policyMaxReplicas=cap, placement=placement,
                                poolCostWeights=weights)


def effective_changes(old: EffectivePolicies | None, new: EffectivePolicies | None, same_generation: bool,
                      st: StatusBuilder) -> None:
    """One `EffectiveSpecChanged` event per value a policy change altered (the model's own spec
    unchanged since the last pass), naming the path and the policy."""
    if old is None or not same_generation or old == new:
        return
    before = {(v.path, v.source): v.value for v in old.values}
    after = {(v.path, v.source): v.value for v in (new.values if new else [])}
    lines = [f"{path} = {value}" + (f" (was {before[(path, source)]})" if (path, source) in before else "") +
             f", set by policy {source}"
             for (path, source), value in after.items() if before.get((path, source)) != value]
    lines += [f"{path} no longer set by policy {source} (was {value})"
              for (path, source), value in before.items() if (path, source) not in after]
    if (new.policies if new else []) != old.policies:
        lines.append("governing policies: " + (", ".join(new.policies) if new else "none") +
                     f" (was {', '.join(old.policies) or 'none'})")
    for line in lines[:MAX_CHANGE_EVENTS]:
        st.note("Normal", EFFECTIVE_SPEC_CHANGED, line)
    if len(lines) > MAX_CHANGE_EVENTS:
        st.note("Normal", EFFECTIVE_SPEC_CHANGED, f"... and {len(lines) - MAX_CHANGE_EVENTS} more changes "
                                                  "(see status.effective)")


# ------------------------------------------------------------------ Planned


def plan_summary(the_plan: PlanStatus) -> str:
    rejected = f"; {len(the_plan.rejected)} pool(s) rejected (see status.plan.rejected)" if the_plan.rejected else ""
    return ", ".join(f"{v.pool}: {v.format.value} tp={v.tensorParallelSize} kv={v.kvCacheDtype}"
                     for v in the_plan.variants) + rejected


def _target_text(target: Any) -> str:
    if target.family:
        return f"family {getattr(target.family, 'value', target.family)}"
    if target.product:
        return f"product {target.product}"
    return "nodeSelector " + ",".join(f"{k}={v}" for k, v in (target.nodeSelector or {}).items())


def current_plan(obs: Observed, acc: Acceptance) -> tuple[PlanStatus, PlanVerdict]:
    """This pass's plan, and what the Planned condition says of it (before pools gone are known):
    the one observe computed (``Observed.planning``, from the same facts), else computed here."""
    if obs.planning is not None:
        return obs.planning.plan, obs.planning.verdict
    return plan_of(obs, acc)


def plan_of(obs: Observed, acc: Acceptance) -> tuple[PlanStatus, PlanVerdict]:
    """The planner run on the observed shape and pools (``current_plan`` says when)."""
    spec = acc.spec
    assert spec is not None
    old = obs.old_status
    pools = list(obs.pools or ())
    if obs.shape is None:
        why = obs.config_error or "the source's config.json was not read"
        if not (old.plan and old.plan.variants and old.observedGeneration == obs.generation):
            return PlanStatus(), PlanVerdict(None, False, Reason.MODEL_CONFIG_UNAVAILABLE, why)
        # The source is unreachable now (Hub outage, rotated token) but this generation was planned
        # before: keep that plan, so what serves keeps its status; say why it's stale.
        return old.plan, PlanVerdict(old.plan, True, Reason.PLANNED, plan_summary(old.plan) +
                                     f"; kept from an earlier pass: the source's config.json cannot be read now ({why})")
    policy = acc.effective.policy
    request = PlanRequest.from_spec(spec, policy.policy_spec() if policy.governed else None,
                                    default_served_model_name=obs.name, adapters=obs.adapters)
    the_plan = plan(obs.shape, pools, request)
    if not pools:
        return the_plan, PlanVerdict(the_plan, False, Reason.NO_GPU_POOLS,
                                     "no node carries GPU Feature Discovery labels (nvidia.com/gpu.product) with "
                                     "allocatable nvidia.com/gpu")
    if not the_plan.variants:
        lost = unmatched_targets(pools, spec.serving.targets)
        unmatched = [f"spec.serving.targets[{i}] ({_target_text(t)}) matches no GPU pool"
                     for i, t in enumerate(spec.serving.targets) if any(t is x for x in lost)]
        return the_plan, PlanVerdict(the_plan, False, Reason.NO_POOL_FITS, "no GPU pool can serve the model: " +
                                     "; ".join(unmatched + [f"{r.pool}: {r.reason}" for r in the_plan.rejected]))
    return the_plan, PlanVerdict(the_plan, True, Reason.PLANNED, plan_summary(the_plan))


def pools_gone(obs: Observed, the_plan: PlanStatus) -> list[tuple[str, str]]:
    """(pool, Deployment) for Deployments of this model whose pool has no node left: kept, and
    reported (cordoned for an upgrade, device plugin restarting, scaled to zero)."""
    wanted = {deployment_name(obs.name, v.pool) for v in the_plan.variants}
    present = {p.name for p in obs.pools or ()}
    out = []
    for dname in sorted(set(obs.deployments) - wanted):
        pool = (obs.deployments[dname]["metadata"].get("labels") or {}).get(LABEL_VARIANT)
        if pool not in present:
            out.append((str(pool), dname))
    return out


def with_gone_pools(the_plan: PlanStatus, gone: list[tuple[str, str]]) -> PlanStatus:
    rejected = list(the_plan.rejected)
    for pool, dname in gone:
        if not any(r.pool == pool for r in rejected):
            rejected.append(RejectedPool(
                pool=pool, reason=f"no node of this pool is in the cluster any more (no Ready node with allocatable "
                                  f"nvidia.com/gpu); Deployment {dname} is kept until the pool returns or the model no "
                                  "longer wants it"))
    return the_plan.model_copy(update={"rejected": rejected})


# ------------------------------------------------------------------ Job sizing


@dataclass(frozen=True)
class JobSizing:
    """What each artifact's Job needs (planner.jobsize), and the artifacts refused a Job (a policy
    cap, no pool that holds its calibration), by format."""

    jobs: list = field(default_factory=list)
    sizes: Mapping[QuantFormat, Any] = field(default_factory=dict)
    refusals: Mapping[QuantFormat, str] = field(default_factory=dict)


def dataset_refusal(obs: Observed, fmt: QuantFormat) -> str | None:
    """Why a Job for ``fmt`` must not start: the evaluation set it would read was not readable
    (observe checked just before). The S3 calibration object is read earlier, for its ETag
    (datapins); an unreadable one is CalibrationDataUnavailable."""
    if fmt is QuantFormat.NONE:
        return None
    return obs.dataset_errors.get(EVAL_FIELD)


def job_sizing(obs: Observed, acc: Acceptance, the_plan: PlanStatus, settings: OperatorSettings) -> JobSizing:
    """Size every artifact's Job from the model's shape; a plan kept from an earlier pass (the
    source's config.json unreadable now) keeps its sizes."""
    if obs.shape is None:
        jobs = list(the_plan.quantizationJobs)
        return JobSizing(jobs, {j.format: j for j in jobs})
    combined = acc.effective.policy
    rules = combined.rules
    jobs, unsized = plan_job_sizes(obs.shape, the_plan, obs.pools or (),
                                   inputs_from(acc.spec, rules.quantizationJob, rules, settings.job_volume_threshold_gib))
    refusals = {fmt: f"{fmt.value}: {why}" for fmt, why in unsized.items()}
    for j in jobs:
        if over := cap_violations(j, rules.maxQuantizationJobGPUs, rules.maxQuantizationJobMemoryGiB,
                                  combined.rule_sources):
            refusals[j.format] = "; ".join(over)
    return JobSizing(jobs, {j.format: j for j in jobs}, refusals)
