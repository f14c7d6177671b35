"""The coordinates of the foreign APIs the operator reads and writes (group, version, plural,
kind), beside the client (kube.py) that calls them. Decision and render modules (lws.py,
routing.py) import them from here, so the client never imports a module that decides.
"""

from __future__ import annotations

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"
LWS_PLURAL = "leaderworkersets"
LWS_KIND = "LeaderWorkerSet"
LWS_CRD = f"{LWS_PLURAL}.{LWS_GROUP}"
"""LeaderWorkerSet (https://lws.sigs.k8s.io): a multi-node variant's serving object (lws.py)."""

INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_VERSION = "v1"
INFERENCE_POOL_PLURAL = "inferencepools"
INFERENCE_POOL_KIND = "InferencePool"
INFERENCE_POOL_API_VERSION = f"{INFERENCE_POOL_GROUP}/{INFERENCE_POOL_VERSION}"
"""The Gateway API Inference Extension's InferencePool (routing.py)."""

HTTP_ROUTE_GROUP = "gateway.networking.k8s.io"
HTTP_ROUTE_VERSION = "v1"
HTTP_ROUTE_PLURAL = "httproutes"
HTTP_ROUTE_KIND = "HTTPRoute"
HTTP_ROUTE_API_VERSION = f"{HTTP_ROUTE_GROUP}/{HTTP_ROUTE_VERSION}"
"""Gateway API's HTTPRoute: the model's route through ``spec.serving.gateway`` (gatewayroute.py)."""
