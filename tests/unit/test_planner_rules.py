"""The planner's decisions per GPU family, format, policy and model."""

from __future__ import annotations

from pathlib import Path

import pytest

from fewerbits_api.formats import KVCacheSetting, QuantFormat
from fewerbits_api.policy import PolicyRules, QuantizationPolicySpec
from fewerbits_api.quantizedmodel import PlanStatus, PlanVariant, QuantizedModelSpec, RejectedPool, ServingTarget
from fewerbits_operator.planner import (
    PlanRequest,
    estimate_weights,
    kernel_support,
    load_model_shape,
    plan,
    plan_pool,
    pool_from_product,
    unmatched_targets,
)
from fewerbits_operator.planner.rules import FAMILY_FORMATS, GIB, runtime_reserve_bytes

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"
F = QuantFormat

T4 = ("Tesla-T4", 1)
A10G = ("NVIDIA-A10G", 1)
L4 = ("NVIDIA-L4", 1)
L40S = ("NVIDIA-L40S", 4)
A100_80 = ("NVIDIA-A100-SXM4-80GB", 8)
H100 = ("NVIDIA-H100-80GB-HBM3", 8)
H200 = ("NVIDIA-H200", 8)
B200 = ("NVIDIA-B200", 8)


def shape(name):
    return load_model_shape(CONFIGS / f"{name}.json")


def pool(gpu):
    return pool_from_product(*gpu)


def one(model, gpu, **request) -> PlanVariant | RejectedPool:
    return plan_pool(shape(model), pool(gpu), PlanRequest(**request))


def variant(model, gpu, **request) -> PlanVariant:
    out = one(model, gpu, **request)
    assert isinstance(out, PlanVariant), out
    return out


def rejected(model, gpu, **request) -> RejectedPool:
    out = one(model, gpu, **request)
    assert isinstance(out, RejectedPool), out
    return out


# --- every family × a small and a large dense model -------------------------------------------

@pytest.mark.parametrize(
    "gpu, fmt, dtype, kv",
    [
        (B200, F.NVFP4, "bfloat16", "fp8"),
        (H100, F.FP8_DYNAMIC, "bfloat16", "fp8"),
        (H200, F.FP8_DYNAMIC, "bfloat16", "fp8"),
        (L40S, F.FP8_DYNAMIC, "bfloat16", "fp8"),
        (L4, F.FP8_DYNAMIC, "bfloat16", "fp8"),
        (A100_80, F.W4A16_AWQ, "bfloat16", "auto"),
        (A10G, F.W4A16_AWQ, "bfloat16", "auto"),
        (T4, F.W8A8_INT8, "float16", "auto"),
    ],
)
def test_small_model_gets_the_family_default(gpu, fmt, dtype, kv):
    v = variant("llama-3.2-1b", gpu)
    assert (v.format, v.dtype, v.kvCacheDtype, v.tensorParallelSize) == (fmt, dtype, kv, 1)
    assert v.maxModelLen == 131072 or gpu == T4
    assert not any("stepped down" in w for w in v.warnings)


@pytest.mark.parametrize(
    "gpu, fmt, tp",
    [
        (B200, F.NVFP4, 1),  # 39.8 GiB of weights on a 179 GiB GPU
        (H200, F.FP8_DYNAMIC, 1),
        (H100, F.FP8_DYNAMIC, 2),  # 67.7 GiB of FP8 weights + KV need two 80 GB GPUs
        (L40S, F.FP8_DYNAMIC, 2),
        (A100_80, F.W4A16_AWQ, 1),
    ],
)
def test_large_model_on_multi_gpu_pools(gpu, fmt, tp):
    v = variant("llama-3.1-70b", gpu)
    assert (v.format, v.tensorParallelSize) == (fmt, tp)
    assert f"--tensor-parallel-size {tp}" in " ".join(v.vllmArgs)


@pytest.mark.parametrize("gpu", [T4, A10G, L4])
def test_large_model_on_single_gpu_pools_is_rejected_with_actionable_reason(gpu):
    r = rejected("llama-3.1-70b", gpu)
    assert "does not fit at any allowed format" in r.reason
    assert "GiB for weights" in r.reason and "GPUs per node" in r.reason


# --- stepping down in bits --------------------------------------------------------------------

def test_auto_steps_down_from_fp8_to_4_bit_when_fp8_does_not_fit():
    v = variant("qwen3-30b-a3b", L4)  # 29 GiB at FP8 on a 22.5 GiB GPU
    assert v.format is F.W4A16_AWQ
    assert any("fp8-dynamic does not fit" in w and "stepped down to w4a16-awq" in w for w in v.warnings)


def test_hopper_never_steps_down_to_w4afp8_whose_artifacts_vllm_cannot_load():
    # llm-compressor 0.14 writes w4afp8 int-quantized; vLLM 0.33 loads only pack-quantized
    # (scripts/vllm-check.sh): the planner neither picks it nor accepts it.
    h100x1 = ("NVIDIA-H100-80GB-HBM3", 1)
    r = rejected("llama-3.1-70b", h100x1, allowed_formats=(F.FP8_DYNAMIC, F.W4AFP8))
    assert "tried fp8-dynamic)" in r.reason
    r = rejected("llama-3.2-1b", h100x1, format=F.W4AFP8)
    assert "do not load in vLLM 0.33" in r.reason and "pack-quantized" in r.reason
    assert r.reason.startswith("spec.quantization.format w4afp8 cannot be served") and "CPU build" in r.reason
    # Not among any family's defaults either (the docs' recommendations say the same).
    assert all(F.W4AFP8 not in chain for chain in FAMILY_FORMATS.values())


def test_format_preferred_over_fewer_gpus():
    # FP8 at TP 2 beats 4-bit at TP 1: step down only when the format fits no allowed TP.
    v = variant("llama-3.1-70b", H100)
    assert v.format is F.FP8_DYNAMIC and v.tensorParallelSize == 2


# --- explicit formats against the GPU ----------------------------------------------------------

@pytest.mark.parametrize(
    "fmt, gpu, outcome, text",
    [
        (F.FP8_DYNAMIC, A100_80, "warn", "weight-only through the FP8 Marlin kernel"),
        (F.FP8_DYNAMIC, T4, "refuse", "needs compute capability 8.0 or newer (native from 8.9); this GPU is 7.5"),
        (F.NVFP4, H100, "warn", "FP4 Marlin fallback"),
        (F.NVFP4, T4, "refuse", "needs compute capability 8.0"),
        (F.W4AFP8, L40S, "refuse", "do not load in vLLM 0.33"),
        (F.W4AFP8, H100, "refuse", "do not load in vLLM 0.33"),
        (F.FP8_BLOCK, L4, "refuse", "needs compute capability 9.0"),
        (F.W4A16_GPTQ, T4, "warn", "Marlin kernel below CC 8.0"),
        (F.W8A8_INT8, T4, "ok", ""),
    ],
)
def test_explicit_format_below_native_capability(fmt, gpu, outcome, text):
    out = one("llama-3.2-1b", gpu, format=fmt)
    if outcome == "refuse":
        assert isinstance(out, RejectedPool) and text in out.reason
        return
    assert isinstance(out, PlanVariant) and out.format is fmt
    fallback_warnings = [w for w in out.warnings if "below compute capability" in w]
    if outcome == "warn":
        assert any(text in w for w in fallback_warnings), out.warnings
    else:
        assert fallback_warnings == []


def test_kernel_support_compares_cc_numerically():
    assert kernel_support(F.NVFP4, (10, 0))[0] == "native"
    assert kernel_support(F.NVFP4, (9, 0))[0] == "fallback"
    assert kernel_support(F.W4AFP8, (10, 0))[0] == "refused"
    assert kernel_support(F.FP8_DYNAMIC, (8, 9))[0] == "native"


def test_explicit_format_that_does_not_fit_names_what_would():
    r = rejected("llama-3.1-70b", ("NVIDIA-H100-80GB-HBM3", 1), format=F.FP8_DYNAMIC)
    assert r.reason.startswith("at fp8-dynamic the weights fit with tensor parallelism 1 (67.7 GiB of 67.8 GiB")
    assert "it would fit at w4a16-awq" in r.reason


def test_format_none_serves_16_bit():
    v = variant("llama-3.1-8b", H100, format=F.NONE)
    assert v.format is F.NONE and v.weightsGiB == pytest.approx(8.03e9 * 2 / GIB, rel=0.01)


# --- dtype, KV cache --------------------------------------------------------------------------

def test_gemma2_on_t4_is_refused_for_float16():
    r = rejected("gemma-2-9b", T4)
    assert "gemma2 cannot run in float16" in r.reason and "8.0 or newer" in r.reason


def test_gemma3_on_l4_runs_bfloat16():
    v = variant("gemma-3-27b-it", ("NVIDIA-L4", 4))
    assert v.dtype == "bfloat16"


@pytest.mark.parametrize(
    "gpu, setting, kv, warned",
    [
        (L4, KVCacheSetting.AUTO, "fp8", False),
        (H100, KVCacheSetting.AUTO, "fp8", False),
        (B200, KVCacheSetting.FP8, "fp8", False),
        (A100_80, KVCacheSetting.AUTO, "auto", False),
        (A100_80, KVCacheSetting.FP8, "auto", True),
        (H100, KVCacheSetting.NONE, "auto", False),
    ],
)
def test_kv_cache_fp8_from_cc_8_9(gpu, setting, kv, warned):
    v = variant("llama-3.1-8b", gpu, kv_cache=setting)
    assert v.kvCacheDtype == kv
    assert any("kvCache fp8 needs compute capability 8.9" in w for w in v.warnings) is warned


def test_fp8_kv_doubles_the_tokens_that_fit():
    fp8 = variant("llama-3.1-8b", H100, max_model_len=8192)
    bf16 = variant("llama-3.1-8b", H100, max_model_len=8192, kv_cache=KVCacheSetting.NONE)
    assert fp8.kvCacheTokens == pytest.approx(2 * bf16.kvCacheTokens, abs=2)


# --- memory ------------------------------------------------------------------------------------

def test_ignored_lm_head_is_counted_at_16_bits():
    s = shape("llama-3.1-8b")
    kept = estimate_weights(s, F.W4A16_AWQ, ["lm_head"]).total_bytes
    quantized = estimate_weights(s, F.W4A16_AWQ, []).total_bytes
    # The 525M-parameter head at 2 bytes instead of ~0.52 bytes.
    assert kept - quantized == pytest.approx(s.lm_head_params * (2 - 0.5 * 1.03), rel=1e-6)
    assert estimate_weights(s, F.W4A16_AWQ, ["re:.*lm_head"]).total_bytes == kept


def test_weights_scale_with_bits():
    s = shape("llama-3.1-8b")
    none = estimate_weights(s, F.NONE, ["lm_head"]).total_bytes
    fp8 = estimate_weights(s, F.FP8_DYNAMIC, ["lm_head"]).total_bytes
    int4 = estimate_weights(s, F.W4A16_AWQ, ["lm_head"]).total_bytes
    assert none == pytest.approx(s.total_params * 2)
    assert none > fp8 > int4
    # 16-bit embeddings + head: 1.05B params stay at 2 bytes in every format.
    assert fp8 == pytest.approx(s.linear_params + (s.embed_params + s.lm_head_params + s.other_params) * 2)


def test_ignore_entries_that_match_nothing_are_warned_about_and_real_ones_sized():
    # A dense Llama has no router: the pattern keeps nothing, and is named. A real layer name is
    # sized at 16 bits instead of being guessed.
    v = variant("llama-3.1-8b", H100, ignore=("lm_head", "re:.*mlp.gate$", "model.layers.0.self_attn.q_proj"))
    joined = " ".join(v.warnings)
    assert "'re:.*mlp.gate$' matches no layer" in joined and "q_proj" not in joined
    s = shape("llama-3.1-8b")
    base = estimate_weights(s, F.FP8_DYNAMIC, ["lm_head"]).total_bytes
    more = estimate_weights(s, F.FP8_DYNAMIC, ["lm_head", "model.layers.0.self_attn.q_proj"]).total_bytes
    assert more - base == pytest.approx(4096 * 4096 * (2 - 1))


def test_runtime_reserve_is_documented_figure():
    # 1.5 GiB + 3% of memory, + 0.5 GiB under tensor parallelism.
    assert runtime_reserve_bytes(80 * GIB, 1) == pytest.approx((1.5 + 2.4) * GIB)
    assert runtime_reserve_bytes(80 * GIB, 2) == pytest.approx((2.0 + 2.4) * GIB)


def test_moe_decode_reads_only_active_experts():
    moe = variant("qwen3-30b-a3b", H100)
    dense = variant("llama-3.1-8b", H100)
    assert moe.weightsGiB > 3 * dense.weightsGiB  # 30B total
    assert moe.decodeTokensPerSecond > dense.decodeTokensPerSecond  # 3.3B active


def test_decode_estimate_is_bandwidth_over_bytes_read():
    v = variant("llama-3.1-8b", L4, max_model_len=4096)
    s = shape("llama-3.1-8b")
    read = estimate_weights(s, F.FP8_DYNAMIC, ["lm_head"]).read_per_token_bytes + s.kv_bytes_per_token(1) * 2048
    assert v.decodeTokensPerSecond == pytest.approx(300e9 / read, rel=0.01)
    assert 25 < v.decodeTokensPerSecond < 45


# --- tensor parallelism ------------------------------------------------------------------------

def test_70b_bf16_on_8xh100_picks_the_smallest_tp_that_fits():
    v = variant("llama-3.1-70b", H100, format=F.NONE, max_model_len=8192)
    assert v.tensorParallelSize == 4  # 131 GiB of weights: TP 2 leaves too little KV room
    assert v.weightsGiB == pytest.approx(131.4, rel=0.01)


def test_8b_on_l4_with_fp8_fits_one_gpu():
    v = variant("llama-3.1-8b", ("NVIDIA-L4", 4), max_model_len=8192)
    assert (v.format, v.tensorParallelSize, v.kvCacheDtype) == (F.FP8_DYNAMIC, 1, "fp8")


def test_min_concurrency_raises_tp():
    few = variant("llama-3.1-8b", ("NVIDIA-L4", 4), max_model_len=32768, min_concurrent_sequences=1)
    many = variant("llama-3.1-8b", ("NVIDIA-L4", 4), max_model_len=32768, min_concurrent_sequences=8)
    assert few.tensorParallelSize == 1 and many.tensorParallelSize == 2
    assert many.kvCacheTokens >= 8 * 32768


def test_tp_must_divide_attention_heads():
    # Qwen2.5-7B has 28 attention heads: TP 8 is never valid, so a pool that would need it is
    # rejected with that reason.
    r = rejected("qwen2.5-7b", ("NVIDIA-L4", 8), format=F.NONE, max_model_len=131072, min_concurrent_sequences=32)
    assert "TP 8: 28 attention heads are not divisible by 8" in r.reason
    v = variant("qwen2.5-7b", ("NVIDIA-L4", 8), format=F.NONE, max_model_len=131072, min_concurrent_sequences=8)
    assert v.tensorParallelSize == 4


def test_group_size_limits_tp_for_4_bit_moe():
    # Qwen3-30B-A3B's 768-wide experts split 4 ways are 192 wide: not whole 128-groups.
    s = shape("qwen3-30b-a3b")
    t4x8 = pool(("Tesla-T4", 8))
    out = plan_pool(s, t4x8, PlanRequest(format=F.W4A16_GPTQ, max_model_len=8192, min_concurrent_sequences=4))
    assert isinstance(out, PlanVariant) and out.tensorParallelSize == 2
    busy = plan_pool(s, t4x8, PlanRequest(format=F.W4A16_GPTQ, max_model_len=8192, min_concurrent_sequences=64))
    assert isinstance(busy, RejectedPool)
    assert "TP 4: w4a16-gptq needs each GPU's share of the expert MLP width (768/4) to be a multiple of its group size 128" in busy.reason
    # FP8 (no groups) may use TP 4 on an FP8-capable pool.
    l4x8 = pool(("NVIDIA-L4", 8))
    fp8 = plan_pool(s, l4x8, PlanRequest(format=F.FP8_DYNAMIC, max_model_len=8192, min_concurrent_sequences=64))
    assert isinstance(fp8, PlanVariant) and fp8.tensorParallelSize >= 4


def test_kv_heads_replicate_when_tp_exceeds_them():
    # 4 KV heads at TP 8 is fine for vLLM (replicated), 28 attention heads at TP 8 is not.
    s = shape("llama-3.1-8b")
    assert s.kv_bytes_per_token_per_gpu(8, 1) == 2 * 32 * 1 * 128


# --- maxModelLen -------------------------------------------------------------------------------

def test_max_model_len_is_clamped_to_the_model_limit():
    v = variant("gemma-2-9b", H100, max_model_len=32768)
    assert v.maxModelLen == 8192
    assert any("above the model's limit; clamped to 8,192" in w for w in v.warnings)
    assert "--max-model-len 8192" in " ".join(v.vllmArgs)


def test_default_max_model_len_is_lowered_to_what_fits():
    v = variant("llama-3.1-8b", L4)
    assert 8192 <= v.maxModelLen < 131072 and v.maxModelLen % 1024 == 0
    assert v.kvCacheTokens >= 4 * v.maxModelLen
    assert any(f"maxModelLen lowered to {v.maxModelLen:,} (model allows 131,072)" in w for w in v.warnings)


def test_requested_len_that_does_not_fit_says_what_would():
    r = rejected("llama-3.1-8b", L4, format=F.FP8_DYNAMIC, max_model_len=131072)
    assert "KV cache then holds only" in r.reason and "lower serving.maxModelLen to" in r.reason


# --- policy --------------------------------------------------------------------------------------

def test_allowed_formats_restrict_auto():
    v = variant("llama-3.1-8b", H100, allowed_formats=(F.W8A8_INT8,))
    assert v.format is F.W8A8_INT8
    r = rejected("llama-3.1-8b", T4, allowed_formats=(F.FP8_BLOCK,))
    assert "none of the policy's allowedFormats (fp8-block) runs on Tesla-T4" in r.reason


def test_explicit_format_outside_allowed_formats_is_rejected():
    r = rejected("llama-3.1-8b", H100, format=F.NVFP4, allowed_formats=(F.FP8_DYNAMIC,))
    assert "not allowed by the policy" in r.reason


def test_format_by_gpu_family_overrides_the_default():
    v = variant("llama-3.1-8b", H100, format_by_gpu_family={"hopper": F.W4A16_AWQ})
    assert v.format is F.W4A16_AWQ
    untouched = variant("llama-3.1-8b", L4, format_by_gpu_family={"hopper": F.W4A16_AWQ})
    assert untouched.format is F.FP8_DYNAMIC


def test_format_by_gpu_family_that_cannot_run_is_ignored_with_a_warning():
    v = variant("llama-3.1-8b", L40S, format_by_gpu_family={"ada-lovelace": F.W4AFP8})
    assert v.format is F.FP8_DYNAMIC
    assert any("formatByGPUFamily.ada-lovelace = w4afp8 cannot run here" in w for w in v.warnings)


def test_max_gpus_per_replica_caps_tp():
    r = rejected("llama-3.1-70b", H100, format=F.NONE, max_gpus_per_replica=2)
    assert "maxGPUsPerReplica" in r.reason
    v = variant("llama-3.1-70b", H100, max_gpus_per_replica=1)
    assert v.tensorParallelSize == 1 and v.format is F.W4A16_AWQ


def test_request_from_spec_and_policy():
    spec = QuantizedModelSpec.model_validate({
        "source": {"uri": "hf://meta-llama/Llama-3.1-8B"},
        "quantization": {"kvCache": "none"},
        "serving": {"maxModelLen": 4096, "targets": [{"family": "hopper"}], "gpuMemoryUtilization": 0.85},
    })
    policy = QuantizationPolicySpec(
        rules=PolicyRules(allowedFormats=[F.FP8_DYNAMIC, F.W4A16_AWQ], maxGPUsPerReplica=2),
        formatByGPUFamily={"hopper": F.W4A16_AWQ},
    )
    req = PlanRequest.from_spec(spec, policy, default_served_model_name="llama")
    assert req.max_model_len == 4096 and req.kv_cache is KVCacheSetting.NONE
    assert req.allowed_formats == (F.FP8_DYNAMIC, F.W4A16_AWQ) and req.max_gpus_per_replica == 2
    assert req.format_by_gpu_family == {"hopper": F.W4A16_AWQ}
    status = plan(shape("llama-3.1-8b"), [pool(H100), pool(L4)], req)
    (v,) = status.variants
    assert (v.pool, v.format, v.kvCacheDtype) == ("h100-80gb-hbm3-x8", F.W4A16_AWQ, "auto")
    assert v.vllmArgs[:2] == ["--served-model-name", "llama"]
    assert "--gpu-memory-utilization 0.85" in " ".join(v.vllmArgs)
    assert PlanRequest(allowed_formats=()).allowed_formats is None  # "Empty: all"


# --- targets and the whole plan ----------------------------------------------------------------

def test_targets_restrict_pools_quietly_and_unmatched_targets_are_reported():
    pools = [pool(H100), pool(L4), pool(T4)]
    req = PlanRequest(targets=(ServingTarget(product="NVIDIA-L4"), ServingTarget(family="turing")))
    status = plan(shape("llama-3.1-8b"), pools, req)
    assert [v.pool for v in status.variants] == ["l4-x1", "t4-x1"] and status.rejected == []
    sel = ServingTarget(nodeSelector={"nvidia.com/gpu.family": "hopper"})
    assert [v.pool for v in plan(shape("llama-3.1-8b"), pools, PlanRequest(targets=(sel,))).variants] == ["h100-80gb-hbm3-x8"]
    typo = ServingTarget(product="NVIDIA-H100")
    assert unmatched_targets(pools, [typo, ServingTarget(family="hopper")]) == [typo]


def test_model_that_fits_nowhere():
    pools = [pool(T4), pool(L4), pool(A10G)]
    status = plan(shape("llama-3.1-70b"), pools, PlanRequest())
    assert status.variants == [] and len(status.rejected) == 3
    assert isinstance(status, PlanStatus)
    # The operator writes it to status as-is.
    assert status.to_wire()["rejected"][0].keys() == {"pool", "reason"}


def test_plan_is_deterministic():
    pools = [pool(g) for g in (T4, A10G, L4, L40S, A100_80, H100, H200, B200)]
    a = plan(shape("mixtral-8x7b"), pools, PlanRequest())
    b = plan(shape("mixtral-8x7b"), pools, PlanRequest())
    assert a == b and len(a.variants) + len(a.rejected) == len(pools)
