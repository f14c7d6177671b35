"""Tests of the local control plane itself: real apiserver, controllers, scheduler, kwok, pod runner."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.procs import pid_alive

pytestmark = pytest.mark.cluster

PY = "fewerbits-test/python:1"        # run by the pod runner (e2e/workloads.py test rule)
KWOK_IMAGE = "registry.example/app:1"  # not in the image map: kwok plays the kubelet


def wait_for(what, fn, timeout=60.0, interval=0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def pods(api, ns, selector=None):
    return api.list_namespaced_pod(ns, label_selector=selector).items


def deployment(name, image, *, replicas=1, gpus=None, node_selector=None, command=None, args=None, ports=None):
    container = {"name": "main", "image": image}
    if command:
        container["command"] = command
    if args:
        container["args"] = args
    if ports:
        container["ports"] = [{"containerPort": p} for p in ports]
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    spec = {"containers": [container], "terminationGracePeriodSeconds": 2}
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": spec}},
    }


def job(name, command, *, env=None):
    container = {"name": "main", "image": PY, "command": command}
    if env:
        container["env"] = env
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}},
    }


def test_version_is_stamped(cluster):
    info = client.VersionApi(cluster.api_client()).get_code()
    assert info.git_version.startswith("v1.36."), info.git_version
    assert info.minor == "36"


def test_gpu_deployment_lands_on_matching_pool_and_pends_without_room(cluster, gpu_pool, namespace):
    h100 = gpu_pool("h100-sched", "NVIDIA-H100-80GB-HBM3", nodes=1)
    gpu_pool("l4-sched", "l4", nodes=1)
    node = client.CoreV1Api(cluster.api_client()).read_node(h100[0])
    assert node.metadata.labels["nvidia.com/gpu.family"] == "hopper"
    assert node.metadata.labels["nvidia.com/gpu.memory"] == "81559"
    assert node.status.allocatable["nvidia.com/gpu"] == "8"

    apps = client.AppsV1Api(cluster.api_client())
    api = client.CoreV1Api(cluster.api_client())
    # Two replicas each wanting a whole 8-GPU hopper node; one node exists.
    apps.create_namespaced_deployment(namespace, deployment(
        "hop", KWOK_IMAGE, replicas=2, gpus=8, node_selector={"nvidia.com/gpu.family": "hopper"}))
    # Wants 2 GPUs on ada-lovelace: the L4 node has 1.
    apps.create_namespaced_deployment(namespace, deployment(
        "ada", KWOK_IMAGE, replicas=1, gpus=2, node_selector={"nvidia.com/gpu.family": "ada-lovelace"}))

    def settled():
        hop = pods(api, namespace, "app=hop")
        running = [p for p in hop if p.status.phase == "Running"]
        pending = [p for p in hop if p.status.phase == "Pending"]
        return (running, pending) if len(running) == 1 and len(pending) == 1 else None

    running, pending = wait_for("one hopper pod Running and one Pending", settled)
    assert running[0].spec.node_name == h100[0]
    assert pending[0].spec.node_name is None

    def unschedulable(p):
        return any(c.type == "PodScheduled" and c.status == "False" and "nvidia.com/gpu" in (c.message or "")
                   for c in p.status.conditions or [])

    wait_for("Insufficient nvidia.com/gpu reported", lambda: unschedulable(
        api.read_namespaced_pod(pending[0].metadata.name, namespace)))
    ada = wait_for("ada pod", lambda: pods(api, namespace, "app=ada"))
    wait_for("ada pod unschedulable", lambda: unschedulable(api.read_namespaced_pod(ada[0].metadata.name, namespace)))
    assert api.read_namespaced_pod(ada[0].metadata.name, namespace).spec.node_name is None


def test_job_runs_a_real_process_with_env_from_secret(cluster, gpu_pool, namespace):
    gpu_pool("t4-job", "t4")
    api = client.CoreV1Api(cluster.api_client())
    api.create_namespaced_secret(namespace, {"metadata": {"name": "creds"}, "stringData": {"token": "s3cr3t"}})
    api.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"}, "data": {"mode": "fast"}})
    script = ("import os, json; print('working'); "
              "open(os.environ['FEWERBITS_TERMINATION_LOG'], 'w').write(json.dumps("
              "{k: os.environ.get(k) for k in ('TOKEN', 'MODE', 'ME', 'POD_IP')}))")
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
           {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
           {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    batch = client.BatchV1Api(cluster.api_client())
    batch.create_namespaced_job(namespace, job("ok", ["python", "-c", script], env=env))

    def complete():
        j = batch.read_namespaced_job("ok", namespace)
        return j if any(c.type == "Complete" and c.status == "True" for c in j.status.conditions or []) else None

    wait_for("Job Complete", complete)
    [pod] = pods(api, namespace, "job-name=ok")
    assert pod.status.phase == "Succeeded"
    term = pod.status.container_statuses[0].state.terminated
    assert term.exit_code == 0
    got = json.loads(term.message)
    assert got["TOKEN"] == "s3cr3t" and got["MODE"] == "fast" and got["ME"] == pod.metadata.name
    assert got["POD_IP"] == pod.status.pod_ip and pod.status.pod_ip.startswith("127.")
    assert "working" in cluster.pod_logs(namespace, pod.metadata.name, "main")


def test_volume_over_the_checkouts_own_path_leaves_the_interpreter_alone(cluster, gpu_pool, namespace):
    """A pod mounting a volume at the top folder of this interpreter's path (/work, /tmp, /root...)
    still runs: mount paths are rewritten in what the container supplies, not in the local
    interpreter the runner adds."""
    gpu_pool("t4-mount", "t4")
    top = "/" + Path(sys.executable).parts[1]
    body = job("mounted", ["python", "-c", f"open('{top}/proof.txt', 'w').write('ok'); print(open('{top}/proof.txt').read())"])
    spec = body["spec"]["template"]["spec"]
    spec["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    spec["containers"][0]["volumeMounts"] = [{"name": "scratch", "mountPath": top}]
    batch = client.BatchV1Api(cluster.api_client())
    batch.create_namespaced_job(namespace, body)

    def complete():
        j = batch.read_namespaced_job("mounted", namespace)
        return j if any(c.type == "Complete" and c.status == "True" for c in j.status.conditions or []) else None

    wait_for("Job Complete", complete)


def test_failing_job_reports_exit_code_and_message(cluster, gpu_pool, namespace):
    gpu_pool("t4-fail", "t4")
    script = ("import os, sys; open(os.environ['FEWERBITS_TERMINATION_LOG'], 'w')"
              ".write('calibration data missing'); sys.exit(3)")
    batch = client.BatchV1Api(cluster.api_client())
    api = client.CoreV1Api(cluster.api_client())
    batch.create_namespaced_job(namespace, job("bad", ["python", "-c", script]))

    def failed():
        j = batch.read_namespaced_job("bad", namespace)
        return j if any(c.type == "Failed" and c.status == "True" for c in j.status.conditions or []) else None

    wait_for("Job Failed", failed)
    [pod] = pods(api, namespace, "job-name=bad")
    assert pod.status.phase == "Failed"
    term = pod.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason, term.message) == (3, "Error", "calibration data missing")


def test_init_container_output_reaches_main_container_through_empty_dir(cluster, gpu_pool, namespace):
    gpu_pool("l4-init", "l4")
    api = client.CoreV1Api(cluster.api_client())
    pod = {
        "metadata": {"name": "init"},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [{"name": "models", "emptyDir": {}}],
            "initContainers": [{"name": "fetch", "image": PY, "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                                "command": ["python", "-c", "open('/models/weights.txt','w').write('w8')"]}],
            "containers": [{"name": "main", "image": PY, "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                            "command": ["python", "-c",
                                        "import os; open(os.environ['FEWERBITS_TERMINATION_LOG'],'w')"
                                        ".write(open('/models/weights.txt').read())"]}],
        },
    }
    api.create_namespaced_pod(namespace, pod)
    done = wait_for("pod Succeeded", lambda: (p := api.read_namespaced_pod("init", namespace)).status.phase
                    in ("Succeeded", "Failed") and p)
    assert done.status.phase == "Succeeded", done.status
    assert done.status.init_container_statuses[0].state.terminated.exit_code == 0
    assert done.status.container_statuses[0].state.terminated.message == "w8"


def test_deleting_owner_garbage_collects_children_and_stops_processes(cluster, gpu_pool, namespace):
    gpu_pool("a100-gc", "a100")
    apps = client.AppsV1Api(cluster.api_client())
    api = client.CoreV1Api(cluster.api_client())
    apps.create_namespaced_deployment(namespace, deployment(
        "sleeper", PY, replicas=2, gpus=1, node_selector={"nvidia.com/gpu.family": "ampere"},
        command=["python", "-c", "import time; time.sleep(3600)"]))
    running = wait_for("2 pods Ready", lambda: (ps := pods(api, namespace, "app=sleeper")) and len(ps) == 2 and all(
        p.status.phase == "Running" and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        for p in ps) and ps)
    pids = [int(p.status.container_statuses[0].container_id.rsplit("/", 1)[1]) for p in running]
    assert all(pid_alive(pid) for pid in pids)
    assert apps.list_namespaced_replica_set(namespace).items

    apps.delete_namespaced_deployment("sleeper", namespace, propagation_policy="Background")
    wait_for("ReplicaSet collected", lambda: not apps.list_namespaced_replica_set(namespace).items)
    wait_for("pods collected", lambda: not pods(api, namespace, "app=sleeper"))
    wait_for("processes stopped", lambda: not any(pid_alive(pid) for pid in pids), timeout=20)


def test_unprivileged_service_account_is_denied_by_rbac(cluster, namespace):
    api = client.CoreV1Api(cluster.api_client())
    api.create_namespaced_service_account(namespace, {"metadata": {"name": "nobody"}})
    token = api.create_namespaced_service_account_token(
        "nobody", namespace, {"spec": {"expirationSeconds": 600}}).status.token
    as_sa = client.CoreV1Api(cluster.api_client_for_token(token))
    with pytest.raises(ApiException) as err:
        as_sa.list_namespaced_secret(namespace)
    assert err.value.status == 403
    assert f"system:serviceaccount:{namespace}:nobody" in err.value.body

    review = client.AuthorizationV1Api(cluster.api_client()).create_subject_access_review({
        "spec": {"user": f"system:serviceaccount:{namespace}:nobody",
                 "resourceAttributes": {"namespace": namespace, "verb": "list", "resource": "secrets"}}})
    assert review.status.allowed is False

    # ...and a Role grant is honoured, so the denial above is RBAC, not a broken token.
    rbac = client.RbacAuthorizationV1Api(cluster.api_client())
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "read-secrets"}, "rules": [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "nobody-reads"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-secrets"},
        "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": namespace}]})
    wait_for("RBAC grant visible", lambda: _can_list(as_sa, namespace), timeout=10)


def test_pod_process_talks_to_the_api_as_its_service_account(cluster, gpu_pool, namespace):
    gpu_pool("t4-sa", "t4")
    api = client.CoreV1Api(cluster.api_client())
    rbac = client.RbacAuthorizationV1Api(cluster.api_client())
    api.create_namespaced_service_account(namespace, {"metadata": {"name": "cm-reader"}})
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "cm-read"}, "rules": [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "cm-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-read"},
        "subjects": [{"kind": "ServiceAccount", "name": "cm-reader", "namespace": namespace}]})
    script = (
        "import os, json\n"
        "from kubernetes import client, config\n"
        "from kubernetes.client.exceptions import ApiException\n"
        "config.load_kube_config()\n"
        "api = client.CoreV1Api(); ns = os.environ['POD_NAMESPACE']; out = {}\n"
        "out['configmaps'] = len(api.list_namespaced_config_map(ns).items) >= 0\n"
        "try:\n    api.list_namespaced_secret(ns); out['secrets'] = 'allowed'\n"
        "except ApiException as e:\n    out['secrets'] = e.status\n"
        "open(os.environ['FEWERBITS_TERMINATION_LOG'], 'w').write(json.dumps(out))\n")
    api.create_namespaced_pod(namespace, {"metadata": {"name": "as-sa"}, "spec": {
        "serviceAccountName": "cm-reader", "restartPolicy": "Never",
        "containers": [{"name": "main", "image": PY, "command": ["python", "-c", script]}]}})
    done = wait_for("pod finished", lambda: (p := api.read_namespaced_pod("as-sa", namespace)).status.phase
                    in ("Succeeded", "Failed") and p)
    term = done.status.container_statuses[0].state.terminated
    assert term.exit_code == 0, cluster.pod_logs(namespace, "as-sa")
    assert json.loads(term.message) == {"configmaps": True, "secrets": 403}


def _can_list(api, ns):
    try:
        api.list_namespaced_secret(ns)
        return True
    except ApiException:
        return False


def test_privileged_pod_rejected_in_restricted_namespace(cluster):
    api = client.CoreV1Api(cluster.api_client())
    ns = f"restricted-{uuid.uuid4().hex[:6]}"
    api.create_namespace({"metadata": {"name": ns, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    try:
        with pytest.raises(ApiException) as err:
            api.create_namespaced_pod(ns, {"metadata": {"name": "priv"}, "spec": {"containers": [
                {"name": "c", "image": KWOK_IMAGE, "securityContext": {"privileged": True}}]}})
        assert err.value.status == 403
        assert "violates PodSecurity" in err.value.body and "privileged" in err.value.body
    finally:
        api.delete_namespace(ns)


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_vllm_pod_serves_simulator_at_pod_ip_with_runtime_metrics(cluster, gpu_pool, namespace):
    gpu_pool("l4-sim", "NVIDIA-L4")
    apps = client.AppsV1Api(cluster.api_client())
    api = client.CoreV1Api(cluster.api_client())
    apps.create_namespaced_deployment(namespace, deployment(
        "vllm", "vllm/vllm-openai:v0.11.0", gpus=1, node_selector={"nvidia.com/gpu.product": "NVIDIA-L4"},
        args=["--model", "/models/abc", "--served-model-name", "tiny-fp8", "--port", "8000",
              "--max-model-len", "4096", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8"], ports=[8000]))
    wait_for("Deployment available", lambda: (apps.read_namespaced_deployment("vllm", namespace).status.ready_replicas
                                              or 0) == 1, timeout=90)
    [pod] = pods(api, namespace, "app=vllm")
    ip = pod.status.pod_ip
    models = json.loads(_get(f"http://{ip}:8000/v1/models"))
    assert [m["id"] for m in models["data"]] == ["tiny-fp8"]
    assert "vllm:kv_cache_usage_perc" in _get(f"http://{ip}:8000/metrics")

    req = urllib.request.Request(f"http://{ip}:8000/admin/config", method="POST",
                                 data=json.dumps({"fake-metrics": {"kv-cache-usage": 0.83, "waiting-requests": 7,
                                                                   "running-requests": 4}}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200

    def metric(text, name):
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return None

    wait_for("fake metrics applied", lambda: metric(_get(f"http://{ip}:8000/metrics"), "vllm:kv_cache_usage_perc") == 0.83,
             timeout=15)
    text = _get(f"http://{ip}:8000/metrics")
    assert metric(text, "vllm:num_requests_waiting") == 7
    assert metric(text, "vllm:num_requests_running") == 4


def test_helm_installs_a_chart_that_checks_kube_version(cluster, namespace, tmp_path):
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    # kubeVersion fails to install when /version says v0.0.0 (no version ldflags in the build).
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\nkubeVersion: '>=1.36.0-0'\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: probe}\ndata: {kube: '{{ .Capabilities.KubeVersion.Version }}'}\n")
    cluster.helm("install", "probe", str(chart), "--namespace", namespace, "--wait", "--timeout", "60s")
    cm = client.CoreV1Api(cluster.api_client()).read_namespaced_config_map("probe", namespace)
    assert cm.data["kube"].startswith("v1.36.")


def test_quantjob_image_runs_the_real_quantjob_module(cluster, gpu_pool, namespace):
    """The image map sends fewerbits-quantjob pods to `python -m fewerbits_quantjob`; with no contract
    it must fail and say why in its termination message (the Job's summary)."""
    gpu_pool("h100-qj", "h100")
    batch = client.BatchV1Api(cluster.api_client())
    api = client.CoreV1Api(cluster.api_client())
    batch.create_namespaced_job(namespace, {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "qj"},
        "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [{
            "name": "quantize", "image": "ghcr.io/fewerbits/fewerbits-quantjob:0.1.0",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}})
    wait_for("quantjob pod finished", lambda: [p for p in pods(api, namespace, "job-name=qj")
                                               if p.status.phase in ("Succeeded", "Failed")], timeout=120)
    [pod] = pods(api, namespace, "job-name=qj")
    term = pod.status.container_statuses[0].state.terminated
    assert pod.status.phase == "Failed" and term.exit_code != 0
    summary = json.loads(term.message)
    assert summary["result"] == "failed" and "contract" in summary["message"]
    assert "fewerbits-quantjob" in cluster.pod_logs(namespace, pod.metadata.name, "quantize")


def test_missing_secret_holds_the_container_until_it_exists(cluster, gpu_pool, namespace):
    gpu_pool("l4-cfg", "l4")
    api = client.CoreV1Api(cluster.api_client())
    script = "import os; open(os.environ['FEWERBITS_TERMINATION_LOG'], 'w').write(os.environ['KEY'])"
    api.create_namespaced_pod(namespace, {"metadata": {"name": "waits"}, "spec": {
        "restartPolicy": "Never", "containers": [{
            "name": "main", "image": PY, "command": ["python", "-c", script],
            "env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "later", "key": "k"}}}]}]}})

    def waiting_reason():
        st = api.read_namespaced_pod("waits", namespace).status.container_statuses or []
        return st and st[0].state.waiting and st[0].state.waiting.reason

    assert wait_for("CreateContainerConfigError", lambda: waiting_reason() == "CreateContainerConfigError")
    api.create_namespaced_secret(namespace, {"metadata": {"name": "later"}, "stringData": {"k": "v1"}})
    done = wait_for("pod Succeeded", lambda: (p := api.read_namespaced_pod("waits", namespace)).status.phase
                    == "Succeeded" and p)
    assert done.status.container_statuses[0].state.terminated.message == "v1"


def test_on_failure_restarts_the_container_in_place(cluster, gpu_pool, namespace):
    gpu_pool("t4-restart", "t4")
    api = client.CoreV1Api(cluster.api_client())
    # Fails on the first run, succeeds on the second: the emptyDir outlives container restarts.
    script = ("import os, sys; f = '/scratch/ran'\n"
              "if not os.path.exists(f):\n    open(f, 'w').close(); sys.exit(1)\n")
    api.create_namespaced_pod(namespace, {"metadata": {"name": "flaky"}, "spec": {
        "restartPolicy": "OnFailure", "volumes": [{"name": "scratch", "emptyDir": {}}],
        "containers": [{"name": "main", "image": PY, "command": ["python", "-c", script],
                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}]}})
    done = wait_for("pod Succeeded after a restart", lambda: (p := api.read_namespaced_pod("flaky", namespace))
                    .status.phase == "Succeeded" and p, timeout=30)
    st = done.status.container_statuses[0]
    assert st.restart_count == 1 and st.last_state.terminated.exit_code == 1

