"""Renderers: typed inputs in, Kubernetes objects (plain dicts) out. No I/O; golden tests pin
their output.

Names are deterministic: the Job by artifact key, the Deployment by model and
pool, the Service by model. A spec-hash annotation on each Deployment lets reconcile tell drift
from a no-op without comparing server-defaulted fields.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from fewerbits_api.adapters import adapter_env
from fewerbits_api.base import API_VERSION, GROUP
from fewerbits_api.endpoints import ALLOW_PRIVATE_ENV
from fewerbits_api.jobcontract import (
    CONTRACT_ENV,
    ENV_HF_TOKEN,
    ENV_SOURCE_ACCESS_KEY,
    ENV_SOURCE_SECRET_KEY,
    JobSource,
    QuantJobContract,
)
from fewerbits_api.names import (
    DEST_MANIFEST_NAME,
    SECRET_ACCESS_KEY_ID,
    SECRET_HF_TOKEN,
    SECRET_SECRET_ACCESS_KEY,
    TERMINATION_LOG_DEFAULT,
)
from fewerbits_api.policy import QuantizationJobPlacement
from fewerbits_api.quantizedmodel import (
    PlanVariant,
    QualityGateSpec,
    QuantizationJobSize,
    QuantizedModelSpec,
    SourceSpec,
)

from fewerbits_operator.artifacts.keys import PlannedArtifact
from fewerbits_operator.artifacts.jobresources import job_resources, pool_placement
from fewerbits_operator.serving.serving_load import (MODELS_DIR, ServedAdapter, secret_env, serving_load,
                                                     storage_credential_env, stream_model_uri)
from fewerbits_operator.planner.vllm_args import lora_args, plan_args, served_model_name
from fewerbits_operator.base.queueing import kueue_labels
from fewerbits_operator.base.settings import OperatorSettings

DOMAIN = GROUP
LABEL_MODEL = f"{DOMAIN}/model"
LABEL_VARIANT = f"{DOMAIN}/variant"
LABEL_ARTIFACT = f"{DOMAIN}/artifact"
LABEL_COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "fewerbits"}
ANNOTATION_SPEC_HASH = f"{DOMAIN}/spec-hash"
ANNOTATION_ARTIFACT_KEY = f"{DOMAIN}/artifact-key"
ANNOTATION_FORMAT = f"{DOMAIN}/format"

VLLM_PORT = 8000
LAUNCHER_DIR = "/fewerbits/launcher"

# Pod security: what the `restricted` Pod Security Standard asks, for every pod we create.
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Owner:
    """The QuantizedModel that owns what we render."""

    name: str
    namespace: str
    uid: str

    def reference(self, controller: bool = True) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": "QuantizedModel",
            "name": self.name,
            "uid": self.uid,
            "controller": controller,
            "blockOwnerDeletion": True,
        }


def _fresh(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy sharing no sub-objects (deepcopy would keep the aliasing), so editing one part of a
    rendered object never edits another."""
    return json.loads(json.dumps(obj))


def spec_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether ``obj`` names the model ``uid`` among its owners (what the operator keeps; anything
    else of the same name is a conflict it reports and never writes)."""
    return any(r.get("uid") == uid for r in (obj.get("metadata") or {}).get("ownerReferences") or [])


def model_labels(model: str) -> dict[str, str]:
    return {**MANAGED_BY, "app.kubernetes.io/name": "fewerbits-model", LABEL_MODEL: model}


def deployment_name(model: str, pool: str) -> str:
    return f"{model}-{pool}"


# ------------------------------------------------------------------ credentials (Secret refs only)


_secret_env = secret_env


def source_credential_env(source: SourceSpec) -> list[dict[str, Any]]:
    if not source.credentialsSecret:
        return []
    if source.scheme == "hf":
        return [_secret_env(ENV_HF_TOKEN, source.credentialsSecret, SECRET_HF_TOKEN)]
    if source.scheme == "s3":
        return [
            _secret_env(ENV_SOURCE_ACCESS_KEY, source.credentialsSecret, SECRET_ACCESS_KEY_ID),
            _secret_env(ENV_SOURCE_SECRET_KEY, source.credentialsSecret, SECRET_SECRET_ACCESS_KEY),
        ]
    return []


def adapter_credential_env(spec: QuantizedModelSpec) -> list[dict[str, Any]]:
    """Each adapter's Secret keys, under its index in the contract's ``adapters`` (adapter_env)."""
    out: list[dict[str, Any]] = []
    for i, a in enumerate(spec.adapters):
        secret = a.source.credentialsSecret
        if not secret:
            continue
        keys = (SECRET_HF_TOKEN,) if a.source.scheme == "hf" else (SECRET_ACCESS_KEY_ID, SECRET_SECRET_ACCESS_KEY)
        out += [_secret_env(adapter_env(i, k), secret, k) for k in keys]
    return out


def endpoint_rule_env(settings: OperatorSettings) -> list[dict[str, Any]]:
    """The operator's allowPrivateEndpoints setting, for the Job's and the fetcher's connection
    guard (fewerbits_api.endpoints); nothing when private addresses are refused (the default)."""
    return [{"name": ALLOW_PRIVATE_ENV, "value": "true"}] if settings.allow_private_endpoints else []


# ------------------------------------------------------------------ quantization Job


def _job_sizing(placement: QuantizationJobPlacement, settings: OperatorSettings, size: QuantizationJobSize | None,
                artifact: PlannedArtifact, volumes: list[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """The Job's resources and deadline: from the plan's sizing (which also sizes the work volume,
    ``volumes[0]``, in place), else the operator's fixed requests and the placement's GPUs."""
    if size is not None:
        sized = job_resources(size, placement, settings, artifact.job_name)
        volumes[0] = sized.work_volume
        return sized.resources, sized.deadline_seconds
    resources: dict[str, Any] = {"requests": {"cpu": settings.job_cpu_request, "memory": settings.job_memory_request}}
    if placement.gpus:
        resources["limits"] = {"nvidia.com/gpu": str(placement.gpus)}
        resources["requests"]["nvidia.com/gpu"] = str(placement.gpus)
    return resources, placement.activeDeadlineSeconds


def render_job(
    owner: Owner,
    spec: QuantizedModelSpec,
    artifact: PlannedArtifact,
    placement: QuantizationJobPlacement,
    gate: QualityGateSpec,
    settings: OperatorSettings,
    size: QuantizationJobSize | None = None,
    pool_selector: dict[str, str] | list[dict[str, str]] | None = None,
    mode: Literal["quantize", "evaluate"] = "quantize",
) -> dict[str, Any]:
    """One Job per artifact key: fetch, calibrate, quantize, evaluate, publish (manifest last).
    ``mode: evaluate``: the same Job measures a published artifact again (evaljob.py). ``size``:
    the plan's sizing (requests, limits, work volume, deadline; ``pool_selector``, or the selectors
    of every pool that can run it, the chosen one first); without it, the fixed requests and GPUs."""
    assert spec.storage is not None
    volumes, mounts, source_mount = _job_volumes(spec)
    # What decides the bytes travels once, in keyInputs (source, format, ignore, calibration).
    contract = QuantJobContract(
        key=artifact.key,
        keyInputs=artifact.inputs,
        source=JobSource(endpoint=spec.source.endpoint, region=spec.source.region,
                         trustRemoteCode=spec.source.trustRemoteCode, mountPath=source_mount),
        qualityGate=gate,
        evalDatasetEtag=gate.eval_dataset_etag,
        adapters=list(gate.adapters) or None,
        evalMaxSeqLength=spec.quantization.calibration.maxSeqLength,
        storage=spec.storage,
        mode=mode,
    )
    resources, deadline = _job_sizing(placement, settings, size, artifact, volumes)
    gpus = placement.gpus if size is None else size.gpus
    labels = {**MANAGED_BY, LABEL_COMPONENT: "quantize", LABEL_ARTIFACT: artifact.key[:63]}
    pod_spec = _job_pod_spec(spec, settings, contract, resources, mounts, volumes)
    pod_spec.update(_job_scheduling(placement, gpus, size, pool_selector))
    kueue = placement.kueue  # Kueue admits it: created suspended, in its LocalQueue
    job_labels = {**labels, **(kueue_labels(kueue.localQueueName, kueue.workloadPriorityClassName) if kueue else {})}
    return _fresh({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": artifact.job_name,
            "namespace": owner.namespace,
            "labels": job_labels,
            "annotations": {ANNOTATION_ARTIFACT_KEY: artifact.key, ANNOTATION_FORMAT: artifact.format.value},
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "backoffLimit": placement.backoffLimit,
            "activeDeadlineSeconds": deadline,
            "ttlSecondsAfterFinished": settings.job_ttl_seconds,
            # Exit code 2 is a bad contract or bad input: retrying cannot help.
            "podFailurePolicy": {"rules": [{
                "action": "FailJob",
                "onExitCodes": {"containerName": "quantize", "operator": "In", "values": [2]},
            }]},
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
            **({"suspend": True} if placement.kueue is not None else {}),
        },
    })


def _job_volumes(spec: QuantizedModelSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """The Job's volumes (``work`` first: the sizing may replace it), mounts, and where a ``pvc://``
    source's claim is mounted (its root; the Job reads ``<mountPath>/<path>``)."""
    volumes: list[dict[str, Any]] = [{"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "work", "mountPath": "/work"}, {"name": "tmp", "mountPath": "/tmp"}]
    if spec.source.scheme != "pvc":
        return volumes, mounts, None
    claim = spec.source.uri.removeprefix("pvc://").partition("/")[0]
    volumes.append({"name": "source", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    mounts.append({"name": "source", "mountPath": "/source", "readOnly": True})
    return volumes, mounts, "/source"


def _job_pod_spec(spec: QuantizedModelSpec, settings: OperatorSettings, contract: QuantJobContract,
                  resources: dict[str, Any], mounts: list[dict[str, Any]], volumes: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    """The quantize container in a restricted pod: the contract and credentials by env, never args."""
    return {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": dict(POD_SECURITY),
        "containers": [{
            "name": "quantize",
            "image": settings.quantjob_image,
            "env": [
                {"name": CONTRACT_ENV, "value": contract.to_json()},
                {"name": "HOME", "value": "/work"},
                {"name": "HF_HOME", "value": "/work/hf"},
                {"name": "PYTHONUNBUFFERED", "value": "1"},
                *source_credential_env(spec.source),
                *storage_credential_env(spec.storage),
                *adapter_credential_env(spec),
                *endpoint_rule_env(settings),
            ],
            "resources": resources,
            "securityContext": dict(CONTAINER_SECURITY),
            "volumeMounts": mounts,
            "terminationMessagePath": TERMINATION_LOG_DEFAULT,
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }],
        "volumes": volumes,
    }


def _job_scheduling(placement: QuantizationJobPlacement, gpus: int, size: QuantizationJobSize | None,
                    pool_selector: dict[str, str] | list[dict[str, str]] | None) -> dict[str, Any]:
    """Where the Job's pod may run: GPU toleration, the placement's node selector (else the pools the
    sizing found able to run it), the placement's own tolerations (added, never instead) and priority."""
    out: dict[str, Any] = {}
    if gpus:
        out["tolerations"] = [dict(GPU_TOLERATION)]
    if placement.nodeSelector:
        out["nodeSelector"] = dict(placement.nodeSelector)
    elif size is not None and size.gpus and pool_selector:
        out.update(pool_placement(pool_selector))
    if placement.tolerations:
        out["tolerations"] = out.get("tolerations", []) + [t.to_wire() for t in placement.tolerations]
    if placement.priorityClassName:
        out["priorityClassName"] = placement.priorityClassName
    return out


# ------------------------------------------------------------------ serving


def startup_budget_seconds(weights_gib: float) -> int:
    """Time vLLM may take from container start to a healthy /health: loading weights from the
    local disk (~0.5 GiB/s, conservative for network-attached volumes), plus engine start-up,
    profiling and CUDA-graph capture (~3 minutes)."""
    return int(180 + math.ceil(weights_gib / 0.5))


def adapter_args(variant: PlanVariant, adapters: tuple[ServedAdapter, ...]) -> list[str]:
    """vLLM's LoRA flags, sized by the pool's plan, and ``--lora-modules`` for the adapters that
    passed on this pool's base (none: no flag, no LoRA buffers paid for)."""
    if not adapters or variant.lora is None:
        return []
    return [*lora_args(variant.lora), "--lora-modules", *(f"{a.name}={a.path}" for a in adapters)]


def lora_modules_in(workload: Mapping[str, Any]) -> frozenset[str]:
    """The ``--lora-modules`` entries (``NAME=PATH``) of a serving object's vLLM container: a
    Deployment's pod template, or a LeaderWorkerSet's leader template."""
    spec = workload.get("spec") or {}
    lws = spec.get("leaderWorkerTemplate") or {}
    template = lws.get("leaderTemplate") or lws.get("workerTemplate") or spec.get("template") or {}
    containers = (template.get("spec") or {}).get("containers") or []
    command = [str(a) for c in containers[:1] for a in [*(c.get("command") or []), *(c.get("args") or [])]]
    entries: set[str] = set()
    taking = False
    for a in command:
        if a.startswith("--"):
            taking = a == "--lora-modules"
        elif taking:
            entries.add(a)
    return frozenset(entries)


def _serve_command(owner: Owner, spec: QuantizedModelSpec, variant: PlanVariant, compute_capability: str,
                   artifact_key: str, model_dir: str, adapters: tuple[ServedAdapter, ...] = ()) -> list[str]:
    """The launcher, then `vllm serve` with the plan's arguments (plan_args owns them, from the
    plan's typed fields, never from the display copy in status), the adapters, and the model's extras."""
    return [
        "python3", "-m", "fewerbits_runtime", "launch",
        "--manifest", f"{model_dir}/{DEST_MANIFEST_NAME}",
        "--node-cc", compute_capability,
        "--",
        "vllm", "serve", stream_model_uri(spec, artifact_key) or model_dir,
        "--host", "0.0.0.0", "--port", str(VLLM_PORT),
        *plan_args(variant, served_model_name(spec, owner.name)),
        *adapter_args(variant, adapters),
        *(["--load-format", "runai_streamer"] if spec.serving.loadFormat == "stream" else []),
        *spec.serving.extraArgs,
    ]


def _fetch_container(spec: QuantizedModelSpec, settings: OperatorSettings, artifact_key: str, model_dir: str,
                     load) -> dict[str, Any]:
    """The init container: the runtime's fetcher puts the artifact and the launcher in place."""
    assert spec.storage is not None
    return {
        "name": "fetch",
        "image": settings.runtime_image,
        "args": ["fetch", "--storage-uri", spec.storage.uri, "--key", artifact_key, *load.fetch_args(model_dir),
                 "--launcher-dir", LAUNCHER_DIR,
                 *(["--endpoint", spec.storage.endpoint] if spec.storage.endpoint else []),
                 *(["--region", spec.storage.region] if spec.storage.region else [])],
        "env": [{"name": "HOME", "value": "/tmp"}, *storage_credential_env(spec.storage),
                *endpoint_rule_env(settings)],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
        "securityContext": dict(CONTAINER_SECURITY),
        "volumeMounts": [
            *load.fetch_mounts(),
            {"name": "launcher", "mountPath": "/fewerbits"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _vllm_container(spec: QuantizedModelSpec, variant: PlanVariant, settings: OperatorSettings,
                    command: list[str], model_dir: str, load) -> dict[str, Any]:
    """The serving container: its GPUs, probes sized by the startup budget, and the mounts."""
    budget = startup_budget_seconds(variant.weightsGiB)
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    gpus = str(variant.tensorParallelSize)
    return {
        "name": "vllm",
        "image": spec.serving.image or settings.vllm_image,
        "command": command,
        "env": [
            {"name": "PYTHONPATH", "value": LAUNCHER_DIR},
            {"name": "FEWERBITS_NODE_GPU_PRODUCT", "value": variant.gpuProduct},
            {"name": "HOME", "value": "/tmp"},
            {"name": "HF_HOME", "value": "/tmp/hf"},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            *load.serving_env(),
        ],
        "ports": [{"name": "http", "containerPort": VLLM_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": settings.vllm_cpu_request, "memory": settings.vllm_memory_request,
                         "nvidia.com/gpu": gpus},
            "limits": {"nvidia.com/gpu": gpus},
        },
        "securityContext": {**CONTAINER_SECURITY, "readOnlyRootFilesystem": False},
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": math.ceil(budget / 10)},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 15, "failureThreshold": 4, "timeoutSeconds": 5},
        "volumeMounts": [
            load.serving_mount(model_dir),
            *load.adapter_mounts(),
            {"name": "launcher", "mountPath": "/fewerbits", "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _serving_volumes(load, artifact_bytes: int | None) -> list[dict[str, Any]]:
    # emptyDir sized for the artifact plus headroom, so a full node disk shows as an eviction
    # with a reason rather than a corrupt half-written model.
    model_volume: dict[str, Any] = {}
    if artifact_bytes:
        model_volume["sizeLimit"] = f"{math.ceil(artifact_bytes * 1.2 / 2**20) + 256}Mi"
    return [
        load.volume(model_volume),
        *load.extra_volumes(),
        {"name": "launcher", "emptyDir": {"sizeLimit": "64Mi"}},
        {"name": "tmp", "emptyDir": {}},
        # vLLM's tensor-parallel workers talk through shared memory.
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
    ]


def render_deployment(
    owner: Owner,
    spec: QuantizedModelSpec,
    variant: PlanVariant,
    node_selector: dict[str, str],
    compute_capability: str,
    artifact_key: str,
    artifact_bytes: int | None,
    replicas: int,
    settings: OperatorSettings,
    adapters: tuple[ServedAdapter, ...] = (),
) -> dict[str, Any]:
    """One vLLM Deployment per planned variant (loading ``adapters`` where its plan holds LoRA)."""
    assert spec.storage is not None
    name = deployment_name(owner.name, variant.pool)
    labels = {**model_labels(owner.name), LABEL_VARIANT: variant.pool, LABEL_COMPONENT: "server"}
    model_dir = f"{MODELS_DIR}/{artifact_key}"
    adapters = adapters if variant.lora is not None else ()
    load = serving_load(spec, artifact_key, settings, adapters)
    command = _serve_command(owner, spec, variant, compute_capability, artifact_key, model_dir, adapters)
    template = {
        "metadata": {
            "labels": dict(labels),
            "annotations": {ANNOTATION_ARTIFACT_KEY: artifact_key, ANNOTATION_FORMAT: variant.format.value},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": dict(POD_SECURITY),
            "nodeSelector": dict(node_selector),
            "tolerations": [dict(GPU_TOLERATION)],
            "terminationGracePeriodSeconds": 60,
            "initContainers": [_fetch_container(spec, settings, artifact_key, model_dir, load)],
            "containers": [_vllm_container(spec, variant, settings, command, model_dir, load)],
            "volumes": _serving_volumes(load, artifact_bytes),
        },
    }
    deployment_spec = {
        "selector": {"matchLabels": {LABEL_MODEL: owner.name, LABEL_VARIANT: variant.pool}},
        # A new artifact rolls out without dropping the old one until new pods are ready.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "revisionHistoryLimit": 3,
        "progressDeadlineSeconds": max(600, startup_budget_seconds(variant.weightsGiB) + 300),
        "template": template,
    }
    return _fresh({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": labels,
            "annotations": {ANNOTATION_SPEC_HASH: spec_hash(deployment_spec), ANNOTATION_ARTIFACT_KEY: artifact_key},
            "ownerReferences": [owner.reference()],
        },
        "spec": {**deployment_spec, "replicas": replicas},
    })


def render_service(owner: Owner) -> dict[str, Any]:
    """One Service in front of every variant: clients see one endpoint."""
    labels = model_labels(owner.name)
    return _fresh({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": owner.name,
            "namespace": owner.namespace,
            "labels": labels,
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_MODEL: owner.name, LABEL_COMPONENT: "server"},
            "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    })


def endpoint(owner: Owner) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{VLLM_PORT}"
