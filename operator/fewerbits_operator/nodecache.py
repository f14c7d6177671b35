"""How a serving pod gets its weights: the parts of the pod that `spec.serving.loadFormat` and
`spec.serving.artifactCache` decide (pure: render.py places them).

* ``fetch`` + ``Pod`` (default): the fetch init container downloads and verifies the artifact into
  an emptyDir sized for it; vLLM reads it read-only.
* ``fetch`` + ``Node``: the init container fetches into the node-local cache (a hostPath under
  ``settings.node_cache_root``, ``fewerbits_runtime.nodecache``), verified once per node; vLLM
  mounts the artifact's entry read-only (``subPath``). docs/cache.md says why a hostPath and what
  that means for Pod Security.
* ``stream``: the init container checks the manifest only (storage reachable, credentials
  accepted, artifact published) and installs the launcher; vLLM streams the safetensors from
  ``s3://`` with the Run:ai model streamer. Credentials reach vLLM from the storage Secret as
  environment variables (``secretKeyRef``), never as arguments.

Which artifacts QuantizedModels still reference reaches the node cache through one ConfigMap per
namespace that has node-cache models (``fewerbits-node-cache-references``, key ``keys``: the
artifact keys every node-cache model of the watched namespaces references, one a line; content
addresses only, no names, no secrets). The fetch init container mounts it (optional: a pod started
before the first sync evicts by plain LRU) and passes it as ``--referenced-keys``: unreferenced
entries are evicted first. :func:`decide_references` computes the ConfigMaps (pure);
``execute.execute_references`` writes them; the runner's references loop observes and syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union

from fewerbits_api.artifact import FILES_DIR, artifact_prefix
from fewerbits_api.quantizedmodel import QuantizedModelSpec

from .settings import OperatorSettings

NODE_CACHE_MOUNT = "/node-cache"
"""Where the fetch init container sees the node cache's root."""
REFERENCES_CONFIGMAP = "fewerbits-node-cache-references"
"""Per namespace with node-cache models: the artifact keys QuantizedModels reference."""
REFERENCES_FILE = "keys"
REFERENCES_VOLUME = "node-cache-references"
REFERENCES_MOUNT = "/node-cache-references"
REFERENCES_HEADER = ("# Artifact keys referenced by QuantizedModels with spec.serving.artifactCache: Node,"
                     " one a line.\n"
                     "# Written by the fewerbits operator; the node cache evicts keys not listed here first.\n")


def stream_model_uri(spec: QuantizedModelSpec, key: str) -> str | None:
    """The ``s3://`` folder vLLM streams from (``<uri>/<key>/files/``), or None for a fetched load."""
    if spec.serving.loadFormat != "stream" or spec.storage is None:
        return None
    bucket, prefix = artifact_prefix(spec.storage.uri, key)
    return f"s3://{bucket}/{prefix}{FILES_DIR.strip('/')}/"


@dataclass(frozen=True)
class ServingLoad:
    mode: str
    """``pod``, ``node`` or ``stream``."""
    key: str
    spec: QuantizedModelSpec
    settings: OperatorSettings

    def fetch_args(self, model_dir: str) -> list[str]:
        if self.mode == "node":
            budget = self.settings.node_cache_budget
            return ["--node-cache", NODE_CACHE_MOUNT, *(["--node-cache-budget", budget] if budget else []),
                    "--referenced-keys", f"{REFERENCES_MOUNT}/{REFERENCES_FILE}"]
        if self.mode == "stream":
            return ["--dest", model_dir, "--manifest-only"]
        return ["--dest", model_dir]

    def fetch_mounts(self) -> list[dict[str, Any]]:
        if self.mode == "node":
            return [{"name": "models", "mountPath": NODE_CACHE_MOUNT},
                    {"name": REFERENCES_VOLUME, "mountPath": REFERENCES_MOUNT, "readOnly": True}]
        from .render import MODELS_DIR

        return [{"name": "models", "mountPath": MODELS_DIR}]

    def serving_mount(self, model_dir: str) -> dict[str, Any]:
        if self.mode == "node":
            return {"name": "models", "mountPath": model_dir, "subPath": f"artifacts/{self.key}", "readOnly": True}
        from .render import MODELS_DIR

        return {"name": "models", "mountPath": MODELS_DIR, "readOnly": True}

    def volume(self, empty_dir: dict[str, Any]) -> dict[str, Any]:
        if self.mode == "node":
            return {"name": "models", "hostPath": {"path": self.settings.node_cache_root, "type": "DirectoryOrCreate"}}
        if self.mode == "stream":
            return {"name": "models", "emptyDir": {"sizeLimit": "64Mi"}}  # the manifest only
        return {"name": "models", "emptyDir": empty_dir}

    def extra_volumes(self) -> list[dict[str, Any]]:
        """The referenced-keys ConfigMap for the node cache's eviction order (optional: absent
        until the operator's first sync, and then every entry counts as unreferenced)."""
        if self.mode != "node":
            return []
        return [{"name": REFERENCES_VOLUME, "configMap": {"name": REFERENCES_CONFIGMAP, "optional": True}}]

    def serving_env(self) -> list[dict[str, Any]]:
        """The streamer's environment: storage credentials from the Secret (boto3's chain, which the
        streamer's S3 backend uses), the endpoint and path-style addressing for S3-compatible stores."""
        if self.mode != "stream":
            return []
        from .render import storage_credential_env

        storage = self.spec.storage
        assert storage is not None
        env = list(storage_credential_env(storage))
        if storage.endpoint:
            env += [{"name": "AWS_ENDPOINT_URL", "value": storage.endpoint},
                    {"name": "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "value": "0"}]
        if storage.region:
            env.append({"name": "AWS_REGION", "value": storage.region})
        return env


def serving_load(spec: QuantizedModelSpec, key: str, settings: OperatorSettings) -> ServingLoad:
    if spec.serving.loadFormat == "stream":
        mode = "stream"
    elif spec.serving.artifactCache == "Node":
        mode = "node"
    else:
        mode = "pod"
    return ServingLoad(mode, key, spec, settings)


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
    from fewerbits_api.base import API_VERSION

    from .render import MANAGED_BY

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
    from .retention import referenced_keys, effective_models

    uses = [NodeCacheUse(body["metadata"]["namespace"], body["metadata"]["name"], body["metadata"].get("uid", ""),
                         uses_node_cache(acc.spec), referenced_keys([status]))
            for body, status, acc in effective_models(kube, settings)]
    current = {ns: kube.get_configmap(ns, REFERENCES_CONFIGMAP) for ns in sorted({u.namespace for u in uses})}
    return uses, current
