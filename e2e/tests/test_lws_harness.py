"""LeaderWorkerSet on the local control plane (e2e/addons/lws.py): a set of 2 groups x 2 pods
becomes ready, scales through its scale subresource, and recreates a group when a worker is
deleted. kwok plays the kubelet for these pods (their image is not one the pod runner owns)."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.addons.lws import fail_worker
from e2e.tests.test_harness import wait_for

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
KWOK_IMAGE = "registry.example/app:1"


def test_lws_groups_ready_scale_and_recreate(cluster, lws, gpu_pool, namespace):
    print(f"LeaderWorkerSet add-on start: {', '.join(f'{k} {v:.1f}s' for k, v in lws.timings.items())}")
    nodes = gpu_pool("lwsh", "NVIDIA-H100-80GB-HBM3", nodes=3)
    api = cluster.api_client()
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    template = {"metadata": {"labels": {"app": "h"}}, "spec": {
        "terminationGracePeriodSeconds": 0,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}]}}},
        "containers": [{"name": "main", "image": KWOK_IMAGE,
                        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "LeaderWorkerSet", "metadata": {"name": "h"},
        "spec": {"replicas": 2, "leaderWorkerTemplate": {
            "size": 2, "restartPolicy": "RecreateGroupOnPodRestart", "workerTemplate": template}}})

    def ready(n):
        def check():
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "h")
            st = obj.get("status") or {}
            running = [p for p in core.list_namespaced_pod(namespace, label_selector="app=h").items
                       if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
            return (st.get("readyReplicas") == n and len(running) == 2 * n) and running
        return check

    pods = wait_for("2 groups ready", ready(2))
    names = sorted(p.metadata.name for p in pods)
    assert names == ["h-0", "h-0-1", "h-1", "h-1-1"]
    # The pod webhook told every pod where its leader is and who it is.
    worker = next(p for p in pods if p.metadata.name == "h-0-1")
    env = {e.name: e.value for e in worker.spec.containers[0].env or []}
    assert env["LWS_LEADER_ADDRESS"].startswith("h-0.h.") and env["LWS_WORKER_INDEX"] == "1"
    assert env["LWS_GROUP_SIZE"] == "2"

    # Scale subresource: groups.
    custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "h", {"spec": {"replicas": 3}})
    assert custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "h")["spec"]["replicas"] == 3
    wait_for("3 groups ready", ready(3))

    # A deleted worker takes its group down and back up (leader recreated too). fail_worker keeps the
    # worker Terminating until LWS has reacted, as a kubelet would (see its docstring for the race).
    leader_uid = core.read_namespaced_pod("h-0", namespace).metadata.uid
    fail_worker(core, namespace, "h-0-1")

    def recreated():
        try:
            leader = core.read_namespaced_pod("h-0", namespace)
        except client.exceptions.ApiException:
            return False
        return leader.metadata.uid != leader_uid and ready(3)()

    wait_for("group 0 recreated and ready", recreated)
