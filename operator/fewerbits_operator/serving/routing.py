"""Routing a model's traffic through an InferencePool (Gateway API Inference Extension) instead of
only its Service: the pure half (docs/routing.md).

``spec.serving.routing: inferencePool`` makes the operator keep one ``InferencePool``
(``inference.networking.k8s.io/v1``) per model, named like the model, selecting the serving pods of
every variant (the same labels as the Service) on vLLM's port, with its endpoint picker (EPP)
referenced as the Service ``<model>-epp`` on the EPP's ext-proc port. The EPP scores each pod on
its KV-cache usage and waiting requests (the operator deploys it: picker.py), so a slow pool gets fewer requests than
the Service's even split. The Service stays in every case: clusters without a gateway keep working.

The default is ``service``: an InferencePool is useful only behind a gateway that implements the
extension, and its CRDs are not in a plain cluster. Without the CRD the option is refused on the
model (``Deployed=False RoutingUnavailable``), the Service keeps serving; an InferencePool of the
model's name that the model does not own is a conflict (``InferencePoolConflict``), never touched.

Everything here is pure (observe reads the facts, execute applies the actions).
"""

from __future__ import annotations

from typing import Any, Mapping

from fewerbits_api.conditions import Reason

from fewerbits_operator.base.apis import (
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_GROUP,
    INFERENCE_POOL_KIND,
    INFERENCE_POOL_PLURAL,
    INFERENCE_POOL_VERSION,
)
from fewerbits_operator.base.actions import CreateInferencePool, PatchInferencePool  # noqa: F401  (the pool's writes)
from fewerbits_operator.base.observed import RoutingFacts  # noqa: F401  (what observe reads for routing)
from fewerbits_operator.serving.render import LABEL_COMPONENT, LABEL_MODEL, VLLM_PORT, Owner, model_labels, owned_by

GROUP = INFERENCE_POOL_GROUP
VERSION = INFERENCE_POOL_VERSION
PLURAL = INFERENCE_POOL_PLURAL
KIND = INFERENCE_POOL_KIND
API_VERSION = INFERENCE_POOL_API_VERSION
EPP_GRPC_PORT = 9002
"""The EPP's ext-proc port (its default, ``--grpc-port``)."""

SERVICE = "service"
INFERENCE_POOL = "inferencePool"
DEFAULT_ROUTING = SERVICE

REASON_UNAVAILABLE = Reason.ROUTING_UNAVAILABLE
REASON_CONFLICT = Reason.INFERENCE_POOL_CONFLICT


def epp_name(model: str) -> str:
    return f"{model}-epp"


def routing_of(serving: Any) -> str:
    return getattr(serving, "routing", None) or DEFAULT_ROUTING


def render_inference_pool(owner: Owner) -> dict[str, Any]:
    """The model's InferencePool: every variant's serving pods (the Service's selector), vLLM's
    port, and the model's EPP. FailOpen: if the picker is down the gateway still forwards."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": owner.name, "namespace": owner.namespace, "labels": model_labels(owner.name),
                     "ownerReferences": [owner.reference()]},
        "spec": {
            "selector": {"matchLabels": {LABEL_MODEL: owner.name, LABEL_COMPONENT: "server"}},
            "targetPorts": [{"number": VLLM_PORT}],
            "endpointPickerRef": {"kind": "Service", "name": epp_name(owner.name),
                                  "port": {"number": EPP_GRPC_PORT}, "failureMode": "FailOpen"},
        },
    }


def pool_actions(facts: RoutingFacts | None, owner: Owner
                 ) -> tuple[list[CreateInferencePool | PatchInferencePool], tuple[str, str] | None]:
    """Create or repair the model's InferencePool. Returns the actions and, when routing through a
    pool cannot be done, (reason, message) for the Deployed condition; the Service serves anyway."""
    if facts is None or not facts.crd_served:
        return [], (REASON_UNAVAILABLE,
                    f"spec.serving.routing: inferencePool needs the {KIND} CRD ({PLURAL}.{GROUP}, {VERSION}), which "
                    "this cluster does not serve: install the Gateway API Inference Extension CRDs or set "
                    "spec.serving.routing: service; the model is served through its Service meanwhile")
    desired = render_inference_pool(owner)
    cur = facts.pool
    if cur is None:
        return [CreateInferencePool(desired)], None
    if not owned_by(cur, owner.uid):
        return [], (REASON_CONFLICT,
                    f"{KIND} {owner.namespace}/{owner.name} exists and is not owned by this QuantizedModel; it is "
                    "left untouched: rename the model or remove that InferencePool; the model is served through "
                    "its Service meanwhile")
    if (cur.get("spec") or {}) != desired["spec"]:
        return [PatchInferencePool(owner.namespace, owner.name, {"spec": desired["spec"]})], None
    return [], None


PER_VARIANT = "perVariant"
CHEAPEST_POOL = "cheapestPool"


def capacity_placement(serving: Any, facts: RoutingFacts | None, operator_weights: Mapping[str, float],
                       policy_weights: Mapping[str, float] | None) -> tuple[str, dict[str, float] | None]:
    """Where the autoscaler puts a model's extra capacity (``status.autoscaling.placement``), and
    the cost weights it prices pools with (the policy's per key over the operator's setting).

    ``cheapestPool`` only when the model's requests reach its pods through the InferencePool: its
    picker sends each request to the pod with the most free KV cache and the shortest queue (and
    the longest cached prefix of its prompt), so a replica added to the cheap pool takes load off
    every other pool: new prompts at once, prompts sharing a cached prefix once the busier pod's
    queue or KV usage outweighs the match. Behind the Service (also when
    the InferencePool CRD is not served, where the Service is all there is) every pod receives the
    same share of requests whatever its speed: a replica added to a fast pool takes no load off a
    saturated slow one, so each variant must scale on its own load (``perVariant``)."""
    weights = {**operator_weights, **(policy_weights or {})} or None
    follows = routing_of(serving) == INFERENCE_POOL and facts is not None and facts.crd_served
    return (CHEAPEST_POOL if follows else PER_VARIANT), weights
