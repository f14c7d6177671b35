"""The shape of a model, read from its Hugging Face ``config.json``.

Everything the planner needs to size a model without downloading its weights: parameter counts
(total and, for mixture-of-experts models, active per token), split into the buckets that
quantization treats differently, and the attention geometry that sizes the KV cache.

Parameter buckets (docs/architecture.md "Memory fit": weights ≈ params × bits/8 with ignored layers at
16 bits):

* ``linear_params`` — the decoder's Linear layers (attention projections, MLP, experts): what a
  quantization format compresses.
* ``embed_params`` — the input embedding (an nn.Embedding: never quantized by llm-compressor).
* ``lm_head_params`` — the LM head when it is not tied to the embedding (0 when tied: the head
  then reuses the embedding matrix, kept at 16 bits).
* ``other_params`` — norms, biases and MoE routers: always 16 bits (routers stay unquantized in
  vLLM and in llm-compressor's recipes).
* ``vision_params`` — a multimodal model's vision encoder and projector (an estimate; left at
  16 bits, as llm-compressor's multimodal recipes ignore them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fewerbits_api.formats import QuantFormat


KV_BLOCK_TOKENS = 16
"""vLLM's default KV-cache block size on CUDA (tokens per block)."""


class ModelConfigError(ValueError):
    """A config.json the planner cannot read; the message names the file or field."""


# Defaults that transformers' config classes apply when config.json leaves a field out (the
# Gemma 3 text_config, for one, carries neither vocab_size nor max_position_embeddings).
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"tie_word_embeddings": True, "head_dim": 256, "max_position_embeddings": 8192},
    "gemma2": {"tie_word_embeddings": True, "head_dim": 256, "max_position_embeddings": 8192},
    "gemma3_text": {
        "tie_word_embeddings": True,
        "head_dim": 256,
        "vocab_size": 262_208,
        "max_position_embeddings": 131_072,
        "num_key_value_heads": 4,
    },
    "llama": {"tie_word_embeddings": False, "max_position_embeddings": 2048},
    "mistral": {"tie_word_embeddings": False, "max_position_embeddings": 32768},
    "mixtral": {"tie_word_embeddings": False, "max_position_embeddings": 32768},
    "qwen2": {"tie_word_embeddings": False, "max_position_embeddings": 32768},
    "qwen3": {"tie_word_embeddings": False, "max_position_embeddings": 32768},
    "qwen2_moe": {"tie_word_embeddings": False, "max_position_embeddings": 32768},
    "qwen3_moe": {"tie_word_embeddings": False, "max_position_embeddings": 32768},
    "deepseek_v2": {"tie_word_embeddings": False},
    "deepseek_v3": {"tie_word_embeddings": False},
}
# transformers' PretrainedConfig default when neither config.json nor the type says otherwise.
_TIE_DEFAULT = False

# Models with q/k/v projection biases although their config does not say so.
_QKV_BIAS_TYPES = {"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"}
# Models whose attention applies RMSNorm to q and k per head (two head_dim vectors a layer).
_QK_NORM_TYPES = {"qwen3", "qwen3_moe", "gemma3_text", "gemma3"}
# Norms per decoder layer (Gemma 2/3 norm both before and after attention and MLP).
_NORMS_PER_LAYER = {"gemma2": 4, "gemma3_text": 4, "gemma3": 4}

# Keys vLLM reads for the model's length limit (vllm/config/model.py, _get_and_verify_max_len);
# the smallest present wins.
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)

_ROPE_ALREADY_SCALED = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")

FLOAT16_UNSUPPORTED_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})
"""Architectures vLLM refuses to run in float16 (vllm/config/model.py _FLOAT16_NOT_SUPPORTED_MODELS:
numerical instability); they need bfloat16, i.e. compute capability 8.0 or newer (docs/architecture.md:
gemma2/3 reject float16)."""


@dataclass(frozen=True)
class LinearGroup:
    """Linear layers the recipe treats alike, named by one representative module (as transformers
    names it, which is what llm-compressor's ``ignore`` matches): one group per projection per
    decoder layer; the routed experts of a layer are one group named by expert 0."""

    name: str
    params: int
    active_params: int
    in_features: int = 0
    """Input width of one of the group's matrices (0: not one vLLM's LoRA adapts, the vision tower)."""
    out_features: int = 0
    """Output width of one of its matrices."""
    matrices: int = 1
    """How many matrices of that shape (the routed experts of a layer: one per expert)."""
    row_parallel: bool = False
    """Split along its input under tensor parallelism (o_proj, down_proj); else along its output."""


@dataclass(frozen=True)
class SourceQuantization:
    """The ``quantization_config`` a source checkpoint already carries."""

    method: str
    """``quant_method`` as written (``fp8``, ``compressed-tensors``, ``awq``, ``gptq``...)."""
    format: "QuantFormat | None"
    """The fewerbits format the checkpoint already is, or None when it is none of them."""
    detail: str
    """What was read, for messages (``quant_method fp8, weight_block_size [128, 128]``)."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only model's size and attention geometry (see the module docstring)."""

    model_type: str
    """``model_type`` of the top-level config (``gemma3`` for Gemma 3, not ``gemma3_text``)."""
    text_model_type: str
    """``model_type`` of the language model (the nested ``text_config`` when there is one)."""
    architectures: tuple[str, ...]
    torch_dtype: str | None
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    """KV heads of the cache (1 for multi-head latent attention: one latent vector per token)."""
    head_dim: int
    vocab_size: int
    intermediate_size: int
    max_position_embeddings: int
    max_model_len: int
    """The longest sequence the model supports: max_position_embeddings, extended by RoPE scaling
    where vLLM extends it."""
    tie_word_embeddings: bool
    embed_params: int
    lm_head_params: int
    linear_params: int
    linear_active_params: int
    other_params: int
    vision_params: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    """The shared experts' intermediate width, all of them together (Qwen-MoE, DeepSeek; 0: none)."""
    kv_head_dim: int = 0
    """Elements per KV head per token per K or V (head_dim; the latent width for MLA)."""
    kv_tensors: int = 2
    """2 (K and V) for ordinary attention; 1 for MLA, which caches one latent vector."""
    mla: bool = False
    rope_scaling: Mapping[str, Any] | None = None
    notes: tuple[str, ...] = ()
    sliding_window: int = 0
    """Tokens a sliding-window attention layer attends to (0: none)."""
    sliding_layers: int = 0
    """Decoder layers with sliding-window attention (the rest attend to the full context)."""
    linear_groups: tuple[LinearGroup, ...] = ()
    """The Linear layers of ``linear_params`` (plus the vision encoder's, as one group per kind),
    for sizing what an ignore list keeps at 16 bits."""
    num_nextn_predict_layers: int = 0
    """DeepSeek-V3's multi-token-prediction layers (not served; kept 16-bit by the recipe)."""
    source_quantization: SourceQuantization | None = None
    """Set when config.json carries a ``quantization_config``: the source is already quantized."""

    @property
    def arch_config(self) -> dict[str, Any]:
        """The config.json keys the architecture table reads (fewerbits_api.architectures)."""
        return {"model_type": self.model_type, "num_hidden_layers": self.num_layers,
                "num_nextn_predict_layers": self.num_nextn_predict_layers}

    @property
    def total_params(self) -> int:
        return self.embed_params + self.lm_head_params + self.linear_params + self.other_params + self.vision_params

    @property
    def active_params(self) -> int:
        """Parameters used per token (all of them for a dense model; the routed experts'
        share for a mixture of experts)."""
        return self.embed_params + self.lm_head_params + self.linear_active_params + self.other_params

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def float16_unsupported(self) -> bool:
        return self.model_type in FLOAT16_UNSUPPORTED_TYPES or self.text_model_type in FLOAT16_UNSUPPORTED_TYPES

    def kv_bytes_per_token_per_gpu(self, tensor_parallel: int, kv_bytes: float) -> float:
        """KV-cache bytes one token takes on each GPU of a replica.

        docs/architecture.md: KV bytes per token = 2 × layers × kv_heads × head_dim × bytes(kv dtype).
        Under tensor parallelism vLLM splits the KV heads across GPUs, and replicates them when
        there are fewer KV heads than GPUs (so each GPU holds at least one); MLA's single
        latent is replicated on every GPU.
        """
        heads_per_gpu = 1 if self.mla else math.ceil(self.num_kv_heads / tensor_parallel)
        return self.kv_tensors * self.num_layers * heads_per_gpu * self.kv_head_dim * kv_bytes

    def kv_bytes_per_sequence_per_gpu(self, tensor_parallel: int, kv_bytes: float, length: int,
                                      in_flight_tokens: int = 0) -> float:
        """KV-cache bytes one sequence of ``length`` tokens takes on each GPU, the way vLLM 0.33's
        hybrid KV-cache manager allocates it: a full-attention layer holds every token; a
        sliding-window layer holds ``min(window - 1 + in_flight_tokens, length)`` tokens plus one
        block (vllm/v1/kv_cache_interface.py, SlidingWindowSpec.max_admission_blocks_per_request;
        ``in_flight_tokens`` is VllmConfig.max_in_flight_tokens). Block rounding of the
        full layers and the padding of KV-cache groups are left out."""
        per_layer_token = self.kv_bytes_per_token_per_gpu(tensor_parallel, kv_bytes) / self.num_layers
        full = self.num_layers - self.sliding_layers
        tokens = full * length
        if self.sliding_layers:
            held = min(self.sliding_window - 1 + in_flight_tokens, length) + KV_BLOCK_TOKENS
            tokens += self.sliding_layers * min(held, length + KV_BLOCK_TOKENS)
        return per_layer_token * tokens

    def kv_bytes_per_token(self, kv_bytes: float) -> float:
        """KV-cache bytes one token takes in the whole replica (TP 1)."""
        return self.kv_bytes_per_token_per_gpu(1, kv_bytes)


def _get(cfg: Mapping[str, Any], key: str, model_type: str, default: Any = None) -> Any:
    value = cfg.get(key)
    if value is None:
        value = _TYPE_DEFAULTS.get(model_type, {}).get(key, default)
    return value


# A config.json comes from whoever publishes the model: every number is checked to be a finite
# integer in a plausible range before any arithmetic, so a hostile or broken file is a
# ModelConfigError naming the field, never an OverflowError, a ZeroDivisionError or a loop over
# 10^12 layers in the operator.
MAX_CONFIG_INT = 2**31 - 1
"""Largest width, vocabulary, expert count or length the planner accepts (int32, as vLLM's
configs are)."""
MAX_LAYERS = 10_000
"""More decoder layers than any published model has by two orders of magnitude."""


def _as_int(value: Any, key: str, where: str, minimum: int = 0, maximum: int = MAX_CONFIG_INT) -> int:
    # bool is an int in Python; `true` for a width is a broken file, not 1.
    if isinstance(value, bool):
        raise ModelConfigError(f"{where}: {key!r} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ModelConfigError(f"{where}: {key!r} must be an integer, got {value!r}")
        value = int(value)
    elif isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ModelConfigError(f"{where}: {key!r} must be an integer, got {value[:64]!r}") from None
    elif not isinstance(value, int):
        raise ModelConfigError(f"{where}: {key!r} must be an integer, got {type(value).__name__}")
    if value < minimum or value > maximum:
        raise ModelConfigError(f"{where}: {key!r} must be between {minimum} and {maximum:,}, got {value:,}"
                               if value.bit_length() < 256 else
                               f"{where}: {key!r} must be between {minimum} and {maximum:,}, got a {value.bit_length()}-bit number")
    return value


def _req_int(cfg: Mapping[str, Any], key: str, model_type: str, where: str, maximum: int = MAX_CONFIG_INT) -> int:
    value = _get(cfg, key, model_type)
    if value is None:
        raise ModelConfigError(f"{where}: missing {key!r}, which the planner needs to size the model")
    n = _as_int(value, key, where, maximum=maximum)
    if n <= 0:
        raise ModelConfigError(f"{where}: {key!r} must be positive, got {value!r}")
    return n


def _opt_int(cfg: Mapping[str, Any], key: str, default: int = 0, where: str = "config.json") -> int:
    value = cfg.get(key)
    if value is None:
        return default
    return _as_int(value, key, where)


def _opt_float(cfg: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ModelConfigError(f"{where}: {key!r} must be a number, got {type(value).__name__}")
    try:
        f = float(value)
    except (ValueError, OverflowError):
        raise ModelConfigError(f"{where}: {key!r} must be a number, got {str(value)[:64]!r}") from None
    if not math.isfinite(f) or f <= 0:
        raise ModelConfigError(f"{where}: {key!r} must be a positive finite number, got {str(value)[:64]}")
    return f


def _rope_scaling(cfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    # transformers 5 writes `rope_parameters`; older configs `rope_scaling` (with `type` or
    # `rope_type`).
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if isinstance(value, Mapping) and value:
            return value
    return None


def _derived_max_len(cfg: Mapping[str, Any], model_type: str, rope: Mapping[str, Any] | None,
                     where: str = "config.json") -> tuple[int, int]:
    """(max_position_embeddings, the model's length limit), the way vLLM derives it."""
    found = []
    for k in _MAX_LEN_KEYS:
        value = cfg.get(k)
        # vLLM skips keys that are absent or not positive numbers; a number it would read must
        # be a plausible integer here.
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(_as_int(value, k, where))
    default = _TYPE_DEFAULTS.get(model_type, {}).get("max_position_embeddings")
    if not found and default:
        found = [int(default)]
    if not found:
        raise ModelConfigError(f"{where}: missing 'max_position_embeddings' (the model's length limit)")
    max_pos = min(found)
    derived = float(max_pos)
    # vLLM 0.33 (vllm/config/model.py, _get_and_verify_max_len) multiplies by the RoPE scaling
    # factor except for types whose max_position_embeddings already is the scaled length
    # (su/longrope/llama3 and the YaRN variants), and never for Gemma 3 (its 128K is already
    # scaled).
    if rope and "gemma3" not in model_type:
        rope_type = str(rope.get("rope_type") or rope.get("type") or "default")
        if rope_type not in _ROPE_ALREADY_SCALED:
            derived *= _opt_float(rope, "factor", 1.0, f"{where}: rope_scaling")
    if derived > MAX_CONFIG_INT:
        raise ModelConfigError(f"{where}: max_position_embeddings {max_pos:,} scaled by rope_scaling.factor gives "
                               f"{derived:.3g} tokens, more than {MAX_CONFIG_INT:,}")
    return max_pos, max(1, int(derived))


def _vision_params(cfg: Mapping[str, Any], text_hidden: int, where: str = "config.json") -> int:
    """A ViT-style encoder's parameters from its vision_config (an estimate: 4h² attention +
    2·h·i MLP per layer, patch and position embeddings, and a projector to the text width)."""
    vc = cfg.get("vision_config")
    if not isinstance(vc, Mapping):
        return 0
    w = f"{where}: vision_config"
    h = _opt_int(vc, "hidden_size", where=w)
    i = _opt_int(vc, "intermediate_size", 4 * h, where=w)
    layers = _opt_int(vc, "num_hidden_layers", where=w) or _opt_int(vc, "depth", where=w)
    if not h or not layers:
        return 0
    if layers > MAX_LAYERS:
        raise ModelConfigError(f"{w}: 'num_hidden_layers' must be at most {MAX_LAYERS:,}, got {layers:,}")
    patch = _opt_int(vc, "patch_size", 14, where=w)
    image = _opt_int(vc, "image_size", 224, where=w)
    channels = _opt_int(vc, "num_channels", 3, where=w)
    per_layer = 4 * h * h + 2 * h * i + 4 * h + 2 * h + i + 4 * h  # weights, biases, 2 norms
    embeddings = channels * patch * patch * h + (image // max(patch, 1)) ** 2 * h
    projector = h * text_hidden
    return layers * per_layer + embeddings + projector

# Vision-language models whose config.json is flat (text fields at the top, a vision_config beside
# them); transformers still nests the language model under model.language_model.
_VL_FLAT_TYPES = {"qwen2_vl", "qwen2_5_vl"}
# One representative Linear of each vision encoder, as transformers names it.
_VISION_NAMES = {
    "qwen2_vl": "model.visual.blocks.0.attn.qkv",
    "qwen2_5_vl": "model.visual.blocks.0.attn.qkv",
    "llava": "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
    "llava_next": "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
    "gemma3": "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
    "mistral3": "model.vision_tower.transformer.layers.0.attention.q_proj",
}


def _sliding(cfg: Mapping[str, Any], text_type: str, layers: int, where: str) -> tuple[int, int]:
    """(window, number of sliding-window layers), as vLLM 0.33 builds the attention layers.

    vLLM reads transformers' ``layer_types`` when the config has it (Gemma-2/3, newer Qwen and
    Mistral configs; transformers fills it in for Gemma-2: every other layer from layer 0, and
    Gemma-3: all but every ``sliding_window_pattern``-th, default 6). Without ``layer_types`` a
    ``sliding_window`` applies to every layer (vLLM's cache_config.sliding_window: Mistral v0.1).
    Qwen2/3 configs carry a ``sliding_window`` that is off unless ``use_sliding_window`` is true.
    """
    raw = cfg.get("sliding_window")
    if raw is None or raw is False:
        return 0, 0
    window = _as_int(raw, "sliding_window", where)
    if window <= 0:
        return 0, 0  # vLLM: 0 means no sliding window
    types = cfg.get("layer_types")
    if isinstance(types, (list, tuple)) and types:
        n = sum(1 for t in list(types)[:layers] if t == "sliding_attention")
    elif text_type == "gemma2":
        n = (layers + 1) // 2
    elif text_type in ("gemma3_text", "gemma3"):
        pattern = _opt_int(cfg, "sliding_window_pattern", 6, where=where) or 6
        n = sum(1 for i in range(layers) if (i + 1) % pattern)
    elif text_type.startswith("qwen") and not cfg.get("use_sliding_window"):
        n = 0
    else:
        n = layers
    return (window, n) if n else (0, 0)


# quant_method values vLLM knows that are none of fewerbits' formats: refused with their name and
# what to do, like an unknown method.
def source_quantization(config: Mapping[str, Any], where: str = "config.json") -> SourceQuantization | None:
    """What the source's ``quantization_config`` says it already is (None: not quantized)."""
    qc = config.get("quantization_config")
    if qc is None:
        text = config.get("text_config")
        qc = text.get("quantization_config") if isinstance(text, Mapping) else None
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ModelConfigError(f"{where}: 'quantization_config' must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method") or "(none)")[:64]
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            return SourceQuantization(method, QuantFormat.FP8_BLOCK,
                                      f"quant_method fp8, weight_block_size {list(block)[:4]}")
        return SourceQuantization(method, QuantFormat.FP8_DYNAMIC,
                                  f"quant_method fp8, activation_scheme {qc.get('activation_scheme', 'dynamic')}")
    if method == "compressed-tensors":
        fmt, detail = _compressed_tensors_format(qc)
        return SourceQuantization(method, fmt, detail)
    if method in ("awq", "gptq") and qc.get("bits") == 4:
        fmt = QuantFormat.W4A16_AWQ if method == "awq" else QuantFormat.W4A16_GPTQ
        return SourceQuantization(method, fmt, f"quant_method {method}, bits 4, group_size {qc.get('group_size')}")
    return SourceQuantization(method, None, f"quant_method {method}")


def _compressed_tensors_format(qc: Mapping[str, Any]) -> tuple[QuantFormat | None, str]:
    groups = qc.get("config_groups")
    fmt_name = str(qc.get("format") or "")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        return None, f"quant_method compressed-tensors, format {fmt_name or '?'}, {len(groups or {})} config groups"
    (group,) = groups.values()
    w = group.get("weights") or {} if isinstance(group, Mapping) else {}
    a = group.get("input_activations") if isinstance(group, Mapping) else None
    wb, wt, ws = w.get("num_bits"), w.get("type"), w.get("strategy")
    detail = (f"quant_method compressed-tensors, format {fmt_name}, weights {wt} {wb}-bit {ws}"
              + (f", activations {a.get('type')} {a.get('num_bits')}-bit" if isinstance(a, Mapping) else ""))
    a_bits = a.get("num_bits") if isinstance(a, Mapping) else None
    a_type = a.get("type") if isinstance(a, Mapping) else None
    if wt == "float" and wb == 8 and a_type == "float" and a_bits == 8:
        return (QuantFormat.FP8_BLOCK if ws == "block" else QuantFormat.FP8_DYNAMIC), detail
    if wt == "float" and wb == 4:
        return (QuantFormat.NVFP4 if a_bits == 4 else QuantFormat.NVFP4A16), detail
    if wt == "int" and wb == 4 and a is None:
        return (QuantFormat.W4A16_GPTQ if w.get("symmetric", True) else QuantFormat.W4A16_AWQ), detail
    if wt == "int" and wb == 4 and a_type == "float" and a_bits == 8:
        return QuantFormat.W4AFP8, detail
    if wt == "int" and wb == 8 and a_type == "int" and a_bits == 8:
        return QuantFormat.W8A8_INT8, detail
    return None, detail


@dataclass(frozen=True)
class _Identity:
    """What the config says the model is, and which mapping holds its language model."""

    model_type: str
    architectures: tuple[str, ...]
    cfg: Mapping[str, Any]
    """The language model's settings: ``text_config`` when nested (Gemma-3, VL), else the config."""
    nested: bool
    text_type: str
    notes: tuple[str, ...]


def _identity(config: Mapping[str, Any], where: str) -> _Identity:
    if not isinstance(config, Mapping):
        raise ModelConfigError(f"{where}: expected a JSON object")
    # Truncated: it is echoed in plan warnings, and the file is not ours.
    model_type = str(config.get("model_type") or "")[:128]
    archs = config.get("architectures") or ()
    if not isinstance(archs, (list, tuple)):
        raise ModelConfigError(f"{where}: 'architectures' must be a list, got {type(archs).__name__}")
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else None
    cfg: Mapping[str, Any] = text if text is not None else config
    text_type = str(cfg.get("model_type") or model_type)[:128]
    if text is not None and not text.get("model_type") and model_type == "gemma3":
        text_type = "gemma3_text"
    notes: list[str] = []
    if text_type not in set(_TYPE_DEFAULTS) | {"gemma3"}:
        notes.append(
            f"model_type {text_type or '(none)'!r} is not one the planner knows; "
            "sized as a Llama-like decoder (gated MLP), so the estimate may be off"
        )
    return _Identity(model_type, tuple(str(a) for a in archs), cfg, text is not None, text_type, tuple(notes))


@dataclass(frozen=True)
class _Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tie: bool


def _dims(config: Mapping[str, Any], ident: _Identity, where: str) -> _Dims:
    """The decoder's sizes, each checked and named when missing or malformed."""
    cfg, text_type = ident.cfg, ident.text_type
    defaults = _TYPE_DEFAULTS.get(text_type, {})
    hidden = _req_int(cfg, "hidden_size", text_type, where)
    layers = _req_int(cfg, "num_hidden_layers", text_type, where, maximum=MAX_LAYERS)
    heads = _req_int(cfg, "num_attention_heads", text_type, where)
    kv_heads = _opt_int(defaults | {k: v for k, v in cfg.items() if v is not None},
                        "num_key_value_heads", heads, where) or heads
    if kv_heads > heads:
        raise ModelConfigError(f"{where}: 'num_key_value_heads' ({kv_heads}) must not exceed "
                               f"'num_attention_heads' ({heads})")
    head_dim = _opt_int(cfg, "head_dim", where=where) or defaults.get("head_dim") or hidden // heads
    if head_dim < 1:
        raise ModelConfigError(f"{where}: 'num_attention_heads' ({heads}) exceeds 'hidden_size' ({hidden}) "
                               "and no 'head_dim' is given")
    vocab = _req_int(cfg, "vocab_size", text_type, where)
    intermediate = _opt_int(cfg, "intermediate_size", where=where)
    tie_value = config.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
    if tie_value is None:
        tie_value = defaults.get("tie_word_embeddings", _TIE_DEFAULT)
    return _Dims(hidden, layers, heads, kv_heads, head_dim, vocab, intermediate, bool(tie_value))


@dataclass(frozen=True)
class _Attention:
    projs: tuple[tuple[str, int, int], ...]
    """(projection name, input width, output width) of one layer's attention."""
    other_per_layer: int
    """Norms, biases and latent norms of one layer (parameters outside the linear layers)."""
    kv_cache_heads: int
    kv_head_dim: int
    kv_tensors: int
    head_dim: int
    mla: bool


def _attention(ident: _Identity, d: _Dims, where: str) -> _Attention:
    cfg, text_type, hidden, heads = ident.cfg, ident.text_type, d.hidden, d.heads
    other_per_layer = _NORMS_PER_LAYER.get(text_type, 2) * hidden
    if cfg.get("kv_lora_rank"):
        # DeepSeek multi-head latent attention: q (optionally through a low-rank q_lora), a joint
        # compressed kv latent plus a shared rope key, and its up-projection.
        q_lora = _opt_int(cfg, "q_lora_rank", where=where)
        kv_lora = _opt_int(cfg, "kv_lora_rank", where=where)
        nope = _opt_int(cfg, "qk_nope_head_dim", 128, where=where)
        rope_dim = _opt_int(cfg, "qk_rope_head_dim", 64, where=where)
        v_dim = _opt_int(cfg, "v_head_dim", 128, where=where)
        q_head = nope + rope_dim
        q_projs = ([("q_a_proj", hidden, q_lora), ("q_b_proj", q_lora, heads * q_head)] if q_lora
                   else [("q_proj", hidden, heads * q_head)])
        projs = q_projs + [("kv_a_proj_with_mqa", hidden, kv_lora + rope_dim),
                           ("kv_b_proj", kv_lora, heads * (nope + v_dim)), ("o_proj", heads * v_dim, hidden)]
        return _Attention(tuple(projs), other_per_layer + kv_lora + (q_lora or 0), 1, kv_lora + rope_dim, 1,
                          q_head, True)
    kv_heads, head_dim = d.kv_heads, d.head_dim
    projs = [("q_proj", hidden, heads * head_dim), ("k_proj", hidden, kv_heads * head_dim),
             ("v_proj", hidden, kv_heads * head_dim), ("o_proj", heads * head_dim, hidden)]
    if text_type in _QKV_BIAS_TYPES or cfg.get("attention_bias"):
        other_per_layer += (heads + 2 * kv_heads) * head_dim
    if text_type in _QK_NORM_TYPES:
        other_per_layer += 2 * head_dim
    return _Attention(tuple(projs), other_per_layer, kv_heads, head_dim, 2, head_dim, False)


@dataclass(frozen=True)
class _Experts:
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    sparse_step: int
    mlp_only: frozenset[int]
    first_dense: int
    moe_freq: int


def _experts(cfg: Mapping[str, Any], intermediate: int, where: str) -> _Experts:
    """The mixture-of-experts settings (Mixtral, Qwen-MoE, DeepSeek), or none (experts 0)."""
    experts = (_opt_int(cfg, "num_local_experts", where=where) or _opt_int(cfg, "num_experts", where=where)
               or _opt_int(cfg, "n_routed_experts", where=where))
    top_k = _opt_int(cfg, "num_experts_per_tok", where=where)
    moe_inter = _opt_int(cfg, "moe_intermediate_size", where=where) or (intermediate if experts else 0)
    shared_inter = _opt_int(cfg, "shared_expert_intermediate_size", where=where)
    n_shared = _opt_int(cfg, "n_shared_experts", where=where)
    if n_shared and not shared_inter:
        shared_inter = n_shared * moe_inter
    sparse_step = _opt_int(cfg, "decoder_sparse_step", 1, where=where) or 1
    mlp_only_raw = cfg.get("mlp_only_layers") or ()
    if not isinstance(mlp_only_raw, (list, tuple)):
        raise ModelConfigError(f"{where}: 'mlp_only_layers' must be a list of layer indices")
    mlp_only = frozenset(_as_int(i, "mlp_only_layers[]", where) for i in mlp_only_raw)
    first_dense = _opt_int(cfg, "first_k_dense_replace", where=where)
    moe_freq = _opt_int(cfg, "moe_layer_freq", 1, where=where) or 1
    if experts and not top_k:
        raise ModelConfigError(f"{where}: a mixture of experts needs 'num_experts_per_tok'")
    if not experts and not intermediate:
        raise ModelConfigError(f"{where}: missing 'intermediate_size', which the planner needs to size the MLP")
    return _Experts(experts, top_k, moe_inter, shared_inter, sparse_step, mlp_only, first_dense, moe_freq)


def _is_moe_layer(layer: int, text_type: str, e: _Experts) -> bool:
    if text_type.startswith("deepseek"):
        return e.experts > 0 and layer >= e.first_dense and layer % e.moe_freq == 0
    return e.experts > 0 and layer not in e.mlp_only and (layer + 1) % e.sparse_step == 0


def _layer_groups(ident: _Identity, d: _Dims, attn: _Attention, e: _Experts) -> tuple[list[LinearGroup], int]:
    """Every decoder layer's linear groups, named as transformers names the modules (what
    llm-compressor's ignore matches), and the parameters outside them."""
    text_type, hidden = ident.text_type, d.hidden
    prefix = ("model.language_model.layers" if ident.nested or ident.model_type in _VL_FLAT_TYPES
              else "model.layers")
    shared_name = "shared_experts" if text_type.startswith("deepseek") else "shared_expert"
    groups: list[LinearGroup] = []
    other = 0
    for layer in range(d.layers):
        at = f"{prefix}.{layer}"
        groups += [LinearGroup(f"{at}.self_attn.{proj}", i * o, i * o, i, o, 1, proj == "o_proj")
                   for proj, i, o in attn.projs]
        other += attn.other_per_layer
        if not _is_moe_layer(layer, text_type, e):
            groups += _mlp_groups(f"{at}.mlp", hidden, d.intermediate)
            continue
        per_proj = hidden * e.moe_inter  # each of gate, up and down projections of one expert
        groups += [LinearGroup(g.name, e.experts * per_proj, e.top_k * per_proj, g.in_features, g.out_features,
                               e.experts, g.row_parallel) for g in _mlp_groups(f"{at}.mlp.experts.0", hidden, e.moe_inter)]
        if e.shared_inter:
            groups += _mlp_groups(f"{at}.mlp.{shared_name}", hidden, e.shared_inter)
        other += hidden * e.experts  # the router
        if e.shared_inter and text_type.startswith("qwen"):
            other += hidden  # Qwen's shared-expert gate
    return groups, other + hidden  # + the final norm


def _mlp_groups(at: str, hidden: int, inter: int) -> list[LinearGroup]:
    """A gated MLP's three projections: gate and up widen, down narrows back (row-parallel)."""
    n = hidden * inter
    return [LinearGroup(f"{at}.gate_proj", n, n, hidden, inter), LinearGroup(f"{at}.up_proj", n, n, hidden, inter),
            LinearGroup(f"{at}.down_proj", n, n, inter, hidden, 1, True)]


def _vision_group(config: Mapping[str, Any], ident: _Identity, hidden: int, where: str) -> tuple[int, tuple[LinearGroup, ...]]:
    if not (ident.nested or ident.model_type in _VL_FLAT_TYPES):
        return 0, ()
    vision = _vision_params(config, hidden, where)
    if not vision:
        return 0, ()
    name = _VISION_NAMES.get(ident.model_type, "model.vision_tower.encoder.layers.0.mlp.fc1")
    return vision, (LinearGroup(name, vision, 0),)


def shape_from_config(config: Mapping[str, Any], where: str = "config.json") -> ModelShape:
    """The shape of a model from its parsed ``config.json``.

    Reads dense decoders (Llama, Mistral, Qwen2/3, Gemma/Gemma2/Gemma3 — whose language model is
    nested in ``text_config``) and mixtures of experts (Mixtral ``num_local_experts``, Qwen2/3-MoE
    ``num_experts`` with ``moe_intermediate_size`` and shared experts, DeepSeek-V2/V3 routed and
    shared experts with multi-head latent attention). Other decoders are read as Llama-like (gated
    MLP), with a note. Raises ModelConfigError naming the missing or malformed field.
    """
    ident = _identity(config, where)
    cfg, text_type = ident.cfg, ident.text_type
    d = _dims(config, ident, where)
    rope = _rope_scaling(cfg)
    max_pos, max_len = _derived_max_len(cfg, text_type, rope, where)
    dtype = config.get("torch_dtype") or config.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
    attn = _attention(ident, d, where)
    e = _experts(cfg, d.intermediate, where)
    groups, other = _layer_groups(ident, d, attn, e)
    vision, vision_group = _vision_group(config, ident, d.hidden, where)
    sliding_window, sliding_layers = _sliding(cfg, text_type, d.layers, where)
    nextn = _opt_int(cfg, "num_nextn_predict_layers", where=where) if text_type == "deepseek_v3" else 0
    return ModelShape(
        model_type=ident.model_type or text_type, text_model_type=text_type, architectures=ident.architectures,
        torch_dtype=str(dtype) if dtype else None, hidden_size=d.hidden, num_layers=d.layers,
        num_attention_heads=d.heads, num_kv_heads=attn.kv_cache_heads, head_dim=attn.head_dim,
        vocab_size=d.vocab, intermediate_size=d.intermediate, max_position_embeddings=max_pos,
        max_model_len=max_len, tie_word_embeddings=d.tie, embed_params=d.vocab * d.hidden,
        lm_head_params=0 if d.tie else d.vocab * d.hidden,
        linear_params=sum(g.params for g in groups), linear_active_params=sum(g.active_params for g in groups),
        other_params=other, vision_params=vision, num_experts=e.experts,
        experts_per_token=e.top_k if e.experts else 0, moe_intermediate_size=e.moe_inter if e.experts else 0,
        shared_expert_intermediate_size=e.shared_inter if e.experts else 0,
        kv_head_dim=attn.kv_head_dim, kv_tensors=attn.kv_tensors, mla=attn.mla,
        rope_scaling=dict(rope) if rope else None, notes=ident.notes, sliding_window=sliding_window,
        sliding_layers=sliding_layers, linear_groups=tuple(groups) + vision_group,
        num_nextn_predict_layers=min(nextn, 64), source_quantization=source_quantization(config, where),
    )


def load_model_shape(path: str | Path) -> ModelShape:
    """The shape of the model whose ``config.json`` is at ``path`` (a file, or a directory that
    holds one). Raises ModelConfigError with a message naming the file."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelConfigError(f"{p}: no such file") from None
    except OSError as e:
        raise ModelConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{p}: not valid JSON: {e.msg} at line {e.lineno}") from None
    return shape_from_config(config, where=str(p))
