"""Scale from zero: the activator holds a request for a model at zero replicas while one replica
starts, then passes it on (docs/routing.md, "Scale from zero").

Why an activator and not the endpoint picker: the EPP (Gateway API Inference Extension v1.1.0)
answers a request for a pool with no ready pod with an error at once; it has no hook that holds a
request or asks for capacity. So, as Knative does, a small HTTP component sits in the path while a
model can be at zero: its own Deployment of 2 replicas (activator_main.py, the chart's
``<release>-activator``), out of the operator's failure domain, so a request held while the
operator's leader dies is still answered; it needs no leadership (it holds requests and wakes a
variant, both safe from several replicas). The operator's ``atzero.py`` points the model's own
Service at it (an extra EndpointSlice) while the model has no more than one ready serving pod, so
the user's URL reaches it at zero.

Which model a request is for, and whether it reached the activator for that model (``admission``,
docs/routing.md "Tenants kept apart"): a client that can connect to the activator chooses every
header it sends, the ``Host`` included, so neither alone is proof.

- ``X-Fewerbits-Model: <namespace>/<model>; token=<token>``: the model's HTTPRoute sets it on every
  request through the gateway (serving/gatewayroute.py); the request is served only when the value
  is exactly what that route, read from the API server, sets (``gatewayroute.header_proves``). Only
  who can read the route in the model's namespace knows the token. A header without a valid token
  is refused; it is never read as a plain model name.
- otherwise the ``Host`` the model's Service was called by, ``<model>.<namespace>.svc[...]``:
  with tenant ports (``FEWERBITS_ACTIVATOR_TENANT_PORTS``, the chart's default), only on the port of
  the model's own namespace, where the operator points that namespace's Services at zero
  (atzero.py) and where the chart's NetworkPolicy admits only that namespace and the gateway; never
  on the main port. Without tenant ports (a process run by hand, ``activator.tenantPorts.enabled:
  false``) a Host is taken as it comes: no tenant is kept apart on the Service path.

Every refusal is the same 404 (``NOT_SERVED``): "no such model" and "not yours" cannot be told apart.
Then:

1. a ready serving pod exists: forward to it at once;
2. otherwise the request waits, bounded in count per model (``activator_queue``) and in time
   (``activator_timeout_seconds``); past either it is answered 503 with ``Retry-After``, as it is
   when the API server does not answer the reads (restarting, its watches broken meanwhile) or
   the chosen pod does not accept the connection (gone with its node): nothing was sent, so the
   client may send it again; a failure once the request was sent is a 502;
3. the first waiting request wakes the model: one variant (the first of the plan with a
   Deployment) goes from 0 to 1 replica through the scale subresource, written conditionally on
   the scale's resourceVersion and only while it is at 0 (two replicas waking at once write once;
   a wake never lowers a count the autoscaler raised), with an event ``ScaledFromZero``;
4. the waiting requests are forwarded as soon as a pod is ready, and the answer is passed back as
   it arrives (server-sent events of ``stream: true`` chunk by chunk, never buffered whole).

What a request reads (the model, its serving pods, its Deployments for a wake) comes, with a
``cache`` (activator_cache.py, what activator_main.py runs), from watches of the namespaces served:
no API call at steady state, and a held request waits for a change of its model's objects, signalled
by the watch, not a LIST every ``poll`` seconds. Without one (``cache=None``), or for a namespace
whose watches have not listed yet or are broken, it reads through the API as it did: a GET of the
model and a LIST of its pods per request, and a LIST every ``poll`` seconds while held.

Prometheus metrics: ``fewerbits_activator_wakes_total``, ``fewerbits_activator_hold_seconds``,
``fewerbits_activator_rejected_total{reason=queue|timeout}``, ``fewerbits_activator_waiting``,
``fewerbits_activator_api_calls_total{verb,resource}`` (activator_cache.count_api_calls).
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Iterator, Literal

from prometheus_client import Counter, Gauge, Histogram

from fewerbits_operator.base.kube import Kube
from fewerbits_operator.runtime.activator_cache import ActivatorCache
from fewerbits_operator.serving.gatewayroute import (
    MODEL_HEADER,
    ModelClaim,
    header_proves,
    parse_model_header,
    route_model_header,
)
from fewerbits_operator.serving.render import LABEL_COMPONENT, LABEL_MODEL, VLLM_PORT

log = logging.getLogger("fewerbits.activator")

SCALED_FROM_ZERO = "ScaledFromZero"
RETRY_AFTER_SECONDS = 5

WAKES = Counter("fewerbits_activator_wakes_total",
                "Variants the activator scaled from 0 to 1 replica (conditional writes that took effect)")
HOLD_SECONDS = Histogram("fewerbits_activator_hold_seconds",
                         "How long a request waited in the activator for a ready replica (served or not)",
                         buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600))
REJECTED = Counter("fewerbits_activator_rejected_total",
                   "Requests answered 503 with Retry-After: the per-model queue was full (queue), no "
                   "replica became ready in time (timeout), the Kubernetes API did not answer (api), or the "
                   "replica did not accept the connection (unreachable)", ["reason"])
WAITING = Gauge("fewerbits_activator_waiting", "Requests waiting in the activator for a ready replica")
for _r in ("queue", "timeout", "api", "unreachable"):
    REJECTED.labels(_r)

Body = bytes | Iterable[bytes]
"""A whole body, or chunks passed on as they arrive (a streamed completion)."""
Response = tuple[int, dict[str, str], Body]
HOST = re.compile(r"^(?P<name>[a-z0-9]([-a-z0-9]*[a-z0-9])?)\.(?P<ns>[a-z0-9]([-a-z0-9]*[a-z0-9])?)\.svc(\.|:|$)")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}


def host_model(host: str | None) -> tuple[str, str] | None:
    """(namespace, name) of the model whose Service the ``Host`` names, or None."""
    m = HOST.match((host or "").lower())
    return (m.group("ns"), m.group("name")) if m else None


@dataclass(frozen=True)
class Admitted:
    """The request is served for this model (by: how it showed it came for it)."""

    namespace: str
    name: str
    by: Literal["route", "tenant port", "host"]


@dataclass(frozen=True)
class Refused:
    """Named a model without proof that it came for it: the uniform 404, whatever the reason."""

    why: str
    """For tests and the debug log only; never sent (the answer is NOT_SERVED)."""


UNNAMED = "unnamed"
"""Neither a model header nor a model Service's Host: /healthz, or a 400."""
Admission = Admitted | Refused | ModelClaim | Literal["unnamed"]
"""A ModelClaim is admitted only if the model's route sets exactly it (Activator.route_is_proof)."""


def admission(host: str | None, header: str | None, *, tenant: str | None, isolated: bool) -> Admission:
    """Which model a request may be served, from what reached the activator (pure).

    ``tenant``: the namespace whose tenant port the request arrived on (None: the main port);
    ``isolated``: whether this activator keeps tenants apart (it has tenant ports). The model
    header, when present, is the request's only claim: with a well-formed token it is returned to
    be checked against the route, else refused (it never falls back to the Host, nor is it read as
    a plain model name)."""
    if header is not None and header.strip():
        claim = parse_model_header(header)
        return claim if claim is not None else Refused("the model header carries no route token")
    key = host_model(host)
    if key is None:
        return UNNAMED
    if not isolated:
        return Admitted(*key, "host")
    if tenant is None:
        return Refused("a Host on the main port: it is no proof (a client chooses it)")
    if key[0] != tenant:
        return Refused(f"a Host of namespace {key[0]} on the tenant port of {tenant}")
    return Admitted(*key, "tenant port")


def ready_pod(pods: list[dict[str, Any]]) -> str | None:
    """`ip:port` of a ready serving pod, or None."""
    for p in pods:
        st = p.get("status") or {}
        if (p.get("metadata") or {}).get("deletionTimestamp") or not st.get("podIP"):
            continue
        if any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []):
            return f"{st['podIP']}:{VLLM_PORT}"
    return None


def variant_to_wake(model: dict[str, Any], deployments: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The Deployment to bring from zero: the first variant of the plan that has one (the planner
    lists its variants best first), else the first Deployment; None when one already has replicas."""
    if any(int((d.get("spec") or {}).get("replicas") or 0) > 0 for d in deployments):
        return None
    order = [v.get("pool") for v in (((model.get("status") or {}).get("plan") or {}).get("variants") or [])]
    by_variant = {(d["metadata"].get("labels") or {}).get("fewerbits.io/variant"): d for d in deployments}
    for pool in order:
        if pool in by_variant:
            return by_variant[pool]
    return deployments[0] if deployments else None


REWAKE_SECONDS = 5.0
ROUTE_PROOF_SECONDS = 10.0
"""How long a route read proves the claims it matches: at most one GET per model and replica in
this period while its requests come through the gateway. A route rewritten keeps its token
(atzero.py), so a cached value is not outdated by a backend switch."""
ROUTE_REREAD_SECONDS = 2.0
"""A claim the last read did not prove is checked against the API again only after this long: a
client sending made-up tokens costs at most one GET per model named and this period."""
ROUTE_CACHE_MAX = 4096
"""Models whose route is remembered; past it the oldest reads are forgotten (claims name any model)."""
NOT_SERVED = ("no model is served to this request here. A model is reached through its own Service "
              "(Host <model>.<namespace>.svc) from its own namespace, or through its HTTPRoute, which alone sets "
              f"{MODEL_HEADER} (docs/routing.md, \"Tenants kept apart\")")
"""The one answer to every request that names a model it may not be served (no such model, another
namespace's, a header without the route's token): an existence oracle across namespaces has nothing
to compare."""


@dataclass
class ModelGate:
    """The requests waiting for one model, and whether a wake-up was asked."""

    waiting: int = 0
    woke_at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Activator:
    def __init__(self, kube: Kube, *, queue: int = 100, timeout: float = 300.0, poll: float = 0.5,
                 forward: Callable[[str, str, str, bytes, dict[str, str]], Response] | None = None,
                 tenant_ports: dict[str, int] | None = None, clock: Callable[[], float] = time.monotonic,
                 cache: ActivatorCache | None = None):
        self.kube = kube
        self.cache = cache
        """Watch-fed reads (activator_cache.py); None: every read goes to the API server (the
        behaviour before it, the baseline of bench/activator_burst.py)."""
        self.tenant_ports = dict(tenant_ports) if tenant_ports is not None else None
        """Namespace -> the port where its Services at zero reach this activator (activator_main.py
        listens on each); None: no tenant is kept apart on the Service path (``admission``)."""
        self.clock = clock
        self._routes: dict[tuple[str, str], tuple[str | None, float]] = {}
        """(namespace, name) -> (the model header its route sets, or None; when it was read)."""
        self.queue = queue
        self.timeout = timeout
        self.poll = poll
        self.forward = forward or forward_http
        self._gates: dict[tuple[str, str], ModelGate] = {}
        self._lock = threading.Lock()
        self.woken = 0
        """Wake-ups asked (a counter for tests and metrics)."""
        self._in_flight = 0
        self._idle = threading.Condition()
        self.draining = False
        """Set on SIGTERM (activator_main.py): /healthz answers 503, held requests are still answered."""

    # ------------------------------------------------------------ draining (SIGTERM)

    def begin(self) -> None:
        """A request arrived (held, forwarded or streamed until its last byte)."""
        with self._idle:
            self._in_flight += 1

    def end(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    @property
    def in_flight(self) -> int:
        with self._idle:
            return self._in_flight

    def drain(self, timeout: float) -> int:
        """Wait (at most ``timeout`` s) until no request is held or being answered here, while the
        server keeps serving them: a replica shutting down (a rolling update, a drained node) loses
        none of the requests it holds. Its pod leaves the activator
        Service's ready endpoints as it terminates, so new requests reach the other replica.
        Returns how many requests were still in flight when it gave up (0: drained)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            return self._in_flight

    def gate(self, key: tuple[str, str]) -> ModelGate:
        with self._lock:
            return self._gates.setdefault(key, ModelGate())

    def cached(self, ns: str) -> bool:
        """Whether this namespace's reads come from the cache (its watches listed, none broken)."""
        return self.cache is not None and self.cache.serves(ns)

    def model(self, ns: str, name: str) -> dict[str, Any] | None:
        """The model (read only), from the cache; else a GET, and a model found so starts the
        cache's watches of its namespace (a made-up name finds none, and starts nothing)."""
        if self.cached(ns):
            assert self.cache is not None
            return self.cache.model(ns, name)
        model = self.kube.get_model(ns, name)
        if model is not None and self.cache is not None:
            self.cache.watch_namespace(ns)
        return model

    def pods(self, ns: str, name: str) -> list[dict[str, Any]]:
        if self.cached(ns):
            assert self.cache is not None
            return self.cache.serving_pods(ns, name)
        return self.kube.list_pods(ns, f"{LABEL_MODEL}={name},{LABEL_COMPONENT}=server")

    def deployments(self, ns: str, name: str) -> list[dict[str, Any]]:
        if self.cached(ns):
            assert self.cache is not None
            return self.cache.deployments(ns, name)
        return self.kube.list_deployments(ns, f"{LABEL_MODEL}={name}")

    def wake(self, ns: str, name: str, model: dict[str, Any]) -> str | None:
        """Scale one variant from zero (once per wait). Returns what it did, for the log."""
        # From the cache a Deployment may lag a wake of ours by the watch's delay: harmless, the
        # write below reads the scale at the API server and is made only from 0.
        deps = self.deployments(ns, name)
        dep = variant_to_wake(model, deps)
        if dep is None:
            return None
        dname = dep["metadata"]["name"]
        # Conditional: only from 0, at the resourceVersion read (another activator replica, or the
        # autoscaler, may have written meanwhile: then this write is refused and nothing is lost).
        if not self.kube.wake_scale(ns, dname):
            return None
        self.woken += 1
        WAKES.inc()
        msg = f"a request arrived while every variant was at zero replicas: Deployment {dname} scaled 0->1"
        self.kube.post_event(model, "Normal", SCALED_FROM_ZERO, msg)
        log.info("%s/%s: %s", ns, name, msg)
        return dname

    @property
    def isolated(self) -> bool:
        return self.tenant_ports is not None

    def route_is_proof(self, claim: ModelClaim) -> bool:
        """Whether the model's own HTTPRoute sets exactly this claim (gatewayroute.header_proves),
        from a read kept ROUTE_PROOF_SECONDS; a claim it does not prove is read again only after
        ROUTE_REREAD_SECONDS. A failed read proves nothing (and is logged without the claim)."""
        key, now = (claim.namespace, claim.name), self.clock()
        with self._lock:
            cached = self._routes.get(key)
        if cached is not None:
            value, read_at = cached
            if now - read_at < ROUTE_PROOF_SECONDS and header_proves(claim, value):
                return True
            if now - read_at < ROUTE_REREAD_SECONDS:
                return False
        try:
            route = self.kube.get_http_route(*key)
            value = route_model_header(route)
        except Exception as e:  # noqa: BLE001 - RBAC, the CRD not served, the API down: no proof
            log.warning("the HTTPRoute %s/%s could not be read to check a request's route token: %s",
                        *key, type(e).__name__)
            value = None
        with self._lock:
            if len(self._routes) >= ROUTE_CACHE_MAX:
                for k in sorted(self._routes, key=lambda k: self._routes[k][1])[:ROUTE_CACHE_MAX // 4]:
                    del self._routes[k]
            self._routes[key] = (value, now)
        return header_proves(claim, value)

    def admit(self, headers: dict[str, str], tenant: str | None = None) -> Admitted | Refused | Literal["unnamed"]:
        """``admission``, with a route claim checked against the route."""
        adm = admission(headers.get("host"), headers.get(MODEL_HEADER.lower()), tenant=tenant, isolated=self.isolated)
        if isinstance(adm, ModelClaim):
            if self.route_is_proof(adm):
                return Admitted(adm.namespace, adm.name, "route")
            return Refused("the model header is not what the model's route sets")
        return adm

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes,
               tenant: str | None = None) -> Response:
        """One request, as it arrived: ``tenant`` is the namespace whose tenant port it came in on
        (None: the main port)."""
        adm = self.admit(headers, tenant)
        if adm == UNNAMED and path == "/healthz":  # the kubelet's probes (Host: the pod's IP)
            return (503, {}, b"draining") if self.draining else (200, {}, b"ok")
        if adm == UNNAMED:
            return error(400, "the request names no model: call the model's Service (Host <model>.<namespace>.svc) "
                              "or its HTTPRoute through the gateway")
        if isinstance(adm, Refused):
            log.debug("refused: %s", adm.why)
            return error(404, NOT_SERVED)
        assert isinstance(adm, Admitted)
        key = ns, name = adm.namespace, adm.name
        try:
            model = self.model(ns, name)
            target = ready_pod(self.pods(ns, name)) if model is not None else None
        except Exception as e:  # noqa: BLE001 - the API server restarting (its watches broken meanwhile)
            log.warning("%s/%s: the API server did not answer (%s): 503", ns, name, type(e).__name__)
            REJECTED.labels("api").inc()
            return error(503, "the activator cannot read the model now: the Kubernetes API did not answer",
                         {"Retry-After": str(RETRY_AFTER_SECONDS)})
        if model is None:
            return error(404, NOT_SERVED)
        if target is None and not ((model.get("status") or {}).get("autoscaling") or {}).get("enabled"):
            # Replicas come from spec.serving.replicas: reconcile would undo a wake-up.
            return error(503, f"{ns}/{name} has no ready replica and autoscaling is off: nothing to wake "
                              "(raise spec.serving.replicas or enable autoscaling with minReplicas 0)")
        if target is None:
            g = self.gate(key)
            with g.lock:
                if g.waiting >= self.queue:
                    REJECTED.labels("queue").inc()
                    return error(503, f"{ns}/{name} is starting and {g.waiting} requests already wait for it",
                                 {"Retry-After": str(RETRY_AFTER_SECONDS)})
                g.waiting += 1
            WAITING.inc()
            t0 = time.monotonic()
            try:
                target = self._wait(ns, name, model, g)
            finally:
                with g.lock:
                    g.waiting -= 1
                WAITING.dec()
                HOLD_SECONDS.observe(time.monotonic() - t0)
            if target is None:
                REJECTED.labels("timeout").inc()
                return error(503, f"{ns}/{name}: no replica became ready within {self.timeout:.0f}s; "
                                  "it is still starting", {"Retry-After": str(RETRY_AFTER_SECONDS)})
        # The route's token is for the activator alone: the serving pod is not told it.
        fwd = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != MODEL_HEADER.lower()}
        return self.forward(method, f"http://{target}{path}", target, body, fwd)

    def _wait(self, ns: str, name: str, model: dict[str, Any], g: ModelGate) -> str | None:
        """Wait for a ready pod: on the cache's change signal when the namespace is cached (the
        version is read before the pods, so a change between the two is not missed), else a LIST
        every ``poll`` seconds. Either way the wake is asked again every REWAKE_SECONDS."""
        deadline = time.monotonic() + self.timeout
        while (left := deadline - time.monotonic()) > 0:
            with g.lock:
                # One wake per wait, asked again every REWAKE_SECONDS: a no-op while a variant has
                # replicas (variant_to_wake), a new wake if the model fell back to zero meanwhile.
                ask = g.woke_at is None or time.monotonic() - g.woke_at > min(self.timeout, REWAKE_SECONDS)
                if ask:
                    g.woke_at = time.monotonic()
            if ask:
                try:
                    self.wake(ns, name, model)
                except Exception as e:  # noqa: BLE001 - a failed write is retried on the next wait
                    log.warning("%s/%s: scale from zero failed: %s", ns, name, e)
                    with g.lock:
                        g.woke_at = None
            seen = self.cache.version(ns, name) if self.cache is not None and self.cached(ns) else None
            try:
                target = ready_pod(self.pods(ns, name))
            except Exception as e:  # noqa: BLE001 - the API server restarting: the wait goes on
                log.warning("%s/%s: listing its pods failed (%s); still waiting", ns, name, type(e).__name__)
                target, seen = None, None
            if target:
                with g.lock:
                    g.woke_at = None
                return target
            if seen is not None and self.cache is not None:
                self.cache.wait_for_change(ns, name, seen, min(left, REWAKE_SECONDS))
            else:
                time.sleep(self.poll)
        return None


def error(code: int, message: str, extra: dict[str, str] | None = None) -> Response:
    body = json.dumps({"error": {"message": message, "type": "fewerbits_activator", "code": code}}).encode()
    return code, {"Content-Type": "application/json", **(extra or {})}, body


CHUNK = 64 * 1024
LISTEN_BACKLOG = 1024
"""Connections waiting to be accepted: a burst of held requests connects at once, and past the
socketserver default of 5 a connection's SYN is dropped and retried by the client after 1 s."""


def forward_http(method: str, url: str, target: str, body: bytes, headers: dict[str, str]) -> Response:
    """Send the request to the pod; the answer's body is an iterator that yields what the pod has
    sent as soon as it arrives (``read1``), so server-sent events pass through one by one."""
    path = url.split(target, 1)[1] or "/"
    host, _, port = target.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        conn.connect()
    except OSError as e:
        # Nothing was sent: the pod is gone (its node deleted, killed) or not listening yet. The
        # client may send it again, as to a model still starting.
        conn.close()
        REJECTED.labels("unreachable").inc()
        return error(503, f"the replica at {target} did not accept the connection ({e}); retry",
                     {"Retry-After": str(RETRY_AFTER_SECONDS)})
    try:
        conn.request(method, path, body=body if method not in ("GET", "HEAD") else None, headers=headers)
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
        conn.close()  # sent: the pod may have acted on it, so it is not asked to be retried
        return error(502, f"forwarding to {target} failed: {e}")
    hdrs = {k: v for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP}
    return resp.status, {**hdrs, "X-Fewerbits-Endpoint": target}, _chunks(resp, conn)


def _chunks(resp: http.client.HTTPResponse, conn: http.client.HTTPConnection) -> Iterator[bytes]:
    try:
        while chunk := resp.read1(CHUNK):
            yield chunk
    finally:
        conn.close()


def serve(activator: Activator, port: int, host: str = "0.0.0.0", tenant: str | None = None) -> ThreadingHTTPServer:
    """Serve on ``port``: the main port, or ``tenant``'s tenant port (every request arriving on it
    is handled as arriving there: the port is what the namespace's Services point at, atzero.py)."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The status line and headers, then the body (or each chunk), are separate writes: with
        # Nagle's algorithm each small write after the first waits for the client's delayed ACK
        # (40 ms on Linux), measured by bench/activator_burst.py as 40 ms added to every answer.
        disable_nagle_algorithm = True

        def _any(self) -> None:
            activator.begin()
            try:
                self._answer()
            finally:
                activator.end()

        def _answer(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            code, hdrs, out = activator.handle(self.command, self.path, headers, body, tenant)
            self.send_response(code)
            for k, v in hdrs.items():
                self.send_header(k, v)
            if isinstance(out, (bytes, bytearray)):
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                return
            # Passed through as it arrives: HTTP/1.1 chunked, one chunk per read from the pod.
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for chunk in out:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            finally:
                close = getattr(out, "close", None)
                if close is not None:
                    close()

        do_GET = do_POST = do_PUT = do_DELETE = _any

        def log_message(self, *args: Any) -> None:  # requests are logged by handle, not per line
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = LISTEN_BACKLOG

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name=f"fewerbits-activator-{port}", daemon=True).start()
    return server
