"""A stand-in for a Gateway API controller's route resolution, for one model's ``HTTPRoute``
(``spec.serving.gateway``, the operator's gatewayroute.py): no Envoy (nor Envoy Gateway, Istio,
kgateway) can be fetched here, so nothing programs a data plane from the route (docs/routing.md).

Per request ``RouteStandIn.open`` reads the route from the API server, applies its rule's
``RequestHeaderModifier`` (``set``) filters, keeps the client's Host (the gateway's name, as Envoy
does), and follows the rule's first backendRef, as a gateway controller would have programmed it:

- ``InferencePool``: to the ext_proc gateway (e2e/gateway/main.go, the harness's data plane), which
  asks the pool's endpoint picker for the pod;
- ``Service``: through e2e/serviceproxy.py (the harness's DNS + kube-proxy), which merges the
  Service's EndpointSlices, the operator's activator slice among them at zero.

A real controller re-programs on a watch event; reading per request is this stand-in's shortcut
(it can only see the route sooner). Nothing of the operator is in this module.
"""

from __future__ import annotations

import http.client
import json
from typing import Callable
from urllib.parse import urlsplit

from kubernetes import client

from e2e.serviceproxy import open_service_url

GROUP, VERSION, PLURAL = "gateway.networking.k8s.io", "v1", "httproutes"


GATEWAY_HOST = "inference-gw.example.com"
"""The Host a client of the gateway sends (not the model's Service name)."""


def route_rule(api: client.ApiClient, namespace: str, name: str) -> dict | None:
    """The route's first rule, or None (no route, no rule)."""
    try:
        route = client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise
    rules = (route.get("spec") or {}).get("rules") or []
    return rules[0] if rules else None


def route_backend(api: client.ApiClient, namespace: str, name: str) -> dict | None:
    """The first backendRef of the route's first rule, or None."""
    refs = (route_rule(api, namespace, name) or {}).get("backendRefs") or []
    return refs[0] if refs else None


def filtered_headers(rule: dict, headers: dict[str, str]) -> dict[str, str]:
    """The request's headers after the rule's RequestHeaderModifier ``set`` entries."""
    out = dict(headers)
    for f in rule.get("filters") or []:
        for h in (f.get("requestHeaderModifier") or {}).get("set") or []:
            out = {k: v for k, v in out.items() if k.lower() != h["name"].lower()} | {h["name"]: h["value"]}
    return out


class RouteStandIn:
    """The gateway's address for one model's HTTPRoute. ``pool_gateway_url`` gives the ext_proc
    gateway's URL for the InferencePool backend (started on demand: it needs the picker's pod)."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str, pool_gateway_url: Callable[[], str]):
        self.api, self.namespace, self.name = api, namespace, name
        self.pool_gateway_url = pool_gateway_url

    def open(self, path: str, method: str = "POST", body: bytes | None = None,
             headers: dict[str, str] | None = None, timeout: float = 300.0) -> tuple[str, http.client.HTTPResponse]:
        """(what it went through: "InferencePool" or "Service:<endpoint source>", the response)."""
        rule = route_rule(self.api, self.namespace, self.name) or {}
        refs = rule.get("backendRefs") or []
        if not refs:
            raise RuntimeError(f"no HTTPRoute {self.namespace}/{self.name} with a backend")
        ref, headers = refs[0], filtered_headers(rule, {**(headers or {}), "Host": GATEWAY_HOST})
        if ref.get("kind") == "InferencePool":
            u = urlsplit(self.pool_gateway_url())
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
            conn.request(method, path, body=body, headers=headers)
            return "InferencePool", conn.getresponse()
        port = ref.get("port", 80)
        ep, r = open_service_url(self.api, f"http://{ref['name']}.{self.namespace}.svc:{port}{path}", method, body,
                                 {k: v for k, v in headers.items() if k != "Host"}, timeout, host=GATEWAY_HOST)
        return f"Service:{ep.source}", r

    def chat(self, model: str, content: str = "hi") -> tuple[str, int, dict]:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                           "max_tokens": 8}).encode()
        via, r = self.open("/v1/chat/completions", "POST", body, {"Content-Type": "application/json"})
        return via, r.status, json.loads(r.read() or b"{}")
