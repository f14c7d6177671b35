"""Replicas across nodes: the planner spans a LeaderWorkerSet group of nodes only when no single
node of the pool holds the model, with tensor parallel inside a node and pipeline parallel across."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fewerbits_api.formats import QuantFormat
from fewerbits_api.quantizedmodel import PlanVariant, RejectedPool
from fewerbits_operator.cli.main import main
from fewerbits_operator.planner import PlanRequest, check_vllm_args, load_model_shape, plan_pool, pool_from_product
from fewerbits_operator.planner.multinode import stage_weight_bytes_per_gpu
from fewerbits_operator.planner.rules import GIB, runtime_reserve_bytes

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"
F = QuantFormat
H100 = "NVIDIA-H100-80GB-HBM3"


def shape(name):
    return load_model_shape(CONFIGS / f"{name}.json")


@pytest.mark.parametrize("model, fmt, product, gpus, nodes, want_nodes, want_format, want_tp", [
    # The FP8 checkpoint served as it is: 627 GiB, one H100 node holds 8 × 67 GiB.
    ("deepseek-v3", F.AUTO, H100, 8, 4, 2, F.FP8_BLOCK, 8),
    ("deepseek-v3", F.AUTO, "NVIDIA-H200", 8, 1, 1, F.FP8_BLOCK, 8),
    ("deepseek-v3", F.AUTO, "NVIDIA-B200", 8, 1, 1, F.FP8_BLOCK, 8),
    # 16 bits: 756 GiB.
    ("llama-3.1-405b", F.NONE, H100, 8, 2, 2, F.NONE, 8),
    ("llama-3.1-405b", F.NONE, "NVIDIA-H200", 8, 1, 1, F.NONE, 8),
    ("llama-3.1-405b", F.NONE, "NVIDIA-B200", 8, 1, 1, F.NONE, 8),
    # A single-node layout at another format (FP8: 378 GiB) wins over spanning nodes at 16 bits.
    ("llama-3.1-405b", F.AUTO, H100, 8, 2, 1, F.FP8_DYNAMIC, 8),
    # A model that fits one node never spans, however many nodes the pool has.
    ("llama-3.1-70b", F.NONE, H100, 8, 4, 1, F.NONE, 4),
])
def test_nodes_per_replica(model, fmt, product, gpus, nodes, want_nodes, want_format, want_tp):
    v = plan_pool(shape(model), pool_from_product(product, gpus, nodes), PlanRequest(format=fmt))
    assert isinstance(v, PlanVariant), v
    assert (v.nodesPerReplica, v.format, v.tensorParallelSize) == (want_nodes, want_format, want_tp)
    spans = [w for w in v.warnings if "LeaderWorkerSet" in w]
    assert bool(spans) == (want_nodes > 1)
    if want_nodes > 1:
        assert v.vllmArgs[-4:] == ["--pipeline-parallel-size", str(want_nodes), "--nnodes", str(want_nodes)]
    else:
        assert "--pipeline-parallel-size" not in v.vllmArgs


def test_weights_per_gpu_arithmetic_across_nodes():
    """Llama-3.1-405B at 16 bits across 2 H100 nodes: the biggest stage (63 of 126 layers, plus the
    larger of embedding and head) on 8 GPUs fits under the usable memory; on one node it does not."""
    s = shape("llama-3.1-405b")
    v = plan_pool(s, pool_from_product(H100, 8, 2), PlanRequest(format=F.NONE))
    total = v.weightsGiB * GIB
    mem = 81559 * 1024**2
    usable = mem * 0.9 - runtime_reserve_bytes(mem, 8)
    assert total / 8 > usable  # one node: no
    per_gpu = stage_weight_bytes_per_gpu(s, total, 8, 2)
    edge = 2 * s.lm_head_params
    assert per_gpu == pytest.approx(((total - edge) * 63 / 126 + edge) / 8)
    assert per_gpu < usable
    # The KV cache of a stage holds half the layers: tokens ≈ free / (per-token KV per GPU / 2).
    kv_token_per_gpu = s.kv_bytes_per_token_per_gpu(8, 1.0) * 63 / 126
    assert v.kvCacheTokens == pytest.approx((usable - per_gpu) / kv_token_per_gpu, rel=1e-3)


def test_fits_nowhere_even_across_the_pool_names_the_numbers():
    # DeepSeek-V3's 16-bit original (1250 GiB) on 2 H100 nodes (8 × 67.3 GiB usable each).
    cfg = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    cfg.pop("quantization_config")
    from fewerbits_operator.planner import shape_from_config

    s = shape_from_config(cfg)
    r = plan_pool(s, pool_from_product(H100, 8, 2), PlanRequest(format=F.NONE))
    assert isinstance(r, RejectedPool)
    assert "1249.9 GiB for weights" in r.reason
    assert "even across 2 nodes of the pool (2 × 8 × 79.6 GiB GPUs)" in r.reason
    assert "1076.7 GiB usable in all" in r.reason
    # With 3 nodes it spans 3 (pipeline parallel need not divide 61 layers).
    v = plan_pool(s, pool_from_product(H100, 8, 4), PlanRequest(format=F.NONE))
    assert isinstance(v, PlanVariant) and v.nodesPerReplica == 3


def test_single_node_pool_says_to_add_nodes():
    r = plan_pool(shape("llama-3.1-405b"), pool_from_product(H100, 8, 1), PlanRequest(format=F.NONE))
    assert isinstance(r, RejectedPool)
    assert "756.0 GiB for weights" in r.reason


def test_policy_gpu_cap_bounds_the_span():
    r = plan_pool(shape("llama-3.1-405b"), pool_from_product(H100, 8, 4),
                  PlanRequest(format=F.NONE, max_gpus_per_replica=8))
    assert isinstance(r, RejectedPool)
    assert "maxGPUsPerReplica" in r.reason


def test_multinode_argv_is_accepted_by_vllms_parser():
    v = plan_pool(shape("deepseek-v3"), pool_from_product(H100, 8, 4), PlanRequest())
    leader = v.vllmArgs + ["--node-rank", "0", "--master-addr", "lws-0.lws", "--master-port", "29501"]
    worker = v.vllmArgs + ["--node-rank", "1", "--master-addr", "lws-0.lws", "--master-port", "29501", "--headless"]
    assert check_vllm_args(leader) == [] and check_vllm_args(worker) == []


def test_cli_gpu_nodes_syntax_table_and_json(capsys):
    cfg = str(CONFIGS / "deepseek-v3.json")
    assert main(["plan", "--model-config", cfg, "--gpu", f"{H100}:8x4", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [v["nodesPerReplica"] for v in doc["variants"]] == [2]
    assert main(["plan", "--model-config", cfg, "--gpu", f"{H100}:8x4"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("POOL "))
    assert header.split()[5:7] == ["TP", "NODES"]
    row = next(line for line in out.splitlines() if line.startswith("h100-80gb-hbm3-x8 ")).split()
    assert row[row.index("fp8") + 1:row.index("fp8") + 3] == ["8", "2"]
    # --format none ("fewerbits does not quantize") on an FP8 checkpoint: served as it is, the
    # issue's done-when (there are no 16-bit weights to serve instead).
    assert main(["plan", "--model-config", cfg, "--gpu", f"{H100}:8x4", "--format", "none", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(v["format"], v["servedAsIs"], v["nodesPerReplica"]) for v in doc["variants"]] == [("fp8-block", True, 2)]
    # Another format would need the 16-bit original: refused with what to do.
    assert main(["plan", "--model-config", cfg, "--gpu", f"{H100}:8x4", "--format", "w4a16-gptq", "-o", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert "16-bit original" in doc["rejected"][0]["reason"]


@pytest.mark.parametrize("bad", [f"{H100}:8x", f"{H100}:8x0", f"{H100}:x4", f"{H100}:8y4"])
def test_cli_gpu_nodes_syntax_errors(capsys, bad):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model-config", str(CONFIGS / "llama-3.1-8b.json"), "--gpu", bad])
    assert e.value.code == 2
    assert "PRODUCT:GPUSxNODES" in capsys.readouterr().err
