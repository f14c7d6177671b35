"""LoRA adapters in the plan: whether an adapter's config fits the base, what vLLM preallocates for
adapters on each GPU, and how many adapters a pool's batch can hold. Pure functions.

vLLM (``--enable-lora``) wraps every linear layer of the language model it can adapt and gives each
one buffers for ``--max-loras`` adapters of ``--max-lora-rank``, in the model's dtype, whatever the
adapters target: per matrix an A of rank × input width and a B of output width × rank, the side
that tensor parallelism splits split (vllm/lora/layers). Those bytes come out of what the KV cache
would get; adapters beyond ``--max-loras`` wait in host memory (``--max-cpu-loras``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fewerbits_api.adapters import VLLM_LORA_RANKS, LoraPlan
from fewerbits_api.quantizedmodel import PlanVariant, RejectedPool
from fewerbits_operator.planner.shape import ModelShape

GIB = 1024**3
LORA_DTYPE_BYTES = 2
"""vLLM keeps LoRA weights in the model's compute dtype: bfloat16 or float16."""


class AdapterConfigError(ValueError):
    """An adapter's adapter_config.json that vLLM would refuse, or that does not fit the base."""


@dataclass(frozen=True)
class AdapterFacts:
    """What the plan needs of one adapter, read from its adapter_config.json."""

    name: str
    rank: int
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class LoraSizing:
    """How a pool's vLLM is asked to hold the adapters."""

    names: tuple[str, ...]
    slots: int
    """--max-loras."""
    rank: int
    """--max-lora-rank (a value vLLM accepts)."""

    @property
    def cpu_slots(self) -> int:
        return len(self.names)


def vllm_rank(rank: int) -> int | None:
    """The smallest `--max-lora-rank` vLLM accepts that holds ``rank``; None above its largest."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def sizing(adapters: tuple[AdapterFacts, ...], slots: int | None = None) -> LoraSizing | None:
    """Every adapter at once (or ``slots`` of them per batch), at the largest rank among them."""
    if not adapters:
        return None
    rank = vllm_rank(max(a.rank for a in adapters))
    assert rank is not None, "adapter ranks are checked against vLLM's limit when read"
    return LoraSizing(tuple(a.name for a in adapters), slots or len(adapters), rank)


def lora_bytes_per_gpu(shape: ModelShape, lora: LoraSizing | None, tp: int, nodes: int = 1) -> float:
    """What vLLM preallocates on each GPU for ``lora`` (0 without adapters); a replica spanning
    ``nodes`` nodes holds a share of the layers on each."""
    if lora is None:
        return 0.0
    widths = 0.0
    for g in shape.linear_groups:
        if not g.in_features:
            continue  # the vision tower: vLLM adapts the language model
        split_in, split_out = (tp, 1) if g.row_parallel else (1, tp)
        widths += g.matrices * (g.in_features / split_in + g.out_features / split_out)
    return lora.slots * lora.rank * LORA_DTYPE_BYTES * widths / nodes


def slot_candidates(n: int) -> list[int]:
    """All ``n`` adapters in a batch, then halved down to one: 6 → [6, 3, 1]."""
    out = [n]
    while out[-1] > 1:
        out.append(max(1, out[-1] // 2))
    return out


PlanOne = Callable[[LoraSizing | None], PlanVariant | RejectedPool]


def plan_with_adapters(plan_one: PlanOne, adapters: tuple[AdapterFacts, ...], shape: ModelShape) -> PlanVariant | RejectedPool:
    """One pool's variant with room for the adapters: the base is planned as without them (the
    adapters never change its format, tensor parallelism or nodes); then as many adapters per batch
    as fit in that layout, the KV cache (and an automatic maxModelLen) giving up what their buffers
    take; with none fitting, the variant serves the base alone and says why no adapter is served there."""
    bare = plan_one(None)
    if not adapters or isinstance(bare, RejectedPool):
        return bare
    full = sizing(adapters)
    assert full is not None
    for slots in slot_candidates(len(adapters)):
        lora = sizing(adapters, slots)
        outcome = plan_one(lora)
        if isinstance(outcome, PlanVariant) and _same_layout(outcome, bare):
            return _with_lora(outcome, lora, full)
        last = outcome
    one = lora_bytes_per_gpu(shape, sizing(adapters, 1), bare.tensorParallelSize, bare.nodesPerReplica)
    return bare.model_copy(update={"adaptersRefused": _refusal(bare, last, full, one)})


def _same_layout(v: PlanVariant, bare: PlanVariant) -> bool:
    """Adapters never change the base's format or the GPUs and nodes a replica takes."""
    return (v.format, v.tensorParallelSize, v.nodesPerReplica) == (bare.format, bare.tensorParallelSize,
                                                                   bare.nodesPerReplica)


def _with_lora(variant: PlanVariant, lora: LoraSizing, full: LoraSizing) -> PlanVariant:
    warnings = list(variant.warnings)
    if lora.slots < full.slots:
        warnings.append(f"--max-loras narrowed to {lora.slots} of {full.slots} adapters: the buffers of all "
                        f"{full.slots} at rank {full.rank} would not leave the KV cache its sequences; the others wait "
                        f"in host memory (--max-cpu-loras {full.cpu_slots}) until a batch has room")
    return variant.model_copy(update={"warnings": warnings})


def _refusal(bare: PlanVariant, last: PlanVariant | RejectedPool, full: LoraSizing, one_bytes: float) -> str:
    why = last.reason if isinstance(last, RejectedPool) else (
        f"it then needs {last.format.value} on {last.tensorParallelSize} GPU(s) × {last.nodesPerReplica} node(s) "
        f"instead of {bare.format.value} on {bare.tensorParallelSize} × {bare.nodesPerReplica}")
    return (f"no adapter is served on this pool: the buffers of even one adapter at rank {full.rank} "
            f"({one_bytes / GIB:.2f} GiB per GPU) do not fit beside {bare.format.value} weights and the KV cache "
            f"({why}); serve the adapters on a pool with more "
            "GPU memory, lower their rank, or lower serving.maxModelLen or minConcurrentSequences")


def lora_plan(shape: ModelShape, lora: LoraSizing, tp: int, nodes: int) -> LoraPlan:
    """The plan's record of ``lora`` on a variant of ``tp`` GPUs per node over ``nodes`` nodes."""
    return LoraPlan(adapters=list(lora.names), maxLoras=lora.slots, maxLoraRank=lora.rank, maxCpuLoras=lora.cpu_slots,
                    gpuMemoryGiB=round(lora_bytes_per_gpu(shape, lora, tp, nodes) / GIB, 3))


# ------------------------------------------------------------------ the adapter's own config


def adapter_facts(name: str, config: Mapping[str, Any], shape: ModelShape, field: str) -> AdapterFacts:
    """The rank and modules of an adapter, or AdapterConfigError naming ``field`` (the adapter's
    `spec.adapters[i].source`) when vLLM would refuse it or it adapts what the base does not have."""
    where = f"{field}: adapter_config.json"
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterConfigError(f"{where} is a {config.get('peft_type')} adapter; vLLM serves LoRA adapters only")
    rank = _rank(config, where)
    for key, why in (("use_dora", "DoRA adapters"), ("modules_to_save", "modules_to_save (whole layers trained "
                     "beside the adapter, which vLLM would drop)")):
        if config.get(key):
            raise AdapterConfigError(f"{where} sets {key}: vLLM serves no {why}")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterConfigError(f"{where} trains biases (bias {config.get('bias')!r}); vLLM serves LoRA weights without bias")
    targets = _targets(config, shape, where)
    return AdapterFacts(name, rank, targets)


def _rank(config: Mapping[str, Any], where: str) -> int:
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise AdapterConfigError(f"{where}: rank_pattern must be an object of module patterns to ranks")
    ranks = [config.get("r")] + list(pattern.values())
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks):
        raise AdapterConfigError(f"{where}: r (and rank_pattern) must be positive integers, got {ranks}")
    rank = max(ranks)
    if vllm_rank(rank) is None:
        raise AdapterConfigError(f"{where}: rank {rank} is above {VLLM_LORA_RANKS[-1]}, the largest vLLM serves")
    return rank


def _targets(config: Mapping[str, Any], shape: ModelShape, where: str) -> tuple[str, ...]:
    """The adapter's target_modules, each matching a linear layer of the base's language model."""
    modules = [g.name for g in shape.linear_groups if g.in_features]
    kinds = sorted({m.rsplit(".", 1)[-1] for m in modules})
    raw = config.get("target_modules")
    if raw == "all-linear":
        return tuple(kinds)
    if isinstance(raw, str):
        # A pattern is not run here (a hostile one could hold a reconcile): name the modules.
        raise AdapterConfigError(f"{where}: target_modules is a pattern ({raw[:80]!r}); fewerbits checks named "
                                 f"modules: list them (this {shape.model_type} base's layers: {', '.join(kinds)}) "
                                 "or use 'all-linear'")
    if not isinstance(raw, list) or not raw or not all(isinstance(t, str) for t in raw):
        raise AdapterConfigError(f"{where}: target_modules must be a list of module names or a pattern, got {raw!r}")
    unknown = [t for t in raw if not any(m == t or m.endswith("." + t) for m in modules)]
    if unknown:
        raise AdapterConfigError(f"{where}: target_modules {', '.join(unknown)} name no linear layer of this "
                                 f"{shape.model_type} base (its layers: {', '.join(kinds)}); the adapter was trained "
                                 "for another architecture")
    layers = config.get("layers_to_transform")
    layers = [layers] if isinstance(layers, int) else layers or []
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise AdapterConfigError(f"{where}: layers_to_transform must be layer numbers, got {layers!r:.80}")
    bad = [i for i in layers if not 0 <= i < shape.num_layers]
    if bad:
        raise AdapterConfigError(f"{where}: layers_to_transform {bad} are not layers of this base "
                                 f"({shape.num_layers} layers)")
    return tuple(raw)
