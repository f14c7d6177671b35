"""The activator in the model's Service path (atzero.py): when the slice is there, what it says,
and that two replicas converge; the loop against an in-memory fake of its I/O."""

from __future__ import annotations

import copy

from fewerbits_api.quantizedmodel import EffectiveAutoscaling
from fewerbits_operator.runtime.atzero import (
    LABEL_MANAGED_BY,
    LABEL_SERVICE_NAME,
    MANAGED_BY,
    ActivatorEndpoint,
    ZeroRouter,
    activator_endpoints,
    activator_in_path,
    decide_model,
    render_slices,
)

NS = "llm"


def model(min_replicas=0, enabled=True, name="m"):
    auto = EffectiveAutoscaling.model_validate({"enabled": enabled, "minReplicas": min_replicas,
                                                "maxReplicas": 3}).to_wire()
    return {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
            "status": {"autoscaling": auto}}


def pod(name, ready=True, terminating=False):
    p = {"metadata": {"name": name, "labels": {"fewerbits.io/model": "m", "app.kubernetes.io/component": "server"}},
         "status": {"podIP": "10.1.0.5", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
    if terminating:
        p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return p


EP = [ActivatorEndpoint("10.0.0.9", 8082), ActivatorEndpoint("10.0.0.8", 8082)]


def test_in_path_while_it_may_reach_zero_and_has_at_most_one_ready_pod():
    assert activator_in_path(model(), [])
    assert activator_in_path(model(), [pod("a", ready=False)])  # waking: not ready yet
    assert activator_in_path(model(), [pod("a")])  # the last pod: the activator is already there
    assert activator_in_path(model(), [pod("a"), pod("b", terminating=True)])
    assert not activator_in_path(model(), [pod("a"), pod("b")])
    assert not activator_in_path(model(min_replicas=1), [])
    assert not activator_in_path(model(enabled=False), [])
    assert not activator_in_path({"metadata": {"name": "m"}, "status": {}}, [])  # nothing published


def test_the_slice_names_the_models_service_and_the_activator_port():
    (s,) = render_slices(model(), EP)
    assert s["metadata"]["labels"][LABEL_SERVICE_NAME] == "m"
    assert s["metadata"]["labels"][LABEL_MANAGED_BY] == MANAGED_BY  # not the EndpointSlice controller's
    assert s["ports"] == [{"name": "http", "port": 8082, "protocol": "TCP"}]  # the Service's port name
    assert [e["addresses"] for e in s["endpoints"]] == [["10.0.0.8"], ["10.0.0.9"]]
    assert s["addressType"] == "IPv4" and s["metadata"]["ownerReferences"][0]["uid"] == "uid-m"
    v6 = render_slices(model(), [ActivatorEndpoint("fd00::2", 8082), *EP])
    assert [x["addressType"] for x in v6] == ["IPv4", "IPv6"]


def test_activator_endpoints_are_the_ready_ones_of_its_own_service():
    slices = [{"ports": [{"name": "http", "port": 8082}],
               "endpoints": [{"addresses": ["10.0.0.8"], "conditions": {"ready": True}},
                             {"addresses": ["10.0.0.7"], "conditions": {"ready": False}}]},
              {"ports": [{"name": "metrics", "port": 8080}, {"name": "other", "port": 1}],
               "endpoints": [{"addresses": ["10.0.0.6"]}]}]
    assert activator_endpoints(slices) == [ActivatorEndpoint("10.0.0.8", 8082)]


def test_decide_creates_keeps_then_deletes():
    first = decide_model(model(), [], EP, [])
    assert len(first.create) == 1 and not first.replace and not first.delete
    current = [{**copy.deepcopy(first.create[0]), "metadata": {**first.create[0]["metadata"], "resourceVersion": "7"}}]
    assert decide_model(model(), [pod("a")], EP, current) == decide_model(model(), [], EP, current)
    assert not any(vars(decide_model(model(), [pod("a")], EP, current)).values())  # nothing to write
    moved = decide_model(model(), [], [ActivatorEndpoint("10.0.0.9", 8082)], current)
    assert moved.replace[0]["metadata"]["resourceVersion"] == "7"  # conditional on what was read
    gone = decide_model(model(), [pod("a"), pod("b")], EP, current)
    assert gone.delete == ((NS, "m-activator-8082", "7"),) and not gone.create
    assert decide_model(model(), [], [], current).delete  # no activator endpoint: not in the path


class FakeIO:
    """EndpointSlices with resourceVersions and conditional writes, as the API server keeps them."""

    def __init__(self, models, pods):
        self.models, self.pods = models, pods
        self.slices: dict[tuple[str, str], dict] = {}
        self.rv = 0
        self.writes = 0
        self.activator = [{"metadata": {"name": "fewerbits-activator-x", "labels": {
            LABEL_SERVICE_NAME: "fewerbits-activator"}}, "ports": [{"name": "http", "port": 8082}],
            "endpoints": [{"addresses": ["10.0.0.8"], "conditions": {"ready": True}}]}]

    def list_models(self, namespaces):
        return copy.deepcopy(self.models)

    def list_models_where(self, namespaces, where):
        self.filtered_lists = getattr(self, "filtered_lists", 0) + 1
        return [m for m in self.list_models(namespaces) if where(m)]

    def list_pods(self, namespace, selector):
        return copy.deepcopy(self.pods)

    def list_endpoint_slices(self, namespace, selector):
        if namespace == "fewerbits-system":
            return copy.deepcopy(self.activator)
        k, v = selector.split("=")
        return [copy.deepcopy(s) for (ns, _), s in self.slices.items()
                if ns == namespace and s["metadata"]["labels"].get(k) == v]

    def _store(self, body):
        self.rv += 1
        self.writes += 1
        self.slices[(body["metadata"]["namespace"], body["metadata"]["name"])] = {
            **body, "metadata": {**body["metadata"], "resourceVersion": str(self.rv)}}

    def create_endpoint_slice(self, body):
        if (body["metadata"]["namespace"], body["metadata"]["name"]) not in self.slices:
            self._store(body)

    def replace_endpoint_slice(self, body):
        cur = self.slices.get((body["metadata"]["namespace"], body["metadata"]["name"]))
        if cur is None or cur["metadata"]["resourceVersion"] != body["metadata"]["resourceVersion"]:
            return False
        self._store(body)
        return True

    def delete_endpoint_slice(self, namespace, name, resource_version):
        cur = self.slices.get((namespace, name))
        if cur is not None and cur["metadata"]["resourceVersion"] == resource_version:
            self.writes += 1
            del self.slices[(namespace, name)]


def test_two_replicas_converge_and_write_nothing_at_rest():
    io = FakeIO([model()], [])
    a, b = ZeroRouter(io, "fewerbits-system/fewerbits-activator"), ZeroRouter(io, "fewerbits-system/fewerbits-activator")
    a.run_once()
    b.run_once()
    assert list(io.slices) == [(NS, "m-activator-8082")] and io.writes == 1
    a.run_once()
    b.run_once()
    assert io.writes == 1  # at rest: no write from either
    io.pods = [pod("a"), pod("b")]  # two ready pods: out of the path
    b.run_once()
    a.run_once()
    assert io.slices == {} and io.writes == 2
    assert a.passes == 3 and b.passes == 3


def test_a_pass_copies_only_the_models_it_keeps_something_for():
    # Between full passes only models that may reach zero, or that still have activator slices,
    # are read out of the index; one that leaves "may reach zero" loses its slice at the next pass.
    from fewerbits_operator.runtime.atzero import FULL_PASS_EVERY

    io = FakeIO([model(), model(min_replicas=1, name="always-on")], [])
    seen = []
    io.list_models_where = lambda ns, where: seen.append(sorted(m["metadata"]["name"] for m in io.models
                                                                if where(m))) or [m for m in io.models if where(m)]
    r = ZeroRouter(io, "fewerbits-system/fewerbits-activator")
    r.run_once()  # the first pass reads every model (after a restart: slices left behind)
    assert seen == [] and list(io.slices) == [(NS, "m-activator-8082")]
    r.run_once()
    assert seen == [["m"]]  # "always-on" has nothing to keep: not copied
    io.models[0] = model(min_replicas=1)  # m no longer reaches zero, but it has a slice: still looked at
    r.run_once()
    assert seen[-1] == ["m"] and io.slices == {}
    r.run_once()
    assert seen[-1] == []
    while r.passes % FULL_PASS_EVERY:
        r.run_once()
    calls = len(seen)
    r.run_once()
    assert len(seen) == calls  # the full pass


def test_last_ready_at_is_when_the_latest_ready_pod_became_ready():
    """The autoscaler's keep-awake input (runner.last_woken): the activator forwards what it holds
    as soon as a pod is Ready, so a woken model's last held request left it then."""
    from datetime import datetime

    from fewerbits_operator.runtime.atzero import last_ready_at

    def at(p, when):
        p["status"]["conditions"][0]["lastTransitionTime"] = when
        return p
    early, late = at(pod("a"), "2026-01-01T00:00:00Z"), at(pod("b"), "2026-01-01T00:05:00Z")
    gone = at(pod("c", terminating=True), "2026-01-01T00:09:00Z")
    starting = at(pod("d", ready=False), "2026-01-01T00:08:00Z")
    assert last_ready_at([early, late, gone, starting]) == datetime.fromisoformat("2026-01-01T00:05:00+00:00").timestamp()
    assert last_ready_at([starting, gone]) is None
    assert last_ready_at([]) is None


def test_last_woken_reads_pods_only_for_a_model_that_may_reach_zero():
    from fewerbits_operator.runtime.runner import Operator

    class Kube:
        def __init__(self, m):
            self.m, self.selectors = m, []

        def get_model(self, ns, name):
            return self.m

        def list_pods(self, ns, selector):
            self.selectors.append(selector)
            p = pod("a")
            p["status"]["conditions"][0]["lastTransitionTime"] = "2026-01-01T00:00:00Z"
            return [p]

    op = Operator()
    op.kube = Kube(model(min_replicas=1))
    assert op.last_woken(NS, "m") is None and op.kube.selectors == []  # cannot reach zero: no read
    op.kube = Kube(model(min_replicas=0))
    assert op.last_woken(NS, "m") is not None
    assert op.kube.selectors == ["fewerbits.io/model=m,app.kubernetes.io/component=server"]
