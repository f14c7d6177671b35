"""``fewerbits plan``: what the operator would plan for a model on some GPU pools, offline.

    fewerbits plan --model-config config.json --gpu NVIDIA-H100-80GB-HBM3:8 --gpu NVIDIA-L4:1
    fewerbits plan --model-config config.json --nodes nodes.yaml --policy policy.yaml -o json
    fewerbits plan --model-config config.json --gpu NVIDIA-L4:1 --adapter plays=./plays-lora

Pools come from ``--gpu PRODUCT:COUNT`` (facts from the GPU catalog; ``PRODUCT:COUNT:MEMORY_GIB:CC``
for a product the catalog lacks) and/or ``--nodes`` (Node
objects as ``kubectl get nodes -o yaml`` prints them); with neither, every catalog GPU at 1 and
8 per node. Exit status: 0 when some pool serves the model, 1 when every pool is rejected, 2 for
bad input (a missing or malformed file, an unknown format or product, a malformed ``--gpu``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fewerbits_api.adapters import ADAPTER_NAME
from fewerbits_api.errors import format_validation_error
from fewerbits_api.formats import KVCacheSetting, QuantFormat
from fewerbits_api.quantizedmodel import PlanStatus

from fewerbits_operator.planner.lora import AdapterConfigError, AdapterFacts, adapter_facts
from fewerbits_operator.planner.vllm_args import lora_args
from fewerbits_operator.planner import (
    GPUPool,
    ModelConfigError,
    ModelShape,
    PlanRequest,
    load_model_shape,
    plan,
    pool_from_product,
    pools_from_nodes,
)

DEFAULT_GPU_COUNTS = (1, 8)
# The products of the GPU table in docs/architecture.md (not every catalog variant) for the no-pools overview.
DEFAULT_PRODUCTS = (
    "Tesla-T4", "NVIDIA-A10G", "NVIDIA-L4", "NVIDIA-L40S", "NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-SXM4-80GB",
    "NVIDIA-H100-80GB-HBM3", "NVIDIA-H200", "NVIDIA-B200",
)


class InputError(Exception):
    """Bad input: printed as one line, exit status 2."""


GPU_ARG_SYNTAX = ("PRODUCT:GPUS or PRODUCT:GPUSxNODES, then :MEMORY_GIB:CC for a product the catalog lacks, e.g. "
                  "NVIDIA-H100-80GB-HBM3:8, NVIDIA-H100-80GB-HBM3:8x4 or NVIDIA-RTX-PRO-6000:4:96:12.0 (96 GiB per "
                  "GPU, compute capability 12.0)")


def _cc_arg(text: str) -> tuple[int, int] | None:
    major, dot, minor = text.partition(".")
    if not major.isdigit() or (dot and not minor.isdigit()):
        return None
    return int(major), int(minor or 0)


def _gpu_arg(value: str) -> tuple[str, int, int, float | None, tuple[int, int] | None]:
    """``PRODUCT:GPUS[xNODES]`` (a pool of NODES nodes, 1 when left out), optionally followed by
    ``:MEMORY_GIB:CC`` for a product the catalog does not know (GFD product labels hold no ``:``)."""
    parts = value.split(":")
    memory = cc = None
    if len(parts) == 4:
        product, count, mem_text, cc_text = parts
        try:
            memory = float(mem_text)
        except ValueError:
            memory = None
        cc = _cc_arg(cc_text)
        if memory is None or not memory > 0 or cc is None:
            raise argparse.ArgumentTypeError(
                f"{value!r}: MEMORY_GIB must be a number above 0 (GiB per GPU) and CC a compute capability "
                f"MAJOR.MINOR such as 9.0; expected {GPU_ARG_SYNTAX}")
    elif len(parts) in (1, 2):
        product, count = (parts[0], "1") if len(parts) == 1 else parts
    else:
        raise argparse.ArgumentTypeError(f"{value!r}: expected {GPU_ARG_SYNTAX}")
    count, x, nodes = count.lower().partition("x")
    if not product or not count.isdigit() or int(count) < 1 or (x and (not nodes.isdigit() or int(nodes) < 1)):
        raise argparse.ArgumentTypeError(f"{value!r}: GPUS and NODES must be at least 1; expected {GPU_ARG_SYNTAX}")
    return product, int(count), int(nodes) if x else 1, memory, cc


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be at least 1")
    return n


def _fraction(value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 < f <= 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be in (0, 1]")
    return f


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan format, dtype, KV cache and tensor parallelism per GPU pool for a model, offline",
        description=__doc__.split("\n\n")[0].strip() if __doc__ else None,
    )
    p.add_argument("--model-config", required=True, type=Path, metavar="PATH",
                   help="the model's Hugging Face config.json (or a directory holding it)")
    p.add_argument("--gpu", action="append", type=_gpu_arg, default=[], metavar="PRODUCT:GPUS[xNODES][:MEMORY_GIB:CC]",
                   help="a pool by its nvidia.com/gpu.product value, GPUs per node and nodes (default 1; "
                        "a model no single node holds is planned across nodes), e.g. NVIDIA-H100-80GB-HBM3:8x4; "
                        "a product the catalog lacks also needs its memory per GPU in GiB and compute capability, "
                        "e.g. NVIDIA-RTX-PRO-6000:4:96:12.0 (repeatable)")
    p.add_argument("--nodes", type=Path, metavar="NODES.yaml",
                   help="Node objects as `kubectl get nodes -o yaml` prints them")
    p.add_argument("--policy", type=Path, metavar="POLICY.yaml",
                   help="a QuantizationPolicy: its defaults, allowedFormats, maxGPUsPerReplica and formatByGPUFamily apply")
    p.add_argument("--format", choices=[f.value for f in QuantFormat], default=None,
                   help="quantization format (default: auto)")
    p.add_argument("--kv-cache", choices=[k.value for k in KVCacheSetting], default=None,
                   help="KV-cache setting (default: auto)")
    p.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N")
    p.add_argument("--min-concurrent-sequences", type=_positive_int, default=None, metavar="N")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="F")
    p.add_argument("--served-model-name", default=None, metavar="NAME")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="a LoRA adapter by its adapter_config.json (or a directory holding it): checked against the "
                        "model, and each pool's LoRA buffers planned (repeatable)")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------ inputs


def _load_yaml_docs(path: Path, what: str) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} {path}: no such file") from None
    except OSError as e:
        raise InputError(f"{what} {path}: cannot read: {e.strerror or e}") from None
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise InputError(f"{what} {path}: not valid YAML: {e}") from None


def load_nodes(path: Path) -> list[dict]:
    """Node objects from a ``kubectl get nodes -o yaml`` List, a NodeList, multi-document YAML or
    JSON."""
    nodes: list[dict] = []
    for doc in _load_yaml_docs(path, "--nodes"):
        if not isinstance(doc, dict):
            raise InputError(f"--nodes {path}: expected Node objects or a List of them")
        if isinstance(doc.get("items"), list):
            nodes += [i for i in doc["items"] if isinstance(i, dict) and i.get("kind", "Node") == "Node"]
        elif doc.get("kind") == "Node":
            nodes.append(doc)
    return nodes


def load_policy(path: Path):
    """The QuantizationPolicy in a YAML file (the first one, if it holds several documents)."""
    from fewerbits_api.policy import QuantizationPolicy

    for doc in _load_yaml_docs(path, "--policy"):
        if isinstance(doc, dict) and doc.get("kind") == "QuantizationPolicy":
            try:
                return QuantizationPolicy.model_validate(doc)
            except ValidationError as e:
                lines = "; ".join(format_validation_error(e))
                raise InputError(f"--policy {path}: invalid QuantizationPolicy: {lines}") from None
    raise InputError(f"--policy {path}: no QuantizationPolicy in the file")


def build_request(args: argparse.Namespace, policy, adapters: tuple[AdapterFacts, ...] = ()) -> PlanRequest:
    """Command-line flags over the policy's defaults over the built-in defaults."""
    fields: dict[str, Any] = {}
    if policy is not None:
        d = policy.spec.defaults
        q, s = d.quantization, d.serving
        # Only defaults the policy sets explicitly: the models' own defaults are not the policy's.
        if q is not None:
            for name, key in (("format", "format"), ("kvCache", "kv_cache"), ("ignore", "ignore")):
                if name in q.model_fields_set:
                    fields[key] = getattr(q, name)
        if s is not None:
            for name, key in (("maxModelLen", "max_model_len"), ("minConcurrentSequences", "min_concurrent_sequences"),
                              ("gpuMemoryUtilization", "gpu_memory_utilization"), ("targets", "targets"),
                              ("servedModelName", "served_model_name")):
                if name in s.model_fields_set:
                    fields[key] = getattr(s, name)
        rules = policy.spec.rules
        if rules.allowedFormats:
            fields["allowed_formats"] = tuple(rules.allowedFormats)
        if rules.maxGPUsPerReplica is not None:
            fields["max_gpus_per_replica"] = rules.maxGPUsPerReplica
        fields["format_by_gpu_family"] = dict(policy.spec.formatByGPUFamily)
    for flag, key in (("format", "format"), ("kv_cache", "kv_cache"), ("max_model_len", "max_model_len"),
                      ("min_concurrent_sequences", "min_concurrent_sequences"),
                      ("gpu_memory_utilization", "gpu_memory_utilization"), ("served_model_name", "served_model_name")):
        value = getattr(args, flag)
        if value is not None:
            fields[key] = value
    if "targets" in fields:
        fields["targets"] = tuple(fields["targets"])
    if "ignore" in fields:
        fields["ignore"] = tuple(fields["ignore"])
    try:
        return PlanRequest(**fields, adapters=adapters)
    except ValidationError as e:
        raise InputError("; ".join(format_validation_error(e))) from None


def build_pools(args: argparse.Namespace) -> tuple[list[GPUPool], str | None]:
    pools: list[GPUPool] = []
    for product, count, nodes, memory, cc in args.gpu:
        try:
            pools.append(pool_from_product(product, count, nodes, memory_gib=memory, cc=cc))
        except ValueError as e:
            raise InputError(f"--gpu: {e}") from None
    if args.nodes is not None:
        from_nodes = pools_from_nodes(load_nodes(args.nodes))
        if not from_nodes:
            raise InputError(
                f"--nodes {args.nodes}: no GPU pools (nodes need a nvidia.com/gpu.product label, "
                "allocatable nvidia.com/gpu and must be schedulable)"
            )
        pools += from_nodes
    note = None
    if not pools:
        pools = [pool_from_product(p, n) for p in DEFAULT_PRODUCTS for n in DEFAULT_GPU_COUNTS]
        note = "no --gpu or --nodes: planning for every catalog GPU at " + " and ".join(map(str, DEFAULT_GPU_COUNTS)) + " per node"
    # The same pool named twice (a --gpu that is also in --nodes) is planned once.
    unique: dict[str, GPUPool] = {}
    for p in pools:
        unique.setdefault(p.name, p)
    return list(unique.values()), note


# ------------------------------------------------------------------------------ output


def load_adapters(values: list[str], shape: ModelShape) -> tuple[AdapterFacts, ...]:
    """``--adapter NAME=PATH`` values: each adapter_config.json read and checked against the model."""
    out = []
    for i, value in enumerate(values):
        name, eq, path = value.partition("=")
        if not eq or not re.fullmatch(ADAPTER_NAME.strip("^$"), name) or not path:
            raise InputError(f"--adapter {value!r}: expected NAME=PATH, NAME as a request names the adapter "
                             "(letters, digits, '.', '_', '-')")
        file = Path(path) / "adapter_config.json" if Path(path).is_dir() else Path(path)
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InputError(f"--adapter {name}: cannot read {file}: {getattr(e, 'strerror', None) or e}") from None
        if not isinstance(config, dict):
            raise InputError(f"--adapter {name}: {file} is not a JSON object")
        try:
            out.append(adapter_facts(name, config, shape, f"--adapter {name}"))
        except AdapterConfigError as e:
            raise InputError(str(e)) from None
    return tuple(out)


def plan_json(status: PlanStatus) -> dict:
    """Exactly ``{"variants": [...], "rejected": [{"pool", "reason"}], "ignore", "quantizationJobs": [...]}`` with
    the API's field names."""
    return status.model_dump(mode="json", by_alias=True)


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _wrap(prefix: str, text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=prefix, subsequent_indent=" " * len(prefix),
                         break_long_words=False, break_on_hyphens=False) or [prefix]


def _describe_model(path: Path, shape: ModelShape) -> str:
    kind = (
        f"{shape.total_params / 1e9:.2f}B parameters, {shape.active_params / 1e9:.2f}B active "
        f"({shape.num_experts} experts, {shape.experts_per_token} per token)"
        if shape.is_moe
        else f"{shape.total_params / 1e9:.2f}B parameters"
    )
    attn = (
        f"{shape.num_attention_heads} heads, MLA" if shape.mla
        else f"{shape.num_attention_heads} heads, {shape.num_kv_heads} KV heads of {shape.head_dim}"
    )
    extra = ""
    if shape.sliding_layers:
        extra += (f", sliding window of {shape.sliding_window:,} tokens on {shape.sliding_layers} of "
                  f"{shape.num_layers} layers")
    sq = shape.source_quantization
    if sq is not None:
        extra += (f"; already quantized: {sq.format.value} ({sq.detail})" if sq.format is not None
                  else f"; already quantized ({sq.detail})")
    return (
        f"Model {path.name} ({shape.model_type}): {kind}, {shape.num_layers} layers, {attn}, "
        f"up to {shape.max_model_len:,} tokens{extra}"
    )


def plan_table(status: PlanStatus, header: str, note: str | None = None, width: int | None = None) -> str:
    width = width or max(80, min(shutil.get_terminal_size((120, 24)).columns, 160))
    out: list[str] = _wrap("", header, width)
    if note:
        out += _wrap("", note, width)
    out.append("")
    if status.variants:
        headers = ["POOL", "GPU", "FORMAT", "DTYPE", "KV", "TP", "NODES", "MAX LEN", "WEIGHTS", "KV TOKENS", "DECODE TOK/S"]
        rows = [
            [v.pool, v.gpuProduct, v.format.value + (" (as-is)" if v.servedAsIs else ""), v.dtype, v.kvCacheDtype, str(v.tensorParallelSize),
             str(v.nodesPerReplica), f"{v.maxModelLen:,}", f"{v.weightsGiB:.1f} GiB", f"{v.kvCacheTokens:,}", f"{v.decodeTokensPerSecond:,.0f}"]
            for v in status.variants
        ]
        out += _table(headers, rows, right={5, 6, 7, 8, 9, 10})
    else:
        out.append("No pool can serve this model.")
    pad = max((len(p) for p in [*(v.pool for v in status.variants), *(r.pool for r in status.rejected)]), default=0)
    warned = [(v.pool, w) for v in status.variants for w in v.warnings]
    if warned:
        out += ["", "Warnings:"]
        for pool, w in warned:
            out += _wrap(f"  {pool + ':':<{pad + 1}} ", w, width)
    with_lora = [v for v in status.variants if v.lora is not None or v.adaptersRefused]
    if with_lora:
        out += ["", "LoRA adapters:"]
        for v in with_lora:
            text = v.adaptersRefused or (
                f"{', '.join(v.lora.adapters)}: {' '.join(lora_args(v.lora))}; {v.lora.gpuMemoryGiB:.2f} GiB per GPU "
                "of buffers (flags for when pods serve adapters: not in this version)")
            out += _wrap(f"  {v.pool + ':':<{pad + 1}} ", text, width)
    if status.rejected:
        out += ["", "Rejected pools:"]
        for r in status.rejected:
            out += _wrap(f"  {r.pool + ':':<{pad + 1}} ", r.reason, width)
    if status.variants:
        # One line per pool, unwrapped, so it can be copied.
        out += ["", "vLLM arguments (after the model path):"]
        out += [f"  {v.pool + ':':<{pad + 1}} {' '.join(v.vllmArgs)}" for v in status.variants]
    out.append(
        "\nDecode tok/s is a batch-1, memory-bound upper bound (bandwidth / bytes read per token); "
        "expect roughly 60-80% of it."
    )
    return "\n".join(out) + "\n"


def with_job_sizes(shape: ModelShape, status: PlanStatus, pools: list[GPUPool], policy) -> tuple[PlanStatus, list[str]]:
    """The plan with each artifact's quantization Job sized (``quantizationJobs``), under the
    policy's Job placement and caps, and the artifacts no pool can quantize."""
    from fewerbits_operator.planner.jobsize import inputs_from, size_plan_jobs
    from fewerbits_operator.base.settings import OperatorSettings

    rules = policy.spec.rules if policy is not None else None
    inputs = inputs_from(None, rules.quantizationJob if rules else None, rules,
                         OperatorSettings().job_volume_threshold_gib)
    jobs, unsized = size_plan_jobs(shape, status, pools, inputs)
    return status.model_copy(update={"quantizationJobs": jobs}), unsized


def jobs_table(status: PlanStatus, unsized: list[str]) -> str:
    """The quantization Jobs the plan needs, one row per artifact."""
    if not status.quantizationJobs and not unsized:
        return ""
    out = ["", "Quantization Jobs (one per artifact; requests and limits of the Job):"]
    if status.quantizationJobs:
        headers = ["FORMAT", "POOL", "GPUS", "GPU MEM", "MEMORY", "DISK", "VOLUME", "EST. TIME", "EVAL OFFLOAD"]
        rows = [[j.format.value + (" (copy)" if j.format is QuantFormat.NONE else ""), j.pool or "-", str(j.gpus), f"{j.gpuMemoryGiB:.1f} GiB", f"{j.memoryGiB} GiB",
                 f"{j.ephemeralStorageGiB} GiB", j.volume, f"{j.estimatedMinutes} min",
                 f"{j.evaluationOffloadGiB:.1f} GiB" if j.evaluationOffloadGiB else "-"]
                for j in status.quantizationJobs]
        out += _table(headers, rows, right={2, 3, 4, 5, 7, 8})
    out += [f"  no Job for {u}" for u in unsized]
    if any(j.format is QuantFormat.NONE for j in status.quantizationJobs):
        out.append("none (copy): nothing is quantized; the Job downloads the source and uploads it unchanged to "
                   "spec.storage, which serving reads (a policy's rules.maxSourceCopyGiB caps it).")
    out.append("GPU MEM: one GPU's peak during calibration (one layer at a time, plus AWQ's cache of every sample; "
               "the pool must also hold 1.5 GiB of CUDA context); memory and disk are the Job's requests and limits "
               "(docs/jobs.md).")
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> int:
    try:
        shape = load_model_shape(args.model_config)
        policy = load_policy(args.policy) if args.policy is not None else None
        request = build_request(args, policy, load_adapters(args.adapter, shape))
        pools, note = build_pools(args)
    except (InputError, ModelConfigError) as e:
        print(f"fewerbits plan: {e}", file=sys.stderr)
        return 2
    status = plan(shape, pools, request)
    status, unsized = with_job_sizes(shape, status, pools, policy)
    if args.output == "json":
        sys.stdout.write(json.dumps(plan_json(status), indent=2) + "\n")
    else:
        sys.stdout.write(plan_table(status, _describe_model(args.model_config, shape), note))
        sys.stdout.write(jobs_table(status, unsized))
    return 0 if status.variants else 1
