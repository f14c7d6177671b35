"""LoRA adapters in the plan (planner/lora.py): an adapter's config against the base, the bytes vLLM
preallocates for adapters, and how the planner narrows or refuses them per pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fewerbits_operator.planner import PlanRequest, plan, pool_from_product, shape_from_config
from fewerbits_operator.planner.lora import (
    AdapterConfigError,
    AdapterFacts,
    adapter_facts,
    lora_bytes_per_gpu,
    sizing,
    slot_candidates,
    vllm_rank,
)
from fewerbits_operator.planner.vllm_args import lora_args, plan_args

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"
LLAMA1B = shape_from_config(json.loads((CONFIGS / "llama-3.2-1b.json").read_text()), where="test")
MIXTRAL = shape_from_config(json.loads((CONFIGS / "mixtral-8x7b.json").read_text()), where="test")
H100 = pool_from_product("NVIDIA-H100-80GB-HBM3", 1)
FIELD = "spec.adapters[0].source"
PEFT = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "bias": "none", "modules_to_save": None, "use_dora": False,
        "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}


def facts(**over) -> AdapterFacts:
    return adapter_facts("plays", {**PEFT, **over}, LLAMA1B, FIELD)


def refusal(**over) -> str:
    with pytest.raises(AdapterConfigError) as e:
        facts(**over)
    assert str(e.value).startswith(f"{FIELD}: adapter_config.json")
    return str(e.value)


def test_a_peft_lora_config_gives_its_rank_and_modules():
    assert facts() == AdapterFacts("plays", 16, ("q_proj", "v_proj"))
    assert facts(rank_pattern={"model.layers.3.self_attn.q_proj": 64}).rank == 64
    assert facts(target_modules="all-linear").target_modules == (
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


@pytest.mark.parametrize("over, words", [
    ({"peft_type": "IA3"}, "IA3 adapter; vLLM serves LoRA adapters only"),
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "trains biases"),
    ({"r": 1024}, "rank 1024 is above 512"),
    ({"r": 0}, "positive integers"),
    ({"r": True}, "positive integers"),
    ({"target_modules": ["c_attn", "q_proj"]}, "target_modules c_attn name no linear layer of this llama base"),
    ({"target_modules": r".*\.(q|v)_proj"}, "is a pattern"),
    ({"target_modules": r"(.*)*x"}, "list them"),
    ({"rank_pattern": ["q_proj", 64]}, "rank_pattern must be an object"),
    ({"layers_to_transform": ["a"]}, "layers_to_transform must be layer numbers"),
    ({"target_modules": []}, "must be a list of module names or a pattern"),
    ({"layers_to_transform": [0, 16]}, "layers_to_transform [16] are not layers of this base (16 layers)"),
])
def test_what_vllm_would_refuse_or_the_base_lacks_is_refused_naming_the_field(over, words):
    assert words in refusal(**over)


def test_the_refusal_of_another_architectures_modules_lists_the_bases_own():
    assert "its layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in refusal(target_modules=["c_fc"])


def test_ranks_round_up_to_what_vllm_accepts():
    assert [vllm_rank(r) for r in (1, 2, 8, 9, 300, 320, 321, 512, 513)] == [1, 8, 8, 16, 320, 320, 512, 512, None]
    assert slot_candidates(6) == [6, 3, 1] and slot_candidates(8) == [8, 4, 2, 1] and slot_candidates(1) == [1]


def test_buffer_bytes_are_rank_times_every_adaptable_layers_widths():
    # Llama-3.2-1B: per layer q 2048+2048, k and v 2048+512, o 2048+2048, gate and up 2048+8192, down
    # 8192+2048 = 44,032; 16 layers; bf16. Tensor parallel 2 splits q/k/v/gate/up's output, o/down's input.
    one = sizing((AdapterFacts("a", 16, ("q_proj",)),))
    assert lora_bytes_per_gpu(LLAMA1B, one, 1) == 16 * 2 * 16 * 44_032
    per_layer_tp2 = (2048 + 1024) + 2 * (2048 + 256) + (1024 + 2048) + 2 * (2048 + 4096) + (4096 + 2048)
    assert lora_bytes_per_gpu(LLAMA1B, one, 2) == 16 * 2 * 16 * per_layer_tp2
    four = sizing(tuple(AdapterFacts(f"a{i}", 8, ("q_proj",)) for i in range(3)) + (AdapterFacts("b", 9, ("q_proj",)),))
    assert (four.slots, four.rank, four.cpu_slots) == (4, 16, 4)
    assert lora_bytes_per_gpu(LLAMA1B, four, 1) == 4 * lora_bytes_per_gpu(LLAMA1B, one, 1)
    assert lora_bytes_per_gpu(LLAMA1B, one, 1, nodes=2) == lora_bytes_per_gpu(LLAMA1B, one, 1) / 2
    assert lora_bytes_per_gpu(LLAMA1B, None, 1) == 0


def test_every_expert_gets_buffers():
    one = sizing((AdapterFacts("a", 8, ("q_proj",)),))
    # Mixtral: 32 layers; attention 4096 wide, 8 KV heads of 128; 8 experts of 14336.
    attention = (4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096)
    experts = 8 * (2 * (4096 + 14336) + (14336 + 4096))
    assert lora_bytes_per_gpu(MIXTRAL, one, 1) == 8 * 2 * 32 * (attention + experts)


def request(n: int, rank: int, **over) -> PlanRequest:
    return PlanRequest(**{"max_model_len": 4096, **over},
                       adapters=tuple(AdapterFacts(f"a{i}", rank, ("q_proj",)) for i in range(n)))


def test_every_adapter_fits_and_the_flags_say_so():
    (v,) = plan(LLAMA1B, [H100], request(3, 16)).variants
    assert (v.lora.adapters, v.lora.maxLoras, v.lora.maxLoraRank, v.lora.maxCpuLoras) == (["a0", "a1", "a2"], 3, 16, 3)
    assert v.lora.gpuMemoryGiB == round(3 * 16 * 2 * 16 * 44_032 / 2**30, 3)
    assert lora_args(v.lora) == ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16", "--max-cpu-loras", "3"]
    assert "--enable-lora" not in plan_args(v, "m")  # no pod serves adapters yet: no pod pays for their buffers


def test_the_kv_cache_gives_up_what_the_buffers_take():
    (bare,) = plan(LLAMA1B, [H100], request(0, 8)).variants
    (with_lora,) = plan(LLAMA1B, [H100], request(32, 512)).variants
    assert bare.lora is None
    lost = (bare.kvCacheTokens - with_lora.kvCacheTokens) / bare.kvCacheTokens
    assert with_lora.format is bare.format and 0.2 < lost < 0.5  # 32 × 0.67 GiB of about 70 GiB of KV


def test_adapters_that_do_not_all_fit_are_narrowed_with_the_numbers():
    (v,) = plan(LLAMA1B, [H100], request(32, 512, min_concurrent_sequences=1024)).variants
    assert v.lora.maxLoras == 2 and v.lora.maxCpuLoras == 32
    assert any("--max-loras narrowed to 2 of 32 adapters" in w for w in v.warnings)


def test_adapters_that_do_not_fit_at_all_leave_the_base_served_alone_at_its_format():
    (bare,) = plan(LLAMA1B, [H100], request(0, 8, max_model_len=4208, min_concurrent_sequences=1024)).variants
    (v,) = plan(LLAMA1B, [H100], request(1, 512, max_model_len=4208, min_concurrent_sequences=1024)).variants
    assert v.format is bare.format and v.lora is None
    assert v.adaptersRefused.startswith("no adapter is served on this pool: the buffers of even one adapter at rank "
                                        "512 (0.67 GiB per GPU) do not fit beside fp8-dynamic weights")


def test_a_pool_that_cannot_serve_the_base_is_rejected_as_without_adapters():
    t4 = pool_from_product("Tesla-T4", 1)
    gemma = shape_from_config(json.loads((CONFIGS / "gemma-2-9b.json").read_text()), where="test")
    with_adapters = plan(gemma, [t4], request(2, 8))
    assert with_adapters == plan(gemma, [t4], request(0, 8))
    assert with_adapters.variants == [] and "float16" in with_adapters.rejected[0].reason
