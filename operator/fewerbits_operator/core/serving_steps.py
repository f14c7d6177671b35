"""Decide's serving steps, pure: each planned variant's serving object (replicas, its canary
gate, the create or replace), the removals, the routing, the serving status and the Deployed,
ServingQualityPassed and Ready conditions. decide.py composes them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from fewerbits_api import conditions as C
from fewerbits_api.quality import base_eval_identity
from fewerbits_api.conditions import Reason
from fewerbits_api.formats import QuantFormat
from fewerbits_api.quantizedmodel import (
    AUTOSCALER_FIELDS,
    PlanVariant,
    PlanStatus,
    PublishedRoute,
    QualityGateSpec,
    QuantizedModelSpec,
    QuantizedModelStatus,
    VariantServingStatus,
)

from fewerbits_operator.core.adapters import (served_on)
from fewerbits_operator.artifacts.keys import (
    artifact_format,
)
from fewerbits_operator.serving.lws import INSTALL_LWS, lws_status, render_lws
from fewerbits_operator.base.actions import (
    Action,
    CreateDeployment,
    CreateService,
    DeleteDeployment,
    Event,
    PatchService,
    ReplaceDeployment,
    WorkloadKind,
)
from fewerbits_operator.serving import canary as canary_mod
from fewerbits_operator.serving.canary import CanaryDecision
from fewerbits_operator.serving.serving_load import ServedAdapter
from fewerbits_operator.serving.render import (
    ANNOTATION_ARTIFACT_KEY,
    ANNOTATION_SPEC_HASH,
    LABEL_VARIANT,
    Owner,
    deployment_name,
    endpoint,
    render_deployment,
    render_service,
)
from fewerbits_operator.base.observed import Observed
from fewerbits_operator.base.terminations import pod_failure
from fewerbits_operator.serving import gatewayroute, picker
from fewerbits_operator.serving import routing
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.core.acceptance import Acceptance
from fewerbits_operator.core.artifact_steps import ArtifactVerdict
from fewerbits_operator.core.outcome import StatusBuilder

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
    """The InferencePool and its endpoint picker (picker.py): scoring on KV, queue and the prompt's
    cached prefix, or an even spread while a variant's pods expose no metrics."""
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
