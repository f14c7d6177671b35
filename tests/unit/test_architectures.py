"""The architecture table: what each model type keeps 16-bit, for the planner and the recipe alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fewerbits_api.architectures import (
    ARCHITECTURES,
    effective_ignore,
    first_bad_regex,
    matches,
    quantize_blocker,
)
from fewerbits_api.formats import QuantFormat
from fewerbits_api.quantizedmodel import PlanVariant, RejectedPool
from fewerbits_operator.planner import PlanRequest, load_model_shape, plan_pool, pool_from_product
from fewerbits_quantjob.recipes import build_recipe_spec

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"
H100 = pool_from_product("NVIDIA-H100-80GB-HBM3", 8)


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize(("model_type", "module", "kept"), [
    ("mixtral", "model.layers.3.block_sparse_moe.gate", True),
    ("mixtral", "model.layers.3.mlp.gate", True),              # transformers 5's name for the router
    ("mixtral", "model.layers.3.mlp.experts.0.gate_proj", False),
    ("qwen3_moe", "model.layers.0.mlp.gate", True),
    ("qwen3_moe", "model.layers.0.mlp.gate_proj", False),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate", True),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert.gate_proj", False),
    ("deepseek_v3", "model.layers.5.mlp.gate", True),
    ("deepseek_v3", "model.layers.5.mlp.shared_experts.gate_proj", False),
    ("qwen2_vl", "model.visual.blocks.0.attn.qkv", True),
    ("qwen2_vl", "model.language_model.layers.0.self_attn.q_proj", False),
    ("gemma3", "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1", True),
    ("gemma3", "model.multi_modal_projector.linear", True),
    ("llava", "model.multi_modal_projector.linear_1", True),
    ("llama", "model.layers.0.mlp.gate_proj", False),
])
def test_the_table_keeps_routers_gates_and_vision_layers(model_type, module, kept):
    entries = effective_ignore({"model_type": model_type}, ["lm_head"]).entries
    assert any(matches(e, module) for e in entries) is kept


def test_deepseek_v3_mtp_layers_come_from_the_config():
    ei = effective_ignore({"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_nextn_predict_layers": 1},
                          ["lm_head"])
    assert any(matches(e, "model.layers.61.eh_proj") for e in ei.entries)
    assert not any(matches(e, "model.layers.60.self_attn.q_a_proj") for e in ei.entries)
    assert {r.what for r in ei.added} == {"router", "MTP layers"}


def test_the_users_entries_come_first_and_applying_twice_adds_nothing():
    cfg = {"model_type": "qwen3_moe"}
    once = effective_ignore(cfg, ["lm_head", "re:.*mlp\\.gate$"])
    assert once.entries[:2] == ("lm_head", "re:.*mlp\\.gate$")
    assert effective_ignore(cfg, once.entries).entries == once.entries


def test_an_unknown_model_type_keeps_the_users_list_with_a_warning_naming_it():
    ei = effective_ignore({"model_type": "zeta_moe"}, ["lm_head"])
    assert ei.entries == ("lm_head",) and ei.added == ()
    assert len(ei.warnings) == 1 and "'zeta_moe'" in ei.warnings[0]


def test_every_table_pattern_compiles():
    assert first_bad_regex(r.pattern for rules in ARCHITECTURES.values() for r in rules) is None
    assert first_bad_regex(["re:(unclosed"]) == ("re:(unclosed", first_bad_regex(["re:(unclosed"])[1])


def test_plain_names_match_exactly_or_as_a_trailing_component():
    assert matches("lm_head", "lm_head") and matches("lm_head", "model.lm_head")
    assert not matches("lm_head", "lm_head_2") and not matches("re:(", "anything")


def test_the_recipe_gets_the_same_list_as_the_planner():
    cfg = config("mixtral-8x7b")
    specs = build_recipe_spec(QuantFormat.FP8_DYNAMIC, ["lm_head"], model_config=cfg)
    assert specs[0].kwargs["ignore"] == list(effective_ignore(cfg, ["lm_head"]).entries)
    assert "re:.*block_sparse_moe\\.gate$" in specs[0].kwargs["ignore"]
    # Without the config the Job's contract list is used as it is (the operator may already have
    # made it effective).
    assert build_recipe_spec(QuantFormat.FP8_DYNAMIC, ["lm_head"])[0].kwargs["ignore"] == ["lm_head"]


@pytest.mark.parametrize("gpu, count, max_model_len", [
    ("NVIDIA-L4", 4, None),                   # the held-out case: Gemma-3 27B on L4
    ("NVIDIA-H100-80GB-HBM3", 1, 131_072),    # the held-out case: H100 at its full 128k context
])
def test_gemma3_vision_language_plans_a_quantized_format(gpu, count, max_model_len):
    """Issue 31: the Job saves Gemma-3's vision tower in the published layout
    (quantize.publish_layout) and vLLM's loader accepts it (scripts/vllm-check.sh), so Gemma-3 is
    no longer served 16-bit only: `auto` picks a quantized format, the vision tower kept 16-bit."""
    shape = load_model_shape(CONFIGS / "gemma-3-27b-it.json")
    assert quantize_blocker("gemma3") is None
    v = plan_pool(shape, pool_from_product(gpu, count), PlanRequest(max_model_len=max_model_len))
    assert isinstance(v, PlanVariant) and v.format is not QuantFormat.NONE, v
    assert max_model_len is None or v.maxModelLen == max_model_len
    assert any("vision_tower" in e for e in effective_ignore(config("gemma-3-27b-it"), ["lm_head"]).entries)


def test_an_architecture_format_pair_llm_compressor_cannot_make_is_refused_and_skipped_by_auto():
    shape = load_model_shape(CONFIGS / "deepseek-v2-lite.json")  # 16-bit MLA + MoE source
    shape = shape.__class__(**{**shape.__dict__, "model_type": "deepseek_v3"})
    assert quantize_blocker("deepseek_v3", "w4a16-awq") and quantize_blocker("deepseek_v3", "w4a16-gptq") is None
    a100 = pool_from_product("NVIDIA-A100-SXM4-80GB", 8)
    r = plan_pool(shape, a100, PlanRequest(format=QuantFormat.W4A16_AWQ))
    assert isinstance(r, RejectedPool) and "use w4a16-gptq" in r.reason
    v = plan_pool(shape, a100, PlanRequest())
    assert isinstance(v, PlanVariant) and v.format is not QuantFormat.W4A16_AWQ
