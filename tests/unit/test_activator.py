"""The scale-from-zero activator against a fake API: held while one variant wakes, then forwarded;
the queue and the wait are bounded; a model without autoscaling is not woken."""

from __future__ import annotations

import threading
import time

from fewerbits_operator.activator import Activator, model_of, variant_to_wake


class FakeKube:
    def __init__(self, autoscaling: bool = True, ready_after: int | None = 2):
        self.scaled: list[tuple[str, str, int]] = []
        self.events: list[str] = []
        self.lists = 0
        self.ready_after = ready_after
        self.model = {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
                      "metadata": {"name": "m", "namespace": "ns"},
                      "status": {"autoscaling": {"enabled": autoscaling, "minReplicas": 0},
                                 "plan": {"variants": [{"pool": "l4"}, {"pool": "h100"}]}}}

    def get_model(self, ns, name):
        return self.model if (ns, name) == ("ns", "m") else None

    def list_deployments(self, ns, selector):
        return [{"metadata": {"name": f"m-{p}", "labels": {"fewerbits.io/variant": p}}, "spec": {"replicas": 0}}
                for p in ("h100", "l4")]

    def list_pods(self, ns, selector):
        self.lists += 1
        if not self.scaled or self.ready_after is None or self.lists < self.ready_after:
            return []
        return [{"metadata": {"name": "p"}, "status": {"podIP": "10.0.0.7",
                                                       "conditions": [{"type": "Ready", "status": "True"}]}}]

    def patch_scale(self, ns, name, replicas):
        self.scaled.append((ns, name, replicas))

    def post_event(self, obj, type_, reason, message):
        self.events.append(reason)


def echo(method, url, target, body, headers):
    return 200, {"X-Fewerbits-Endpoint": target}, url.encode()


HOST = {"host": "m.ns.svc.cluster.local:8000"}


def test_model_from_host_or_header():
    assert model_of("m.ns.svc.cluster.local:8000", None) == ("ns", "m")
    assert model_of("m.ns.svc:8000", None) == ("ns", "m")
    assert model_of("10.0.0.1:8000", "ns/m") == ("ns", "m")
    assert model_of("example.com", None) is None


def test_wakes_the_first_planned_variant_once_and_forwards():
    kube = FakeKube()
    act = Activator(kube, poll=0.01, forward=echo)
    code, hdrs, body = act.handle("POST", "/v1/chat/completions", HOST, b"{}")
    assert code == 200 and body == b"http://10.0.0.7:8000/v1/chat/completions"
    assert kube.scaled == [("ns", "m-l4", 1)] and kube.events == ["ScaledFromZero"]


def test_ready_pod_is_served_without_waking():
    kube = FakeKube(ready_after=1)
    kube.scaled.append(("ns", "m-l4", 1))  # already up
    act = Activator(kube, poll=0.01, forward=echo)
    assert act.handle("POST", "/v1/x", HOST, b"")[0] == 200
    assert len(kube.scaled) == 1 and act.woken == 0


def test_the_wait_is_bounded():
    act = Activator(FakeKube(ready_after=None), timeout=0.2, poll=0.01, forward=echo)
    t0 = time.monotonic()
    code, _, body = act.handle("POST", "/v1/x", HOST, b"")
    assert code == 504 and b"within" in body and time.monotonic() - t0 < 2


def test_the_queue_is_bounded():
    act = Activator(FakeKube(ready_after=None), queue=1, timeout=1.0, poll=0.01, forward=echo)
    first = threading.Thread(target=act.handle, args=("POST", "/v1/x", HOST, b""))
    first.start()
    deadline = time.monotonic() + 2
    while act.gate(("ns", "m")).waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    code, hdrs, body = act.handle("POST", "/v1/x", HOST, b"")
    first.join()
    assert code == 503 and hdrs.get("Retry-After") and b"already wait" in body


def test_no_autoscaling_no_wake_and_unknown_model():
    kube = FakeKube(autoscaling=False)
    act = Activator(kube, poll=0.01, forward=echo)
    code, _, body = act.handle("POST", "/v1/x", HOST, b"")
    assert code == 503 and b"autoscaling is off" in body and kube.scaled == []
    assert act.handle("POST", "/v1/x", {"host": "x.ns.svc"}, b"")[0] == 404
    assert act.handle("POST", "/v1/x", {"host": "1.2.3.4"}, b"")[0] == 400


def test_variant_to_wake_none_when_one_has_replicas():
    deps = [{"metadata": {"name": "a", "labels": {}}, "spec": {"replicas": 1}}]
    assert variant_to_wake({}, deps) is None


def test_a_model_back_at_zero_while_requests_wait_is_woken_again_and_the_wait_is_remembered(monkeypatch):
    import time as _time

    from fewerbits_operator import activator as mod
    monkeypatch.setattr(mod, "REWAKE_SECONDS", 0.05)
    kube = FakeKube(ready_after=None)  # its Deployments stay at zero: as if scaled down again meanwhile
    act = Activator(kube, timeout=0.3, poll=0.01, forward=echo)
    assert act.last_held("ns", "m") is None
    before = _time.time()
    code, _, _ = act.handle("POST", "/v1/chat/completions", HOST, b"{}")
    assert code == 504 and len(kube.scaled) >= 3  # woken again every REWAKE_SECONDS, not once per timeout
    assert before <= act.last_held("ns", "m") <= _time.time()  # what the autoscaler keeps it awake by
