"""GPU catalog and GPU pools, read from GPU Feature Discovery (GFD) node labels.

docs/architecture.md "Planner facts": GFD labels ``nvidia.com/gpu.product``, ``.family``,
``.compute.major``/``.minor``, ``.memory`` (MiB) and ``.count``; compute capability is compared
numerically as a tuple (10.0 > 9.0), never as a string. The catalog adds what labels do not
carry (memory bandwidth, TFLOPS) for known products; an unknown product still plans from its
labels, with its bandwidth estimated from its family and a warning that says so.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

LABEL_PRODUCT = "nvidia.com/gpu.product"
LABEL_FAMILY = "nvidia.com/gpu.family"
LABEL_CC_MAJOR = "nvidia.com/gpu.compute.major"
LABEL_CC_MINOR = "nvidia.com/gpu.compute.minor"
LABEL_MEMORY = "nvidia.com/gpu.memory"
LABEL_COUNT = "nvidia.com/gpu.count"
RESOURCE_GPU = "nvidia.com/gpu"

POOL_NAME_MAX = 20
"""Pool names go into Deployment names (`<model>-<pool>`): short, lower-case DNS labels."""

CC = tuple[int, int]


@dataclass(frozen=True)
class GPUSpec:
    """What the catalog knows about one GPU product (docs/architecture.md, "Planner facts" GPU table)."""

    key: str
    """Short catalog name, e.g. ``h100-sxm``."""
    product: str
    """The canonical GFD ``nvidia.com/gpu.product`` value."""
    family: str
    cc: CC
    memory_mib: int
    """As GFD reports it (nvidia-smi's total, MiB)."""
    bandwidth_gbps: float
    """Memory bandwidth, GB/s."""
    bf16_tflops: float | None
    """Dense BF16 (FP16 on Turing) TFLOPS."""
    fp8_tflops: float | None = None


# docs/architecture.md "Planner facts" GPU table; H100 PCIe / NVL, A100 PCIe and H200 NVL from NVIDIA's
# data sheets (same architecture rows, different memory systems).
CATALOG: tuple[GPUSpec, ...] = (
    GPUSpec("t4", "Tesla-T4", "turing", (7, 5), 15360, 320, 65),
    GPUSpec("a10g", "NVIDIA-A10G", "ampere", (8, 6), 23028, 600, 70),
    GPUSpec("l4", "NVIDIA-L4", "ada-lovelace", (8, 9), 23034, 300, 121, 242),
    GPUSpec("l40s", "NVIDIA-L40S", "ada-lovelace", (8, 9), 46068, 864, 362, 733),
    GPUSpec("a100-40gb", "NVIDIA-A100-SXM4-40GB", "ampere", (8, 0), 40960, 1555, 312),
    GPUSpec("a100-80gb", "NVIDIA-A100-SXM4-80GB", "ampere", (8, 0), 81920, 2039, 312),
    GPUSpec("h100-sxm", "NVIDIA-H100-80GB-HBM3", "hopper", (9, 0), 81559, 3350, 989, 1979),
    GPUSpec("h100-pcie", "NVIDIA-H100-PCIe", "hopper", (9, 0), 81559, 2000, 756, 1513),
    GPUSpec("h100-nvl", "NVIDIA-H100-NVL", "hopper", (9, 0), 95830, 3900, 835, 1671),
    GPUSpec("h200", "NVIDIA-H200", "hopper", (9, 0), 143771, 4800, 989, 1979),
    GPUSpec("h200-nvl", "NVIDIA-H200-NVL", "hopper", (9, 0), 143771, 4800, 835, 1671),
    GPUSpec("b200", "NVIDIA-B200", "blackwell", (10, 0), 183359, 8000, 2250, 4500),
    # Grace Hopper / Grace Blackwell superchips, per GPU, from NVIDIA's published specifications
    # (memory in MiB is the published GB converted, so a little below what nvidia-smi/GFD report;
    # pools read from nodes take GFD's own memory label):
    # - GH200 (https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/, data sheet
    #   "NVIDIA GH200 Grace Hopper Superchip"): H100 GPU, compute capability 9.0, 96 GB HBM3 at
    #   4 TB/s or 144 GB HBM3e at 4.9 TB/s; dense BF16 989 TFLOPS, FP8 1,979 (the H100 SXM's).
    #   GFD reports the 96 GB part as ``NVIDIA-GH200-480GB`` (480 GB is the Grace CPU's LPDDR5X).
    # - GB200 (https://www.nvidia.com/en-us/data-center/gb200-nvl72/, GB200 NVL72 specifications:
    #   13.4 TB HBM3e and 576 TB/s over 72 GPUs, 360 PFLOPS FP16/BF16 and 720 PFLOPS FP8 with
    #   sparsity): per GPU 186 GB at 8 TB/s, dense BF16 2,500 TFLOPS, FP8 5,000; compute capability
    #   10.0 (CUDA's list of GPU compute capabilities: GB200 and B200 are 10.0).
    GPUSpec("gh200", "NVIDIA-GH200-480GB", "hopper", (9, 0), 91553, 4000, 989, 1979),
    GPUSpec("gh200-144gb", "NVIDIA-GH200-144G-HBM3e", "hopper", (9, 0), 137329, 4900, 989, 1979),
    GPUSpec("gb200", "NVIDIA-GB200", "blackwell", (10, 0), 177383, 8000, 2500, 5000),
)
CATALOG_BY_KEY: dict[str, GPUSpec] = {g.key: g for g in CATALOG}

# For an unknown product: the lowest bandwidth of a data-center part of that family (a
# conservative estimate: a plan that is too slow on paper is better than one too fast).
FAMILY_BANDWIDTH_ESTIMATE_GBPS: dict[str, float] = {
    "volta": 900,
    "turing": 320,
    "ampere": 600,
    "ada-lovelace": 300,
    "hopper": 2000,
    "blackwell": 1800,
}

SUFFIXES_TO_STRIP = ("-SHARED",)
"""GFD appends ``-SHARED`` to the product under time-slicing/MPS sharing."""


def family_from_cc(cc: CC) -> str:
    """The architecture family of a compute capability (for nodes without a family label)."""
    if cc >= (10, 0):
        return "blackwell"
    if cc >= (9, 0):
        return "hopper"
    if cc >= (8, 9):
        return "ada-lovelace"
    if cc >= (8, 0):
        return "ampere"
    if cc >= (7, 5):
        return "turing"
    if cc >= (7, 0):
        return "volta"
    return "unknown"


def lookup_product(product: str, memory_mib: int | None = None) -> GPUSpec | None:
    """The catalog entry for a GFD product string, or None.

    Matches on the product's dash-separated tokens, so PCIe/SXM/suffix variants of a known chip
    (``NVIDIA-A100-PCIE-40GB``, ``NVIDIA-A100-80GB-PCIe``, ``NVIDIA-H100-80GB-HBM3-SHARED``) find
    their entry; ``memory_mib`` (the GFD memory label) tells the A100 40 GB from the 80 GB when the
    product string does not.
    """
    name = product.upper()
    for suffix in SUFFIXES_TO_STRIP:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if "-MIG-" in name:
        # A MIG slice is not the whole GPU: its memory and bandwidth differ; plan from labels.
        return None
    tokens = set(name.split("-"))
    if "GB200" in tokens:
        return CATALOG_BY_KEY["gb200"]
    if "GH200" in tokens:
        big = bool(tokens & {"144G", "144GB", "HBM3E"}) or (memory_mib is not None and memory_mib > 120_000)
        return CATALOG_BY_KEY["gh200-144gb" if big else "gh200"]
    if "B200" in tokens:
        return CATALOG_BY_KEY["b200"]
    if "H200" in tokens:
        return CATALOG_BY_KEY["h200-nvl" if "NVL" in tokens else "h200"]
    if "H100" in tokens:
        if "NVL" in tokens:
            return CATALOG_BY_KEY["h100-nvl"]
        if "PCIE" in tokens:
            return CATALOG_BY_KEY["h100-pcie"]
        return CATALOG_BY_KEY["h100-sxm"]
    if "A100" in tokens:
        big = "80GB" in tokens or (memory_mib is not None and memory_mib > 60_000)
        return CATALOG_BY_KEY["a100-80gb" if big else "a100-40gb"]
    if "L40S" in tokens:
        return CATALOG_BY_KEY["l40s"]
    if "L4" in tokens:
        return CATALOG_BY_KEY["l4"]
    if "A10G" in tokens:
        return CATALOG_BY_KEY["a10g"]
    if "T4" in tokens:
        return CATALOG_BY_KEY["t4"]
    return None


@dataclass(frozen=True)
class GPUPool:
    """Nodes with the same GPU product and GPU count: one vLLM Deployment per pool."""

    name: str
    """Deterministic, DNS-label safe, at most 20 characters (e.g. ``h100-80gb-hbm3-x8``)."""
    product: str
    family: str
    cc: CC
    memory_mib: int
    gpus_per_node: int
    node_count: int
    bandwidth_gbps: float
    bandwidth_estimated: bool = False
    """True when the product is not in the catalog and the bandwidth is a family estimate."""
    bf16_tflops: float | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """Labels that select exactly this pool's nodes (for the Deployment's nodeSelector)."""
    common_labels: Mapping[str, str] = field(default_factory=dict)
    """Labels every node of the pool carries (``serving.targets[].nodeSelector`` matches these)."""
    notes: tuple[str, ...] = ()
    """What a person should know about how the pool was read (estimates, missing labels)."""

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024

    @property
    def cc_str(self) -> str:
        return f"{self.cc[0]}.{self.cc[1]}"


def pool_name(product: str, gpus_per_node: int) -> str:
    """A short DNS-label name from the product and GPU count: ``NVIDIA-H100-80GB-HBM3`` x8 ->
    ``h100-80gb-hbm3-x8``. Too long a name is cut and given a hash of the full product, so two
    products never share a name by truncation."""
    base = product.lower()
    base = re.sub(r"^(nvidia|tesla)[-_ ]+", "", base)
    base = re.sub(r"[^a-z0-9]+", "-", base).strip("-") or "gpu"
    suffix = f"-x{gpus_per_node}"
    name = base + suffix
    if len(name) <= POOL_NAME_MAX:
        return name
    digest = hashlib.sha256(product.encode()).hexdigest()[:4]
    keep = POOL_NAME_MAX - len(suffix) - len(digest) - 1
    return f"{base[:keep].rstrip('-')}-{digest}{suffix}"


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(str(labels[key]).strip())
    except (KeyError, ValueError):
        return None


def _quantity(value: Any) -> int | None:
    """An integer resource quantity (``nvidia.com/gpu`` is always a whole number)."""
    if value is None:
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def pool_from_product(product: str, gpus_per_node: int, node_count: int = 1, *,
                      memory_gib: float | None = None, cc: CC | None = None) -> GPUPool:
    """A pool for a product (the CLI's ``--gpu PRODUCT:COUNT[:MEMORY_GIB:CC]``).

    A catalog product takes its facts from the catalog; ``memory_gib`` and ``cc`` given together
    describe a product the catalog lacks (or override a known one's memory and compute
    capability): its family comes from the compute capability and its bandwidth is the family's
    estimate, noted on the pool as for a node whose product is unknown. Raises ValueError for an
    unknown product without them."""
    if (memory_gib is None) != (cc is None):
        raise ValueError("give both the GPU memory in GiB and the compute capability, e.g. NAME:4:96:12.0")
    if gpus_per_node < 1:
        raise ValueError(f"GPU count must be at least 1, got {gpus_per_node}")
    spec = lookup_product(product)
    notes: tuple[str, ...] = ()
    if memory_gib is not None and cc is not None:
        if memory_gib <= 0:
            raise ValueError(f"GPU memory must be above 0 GiB, got {memory_gib:g}")
        family = spec.family if spec is not None and spec.cc == cc else family_from_cc(cc)
        if spec is not None and spec.family == family:
            bandwidth, estimated, tflops = spec.bandwidth_gbps, False, spec.bf16_tflops
        else:
            bandwidth, estimated, tflops = FAMILY_BANDWIDTH_ESTIMATE_GBPS.get(family, 300), True, None
            notes = (f"GPU product {product} is not in the catalog: memory bandwidth estimated as "
                     f"{bandwidth:g} GB/s from its family ({family}), so the decode estimate is rough",)
        memory_mib = int(round(memory_gib * 1024))
    elif spec is None:
        known = ", ".join(g.product for g in CATALOG)
        raise ValueError(f"unknown GPU product {product!r}: known products are {known}; for another product give its "
                         f"memory in GiB and compute capability too, e.g. {product}:{gpus_per_node}:96:12.0")
    else:
        family, cc, memory_mib = spec.family, spec.cc, spec.memory_mib
        bandwidth, estimated, tflops = spec.bandwidth_gbps, False, spec.bf16_tflops
    labels = {
        LABEL_PRODUCT: product,
        LABEL_FAMILY: family,
        LABEL_CC_MAJOR: str(cc[0]),
        LABEL_CC_MINOR: str(cc[1]),
        LABEL_MEMORY: str(memory_mib),
        LABEL_COUNT: str(gpus_per_node),
    }
    return GPUPool(
        name=pool_name(product, gpus_per_node),
        product=product,
        family=family,
        cc=cc,
        memory_mib=memory_mib,
        gpus_per_node=gpus_per_node,
        node_count=node_count,
        bandwidth_gbps=bandwidth,
        bandwidth_estimated=estimated,
        bf16_tflops=tflops,
        node_selector={LABEL_PRODUCT: product, LABEL_COUNT: str(gpus_per_node)},
        common_labels=labels,
        notes=notes,
    )


@dataclass(frozen=True)
class _NodeGPU:
    product: str
    family: str | None
    cc: CC | None
    memory_mib: int | None
    gpus: int
    labels: Mapping[str, str]


def _node_gpu(node: Mapping[str, Any]) -> _NodeGPU | None:
    """The GPU facts of one Node object, or None for nodes that cannot take GPU pods."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    product = labels.get(LABEL_PRODUCT)
    if not product:
        return None
    if (node.get("spec") or {}).get("unschedulable"):
        return None
    allocatable = _quantity(((node.get("status") or {}).get("allocatable") or {}).get(RESOURCE_GPU))
    label_count = _int_label(labels, LABEL_COUNT)
    # A pod can request at most what the scheduler can hand out (allocatable); under
    # time-slicing allocatable exceeds the physical count, and tensor parallelism across
    # replicas of one GPU gains nothing, so take the smaller of the two.
    counts = [c for c in (allocatable, label_count) if c is not None]
    gpus = min(counts) if counts else 0
    if gpus < 1:
        return None
    major, minor = _int_label(labels, LABEL_CC_MAJOR), _int_label(labels, LABEL_CC_MINOR)
    cc = (major, minor if minor is not None else 0) if major is not None else None
    return _NodeGPU(
        product=str(product),
        family=labels.get(LABEL_FAMILY) or None,
        cc=cc,
        memory_mib=_int_label(labels, LABEL_MEMORY),
        gpus=gpus,
        labels={str(k): str(v) for k, v in labels.items()},
    )


def _grouped(nodes: list[Mapping[str, Any]]) -> dict[tuple, list[_NodeGPU]]:
    """Schedulable GPU nodes by (product, GPUs per node, family, compute capability, memory), the
    catalog filling what the labels lack; nodes that cannot be planned left out."""
    groups: dict[tuple, list[_NodeGPU]] = {}
    for node in nodes:
        gpu = _node_gpu(node)
        if gpu is None:
            continue
        spec = lookup_product(gpu.product, gpu.memory_mib)
        cc = gpu.cc or (spec.cc if spec else None)
        memory = gpu.memory_mib or (spec.memory_mib if spec else None)
        if cc is None or memory is None:
            continue
        family = gpu.family or (spec.family if spec else family_from_cc(cc))
        groups.setdefault((gpu.product, gpu.gpus, family, cc, memory), []).append(gpu)
    return groups


def pools_from_nodes(nodes: list[Mapping[str, Any]]) -> list[GPUPool]:
    """GPU pools from Node objects as the API server returns them.

    Nodes without a ``nvidia.com/gpu.product`` label, unschedulable (cordoned) nodes and nodes
    with no allocatable ``nvidia.com/gpu`` are ignored. Nodes are grouped by (product, GPUs per
    node, family, compute capability, memory); each pool counts its nodes. Facts missing from
    the labels come from the catalog; a product the catalog does not know plans from its labels
    with its bandwidth estimated from its family (see ``GPUPool.notes``). Nodes whose product is
    unknown and that lack compute-capability or memory labels cannot be planned and are skipped.
    Pools are returned sorted by name.
    """
    groups = _grouped(nodes)
    pools: list[GPUPool] = []
    names: dict[str, int] = {}
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2], k[3], k[4])):
        product, gpus, family, cc, memory = key
        members = groups[key]
        spec = lookup_product(product, memory)
        notes: list[str] = []
        if spec is not None:
            bandwidth, estimated, tflops = spec.bandwidth_gbps, False, spec.bf16_tflops
        else:
            bandwidth = FAMILY_BANDWIDTH_ESTIMATE_GBPS.get(family, 300)
            estimated, tflops = True, None
            notes.append(
                f"GPU product {product} is not in the catalog: memory bandwidth estimated as "
                f"{bandwidth:g} GB/s from its family ({family}), so the decode estimate is rough"
            )
        common = dict(members[0].labels)
        for m in members[1:]:
            common = {k: v for k, v in common.items() if m.labels.get(k) == v}
        name = pool_name(product, gpus)
        names[name] = names.get(name, 0) + 1
        if names[name] > 1:
            # Same product and count but different memory/CC/family labels (rare: mixed
            # driver versions): keep names unique and deterministic.
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:4]
            name = f"{name[: POOL_NAME_MAX - 5].rstrip('-')}-{digest}"
        selector = {LABEL_PRODUCT: product}
        if LABEL_COUNT in common:
            selector[LABEL_COUNT] = common[LABEL_COUNT]
        pools.append(
            GPUPool(
                name=name,
                product=product,
                family=family,
                cc=cc,
                memory_mib=memory,
                gpus_per_node=gpus,
                node_count=len(members),
                bandwidth_gbps=bandwidth,
                bandwidth_estimated=estimated,
                bf16_tflops=tflops,
                node_selector=selector,
                common_labels=common,
                notes=tuple(notes),
            )
        )
    return sorted(pools, key=lambda p: p.name)
