"""Model shapes from real config.json files, against the published parameter counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fewerbits_operator.planner.shape import ModelConfigError, load_model_shape, shape_from_config

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"


def shape(name):
    return load_model_shape(CONFIGS / f"{name}.json")


# Published totals (model cards / papers), in billions; MoE active counts where published.
@pytest.mark.parametrize(
    "name, total_b, active_b",
    [
        ("llama-3.1-8b", 8.03, None),
        ("llama-3.1-70b", 70.6, None),
        ("llama-3.2-1b", 1.24, None),
        ("qwen2.5-7b", 7.61, None),
        ("mistral-7b-instruct-v0.3", 7.25, None),
        ("gemma-2-9b", 9.24, None),
        ("gemma-3-27b-it", 27.4, None),  # 27.0B language model + ~0.4B SigLIP encoder
        ("mixtral-8x7b", 46.7, 12.9),
        ("qwen3-30b-a3b", 30.5, 3.3),
        ("deepseek-v2-lite", 15.7, None),
    ],
)
def test_parameter_counts_match_published_figures(name, total_b, active_b):
    s = shape(name)
    assert s.total_params / 1e9 == pytest.approx(total_b, rel=0.03)
    if active_b is not None:
        assert s.active_params / 1e9 == pytest.approx(active_b, rel=0.03)
    else:
        assert s.active_params <= s.total_params


def test_tiny_model_counts_exactly():
    s = shape("tiny-random-llama")
    hidden, inter, vocab, layers = 16, 64, 32000, 2
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    assert s.total_params == 2 * vocab * hidden + layers * per_layer + hidden
    assert s.head_dim == 4 and s.num_kv_heads == 4


def test_llama_geometry_and_kv_bytes():
    s = shape("llama-3.1-8b")
    assert (s.num_layers, s.num_attention_heads, s.num_kv_heads, s.head_dim) == (32, 32, 8, 128)
    assert (s.hidden_size, s.vocab_size, s.model_type) == (4096, 128256, "llama")
    assert s.architectures == ("LlamaForCausalLM",) and s.torch_dtype == "bfloat16"
    assert not s.tie_word_embeddings and s.lm_head_params == s.embed_params
    # docs/architecture.md: 2 × layers × kv_heads × head_dim × bytes = 2×32×8×128×2 = 128 KiB at 16 bits.
    assert s.kv_bytes_per_token(2) == 131072
    assert s.kv_bytes_per_token(1) == 65536
    # TP 2 splits the 8 KV heads; TP 16 would replicate (at least one head per GPU).
    assert s.kv_bytes_per_token_per_gpu(2, 2) == 65536
    assert s.kv_bytes_per_token_per_gpu(16, 2) == 2 * 32 * 1 * 128 * 2


def test_llama3_rope_scaling_does_not_extend_the_limit_again():
    s = shape("llama-3.1-8b")
    assert s.max_position_embeddings == 131072 and s.max_model_len == 131072


def test_rope_scaling_limit_follows_vllm_0_33():
    # YaRN: max_position_embeddings already is the scaled length (vLLM 0.33 no longer multiplies).
    assert shape("deepseek-v2-lite").max_model_len == 163840
    cfg = json.loads((CONFIGS / "qwen2.5-7b.json").read_text())
    cfg["max_position_embeddings"] = 32768
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert shape_from_config(cfg).max_model_len == 32768
    # Linear and dynamic scaling extend it by the factor.
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    assert shape_from_config(cfg).max_model_len == 65536
    # The smallest of the length keys vLLM reads wins.
    cfg["rope_scaling"] = None
    cfg["seq_length"] = 4096
    assert shape_from_config(cfg).max_model_len == 4096


def test_tied_embeddings_have_no_separate_lm_head():
    s = shape("llama-3.2-1b")
    assert s.tie_word_embeddings and s.lm_head_params == 0 and s.head_dim == 64


def test_gemma3_reads_nested_text_config_with_type_defaults():
    s = shape("gemma-3-27b-it")
    assert s.model_type == "gemma3" and s.text_model_type == "gemma3_text"
    assert (s.num_layers, s.num_attention_heads, s.num_kv_heads, s.head_dim) == (62, 32, 16, 128)
    assert s.vocab_size == 262208  # transformers' default: the text_config leaves it out
    assert s.max_model_len == 131072  # Gemma 3's 128K is already scaled: the factor is not applied
    assert s.tie_word_embeddings and s.vision_params > 0.3e9
    assert s.float16_unsupported


def test_gemma2_is_float16_unsupported_and_llama_is_not():
    assert shape("gemma-2-9b").float16_unsupported
    assert shape("gemma-2-9b").torch_dtype == "float32"
    assert not shape("llama-3.1-8b").float16_unsupported


def test_mixtral_experts():
    s = shape("mixtral-8x7b")
    assert s.is_moe and (s.num_experts, s.experts_per_token) == (8, 2)
    assert s.moe_intermediate_size == 14336  # Mixtral's experts use intermediate_size


def test_qwen3_moe_experts():
    s = shape("qwen3-30b-a3b")
    assert (s.num_experts, s.experts_per_token, s.moe_intermediate_size) == (128, 8, 768)
    assert s.max_model_len == 40960


def test_qwen2_moe_shared_expert_counts_as_always_active():
    cfg = {
        "model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
        "vocab_size": 151936, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    }
    s = shape_from_config(cfg)
    # Qwen1.5-MoE-A2.7B: 14.3B total, 2.7B active.
    assert s.total_params / 1e9 == pytest.approx(14.3, rel=0.03)
    assert s.active_params / 1e9 == pytest.approx(2.7, rel=0.05)


def test_deepseek_mla_caches_one_latent_per_token_per_layer():
    s = shape("deepseek-v2-lite")
    assert s.mla and s.num_experts == 64 and s.experts_per_token == 6
    # kv_lora_rank 512 + rope dim 64, one vector per layer, not split by TP.
    assert s.kv_bytes_per_token(2) == 27 * 576 * 2
    assert s.kv_bytes_per_token_per_gpu(4, 2) == s.kv_bytes_per_token(2)


def test_unknown_model_type_is_sized_llama_like_with_a_note():
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    cfg["model_type"] = "somethingnew"
    s = shape_from_config(cfg)
    assert s.total_params == shape("llama-3.1-8b").total_params
    assert any("somethingnew" in n for n in s.notes)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.pop("hidden_size"), "missing 'hidden_size'"),
        (lambda c: c.update(num_hidden_layers="many"), "'num_hidden_layers' must be an integer"),
        (lambda c: c.pop("intermediate_size"), "missing 'intermediate_size'"),
        (lambda c: c.update(num_local_experts=8), "num_experts_per_tok"),
    ],
)
def test_malformed_configs_name_the_field(mutate, message):
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    mutate(cfg)
    with pytest.raises(ModelConfigError, match=message):
        shape_from_config(cfg)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ModelConfigError, match="no such file"):
        load_model_shape(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_model_shape(tmp_path)  # a directory holding config.json
    bad.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="expected a JSON object"):
        load_model_shape(bad)
