"""The model's own endpoint at zero replicas: its Service points at the activator (docs/routing.md,
"Through the model's Service at zero").

A model with ``autoscaling.minReplicas: 0`` may have no pod; a client that calls its Service (the
endpoint in status) must still be answered. As Knative does for a revision at zero, the activator
is put in the Service's data path, here by one extra **EndpointSlice** for the model's Service:

- labelled ``kubernetes.io/service-name: <model>`` (kube-proxy, and any gateway that resolves
  Services through EndpointSlices, merges every slice with that label, whoever manages it) and
  ``endpointslice.kubernetes.io/managed-by: activator.fewerbits.io`` (the EndpointSlice
  controller leaves slices it does not manage alone, so the Service keeps its selector and its
  own slice of pods);
- listing the activator's ready endpoints, copied from the slices of the activator's own Service
  (``FEWERBITS_ACTIVATOR_SERVICE``, ``<namespace>/<name>``, kept by the EndpointSlice controller:
  a dead operator replica leaves them there and so leaves this slice at the next pass), on the
  **model's namespace's tenant port** when the activator's Service has one (a port named
  ``tenant_port_name(<namespace>)``: the activator serves there, by Host, only models of that
  namespace, and the chart's NetworkPolicy lets only that namespace and the gateway reach it;
  docs/routing.md, "Tenants kept apart"), else on its port ``http``. The slice's port is named
  like the model Service's (``http``) either way.

When: while the model may reach zero (``status.autoscaling``: enabled, ``minReplicas: 0``) and
has at most one ready serving pod. So the activator is in the path **before** the last pod goes
(the last ready pod and the activator share the traffic; the activator forwards what it gets to
that pod), and leaves it only once a second pod is ready: there is no moment at which the Service
has no ready endpoint because of this switch, in either direction. The Service's selector is never
changed. Knative keeps its activator in the path of a revision with little spare capacity for the
same reason (``target-burst-capacity``).

The leader alone runs this loop (runner.start_leading; a standby writes nothing, and the activator
itself is its own Deployment, activator_main.py, that needs no leadership). A pass computes the
slice from the facts and writes only when it differs, conditionally on the resourceVersion it read
(a conflict, such as a write of the previous leader's still landing, is left to the next pass).

The same loop keeps the model's HTTPRoute when reconcile published one (``status.route``: the
effective ``spec.serving.gateway``, serving/gatewayroute.py): its backend is the model's Service
while the activator is in that Service's path (the rule above, the same facts), else the
InferencePool, so a request through the gateway at zero reaches the activator too. One writer for
the route: this loop.

Everything but ``ZeroRouter`` is pure.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Protocol

from fewerbits_api.quantizedmodel import PublishedRoute

from fewerbits_operator.autoscaler.loop import is_ready, published_autoscaling
from fewerbits_operator.runtime.periodic import run_periodically
from fewerbits_operator.serving import gatewayroute
from fewerbits_operator.serving.render import LABEL_COMPONENT, LABEL_MODEL, Owner

log = logging.getLogger("fewerbits.atzero")

ROUTE_RECHECK_SECONDS = 30.0
"""How long a replica trusts that a model's HTTPRoute is as it last saw it while what it wants is
unchanged: the route is read by GET (no index holds it), so at rest it is read once per this
period per model, not every pass; a change of the wanted backend is written at the next pass, and a
hand edit is repaired within this period."""

LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "activator.fewerbits.io"
"""A label value (no "/"), after the EndpointSlice controller's own `endpointslice-controller.k8s.io`."""
SERVICE_PORT_NAME = "http"
"""The model Service's port name (render.render_service): a slice's port must carry it."""
TENANT_PORT_PREFIX = "t-"


def tenant_port_name(namespace: str) -> str:
    """The name of the activator Service's port for ``namespace``'s Services at zero: ``t-`` and 12
    hex digits of the name's SHA-256 (a port name has at most 15 characters; a namespace's up to
    63). The chart names its ports the same way (templates/activator.yaml,
    ``fewerbits.activatorTenantPortName``; tests/unit/test_chart_networkpolicy.py compares them)."""
    return TENANT_PORT_PREFIX + hashlib.sha256(namespace.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ActivatorEndpoint:
    ip: str
    port: int


def activator_endpoints(slices: list[dict[str, Any]], port_name: str = SERVICE_PORT_NAME) -> list[ActivatorEndpoint]:
    """The ready endpoints of the activator's own Service, from its EndpointSlices, on the port
    named ``port_name`` (``http``, the chart's, for which a slice's single unnamed port also
    counts; or a namespace's tenant port)."""
    out: set[ActivatorEndpoint] = set()
    for s in slices:
        ports = s.get("ports") or []
        port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
        if port is None and len(ports) == 1 and not ports[0].get("name") and port_name == SERVICE_PORT_NAME:
            port = ports[0].get("port")
        if not port:
            continue
        for e in s.get("endpoints") or []:
            if (e.get("conditions") or {}).get("ready") is False:
                continue
            out |= {ActivatorEndpoint(a, int(port)) for a in e.get("addresses") or []}
    return sorted(out, key=lambda e: (e.port, e.ip))


def namespace_endpoints(slices: list[dict[str, Any]], namespace: str) -> list[ActivatorEndpoint]:
    """Where a model of ``namespace`` reaches the activator through its Service: the namespace's
    tenant port when the activator's Service has it (the activator then tells the namespace by the
    port a request arrived on, which a client cannot choose past the NetworkPolicy), else ``http``
    (an activator that keeps no tenants apart, or a namespace without a port: there the activator
    serves a request naming a model by Host only if it keeps no tenants apart)."""
    return activator_endpoints(slices, tenant_port_name(namespace)) or activator_endpoints(slices)


def may_reach_zero(model: dict[str, Any]) -> bool:
    auto = published_autoscaling(model)
    return auto is not None and auto.enabled and auto.minReplicas == 0


def ready_serving_pods(pods: list[dict[str, Any]]) -> int:
    return sum(1 for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")
               and (p.get("status") or {}).get("podIP") and is_ready(p))


def last_ready_at(pods: list[dict[str, Any]]) -> float | None:
    """When (epoch seconds) the most recently ready serving pod became ready, or None.

    The autoscaler's keep-awake input (``autoscaler.loop.keep_awake``): no scale-down to zero
    within ``scaleDownDelaySeconds`` of it. The activator answers what it holds as soon as a pod
    is ready (it polls every 0.5 s), so for a woken model this is when its last held request left
    the activator, read from the pods (API objects) since the activator runs in its own Deployment."""
    times = []
    for p in pods:
        if (p.get("metadata") or {}).get("deletionTimestamp"):
            continue
        for c in (p.get("status") or {}).get("conditions") or []:
            if c.get("type") == "Ready" and c.get("status") == "True" and c.get("lastTransitionTime"):
                times.append(_epoch(c["lastTransitionTime"]))
    return max(times) if times else None


def _epoch(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def activator_in_path(model: dict[str, Any], pods: list[dict[str, Any]]) -> bool:
    """Whether the model's Service must also point at the activator: it may reach zero and has no
    more than one ready serving pod (see the module docstring for why one, not zero)."""
    return may_reach_zero(model) and ready_serving_pods(pods) <= 1


def slice_name(model: str, port: int) -> str:
    return f"{model}-activator-{port}"


def render_slices(model: dict[str, Any], endpoints: list[ActivatorEndpoint]) -> list[dict[str, Any]]:
    """One EndpointSlice per activator port and address family (a slice has one of each), owned by
    the model (deleted with it)."""
    md = model["metadata"]
    groups: dict[tuple[int, str], list[str]] = {}
    for e in endpoints:
        family = "IPv6" if ipaddress.ip_address(e.ip).version == 6 else "IPv4"
        groups.setdefault((e.port, family), []).append(e.ip)
    out = []
    for (port, family), ips in sorted(groups.items()):
        out.append({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {
                "name": slice_name(md["name"], port) + ("-v6" if family == "IPv6" else ""),
                "namespace": md["namespace"],
                "labels": {LABEL_SERVICE_NAME: md["name"], LABEL_MANAGED_BY: MANAGED_BY, LABEL_MODEL: md["name"]},
                "ownerReferences": [{"apiVersion": model.get("apiVersion", "fewerbits.io/v1alpha1"),
                                     "kind": model.get("kind", "QuantizedModel"), "name": md["name"],
                                     "uid": md["uid"]}],
            },
            "addressType": family,
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True, "serving": True, "terminating": False}}
                          for ip in sorted(ips)],
            "ports": [{"name": SERVICE_PORT_NAME, "port": port, "protocol": "TCP"}],
        })
    return out


def _content(s: dict[str, Any]) -> Any:
    md = s.get("metadata") or {}
    return (md.get("labels"), s.get("addressType"), s.get("endpoints"), s.get("ports"),
            [(r.get("uid"), r.get("name")) for r in md.get("ownerReferences") or []])


@dataclass(frozen=True)
class SliceChanges:
    create: tuple[dict[str, Any], ...] = ()
    replace: tuple[dict[str, Any], ...] = ()
    """Desired slices carrying the resourceVersion of the one they replace."""
    delete: tuple[tuple[str, str, str], ...] = ()
    """(namespace, name, resourceVersion)."""


def slice_changes(desired: list[dict[str, Any]], current: list[dict[str, Any]]) -> SliceChanges:
    """What to write so that the model's activator slices are ``desired``; nothing when they are."""
    cur = {s["metadata"]["name"]: s for s in current}
    want = {s["metadata"]["name"]: s for s in desired}
    create = tuple(s for n, s in want.items() if n not in cur)
    replace = tuple({**s, "metadata": {**s["metadata"], "resourceVersion": cur[n]["metadata"].get("resourceVersion")}}
                    for n, s in want.items() if n in cur and _content(cur[n]) != _content(s))
    delete = tuple((s["metadata"]["namespace"], n, s["metadata"].get("resourceVersion", ""))
                   for n, s in cur.items() if n not in want)
    return SliceChanges(create, replace, delete)


def decide_model(model: dict[str, Any], pods: list[dict[str, Any]], endpoints: list[ActivatorEndpoint],
                 current: list[dict[str, Any]]) -> SliceChanges:
    desired = render_slices(model, endpoints) if endpoints and activator_in_path(model, pods) else []
    return slice_changes(desired, current)


def desired_route(model: dict[str, Any], route: PublishedRoute, pods: list[dict[str, Any]],
                  endpoints: list[ActivatorEndpoint], token: str = "") -> dict[str, Any]:
    """The model's HTTPRoute (``status.route``): the Service as its backend on exactly the
    condition that puts the activator slice on the Service (``decide_model``), so the route never
    points at a Service without a ready endpoint nor at a pool without a ready pod because of the
    switch. ``token``: the route's (gatewayroute.route_token), set in its model header."""
    md = model["metadata"]
    in_path = bool(endpoints) and activator_in_path(model, pods)
    backend = gatewayroute.route_backend(route.inferencePool, in_path)
    return gatewayroute.render_http_route(Owner(md["name"], md["namespace"], md["uid"]), route.gateway.to_wire(),
                                          backend, token)


def decide_route(model: dict[str, Any], route: PublishedRoute, pods: list[dict[str, Any]],
                 endpoints: list[ActivatorEndpoint], current: dict[str, Any] | None,
                 new_token: Callable[[], str] = gatewayroute.new_route_token) -> gatewayroute.RouteChange:
    """What to write for the model's HTTPRoute: ``desired_route`` against the route read, keeping
    the token of the route read when it is the model's (``new_token`` only for a route without one)."""
    uid = model["metadata"]["uid"]
    token = gatewayroute.route_token(current, uid) or new_token()
    return gatewayroute.route_change(desired_route(model, route, pods, endpoints, token), current, uid)


class ZeroRouterIO(Protocol):
    """``fewerbits_operator.base.kube.Kube`` implements these."""

    def list_models(self, namespaces: list[str]) -> list[dict[str, Any]]: ...
    def list_models_where(self, namespaces: list[str], where: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]: ...
    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...
    def list_endpoint_slices(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...
    def create_endpoint_slice(self, body: dict[str, Any]) -> None: ...
    def replace_endpoint_slice(self, body: dict[str, Any]) -> bool: ...
    def delete_endpoint_slice(self, namespace: str, name: str, resource_version: str) -> None: ...
    def get_http_route(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create_http_route(self, body: dict[str, Any]) -> None: ...
    def replace_http_route(self, body: dict[str, Any]) -> bool: ...


FULL_PASS_EVERY = 15
"""Every 15th pass (30 s at the default 2 s) looks at every model (ZeroRouter._models)."""


def _key(model: dict[str, Any]) -> tuple[str, str]:
    md = model.get("metadata") or {}
    return md.get("namespace", ""), md.get("name", "")


class ZeroRouter:
    """The loop: every ``period`` seconds, each model's activator slices are brought to what
    ``decide_model`` says. A pass reads no API at rest: the models, their pods and their activator
    slices come from kopf's indexes (Kube.list_models, list_pods, list_endpoint_slices), the
    activator Service's slices from ``activator_slices`` (slicewatch.SliceWatch: a watch; None
    until it first listed, and then the pass is skipped). Without ``activator_slices`` they are
    listed each pass (tests' fakes)."""

    def __init__(self, io: ZeroRouterIO, activator_service: str, namespaces: list[str] | None = None,
                 activator_slices: Callable[[], list[dict[str, Any]] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 new_token: Callable[[], str] = gatewayroute.new_route_token):
        self.io = io
        self.clock = clock
        self.new_token = new_token
        self._tokens: dict[tuple[str, str], str] = {}
        """(namespace, name) -> the token of the model's route, as last read or made (never logged)."""
        self._routes_seen: dict[tuple[str, str], tuple[dict[str, Any], float]] = {}
        """(namespace, name) -> (the route wanted, when it was last found or made so)."""
        self.activator_ns, _, self.activator_name = activator_service.partition("/")
        self.namespaces = list(namespaces or [])
        self.activator_slices = activator_slices or (lambda: self.io.list_endpoint_slices(
            self.activator_ns, f"{LABEL_SERVICE_NAME}={self.activator_name}"))
        self.passes = 0
        """Completed passes (tests wait on it instead of sleeping)."""
        self.route_writes = 0
        """HTTPRoutes created or replaced."""
        self._in_path: set[tuple[str, str]] = set()
        """Models this replica last saw with activator slices: in scope until they have none."""

    def run_once(self) -> dict[str, SliceChanges]:
        slices = self.activator_slices()
        if slices is None:  # the watch has not listed yet: "no endpoints" would remove every slice
            return {}
        done: dict[str, SliceChanges] = {}
        current_by_ns: dict[str, list[dict[str, Any]]] = {}
        listed: set[tuple[str, str]] = set()
        for model in self._models():
            md = model.get("metadata") or {}
            ns, name = md.get("namespace", ""), md.get("name", "")
            try:
                if ns not in current_by_ns:
                    current_by_ns[ns] = self.io.list_endpoint_slices(ns, f"{LABEL_MANAGED_BY}={MANAGED_BY}")
                current = [s for s in current_by_ns[ns]
                           if (s["metadata"].get("labels") or {}).get(LABEL_SERVICE_NAME) == name]
                pods = (self.io.list_pods(ns, f"{LABEL_MODEL}={name},{LABEL_COMPONENT}=server")
                        if may_reach_zero(model) else [])
                endpoints = namespace_endpoints(slices, ns)
                changes = decide_model(model, pods, endpoints, current)
                self._apply(changes)
                left = len(current) - len(changes.delete) + len(changes.create)
                (self._in_path.add if left > 0 else self._in_path.discard)((ns, name))
                if changes.create or changes.replace or changes.delete:
                    done[f"{ns}/{name}"] = changes
                    log.info("%s/%s: activator %s the Service's path", ns, name,
                             "out of" if changes.delete and not (changes.create or changes.replace) else "in")
                if (route := gatewayroute.published_route(model)) is not None:
                    self._sync_route(model, route, pods, endpoints)
            except Exception as e:  # one model never stops the rest; the next pass retries
                log.warning("activator path of %s/%s not updated: %s: %s", ns, name, type(e).__name__, e)
            listed.add((ns, name))
        self._routes_seen = {k: v for k, v in self._routes_seen.items() if k in listed}  # models gone
        self._tokens = {k: v for k, v in self._tokens.items() if k in listed}
        self._in_path &= listed
        self.passes += 1
        return done

    def _models(self) -> list[dict[str, Any]]:
        """The models a pass looks at. Only those with something to keep (they may reach zero, they
        have a route, or they had activator slices) are copied out of the index: at 300 models a
        copy of every model each pass holds the interpreter for tens of milliseconds every 2 s, and
        a reconcile waits that long. Every FULL_PASS_EVERY passes (the first included, so after a
        restart) all are, to remove slices a model left behind while no replica watched."""
        if self.passes % FULL_PASS_EVERY == 0:
            return self.io.list_models(self.namespaces)
        return self.io.list_models_where(self.namespaces, lambda m: may_reach_zero(m) or (
            gatewayroute.published_route(m) is not None) or _key(m) in self._in_path)

    def _apply(self, changes: SliceChanges) -> None:
        for body in changes.create:
            self.io.create_endpoint_slice(body)
        for body in changes.replace:
            self.io.replace_endpoint_slice(body)
        for ns, name, rv in changes.delete:
            self.io.delete_endpoint_slice(ns, name, rv)

    def _sync_route(self, model: dict[str, Any], route: PublishedRoute, pods: list[dict[str, Any]],
                    endpoints: list[ActivatorEndpoint]) -> None:
        """The model's HTTPRoute brought to ``decide_route``. Reconcile publishes ``status.route``
        only while the cluster serves HTTPRoutes and no route of that name is another's (it says
        which in the Deployed condition otherwise); a route found not the model's is left alone."""
        md = model["metadata"]
        key, now = (md["namespace"], md["name"]), self.clock()
        token = self._tokens.get(key)
        seen = self._routes_seen.get(key)
        if token is not None and seen is not None and now - seen[1] < ROUTE_RECHECK_SECONDS and (
                seen[0] == desired_route(model, route, pods, endpoints, token)):
            return  # as this replica last found or made it, and wanted unchanged: no read
        current = self.io.get_http_route(*key)
        # The route's own token is kept (a switch, a new leader, a restart): a request on its way
        # through the gateway with it is not refused by the activator because the route was rewritten.
        token = gatewayroute.route_token(current, md["uid"]) or token or self.new_token()
        self._tokens[key] = token
        desired = desired_route(model, route, pods, endpoints, token)
        change = gatewayroute.route_change(desired, current, md["uid"])
        if change.conflict:
            return  # not the model's: never written (reconcile reports it and withdraws status.route)
        if change.create is not None:
            self.io.create_http_route(change.create)
        elif change.replace is not None and not self.io.replace_http_route(change.replace):
            return  # changed meanwhile: read again at the next pass
        self._routes_seen[key] = (desired, now)
        if change.create is not None or change.replace is not None:
            self.route_writes += 1
            log.info("%s/%s: HTTPRoute backend %s", md["namespace"], md["name"],
                     gatewayroute.current_backend(change.create or change.replace))

    def run_forever(self, stop: threading.Event, period: float = 2.0) -> None:
        log.info("activator path kept for models that may reach zero (every %.0fs, activator Service %s/%s)",
                 period, self.activator_ns, self.activator_name)
        run_periodically(stop, period, self.run_once, "activator path", log)
