"""The relevance filter: the gap it fills is that ``kopf.on.event`` hands a handler the new body
only, never the old one, so it cannot tell a heartbeat from a change. ``RelevanceFilter`` keeps,
per object, the projection of what the operator acts on (``*_relevant`` below) and says whether a
new event changed it: a Node's GPU facts, a policy's spec, a model's generation and metadata (not
its status: our own writes and the autoscaler's), every version of a Job, Deployment or
LeaderWorkerSet (their status is what reconcile reads).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

Projection = Callable[[dict[str, Any]], Any]


def node_facts(node: dict[str, Any]) -> dict[str, Any]:
    """What the planner reads of a Node (planner/catalog.py ``_node_gpu``): labels (GPU Feature
    Discovery's, and any a target's nodeSelector names), ``spec.unschedulable`` and
    ``status.allocatable``. The index keeps only this, and only a change of it is a change:
    heartbeats (``status.conditions``), images and addresses are not."""
    md, spec, st = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    return {
        "metadata": {"name": md.get("name"), "labels": dict(md.get("labels") or {}),
                     "resourceVersion": md.get("resourceVersion")},
        "spec": {"unschedulable": bool(spec.get("unschedulable"))},
        "status": {"allocatable": dict(st.get("allocatable") or {})},
    }


POD_METADATA = ("name", "namespace", "uid", "labels", "resourceVersion", "creationTimestamp", "deletionTimestamp")


def pod_facts(pod: dict[str, Any]) -> dict[str, Any]:
    """What the loops read of a model's pod (Kube.list_pods from the pods index: the autoscaler's
    classify_pods, the zero router, the metrics probe, observe's terminations): identity, labels
    and timestamps, each container's name and ports (``http_port``) and the whole status (phase,
    podIP, conditions, container states). The spec's command lines, env, volumes and the
    annotations are dropped: most of a pod's bytes, read by nothing here, held 300 times over."""
    md, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    return {
        "metadata": {k: md[k] for k in POD_METADATA if md.get(k) is not None},
        "spec": {"nodeName": spec.get("nodeName"),
                 "containers": [{"name": c.get("name"), "ports": c.get("ports") or []}
                                for c in spec.get("containers") or []]},
        "status": pod.get("status") or {},
    }


def node_relevant(node: dict[str, Any]) -> Any:
    facts = node_facts(node)
    return (facts["metadata"]["labels"], facts["spec"], facts["status"])


def policy_relevant(policy: dict[str, Any]) -> Any:
    """A policy decides through its spec (and is found by name); its status does not change any model."""
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


def key_of(obj: dict[str, Any]) -> str:
    md = obj.get("metadata") or {}
    return f"{md.get('namespace') or ''}/{md.get('name')}"


class RelevanceFilter:
    """The last projection seen per object of one kind. kopf calls an object's event handler for
    one event at a time, in order; ``observe`` is that handler's first step."""

    def __init__(self, relevant: Projection):
        self._relevant = relevant
        self._lock = threading.Lock()
        self._seen: dict[str, Any] = {}

    def observe(self, event_type: str | None, obj: dict[str, Any]) -> tuple[Any, Any] | None:
        """(old projection, new projection) when this event is a relevant change, else None. An
        object first seen (kopf's listing: type None, or ADDED) has old None; a DELETED one, new
        None. A listing event of an object already seen is a change only when it differs (a
        re-list after a broken watch reports what changed meanwhile)."""
        key = key_of(obj)
        with self._lock:
            old = self._seen.pop(key, None) if event_type == "DELETED" else self._seen.get(key)
            if event_type == "DELETED":
                return (old[0], None) if old is not None else None
            new = self._seen[key] = (self._relevant(obj),)  # boxed: a projection may itself be None
        if old is not None and old == new:
            return None
        return (old[0] if old is not None else None, new[0])

    def forget_all_but(self, keys: set[str]) -> list[str]:
        """Keys seen but not in ``keys`` (a re-list missed their deletion): dropped and returned."""
        with self._lock:
            gone = [k for k in self._seen if k not in keys]
            for k in gone:
                del self._seen[k]
        return gone
