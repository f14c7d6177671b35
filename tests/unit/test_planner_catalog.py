"""GPU catalog and pools read from GPU Feature Discovery node labels."""

from __future__ import annotations

import re

import pytest

from fewerbits_operator.planner.catalog import (
    CATALOG,
    POOL_NAME_MAX,
    family_from_cc,
    lookup_product,
    pool_from_product,
    pool_name,
    pools_from_nodes,
)


def node(name, product=None, count=8, *, family=None, major=None, minor=None, memory=None,
         allocatable=None, unschedulable=False, extra=None):
    labels = {"kubernetes.io/hostname": name}
    if product:
        labels["nvidia.com/gpu.product"] = product
        labels["nvidia.com/gpu.count"] = str(count)
    for key, value in (("family", family), ("compute.major", major), ("compute.minor", minor), ("memory", memory)):
        if value is not None:
            labels[f"nvidia.com/gpu.{key}"] = str(value)
    labels.update(extra or {})
    obj = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": True} if unschedulable else {},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}},
    }
    if product:
        obj["status"]["allocatable"]["nvidia.com/gpu"] = str(count if allocatable is None else allocatable)
    return obj


@pytest.mark.parametrize(
    "product, key, family, cc",
    [
        ("NVIDIA-H100-80GB-HBM3", "h100-sxm", "hopper", (9, 0)),
        ("NVIDIA-H100-80GB-HBM3-SHARED", "h100-sxm", "hopper", (9, 0)),
        ("NVIDIA-H100-PCIe", "h100-pcie", "hopper", (9, 0)),
        ("NVIDIA-H100-NVL", "h100-nvl", "hopper", (9, 0)),
        ("NVIDIA-A100-SXM4-80GB", "a100-80gb", "ampere", (8, 0)),
        ("NVIDIA-A100-SXM4-40GB", "a100-40gb", "ampere", (8, 0)),
        ("NVIDIA-A100-PCIE-40GB", "a100-40gb", "ampere", (8, 0)),
        ("NVIDIA-A100-80GB-PCIe", "a100-80gb", "ampere", (8, 0)),
        ("NVIDIA-L4", "l4", "ada-lovelace", (8, 9)),
        ("NVIDIA-L40S", "l40s", "ada-lovelace", (8, 9)),
        ("NVIDIA-H200", "h200", "hopper", (9, 0)),
        ("NVIDIA-B200", "b200", "blackwell", (10, 0)),
        ("NVIDIA-GH200-480GB", "gh200", "hopper", (9, 0)),
        ("NVIDIA-GH200-144G-HBM3e", "gh200-144gb", "hopper", (9, 0)),
        ("NVIDIA-GB200", "gb200", "blackwell", (10, 0)),
        ("Tesla-T4", "t4", "turing", (7, 5)),
        ("NVIDIA-A10G", "a10g", "ampere", (8, 6)),
    ],
)
def test_gfd_product_strings_find_their_catalog_entry(product, key, family, cc):
    spec = lookup_product(product)
    assert spec is not None and spec.key == key
    assert (spec.family, spec.cc) == (family, cc)


def test_lookup_does_not_confuse_l4_with_l40s_or_a10g_with_a100():
    assert lookup_product("NVIDIA-L40S").key == "l40s"
    assert lookup_product("NVIDIA-L4").key == "l4"
    assert lookup_product("NVIDIA-L40") is None  # a different card, not in the catalog
    assert lookup_product("NVIDIA-A10G").key == "a10g"
    assert lookup_product("NVIDIA-A100-SXM4-40GB", memory_mib=81920).key == "a100-80gb"
    assert lookup_product("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb") is None  # a slice, not the GPU


def test_catalog_bandwidths_match_design_table():
    by_key = {g.key: g for g in CATALOG}
    assert by_key["t4"].bandwidth_gbps == 320
    assert by_key["l4"].bandwidth_gbps == 300
    assert by_key["l40s"].bandwidth_gbps == 864
    assert by_key["h100-sxm"].bandwidth_gbps == 3350
    assert by_key["h200"].bandwidth_gbps == 4800
    assert by_key["b200"].bandwidth_gbps == 8000
    assert by_key["a100-80gb"].bandwidth_gbps > by_key["a100-40gb"].bandwidth_gbps


def test_family_from_compute_capability_compares_numerically():
    # "10.0" < "9.0" as strings; numerically Blackwell is newer.
    assert family_from_cc((10, 0)) == "blackwell"
    assert family_from_cc((12, 0)) == "blackwell"
    assert family_from_cc((9, 0)) == "hopper"
    assert family_from_cc((8, 9)) == "ada-lovelace"
    assert family_from_cc((8, 6)) == "ampere"
    assert family_from_cc((7, 5)) == "turing"


@pytest.mark.parametrize(
    "product, count, expected",
    [
        ("NVIDIA-H100-80GB-HBM3", 8, "h100-80gb-hbm3-x8"),
        ("NVIDIA-A100-SXM4-80GB", 8, "a100-sxm4-80gb-x8"),
        ("NVIDIA-L4", 1, "l4-x1"),
        ("Tesla-T4", 4, "t4-x4"),
        ("NVIDIA-B200", 8, "b200-x8"),
    ],
)
def test_pool_names_are_short_readable_dns_labels(product, count, expected):
    assert pool_name(product, count) == expected


def test_long_product_names_are_cut_with_a_hash_and_stay_distinct():
    a = pool_name("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", 7)
    b = pool_name("NVIDIA-A100-SXM4-40GB-MIG-2g.10gb", 3)
    c = pool_name("NVIDIA-A100-SXM4-40GB-MIG-2g.10gb", 7)
    for name in (a, b, c):
        assert len(name) <= POOL_NAME_MAX
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    assert len({a, b, c}) == 3
    assert pool_name("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", 7) == a  # deterministic


def test_pools_group_nodes_and_count_them():
    nodes = [
        node("h1", "NVIDIA-H100-80GB-HBM3", 8, family="hopper", major=9, minor=0, memory=81559),
        node("h2", "NVIDIA-H100-80GB-HBM3", 8, family="hopper", major=9, minor=0, memory=81559),
        node("l1", "NVIDIA-L4", 1, family="ada-lovelace", major=8, minor=9, memory=23034),
        node("l2", "NVIDIA-L4", 4, family="ada-lovelace", major=8, minor=9, memory=23034),
        node("cpu1"),  # no GPU labels
        node("h3", "NVIDIA-H100-80GB-HBM3", 8, family="hopper", major=9, minor=0, memory=81559, unschedulable=True),
    ]
    pools = pools_from_nodes(nodes)
    assert [(p.name, p.node_count, p.gpus_per_node) for p in pools] == [
        ("h100-80gb-hbm3-x8", 2, 8),
        ("l4-x1", 1, 1),
        ("l4-x4", 1, 4),
    ]
    h100 = pools[0]
    assert h100.cc == (9, 0) and h100.family == "hopper" and h100.memory_mib == 81559
    assert h100.bandwidth_gbps == 3350 and not h100.bandwidth_estimated
    assert h100.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8"}
    assert "kubernetes.io/hostname" not in h100.common_labels  # differs between h1 and h2


def test_compute_capability_labels_are_read_as_numbers():
    pools = pools_from_nodes([node("b", "NVIDIA-B200", 8, family="blackwell", major=10, minor=0, memory=183359)])
    assert pools[0].cc == (10, 0) and pools[0].cc > (9, 0)


def test_unknown_product_plans_from_labels_with_a_bandwidth_estimate():
    pools = pools_from_nodes([node("x", "NVIDIA-RTX-PRO-6000-Blackwell", 2, family="blackwell", major=12, minor=0, memory=97887)])
    (p,) = pools
    assert p.cc == (12, 0) and p.memory_mib == 97887 and p.family == "blackwell"
    assert p.bandwidth_estimated
    assert any("not in the catalog" in n and "estimated" in n for n in p.notes)


def test_missing_labels_are_filled_from_the_catalog_and_family_from_cc():
    # Only product and count labels (older GFD): the catalog fills CC, memory and family.
    (p,) = pools_from_nodes([node("l", "NVIDIA-L40S", 2)])
    assert (p.cc, p.memory_mib, p.family) == ((8, 9), 46068, "ada-lovelace")
    # Unknown product without a family label: family derived from the CC labels.
    (q,) = pools_from_nodes([node("v", "Tesla-V100-SXM2-32GB", 8, major=7, minor=0, memory=32768)])
    assert q.family == "volta" and q.bandwidth_estimated


def test_unknown_product_without_cc_or_memory_labels_is_skipped():
    assert pools_from_nodes([node("m", "Mystery-GPU", 8)]) == []


def test_allocatable_limits_gpus_and_zero_allocatable_skips_node():
    # Time-slicing advertises more GPUs than exist; a degraded node fewer than its label.
    (shared,) = pools_from_nodes([node("s", "NVIDIA-L4", 1, allocatable=4, major=8, minor=9, memory=23034)])
    assert shared.gpus_per_node == 1
    (degraded,) = pools_from_nodes([node("d", "NVIDIA-H100-80GB-HBM3", 8, allocatable=7)])
    assert degraded.gpus_per_node == 7 and degraded.name == "h100-80gb-hbm3-x7"
    assert pools_from_nodes([node("z", "NVIDIA-L4", 1, allocatable=0)]) == []


def test_pool_from_product_fills_facts_and_rejects_unknown_products():
    p = pool_from_product("NVIDIA-H200", 8)
    assert (p.name, p.family, p.cc, p.gpus_per_node) == ("h200-x8", "hopper", (9, 0), 8)
    assert p.common_labels["nvidia.com/gpu.family"] == "hopper"
    with pytest.raises(ValueError, match="unknown GPU product 'NVIDIA-X999'.*NVIDIA-L4"):
        pool_from_product("NVIDIA-X999", 1)
    with pytest.raises(ValueError, match="at least 1"):
        pool_from_product("NVIDIA-L4", 0)


def test_grace_superchips_are_not_taken_for_their_h200_or_b200_neighbours():
    # "GH200" and "GB200" are tokens of their own: not the H200's 141 GB nor the B200's 180 GB.
    gh200, gb200 = lookup_product("NVIDIA-GH200-480GB"), lookup_product("NVIDIA-GB200")
    assert gh200.memory_mib < lookup_product("NVIDIA-H200").memory_mib
    assert 90_000 < gh200.memory_mib < 100_000 and gh200.bandwidth_gbps == 4000  # 96 GB HBM3, 4 TB/s
    assert lookup_product("NVIDIA-GH200-480GB", memory_mib=146_000).key == "gh200-144gb"  # by its GFD memory
    assert gb200.key == "gb200" and gb200.bf16_tflops > lookup_product("NVIDIA-B200").bf16_tflops
    pool = pool_from_product("NVIDIA-GH200-480GB", 1)
    assert (pool.family, pool.cc, pool.bandwidth_estimated, pool.notes) == ("hopper", (9, 0), False, ())


def test_a_product_the_catalog_lacks_plans_from_the_memory_and_capability_given():
    p = pool_from_product("NVIDIA-RTX-PRO-6000", 4, memory_gib=96, cc=(12, 0))
    assert (p.memory_mib, p.cc, p.family, p.gpus_per_node) == (98304, (12, 0), "blackwell", 4)
    assert p.bandwidth_estimated and p.bf16_tflops is None
    assert "not in the catalog" in p.notes[0] and "estimated" in p.notes[0]
    assert p.common_labels["nvidia.com/gpu.compute.major"] == "12"
    # A known product given other facts takes them (a different memory variant), keeping its bandwidth.
    h100 = pool_from_product("NVIDIA-H100-80GB-HBM3", 8, memory_gib=94, cc=(9, 0))
    assert h100.memory_mib == 96256 and h100.bandwidth_gbps == 3350 and not h100.bandwidth_estimated
    with pytest.raises(ValueError, match="both the GPU memory in GiB and the compute capability"):
        pool_from_product("NVIDIA-RTX-PRO-6000", 4, memory_gib=96)
    with pytest.raises(ValueError, match="memory in GiB and compute capability too, e.g. NVIDIA-X999:2:96:12.0"):
        pool_from_product("NVIDIA-X999", 2)
