"""The steps ``decide_serving`` is composed of, one at a time, like test_artifact_steps: each takes
the facts it reads and returns what it decided (a typed step result), writing nothing itself
(test_decide, test_canary and test_decide_lws check the composition through ``decide``)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from fewerbits_api import conditions as C
from fewerbits_api.conditions import Reason
from fewerbits_api.quantizedmodel import QuantizedModelSpec, VariantServingStatus
from fewerbits_operator.base.actions import (
    CreateDeployment,
    CreateInferencePool,
    CreateService,
    DeleteDeployment,
    PatchService,
    ReplaceDeployment,
    WorkloadKind,
)
from fewerbits_operator.core.acceptance import effective_for
from fewerbits_operator.core.artifact_steps import ArtifactVerdict
from fewerbits_operator.core.serving_steps import rolled_out
from fewerbits_operator.core.serving_steps import (
    RoutingStep,
    ServingStep,
    VariantWorkload,
    deployed_condition,
    needs_replace,
    ready_condition,
    removals,
    replicas_for,
    rollout,
    routing_step,
    serving_quality_condition,
    serving_status,
    variant_workload,
)
from fewerbits_operator.base.observed import CanaryLeftovers, ContainerTermination
from fewerbits_operator.serving.render import ANNOTATION_SPEC_HASH, LABEL_VARIANT, Owner, endpoint
from fewerbits_operator.base.observed import PickerFacts, RoutingFacts
from fewerbits_operator.serving.picker import KINDS
from tests.unit.test_decide import NAME, NS, SETTINGS, UID, World, manifest
from tests.unit.test_decide_lws import H100X8X2, world as lws_world


def served_world() -> World:
    w = World()
    w.publish()
    w.serve()
    return w


def verdict(w: World, passed: bool | None = True) -> ArtifactVerdict:
    (art,) = w.planned()[2]
    return ArtifactVerdict(art, manifest=manifest(art, 0.5), passed=passed)


def the_variant(w: World):
    return w.planned()[1].variants[0]


def spec(**serving: Any) -> QuantizedModelSpec:
    w = World()
    w.spec["serving"] = {**w.spec.get("serving", {}), **serving}
    return effective_for(w.observed(), SETTINGS).spec


# ------------------------------------------------------------------ replicas and replace


@pytest.mark.parametrize("autoscaling, replicas, current, want", [
    ({"enabled": False}, 3, None, 3),
    ({"enabled": False}, 3, {"spec": {"replicas": 7}}, 3),            # the operator's, not the object's
    ({"enabled": True, "minReplicas": 2}, 1, None, 2),                  # a new object starts at the minimum
    ({"enabled": True, "minReplicas": 0}, 1, None, 1),                  # ... never at zero
    ({"enabled": True, "minReplicas": 2}, 1, {"spec": {"replicas": 5}}, 5),  # then the autoscaler owns them
])
def test_replicas_for(autoscaling, replicas, current, want):
    w = World()
    w.spec["autoscaling"] = {**w.spec.get("autoscaling", {}), **autoscaling}
    w.spec["serving"] = {**w.spec.get("serving", {}), "replicas": replicas}
    assert replicas_for(effective_for(w.observed(), SETTINGS).spec, current) == want


def _obj(spec_hash: str = "h", replicas: int = 1, **annotations: str) -> dict[str, Any]:
    return {"metadata": {"annotations": {ANNOTATION_SPEC_HASH: spec_hash, **annotations}, "resourceVersion": "5"},
            "spec": {"replicas": replicas}}


@pytest.mark.parametrize("current, desired, autoscaled, replicas, want", [
    (_obj(), _obj(), False, 1, False),
    (_obj("old"), _obj("new"), False, 1, True),                         # another pod spec
    (_obj(replicas=2), _obj(), False, 1, True),                         # the operator's replicas changed
    (_obj(replicas=2), _obj(), True, 1, False),                         # ... the autoscaler's are not chased
    (_obj(), _obj(**{"fewerbits.io/serving-config": "c"}), False, 1, True),   # the canary's hash to stamp
    (_obj(**{"fewerbits.io/serving-config": "c"}), _obj(**{"fewerbits.io/serving-config": "c"}), False, 1, False),
])
def test_needs_replace(current, desired, autoscaled, replicas, want):
    assert needs_replace(current, desired, autoscaled, replicas) is want


# ------------------------------------------------------------------ one variant's workload


def test_rollout_creates_keeps_or_replaces():
    w = served_world()
    pv, art = the_variant(w), verdict(w)
    (cur,) = w.deployments.values()
    name = cur["metadata"]["name"]
    created = rollout(NS, pv, art, copy.deepcopy(cur), None, False, 1)
    assert [type(a) for a in created.creates] == [CreateDeployment] and created.up_to_date
    assert [e.reason for e in created.events] == ["DeploymentCreated"] and not created.deletes
    kept = rollout(NS, pv, art, copy.deepcopy(cur), cur, False, 1)
    assert kept == VariantWorkload(pv, name, cur, True)
    other = copy.deepcopy(cur)
    other["metadata"]["annotations"][ANNOTATION_SPEC_HASH] = "changed"
    replaced = rollout(NS, pv, art, other, cur, False, 1)
    (rep,) = replaced.creates
    assert isinstance(rep, ReplaceDeployment) and rep.deployment["metadata"]["resourceVersion"] == "5"
    assert not replaced.up_to_date and replaced.current["status"] == cur["status"]  # rolled out once its status says
    assert [e.reason for e in replaced.events] == ["RollingOut"]


def test_rollout_replaces_an_object_of_the_other_kind():
    w = served_world()
    (cur,) = w.deployments.values()
    desired = {**copy.deepcopy(cur), "kind": WorkloadKind.LEADER_WORKER_SET.value}
    out = rollout(NS, the_variant(w), verdict(w), desired, cur, False, 1)
    assert out.deletes == (DeleteDeployment(NS, cur["metadata"]["name"], WorkloadKind.DEPLOYMENT),)
    assert [type(a) for a in out.creates] == [CreateDeployment]


@pytest.mark.parametrize("case, want", [
    ("no LeaderWorkerSet API", dict(no_lws=True, current=None)),
    ("artifact not deployable", dict(no_lws=False, current="kept")),
    ("pool gone", dict(no_lws=False, current="kept")),
])
def test_variant_workload_refused_or_kept(case, want):
    if case == "no LeaderWorkerSet API":
        w = lws_world([H100X8X2])
        obs = dataclasses.replace(w.observed(), lws_available=False)
        art = verdict(w)
    else:
        w = served_world()
        obs = w.observed()
        art = verdict(w, passed=False if case == "artifact not deployable" else True)
        if case == "pool gone":
            obs = dataclasses.replace(obs, pools=())
    pv = the_variant(w)
    out = variant_workload(obs, effective_for(obs, SETTINGS), pv, art, SETTINGS)
    assert out.no_lws is want["no_lws"] and not out.up_to_date
    assert not (out.creates or out.deletes or out.events)
    assert out.current is (next(iter(w.deployments.values())) if want["current"] == "kept" else None)


def test_variant_workload_of_a_multinode_variant_is_a_leaderworkerset():
    w = lws_world([H100X8X2])
    obs = dataclasses.replace(w.observed(), lws_available=True)
    out = variant_workload(obs, effective_for(obs, SETTINGS), the_variant(w), verdict(w), SETTINGS)
    (create,) = out.creates
    assert WorkloadKind.of(create.deployment) is WorkloadKind.LEADER_WORKER_SET


# ------------------------------------------------------------------ removals


def test_removals_delete_leftover_canaries_and_unplanned_variants_but_keep_a_gone_pool():
    w = served_world()
    stray = copy.deepcopy(next(iter(w.deployments.values())))
    stray["metadata"].update(name=f"{NAME}-l4", labels={**stray["metadata"]["labels"], LABEL_VARIANT: "l4"})
    kept = {**copy.deepcopy(stray), "metadata": {**stray["metadata"], "name": f"{NAME}-a100"}}
    lws = {**copy.deepcopy(stray), "kind": "LeaderWorkerSet", "metadata": {**stray["metadata"], "name": f"{NAME}-x"}}
    w.deployments.update({o["metadata"]["name"]: o for o in (stray, kept, lws)})
    obs = dataclasses.replace(w.observed(), canary_leftovers=CanaryLeftovers(("c1",), ("c2",)))
    out = removals(obs, w.planned()[1], [("a100", f"{NAME}-a100")])
    assert out.actions == (DeleteDeployment(NS, "c1"), DeleteDeployment(NS, "c2", WorkloadKind.LEADER_WORKER_SET),
                           DeleteDeployment(NS, f"{NAME}-l4"),
                           DeleteDeployment(NS, f"{NAME}-x", WorkloadKind.LEADER_WORKER_SET))
    assert [e.reason for e in out.events] == ["DeploymentRemoved", "DeploymentRemoved"]


# ------------------------------------------------------------------ routing


def _svc_owned_by(uid: str | None) -> dict[str, Any]:
    w = served_world()
    svc = copy.deepcopy(w.service)
    svc["metadata"]["ownerReferences"] = [{"uid": uid}] if uid else []
    return svc


@pytest.mark.parametrize("case, service, routing, planned, want_types, conflict, problem", [
    ("nothing planned", None, "service", False, [], False, None),
    ("new Service", None, "service", True, [CreateService], False, None),
    ("own Service", "own", "service", True, [], False, None),
    ("Service drifted", "drifted", "service", True, [PatchService], False, None),
    ("another's Service", "foreign", "service", True, [], True, None),
    ("pool without its CRD", "own", "inferencePool", True, [], False, Reason.ROUTING_UNAVAILABLE),
    ("pool and picker", "own", "inferencePool+crd", True, [CreateInferencePool], False, None),
])
def test_routing_step(case, service, routing, planned, want_types, conflict, problem):
    w = served_world()
    if routing.startswith("inferencePool"):
        w.spec["serving"] = {**w.spec.get("serving", {}), "routing": "inferencePool"}
        crd = routing.endswith("+crd")
        w.routing = RoutingFacts(crd, None, PickerFacts({k: None for k in KINDS}) if crd else None)
    svc = None if service is None else _svc_owned_by(None if service == "foreign" else "uid-m")
    if service == "drifted":
        svc["spec"]["selector"] = {"app": "other"}
    obs = dataclasses.replace(w.observed(), service=svc)
    out = routing_step(obs, effective_for(obs, SETTINGS).spec, planned, SETTINGS)
    types = [type(a) for a in out.actions]
    if routing == "inferencePool+crd":
        assert types[0] is CreateInferencePool and len(types) > 1  # then the picker's objects
    else:
        assert types == want_types
    assert bool(out.conflict) is conflict
    assert (out.problem[0] if out.problem else None) == problem
    assert out.endpoint == (None if conflict or not planned else endpoint(Owner(NAME, NS, UID)))


# ------------------------------------------------------------------ status


def _with_status(d: dict[str, Any], **status: Any) -> dict[str, Any]:
    return {**d, "metadata": {**d["metadata"], "generation": 2}, "status": status}


@pytest.mark.parametrize("status, up_to_date, want", [
    (dict(observedGeneration=2, replicas=1, updatedReplicas=1, readyReplicas=1), True, True),
    (dict(observedGeneration=2, replicas=1, updatedReplicas=1, readyReplicas=1), False, False),  # just replaced
    (dict(observedGeneration=1, replicas=1, updatedReplicas=1, readyReplicas=1), True, False),  # not seen yet
    (dict(observedGeneration=2, replicas=2, updatedReplicas=1, readyReplicas=1), True, False),  # old pods left
    (dict(observedGeneration=2, replicas=1, updatedReplicas=0, readyReplicas=1), True, False),
])
def test_rolled_out(status, up_to_date, want):
    (d,) = served_world().deployments.values()
    assert rolled_out(_with_status(d, **status), up_to_date) is want


def test_serving_status_keeps_the_autoscalers_fields_and_counts_replicas():
    w = served_world()
    (d,) = w.deployments.values()
    pv = the_variant(w)
    w.status = {"serving": [{"variant": pv.pool, "deployment": d["metadata"]["name"], "desiredReplicas": 3}]}
    step = serving_status(w.observed(), [VariantWorkload(pv, d["metadata"]["name"], d, True)])
    (entry,) = step.serving
    assert step.rolled_out and step.replicas == "1/1" and entry.desiredReplicas == 3
    assert serving_status(w.observed(), [VariantWorkload(pv, "x")]) == ServingStep((), False)
    assert ServingStep().replicas is None


# ------------------------------------------------------------------ conditions


def entry(variant: str, replicas: int, ready: int) -> VariantServingStatus:
    return VariantServingStatus(variant=variant, deployment=f"{NAME}-{variant}", replicas=replicas,
                                readyReplicas=ready)


@pytest.mark.parametrize("serving, failing, want", [
    ([entry("h100", 1, 1)], False, ("True", Reason.ALL_VARIANTS_READY)),
    ([entry("h100", 2, 1)], True, ("True", Reason.PODS_FAILING)),         # serving everywhere, one pod failing
    ([entry("h100", 1, 0)], True, ("False", Reason.PODS_FAILING)),
    ([], False, ("False", Reason.NO_REPLICAS_READY)),
    ([entry("h100", 1, 0)], False, ("False", Reason.NO_REPLICAS_READY)),
])
def test_ready_condition(serving, failing, want):
    w = served_world()
    plan = w.planned()[1]
    serving = [s.model_copy(update={"variant": plan.variants[0].pool}) for s in serving]
    terms = {plan.variants[0].pool: (ContainerTermination("p", "server", 12, "Error", "boom"),)} if failing else {}
    obs = dataclasses.replace(w.observed(), pod_terminations=terms)
    c = ready_condition(obs, plan, ServingStep(tuple(serving), True), "http://x")
    assert (c.type, "True" if c.status else "False", c.reason) == (C.READY, *want)


@pytest.mark.parametrize("case, want", [
    ("no LeaderWorkerSet", (False, Reason.LEADER_WORKER_SET_MISSING)),
    ("gate failed", (False, Reason.BLOCKED)),
    ("artifact pending", (False, Reason.AWAITING_ARTIFACT)),
    ("routing refused", (False, Reason.ROUTING_UNAVAILABLE)),
    ("rolled out", (True, Reason.DEPLOYMENTS_CREATED)),
    ("rolling out", (False, Reason.ROLLING_OUT)),
])
def test_deployed_condition_in_order(case, want):
    w = served_world()
    obs, pv = w.observed(), the_variant(w)
    s = effective_for(obs, SETTINGS).spec
    workloads = [VariantWorkload(pv, "x", no_lws=case == "no LeaderWorkerSet")]
    blocked = [pv] if case in ("gate failed", "artifact pending") else []
    route = RoutingStep(problem=(Reason.ROUTING_UNAVAILABLE, "no CRD") if case == "routing refused" else None)
    step = ServingStep((entry(pv.pool, 1, 1),), case != "rolling out")
    c = deployed_condition(obs, s, workloads, blocked, case == "gate failed", {}, route, step)
    assert (c.type, c.status, c.reason) == (C.DEPLOYED, *want)


def test_serving_quality_condition_blocked_before_any_canary():
    s = effective_for(World().observed(), SETTINGS).spec
    on = s.model_copy(update={"serving": s.serving.model_copy(update={
        "canary": s.serving.canary.model_copy(update={"enabled": True})})})
    pv = the_variant(World())
    assert serving_quality_condition(on, [pv], {}).reason == Reason.BLOCKED
    assert serving_quality_condition(on, [], {}).reason == Reason.CANARY_PASSED
    off = s.model_copy(update={"serving": s.serving.model_copy(update={
        "canary": s.serving.canary.model_copy(update={"enabled": False})})})
    assert serving_quality_condition(off, [pv], {}).reason == Reason.CANARY_DISABLED
