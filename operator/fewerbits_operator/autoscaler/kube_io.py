"""The autoscaler's adapter over the operator's API client: ``AutoscalerIO`` on ``kube.Kube``.

Every verb is the client's own except the status write, which is the autoscaler's rule: only its
fields of ``status.serving`` entries (``merge_serving``), merged into a fresh read and written
conditionally on its resourceVersion. It lives here, above the client, so ``kube.py`` imports
nothing of the autoscaler.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from fewerbits_operator.base.kube import CONFLICT_RETRIES, Kube
from fewerbits_operator.autoscaler.loop import merge_serving


class KubeAutoscalerIO:
    """``AutoscalerIO`` for the operator: the client's reads and scale writes, and the merged
    serving-status write."""

    def __init__(self, kube: Kube):
        self.kube = kube

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kube, name)  # the client's other attributes (its API objects, counters)

    # The pass reads every model, Deployment and pod and changes none of them (loop.py builds new
    # dicts for what it writes): the cache's objects are read in place, not copied.

    def list_models(self, namespaces: list[str]) -> list[dict[str, Any]]:
        return self.kube.list_models(namespaces, shared=True)

    def list_deployments(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.kube.list_deployments(namespace, selector, shared=True)

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.kube.list_pods(namespace, selector, shared=True)

    def read_scale(self, namespace: str, name: str) -> int | None:
        return self.kube.read_scale(namespace, name)

    def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        self.kube.patch_scale(namespace, name, replicas)

    def post_event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.kube.post_event(obj, type_, reason, message)

    def patch_serving_status(self, namespace: str, name: str, updates: dict[str, dict[str, Any]]) -> None:
        """Only the autoscaler's fields of ``status.serving`` entries, merged into a fresh read and
        written conditionally on its resourceVersion (re-read on conflict)."""
        for _ in range(CONFLICT_RETRIES):
            obj = self.kube.get_model(namespace, name)
            if obj is None:
                return
            serving = merge_serving((obj.get("status") or {}).get("serving") or [], updates)
            if serving is None:
                return
            if self.kube.patch_model_status(namespace, name, {"serving": serving}, obj["metadata"]["resourceVersion"]):
                return
        raise ApiException(status=409, reason=f"status of {namespace}/{name} kept changing; retry next pass")
