"""The serving canary's decisions (operator/fewerbits_operator/serving/canary.py), on the same hand-built
worlds as test_decide.py: a new served configuration runs one unexposed pod, is judged by a Job,
and takes traffic only after a passing verdict; what served keeps serving throughout."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from fewerbits_api import conditions as C
from fewerbits_api.canary import CanaryContract, ServingMetric, ServingQualityResult
from fewerbits_api.conditions import Reason
from fewerbits_api.quantizedmodel import QuantizedModelStatus
from fewerbits_operator.serving import canary as K
from fewerbits_operator.serving import routing
from fewerbits_operator.artifacts.keys import artifact_format
from fewerbits_operator.core.decide import CreateDeployment, CreateJob, DeleteDeployment, ReplaceDeployment, decide
from fewerbits_operator.core.execute import ordered
from fewerbits_operator.base.observed import CanaryLeftovers, ContainerTermination, JobFacts, JobState
from fewerbits_operator.serving.render import LABEL_MODEL, Owner, render_service

from tests.unit.test_decide import NAME, NOW, NS, SETTINGS, UID, World, base_spec, policy

LATER = "2026-11-23T12:10:00Z"


def canary_world(**serving: Any) -> World:
    w = World(spec=base_spec(serving={"maxModelLen": 4096, "canary": {"enabled": True}, **serving}))
    w.publish()
    return w


def target(w: World) -> tuple[Any, str, str]:
    """(the variant, its artifact key, its served configuration hash)."""
    acc, the_plan, arts = w.planned()
    pv = the_plan.variants[0]
    key = next(a.key for a in arts if a.format == artifact_format(pv))
    return pv, key, K.config_hash(acc.spec, pv, key, NAME, SETTINGS)


def run(w: World, now: str = NOW, **facts: Any):
    pv, _, chash = target(w)
    obs = replace(w.observed(), now=now, canaries={pv.pool: K.CanaryFacts(chash, **facts)} if facts is not None else {})
    return decide(obs, SETTINGS)


def conds(o) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in o.status.conditions}


def feed(w: World, o) -> None:
    w.status = o.status.to_wire()


def canary_deployment(w: World, created: str = NOW) -> dict[str, Any]:
    o = run(w)
    (d,) = [a.deployment for a in o.actions if isinstance(a, CreateDeployment)]
    d = json.loads(json.dumps(d))
    d["metadata"]["creationTimestamp"] = created
    return d


def result(w: World, passed: bool, reason: str = "") -> ServingQualityResult:
    pv, key, chash = target(w)
    metric = ServingMetric(name="custom:exact_match", kind="custom", base=0.9, jobQuantized=0.88,
                           served=0.89 if passed else 0.1, recoveryPercent=98.9 if passed else 11.1,
                           minRecoveryPercent=95, passed=passed, samples=8, method="completions")
    return ServingQualityResult(key=key, configHash=chash, variant=pv.pool, kvCacheDtype=pv.kvCacheDtype,
                                passed=passed, reason=reason, metrics=[metric], requests=8, seconds=3.5)


def test_a_new_variant_starts_one_unexposed_canary_pod_and_no_deployment():
    w = canary_world()
    o = run(w)
    creates = [a for a in o.actions if isinstance(a, CreateDeployment)]
    assert len(creates) == 1
    d = creates[0].deployment
    assert d["metadata"]["name"].endswith("-canary") and d["spec"]["replicas"] == 1
    pod_labels = d["spec"]["template"]["metadata"]["labels"]
    assert LABEL_MODEL not in pod_labels and pod_labels[K.LABEL_CANARY] == NAME
    assert LABEL_MODEL not in d["metadata"]["labels"]  # nothing lists it as a variant (observe, autoscaler)
    # Everything that sends traffic selects fewerbits.io/model: none of them selects the canary pod.
    owner = Owner(NAME, NS, UID)
    selectors = [render_service(owner)["spec"]["selector"],
                 routing.render_inference_pool(owner)["spec"]["selector"]["matchLabels"]]
    for sel in selectors:
        assert not sel.items() <= pod_labels.items()
    assert "CanaryStarted" in [e.reason for e in o.events]
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_PENDING)
    assert conds(o)[C.DEPLOYED][0] == "False"
    (entry,) = o.status.serving
    assert entry.replicas == 0 and entry.canary.phase == "Pending" and entry.canary.kvCacheDtype == "fp8"
    assert entry.canary.configHash == target(w)[2]


def test_a_ready_canary_gets_its_evaluation_job_with_the_served_kv_dtype():
    w = canary_world()
    d = canary_deployment(w)
    o = run(w, deployment=d, pod_ready=True, pod_ip="10.1.2.3")
    (job,) = [a.job for a in o.actions if isinstance(a, CreateJob)]
    pv, key, chash = target(w)
    assert job["metadata"]["name"] == K.canary_job_name(NAME, pv.pool, chash)
    spec = job["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e for e in c["env"]}
    contract = CanaryContract.model_validate_json(env["FEWERBITS_CANARY_CONTRACT"]["value"])
    assert contract.endpoint == "http://10.1.2.3:8000" and contract.kvCacheDtype == "fp8"
    assert contract.key == key and contract.configHash == chash and contract.servedModelName == NAME
    assert contract.qualityGate.maxPerplexityIncreasePercent == 5
    # Secrets by reference only, restricted pod security, no GPU, bounded, no retries.
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3"
    assert "AKIA" not in json.dumps(job)
    assert spec["securityContext"]["runAsNonRoot"] and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == SETTINGS.canary_eval_deadline_seconds
    assert job["metadata"]["ownerReferences"][0]["uid"] == UID
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_EVALUATING)
    assert "CanaryEvaluating" in [e.reason for e in o.events]
    assert not [a for a in o.actions if isinstance(a, CreateDeployment)]


def test_a_running_evaluation_waits_and_writes_nothing_new():
    w = canary_world()
    d = canary_deployment(w)
    pv, _, chash = target(w)
    feed(w, run(w, deployment=d, pod_ready=True, pod_ip="10.1.2.3"))
    o = run(w, deployment=d, pod_ready=True, pod_ip="10.1.2.3",
            job=JobFacts(K.canary_job_name(NAME, pv.pool, chash), (), JobState.ACTIVE))
    assert not [a for a in o.actions if isinstance(a, (CreateJob, CreateDeployment, ReplaceDeployment))]
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_EVALUATING)
    assert not [e for e in o.events if e.reason.startswith("Canary")]


def test_a_passed_verdict_rolls_out_then_the_canary_goes():
    w = canary_world()
    d = canary_deployment(w)
    pv, _, chash = target(w)
    feed(w, run(w, deployment=d, pod_ready=True, pod_ip="10.1.2.3"))
    job = JobFacts(K.canary_job_name(NAME, pv.pool, chash), (), JobState.SUCCEEDED)
    o = run(w, deployment=d, pod_ready=True, pod_ip="10.1.2.3", job=job, result=result(w, True))
    real = [a.deployment for a in o.actions if isinstance(a, CreateDeployment)]
    assert [r["metadata"]["name"] for r in real] == [f"{NAME}-{pv.pool}"]
    assert real[0]["metadata"]["annotations"][K.ANNOTATION_SERVING_CONFIG] == chash
    assert real[0]["spec"]["template"]["metadata"]["labels"][LABEL_MODEL] == NAME
    deletes = [a for a in o.actions if isinstance(a, (DeleteDeployment, K.DeleteJob))]
    assert {(type(a).__name__, a.name) for a in deletes} == {("DeleteDeployment", d["metadata"]["name"]),
                                                             ("DeleteJob", job.name)}
    reasons = [e.reason for e in o.events]
    assert reasons.index("CanaryPassed") < reasons.index("DeploymentCreated")  # canary → verdict → traffic
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("True", Reason.CANARY_PASSED)
    (entry,) = o.status.serving
    assert entry.canary.phase == "Passed"
    m = entry.canary.metrics[0]
    assert (m.base, m.jobQuantized, m.served) == (0.9, 0.88, 0.89)  # served beside the Job's figures
    ordered(o.actions)  # every action has its place in execute's order


def test_a_stored_passed_verdict_is_reused_and_a_rolled_out_variant_needs_no_canary():
    w = canary_world()
    o = run(w, result=result(w, True))  # e.g. after an operator restart: no canary, no Job
    assert [a.deployment["metadata"]["name"] for a in o.actions if isinstance(a, CreateDeployment)] == [f"{NAME}-{target(w)[0].pool}"]
    assert not [a for a in o.actions if isinstance(a, CreateJob)]
    (real,) = [a.deployment for a in o.actions if isinstance(a, CreateDeployment)]
    real = json.loads(json.dumps(real))
    real["metadata"].update(resourceVersion="5", generation=1)
    real["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
    w.deployments = {real["metadata"]["name"]: real}
    feed(w, o)
    svc = render_service(Owner(NAME, NS, UID))
    svc["metadata"]["ownerReferences"] = [{"uid": UID}]
    w.service = svc
    obs = replace(w.observed(), canaries={})  # observe reads nothing for a variant serving its configuration
    o2 = decide(obs, SETTINGS)
    assert o2.actions == ()
    assert conds(o2)[C.SERVING_QUALITY_PASSED] == ("True", Reason.CANARY_PASSED)
    assert conds(o2)[C.READY] == ("True", Reason.ALL_VARIANTS_READY)
    assert not K.canary_wanted(w.planned()[0].spec, target(w)[0], real, target(w)[2])


def _serving_old_artifact(w: World) -> None:
    """The variant serves an older artifact (rolled out with its own verdict)."""
    w.serve(stale=True)
    for d in w.deployments.values():
        d["metadata"]["annotations"][K.ANNOTATION_SERVING_CONFIG] = "0" * 32


def test_a_failed_verdict_never_rolls_out_and_the_old_artifact_keeps_serving():
    w = canary_world()
    _serving_old_artifact(w)
    d = canary_deployment(w)
    old = json.loads(json.dumps(w.deployments))
    o = run(w, deployment=d, result=result(w, False, "custom:exact_match served 0.1 vs base 0.9: 11.1% "
                                                     "(min 95%), KV cache fp8"))
    assert not [a for a in o.actions if isinstance(a, (CreateDeployment, ReplaceDeployment))]
    assert [a.name for a in o.actions if isinstance(a, DeleteDeployment)] == [d["metadata"]["name"]]
    assert w.deployments == old
    status, reason = conds(o)[C.SERVING_QUALITY_PASSED]
    assert (status, reason) == ("False", Reason.CANARY_FAILED)
    msg = next(c.message for c in o.status.conditions if c.type == C.SERVING_QUALITY_PASSED)
    assert "custom:exact_match" in msg and "KV cache fp8" in msg
    assert conds(o)[C.DEPLOYED] == ("False", Reason.BLOCKED)
    assert conds(o)[C.READY] == ("True", Reason.ALL_VARIANTS_READY)  # the old artifact serves
    (entry,) = o.status.serving
    assert entry.readyReplicas == 1 and entry.artifactKey == "0" * 64 and entry.canary.phase == "Failed"
    warn = [e for e in o.events if e.reason == "CanaryFailed"]
    assert warn and warn[0].type == "Warning"
    # The verdict stays: the next pass starts no second canary for this configuration.
    feed(w, o)
    o2 = run(w, result=result(w, False, "custom:exact_match ..."))
    assert not [a for a in o2.actions if isinstance(a, (CreateDeployment, CreateJob, ReplaceDeployment))]


def test_kv_cache_none_is_a_new_configuration_of_the_same_artifact():
    """The one-field fallback: `quantization.kvCache: none` changes the served configuration (so
    it is judged again) without a new artifact (no new quantization Job)."""
    w = canary_world()
    pv, key, chash = target(w)
    w2 = World(spec=base_spec(serving={"maxModelLen": 4096, "canary": {"enabled": True}},
                              quantization={"format": "auto", "kvCache": "none",
                                            "qualityGate": {"maxPerplexityIncreasePercent": 5}}))
    pv2, key2, chash2 = target(w2)
    assert key2 == key and chash2 != chash
    assert (pv.kvCacheDtype, pv2.kvCacheDtype) == ("fp8", "auto")


def test_replicas_are_not_part_of_the_served_configuration():
    w = canary_world()
    acc, _, _ = w.planned()
    pv, key, chash = target(w)
    spec2 = acc.spec.model_copy(update={"serving": acc.spec.serving.model_copy(update={"replicas": 7})})
    assert K.config_hash(spec2, pv, key, NAME, SETTINGS) == chash
    spec3 = acc.spec.model_copy(update={"serving": acc.spec.serving.model_copy(update={"image": "vllm/vllm-openai:v0.34.0"})})
    assert K.config_hash(spec3, pv, key, NAME, SETTINGS) != chash


def test_a_crashing_canary_is_reported_removed_and_not_restarted_in_a_loop():
    w = canary_world()
    _serving_old_artifact(w)
    d = canary_deployment(w)
    crash = ContainerTermination(pod="m-h100-canary-x", container="vllm", exit_code=1, reason="OOMKilled", message="")
    o = run(w, deployment=d, terminations=(crash,))
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_NOT_READY)
    msg = next(c.message for c in o.status.conditions if c.type == C.SERVING_QUALITY_PASSED)
    assert "OOMKilled" in msg and "m-h100-canary-x" in msg
    assert [a.name for a in o.actions if isinstance(a, DeleteDeployment)] == [d["metadata"]["name"]]
    assert conds(o)[C.READY][0] == "True"  # the old variant keeps serving
    feed(w, o)
    o2 = run(w, now="2026-11-23T12:01:00Z")  # the canary is gone: not started again before the back-off
    assert not [a for a in o2.actions if isinstance(a, CreateDeployment)]
    assert conds(o2)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_NOT_READY)
    o3 = run(w, now="2026-11-23T13:00:00Z")  # after canary_retry_seconds: one new try
    assert [a.deployment["metadata"]["name"] for a in o3.actions if isinstance(a, CreateDeployment)] == [d["metadata"]["name"]]


def test_an_image_that_cannot_be_pulled_is_reported_at_once():
    w = canary_world()
    d = canary_deployment(w)
    o = run(w, deployment=d, waiting=("pod p container vllm: ImagePullBackOff: Back-off pulling image",))
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_NOT_READY)
    assert "ImagePullBackOff" in next(c.message for c in o.status.conditions if c.type == C.SERVING_QUALITY_PASSED)


def test_a_canary_never_ready_is_given_up_after_its_deadline():
    w = canary_world()
    d = canary_deployment(w, created="2026-11-23T10:00:00Z")
    o = run(w, deployment=d, unschedulable="0/3 nodes are available: 3 Insufficient nvidia.com/gpu")
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_NOT_READY)
    msg = next(c.message for c in o.status.conditions if c.type == C.SERVING_QUALITY_PASSED)
    assert "not ready after 7200 s" in msg and "Insufficient nvidia.com/gpu" in msg
    young = canary_deployment(w, created="2026-11-23T11:59:00Z")
    o2 = run(w, deployment=young, unschedulable="0/3 nodes are available")
    assert conds(o2)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_PENDING)


ENGINE_DIED = ContainerTermination("c-canary-0", "vllm", 21, "Error", json.dumps({
    "component": "launch", "reason": "VllmEngineDied", "exitCode": 21,
    "message": "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"}), running_ready=True)
"""The healthy-but-cannot-answer server (e2e/tests/test_vllm_cpu_serve.py): /health answered, the
first request killed its engine, the launcher exited 21 with the cause, and the pod came back ready."""


@pytest.mark.parametrize("reason, terminations, words", [
    ("canary unreachable: http://10.1.2.3:8000/v1/models: connection refused", (), ["connection refused"]),
    ("HTTP 500 from the canary: EngineCore encountered an issue", (ENGINE_DIED,),
     ["HTTP 500", "server failed while evaluated", "exit 21, VllmEngineDied: AttributeError", "cpu_gemm_wna16"]),
])
def test_an_evaluation_without_a_verdict_fails_closed_with_its_cause(reason, terminations, words):
    w = canary_world()
    _serving_old_artifact(w)
    d = canary_deployment(w)
    pv, _, chash = target(w)
    message = json.dumps({"outcome": "error", "configHash": chash, "reason": reason})
    job = JobFacts(K.canary_job_name(NAME, pv.pool, chash), (), JobState.FAILED)
    o = run(w, deployment=d, pod_ready=True, pod_ip="10.1.2.3", job=job, job_message=message,
            terminations=terminations)
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_ERROR)
    msg = next(c.message for c in o.status.conditions if c.type == C.SERVING_QUALITY_PASSED)
    assert all(x in msg for x in words) and "fail closed" in msg, msg
    assert not [a for a in o.actions if isinstance(a, (CreateDeployment, ReplaceDeployment, CreateJob))]
    assert [a.name for a in o.actions if isinstance(a, DeleteDeployment)] == [d["metadata"]["name"]]
    assert not [a for a in o.actions if isinstance(a, K.DeleteJob)]  # kept until its TTL: the back-off


def test_a_deployment_from_before_the_canary_is_not_judged_until_it_changes():
    w = canary_world()
    w.serve()  # rendered without the served-configuration annotation
    o = run(w)
    assert not [a for a in o.actions if isinstance(a, (CreateDeployment, CreateJob))]
    (rep,) = [a for a in o.actions if isinstance(a, ReplaceDeployment)]  # the annotation only, once
    assert rep.deployment["metadata"]["annotations"][K.ANNOTATION_SERVING_CONFIG] == target(w)[2]
    assert conds(o)[C.SERVING_QUALITY_PASSED][0] == "True"


def test_a_canary_left_behind_is_removed():
    w = World()  # canary off
    w.publish()
    d = canary_deployment(canary_world())
    obs = replace(w.observed(), canary_leftovers=CanaryLeftovers(deployments=(d["metadata"]["name"],)))
    o = decide(obs, SETTINGS)
    assert d["metadata"]["name"] in [a.name for a in o.actions if isinstance(a, DeleteDeployment)]
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("True", Reason.CANARY_DISABLED)


def test_a_policy_can_require_the_canary():
    w = World(policies=[policy(rules={"requireServingCanary": True})])
    o = decide(w.observed(), SETTINGS)
    assert conds(o)[C.ACCEPTED] == ("False", Reason.POLICY_VIOLATION)
    assert "requireServingCanary" in next(c.message for c in o.status.conditions if c.type == C.ACCEPTED)
    w2 = World(spec=base_spec(serving={"canary": {"enabled": True}}), policies=[policy(rules={"requireServingCanary": True})])
    assert conds(decide(w2.observed(), SETTINGS))[C.ACCEPTED][0] == "True"


def test_the_canary_is_on_by_default():
    spec = base_spec()
    del spec["serving"]["canary"]
    w = World(spec=spec)
    w.publish()
    o = run(w)
    assert conds(o)[C.SERVING_QUALITY_PASSED] == ("False", Reason.CANARY_PENDING)


def test_status_round_trips_with_served_scores():
    w = canary_world()
    o = run(w, result=result(w, True))
    again = QuantizedModelStatus.model_validate(json.loads(json.dumps(o.status.to_wire())))
    assert again.serving[0].canary.metrics[0].served == 0.89


def test_cases_cover_every_canary_reason():
    """Each canary reason is produced above (test_decide.py leaves them to this file)."""
    produced = {Reason.CANARY_DISABLED, Reason.CANARY_PENDING, Reason.CANARY_EVALUATING, Reason.CANARY_PASSED,
                Reason.CANARY_FAILED, Reason.CANARY_NOT_READY, Reason.CANARY_ERROR}
    written = {v for k, v in vars(Reason).items() if k.startswith("CANARY_")}
    assert written == produced


def test_quality_cli_shows_served_scores_beside_the_jobs(capsys):
    import argparse

    from fewerbits_operator.cli import quality_cmd

    w = canary_world()
    o = run(w, result=result(w, False, "custom:exact_match served 0.1 vs base 0.9: 11.1% (min 95%), KV cache fp8"))

    class Reader:
        def get_model(self, ns, name):
            return {"status": o.status.to_wire()}

    args = argparse.Namespace(name=NAME, namespace=NS, output="table", context=None, kubeconfig=None)
    assert quality_cmd.run(args, Reader()) == 0
    out = capsys.readouterr().out
    assert "Served (serving canary):" in out
    row = next(line for line in out.splitlines() if "custom:exact_match" in line and "Failed" in line)
    assert row.split()[2:4] == ["fp8", "Failed"] and "0.9" in row and "0.88" in row and "0.1" in row and "11.1%" in row
    args.output = "json"
    assert quality_cmd.run(args, Reader()) == 0
    served = [r for r in json.loads(capsys.readouterr().out) if r["table"] == "served"]
    assert served[0]["job"] == 0.88 and served[0]["kvCacheDtype"] == "fp8"
