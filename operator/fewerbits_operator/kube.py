"""The one module that talks to the Kubernetes API server (STYLE.md rule 1).

Everything else computes; this reads and writes. AlreadyExists on create and NotFound on delete
are success (STYLE.md rule 2). Secrets are read only to check they exist and, for the operator's
own look-ups in object storage and the model source, for their credential values; those values
never leave this process (not logged, not in status, not in events).
"""

from __future__ import annotations

import base64
import fnmatch
import logging
import threading
from datetime import datetime, timezone
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from fewerbits_api.base import GROUP, VERSION
from fewerbits_api.policy import PLURAL as POLICY_PLURAL
from fewerbits_api.quantizedmodel import PLURAL as QM_PLURAL

log = logging.getLogger("fewerbits.kube")
COMPONENT = "fewerbits-operator"
CONFLICT_RETRIES = 3


def load_config() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def namespace_watched(namespace: str, patterns: list[str]) -> bool:
    """kopf's rule: included by any positive pattern (or all when there is none), excluded by any `!pattern`."""
    positive = [p for p in patterns if not p.startswith("!")]
    negative = [p[1:] for p in patterns if p.startswith("!")]
    included = not positive or any(fnmatch.fnmatchcase(namespace, p) for p in positive)
    return included and not any(fnmatch.fnmatchcase(namespace, p) for p in negative)


def _missing(e: ApiException) -> bool:
    return e.status == 404


class Kube:
    """Typed verbs over the API objects the operator touches."""

    def __init__(self, api: client.ApiClient | None = None):
        self.api = api or load_config()
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self._lock = threading.Lock()
        self.writes = 0
        """API writes made by this process (for metrics and the 'no writes at rest' check)."""

    def _wrote(self) -> None:
        with self._lock:
            self.writes += 1

    # ------------------------------------------------------------ QuantizedModel / Policy

    def get_model(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, QM_PLURAL, name)
        except ApiException as e:
            if _missing(e):
                return None
            raise

    def list_models(self, namespaces: list[str]) -> list[dict[str, Any]]:
        """Models in the watched namespaces: all when empty; names or glob patterns (as kopf takes
        them: `team-*`, `!team-test`)."""
        if not namespaces or any(set(ns) & set("*?[!") for ns in namespaces):
            items = self.custom.list_cluster_custom_object(GROUP, VERSION, QM_PLURAL).get("items", [])
            return [o for o in items if namespace_watched(o["metadata"]["namespace"], namespaces)]
        items: list[dict[str, Any]] = []
        for ns in namespaces:
            items += self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, QM_PLURAL).get("items", [])
        return items

    def patch_model_status(self, namespace: str, name: str, status_patch: dict[str, Any],
                           resource_version: str | None = None) -> bool:
        """JSON merge patch of the status subresource (lists are replaced whole). With a
        resourceVersion the write is conditional: it returns False on a conflict (someone wrote in
        between, e.g. the autoscaler), and the caller recomputes from a fresh read."""
        body: dict[str, Any] = {"status": status_patch}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, QM_PLURAL, name, body)
            self._wrote()
        except ApiException as e:
            if e.status == 409:
                return False
            if not _missing(e):
                raise
        return True

    def patch_serving_status(self, namespace: str, name: str, updates: dict[str, dict[str, Any]]) -> None:
        """The autoscaler's status write: only its fields of ``status.serving`` entries, merged
        into a fresh read and written conditionally on its resourceVersion (re-read on conflict)."""
        from .autoscaler.loop import merge_serving

        for attempt in range(CONFLICT_RETRIES):
            obj = self.get_model(namespace, name)
            if obj is None:
                return
            serving = merge_serving((obj.get("status") or {}).get("serving") or [], updates)
            if serving is None:
                return
            if self.patch_model_status(namespace, name, {"serving": serving}, obj["metadata"]["resourceVersion"]):
                return
        raise ApiException(status=409, reason=f"status of {namespace}/{name} kept changing; retry next pass")

    def list_policies(self) -> list[dict[str, Any]]:
        return self.custom.list_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL).get("items", [])

    # ------------------------------------------------------------ cluster facts

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        try:
            return dict(self.core.read_namespace(namespace).metadata.labels or {})
        except ApiException as e:
            if _missing(e):
                return {}
            raise

    def list_nodes(self) -> list[dict[str, Any]]:
        nodes = self.core.list_node()
        return [self.api.sanitize_for_serialization(n) for n in nodes.items]

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """Decoded data of a Secret, or None when it does not exist."""
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as e:
            if _missing(e):
                return None
            raise
        return {k: base64.b64decode(v).decode(errors="replace") for k, v in (secret.data or {}).items()}

    # ------------------------------------------------------------ Jobs and pods

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.api.sanitize_for_serialization(self.batch.read_namespaced_job(name, namespace))
        except ApiException as e:
            if _missing(e):
                return None
            raise

    def create(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Create a Job, Deployment or Service; returns None when it already existed."""
        kind, ns = body["kind"], body["metadata"]["namespace"]
        try:
            if kind == "Job":
                out = self.batch.create_namespaced_job(ns, body)
            elif kind == "Deployment":
                out = self.apps.create_namespaced_deployment(ns, body)
            elif kind == "Service":
                out = self.core.create_namespaced_service(ns, body)
            else:
                raise ValueError(f"cannot create {kind}")
        except ApiException as e:
            if e.status == 409:
                return None
            raise
        self._wrote()
        return self.api.sanitize_for_serialization(out)

    def add_owner(self, kind: str, namespace: str, name: str, owner_refs: list[dict[str, Any]]) -> None:
        patch = {"metadata": {"ownerReferences": owner_refs}}
        try:
            if kind == "Job":
                self.batch.patch_namespaced_job(name, namespace, patch)
        except ApiException as e:
            if _missing(e):
                return  # removed meanwhile (TTL): nothing to own
            raise
        self._wrote()

    def job_pods(self, namespace: str, job_name: str) -> list[dict[str, Any]]:
        return self.list_pods(namespace, f"job-name={job_name}")

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector)
        return [self.api.sanitize_for_serialization(p) for p in pods.items]

    # ------------------------------------------------------------ Deployments and Services

    def list_deployments(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        deps = self.apps.list_namespaced_deployment(namespace, label_selector=selector)
        return [self.api.sanitize_for_serialization(d) for d in deps.items]

    def replace_deployment(self, body: dict[str, Any]) -> bool:
        """Replace at the resourceVersion in ``body``; False when it changed meanwhile (e.g. scaled)."""
        md = body["metadata"]
        try:
            self.apps.replace_namespaced_deployment(md["name"], md["namespace"], body)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        self._wrote()
        return True

    def read_scale(self, namespace: str, name: str) -> int | None:
        """A Deployment's replicas from its scale subresource; None when it is gone."""
        try:
            scale = self.apps.read_namespaced_deployment_scale(name, namespace)
        except ApiException as e:
            if _missing(e):
                return None
            raise
        return int((scale.spec.replicas if scale.spec else 0) or 0)

    def patch_scale(self, namespace: str, name: str, replicas: int) -> None:
        """The autoscaler's only Deployment write: the scale subresource, never the spec."""
        self.apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": int(replicas)}},
                                                    _content_type="application/merge-patch+json")
        self._wrote()

    def delete_deployment(self, namespace: str, name: str) -> None:
        try:
            self.apps.delete_namespaced_deployment(name, namespace, propagation_policy="Background")
            self._wrote()
        except ApiException as e:
            if not _missing(e):
                raise

    def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.api.sanitize_for_serialization(self.core.read_namespaced_service(name, namespace))
        except ApiException as e:
            if _missing(e):
                return None
            raise

    def patch_service(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.core.patch_namespaced_service(name, namespace, patch)
        self._wrote()

    # ------------------------------------------------------------ events

    def post_event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the object; best effort (an event lost is not a reconcile failure)."""
        md = obj["metadata"]
        now = datetime.now(timezone.utc)
        body = {
            "metadata": {"generateName": f"{md['name']}.", "namespace": md["namespace"]},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": md["name"],
                "namespace": md["namespace"], "uid": md.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": COMPONENT,
            "firstTimestamp": now.isoformat(),
            "lastTimestamp": now.isoformat(),
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(md["namespace"], body)
            self._wrote()
        except ApiException as e:
            log.warning("could not post event %s on %s/%s: %s", reason, md["namespace"], md["name"], e.reason)
