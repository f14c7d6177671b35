"""Property-based tests of the planner (hypothesis): random model shapes × random GPU pools.

Whatever the config.json and the pools, the planner raises nothing but its documented
ModelConfigError, every variant it plans fits the memory it claims, splits the model the way
vLLM can, follows the compute-capability facts (docs/architecture.md) and passes vLLM 0.33's argument
check; more GPU memory never makes a fitting model stop fitting.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fewerbits_api.formats import FORMAT_FACTS, KVCacheSetting, QuantFormat
from fewerbits_operator.planner import (
    CATALOG,
    ModelConfigError,
    PlanRequest,
    check_vllm_args,
    plan,
    pool_from_product,
    shape_from_config,
)
from fewerbits_operator.planner.rules import GIB, estimate_weights, runtime_reserve_bytes

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- strategies

POW2 = st.sampled_from([1, 2, 4, 8, 16, 32, 64])


@st.composite
def model_configs(draw) -> dict:
    """config.json dicts of plausible decoders: dense, GQA, MoE, tied or not, RoPE-scaled."""
    heads = draw(st.sampled_from([4, 8, 12, 16, 28, 32, 40, 64, 96, 128]))
    head_dim = draw(st.sampled_from([64, 80, 96, 128, 256]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4, 8, 16, heads) if heads % h == 0]))
    cfg = {
        "model_type": draw(st.sampled_from(["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "other"])),
        "hidden_size": heads * head_dim,
        "num_hidden_layers": draw(st.integers(1, 128)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": draw(st.integers(1000, 260_000)),
        "intermediate_size": draw(st.integers(1, 64)) * 512,
        "max_position_embeddings": draw(st.sampled_from([2048, 4096, 8192, 32768, 131072])),
        "tie_word_embeddings": draw(st.booleans()),
    }
    if draw(st.booleans()):
        cfg["num_local_experts"] = draw(st.sampled_from([8, 16, 64]))
        cfg["num_experts_per_tok"] = draw(st.sampled_from([1, 2, 8]))
    if draw(st.booleans()):
        cfg["rope_scaling"] = {"rope_type": draw(st.sampled_from(["linear", "yarn", "llama3"])),
                               "factor": draw(st.sampled_from([1.0, 2.0, 4.0, 8.0]))}
    return cfg


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                    max_leaves=12)
CONFIG_KEYS = ["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "intermediate_size", "max_position_embeddings", "rope_scaling",
               "num_local_experts", "num_experts_per_tok", "mlp_only_layers", "architectures", "text_config",
               "kv_lora_rank", "vision_config", "tie_word_embeddings", "moe_intermediate_size"]


@st.composite
def hostile_configs(draw) -> dict:
    """A valid config with some fields replaced by arbitrary JSON (what a hostile repo may hold)."""
    cfg = draw(model_configs())
    for key in draw(st.lists(st.sampled_from(CONFIG_KEYS), min_size=1, max_size=4, unique=True)):
        cfg[key] = draw(JSON)
    return cfg


@st.composite
def pools(draw):
    gpu = draw(st.sampled_from(CATALOG))
    pool = pool_from_product(gpu.product, draw(st.sampled_from([1, 2, 4, 8])))
    if draw(st.booleans()):
        # A memory the catalog does not list (a MIG slice, a future part): 4-200 GiB.
        pool = dataclasses.replace(pool, memory_mib=draw(st.integers(4, 200)) * 1024)
    return pool


@st.composite
def requests(draw) -> PlanRequest:
    return PlanRequest(
        format=draw(st.sampled_from(list(QuantFormat))),
        kv_cache=draw(st.sampled_from(list(KVCacheSetting))),
        ignore=tuple(draw(st.sampled_from([["lm_head"], [], ["lm_head", "re:.*mlp.gate$"]]))),
        max_model_len=draw(st.one_of(st.none(), st.integers(128, 200_000))),
        min_concurrent_sequences=draw(st.integers(1, 16)),
        gpu_memory_utilization=draw(st.floats(0.3, 0.98)),
        served_model_name=draw(st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,20}", fullmatch=True))),
        allowed_formats=draw(st.one_of(st.none(), st.lists(st.sampled_from(list(QuantFormat)), max_size=4).map(tuple))),
        max_gpus_per_replica=draw(st.one_of(st.none(), st.integers(1, 8))),
    )


# ---------------------------------------------------------------- properties


@SETTINGS
@given(hostile_configs())
def test_a_hostile_config_raises_only_model_config_error(cfg):
    try:
        shape = shape_from_config(json.loads(json.dumps(cfg)))
    except ModelConfigError as e:
        assert str(e).startswith("config.json")
        return
    # What it does read is sane enough to plan with.
    assert shape.num_layers >= 1 and shape.num_attention_heads >= 1 and shape.head_dim >= 1
    assert 1 <= shape.num_kv_heads <= shape.num_attention_heads and shape.kv_head_dim >= 1
    plan(shape, [pool_from_product("NVIDIA-H100-80GB-HBM3", 8)], PlanRequest())


@SETTINGS
@given(model_configs(), st.lists(pools(), min_size=1, max_size=3, unique_by=lambda p: p.name), requests())
def test_every_variant_fits_splits_evenly_follows_the_facts_and_parses(cfg, pool_list, request):
    shape = shape_from_config(cfg)
    result = plan(shape, pool_list, request)
    by_name = {p.name: p for p in pool_list}
    assert len(result.variants) + len(result.rejected) == len({p.name for p in pool_list})
    for r in result.rejected:
        assert r.reason.strip()
    for v in result.variants:
        pool = by_name[v.pool]
        tp = v.tensorParallelSize
        # Splits the way vLLM can: a power of two within one node that divides the heads.
        assert tp & (tp - 1) == 0 and tp <= pool.gpus_per_node
        assert shape.num_attention_heads % tp == 0
        if request.max_gpus_per_replica:
            assert tp <= request.max_gpus_per_replica
        # Fits: weights per GPU within what vLLM may use, and the KV cache holds
        # minConcurrentSequences sequences of the planned length.
        mem = pool.memory_mib * 1024**2
        usable = mem * request.gpu_memory_utilization - runtime_reserve_bytes(mem, tp)
        weights = estimate_weights(shape, v.format, request.ignore)
        assert weights.total_bytes / tp < usable
        assert abs(v.weightsGiB - weights.total_bytes / GIB) < 0.01
        assert v.kvCacheTokens >= request.min_concurrent_sequences * v.maxModelLen
        assert v.maxModelLen <= shape.max_model_len
        # The compute-capability facts (docs/architecture.md): bfloat16 from 8.0, FP8 KV from 8.9, and a
        # format only where vLLM has a kernel for it (native or the documented fallback).
        assert v.dtype == ("bfloat16" if pool.cc >= (8, 0) else "float16")
        assert v.kvCacheDtype in ("fp8", "auto")
        if v.kvCacheDtype == "fp8":
            assert pool.cc >= (8, 9) and request.kv_cache is not KVCacheSetting.NONE
        facts = FORMAT_FACTS[v.format]
        assert pool.cc >= (facts.fallback_min_cc or facts.native_min_cc)
        if facts.native_max_cc:
            assert pool.cc <= facts.native_max_cc
        if request.format is not QuantFormat.AUTO:
            assert v.format is request.format
        if request.allowed_formats and any(f is not QuantFormat.AUTO for f in request.allowed_formats):
            assert v.format in request.allowed_formats
        if v.dtype == "float16":
            assert not shape.float16_unsupported
        # vLLM 0.33 parses what the planner writes.
        assert check_vllm_args(v.vllmArgs) == [], v.vllmArgs


@SETTINGS
@given(model_configs(), pools(), requests(), st.integers(1, 64))
def test_more_gpu_memory_never_makes_a_fitting_model_not_fit(cfg, pool, request, extra_gib):
    shape = shape_from_config(cfg)
    smaller = plan(shape, [pool], request)
    assume(smaller.variants)
    bigger_pool = dataclasses.replace(pool, memory_mib=pool.memory_mib + extra_gib * 1024)
    bigger = plan(shape, [bigger_pool], request)
    assert bigger.variants, bigger.rejected
    # Never more GPUs per replica for more memory per GPU.
    assert bigger.variants[0].tensorParallelSize <= smaller.variants[0].tensorParallelSize


_TINY = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 1000, "intermediate_size": 256, "max_position_embeddings": 2048}


@pytest.mark.parametrize("patch, field", [
    ({"num_hidden_layers": 10**12}, "num_hidden_layers"),          # was: a loop over 10^12 layers
    ({"hidden_size": float("inf")}, "hidden_size"),                # was: OverflowError
    ({"max_position_embeddings": float("inf")}, "max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "x"}}, "factor"),  # was: ValueError
    ({"rope_scaling": {"rope_type": "linear", "factor": 1e308}}, "rope_scaling.factor"),
    ({"mlp_only_layers": 5}, "mlp_only_layers"),                   # was: TypeError
    ({"architectures": 5}, "architectures"),
    ({"num_key_value_heads": "x"}, "num_key_value_heads"),
    ({"num_key_value_heads": 64}, "num_key_value_heads"),
    ({"head_dim": -1}, "head_dim"),
    ({"num_attention_heads": 1000}, "num_attention_heads"),        # was: head_dim 0, ZeroDivisionError
    ({"hidden_size": True}, "hidden_size"),
    ({"hidden_size": 10**200}, "hidden_size"),
])
def test_hostile_config_values_are_model_config_errors_naming_the_field(patch, field):
    with pytest.raises(ModelConfigError, match=field):
        shape_from_config({**_TINY, **patch})
