"""What observe reads without an API call: kopf indexes (``@kopf.index``, registered in
handlers.py), one per kind, each keyed by ``(namespace, name)`` and holding the object slimmed to
what the operator reads (no ``managedFields``; a Node only its GPU facts, relevance.node_facts;
a pod its identity, ports and status, relevance.pod_facts).

kopf fills and empties the indexes in its event loop; the reconciles run in worker threads and
read them through ``IndexView``, which copies values out (a value is a fresh dict per event that
kopf replaces whole and never mutates, and a list of a dict is one C call under the GIL: no torn
read) and applies the read-your-writes guard (freshness.py). kopf delivers no event handler call
before every index finished its first listing (kopf's ``operator_indexed`` toggle,
processing.py); the first ``on.event`` call marks the views ``synced`` (until then, and for a key
the guard holds back, kube.py reads the API server).
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from typing import Any, Callable, Mapping

from fewerbits_operator.base.freshness import ReadYourWrites
from fewerbits_operator.base.relevance import node_facts, pod_facts

Key = tuple[str, str]


SHARED_STR_MAX = 64
"""Strings up to this length are interned by ``compact``: keys, labels, names, enum values."""


def compact(obj: Any) -> Any:
    """A deep copy of a JSON value whose keys and short strings are interned (``sys.intern``).

    Every watch event is its own ``json.loads``: each object held its own copy of every key
    (``metadata``, ``containers``, ``resourceVersion``...) and of every repeated value (a
    namespace, an image, ``IfNotPresent``). Shared, the indexes hold each once: measured on the
    300 models of ``bench/load_models.py``, the Deployments, Services, models and EndpointSlices
    held 17.9 MiB of Python objects as parsed and 8.7 MiB compacted. Interned strings are freed
    with their last reference; a long string (a message, a certificate) is kept as it is."""
    if isinstance(obj, dict):
        return {sys.intern(k) if type(k) is str else k: compact(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [compact(v) for v in obj]
    if type(obj) is str and len(obj) <= SHARED_STR_MAX:
        return sys.intern(obj)
    return obj


def without_managed_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A compacted deep copy without server-side apply bookkeeping (the largest part of most
    objects, read by nothing here)."""
    out = compact(dict(obj))
    md = out.get("metadata")
    if isinstance(md, dict):
        md.pop("managedFields", None)
    return out


def index_entry(body: Mapping[str, Any], slim: Callable[[Mapping[str, Any]], dict[str, Any]] = without_managed_fields
                ) -> dict[Key, dict[str, Any]]:
    """What an index function returns for one object: ``{(namespace, name): slim body}``."""
    md = body.get("metadata") or {}
    return {(md.get("namespace") or "", md.get("name") or ""): slim(body)}


def node_entry(body: Mapping[str, Any]) -> dict[Key, dict[str, Any]]:
    return index_entry(body, lambda b: compact(node_facts(dict(b))))


def pod_entry(body: Mapping[str, Any]) -> dict[Key, dict[str, Any]]:
    return index_entry(body, lambda b: compact(pod_facts(dict(b))))


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


def _rv(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


class IndexView:
    """One kind's kopf index as the reconciles read it. ``index`` is kopf's live
    ``Index[(namespace, name), Store[body]]`` once ``attach``ed (None: no index, reads go live)."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.index: Mapping[Key, Any] | None = None
        self._synced = threading.Event()
        self.guard = ReadYourWrites(self._held_rv, clock)

    # ------------------------------------------------------------ wiring

    def attach(self, index: Mapping[Key, Any]) -> None:
        self.index = index

    def mark_synced(self) -> None:
        if self.index is not None:
            self._synced.set()

    def synced(self) -> bool:
        return self._synced.is_set()

    # ------------------------------------------------------------ reads

    def _values(self, key: Key) -> list[dict[str, Any]]:
        if self.index is None:
            return []
        store = self.index.get(key)
        return list(store) if store is not None else []

    def _latest(self, key: Key) -> dict[str, Any] | None:
        """The object under ``key``; of two (deleted and created again within kopf's batch window,
        two uids) the later version."""
        values = self._values(key)
        if not values:
            return None
        return max(values, key=lambda o: int(_rv(o)) if (_rv(o) or "").isdigit() else 0)

    def _held_rv(self, flat_key: str) -> str | None:
        ns, _, name = flat_key.partition("/")
        held = self._latest((ns, name))
        return _rv(held) if held is not None else None

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A deep copy of the object held under (namespace, name), or None."""
        o = self._latest((namespace or "", name))
        return copy.deepcopy(o) if o is not None else None

    def items(self, namespace: str | None = None, where: Callable[[dict[str, Any]], bool] | None = None,
              shared: bool = False) -> list[dict[str, Any]]:
        """Deep copies of what the index holds: all, or one namespace's (and of those, what ``where``
        accepts). ``shared``: the held objects themselves, for a caller that only reads them (the
        autoscaler's pass over every model): kopf replaces a held object on each event and nothing
        here changes one in place, so a reader sees one consistent version."""
        if self.index is None:
            return []
        keys = [k for k in list(self.index) if namespace is None or k[0] == namespace]
        out = []
        for k in keys:
            o = self._latest(k)
            if o is not None and (where is None or where(o)):
                out.append(o if shared else copy.deepcopy(o))
        return out

    # ------------------------------------------------------------ the read-your-writes guard

    def fresh(self, namespace: str, name: str) -> bool:
        """Synced, and holding at least what this process last wrote or read of the object."""
        return self.synced() and self.guard.fresh(f"{namespace or ''}/{name}")

    def fresh_namespace(self, namespace: str) -> bool:
        return self.synced() and self.guard.fresh_prefix(f"{namespace}/")

    def note(self, namespace: str, name: str, resource_version: str | None) -> None:
        self.guard.note(f"{namespace or ''}/{name}", resource_version)

    def invalidate(self, namespace: str, name: str) -> None:
        self.guard.invalidate(f"{namespace or ''}/{name}")
