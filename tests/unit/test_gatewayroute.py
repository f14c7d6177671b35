"""The model's HTTPRoute (spec.serving.gateway, gatewayroute.py): every branch of the pure route
function and of the change it asks for, the backend switch on the activator slice's own rule
(atzero.decide_route), and the loop against an in-memory fake of its I/O (two replicas converge,
nothing is written at rest, a route the model does not own is never touched)."""

from __future__ import annotations

import copy

import pytest

from fewerbits_api.conditions import Reason
from fewerbits_operator.runtime.atzero import ZeroRouter, decide_model, decide_route
from fewerbits_operator.serving import gatewayroute as gr
from fewerbits_operator.serving.render import Owner
from tests.unit.test_atzero import EP, NS, FakeIO, model, pod

OWNER = Owner("m", NS, "uid-m")


def gw_model(pool=True, gateway=None, **kw):
    """A model whose reconcile published its route (status.route)."""
    m = model(**kw)
    m["status"]["route"] = {"gateway": gateway or {"name": "inference-gw"}, "inferencePool": pool}
    return m


def route_of(m):
    return gr.published_route(m)


@pytest.mark.parametrize("pool_usable, in_path, want", [
    (True, False, gr.POOL),
    (True, True, gr.SERVICE),  # at zero or on the last pod: only the Service holds a request
    (False, False, gr.SERVICE),  # routing: service, or no pool of its own (CRD missing, a conflict)
    (False, True, gr.SERVICE),
])
def test_route_backend(pool_usable, in_path, want):
    assert gr.route_backend(pool_usable, in_path) == want


def test_published_route_is_read_from_status_only():
    assert route_of(gw_model(gateway={"name": "gw", "namespace": "edge"})).gateway.namespace == "edge"
    assert route_of(model()) is None
    bad = model()
    bad["status"]["route"] = {"gateway": {"name": "Not A Name"}}
    assert route_of(bad) is None
    spec_only = model()
    spec_only["spec"] = {"serving": {"gateway": {"name": "gw"}}}  # not yet resolved by reconcile
    assert route_of(spec_only) is None


TOKEN = "t" * 43


def test_render_names_the_gateway_and_one_backend():
    r = gr.render_http_route(OWNER, {"name": "gw"}, gr.POOL, TOKEN)
    assert r["apiVersion"] == "gateway.networking.k8s.io/v1" and r["kind"] == "HTTPRoute"
    assert r["metadata"]["name"] == "m" and r["metadata"]["ownerReferences"][0]["uid"] == "uid-m"
    assert r["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw",
                                        "namespace": NS}]  # the model's namespace by default
    assert r["spec"]["rules"] == [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],  # the CRD's defaults
                                   # the activator finds the model by it (a gateway keeps the client's Host)
                                   "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {
                                       "set": [{"name": "X-Fewerbits-Model", "value": f"{NS}/m; token={TOKEN}"}]}}],
                                   "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                    "name": "m", "port": 8000, "weight": 1}]}]
    s = gr.render_http_route(OWNER, {"name": "gw", "namespace": "edge", "sectionName": "https"}, gr.SERVICE)
    assert s["spec"]["parentRefs"][0] | {} == {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw",
                                              "namespace": "edge", "sectionName": "https"}
    assert s["spec"]["rules"][0]["backendRefs"] == [{"group": "", "kind": "Service", "name": "m", "port": 8000,
                                                     "weight": 1}]
    assert gr.current_backend(s) == "Service" and gr.current_backend(None) is None
    assert gr.current_backend({"spec": {"rules": []}}) is None


def test_the_model_header_is_what_the_activator_reads():
    route = gr.render_http_route(OWNER, {"name": "gw"}, gr.SERVICE, TOKEN)
    (f,) = route["spec"]["rules"][0]["filters"]
    (h,) = f["requestHeaderModifier"]["set"]
    assert h["name"] == "X-Fewerbits-Model" and gr.route_model_header(route) == h["value"]
    claim = gr.parse_model_header(h["value"])
    assert claim == gr.ModelClaim(NS, "m", TOKEN) and gr.route_proves(claim, route)
    assert gr.route_token(route, "uid-m") == TOKEN and gr.route_token(route, "someone-else") is None
    assert gr.route_token(gr.render_http_route(OWNER, {"name": "gw"}, gr.SERVICE), "uid-m") is None  # none: made


def test_the_loop_keeps_the_routes_token_across_rewrites_and_replicas():
    """A token is made once per route and then kept: a backend switch, a second replica (a new
    leader) and a restart rewrite nothing for it, so a request on its way with it is not refused."""
    io = RouteIO([gw_model()], [])
    made = iter(["a" * 43, "b" * 43, "c" * 43])
    a = ZeroRouter(io, "fewerbits-system/fewerbits-activator", new_token=lambda: next(made))
    a.run_once()
    token = gr.route_token(io.routes[(NS, "m")], "uid-m")
    assert token == "a" * 43
    io.pods = [pod("a"), pod("b")]
    b = ZeroRouter(io, "fewerbits-system/fewerbits-activator", new_token=lambda: next(made))
    b.run_once()  # the switch to the pool, by another replica
    assert gr.current_backend(io.routes[(NS, "m")]) == "InferencePool"
    assert gr.route_token(io.routes[(NS, "m")], "uid-m") == token and b.route_writes == 1
    stale = gr.render_http_route(OWNER, {"name": "gw"}, gr.POOL)  # a route from before tokens
    io.routes[(NS, "m")]["spec"] = stale["spec"]
    c = ZeroRouter(io, "fewerbits-system/fewerbits-activator", new_token=lambda: next(made))
    c.run_once()
    assert gr.route_token(io.routes[(NS, "m")], "uid-m") == "b" * 43  # given one, once


def test_route_change_create_keep_replace_conflict():
    desired = gr.render_http_route(OWNER, {"name": "gw"}, gr.POOL, TOKEN)
    assert gr.route_change(desired, None, "uid-m") == gr.RouteChange(create=desired)
    current = copy.deepcopy(desired)
    current["metadata"] |= {"resourceVersion": "5", "annotations": {"a": "b"}}
    current["status"] = {"parents": []}  # the gateway's, never compared
    assert gr.route_change(desired, current, "uid-m") == gr.RouteChange()
    switched = gr.render_http_route(OWNER, {"name": "gw"}, gr.SERVICE, TOKEN)
    ch = gr.route_change(switched, current, "uid-m")
    assert ch.replace["metadata"]["resourceVersion"] == "5" and ch.replace["metadata"]["annotations"] == {"a": "b"}
    assert ch.replace["spec"] == switched["spec"] and ch.create is None and not ch.conflict
    relabelled = copy.deepcopy(current)
    relabelled["metadata"]["labels"] = {}
    assert gr.route_change(desired, relabelled, "uid-m").replace is not None
    theirs = copy.deepcopy(current)
    theirs["metadata"]["ownerReferences"] = [{"uid": "someone-else"}]
    assert gr.route_change(desired, theirs, "uid-m") == gr.RouteChange(conflict=True)


def test_route_problem_names_the_field():
    reason, msg = gr.route_problem(False, None, OWNER)
    assert reason == Reason.ROUTING_UNAVAILABLE and "spec.serving.gateway" in msg and "httproutes" in msg
    theirs = {"metadata": {"ownerReferences": [{"uid": "x"}]}}
    reason, msg = gr.route_problem(True, theirs, OWNER)
    assert reason == Reason.HTTP_ROUTE_CONFLICT and "spec.serving.gateway" in msg and f"{NS}/m" in msg
    assert gr.route_problem(True, None, OWNER) is None
    assert gr.route_problem(True, {"metadata": {"ownerReferences": [{"uid": "uid-m"}]}}, OWNER) is None


def test_the_route_uses_the_pool_exactly_when_the_activator_slice_is_absent():
    """The same rule and facts as the Service's activator slice: for every pod count the route
    points at the Service iff the slice is (to be) there."""
    for pods in ([], [pod("a", ready=False)], [pod("a")], [pod("a"), pod("b", terminating=True)],
                 [pod("a"), pod("b")]):
        for eps in (EP, []):
            m = gw_model()
            slice_there = bool(decide_model(m, pods, eps, []).create)
            backend = gr.current_backend(decide_route(m, route_of(m), pods, eps, None).create)
            assert backend == ("Service" if slice_there else "InferencePool"), (pods, eps)
    m = gw_model(min_replicas=1)
    assert gr.current_backend(decide_route(m, route_of(m), [], EP, None).create) == "InferencePool"
    m = gw_model(pool=False)
    assert gr.current_backend(decide_route(m, route_of(m), [pod("a"), pod("b")], EP, None).create) == "Service"


class RouteIO(FakeIO):
    """FakeIO with HTTPRoutes kept as the API server keeps them (resourceVersions, conditional replace)."""

    def __init__(self, models, pods):
        super().__init__(models, pods)
        self.routes: dict[tuple[str, str], dict] = {}
        self.gets = 0

    def get_http_route(self, namespace, name):
        self.gets += 1
        return copy.deepcopy(self.routes.get((namespace, name)))

    def _keep(self, body):
        self.rv += 1
        self.writes += 1
        self.routes[(body["metadata"]["namespace"], body["metadata"]["name"])] = {
            **body, "metadata": {**body["metadata"], "resourceVersion": str(self.rv)}}

    def create_http_route(self, body):
        if (body["metadata"]["namespace"], body["metadata"]["name"]) not in self.routes:
            self._keep(body)

    def replace_http_route(self, body):
        cur = self.routes.get((body["metadata"]["namespace"], body["metadata"]["name"]))
        if cur is None or cur["metadata"]["resourceVersion"] != body["metadata"]["resourceVersion"]:
            return False
        self._keep(body)
        return True


def test_loop_switches_the_route_and_converges_across_two_replicas():
    io = RouteIO([gw_model()], [])
    a, b = (ZeroRouter(io, "fewerbits-system/fewerbits-activator") for _ in range(2))
    a.run_once()
    b.run_once()
    assert gr.current_backend(io.routes[(NS, "m")]) == "Service" and a.route_writes + b.route_writes == 1
    io.pods = [pod("a")]
    a.run_once()
    b.run_once()
    assert gr.current_backend(io.routes[(NS, "m")]) == "Service" and a.route_writes + b.route_writes == 1
    io.pods = [pod("a"), pod("b")]
    b.run_once()
    a.run_once()
    assert gr.current_backend(io.routes[(NS, "m")]) == "InferencePool" and a.route_writes + b.route_writes == 2


def test_loop_writes_nothing_unpublished_or_over_a_route_it_does_not_own():
    unresolved = model()
    unresolved["spec"] = {"serving": {"gateway": {"name": "gw"}}}  # reconcile published no route (no CRD, ...)
    io = RouteIO([unresolved], [])
    ZeroRouter(io, "fewerbits-system/fewerbits-activator").run_once()
    assert io.routes == {}
    io = RouteIO([gw_model()], [])
    theirs = {"metadata": {"name": "m", "namespace": NS, "resourceVersion": "1"}, "spec": {"rules": []}}
    io.routes[(NS, "m")] = copy.deepcopy(theirs)
    r = ZeroRouter(io, "fewerbits-system/fewerbits-activator")
    r.run_once()
    assert io.routes[(NS, "m")] == theirs and r.route_writes == 0
    io = RouteIO([model()], [])  # no gateway named: no route
    ZeroRouter(io, "fewerbits-system/fewerbits-activator").run_once()
    assert io.routes == {}


def test_at_rest_the_route_is_read_once_per_recheck_period_and_a_switch_is_at_once():
    from fewerbits_operator.runtime.atzero import ROUTE_RECHECK_SECONDS

    now = [0.0]
    io = RouteIO([gw_model()], [])
    r = ZeroRouter(io, "fewerbits-system/fewerbits-activator", clock=lambda: now[0])
    r.run_once()
    assert (io.gets, r.route_writes) == (1, 1)
    for _ in range(5):  # at rest, within the period: no read, no write
        now[0] += 2
        r.run_once()
    assert (io.gets, r.route_writes) == (1, 1)
    io.pods = [pod("a"), pod("b")]  # what is wanted changed: read and written at this pass
    r.run_once()
    assert (io.gets, r.route_writes) == (2, 2) and gr.current_backend(io.routes[(NS, "m")]) == "InferencePool"
    io.routes[(NS, "m")]["spec"]["rules"][0]["backendRefs"][0]["name"] = "edited-by-hand"
    now[0] += ROUTE_RECHECK_SECONDS  # a hand edit is repaired once the period is over
    r.run_once()
    assert io.gets == 3 and io.routes[(NS, "m")]["spec"]["rules"][0]["backendRefs"][0]["name"] == "m"
    io.models = []  # the model gone: forgotten
    r.run_once()
    assert r._routes_seen == {}
