"""The planner on real architectures: sliding-window KV sizing, already-quantized sources, and the
ignore list the recipe gets (architecture table + user entries), with the public config.json of
DeepSeek-V3, Gemma-2-27B, Gemma-3-27B and Mistral-7B-v0.1."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fewerbits_api.formats import QuantFormat
from fewerbits_api.quantizedmodel import PlanVariant, RejectedPool
from fewerbits_operator.planner import PlanRequest, estimate_weights, load_model_shape, plan_pool, pool_from_product
from fewerbits_operator.planner.rules import effective_ignore_entries, in_flight_tokens
from fewerbits_operator.planner.shape import KV_BLOCK_TOKENS, shape_from_config

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"
F = QuantFormat
L4 = ("NVIDIA-L4", 1)
L40S = ("NVIDIA-L40S", 4)
A100_80 = ("NVIDIA-A100-SXM4-80GB", 8)
H100 = ("NVIDIA-H100-80GB-HBM3", 8)
H200 = ("NVIDIA-H200", 8)
B200 = ("NVIDIA-B200", 8)


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def shape(name: str):
    if name == "gemma-3-27b-text":
        return shape_from_config(config("gemma-3-27b-it")["text_config"])
    return load_model_shape(CONFIGS / f"{name}.json")


def one(s, gpu, **request) -> PlanVariant | RejectedPool:
    return plan_pool(s, pool_from_product(*gpu), PlanRequest(**request))


# ------------------------------------------------------------------ sliding windows


@pytest.mark.parametrize(("name", "window", "sliding", "layers"), [
    ("gemma-2-27b", 4096, 23, 46),       # every other layer from layer 0 (transformers' Gemma2Config)
    ("gemma-2-9b", 4096, 21, 42),
    ("gemma-3-27b-it", 1024, 52, 62),    # 5 local : 1 global (sliding_window_pattern 6)
    ("mistral-7b-v0.1", 4096, 32, 32),   # no layer_types: vLLM applies the window to every layer
    ("mistral-7b-instruct-v0.3", 0, 0, 32),
    ("qwen2.5-7b", 0, 0, 28),            # sliding_window present but use_sliding_window false
    ("llama-3.1-8b", 0, 0, 32),
])
def test_sliding_window_layers_are_counted_as_vllm_builds_them(name, window, sliding, layers):
    s = shape(name)
    assert (s.sliding_window, s.sliding_layers, s.num_layers) == (window, sliding, layers)


def test_layer_types_decide_when_present():
    cfg = config("llama-3.1-8b") | {"sliding_window": 512,
                                     "layer_types": ["sliding_attention", "full_attention"] * 16}
    s = shape_from_config(cfg)
    assert (s.sliding_window, s.sliding_layers) == (512, 16)


def test_sequence_kv_bytes_follow_vllms_sliding_window_spec():
    s = shape("gemma-3-27b-it")
    per_layer_token = 2 * 16 * 128 * 1  # K and V, 16 KV heads of 128, FP8
    length, in_flight = 131_072, 16_384
    held = min(1024 - 1 + in_flight, length) + KV_BLOCK_TOKENS
    expected = per_layer_token * (10 * length + 52 * held)
    assert s.kv_bytes_per_sequence_per_gpu(1, 1.0, length, in_flight) == expected
    # Short sequences: a sliding layer holds the whole (short) sequence, plus one block.
    assert s.kv_bytes_per_sequence_per_gpu(1, 1.0, 100, in_flight) == per_layer_token * (10 * 100 + 52 * 116)
    dense = shape("llama-3.1-8b")
    assert dense.kv_bytes_per_sequence_per_gpu(1, 2.0, 1000, in_flight) == dense.kv_bytes_per_token(2.0) * 1000


@pytest.mark.parametrize(("gpu", "tokens"), [
    (L4, 2 * 2048), (A100_80, 2 * 2048), (H100, 2 * 8192), (H200, 2 * 8192), (B200, 2 * 16384)])
def test_in_flight_tokens_follow_vllms_default_batch_per_gpu(gpu, tokens):
    assert in_flight_tokens(pool_from_product(*gpu)) == tokens


@pytest.mark.parametrize(("name", "gpu", "length"), [
    ("gemma-3-27b-text", L40S, 8192),    # 1023 + 2 x 2048 in-flight tokens < 8192
    ("gemma-3-27b-text", H100, 32768),
    ("mistral-7b-v0.1", H100, 32768),    # 4095 + 2 x 8192 < 32768
    ("mistral-7b-v0.1", A100_80, 16384),
])
def test_sliding_windows_give_more_kv_room_beyond_window_plus_in_flight_tokens(name, gpu, length):
    s = shape(name)
    full = dataclasses.replace(s, sliding_window=0, sliding_layers=0)
    with_window, without = one(s, gpu, max_model_len=length), one(full, gpu, max_model_len=length)
    assert isinstance(with_window, PlanVariant), with_window
    if isinstance(without, PlanVariant):
        assert with_window.kvCacheTokens > 1.4 * without.kvCacheTokens


def test_gemma3_on_h100_serves_its_full_128k_context_thanks_to_local_layers():
    # The text model alone (model_type gemma3_text; the vision-language one is served 16-bit).
    s = shape_from_config(config("gemma-3-27b-it")["text_config"])
    assert (s.model_type, s.sliding_layers) == ("gemma3_text", 52)
    v = one(s, H100)
    assert isinstance(v, PlanVariant) and v.maxModelLen == 131_072 and v.tensorParallelSize == 1
    full = one(dataclasses.replace(s, sliding_window=0, sliding_layers=0), H100)
    assert isinstance(full, PlanVariant) and (full.maxModelLen < 131_072 or full.tensorParallelSize > 1)


def test_gemma2_at_8k_gains_nothing_under_vllm_defaults():
    # Window 4096 - 1 + 2 x 8192 in-flight tokens > 8192: each sliding layer holds the whole sequence.
    s = shape("gemma-2-27b")
    full = dataclasses.replace(s, sliding_window=0, sliding_layers=0)
    a, b = one(s, H100), one(full, H100)
    assert isinstance(a, PlanVariant) and isinstance(b, PlanVariant)
    assert a.maxModelLen == b.maxModelLen == 8192
    assert a.kvCacheTokens <= b.kvCacheTokens  # the extra block per sliding layer


# ------------------------------------------------------------------ already-quantized sources


def test_deepseek_v3_is_read_as_fp8_block_and_served_as_is_where_it_runs():
    s = shape("deepseek-v3")
    assert s.source_quantization is not None and s.source_quantization.format is F.FP8_BLOCK
    assert s.num_nextn_predict_layers == 1
    for gpu in (H200, B200):
        v = one(s, gpu)
        assert isinstance(v, PlanVariant), v
        assert v.servedAsIs and v.format is F.FP8_BLOCK and v.tensorParallelSize == 8
        # No quantization, but the truth about the copy (issue 31 item 5): a `none` Job copies the source.
        assert any("already quantized" in w and "with no quantization" in w and "copy Job (format none)" in w
                   for w in v.warnings)


def test_deepseek_v3_refused_where_its_format_does_not_run_with_what_to_do():
    r = one(shape("deepseek-v3"), A100_80)
    assert isinstance(r, RejectedPool)
    assert "already quantized" in r.reason and "fp8-block needs compute capability 9.0" in r.reason
    assert "16-bit original" in r.reason


def test_deepseek_v3_too_big_for_8_h100_says_so_at_its_own_format():
    r = one(shape("deepseek-v3"), H100)
    assert isinstance(r, RejectedPool) and "fp8-block" in r.reason and "GiB for weights" in r.reason


def test_an_explicit_other_format_for_a_quantized_source_is_refused():
    r = one(shape("deepseek-v3"), H200, format=F.W4A16_AWQ)
    assert isinstance(r, RejectedPool)
    assert "format w4a16-awq would need its 16-bit original" in r.reason
    v = one(shape("deepseek-v3"), H200, format=F.FP8_BLOCK)
    assert isinstance(v, PlanVariant) and v.servedAsIs


def test_a_16bit_source_is_never_served_as_is():
    v = one(shape("llama-3.1-8b"), H100)
    assert isinstance(v, PlanVariant) and not v.servedAsIs


CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
CT_W4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                       "symmetric": True}}}}


@pytest.mark.parametrize(("qc", "fmt"), [
    (CT_FP8, F.FP8_DYNAMIC),
    (CT_W4, F.W4A16_GPTQ),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, F.FP8_DYNAMIC),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, F.W4A16_AWQ),
])
def test_quantization_config_is_mapped_to_a_format_and_served_as_is(qc, fmt):
    s = shape_from_config(config("llama-3.1-8b") | {"quantization_config": qc})
    assert s.source_quantization is not None and s.source_quantization.format is fmt
    v = one(s, H100)
    assert isinstance(v, PlanVariant) and v.servedAsIs and v.format is fmt


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq-magic-9"])
def test_an_unknown_or_unservable_method_is_refused_with_its_name(method):
    s = shape_from_config(config("llama-3.1-8b") | {"quantization_config": {"quant_method": method}})
    for gpu in (L4, H100):
        r = one(s, gpu)
        assert isinstance(r, RejectedPool) and repr(method) in r.reason and "16-bit original" in r.reason


# ------------------------------------------------------------------ the ignore list the recipe gets


def test_the_planner_sizes_the_architectures_ignore_list():
    s = shape("mixtral-8x7b")
    assert "re:.*block_sparse_moe\\.gate$" in effective_ignore_entries(s, ["lm_head"])
    s = shape("deepseek-v3")
    entries = effective_ignore_entries(s, ["lm_head"])
    assert entries[0] == "lm_head" and "re:model\\.layers\\.(61)\\..*" in entries


def test_vision_encoder_kept_16bit_and_sized_so():
    s = shape("gemma-3-27b-it")
    assert s.vision_params > 0
    fp8 = estimate_weights(s, F.FP8_DYNAMIC, ["lm_head"]).total_bytes
    quantized_vision = dataclasses.replace(s, model_type="not-in-table")
    fp8_all = estimate_weights(quantized_vision, F.FP8_DYNAMIC, ["lm_head"]).total_bytes
    assert fp8 - fp8_all == pytest.approx(s.vision_params * (2 - 1))


def test_unknown_architecture_keeps_the_users_list_and_is_named():
    s = shape_from_config(config("llama-3.1-8b") | {"model_type": "brand_new_arch"})
    v = one(s, H100)
    assert isinstance(v, PlanVariant)
    assert any("'brand_new_arch' is not in fewerbits' architecture table" in w for w in v.warnings)
    assert effective_ignore_entries(s, ["lm_head"]) == ("lm_head",)


@pytest.mark.parametrize("ignore", [("*",), ("lm_head", "re:.*_proj$"), ("re:model\\.layers\\..*",)])
def test_an_ignore_list_that_keeps_every_linear_is_refused(ignore):
    r = one(shape("llama-3.1-8b"), H100, ignore=ignore)
    assert isinstance(r, RejectedPool) and "nothing would be quantized" in r.reason


def test_format_none_with_everything_ignored_is_fine():
    v = one(shape("llama-3.1-8b"), H100, ignore=("*",), format=F.NONE)
    assert isinstance(v, PlanVariant)


def test_an_ignore_entry_matching_nothing_is_named():
    v = one(shape("qwen3-30b-a3b"), H100, ignore=("lm_head", "re:.*vision.*", "model.layers.3.mlp.experts.17.up_proj"))
    assert isinstance(v, PlanVariant)
    named = [w for w in v.warnings if "matches no layer" in w]
    assert len(named) == 1 and "'re:.*vision.*'" in named[0]


@pytest.mark.parametrize(("extra", "named"), [
    ({"quantization_config": "fp8"}, "'quantization_config' must be an object"),
    ({"sliding_window": "wide"}, "'sliding_window' must be an integer"),
    ({"sliding_window": True}, "'sliding_window' must be an integer"),
])
def test_malformed_new_fields_are_named(extra, named):
    from fewerbits_operator.planner.shape import ModelConfigError

    with pytest.raises(ModelConfigError, match=named):
        shape_from_config(config("llama-3.1-8b") | extra)
