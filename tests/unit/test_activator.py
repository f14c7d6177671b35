"""The scale-from-zero activator against a fake API: held while one variant wakes, then forwarded;
the queue and the wait are bounded (503 with Retry-After, counted); a model without autoscaling is
not woken; two activator replicas wake once; a streamed answer passes through chunk by chunk (a
real HTTP server as the pod, the activator's own HTTP server in front)."""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import REGISTRY

from e2e.procs import free_port

from fewerbits_operator.runtime.activator import Activator, host_model, serve, variant_to_wake


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

    def wake_scale(self, ns, name):
        # The API server's conditional write: only from 0 (one replica at the fake's scale).
        if any(n == name for _, n, _ in self.scaled):
            return False
        self.scaled.append((ns, name, 1))
        return True

    def post_event(self, obj, type_, reason, message):
        self.events.append(reason)


def echo(method, url, target, body, headers):
    return 200, {"X-Fewerbits-Endpoint": target}, url.encode()


HOST = {"host": "m.ns.svc.cluster.local:8000"}


def _rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("fewerbits_activator_rejected_total", {"reason": reason}) or 0.0


def test_model_from_host():
    """Which requests are served for it: tests/unit/test_activator_tenancy.py."""
    assert host_model("m.ns.svc.cluster.local:8000") == ("ns", "m")
    assert host_model("m.ns.svc:8000") == ("ns", "m")
    assert host_model("10.0.0.1:8000") is None
    assert host_model("example.com") is None


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
    before = _rejected("timeout")
    t0 = time.monotonic()
    code, hdrs, body = act.handle("POST", "/v1/x", HOST, b"")
    assert code == 503 and hdrs.get("Retry-After") and b"within" in body and time.monotonic() - t0 < 2
    assert _rejected("timeout") == before + 1


def test_the_queue_is_bounded():
    act = Activator(FakeKube(ready_after=None), queue=1, timeout=1.0, poll=0.01, forward=echo)
    first = threading.Thread(target=act.handle, args=("POST", "/v1/x", HOST, b""))
    first.start()
    deadline = time.monotonic() + 2
    while act.gate(("ns", "m")).waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    before = _rejected("queue")
    code, hdrs, body = act.handle("POST", "/v1/x", HOST, b"")
    first.join()
    assert code == 503 and hdrs.get("Retry-After") and b"already wait" in body
    assert _rejected("queue") == before + 1


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


def test_a_model_back_at_zero_while_requests_wait_is_woken_again(monkeypatch):
    from fewerbits_operator.runtime import activator as mod
    monkeypatch.setattr(mod, "REWAKE_SECONDS", 0.05)
    kube = FakeKube(ready_after=None)  # its Deployments stay at zero: as if scaled down again meanwhile
    act = Activator(kube, timeout=0.3, poll=0.01, forward=echo)
    kube.wake_scale = lambda ns, name: kube.scaled.append((ns, name, 1)) or True  # scaled down again each time
    code, _, _ = act.handle("POST", "/v1/chat/completions", HOST, b"{}")
    assert code == 503 and len(kube.scaled) >= 3  # woken again every REWAKE_SECONDS, not once per timeout


def test_two_activator_replicas_wake_the_model_once():
    kube = FakeKube()
    a, b = Activator(kube, poll=0.01, forward=echo), Activator(kube, poll=0.01, forward=echo)
    wakes = REGISTRY.get_sample_value("fewerbits_activator_wakes_total") or 0.0
    out = []
    threads = [threading.Thread(target=lambda x=x: out.append(x.handle("POST", "/v1/x", HOST, b"")[0])) for x in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [200, 200]
    assert kube.scaled == [("ns", "m-l4", 1)] and kube.events == ["ScaledFromZero"]
    assert a.woken + b.woken == 1
    assert REGISTRY.get_sample_value("fewerbits_activator_wakes_total") == wakes + 1


class StreamingPod:
    """A pod that sends server-sent events one at a time, each only after the test saw the last
    one arrive through the activator (so a buffering activator could never pass)."""

    def __init__(self, events: int):
        self.events = events
        self.sent = threading.Semaphore(0)
        self.go = threading.Semaphore(0)
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for i in range(outer.events):
                    self.wfile.write(f"data: {{\"n\": {i}}}\n\n".encode())
                    self.wfile.flush()
                    outer.sent.release()
                    if not outer.go.acquire(timeout=10):
                        return
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()


def test_a_streamed_answer_passes_through_event_by_event(monkeypatch):
    from fewerbits_operator.runtime import activator as mod

    pod = StreamingPod(events=3)
    monkeypatch.setattr(mod, "VLLM_PORT", pod.port)
    kube = FakeKube(ready_after=1)
    kube.scaled.append(("ns", "m-l4", 1))
    kube.list_pods = lambda ns, sel: [{"metadata": {"name": "p"}, "status": {
        "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}]
    srv = serve(Activator(kube, poll=0.01), 0, host="127.0.0.1")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=10)
        conn.request("POST", "/v1/chat/completions", body=b'{"stream": true}',
                     headers={"Host": "m.ns.svc:8000", "Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Transfer-Encoding") == "chunked"
        got = []
        for i in range(3):
            assert pod.sent.acquire(timeout=10)
            line = resp.fp.readline()  # the chunk-size line, then the event itself
            while not line.startswith(b"data:"):
                line = resp.fp.readline()
            got.append(line.strip())
            # The pod has not sent the next event yet: this one came through before the end.
            pod.go.release()
        assert got == [b'data: {"n": 0}', b'data: {"n": 1}', b'data: {"n": 2}']
        conn.close()
    finally:
        srv.shutdown()
        srv.server_close()
        pod.srv.shutdown()


class GatedKube(FakeKube):
    """The woken pod becomes ready only once the test opens ``ready``."""

    def __init__(self):
        super().__init__(ready_after=1)
        self.ready = threading.Event()
        self.polled = threading.Event()

    def list_pods(self, ns, selector):
        if self.scaled:
            self.polled.set()
        return super().list_pods(ns, selector) if self.ready.is_set() else []


def test_drain_waits_for_the_held_request_to_be_answered():
    """SIGTERM while a request is held: drain returns only once it has been forwarded and answered,
    so a replica shutting down (rolling update, failover) loses none of the requests it holds."""
    kube = GatedKube()
    act = Activator(kube, poll=0.01, forward=echo)
    server = serve(act, 0, "127.0.0.1")
    port = server.server_address[1]
    answered: list[int] = []

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=b"{}", headers={"Host": HOST["host"]})
        answered.append(conn.getresponse().status)

    t = threading.Thread(target=client)
    t.start()
    try:
        assert kube.polled.wait(10)  # held: woken, waiting for a ready pod
        assert act.in_flight == 1
        assert act.drain(0.05) == 1  # still held: a short drain gives up and says how many
        drained: list[int] = []
        d = threading.Thread(target=lambda: drained.append(act.drain(30)))
        d.start()
        assert drained == [] and answered == []  # nothing is answered while no pod is ready
        kube.ready.set()
        d.join(30)
        t.join(30)
        assert drained == [0] and answered == [200] and act.in_flight == 0
    finally:
        server.shutdown()
        server.server_close()


def test_drain_returns_at_once_when_nothing_is_held():
    act = Activator(FakeKube(), poll=0.01, forward=echo)
    assert act.in_flight == 0 and act.drain(0) == 0


def test_healthz_answers_the_probes_and_fails_readiness_once_draining():
    """The kubelet probes /healthz with the pod's IP as Host (no model): 200 while serving, 503 once
    SIGTERM set ``draining`` (activator_main.py), so the pod leaves the Service's ready endpoints
    while what it holds is still answered. A request naming a model is never taken for a probe."""
    act = Activator(FakeKube(), poll=0.01, forward=echo)
    assert act.handle("GET", "/healthz", {"host": "10.0.0.7:8082"}, b"")[:1] == (200,)
    act.draining = True
    assert act.handle("GET", "/healthz", {"host": "10.0.0.7:8082"}, b"")[:1] == (503,)
    assert act.handle("GET", "/metrics", {"host": "10.0.0.7:8082"}, b"")[0] == 400  # no model named
    code, _, body = act.handle("GET", "/healthz", HOST, b"")  # draining still: requests are still served
    assert code == 200 and body == b"http://10.0.0.7:8000/healthz" and act.woken == 1  # the model's, woken and forwarded


def test_the_server_takes_a_burst_and_answers_without_a_delayed_ack_stall():
    """A burst connects at once: the listen backlog is past socketserver's 5 (a SYN dropped is
    retried after 1 s). Headers, body and each chunk are separate writes: TCP_NODELAY, or each waits
    for the client's delayed ACK (40 ms an answer, bench/activator_burst.py)."""
    import socket

    srv = serve(Activator(FakeKube(), poll=0.01, forward=echo), 0, host="127.0.0.1")
    nodelay = []
    original = srv.RequestHandlerClass.setup

    def setup(self):
        original(self)
        nodelay.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    srv.RequestHandlerClass.setup = setup
    try:
        assert srv.request_queue_size >= 1024
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=10)
        conn.request("GET", "/healthz", headers={"Host": "10.0.0.7:8082"})
        assert conn.getresponse().read() == b"ok"
        conn.close()
        assert len(nodelay) == 1 and nodelay[0] != 0
    finally:
        srv.shutdown()
        srv.server_close()


class DownKube(FakeKube):
    """The API server restarting: every read fails as the kubernetes client fails (no ApiException)."""

    def get_model(self, ns, name):
        raise ConnectionRefusedError("[Errno 111] Connection refused")


def test_the_api_server_not_answering_is_a_503_with_retry_after_not_a_dropped_connection():
    before = _rejected("api")
    code, hdrs, body = Activator(DownKube(), poll=0.01, forward=echo).handle("POST", "/v1/x", HOST, b"")
    assert code == 503 and hdrs.get("Retry-After") and b"Kubernetes API did not answer" in body
    assert _rejected("api") == before + 1


def test_a_held_request_keeps_waiting_through_a_failed_pod_list():
    class Flaky(FakeKube):
        def list_pods(self, ns, selector):
            if self.lists == 1:  # the second list (in the wait) fails once
                self.lists += 1
                raise OSError("connection reset")
            return super().list_pods(ns, selector)

    kube = Flaky(ready_after=4)
    code, _, body = Activator(kube, poll=0.01, forward=echo).handle("POST", "/v1/x", HOST, b"")
    assert code == 200 and body == b"http://10.0.0.7:8000/v1/x" and kube.lists >= 4


def test_a_replica_that_refuses_the_connection_is_a_503_with_retry_after_and_one_that_fails_after_is_a_502():
    from fewerbits_operator.runtime.activator import forward_http

    port = free_port()  # nothing listens: the pod is gone
    before = _rejected("unreachable")
    code, hdrs, _ = forward_http("POST", f"http://127.0.0.1:{port}/v1/x", f"127.0.0.1:{port}", b"{}", {})
    assert code == 503 and hdrs.get("Retry-After") and _rejected("unreachable") == before + 1

    class Hangup(BaseHTTPRequestHandler):
        def do_POST(self):  # reads the request, then closes without an answer
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hangup)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = f"127.0.0.1:{server.server_address[1]}"
        code, hdrs, _ = forward_http("POST", f"http://{target}/v1/x", target, b"{}", {"Content-Length": "2"})
        assert code == 502 and "Retry-After" not in hdrs
    finally:
        server.shutdown()
