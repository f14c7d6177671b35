"""``python -m fewerbits_operator.runtime.activator_main``: the scale-from-zero activator as its own
process, the chart's ``<release>-activator`` Deployment (2 replicas, same image as the operator).

Why apart from the operator: the operator's replicas are one failure domain with a leader that may
be SIGKILLed (a node lost, an OOM kill); a request the activator holds must not go with it. The
activator is stateless (it holds requests in memory while one replica starts, and wakes a variant
with a conditional scale from 0), so two replicas behind one Service need no election: either
answers any request, and a wake asked by both writes once (Kube.wake_scale).

What the process serves, on ``activator_port``: the requests (activator.py), ``/healthz`` (200
while serving, 503 once SIGTERM came: the kubelet's readiness and liveness probes), and its
Prometheus metrics on ``metrics_port``; and on each of ``activator_tenant_ports`` the requests of
that namespace's Services at zero (a request is handled as arriving on its namespace's port: the
tenant check, activator.admission). On SIGTERM it keeps answering until no request is held or
being streamed (``Activator.drain``, bounded by the activator's own wait, which the chart's
``terminationGracePeriodSeconds`` covers), then exits.

What it reads comes from watches of its own (activator_cache.py): those of the tenant ports'
namespaces start with the process, any other namespace's on the first model found there; every API
request is counted in ``fewerbits_activator_api_calls_total{verb,resource}``.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fewerbits_operator.base.settings import OperatorSettings
    from fewerbits_operator.runtime.activator import Activator

log = logging.getLogger("fewerbits.activator")
DRAIN_MARGIN_SECONDS = 5.0
"""Beyond the activator's own wait: the last held request's answer being passed back."""


def build(s: OperatorSettings, api: Any = None, *, cached: bool = True, **activator_kwargs: Any) -> Activator:
    """The activator as this process runs it: a Kube whose every API request is counted, and (with
    ``cached``) the watch-fed caches, the tenant namespaces' watches started. ``api``: a kubernetes
    ApiClient (default: in-cluster or KUBECONFIG); ``cached=False``: every read through the API,
    the baseline of bench/activator_burst.py; ``activator_kwargs`` go to the Activator."""
    from fewerbits_operator.base.kube import Kube, load_config
    from fewerbits_operator.runtime.activator import Activator
    from fewerbits_operator.runtime.activator_cache import ActivatorCache, count_api_calls

    kube = Kube(count_api_calls(api or load_config()))
    cache = ActivatorCache(kube) if cached else None
    if cache is not None:
        for ns in sorted(s.activator_tenant_ports or {}):
            cache.watch_namespace(ns)
    return Activator(kube, queue=s.activator_queue, timeout=s.activator_timeout_seconds,
                     tenant_ports=s.activator_tenant_ports, cache=cache, **activator_kwargs)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from prometheus_client import start_http_server

    from fewerbits_operator.base.settings import get_settings
    from fewerbits_operator.runtime.activator import serve

    s = get_settings()
    if not s.activator_port:
        log.error("FEWERBITS_ACTIVATOR_PORT is 0: the activator has no port to serve on")
        return 2
    activator = build(s)
    if s.metrics_port:
        start_http_server(s.metrics_port)
    servers = [serve(activator, s.activator_port)]
    servers += [serve(activator, port, tenant=ns) for ns, port in sorted((s.activator_tenant_ports or {}).items())]
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    log.info("activator serving on port %d (queue %d per model, wait %.0fs)", s.activator_port,
             s.activator_queue, s.activator_timeout_seconds)
    if s.activator_tenant_ports is None:
        log.warning("no tenant ports (FEWERBITS_ACTIVATOR_TENANT_PORTS unset): a request naming a model by its "
                    "Service's Host is served on any port, whoever sent it; only route tokens are checked")
    else:
        log.info("tenants kept apart: %d tenant port(s) %s; the main port serves route tokens only",
                 len(s.activator_tenant_ports), sorted(s.activator_tenant_ports.values()))
    stopping.wait()
    activator.draining = True
    log.info("stopping: draining %d request(s) held or being answered", activator.in_flight)
    left = activator.drain(activator.timeout + DRAIN_MARGIN_SECONDS)
    if left:
        log.warning("%d request(s) still in flight at shutdown", left)
    for server in servers:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
