"""The planner's memory and speed estimates, shared by the single-node rules (rules.py) and the
multi-node fit (multinode.py), below both: the weights a format leaves, the runtime reserve per
GPU, the KV cache's bytes and in-flight tokens, the tensor-parallel sizes a format allows, and the
``Fit`` both return. Pure functions; the assumptions they add are named as module constants.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable

from fewerbits_api.architectures import effective_ignore, matches
from fewerbits_api.formats import FORMAT_FACTS, QuantFormat, cc_verdict

from fewerbits_operator.planner.catalog import CC, GPUPool
from fewerbits_operator.planner.shape import LinearGroup, ModelShape

GIB = 1024**3

# --- assumptions the planner adds to the sizing formulas ---------------------------------------

RESERVE_FIXED_GIB = 1.5
"""Per GPU, outside weights and KV: CUDA context, CUDA graphs and sampler buffers."""
RESERVE_FRACTION = 0.03
"""Per GPU, a share of its memory for the activation peak of vLLM's profiling run (vLLM picks
larger batches on larger GPUs, so the peak grows with the GPU)."""
RESERVE_TP_GIB = 0.5
"""Per GPU when tensor-parallel: NCCL communication buffers."""
DEFAULT_MIN_MODEL_LEN = 8192
"""Without ``serving.maxModelLen`` the length defaults to the model's limit, lowered to what fits;
the tensor-parallel size is chosen so that at least this length (or the model's limit, if
shorter) fits ``minConcurrentSequences`` times."""
MODEL_LEN_STEP = 1024
"""A lowered default length is rounded down to a multiple of this."""
TYPICAL_CONTEXT_TOKENS = 2048
"""Context length at which the batch-1 decode speed is estimated (KV read per token)."""
GROUP_SIZE: dict[QuantFormat, int] = {
    # Group / block sizes of llm-compressor's presets. vLLM's kernels need each GPU's share of a
    # quantized layer's input (row-parallel: o_proj, down_proj, experts) to be a whole number of
    # groups, so these limit the tensor-parallel sizes a format can use.
    QuantFormat.W4A16_AWQ: 128,
    QuantFormat.W4A16_GPTQ: 128,
    QuantFormat.W4AFP8: 128,
    QuantFormat.FP8_BLOCK: 128,
    QuantFormat.NVFP4: 16,
    QuantFormat.NVFP4A16: 16,
}


def _cc(cc: CC) -> str:
    return f"{cc[0]}.{cc[1]}"


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB"


def _tokens(n: int) -> str:
    return f"{n:,}"


def kernel_support(fmt: QuantFormat, cc: CC) -> tuple[str, str]:
    """Whether vLLM runs ``fmt`` on compute capability ``cc`` (``fewerbits_api.formats.cc_verdict``):
    ("native", ""), ("fallback", what the fallback means) or ("refused", why, naming this GPU)."""
    verdict = cc_verdict(fmt, cc)
    if verdict.kind == "refused":
        return "refused", f"{verdict.why}; this GPU is {_cc(cc)}"
    return verdict.kind, verdict.why


def _lm_head_ignored(ignore: Iterable[str]) -> bool:
    for entry in ignore:
        if entry == "lm_head" or entry.endswith(".lm_head"):
            return True
        if entry.startswith("re:"):
            try:
                if re.search(entry[3:], "lm_head"):
                    return True
            except re.error:
                continue
    return False


def effective_ignore_entries(shape: ModelShape, ignore: Iterable[str]) -> tuple[str, ...]:
    """The ignore list the recipe gets for this model: the user's plus the architecture's
    (fewerbits_api.architectures), the same function the Job's recipe uses."""
    return _effective(tuple(shape.arch_config.items()), tuple(ignore)).entries


@functools.lru_cache(maxsize=256)
def _effective(arch: tuple, ignore: tuple[str, ...]):
    return effective_ignore(dict(arch), ignore)


@functools.lru_cache(maxsize=256)
def _kept_params(groups: tuple[LinearGroup, ...], entries: tuple[str, ...]) -> tuple[int, int]:
    """(parameters, active parameters) of the Linear groups an ignore list keeps at 16 bits."""
    kept = kept_active = 0
    for g in groups:
        if any(matches(e, g.name) for e in entries):
            kept += g.params
            kept_active += g.active_params
    return kept, kept_active


@functools.lru_cache(maxsize=64)
def _candidate_names(groups: tuple[LinearGroup, ...], num_experts: int) -> tuple[str, ...]:
    """Module names an ignore entry may sensibly name: every Linear group, every routed expert,
    routers, the LM head and the embedding."""
    names = [g.name for g in groups]
    for g in groups:
        if ".experts.0." in g.name:
            names += [g.name.replace(".experts.0.", f".experts.{e}.") for e in range(1, num_experts)]
    if num_experts:
        layer_prefixes = {g.name.split(".self_attn.")[0] for g in groups if ".self_attn." in g.name}
        for lp in sorted(layer_prefixes):
            names += [f"{lp}.mlp.gate", f"{lp}.block_sparse_moe.gate", f"{lp}.mlp.shared_expert_gate"]
    return tuple(names + ["lm_head", "model.embed_tokens", "model.language_model.embed_tokens"])


@dataclass(frozen=True)
class IgnoreFindings:
    unmatched: tuple[str, ...]
    """User entries that match no layer of the model."""
    nothing_quantized: bool
    """The effective list keeps every Linear of the language model at 16 bits (or is ``*``)."""


def ignore_findings(shape: ModelShape, ignore: Iterable[str]) -> IgnoreFindings:
    """What the user's ignore list does to this model: entries that match nothing, and whether
    nothing would be left to quantize."""
    return _ignore_findings(shape.linear_groups, shape.num_experts, bool(shape.vision_params),
                            tuple(shape.arch_config.items()), tuple(ignore))


@functools.lru_cache(maxsize=256)
def _ignore_findings(groups: tuple[LinearGroup, ...], num_experts: int, has_vision: bool, arch: tuple,
                     user: tuple[str, ...]) -> IgnoreFindings:
    # The vision encoder's group is the one with no active parameters (the text model's all have some).
    text_groups = tuple(g for g in groups if g.active_params or not has_vision)
    entries = _effective(arch, user).entries
    if "*" in user:
        return IgnoreFindings((), True)
    if not groups:
        return IgnoreFindings((), False)
    names = _candidate_names(groups, num_experts)
    unmatched = tuple(e for e in user if not any(matches(e, n) for n in names))
    kept, _ = _kept_params(text_groups, entries)
    return IgnoreFindings(unmatched, kept >= sum(g.params for g in text_groups))


@dataclass(frozen=True)
class WeightEstimate:
    total_bytes: float
    """Weights of one replica (all GPUs together)."""
    read_per_token_bytes: float
    """Weights read to decode one token (active experts only; the input embedding is a lookup)."""


def estimate_weights(shape: ModelShape, fmt: QuantFormat, ignore: Iterable[str]) -> WeightEstimate:
    """Memory fit (docs/architecture.md): weights ≈ params × bits/8 (+ scales: ~3% for group-128
    int4), with embeddings, norms and routers at 16 bits, and every Linear the effective ignore
    list (the user's plus the architecture's, the list the recipe gets) names at 16 bits too."""
    facts = FORMAT_FACTS[fmt]
    q = facts.weight_bits / 8 * (1 + facts.scale_overhead)
    half = 2.0
    entries = effective_ignore_entries(shape, ignore) if fmt is not QuantFormat.NONE else ()
    lm_head_bytes_per_param = half if _lm_head_ignored(entries) else q
    lm_head = shape.lm_head_params * lm_head_bytes_per_param
    if shape.linear_groups:
        group_total = sum(g.params for g in shape.linear_groups)
        group_active = sum(g.active_params for g in shape.linear_groups)
        kept, kept_active = _kept_params(shape.linear_groups, entries)
        linear = (group_total - kept) * q + kept * half
        linear_read = (group_active - kept_active) * q + kept_active * half
        vision = 0.0 if group_total > shape.linear_params else shape.vision_params * half
    else:  # a shape built by hand, without its layer inventory
        linear, linear_read, vision = shape.linear_params * q, shape.linear_active_params * q, shape.vision_params * half
    sixteen_bit = (shape.embed_params + shape.other_params) * half + vision
    total = linear + lm_head + sixteen_bit
    # Decoding reads the LM head whole (the embedding matrix, at 16 bits, when tied).
    head_read = lm_head if shape.lm_head_params else shape.embed_params * half
    read = linear_read + head_read + shape.other_params * half
    return WeightEstimate(total, read)


def runtime_reserve_bytes(memory_bytes: float, tensor_parallel: int) -> float:
    """What each GPU keeps outside weights and KV (see the RESERVE_* constants)."""
    return (RESERVE_FIXED_GIB + (RESERVE_TP_GIB if tensor_parallel > 1 else 0.0)) * GIB + RESERVE_FRACTION * memory_bytes


def in_flight_tokens(pool: GPUPool) -> int:
    """vLLM 0.33's VllmConfig.max_in_flight_tokens for `vllm serve` on this GPU: two concurrent
    batches (async scheduling, on by default) of the default max_num_batched_tokens, which
    vllm/engine/arg_utils.py picks by GPU memory: 16384 from 160 GiB, 8192 from 70 GiB (not A100),
    2048 otherwise. Sliding-window layers keep this many tokens beyond their window."""
    mem = pool.memory_mib * 1024**2
    if mem >= 160 * GIB:
        batched = 16384
    elif mem >= 70 * GIB and "a100" not in pool.product.lower():
        batched = 8192
    else:
        batched = 2048
    return 2 * batched


def _tokens_held(free: float, length: int, seq_bytes: float) -> int:
    """Tokens the KV cache holds in sequences of ``length`` (all of them when no layer slides)."""
    return int(free / (seq_bytes / length)) if seq_bytes > 0 else 0


def _kv_bytes(kv_dtype: str) -> float:
    return 1.0 if kv_dtype == "fp8" else 2.0


def _tp_blocker(shape: ModelShape, fmt: QuantFormat, tp: int) -> str | None:
    """Why vLLM cannot split the model ``tp`` ways, or None."""
    if shape.num_attention_heads % tp:
        return f"{shape.num_attention_heads} attention heads are not divisible by {tp}"
    kv = shape.num_kv_heads
    if not shape.mla and (kv % tp if kv >= tp else tp % kv):
        # vLLM splits KV heads across GPUs, or replicates them when fewer than the GPUs.
        return f"{kv} KV heads cannot be split or replicated evenly over {tp} GPUs"
    group = GROUP_SIZE.get(fmt)
    if group and tp > 1:
        dims = []
        if shape.intermediate_size and (not shape.is_moe or shape.linear_params > 0):
            dims.append(("MLP width", shape.intermediate_size))
        if shape.is_moe and shape.moe_intermediate_size:
            dims.append(("expert MLP width", shape.moe_intermediate_size))
        if not shape.mla:
            dims.append(("attention width", shape.num_attention_heads * shape.head_dim))
        for what, width in dims:
            if width % tp or (width // tp) % group:
                return f"{fmt.value} needs each GPU's share of the {what} ({width}/{tp}) to be a multiple of its group size {group}"
    return None


def tp_candidates(pool: GPUPool, max_gpus: int | None) -> list[int]:
    """Powers of two up to the GPUs of one node (one replica stays on one node) and the
    policy's maxGPUsPerReplica."""
    limit = min(pool.gpus_per_node, max_gpus or pool.gpus_per_node)
    out, tp = [], 1
    while tp <= limit:
        out.append(tp)
        tp *= 2
    return out


@dataclass(frozen=True)
class Fit:
    """The outcome of sizing one format on one pool."""

    fmt: QuantFormat
    tp: int | None = None
    weights: WeightEstimate | None = None
    kv_tokens: int = 0
    max_model_len: int = 0
    reason: str = ""
    """Why it does not fit (when tp is None), with advice."""
    summary: str = ""
    """The same in a few words (for step-down warnings)."""
    lowered_len_from: int | None = None
    nodes: int = 1
    """Nodes one replica spans (pipeline-parallel size; planner/multinode.py when above 1)."""


def longest_length(conc: int, seq_bytes, free: float, need_len: int, limit: int) -> tuple[int, int | None]:
    """The longest length at which ``conc`` sequences fit ``free`` bytes (sequence bytes grow with
    length), and the model's limit when that had to be lowered (rounded down to MODEL_LEN_STEP)."""
    lo, hi = need_len, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if conc * seq_bytes(mid) <= free:
            lo = mid
        else:
            hi = mid - 1
    if lo < limit:
        return max(need_len, lo // MODEL_LEN_STEP * MODEL_LEN_STEP), limit
    return lo, None
