"""Decide's artifact steps, pure: one planned artifact step by step (published, claimed,
queued, admitted, its Job started, running, failed or refused), its quality evaluation, and the
Quantized and QualityGatePassed conditions from every artifact's verdict. decide.py composes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fewerbits_api import conditions as C
from fewerbits_api.conditions import Reason
from fewerbits_api.formats import QuantFormat
from fewerbits_api.policy import QuantizationJobPlacement
from fewerbits_api.quantizedmodel import (
    ArtifactFailure,
    ArtifactQueue,
    ArtifactStatus,
    QualityGateSpec,
    QualityStatus,
    StorageSpec,
)

from fewerbits_operator.artifacts.keys import (
    PlannedArtifact,
    outdated_tools,
    published_at,
)
from fewerbits_operator.base.claims import ClaimState, claim_state, new_claim
from fewerbits_operator.artifacts.jobfailure import classify as classify_job_failure
from fewerbits_operator.planner.jobsize import deadline_seconds, job_pool_selectors
from fewerbits_operator.base.actions import (
    Action,
    AddJobOwner,
    ClaimArtifact,
    CreateJob,
    Event,
)
from fewerbits_operator.serving.render import (
    Owner,
    render_job,
)
from fewerbits_operator.base.observed import ArtifactFacts, JobFacts, JobState, Observed
from fewerbits_operator.base.terminations import job_failure_text
from fewerbits_operator.base.queueing import OPERATOR_CAP, Admission, Waiter, kueue_queue, operator_queue
from fewerbits_operator.artifacts.evaljob import render_eval_job
from fewerbits_operator.artifacts.quality_gate import failure_text, judge_quality, needs_evaluation
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.core.acceptance import Acceptance, JobSizing, dataset_refusal
from fewerbits_operator.core.outcome import StatusBuilder

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
