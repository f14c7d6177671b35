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


from fewerbits_api import conditions as C
from fewerbits_api.quality import eval_identity
from fewerbits_api.conditions import Reason
from fewerbits_api.quantizedmodel import (
    PlanStatus,
    QuantizedModelStatus,
)

from fewerbits_operator.core.adapters import (AdapterInputs, adapters_condition, adapters_step, confirm_served)
from fewerbits_operator.artifacts.keys import (
    planned_artifacts,
)
from fewerbits_operator.base.datapins import CALIBRATION_FIELD, calibration_status, s3_calibration_uri
from fewerbits_operator.artifacts.effective import effective_values
from fewerbits_operator.planner.vllm_args import served_model_name
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
from fewerbits_operator.serving.canary import adapter_verdicts
from fewerbits_operator.serving.render import (
    LABEL_VARIANT,
    lora_modules_in,
)
from fewerbits_operator.base.observed import ArtifactFacts, Observed
from fewerbits_operator.base.queueing import Admission
from fewerbits_operator.artifacts.quality_gate import worst_recovery
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.core.acceptance import (Acceptance, JobSizing, current_plan, effective_autoscaling,
                                                effective_changes, effective_for, job_sizing, plan_summary, pools_gone,
                                                with_gone_pools)
from fewerbits_operator.core.artifact_steps import (ArtifactVerdict, artifact_status, decide_artifact, judge,
                                                    quantized_conditions)
from fewerbits_operator.core.outcome import LATER, Outcome, StatusBuilder
from fewerbits_operator.core.serving_steps import decide_serving, rolled_out

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
