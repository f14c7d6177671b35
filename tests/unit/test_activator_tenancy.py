"""Tenants kept apart by the activator (activator.admission, docs/routing.md "Tenants kept apart"):
which requests are served, from what reached the activator: a model's route token (checked
against the route the API server holds), or a Service's Host on the tenant port of the model's own
namespace; every other request that names a model gets the same 404, plain or streamed, whatever
the reason (no existence oracle). The operator's half: a namespace's Services at zero point at its
tenant port (atzero.namespace_endpoints), found by name on the activator's Service.

The decision is pure and table-tested; the Activator then runs against an in-memory API (models,
their pods, their HTTPRoutes), and once through its own HTTP servers on a main and two tenant ports.
"""

from __future__ import annotations

import copy
import http.client
import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.runtime.activator import (
    NOT_SERVED,
    ROUTE_PROOF_SECONDS,
    ROUTE_REREAD_SECONDS,
    UNNAMED,
    Activator,
    Admitted,
    Refused,
    admission,
    serve,
)
from fewerbits_operator.runtime.atzero import (
    LABEL_SERVICE_NAME,
    ActivatorEndpoint,
    ZeroRouter,
    namespace_endpoints,
    tenant_port_name,
)
from fewerbits_operator.serving import gatewayroute as gr
from fewerbits_operator.serving.render import Owner
from tests.unit.test_atzero import FakeIO
from tests.unit.test_atzero import model as zero_model

A, B = "team-a", "team-b"
TOKEN_A, TOKEN_B = "A" * 43, "B" * 43
PORTS = {A: 8101, B: 8102}


def claim(ns: str, name: str, token: str) -> str:
    return f"{ns}/{name}; token={token}"


# ------------------------------------------------------------------ the decision (pure)


@pytest.mark.parametrize("host, header, tenant, isolated, want", [
    # Tenants kept apart (the chart's default): a Host counts only on its own namespace's port.
    ("m.team-b.svc:8000", None, B, True, Admitted(B, "m", "tenant port")),
    ("m.team-b.svc.cluster.local", None, B, True, Admitted(B, "m", "tenant port")),
    ("m.team-b.svc:8000", None, A, True, Refused),  # A's port naming B's model
    ("m.team-b.svc:8000", None, None, True, Refused),  # the main port: a Host there is anyone's
    # The header is the only claim when present: checked against the route, never a bare name.
    ("m.team-b.svc:8000", claim(B, "m", TOKEN_B), B, True, gr.ModelClaim(B, "m", TOKEN_B)),
    ("gw.example.com", claim(B, "m", TOKEN_B), None, True, gr.ModelClaim(B, "m", TOKEN_B)),
    ("gw.example.com", claim(B, "m", TOKEN_B), None, False, gr.ModelClaim(B, "m", TOKEN_B)),
    ("gw.example.com", f"{B}/m", None, False, Refused),  # the form before tokens: refused everywhere
    ("m.team-b.svc:8000", f"{B}/m", B, True, Refused),  # ... even with a Host that would pass
    ("gw.example.com", f"{B}/m; token=short", None, True, Refused),
    ("gw.example.com", f"{B}/M; token={TOKEN_B}", None, True, Refused),  # not a name
    # Nothing named: /healthz, or a 400.
    ("10.0.0.7:8082", None, None, True, UNNAMED),
    ("10.0.0.7:8082", "   ", A, True, UNNAMED),
    # No tenant ports (a process run by hand): a Host as it comes, on any port.
    ("m.team-b.svc:8000", None, None, False, Admitted(B, "m", "host")),
])
def test_admission(host, header, tenant, isolated, want):
    got = admission(host, header, tenant=tenant, isolated=isolated)
    if want is Refused:
        assert isinstance(got, Refused), got
    else:
        assert got == want


# ------------------------------------------------------------------ the activator on an in-memory API


class TenantKube:
    """Two namespaces, one model each (a ready pod, autoscaling on), B's behind an HTTPRoute."""

    def __init__(self):
        self.models = {(ns, "m"): {"metadata": {"name": "m", "namespace": ns, "uid": f"uid-{ns}"},
                                   "status": {"autoscaling": {"enabled": True, "minReplicas": 0}}} for ns in (A, B)}
        self.routes = {(ns, "m"): gr.render_http_route(Owner("m", ns, f"uid-{ns}"), {"name": "gw"}, gr.SERVICE, tok)
                       for ns, tok in ((A, TOKEN_A), (B, TOKEN_B))}
        self.route_gets: list[tuple[str, str]] = []
        self.fail_routes = False

    def get_model(self, ns, name):
        return copy.deepcopy(self.models.get((ns, name)))

    def list_pods(self, ns, selector):
        ip = {A: "10.0.1.1", B: "10.0.2.1"}[ns]
        ready = [{"type": "Ready", "status": "True"}]
        return [{"metadata": {"name": "p"}, "status": {"podIP": ip, "conditions": ready}}]

    def get_http_route(self, ns, name):
        self.route_gets.append((ns, name))
        if self.fail_routes:
            raise RuntimeError(f"403 Forbidden {claim(ns, name, 'x' * 40)}")
        return copy.deepcopy(self.routes.get((ns, name)))


def recording_forward(sent: list):
    def forward(method, url, target, body, headers):
        sent.append((target, dict(headers)))
        if json.loads(body or b"{}").get("stream"):
            return 200, {"Content-Type": "text/event-stream", "X-Fewerbits-Endpoint": target}, iter(
                [b'data: {"object": "chat.completion.chunk"}\n\n', b"data: [DONE]\n\n"])
        return 200, {"X-Fewerbits-Endpoint": target}, b'{"choices": [{}]}'
    return forward


def activator(kube=None, tenant_ports=PORTS, clock=None):
    sent: list = []
    act = Activator(kube or TenantKube(), poll=0.01, forward=recording_forward(sent), tenant_ports=tenant_ports,
                    **({"clock": clock} if clock else {}))
    return act, sent


PLAIN, STREAMED = b'{"model": "m"}', b'{"model": "m", "stream": true}'


def body_of(resp) -> bytes:
    out = resp[2]
    return out if isinstance(out, bytes) else b"".join(out)


@pytest.mark.parametrize("payload", [PLAIN, STREAMED], ids=["plain", "streamed"])
def test_a_namespace_reaches_its_own_model_through_its_port_and_its_route(payload):
    act, sent = activator()
    assert act.handle("POST", "/v1/chat/completions", {"host": "m.team-b.svc:8000"}, payload, B)[0] == 200
    via_route = {"host": "gw.example.com", "x-fewerbits-model": claim(B, "m", TOKEN_B)}
    for tenant in (None, B, A):  # the route's token holds on any port (a gateway reaches B's Service's port)
        code, _, out = act.handle("POST", "/v1/chat/completions", via_route, payload, tenant)
        assert code == 200 and (b"[DONE]" in b"".join(out) if payload == STREAMED else True)
    assert [t for t, _ in sent] == ["10.0.2.1:8000"] * 4
    # The route's token is the activator's alone: the serving pod is not sent it.
    assert all("x-fewerbits-model" not in {k.lower() for k in h} for _, h in sent)


@pytest.mark.parametrize("payload", [PLAIN, STREAMED], ids=["plain", "streamed"])
def test_a_client_of_another_namespace_gets_the_same_404_whatever_it_sends(payload):
    """A client in A, on A's port or the main port (all the chart's NetworkPolicy lets it reach),
    naming B's model every way it can: the same 404 body for each, the same as for a model that
    does not exist; B's pod is never reached."""
    act, sent = activator()
    tries = [
        ({"host": "m.team-b.svc:8000"}, A),
        ({"host": "m.team-b.svc:8000"}, None),
        ({"host": "m.team-b.svc.cluster.local"}, A),
        ({"host": "gw", "x-fewerbits-model": f"{B}/m"}, A),  # the header as it was before tokens
        ({"host": "gw", "x-fewerbits-model": claim(B, "m", "x" * 43)}, None),  # a made-up token
        ({"host": "gw", "x-fewerbits-model": claim(B, "m", TOKEN_A)}, A),  # A's own route's token
        ({"host": "m.team-b.svc:8000", "x-fewerbits-model": claim(A, "m", TOKEN_B)}, A),  # B's token, A's name
        ({"host": "m.team-b.svc:8000", "x-fewerbits-model": f"{B}/m"}, B),  # a bare header even on B's port
        ({"host": "nope.team-b.svc:8000"}, A),  # no such model
        ({"host": "gw", "x-fewerbits-model": claim(B, "nope", "x" * 43)}, None),  # no such model, no route
        ({"host": "nope.team-a.svc:8000"}, A),  # no such model in A's own namespace
    ]
    answers = {(json.dumps(h), t): act.handle("POST", "/v1/chat/completions", h, payload, t) for h, t in tries}
    assert {r[0] for r in answers.values()} == {404}, answers
    assert {body_of(r) for r in answers.values()} == {
        json.dumps({"error": {"message": NOT_SERVED, "type": "fewerbits_activator", "code": 404}}).encode()}
    assert sent == []


def test_a_route_is_read_at_most_once_per_period_whatever_is_claimed():
    now = [0.0]
    kube = TenantKube()
    act, _ = activator(kube, clock=lambda: now[0])
    good = {"host": "gw", "x-fewerbits-model": claim(B, "m", TOKEN_B)}
    forged = {"host": "gw", "x-fewerbits-model": claim(B, "m", "x" * 43)}
    for _ in range(20):
        assert act.handle("POST", "/v1/x", forged, b"")[0] == 404
    assert kube.route_gets == [(B, "m")]  # one read: the made-up tokens cost nothing more
    for _ in range(20):
        now[0] += 0.1
        assert act.handle("POST", "/v1/x", good, b"")[0] == 200  # proven by that read while it is kept
    assert kube.route_gets == [(B, "m")]
    now[0] += ROUTE_PROOF_SECONDS
    assert act.handle("POST", "/v1/x", good, b"")[0] == 200
    assert kube.route_gets == [(B, "m")] * 2  # read again once ROUTE_PROOF_SECONDS passed
    assert act.handle("POST", "/v1/x", forged, b"")[0] == 404
    assert len(kube.route_gets) == 2  # that read is fresh: no read for a made-up token
    now[0] += ROUTE_REREAD_SECONDS
    assert act.handle("POST", "/v1/x", forged, b"")[0] == 404
    assert len(kube.route_gets) == 3  # past ROUTE_REREAD_SECONDS a claim the read did not prove reads again
    now[0] += ROUTE_PROOF_SECONDS
    kube.routes[(B, "m")] = gr.render_http_route(Owner("m", B, "uid-b"), {"name": "gw"}, gr.SERVICE, "n" * 43)
    assert act.handle("POST", "/v1/x", good, b"")[0] == 404  # a new route's token: the old one no longer holds
    del kube.routes[(B, "m")]
    now[0] += ROUTE_PROOF_SECONDS
    assert act.handle("POST", "/v1/x", {"host": "gw", "x-fewerbits-model": claim(B, "m", "n" * 43)}, b"")[0] == 404


def test_a_route_that_cannot_be_read_proves_nothing_and_the_log_holds_no_token(caplog):
    kube = TenantKube()
    kube.fail_routes = True
    act, sent = activator(kube)
    with caplog.at_level(logging.DEBUG, logger="fewerbits.activator"):
        code, _, body = act.handle("POST", "/v1/x", {"host": "gw", "x-fewerbits-model": claim(B, "m", TOKEN_B)}, b"")
    assert code == 404 and sent == [] and json.loads(body)["error"]["message"] == NOT_SERVED
    assert "route token" in caplog.text and TOKEN_B not in caplog.text and "token=" not in caplog.text


def test_without_tenant_ports_a_host_is_taken_as_it_comes_but_a_header_still_needs_its_token():
    act, sent = activator(tenant_ports=None)
    assert not act.isolated
    assert act.handle("POST", "/v1/x", {"host": "m.team-b.svc:8000"}, b"")[0] == 200
    assert act.handle("POST", "/v1/x", {"host": "gw", "x-fewerbits-model": f"{B}/m"}, b"")[0] == 404
    assert act.handle("POST", "/v1/x", {"host": "gw", "x-fewerbits-model": claim(B, "m", TOKEN_B)}, b"")[0] == 200


def test_healthz_on_every_port_and_a_request_naming_nothing_is_a_400():
    act, _ = activator()
    for tenant in (None, A):
        assert act.handle("GET", "/healthz", {"host": "10.0.0.7:8082"}, b"", tenant)[0] == 200
        assert act.handle("GET", "/v1/models", {"host": "10.0.0.7:8082"}, b"", tenant)[0] == 400


# ------------------------------------------------------------------ through the activator's own HTTP servers


class Pod(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        stream = json.loads(self.rfile.read(n) or b"{}").get("stream")
        out = b"data: {}\n\ndata: [DONE]\n\n" if stream else b'{"choices": [{}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_the_port_a_request_arrives_on_is_its_namespace_plain_and_streamed():
    """The activator's main port and one port per namespace, as activator_main starts them: B's
    model by its Host only on B's port, by its route token on any."""
    pod = ThreadingHTTPServer(("127.0.0.1", 0), Pod)
    threading.Thread(target=pod.serve_forever, daemon=True).start()
    kube = TenantKube()
    kube.list_pods = lambda ns, sel: [{"metadata": {"name": "p"}, "status": {
        "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}]
    act = Activator(kube, poll=0.01, tenant_ports=PORTS)
    import fewerbits_operator.runtime.activator as mod
    port_of_pod = pod.server_address[1]
    servers = {None: serve(act, 0, "127.0.0.1")} | {ns: serve(act, 0, "127.0.0.1", tenant=ns) for ns in PORTS}
    original = mod.VLLM_PORT
    try:
        mod.VLLM_PORT = port_of_pod  # the pod's port on this machine

        def post(tenant, headers, payload):
            conn = http.client.HTTPConnection("127.0.0.1", servers[tenant].server_address[1], timeout=10)
            conn.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json", **headers})
            r = conn.getresponse()
            return r.status, r.read()
        for payload in (PLAIN, STREAMED):
            assert post(B, {"Host": "m.team-b.svc:8000"}, payload)[0] == 200
            assert post(None, {"X-Fewerbits-Model": claim(B, "m", TOKEN_B)}, payload)[0] == 200
            refused = {post(A, {"Host": "m.team-b.svc:8000"}, payload),
                       post(None, {"Host": "m.team-b.svc:8000"}, payload),
                       post(A, {"X-Fewerbits-Model": claim(B, "m", TOKEN_A)}, payload)}
            assert {code for code, _ in refused} == {404} and len(refused) == 1, refused
        assert b"[DONE]" in post(B, {"Host": "m.team-b.svc"}, STREAMED)[1]
    finally:
        mod.VLLM_PORT = original
        for s in servers.values():
            s.shutdown()
        pod.shutdown()


# ------------------------------------------------------------------ the operator's half (atzero.py)


def test_tenant_port_names_are_valid_service_port_names_of_their_own():
    names = {ns: tenant_port_name(ns) for ns in (A, B, "default", "x" * 63)}
    assert len(set(names.values())) == len(names)
    for n in names.values():  # IANA_SVC_NAME, as the API server checks a port's name
        assert len(n) <= 15 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", n) and re.search("[a-z]", n)
        assert "--" not in n


def activator_slices(tenant_ports: dict[str, int]) -> list[dict]:
    return [{"metadata": {"name": "act-x", "labels": {LABEL_SERVICE_NAME: "fewerbits-activator"}},
             "ports": [{"name": "http", "port": 8082}, {"name": "metrics", "port": 8080},
                       *({"name": tenant_port_name(ns), "port": p} for ns, p in tenant_ports.items())],
             "endpoints": [{"addresses": ["10.0.0.8"], "conditions": {"ready": True}}]}]


def test_a_namespaces_services_point_at_its_own_tenant_port():
    slices = activator_slices(PORTS)
    assert namespace_endpoints(slices, A) == [ActivatorEndpoint("10.0.0.8", 8101)]
    assert namespace_endpoints(slices, B) == [ActivatorEndpoint("10.0.0.8", 8102)]
    assert namespace_endpoints(slices, "elsewhere") == [ActivatorEndpoint("10.0.0.8", 8082)]  # no port of its own
    assert namespace_endpoints(activator_slices({}), A) == [ActivatorEndpoint("10.0.0.8", 8082)]


def test_the_loop_writes_each_namespaces_slice_on_its_tenant_port():
    ns_model = {}
    for ns in (A, "other"):
        m = zero_model(name="m")
        m["metadata"]["namespace"] = ns
        m["metadata"]["uid"] = f"uid-{ns}"
        ns_model[ns] = m
    io = FakeIO(list(ns_model.values()), [])
    io.activator = activator_slices({A: 8101})
    ZeroRouter(io, "fewerbits-system/fewerbits-activator").run_once()
    ports = {ns: [p["port"] for p in s["ports"]] for (ns, _), s in io.slices.items()}
    assert ports == {A: [8101], "other": [8082]}
    assert all(p["name"] == "http" for s in io.slices.values() for p in s["ports"])  # the model Service's port name


def test_tenant_ports_are_checked_at_start(monkeypatch):
    for k in ("FEWERBITS_ACTIVATOR_PORT", "FEWERBITS_METRICS_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FEWERBITS_ACTIVATOR_TENANT_PORTS", json.dumps(PORTS))
    assert OperatorSettings().activator_tenant_ports == PORTS
    for bad in ({A: 8101, B: 8101}, {A: 8082}, {"Not_A_Namespace": 8101}, {A: 70000}):
        monkeypatch.setenv("FEWERBITS_ACTIVATOR_TENANT_PORTS", json.dumps(bad))
        with pytest.raises(ValueError, match="activator.tenantPorts"):
            OperatorSettings()
    monkeypatch.delenv("FEWERBITS_ACTIVATOR_TENANT_PORTS")
    assert OperatorSettings().activator_tenant_ports is None
