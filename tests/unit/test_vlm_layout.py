"""Vision-language checkpoints the Job writes load in vLLM (issue 31 item 3): Gemma-3's published
tensor layout (`quantize.publish_layout`) and the transformers class that loads the whole model
(`quantize.model_class`). vLLM's loader itself judges the artifacts in scripts/vllm-check.sh.
Qwen2-VL and Qwen2.5-VL are not quantized at all: the planner refuses every quantized format for
them, with the reason (last test)."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fewerbits_quantjob import quantize


def _checkpoint(tmp_path, model_type: str, names: list[str], ignore: list[str]):
    save_file({n: torch.zeros(2, dtype=torch.bfloat16) for n in names}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type,
                                                      "quantization_config": {"ignore": ignore}}))


def test_gemma3_vision_tower_gets_the_published_names(tmp_path):
    names = ["vision_tower.embeddings.patch_embedding.weight", "vision_tower.encoder.layers.0.mlp.fc1.weight",
             "vision_tower.vision_model.post_layernorm.weight",  # already published: kept
             "language_model.model.layers.0.mlp.down_proj.weight_packed", "multi_modal_projector.mm_soft_emb_norm.weight"]
    _checkpoint(tmp_path, "gemma3", names, ["vision_tower.encoder.layers.0.mlp.fc1", "lm_head", "re:.*vision_tower\\..*"])
    assert quantize.publish_layout(tmp_path) == ["model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted([
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
            "vision_tower.vision_model.post_layernorm.weight",
            "language_model.model.layers.0.mlp.down_proj.weight_packed",
            "multi_modal_projector.mm_soft_emb_norm.weight"])
        assert f.metadata() == {"format": "pt"}
    ignore = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["vision_tower.encoder.layers.0.mlp.fc1", "lm_head", "re:.*vision_tower\\..*",
                      "vision_tower.vision_model.encoder.layers.0.mlp.fc1"]
    assert quantize.publish_layout(tmp_path) == []  # idempotent


def test_other_architectures_are_left_as_saved(tmp_path):
    _checkpoint(tmp_path, "qwen2_5_vl", ["visual.blocks.0.attn.qkv.weight", "model.layers.0.mlp.up_proj.weight"],
                ["visual.blocks.0.attn.qkv"])
    before = (tmp_path / "model.safetensors").read_bytes()
    assert quantize.publish_layout(tmp_path) == []
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_a_vision_language_model_causal_lm_does_not_map_loads_as_image_text_to_text(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for model_type, cls in (("qwen2_5_vl", AutoModelForImageTextToText), ("gemma3", AutoModelForCausalLM),
                            ("llama", AutoModelForCausalLM)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert quantize.model_class(tmp_path, trust_remote_code=False) is cls, model_type


def test_qwen_vl_is_refused_until_the_jobs_evaluation_can_reload_it():
    from fewerbits_api.architectures import quantize_blocker

    for model_type in ("qwen2_5_vl", "qwen2_vl"):
        why = quantize_blocker(model_type)
        # The cause, and the fix naming the field.
        assert why and "transformers 5.17" in why and "set spec.quantization.format to none" in why
    assert quantize_blocker("gemma3") is None
