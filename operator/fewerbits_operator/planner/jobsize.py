"""What a quantization Job needs, from the model's shape: host memory, disk, GPUs, the pool that
can hold its calibration and evaluation, and a wall-time estimate. Pure; no cluster access.

The model behind the figures (docs/jobs.md states it with the measurements):

* **Host memory.** The Job loads the whole source checkpoint on the CPU at its own dtype
  (``quantize.load_for_quantization``: llm-compressor's pipelines then move one layer at a time to
  the GPU). Measured on this project's machine (``bench/job_footprint.py``) the peak resident
  memory of the Job's load-quantize-save stages is ``RSS_BASE_GIB + RSS_PER_SOURCE_BYTE × source
  bytes`` (with the CPU evaluation too, for a Job without GPUs: ``CPU_RSS_*``); on top of that the sequential pipeline keeps every calibration sample's hidden states
  between layers (``samples × seq × hidden × 2 bytes``, twice: a layer's inputs and outputs), an
  MoE model's AWQ its cached inputs (``awq_host_bytes``; a Job without GPUs all of AWQ's cache), and
  ``HEADROOM`` for what a real checkpoint adds (a tokenizer, a larger vocabulary's logits).
* **Disk.** The source download (one copy: ``snapshot_download(local_dir=...)``), the quantized
  output, and ``HEADROOM`` plus ``DISK_FIXED_GIB`` (calibration data, tokenizer, temp files).
* **GPU.** ``gpuMemoryGiB`` is the peak torch allocates on one GPU while calibrating (what CUDA's
  ``max_memory_allocated`` measures), fitted to one NVIDIA H200's figures (issue 31, docs/jobs.md):
  llm-compressor's sequential pipeline onloads one decoder layer at a time, so the need is per
  layer: the layer's 16-bit weights and their quantized working copy, one sample's activations;
  GPTQ (and w8a8-int8, which runs it) adds a Hessian per Linear and the solve's copies for the
  largest one; AWQ adds its cache for *every* calibration sample (three hidden-wide tensors per
  token: the parent module's 16-bit outputs, those of the current grid point, and the cached inputs
  it replays), so it grows with samples × length × hidden. For a mixture of experts llm-compressor
  keeps the cached inputs in host memory (``awq_offloads_inputs``): the GPU holds the two output
  tensors per token, and the host memory every parent's inputs of a layer, every expert's included
  (``awq_host_bytes``). The measured peaks of the small test models also held
  the whole model on the GPU where it fitted (compressed-tensors' dispatch keeps what fits); that
  part is opportunistic, not a need, and the plan leaves it out. A pool must hold the need plus
  the CUDA context within ``GPU_USABLE_FRACTION`` of a GPU. Evaluation loads one model at a time in
  bf16 with ``device_map="auto"``: the Job asks for the fewest GPUs of its pool that hold it; when
  a cap or the pool's node is smaller, accelerate keeps the rest in host memory (already counted:
  the host holds the whole model anyway) and streams it over PCIe on every forward pass.
* **Time.** Download at ``DOWNLOAD_GBPS``, load and save at the measured disk rates, calibration
  per decoder layer from the H200's per-layer seconds (``CALIBRATION_RATES``: a term in the
  layer's forward FLOPs and one in tokens × hidden, scaled by the pool's bf16 peak), evaluation at
  ``EVAL_GPU_EFFICIENCY`` of the peak plus the offload's PCIe traffic, and a fixed start-up. A
  ``none`` artifact (a source served as it is) downloads and uploads the source: no model in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from fewerbits_api.formats import FORMAT_FACTS, QuantFormat
from fewerbits_api.quantizedmodel import QuantizationJobSize

from fewerbits_operator.planner.catalog import GPUPool
from fewerbits_operator.planner.rules import estimate_weights
from fewerbits_operator.planner.shape import ModelShape

GIB = 2**30

# ---- measured (bench/job_footprint.py on the project's 2-core machine, fp8-dynamic at 0.35-0.79 GB of
# bf16 source; docs/jobs.md has the rows). Least-squares lines through the peak resident memory
# (anonymous + mapped checkpoint pages: transformers maps the safetensors and computes from them).
RSS_BASE_GIB = 0.96
"""Peak resident memory of the load-quantize-save stages with a near-empty model (Python, torch,
transformers, llm-compressor)."""
RSS_PER_SOURCE_BYTE = 1.97
"""Peak resident memory of those stages grows by this many bytes per byte of source checkpoint
(the mapped bf16 weights, the quantized weights beside them, the compressed copies while saving).
A Job with GPUs evaluates on them; this is its host peak."""
CPU_RSS_BASE_GIB = 1.21
CPU_RSS_PER_SOURCE_BYTE = 2.48
"""The same for the whole Job on the CPU (0 GPUs): the evaluation loads the bf16 model again in host
memory (after the quantized one is released) and keeps its logits there."""
LOAD_BYTES_PER_SECOND = 100e6
"""Reading safetensors into memory and building the model (assumed: the load times measured on this
machine are dominated by imports and by the machine's load, see docs/jobs.md)."""
SAVE_BYTES_PER_SECOND = 80e6
"""Compressing and writing the checkpoint (assumed, as above)."""
CPU_CALIBRATION_FLOPS = 20e9
"""Effective FLOP/s of calibration forward passes on the CPU (a Job with 0 GPUs; assumed)."""

# ---- assumed (stated in docs/jobs.md)
HEADROOM = 0.10
"""Extra fraction on memory and disk."""
DISK_FIXED_GIB = 5.0
CUDA_CONTEXT_GIB = 1.5
"""The CUDA context and the allocator's reserve beyond what it hands out (not in
``max_memory_allocated``): added when checking that a pool's GPU holds the need."""
GPU_USABLE_FRACTION = 0.9
"""Share of a GPU's memory the Job plans to fill (allocator fragmentation)."""
DOWNLOAD_GBPS = 0.2
"""Source download rate, GB/s (Hub or S3 into the pod)."""
UPLOAD_GBPS = 0.2
"""Artifact upload rate into spec.storage, GB/s."""
PCIE_GBPS = 20.0
"""Host-to-GPU rate for evaluation layers offloaded to host memory."""
START_MINUTES = 3.0
"""Image pull, container start, imports."""
GPTQ_SOLVE_FACTOR = 1.0
"""On the CPU (a Job with 0 GPUs, not measured): GPTQ's and AWQ's per-layer solve and search, as a
multiple of the calibration forward time."""
NONE_MEMORY_GIB = 2.0
"""A `none` artifact (a source served as it is) streams files: no model in memory."""

# ---- measured on one NVIDIA H200 (issue 31: torch 2.11, llm-compressor 0.14.0.1, transformers 5.17.0;
# bench/gpu_quantize.py and a calibration-size run on its functions; Llama of Llama-3-8B width with 4
# layers and of Llama-3-70B width with 2, random weights). tests/unit/test_jobsize.py pins each figure
# against the model below (within 25%); docs/jobs.md has the table.
REFERENCE_BF16_TFLOPS = 989.0
"""The H200's dense bf16 peak (the catalog's): the per-layer seconds below are at this rate."""
LAYER_WEIGHT_COPIES = 1.5
"""One decoder layer's 16-bit weights onloaded, plus the quantized copy and scales of its largest
module: fp8-dynamic peaked at 0.61 GiB for a 0.41 GiB layer (hidden 4096)."""
AWQ_GPU_OUTPUTS = 2.0
"""AWQ keeps hidden-wide bf16 tensors for every calibration token while it searches a mapping's
scales: 24.2 GiB at 8B width and 48.8 at 70B width for 512 × 2048 tokens are 2.9-3.0 × samples ×
length × hidden × 2 bytes (fitted, dense Llamas). Two of the three are outputs, on the GPU
whatever the model (llm-compressor 0.14 ``AWQModifier._apply_smoothing``: ``fp16_outputs``, the
parent module's 16-bit outputs of every batch, and ``int_w_outputs``, those of the current grid
point, both returned on the execution device by ``_run_samples``)..."""
AWQ_CACHED_INPUTS = 1.0
"""...and the rest of the fit is the cached inputs the grid search replays (``_parent_args_cache``,
an ``IntermediatesCache`` kept on ``offload_device``). The split of the dense fit is read from the
code, not measured apart (on the CPU the zoo's tiny Llama caches 4.3 × tokens × hidden at the start
of a layer's smoothing: more than this fit leaves; to be measured on a GPU, docs/jobs.md). An MoE
model's cached inputs are sized from its shape instead (``awq_host_bytes``)."""
GPTQ_SOLVE_HESSIAN_COPIES = 2.0
"""Beside every Linear's Hessian of the layer (in-features² × 4 bytes each), GPTQ's peak holds two
more of the largest Linear's (read as the damped Hessian and its inverse Cholesky factor)..."""
GPTQ_SOLVE_WEIGHT_COPIES = 2.0
"""...and that Linear's weight in fp32 twice. With these the model is within 1% of GPTQ's and
INT8's peaks at both widths (the split between the terms is not measured, only their sum)."""
CALIBRATION_RATES: dict[QuantFormat, tuple[float, float]] = {
    # Seconds of one decoder layer's calibration = tokens × (a × 2 × the layer's active Linear
    # parameters + b × hidden) / (the GPU's bf16 FLOP/s). Fitted exactly to the H200's per-layer
    # seconds at 512 × 2048 tokens at both widths (GPTQ 8.7 / 26.7 s, AWQ 17.5 / 37.6, w8a8-int8
    # 10.3 / 30.4; nvfp4 3.9 at 8B width only, so its b is 0). a = 1 / the share of the bf16 peak
    # the FLOP part reaches (GPTQ ~10%, AWQ ~34%, nvfp4 ~12%); b is what does not grow with the
    # layer's FLOPs (AWQ's per-token grid search over the cached outputs, GPTQ's Hessian updates).
    QuantFormat.W4A16_GPTQ: (10.46, 0.890e6),
    QuantFormat.W4A16_AWQ: (2.92, 3.72e6),
    QuantFormat.W8A8_INT8: (11.02, 1.20e6),
    QuantFormat.NVFP4: (8.43, 0.0),
}
"""(a, b) per format that calibrates; tests/unit/test_jobsize.py checks them against each figure."""
DEFAULT_CALIBRATION_RATE = CALIBRATION_RATES[QuantFormat.NVFP4]
"""A format that calibrates and was not measured: a calibration forward with observers (nvfp4's)."""
EVAL_GPU_EFFICIENCY = 0.12
"""Share of the bf16 peak the evaluation's forward passes reach (assumed: the fastest calibration
measured, nvfp4's forward with observers, reached 11.8% of the H200's peak; the assumed 25% of
earlier releases was twice what any measured pass reached)."""


@dataclass(frozen=True)
class JobInputs:
    """What of the spec and policy the sizing reads."""

    calibration_samples: int = 512
    calibration_seq_len: int = 2048
    eval_samples: int = 64
    eval_seq_len: int = 2048
    adapter_eval_samples: int = 0
    """Windows the LoRA adapters' gates score, all adapters together (each on both models)."""
    gpus: int | None = None
    """The policy's `quantizationJob.gpus` when it sets it (None: sized here)."""
    max_gpus: int | None = None
    """The policy's `maxQuantizationJobGPUs`."""
    node_selector: Mapping[str, str] | None = None
    """The policy's `quantizationJob.nodeSelector`: only pools whose nodes carry these labels."""
    volume_threshold_gib: int = 100
    max_copy_gib: int | None = None
    """The policy's `maxSourceCopyGiB`: the largest already-quantized source a `none` Job copies."""


def source_bytes(shape: ModelShape) -> float:
    """The source checkpoint's size: 16-bit weights (32-bit when config.json says float32), or the
    quantized size of an already-quantized source."""
    sq = shape.source_quantization
    if sq is not None and sq.format is not None:
        return estimate_weights(shape, sq.format, ()).total_bytes
    per = 4 if (shape.torch_dtype or "").lower() in ("float32", "torch.float32") else 2
    return float(shape.total_params * per)


def bf16_bytes(shape: ModelShape) -> float:
    return float(shape.total_params * 2)


@dataclass(frozen=True)
class LayerFacts:
    """What one decoder layer holds during calibration, from the model's shape."""

    weight_bytes: float
    """The layer's Linear weights at 16 bits (the largest layer: all of a layer's experts)."""
    active_params: float
    """Linear parameters one token passes through (the routed experts' share of an MoE layer)."""
    hessian_bytes: float
    """GPTQ: one fp32 Hessian (in-features²) per Linear of the layer."""
    largest_hessian_bytes: float
    largest_linear_params: float
    widest: int
    """The widest activation: max(hidden, intermediate, expert intermediate)."""


def layer_facts(shape: ModelShape) -> LayerFacts:
    layers = max(shape.num_layers, 1)
    h, i = shape.hidden_size, shape.intermediate_size
    m = shape.moe_intermediate_size or i
    widest = max(h, i, m)
    dense = 6 * h * h + i * i  # q, k, v, o (≈ hidden² each), gate/up (hidden²), down (intermediate²)
    if shape.num_experts:
        dense = 4 * h * h + shape.num_experts * (2 * h * h + m * m)
    attention_out = shape.num_attention_heads * shape.head_dim
    return LayerFacts(
        weight_bytes=shape.linear_params / layers * 2, active_params=shape.linear_active_params / layers,
        hessian_bytes=4.0 * dense, largest_hessian_bytes=4.0 * widest * widest,
        largest_linear_params=float(max(h * max(i, m), h * attention_out)), widest=widest)


def calibration_gpu_bytes(shape: ModelShape, fmt: QuantFormat, samples: int, seq_len: int) -> float:
    """The peak torch allocates on one GPU while calibrating ``fmt`` (module docstring, docs/jobs.md):
    one layer's weights and working copies, one sample's activations, GPTQ's Hessians and solve,
    AWQ's cached outputs of every sample. Without the CUDA context (see ``gpu_holds``)."""
    lf = layer_facts(shape)
    need = LAYER_WEIGHT_COPIES * lf.weight_bytes
    if FORMAT_FACTS[fmt].needs_calibration_data:
        need += seq_len * (shape.hidden_size + lf.widest) * 2  # one sample through the layer, bf16
    if fmt in (QuantFormat.W4A16_GPTQ, QuantFormat.W8A8_INT8):
        need += (lf.hessian_bytes + GPTQ_SOLVE_HESSIAN_COPIES * lf.largest_hessian_bytes
                 + GPTQ_SOLVE_WEIGHT_COPIES * 4 * lf.largest_linear_params)
    if fmt is QuantFormat.W4A16_AWQ:
        need += awq_gpu_bytes(shape, samples, seq_len)
    return need


def awq_offloads_inputs(shape: ModelShape) -> bool:
    """Whether AWQ keeps its cached inputs in host memory: llm-compressor 0.14's ``AWQModifier``
    (``on_initialize``) sets ``offload_device`` to the CPU when the recipe names none and
    ``is_moe_model`` finds a module whose class name holds ``MoE`` or ``Expert``, or a config
    attribute holding ``moe`` or ``expert`` (``num_local_experts``, ``num_experts``,
    ``n_routed_experts``...): a model with experts, which the Job's recipe (fewerbits_quantjob.recipes:
    ``AWQModifier`` without arguments) leaves to that default."""
    return shape.is_moe


def awq_gpu_bytes(shape: ModelShape, samples: int, seq_len: int) -> float:
    """What AWQ holds on the GPU for every calibration token: its outputs, and its cached inputs
    unless it offloads them (``awq_offloads_inputs``)."""
    per_token = AWQ_GPU_OUTPUTS + (0.0 if awq_offloads_inputs(shape) else AWQ_CACHED_INPUTS)
    return per_token * samples * seq_len * shape.hidden_size * 2


def awq_cache_bytes(shape: ModelShape, samples: int, seq_len: int) -> float:
    """AWQ's whole cache, wherever it is held (all in host memory for a Job without GPUs)."""
    return awq_gpu_bytes(shape, samples, seq_len) + awq_host_bytes(shape, samples, seq_len)


def awq_host_bytes(shape: ModelShape, samples: int, seq_len: int) -> float:
    """What AWQ holds in host memory for a model whose AWQ offloads its cached inputs (pinned pages:
    ``_apply_smoothing`` pins each batch before the grid search): the inputs of every parent module
    of one decoder layer, for every calibration token, since llm-compressor caches them all in the
    layer's calibration pass and frees each only once its mapping is smoothed. Those parents are the
    attention (its input, hidden wide; and ``o_proj``'s where ``v_proj`` maps onto it: multi-head
    attention), the MoE block (hidden wide), and every expert's ``down_proj`` (its intermediate
    width), each over every token: llm-compressor's oneshot runs every expert on every token while
    calibrating (``moe_calibrate_all_experts``, default True, which the Job leaves), and so do the
    shared experts. Measured on the CPU with the zoo's Mixtral and Qwen3-MoE (the caches' bytes at
    the start of smoothing: 10.02 and 6.02 × tokens × hidden × 2 bytes, this sum 10.0 and 6.0;
    tests/unit/test_jobsize_moe_awq.py)."""
    if not awq_offloads_inputs(shape):
        return 0.0
    mha = shape.num_kv_heads == shape.num_attention_heads and not shape.mla
    widths = (2 * shape.hidden_size + (shape.num_attention_heads * shape.head_dim if mha else 0)
              + shape.num_experts * shape.moe_intermediate_size + shape.shared_expert_intermediate_size)
    return float(samples * seq_len * widths * 2)


def gpu_holds(memory_gib: float, need: float) -> bool:
    """One GPU of ``memory_gib`` holds a calibration need (plus the CUDA context) within the usable
    fraction."""
    return need + CUDA_CONTEXT_GIB * GIB <= memory_gib * GIB * GPU_USABLE_FRACTION


def calibration_seconds_per_layer(shape: ModelShape, fmt: QuantFormat, tokens: int, bf16_tflops: float) -> float:
    """One decoder layer's calibration on a GPU of ``bf16_tflops`` (``CALIBRATION_RATES``)."""
    a, b = CALIBRATION_RATES.get(fmt, DEFAULT_CALIBRATION_RATE)
    lf = layer_facts(shape)
    return tokens * (a * 2 * lf.active_params + b * shape.hidden_size) / (bf16_tflops * 1e12)


def _round_gib(x: float) -> int:
    return max(1, math.ceil(x / GIB))


def _pool_ok(pool: GPUPool, selector: Mapping[str, str] | None) -> bool:
    if not selector:
        return True
    labels = {**pool.common_labels, **pool.node_selector}
    return all(labels.get(k) == v for k, v in selector.items())


@dataclass(frozen=True)
class _Choice:
    pool: GPUPool | None
    gpus: int
    offload: float


def no_pool_reason(shape: ModelShape, fmt: QuantFormat, pools: Sequence[GPUPool], inputs: JobInputs,
                   gpu_need: float) -> str:
    """Why no pool runs the calibration, with the figures and what would fit. Lowering
    llm-compressor's batch size cannot help: the Job calibrates one sample at a time already (oneshot's
    default ``batch_size`` of 1), and AWQ caches every sample's outputs whatever the batch."""
    selector = "" if not inputs.node_selector else " matching the policy's quantizationJob.nodeSelector"
    why = (f"no GPU pool{selector} holds the calibration of {fmt.value}: it needs {gpu_need / GIB:.1f} GiB on one GPU "
           f"plus {CUDA_CONTEXT_GIB:g} GiB of CUDA context within {GPU_USABLE_FRACTION:.0%} of the GPU's memory")
    if not pools:
        return why
    largest = max(pools, key=lambda p: p.memory_gib)
    why += f"; the largest GPU has {largest.memory_gib:.1f} GiB ({largest.product})"
    if fmt is QuantFormat.W4A16_AWQ and inputs.calibration_samples:
        cache = awq_gpu_bytes(shape, inputs.calibration_samples, inputs.calibration_seq_len)
        per_sample = cache / inputs.calibration_samples
        room = largest.memory_gib * GIB * GPU_USABLE_FRACTION - CUDA_CONTEXT_GIB * GIB - (gpu_need - cache)
        fits = max(0, int(room // per_sample))
        why += (f"; AWQ caches every calibration sample's layer outputs on the GPU ({cache / GIB:.1f} GiB for "
                f"{inputs.calibration_samples} samples × {inputs.calibration_seq_len} tokens × hidden "
                f"{shape.hidden_size}{', its inputs kept in host memory' if awq_offloads_inputs(shape) else ''}), "
                f"so that GPU holds at most {fits} samples of {inputs.calibration_seq_len} "
                "tokens: lower spec.quantization.calibration.samples or maxSeqLength, choose w4a16-gptq, "
                "or add a pool with more GPU memory")
    return why


def choose_pool(shape: ModelShape, fmt: QuantFormat, pools: Sequence[GPUPool], inputs: JobInputs,
                gpu_need: float) -> tuple[_Choice | None, str | None]:
    """The pool and GPU count: a pool whose GPU holds a calibration layer, and on it the fewest GPUs
    that hold the bf16 model for evaluation (capped by the node and the policy). Prefers no
    offload, then the fewest GPUs, then the least GPU memory. (None, why) when no pool can."""
    want = inputs.gpus
    cap = inputs.max_gpus
    if want == 0 or cap == 0:
        return _Choice(None, 0, 0.0), None
    model = bf16_bytes(shape) * 1.05  # + the evaluation's activations and logits
    choices: list[_Choice] = []
    # A policy nodeSelector that matches no node seen yet (nodes a cluster autoscaler adds on
    # demand, or labels applied later) sizes on the pools there are; the Job keeps the selector and
    # waits for a matching node. One that matches pools too small is refused below.
    matching = [p for p in pools if _pool_ok(p, inputs.node_selector)] or list(pools)
    for pool in matching:
        if not gpu_holds(pool.memory_gib, gpu_need):
            continue
        usable = pool.memory_gib * GIB * GPU_USABLE_FRACTION
        n = want if want is not None else math.ceil(model / usable)
        n = max(1, min(n, pool.gpus_per_node, cap if cap is not None else n))
        choices.append(_Choice(pool, n, max(0.0, model - n * usable)))
    if not choices:
        return None, no_pool_reason(shape, fmt, matching, inputs, gpu_need)
    best = min(choices, key=lambda c: (c.offload > 0, c.offload, c.gpus, c.gpus * c.pool.memory_gib, c.pool.name))
    return best, None


def estimate_minutes(shape: ModelShape, fmt: QuantFormat, src: float, out: float, choice: _Choice,
                     inputs: JobInputs) -> float:
    minutes = START_MINUTES + src / (DOWNLOAD_GBPS * 1e9) / 60 + out / (UPLOAD_GBPS * 1e9) / 60
    if fmt is QuantFormat.NONE:
        return minutes  # the source's files are the artifact: download, upload, nothing between
    minutes += (src / LOAD_BYTES_PER_SECOND + out / SAVE_BYTES_PER_SECOND + bf16_bytes(shape) * 2 / LOAD_BYTES_PER_SECOND) / 60
    flops_per_token = 2 * shape.active_params
    tokens = inputs.calibration_samples * inputs.calibration_seq_len
    if choice.pool is not None:
        tflops = choice.pool.bf16_tflops or 100.0
        if FORMAT_FACTS[fmt].needs_calibration_data:
            minutes += max(shape.num_layers, 1) * calibration_seconds_per_layer(shape, fmt, tokens, tflops) / 60
        rate = tflops * 1e12 * EVAL_GPU_EFFICIENCY
    else:
        rate = CPU_CALIBRATION_FLOPS
        if FORMAT_FACTS[fmt].needs_calibration_data:
            minutes += tokens * flops_per_token / rate * (1 + GPTQ_SOLVE_FACTOR) / 60
    eval_tokens = 2 * (inputs.eval_samples + inputs.adapter_eval_samples) * min(inputs.eval_seq_len, 512)
    minutes += eval_tokens * flops_per_token / rate / 60
    if choice.offload:
        # Every evaluation batch streams the offloaded layers from host memory.
        batches = 2 * math.ceil(inputs.eval_samples / 8)
        minutes += batches * choice.offload / (PCIE_GBPS * 1e9) / 60
    return minutes


def copy_refusal(shape: ModelShape, src: float, minutes: int, cap_gib: int) -> str:
    """Why the policy refuses to copy an already-quantized source, with the figures."""
    sq = shape.source_quantization
    what = f"already {sq.format.value}" if sq is not None and sq.format is not None else "a 16-bit source served as it is"
    return (f"the source is {what}: served as it is, its `none` Job copies {src / GIB:,.0f} GiB unchanged into "
            f"spec.storage (about {minutes} min); rules.maxSourceCopyGiB allows {cap_gib} GiB: raise it, or point "
            "spec.source at a smaller checkpoint")


def size_job(shape: ModelShape, fmt: QuantFormat, pools: Sequence[GPUPool], inputs: JobInputs,
             ignore: Iterable[str] = ("lm_head",)) -> tuple[QuantizationJobSize | None, str | None]:
    """The Job for one artifact, or (None, why) when no pool can run it."""
    src = source_bytes(shape)
    out = src if fmt is QuantFormat.NONE else estimate_weights(shape, fmt, ignore).total_bytes
    # A `none` Job uploads the downloaded files themselves: one copy on disk.
    disk = (src + (0 if fmt is QuantFormat.NONE else out)) * (1 + HEADROOM) + DISK_FIXED_GIB * GIB
    if fmt is QuantFormat.NONE:
        choice = _Choice(None, 0, 0.0)
        minutes = math.ceil(estimate_minutes(shape, fmt, src, out, choice, inputs))
        if inputs.max_copy_gib is not None and src / GIB > inputs.max_copy_gib:
            return None, copy_refusal(shape, src, minutes, inputs.max_copy_gib)
        return QuantizationJobSize(
            format=fmt, gpus=0, gpuMemoryGiB=0.0, memoryGiB=_round_gib(NONE_MEMORY_GIB * GIB),
            ephemeralStorageGiB=_round_gib(disk), estimatedMinutes=minutes,
            volume="ephemeral" if disk / GIB > inputs.volume_threshold_gib else "emptyDir"), None
    samples = inputs.calibration_samples if FORMAT_FACTS[fmt].needs_calibration_data else 0
    intermediates = 2 * samples * inputs.calibration_seq_len * shape.hidden_size * 2
    gpu_need = calibration_gpu_bytes(shape, fmt, samples, inputs.calibration_seq_len)
    choice, why = choose_pool(shape, fmt, pools, inputs, gpu_need)
    if choice is None:
        return None, why
    if choice.gpus:
        # The evaluation's offloaded layers sit in host memory the quantize stage already used;
        # an MoE model's AWQ keeps its cached inputs there while it calibrates.
        host_cache = awq_host_bytes(shape, samples, inputs.calibration_seq_len) if fmt is QuantFormat.W4A16_AWQ else 0
        peak = max(RSS_BASE_GIB * GIB + RSS_PER_SOURCE_BYTE * src + intermediates + host_cache,
                   RSS_BASE_GIB * GIB + choice.offload)
    else:
        # Without a GPU every tensor of the calibration is in host memory, AWQ's whole cache included.
        host_cache = awq_cache_bytes(shape, samples, inputs.calibration_seq_len) if fmt is QuantFormat.W4A16_AWQ else 0
        peak = max(CPU_RSS_BASE_GIB * GIB + CPU_RSS_PER_SOURCE_BYTE * src,
                   RSS_BASE_GIB * GIB + RSS_PER_SOURCE_BYTE * src + intermediates + host_cache)
    memory = peak * (1 + HEADROOM)
    return QuantizationJobSize(
        format=fmt, gpus=choice.gpus, gpuMemoryGiB=round(gpu_need / GIB, 1) if choice.gpus else 0.0,
        memoryGiB=_round_gib(memory), ephemeralStorageGiB=_round_gib(disk),
        estimatedMinutes=math.ceil(estimate_minutes(shape, fmt, src, out, choice, inputs)),
        pool=choice.pool.name if choice.pool is not None else None,
        evaluationOffloadGiB=round(choice.offload / GIB, 1),
        volume="ephemeral" if disk / GIB > inputs.volume_threshold_gib else "emptyDir"), None


def deadline_seconds(job: QuantizationJobSize) -> int:
    """The Job's activeDeadlineSeconds: three times the estimate, at least an hour, at most the
    API's week."""
    return int(min(604800, max(3600, 3 * job.estimatedMinutes * 60)))


def cap_violations(job: QuantizationJobSize, max_gpus: int | None, max_memory_gib: int | None,
                   policy_sources: Mapping[str, str] | None = None) -> list[str]:
    """Why a policy cap refuses this Job, with the figures."""
    src = policy_sources or {}
    out = []
    if max_memory_gib is not None and job.memoryGiB > max_memory_gib:
        who = f" (policy {src['maxQuantizationJobMemoryGiB']})" if "maxQuantizationJobMemoryGiB" in src else ""
        out.append(f"{job.format.value}: the quantization Job needs {job.memoryGiB} GiB of memory; "
                   f"rules.maxQuantizationJobMemoryGiB{who} allows {max_memory_gib} GiB")
    return out


def inputs_from(spec, placement=None, rules=None, volume_threshold_gib: int = 100) -> JobInputs:
    """JobInputs from an effective QuantizedModelSpec (or None: the API's defaults) and the combined
    policy's ``quantizationJob`` placement and rules."""
    from fewerbits_api.quantizedmodel import CalibrationSpec, QualityGateSpec

    calib = spec.quantization.calibration if spec is not None else CalibrationSpec()
    gate = (spec.quantization.qualityGate if spec is not None else None) or QualityGateSpec()
    return JobInputs(
        calibration_samples=calib.samples, calibration_seq_len=calib.maxSeqLength,
        eval_samples=gate.evalSamples, eval_seq_len=calib.maxSeqLength,
        adapter_eval_samples=sum(a.gate.evalSamples or gate.evalSamples for a in getattr(spec, "adapters", None) or ()),
        gpus=placement.gpus if placement is not None and "gpus" in placement.model_fields_set else None,
        max_gpus=rules.maxQuantizationJobGPUs if rules is not None else None,
        node_selector=dict(placement.nodeSelector) if placement is not None and placement.nodeSelector else None,
        volume_threshold_gib=volume_threshold_gib,
        max_copy_gib=getattr(rules, "maxSourceCopyGiB", None) if rules is not None else None)


def size_plan_jobs(shape: ModelShape, plan, pools: Sequence[GPUPool], inputs: JobInputs
                   ) -> tuple[list[QuantizationJobSize], list[str]]:
    """``plan_job_sizes`` with each unsized artifact told as one line, ``<format>: <why>``."""
    jobs, unsized = plan_job_sizes(shape, plan, pools, inputs)
    return jobs, [f"{fmt.value}: {why}" for fmt, why in unsized.items()]


def plan_job_sizes(shape: ModelShape, plan, pools: Sequence[GPUPool], inputs: JobInputs
                   ) -> tuple[list[QuantizationJobSize], dict[QuantFormat, str]]:
    """One Job size per artifact format the plan needs (a variant served as it is needs a `none`
    artifact), in the plan's order; and why, by format, for each artifact no pool can run."""
    formats: list[QuantFormat] = []
    for v in plan.variants:
        fmt = QuantFormat.NONE if v.servedAsIs else v.format
        if fmt not in formats:
            formats.append(fmt)
    jobs: list[QuantizationJobSize] = []
    unsized: dict[QuantFormat, str] = {}
    ignore = tuple(plan.ignore) if plan.ignore is not None else ("lm_head",)
    for fmt in formats:
        job, why = size_job(shape, fmt, pools, inputs, ignore)
        if job is None:
            unsized[fmt] = why
        else:
            jobs.append(job)
    return jobs, unsized


def job_pool_selectors(job: QuantizationJobSize, pools: Sequence[GPUPool]) -> list[dict[str, str]]:
    """Node selectors of the pools that can run ``job``: its chosen pool first, then every other
    pool whose GPU holds the calibration layer and whose nodes have its GPU count."""
    chosen = [p for p in pools if p.name == job.pool]
    others = sorted((p for p in pools if p.name != job.pool and p.gpus_per_node >= job.gpus
                     and gpu_holds(p.memory_gib, job.gpuMemoryGiB * GIB)), key=lambda p: p.name)
    return [dict(p.node_selector) for p in chosen + others if p.node_selector]
