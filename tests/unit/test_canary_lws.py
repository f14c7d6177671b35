"""The serving canary of a multi-node variant (canary.py, canary_observe.py): one unexposed
LeaderWorkerSet group is judged through its leader's serving API before the variant's
LeaderWorkerSet is created or replaced; a failed verdict leaves the old one serving."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fewerbits_api import conditions as C
from fewerbits_api.canary import CanaryContract
from fewerbits_api.conditions import Reason
from fewerbits_operator.serving import canary as K
from fewerbits_operator.serving import routing
from fewerbits_operator.serving.canary_observe import read_canaries
from fewerbits_operator.base.observed import CanaryLeftovers
from fewerbits_operator.core.decide import CreateDeployment, CreateJob, DeleteDeployment, ReplaceDeployment, decide
from fewerbits_operator.core.execute import ordered
from fewerbits_operator.serving.lws import leader_selector
from fewerbits_operator.base.observed import JobFacts, JobState
from fewerbits_operator.serving.render import ANNOTATION_ARTIFACT_KEY, LABEL_MODEL, LABEL_VARIANT, Owner, render_service

from tests.unit.test_canary import result, target
from tests.unit.test_decide import NAME, NOW, NS, SETTINGS, UID, World, base_spec
from tests.unit.test_decide_lws import H100X8X2, LLAMA405

LWS_LABELS = ("leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/worker-index",
              "leaderworkerset.sigs.k8s.io/group-index", "leaderworkerset.sigs.k8s.io/group-key",
              "leaderworkerset.sigs.k8s.io/template-revision-hash")
"""What LeaderWorkerSet v0.7.0 adds to a group's pods (its controller and pod webhook): its own
labels only, never the LeaderWorkerSet object's."""


def lws_world() -> World:
    w = World(shape=LLAMA405, pools=[H100X8X2],
              spec=base_spec(serving={"maxModelLen": 4096, "canary": {"enabled": True}}))
    w.spec["quantization"] = {**w.spec["quantization"], "format": "none"}
    w.publish()
    return w


def run(w: World, now: str = NOW, **facts: Any):
    pv, _, chash = target(w)
    obs = dataclasses.replace(w.observed(), now=now, lws_available=True,
                              canaries={pv.pool: K.CanaryFacts(chash, **facts)})
    return decide(obs, SETTINGS)


def canary_lws(w: World) -> dict[str, Any]:
    (d,) = [a.deployment for a in run(w).actions if isinstance(a, CreateDeployment)]
    d = json.loads(json.dumps(d))
    d["metadata"]["creationTimestamp"] = NOW
    return d


def conds(o) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in o.status.conditions}


def pod_labels(template: dict[str, Any], lws_name: str, worker: int) -> dict[str, str]:
    """A group pod's labels as LeaderWorkerSet sets them: the template's plus its own."""
    return {**template["metadata"]["labels"], LWS_LABELS[0]: lws_name, LWS_LABELS[1]: str(worker),
            LWS_LABELS[2]: "0", LWS_LABELS[3]: "k", LWS_LABELS[4]: "r"}


def test_a_multinode_variant_is_canaried_by_one_unexposed_group():
    w = lws_world()
    pv, _, chash = target(w)
    assert pv.nodesPerReplica == 2
    o = run(w)
    (d,) = [a.deployment for a in o.actions if isinstance(a, CreateDeployment)]  # the canary only
    real = f"{NAME}-{pv.pool}"
    assert d["kind"] == "LeaderWorkerSet" and d["metadata"]["name"] == f"{real}-canary"
    assert d["spec"]["replicas"] == 1 and d["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert d["metadata"]["annotations"][K.ANNOTATION_SERVING_CONFIG] == chash
    assert LABEL_MODEL not in d["metadata"]["labels"] and d["metadata"]["labels"][K.LABEL_CANARY] == NAME
    lwt = d["spec"]["leaderWorkerTemplate"]
    leader = pod_labels(lwt["leaderTemplate"], d["metadata"]["name"], 0)
    worker = pod_labels(lwt["workerTemplate"], d["metadata"]["name"], 1)
    owner = Owner(NAME, NS, UID)
    selectors = [render_service(owner)["spec"]["selector"],
                 routing.render_inference_pool(owner)["spec"]["selector"]["matchLabels"],
                 leader_selector(NAME, pv.pool), {LABEL_MODEL: NAME}]
    for labels in (leader, worker):
        assert LABEL_MODEL not in labels and labels[K.LABEL_CANARY] == NAME and labels[LABEL_VARIANT] == pv.pool
        for sel in selectors:  # nothing that sends traffic, scales or scrapes selects a canary pod
            assert not sel.items() <= labels.items()
    # The same group as the variant would run: the leader serves (node rank 0), the worker is headless.
    assert "--headless" in lwt["workerTemplate"]["spec"]["containers"][0]["command"]
    assert "--headless" not in lwt["leaderTemplate"]["spec"]["containers"][0]["command"]
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_PENDING)
    (entry,) = o.status.serving
    assert entry.canary.phase == "Pending" and entry.nodesPerReplica == 2 and "1 group of 2 pods" in entry.canary.reason
    assert "CanaryStarted" in [e.reason for e in o.events]


def test_canary_then_job_against_the_leader_then_verdict_then_the_real_lws():
    w = lws_world()
    pv, key, chash = target(w)
    d = canary_lws(w)
    waiting = run(w, deployment=d, pod_ip="10.1.0.1", pod_ready=False)  # leader up, a worker not yet
    assert not [a for a in waiting.actions if isinstance(a, (CreateJob, CreateDeployment))]
    assert conds(waiting)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_PENDING)
    o = run(w, deployment=d, pod_ip="10.1.0.1", pod_ready=True)
    (job,) = [a.job for a in o.actions if isinstance(a, CreateJob)]
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    contract = CanaryContract.model_validate_json(env["FEWERBITS_CANARY_CONTRACT"]["value"])
    assert contract.endpoint == "http://10.1.0.1:8000" and contract.configHash == chash and contract.key == key
    assert not [a for a in o.actions if isinstance(a, CreateDeployment)]
    w.status = o.status.to_wire()
    jf = JobFacts(K.canary_job_name(NAME, pv.pool, chash), (), JobState.SUCCEEDED)
    o2 = run(w, deployment=d, pod_ip="10.1.0.1", pod_ready=True, job=jf, result=result(w, True))
    (real,) = [a.deployment for a in o2.actions if isinstance(a, CreateDeployment)]
    assert real["kind"] == "LeaderWorkerSet" and real["metadata"]["name"] == f"{NAME}-{pv.pool}"
    assert real["metadata"]["annotations"][K.ANNOTATION_SERVING_CONFIG] == chash
    assert real["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"][LABEL_MODEL] == NAME
    deletes = {(type(a).__name__, getattr(a, "kind", "Job"), a.name) for a in o2.actions
               if isinstance(a, (DeleteDeployment, K.DeleteJob))}
    assert deletes == {("DeleteDeployment", "LeaderWorkerSet", d["metadata"]["name"]), ("DeleteJob", "Job", jf.name)}
    reasons = [e.reason for e in o2.events]
    assert reasons.index("CanaryPassed") < reasons.index("DeploymentCreated")
    assert conds(o2)[C.SERVING_QUALITY_PASSED] == ("True", Reason.CANARY_PASSED)
    (entry,) = o2.status.serving
    assert entry.canary.phase == "Passed" and entry.canary.metrics[0].served == 0.89
    ordered(o2.actions)


def _serving_old_lws(w: World) -> dict[str, Any]:
    """The variant's LeaderWorkerSet serving an older artifact (rolled out with its own verdict)."""
    pv, _, _ = target(w)
    o = run(w, result=result(w, True))
    (lws,) = [json.loads(json.dumps(a.deployment)) for a in o.actions if isinstance(a, CreateDeployment)]
    lws["metadata"].update(resourceVersion="5", generation=1)
    lws["metadata"]["annotations"].update({K.ANNOTATION_SERVING_CONFIG: "0" * 32, ANNOTATION_ARTIFACT_KEY: "0" * 64})
    lws["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                     "conditions": [{"type": "Available", "status": "True"}]}
    w.deployments = {lws["metadata"]["name"]: lws}
    svc = render_service(Owner(NAME, NS, UID))
    svc["metadata"]["ownerReferences"] = [{"uid": UID}]
    w.service = svc
    return lws


def test_a_failed_verdict_keeps_the_old_lws_serving():
    w = lws_world()
    _serving_old_lws(w)
    old = json.loads(json.dumps(w.deployments))
    d = canary_lws(w)
    assert d["metadata"]["name"].endswith("-canary")
    o = run(w, deployment=d, result=result(w, False, "custom:exact_match served 0.1 vs base 0.9: 11.1% "
                                                     "(min 95%), KV cache fp8"))
    assert not [a for a in o.actions if isinstance(a, (CreateDeployment, ReplaceDeployment, CreateJob))]
    assert [(a.kind, a.name) for a in o.actions if isinstance(a, DeleteDeployment)] == \
        [("LeaderWorkerSet", d["metadata"]["name"])]
    assert w.deployments == old
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_FAILED)
    assert conds(o)[C.DEPLOYED] == ("False", Reason.BLOCKED)
    assert conds(o)[C.READY][0] == "True"  # the old LeaderWorkerSet serves
    (entry,) = o.status.serving
    assert entry.artifactKey == "0" * 64 and entry.readyReplicas == 1 and entry.canary.phase == "Failed"


def test_a_canary_group_of_an_earlier_configuration_is_deleted_as_a_leaderworkerset():
    w = lws_world()
    d = canary_lws(w)
    d["metadata"]["annotations"][K.ANNOTATION_SERVING_CONFIG] = "f" * 32
    o = run(w, deployment=d)
    assert [(a.kind, a.name) for a in o.actions if isinstance(a, DeleteDeployment)] == \
        [("LeaderWorkerSet", d["metadata"]["name"])]


def test_a_canary_lws_left_behind_is_removed():
    w = World()  # canary off
    w.publish()
    obs = dataclasses.replace(w.observed(), canary_leftovers=CanaryLeftovers(leader_worker_sets=("m-old-canary",)))
    o = decide(obs, SETTINGS)
    assert DeleteDeployment(NS, "m-old-canary", kind="LeaderWorkerSet") in o.actions


# ------------------------------------------------------------------ observe (canary_observe.py)


def pod(name: str, worker: int, ip: str | None, ready: bool, lws_name: str, pool: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": NOW,
                         "labels": {K.LABEL_CANARY: NAME, LABEL_VARIANT: pool, LWS_LABELS[0]: lws_name,
                                    LWS_LABELS[1]: str(worker)}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


class FakeKube:
    def __init__(self, lws: list[dict[str, Any]], pods: list[dict[str, Any]]):
        self.lws, self.pods, self.selectors = lws, pods, []

    def lws_available(self) -> bool:
        return True

    def list_lws(self, ns: str, selector: str) -> list[dict[str, Any]]:
        self.selectors.append(("lws", selector))
        return self.lws

    def list_deployments(self, ns: str, selector: str) -> list[dict[str, Any]]:
        return []

    def list_pods(self, ns: str, selector: str) -> list[dict[str, Any]]:
        self.selectors.append(("pods", selector))
        return self.pods

    def get_job(self, ns: str, name: str) -> None:
        return None


class FakeStore:
    def get_serving_result(self, *args: Any) -> None:
        return None


class Observer:
    def __init__(self, kube: FakeKube):
        self.kube, self.store, self.settings = kube, FakeStore(), SETTINGS


def observe(w: World, lws: list[dict[str, Any]], pods: list[dict[str, Any]]):
    acc, the_plan, _ = w.planned()
    kube = FakeKube(lws, pods)
    out, leftovers = read_canaries(Observer(kube), acc.spec, NS, NAME, the_plan, w.artifacts, {}, None, None)
    return out, kube, leftovers


def test_observe_evaluates_the_leader_once_the_whole_group_is_ready():
    w = lws_world()
    pv, _, chash = target(w)
    d = canary_lws(w)
    cname = d["metadata"]["name"]
    stale = {**json.loads(json.dumps(d)), "metadata": {**d["metadata"], "name": "m-gone-canary"}}
    worker_down = [pod(f"{cname}-0-1", 1, "10.1.0.2", False, cname, pv.pool),
                   pod(f"{cname}-0", 0, "10.1.0.1", True, cname, pv.pool)]
    out, kube, leftovers = observe(w, [d, stale], worker_down)
    f = out[pv.pool]
    assert f.config_hash == chash and f.deployment["kind"] == "LeaderWorkerSet"
    assert (f.pod_ip, f.pod_ready) == ("10.1.0.1", False)  # the leader's IP; not ready while a worker is not
    assert ("lws", f"{K.LABEL_CANARY}={NAME}") in kube.selectors
    assert leftovers == CanaryLeftovers(deployments=(), leader_worker_sets=("m-gone-canary",))
    ready = [pod(f"{cname}-0-1", 1, "10.1.0.2", True, cname, pv.pool),
             pod(f"{cname}-0", 0, "10.1.0.1", True, cname, pv.pool)]
    f = observe(w, [d], ready)[0][pv.pool]
    assert (f.pod_ip, f.pod_ready) == ("10.1.0.1", True)
    f = observe(w, [d], ready[1:])[0][pv.pool]  # the worker pod not created yet: the group is short
    assert (f.pod_ip, f.pod_ready) == ("10.1.0.1", False)
