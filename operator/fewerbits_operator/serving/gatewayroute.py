"""The model's HTTPRoute (``spec.serving.gateway``): the pure half (docs/routing.md, "Through a
gateway at zero").

A model with ``spec.serving.gateway`` is reached through that Gateway by one ``HTTPRoute``
(``gateway.networking.k8s.io/v1``) named like the model and owned by it, with one rule and one
backend:

- the model's **InferencePool** (``routing: inferencePool``) normally: its picker chooses the pod;
- the model's **Service** (port 8000) while the model may reach zero and has at most one ready
  serving pod, or whenever routing is ``service``. At zero the Service reaches the activator
  through its extra EndpointSlice (runtime/atzero.py), so a request sent through the gateway is
  held while a replica starts. The endpoint picker of GIE v1.1.0 answers at once with an error
  when its pool has no ready pod, and Gateway API has no fallback between a rule's backends, so the
  backend itself is switched. The rule and the facts are the activator slice's: the Service gains
  the activator before the last pod goes, and the route returns to the pool only once a second pod
  is ready, so the switch never leaves the route without a ready backend.

The route is written by the activator-path loop (runtime/atzero.py, one writer); reconcile only
reports what stops it (decide.routing_step): the CRD not served (``RoutingUnavailable``) or a
route of the model's name the model does not own (``HTTPRouteConflict``, never written).

Everything here is pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from fewerbits_api.conditions import Reason
from fewerbits_api.quantizedmodel import PublishedRoute

from fewerbits_operator.base.apis import (
    HTTP_ROUTE_API_VERSION,
    HTTP_ROUTE_GROUP,
    HTTP_ROUTE_KIND,
    HTTP_ROUTE_PLURAL,
    HTTP_ROUTE_VERSION,
    INFERENCE_POOL_GROUP,
    INFERENCE_POOL_KIND,
)
from fewerbits_operator.serving.render import VLLM_PORT, Owner, model_labels, owned_by

Backend = Literal["InferencePool", "Service"]
POOL: Backend = "InferencePool"
SERVICE: Backend = "Service"

REASON_UNAVAILABLE = Reason.ROUTING_UNAVAILABLE
REASON_CONFLICT = Reason.HTTP_ROUTE_CONFLICT


def published_route(model: Mapping[str, Any]) -> PublishedRoute | None:
    """The route reconcile resolved for the model (``status.route``: the effective
    ``spec.serving.gateway``, policies' defaults included, and whether the InferencePool can be its
    backend); None when it published none or wrote something unreadable."""
    raw = (model.get("status") or {}).get("route")
    if not isinstance(raw, dict):
        return None
    try:
        return PublishedRoute.model_validate(raw)
    except ValueError:
        return None


def parent_ref(gateway: Mapping[str, Any], model_namespace: str) -> dict[str, Any]:
    """The route's parentRef: the Gateway, in the model's namespace unless another is named."""
    ref = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway["name"],
           "namespace": gateway.get("namespace") or model_namespace}
    if gateway.get("sectionName"):
        ref["sectionName"] = gateway["sectionName"]
    return ref


MATCH_ALL = [{"path": {"type": "PathPrefix", "value": "/"}}]
"""A rule's ``matches`` as the HTTPRoute CRD defaults it (v1.4.0 standard channel)."""
MODEL_HEADER = "X-Fewerbits-Model"
"""How the activator tells the model of a request that does not carry the Service's Host
(runtime/activator.model_of: ``<namespace>/<name>``, before the Host): a gateway forwards the
client's Host (the gateway's name), so the route sets this header on every request."""


def model_header_filter(owner: Owner) -> dict[str, Any]:
    """Sets (never adds to) the model header: a client cannot name another model through this route."""
    return {"type": "RequestHeaderModifier",
            "requestHeaderModifier": {"set": [{"name": MODEL_HEADER, "value": f"{owner.namespace}/{owner.name}"}]}}


def backend_ref(backend: Backend, model: str) -> dict[str, Any]:
    """With ``weight: 1``, the CRD's default: the route is rendered as the API server stores it, so
    a route that is as wanted compares equal and is never rewritten at rest."""
    if backend == POOL:
        return {"group": INFERENCE_POOL_GROUP, "kind": INFERENCE_POOL_KIND, "name": model, "port": VLLM_PORT,
                "weight": 1}
    return {"group": "", "kind": "Service", "name": model, "port": VLLM_PORT, "weight": 1}


def route_backend(pool_usable: bool, activator_in_path: bool) -> Backend:
    """The route's one backend: the InferencePool when the model routes through one that it owns
    (``status.route.inferencePool``), except while the activator is in the Service's path
    (atzero.activator_in_path with the activator's endpoints: may reach zero, at most one ready
    pod), where only the Service can hold a request while a replica starts."""
    return POOL if pool_usable and not activator_in_path else SERVICE


def render_http_route(owner: Owner, gateway: Mapping[str, Any], backend: Backend) -> dict[str, Any]:
    return {
        "apiVersion": HTTP_ROUTE_API_VERSION,
        "kind": HTTP_ROUTE_KIND,
        "metadata": {"name": owner.name, "namespace": owner.namespace, "labels": model_labels(owner.name),
                     "ownerReferences": [owner.reference()]},
        "spec": {
            "parentRefs": [parent_ref(gateway, owner.namespace)],
            "rules": [{"matches": MATCH_ALL, "filters": [model_header_filter(owner)],
                       "backendRefs": [backend_ref(backend, owner.name)]}],
        },
    }


def current_backend(route: Mapping[str, Any] | None) -> str | None:
    """The kind of the first backend of the route's first rule (what a gateway sends to), or None."""
    rules = ((route or {}).get("spec") or {}).get("rules") or []
    refs = (rules[0].get("backendRefs") if rules else None) or []
    return refs[0].get("kind") if refs else None


@dataclass(frozen=True)
class RouteChange:
    """What to write so that the model's HTTPRoute is ``desired``."""

    create: dict[str, Any] | None = None
    replace: dict[str, Any] | None = None
    """The desired route carrying the resourceVersion of the one it replaces."""
    conflict: bool = False
    """A route of that name the model does not own: never written."""


def route_change(desired: dict[str, Any], current: Mapping[str, Any] | None, uid: str) -> RouteChange:
    """Create, replace at the resourceVersion read, nothing when it is as wanted, or a conflict."""
    if current is None:
        return RouteChange(create=desired)
    if not owned_by(current, uid):
        return RouteChange(conflict=True)
    md = current.get("metadata") or {}
    if current.get("spec") == desired["spec"] and (md.get("labels") or {}) == desired["metadata"]["labels"]:
        return RouteChange()
    keep = {k: md[k] for k in ("resourceVersion", "annotations") if md.get(k)}
    return RouteChange(replace={**desired, "metadata": {**desired["metadata"], **keep}})


def route_problem(crd_served: bool, route: Mapping[str, Any] | None, owner: Owner) -> tuple[str, str] | None:
    """(reason, message) for the Deployed condition when the route cannot be kept; the Service
    (and the InferencePool) serve meanwhile."""
    if not crd_served:
        return (REASON_UNAVAILABLE,
                f"spec.serving.gateway needs the {HTTP_ROUTE_KIND} CRD ({HTTP_ROUTE_PLURAL}.{HTTP_ROUTE_GROUP}, "
                f"{HTTP_ROUTE_VERSION}), which this cluster does not serve: install the Gateway API CRDs or remove "
                "spec.serving.gateway; no route is written, the model is served through its Service meanwhile")
    if route is not None and not owned_by(route, owner.uid):
        return (REASON_CONFLICT,
                f"{HTTP_ROUTE_KIND} {owner.namespace}/{owner.name} exists and is not owned by this QuantizedModel; "
                "it is left untouched (spec.serving.gateway is not applied): rename the model or remove that "
                "HTTPRoute; the model is served through its Service meanwhile")
    return None
