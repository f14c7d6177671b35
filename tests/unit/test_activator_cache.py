"""The activator's watch-fed reads (activator_cache.py, docs/routing.md "What the activator reads,
and when"): at steady state a request makes no API call; a held request is released by the watch's
change signal, not by polling; a namespace whose watches have not listed yet, or whose watch broke,
is read through the API, and every API request is counted by verb and resource; what is deleted
leaves the cache.

Two stand-ins for the API server: ``FakeApi``, the Kube verbs the activator calls with a watch
that replays an event log (every call counted), and, for the real Kube and kubernetes client, a
transport in place of ``ApiClient.request`` (``Transport``)."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import REGISTRY

from fewerbits_operator.base.kube import Kube
from fewerbits_operator.runtime import activator as act_mod
from fewerbits_operator.runtime import activator_cache as cache_mod
from fewerbits_operator.runtime.activator import Activator
from fewerbits_operator.runtime.activator_cache import ActivatorCache, api_call, count_api_calls

NS = "ns"
HOST = {"host": "m.ns.svc.cluster.local:8000"}
READS = {"get_model", "list_pods", "list_deployments"}
"""The Kube verbs a request reads through when its namespace is not cached."""


def model(name: str = "m") -> dict[str, Any]:
    return {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "managedFields": [{"manager": "x"}]},
            "status": {"autoscaling": {"enabled": True, "minReplicas": 0}, "plan": {"variants": [{"pool": "l4"}]}}}


def deployment(replicas: int = 0) -> dict[str, Any]:
    return {"metadata": {"name": "m-l4", "namespace": NS,
                         "labels": {"fewerbits.io/model": "m", "fewerbits.io/variant": "l4"}},
            "spec": {"replicas": replicas, "template": {"spec": {"containers": [{"name": "vllm"}]}}}}


def pod(name: str = "p", ready: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS,
                         "labels": {"fewerbits.io/model": "m", "app.kubernetes.io/component": "server"}},
            "spec": {"containers": [{"name": "vllm", "env": [{"name": "X", "value": "y" * 100}]}]},
            "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": str(ready)}]}}


class FakeApi:
    """The Kube verbs the activator calls, over an in-memory store with an event log: a watch from a
    resourceVersion replays what came after it, then waits for more. Every call is counted."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.rv = 0
        self.log: list[tuple[int, str, str, dict[str, Any]]] = []
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: Counter[str] = Counter()
        self.closed = False
        self.break_watches = False
        self.lists_allowed = threading.Event()
        self.lists_allowed.set()
        self.woken = threading.Event()

    # ---- the store (what a test changes, as the cluster would)

    def put(self, resource: str, obj: dict[str, Any]) -> None:
        self._emit(resource, "MODIFIED" if (resource, obj["metadata"]["name"]) in self.objects else "ADDED", obj)

    def delete(self, resource: str, name: str) -> None:
        self._emit(resource, "DELETED", self.objects[(resource, name)])

    def _emit(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        with self.cond:
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            if kind == "DELETED":
                self.objects.pop((resource, obj["metadata"]["name"]), None)
            else:
                self.objects[(resource, obj["metadata"]["name"])] = obj
            self.log.append((self.rv, resource, kind, obj))
            self.cond.notify_all()

    def _items(self, resource: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (r, _), o in self.objects.items() if r == resource]

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    # ---- the watches' verbs (Kube.list_raw, Kube.watch_raw)

    def list_raw(self, resource: str, namespace: str, selector: str = "") -> tuple[list[dict[str, Any]], str]:
        self.calls[f"list_raw {resource}"] += 1
        assert self.lists_allowed.wait(10)
        with self.cond:
            return self._items(resource), str(self.rv)

    def watch_raw(self, resource: str, namespace: str, selector: str, resource_version: str,
                  timeout_seconds: int) -> Iterator[dict[str, Any]]:
        self.calls[f"watch_raw {resource}"] += 1
        pos = int(resource_version)
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or self.break_watches or self.rv > pos)
                if self.closed:
                    return
                if self.break_watches:
                    raise ApiException(status=500, reason="the watch broke")
                new = [(rv, kind, o) for rv, r, kind, o in self.log if rv > pos and r == resource]
                pos = self.rv
            for _, kind, o in new:
                yield {"type": kind, "object": copy.deepcopy(o)}

    # ---- the per-request verbs (read through when not cached) and the wake

    def get_model(self, ns: str, name: str) -> dict[str, Any] | None:
        self.calls["get_model"] += 1
        with self.cond:
            return copy.deepcopy(self.objects.get(("quantizedmodels", name)))

    def list_pods(self, ns: str, selector: str) -> list[dict[str, Any]]:
        self.calls["list_pods"] += 1
        with self.cond:
            return self._items("pods")

    def list_deployments(self, ns: str, selector: str) -> list[dict[str, Any]]:
        self.calls["list_deployments"] += 1
        with self.cond:
            return self._items("deployments")

    def wake_scale(self, ns: str, name: str) -> bool:
        self.calls["wake_scale"] += 1
        with self.cond:
            dep = self.objects[("deployments", name)]
        if dep["spec"]["replicas"]:
            return False
        self.put("deployments", {**dep, "spec": {**dep["spec"], "replicas": 1}})
        self.woken.set()
        return True

    def post_event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.calls["post_event"] += 1


def echo(method, url, target, body, headers):
    return 200, {"X-Fewerbits-Endpoint": target}, url.encode()


def settle(cache: ActivatorCache, pred: Callable[[], bool], of: str = "m", timeout: float = 10.0) -> None:
    """Wait on the cache's own change signal for model ``of`` (never a sleep) until ``pred`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        seen = cache.version(NS, of)
        if pred():
            return
        left = deadline - time.monotonic()
        assert left > 0 and cache.wait_for_change(NS, of, seen, left), "the cache never got there"


@pytest.fixture
def api():
    fake = FakeApi()
    fake.put("quantizedmodels", model())
    fake.put("deployments", deployment(0))
    yield fake
    fake.close()


@pytest.fixture
def cache(api):
    c = ActivatorCache(api)
    yield c
    c.stop()
    api.close()


def reads(api: FakeApi) -> int:
    return sum(n for k, n in api.calls.items() if k in READS)


def test_a_request_at_steady_state_makes_no_api_call(api, cache):
    api.put("deployments", deployment(1))
    api.put("pods", pod())
    cache.watch_namespace(NS)
    settle(cache, lambda: cache.serves(NS) and len(cache.serving_pods(NS, "m")) == 1)
    act = Activator(api, cache=cache, forward=echo)
    for _ in range(20):
        code, _, body = act.handle("POST", "/v1/completions", HOST, b"{}")
        assert code == 200 and body == b"http://10.0.0.7:8000/v1/completions"
    # Not one GET, LIST or write for 20 requests; the caches' own calls: one LIST (and one WATCH) each.
    assert {k: n for k, n in api.calls.items() if not k.startswith(("list_raw", "watch_raw"))} == {}
    assert {k: n for k, n in api.calls.items() if k.startswith("list_raw")} == {
        "list_raw quantizedmodels": 1, "list_raw pods": 1, "list_raw deployments": 1}


def test_a_made_up_model_is_refused_from_the_cache(api, cache):
    cache.watch_namespace(NS)
    settle(cache, lambda: cache.serves(NS))
    before = reads(api)
    act = Activator(api, cache=cache, forward=echo)
    assert act.handle("POST", "/v1/x", {"host": "nope.ns.svc"}, b"")[0] == 404
    assert reads(api) == before


def test_a_held_request_is_released_by_the_watch_not_by_polling(api, cache, monkeypatch):
    """Polling, the wait and the re-wake all an hour apart: only the watch's signal can release it."""
    monkeypatch.setattr(act_mod, "REWAKE_SECONDS", 3600.0)
    cache.watch_namespace(NS)
    settle(cache, lambda: cache.serves(NS))
    act = Activator(api, cache=cache, forward=echo, timeout=3600.0, poll=3600.0)
    out: list[int] = []
    held = threading.Thread(target=lambda: out.append(act.handle("POST", "/v1/x", HOST, b"{}")[0]), daemon=True)
    held.start()
    assert api.woken.wait(10)  # held, and the model woken (the Deployment read from the cache)
    assert held.is_alive() and out == []
    api.put("pods", pod(ready=False))  # a change of the model's pods: the request looks, and waits on
    api.put("pods", pod(ready=True))
    held.join(10)
    assert not held.is_alive() and out == [200]
    assert reads(api) == 0  # no LIST while held, no GET: the model, pods and Deployments from the cache
    assert api.calls["wake_scale"] == 1 and act.woken == 1


def test_held_requests_wait_on_their_own_model_only(api, cache):
    """A change of another model's objects does not release (nor rescan for) this model's requests."""
    cache.watch_namespace(NS)
    settle(cache, lambda: cache.serves(NS))
    seen = cache.version(NS, "m")
    api.put("quantizedmodels", model("other"))
    other = pod("q")
    other["metadata"]["labels"]["fewerbits.io/model"] = "other"
    api.put("pods", other)
    settle(cache, lambda: bool(cache.serving_pods(NS, "other")) and cache.model(NS, "other") is not None, of="other")
    assert cache.version(NS, "m") == seen and not cache.wait_for_change(NS, "m", seen, 0)
    assert cache.serving_pods(NS, "m") == []


def test_not_synced_yet_reads_through_the_api_then_from_the_cache(api, cache):
    api.lists_allowed.clear()  # start-up: the watches' first LIST has not answered
    api.put("deployments", deployment(1))
    api.put("pods", pod())
    cache.watch_namespace(NS)
    act = Activator(api, cache=cache, forward=echo)
    assert not cache.serves(NS)
    assert act.handle("POST", "/v1/x", HOST, b"")[0] == 200
    assert api.calls["get_model"] == 1 and api.calls["list_pods"] == 1  # read through, as before
    api.lists_allowed.set()
    settle(cache, lambda: cache.serves(NS))
    before = reads(api)
    assert act.handle("POST", "/v1/x", HOST, b"")[0] == 200
    assert reads(api) == before


def test_a_broken_watch_reads_through_the_api_until_it_lists_again(api, cache, monkeypatch):
    monkeypatch.setattr(cache_mod, "FIRST_BACKOFF_SECONDS", 0.01)
    api.put("deployments", deployment(1))
    api.put("pods", pod())
    cache.watch_namespace(NS)
    settle(cache, lambda: cache.serves(NS))
    api.lists_allowed.clear()  # the relist after the break waits until the test lets it
    with api.cond:
        api.break_watches = True
        api.cond.notify_all()
    settle(cache, lambda: not cache.serves(NS))
    act = Activator(api, cache=cache, forward=echo)
    before = reads(api)
    assert act.handle("POST", "/v1/x", HOST, b"")[0] == 200
    assert reads(api) == before + 2  # GET the model, LIST its pods
    with api.cond:
        api.break_watches = False
    api.lists_allowed.set()
    settle(cache, lambda: cache.serves(NS))
    before = reads(api)
    assert act.handle("POST", "/v1/x", HOST, b"")[0] == 200
    assert reads(api) == before


def test_what_is_deleted_leaves_the_cache(api, cache):
    api.put("pods", pod())
    cache.watch_namespace(NS)
    settle(cache, lambda: cache.serves(NS) and len(cache.serving_pods(NS, "m")) == 1)
    assert "managedFields" not in cache.model(NS, "m")["metadata"]  # held slim
    assert set(cache.serving_pods(NS, "m")[0]) == {"metadata", "status"}  # the pod's spec is not held
    api.delete("pods", "p")
    settle(cache, lambda: cache.serving_pods(NS, "m") == [])
    api.delete("quantizedmodels", "m")
    settle(cache, lambda: cache.model(NS, "m") is None)
    act = Activator(api, cache=cache, forward=echo)
    before = reads(api)
    assert act.handle("POST", "/v1/x", HOST, b"")[0] == 404  # gone: the same 404 as any unknown model
    assert reads(api) == before


def test_a_namespace_is_watched_once_a_model_is_found_there(api, cache):
    act = Activator(api, cache=cache, forward=echo)
    assert act.handle("POST", "/v1/x", {"host": "nope.ns.svc"}, b"")[0] == 404
    assert not cache.watching(NS)  # a made-up name starts nothing
    api.put("deployments", deployment(1))
    api.put("pods", pod())
    assert act.handle("POST", "/v1/x", HOST, b"")[0] == 200
    assert cache.watching(NS)
    settle(cache, lambda: cache.serves(NS))


def test_namespaces_watched_are_bounded(api):
    c = ActivatorCache(api, max_namespaces=1)
    try:
        assert c.watch_namespace("a") and c.watch_namespace("a") and not c.watch_namespace("b")
        assert not c.serves("b")
    finally:
        c.stop()


# ------------------------------------------------------------------ counting, through the real Kube


@pytest.mark.parametrize("method, url, query, want", [
    ("GET", "https://k/apis/fewerbits.io/v1alpha1/namespaces/ns/quantizedmodels/m", [], ("get", "quantizedmodels")),
    ("GET", "https://k/api/v1/namespaces/ns/pods", [("labelSelector", "a=b")], ("list", "pods")),
    ("GET", "https://k/api/v1/namespaces/ns/pods", [("watch", True)], ("watch", "pods")),
    ("GET", "https://k/apis/apps/v1/namespaces/ns/deployments/d/scale", [], ("get", "deployments/scale")),
    ("PUT", "https://k/apis/apps/v1/namespaces/ns/deployments/d/scale", [], ("update", "deployments/scale")),
    ("POST", "https://k/api/v1/namespaces/ns/events", [], ("create", "events")),
    ("GET", "https://k/apis/gateway.networking.k8s.io/v1/namespaces/ns/httproutes/r", [], ("get", "httproutes")),
    ("GET", "https://k/api/v1/namespaces/ns", [], ("get", "namespaces")),
    ("GET", "https://k/api/v1/nodes", None, ("list", "nodes")),
])
def test_api_call(method, url, query, want):
    assert api_call(method, url, query) == want


class Response:
    """What ApiClient.request returns, enough for the client: a whole body, or a watch's stream."""

    def __init__(self, body: Any = None, events: list[dict[str, Any]] | None = None,
                 until: threading.Event | None = None):
        self.status, self.reason = 200, "OK"
        self.data = json.dumps(body).encode() if body is not None else b""
        self.events, self.until = events or [], until

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return "application/json" if name.lower() == "content-type" else default

    def getheaders(self) -> dict[str, str]:
        return {"content-type": "application/json"}

    def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
        for e in self.events:
            yield json.dumps(e).encode() + b"\n"
        assert self.until is not None
        self.until.wait(30)

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class Transport:
    """``ApiClient.request`` answering from fixed bodies by path; a watch streams one bookmark and
    then nothing until ``end`` is set."""

    def __init__(self, bodies: dict[str, Any]):
        self.bodies, self.end = bodies, threading.Event()

    def __call__(self, method: str, url: str, query_params: Any = None, **_: Any) -> Response:
        path = urlsplit(url).path
        if any(k == "watch" for k, _ in query_params or ()):
            return Response(events=[{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "8"}}}],
                            until=self.end)
        if path in self.bodies:
            return Response(self.bodies[path])
        e = ApiException(status=404, reason="Not Found")
        e.body = b"{}"
        raise e


def counted(verb: str, resource: str) -> float:
    return REGISTRY.get_sample_value("fewerbits_activator_api_calls_total", {"verb": verb, "resource": resource}) or 0.0


def test_reads_through_the_api_are_counted_and_the_watches_then_serve():
    """The real Kube and kubernetes client on a stand-in transport: a namespace not watched yet is
    read through the API (counted by verb and resource); the model found there starts its watches
    (Kube.list_raw, Kube.watch_raw: counted too), and from then on a request counts nothing."""
    qm = model()
    pods = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"}, "items": [pod()]}
    bodies = {
        "/apis/fewerbits.io/v1alpha1/namespaces/ns/quantizedmodels/m": qm,
        "/apis/fewerbits.io/v1alpha1/namespaces/ns/quantizedmodels": {"metadata": {"resourceVersion": "7"},
                                                                      "items": [qm]},
        "/api/v1/namespaces/ns/pods": pods,
        "/apis/apps/v1/namespaces/ns/deployments": {"kind": "DeploymentList", "apiVersion": "apps/v1",
                                                    "metadata": {"resourceVersion": "7"}, "items": []},
    }
    transport = Transport(bodies)
    api = client.ApiClient()
    api.request = transport
    kube = Kube(count_api_calls(api))
    cache = ActivatorCache(kube)
    act = Activator(kube, cache=cache, forward=echo)
    labels = [("get", "quantizedmodels"), ("list", "pods"), ("list", "quantizedmodels"), ("list", "deployments")]
    before = {k: counted(*k) for k in labels}
    try:
        assert act.handle("POST", "/v1/x", {"host": "nope.ns.svc"}, b"")[0] == 404
        assert act.handle("POST", "/v1/x", HOST, b"")[0] == 200
        assert counted("get", "quantizedmodels") == before[("get", "quantizedmodels")] + 2
        assert counted("list", "pods") >= before[("list", "pods")] + 1
        settle(cache, lambda: cache.serves(NS))
        assert cache.model(NS, "m")["metadata"]["uid"] == "uid-m" and len(cache.serving_pods(NS, "m")) == 1
        after = {k: counted(*k) for k in labels}
        assert after[("list", "quantizedmodels")] == before[("list", "quantizedmodels")] + 1
        assert after[("list", "deployments")] == before[("list", "deployments")] + 1
        for _ in range(5):
            assert act.handle("POST", "/v1/x", HOST, b"")[0] == 200
        assert {k: counted(*k) for k in labels} == after
    finally:
        cache.stop()
        transport.end.set()
