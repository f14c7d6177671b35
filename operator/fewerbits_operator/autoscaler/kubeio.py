"""``AutoscalerIO`` over the official ``kubernetes`` client: the autoscaler's only API I/O.

Writes: the Deployment's scale subresource (``patch_namespaced_deployment_scale``), the
QuantizedModel's status subresource (``patch_namespaced_custom_object_status``, a JSON merge
patch of the whole ``status.serving`` list carrying the ``resourceVersion`` it was computed from,
so a concurrent reconcile write makes it fail with 409 and re-read instead of losing that write),
and Events. Never a spec.

RBAC it needs: quantizedmodels get/list, quantizedmodels/status patch, quantizationpolicies list,
namespaces get, deployments list, deployments/scale get/patch, pods list, events create.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fewerbits_api.base import GROUP, VERSION
from fewerbits_api.policy import PLURAL as POLICY_PLURAL
from fewerbits_api.quantizedmodel import PLURAL as QM_PLURAL

from .loop import merge_serving

log = logging.getLogger("fewerbits.autoscaler.kube")
COMPONENT = "fewerbits-autoscaler"
CONFLICT_RETRIES = 3


class KubernetesAutoscalerIO:
    """Implements ``loop.AutoscalerIO`` with ``kubernetes.client`` APIs."""

    def __init__(self, api: client.ApiClient | None = None):
        if api is None:
            from kubernetes import config
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.ApiClient()
        self.api = api
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.writes = 0
        """API writes made (scale, status, events)."""

    def _plain(self, obj: Any) -> dict[str, Any]:
        return self.api.sanitize_for_serialization(obj)

    # -------------------------------------------------------------- reads

    def list_models(self, namespaces: list[str]) -> list[dict[str, Any]]:
        if not namespaces:
            return self.custom.list_cluster_custom_object(GROUP, VERSION, QM_PLURAL).get("items", [])
        items: list[dict[str, Any]] = []
        for ns in namespaces:
            items += self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, QM_PLURAL).get("items", [])
        return items

    def list_policies(self) -> list[dict[str, Any]]:
        return self.custom.list_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL).get("items", [])

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        try:
            return dict(self.core.read_namespace(namespace).metadata.labels or {})
        except ApiException as e:
            if e.status == 404:
                return {}
            raise

    def list_deployments(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return [self._plain(d) for d in self.apps.list_namespaced_deployment(namespace, label_selector=selector).items]

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return [self._plain(p) for p in self.core.list_namespaced_pod(namespace, label_selector=selector).items]

    def read_scale(self, namespace: str, name: str) -> int | None:
        try:
            scale = self.apps.read_namespaced_deployment_scale(name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return int((scale.spec.replicas if scale.spec else 0) or 0)

    # -------------------------------------------------------------- writes

    def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        self.apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": int(replicas)}},
                                                    _content_type="application/merge-patch+json")
        self.writes += 1

    def patch_serving_status(self, namespace: str, name: str, updates: dict[str, dict[str, Any]]) -> None:
        for attempt in range(CONFLICT_RETRIES):
            try:
                obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, QM_PLURAL, name)
            except ApiException as e:
                if e.status == 404:
                    return
                raise
            serving = merge_serving((obj.get("status") or {}).get("serving") or [], updates)
            if serving is None:
                return
            body = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                    "status": {"serving": serving}}
            try:
                # A dict body is sent as a JSON merge patch by this client for custom objects.
                self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, QM_PLURAL, name, body)
                self.writes += 1
                return
            except ApiException as e:
                if e.status == 404:
                    return
                if e.status != 409 or attempt == CONFLICT_RETRIES - 1:
                    raise

    def post_event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        md = obj["metadata"]
        now = datetime.now(timezone.utc).isoformat()
        body = {
            "metadata": {"generateName": f"{md['name']}.", "namespace": md["namespace"]},
            "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": md["name"],
                               "namespace": md["namespace"], "uid": md.get("uid")},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT, "reportingInstance": COMPONENT,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self.core.create_namespaced_event(md["namespace"], body)
            self.writes += 1
        except ApiException as e:  # an event lost is not a failed scaling pass
            log.warning("could not post event %s on %s/%s: %s", reason, md["namespace"], md["name"], e.reason)
