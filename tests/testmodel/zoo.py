"""A zoo of tiny real architectures: random weights, the real module names and nesting.

Each model is built locally from a ``transformers`` config class (no Hub), small enough for CPU
tests, and keeps what makes its architecture different for quantization and for vLLM's loader:

| name | transformers class | what it exercises |
|---|---|---|
| llama | LlamaForCausalLM | the plain dense decoder |
| mistral | MistralForCausalLM | a sliding window on every layer (Mistral v0.1) |
| qwen2 | Qwen2ForCausalLM | q/k/v biases |
| gemma2 | Gemma2ForCausalLM | logit soft-capping, alternating sliding-window layers, tied embeddings |
| mixtral | MixtralForCausalLM | mixture of experts (router `mlp.gate`, fused experts) |
| qwen3_moe | Qwen3MoeForCausalLM | 128-expert MoE shape-reduced to 8, q/k norms |
| deepseek_v3 | DeepseekV3ForCausalLM | MLA (q/kv low rank), a dense first layer, routed + shared experts |
| deepseek_v3_fp8 | the same checkpoint, its Linear weights stored FP8 in 128×128 blocks with `weight_scale_inv`, as DeepSeek ships V3 (`quantization_config.quant_method: fp8`) |
| gemma3 | Gemma3ForConditionalGeneration | vision-language: SigLIP tower + projector around a Gemma-3 text model (5:1 local:global) |
| qwen2_5_vl | Qwen2_5_VLForConditionalGeneration | vision-language: windowed ViT + patch merger (`visual`) around a Qwen2 text model with M-RoPE |

Widths are multiples of 128 where a quantized Linear needs it (group-128 int4 inputs, FP8
128×128 blocks). The tokenizer is the test model's (tests.testmodel.build_tokenizer, 512
tokens), so every model's vocabulary is 512.

    from tests.testmodel.zoo import build_zoo_model, ZOO
    path = build_zoo_model("mixtral")      # cached, built on first use (seconds)

Cached under ``${FEWERBITS_CACHE:-~/.cache/fewerbits}/zoo/<name>-<hash>/``; the hash covers the
recipe and the torch/transformers versions. The existing tiny Llama (tests.testmodel) is separate
and unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

ZOO_VERSION = 1
VOCAB = 512
_H, _I, _HEADS, _KV, _HD = 256, 512, 4, 2, 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=_H, intermediate_size=_I, num_hidden_layers=2,
               num_attention_heads=_HEADS, num_key_value_heads=_KV, head_dim=_HD, max_position_embeddings=512,
               tie_word_embeddings=False)

ZOO: dict[str, dict[str, Any]] = {
    "llama": {"config": "LlamaConfig", "model": "LlamaForCausalLM", "kwargs": dict(_COMMON)},
    "mistral": {"config": "MistralConfig", "model": "MistralForCausalLM", "kwargs": {**_COMMON, "sliding_window": 64}},
    "qwen2": {"config": "Qwen2Config", "model": "Qwen2ForCausalLM",
              "kwargs": {**_COMMON, "use_sliding_window": False}},
    "gemma2": {"config": "Gemma2Config", "model": "Gemma2ForCausalLM",
               "kwargs": {**_COMMON, "tie_word_embeddings": True, "sliding_window": 64,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                          "query_pre_attn_scalar": _HD}},
    "mixtral": {"config": "MixtralConfig", "model": "MixtralForCausalLM",
                "kwargs": {**_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2}},
    # Qwen3-30B-A3B: 128 experts of moe_intermediate 768, 8 per token; reduced to 8 experts of 128.
    "qwen3_moe": {"config": "Qwen3MoeConfig", "model": "Qwen3MoeForCausalLM",
                  "kwargs": {**_COMMON, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                             "decoder_sparse_step": 1, "norm_topk_prob": True}},
    # DeepSeek-V3: first_k_dense_replace 3 of 61 layers, 256 routed + 1 shared expert, MLA with
    # q_lora 1536 / kv_lora 512 / rope 64; reduced keeping every kind of layer.
    "deepseek_v3": {"config": "DeepseekV3Config", "model": "DeepseekV3ForCausalLM",
                    "kwargs": {**{k: v for k, v in _COMMON.items() if k != "head_dim"}, "num_key_value_heads": _HEADS,
                               "moe_intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
                               "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                               "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
                               "v_head_dim": 64, "num_nextn_predict_layers": 1, "rope_scaling": None,
                               "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5}},
    "gemma3": {"config": "Gemma3Config", "model": "Gemma3ForConditionalGeneration",
               "kwargs": {"text_config": {**_COMMON, "num_hidden_layers": 2, "sliding_window": 64,
                                          "sliding_window_pattern": 2, "query_pre_attn_scalar": _HD},
                          "vision_config": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
                                            "num_attention_heads": 2, "image_size": 56, "patch_size": 14,
                                            "vision_use_head": False},
                          "mm_tokens_per_image": 4, "tie_word_embeddings": True},
               # transformers 5.17 saves the SigLIP tower as vision_tower.*; the published Gemma-3
               # checkpoints (and so the sources users quantize) name it vision_tower.vision_model.*
               "hub_renames": [["vision_tower.", "vision_tower.vision_model."]]},
    # Qwen2.5-VL-7B's shape reduced: a 2-block ViT (one windowed, one full-attention block), the
    # 2x2 patch merger out to the text width, and M-RoPE sections splitting the 64-wide head.
    "qwen2_5_vl": {"config": "Qwen2_5_VLConfig", "model": "Qwen2_5_VLForConditionalGeneration",
                   "kwargs": {"text_config": {**_COMMON, "rope_parameters": {
                                  "rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]}},
                              "vision_config": {"depth": 2, "hidden_size": 128, "intermediate_size": 256,
                                                "num_heads": 2, "out_hidden_size": _H, "patch_size": 14,
                                                "spatial_merge_size": 2, "temporal_patch_size": 2,
                                                "window_size": 112, "fullatt_block_indexes": [1]},
                              "tie_word_embeddings": False},
                   "token_ids": {"image_token_id": VOCAB - 1, "video_token_id": VOCAB - 2,
                                 "vision_start_token_id": VOCAB - 3, "vision_end_token_id": VOCAB - 4}},
}
"""name -> transformers config class, model class and config arguments."""

DERIVED = {"deepseek_v3_fp8": "deepseek_v3"}
"""Zoo entries made from another's checkpoint (name -> base name)."""

FP8_BLOCK = 128


def names() -> list[str]:
    return [*ZOO, *DERIVED]


def cache_root() -> Path:
    return Path(os.environ.get("FEWERBITS_CACHE") or Path.home() / ".cache" / "fewerbits") / "zoo"


def recipe_hash(name: str) -> str:
    import torch
    import transformers

    base = DERIVED.get(name, name)
    ident = {"zoo": ZOO_VERSION, "name": name, "recipe": ZOO[base], "fp8_block": FP8_BLOCK if name in DERIVED else None,
             "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def build_zoo_model(name: str) -> Path:
    """The cached directory of zoo model ``name`` (read-only for callers), built on first use."""
    if name not in ZOO and name not in DERIVED:
        raise KeyError(f"no zoo model {name!r} (have: {', '.join(names())})")
    cached = cache_root() / f"{name}-{recipe_hash(name)}"
    if (cached / "config.json").exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cached.name}.tmp.", dir=cached.parent))
    try:
        if name in DERIVED:
            _fp8_block_copy(build_zoo_model(DERIVED[name]), staging)
        else:
            _build(name, staging)
        try:
            os.rename(staging, cached)
        except OSError:
            if not (cached / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cached


def _build(name: str, out: Path) -> None:
    import torch
    import transformers

    from . import build_tokenizer

    spec = ZOO[name]
    torch.manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    tokenizer = build_tokenizer()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    kwargs = json.loads(json.dumps(spec["kwargs"]))
    if "text_config" in kwargs:
        kwargs["text_config"].update(ids)
        kwargs.update(spec.get("token_ids") or {"image_token_index": VOCAB - 1, "boi_token_index": VOCAB - 2,
                                                "eoi_token_index": VOCAB - 3})
    else:
        kwargs.update(ids)
    config = getattr(transformers, spec["config"])(**kwargs)
    model = getattr(transformers, spec["model"])(config)
    with torch.no_grad():
        for p in model.parameters():  # small weights keep bf16 activations and FP8 scales in range
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.eval()
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if spec.get("hub_renames"):
        _rename_tensors(out, spec["hub_renames"])
    (out / "fewerbits-zoo.json").write_text(json.dumps({"name": name, "recipe": spec, "zoo": ZOO_VERSION},
                                                       indent=2, sort_keys=True) + "\n")


def _rename_tensors(out: Path, renames: list[list[str]]) -> None:
    """Rewrite the checkpoint's tensor names to the published layout (prefix renames)."""
    from safetensors.torch import load_file, save_file

    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        renamed = {}
        for key, t in tensors.items():
            for old, new in renames:
                if key.startswith(old) and not key.startswith(new):
                    key = new + key[len(old):]
            renamed[key] = t
        save_file(renamed, f, metadata={"format": "pt"})


def _fp8_block_copy(src: Path, out: Path) -> None:
    """DeepSeek-V3's own checkpoint format: every Linear weight of the decoder as float8_e4m3fn
    with one float32 ``weight_scale_inv`` per 128×128 block (routers, norms, embeddings and the
    LM head stay bf16), and ``quantization_config`` {quant_method: fp8, weight_block_size}."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    quantized: dict[str, torch.Tensor] = {}
    for key, w in tensors.items():
        is_linear = (key.endswith("_proj.weight") or key.endswith("kv_a_proj_with_mqa.weight")) and w.dim() == 2
        if not is_linear or ".gate." in key:
            quantized[key] = w
            continue
        rows, cols = w.shape
        br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
        padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK, dtype=torch.float32)
        padded[:rows, :cols] = w.float()
        blocks = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK)
        amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = amax / fp8_max  # weight = fp8 * scale_inv
        q = (blocks / scale[:, None, :, None]).clamp(-fp8_max, fp8_max).view(br * FP8_BLOCK, bc * FP8_BLOCK)
        quantized[key] = q[:rows, :cols].to(torch.float8_e4m3fn).contiguous()
        quantized[key.removesuffix(".weight") + ".weight_scale_inv"] = scale.contiguous()
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for p in src.iterdir():
        if p.is_file() and p.suffix in (".json", ".jinja", ".txt") and p.name not in ("config.json",
                                                                                      "model.safetensors.index.json"):
            shutil.copy2(p, out / p.name)
