"""AWQ on a mixture of experts (issue 47): llm-compressor 0.14's AWQModifier keeps its cached inputs
in host memory by default for an MoE model (``offload_device`` = CPU), so the plan's GPU figure for
Mixtral AWQ leaves that cache out and the Job's host memory takes it in: every parent's inputs of
one decoder layer, every expert's down projection over every token included (oneshot calibrates
all experts on all tokens). A dense model keeps its cache on the GPU, unchanged. Which models
llm-compressor treats as MoE is checked against its own ``is_moe_model`` on the real configs, the
default against ``AWQModifier.on_initialize``, and the host figure against the bytes llm-compressor
caches when it quantizes the zoo's Mixtral and Qwen3-MoE on this CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fewerbits_api.formats import QuantFormat
from fewerbits_operator.planner import load_model_shape, pool_from_product
from fewerbits_operator.planner import jobsize
from fewerbits_operator.planner.jobsize import GIB, JobInputs, size_job

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"
H200 = pool_from_product("NVIDIA-H200", 8)
TOKENS = 512 * 2048  # the default calibration: 512 samples of 2048 tokens


def _sized(name: str, fmt: QuantFormat, inputs: JobInputs | None = None):
    job, why = size_job(load_model_shape(CONFIGS / name), fmt, [H200], inputs or JobInputs())
    assert job is not None, why
    return job


def test_mixtral_awq_counts_its_cached_inputs_in_host_memory_not_on_the_gpu():
    shape = load_model_shape(CONFIGS / "mixtral-8x7b.json")  # hidden 4096, 8 experts of 14336, GQA
    assert jobsize.awq_offloads_inputs(shape)
    assert jobsize.awq_gpu_bytes(shape, 512, 2048) == jobsize.AWQ_GPU_OUTPUTS * TOKENS * 4096 * 2  # 16 GiB, not 24
    # Attention and MoE block inputs, and 8 experts' down_proj inputs, each over all 1M tokens: 240 GiB.
    assert jobsize.awq_host_bytes(shape, 512, 2048) == TOKENS * (2 * 4096 + 8 * 14336) * 2 == 240 * GIB
    awq, gptq = _sized("mixtral-8x7b.json", QuantFormat.W4A16_AWQ), _sized("mixtral-8x7b.json", QuantFormat.W4A16_GPTQ)
    gpu_without_awq = jobsize.calibration_gpu_bytes(shape, QuantFormat.W4A16_AWQ, 0, 2048)
    assert awq.gpuMemoryGiB == round((gpu_without_awq + 16 * GIB) / GIB, 1)
    # The host figure carries the cache and its headroom (264 GiB, each figure rounded up) over the
    # same model's GPTQ Job; fewer samples shrink it in proportion.
    assert awq.memoryGiB - gptq.memoryGiB in (264, 265)
    fewer = _sized("mixtral-8x7b.json", QuantFormat.W4A16_AWQ, JobInputs(calibration_samples=64))
    assert fewer.memoryGiB < awq.memoryGiB - 200


def test_shared_experts_and_multi_head_attention_add_their_inputs():
    shape = load_model_shape(CONFIGS / "qwen3-30b-a3b.json")  # hidden 2048, 128 experts of 768, GQA
    assert jobsize.awq_host_bytes(shape, 1, 1) == (2 * 2048 + 128 * 768) * 2
    mha = shape.__class__(**{**shape.__dict__, "num_kv_heads": shape.num_attention_heads,
                             "shared_expert_intermediate_size": 512})
    assert jobsize.awq_host_bytes(mha, 1, 1) - jobsize.awq_host_bytes(shape, 1, 1) == \
        (shape.num_attention_heads * shape.head_dim + 512) * 2


def test_a_dense_models_awq_keeps_its_whole_cache_on_the_gpu():
    shape = load_model_shape(CONFIGS / "llama-3.1-8b.json")  # hidden 4096, as Mixtral-8x7B
    assert not jobsize.awq_offloads_inputs(shape) and jobsize.awq_host_bytes(shape, 512, 2048) == 0
    assert jobsize.awq_gpu_bytes(shape, 512, 2048) == 3.0 * TOKENS * 4096 * 2  # the H200's fitted 3 (24.2 GiB measured)
    awq, gptq = _sized("llama-3.1-8b.json", QuantFormat.W4A16_AWQ), _sized("llama-3.1-8b.json", QuantFormat.W4A16_GPTQ)
    assert awq.memoryGiB == gptq.memoryGiB  # nothing of AWQ's cache in host memory


def test_a_job_without_gpus_holds_awqs_whole_cache_in_host_memory():
    # Llama-3.1-8B: the calibration's peak (not the CPU evaluation's) sets the figure.
    awq = _sized("llama-3.1-8b.json", QuantFormat.W4A16_AWQ, JobInputs(gpus=0))
    gptq = _sized("llama-3.1-8b.json", QuantFormat.W4A16_GPTQ, JobInputs(gpus=0))
    assert awq.gpus == 0 and awq.memoryGiB - gptq.memoryGiB in (26, 27)  # 24 GiB and its headroom


@pytest.mark.quantize
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_the_host_figure_is_what_llm_compressor_caches(name):
    """Quantize the zoo's MoE model with the Job's AWQ recipe on this CPU and read, at the start of
    each layer's smoothing, the bytes of AWQ's cached inputs: the planner's figure for that model's
    shape (its config.json), within 5% (the attention's rotary terms are left out)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.transform.awq import base as awq_base

    from fewerbits_quantjob import quantize, recipes
    from fewerbits_quantjob.textdata import TextSet
    from tests.testmodel.zoo import build_zoo_model

    path = build_zoo_model(name)
    model, tokenizer = quantize.load_for_quantization(path, trust_remote_code=False)
    texts = ["Rivers carve valleys as rain gathers in channels that deepen over the years. " * 4] * 8
    samples = quantize.calibration_samples(TextSet(texts=texts, source="t", sha256="0"), tokenizer, 64)
    seen: list[tuple[float, str]] = []
    smoothing = awq_base.AWQModifier._apply_smoothing

    def measured(self, model):
        held = sum(v.value.numel() * v.value.element_size()
                   for cache in self._parent_args_cache.values() for batch in cache.batch_intermediates
                   for v in batch.values() if isinstance(getattr(v, "value", None), torch.Tensor))
        seen.append((held, str(self.offload_device)))
        return smoothing(self, model)

    awq_base.AWQModifier._apply_smoothing = measured
    try:
        specs = recipes.build_recipe_spec(QuantFormat.W4A16_AWQ, ["lm_head"], model_config=model.config.to_dict())
        quantize.run_oneshot(model, tokenizer, QuantFormat.W4A16_AWQ, specs, samples, 64)
    finally:
        awq_base.AWQModifier._apply_smoothing = smoothing
    per_layer = max(held for held, _ in seen)
    planned = jobsize.awq_host_bytes(load_model_shape(path), samples.count, 1) * (samples.tokens / samples.count)
    assert {device for _, device in seen} == {"cpu"}  # offloaded: an MoE model
    assert abs(per_layer / planned - 1) < 0.05, (per_layer, planned)


def test_no_pool_reason_counts_only_what_stays_on_the_gpu():
    l40s = pool_from_product("NVIDIA-L40S", 1)
    shape = load_model_shape(CONFIGS / "mixtral-8x7b.json")
    job, why = size_job(shape, QuantFormat.W4A16_AWQ, [l40s], JobInputs(calibration_samples=4096))
    assert job is None and "128.0 GiB for 4096 samples × 2048 tokens × hidden 4096, its inputs kept in host memory" in why


MODEL_TYPES = ["mixtral-8x7b.json", "qwen3-30b-a3b.json", "deepseek-v3.json", "deepseek-v2-lite.json",
               "llama-3.1-8b.json", "qwen2.5-7b.json", "gemma-2-9b.json", "mistral-7b-v0.1.json"]


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_the_planners_moe_is_llm_compressors(name):
    """``awq_offloads_inputs`` against llm-compressor's own rule, on the transformers config of the
    real model (a module carrying it: the rule reads the config's attribute names)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from llmcompressor.modifiers.utils.pytorch_helpers import is_moe_model

    raw = json.loads((CONFIGS / name).read_text())
    raw.pop("quantization_config", None)
    module = torch.nn.Module()
    module.config = transformers.AutoConfig.for_model(**raw)
    assert is_moe_model(module) == jobsize.awq_offloads_inputs(load_model_shape(CONFIGS / name))


def test_awq_offloads_to_the_cpu_by_default_for_moe_only():
    """The default the sizing relies on: the Job's recipe gives ``AWQModifier`` no
    ``offload_device`` (fewerbits_quantjob.recipes), so llm-compressor chooses it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from llmcompressor.core import State
    from llmcompressor.modifiers.transform import AWQModifier

    from fewerbits_quantjob.recipes import build_recipe_spec

    (awq, _) = build_recipe_spec(QuantFormat.W4A16_AWQ, ["lm_head"])
    assert awq.kind == "AWQModifier" and "offload_device" not in awq.kwargs
    for config, device in ((transformers.MixtralConfig(), torch.device("cpu")), (transformers.LlamaConfig(), None)):
        module = torch.nn.Module()
        module.config = config
        modifier = AWQModifier(mappings=[], **awq.kwargs)
        modifier.on_initialize(State(model=module))
        assert modifier.offload_device == device, type(config).__name__
