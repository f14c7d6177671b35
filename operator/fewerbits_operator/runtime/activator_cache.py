"""What the activator reads per request, kept by watches of its own (docs/routing.md, "What the
activator reads, and when"): per namespace it serves, the QuantizedModels, the models' serving pods
(``fewerbits.io/model`` with ``app.kubernetes.io/component=server``) and the models' Deployments.

Why: a request read its model (GET) and its pods (LIST), and a held request LISTed the pods every
0.5 s, so a burst of held requests multiplied API reads by requests x seconds held. From these
caches a request at steady state makes no API call, and a held request waits on a change of its
model's pods, Deployments or model object (``wait_for_change``, signalled by the watch) instead of
polling. The activator's one write, the wake (a conditional replace of the scale from 0,
Kube.wake_scale), is made as before, on a scale read at the API server: a cache never decides a write.

The activator runs no kopf (it is its own small process, activator_main.py), so, like
slicewatch.py: list once, then watch from the list's resourceVersion (bookmarks asked); a watch the
API server ends after ``timeout_seconds`` goes on from the last version seen; any error (410 Gone,
RBAC, the API unreachable, a read silent past the watch's timeout) marks the resource not serving
and lists again after a back-off of 1, 2, 4 ... 30 s. A namespace is served from the caches only
while all three of its watches serve; until then (start-up) and while one is broken, the activator
reads through the API as before, and every API request is counted
(``fewerbits_activator_api_calls_total{verb,resource}``, ``count_api_calls``).

Which namespaces: those of the tenant ports (activator_main.py starts them at once), and any other
the first time a request's model is found there by a read through the API (a namespace a made-up
name points at holds no model, so it starts no watch), at most ``WATCHED_NAMESPACES_MAX``.

Objects are held slim (what the activator reads) and never changed in place: each event replaces
one whole, so a reader may keep what it got (read only) without a copy.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

from kubernetes.client.exceptions import ApiException
from prometheus_client import Counter

from fewerbits_operator.base.indexes import without_managed_fields
from fewerbits_operator.serving.render import LABEL_COMPONENT, LABEL_MODEL

log = logging.getLogger("fewerbits.activator")

API_CALLS = Counter("fewerbits_activator_api_calls_total",
                    "API requests the activator made, by verb and resource as RBAC names them (a watch "
                    "counts once, when it is opened)", ["verb", "resource"])
MODELS, PODS, DEPLOYMENTS = "quantizedmodels", "pods", "deployments"
SERVING_POD_SELECTOR = f"{LABEL_MODEL},{LABEL_COMPONENT}=server"
"""The activator's pods cache: every serving pod of every model (Activator.pods reads one model's)."""
DEPLOYMENT_SELECTOR = LABEL_MODEL
"""Every Deployment of a model (Activator.wake picks the variant to wake among one model's)."""
WATCHED_NAMESPACES_MAX = 128
"""Namespaces watched at most (3 watches each); past it a namespace is read through the API."""
WATCH_TIMEOUT_SECONDS = 300
"""How long the API server holds one watch: at rest, 3 watch requests per namespace per period."""
FIRST_BACKOFF_SECONDS, MAX_BACKOFF_SECONDS = 1.0, 30.0

Key = tuple[str, str]
Version = tuple[int, int]


# ------------------------------------------------------------------ counting API requests


def api_call(method: str, url: str, query: Iterable[tuple[str, Any]] | None = None) -> tuple[str, str]:
    """(verb, resource) of one API request, as RBAC names them: ``get``/``list``/``watch``/``create``/
    ``update``/``patch``/``delete``, ``pods``, ``deployments/scale`` (pure)."""
    parts = [p for p in urlsplit(url).path.split("/") if p]
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:] if parts[:1] == ["apis"] else parts
    if len(rest) > 2 and rest[0] == "namespaces":
        rest = rest[2:]
    resource = rest[0] if rest else ""
    named = len(rest) >= 2
    if len(rest) >= 3:
        resource = f"{resource}/{rest[2]}"
    method = method.upper()
    if method == "GET":
        watch = any(k == "watch" and str(v).lower() in ("true", "1") for k, v in query or ())
        return ("get" if named else "watch" if watch else "list"), resource
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete" if named else "deletecollection"}.get(method, method.lower())
    return verb, resource


def count_api_calls(api: Any, counter: Counter = API_CALLS) -> Any:
    """Count every request ``api`` (a kubernetes ApiClient) sends, by ``api_call``: the per-request
    reads, the caches' lists and watches, the wake's scale read and write, the event, a route read."""
    request = api.request

    def counted(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        counter.labels(*api_call(method, url, kwargs.get("query_params"))).inc()
        return request(method, url, *args, **kwargs)

    api.request = counted
    return api


# ------------------------------------------------------------------ what is held


def model_of(obj: dict[str, Any] | None) -> str | None:
    """The model a pod or Deployment belongs to (its ``fewerbits.io/model`` label)."""
    return (((obj or {}).get("metadata") or {}).get("labels") or {}).get(LABEL_MODEL)


def slim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """What ``activator.ready_pod`` reads: identity, labels, deletion, the pod IP and conditions."""
    md, st = pod.get("metadata") or {}, pod.get("status") or {}
    return {"metadata": {k: md[k] for k in ("name", "namespace", "labels", "resourceVersion", "deletionTimestamp")
                         if md.get(k) is not None},
            "status": {"podIP": st.get("podIP"), "conditions": list(st.get("conditions") or [])}}


def slim_deployment(dep: dict[str, Any]) -> dict[str, Any]:
    """What ``activator.variant_to_wake`` reads: name, labels (the variant), replicas."""
    md = dep.get("metadata") or {}
    return {"metadata": {k: md[k] for k in ("name", "namespace", "labels", "resourceVersion") if md.get(k) is not None},
            "spec": {"replicas": (dep.get("spec") or {}).get("replicas")}}


class Gone(Exception):
    """The watch's resourceVersion was compacted away (410): list again."""


class ResourceWatch:
    """One resource of one namespace, label-selected: list, then watch (see the module)."""

    def __init__(self, kube: Any, resource: str, namespace: str, selector: str,
                 slim: Callable[[dict[str, Any]], dict[str, Any]], key: Callable[[dict[str, Any] | None], str | None],
                 changed: Callable[[set[str] | None], None], timeout_seconds: int = WATCH_TIMEOUT_SECONDS):
        self.kube, self.resource, self.namespace, self.selector = kube, resource, namespace, selector
        self.slim, self.key, self.changed = slim, key, changed
        self.timeout_seconds = timeout_seconds
        self._lock = threading.Lock()
        self._objects: dict[str, dict[str, Any]] = {}
        self._by_key: dict[str, dict[str, dict[str, Any]]] = {}
        self._serving = False

    # ------------------------------------------------------------ reads

    def serving(self) -> bool:
        """Listed, and no error since: what it holds is what the API server holds (up to the watch's lag)."""
        return self._serving

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get(name)

    def of(self, key: str) -> list[dict[str, Any]]:
        """The objects of one model (``key``)."""
        with self._lock:
            return list((self._by_key.get(key) or {}).values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    # ------------------------------------------------------------ writes (the watch thread's)

    def _put(self, name: str, obj: dict[str, Any] | None) -> set[str]:
        """Hold ``obj`` under ``name`` (None: remove it); the models whose objects changed. Caller holds the lock."""
        old = self._objects.pop(name, None)
        keys = {k for k in (self.key(old), self.key(obj)) if k is not None}
        if old is not None and (k := self.key(old)) is not None:
            self._by_key.get(k, {}).pop(name, None)
            if not self._by_key.get(k):
                self._by_key.pop(k, None)
        if obj is not None:
            self._objects[name] = obj
            if (k := self.key(obj)) is not None:
                self._by_key.setdefault(k, {})[name] = obj
        return keys

    def replace(self, items: list[dict[str, Any]]) -> None:
        """The whole set, from a list: serving from now on."""
        held = {(o.get("metadata") or {}).get("name"): self.slim(o) for o in items}
        with self._lock:
            self._objects, self._by_key = {}, {}
            for name, obj in held.items():
                if name:
                    self._put(name, obj)
            self._serving = True
        self.changed(None)

    def apply(self, event: dict[str, Any]) -> str | None:
        """One watch event; returns its resourceVersion. An ERROR event raises (410: ``Gone``)."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if int(obj.get("code") or 0) == 410:
                raise Gone(obj.get("message"))
            raise ApiException(status=int(obj.get("code") or 500), reason=obj.get("message"))
        md = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED", "DELETED") and md.get("name"):
            with self._lock:
                keys = self._put(md["name"], self.slim(obj) if kind != "DELETED" else None)
            if keys:
                self.changed(keys)
        return md.get("resourceVersion")

    def broken(self, why: str, level: int = logging.WARNING) -> None:
        """Not serving until the next list: reads go through the API meanwhile."""
        was, self._serving = self._serving, False
        if was:
            self.changed(None)
        log.log(level, "watch of %s in %s (%s): %s; read through the API until it lists again",
                    self.resource, self.namespace, self.selector or "all", why)

    def run(self, stop: threading.Event) -> None:
        """Thread entry."""
        rv: str | None = None
        backoff = FIRST_BACKOFF_SECONDS
        while not stop.is_set():
            try:
                if rv is None:
                    items, rv = self.kube.list_raw(self.resource, self.namespace, self.selector)
                    self.replace(items)
                opened, events = time.monotonic(), 0
                for event in self.kube.watch_raw(self.resource, self.namespace, self.selector, rv,
                                                 self.timeout_seconds):
                    rv = self.apply(event) or rv
                    events += 1
                    if stop.is_set():
                        return
                # The API server ended it (timeoutSeconds): go on from rv. One that ends at once with
                # nothing (a proxy in between that cuts streams) is not reopened in a tight loop.
                if events or time.monotonic() - opened >= FIRST_BACKOFF_SECONDS:
                    backoff = FIRST_BACKOFF_SECONDS
                else:
                    stop.wait(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
            except Gone:
                self.broken("410 Gone (compacted): listing again", logging.INFO)
                rv = None
            except Exception as e:  # noqa: BLE001 - RBAC, the API unreachable, a dead connection: list again
                self.broken(f"{type(e).__name__}: {getattr(e, 'status', '') or e}")
                rv = None
                stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)


class ActivatorCache:
    """The three watches of each namespace served, and the change signal held requests wait on."""

    def __init__(self, kube: Any, *, timeout_seconds: int = WATCH_TIMEOUT_SECONDS,
                 max_namespaces: int = WATCHED_NAMESPACES_MAX):
        self.kube = kube
        self.timeout_seconds = timeout_seconds
        self.max_namespaces = max_namespaces
        self._watches: dict[str, dict[str, ResourceWatch]] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._seq: dict[Key, int] = {}
        self._epoch: dict[str, int] = {}
        self._stop = threading.Event()
        self._full_logged = False

    # ------------------------------------------------------------ which namespaces

    def watch_namespace(self, namespace: str) -> bool:
        """Start the namespace's watches (once); False when ``max_namespaces`` are watched already."""
        with self._lock:
            if namespace in self._watches:
                return True
            if len(self._watches) >= self.max_namespaces:
                if not self._full_logged:
                    self._full_logged = True
                    log.warning("%d namespaces watched already: requests for models of others read the API",
                                self.max_namespaces)
                return False
            changed = lambda keys, ns=namespace: self._bump(ns, keys)  # noqa: E731
            watches = {
                MODELS: ResourceWatch(self.kube, MODELS, namespace, "", without_managed_fields,
                                      lambda o: ((o or {}).get("metadata") or {}).get("name") if o else None,
                                      changed, self.timeout_seconds),
                PODS: ResourceWatch(self.kube, PODS, namespace, SERVING_POD_SELECTOR, slim_pod, model_of, changed,
                                    self.timeout_seconds),
                DEPLOYMENTS: ResourceWatch(self.kube, DEPLOYMENTS, namespace, DEPLOYMENT_SELECTOR, slim_deployment,
                                           model_of, changed, self.timeout_seconds),
            }
            self._watches[namespace] = watches
        for resource, w in watches.items():
            threading.Thread(target=w.run, args=(self._stop,), name=f"activator-watch-{resource}-{namespace}",
                             daemon=True).start()
        return True

    def watching(self, namespace: str) -> bool:
        with self._lock:
            return namespace in self._watches

    def serves(self, namespace: str) -> bool:
        """Whether reads of this namespace come from the caches: all three watches serving."""
        with self._lock:
            watches = self._watches.get(namespace)
        return watches is not None and all(w.serving() for w in watches.values())

    def stop(self) -> None:
        """The watches end at their next event (or the API server's timeout): the threads are daemons."""
        self._stop.set()

    # ------------------------------------------------------------ reads (only where ``serves``)

    def _watch(self, namespace: str, resource: str) -> ResourceWatch:
        with self._lock:
            return self._watches[namespace][resource]

    def model(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._watch(namespace, MODELS).get(name)

    def serving_pods(self, namespace: str, model: str) -> list[dict[str, Any]]:
        return self._watch(namespace, PODS).of(model)

    def deployments(self, namespace: str, model: str) -> list[dict[str, Any]]:
        return self._watch(namespace, DEPLOYMENTS).of(model)

    # ------------------------------------------------------------ the change signal

    def _bump(self, namespace: str, keys: set[str] | None) -> None:
        """A model's objects changed (None: the whole namespace's: a list, a watch broken)."""
        with self._changed:
            if keys is None:
                self._epoch[namespace] = self._epoch.get(namespace, 0) + 1
            else:
                for k in keys:
                    self._seq[(namespace, k)] = self._seq.get((namespace, k), 0) + 1
            self._changed.notify_all()

    def version(self, namespace: str, model: str) -> Version:
        """Read before reading the caches; ``wait_for_change`` returns once it differs."""
        with self._changed:
            return self._epoch.get(namespace, 0), self._seq.get((namespace, model), 0)

    def wait_for_change(self, namespace: str, model: str, seen: Version, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the model's pods, Deployments or model object changed
        since ``seen``, or the namespace was listed again or its watch broke. True when it did."""
        with self._changed:
            return self._changed.wait_for(
                lambda: (self._epoch.get(namespace, 0), self._seq.get((namespace, model), 0)) != seen, timeout)
