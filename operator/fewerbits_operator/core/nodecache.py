"""The node cache's referenced-keys feed: which artifacts QuantizedModels still reference reaches
the node cache through one ConfigMap per namespace that has node-cache models
(``fewerbits-node-cache-references``, key ``keys``: the artifact keys every node-cache model of the
watched namespaces references, one a line; content addresses only, no names, no secrets). The fetch
init container mounts it (serving_load.py: optional, so a pod started before the first sync evicts
by plain LRU) and passes it as ``--referenced-keys``: unreferenced entries are evicted first.
:func:`decide_references` computes the ConfigMaps (pure); ``execute.execute_references`` writes
them; the runner's references loop observes (``observe_references``) and syncs.

What a serving pod renders for the cache (its mounts, volumes, arguments) is serving_load.py's;
this module is the loop's, above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union

from fewerbits_api.base import API_VERSION
from fewerbits_api.quantizedmodel import QuantizedModelSpec

from fewerbits_operator.serving.render import MANAGED_BY
from fewerbits_operator.core.retention import effective_models, referenced_keys
from fewerbits_operator.serving.serving_load import (  # noqa: F401  (re-exported: the pod's side of the cache)
    NODE_CACHE_MOUNT,
    REFERENCES_CONFIGMAP,
    REFERENCES_FILE,
    REFERENCES_HEADER,
    REFERENCES_MOUNT,
    REFERENCES_VOLUME,
    ServingLoad,
    serving_load,
    stream_model_uri,
)


# ------------------------------------------------------------------ the referenced-keys feed


@dataclass(frozen=True)
class NodeCacheUse:
    """One watched model, as the references feed sees it."""

    namespace: str
    name: str
    uid: str
    node_cache: bool
    """Its effective spec serves with ``artifactCache: Node`` (and ``loadFormat: fetch``)."""
    keys: frozenset[str]
    """The artifact keys its status names (planned, in the making, served)."""


@dataclass(frozen=True)
class ApplyReferences:
    namespace: str
    body: dict[str, Any]
    resource_version: str | None
    """None: create; else replace that version (a conflict waits for the next sync)."""


@dataclass(frozen=True)
class DeleteReferences:
    namespace: str
    resource_version: str


ReferencesAction = Union[ApplyReferences, DeleteReferences]


def uses_node_cache(spec: QuantizedModelSpec | None) -> bool:
    return spec is not None and spec.serving.artifactCache == "Node" and spec.serving.loadFormat == "fetch"


def references_body(namespace: str, keys: frozenset[str], owners: list[NodeCacheUse]) -> dict[str, Any]:
    """The ConfigMap for one namespace: every referenced key (sorted), owned by that namespace's
    node-cache models (not as controller), so it goes with the last of them."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": REFERENCES_CONFIGMAP,
            "namespace": namespace,
            "labels": {**MANAGED_BY, "app.kubernetes.io/component": "node-cache-references"},
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": "QuantizedModel", "name": u.name, "uid": u.uid,
                                 "controller": False, "blockOwnerDeletion": False}
                                for u in sorted(owners, key=lambda u: (u.name, u.uid))],
        },
        "data": {REFERENCES_FILE: REFERENCES_HEADER + "".join(f"{k}\n" for k in sorted(keys))},
    }


def _same(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    md, want = current.get("metadata") or {}, desired["metadata"]
    return ((current.get("data") or {}) == desired["data"]
            and all((md.get("labels") or {}).get(k) == v for k, v in want["labels"].items())
            and [(o.get("name"), o.get("uid")) for o in md.get("ownerReferences") or []]
            == [(o["name"], o["uid"]) for o in want["ownerReferences"]])


def decide_references(uses: list[NodeCacheUse],
                      current: Mapping[str, Mapping[str, Any] | None]) -> list[ReferencesAction]:
    """The writes that bring each namespace's referenced-keys ConfigMap to what the models say.
    Pure. ``current``: per namespace looked at (every namespace with a model), its ConfigMap as the
    API server returned it, or None. A namespace with node-cache models gets the cluster-wide key
    list; one without them loses its ConfigMap; an unchanged one is not written."""
    keys = frozenset().union(*(u.keys for u in uses if u.node_cache))
    owners: dict[str, list[NodeCacheUse]] = {}
    for u in uses:
        if u.node_cache:
            owners.setdefault(u.namespace, []).append(u)
    out: list[ReferencesAction] = []
    for ns in sorted(set(current) | set(owners)):
        cm = current.get(ns)
        if ns in owners:
            body = references_body(ns, keys, owners[ns])
            if cm is None:
                out.append(ApplyReferences(ns, body, None))
            elif not _same(cm, body):
                out.append(ApplyReferences(ns, body, (cm.get("metadata") or {}).get("resourceVersion") or ""))
        elif cm is not None:
            out.append(DeleteReferences(ns, (cm.get("metadata") or {}).get("resourceVersion") or ""))
    return out


def observe_references(kube: Any, settings: Any) -> tuple[list[NodeCacheUse], dict[str, dict[str, Any] | None]]:
    """The watched models as the feed sees them (effective specs, status keys) and, for each
    namespace with a model, its referenced-keys ConfigMap (one GET by name per namespace)."""
    uses = [NodeCacheUse(body["metadata"]["namespace"], body["metadata"]["name"], body["metadata"].get("uid", ""),
                         uses_node_cache(acc.spec), referenced_keys([status]))
            for body, status, acc in effective_models(kube, settings)]
    current = {ns: kube.get_configmap(ns, REFERENCES_CONFIGMAP) for ns in sorted({u.namespace for u in uses})}
    return uses, current
