"""GitOps for real: Argo CD (v3.2, built from its Go module, e2e/addons/argocd.py) syncs fewerbits from
a local git repository, and judges each QuantizedModel's health with the Lua check fewerbits ships.

Nothing under test is applied with kubectl: the test applies one root Application (app of apps),
the models' namespace and its S3 Secret (a secret manager's job, never git's), and from then on
only commits. It follows what a platform team does on day one and after (e2e/gitops.py has the
repository's layout): the chart installs in wave -2, a QuantizationPolicy in wave -1 and two models
in wave 0; the models' Application is Progressing while they quantize and Healthy at Ready; it
stays Synced while the operator writes status and the autoscaler scales; a spec change rolls out
and its revert rolls back to the cached artifact without a Job; a model whose gate fails makes the
Application Degraded with the model's message; a deleted model is pruned with everything it owns;
a hand edit is healed; an invalid model shows the API server's error in the sync result.

Simulator: the models are served by llm-d-inference-sim (the quantization Jobs are real): what is
judged here is what Argo CD and the operator do with the objects, and the autoscaling step needs
pods whose load the test sets (the simulator's fake metrics); what vLLM does with an artifact is
tests/integration/test_canary.py's and e2e/tests/test_vllm_cpu_serve.py's.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from kubernetes import client

from e2e import demo, gitops
from e2e.addons import argocd as argo
from tests.integration.test_autoscaling import set_load

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]
SECRET = "s3-credentials"
QM = "QuantizedModel"


def qm(cluster, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(cluster.api_client()).get_namespaced_custom_object(
        demo.GROUP, demo.VERSION, ns, demo.PLURAL, name)


def qm_exists(cluster, ns: str, name: str) -> bool:
    try:
        qm(cluster, ns, name)
        return True
    except client.exceptions.ApiException as e:
        if e.status == 404:
            return False
        raise


def condition(obj: dict, kind: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def artifact_keys(obj: dict) -> set[str]:
    return {a["key"] for a in (obj.get("status") or {}).get("artifacts") or []}


def serving_keys(obj: dict) -> set[str]:
    return {s["artifactKey"] for s in (obj.get("status") or {}).get("serving") or []}


def jobs(cluster, ns: str) -> set[str]:
    return {j.metadata.uid for j in client.BatchV1Api(cluster.api_client()).list_namespaced_job(ns).items}


def owned_by(cluster, ns: str, uid: str) -> list[str]:
    """The namespace's objects whose owner references name ``uid``, as ``Kind/name``."""
    api = cluster.api_client()
    lists = (client.AppsV1Api(api).list_namespaced_deployment(ns).items,
             client.CoreV1Api(api).list_namespaced_service(ns).items,
             client.CoreV1Api(api).list_namespaced_pod(ns).items,
             client.BatchV1Api(api).list_namespaced_job(ns).items,
             client.CoreV1Api(api).list_namespaced_config_map(ns).items,
             client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(ns).items)
    return [f"{type(o).__name__.removeprefix('V1')}/{o.metadata.name}" for items in lists for o in items
            if any(r.uid == uid for r in o.metadata.owner_references or [])]


def wait_for(what: str, check, timeout: float, interval: float = 1.0, last=lambda: ""):
    """The first truthy ``check()``; ``last()`` says what was seen instead, when it never comes."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f}s; {last()}"
        time.sleep(interval)


def resource_health(st: argo.AppState, name: str) -> dict:
    return st.resource(QM, name).get("health") or {}


def models_healthy(revision: str):
    return lambda st: st.sync == "Synced" and st.revision == revision and st.health == "Healthy"


def test_argocd_syncs_fewerbits_from_git_and_judges_models_with_the_shipped_health_check(
        cluster, gpu_pool, argocd, tmp_path):
    gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    cluster.add_cpu_node("cpu-gitops")
    suffix = uuid.uuid4().hex[:6]
    ns, system_ns = f"gitops-{suffix}", f"fb-gitops-{suffix}"
    demo.create_namespace_with_secret(cluster, ns, SECRET)
    source = demo.upload_test_model(cluster)
    repo = gitops.GitRepo(tmp_path / "platform-repo")
    alpha = gitops.model(cluster, "alpha", source, SECRET,
                         autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                                      "scaleDownDelaySeconds": 600})
    # fp8-dynamic needs no calibration data: what changes its bytes (and key) is what it leaves at 16 bits.
    beta = gitops.model(cluster, "beta", source, SECRET, quantization={"ignore": ["lm_head", "re:.*mlp.up_proj"]})
    first = gitops.write_layout(cluster, repo, ns, system_ns, [alpha, beta], SECRET)
    w = gitops.Watch(cluster, out=print)
    cluster.apply(gitops.root_app(repo))
    try:
        _flow(cluster, repo, w, ns, first, alpha)
    except BaseException:
        print(argocd.log_tail(60))
        raise
    finally:
        _delete_root(cluster, ns, system_ns)


def _flow(cluster, repo: gitops.GitRepo, w: gitops.Watch, ns: str, first: str, alpha: dict) -> None:
    # --- 1. Waves: the chart (CRDs, RBAC, operator) is synced and healthy before the models'
    # Application exists; inside it the policy precedes the models, which name no storage of their own.
    chart = w.until(gitops.CHART_APP, lambda st: st.sync == "Synced" and st.health == "Healthy"
                    and st.operation_phase == "Succeeded", "Synced, Healthy and done", 300)
    assert chart.resource("Deployment", "fewerbits").get("health", {}).get("status") == "Healthy"
    chart_healthy = argo.get_app(cluster, gitops.CHART_APP)["status"]["health"]["lastTransitionTime"]
    models_created = wait_for("the models' Application", lambda: _created(cluster, gitops.MODELS_APP), 300)
    assert models_created >= chart_healthy, (models_created, chart_healthy)

    # --- 2. Health as Argo CD computes it with the shipped check: Progressing while quantizing,
    # then Healthy at Ready, for the Application and for each model.
    st = w.until(gitops.MODELS_APP, models_healthy(first), "Healthy at the first commit", 900)
    seen = w.history[gitops.MODELS_APP]
    progressing = [s for s in seen if s.health == "Progressing"]
    assert progressing, [s.line() for s in seen]
    model_health = [(n, resource_health(s, n)) for s in progressing for n in ("alpha", "beta")]
    assert any(h.get("status") == "Progressing" and "Quantized" in h.get("message", "") for _, h in model_health), \
        f"no model was ever Progressing with a Quantized message: {model_health}"
    assert not any(s.health == "Degraded" for s in seen), [s.line() for s in seen]
    for name in ("alpha", "beta"):
        h = resource_health(st, name)
        assert h.get("status") == "Healthy", h
        assert condition(qm(cluster, ns, name), "Ready")["status"] == "True"
    assert st.resource("QuantizationPolicy", gitops.POLICY).get("status") == "Synced"
    for name in ("alpha", "beta"):
        accepted = condition(qm(cluster, ns, name), "Accepted")
        assert accepted["status"] == "True", accepted  # the policy's storage default applied

    # --- 3. Synced while the operator writes status and the autoscaler scales alpha 1 -> 2.
    core, apps = client.CoreV1Api(cluster.api_client()), client.AppsV1Api(cluster.api_client())
    [deployment] = [d.metadata.name for d in apps.list_namespaced_deployment(ns).items
                    if d.metadata.name.startswith("alpha-")]

    def scaled() -> bool:
        set_load(core, ns, "alpha", 0.95, 8, 4)
        assert w.state(gitops.MODELS_APP).sync == "Synced"
        return apps.read_namespaced_deployment_scale(deployment, ns).spec.replicas == 2
    wait_for("the autoscaler's scale-up of alpha", scaled, 180)
    _stays_synced(cluster, w, reconciliations=3)
    live = qm(cluster, ns, "alpha")
    assert set(live["metadata"].get("annotations") or {}) <= {
        "argocd.argoproj.io/tracking-id", "kubectl.kubernetes.io/last-applied-configuration"}, \
        live["metadata"].get("annotations")
    set_load(core, ns, "alpha", 0.0, 0, 0)

    # --- 4. A commit that changes alpha's spec rolls out a new artifact (one new Job); its revert
    # rolls back to the cached artifact with no Job at all.
    old_keys, jobs_before = serving_keys(qm(cluster, ns, "alpha")), jobs(cluster, ns)
    changed = dict(alpha, spec=demo.merge_spec(alpha["spec"], quantization={
        "ignore": ["lm_head", "re:.*mlp.down_proj"]}))
    repo.write("models/alpha.yaml", changed)
    change = repo.commit("alpha: keep the MLP down projections at 16 bits")
    w.until(gitops.MODELS_APP, lambda s: s.revision == change and s.health == "Progressing",
            "Progressing on the change", 120, refresh=True)
    w.until(gitops.MODELS_APP, models_healthy(change), "Healthy on the change", 600)
    new_keys = serving_keys(qm(cluster, ns, "alpha"))
    assert new_keys and new_keys.isdisjoint(old_keys), (old_keys, new_keys)
    assert len(jobs(cluster, ns) - jobs_before) == 1
    jobs_after_change = jobs(cluster, ns)
    revert = repo.revert(change)
    w.until(gitops.MODELS_APP, models_healthy(revert), "Healthy on the revert", 300, refresh=True)
    wait_for("alpha serving its first artifact again", lambda: serving_keys(qm(cluster, ns, "alpha")) == old_keys, 120)
    assert jobs(cluster, ns) == jobs_after_change, "the revert started a Job"

    # --- 5. A model whose gate fails makes the Application Degraded, with the model's own message.
    # fp8 does not hurt the test model (its perplexity even drops a little); nvfp4 with nothing left
    # at 16 bits is reliably worse, so a gate of 0.001% fails it (as in tests/integration/test_operator.py).
    gamma = gitops.model(cluster, "gamma", alpha["spec"]["source"]["uri"], SECRET, quantization={
        "format": "nvfp4", "ignore": [], "qualityGate": {"maxPerplexityIncreasePercent": 0.001, "evalSamples": 8}})
    repo.write("models/gamma.yaml", gamma)
    strict = repo.commit("gamma: alpha's model under a gate it cannot pass")
    st = w.until(gitops.MODELS_APP, lambda s: s.revision == strict and s.health == "Degraded",
                 "Degraded by gamma's gate", 300, refresh=True)
    gate = condition(qm(cluster, ns, "gamma"), "QualityGatePassed")
    assert gate["status"] == "False" and gate["reason"] == "GateFailed", gate
    h = resource_health(st, "gamma")
    assert h["status"] == "Degraded" and gate["message"] in h["message"], (h, gate)
    assert resource_health(st, "alpha")["status"] == "Healthy"

    # --- 6. A commit that deletes beta and gamma prunes them and everything they own.
    uids = {n: qm(cluster, ns, n)["metadata"]["uid"] for n in ("beta", "gamma")}
    assert owned_by(cluster, ns, uids["beta"]), "beta owns nothing to prune"
    repo.remove("models/beta.yaml")
    repo.remove("models/gamma.yaml")
    pruned = repo.commit("retire beta and gamma")
    w.until(gitops.MODELS_APP, models_healthy(pruned), "Healthy after the prune", 300, refresh=True)
    for name, uid in uids.items():
        wait_for(f"{name} deleted", lambda: not qm_exists(cluster, ns, name), 120)
        wait_for(f"{name}'s objects garbage-collected", lambda: not owned_by(cluster, ns, uid), 120)
    assert condition(qm(cluster, ns, "alpha"), "Ready")["status"] == "True"

    # --- 7. A hand edit of a managed object is healed, and the operator does not fight it.
    cluster.kubectl("patch", "qm", "alpha", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"serving": {"maxModelLen": 128}}}))
    wait_for("self-heal of alpha's spec",
             lambda: qm(cluster, ns, "alpha")["spec"]["serving"]["maxModelLen"] == 256, 120)
    healed = qm(cluster, ns, "alpha")["metadata"]["generation"]
    w.until(gitops.MODELS_APP, models_healthy(pruned), "Healthy after the heal", 300)
    _stays_synced(cluster, w, reconciliations=3)
    assert qm(cluster, ns, "alpha")["metadata"]["generation"] == healed, "alpha's spec changed after the heal"

    # --- 8. An invalid model committed beside a valid change: the API server's error, naming the
    # field, in the sync result; the valid change in the same commit is applied, nothing is pruned.
    bad = gitops.model(cluster, "broken", alpha["spec"]["source"]["uri"], SECRET)
    bad["spec"]["quantization"]["format"] = "fp9"
    repo.write("models/broken.yaml", bad)
    repo.write("models/alpha.yaml", dict(alpha, metadata={"name": "alpha", "labels": {"team": "search"}}))
    invalid = repo.commit("broken: a format that does not exist; alpha: a team label")
    argo.refresh(cluster, gitops.MODELS_APP)
    op = wait_for("the failed sync", lambda: _failed_sync(cluster, invalid), 180, last=lambda: json.dumps(
        (argo.get_app(cluster, gitops.MODELS_APP).get("status") or {}).get("operationState"))[:3000])
    results = {r["name"]: r for r in op["syncResult"]["resources"]}
    assert results["broken"]["status"] == "SyncFailed"
    assert "spec.quantization.format" in results["broken"]["message"] and "fp9" in results["broken"]["message"]
    assert "spec.quantization.format" in op["message"]
    assert not qm_exists(cluster, ns, "broken")
    live = qm(cluster, ns, "alpha")
    assert (live["metadata"].get("labels") or {}).get("team") == "search"  # applied in the same sync
    assert condition(live, "Ready")["status"] == "True"
    assert w.state(gitops.MODELS_APP).sync == "OutOfSync"  # broken is in git, not in the cluster
    # The fix: revert the commit. Argo CD retries a failed automated sync (five times, backing off
    # for minutes); a person who has fixed git ends the retries, as `argocd app terminate-op` does.
    fixed = repo.revert(invalid)
    argo.terminate_operation(cluster, gitops.MODELS_APP)
    w.until(gitops.MODELS_APP, models_healthy(fixed), "Healthy after the fix", 300, refresh=True)
    assert not (qm(cluster, ns, "alpha")["metadata"].get("labels") or {}).get("team")


def _created(cluster, name: str) -> str:
    return (argo.get_app(cluster, name).get("metadata") or {}).get("creationTimestamp", "")


def _failed_sync(cluster, revision: str) -> dict:
    """The models' operation at ``revision`` once a resource failed to apply: Failed, or Running
    between the automated sync's retries (its message names the failure)."""
    op = (argo.get_app(cluster, gitops.MODELS_APP).get("status") or {}).get("operationState") or {}
    sync = op.get("syncResult") or {}
    failed = any(r.get("status") == "SyncFailed" for r in sync.get("resources") or [])
    if sync.get("revision") == revision and failed and op.get("phase") in ("Failed", "Error", "Running"):
        return op
    return {}


def _stays_synced(cluster, w: gitops.Watch, reconciliations: int) -> None:
    """Synced through ``reconciliations`` comparisons with git (each advances ``reconciledAt``)."""
    seen: set[str] = set()

    def compared() -> bool:
        st = w.state(gitops.MODELS_APP)
        assert st.sync == "Synced", st.line()
        seen.add(argo.get_app(cluster, gitops.MODELS_APP)["status"].get("reconciledAt", ""))
        return len(seen) > reconciliations
    wait_for(f"{reconciliations} reconciliations", compared, 30 * reconciliations)


def _delete_root(cluster, ns: str, system_ns: str) -> None:
    """The root without cascade (it would re-create a child deleted under it), then the models
    (the operator's finalizers need it running), then the chart (not the CRDs: Argo CD keeps them)."""
    app = f"applications.{argo.GROUP}"
    argo.terminate_operation(cluster, gitops.MODELS_APP)  # a failed sync's retries would hold the deletion
    cluster.kubectl("patch", app, gitops.ROOT_APP, "-n", argo.NAMESPACE, "--type=merge", "-p",
                    '{"metadata":{"finalizers":[]}}', check=False)
    cluster.kubectl("delete", app, gitops.ROOT_APP, "-n", argo.NAMESPACE, "--ignore-not-found", check=False)
    for name in (gitops.MODELS_APP, gitops.CHART_APP):
        cluster.kubectl("delete", app, name, "-n", argo.NAMESPACE, "--ignore-not-found", "--timeout=180s",
                        check=False, timeout=200)
    for n in (ns, system_ns):
        cluster.kubectl("delete", "namespace", n, "--ignore-not-found", "--wait=false", check=False)
