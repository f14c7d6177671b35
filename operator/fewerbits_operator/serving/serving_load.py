"""How a serving pod gets its weights: the parts of the pod that `spec.serving.loadFormat` and
`spec.serving.artifactCache` decide (pure: render.py places them).

* ``fetch`` + ``Pod`` (default): the fetch init container downloads and verifies the artifact into
  an emptyDir sized for it; vLLM reads it read-only.
* ``fetch`` + ``Node``: the init container fetches into the node-local cache (a hostPath under
  ``settings.node_cache_root``, ``fewerbits_runtime.nodecache``), verified once per node; vLLM
  mounts the artifact's entry read-only (``subPath``), and the referenced-keys ConfigMap
  (nodecache.py keeps it) orders the cache's evictions. docs/cache.md says why a hostPath and what
  that means for Pod Security.
* ``stream``: the init container checks the manifest only (storage reachable, credentials
  accepted, artifact published) and installs the launcher; vLLM streams the safetensors from
  ``s3://`` with the Run:ai model streamer. Credentials reach vLLM from the storage Secret as
  environment variables (``secretKeyRef``), never as arguments.

This module sits below render.py (which places these parts) and nodecache.py (the loop that keeps
the referenced-keys ConfigMap); it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fewerbits_api.artifact import FILES_DIR, artifact_prefix
from fewerbits_api.jobcontract import ENV_STORAGE_ACCESS_KEY, ENV_STORAGE_SECRET_KEY
from fewerbits_api.names import SECRET_ACCESS_KEY_ID, SECRET_SECRET_ACCESS_KEY
from fewerbits_api.quantizedmodel import QuantizedModelSpec, StorageSpec

from fewerbits_operator.base.settings import OperatorSettings

ADAPTERS_DIR = "/adapters"
"""Where the serving container sees the LoRA adapters it loads (``/adapters/<adapterKey>``)."""
MODELS_DIR = "/models"
"""Where the serving container (and the fetch init container) sees the artifact."""
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


def secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def storage_credential_env(storage: StorageSpec) -> list[dict[str, Any]]:
    """The storage Secret's keys as environment variables (``secretKeyRef``: never the values)."""
    if not storage.credentialsSecret:
        return []
    return [
        secret_env(ENV_STORAGE_ACCESS_KEY, storage.credentialsSecret, SECRET_ACCESS_KEY_ID),
        secret_env(ENV_STORAGE_SECRET_KEY, storage.credentialsSecret, SECRET_SECRET_ACCESS_KEY),
    ]


def stream_model_uri(spec: QuantizedModelSpec, key: str) -> str | None:
    """The ``s3://`` folder vLLM streams from (``<uri>/<key>/files/``), or None for a fetched load."""
    if spec.serving.loadFormat != "stream" or spec.storage is None:
        return None
    bucket, prefix = artifact_prefix(spec.storage.uri, key)
    return f"s3://{bucket}/{prefix}{FILES_DIR.strip('/')}/"


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter a pool's pods load: it passed its gate on that pool's base, and its files are
    published under ``key`` (core/adapters.py decides which)."""

    name: str
    key: str

    @property
    def path(self) -> str:
        return f"{ADAPTERS_DIR}/{self.key}"


@dataclass(frozen=True)
class ServingLoad:
    mode: str
    """``pod``, ``node`` or ``stream``."""
    key: str
    spec: QuantizedModelSpec
    settings: OperatorSettings
    adapters: tuple[ServedAdapter, ...] = ()
    """Fetched like the artifact: into the node cache with it, else into their own emptyDir (a
    streamed load streams the base only)."""

    def keys(self) -> list[str]:
        """The adapters' keys, each once (two adapters may name the same files)."""
        return sorted({a.key for a in self.adapters})

    def fetch_args(self, model_dir: str) -> list[str]:
        adapters = [a for key in self.keys() for a in ("--adapter", key)]
        if adapters and self.mode != "node":
            adapters += ["--adapters-dir", ADAPTERS_DIR]
        if self.mode == "node":
            budget = self.settings.node_cache_budget
            return ["--node-cache", NODE_CACHE_MOUNT, *(["--node-cache-budget", budget] if budget else []),
                    "--referenced-keys", f"{REFERENCES_MOUNT}/{REFERENCES_FILE}", *adapters]
        if self.mode == "stream":
            return ["--dest", model_dir, "--manifest-only", *adapters]
        return ["--dest", model_dir, *adapters]

    def fetch_mounts(self) -> list[dict[str, Any]]:
        if self.mode == "node":
            return [{"name": "models", "mountPath": NODE_CACHE_MOUNT},
                    {"name": REFERENCES_VOLUME, "mountPath": REFERENCES_MOUNT, "readOnly": True}]
        own = [{"name": "adapters", "mountPath": ADAPTERS_DIR}] if self.adapters else []
        return [{"name": "models", "mountPath": MODELS_DIR}, *own]

    def serving_mount(self, model_dir: str) -> dict[str, Any]:
        if self.mode == "node":
            return {"name": "models", "mountPath": model_dir, "subPath": f"artifacts/{self.key}", "readOnly": True}
        return {"name": "models", "mountPath": MODELS_DIR, "readOnly": True}

    def adapter_mounts(self) -> list[dict[str, Any]]:
        """The adapters, read-only: each node-cache entry by its own subPath, else their emptyDir."""
        if not self.adapters:
            return []
        if self.mode == "node":
            return [{"name": "models", "mountPath": f"{ADAPTERS_DIR}/{key}", "subPath": f"artifacts/{key}",
                     "readOnly": True} for key in self.keys()]
        return [{"name": "adapters", "mountPath": ADAPTERS_DIR, "readOnly": True}]

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
            return [{"name": "adapters", "emptyDir": {}}] if self.adapters else []
        return [{"name": REFERENCES_VOLUME, "configMap": {"name": REFERENCES_CONFIGMAP, "optional": True}}]

    def serving_env(self) -> list[dict[str, Any]]:
        """The streamer's environment: storage credentials from the Secret (boto3's chain, which the
        streamer's S3 backend uses), the endpoint and path-style addressing for S3-compatible stores."""
        if self.mode != "stream":
            return []
        storage = self.spec.storage
        assert storage is not None
        env = list(storage_credential_env(storage))
        if storage.endpoint:
            env += [{"name": "AWS_ENDPOINT_URL", "value": storage.endpoint},
                    {"name": "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "value": "0"}]
        if storage.region:
            env.append({"name": "AWS_REGION", "value": storage.region})
        return env


def serving_load(spec: QuantizedModelSpec, key: str, settings: OperatorSettings,
                 adapters: tuple[ServedAdapter, ...] = ()) -> ServingLoad:
    if spec.serving.loadFormat == "stream":
        mode = "stream"
    elif spec.serving.artifactCache == "Node":
        mode = "node"
    else:
        mode = "pod"
    return ServingLoad(mode, key, spec, settings, adapters)
