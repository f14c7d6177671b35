"""Faults on the real control plane: the operator killed at random points, kube-apiserver and the S3
server going away mid-work, a corrupted artifact object, a GPU pool vanishing, a model deleted while
its Job runs. Each test ends by checking what a platform team would check: one Job per artifact
key, no manifest for an incomplete artifact, status that says what happened, nothing left behind,
and no secret value anywhere.

The operator kill test prints its random seed; FEWERBITS_FAULT_SEED=<seed> replays its delays.

Simulator: the serving containers run the operator's default vLLM image, played by
llm-d-inference-sim: every verdict here is about the operator, the Job, storage, the fetch init
container (real, exit 12 DigestMismatch before any server starts) and status, none about what
vLLM answers; vLLM's own start failures are judged on real vLLM in test_autoscaling_vllm.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
import uuid
from collections import Counter

import pytest
from kubernetes import client

from e2e import demo
from tests.integration.faults import (
    assert_manifest_complete,
    enforce_pod_security,
    manifests,
    no_pod_security_refusals,
    scan_for_secrets,
)
from tests.integration.operator_harness import Models, OperatorProcess

pytestmark = pytest.mark.cluster

H100 = "NVIDIA-H100-80GB-HBM3"


def conditions(obj: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def is_true(obj: dict, type_: str) -> bool:
    c = conditions(obj).get(type_)
    return bool(c and c["status"] == "True")


def phase(obj: dict) -> str:
    if is_true(obj, "Ready") and (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]:
        # Ready stays True while a spec change rolls out (the old pods serve); done is both.
        return "ready" if is_true(obj, "Deployed") else "rolling out"
    if is_true(obj, "Quantized"):
        return "rolling out"
    return "quantizing"


def test_operator_killed_at_random_points_ends_with_one_job_per_key_and_whole_status(
        cluster, gpu_pool, namespace, models, model_spec, operator):
    """SIGKILL the operator at least six times while two artifacts are quantized and while spec
    changes roll out. The namespace enforces the `restricted` Pod Security Standard, so every pod the
    operator creates (quantjob, fetcher + vLLM) must pass it."""
    seed = int(os.environ.get("FEWERBITS_FAULT_SEED") or time.time_ns() % 1_000_000)
    rng = random.Random(seed)
    print(f"fault seed {seed} (FEWERBITS_FAULT_SEED={seed} replays it)")
    enforce_pod_security(cluster, namespace, "restricted")
    gpu_pool("h100", H100)
    gpu_pool("a100", "NVIDIA-A100-SXM4-80GB")
    policy = {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizationPolicy",
              "metadata": {"name": f"int8-on-ampere-{namespace}"},
              "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                       "formatByGPUFamily": {"ampere": "w8a8-int8"}}}
    cluster.apply(policy)
    kills: list[str] = []

    def kill(why: str) -> None:
        obj = models.get(namespace, "crashy")
        kills.append(f"{why} ({phase(obj)}, {len(models.jobs(namespace))} Job(s))")
        operator.restart()  # SIGKILL to the process group, then a fresh process

    try:
        models.apply(namespace, "crashy", model_spec())
        # During quantization: a kill every 0.5–3 s while the Jobs run (at most four).
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and sum("quantization" in k for k in kills) < 4:
            time.sleep(rng.uniform(0.5, 3))
            if phase(models.get(namespace, "crashy")) != "quantizing":
                break
            kill("quantization")
        models.wait("two artifacts published", lambda: is_true(models.get(namespace, "crashy"), "Quantized"),
                    timeout=900, namespace=namespace, name="crashy")
        # During roll-out: right as Deployments appear, then at random points of spec changes' roll-outs,
        # as many changes as it takes to reach six kills in all (a fast machine quantizes quickly).
        if not models.deployments(namespace, "crashy"):
            models.wait("a Deployment", lambda: models.deployments(namespace, "crashy"), timeout=120)
            kill("first roll-out")
        models.wait_condition(namespace, "crashy", "Ready", timeout=300)
        lengths = iter([512, 384, 640, 448, 576, 320])
        max_model_len = None
        while len(kills) < 6 or sum("roll-out" in k for k in kills) < 2:
            max_model_len = next(lengths)
            models.patch_spec(namespace, "crashy", {"serving": {"maxModelLen": max_model_len}})
            for _ in range(2):
                time.sleep(rng.uniform(0, 3))
                kill("spec change roll-out")
        generation = models.get(namespace, "crashy")["metadata"]["generation"]
        obj = models.wait(f"generation {generation} Ready", lambda: (o := models.get(namespace, "crashy")) and
                          phase(o) == "ready" and o, timeout=300, namespace=namespace, name="crashy")
        print("kills:", *kills, sep="\n  ")
        assert len(kills) >= 6 and any("quantization" in k for k in kills), kills

        status = obj["status"]
        # Whole status: every condition observed the final generation, plan, artifacts (with the Jobs that
        # made them and their quality), serving, endpoint.
        assert status["observedGeneration"] == generation
        assert {c["type"]: (c["status"], c["observedGeneration"]) for c in status["conditions"]} == {
            t: ("True", generation) for t in ("Accepted", "Planned", "Quantized", "QualityGatePassed", "ServingQualityPassed",
                                          "Deployed", "Ready")}
        assert {v["format"] for v in status["plan"]["variants"]} == {"fp8-dynamic", "w8a8-int8"}
        keys = {a["key"] for a in status["artifacts"]}
        assert len(keys) == 2
        assert all(a.get("job") and a["quality"]["passed"] and a["sizeBytes"] > 0 for a in status["artifacts"]), \
            status["artifacts"]
        assert {s["variant"] for s in status["serving"]} == {v["pool"] for v in status["plan"]["variants"]}
        assert len(status["serving"]) == 2
        assert all(s["readyReplicas"] == 1 and s["artifactKey"] in keys for s in status["serving"])
        assert status["endpoint"] == f"http://crashy.{namespace}.svc:8000"

        # Exactly one Job per artifact key, each the one status names; one manifest per key. (A Job is
        # labelled with the key it was planned for: w8a8-int8 calibrates on `auto`, and without the Hub
        # its Job publishes under the fallback's own key, which status then names.)
        jobs = models.jobs(namespace)
        per_key = Counter(j.metadata.labels["fewerbits.io/artifact"] for j in jobs)
        assert len(per_key) == len(keys) and set(per_key.values()) == {1}, per_key
        assert {j.metadata.name for j in jobs} == {a["job"] for a in status["artifacts"]}
        assert sorted(manifests(cluster, namespace)) == sorted(f"{namespace}/{k}/manifest.json" for k in keys)
        for k in keys:
            assert_manifest_complete(cluster, namespace, k)
        deployments = models.deployments(namespace, "crashy")
        assert len(deployments) == 2
        for d in deployments:
            args = d.spec.template.spec.containers[0].command
            assert args[args.index("--max-model-len") + 1] == str(max_model_len)
        assert no_pod_security_refusals(cluster, namespace) == []
        leaks, scanned = scan_for_secrets(cluster, namespace, [cluster.s3.secret_key], operator.log_path)
        assert leaks == [] and any(s.startswith("container output") for s in scanned)
    finally:
        cluster.kubectl("delete", "quantizationpolicy", policy["metadata"]["name"], "--wait=false")
        if operator.proc is None or operator.proc.poll() is not None:
            operator.start()


def test_kube_apiserver_restart_mid_reconcile_is_survived_without_operator_restart(
        cluster, gpu_pool, model_spec, tmp_path, crds_installed):
    """An operator of its own, with no periodic resync: after kube-apiserver dies (SIGKILL) and
    comes back twice, its watches alone must carry on — a model applied afterwards is picked up."""
    ns = f"f-{uuid.uuid4().hex[:8]}"
    demo.create_namespace_with_secret(cluster, ns, "s3-credentials")
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log",
                         env_extra={"FEWERBITS_NAMESPACES": '["f-*"]', "FEWERBITS_RESYNC_SECONDS": "86400"}).start()
    models = Models(cluster.api_client(), op)
    gpu_pool("h100", H100)
    try:
        spec = model_spec(quantization={"format": "fp8-dynamic"})
        spec["storage"]["uri"] = f"s3://{demo.ARTIFACT_BUCKET}/{ns}"
        models.apply(ns, "survivor", spec)
        models.wait("a quantization Job", lambda: models.jobs(ns), timeout=180, namespace=ns, name="survivor")
        pid = op.proc.pid
        cluster.restart_component("kube-apiserver", signal.SIGKILL)  # while the Job runs and reconciles
        models = Models(cluster.api_client(), op)
        models.wait_condition(ns, "survivor", "Quantized", timeout=600)
        cluster.restart_component("kube-apiserver", signal.SIGKILL)  # during roll-out
        models = Models(cluster.api_client(), op)
        models.wait_condition(ns, "survivor", "Ready", timeout=300)
        # Created after the restarts, reached only through the operator's (re-established) watch.
        models.apply(ns, "newcomer", spec)
        models.wait_condition(ns, "newcomer", "Ready", timeout=180)
        assert op.proc.pid == pid and op.proc.poll() is None, "the operator process restarted"
        assert len(models.jobs(ns)) == 1
        assert len(manifests(cluster, ns)) == 1
    finally:
        op.stop()
        client.CoreV1Api(cluster.api_client()).delete_namespace(ns)


def test_s3_stopped_during_upload_is_retried_and_never_leaves_a_manifest_for_a_partial_artifact(
        cluster, gpu_pool, namespace, models, model_spec):
    """The Job's pod pauses after its first uploaded file (a debug hook the pod runner injects); MinIO
    is killed then. The pod fails on the next file, the Job's next pod completes the artifact."""
    gpu_pool("h100", H100)
    cluster.set_container_env("fewerbits-quantjob", {"FEWERBITS_DEBUG_PAUSE_AFTER_FILES": "1",
                                                      "FEWERBITS_DEBUG_PAUSE_SECONDS": "15"})
    core = client.CoreV1Api(cluster.api_client())
    try:
        models.apply(namespace, "s3down", model_spec(quantization={"format": "fp8-dynamic"}))
        (job,) = models.wait("the quantization Job", lambda: models.jobs(namespace), timeout=180)
        job_name = job.metadata.name

        def paused_pod():
            for p in core.list_namespaced_pod(namespace, label_selector=f"job-name={job_name}").items:
                if "debug pause after 1 uploaded files" in cluster.pod_logs(namespace, p.metadata.name):
                    return p.metadata.name
            return None
        first = models.wait("the Job's pod mid-upload", paused_pod, timeout=600, namespace=namespace, name="s3down")
        cluster.stop_component("minio", signal.SIGKILL)
        try:
            def failed():
                p = core.read_namespaced_pod(first, namespace)
                return p.status.phase == "Failed" and p
            pod = models.wait("the mid-upload pod to fail without storage", failed, timeout=240)
            term = pod.status.container_statuses[0].state.terminated
            summary = json.loads(term.message)
            assert summary["stage"] == "upload" and summary["reason"] in ("UploadFailed", "StorageUnavailable"), summary
        finally:
            cluster.start_component("minio")
        # Storage is back; the failed attempt left files but no manifest.
        status = models.get(namespace, "s3down")["status"]
        key = status["artifacts"][0]["key"]
        assert manifests(cluster, namespace) == [], "a manifest exists for an artifact whose upload failed"
        models.wait_condition(namespace, "s3down", "Ready", timeout=600)
        batch = client.BatchV1Api(cluster.api_client())
        job = models.wait("the Job to count its success", lambda: (
            j := batch.read_namespaced_job(job_name, namespace)).status.succeeded and j, timeout=60)
        assert (job.status.failed, job.status.succeeded) == (1, 1)
        assert manifests(cluster, namespace) == [f"{namespace}/{key}/manifest.json"]
        assert_manifest_complete(cluster, namespace, key)
        leaks, _ = scan_for_secrets(cluster, namespace, [cluster.s3.secret_key], models.operator.log_path)
        assert leaks == []
    finally:
        cluster.set_container_env("fewerbits-quantjob", None)


def test_corrupted_artifact_object_fails_the_fetch_clearly_and_nothing_serves_it(
        cluster, gpu_pool, namespace, models, model_spec):
    gpu_pool("h100", H100)
    models.apply(namespace, "corrupt", model_spec(quantization={"format": "fp8-dynamic"}))
    models.wait_condition(namespace, "corrupt", "Ready", timeout=600)
    key = models.get(namespace, "corrupt")["status"]["artifacts"][0]["key"]
    manifest = assert_manifest_complete(cluster, namespace, key)

    # Flip bytes in the largest file, same size and metadata: only its digest can tell.
    victim = max(manifest["files"], key=lambda f: f["sizeBytes"])
    obj = f"{namespace}/{key}/files/{victim['path']}"
    s3 = cluster.s3.client()
    head = s3.head_object(Bucket=demo.ARTIFACT_BUCKET, Key=obj)
    data = bytearray(s3.get_object(Bucket=demo.ARTIFACT_BUCKET, Key=obj)["Body"].read())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    s3.put_object(Bucket=demo.ARTIFACT_BUCKET, Key=obj, Body=bytes(data), Metadata=head["Metadata"])

    # The node "goes away": the pod is deleted; its replacement has to fetch again.
    core = client.CoreV1Api(cluster.api_client())
    (old,) = core.list_namespaced_pod(namespace, label_selector="fewerbits.io/model=corrupt").items
    core.delete_namespaced_pod(old.metadata.name, namespace, grace_period_seconds=0)
    ready = models.wait_condition(namespace, "corrupt", "Ready", status="False", reason="PodsFailing", timeout=180)
    assert "DigestMismatch" in ready["message"] and victim["path"] in ready["message"], ready["message"]

    (pod,) = [p for p in core.list_namespaced_pod(namespace, label_selector="fewerbits.io/model=corrupt").items
              if p.metadata.name != old.metadata.name]
    (fetch,) = pod.status.init_container_statuses
    term = fetch.state.terminated or fetch.last_state.terminated
    assert term.exit_code == 12, term
    assert json.loads(term.message)["reason"] == "DigestMismatch"
    (vllm,) = pod.status.container_statuses
    assert vllm.state.running is None and vllm.restart_count == 0 and not vllm.ready, vllm
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{pod.status.pod_ip}:8000/v1/models", timeout=3)
    models.wait_events(namespace, "corrupt", {"PodsFailing"})


def test_node_pool_removed_is_said_in_plan_and_status_and_its_deployment_kept(
        cluster, gpu_pool, namespace, models, model_spec):
    gpu_pool("h100", H100)
    gpu_pool("l4", "NVIDIA-L4")
    models.apply(namespace, "twopools", model_spec(quantization={"format": "fp8-dynamic"}))
    models.wait_condition(namespace, "twopools", "Ready", timeout=600)
    status = models.get(namespace, "twopools")["status"]
    pools = {v["gpuProduct"]: v["pool"] for v in status["plan"]["variants"]}
    l4 = pools["NVIDIA-L4"]
    assert {s["variant"] for s in status["serving"]} == set(pools.values())

    cluster.remove_pool("l4")
    planned = models.wait_condition(namespace, "twopools", "Planned", reason="PoolGone", timeout=120)
    assert l4 in planned["message"] and f"twopools-{l4}" in planned["message"], planned["message"]
    status = models.get(namespace, "twopools")["status"]
    assert [r["pool"] for r in status["plan"]["rejected"]] == [l4]
    assert "no node of this pool" in status["plan"]["rejected"][0]["reason"]
    assert [v["pool"] for v in status["plan"]["variants"]] == [pools[H100]]
    assert {d.metadata.name for d in models.deployments(namespace, "twopools")} == {
        f"twopools-{p}" for p in pools.values()}
    models.wait_events(namespace, "twopools", {"PoolGone"})

    gpu_pool("l4", "NVIDIA-L4")  # the pool comes back: planned again, nothing recreated
    models.wait_condition(namespace, "twopools", "Planned", reason="Planned", timeout=120)
    models.wait("both variants serving again", lambda: {s["variant"] for s in models.get(
        namespace, "twopools")["status"]["serving"] if s["readyReplicas"]} == set(pools.values()) and is_true(
        models.get(namespace, "twopools"), "Ready"), timeout=180, namespace=namespace, name="twopools")


def test_model_deleted_while_its_job_runs_leaves_nothing_behind(cluster, gpu_pool, namespace, models, model_spec):
    gpu_pool("h100", H100)
    models.apply(namespace, "doomed", model_spec(quantization={"format": "fp8-dynamic"}))
    core = client.CoreV1Api(cluster.api_client())

    def running_pod():
        pods = core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=quantize").items
        return next((p for p in pods if p.status.phase == "Running"), None)
    pod = models.wait("the Job's pod running", running_pod, timeout=300, namespace=namespace, name="doomed")
    models.delete(namespace, "doomed")
    api = cluster.api_client()
    models.wait("Job, pods, Deployments and Service collected", lambda: not models.jobs(namespace) and not
                core.list_namespaced_pod(namespace).items and not
                client.AppsV1Api(api).list_namespaced_deployment(namespace).items and not
                core.list_namespaced_service(namespace).items, timeout=120)
    # The quantjob process went with its pod: its output stops, and it never publishes.
    out = cluster.pod_logs(namespace, pod.metadata.name)
    time.sleep(10)
    assert cluster.pod_logs(namespace, pod.metadata.name) == out
    assert manifests(cluster, namespace) == []
    assert models.operator.proc.poll() is None


def test_a_service_the_model_does_not_own_is_never_touched(cluster, gpu_pool, namespace, models, model_spec):
    """Another team's Service already has the model's name: the operator reports the conflict and
    leaves it alone (no selector rewrite that would steal its traffic)."""
    gpu_pool("h100", H100)
    core = client.CoreV1Api(cluster.api_client())
    theirs = {"metadata": {"name": "taken"}, "spec": {"selector": {"app": "theirs"},
                                                      "ports": [{"port": 80, "targetPort": 8080}]}}
    core.create_namespaced_service(namespace, theirs)
    models.apply(namespace, "taken", model_spec(quantization={"format": "fp8-dynamic"}))
    c = models.wait_condition(namespace, "taken", "Deployed", status="False", reason="ServiceConflict", timeout=180)
    assert "not owned by this QuantizedModel" in c["message"]
    assert models.condition(namespace, "taken", "Ready")["reason"] == "ServiceConflict"
    assert "endpoint" not in models.get(namespace, "taken")["status"]
    svc = core.read_namespaced_service("taken", namespace)
    assert svc.spec.selector == {"app": "theirs"} and [p.port for p in svc.spec.ports] == [80]
    assert not svc.metadata.owner_references


def test_source_unreadable_after_a_secret_rotation_keeps_the_plan_and_ready(
        cluster, gpu_pool, namespace, models, model_spec):
    """The source's credentials rotate to ones that can't read it (or the Hub is down): what serves
    keeps serving and Ready stays True; Planned says the plan is kept and why."""
    gpu_pool("h100", H100)
    demo.create_s3_secret(cluster, namespace, "source-credentials")
    spec = model_spec(quantization={"format": "fp8-dynamic"})
    spec["source"]["credentialsSecret"] = "source-credentials"
    models.apply(namespace, "rotated", spec)
    models.wait_condition(namespace, "rotated", "Ready", timeout=600)
    client.CoreV1Api(cluster.api_client()).patch_namespaced_secret("source-credentials", namespace, {
        "stringData": {"AWS_ACCESS_KEY_ID": "rotated-elsewhere", "AWS_SECRET_ACCESS_KEY": "not-valid-here"}})
    planned = models.wait("Planned to say the plan is kept", lambda: (
        c := models.condition(namespace, "rotated", "Planned")) and "kept from an earlier pass" in c["message"] and c,
        timeout=120, namespace=namespace, name="rotated")
    assert planned["status"] == "True" and "InvalidAccessKeyId" in planned["message"], planned
    ready = models.condition(namespace, "rotated", "Ready")
    assert ready["status"] == "True", ready
    assert models.get(namespace, "rotated")["status"]["serving"][0]["readyReplicas"] == 1
