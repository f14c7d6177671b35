"""Catalog of GPU node pools and the kwok Node manifests that stand in for them.

Labels are the ones NVIDIA GPU Feature Discovery writes (docs/architecture.md, "Planner facts"): the operator
derives pools from these alone, so nothing here adds a custom label that behaviour could depend on.
Memory figures are what GFD reports (`nvidia.com/gpu.memory`, MiB, from NVML).
"""

from __future__ import annotations

from dataclasses import dataclass

KWOK_ANNOTATION = {"kwok.x-k8s.io/node": "fake"}


@dataclass(frozen=True)
class GPUModel:
    product: str          # nvidia.com/gpu.product
    family: str           # nvidia.com/gpu.family
    compute_major: int
    compute_minor: int
    memory_mib: int       # nvidia.com/gpu.memory
    count: int            # GPUs per node (nvidia.com/gpu.count and capacity)
    cpu: str = "96"
    memory: str = "1Ti"


# Keyed by a short pool name; `add_gpu_pool(name, product=...)` also accepts the product string.
CATALOG: dict[str, GPUModel] = {
    "h100": GPUModel("NVIDIA-H100-80GB-HBM3", "hopper", 9, 0, 81559, 8, cpu="208", memory="2Ti"),
    "a100": GPUModel("NVIDIA-A100-SXM4-80GB", "ampere", 8, 0, 81920, 8, cpu="128", memory="2Ti"),
    "l4": GPUModel("NVIDIA-L4", "ada-lovelace", 8, 9, 23034, 1, cpu="16", memory="64Gi"),
    "b200": GPUModel("NVIDIA-B200", "blackwell", 10, 0, 183359, 8, cpu="224", memory="4Ti"),
    "t4": GPUModel("Tesla-T4", "turing", 7, 5, 15360, 1, cpu="8", memory="32Gi"),
    "h200": GPUModel("NVIDIA-H200", "hopper", 9, 0, 143771, 8, cpu="208", memory="2Ti"),
    "l40s": GPUModel("NVIDIA-L40S", "ada-lovelace", 8, 9, 46068, 4, cpu="64", memory="512Gi"),
}
BY_PRODUCT = {m.product: m for m in CATALOG.values()}


def lookup(product: str) -> GPUModel:
    """A catalog entry by short name (`h100`) or GFD product string (`NVIDIA-H100-80GB-HBM3`)."""
    if product in CATALOG:
        return CATALOG[product]
    if product in BY_PRODUCT:
        return BY_PRODUCT[product]
    known = ", ".join(f"{k} ({m.product})" for k, m in CATALOG.items())
    raise KeyError(f"unknown GPU {product!r}; known: {known}")


def gfd_labels(model: GPUModel, gpus: int | None = None) -> dict[str, str]:
    return {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": model.product,
        "nvidia.com/gpu.family": model.family,
        "nvidia.com/gpu.compute.major": str(model.compute_major),
        "nvidia.com/gpu.compute.minor": str(model.compute_minor),
        "nvidia.com/gpu.memory": str(model.memory_mib),
        "nvidia.com/gpu.count": str(gpus if gpus is not None else model.count),
        "nvidia.com/gpu.machine": "kwok",
    }


def node_manifest(name: str, model: GPUModel, gpus: int | None = None, extra_labels: dict | None = None) -> dict:
    """A kwok-managed Node carrying GFD labels and `nvidia.com/gpu` capacity."""
    count = gpus if gpus is not None else model.count
    resources = {"cpu": model.cpu, "memory": model.memory, "pods": "110", "nvidia.com/gpu": str(count),
                 "ephemeral-storage": "30Ti"}  # a DGX H100 has 30 TB of NVMe
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        **gfd_labels(model, count),
        **(extra_labels or {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": dict(KWOK_ANNOTATION)},
        # kwok's node-initialize stage keeps capacity/allocatable as given here.
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def cpu_node_manifest(name: str) -> dict:
    """A plain (no GPU) node, e.g. for the operator's own pods or CPU Jobs."""
    resources = {"cpu": "32", "memory": "128Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                       "type": "kwok"},
            "annotations": dict(KWOK_ANNOTATION),
        },
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }
