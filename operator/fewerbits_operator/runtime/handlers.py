"""The kopf registration: what kopf watches and indexes, and where each event goes. Every handler
is a one-line delegation to the runner (runner.Operator); nothing here decides.

kopf is the watch layer and the process: ``@kopf.index`` holds every object observe reads
(indexes.py), ``@kopf.on.event`` feeds the work queue, ``on.startup`` / ``on.cleanup`` /
``on.probe`` start and stop the runner and answer the liveness probe. No handler persists
anything: ``on.event`` and indexes keep no state on the object (no finalizer, no annotation); the
high-level ``on.create/update/resume`` handlers and timers, which would, are not used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import kopf

from fewerbits_api.base import GROUP, VERSION
from fewerbits_api.policy import PLURAL as POLICY_PLURAL
from fewerbits_api.quantizedmodel import PLURAL as QM_PLURAL

from fewerbits_operator.base.indexes import index_entry, node_entry, pod_entry
from fewerbits_operator.serving.lws import LWS_GROUP, LWS_PLURAL, LWS_VERSION
from fewerbits_operator.base.scope import KopfScope

if TYPE_CHECKING:
    from fewerbits_operator.runtime.runner import Operator

MANAGED = {"app.kubernetes.io/managed-by": "fewerbits"}
"""The Jobs, Deployments and LeaderWorkerSets the operator creates carry this label (render.py)."""
KINDS: dict[str, tuple[str, str, str, dict[str, str] | None]] = {
    "models": (GROUP, VERSION, QM_PLURAL, None),
    "jobs": ("batch", "v1", "jobs", MANAGED),
    "deployments": ("apps", "v1", "deployments", MANAGED),
    "leaderworkersets": (LWS_GROUP, LWS_VERSION, LWS_PLURAL, MANAGED),
    "nodes": ("", "v1", "nodes", None),
    "policies": (GROUP, VERSION, POLICY_PLURAL, None),
}
"""Index and event handler per kind: ``<kind>_index`` is also the kwarg kopf passes the index as."""
INDEXED: dict[str, tuple[str, str, str, dict[str, Any], str]] = {
    # The pods of the models' workloads (render.py labels every one with its model).
    "pods": ("", "v1", "pods", {"fewerbits.io/model": kopf.PRESENT}, "fewerbits.io/model"),
    # The models' Services (render.py labels them as its other objects): observe's read of a model's
    # Service at every resync comes from here (Kube.get_service).
    "services": ("", "v1", "services", MANAGED, "app.kubernetes.io/managed-by=fewerbits"),
    # The models' activator EndpointSlices (atzero.py writes them).
    "endpointslices": ("discovery.k8s.io", "v1", "endpointslices",
                       {"endpointslice.kubernetes.io/managed-by": "activator.fewerbits.io"},
                       "endpointslice.kubernetes.io/managed-by=activator.fewerbits.io"),
}
"""Indexed only, no event handler (a change enqueues nothing): what the loops beside reconcile
read each pass instead of a LIST (atzero.ZeroRouter, metricsprobe.MetricsProbe, the autoscaler's
keep-awake; Kube.list_pods, Kube.list_endpoint_slices). The last field: the same filter as a
label selector, for the API server (runner.configure_kopf)."""


STARTUP_RETRY_SECONDS = 2.0
"""How soon a start-up the API server did not answer is tried again."""


def api_unavailable(e: BaseException) -> bool:
    """The API server not answering (refused, reset, timed out) or answering that it cannot serve
    now (429, 5xx): a start-up tried again shortly, not a failure of the operator."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    if isinstance(e, ApiException):
        return e.status == 429 or (e.status or 0) >= 500
    return isinstance(e, (urllib3.exceptions.HTTPError, OSError))


def register(op: "Operator", scope: KopfScope, registry: kopf.OperatorRegistry) -> None:
    """Every handler of the operator, on ``registry``."""
    when = (lambda namespace, **_: scope.serves(namespace)) if scope.patterns else None
    for kind, (group, version, plural, labels) in KINDS.items():
        coords = (group, version, plural) if group else (version, plural)
        entry = node_entry if kind == "nodes" else index_entry
        kopf.index(*coords, labels=labels, when=when, id=f"{kind}_index", registry=registry)(_indexer(entry))
        kopf.on.event(*coords, labels=labels, when=when, id=f"{kind}_event", registry=registry)(_on_event(op, kind))
    for kind, (group, version, plural, labels, _) in INDEXED.items():
        coords = (group, version, plural) if group else (version, plural)
        entry = pod_entry if kind == "pods" else index_entry
        kopf.index(*coords, labels=labels, when=when, id=f"{kind}_index", registry=registry)(_indexer(entry))

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:  # an own registry has none of kopf's default login handlers
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
        try:
            op.on_startup(settings, {kind: kwargs[f"{kind}_index"] for kind in (*KINDS, *INDEXED)})
        except Exception as e:
            if not api_unavailable(e):
                raise
            # kopf's own retry of a failed start-up is a minute later, with a traceback: a replica
            # started while the API server restarts would sit that long not even standing by.
            raise kopf.TemporaryError(f"the API server did not answer at start ({type(e).__name__}: {e}); "
                                      f"trying again in {STARTUP_RETRY_SECONDS:g}s", delay=STARTUP_RETRY_SECONDS) from e

    @kopf.on.cleanup(registry=registry)
    def cleanup(**_: Any) -> None:  # sync: kopf runs it in its executor (it joins threads)
        op.on_cleanup()

    # PERMANENT: a failing probe answers 500 at once (kopf would otherwise retry it with back-off
    # inside the kubelet's request).
    @kopf.on.probe(id="runtime", errors=kopf.ErrorsMode.PERMANENT, registry=registry)
    def runtime(**_: Any) -> str:
        return op.probe()


def _indexer(entry: Any) -> Any:
    async def index(body: kopf.Body, **_: Any) -> Any:  # async: kopf awaits it in its loop, no thread hop
        return entry(body)
    return index


def _on_event(op: "Operator", kind: str) -> Any:
    async def on_event(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002 — kopf's kwarg
        op.on_event(kind, type, dict(body))
    return on_event
