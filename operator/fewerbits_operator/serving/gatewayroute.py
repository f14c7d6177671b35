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

Every request the route forwards carries ``X-Fewerbits-Model: <namespace>/<model>; token=<token>``
(set, never added to): the activator serves a model to a request naming it by this header only when
the value is exactly what the model's own route sets (runtime/activator.py reads that route), so the
header proves that the request came through the model's route, and a client that sets it itself
cannot name a model whose route it cannot read (docs/routing.md, "Tenants kept apart"). The token
is random, made once per route and kept across rewrites (``route_token``).

The route is written by the activator-path loop (runtime/atzero.py, one writer); reconcile only
reports what stops it (core.serving_steps.routing_step): the CRD not served (``RoutingUnavailable``) or a
route of the model's name the model does not own (``HTTPRouteConflict``, never written).

Everything here is pure.
"""

from __future__ import annotations

import hmac
import re
import secrets
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
"""The header the model's route sets on every request it forwards: the model and the route's token,
``<namespace>/<name>; token=<token>``. A gateway forwards its client's Host (the gateway's name), not
``<model>.<namespace>.svc``, so at zero the activator finds the model by this header, and serves it
only when the value is the one the model's route sets (``route_proves``)."""
ROUTE_TOKEN_BYTES = 32
"""256 random bits (``secrets.token_urlsafe``: 43 characters): not guessable, so only who can read
the model's HTTPRoute (its namespace's readers, the gateway controller) can send the header."""
MODEL_HEADER_VALUE = re.compile(
    r"^\s*(?P<ns>[a-z0-9]([-a-z0-9]*[a-z0-9])?)/(?P<name>[a-z0-9]([-.a-z0-9]*[a-z0-9])?)"
    r"\s*;\s*token=(?P<token>[A-Za-z0-9_-]{32,128})\s*$")


@dataclass(frozen=True)
class ModelClaim:
    """What an ``X-Fewerbits-Model`` header says: the model, and the token of the route it came by."""

    namespace: str
    name: str
    token: str


def new_route_token() -> str:
    return secrets.token_urlsafe(ROUTE_TOKEN_BYTES)


def model_header_value(owner: Owner, token: str) -> str:
    return f"{owner.namespace}/{owner.name}; token={token}"


def parse_model_header(value: str | None) -> ModelClaim | None:
    """The claim of a well-formed header value, else None (a bare ``<namespace>/<model>``, the form
    before routes carried a token, is not well-formed)."""
    m = MODEL_HEADER_VALUE.match(value or "")
    return ModelClaim(m.group("ns"), m.group("name"), m.group("token")) if m else None


def route_model_header(route: Mapping[str, Any] | None) -> str | None:
    """The value the route's first rule sets for MODEL_HEADER, or None."""
    rules = ((route or {}).get("spec") or {}).get("rules") or []
    for f in (rules[0].get("filters") if rules else None) or []:
        for h in (f.get("requestHeaderModifier") or {}).get("set") or []:
            if str(h.get("name", "")).lower() == MODEL_HEADER.lower():
                return h.get("value")
    return None


def route_token(route: Mapping[str, Any] | None, uid: str) -> str | None:
    """The token the model's own route (owned by ``uid``) carries, to keep it when the route is
    rewritten (a backend switch, another operator replica taking over); None when there is none."""
    if route is None or not owned_by(route, uid):
        return None
    claim = parse_model_header(route_model_header(route))
    return claim.token if claim else None


def header_proves(claim: ModelClaim, routed: str | None) -> bool:
    """Whether ``routed``, the model header the route at ``<claim.namespace>/<claim.name>`` sets,
    is exactly this claim: then the request came through that route (or from someone who may read
    it). The tokens are compared in constant time."""
    route_claim = parse_model_header(routed)
    return (route_claim is not None and (route_claim.namespace, route_claim.name) == (claim.namespace, claim.name)
            and hmac.compare_digest(route_claim.token.encode(), claim.token.encode()))


def route_proves(claim: ModelClaim, route: Mapping[str, Any] | None) -> bool:
    """``header_proves`` for the route read at ``<claim.namespace>/<claim.name>``."""
    return header_proves(claim, route_model_header(route))


def model_header_filter(owner: Owner, token: str) -> dict[str, Any]:
    """Sets (never adds to) the model header: a client cannot name another model through this route."""
    return {"type": "RequestHeaderModifier",
            "requestHeaderModifier": {"set": [{"name": MODEL_HEADER, "value": model_header_value(owner, token)}]}}


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


def render_http_route(owner: Owner, gateway: Mapping[str, Any], backend: Backend, token: str = "") -> dict[str, Any]:
    """The model's route; ``token`` is the route's (``new_route_token`` once, then ``route_token``):
    without one the header it sets proves nothing to the activator."""
    return {
        "apiVersion": HTTP_ROUTE_API_VERSION,
        "kind": HTTP_ROUTE_KIND,
        "metadata": {"name": owner.name, "namespace": owner.namespace, "labels": model_labels(owner.name),
                     "ownerReferences": [owner.reference()]},
        "spec": {
            "parentRefs": [parent_ref(gateway, owner.namespace)],
            "rules": [{"matches": MATCH_ALL, "filters": [model_header_filter(owner, token)],
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
