"""What kopf's indexes hold and what counts as a change (relevance.py, indexes.py), and the TTL
cache of namespace labels. kopf's own ``OperatorIndexer`` stands for the index kopf fills."""

from __future__ import annotations

from kopf._core.engines.indexing import OperatorIndexer

from fewerbits_operator.base.indexes import IndexView, node_entry, pod_entry
from fewerbits_operator.base.relevance import RelevanceFilter, node_relevant, policy_relevant
from fewerbits_operator.base.ttlcache import TTLCache


def node(name: str, rv: str, *, product: str = "NVIDIA-H100-80GB-HBM3", gpus: str = "8",
         heartbeat: str = "t0", unschedulable: bool = False, extra_labels: dict | None = None) -> dict:
    return {
        "metadata": {"name": name, "uid": name, "resourceVersion": rv, "labels": {
            "nvidia.com/gpu.product": product, "nvidia.com/gpu.count": gpus, **(extra_labels or {})},
            "annotations": {"kwok.x-k8s.io/node": "fake"}, "managedFields": [{"big": "x" * 100}]},
        "spec": {"unschedulable": unschedulable, "taints": [{"key": "node.kubernetes.io/not-ready"}]},
        "status": {"allocatable": {"nvidia.com/gpu": gpus, "cpu": "32"}, "capacity": {"nvidia.com/gpu": gpus},
                   "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": heartbeat}],
                   "images": [{"names": ["x"]}]},
    }



def test_the_node_index_keeps_only_what_the_planner_reads():
    indexer, view = OperatorIndexer(), IndexView("nodes")
    view.attach(indexer.index)
    for n in (node("a", "1"), node("b", "2")):
        indexer.replace((None, n["metadata"]["name"], n["metadata"]["uid"]), node_entry(n))
    view.mark_synced()
    items = sorted(view.items(), key=lambda n: n["metadata"]["name"])
    assert [n["metadata"]["name"] for n in items] == ["a", "b"]
    assert set(items[0]["status"]) == {"allocatable"} and "managedFields" not in items[0]["metadata"]
    assert set(items[0]["metadata"]) == {"name", "labels", "resourceVersion"}


def served_pod(name: str, *, ready: bool = True, created: str = "2026-11-26T10:00:00Z") -> dict:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": "7",
                     "creationTimestamp": created, "generateName": "m-",
                     "labels": {"fewerbits.io/model": "m", "fewerbits.io/variant": "h100"},
                     "annotations": {"big": "x" * 1000}, "managedFields": [{"big": "x" * 1000}]},
        "spec": {"nodeName": "gpu-1", "volumes": [{"name": "v", "emptyDir": {}}],
                 "containers": [{"name": "vllm", "args": ["--model", "/models/m"] * 50,
                                 "env": [{"name": "E", "value": "x" * 500}],
                                 "ports": [{"name": "http", "containerPort": 8123}]}]},
        "status": {"phase": "Running", "podIP": "10.0.0.9",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                   "lastTransitionTime": "2026-11-26T10:01:00Z"}],
                   "containerStatuses": [{"name": "vllm", "ready": ready, "state": {"running": {}},
                                          "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                                                        "message": "ValueError: bad flag"}}}]},
    }


def test_the_pod_index_keeps_what_the_loops_read_and_they_read_the_same():
    """A slim pod gives every reader of Kube.list_pods the answer the whole pod gives, at a
    fraction of its size (the pods index holds one per serving pod, 300 models over)."""
    import json

    from fewerbits_operator.autoscaler.loop import classify_pods, http_port
    from fewerbits_operator.base.terminations import terminations
    from fewerbits_operator.runtime.atzero import last_ready_at, ready_serving_pods

    full = [served_pod("a"), served_pod("b", ready=False, created="2026-11-26T10:05:00Z")]
    indexer, view = OperatorIndexer(), IndexView("pods")
    view.attach(indexer.index)
    for p in full:
        indexer.replace(("ns", p["metadata"]["name"], p["metadata"]["uid"]), pod_entry(p))
    view.mark_synced()
    slim = sorted(view.items("ns"), key=lambda p: p["metadata"]["name"])
    assert [p["metadata"]["name"] for p in slim] == ["a", "b"]
    assert "managedFields" not in slim[0]["metadata"] and "annotations" not in slim[0]["metadata"]
    assert slim[0]["spec"]["containers"] == [{"name": "vllm", "ports": [{"name": "http", "containerPort": 8123}]}]
    assert len(json.dumps(slim[0])) * 4 < len(json.dumps(full[0]))
    for reader in (lambda ps: classify_pods("ns", ps), terminations, last_ready_at, ready_serving_pods,
                   lambda ps: [http_port(p) for p in ps]):
        assert reader(slim) == reader(full)


def test_heartbeats_and_status_only_updates_are_not_changes():
    f = RelevanceFilter(node_relevant)
    assert f.observe(None, node("a", "1")) == (None, node_relevant(node("a", "1")))  # listed: new
    assert f.observe("MODIFIED", node("a", "2", heartbeat="t1")) is None
    changed_taint = node("a", "3", heartbeat="t2")
    changed_taint["spec"]["taints"] = []
    changed_taint["status"]["images"] = []
    assert f.observe("MODIFIED", changed_taint) is None


def test_gpu_relevant_changes_are_reported():
    f = RelevanceFilter(node_relevant)
    f.observe(None, node("a", "1"))
    f.observe(None, node("b", "1"))
    assert f.observe("MODIFIED", node("a", "2", gpus="4"))                        # allocatable
    assert f.observe("MODIFIED", node("a", "3", gpus="4", unschedulable=True))    # cordoned
    assert f.observe("MODIFIED", node("a", "4", gpus="4", unschedulable=True,
                                      extra_labels={"pool": "x"}))                 # a label
    assert f.observe("ADDED", node("c", "5"))[0] is None
    assert f.observe("DELETED", node("b", "6"))[1] is None
    assert f.observe("DELETED", node("zz", "7")) is None  # never seen: nothing to report


def test_a_relist_reports_only_what_changed_while_disconnected():
    f = RelevanceFilter(node_relevant)
    for n in (node("a", "1"), node("b", "1")):
        f.observe(None, n)
    assert f.observe(None, node("a", "5", heartbeat="later")) is None  # kopf's re-list: same facts
    assert f.observe(None, node("b", "5", gpus="2")) is not None


def test_policy_changes_are_spec_changes():
    f = RelevanceFilter(policy_relevant)
    p = {"metadata": {"name": "p", "resourceVersion": "1"}, "spec": {"priority": 1}}
    f.observe(None, p)
    assert f.observe("MODIFIED", {**p, "metadata": {"name": "p", "resourceVersion": "2", "annotations": {"x": "y"}}}) is None
    assert f.observe("MODIFIED", {**p, "spec": {"priority": 2}}) is not None
    empty = RelevanceFilter(policy_relevant)  # a projection that is None is still a projection
    assert empty.observe(None, {"metadata": {"name": "q"}}) == (None, None)
    assert empty.observe("MODIFIED", {"metadata": {"name": "q"}}) is None


def test_namespace_labels_are_kept_for_the_ttl():
    now = [0.0]
    cache = TTLCache(30, clock=lambda: now[0])
    loads = []

    def load():
        loads.append(1)
        return {"team": "a"}

    assert cache.get("ns", load) == {"team": "a"}
    cache.get("ns", load)["team"] = "changed by the caller"
    assert cache.get("ns", load) == {"team": "a"} and len(loads) == 1
    now[0] = 31
    cache.get("ns", load)
    assert len(loads) == 2
    assert TTLCache(0).get("x", load) == {"team": "a"} and len(loads) == 3


def _model_pod(name: str, model: str, rv: str) -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "uid": name, "resourceVersion": rv,
                         "labels": {"fewerbits.io/model": model, "app.kubernetes.io/component": "server"}},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


class _LiveLists:
    """What Kube asks the API server (counted): the cached reads must not come here."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.created_rv = "50"

    def list_namespaced_pod(self, namespace, label_selector):
        self.calls.append(("pods", label_selector))
        return type("L", (), {"items": []})()

    def list_namespaced_endpoint_slice(self, namespace, label_selector):
        self.calls.append(("endpointslices", label_selector))
        return type("L", (), {"items": []})()

    def create_namespaced_endpoint_slice(self, namespace, body):
        return {**body, "metadata": {**body["metadata"], "resourceVersion": self.created_rv}}


def test_the_loops_read_pods_and_activator_slices_from_the_caches_not_the_api_server():
    """Kube.list_pods and list_endpoint_slices (atzero.ZeroRouter, metricsprobe, the keep-awake):
    from kopf's indexes (handlers.INDEXED) for what they hold; a LIST for what they cannot (a Job's
    pods), and for a namespace where a slice of ours is newer than the cache (read-your-writes)."""
    from kubernetes import client

    from fewerbits_operator.base.indexes import index_entry
    from fewerbits_operator.base.kube import Kube

    kube = Kube(client.ApiClient())
    live = kube.core = kube.discovery = _LiveLists()
    pods, slices = (OperatorIndexer(), IndexView("pods")), (OperatorIndexer(), IndexView("endpointslices"))
    for indexer, view in (pods, slices):
        view.attach(indexer.index)
        view.mark_synced()
    kube.pods, kube.slices = pods[1], slices[1]
    for p in (_model_pod("a-1", "a", "3"), _model_pod("b-1", "b", "4")):
        pods[0].replace(("ns", p["metadata"]["name"], p["metadata"]["uid"]), index_entry(p))
    assert [p["metadata"]["name"] for p in kube.list_pods("ns", "fewerbits.io/model=a,app.kubernetes.io/component=server")] \
        == ["a-1"]
    kube.list_pods("ns", "job-name=quantize-x")  # not a model's pod: the cache cannot answer
    ours = "endpointslice.kubernetes.io/managed-by=activator.fewerbits.io"
    assert kube.list_endpoint_slices("ns", ours) == []
    assert live.calls == [("pods", "job-name=quantize-x")]
    body = {"metadata": {"name": "a-activator-8082", "namespace": "ns", "uid": "s1",
                         "labels": {"endpointslice.kubernetes.io/managed-by": "activator.fewerbits.io"}}}
    kube.create_endpoint_slice(body)
    kube.list_endpoint_slices("ns", ours)  # the cache is behind our write: live
    assert live.calls[-1] == ("endpointslices", ours)
    slices[0].replace(("ns", "a-activator-8082", "s1"), index_entry({**body, "metadata": {
        **body["metadata"], "resourceVersion": "50"}}))
    n = len(live.calls)
    assert [s["metadata"]["name"] for s in kube.list_endpoint_slices("ns", ours)] == ["a-activator-8082"]
    assert len(live.calls) == n  # caught up: from the cache again
