"""The autoscaler on a multi-node variant: it reads metrics from the groups' leaders only and
writes the LeaderWorkerSet's scale subresource (replicas = groups)."""

from __future__ import annotations

import copy

import tests.unit.test_autoscaler_loop as _c
from tests.unit.test_autoscaler_loop import NS, T0, servers  # noqa: F401 — servers is a fixture


class LWSFakeIO(_c.FakeIO):
    def __init__(self, served=True):
        super().__init__()
        self.served = served
        self.lws: dict[str, dict] = {}
        self.lws_scale_writes: list[tuple[str, int]] = []

    def lws_available(self):
        return self.served

    def list_lws(self, namespace, selector):
        return [copy.deepcopy(d) for d in self.lws.values() if self._match(d, selector)]

    def read_lws_scale(self, namespace, name):
        d = self.lws.get(name)
        return None if d is None else d["spec"]["replicas"]

    def patch_lws_scale(self, namespace, name, replicas):
        self.lws_scale_writes.append((name, replicas))
        self.lws[name]["spec"]["replicas"] = replicas

    def add_group(self, model, pool, group, port):
        """One group: a leader serving /metrics and a headless worker (Ready, no HTTP)."""
        for idx, component in ((0, "server"), (1, "server-worker")):
            name = f"{model}-{pool}-{group}" + (f"-{idx}" if idx else "")
            self.pods[name] = {
                "metadata": {"name": name, "namespace": NS, "labels": {
                    "fewerbits.io/model": model, "fewerbits.io/variant": pool,
                    "app.kubernetes.io/component": component}},
                "spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": port}]
                                         if component == "server" else []}]},
                "status": {"phase": "Running", "podIP": "127.0.0.1" if component == "server" else "127.0.0.2",
                           "conditions": [{"type": "Ready", "status": "True"}]}}


def test_kv_pressure_on_leaders_scales_groups_through_the_lws_scale_subresource(servers):
    io = LWSFakeIO()
    io.add_model("big", {"enabled": True, "minReplicas": 1, "maxReplicas": 3}, pools=("h100-x8",))
    io.lws["big-h100-x8"] = {"metadata": {"name": "big-h100-x8", "namespace": NS, "labels": {
        "fewerbits.io/model": "big", "fewerbits.io/variant": "h100-x8"}}, "spec": {"replicas": 1}}
    (leader,) = servers(1)
    leader.set(kv=0.95)
    io.add_group("big", "h100-x8", 0, leader.port)
    out = _c.scaler(io).run_once(T0)
    assert io.lws_scale_writes == [("big-h100-x8", 2)]
    assert io.scale_writes == []  # no Deployment write
    assert out[0].decision.desired == 2
    # Only the leader was sampled: a worker scrape would have failed (nothing listens there).
    assert out[0].decision.avg_kv == 0.95


def test_without_the_lws_api_nothing_is_asked(servers):
    io = LWSFakeIO(served=False)
    io.add_model("big", {"enabled": True, "minReplicas": 1, "maxReplicas": 3}, pools=("h100-x8",))
    assert _c.scaler(io).run_once(T0) == []
    assert io.lws_scale_writes == []
