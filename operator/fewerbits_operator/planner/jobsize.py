"""What a quantization Job needs, from the model's shape: host memory, disk, GPUs, the pool that
can hold its calibration and evaluation, and a wall-time estimate. Pure; no cluster access.

The model behind the figures (docs/jobs.md states it with the measurements):

* **Host memory.** The Job loads the whole source checkpoint on the CPU at its own dtype
  (``quantize.load_for_quantization``: llm-compressor's pipelines then move one layer at a time to
  the GPU). Measured on this project's machine (``bench/job_footprint.py``) the peak resident
  memory of the Job's load-quantize-save stages is ``RSS_BASE_GIB + RSS_PER_SOURCE_BYTE × source
  bytes`` (with the CPU evaluation too, for a Job without GPUs: ``CPU_RSS_*``); on top of that the sequential pipeline keeps every calibration sample's hidden states
  between layers (``samples × seq × hidden × 2 bytes``, twice: a layer's inputs and outputs), and
  ``HEADROOM`` for what a real checkpoint adds (a tokenizer, a larger vocabulary's logits).
* **Disk.** The source download (one copy: ``snapshot_download(local_dir=...)``), the quantized
  output, and ``HEADROOM`` plus ``DISK_FIXED_GIB`` (calibration data, tokenizer, temp files).
* **GPU.** Calibration onloads one decoder layer at a time: one GPU holds a layer at 16 bits
  twice (weights and the quantizer's working copy), GPTQ's Hessians (in-features² × 4 bytes per
  Linear), one sample's activations and the CUDA context. Evaluation loads one model at a time in
  bf16 with ``device_map="auto"``: the Job asks for the fewest GPUs of its pool that hold it; when
  a cap or the pool's node is smaller, accelerate keeps the rest in host memory (already counted:
  the host holds the whole model anyway) and streams it over PCIe on every forward pass.
* **Time.** Download at ``DOWNLOAD_GBPS``, load and save at the measured disk rates, calibration
  as forward FLOPs over the GPU's bf16 rate at ``GPU_EFFICIENCY`` (an assumption: no GPU was lent
  to measure it), evaluation likewise plus the offload's PCIe traffic, and a fixed start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from fewerbits_api.formats import FORMAT_FACTS, QuantFormat
from fewerbits_api.quantizedmodel import QuantizationJobSize

from .catalog import GPUPool
from .rules import estimate_weights
from .shape import ModelShape

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

# ---- assumed (stated in docs/jobs.md; to be replaced by figures measured on a GPU)
HEADROOM = 0.10
"""Extra fraction on memory and disk."""
DISK_FIXED_GIB = 5.0
CUDA_CONTEXT_GIB = 1.5
GPU_USABLE_FRACTION = 0.9
"""Share of a GPU's memory the Job plans to fill (allocator fragmentation, the CUDA context)."""
DOWNLOAD_GBPS = 0.2
"""Source download rate, GB/s (Hub or S3 into the pod)."""
GPU_EFFICIENCY = 0.25
"""Share of the GPU's bf16 peak a layer-by-layer calibration forward reaches."""
PCIE_GBPS = 20.0
"""Host-to-GPU rate for evaluation layers offloaded to host memory."""
START_MINUTES = 3.0
"""Image pull, container start, imports."""
GPTQ_SOLVE_FACTOR = 1.0
"""GPTQ's and AWQ's per-layer solve and search, as a multiple of the calibration forward time."""
NONE_MEMORY_GIB = 2.0
"""A `none` artifact (a source served as it is) streams files: no model in memory."""


@dataclass(frozen=True)
class JobInputs:
    """What of the spec and policy the sizing reads."""

    calibration_samples: int = 512
    calibration_seq_len: int = 2048
    eval_samples: int = 64
    eval_seq_len: int = 2048
    gpus: int | None = None
    """The policy's `quantizationJob.gpus` when it sets it (None: sized here)."""
    max_gpus: int | None = None
    """The policy's `maxQuantizationJobGPUs`."""
    node_selector: Mapping[str, str] | None = None
    """The policy's `quantizationJob.nodeSelector`: only pools whose nodes carry these labels."""
    volume_threshold_gib: int = 100


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


def layer_gpu_bytes(shape: ModelShape, fmt: QuantFormat, seq_len: int) -> float:
    """One GPU's need during calibration (sequential onloading): the largest decoder layer at 16
    bits twice, GPTQ's Hessians, one sample's activations, the CUDA context."""
    layers = max(shape.num_layers, 1)
    layer = shape.linear_params / layers * 2
    hessians = 0.0
    if fmt in (QuantFormat.W4A16_GPTQ,):
        h, i = shape.hidden_size, shape.intermediate_size
        dense = 6 * h * h + i * i  # q, k, v, o (≈ hidden² each), gate/up (hidden²), down (intermediate²)
        if shape.num_experts:
            m = shape.moe_intermediate_size or i
            dense = 4 * h * h + shape.num_experts * (2 * h * h + m * m)
        hessians = 4.0 * dense
    width = shape.hidden_size + max(shape.intermediate_size, shape.moe_intermediate_size)
    activations = seq_len * width * 4 * 4
    return 2 * layer + hessians + activations + CUDA_CONTEXT_GIB * GIB


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
        usable = pool.memory_gib * GIB * GPU_USABLE_FRACTION
        if usable < gpu_need:
            continue
        n = want if want is not None else math.ceil(model / usable)
        n = max(1, min(n, pool.gpus_per_node, cap if cap is not None else n))
        choices.append(_Choice(pool, n, max(0.0, model - n * usable)))
    if not choices:
        selector = "" if not inputs.node_selector else " matching the policy's quantizationJob.nodeSelector"
        return None, (f"no GPU pool{selector} holds one calibration layer: it needs {gpu_need / GIB:.1f} GiB on one GPU"
                      + (f"; the largest GPU has {max(p.memory_gib for p in pools):.1f} GiB" if pools else ""))
    best = min(choices, key=lambda c: (c.offload > 0, c.offload, c.gpus, c.gpus * c.pool.memory_gib, c.pool.name))
    return best, None


def estimate_minutes(shape: ModelShape, fmt: QuantFormat, src: float, out: float, choice: _Choice,
                     inputs: JobInputs) -> float:
    minutes = START_MINUTES + src / (DOWNLOAD_GBPS * 1e9) / 60
    if fmt is QuantFormat.NONE:
        return minutes
    minutes += (src / LOAD_BYTES_PER_SECOND + out / SAVE_BYTES_PER_SECOND + bf16_bytes(shape) * 2 / LOAD_BYTES_PER_SECOND) / 60
    flops_per_token = 2 * shape.active_params
    if choice.pool is not None:
        rate = (choice.pool.bf16_tflops or 100.0) * 1e12 * GPU_EFFICIENCY
    else:
        rate = CPU_CALIBRATION_FLOPS
    if FORMAT_FACTS[fmt].needs_calibration_data:
        tokens = inputs.calibration_samples * inputs.calibration_seq_len
        minutes += tokens * flops_per_token / rate * (1 + GPTQ_SOLVE_FACTOR) / 60
    eval_tokens = 2 * inputs.eval_samples * min(inputs.eval_seq_len, 512)
    minutes += eval_tokens * flops_per_token / rate / 60
    if choice.offload:
        # Every evaluation batch streams the offloaded layers from host memory.
        batches = 2 * math.ceil(inputs.eval_samples / 8)
        minutes += batches * choice.offload / (PCIE_GBPS * 1e9) / 60
    return minutes


def size_job(shape: ModelShape, fmt: QuantFormat, pools: Sequence[GPUPool], inputs: JobInputs,
             ignore: Iterable[str] = ("lm_head",)) -> tuple[QuantizationJobSize | None, str | None]:
    """The Job for one artifact, or (None, why) when no pool can run it."""
    src = source_bytes(shape)
    out = src if fmt is QuantFormat.NONE else estimate_weights(shape, fmt, ignore).total_bytes
    disk = (src + out) * (1 + HEADROOM) + DISK_FIXED_GIB * GIB
    if fmt is QuantFormat.NONE:
        choice = _Choice(None, 0, 0.0)
        return QuantizationJobSize(
            format=fmt, gpus=0, gpuMemoryGiB=0.0, memoryGiB=_round_gib(NONE_MEMORY_GIB * GIB),
            ephemeralStorageGiB=_round_gib(disk), estimatedMinutes=math.ceil(estimate_minutes(
                shape, fmt, src, out, choice, inputs)),
            volume="ephemeral" if disk / GIB > inputs.volume_threshold_gib else "emptyDir"), None
    samples = inputs.calibration_samples if FORMAT_FACTS[fmt].needs_calibration_data else 0
    intermediates = 2 * samples * inputs.calibration_seq_len * shape.hidden_size * 2
    gpu_need = layer_gpu_bytes(shape, fmt, inputs.calibration_seq_len)
    choice, why = choose_pool(shape, fmt, pools, inputs, gpu_need)
    if choice is None:
        return None, why
    if choice.gpus:
        # The evaluation's offloaded layers sit in host memory the quantize stage already used.
        peak = max(RSS_BASE_GIB * GIB + RSS_PER_SOURCE_BYTE * src + intermediates,
                   RSS_BASE_GIB * GIB + choice.offload)
    else:
        peak = max(CPU_RSS_BASE_GIB * GIB + CPU_RSS_PER_SOURCE_BYTE * src,
                   RSS_BASE_GIB * GIB + RSS_PER_SOURCE_BYTE * src + intermediates)
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
        gpus=placement.gpus if placement is not None and "gpus" in placement.model_fields_set else None,
        max_gpus=rules.maxQuantizationJobGPUs if rules is not None else None,
        node_selector=dict(placement.nodeSelector) if placement is not None and placement.nodeSelector else None,
        volume_threshold_gib=volume_threshold_gib)


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
                     and p.memory_gib * GPU_USABLE_FRACTION >= job.gpuMemoryGiB), key=lambda p: p.name)
    return [dict(p.node_selector) for p in chosen + others if p.node_selector]
