"""Decide: from one ``Observed`` to the new status, the writes to make and the events to post.

``decide(observed, settings) -> Outcome`` is pure: no I/O, and no clock but ``observed.now``.
Running it twice on the same facts gives the same outcome, and on facts that already match what it
wants, no action (zero writes at rest). ``execute`` applies the outcome; ``observe`` gathers the
facts. The steps mirror the conditions:

Accepted → Planned → Quantized → QualityGatePassed → Deployed → Ready. Each step that cannot go
on says why in its condition; the steps after it say what they wait for. What is already serving
keeps serving: a failed gate, a failed Job or an invalid new spec never removes a Deployment that
works.

Memory between passes is typed status, never text: a failed Job is remembered in
``status.artifacts[].failure`` (with its generation), a cache hit in ``cacheHit``, the Job of an
artifact in ``job``. Condition messages are written for people and never read back.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from fewerbits_api import conditions as C
from fewerbits_api.quality import base_eval_identity, eval_identity
from fewerbits_api.conditions import Condition, Reason, set_condition
from fewerbits_api.formats import QuantFormat
from fewerbits_api.names import SECRET_ACCESS_KEY_ID, SECRET_HF_TOKEN, SECRET_SECRET_ACCESS_KEY
from fewerbits_api.policy import QuantizationJobPlacement
from fewerbits_api.quantizedmodel import (
    AUTOSCALER_FIELDS,
    PlanVariant,
    ArtifactFailure,
    ArtifactQueue,
    ArtifactStatus,
    EffectiveAutoscaling,
    EffectivePolicies,
    PlanStatus,
    PublishedRoute,
    QualityGateSpec,
    QualityStatus,
    QuantizedModelSpec,
    QuantizedModelStatus,
    RejectedPool,
    StorageSpec,
    VariantServingStatus,
)
from fewerbits_api.validation import DNS1123_LABEL

from fewerbits_operator.core.adapters import (AdapterInputs, adapters_condition, adapters_step, confirm_served,
                                              served_on)
from fewerbits_operator.artifacts.keys import (
    PlannedArtifact,
    artifact_format,
    outdated_tools,
    planned_artifacts,
    published_at,
)
from fewerbits_operator.base.claims import ClaimState, claim_state, new_claim
from fewerbits_operator.base.datapins import CALIBRATION_FIELD, EVAL_FIELD, calibration_status, s3_calibration_uri
from fewerbits_operator.artifacts.effective import Effective, combine_policies, effective_spec, effective_values, matching_policies
from fewerbits_operator.planner import PlanRequest, plan, unmatched_targets
from fewerbits_operator.artifacts.jobfailure import classify as classify_job_failure
from fewerbits_operator.planner.jobsize import cap_violations, deadline_seconds, inputs_from, job_pool_selectors, plan_job_sizes
from fewerbits_operator.planner.vllm_args import served_model_name
from fewerbits_operator.serving.lws import INSTALL_LWS, lws_status, render_lws
from fewerbits_operator.base.actions import (  # noqa: F401  (re-exported: the writes decide asks for)
    ACTION_TYPES,
    Action,
    AddJobOwner,
    ClaimArtifact,
    CreateDeployment,
    CreateInferencePool,
    CreateJob,
    CreatePickerObject,
    CreateService,
    DeleteDeployment,
    DeleteJob,
    Event,
    PatchInferencePool,
    PatchService,
    ReplaceDeployment,
    UpdatePickerObject,
    WorkloadKind,
)
from fewerbits_operator.serving import canary as canary_mod
from fewerbits_operator.serving.canary import CanaryDecision, adapter_verdicts
from fewerbits_operator.serving.serving_load import ServedAdapter
from fewerbits_operator.serving.render import (
    ANNOTATION_ARTIFACT_KEY,
    ANNOTATION_SPEC_HASH,
    LABEL_VARIANT,
    Owner,
    deployment_name,
    endpoint,
    render_deployment,
    lora_modules_in,
    render_job,
    render_service,
)
from fewerbits_operator.base.observed import ArtifactFacts, ContainerTermination, JobFacts, JobState, Observed, Planning, PlanVerdict  # noqa: F401
from fewerbits_operator.base.terminations import job_failure_text, pod_failure, termination_text  # noqa: F401  (re-exported)
from fewerbits_operator.base.queueing import OPERATOR_CAP, Admission, Waiter, kueue_queue, operator_queue
from fewerbits_operator.artifacts.evaljob import render_eval_job
from fewerbits_operator.artifacts.quality_gate import failure_text, judge_quality, needs_evaluation, worst_recovery
from fewerbits_operator.serving import gatewayroute, picker
from fewerbits_operator.serving import routing
from fewerbits_operator.serving.routing import capacity_placement
from fewerbits_operator.base.settings import OperatorSettings

EFFECTIVE_SPEC_CHANGED = "EffectiveSpecChanged"
"""Event reason: a policy change altered a value of the model's effective spec."""
MAX_CHANGE_EVENTS = 8
"""EffectiveSpecChanged events per pass; one policy edit rarely changes more values."""
LATER = (C.PLANNED, C.QUANTIZED, C.QUALITY_GATE_PASSED, C.SERVING_QUALITY_PASSED, C.DEPLOYED, C.READY)
WARNING_REASONS = frozenset({
    Reason.INVALID_SPEC, Reason.POLICY_VIOLATION, Reason.MISSING_SECRET, Reason.NO_GPU_POOLS,
    Reason.NO_POOL_FITS, Reason.MODEL_CONFIG_UNAVAILABLE, Reason.JOB_FAILED, Reason.STORAGE_UNAVAILABLE,
    Reason.JOB_OOM_KILLED, Reason.JOB_EVICTED, Reason.JOB_OUT_OF_DISK, Reason.JOB_DEADLINE_EXCEEDED,
    Reason.JOB_EXCEEDS_POLICY, Reason.DATASET_UNREADABLE,
    Reason.GATE_FAILED, Reason.PODS_FAILING, Reason.POOL_GONE, Reason.SERVICE_CONFLICT,
    Reason.CALIBRATION_DATA_UNAVAILABLE, Reason.ADAPTER_INVALID, Reason.ADAPTERS_NOT_PLANNED,
    routing.REASON_UNAVAILABLE, routing.REASON_CONFLICT, Reason.METRICS_UNAVAILABLE,
    Reason.CANARY_FAILED, Reason.CANARY_NOT_READY, Reason.CANARY_ERROR,
})
MAX_NAME = 40
"""A model's name prefixes Deployment names (`<name>-<pool>`): at most 40 characters."""


# ------------------------------------------------------------------ the outcome


@dataclass(frozen=True)
class Outcome:
    """What one pass decided: the whole new status, the writes, the events."""

    status: QuantizedModelStatus
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()


# ------------------------------------------------------------------ condition bookkeeping


@dataclass
class StatusBuilder:
    """Conditions set in order, with an event for each real transition (status or reason)."""

    conditions: list[Condition]
    generation: int | None
    now: str
    events: list[Event] = field(default_factory=list)

    def set(self, type_: str, ok: bool | str, reason: str, message: str) -> None:
        before = C.get_condition(self.conditions, type_)
        self.conditions = set_condition(self.conditions, type_, ok, reason, message, self.generation, now=self.now)
        after = C.get_condition(self.conditions, type_)
        assert after is not None
        if before is None or before.status != after.status or before.reason != after.reason:
            kind = "Warning" if reason in WARNING_REASONS else "Normal"
            self.events.append(Event(kind, reason, f"{type_}={after.status}: {message}"[:1024]))

    def waiting(self, types: tuple[str, ...], reason: str, message: str) -> None:
        for t in types:
            self.set(t, False, reason, message)

    def note(self, type_: str, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message[:1024]))


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


# ------------------------------------------------------------------ Quantized and the gate


@dataclass
class ArtifactVerdict:
    """What is decided of one planned artifact."""

    planned: PlannedArtifact
    manifest: Any = None
    job: str | None = None
    """The Job that produces it (None on a cache hit)."""
    cache_hit: bool = False
    failure: ArtifactFailure | None = None
    """Its Job failed (kept after the Job's TTL removes it)."""
    unavailable: str | None = None
    """Storage could not be read now (transient)."""
    unavailable_reason: str = Reason.STORAGE_UNAVAILABLE
    """The Quantized reason it gives: the storage, or the S3 calibration object."""
    waiting: str | None = None
    """What it waits for."""
    pending: bool = False
    """Its Job has no running pod yet."""
    passed: bool | None = None
    quality: QualityStatus | None = None
    outdated_tools: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Tools whose version differs from the current quantization image's (made, current)."""
    refused: str | None = None
    """No Job is created: its sizing exceeds a policy cap, or no pool can run it (the figures), or
    a dataset it would read cannot be read."""
    refused_reason: str = Reason.JOB_EXCEEDS_POLICY
    queue: ArtifactQueue | None = None
    """Its Job waits: not created yet under the operator's cap, or suspended until Kueue admits it."""
    quality_result: Any = None
    """Figures measured after publishing under the current evaluation identity (they answer the gate)."""
    evaluating: str | None = None
    """The evaluation-only Job that measures the artifact under the current gate, and its state."""

    @property
    def ready(self) -> bool:
        return self.manifest is not None

    @property
    def deployable(self) -> bool:
        return self.ready and bool(self.passed)

    @property
    def failed(self) -> bool:
        return self.failure is not None or self.unavailable is not None or self.refused is not None


def pending_text(job_name: str) -> str:
    return f"Job {job_name} pending (waiting for a node with room)"


def judge(v: ArtifactVerdict, gate: float, gate_spec: QualityGateSpec | None = None) -> None:
    """The operator enforces the gate, with this model's thresholds: an artifact shared by two
    models may pass one's gate and fail the other's (every metric: quality_gate.judge_quality)."""
    if v.manifest is None:
        return
    q = v.quality_result or v.manifest.quality
    if q is None:
        v.passed = v.manifest.format is QuantFormat.NONE
        return
    v.quality = judge_quality(q, gate_spec or QualityGateSpec(maxPerplexityIncreasePercent=gate))
    v.passed = v.quality.passed if not (v.evaluating and not v.quality.passed) else None


def kueue_text(job_name: str, local_queue: str | None) -> str:
    return f"Job {job_name} suspended until Kueue admits it from LocalQueue {local_queue}"


# ------------------------------------------------------------------ one artifact, step by step
#
# decide_artifact composes small steps. Each takes the facts it reads and returns what it decided
# (a verdict, the writes, the events), and writes nothing itself: decide_artifact appends their
# writes and events in the order the steps run. The one exception is the operator's queue
# (``Admission``): admitting a Job holds a slot for the later Jobs of the same pass.


@dataclass(frozen=True)
class ArtifactStep:
    """What one step decided of an artifact: its verdict, the writes and the events, in order."""

    verdict: ArtifactVerdict
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class ClaimStep:
    """The storage claim of an artifact that has no Job: wait for another namespace's Job
    (``held``), or go on and write ``write`` (None: the claim is already this model's)."""

    held: ArtifactVerdict | None = None
    write: ClaimArtifact | None = None


def as_published(planned: PlannedArtifact, facts: ArtifactFacts) -> PlannedArtifact:
    """The artifact under the key it is published at. Published under a legacy key (tool versions
    hashed in) with the planned bytes, or under the fallback key of an `auto` calibration this
    model's Job made without the Hub, it keeps serving under its own key; nothing is re-quantized
    (observe checked serves_planned)."""
    return published_at(planned, facts.manifest)


def previous_artifact(obs: Observed, key: str) -> ArtifactStatus | None:
    """The artifact's entry in the status the last pass wrote."""
    return next((a for a in obs.old_status.artifacts if a.key == key), None)


def owned_by(job: JobFacts, uid: str) -> bool:
    """Whether the model ``uid`` is among the Job's owners."""
    return any(r.get("uid") == uid for r in job.owner_refs)


def queued_since(previous: ArtifactStatus | None, now: str) -> str:
    """When the model first wanted this artifact's Job and could not start it (kept across passes)."""
    return previous.queue.since if previous is not None and previous.queue is not None else now


def published_step(obs: Observed, planned: PlannedArtifact, facts: ArtifactFacts,
                   previous: ArtifactStatus | None, settings: OperatorSettings) -> ArtifactStep:
    """A manifest is at the key: the artifact is ready, made by this model's Job or a cache hit."""
    manifest = facts.manifest
    assert manifest is not None
    job = facts.job
    v = ArtifactVerdict(planned, manifest=manifest, outdated_tools=outdated_tools(manifest, settings.quantjob_tools))
    # A cache hit: published before this model asked for it, by no Job it owns (another
    # model's Job for the same key may still be there until its TTL).
    owns_job = job is not None and owned_by(job, obs.uid)
    # A Job that only waited under the operator's cap was never created: published by another.
    never_started = previous is not None and previous.queue is not None and previous.queue.reason == OPERATOR_CAP
    v.cache_hit = not owns_job and (previous is None or previous.job is None or never_started)
    v.job = None if v.cache_hit else (job.name if job is not None else previous.job if previous else None)
    events: tuple[Event, ...] = ()
    if v.cache_hit and (previous is None or not previous.cacheHit):
        events = (Event("Normal", "CacheHit", f"artifact {planned.key[:12]} ({planned.format.value}) already "
                                              "published: no quantization Job needed"),)
    return ArtifactStep(v, events=events)


def job_step(obs: Observed, planned: PlannedArtifact, job: JobFacts,
             previous: ArtifactStatus | None) -> ArtifactStep:
    """The artifact's Job exists and no manifest is at the key (yet): the model co-owns the Job,
    and the verdict says how the Job stands."""
    v = ArtifactVerdict(planned, job=job.name)
    actions: tuple[Action, ...] = ()
    if not owned_by(job, obs.uid):
        owner = Owner(obs.name, obs.namespace, obs.uid)
        actions = (AddJobOwner(obs.namespace, job.name, tuple(job.owner_refs) + (owner.reference(controller=False),)),)
    if job.state is JobState.FAILED:
        # The first generation that saw this Job fail is kept: an edit made while the failed Job
        # is still there retries once the Job is gone.
        kept = previous.failure if previous is not None and previous.failure is not None \
            and previous.failure.job == job.name else None
        reason, message = classify_job_failure(job) or (Reason.JOB_FAILED, job_failure_text(job))
        v.failure = ArtifactFailure(generation=kept.generation if kept else (obs.generation or 0),
                                    reason=reason, message=message, job=job.name)
    elif job.state is JobState.SUCCEEDED:
        v.failure = ArtifactFailure(generation=obs.generation or 0, reason=Reason.JOB_FAILED, job=job.name,
                                    # The Job is named by key and destination (artifacts.job_name), so it
                                    # published here: the artifact was removed since.
                                    message=f"Job {job.name} succeeded but no manifest is at the artifact key; "
                                            "was the artifact removed after publishing?")
    elif job.suspended and job.queue_name and not job.pod_phases:
        v.pending, v.waiting = True, kueue_text(job.name, job.queue_name)
        v.queue = kueue_queue(job.queue_name, queued_since(previous, obs.now))
    elif job.state is JobState.ACTIVE and job.pod_phases and set(job.pod_phases) != {"Pending"}:
        v.waiting = f"Job {job.name} running (pod {', '.join(job.pod_phases)})"
    elif job.state is JobState.ACTIVE:
        # Active in the Job's count, but no pod of it has started: it waits for the scheduler.
        v.pending, v.waiting = True, f"Job {job.name} pending (pod {', '.join(job.pod_phases) or 'not created yet'}: " \
                                     "waiting for a node with room)"
    else:
        v.pending, v.waiting = True, pending_text(job.name)
    return ArtifactStep(v, actions)


def refusal_step(obs: Observed, planned: PlannedArtifact, previous: ArtifactStatus | None,
                 sizing: JobSizing | None) -> ArtifactVerdict | None:
    """Why no Job may be created for the artifact now, in this order: its Job failed for this
    generation (a new Job would fail the same way), a policy cap or no pool refuses its sizing,
    the evaluation set it would read is unreadable. None: nothing refuses it."""
    if previous is not None and previous.failure is not None and previous.failure.generation == obs.generation:
        # The Job failed for this generation and its TTL (or a person) has since removed it: a
        # new Job would fail the same way. A new generation of the spec (any edit) tries again.
        return ArtifactVerdict(planned, failure=previous.failure, job=previous.failure.job)
    if sizing is not None and (why := sizing.refusals.get(planned.format)):
        return ArtifactVerdict(planned, refused=why)
    if unreadable := dataset_refusal(obs, planned.format):
        return ArtifactVerdict(planned, refused=unreadable, refused_reason=Reason.DATASET_UNREADABLE)
    return None


def claim_step(obs: Observed, storage: StorageSpec, planned: PlannedArtifact, facts: ArtifactFacts,
               deadline: int) -> ClaimStep:
    """One Job per key and storage location, cluster-wide (claims.py): wait while another
    namespace's Job holds the claim, else the claim to write before the Job (``deadline``: the
    Job's activeDeadlineSeconds, which bounds the claim's expiry)."""
    claimed = claim_state(facts.claim, facts.claim_present, obs.namespace, planned.job_name, obs.now,
                          facts.claim_holder_gone)
    if claimed is ClaimState.HELD and facts.claim is not None:
        # Another namespace's Job publishes these bytes to this storage: one Job per key and
        # location, cluster-wide; its manifest will be this model's cache hit.
        return ClaimStep(held=ArtifactVerdict(
            planned, pending=True,
            waiting=(f"Job {facts.claim.job} in namespace {facts.claim.namespace} is producing this artifact in the "
                     f"same storage (claimed until {facts.claim.expires_at}); waiting for its manifest")))
    if claimed is ClaimState.MINE:
        return ClaimStep()
    claim = new_claim(obs.namespace, planned.job_name, obs.now, deadline)
    return ClaimStep(write=ClaimArtifact(obs.namespace, storage, planned.key, claim.to_json(),
                                         take_over=claimed is ClaimState.STALE))


def admission_step(obs: Observed, planned: PlannedArtifact, placement: QuantizationJobPlacement,
                   admission: Admission | None, since: str) -> ArtifactVerdict | None:
    """The operator's cap (queueing.py): over it, the Job is not created yet and the verdict says
    its place in the queue. None: the Job may be created (Kueue's Jobs are created at once and
    wait in Kueue). Admitting holds a slot in ``admission`` for the pass's later Jobs."""
    if placement.kueue is not None or admission is None:
        return None
    position = admission.admit(Waiter(since, obs.namespace, obs.name, planned.job_name))
    if position is None:
        return None
    return ArtifactVerdict(planned, job=planned.job_name, pending=True, queue=operator_queue(position, since),
                           waiting=(f"Job {planned.job_name} queued at position {position}: {admission.running} "
                                    f"of {admission.cap} quantization Jobs running (the operator's cap)"))


def start_step(obs: Observed, acc: Acceptance, planned: PlannedArtifact, placement: QuantizationJobPlacement,
               settings: OperatorSettings, size: Any, since: str) -> ArtifactStep:
    """Create the artifact's Job (``size``: its sizing, None for a plan kept without one). Just
    created, it has no pod yet, told exactly as the next pass will see it (no second write); a
    Kueue Job is created suspended and waits for Kueue."""
    spec = acc.spec
    assert spec is not None
    rendered = render_job(Owner(obs.name, obs.namespace, obs.uid), spec, planned, placement, acc.effective.gate(),
                          settings, size, job_pool_selectors(size, obs.pools or ()) if size is not None else None)
    started = f"Job {planned.job_name} quantizes {spec.source.uri} to {planned.format.value}"
    if placement.kueue is not None:
        local_queue = placement.kueue.localQueueName
        v = ArtifactVerdict(planned, job=planned.job_name, pending=True, queue=kueue_queue(local_queue, since),
                            waiting=kueue_text(planned.job_name, local_queue))
        return ArtifactStep(v, (CreateJob(rendered),),
                            (Event("Normal", "QuantizationStarted", f"{started} once Kueue admits it"),))
    v = ArtifactVerdict(planned, job=planned.job_name, pending=True, waiting=pending_text(planned.job_name))
    return ArtifactStep(v, (CreateJob(rendered),), (Event("Normal", "QuantizationStarted", started),))


def applied(step: ArtifactStep, st: StatusBuilder, actions: list[Action]) -> ArtifactVerdict:
    """A step's writes and events, appended in order; its verdict."""
    actions.extend(step.actions)
    for e in step.events:
        st.note(e.type, e.reason, e.message)
    return step.verdict


def decide_artifact(obs: Observed, acc: Acceptance, planned: PlannedArtifact, facts: ArtifactFacts,
                    placement: QuantizationJobPlacement, settings: OperatorSettings,
                    st: StatusBuilder, actions: list[Action], sizing: JobSizing | None = None,
                    admission: Admission | None = None) -> ArtifactVerdict:
    """One planned artifact: published, its Job's state, or why no Job, or the Job to create (after
    the storage claim and the operator's queue)."""
    spec = acc.spec
    assert spec is not None and spec.storage is not None
    planned = as_published(planned, facts)
    previous = previous_artifact(obs, planned.key)
    if facts.storage_error is not None:
        return ArtifactVerdict(planned, unavailable=facts.storage_error,
                               unavailable_reason=facts.storage_error_reason or Reason.STORAGE_UNAVAILABLE)
    if facts.manifest is not None:
        v = applied(published_step(obs, planned, facts, previous, settings), st, actions)
        decide_evaluation(obs, acc, planned, facts, placement, settings, st, actions, v)
        return v
    if facts.job is not None:
        return applied(job_step(obs, planned, facts.job, previous), st, actions)
    if refused := refusal_step(obs, planned, previous, sizing):
        return refused
    size = sizing.sizes.get(planned.format) if sizing is not None else None
    claim = claim_step(obs, spec.storage, planned, facts,
                       deadline_seconds(size) if size is not None else placement.activeDeadlineSeconds)
    if claim.held is not None:
        return claim.held
    since = queued_since(previous, obs.now)
    if queued := admission_step(obs, planned, placement, admission, since):
        return queued
    if claim.write is not None:
        actions.append(claim.write)
    return applied(start_step(obs, acc, planned, placement, settings, size, since), st, actions)


def decide_evaluation(obs: Observed, acc: Acceptance, planned: PlannedArtifact, facts: ArtifactFacts,
                      placement: QuantizationJobPlacement, settings: OperatorSettings, st: StatusBuilder,
                      actions: list[Action], v: ArtifactVerdict) -> None:
    """A published artifact whose figures do not answer the current gate is measured again by an
    evaluation-only Job (evaljob.py); it is never re-quantized (docs/quality.md)."""
    gate = acc.effective.gate()
    if facts.quality_result is not None:
        v.quality_result = facts.quality_result
        return
    if not needs_evaluation(v.manifest.quality, gate):
        return
    job = facts.eval_job
    if job is None:
        rendered = render_eval_job(Owner(obs.name, obs.namespace, obs.uid), acc.spec, planned, placement, gate,
                                   settings)
        actions.append(CreateJob(rendered))
        name = rendered["metadata"]["name"]
        v.evaluating = f"evaluation Job {name} pending"
        st.note("Normal", "EvaluationStarted", f"Job {name} evaluates artifact {planned.key[:12]} under the changed "
                                               "quality gate (no re-quantization)")
    elif job.state is JobState.FAILED:
        v.evaluating = job_failure_text(job)
    elif job.state is JobState.SUCCEEDED:
        v.evaluating = f"evaluation Job {job.name} succeeded but wrote no result; was it removed?"
    else:
        v.evaluating = f"evaluation Job {job.name} running"


def artifact_status(storage: StorageSpec, v: ArtifactVerdict) -> ArtifactStatus:
    m = v.manifest
    return ArtifactStatus(
        key=v.planned.key,
        uri=f"{storage.uri.rstrip('/')}/{v.planned.key}/",
        format=v.planned.format,
        variants=list(v.planned.variants),
        sizeBytes=m.totalBytes if m else None,
        job=v.job,
        cacheHit=v.cache_hit if m else None,
        quality=v.quality,
        tools=dict(m.tools) if m else {},
        failure=v.failure,
        queue=v.queue,
        calibration=m.calibration if m else None,
    )


def tools_note(verdicts: list[ArtifactVerdict]) -> str:
    """Said, not acted on: an upgrade re-quantizes only when asked (`spec.quantization.requantize`)."""
    older = sorted({f"{t} {made}" for v in verdicts for t, (made, _) in v.outdated_tools.items()})
    if not older:
        return ""
    current = sorted({f"{t} {now}" for v in verdicts for t, (_, now) in v.outdated_tools.items()})
    return (f"; made with {', '.join(older)}, the quantization image has {', '.join(current)}: set "
            "spec.quantization.requantize to re-quantize")


def failure_reason(failed: list[ArtifactVerdict]) -> str:
    """The Quantized condition's reason: the failures' own typed reason (JobOOMKilled, JobEvicted,
    JobOutOfDisk, JobDeadlineExceeded) when they share one, else JobFailed."""
    reasons = {v.failure.reason for v in failed if v.failure is not None}
    typed = {Reason.JOB_OOM_KILLED, Reason.JOB_EVICTED, Reason.JOB_OUT_OF_DISK, Reason.JOB_DEADLINE_EXCEEDED}
    return reasons.pop() if len(reasons) == 1 and reasons <= typed else Reason.JOB_FAILED


def quantized_conditions(verdicts: list[ArtifactVerdict], gate: float, st: StatusBuilder) -> None:
    if not verdicts:
        st.waiting((C.QUANTIZED, C.QUALITY_GATE_PASSED), Reason.BLOCKED, "nothing planned (see Planned)")
        return
    if refused := [v for v in verdicts if v.refused is not None]:
        hint = ("; no quantization Job is created: raise the policy's cap, or choose a smaller model, "
                "another format or a pool that fits"
                if refused[0].refused_reason == Reason.JOB_EXCEEDS_POLICY else
                "; no quantization Job is created until it can be read")
        st.set(C.QUANTIZED, False, refused[0].refused_reason,
               "; ".join(dict.fromkeys(str(v.refused) for v in refused)) + hint)
    elif failed := [v for v in verdicts if v.failed]:
        job_failed = [v for v in failed if v.failure is not None]
        reason = failure_reason(job_failed) if job_failed else Reason.STORAGE_UNAVAILABLE
        if not job_failed and all(v.unavailable_reason == Reason.CALIBRATION_DATA_UNAVAILABLE for v in failed):
            reason = Reason.CALIBRATION_DATA_UNAVAILABLE
        hint = ("; a failed Job is not re-run for the same generation: fix the cause, then edit the spec"
                if job_failed else "")
        st.set(C.QUANTIZED, False, reason, "; ".join(
            f"{v.planned.format.value}: {v.failure.message if v.failure else v.unavailable}" for v in failed) + hint)
    elif all(v.ready for v in verdicts):
        hits = [v for v in verdicts if v.cache_hit]
        reduced = [f"{v.planned.format.value} {v.manifest.calibration.shortfall}" for v in verdicts
                   if v.manifest and v.manifest.calibration and v.manifest.calibration.shortfall]
        reason = Reason.CACHE_HIT if len(hits) == len(verdicts) else Reason.JOB_SUCCEEDED
        st.set(C.QUANTIZED, True, Reason.CALIBRATION_REDUCED if reduced else reason,
               ", ".join(f"{v.planned.format.value}: {v.planned.key[:12]}{' (cache hit)' if v.cache_hit else ''}"
                         for v in verdicts) + tools_note(verdicts)
               + (f"; {'; '.join(reduced)} (more samples: spec.quantization.calibration.dataset)" if reduced else ""))
    else:
        waiting = [v for v in verdicts if not v.ready]
        reason = Reason.JOB_PENDING if all(v.pending for v in waiting) else Reason.JOB_RUNNING
        if all(v.queue is not None for v in waiting):
            reason = Reason.QUEUED
        st.set(C.QUANTIZED, False, reason,
               "; ".join(f"{v.planned.format.value}: {v.waiting or 'waiting'}" for v in waiting))
    if gate_failed := [v for v in verdicts if v.ready and v.passed is False]:
        st.set(C.QUALITY_GATE_PASSED, False, Reason.GATE_FAILED, "; ".join(
            failure_text(v.planned.format.value, v.quality) if v.quality and (v.quality.metrics[1:] or v.quality.missing)
            else f"{v.planned.format.value}: perplexity {v.quality.baselinePerplexity:.3f} → {v.quality.perplexity:.3f} "
            f"({v.quality.increasePercent:+.2f}%) exceeds the gate of {gate:g}%; not rolled out"
            if v.quality else f"{v.planned.format.value}: no quality figures in the manifest; not rolled out"
            for v in gate_failed))
    elif all(v.deployable for v in verdicts):
        st.set(C.QUALITY_GATE_PASSED, True, Reason.GATE_PASSED, ", ".join(
            f"{v.planned.format.value}: {v.quality.increasePercent:+.2f}% ≤ {gate:g}%"
            + "".join(f", {m.name} {m.recoveryPercent:.1f}% ≥ {m.minRecoveryPercent:g}%" for m in v.quality.metrics[1:])
            if v.quality else f"{v.planned.format.value}: unquantized" for v in verdicts))
    else:
        st.set(C.QUALITY_GATE_PASSED, False, Reason.AWAITING_ARTIFACT, "; ".join(
            f"{v.planned.format.value}: {v.evaluating}" for v in verdicts if v.evaluating)
            or "waiting for the quantized artifacts")


# ------------------------------------------------------------------ Deployed and Ready, step by step
#
# decide_serving composes small steps, like decide_artifact: each planned variant's workload (its
# replicas, its canary gate, the create or replace), the removals, the routing, the serving status
# and the three conditions. Each returns what it decided and writes nothing itself; decide_serving
# appends their writes and events in the order the steps run.


@dataclass(frozen=True)
class VariantWorkload:
    """What one planned variant's serving object (a Deployment, or a LeaderWorkerSet: the plan's
    ``WorkloadKind``) became this pass."""

    variant: PlanVariant
    name: str
    current: Mapping[str, Any] | None = None
    """What serves the variant after this pass's writes (None: nothing yet)."""
    up_to_date: bool = False
    """Its object is what is wanted (rolled out only once its status says so too)."""
    canary: CanaryDecision | None = None
    """Its canary's decision, when the canary is on."""
    no_lws: bool = False
    """It spans nodes and the cluster serves no LeaderWorkerSet: refused, the rest serves."""
    deletes: tuple[Action, ...] = ()
    creates: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class Removals:
    """The serving objects no planned variant needs: canaries left over, variants planned away."""

    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class RoutingStep:
    """The Service, and the InferencePool with its picker when the model routes through one."""

    actions: tuple[Action, ...] = ()
    conflict: str | None = None
    """A Service of the model's name that it does not own: nothing is exposed."""
    problem: tuple[str, str] | None = None
    """(reason, message): routing through an InferencePool is refused; the Service serves."""
    endpoint: str | None = None
    route: PublishedRoute | None = None
    """The HTTPRoute to keep (spec.serving.gateway), for status.route."""


@dataclass(frozen=True)
class ServingStep:
    """The serving status: an entry per variant that serves or is judged, and whether every one
    is rolled out."""

    serving: tuple[VariantServingStatus, ...] = ()
    rolled_out: bool = True

    @property
    def replicas(self) -> str | None:
        if not self.serving:
            return None
        return f"{sum(s.readyReplicas for s in self.serving)}/{sum(s.replicas for s in self.serving)}"


@dataclass(frozen=True)
class ConditionVerdict:
    type: str
    status: bool
    reason: str
    message: str


RENDERERS = {WorkloadKind.DEPLOYMENT: render_deployment, WorkloadKind.LEADER_WORKER_SET: render_lws}
"""The renderer of each kind of serving object."""


def replicas_for(spec: QuantizedModelSpec, current: Mapping[str, Any] | None) -> int:
    """The replicas to render: the autoscaler owns them once the object exists (autoscaling on)."""
    if spec.autoscaling.enabled and current is not None:
        return int((current.get("spec") or {}).get("replicas") or 0)
    if spec.autoscaling.enabled:
        return max(1, spec.autoscaling.minReplicas)
    return spec.serving.replicas


def canary_gate(obs: Observed, acc: Acceptance, pv: PlanVariant, art: ArtifactVerdict, desired: dict[str, Any],
                current: Mapping[str, Any] | None, settings: OperatorSettings,
                published: canary_mod.Published | None = None, template: dict[str, Any] | None = None,
                scores_key: str | None = None) -> CanaryDecision | None:
    """A new served configuration takes traffic only after its canary's verdict (canary.py); the
    configuration's hash is stamped on ``desired``. None: the canary is off."""
    spec = acc.spec
    assert spec is not None
    if not spec.serving.canary.enabled:
        return None
    owner = Owner(obs.name, obs.namespace, obs.uid)
    chash = canary_mod.config_hash(spec, pv, art.planned.key, owner.name, settings, published)
    desired["metadata"]["annotations"][canary_mod.ANNOTATION_SERVING_CONFIG] = chash
    old = next((s.canary for s in obs.old_status.serving if s.variant == pv.pool), None)
    return canary_mod.decide_canary(
        owner=owner, spec=spec, variant=pv, desired=desired, current=current, chash=chash,
        artifact_key=art.planned.key, facts=obs.canaries.get(pv.pool), old=old, gate=acc.effective.gate(),
        now=obs.now, settings=settings, canary_template=template,
        scores_key=scores_key if pv.format is QuantFormat.NONE else None)


def base_scores_key(verdicts: list[ArtifactVerdict], gate: QualityGateSpec) -> str | None:
    """A quantized artifact whose report holds the 16-bit base's figures under the gate's
    identity: a 16-bit variant's canary judges it against them (its own artifact measures nothing).
    None while no report answers the gate (the canary then ends without a verdict, naming it)."""
    base = base_eval_identity(gate)
    for v in verdicts:
        q = v.quality_result or (v.manifest.quality if v.manifest else None)
        if v.manifest is not None and v.manifest.format is not QuantFormat.NONE and q is not None and \
                (v.quality_result is not None or base in (q.evalIdentity, q.baseEvalIdentity)):
            return v.manifest.key
    return None


def needs_replace(current: Mapping[str, Any], desired: Mapping[str, Any], autoscaled: bool, replicas: int) -> bool:
    """The object serves another pod spec, other replicas (the operator's, autoscaling off), or
    lacks the served configuration's hash the canary put on the desired one."""
    have = current["metadata"].get("annotations") or {}
    want = desired["metadata"]["annotations"]
    return have.get(ANNOTATION_SPEC_HASH) != want[ANNOTATION_SPEC_HASH] or \
        (not autoscaled and (current.get("spec") or {}).get("replicas") != replicas) or \
        canary_mod.ANNOTATION_SERVING_CONFIG in want and canary_mod.ANNOTATION_SERVING_CONFIG not in have


def rollout(namespace: str, pv: PlanVariant, art: ArtifactVerdict, desired: dict[str, Any],
            current: Mapping[str, Any] | None, autoscaled: bool, replicas: int) -> VariantWorkload:
    """Create the variant's object, replace it when it differs, or keep it. The plan moved between
    one node and several: the old kind goes, the new one comes."""
    dname = desired["metadata"]["name"]
    deletes: tuple[Action, ...] = ()
    if current is not None and WorkloadKind.of(current) is not WorkloadKind.of(desired):
        deletes, current = (DeleteDeployment(namespace, dname, WorkloadKind.of(current)),), None
    if current is None:
        return VariantWorkload(pv, dname, desired, True, deletes=deletes, creates=(CreateDeployment(desired),),
                               events=(Event("Normal", "DeploymentCreated",
                                             f"Deployment {dname} serves {pv.format.value} on pool {pv.pool}"),))
    if not needs_replace(current, desired, autoscaled, replicas):
        return VariantWorkload(pv, dname, current, True, deletes=deletes)
    desired["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    # Just replaced: rolled out only once its status says so.
    return VariantWorkload(pv, dname, {**desired, "status": current.get("status") or {}}, False, deletes=deletes,
                           creates=(ReplaceDeployment(desired),),
                           events=(Event("Normal", "RollingOut", f"Deployment {dname} updated (artifact "
                                                                 f"{art.planned.key[:12]}, {pv.format.value})"),))


def variant_workload(obs: Observed, acc: Acceptance, pv: PlanVariant, art: ArtifactVerdict,
                     settings: OperatorSettings, adapters: tuple[ServedAdapter, ...] = (),
                     published: canary_mod.Published | None = None, scores_key: str | None = None
                     ) -> VariantWorkload:
    """One planned variant: refused (no LeaderWorkerSet), kept as it serves (no deployable artifact,
    its pool gone, its canary without a verdict), or rolled out. ``adapters``: what its pods load;
    ``published``: the adapters published for its pool, which its canary measures."""
    spec = acc.spec
    assert spec is not None
    dname = deployment_name(obs.name, pv.pool)
    current = obs.deployments.get(dname)
    kind = WorkloadKind.for_nodes(pv.nodesPerReplica)
    if kind is WorkloadKind.LEADER_WORKER_SET and not obs.lws_available:
        return VariantWorkload(pv, dname, no_lws=True)
    pool = next((p for p in obs.pools or () if p.name == pv.pool), None)
    if not art.deployable or pool is None:
        return VariantWorkload(pv, dname, current)  # keep what serves (an older artifact) until one passes
    replicas = replicas_for(spec, current)
    def render(loads: tuple[ServedAdapter, ...]) -> dict[str, Any]:
        return RENDERERS[kind](Owner(obs.name, obs.namespace, obs.uid), spec, pv, dict(pool.node_selector),
                               pool.cc_str, art.planned.key, art.manifest.totalBytes if art.manifest else None,
                               replicas, settings, loads)
    desired = render(adapters)
    everything = tuple(ServedAdapter(n, k) for n, k in sorted(published.keys.items())) if published else ()
    template = render(everything) if spec.serving.canary.enabled and everything != adapters else None
    gate = canary_gate(obs, acc, pv, art, desired, current, settings, published, template, scores_key)
    judged = VariantWorkload(pv, dname, current, canary=gate) if gate is None else VariantWorkload(
        pv, dname, current, canary=gate, deletes=tuple(gate.deletes), creates=tuple(gate.creates),
        events=tuple(gate.events))
    if gate is not None and not gate.may_serve:
        return judged  # what serves keeps serving, untouched, until the verdict
    out = rollout(obs.namespace, pv, art, desired, current, spec.autoscaling.enabled, replicas)
    return dataclasses.replace(out, canary=gate, deletes=judged.deletes + out.deletes,
                               creates=judged.creates + out.creates, events=judged.events + out.events)


def removals(obs: Observed, the_plan: PlanStatus, gone: list[tuple[str, str]]) -> Removals:
    """Canaries no variant needs, and the objects of variants no longer planned (a pool gone from
    the cluster keeps its object: pools_gone)."""
    ns = obs.namespace
    left = obs.canary_leftovers
    actions: list[Action] = [DeleteDeployment(ns, n) for n in left.deployments]
    actions += [DeleteDeployment(ns, n, WorkloadKind.LEADER_WORKER_SET) for n in left.leader_worker_sets]
    wanted = {deployment_name(obs.name, v.pool) for v in the_plan.variants}
    events = []
    for dname in sorted(set(obs.deployments) - wanted - {d for _, d in gone}):
        obj = obs.deployments[dname]
        pool = (obj["metadata"].get("labels") or {}).get(LABEL_VARIANT)
        actions.append(DeleteDeployment(ns, dname, WorkloadKind.of(obj)))
        events.append(Event("Normal", "DeploymentRemoved",
                            f"Deployment {dname}: pool {pool} is no longer planned for this model"))
    return Removals(tuple(actions), tuple(events))


def service_actions(obs: Observed, owner: Owner) -> tuple[list[Action], str | None]:
    """Create or repair the model's Service; a Service of that name the model does not own is
    someone else's and is never touched (returns why)."""
    desired = render_service(owner)
    cur = obs.service
    if cur is None:
        return [CreateService(desired)], None
    if not any(r.get("uid") == owner.uid for r in cur["metadata"].get("ownerReferences") or []):
        return [], (f"Service {owner.namespace}/{owner.name} exists and is not owned by this QuantizedModel; it is "
                    "left untouched and nothing is exposed: rename the model or remove that Service")
    spec = cur.get("spec") or {}
    if spec.get("selector") != desired["spec"]["selector"] or \
            [(p.get("port"), p.get("targetPort")) for p in spec.get("ports") or []] != \
            [(p["port"], p["targetPort"]) for p in desired["spec"]["ports"]]:
        return [PatchService(owner.namespace, owner.name,
                             {"spec": {"selector": desired["spec"]["selector"], "ports": desired["spec"]["ports"]}})], None
    return [], None


def inference_pool_step(obs: Observed, owner: Owner, settings: OperatorSettings
                        ) -> tuple[list[Action], tuple[str, str] | None]:
    """The InferencePool and its endpoint picker (picker.py): scoring on KV and queue, or an even
    spread while a variant's pods expose no metrics."""
    actions: list[Action] = []
    pool_actions, problem = routing.pool_actions(obs.routing, owner)
    actions.extend(pool_actions)
    if problem is None and obs.routing is not None:
        picker_actions, conflict = picker.picker_actions(obs.routing.picker, owner, settings.epp_image,
                                                         settings.epp_cluster_role,
                                                         picker.unmetered_variants(obs.old_status.serving))
        actions.extend(picker_actions)
        problem = (routing.REASON_CONFLICT, conflict) if conflict else None
    return actions, problem


def routing_step(obs: Observed, spec: QuantizedModelSpec, planned: bool, settings: OperatorSettings) -> RoutingStep:
    """The Service (something planned), the InferencePool when asked for, else the picker's
    Deployment left from when it was."""
    owner = Owner(obs.name, obs.namespace, obs.uid)
    routed = routing.routing_of(spec.serving) == routing.INFERENCE_POOL
    if not planned:
        gone = picker.leftover(obs.routing.picker, owner) if not routed and obs.routing is not None else None
        return RoutingStep((DeleteDeployment(*gone),) if gone else ())
    actions, conflict = service_actions(obs, owner)
    problem = None
    if routed and not conflict:
        pool_actions, problem = inference_pool_step(obs, owner, settings)
        actions.extend(pool_actions)
    elif not routed and obs.routing is not None and (gone := picker.leftover(obs.routing.picker, owner)):
        actions.append(DeleteDeployment(*gone))
    route = None
    if spec.serving.gateway is not None and not conflict and obs.gateway is not None:
        route_problem = gatewayroute.route_problem(obs.gateway.crd_served, obs.gateway.route, owner)
        route = None if route_problem else PublishedRoute(gateway=spec.serving.gateway,
                                                          inferencePool=routed and problem is None)
        problem = problem or route_problem
    return RoutingStep(tuple(actions), conflict, problem, None if conflict else endpoint(owner), route)


def rolled_out(workload: Mapping[str, Any], up_to_date: bool) -> bool:
    """The object is what is wanted and its controller has rolled every replica out."""
    ds = workload.get("status") or {}
    replicas = int((workload.get("spec") or {}).get("replicas") or 0)
    if WorkloadKind.of(workload) is WorkloadKind.DEPLOYMENT:
        seen = int(ds.get("observedGeneration") or 0) >= int(workload["metadata"].get("generation") or 0)
    else:
        seen = lws_status(workload)[3]
    return up_to_date and seen and int(ds.get("updatedReplicas") or 0) >= replicas and \
        int(ds.get("replicas") or 0) == replicas


def serving_status(obs: Observed, workloads: list[VariantWorkload]) -> ServingStep:
    """An entry per variant that has an object (or a canary judging its first one); the
    autoscaler's fields kept from the last pass."""
    old = {s.variant: s for s in obs.old_status.serving}
    serving: list[VariantServingStatus] = []
    done = True
    for w in workloads:
        pv, d = w.variant, w.current
        cstatus = w.canary.status if w.canary is not None else None
        if d is None:
            done = False
            if cstatus is not None:  # a new variant under its canary: no Deployment yet
                serving.append(VariantServingStatus(variant=pv.pool, deployment=w.name, canary=cstatus,
                                                    nodesPerReplica=pv.nodesPerReplica))
            continue
        done = done and rolled_out(d, w.up_to_date)
        entry = VariantServingStatus(
            variant=pv.pool, deployment=w.name, replicas=int((d.get("spec") or {}).get("replicas") or 0),
            readyReplicas=int((d.get("status") or {}).get("readyReplicas") or 0),
            artifactKey=(d["metadata"].get("annotations") or {}).get(ANNOTATION_ARTIFACT_KEY),
            nodesPerReplica=pv.nodesPerReplica, canary=cstatus)
        if (prev := old.get(pv.pool)) is not None:
            entry = entry.model_copy(update={k: getattr(prev, k) for k in AUTOSCALER_FIELDS})
        serving.append(entry)
    return ServingStep(tuple(serving), done)


def serving_quality_condition(spec: QuantizedModelSpec, blocked: list[PlanVariant],
                              canaries: Mapping[str, CanaryDecision]) -> ConditionVerdict:
    """ServingQualityPassed: the canaries' verdicts (canary.condition), or blocked before them."""
    if blocked and not canaries and spec.serving.canary.enabled:
        return ConditionVerdict(C.SERVING_QUALITY_PASSED, False, Reason.BLOCKED,
                                "no artifact to serve yet (see QualityGatePassed)")
    return ConditionVerdict(C.SERVING_QUALITY_PASSED, *canary_mod.condition(canaries, spec.serving.canary.enabled))


def held_condition(canaries: Mapping[str, CanaryDecision]) -> ConditionVerdict | None:
    """Deployed while a canary holds its variant back: blocked by a verdict, or waiting for one."""
    held = [pool for pool, cd in canaries.items() if not cd.may_serve]
    if not held:
        return None
    failed = [p for p in held if canaries[p].condition_reason not in (Reason.CANARY_PENDING,
                                                                      Reason.CANARY_EVALUATING)]
    return ConditionVerdict(C.DEPLOYED, False, Reason.BLOCKED if failed else Reason.ROLLING_OUT,
                            f"not rolled out on {', '.join(held)}: " +
                            ("its canary gave no passing verdict" if failed else "waiting for its canary's verdict") +
                            " (see ServingQualityPassed); what served keeps serving")


def rolled_out_condition(obs: Observed, spec: QuantizedModelSpec, step: ServingStep) -> ConditionVerdict:
    """Deployed once nothing holds a variant back: rolled out (said when some pods expose no
    metrics), or rolling out."""
    owner = obs.name
    if step.rolled_out and (unmetered := picker.unmetered_variants(obs.old_status.serving)):
        # Served and never dropped; said on the model (the autoscaler's event says it too).
        routed = routing.routing_of(spec.serving) == routing.INFERENCE_POOL
        return ConditionVerdict(
            C.DEPLOYED, True, Reason.METRICS_UNAVAILABLE,
            f"{len(step.serving)} Deployment(s) rolled out behind Service {owner}; variant(s) "
            f"{', '.join(unmetered)} have ready pods that expose no vLLM metrics (a wrong image or an old vLLM): "
            + ("the endpoint picker spreads requests evenly over every pod until they report"
               if routed else "they are served, and not scaled down until they report"))
    if step.rolled_out:
        return ConditionVerdict(C.DEPLOYED, True, Reason.DEPLOYMENTS_CREATED,
                                f"{len(step.serving)} Deployment(s) rolled out behind Service {owner}")
    return ConditionVerdict(C.DEPLOYED, False, Reason.ROLLING_OUT, "; ".join(
        f"{s.deployment}: {s.readyReplicas}/{s.replicas} ready" for s in step.serving) or "creating Deployments")


def deployed_condition(obs: Observed, spec: QuantizedModelSpec, workloads: list[VariantWorkload],
                       blocked: list[PlanVariant], gate_failed: bool, canaries: Mapping[str, CanaryDecision],
                       route: RoutingStep, step: ServingStep) -> ConditionVerdict:
    """Deployed, in this order: a variant refused (no LeaderWorkerSet), one blocked on its artifact,
    one held by its canary, routing refused, then how the rollout stands."""
    if no_lws := [w.variant for w in workloads if w.no_lws]:
        return ConditionVerdict(C.DEPLOYED, False, Reason.LEADER_WORKER_SET_MISSING, "; ".join(
            f"{v.pool}: " + INSTALL_LWS.format(nodes=v.nodesPerReplica) for v in no_lws))
    if blocked:
        return ConditionVerdict(C.DEPLOYED, False, Reason.BLOCKED if gate_failed else Reason.AWAITING_ARTIFACT,
                                f"not rolled out on {', '.join(v.pool for v in blocked)}: " +
                                ("its artifact failed the quality gate" if gate_failed else
                                 "its artifact is not published yet"))
    if (held := held_condition(canaries)) is not None:
        return held
    if route.problem:
        # Served through the Service meanwhile (Ready says so); what was asked of routing is refused.
        return ConditionVerdict(C.DEPLOYED, False, *route.problem)
    return rolled_out_condition(obs, spec, step)


def ready_condition(obs: Observed, the_plan: PlanStatus, step: ServingStep, endpoint_: str | None
                    ) -> ConditionVerdict:
    """Ready: every planned variant has a ready replica and no pod failing; else what serves, and
    why the rest does not (their pods' termination messages)."""
    serving = step.serving
    ready = [s for s in serving if s.readyReplicas > 0]
    failing = [f"{s.variant}: {why}" for s in serving if s.readyReplicas < s.replicas
               for why in [pod_failure(obs.pod_terminations.get(s.variant, ()))] if why]
    everywhere = bool(serving) and len(ready) == len(the_plan.variants)
    if everywhere and not failing:
        return ConditionVerdict(C.READY, True, Reason.ALL_VARIANTS_READY,
                                f"{len(ready)} variant(s) serving at {endpoint_}")
    if failing:
        return ConditionVerdict(C.READY, everywhere, Reason.PODS_FAILING,
                                (f"serving on {', '.join(s.variant for s in ready)}; " if ready else
                                 "nothing is served; ") + "; ".join(failing))
    if ready:
        names = {s.variant for s in ready}
        return ConditionVerdict(C.READY, False, Reason.SOME_VARIANTS_READY,
                                f"serving on {', '.join(s.variant for s in ready)}; waiting for "
                                f"{', '.join(v.pool for v in the_plan.variants if v.pool not in names)}")
    return ConditionVerdict(C.READY, False, Reason.NO_REPLICAS_READY, "no replica is ready yet")


def serving_conditions(obs: Observed, spec: QuantizedModelSpec, the_plan: PlanStatus,
                       by_format: Mapping[QuantFormat, ArtifactVerdict], workloads: list[VariantWorkload],
                       route: RoutingStep, step: ServingStep, endpoint_: str | None) -> tuple[ConditionVerdict, ...]:
    """ServingQualityPassed, Deployed and Ready of a pass that planned variants."""
    canaries = {w.variant.pool: w.canary for w in workloads if w.canary is not None}
    blocked = [v for v in the_plan.variants if not by_format[artifact_format(v)].deployable]
    quality = serving_quality_condition(spec, blocked, canaries)
    if route.conflict:
        return (quality, ConditionVerdict(C.DEPLOYED, False, Reason.SERVICE_CONFLICT, route.conflict),
                ConditionVerdict(C.READY, False, Reason.SERVICE_CONFLICT, route.conflict))
    gate_failed = any(by_format[artifact_format(v)].passed is False for v in the_plan.variants)
    return (quality, deployed_condition(obs, spec, workloads, blocked, gate_failed, canaries, route, step),
            ready_condition(obs, the_plan, step, endpoint_))


def decide_serving(obs: Observed, acc: Acceptance, the_plan: PlanStatus, verdicts: list[ArtifactVerdict],
                   gone: list[tuple[str, str]], settings: OperatorSettings, st: StatusBuilder,
                   status: QuantizedModelStatus, actions: list[Action]) -> None:
    """One object per planned variant (behind its canary), one Service (and an InferencePool when
    asked for), the serving status and its three conditions."""
    spec = acc.spec
    assert spec is not None
    by_format = {v.planned.format: v for v in verdicts}  # by artifact_format(variant)
    published = canary_mod.published_by_pool(spec.adapters, the_plan.variants,
                                             lambda pv: by_format.get(artifact_format(pv)))
    scores = base_scores_key(verdicts, acc.effective.gate())
    workloads = [variant_workload(obs, acc, pv, by_format[artifact_format(pv)], settings,
                                  served_on(status.adapters, pv.pool), published.get(pv.pool), scores)
                 for pv in the_plan.variants]
    creates: list[Action] = []
    for w in workloads:
        for e in w.events:
            st.note(e.type, e.reason, e.message)
        actions.extend(w.deletes)  # deletes first: they free GPUs the new objects may need
        creates.extend(w.creates)
    gone_objects = removals(obs, the_plan, gone)
    actions.extend(gone_objects.actions)
    for e in gone_objects.events:
        st.note(e.type, e.reason, e.message)
    actions.extend(creates)
    route = routing_step(obs, spec, bool(the_plan.variants), settings)
    actions.extend(route.actions)
    if the_plan.variants:
        status.endpoint, status.route = route.endpoint, route.route
    step = serving_status(obs, workloads)
    status.serving = list(step.serving)
    status.replicas = step.replicas
    if not the_plan.variants:
        st.waiting((C.SERVING_QUALITY_PASSED, C.DEPLOYED, C.READY), Reason.BLOCKED, "no variant is planned (see Planned)")
        return
    for c in serving_conditions(obs, spec, the_plan, by_format, workloads, route, step, status.endpoint):
        st.set(c.type, c.status, c.reason, c.message)


# ------------------------------------------------------------------ the whole pass


def accepted_step(obs: Observed, settings: OperatorSettings, st: StatusBuilder,
                  status: QuantizedModelStatus) -> Acceptance:
    """Accepted: the effective spec, the policies' rules, the Secrets it names. When it is not
    accepted, every later condition waits (``Acceptance.accepted`` says so)."""
    old = obs.old_status
    acc = effective_for(obs, settings)
    eff = acc.effective
    status.effective = effective_values(eff)
    effective_changes(old.effective, status.effective, obs.generation == old.observedGeneration, st)
    if not eff.accepted:
        reason = Reason.INVALID_SPEC if eff.errors else Reason.POLICY_VIOLATION
        st.set(C.ACCEPTED, False, reason, "; ".join(eff.errors + eff.violations))
        st.waiting(LATER, Reason.BLOCKED, "the spec is not accepted (see Accepted)")
        if reason == Reason.POLICY_VIOLATION:
            # A refusing (or unreadable) policy stops scaling too. A spec error keeps the last
            # accepted autoscaling: a typo in a field being edited doesn't freeze what serves.
            status.autoscaling = None
        return acc
    if acc.missing_secrets:
        st.set(C.ACCEPTED, False, Reason.MISSING_SECRET, "; ".join(acc.missing_secrets))
        st.waiting(LATER, Reason.BLOCKED, "a referenced Secret is missing (see Accepted)")
        status.autoscaling = effective_autoscaling(acc, obs, settings)
        return acc
    st.set(C.ACCEPTED, True, Reason.VALID,
           (f"policy {eff.policy.names[0]} applies" if len(eff.policy.names) == 1 else
            f"policies {', '.join(eff.policy.names)} apply")
           if eff.policy.governed else "no QuantizationPolicy matches this namespace")
    status.autoscaling = effective_autoscaling(acc, obs, settings)
    return acc


def planned_step(obs: Observed, acc: Acceptance, settings: OperatorSettings, st: StatusBuilder,
                 status: QuantizedModelStatus) -> tuple[PlanStatus, list[tuple[str, str]], JobSizing] | None:
    """Planned: model shape × GPU pools, the pools gone since the last pass, and each artifact's
    Job sized. None: nothing can be planned (every later condition waits)."""
    the_plan, verdict = current_plan(obs, acc)
    if verdict.plan is None:
        st.set(C.PLANNED, False, verdict.reason, verdict.message)
        st.waiting(LATER[1:], Reason.BLOCKED, "no plan yet (see Planned)")
        return None
    gone = pools_gone(obs, the_plan)
    if gone:
        the_plan = with_gone_pools(the_plan, gone)
        planned_msg = plan_summary(the_plan) if the_plan.variants else "no variant"
        st.set(C.PLANNED, bool(the_plan.variants), Reason.POOL_GONE,
               f"pool(s) gone from the cluster: {', '.join(f'{p} (Deployment {d} kept)' for p, d in gone)}; "
               f"planned: {planned_msg}")
    else:
        st.set(C.PLANNED, verdict.ok, verdict.reason, verdict.message)
    sizing = job_sizing(obs, acc, the_plan, settings)
    the_plan = the_plan.model_copy(update={"quantizationJobs": sizing.jobs})
    status.plan = the_plan
    status.formats = ",".join(sorted({v.format.value for v in the_plan.variants})) or None
    return the_plan, gone, sizing


def quantized_step(obs: Observed, acc: Acceptance, the_plan: PlanStatus, sizing: JobSizing,
                   settings: OperatorSettings, st: StatusBuilder, status: QuantizedModelStatus,
                   actions: list[Action]) -> list[ArtifactVerdict]:
    """Quantized and QualityGatePassed: one artifact per format; its manifest in storage, or one
    Job per key and storage location."""
    spec = acc.spec
    assert spec is not None and spec.storage is not None
    eff = acc.effective
    placement = eff.policy.rules.quantizationJob
    gate = eff.gate().maxPerplexityIncreasePercent
    verdicts = []
    admission = Admission(settings.max_running_quantization_jobs, obs.queue) if obs.queue is not None else None
    status.calibrationData = calibration_status(spec, the_plan, obs.data_pin)
    data_uri = s3_calibration_uri(spec, the_plan)
    for planned in planned_artifacts(spec, the_plan, obs.data_pin):
        facts = obs.artifacts.get(planned.key, ArtifactFacts(storage_error="storage was not read"))
        if data_uri and obs.data_pin is None and planned.inputs.calibrationDataset == data_uri:
            # Named before any Job starts: without its ETag the key would not name the data.
            facts = ArtifactFacts(storage_error=f"{CALIBRATION_FIELD}: {obs.data_error or data_uri + ' was not read'}",
                                  storage_error_reason=Reason.CALIBRATION_DATA_UNAVAILABLE)
        v = decide_artifact(obs, acc, planned, facts, placement, settings, st, actions, sizing, admission)
        judge(v, gate, eff.gate())
        verdicts.append(v)
    status.artifacts = [artifact_status(spec.storage, v) for v in verdicts]
    status.worstRecovery = worst_recovery([v.quality for v in verdicts])
    quantized_conditions(verdicts, gate, st)
    return verdicts


def adapters_in_status(obs: Observed, acc: Acceptance, the_plan: PlanStatus, verdicts: list[ArtifactVerdict],
                       st: StatusBuilder, status: QuantizedModelStatus) -> None:
    """status.adapters (core/adapters.py), judged on each base artifact's quality report: what each
    pool is to load, for decide_serving to render; adapters_served then sets AdaptersServed."""
    spec = acc.spec
    assert spec is not None
    if not spec.adapters:  # the common case: no gate, identity or report lookups on every pass
        status.adapters = None
        st.conditions = [c for c in st.conditions if c.type != C.ADAPTERS_SERVED]
        return
    gate = acc.effective.gate()
    outcome = adapters_step(AdapterInputs(
        adapters=spec.adapters, plan=the_plan, evaluations=gate.adapters, facts=obs.adapters,
        problems=obs.adapter_problems, served_name=served_model_name(spec, obs.name), identity=eval_identity(gate),
        artifact_keys={v: a.key for a in status.artifacts for v in a.variants},
        reports={v.planned.key: v.quality_result or (v.manifest.quality if v.manifest else None) for v in verdicts},
        old=obs.old_status.adapters or [], loaded=loaded_adapters(obs),
        canary={pool: adapter_verdicts(f.result, {e.name: e.maxIncreasePercent for e in gate.adapters})
                for pool, f in obs.canaries.items() if f.result is not None},
        canary_unread=frozenset(pool for pool, f in obs.canaries.items() if f.result_error is not None),
    ))
    status.adapters = outcome.statuses  # served: what the pods are to load (decide_serving renders it)
    for line in outcome.failed:
        st.note("Warning", "AdapterGateFailed", line)


def loaded_adapters(obs: Observed) -> dict[str, frozenset[str]]:
    """By pool: the ``--lora-modules`` entries of its serving object as observed."""
    return {(obj["metadata"].get("labels") or {}).get(LABEL_VARIANT, ""): lora_modules_in(obj)
            for obj in obs.deployments.values()}


def adapters_served(obs: Observed, st: StatusBuilder, status: QuantizedModelStatus) -> None:
    """AdaptersServed on what the pools' objects load as observed, after serving rendered what they
    are to load: True only once the pods load every adapter that passed."""
    if status.adapters is None:
        return
    rolled = frozenset((obj["metadata"].get("labels") or {}).get(LABEL_VARIANT, "")
                       for obj in obs.deployments.values() if rolled_out(obj, True))
    status.adapters = confirm_served(status.adapters, loaded_adapters(obs), rolled, obs.old_status.adapters or [])
    st.set(C.ADAPTERS_SERVED, *adapters_condition(status.adapters))


def decide(obs: Observed, settings: OperatorSettings) -> Outcome:
    """One pass: Accepted → Planned → Quantized/QualityGatePassed → the serving conditions, each
    step on what the previous one decided; a step that cannot go on ends the pass."""
    old = obs.old_status
    st = StatusBuilder(list(old.conditions), obs.generation, obs.now)
    status = QuantizedModelStatus(observedGeneration=obs.generation, conditions=[], plan=old.plan,
                                  artifacts=old.artifacts, serving=old.serving, endpoint=old.endpoint,
                                  formats=old.formats, replicas=old.replicas, autoscaling=old.autoscaling,
                                  route=old.route, calibrationData=old.calibrationData, adapters=old.adapters)
    actions: list[Action] = []

    def done() -> Outcome:
        status.conditions = st.conditions
        return Outcome(status, tuple(actions), tuple(st.events))

    acc = accepted_step(obs, settings, st, status)
    if not acc.accepted:
        return done()
    planned = planned_step(obs, acc, settings, st, status)
    if planned is None:
        return done()
    the_plan, gone, sizing = planned
    verdicts = quantized_step(obs, acc, the_plan, sizing, settings, st, status, actions)
    adapters_in_status(obs, acc, the_plan, verdicts, st, status)
    decide_serving(obs, acc, the_plan, verdicts, gone, settings, st, status, actions)
    adapters_served(obs, st, status)
    return done()
