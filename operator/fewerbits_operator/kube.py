"""The one module that talks to the Kubernetes API server (STYLE.md rule 1).

Everything else computes; this reads and writes. AlreadyExists on create and NotFound on delete
are success (STYLE.md rule 2). Secrets are read only to check they exist and, for the operator's
own look-ups in object storage and the model source, for their credential values; those values
never leave this process (not logged, not in status, not in events).
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import json
import logging
import random
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

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


# ---------------------------------------------------------------- watched caches (informers)

ChangeHandler = Callable[[dict[str, Any] | None, dict[str, Any] | None], None]
"""Called with (old, new) for a relevant change; old is None on add, new is None on delete."""


def node_facts(node: dict[str, Any]) -> dict[str, Any]:
    """What the planner reads of a Node (planner/catalog.py ``_node_gpu``): labels (GPU Feature
    Discovery's, and any a target's nodeSelector names), ``spec.unschedulable`` and
    ``status.allocatable``. The cache keeps only this, and only a change of it is a change:
    heartbeats (``status.conditions``), images and addresses are not."""
    md, spec, st = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    return {
        "metadata": {"name": md.get("name"), "labels": dict(md.get("labels") or {}),
                     "resourceVersion": md.get("resourceVersion")},
        "spec": {"unschedulable": bool(spec.get("unschedulable"))},
        "status": {"allocatable": dict(st.get("allocatable") or {})},
    }


def node_relevant(node: dict[str, Any]) -> Any:
    facts = node_facts(node)
    return (facts["metadata"]["labels"], facts["spec"], facts["status"])


def policy_relevant(policy: dict[str, Any]) -> Any:
    """A policy decides through its spec (and is found by name); its status and bookkeeping
    annotations do not change any model."""
    return policy.get("spec")


class WatchCache:
    """One kind, listed once and then kept current by a watch (what client-go calls an informer).

    ``run`` LISTs, then WATCHes from the list's resourceVersion with bookmarks; when the watch
    ends it resumes from the last resourceVersion seen, and re-LISTs when the server says that
    version is gone (410) or the connection failed. ``on_change`` is called, outside the lock,
    only when ``relevant(obj)`` differs (or an object came or went); a re-LIST compares with what
    was held, so a change missed while disconnected is still reported. Until the first LIST has
    landed ``synced`` is False and callers read live instead.
    """

    def __init__(self, name: str, list_fn: Callable[..., Any], *, relevant: Callable[[dict[str, Any]], Any],
                 slim: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 on_change: ChangeHandler | None = None, watch_timeout_seconds: int = 300):
        self.name = name
        self._list_fn = list_fn
        self._relevant = relevant
        self._slim = slim or (lambda o: o)
        self.on_change = on_change
        self.watch_timeout_seconds = watch_timeout_seconds
        self._lock = threading.Lock()
        self._objs: dict[str, dict[str, Any]] = {}
        self._rv: str | None = None
        self.synced = threading.Event()
        self.lists = 0
        self.watches = 0

    # ------------------------------------------------------------ the store (pure; unit-tested)

    @staticmethod
    def key(obj: dict[str, Any]) -> str:
        md = obj.get("metadata") or {}
        return f"{md.get('namespace') or ''}/{md.get('name')}"

    def items(self) -> list[dict[str, Any]]:
        """Deep copies: callers may keep or change what they get."""
        with self._lock:
            return [copy.deepcopy(o) for o in self._objs.values()]

    def replace(self, objs: list[dict[str, Any]], resource_version: str | None) -> None:
        """The result of a LIST. Reports what differs from what was held (nothing on the first)."""
        changes: list[tuple[dict[str, Any] | None, dict[str, Any] | None]] = []
        new = {self.key(o): self._slim(o) for o in objs}
        with self._lock:
            if self.synced.is_set():
                for k in set(self._objs) | set(new):
                    old_o, new_o = self._objs.get(k), new.get(k)
                    if old_o is None or new_o is None or self._relevant(old_o) != self._relevant(new_o):
                        changes.append((old_o, new_o))
            self._objs, self._rv = new, resource_version
            self.synced.set()
        self._report(changes)

    def apply(self, event_type: str, obj: dict[str, Any]) -> bool:
        """One watch event; True when it was a relevant change (and reported)."""
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if event_type == "BOOKMARK":
            with self._lock:
                self._rv = rv or self._rv
            return False
        k = self.key(obj)
        slim = self._slim(obj)
        with self._lock:
            old = self._objs.get(k)
            if event_type == "DELETED":
                self._objs.pop(k, None)
                change = (old, None) if old is not None else None
            elif event_type in ("ADDED", "MODIFIED"):
                self._objs[k] = slim
                change = (old, slim) if old is None or self._relevant(old) != self._relevant(slim) else None
            else:
                return False
            self._rv = rv or self._rv
        if change is None:
            return False
        self._report([change])
        return True

    def _report(self, changes: list[tuple[dict[str, Any] | None, dict[str, Any] | None]]) -> None:
        if not changes or self.on_change is None:
            return
        for old, new in changes:
            try:
                self.on_change(old, new)
            except Exception as e:  # noqa: BLE001 — a handler's bug must not stop the watch
                log.warning("%s cache: change handler failed: %s: %s", self.name, type(e).__name__, e)

    # ------------------------------------------------------------ the I/O loop

    def run(self, stop: threading.Event) -> None:
        """Thread entry: list and watch until ``stop`` is set; errors back off (1 s → 60 s) and re-list."""
        backoff = 1.0
        need_list = True
        while not stop.is_set():
            try:
                if need_list:
                    self._list()
                    need_list = False
                need_list = self._watch(stop)
                backoff = 1.0
            except Exception as e:  # noqa: BLE001 — network, 403 (RBAC), 5xx: retry from a fresh list
                if isinstance(e, ApiException) and e.status == 403:
                    # Without list or watch the getters keep reading live: correct, only chattier.
                    self.synced.clear()
                log.warning("%s cache: %s: %s; re-listing in %.0fs", self.name, type(e).__name__,
                            getattr(e, "reason", None) or e, backoff)
                need_list = True
                stop.wait(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 60.0)

    def _list(self) -> None:
        # Raw JSON, not the client's typed models: cheaper, and the same dicts the watch yields.
        resp = self._list_fn(_preload_content=False, _request_timeout=60)
        self.lists += 1
        body = json.loads(resp.data)
        self.replace(body.get("items") or [], (body.get("metadata") or {}).get("resourceVersion"))

    def _watch(self, stop: threading.Event) -> bool:
        """One watch request; returns True when a re-list is needed (410 Gone)."""
        from kubernetes.watch.watch import iter_resp_lines

        with self._lock:
            rv = self._rv
        self.watches += 1
        resp = self._list_fn(watch=True, resource_version=rv, allow_watch_bookmarks=True,
                             timeout_seconds=self.watch_timeout_seconds, _preload_content=False,
                             _request_timeout=self.watch_timeout_seconds + 30)
        try:
            for line in iter_resp_lines(resp):
                if stop.is_set():
                    return False
                if not line or not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    if status.get("code") == 410:
                        return True
                    raise ApiException(status=status.get("code"), reason=status.get("message"))
                self.apply(event.get("type", ""), event.get("object") or {})
        finally:
            resp.close()
            resp.release_conn()
        return False


class TTLCache:
    """Values kept for ``ttl`` seconds (0: not kept)."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._values: dict[Any, tuple[float, Any]] = {}

    def get(self, key: Any, load: Callable[[], Any]) -> Any:
        if self.ttl <= 0:
            return load()
        now = self._clock()
        with self._lock:
            hit = self._values.get(key)
            if hit is not None and hit[0] > now:
                return copy.deepcopy(hit[1])
        value = load()
        with self._lock:
            self._values[key] = (now + self.ttl, value)
        return copy.deepcopy(value)


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
        self.nodes: WatchCache | None = None
        self.policies: WatchCache | None = None
        self._namespace_labels = TTLCache(0)

    def start_caches(self, stop: threading.Event, *, on_node_change: ChangeHandler | None = None,
                     on_policy_change: ChangeHandler | None = None, namespace_ttl_seconds: float = 0,
                     wait_seconds: float = 10) -> None:
        """Serve ``list_nodes`` and ``list_policies`` from watched caches, and namespace labels
        for ``namespace_ttl_seconds``. Every reconcile reads all three; without the caches each
        one LISTs every Node and policy. Waits up to ``wait_seconds`` for the first lists (the
        getters read live until then)."""
        self.nodes = WatchCache("nodes", self.core.list_node, relevant=node_relevant, slim=node_facts,
                                on_change=on_node_change)
        self.policies = WatchCache("quantizationpolicies", self._list_policies_raw, relevant=policy_relevant,
                                   on_change=on_policy_change)
        self._namespace_labels = TTLCache(namespace_ttl_seconds)
        for cache in (self.nodes, self.policies):
            threading.Thread(target=cache.run, args=(stop,), name=f"fewerbits-cache-{cache.name}",
                             daemon=True).start()
        deadline = time.monotonic() + wait_seconds
        for cache in (self.nodes, self.policies):
            cache.synced.wait(max(0.0, deadline - time.monotonic()))

    def _list_policies_raw(self, **kwargs: Any) -> Any:
        return self.custom.list_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, **kwargs)

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
        if self.policies is not None and self.policies.synced.is_set():
            return self.policies.items()
        return self.custom.list_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL).get("items", [])

    # ------------------------------------------------------------ cluster facts

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        """A namespace's labels (policies select by them), kept for the TTL given to
        ``start_caches``: a label change reaches a model by its next reconcile after that."""
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
        if self.nodes is not None and self.nodes.synced.is_set():
            return self.nodes.items()
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
