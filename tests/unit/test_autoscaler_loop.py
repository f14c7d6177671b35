"""The autoscaler loop against an in-memory fake of its AutoscalerIO protocol, with each pod's
/metrics served by a real HTTP server on 127.0.0.1; and the kubernetes-client wrapper's calls."""

from __future__ import annotations

import copy
import inspect
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from unittest import mock

import pytest
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from fewerbits_api.quantizedmodel import EffectiveAutoscaling
from fewerbits_operator.base.kube import Kube
from fewerbits_operator.autoscaler.kube_io import KubeAutoscalerIO
from fewerbits_operator.autoscaler.loop import (
    AUTOSCALER_FIELDS,
    Autoscaler,
    AutoscalerIO,
    classify_pods,
    http_port,
    merge_serving,
)
from fewerbits_operator.autoscaler.metrics import DirectScrapeSource

NS = "llm"
T0 = 1_800_000_000.0


# ------------------------------------------------------------------ fakes


class MetricsServer:
    """One pod's vLLM /metrics, on a real socket; `page` may be changed between passes."""

    def __init__(self):
        self.page = ""
        self.status = 200
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                data = outer.page.encode()
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def set(self, kv: float, waiting: float = 0, running: float = 8, old_name: bool = False):
        name = "vllm:gpu_cache_usage_perc" if old_name else "vllm:kv_cache_usage_perc"
        self.page = (f'# TYPE {name} gauge\n{name}{{engine="0",model_name="m"}} {kv}\n'
                     f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
                     f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n')

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


class FakeIO:
    """An in-memory API server for the verbs of AutoscalerIO, recording every write."""

    def __init__(self):
        self.models: dict[str, dict[str, Any]] = {}
        self.deployments: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.scale_writes: list[tuple[str, int]] = []
        self.status_writes: list[tuple[str, dict]] = []
        self.events: list[tuple[str, str, str]] = []
        self.fail_pods_for: set[str] = set()

    # reads
    def list_models(self, namespaces):
        return [copy.deepcopy(m) for m in self.models.values()
                if not namespaces or m["metadata"]["namespace"] in namespaces]

    @staticmethod
    def _match(obj, selector):
        labels = obj["metadata"].get("labels") or {}
        return all(labels.get(k) == v for k, v in (kv.split("=") for kv in selector.split(",")))

    def list_deployments(self, namespace, selector):
        return [copy.deepcopy(d) for d in self.deployments.values() if self._match(d, selector)]

    def list_pods(self, namespace, selector):
        if any(f"fewerbits.io/model={m}" in selector for m in self.fail_pods_for):
            raise RuntimeError("API server unavailable")
        return [copy.deepcopy(p) for p in self.pods.values() if self._match(p, selector)]

    def read_scale(self, namespace, name):
        d = self.deployments.get(name)
        return None if d is None else d["spec"]["replicas"]

    # writes
    def patch_scale(self, namespace, name, replicas):
        self.scale_writes.append((name, replicas))
        self.deployments[name]["spec"]["replicas"] = replicas

    def patch_serving_status(self, namespace, name, updates):
        m = self.models[name]
        merged = merge_serving(m["status"]["serving"], updates)
        self.status_writes.append((name, copy.deepcopy(updates)))
        if merged is not None:
            m["status"]["serving"] = merged

    def post_event(self, obj, type_, reason, message):
        self.events.append((obj["metadata"]["name"], reason, message))

    # set-up helpers
    def add_model(self, name, autoscaling=None, pools=("h100",), policy_cap=None):
        """A model as reconcile leaves it: ``status.autoscaling`` is what reconcile published (the
        effective autoscaling and the policy's cap), absent when the autoscaling is invalid."""
        try:
            published = EffectiveAutoscaling.model_validate(
                {**(autoscaling or {}), "policyMaxReplicas": policy_cap}).to_wire()
        except ValueError:
            published = None
        self.models[name] = {
            "apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
            "spec": {"source": {"uri": "hf://org/m", "revision": "abc"}, "storage": {"uri": "s3://bucket/p"},
                     "autoscaling": autoscaling or {}},
            "status": {"serving": [{"variant": p, "deployment": f"{name}-{p}", "replicas": 1, "readyReplicas": 1}
                                   for p in pools], **({"autoscaling": published} if published else {})},
        }

    def add_deployment(self, model, pool, replicas):
        name = f"{model}-{pool}"
        self.deployments[name] = {"metadata": {"name": name, "namespace": NS, "labels": {
            "fewerbits.io/model": model, "fewerbits.io/variant": pool}}, "spec": {"replicas": replicas}}

    def add_pod(self, model, pool, name, port, ready=True, ip="127.0.0.1", terminating=False):
        pod = {"metadata": {"name": name, "namespace": NS,
                            "labels": {"fewerbits.io/model": model, "fewerbits.io/variant": pool}},
               "spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": port}]}]},
               "status": {"phase": "Running", "podIP": ip,
                          "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        if terminating:
            pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        self.pods[name] = pod


def test_fake_and_wrapper_implement_the_protocol():
    wanted = {n: inspect.signature(getattr(AutoscalerIO, n)) for n in dir(AutoscalerIO)
              if not n.startswith("_") and callable(getattr(AutoscalerIO, n))}
    assert set(wanted) == {"list_models", "list_deployments", "list_pods",
                           "read_scale", "patch_scale", "patch_serving_status", "post_event"}
    for impl in (KubeAutoscalerIO, FakeIO):
        for n, sig in wanted.items():
            assert list(inspect.signature(getattr(impl, n)).parameters) == list(sig.parameters), (impl, n)


@pytest.fixture
def servers():
    made: list[MetricsServer] = []

    def make(n):
        new = [MetricsServer() for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for s in made:
        s.close()


def setup(io: FakeIO, servers, n_pods: int, replicas: int | None = None, model="m1", pool="h100",
          policy_cap=None, **auto):
    io.add_model(model, auto, pools=(pool,), policy_cap=policy_cap)
    io.add_deployment(model, pool, replicas if replicas is not None else n_pods)
    srvs = servers(n_pods)
    for i, s in enumerate(srvs):
        io.add_pod(model, pool, f"{model}-{pool}-{i}", s.port)
    return srvs


def scaler(io, **kw):
    return Autoscaler(io, DirectScrapeSource(timeout=1.0), registry=CollectorRegistry(), **kw)


def _sample(a: Autoscaler, name: str, labels: dict) -> float | None:
    for metric in a.registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


# ------------------------------------------------------------------ loop behaviour


def test_scale_up_on_kv_writes_only_scale_status_and_event(servers):
    io = FakeIO()
    srvs = setup(io, servers, 2)
    for s in srvs:
        s.set(kv=0.95)
    spec_before = copy.deepcopy(io.models["m1"]["spec"])
    a = scaler(io)
    out = a.run_once(T0)
    assert io.scale_writes == [("m1-h100", 3)]
    assert out[0].scaled and out[0].decision.desired == 3
    (model, reason, message), = io.events
    assert reason == "ScaledUp" and "m1-h100: scale up 2->3" in message and "KV 0.95" in message
    entry = io.models["m1"]["status"]["serving"][0]
    assert entry["desiredReplicas"] == 3 and entry["kvCacheUsage"] == 0.95 and entry["waitingRequests"] == 0.0
    assert entry["lastScaleTime"] == "2027-01-15T08:00:00Z"
    assert entry["readyReplicas"] == 1 and entry["deployment"] == "m1-h100"  # reconcile's fields untouched
    assert io.models["m1"]["spec"] == spec_before  # never the spec
    assert _sample(a, "fewerbits_autoscaler_desired_replicas", {"model": "m1", "variant": "h100"}) == 3
    assert _sample(a, "fewerbits_autoscaler_kv_cache_usage", {"namespace": NS}) == pytest.approx(0.95)
    assert _sample(a, "fewerbits_autoscaler_scale_events_total", {"direction": "up"}) == 1


def test_at_target_no_scale_writes_and_status_rate_limited(servers):
    io = FakeIO()
    srvs = setup(io, servers, 3)
    for s in srvs:
        s.set(kv=0.7, waiting=1)
    a = scaler(io, status_interval_seconds=60)
    a.run_once(T0)
    assert io.scale_writes == [] and io.events == []
    assert len(io.status_writes) == 1  # first figures
    srvs[0].set(kv=0.72)
    a.run_once(T0 + 15)
    assert len(io.status_writes) == 1  # only figures moved, within the interval
    a.run_once(T0 + 75)
    assert len(io.status_writes) == 2
    a.run_once(T0 + 200)
    assert len(io.status_writes) == 2  # nothing changed: no write at rest


def test_queue_bound_low_kv_scales_up(servers):
    io = FakeIO()
    srvs = setup(io, servers, 2, maxReplicas=8)
    for s in srvs:
        s.set(kv=0.3, waiting=25, running=10)
    scaler(io).run_once(T0)
    # queue: (25-5) x 2 = 40 excess / 10 running per pod -> 2 + 4 = 6 (step limit 6)
    assert io.scale_writes == [("m1-h100", 6)]
    assert "25.0 waiting/pod > 5" in io.events[0][2]


def test_old_metric_name_scales(servers):
    io = FakeIO()
    srvs = setup(io, servers, 1)
    srvs[0].set(kv=0.99, old_name=True)
    scaler(io).run_once(T0)
    assert io.scale_writes == [("m1-h100", 2)]


def test_scale_down_only_after_delay_then_to_min(servers):
    io = FakeIO()
    srvs = setup(io, servers, 4, minReplicas=1, scaleDownDelaySeconds=60)
    for s in srvs:
        s.set(kv=0.05)
    a = scaler(io)
    for k in range(4):  # 0, 15, 30, 45 s
        a.run_once(T0 + 15 * k)
        assert io.scale_writes == []
    a.run_once(T0 + 60)
    assert io.scale_writes == [("m1-h100", 1)]
    assert io.events[-1][1] == "ScaledDown" and "highest recommendation in the last 60s is 1" in io.events[-1][2]


def test_restart_loses_history_and_waits_the_full_delay_again(servers):
    io = FakeIO()
    srvs = setup(io, servers, 3, scaleDownDelaySeconds=60)
    for s in srvs:
        s.set(kv=0.05)
    a = scaler(io)
    for k in range(4):
        a.run_once(T0 + 15 * k)
    b = scaler(io)  # operator restarted
    b.run_once(T0 + 60)
    b.run_once(T0 + 105)
    assert io.scale_writes == []
    b.run_once(T0 + 120)
    assert io.scale_writes == [("m1-h100", 1)]


def test_unready_and_failing_pods_block_scale_down(servers):
    io = FakeIO()
    srvs = setup(io, servers, 3, scaleDownDelaySeconds=0)
    for s in srvs:
        s.set(kv=0.05)
    srvs[2].status = 500
    a = scaler(io)
    a.run_once(T0)
    assert io.scale_writes == []
    srvs[2].status = 200
    io.add_pod("m1", "h100", "m1-h100-starting", srvs[0].port, ready=False)
    io.deployments["m1-h100"]["spec"]["replicas"] = 4
    a.run_once(T0 + 15)
    assert io.scale_writes == []
    del io.pods["m1-h100-starting"]
    io.deployments["m1-h100"]["spec"]["replicas"] = 3
    a.run_once(T0 + 30)
    assert io.scale_writes == [("m1-h100", 1)]
    assert _sample(a, "fewerbits_autoscaler_scrape_failures_total", {}) == 1


def test_policy_cap_clamps(servers):
    io = FakeIO()
    srvs = setup(io, servers, 4, maxReplicas=8, policy_cap=2)
    for s in srvs:
        s.set(kv=0.7)
    scaler(io).run_once(T0)
    assert io.scale_writes == [("m1-h100", 2)] and "policy rules.maxReplicas 2" in io.events[0][2]


def test_unpublished_disabled_or_invalid_autoscaling_is_left_alone(servers):
    """Reconcile publishes no status.autoscaling for a model it has not accepted (an invalid or
    violated policy fails closed): the autoscaler leaves such a model alone, as it does a disabled
    one and a published value it cannot read."""
    io = FakeIO()
    srvs = setup(io, servers, 1, enabled=False)
    srvs[0].set(kv=1.0, waiting=50)
    bad = setup(io, servers, 1, model="bad", minReplicas=5, maxReplicas=2)
    bad[0].set(kv=1.0)
    refused = setup(io, servers, 1, model="refused")
    refused[0].set(kv=1.0)
    del io.models["refused"]["status"]["autoscaling"]
    garbled = setup(io, servers, 1, model="garbled")
    garbled[0].set(kv=1.0)
    io.models["garbled"]["status"]["autoscaling"] = {"minReplicas": "many"}
    a = scaler(io)
    assert a.run_once(T0) == []
    assert io.scale_writes == [] and io.status_writes == [] and io.events == []


def test_published_targets_are_used_not_the_spec(servers):
    """The bounds and targets come from status.autoscaling (policy defaults already applied by
    reconcile), not from the raw spec."""
    io = FakeIO()
    srvs = setup(io, servers, 2, targetKVCacheUsage=0.5)
    io.models["m1"]["spec"]["autoscaling"] = {}  # the policy default, not the model, set the target
    for s in srvs:
        s.set(kv=0.6)  # within 10% of 0.7, but 1.2 x the policy's 0.5
    scaler(io).run_once(T0)
    assert io.scale_writes == [("m1-h100", 3)] and "target 0.50" in io.events[0][2]


def test_one_failing_model_does_not_stop_the_rest(servers):
    io = FakeIO()
    a_srv = setup(io, servers, 1, model="a")
    b_srv = setup(io, servers, 1, model="b")
    a_srv[0].set(kv=1.0)
    b_srv[0].set(kv=1.0)
    io.fail_pods_for = {"a"}
    a = scaler(io)
    a.run_once(T0)
    assert io.scale_writes == [("b-h100", 2)]
    assert _sample(a, "fewerbits_autoscaler_errors_total", {}) == 1


def test_in_flight_scale_up_is_not_repeated(servers):
    io = FakeIO()
    srvs = setup(io, servers, 2)
    for s in srvs:
        s.set(kv=1.0)
    a = scaler(io)
    a.run_once(T0)
    assert io.scale_writes == [("m1-h100", 3)]
    io.add_pod("m1", "h100", "m1-h100-new", srvs[0].port, ready=False)  # the third pod is starting
    for k in range(1, 8):
        a.run_once(T0 + 15 * k)
    assert io.scale_writes == [("m1-h100", 3)]


def test_gone_variants_are_forgotten(servers):
    io = FakeIO()
    srvs = setup(io, servers, 1)
    srvs[0].set(kv=0.7)
    a = scaler(io)
    a.run_once(T0)
    assert _sample(a, "fewerbits_autoscaler_desired_replicas", {"model": "m1"}) == 1
    del io.deployments["m1-h100"]
    a.run_once(T0 + 15)
    assert _sample(a, "fewerbits_autoscaler_desired_replicas", {"model": "m1"}) is None and a._history == {}


def test_run_forever_stops():
    io = FakeIO()
    a = scaler(io)
    stop = threading.Event()
    t = threading.Thread(target=a.run_forever, args=(stop, 0.01), daemon=True)
    t.start()
    stop.set()
    t.join(2)
    assert not t.is_alive()


# ------------------------------------------------------------------ pure helpers


def test_merge_serving_changes_only_autoscaler_fields():
    serving = [{"variant": "a", "deployment": "m-a", "replicas": 2, "kvCacheUsage": 0.5},
               {"variant": "b", "deployment": "m-b", "replicas": 1}]
    out = merge_serving(serving, {"a": {"desiredReplicas": 3, "kvCacheUsage": None}, "zzz": {"desiredReplicas": 9}})
    assert out == [{"variant": "a", "deployment": "m-a", "replicas": 2, "desiredReplicas": 3}, serving[1]]
    assert serving[0]["kvCacheUsage"] == 0.5  # input untouched
    assert merge_serving(serving, {"a": {"kvCacheUsage": 0.5}}) is None
    with pytest.raises(ValueError, match="replicas"):
        merge_serving(serving, {"a": {"replicas": 5}})
    assert set(AUTOSCALER_FIELDS) == {"desiredReplicas", "kvCacheUsage", "waitingRequests", "lastScaleTime",
                                      "podsWithoutMetrics", "forecast", "lastScaleCause"}


def test_classify_pods():
    io = FakeIO()
    io.add_pod("m", "p", "ready", 9000)
    io.add_pod("m", "p", "starting", 9000, ready=False)
    io.add_pod("m", "p", "leaving", 9000, terminating=True)
    io.add_pod("m", "p", "no-ip", 9000, ip="")
    io.add_pod("m", "p", "done", 9000)
    io.pods["done"]["status"]["phase"] = "Failed"
    targets, not_ready = classify_pods(NS, list(io.pods.values()))
    assert [t.name for t in targets] == ["ready"] and targets[0].port == 9000 and not_ready == 2
    assert http_port({"spec": {"containers": [{"ports": [{"name": "grpc", "containerPort": 1}]}]}}) == 8000


# ------------------------------------------------------------------ the kubernetes-client wrapper


def wrapper() -> Kube:
    w = Kube(api=mock.MagicMock())
    w.apps, w.core, w.custom = mock.MagicMock(), mock.MagicMock(), mock.MagicMock()
    return w


def test_wrapper_patches_only_the_scale_subresource():
    w = wrapper()
    w.patch_scale(NS, "m-h100", 4)
    w.apps.patch_namespaced_deployment_scale.assert_called_once_with(
        "m-h100", NS, {"spec": {"replicas": 4}}, _content_type="application/merge-patch+json")
    assert not w.apps.patch_namespaced_deployment.called and not w.custom.patch_namespaced_custom_object.called
    w.apps.read_namespaced_deployment_scale.return_value = mock.NonCallableMock(**{'spec.replicas': 3})
    assert w.read_scale(NS, "m-h100") == 3
    w.apps.read_namespaced_deployment_scale.side_effect = ApiException(status=404)
    assert w.read_scale(NS, "gone") is None


def test_wrapper_status_patch_rewrites_serving_with_resource_version_and_retries_conflicts():
    w = wrapper()
    obj = {"metadata": {"resourceVersion": "7"},
           "status": {"serving": [{"variant": "a", "deployment": "m-a", "replicas": 2}], "conditions": [{"x": 1}]}}
    w.custom.get_namespaced_custom_object.return_value = obj
    w.custom.patch_namespaced_custom_object_status.side_effect = [ApiException(status=409), None]
    KubeAutoscalerIO(w).patch_serving_status(NS, "m", {"a": {"desiredReplicas": 3}})
    assert w.custom.get_namespaced_custom_object.call_count == 2
    args = w.custom.patch_namespaced_custom_object_status.call_args.args
    assert args[:5] == ("fewerbits.io", "v1alpha1", NS, "quantizedmodels", "m")
    args = (*args[:5], {"metadata": args[5]["metadata"], "status": args[5]["status"]})
    assert args[5] == {"metadata": {"resourceVersion": "7"},
                       "status": {"serving": [{"variant": "a", "deployment": "m-a", "replicas": 2, "desiredReplicas": 3}]}}
    assert not w.custom.patch_namespaced_custom_object.called  # never the spec
    assert w.writes == 1


def test_wrapper_status_patch_skips_when_unchanged_or_gone():
    w = wrapper()
    w.custom.get_namespaced_custom_object.return_value = {"metadata": {"resourceVersion": "1"},
                                                          "status": {"serving": [{"variant": "a", "desiredReplicas": 3}]}}
    KubeAutoscalerIO(w).patch_serving_status(NS, "m", {"a": {"desiredReplicas": 3}})
    w.custom.get_namespaced_custom_object.side_effect = ApiException(status=404)
    KubeAutoscalerIO(w).patch_serving_status(NS, "m", {"a": {"desiredReplicas": 4}})
    assert not w.custom.patch_namespaced_custom_object_status.called


def test_wrapper_event_is_best_effort():
    w = wrapper()
    w.core.create_namespaced_event.side_effect = ApiException(status=403, reason="Forbidden")
    w.post_event({"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
                  "metadata": {"name": "m", "namespace": NS, "uid": "u"}}, "Normal", "ScaledUp", "x" * 5000)
    body = w.core.create_namespaced_event.call_args.args[1]
    assert body["involvedObject"]["kind"] == "QuantizedModel" and len(body["message"]) == 1024


# ------------------------------------------------------------------ placement across pools, missing metrics


def two_pool_model(io: FakeIO, servers, placement: str, kv: float = 0.9):
    """Model m2 on an H100 pool (100 tokens/s per replica) and an L4 pool (10 tokens/s, weight
    0.27 per GPU: 2.7x the H100's cost per token), two pods each at the same KV usage."""
    io.add_model("m2", {"maxReplicas": 10}, pools=("h100", "l4"))
    io.models["m2"]["status"]["autoscaling"].update(placement=placement, poolCostWeights={"NVIDIA-L4": 0.27})
    io.models["m2"]["status"]["plan"] = {"variants": [
        {"pool": "h100", "gpuProduct": "NVIDIA-H100-80GB-HBM3", "tensorParallelSize": 1, "decodeTokensPerSecond": 100.0},
        {"pool": "l4", "gpuProduct": "NVIDIA-L4", "tensorParallelSize": 1, "decodeTokensPerSecond": 10.0}]}
    srvs = servers(4)
    for i, (pool, s) in enumerate(zip(("h100", "h100", "l4", "l4"), srvs)):
        io.add_pod("m2", pool, f"m2-{pool}-{i}", s.port)
        s.set(kv=kv)
    io.add_deployment("m2", "h100", 2)
    io.add_deployment("m2", "l4", 2)
    return srvs


def test_cheapest_pool_placement_adds_the_demand_on_the_cheaper_pool_per_token(servers):
    io = FakeIO()
    two_pool_model(io, servers, "cheapestPool")
    out = scaler(io).run_once(T0)
    # Each pool's own rule wants 3 (KV 0.9 / 0.7): 330 units wanted of 220; the H100 takes the
    # missing 110 (+2 replicas), the L4 (2.7x per token) stays.
    assert sorted(io.scale_writes) == [("m2-h100", 4)]
    assert {o.variant: o.decision.desired for o in out} == {"h100": 4, "l4": 2}
    (reason,) = [m for _, r, m in io.events if r == "ScaledUp"]
    assert reason.startswith("m2-h100: capacity-aware") and "own decision: 3" in reason
    serving = {e["variant"]: e for e in io.models["m2"]["status"]["serving"]}
    assert serving["h100"]["desiredReplicas"] == 4 and serving["l4"]["desiredReplicas"] == 2


def test_per_variant_placement_scales_each_pool_on_its_own_load(servers):
    # Behind the Service every pod gets the same share: each pool must grow on its own load.
    io = FakeIO()
    two_pool_model(io, servers, "perVariant")
    scaler(io).run_once(T0)
    assert sorted(io.scale_writes) == [("m2-h100", 3), ("m2-l4", 3)]


def test_pods_without_metrics_warn_once_and_keep_serving(servers):
    io = FakeIO()
    srvs = setup(io, servers, 2)
    srvs[0].set(kv=0.7)
    srvs[1].page = "# an old server: no vLLM metrics here\n"
    a = scaler(io)
    a.run_once(T0)
    a.run_once(T0 + 15)
    warnings = [m for _, r, m in io.events if r == "MetricsUnavailable"]
    assert len(warnings) == 1 and "variant h100: 1 of 2 ready pod(s) expose no vLLM metrics" in warnings[0]
    assert io.scale_writes == []  # never a scale-down on missing data
    assert io.models["m1"]["status"]["serving"][0]["podsWithoutMetrics"] == 1  # what reconcile reads
    srvs[1].set(kv=0.7)
    a.run_once(T0 + 30)
    assert [m for _, r, m in io.events if r == "MetricsRestored"] == ["variant h100: all 2 ready pod(s) report "
                                                                      "vLLM metrics again"]
    assert "podsWithoutMetrics" not in io.models["m1"]["status"]["serving"][0]


def test_a_model_the_activator_just_woke_is_not_scaled_back_to_zero(servers):
    # Idle with minReplicas 0 and a 6 s delay: it would go to zero, but the activator held a request
    # for it 2 s ago (its pod started between two passes): kept until the delay after that.
    io = FakeIO()
    srvs = setup(io, servers, 1, minReplicas=0, maxReplicas=2, scaleDownDelaySeconds=6)
    srvs[0].set(kv=0.0)
    held = {"at": None}
    a = scaler(io, held=lambda ns, name: held["at"])
    for t in (0, 2, 4, 6):
        a.run_once(T0 + t)
    assert io.scale_writes == [("m1-h100", 0)]  # idle for the delay: down to zero
    io.deployments["m1-h100"]["spec"]["replicas"] = 1  # the activator's wake
    held["at"] = T0 + 7
    out = a.run_once(T0 + 8)
    assert io.scale_writes == [("m1-h100", 0)] and not out[0].decision.act
    assert "the activator held a request for this model 1s ago" in out[0].decision.reason
    a.run_once(T0 + 13.5)
    assert len(io.scale_writes) == 2 and io.scale_writes[-1] == ("m1-h100", 0)  # 6.5 s after it


def test_two_idle_replicas_go_to_zero_through_one(servers):
    # Idle at two replicas with minReplicas 0: the straight step 2 -> 0 would leave the model's
    # Service with only terminating pods until the activator's slice pass; it goes 2 -> 1, and
    # to zero only at a later pass (the activator enters the path at one ready pod, atzero.py).
    io = FakeIO()
    srvs = setup(io, servers, 2, minReplicas=0, maxReplicas=4, scaleDownDelaySeconds=6)
    for s in srvs:
        s.set(kv=0.0)
    a = scaler(io)
    out = []
    for t in (0, 2, 4, 6):
        out = a.run_once(T0 + t)
    assert io.scale_writes == [("m1-h100", 1)]
    assert out[0].decision.desired == 1 and "2 -> 1, not 0" in out[0].decision.reason
    io.deployments["m1-h100"]["spec"]["replicas"] = 1
    del io.pods[sorted(io.pods)[-1]]
    a.run_once(T0 + 8)
    assert io.scale_writes == [("m1-h100", 1), ("m1-h100", 0)]


def test_through_one_counts_the_model_not_the_variant():
    from fewerbits_operator.autoscaler.algorithm import Decision, History
    from fewerbits_operator.autoscaler.loop import through_one

    def d(current, desired):
        return Decision(desired, current, desired != current, "idle", History(), "down" if desired < current else None)

    two_variants = through_one([d(1, 0), d(1, 0)], may_reach_zero=True)
    assert [x.desired for x in two_variants] == [1, 0] and not two_variants[0].act and two_variants[1].act
    assert [x.desired for x in through_one([d(1, 0), d(3, 0)], True)] == [0, 1]
    assert [x.desired for x in through_one([d(1, 0)], True)] == [0]         # the last one: the activator is in
    assert [x.desired for x in through_one([d(2, 0)], False)] == [0]        # never reaches zero by policy
    assert [x.desired for x in through_one([d(2, 1), d(1, 0)], True)] == [1, 0]  # not all to zero


def _warm_forecast(a: Autoscaler, srvs, kv: float, passes: int = 70) -> float:
    """One pass a minute at a steady load until the forecast has checked enough of its forecasts to
    know its band (ForecastTuning.min_errors); returns the time of the last pass."""
    for s in srvs:
        s.set(kv=kv)
    for i in range(passes):
        a.run_once(T0 + 60 * i)
    return T0 + 60 * (passes - 1)


def test_a_ramp_is_scaled_for_ahead_and_the_status_says_predictive(servers):
    io = FakeIO()
    srvs = setup(io, servers, 2, maxReplicas=8)
    a = scaler(io, status_interval_seconds=0)
    t = _warm_forecast(a, srvs, 0.7)
    assert io.scale_writes == []  # a steady load at the target: no predictive scaling
    entry = io.models["m1"]["status"]["serving"][0]
    assert entry["forecast"]["phase"] == "Trend" and entry["forecast"]["upperReplicas"] == pytest.approx(2.0, abs=0.1)
    assert entry["forecast"]["horizonSeconds"] == 195 and entry["forecast"]["historySince"] == "2027-01-15T08:00:00Z"
    kv = 0.7
    while not io.scale_writes:
        t += 15
        kv += 0.02
        assert kv < 0.77, "the reactive KV rule would fire now: the forecast did not act ahead of it"
        for s in srvs:
            s.set(kv=kv)
        out = a.run_once(t)
    (name, replicas), = io.scale_writes
    assert name == "m1-h100" and replicas >= 3
    assert out[0].decision.cause == "predictive" and out[0].decision.reason.startswith("predictive scale up 2->")
    entry = io.models["m1"]["status"]["serving"][0]
    assert entry["lastScaleCause"] == "Predictive" and entry["forecast"]["expectedReplicas"] > 2.2
    assert [e[1] for e in io.events] == ["ScaledUp"]
    labels = {"model": "m1", "variant": "h100"}
    assert _sample(a, "fewerbits_autoscaler_predictive_scale_ups_total", labels) == 1
    # The ramp stops at once: the demand never exceeds what 2 replicas hold within the tolerance,
    # so two horizons later the scale-up is counted as not needed.
    for i in range(1, 30):
        a.run_once(t + 15 * i)
    assert _sample(a, "fewerbits_autoscaler_predictive_scale_ups_unneeded_total", labels) == 1


def test_predictive_off_publishes_the_forecast_but_scales_reactively(servers):
    io = FakeIO()
    srvs = setup(io, servers, 2, maxReplicas=8, predictive=False)
    a = scaler(io, status_interval_seconds=0)
    t = _warm_forecast(a, srvs, 0.7)
    kv = 0.7
    for _ in range(3):
        t += 15
        kv += 0.02
        for s in srvs:
            s.set(kv=kv)
        a.run_once(t)
    assert io.scale_writes == []  # 0.76 is within the reactive tolerance
    assert io.models["m1"]["status"]["serving"][0]["forecast"]["expectedReplicas"] > 2.2


def test_startup_is_read_from_the_pods_ready_transitions():
    from fewerbits_operator.autoscaler.loop import startup_seconds

    def pod(created, ready_at, status="True"):
        return {"metadata": {"creationTimestamp": created},
                "status": {"conditions": [{"type": "Ready", "status": status, "lastTransitionTime": ready_at}]}}

    pods = [pod("2027-01-15T08:00:00Z", "2027-01-15T08:03:00Z"), pod("2027-01-15T08:00:00Z", "2027-01-15T08:04:00Z"),
            pod("2027-01-15T08:10:00Z", "2027-01-15T08:12:00Z"), pod("2027-01-15T08:00:00Z", "x"),
            pod("2027-01-15T08:00:00Z", "2027-01-15T08:30:00Z", status="False")]
    assert startup_seconds(pods) == 180.0  # the median of 120, 180, 240; unready and unreadable pods ignored
    assert startup_seconds([pod("2027-01-15T08:00:00Z", "2027-01-15T08:30:00Z", status="False")]) is None


class InPlaceIO(FakeIO):
    """Reads return the held objects themselves, as ``KubeAutoscalerIO`` reads the kopf indexes
    (``shared``); writes replace an object, as an index does on the next event. Every object handed
    out is kept with a copy taken then."""

    def __init__(self):
        super().__init__()
        self.handed: list[tuple[dict, dict]] = []

    def _hand(self, objs):
        self.handed += [(o, copy.deepcopy(o)) for o in objs]
        return objs

    def list_models(self, namespaces):
        return self._hand([m for m in self.models.values() if not namespaces or m["metadata"]["namespace"] in namespaces])

    def list_deployments(self, namespace, selector):
        return self._hand([d for d in self.deployments.values() if self._match(d, selector)])

    def list_pods(self, namespace, selector):
        return self._hand([p for p in self.pods.values() if self._match(p, selector)])

    def patch_scale(self, namespace, name, replicas):
        self.scale_writes.append((name, replicas))
        d = self.deployments[name]
        self.deployments[name] = {**d, "spec": {**d["spec"], "replicas": replicas}}

    def patch_serving_status(self, namespace, name, updates):
        m = self.models[name]
        merged = merge_serving(m["status"]["serving"], updates)
        self.status_writes.append((name, copy.deepcopy(updates)))
        if merged is not None:
            self.models[name] = {**m, "status": {**m["status"], "serving": merged}}


def test_a_pass_changes_nothing_it_reads_so_the_cache_is_read_in_place(servers):
    """The operator's autoscaler reads the kopf indexes' objects without copying them: no pass may
    change one (scale-ups, status writes, events, missing metrics, the forecast)."""
    io = InPlaceIO()
    up = setup(io, servers, 2)
    for s in up:
        s.set(kv=0.95)
    quiet = setup(io, servers, 2, model="m2")
    quiet[0].set(kv=0.1)
    quiet[1].page = "# no vLLM metrics here\n"
    a = scaler(io)
    for i in range(4):
        a.run_once(T0 + 15 * i)
    assert io.scale_writes and io.status_writes and io.events  # the pass wrote, through the IO only
    assert len(io.handed) > 12
    assert all(obj == then for obj, then in io.handed)
