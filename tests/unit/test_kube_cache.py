"""The watched caches in kube.py: what counts as a change, re-lists, the watch loop, the getters."""

from __future__ import annotations

import json
import threading
from unittest import mock

from fewerbits_operator.informer import TTLCache, WatchCache, node_facts, node_relevant, policy_relevant
from fewerbits_operator.kube import Kube


def node(name: str, rv: str, *, product: str = "NVIDIA-H100-80GB-HBM3", gpus: str = "8",
         heartbeat: str = "t0", unschedulable: bool = False, extra_labels: dict | None = None) -> dict:
    return {
        "metadata": {"name": name, "resourceVersion": rv, "labels": {
            "nvidia.com/gpu.product": product, "nvidia.com/gpu.count": gpus, **(extra_labels or {})},
            "annotations": {"kwok.x-k8s.io/node": "fake"}, "managedFields": [{"big": "x" * 100}]},
        "spec": {"unschedulable": unschedulable, "taints": [{"key": "node.kubernetes.io/not-ready"}]},
        "status": {"allocatable": {"nvidia.com/gpu": gpus, "cpu": "32"}, "capacity": {"nvidia.com/gpu": gpus},
                   "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": heartbeat}],
                   "images": [{"names": ["x"]}]},
    }


def node_cache() -> tuple[WatchCache, list]:
    changes: list = []
    cache = WatchCache("nodes", mock.MagicMock(), relevant=node_relevant, slim=node_facts,
                       on_change=lambda old, new: changes.append((old and old["metadata"]["name"],
                                                                  new and new["metadata"]["name"])))
    return cache, changes


def test_the_first_list_fills_the_cache_and_reports_nothing():
    cache, changes = node_cache()
    assert not cache.synced.is_set()
    cache.replace([node("a", "1"), node("b", "2")], "10")
    assert cache.synced.is_set() and changes == []
    items = sorted(cache.items(), key=lambda n: n["metadata"]["name"])
    assert [n["metadata"]["name"] for n in items] == ["a", "b"]
    # only what the planner reads is kept
    assert set(items[0]["status"]) == {"allocatable"} and "managedFields" not in items[0]["metadata"]


def test_heartbeats_and_status_only_updates_are_not_changes():
    cache, changes = node_cache()
    cache.replace([node("a", "1")], "10")
    assert not cache.apply("MODIFIED", node("a", "2", heartbeat="t1"))
    changed_taint = node("a", "3", heartbeat="t2")
    changed_taint["spec"]["taints"] = []
    changed_taint["status"]["images"] = []
    assert not cache.apply("MODIFIED", changed_taint)
    assert not cache.apply("BOOKMARK", {"metadata": {"resourceVersion": "99"}})
    assert changes == []
    assert cache._rv == "99"


def test_gpu_relevant_changes_are_reported():
    cache, changes = node_cache()
    cache.replace([node("a", "1"), node("b", "1")], "10")
    assert cache.apply("MODIFIED", node("a", "2", gpus="4"))                        # allocatable
    assert cache.apply("MODIFIED", node("a", "3", gpus="4", unschedulable=True))    # cordoned
    assert cache.apply("MODIFIED", node("a", "4", gpus="4", unschedulable=True,
                                        extra_labels={"pool": "x"}))                 # a label
    assert cache.apply("ADDED", node("c", "5"))
    assert cache.apply("DELETED", node("b", "6"))
    assert not cache.apply("DELETED", node("zz", "7"))  # never seen: nothing to report
    assert changes == [("a", "a"), ("a", "a"), ("a", "a"), (None, "c"), ("b", None)]
    assert sorted(n["metadata"]["name"] for n in cache.items()) == ["a", "c"]


def test_a_relist_reports_what_changed_while_disconnected():
    cache, changes = node_cache()
    cache.replace([node("a", "1"), node("b", "1"), node("c", "1")], "10")
    cache.replace([node("a", "5", heartbeat="later"), node("b", "5", gpus="2"), node("d", "5")], "20")
    assert sorted(changes, key=str) == sorted([("b", "b"), ("c", None), (None, "d")], key=str)


def test_items_are_copies():
    cache, _ = node_cache()
    cache.replace([node("a", "1")], "10")
    cache.items()[0]["metadata"]["labels"].clear()
    assert cache.items()[0]["metadata"]["labels"]


def test_policy_changes_are_spec_changes():
    changes: list = []
    cache = WatchCache("policies", mock.MagicMock(), relevant=policy_relevant, on_change=lambda o, n: changes.append(1))
    p = {"metadata": {"name": "p", "resourceVersion": "1"}, "spec": {"priority": 1}}
    cache.replace([p], "1")
    assert not cache.apply("MODIFIED", {**p, "metadata": {"name": "p", "resourceVersion": "2", "annotations": {"x": "y"}}})
    assert cache.apply("MODIFIED", {**p, "spec": {"priority": 2}})
    assert changes == [1]


def test_a_failing_change_handler_does_not_stop_the_cache():
    def boom(old, new):
        raise RuntimeError("handler bug")
    cache = WatchCache("nodes", mock.MagicMock(), relevant=node_relevant, slim=node_facts, on_change=boom)
    cache.replace([], "1")
    assert cache.apply("ADDED", node("a", "2"))
    assert len(cache.items()) == 1


class FakeResp:
    def __init__(self, data: bytes = b"", lines: list[dict] | None = None):
        self.data = data
        self._lines = [json.dumps(x).encode() + b"\n" for x in lines or []]
        self.closed = False

    def stream(self, *a, **k):
        yield from self._lines

    def read_chunked(self, *a, **k):
        yield from self._lines

    def close(self):
        self.closed = True

    def release_conn(self):
        pass


def test_the_loop_lists_watches_from_the_list_version_and_relists_on_410():
    stop = threading.Event()
    calls: list[dict] = []
    lists = [
        {"metadata": {"resourceVersion": "10"}, "items": [node("a", "1")]},
        {"metadata": {"resourceVersion": "30"}, "items": [node("a", "1"), node("b", "29")]},
    ]
    watches = [
        [{"type": "ADDED", "object": node("c", "11")}, {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}}],
        [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}],
        [],
    ]

    def list_fn(**kwargs):
        calls.append(kwargs)
        if kwargs.get("watch"):
            if len(watches) == 1:
                stop.set()
            return FakeResp(lines=watches.pop(0))
        return FakeResp(data=json.dumps(lists.pop(0)).encode())

    changes: list = []
    cache = WatchCache("nodes", list_fn, relevant=node_relevant, slim=node_facts,
                       on_change=lambda o, n: changes.append((o and o["metadata"]["name"], n and n["metadata"]["name"])))
    cache.run(stop)
    kinds = [("watch", c["resource_version"]) if c.get("watch") else ("list", None) for c in calls]
    assert kinds == [("list", None), ("watch", "10"), ("watch", "15"), ("list", None), ("watch", "30")]
    assert all(c.get("allow_watch_bookmarks") for c in calls if c.get("watch"))
    # c came by the watch, b by the re-list, and c went (absent from the re-list)
    assert changes[0] == (None, "c") and sorted(changes[1:], key=str) == sorted([(None, "b"), ("c", None)], key=str)
    assert sorted(n["metadata"]["name"] for n in cache.items()) == ["a", "b"]


def test_getters_read_live_until_synced_then_from_the_cache():
    k = Kube(api=mock.MagicMock())
    k.core, k.custom = mock.MagicMock(), mock.MagicMock()
    k.core.list_node.return_value = mock.MagicMock(items=[node("live", "1")])
    k.api.sanitize_for_serialization.side_effect = lambda n: n
    k.custom.list_cluster_custom_object.return_value = {"items": [{"metadata": {"name": "live-p"}}]}
    assert [n["metadata"]["name"] for n in k.list_nodes()] == ["live"]
    assert [p["metadata"]["name"] for p in k.list_policies()] == ["live-p"]
    k.nodes = WatchCache("nodes", mock.MagicMock(), relevant=node_relevant, slim=node_facts)
    k.policies = WatchCache("policies", mock.MagicMock(), relevant=policy_relevant)
    assert [n["metadata"]["name"] for n in k.list_nodes()] == ["live"]  # not synced yet
    k.nodes.replace([node("cached", "2")], "2")
    k.policies.replace([], "2")
    k.core.list_node.reset_mock()
    k.custom.list_cluster_custom_object.reset_mock()
    assert [n["metadata"]["name"] for n in k.list_nodes()] == ["cached"]
    assert k.list_policies() == []
    assert not k.core.list_node.called and not k.custom.list_cluster_custom_object.called


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
