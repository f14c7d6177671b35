"""vLLM arguments checked against vLLM 0.33.0's own parser rules (dumped to JSON, no vLLM here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fewerbits_api.formats import KVCacheSetting, QuantFormat
from fewerbits_operator.planner import (
    CATALOG,
    VLLM_VERSION,
    PlanRequest,
    check_vllm_args,
    load_model_shape,
    plan,
    pool_from_product,
    vllm_arg_spec,
)

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"


def test_dump_names_its_version_and_has_the_planned_flags():
    spec = vllm_arg_spec()
    assert spec["vllm_version"] == VLLM_VERSION == "0.33.0"
    opts = spec["options"]
    for flag in ("--dtype", "--kv-cache-dtype", "--tensor-parallel-size", "--max-model-len",
                 "--gpu-memory-utilization", "--served-model-name", "--quantization"):
        assert flag in opts
    assert {"bfloat16", "float16"} <= set(opts["--dtype"]["choices"])
    assert {"auto", "fp8"} <= set(opts["--kv-cache-dtype"]["choices"])
    assert opts["--tensor-parallel-size"]["type"] == "int"


@pytest.mark.parametrize(
    "args",
    [
        ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2"],
        ["--max-model-len", "32k"],
        ["--max-model-len", "-1"],
        ["--gpu-memory-utilization=0.85"],
        ["--served-model-name", "a", "b"],
        ["--enforce-eager"],
        ["--no-enforce-eager"],
        ["--max_num_seqs", "64"],  # vLLM reads underscores as dashes
        ["-tp", "4"],
        ["-O3"],
        ["--compilation-config.mode", "3"],
        ["--hf-overrides", '{"max_position_embeddings": 4096}'],
        ["--enable-prefix-caching", "--max-num-seqs", "128"],
    ],
)
def test_arguments_vllm_accepts(args):
    assert check_vllm_args(args) == []


@pytest.mark.parametrize(
    "args, error",
    [
        (["--dtype", "bf16"], "--dtype 'bf16': not one of vLLM's choices"),
        (["--tensor-parallel-size", "two"], "must be an integer"),
        (["--max-model-len", "lots"], "--max-model-len 'lots'"),
        (["--max-num-seqs"], "--max-num-seqs: needs a value"),
        (["--swap-space", "4"], "--swap-space: not an option of vLLM 0.33.0"),
        (["--tensor-parallel-sise", "2"], "did you mean --tensor-parallel-size?"),
        (["--enforce-eager=1"], "takes no value"),
        (["--kv-cache-dtype", "fp9"], "--kv-cache-dtype 'fp9'"),
        (["--quantization", "nonsense"], "--quantization 'nonsense'"),
        (["--compilation-config", "{bad"], "must be a JSON object"),
        (["--dtype.x", "1"], "does not take dotted keys"),
        (["--tensor-parallel-size", "2", "extra"], "'extra': a value with no option before it"),
    ],
)
def test_arguments_vllm_refuses(args, error):
    errors = check_vllm_args(args)
    assert len(errors) == 1 and error in errors[0], errors


def test_unknown_version_is_an_error():
    with pytest.raises(ValueError, match="no vLLM argument dump for version 0.1.0"):
        vllm_arg_spec("0.1.0")


MODELS = sorted(p.stem for p in CONFIGS.glob("*.json"))
POOLS = [pool_from_product(g.product, n) for g in CATALOG for n in (1, 2, 8)]
REQUESTS = [
    PlanRequest(served_model_name="m"),
    PlanRequest(max_model_len=4096, kv_cache=KVCacheSetting.FP8),
    PlanRequest(format=QuantFormat.NONE, kv_cache=KVCacheSetting.NONE, gpu_memory_utilization=0.95),
    PlanRequest(format=QuantFormat.W4A16_GPTQ, max_gpus_per_replica=2),
    PlanRequest(format=QuantFormat.NVFP4, max_model_len=1_000_000),
]


@pytest.mark.parametrize("model", MODELS)
def test_every_planned_variant_has_arguments_vllm_accepts(model):
    shape = load_model_shape(CONFIGS / f"{model}.json")
    checked = 0
    for request in REQUESTS:
        for v in plan(shape, POOLS, request).variants:
            assert check_vllm_args(v.vllmArgs) == [], (v.pool, v.vllmArgs)
            assert "--quantization" not in v.vllmArgs  # compressed-tensors needs none
            checked += 1
    assert checked > 0
