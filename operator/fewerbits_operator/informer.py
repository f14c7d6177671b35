"""Watched caches (informers): each kind the operator reads often, listed once and then kept
current by a watch, so that a reconcile reads memory instead of the API server.

``WatchCache`` is one list/watch loop (one kind, cluster-wide or in one namespace); ``Informer``
groups the loops of one kind over the watched namespaces (one cluster-wide loop filtered by the
namespace patterns, or one loop per named namespace: the chart's namespaced RBAC allows nothing
wider). ``TTLCache`` keeps values that no watch serves (namespace labels) for a while.

Read-your-writes: the cache lags the API server by a watch event. A reader that must not act on
an object older than one it wrote or read itself records that object's resourceVersion as the
key's *floor* (``WatchCache.note``); ``fresh(key)`` is False until the watch has delivered that
version or a later one (``rv_at_least``), and the reader goes to the API server meanwhile. A floor
is dropped after ``FLOOR_SECONDS`` whatever happens (an object written again by someone else at a
version that never compares), so a reader falls back to the cache, which conditional writes keep
safe. Kube (kube.py) is the one user.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import threading
import time
from typing import Any, Callable

from kubernetes.client.exceptions import ApiException

log = logging.getLogger("fewerbits.informer")

ChangeHandler = Callable[[dict[str, Any] | None, dict[str, Any] | None], None]
"""Called with (old, new) for a relevant change; old is None on add, new is None on delete."""
ListHandler = Callable[[list[dict[str, Any]]], None]
"""Called with every object after each LIST (the first and every re-list)."""
FLOOR_SECONDS = 30.0
GONE = "gone"
"""A floor meaning: deleted by us; fresh once the cache no longer holds the object."""
STALE = ""
"""A floor meaning: behind, whatever it holds; fresh once the caller has read live and noted it."""


# ---------------------------------------------------------------- what each cache keeps


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


def model_relevant(model: dict[str, Any]) -> Any:
    """A model is reconciled again when its spec changes (generation), its deletion starts, or
    its labels or annotations change; not on status writes (its own, or the autoscaler's), except
    the autoscaler's finding that a variant's pods expose no metrics (the picker's profile follows it)."""
    md = model.get("metadata") or {}
    unmetered = tuple(sorted(str(s.get("variant")) for s in ((model.get("status") or {}).get("serving") or [])
                             if isinstance(s, dict) and s.get("podsWithoutMetrics")))
    return (md.get("generation"), md.get("deletionTimestamp"), md.get("labels"), md.get("annotations"), unmetered)


def any_change(obj: dict[str, Any]) -> Any:
    """Every new version is a change (Jobs and Deployments: their status is what reconcile reads)."""
    return (obj.get("metadata") or {}).get("resourceVersion")


def without_managed_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply bookkeeping: the largest part of most objects, and read by nothing here."""
    md = obj.get("metadata")
    if isinstance(md, dict) and "managedFields" in md:
        obj = {**obj, "metadata": {k: v for k, v in md.items() if k != "managedFields"}}
    return obj


def rv_at_least(rv: str | None, floor: str) -> bool:
    """Whether ``rv`` is ``floor`` or later. resourceVersions are compared as the integers the API
    server gives out (etcd revisions); anything else counts only when equal."""
    if rv is None:
        return False
    if rv == floor:
        return True
    if rv.isdigit() and floor.isdigit():
        return int(rv) >= int(floor)
    return False


def selector_matches(selector: str, labels: dict[str, str]) -> bool | None:
    """An equality-based label selector (``a=b,c!=d``) against labels; None for a form it does
    not read (set-based), so that the caller asks the API server instead."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        else:
            return None
    return True


# ---------------------------------------------------------------- one list/watch loop


class WatchCache:
    """One kind, listed once and then kept current by a watch (what client-go calls a reflector
    and its store).

    ``run`` LISTs, then WATCHes from the list's resourceVersion with bookmarks; when the watch
    ends it resumes from the last resourceVersion seen, and re-LISTs when the server says that
    version is gone (410) or the connection failed. ``on_change`` is called, outside the lock,
    only when ``relevant(obj)`` differs (or an object came or went); a re-LIST compares with what
    was held, so a change missed while disconnected is still reported. ``on_list`` is called with
    every object after each LIST. ``accept`` drops objects the operator does not serve (a
    namespace outside its patterns). Until the first LIST has landed ``synced`` is False and
    callers read live instead.
    """

    def __init__(self, name: str, list_fn: Callable[..., Any], *, relevant: Callable[[dict[str, Any]], Any],
                 slim: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 on_change: ChangeHandler | None = None, on_list: ListHandler | None = None,
                 accept: Callable[[dict[str, Any]], bool] | None = None, watch_timeout_seconds: int = 300,
                 clock: Callable[[], float] = time.monotonic):
        self.name = name
        self._list_fn = list_fn
        self._relevant = relevant
        self._slim = slim or (lambda o: o)
        self._accept = accept or (lambda o: True)
        self.on_change = on_change
        self.on_list = on_list
        self.watch_timeout_seconds = watch_timeout_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._objs: dict[str, dict[str, Any]] = {}
        self._floors: dict[str, tuple[str, float]] = {}
        self._rv: str | None = None
        self.synced = threading.Event()
        self.lists = 0
        self.watches = 0

    # ------------------------------------------------------------ the store (pure; unit-tested)

    @staticmethod
    def key(obj: dict[str, Any]) -> str:
        md = obj.get("metadata") or {}
        return f"{md.get('namespace') or ''}/{md.get('name')}"

    def items(self, where: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        """Deep copies (of those ``where`` accepts): callers may keep or change what they get."""
        with self._lock:
            return [copy.deepcopy(o) for o in self._objs.values() if where is None or where(o)]

    def get(self, key: str) -> dict[str, Any] | None:
        """A deep copy of the object held under ``key`` (``namespace/name``), or None."""
        with self._lock:
            o = self._objs.get(key)
            return copy.deepcopy(o) if o is not None else None

    def note(self, key: str, resource_version: str | None) -> None:
        """The caller wrote or read ``key`` at this version (``GONE``: deleted it): until the cache
        holds it (or a later one), ``fresh(key)`` is False."""
        if not resource_version:
            return
        with self._lock:
            if self._reached(key, resource_version):
                self._floors.pop(key, None)
            else:
                self._floors[key] = (resource_version, self._clock() + FLOOR_SECONDS)

    def invalidate(self, key: str) -> None:
        """The cached ``key`` is known to be behind (a conditional write conflicted): not ``fresh``
        until the caller reads it live and ``note``s what it read (or ``FLOOR_SECONDS`` pass)."""
        with self._lock:
            self._floors[key] = (STALE, self._clock() + FLOOR_SECONDS)

    def fresh_prefix(self, prefix: str) -> bool:
        """``fresh`` for every key that starts with ``prefix`` (``namespace/``: a list in it)."""
        if not self.synced.is_set():
            return False
        with self._lock:
            keys = [k for k in self._floors if k.startswith(prefix)]
        return all(self.fresh(k) for k in keys)

    def fresh(self, key: str) -> bool:
        """Synced, and holding at least what the caller last wrote or read of ``key``."""
        if not self.synced.is_set():
            return False
        with self._lock:
            floor = self._floors.get(key)
            if floor is None:
                return True
            if self._reached(key, floor[0]) or self._clock() >= floor[1]:
                del self._floors[key]
                return True
            return False

    def _reached(self, key: str, floor: str) -> bool:
        if floor == STALE:
            return False
        held = self._objs.get(key)
        if floor == GONE:
            return held is None
        return held is not None and rv_at_least((held.get("metadata") or {}).get("resourceVersion"), floor)

    def replace(self, objs: list[dict[str, Any]], resource_version: str | None) -> None:
        """The result of a LIST. Reports what differs from what was held (nothing on the first)."""
        changes: list[tuple[dict[str, Any] | None, dict[str, Any] | None]] = []
        new = {self.key(o): self._slim(o) for o in objs if self._accept(o)}
        with self._lock:
            if self.synced.is_set():
                for k in set(self._objs) | set(new):
                    old_o, new_o = self._objs.get(k), new.get(k)
                    if old_o is None or new_o is None or self._relevant(old_o) != self._relevant(new_o):
                        changes.append((old_o, new_o))
            self._objs, self._rv = new, resource_version
            self.synced.set()
            listed = list(new.values())
        self._report(changes)
        if self.on_list is not None:
            try:
                self.on_list(listed)
            except Exception as e:  # noqa: BLE001 — a handler's bug must not stop the watch
                log.warning("%s cache: list handler failed: %s: %s", self.name, type(e).__name__, e)

    def apply(self, event_type: str, obj: dict[str, Any]) -> bool:
        """One watch event; True when it was a relevant change (and reported)."""
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if event_type == "BOOKMARK":
            with self._lock:
                self._rv = rv or self._rv
            return False
        if event_type not in ("ADDED", "MODIFIED", "DELETED"):
            return False
        k = self.key(obj)
        with self._lock:
            self._rv = rv or self._rv
            if not self._accept(obj):
                return False
            old = self._objs.get(k)
            if event_type == "DELETED":
                self._objs.pop(k, None)
                change = (old, None) if old is not None else None
            else:
                slim = self._slim(obj)
                self._objs[k] = slim
                change = (old, slim) if old is None or self._relevant(old) != self._relevant(slim) else None
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


# ---------------------------------------------------------------- one kind over the watched namespaces


class Informer:
    """One kind over the namespaces the operator serves: a single loop (``per_namespace`` None:
    cluster-wide, or cluster-scoped kinds) or one loop per namespace name. Reads route by the
    key's namespace; a namespace with no loop is never ``fresh`` (the caller reads live)."""

    def __init__(self, caches: dict[str | None, WatchCache]):
        self.caches = caches
        """Namespace → its loop; the key None: the one cluster-wide loop."""

    @property
    def name(self) -> str:
        return next(iter(self.caches.values())).name

    def _cache(self, namespace: str | None) -> WatchCache | None:
        return self.caches.get(None) or self.caches.get(namespace)

    def synced(self) -> bool:
        return all(c.synced.is_set() for c in self.caches.values())

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for c in self.caches.values():
            if not c.synced.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def items(self, namespace: str | None = None,
              where: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        """Copies of what the loops hold: all, or one namespace's (and of those, what ``where`` accepts)."""
        if namespace is None:
            return [o for c in self.caches.values() for o in c.items(where)]
        cache = self._cache(namespace)
        if cache is None:
            return []
        return cache.items(lambda o: (o.get("metadata") or {}).get("namespace") == namespace
                           and (where is None or where(o)))

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        cache = self._cache(namespace)
        return cache.get(f"{namespace}/{name}") if cache else None

    def fresh(self, namespace: str, name: str) -> bool:
        cache = self._cache(namespace)
        return cache is not None and cache.fresh(f"{namespace}/{name}")

    def fresh_namespace(self, namespace: str) -> bool:
        cache = self._cache(namespace)
        return cache is not None and cache.fresh_prefix(f"{namespace}/")

    def note(self, namespace: str, name: str, resource_version: str | None) -> None:
        cache = self._cache(namespace)
        if cache is not None:
            cache.note(f"{namespace}/{name}", resource_version)

    def invalidate(self, namespace: str, name: str) -> None:
        cache = self._cache(namespace)
        if cache is not None:
            cache.invalidate(f"{namespace}/{name}")

    def start(self, stop: threading.Event) -> list[threading.Thread]:
        threads = []
        for ns, cache in self.caches.items():
            t = threading.Thread(target=cache.run, args=(stop,), daemon=True,
                                 name=f"fewerbits-cache-{cache.name}" + (f"-{ns}" if ns else ""))
            t.start()
            threads.append(t)
        return threads


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
