"""The one module that talks to the Kubernetes API server (docs/architecture.md, house rule 1): the API verbs. The
kopf indexes it reads through are indexes.py's views (kopf itself watches: handlers.py).

Everything else computes; this reads and writes. AlreadyExists on create and NotFound on delete
are success (docs/architecture.md, house rule 2). Secrets are read only to check they exist and, for the operator's
own look-ups in object storage and the model source, for their credential values; those values
never leave this process (not logged, not in status, not in events).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from datetime import datetime, timezone
from typing import Any, Iterator

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from fewerbits_api.base import GROUP, VERSION
from fewerbits_api.policy import PLURAL as POLICY_PLURAL
from fewerbits_api.quantizedmodel import PLURAL as QM_PLURAL

from fewerbits_operator.base.apis import (
    HTTP_ROUTE_GROUP,
    HTTP_ROUTE_PLURAL,
    HTTP_ROUTE_VERSION,
    INFERENCE_POOL_GROUP,
    INFERENCE_POOL_PLURAL,
    INFERENCE_POOL_VERSION,
    LWS_GROUP,
    LWS_KIND,
    LWS_PLURAL,
    LWS_VERSION,
)
from fewerbits_operator.base.freshness import GONE
from fewerbits_operator.base.indexes import IndexView, selector_matches
from fewerbits_operator.base.scope import namespace_watched, plain_names  # noqa: F401 — re-exported (observe.py, tests)
from fewerbits_operator.base.ttlcache import TTLCache

INFERENCE_POOL = (INFERENCE_POOL_GROUP, INFERENCE_POOL_VERSION, INFERENCE_POOL_PLURAL)
HTTP_ROUTE = (HTTP_ROUTE_GROUP, HTTP_ROUTE_VERSION, HTTP_ROUTE_PLURAL)
log = logging.getLogger("fewerbits.kube")
COMPONENT = "fewerbits-operator"
CONFLICT_RETRIES = 3
MANAGED_SELECTOR = "app.kubernetes.io/managed-by=fewerbits"
MODEL_LABEL = "fewerbits.io/model"
"""Every pod of a model's workload carries it (render.model_labels): the pods cache's filter."""
ACTIVATOR_SLICE_LABEL, ACTIVATOR_SLICE_MANAGER = "endpointslice.kubernetes.io/managed-by", "activator.fewerbits.io"
"""The models' activator EndpointSlices (atzero.py): the slices cache's filter."""
"""The Jobs and Deployments the operator creates carry this label (render.py); only they are watched."""


def load_config() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _missing(e: ApiException) -> bool:
    return e.status == 404


def _rv(obj: Any) -> str | None:
    """The resourceVersion of a raw object or of one of the client's typed objects."""
    if isinstance(obj, dict):
        md = obj.get("metadata")
        rv = md.get("resourceVersion") if isinstance(md, dict) else None
    else:
        rv = getattr(getattr(obj, "metadata", None), "resource_version", None)
    return rv if isinstance(rv, str) else None


class Kube:
    """Typed verbs over the API objects the operator touches.

    Reads of QuantizedModels, managed Jobs and Deployments, Nodes and policies are served from
    kopf's indexes once ``use_views`` ran and kopf listed them; until then, for a namespace no cache
    covers, and for a key whose cache is behind what this process last wrote or read, they go to
    the API server. "Behind" is exact: every write notes the resourceVersion the server answered
    (``IndexView.note``) and the cache serves that key again only once its watch delivered that
    version or a later one; a conflicting conditional status write marks the model's cache entry
    stale, so the reconcile's retry (reconcile.py retries a ``StatusConflict`` 3 times, re-reading
    through ``get_model``) reads the model live and converges whatever the watch's lag. Reads
    from a cache are raw API JSON (camelCase keys, RFC 3339 timestamps), like the live ones.
    """

    def __init__(self, api: client.ApiClient | None = None):
        self.api = api or load_config()
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.discovery = client.DiscoveryV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self._lock = threading.Lock()
        self.writes = 0
        """API writes made by this process (for metrics and the 'no writes at rest' check)."""
        self.namespaces: list[str] = []
        """The namespace patterns the indexes cover (``use_views``)."""
        self.nodes: IndexView | None = None
        self.policies: IndexView | None = None
        self.models: IndexView | None = None
        self.jobs: IndexView | None = None
        self.deployments: IndexView | None = None
        self.lws: IndexView | None = None
        self.pods: IndexView | None = None
        """The models' pods (labelled ``fewerbits.io/model``): the loops' reads (list_pods)."""
        self.slices: IndexView | None = None
        """The models' activator EndpointSlices (atzero.py's, list_endpoint_slices)."""
        self.services: IndexView | None = None
        """The models' Services (labelled managed-by fewerbits): get_service."""
        self._lws_served_at_start = True
        """Whether the LeaderWorkerSet API was served when kopf started (``lws_available``)."""
        self._namespace_labels = TTLCache(0)
        self._secrets = TTLCache(0)
        self._served = TTLCache(10)

    def use_views(self, namespaces: list[str], views: dict[str, IndexView], read_ttl_seconds: float = 0) -> None:
        """Read through kopf's indexes (runner.py attaches them): models, the managed Jobs,
        Deployments and LeaderWorkerSets of ``namespaces`` (the operator's scope), Nodes and
        policies. Until kopf listed them (``synced``) the getters read live. What no index holds
        (a namespace's labels, a found Secret) is kept ``read_ttl_seconds``."""
        self.namespaces = list(namespaces)
        self.models, self.jobs, self.deployments = views["models"], views["jobs"], views["deployments"]
        self.lws, self.nodes, self.policies = views["leaderworkersets"], views["nodes"], views["policies"]
        self.pods, self.slices, self.services = views.get("pods"), views.get("endpointslices"), views.get("services")
        self._namespace_labels = TTLCache(read_ttl_seconds)
        self._secrets = TTLCache(read_ttl_seconds)
        self._lws_served_at_start = self.serves(LWS_GROUP, LWS_VERSION, LWS_PLURAL)

    def _wrote(self) -> None:
        with self._lock:
            self.writes += 1

    # ------------------------------------------------------------ QuantizedModel / Policy

    def get_model(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The model from the watched cache when it holds what this process last wrote or read of
        it (see the class), else a GET (noted, so the cache serves it again once it caught up)."""
        if self.models is not None and self.models.fresh(namespace, name):
            return self.models.get(namespace, name)
        try:
            obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, QM_PLURAL, name)
        except ApiException as e:
            if _missing(e):
                if self.models is not None:
                    self.models.note(namespace, name, GONE)
                return None
            raise
        if self.models is not None:
            self.models.note(namespace, name, _rv(obj))
        return obj

    def list_models_where(self, namespaces: list[str], where: Any) -> list[dict[str, Any]]:
        """The models of ``list_models`` that ``where`` accepts (the cache copies only those)."""
        if self.models is not None and namespaces == self.namespaces and self.models.synced():
            return self.models.items(where=where)
        return [m for m in self.list_models(namespaces) if where(m)]

    def list_models(self, namespaces: list[str], shared: bool = False) -> list[dict[str, Any]]:
        """Models in the watched namespaces: all when empty; names or glob patterns (`team-*`,
        `!team-test`). From the watched cache when it covers exactly these namespaces (``shared``:
        not copied, for a caller that only reads: ``IndexView.items``)."""
        if self.models is not None and namespaces == self.namespaces and self.models.synced():
            return self.models.items(shared=shared)
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
            out = self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, QM_PLURAL, name, body)
            self._wrote()
        except ApiException as e:
            if e.status == 409:
                if self.models is not None:
                    self.models.invalidate(namespace, name)  # the next get_model reads live
                return False
            if not _missing(e):
                raise
            return True
        if self.models is not None:
            self.models.note(namespace, name, _rv(out))
        return True

    def patch_policy_status(self, name: str, status: dict[str, Any], resource_version: str | None) -> bool:
        """Merge patch of a QuantizationPolicy's status subresource, conditional on its
        resourceVersion: False on a conflict (the policy changed; the next pass recomputes)."""
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            self.custom.patch_cluster_custom_object_status(GROUP, VERSION, POLICY_PLURAL, name, body)
            self._wrote()
        except ApiException as e:
            if e.status == 409:
                return False
            if not _missing(e):
                raise
        return True

    def list_policies(self) -> list[dict[str, Any]]:
        if self.policies is not None and self.policies.synced():
            return self.policies.items()
        return self.custom.list_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL).get("items", [])

    # ------------------------------------------------------------ cluster facts

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        """A namespace's labels (policies select by them), kept for the TTL given to
        ``use_views``: a label change reaches a model by its next reconcile after that."""
        return self._namespace_labels.get(namespace, lambda: self._read_namespace_labels(namespace))

    def _read_namespace_labels(self, namespace: str) -> dict[str, str]:
        try:
            return dict(self.core.read_namespace(namespace).metadata.labels or {})
        except ApiException as e:
            if _missing(e):
                return {}
            raise

    def list_nodes(self) -> list[dict[str, Any]]:
        """Nodes as the planner reads them (``node_facts``), from the watched cache once synced."""
        if self.nodes is not None and self.nodes.synced():
            return self.nodes.items()
        nodes = self.core.list_node()
        return [self.api.sanitize_for_serialization(n) for n in nodes.items]

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """Decoded data of a Secret, or None when it does not exist. A Secret found is kept for the
        TTL given to ``use_views`` (the resync period), shared by the namespace's models: at rest
        each model read its storage Secret once a resync (60 GETs a minute at 300 models), now one
        GET per Secret and period. A rotated or deleted Secret reaches the models within that TTL;
        one not found is read again each time, so a Secret created after its model is seen at once.
        The operator does not watch Secrets (its RBAC reads them by name only)."""
        return self._secrets.get((namespace, name), lambda: self._read_secret(namespace, name),
                                 keep=lambda data: data is not None)

    def _read_secret(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as e:
            if _missing(e):
                return None
            raise
        return {k: base64.b64decode(v).decode(errors="replace") for k, v in (secret.data or {}).items()}

    # ------------------------------------------------------------ Jobs and pods

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A managed Job from the watched cache (as ``get_model``), else a GET. A Job of that name
        without the managed-by label is not in the cache: the operator's create then meets
        AlreadyExists, as it would have found it."""
        if self.jobs is not None and self.jobs.fresh(namespace, name):
            return self.jobs.get(namespace, name)
        try:
            job = self.api.sanitize_for_serialization(self.batch.read_namespaced_job(name, namespace))
        except ApiException as e:
            if _missing(e):
                if self.jobs is not None:
                    self.jobs.note(namespace, name, GONE)
                return None
            raise
        if self.jobs is not None:
            self.jobs.note(namespace, name, _rv(job))
        return job

    def create(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Create a Job, Deployment or Service; returns None when it already existed."""
        kind, ns = body["kind"], body["metadata"]["namespace"]
        try:
            if kind == LWS_KIND:
                out = self.custom.create_namespaced_custom_object(LWS_GROUP, LWS_VERSION, ns, LWS_PLURAL, body)
            elif kind == "Job":
                out = self.batch.create_namespaced_job(ns, body)
            elif kind == "Deployment":
                out = self.apps.create_namespaced_deployment(ns, body)
            elif kind == "Service":
                out = self.core.create_namespaced_service(ns, body)
            elif kind == "ServiceAccount":  # the endpoint picker's (picker.py)
                out = self.core.create_namespaced_service_account(ns, body)
            elif kind == "ConfigMap":
                out = self.core.create_namespaced_config_map(ns, body)
            elif kind == "RoleBinding":
                out = client.RbacAuthorizationV1Api(self.api).create_namespaced_role_binding(ns, body)
            else:
                raise ValueError(f"cannot create {kind}")
        except ApiException as e:
            if e.status == 409:
                return None
            raise
        self._wrote()
        created = self.api.sanitize_for_serialization(out)
        self._noted(kind, ns, body["metadata"].get("name"), _rv(created))
        return created

    def _noted(self, kind: str, namespace: str, name: str | None, resource_version: str | None) -> None:
        """A write of ours: the index of that kind serves the object again once it has it."""
        view = {"Job": self.jobs, "Deployment": self.deployments, LWS_KIND: self.lws, "Service": self.services}.get(kind)
        if view is not None and name:
            view.note(namespace, name, resource_version)

    def add_owner(self, kind: str, namespace: str, name: str, owner_refs: list[dict[str, Any]]) -> None:
        patch = {"metadata": {"ownerReferences": owner_refs}}
        try:
            if kind != "Job":
                raise ValueError(f"cannot add an owner to a {kind}")
            out = self.batch.patch_namespaced_job(name, namespace, patch)
        except ApiException as e:
            if _missing(e):
                return  # removed meanwhile (TTL): nothing to own
            raise
        self._wrote()
        self._noted(kind, namespace, name, _rv(out))

    def list_managed_jobs(self, namespaces: list[str]) -> list[dict[str, Any]]:
        """Every managed Job in the watched namespaces (the cap on running quantization Jobs), from
        the watched cache once synced, else a LIST (no caches: a one-off reconcile)."""
        if self.jobs is not None and namespaces == self.namespaces and self.jobs.synced():
            return self.jobs.items()
        if not namespaces or any(set(ns) & set("*?[!") for ns in namespaces):
            items = self.batch.list_job_for_all_namespaces(label_selector=MANAGED_SELECTOR).items
            jobs = [self.api.sanitize_for_serialization(j) for j in items]
            return [j for j in jobs if namespace_watched(j["metadata"]["namespace"], namespaces)]
        return [self.api.sanitize_for_serialization(j) for ns in namespaces
                for j in self.batch.list_namespaced_job(ns, label_selector=MANAGED_SELECTOR).items]

    def delete_job(self, namespace: str, name: str) -> None:
        """Delete a Job and its pods (a serving canary's evaluation Job once its verdict is read)."""
        try:
            self.batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
            self._wrote()
        except ApiException as e:
            if not _missing(e):
                raise
        self._noted("Job", namespace, name, GONE)

    def job_pods(self, namespace: str, job_name: str) -> list[dict[str, Any]]:
        return self.list_pods(namespace, f"job-name={job_name}")

    def list_pods(self, namespace: str, selector: str, shared: bool = False) -> list[dict[str, Any]]:
        """Pods matching an equality selector; from the watched cache of the models' pods when the
        selector names a model (every pod the cache can miss lacks that label), else a LIST. The
        operator never writes a pod, so the cache is never behind a write of its own."""
        if self.pods is not None and self.pods.fresh_namespace(namespace) and \
                any(t.split("=", 1)[0].strip() == MODEL_LABEL for t in selector.split(",") if "!=" not in t) and \
                selector_matches(selector, {}) is not None:
            return self.pods.items(namespace, lambda p: bool(selector_matches(
                selector, (p.get("metadata") or {}).get("labels") or {})), shared=shared)
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector)
        return [self.api.sanitize_for_serialization(p) for p in pods.items]

    # ------------------------------------------------------------ Deployments and Services

    def list_deployments(self, namespace: str, selector: str, shared: bool = False) -> list[dict[str, Any]]:
        """Deployments matching an equality selector, from the watched cache of managed ones when
        it holds every write of ours in the namespace; else a LIST. Every Deployment the operator
        creates carries the managed-by label (render.py), so the cache has all it can ask for."""
        if self.deployments is not None and self.deployments.fresh_namespace(namespace):
            if selector_matches(selector, {}) is not None:  # a form it reads
                return self.deployments.items(namespace, lambda d: bool(selector_matches(
                    selector, (d.get("metadata") or {}).get("labels") or {})), shared=shared)
        deps = [self.api.sanitize_for_serialization(d)
                for d in self.apps.list_namespaced_deployment(namespace, label_selector=selector).items]
        for d in deps:
            self._noted("Deployment", namespace, (d.get("metadata") or {}).get("name"), _rv(d))
        return deps

    def replace_deployment(self, body: dict[str, Any]) -> bool:
        """Replace at the resourceVersion in ``body``; False when it changed meanwhile (e.g. scaled)."""
        md = body["metadata"]
        try:
            if body.get("kind") == LWS_KIND:
                out = self.custom.replace_namespaced_custom_object(LWS_GROUP, LWS_VERSION, md["namespace"],
                                                                   LWS_PLURAL, md["name"], body)
                self._wrote()
                self._noted(LWS_KIND, md["namespace"], md["name"], _rv(out))
                return True
            out = self.apps.replace_namespaced_deployment(md["name"], md["namespace"], body)
        except ApiException as e:
            if e.status == 409:
                if self.deployments is not None:
                    self.deployments.invalidate(md["namespace"], md["name"])
                return False
            raise
        self._wrote()
        self._noted("Deployment", md["namespace"], md["name"], _rv(out))
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
        out = self.apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": int(replicas)}},
                                                          _content_type="application/merge-patch+json")
        self._wrote()
        self._noted("Deployment", namespace, name, _rv(out))

    # ------------------------------------------------------------ EndpointSlices (atzero.py)

    def list_endpoint_slices(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """EndpointSlices matching an equality selector; the models' activator slices from the
        watched cache when it holds every write of ours in the namespace (the read-your-writes
        guard, as for Deployments), else a LIST."""
        ours = f"{ACTIVATOR_SLICE_LABEL}={ACTIVATOR_SLICE_MANAGER}" in (t.strip() for t in selector.split(",")) \
            and selector_matches(selector, {}) is not None
        if ours and self.slices is not None and self.slices.fresh_namespace(namespace):
            return self.slices.items(namespace, lambda o: bool(selector_matches(
                selector, (o.get("metadata") or {}).get("labels") or {})))
        out = [self.api.sanitize_for_serialization(s)
               for s in self.discovery.list_namespaced_endpoint_slice(namespace, label_selector=selector).items]
        for o in out if ours else ():  # read live: the cache serves them again once it holds what was read
            self._noted_slice(namespace, o["metadata"]["name"], _rv(o))
        return out

    def _noted_slice(self, namespace: str, name: str, resource_version: str | None) -> None:
        if self.slices is not None:
            self.slices.note(namespace, name, resource_version)

    def create_endpoint_slice(self, body: dict[str, Any]) -> None:
        md = body["metadata"]
        try:
            out = self.discovery.create_namespaced_endpoint_slice(md["namespace"], body)
        except ApiException as e:
            if e.status != 409:  # another operator replica created the same slice: success
                raise
            if self.slices is not None:
                self.slices.invalidate(md["namespace"], md["name"])  # theirs: read it live until the cache has it
            return
        self._wrote()
        self._noted_slice(md["namespace"], md["name"], _rv(out))

    def replace_endpoint_slice(self, body: dict[str, Any]) -> bool:
        """Replace at the resourceVersion in ``body``; False when it changed meanwhile."""
        md = body["metadata"]
        try:
            out = self.discovery.replace_namespaced_endpoint_slice(md["name"], md["namespace"], body)
        except ApiException as e:
            if e.status in (404, 409):
                if self.slices is not None:
                    self.slices.invalidate(md["namespace"], md["name"])
                return False
            raise
        self._wrote()
        self._noted_slice(md["namespace"], md["name"], _rv(out))
        return True

    def delete_endpoint_slice(self, namespace: str, name: str, resource_version: str) -> None:
        try:
            self.discovery.delete_namespaced_endpoint_slice(
                name, namespace, body=client.V1DeleteOptions(
                    preconditions=client.V1Preconditions(resource_version=resource_version or None)))
        except ApiException as e:
            if e.status not in (404, 409):
                raise
            if e.status == 409 and self.slices is not None:
                self.slices.invalidate(namespace, name)
                return
        self._wrote()
        self._noted_slice(namespace, name, GONE)

    def wake_scale(self, namespace: str, name: str) -> bool:
        """The activator's wake: 0 -> 1 replica on the scale subresource, only while it is at 0 and
        conditional on the scale's resourceVersion. False when it was not at 0 or changed meanwhile
        (another activator replica woke it, or the autoscaler wrote): safe from several replicas."""
        try:
            scale = self.apps.read_namespaced_deployment_scale(name, namespace)
        except ApiException as e:
            if _missing(e):
                return False
            raise
        if int((scale.spec.replicas if scale.spec else 0) or 0) > 0:
            return False
        body = {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": namespace, "resourceVersion": scale.metadata.resource_version},
                "spec": {"replicas": 1}}
        try:
            out = self.apps.replace_namespaced_deployment_scale(name, namespace, body)
        except ApiException as e:
            if e.status == 409 or _missing(e):
                return False
            raise
        self._wrote()
        self._noted("Deployment", namespace, name, _rv(out))
        return True

    def delete_deployment(self, namespace: str, name: str) -> None:
        try:
            self.apps.delete_namespaced_deployment(name, namespace, propagation_policy="Background")
            self._wrote()
        except ApiException as e:
            if not _missing(e):
                raise
        self._noted("Deployment", namespace, name, GONE)

    # ------------------------------------------------------------ LeaderWorkerSets (multi-node variants)

    def lws_available(self) -> bool:
        """Whether the API server serves leaderworkerset.x-k8s.io/v1 (the CRD is installed).
        kopf resolves the resources it watches once at start-up (scanning is off: no CRD watch),
        so a CRD installed later is not watched until the operator restarts; meanwhile
        ``list_lws`` reads live (the LeaderWorkerSet index stays unsynced) and a multi-node
        variant's group status reaches its model at the model's next resync (``resync_seconds``
        while it is not Ready), not at once."""
        served = self.serves(LWS_GROUP, LWS_VERSION, LWS_PLURAL)
        if served and not self._lws_served_at_start and not getattr(self, "_lws_late_logged", False):
            self._lws_late_logged = True
            log.warning("LeaderWorkerSet API served since the operator started: read live (no watch) "
                        "until the next restart")
        return served

    def list_lws(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """A model's LeaderWorkerSets (equality selector), from the watched cache when it is fresh."""
        if (self.lws is not None and self._lws_served_at_start and self.lws.fresh_namespace(namespace)
                and selector_matches(selector, {}) is not None):
            return self.lws.items(namespace, lambda d: bool(selector_matches(
                selector, (d.get("metadata") or {}).get("labels") or {})))
        out = self.custom.list_namespaced_custom_object(LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL,
                                                        label_selector=selector)
        return list(out.get("items") or [])

    def delete_lws(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name,
                                                        propagation_policy="Background")
            self._wrote()
        except ApiException as e:
            if not _missing(e):
                raise
        self._noted(LWS_KIND, namespace, name, GONE)

    def read_lws_scale(self, namespace: str, name: str) -> int | None:
        """A LeaderWorkerSet's groups from its scale subresource; None when it is gone."""
        try:
            scale = self.custom.get_namespaced_custom_object_scale(LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name)
        except ApiException as e:
            if _missing(e):
                return None
            raise
        return int(((scale or {}).get("spec") or {}).get("replicas") or 0)

    def patch_lws_scale(self, namespace: str, name: str, replicas: int) -> None:
        """The autoscaler's write for a multi-node variant: groups, through the scale subresource."""
        self.custom.patch_namespaced_custom_object_scale(LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name,
                                                         {"spec": {"replicas": int(replicas)}},
                                                         _content_type="application/merge-patch+json")
        self._wrote()

    def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A model's Service from the watched cache when it holds it (and at least what this process
        last wrote); else a GET: a Service not created yet, or one of that name without the
        managed-by label (a conflict routing.py reports), is never in the cache."""
        if self.services is not None and self.services.fresh(namespace, name):
            held = self.services.get(namespace, name)
            if held is not None:
                return held
        try:
            svc = self.api.sanitize_for_serialization(self.core.read_namespaced_service(name, namespace))
        except ApiException as e:
            if _missing(e):
                return None
            raise
        self._noted("Service", namespace, name, _rv(svc))
        return svc

    def patch_service(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        out = self.core.patch_namespaced_service(name, namespace, patch)
        self._wrote()
        self._noted("Service", namespace, name, _rv(self.api.sanitize_for_serialization(out)))

    # ------------------------------------------------------------ InferencePools (routing.py)

    def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves ``plural`` in ``group/version`` (discovery, one GET; the
        answer is kept 10 s, so a CRD installed later is seen within one resync)."""
        def load() -> bool:
            try:
                out = self.custom.get_api_resources(group, version)
            except ApiException as e:
                if _missing(e):
                    return False
                raise
            return any(r.name == plural for r in (out.resources if out else None) or [])
        return bool(self._served.get((group, version, plural), load))

    def _get_custom(self, crd: tuple[str, str, str], namespace: str, name: str) -> dict[str, Any] | None:
        """A namespaced custom object (group, version, plural) by name, or None."""
        try:
            return self.custom.get_namespaced_custom_object(*crd[:2], namespace, crd[2], name)
        except ApiException as e:
            if _missing(e):
                return None
            raise

    def _create_custom(self, crd: tuple[str, str, str], body: dict[str, Any]) -> None:
        """AlreadyExists is success: another operator replica (or an earlier pass) created it."""
        try:
            self.custom.create_namespaced_custom_object(*crd[:2], body["metadata"]["namespace"], crd[2], body)
        except ApiException as e:
            if e.status != 409:
                raise
            return
        self._wrote()

    def get_inference_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_custom(INFERENCE_POOL, namespace, name)

    def create_inference_pool(self, body: dict[str, Any]) -> None:
        self._create_custom(INFERENCE_POOL, body)

    def patch_inference_pool(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(INFERENCE_POOL_GROUP, INFERENCE_POOL_VERSION, namespace,
                                                  INFERENCE_POOL_PLURAL, name, patch)
        self._wrote()

    def get_http_route(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The HTTPRoute of that name (spec.serving.gateway, gatewayroute.py), or None."""
        return self._get_custom(HTTP_ROUTE, namespace, name)

    def create_http_route(self, body: dict[str, Any]) -> None:
        self._create_custom(HTTP_ROUTE, body)

    def replace_http_route(self, body: dict[str, Any]) -> bool:
        """Replace at the resourceVersion in ``body``; False when it changed meanwhile (next pass)."""
        md = body["metadata"]
        try:
            self.custom.replace_namespaced_custom_object(HTTP_ROUTE_GROUP, HTTP_ROUTE_VERSION, md["namespace"],
                                                        HTTP_ROUTE_PLURAL, md["name"], body)
        except ApiException as e:
            if e.status in (404, 409):
                return False
            raise
        self._wrote()
        return True

    # ------------------------------------------------------------ the node cache's referenced keys (nodecache.py)

    def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get_picker_object("ConfigMap", namespace, name)

    def get_picker_object(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A ServiceAccount, RoleBinding, ConfigMap or Service by name (the picker's objects, the node
        cache's references ConfigMap); the picker's Deployment comes from ``list_deployments``."""
        read = {"ServiceAccount": self.core.read_namespaced_service_account,
                "ConfigMap": self.core.read_namespaced_config_map,
                "Service": self.core.read_namespaced_service,
                "RoleBinding": client.RbacAuthorizationV1Api(self.api).read_namespaced_role_binding}[kind]
        try:
            return self.api.sanitize_for_serialization(read(name, namespace))
        except ApiException as e:
            if _missing(e):
                return None
            raise

    def apply_configmap(self, body: dict[str, Any], resource_version: str | None) -> bool:
        """Create (``resource_version`` None) or replace that version; False when it was created or
        changed meanwhile (the next sync reads it again)."""
        md = body["metadata"]
        try:
            if resource_version is None:
                self.core.create_namespaced_config_map(md["namespace"], body)
            else:
                body = {**body, "metadata": {**md, "resourceVersion": resource_version}}
                self.core.replace_namespaced_config_map(md["name"], md["namespace"], body)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        self._wrote()
        return True

    def delete_configmap(self, namespace: str, name: str, resource_version: str) -> None:
        try:
            self.core.delete_namespaced_config_map(name, namespace, body=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(resource_version=resource_version or None)))
        except ApiException as e:
            if not _missing(e) and e.status != 409:
                raise
            return
        self._wrote()

    # ------------------------------------------------------------ the endpoint picker (picker.py)

    def patch_picker_object(self, body: dict[str, Any]) -> None:
        """Merge-patch the picker's ServiceAccount, RoleBinding, ConfigMap or Service to ``body``."""
        kind, md = body["kind"], body["metadata"]
        patch = {k: v for k, v in body.items() if k not in ("apiVersion", "kind", "metadata", "roleRef")}
        patch["metadata"] = {"labels": md.get("labels"), "annotations": md.get("annotations")}
        fn = {"ServiceAccount": self.core.patch_namespaced_service_account,
              "ConfigMap": self.core.patch_namespaced_config_map,
              "Service": self.core.patch_namespaced_service,
              "RoleBinding": client.RbacAuthorizationV1Api(self.api).patch_namespaced_role_binding}[kind]
        fn(md["name"], md["namespace"], patch)
        self._wrote()

    # ------------------------------------------------------------ list and watch, raw (the activator's caches)

    WATCHED = ("quantizedmodels", "pods", "deployments")
    """What ``list_raw`` and ``watch_raw`` read (activator_cache.py: what a request reads)."""

    def _collection(self, resource: str, namespace: str, **kwargs: Any) -> Any:
        if resource == "quantizedmodels":
            return self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, QM_PLURAL, **kwargs)
        if resource == "pods":
            return self.core.list_namespaced_pod(namespace, **kwargs)
        if resource == "deployments":
            return self.apps.list_namespaced_deployment(namespace, **kwargs)
        raise ValueError(f"cannot watch {resource} (one of {', '.join(self.WATCHED)})")

    def list_raw(self, resource: str, namespace: str, selector: str = "") -> tuple[list[dict[str, Any]], str]:
        """One LIST as raw API JSON (not the client's typed objects: a watch-fed cache holds what the
        API server sent), and the list's resourceVersion, from which ``watch_raw`` goes on."""
        out = self._collection(resource, namespace, label_selector=selector or None, _preload_content=False)
        body = json.loads(out.data)
        return list(body.get("items") or []), str((body.get("metadata") or {}).get("resourceVersion") or "")

    def watch_raw(self, resource: str, namespace: str, selector: str, resource_version: str,
                  timeout_seconds: int) -> Iterator[dict[str, Any]]:
        """The events of one WATCH from ``resource_version`` (``{"type", "object"}``, raw JSON,
        bookmarks included), until the API server ends it after ``timeout_seconds``. A read that
        waits ``timeout_seconds`` + 30 s for a byte raises: a connection that died silently is not
        taken for a quiet one. An ``ERROR`` event is passed on (410 Gone: list again)."""
        resp = self._collection(resource, namespace, label_selector=selector or None, watch=True,
                                resource_version=resource_version, allow_watch_bookmarks=True,
                                timeout_seconds=timeout_seconds, _preload_content=False,
                                _request_timeout=(10, timeout_seconds + 30))
        try:
            for line in iter_resp_lines(resp):
                if line.strip():
                    yield json.loads(line)
        finally:  # as kubernetes.watch does: a stream left half-read is closed, never reused
            resp.close()
            resp.release_conn()

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
