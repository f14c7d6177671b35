"""The planner's decision rules: for each GPU pool, format, dtype, KV-cache dtype, tensor-parallel
size and maximum length that fit and run fastest there — or the reason the pool cannot serve.

Pure functions: ``plan(shape, pools, request) -> PlanStatus``. The planner's facts (formats and
their kernels in ``fewerbits_api.formats``; the memory and speed formulas in ``estimates.py``,
shared with the multi-node fit) are described in docs/planner.md; the assumptions the planner adds
are named as module constants, here and in ``estimates.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fewerbits_api.formats import FORMAT_FACTS, QUANTIZED_FORMATS, KVCacheSetting, QuantFormat
from fewerbits_api.quantizedmodel import PlanStatus, PlanVariant, RejectedPool, ServingTarget

from fewerbits_api.architectures import quantize_blocker

from fewerbits_operator.planner.catalog import CC, GPUPool, family_from_cc
from fewerbits_operator.planner.shape import ModelShape
from fewerbits_operator.planner.multinode import fit_across_nodes
from fewerbits_operator.planner.lora import AdapterFacts, LoraSizing, lora_bytes_per_gpu, lora_plan, plan_with_adapters
from fewerbits_operator.planner.vllm_args import plan_args
from fewerbits_operator.planner.estimates import (  # the estimates below rules and multinode
    DEFAULT_MIN_MODEL_LEN,
    Fit,
    GIB,
    TYPICAL_CONTEXT_TOKENS,
    WeightEstimate,
    _cc,
    _effective,
    _gib,
    _kv_bytes,
    _tokens,
    _tokens_held,
    _tp_blocker,
    effective_ignore_entries,
    estimate_weights,
    ignore_findings,
    in_flight_tokens,
    kernel_support,
    longest_length,
    runtime_reserve_bytes,
    tp_candidates,
)

if TYPE_CHECKING:  # pragma: no cover
    from fewerbits_api.policy import QuantizationPolicySpec
    from fewerbits_api.quantizedmodel import QuantizedModelSpec

# Default choice per family: blackwell → nvfp4 (alt fp8-dynamic); hopper →
# fp8-dynamic (alt w4a16-awq when memory is tight; not w4afp8: see FORMAT_BLOCKERS); ada-lovelace → fp8-dynamic (alt
# w4a16-awq); ampere → w4a16-awq (w8a8-int8 for heavy batching); turing → w8a8-int8 (alt
# w4a16-gptq). Each list is also the step-down order: the first format that fits wins. Formats
# missing from a list are appended (so a policy's allowedFormats can always be honoured), then
# formats that run only through a fallback kernel are moved behind the native ones, and `none`
# (16 bits) comes last.
FAMILY_FORMATS: dict[str, tuple[QuantFormat, ...]] = {
    "blackwell": (QuantFormat.NVFP4, QuantFormat.FP8_DYNAMIC, QuantFormat.W4A16_AWQ, QuantFormat.W4A16_GPTQ),
    "hopper": (QuantFormat.FP8_DYNAMIC, QuantFormat.W4A16_AWQ, QuantFormat.W4A16_GPTQ),
    "ada-lovelace": (QuantFormat.FP8_DYNAMIC, QuantFormat.W4A16_AWQ, QuantFormat.W4A16_GPTQ),
    "ampere": (QuantFormat.W4A16_AWQ, QuantFormat.W4A16_GPTQ, QuantFormat.W8A8_INT8),
    "turing": (QuantFormat.W8A8_INT8, QuantFormat.W4A16_GPTQ, QuantFormat.W4A16_AWQ),
    "volta": (),
}

class PlanRequest(BaseModel):
    """What the planner is asked: the effective spec's quantization and serving settings plus the
    matching policy's constraints. Build it with ``PlanRequest.from_spec`` in the operator."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: QuantFormat = QuantFormat.AUTO
    """`auto` picks per pool; a concrete format is used where it runs and fits, refused elsewhere."""
    kv_cache: KVCacheSetting = KVCacheSetting.AUTO
    ignore: tuple[str, ...] = ("lm_head",)
    """Layers kept at 16 bits (llm-compressor names or `re:` patterns)."""
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    """Requested `--max-model-len`; None: the model's limit, lowered to what fits."""
    min_concurrent_sequences: Annotated[int, Field(ge=1)] = 4
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    targets: tuple[ServingTarget, ...] = ()
    """Pools to serve on; empty: all pools."""
    served_model_name: str | None = None
    """Put in `--served-model-name` when set."""
    allowed_formats: tuple[QuantFormat, ...] | None = None
    """Policy `rules.allowedFormats` (None or empty: all)."""
    format_by_gpu_family: Mapping[str, QuantFormat] = Field(default_factory=dict)
    """Policy `formatByGPUFamily`: replaces the family default of `format: auto`."""
    max_gpus_per_replica: Annotated[int, Field(ge=1)] | None = None
    """Policy `rules.maxGPUsPerReplica`: caps the tensor-parallel size."""
    adapters: tuple[AdapterFacts, ...] = ()
    """The model's LoRA adapters whose configs fit the base (planner/lora.py)."""
    lora: LoraSizing | None = None
    """The adapters' buffers this plan makes room for (set per try by ``plan_pool``)."""

    @field_validator("allowed_formats")
    @classmethod
    def _empty_is_all(cls, v: tuple[QuantFormat, ...] | None) -> tuple[QuantFormat, ...] | None:
        # "Empty: all" (PolicyRules.allowedFormats); `auto` in the list means nothing concrete.
        if v is None:
            return None
        concrete = tuple(f for f in v if f is not QuantFormat.AUTO)
        return concrete or None

    @classmethod
    def from_spec(
        cls,
        spec: QuantizedModelSpec,
        policy: QuantizationPolicySpec | None = None,
        *,
        default_served_model_name: str | None = None,
        adapters: tuple[AdapterFacts, ...] = (),
    ) -> PlanRequest:
        """The request for an effective QuantizedModel spec under the matching policy's spec, with
        the facts read from its adapters' configs (those that fit the base)."""
        q, s = spec.quantization, spec.serving
        rules = policy.rules if policy is not None else None
        return cls(
            format=q.format,
            kv_cache=q.kvCache,
            ignore=tuple(q.ignore),
            max_model_len=s.maxModelLen,
            min_concurrent_sequences=s.minConcurrentSequences,
            gpu_memory_utilization=s.gpuMemoryUtilization,
            targets=tuple(s.targets),
            served_model_name=s.servedModelName or default_served_model_name,
            allowed_formats=tuple(rules.allowedFormats) if rules and rules.allowedFormats else None,
            format_by_gpu_family=dict(policy.formatByGPUFamily) if policy is not None else {},
            max_gpus_per_replica=rules.maxGPUsPerReplica if rules else None,
            adapters=adapters,
        )

    def allows(self, fmt: QuantFormat) -> bool:
        return self.allowed_formats is None or fmt in self.allowed_formats


# ------------------------------------------------------------------------------ helpers


@dataclass(frozen=True)
class _KVShortfall:
    tp: int
    kv_tokens: int
    weights_per_gpu: float
    usable_per_gpu: float


def fit_format(
    shape: ModelShape,
    pool: GPUPool,
    fmt: QuantFormat,
    kv_dtype: str,
    target_len: int | None,
    request: PlanRequest,
) -> Fit:
    """The smallest tensor-parallel size at which ``fmt`` fits on ``pool``, and what it gives.

    Tensor-parallel size is the smallest power of two that divides the attention
    heads and leaves room for KV of maxModelLen × a minimum concurrency; usable per GPU ≈
    memory × gpu-memory-utilization minus a runtime reserve.
    """
    weights = estimate_weights(shape, fmt, request.ignore)
    mem = pool.memory_mib * 1024**2
    util = request.gpu_memory_utilization
    conc = request.min_concurrent_sequences
    limit = shape.max_model_len
    need_len = target_len if target_len is not None else min(limit, DEFAULT_MIN_MODEL_LEN)
    candidates = tp_candidates(pool, request.max_gpus_per_replica)
    blockers: list[str] = []
    shortfall: _KVShortfall | None = None
    for tp in candidates:
        blocker = _tp_blocker(shape, fmt, tp)
        if blocker:
            blockers.append(f"TP {tp}: {blocker}")
            continue
        usable = mem * util - runtime_reserve_bytes(mem, tp) - lora_bytes_per_gpu(shape, request.lora, tp)
        free = usable - weights.total_bytes / tp
        if free <= 0:
            continue
        kvb, in_flight = _kv_bytes(kv_dtype), in_flight_tokens(pool)

        def seq_bytes(length: int, tp: int = tp) -> float:
            return shape.kv_bytes_per_sequence_per_gpu(tp, kvb, length, in_flight)

        if conc * seq_bytes(need_len) > free:
            shortfall = _KVShortfall(tp, _tokens_held(free, need_len, seq_bytes(need_len)),
                                     weights.total_bytes / tp, usable)
            continue
        if target_len is not None:
            return Fit(fmt, tp, weights, _tokens_held(free, target_len, seq_bytes(target_len)), target_len)
        length, lowered = longest_length(conc, seq_bytes, free, need_len, limit)
        return Fit(fmt, tp, weights, _tokens_held(free, length, seq_bytes(length)), length, lowered_len_from=lowered)
    reason = _no_fit_reason(shape, pool, fmt, weights, need_len, candidates, blockers, shortfall, request, kv_dtype)
    if shortfall is not None:
        summary = (
            f"its KV cache would hold {_tokens(shortfall.kv_tokens)} tokens, "
            f"fewer than {conc} × {_tokens(need_len)}"
        )
    else:
        summary = f"{_gib(weights.total_bytes)} of weights"
    return Fit(fmt, None, weights, reason=reason, summary=summary)


def _no_fit_reason(
    shape: ModelShape,
    pool: GPUPool,
    fmt: QuantFormat,
    weights: WeightEstimate,
    need_len: int,
    candidates: list[int],
    blockers: list[str],
    shortfall: _KVShortfall | None,
    request: PlanRequest,
    kv_dtype: str,
) -> str:
    mem = pool.memory_mib * 1024**2
    util = request.gpu_memory_utilization
    fmt_name = "16 bits (format none)" if fmt is QuantFormat.NONE else fmt.value
    usable_tp = [tp for tp in candidates if not _tp_blocker(shape, fmt, tp)]
    if not usable_tp:
        return f"at {fmt_name} no tensor-parallel size up to {candidates[-1]} works: " + "; ".join(blockers)
    cap = ""
    if request.max_gpus_per_replica is not None and request.max_gpus_per_replica < pool.gpus_per_node:
        cap = f", capped at {request.max_gpus_per_replica} by the policy's maxGPUsPerReplica"
    if blockers:
        cap += " (" + "; ".join(blockers) + ")"
    if shortfall is None:
        # The weights alone overflow every usable tensor-parallel size.
        usable_multi = mem * util - runtime_reserve_bytes(mem, 2)
        gpus = max(1.0, weights.total_bytes / max(usable_multi, 1.0))
        need_gpus = 2 ** math.ceil(math.log2(gpus) - 1e-9)
        gpus_word = "GPU" if pool.gpus_per_node == 1 else "GPUs"
        advice = (
            f"use a pool with ≥ {need_gpus} GPUs per node, a format with fewer bits, or a smaller model"
            if need_gpus > usable_tp[-1] and not cap
            else "allow more GPUs per replica, use a format with fewer bits, or a smaller model"
        )
        return (
            f"needs {_gib(weights.total_bytes)} for weights at {fmt_name}; the pool has "
            f"{pool.gpus_per_node}×{pool.memory_gib:.1f} GiB {gpus_word} per node{cap} "
            f"({_gib(mem * util - runtime_reserve_bytes(mem, 1))} usable on each); {advice}"
        )
    conc = request.min_concurrent_sequences
    fits_len = shortfall.kv_tokens // conc // 256 * 256
    lower = f"lower serving.maxModelLen to {_tokens(fits_len)}, " if fits_len >= 256 else ""
    return (
        f"at {fmt_name} the weights fit with tensor parallelism {shortfall.tp}{cap} "
        f"({_gib(shortfall.weights_per_gpu)} of {_gib(shortfall.usable_per_gpu)} usable per GPU) but the "
        f"{'FP8' if kv_dtype == 'fp8' else '16-bit'} KV cache then holds only {_tokens(shortfall.kv_tokens)} tokens, "
        f"fewer than {conc} sequences × {_tokens(need_len)} tokens (serving.minConcurrentSequences × maxModelLen); "
        f"{lower}lower minConcurrentSequences, or use a pool with more GPU memory"
    )


# ------------------------------------------------------------------------------ per pool


def compute_dtype(cc: CC) -> str:
    """bfloat16 from compute capability 8.0, float16 below."""
    return "bfloat16" if cc >= (8, 0) else "float16"


def kv_cache_dtype(setting: KVCacheSetting, cc: CC) -> tuple[str, str | None]:
    """(vLLM --kv-cache-dtype, warning): fp8 from compute capability 8.9, auto below.

    An explicit `fp8` below 8.9 is served with the model dtype and a warning rather than refused:
    unlike the weight format, the KV dtype is a per-pool runtime flag that needs no other
    artifact, and vLLM's FP8 KV kernels below Ada are slower or missing — so the pool still
    serves, just with half the KV capacity the user hoped for (the fit is checked with 16 bits).
    """
    if setting is KVCacheSetting.NONE:
        return "auto", None
    if cc >= (8, 9):
        return "fp8", None
    if setting is KVCacheSetting.FP8:
        return "auto", (
            f"kvCache fp8 needs compute capability 8.9 for FP8 attention kernels; this GPU is {_cc(cc)}, "
            "so the KV cache stays 16-bit (sized as such)"
        )
    return "auto", None


FORMAT_BLOCKERS: dict[QuantFormat, str] = {
    QuantFormat.W4AFP8: (
        "spec.quantization.format w4afp8 cannot be served: w4afp8 artifacts do not load in vLLM 0.33: llm-compressor "
        "0.14 saves them int-quantized (int4 values in int8 'weight' tensors) while vLLM's W4A8-FP8 scheme loads only "
        "pack-quantized 'weight_packed', so its loader refuses them on every architecture (scripts/vllm-check.sh), "
        "and vLLM's CPU build has no W4A8-FP8 scheme at all; use w4a16-awq or fp8-dynamic (or format auto)"),
}
"""Formats the planner never picks, and refuses on every pool when asked for, because the Job's
artifact would not load in the vLLM the pools run (found by loading the Job's artifacts with vLLM's
own loader). Each is also left out of ``FAMILY_FORMATS`` and the docs' recommendations."""


def _auto_chain(pool: GPUPool, request: PlanRequest) -> tuple[list[QuantFormat], list[str]]:
    """The formats `auto` tries on a pool, in order, and notes about the policy override."""
    family = pool.family if pool.family in FAMILY_FORMATS else family_from_cc(pool.cc)
    base = list(FAMILY_FORMATS.get(family, ()))
    base += [f for f in QUANTIZED_FORMATS if f not in base]
    native = [f for f in base if kernel_support(f, pool.cc)[0] == "native"]
    fallback = [f for f in base if kernel_support(f, pool.cc)[0] == "fallback"]
    chain = native + fallback + [QuantFormat.NONE]
    notes: list[str] = []
    override = request.format_by_gpu_family.get(pool.family) or request.format_by_gpu_family.get(family)
    if override is not None and override is not QuantFormat.AUTO:
        support, why = kernel_support(override, pool.cc)
        if support == "refused":
            notes.append(f"policy formatByGPUFamily.{family} = {override.value} cannot run here ({why}); ignored")
        else:
            chain = [override] + [f for f in chain if f is not override]
    return [f for f in chain if request.allows(f) and f not in FORMAT_BLOCKERS], notes


def _variant(
    shape: ModelShape,
    pool: GPUPool,
    fit: Fit,
    dtype: str,
    kv_dtype: str,
    request: PlanRequest,
    warnings: list[str],
) -> PlanVariant:
    assert fit.tp is not None and fit.weights is not None
    # Decode at batch 1 is memory-bound: tokens/s ≈ bandwidth / bytes read per token
    # (weights/TP + KV read). Each GPU reads its share in parallel; the KV read is that of a
    # TYPICAL_CONTEXT_TOKENS context. No efficiency factor and no all-reduce time: an upper bound
    # (real servers reach roughly 60-80% of it).
    context = min(fit.max_model_len, TYPICAL_CONTEXT_TOKENS)
    kv_read = shape.kv_bytes_per_sequence_per_gpu(fit.tp, _kv_bytes(kv_dtype), context)
    per_gpu_bytes = fit.weights.read_per_token_bytes / fit.tp + kv_read
    decode = pool.bandwidth_gbps * 1e9 / per_gpu_bytes
    variant = PlanVariant(
        pool=pool.name,
        gpuProduct=pool.product,
        family=pool.family,
        format=fit.fmt,
        kvCacheDtype=kv_dtype,
        dtype=dtype,
        tensorParallelSize=fit.tp,
        maxModelLen=fit.max_model_len,
        gpuMemoryUtilization=request.gpu_memory_utilization,
        weightsGiB=round(fit.weights.total_bytes / GIB, 2),
        kvCacheTokens=fit.kv_tokens,
        decodeTokensPerSecond=round(decode, 1),
        warnings=warnings,
        nodesPerReplica=fit.nodes,
        lora=lora_plan(shape, request.lora, fit.tp, fit.nodes) if request.lora else None,
    )
    # For display only: the serving pod renders its arguments from the typed fields.
    return variant.model_copy(update={"vllmArgs": plan_args(variant, request.served_model_name)})


def plan_pool(shape: ModelShape, pool: GPUPool, request: PlanRequest) -> PlanVariant | RejectedPool:
    """The variant for one pool, or why the pool cannot serve the model; with room for the
    model's adapters where they fit beside it (planner/lora.py)."""
    return plan_with_adapters(lambda lora: _plan_pool(shape, pool, request.model_copy(update={"lora": lora})),
                              request.adapters, shape)


def _plan_pool(shape: ModelShape, pool: GPUPool, request: PlanRequest) -> PlanVariant | RejectedPool:
    warnings: list[str] = list(pool.notes) + list(shape.notes)
    dtype = compute_dtype(pool.cc)
    if dtype == "float16" and shape.float16_unsupported:
        return RejectedPool(
            pool=pool.name,
            reason=(
                f"{shape.text_model_type} cannot run in float16 (vLLM refuses it: activations overflow) and "
                f"{pool.product} (compute capability {_cc(pool.cc)}) has no bfloat16; "
                "use a pool with compute capability 8.0 or newer (Ampere and later)"
            ),
        )
    kv_dtype, kv_warning = kv_cache_dtype(request.kv_cache, pool.cc)
    if kv_warning:
        warnings.append(kv_warning)

    limit = shape.max_model_len
    target_len = request.max_model_len
    if target_len is not None and target_len > limit:
        # vLLM refuses a --max-model-len above the model's derived limit.
        warnings.append(f"maxModelLen {_tokens(target_len)} is above the model's limit; clamped to {_tokens(limit)}")
        target_len = limit

    if request.format is not QuantFormat.NONE:
        rejected = _ignore_warnings(shape, pool, request, warnings)
        if rejected is not None:
            return rejected

    if shape.source_quantization is not None:
        return _plan_as_is(shape, pool, request, dtype, kv_dtype, target_len, warnings)
    if request.format not in (QuantFormat.AUTO, QuantFormat.NONE):
        blocker = quantize_blocker(shape.model_type, request.format.value)
        if blocker:
            return RejectedPool(pool=pool.name, reason=f"format {request.format.value}: {blocker}")
    elif request.format is QuantFormat.AUTO and quantize_blocker(shape.model_type):
        warnings.append(f"served at 16 bits (format none): {quantize_blocker(shape.model_type)}")
        request = request.model_copy(update={"format": QuantFormat.NONE})

    if request.format is not QuantFormat.AUTO:
        return _plan_format(shape, pool, request, dtype, kv_dtype, target_len, warnings)
    return _plan_auto(shape, pool, request, dtype, kv_dtype, target_len, warnings)


def _ignore_warnings(shape: ModelShape, pool: GPUPool, request: PlanRequest, warnings: list[str]) -> RejectedPool | None:
    """spec.quantization.ignore against the model's layers: a rejection when it keeps every layer
    at 16 bits (nothing to quantize), else a warning per entry that matches nothing."""
    findings = ignore_findings(shape, request.ignore)
    if findings.nothing_quantized and shape.source_quantization is None:
        return RejectedPool(pool=pool.name, reason=(
            "spec.quantization.ignore matches every Linear layer of the model: nothing would be quantized; "
            "name fewer layers, or set format none to serve the model at 16 bits"))
    for entry in findings.unmatched:
        warnings.append(f"spec.quantization.ignore entry {entry!r} matches no layer of this model "
                        f"({shape.model_type}); it keeps nothing at 16 bits")
    warnings.extend(_effective(tuple(shape.arch_config.items()), tuple(request.ignore)).warnings)
    return None


def _plan_format(shape: ModelShape, pool: GPUPool, request: PlanRequest, dtype: str, kv_dtype: str,
                 target_len: int | None, warnings: list[str]) -> PlanVariant | RejectedPool:
    """The format the request names (not auto): allowed, runnable on this GPU, and fitting (on one
    node, else across the pool's nodes); a rejection names the first format of the chain that would fit."""
    fmt = request.format
    if not request.allows(fmt):
        allowed = ", ".join(f.value for f in request.allowed_formats or ())
        return RejectedPool(pool=pool.name, reason=f"format {fmt.value} is not allowed by the policy (allowedFormats: {allowed})")
    if fmt in FORMAT_BLOCKERS:
        return RejectedPool(pool=pool.name, reason=FORMAT_BLOCKERS[fmt])
    support, why = kernel_support(fmt, pool.cc)
    if support == "refused":
        return RejectedPool(pool=pool.name, reason=f"{why}; use format auto or a format this GPU runs")
    if support == "fallback":
        warnings.append(f"{fmt.value} below compute capability {_cc(FORMAT_FACTS[fmt].native_min_cc)}: {why}")
    fit = _or_across_nodes(shape, pool, fit_format(shape, pool, fmt, kv_dtype, target_len, request),
                           kv_dtype, target_len, request, warnings)
    if fit.tp is not None:
        return _finish(shape, pool, fit, dtype, kv_dtype, request, warnings)
    hint = ""
    chain, _ = _auto_chain(pool, request)
    for alt in chain:
        if alt is fmt:
            continue
        alt_fit = fit_format(shape, pool, alt, kv_dtype, target_len, request)
        if alt_fit.tp is not None:
            hint = f"; it would fit at {alt.value} (tensor parallelism {alt_fit.tp})"
            break
    return RejectedPool(pool=pool.name, reason=fit.reason + hint)


def _plan_auto(shape: ModelShape, pool: GPUPool, request: PlanRequest, dtype: str, kv_dtype: str,
               target_len: int | None, warnings: list[str]) -> PlanVariant | RejectedPool:
    """Format auto: the first format of the pool's chain that fits on one node, else the first that
    fits across the pool's nodes; a rejection gives the reason of the format with the fewest bytes."""
    chain, notes = _auto_chain(pool, request)
    warnings += notes
    chain = [f for f in chain if f is QuantFormat.NONE or not quantize_blocker(shape.model_type, f.value)]
    if not chain:
        allowed = ", ".join(f.value for f in request.allowed_formats or ())
        return RejectedPool(pool=pool.name, reason=f"none of the policy's allowedFormats ({allowed}) runs on {pool.product} (compute capability {_cc(pool.cc)})")
    tried: list[Fit] = []
    for fmt in chain:
        fit = fit_format(shape, pool, fmt, kv_dtype, target_len, request)
        if fit.tp is None:
            tried.append(fit)
            continue
        if tried:
            first = tried[0]
            warnings.append(
                f"{first.fmt.value} does not fit ({first.summary}); stepped down to {fmt.value} "
                f"({FORMAT_FACTS[fmt].weight_bits:g} bits per weight)"
            )
        support, why = kernel_support(fmt, pool.cc)
        if support == "fallback":
            warnings.append(f"{fmt.value} below compute capability {_cc(FORMAT_FACTS[fmt].native_min_cc)}: {why}")
        return _finish(shape, pool, fit, dtype, kv_dtype, request, warnings)
    if pool.node_count > 1:
        # No single-node layout at any format: span nodes, at the first format that fits so.
        spanned = []
        for single in tried:
            fit = _or_across_nodes(shape, pool, single, kv_dtype, target_len, request, warnings)
            if fit.tp is not None:
                return _finish(shape, pool, fit, dtype, kv_dtype, request, warnings)
            spanned.append(fit)
        tried = spanned
    # Nothing fits: the reason of the format with the fewest bytes is the one to act on.
    smallest = min(tried, key=lambda f: f.weights.total_bytes if f.weights else math.inf)
    names = ", ".join(f.fmt.value for f in tried)
    return RejectedPool(
        pool=pool.name,
        reason=f"does not fit at any allowed format (tried {names}); {smallest.reason}",
    )


def _plan_as_is(shape: ModelShape, pool: GPUPool, request: PlanRequest, dtype: str, kv_dtype: str,
                target_len: int | None, warnings: list[str]) -> PlanVariant | RejectedPool:
    """A source that is already quantized is served as it is, or not at all on this pool.

    fewerbits quantizes from 16-bit weights only: quantizing an FP8 or int4 checkpoint again
    would need a dequantization step that compounds both errors, so the source's own format is
    the only one a pool can get. Where the pool runs that format (and it fits) the variant is
    marked ``servedAsIs``: no quantization; the artifact is the source pinned by its revision, which a
    `none` Job copies unchanged into the storage (sized and shown in the plan's quantizationJobs).
    Elsewhere the pool is refused with what to do (a 16-bit source, or another pool). Format
    ``none`` ("fewerbits does not quantize") on such a source means the same as ``auto``: serve it
    as it is; there are no 16-bit weights to serve instead.
    """
    sq = shape.source_quantization
    assert sq is not None
    already = f"the source is already quantized ({sq.detail})"
    if sq.format is None:
        return RejectedPool(pool=pool.name, reason=(
            f"{already}, which is none of the formats fewerbits serves or quantizes from "
            f"(quantization_config.quant_method {sq.method!r}); point spec.source at the model's 16-bit original"))
    fmt = sq.format
    if request.format not in (QuantFormat.AUTO, QuantFormat.NONE, fmt):
        return RejectedPool(pool=pool.name, reason=(
            f"{already}, i.e. {fmt.value}; format {request.format.value} would need its 16-bit original: "
            f"set spec.quantization.format to auto, none or {fmt.value}, or point spec.source at the 16-bit original"))
    if not request.allows(fmt):
        allowed = ", ".join(f.value for f in request.allowed_formats or ())
        return RejectedPool(pool=pool.name, reason=(
            f"{already}, i.e. {fmt.value}, which the policy does not allow (allowedFormats: {allowed}); "
            "point spec.source at the 16-bit original"))
    support, why = kernel_support(fmt, pool.cc)
    if support == "refused":
        return RejectedPool(pool=pool.name, reason=(
            f"{already}, i.e. {fmt.value}, and is served as it is; {why}; serve it on a pool that runs {fmt.value}, "
            "or point spec.source at the 16-bit original so fewerbits can quantize for this GPU"))
    if support == "fallback":
        warnings.append(f"{fmt.value} below compute capability {_cc(FORMAT_FACTS[fmt].native_min_cc)}: {why}")
    fit = _or_across_nodes(shape, pool, fit_format(shape, pool, fmt, kv_dtype, target_len, request),
                           kv_dtype, target_len, request, warnings)
    if fit.tp is None:
        return RejectedPool(pool=pool.name, reason=f"{already}, i.e. {fmt.value}, served as it is: {fit.reason}")
    warnings.append(f"{already}: served as {fmt.value} as it is, with no quantization; a copy Job (format none) "
                    "publishes the source unchanged to spec.storage first (its disk and time in quantizationJobs; "
                    "a policy's rules.maxSourceCopyGiB caps it)")
    variant = _finish(shape, pool, fit, dtype, kv_dtype, request, warnings)
    return variant.model_copy(update={"servedAsIs": True})


def _or_across_nodes(shape: ModelShape, pool: GPUPool, single: Fit, kv_dtype: str, target_len: int | None,
                     request: PlanRequest, warnings: list[str]) -> Fit:
    """``single`` when it fits one node; else the multi-node fit (planner/multinode.py), with a
    warning that says why, or ``single`` with the multi-node numbers added to its reason."""
    if single.tp is not None or pool.node_count < 2:
        return single
    multi = fit_across_nodes(shape, pool, single.fmt, kv_dtype, target_len, request)
    if multi.tp is None:
        return Fit(single.fmt, None, single.weights, reason=f"{single.reason}; across nodes: {multi.reason}",
                   summary=single.summary)
    warnings.append(
        f"{single.fmt.value} fits no single node ({single.summary}); each replica spans {multi.nodes} nodes as a "
        f"LeaderWorkerSet group: tensor parallel {multi.tp} inside each node, pipeline parallel {multi.nodes} across them")
    return multi


def _finish(
    shape: ModelShape,
    pool: GPUPool,
    fit: Fit,
    dtype: str,
    kv_dtype: str,
    request: PlanRequest,
    warnings: list[str],
) -> PlanVariant:
    if fit.lowered_len_from is not None:
        warnings.append(
            f"maxModelLen lowered to {_tokens(fit.max_model_len)} (model allows {_tokens(fit.lowered_len_from)}) "
            f"so {request.min_concurrent_sequences} sequences fit the KV cache; set serving.maxModelLen to choose"
        )
    return _variant(shape, pool, fit, dtype, kv_dtype, request, warnings)


# ------------------------------------------------------------------------------ all pools


def pool_targeted(pool: GPUPool, targets: Iterable[ServingTarget]) -> bool:
    """Whether a pool is one of ``serving.targets`` (all pools when there are none). A
    nodeSelector target matches a pool whose nodes all carry its labels."""
    targets = list(targets)
    if not targets:
        return True
    for t in targets:
        if t.family is not None and t.family == pool.family:
            return True
        if t.product is not None and t.product == pool.product:
            return True
        if t.nodeSelector is not None and all(pool.common_labels.get(k) == v for k, v in t.nodeSelector.items()):
            return True
    return False


def unmatched_targets(pools: Iterable[GPUPool], targets: Iterable[ServingTarget]) -> list[ServingTarget]:
    """Targets that select no pool at all (a typo in a product name, a family the cluster lacks):
    for the operator to report in the Planned condition."""
    pools = list(pools)
    return [t for t in targets if not any(pool_targeted(p, [t]) for p in pools)]


def plan(shape: ModelShape, pools: Iterable[GPUPool], request: PlanRequest) -> PlanStatus:
    """The plan for every targeted pool: a variant where the model runs and fits, a rejection
    with a reason a person can act on elsewhere. Pools that ``serving.targets`` leaves out are
    neither (they are not candidates; see ``unmatched_targets`` for targets that match nothing).
    """
    variants: list[PlanVariant] = []
    rejected: list[RejectedPool] = []
    for pool in pools:
        if not pool_targeted(pool, request.targets):
            continue
        outcome = plan_pool(shape, pool, request)
        (variants if isinstance(outcome, PlanVariant) else rejected).append(outcome)
    return PlanStatus(variants=variants, rejected=rejected,
                      ignore=list(effective_ignore_entries(shape, request.ignore)))
