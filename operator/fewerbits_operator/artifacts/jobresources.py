"""The quantization Job's requests, limits, work volume and deadline, from its sizing
(``planner.jobsize``). Pure; ``render.render_job`` puts the result into the Job.

Memory and ephemeral storage are requested and limited at the same figure: the Job then has a known
ceiling, and when a real model outgrows its estimate the kubelet's OOM kill or eviction names the
resource (reported as `JobOOMKilled` / `JobOutOfDisk` with the figure to raise, see artifacts/jobfailure.py). CPU
is requested, never limited (throttling a Job only makes it slower).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fewerbits_api.policy import QuantizationJobPlacement
from fewerbits_api.quantizedmodel import QuantizationJobSize

from fewerbits_operator.planner.jobsize import deadline_seconds
from fewerbits_operator.base.settings import OperatorSettings

TMP_GIB = 10
"""`/tmp` beside a work volume on a PVC: the node-local disk the Job still uses."""
_QUANTITY = re.compile(r"^([0-9.]+)([KMGTPE]i?)?$")
_UNIT = {None: 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
         "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_bytes(q: str) -> float:
    """A Kubernetes memory quantity in bytes (`8Gi`, `500M`, `1073741824`)."""
    m = _QUANTITY.match(q.strip())
    if not m:
        raise ValueError(f"not a memory quantity: {q!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


@dataclass(frozen=True)
class JobResources:
    resources: dict[str, Any]
    work_volume: dict[str, Any]
    deadline_seconds: int


def job_resources(size: QuantizationJobSize, placement: QuantizationJobPlacement, settings: OperatorSettings,
                  job_name: str) -> JobResources:
    """Requests and limits (cpu, memory, nvidia.com/gpu, ephemeral-storage), the `work` volume
    (an `emptyDir` with a size limit, or a generic ephemeral volume from a StorageClass above the
    operator's threshold) and activeDeadlineSeconds (the policy's when it sets one)."""
    memory = f"{size.memoryGiB}Gi"
    if quantity_bytes(settings.job_memory_request) > size.memoryGiB * 2**30:
        memory = settings.job_memory_request  # the operator's floor
    if size.volume == "ephemeral":
        storage_class = placement.storageClassName or settings.job_storage_class
        claim: dict[str, Any] = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": f"{size.ephemeralStorageGiB}Gi"}},
        }
        if storage_class:
            claim["storageClassName"] = storage_class
        volume = {"name": "work", "ephemeral": {"volumeClaimTemplate": {
            "metadata": {"labels": {"app.kubernetes.io/managed-by": "fewerbits", "fewerbits.io/job": job_name}},
            "spec": claim}}}
        disk = f"{TMP_GIB}Gi"
    else:
        disk = f"{size.ephemeralStorageGiB}Gi"
        floor = settings.job_ephemeral_storage_request
        if floor and quantity_bytes(floor) > size.ephemeralStorageGiB * 2**30:
            disk = floor
        volume = {"name": "work", "emptyDir": {"sizeLimit": disk}}
    requests = {"cpu": settings.job_cpu_request, "memory": memory, "ephemeral-storage": disk}
    limits = {"memory": memory, "ephemeral-storage": disk}
    if size.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(size.gpus)
    deadline = (placement.activeDeadlineSeconds if "activeDeadlineSeconds" in placement.model_fields_set
                else deadline_seconds(size))
    return JobResources({"requests": requests, "limits": limits}, volume, deadline)


def pool_placement(selectors: dict[str, str] | list[dict[str, str]]) -> dict[str, Any]:
    """Where the Job may run: one pool is a nodeSelector; several pools (each able to hold the
    calibration layer and the GPU count) are a required node affinity over them, preferring the
    first (the one the sizing chose), so a busy pool does not keep the Job waiting."""
    pools = [selectors] if isinstance(selectors, dict) else [s for s in selectors if s]
    if len(pools) == 1:
        return {"nodeSelector": dict(pools[0])}

    def term(sel: dict[str, str]) -> dict[str, Any]:
        return {"matchExpressions": [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(sel.items())]}

    return {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term(s) for s in pools]},
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": term(pools[0])}],
    }}}
