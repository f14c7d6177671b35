"""Which layers of a model stay 16-bit because of its architecture: one table for the planner and
the quantization Job.

The recipe quantizes every ``Linear`` except the effective ``ignore`` list: the user's
``spec.quantization.ignore`` plus what the architecture requires. The planner sizes exactly that
(``fewerbits_operator.planner``), and the Job's recipe receives exactly that list
(``fewerbits_quantjob.recipes``), so the two cannot disagree, and the artifact's
``quantization_config.ignore`` (llm-compressor writes the module names it left alone) shows it.

What an architecture requires, and why (vLLM 0.33 and llm-compressor 0.14):

| model_type | kept 16-bit | why |
|---|---|---|
| mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3 | MoE router (`mlp.gate`, `block_sparse_moe.gate`) | vLLM builds the router as a `GateLinear` whose fast kernels need 16-bit weights; a quantized router changes which experts run |
| qwen2_moe, qwen3_moe | shared-expert gate | vLLM builds it as a `ReplicatedLinear` with `quant_config=None`: a quantized checkpoint tensor would not load |
| deepseek_v3 | multi-token-prediction layers (`model.layers.<num_hidden_layers..>`) | speculative-decoding heads; transformers does not build them, vLLM loads them only as a draft model |
| qwen2_vl, qwen2_5_vl | vision encoder and merger (`visual`) | llm-compressor's multimodal recipes keep them 16-bit; calibration text never reaches them (no quantized format is planned for these yet: ``QUANTIZE_BLOCKERS``) |
| llava, llava_next, gemma3, mistral3 | vision tower and multimodal projector | as above |

Model types the table does not know keep only the user's list, with a warning naming the type
(``EffectiveIgnore.warnings``). Dense decoders (llama, mistral, qwen2, qwen3, gemma, gemma2,
gemma3_text) need nothing beyond the user's list.

Patterns use llm-compressor's syntax: a module name, or ``re:`` and a regular expression that
must match the module name from its start (compressed-tensors ``re.match``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


@dataclass(frozen=True)
class KeepRule:
    """One group of layers an architecture keeps 16-bit."""

    pattern: str
    """llm-compressor ignore entry (``re:`` regular expression or module name)."""
    what: str
    """Short name of the layers: ``router``, ``shared-expert gate``, ``vision encoder``..."""
    why: str


_ROUTER = KeepRule(r"re:.*mlp\.gate$", "router",
                   "MoE router: vLLM runs it as a 16-bit GateLinear; quantizing it changes expert choice")
_MIXTRAL_ROUTER = KeepRule(r"re:.*block_sparse_moe\.gate$", "router",
                           "MoE router (Mixtral's name): vLLM runs it as a 16-bit GateLinear")
_SHARED_GATE = KeepRule(r"re:.*shared_expert_gate$", "shared-expert gate",
                        "vLLM builds it with quant_config=None: a quantized tensor would not load")
_QWEN_VISUAL = KeepRule(r"re:(model\.)?visual\..*", "vision encoder",
                        "vision encoder and merger: calibration text never reaches them; vLLM's multimodal "
                        "recipes keep them 16-bit")
_VISION_TOWER = KeepRule(r"re:.*vision_tower\..*", "vision encoder",
                         "vision tower: calibration text never reaches it")
_PROJECTOR = KeepRule(r"re:.*multi_modal_projector\..*", "multimodal projector",
                      "projector from the vision tower to the text model: calibration text never reaches it")

ARCHITECTURES: dict[str, tuple[KeepRule, ...]] = {
    # dense decoders: nothing beyond the user's list
    "llama": (), "mistral": (), "qwen2": (), "qwen3": (), "gemma": (), "gemma2": (), "gemma3_text": (),
    "phi3": (),
    # mixtures of experts
    "mixtral": (_MIXTRAL_ROUTER, _ROUTER),
    "qwen2_moe": (_ROUTER, _SHARED_GATE),
    "qwen3_moe": (_ROUTER, _SHARED_GATE),
    "deepseek_v2": (_ROUTER,),
    "deepseek_v3": (_ROUTER,),  # + MTP layers, derived from the config (mtp_rule)
    # vision-language
    "qwen2_vl": (_QWEN_VISUAL,),
    "qwen2_5_vl": (_QWEN_VISUAL,),
    "llava": (_VISION_TOWER, _PROJECTOR),
    "llava_next": (_VISION_TOWER, _PROJECTOR),
    "gemma3": (_VISION_TOWER, _PROJECTOR),
    "mistral3": (_VISION_TOWER, _PROJECTOR),
}
"""model_type (top level of config.json) -> the layers it keeps 16-bit."""


_VL_RELOAD = (
    "fewerbits does not quantize {name}: its quantization Job measures the quality gate by reloading the "
    "quantized checkpoint with transformers 5.17, which does not map that checkpoint's tensor names "
    "(model.layers.*, visual.*) back to its own modules (model.language_model.*), so the Job would fail at its "
    "evaluation after the quantization's GPU time; set spec.quantization.format to none to serve it at 16 bits "
    "(format auto does so on every pool)")
QUANTIZE_BLOCKERS: dict[tuple[str, str | None], str] = {
    ("qwen2_5_vl", None): _VL_RELOAD.format(name="Qwen2.5-VL"),
    ("qwen2_vl", None): _VL_RELOAD.format(name="Qwen2-VL"),
    ("deepseek_v3", "w4a16-awq"): (
        "llm-compressor 0.14's AWQ cannot quantize DeepSeek-V3 (its mappings match the post-attention norm of a "
        "dense and a MoE layer at once: \"AWQ needs to match a single smoothlayer for each mapping\"; found by "
        "scripts/vllm-check.sh); use w4a16-gptq"),
}
"""(model_type, format or None for every quantized format) -> why fewerbits will not make that
artifact (the planner refuses it, and `auto` steps past it). Found by making the Job's artifacts
with its own functions and loading them with vLLM's own loader (scripts/vllm-check.sh, which calls
those functions directly, past the planner); each entry goes when the cause is fixed.

Qwen2-VL and Qwen2.5-VL: the zoo's artifacts made that way (vision encoder kept 16-bit) load in
vLLM's loader, but a Job the operator starts would fail at its own evaluation, so no quantized
format is planned for them and `auto` serves them at 16 bits."""


def quantize_blocker(model_type: str, fmt: str | None = None) -> str | None:
    """Why ``model_type`` is not quantized to ``fmt`` (a format's value), or None."""
    return QUANTIZE_BLOCKERS.get((model_type, None)) or (QUANTIZE_BLOCKERS.get((model_type, fmt)) if fmt else None)


def mtp_rule(config: Mapping[str, Any]) -> KeepRule | None:
    """DeepSeek-V3's multi-token-prediction layers: indices num_hidden_layers .. +num_nextn_predict_layers."""
    n = config.get("num_nextn_predict_layers")
    layers = config.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or not isinstance(layers, int) or n > 64:
        return None
    idx = "|".join(str(layers + i) for i in range(n))
    return KeepRule(rf"re:model\.layers\.({idx})\..*", "MTP layers",
                    "multi-token-prediction layers: a speculative-decoding draft, not part of the served model")


def architecture_rules(config: Mapping[str, Any]) -> tuple[KeepRule, ...] | None:
    """The rules for a parsed config.json, or None when its model_type is not in the table."""
    model_type = str(config.get("model_type") or "")
    rules = ARCHITECTURES.get(model_type)
    if rules is None:
        return None
    extra = mtp_rule(config) if model_type == "deepseek_v3" else None
    return rules + ((extra,) if extra else ())


@dataclass(frozen=True)
class EffectiveIgnore:
    """The ignore list a recipe gets, and what was added to the user's."""

    entries: tuple[str, ...]
    """The user's entries in order, then the architecture's that the user did not already list."""
    added: tuple[KeepRule, ...] = ()
    """The architecture's rules added to the user's list."""
    warnings: tuple[str, ...] = field(default_factory=tuple)


def effective_ignore(config: Mapping[str, Any], user_ignore: Iterable[str]) -> EffectiveIgnore:
    """The user's ``ignore`` plus what the architecture of ``config`` requires. Idempotent:
    applying it to its own result adds nothing."""
    user = list(dict.fromkeys(user_ignore))
    rules = architecture_rules(config)
    if rules is None:
        model_type = str(config.get("model_type") or "(none)")[:128]
        return EffectiveIgnore(tuple(user), (), (
            f"model_type {model_type!r} is not in fewerbits' architecture table: only the ignore list given "
            f"({', '.join(user) or 'empty'}) stays 16-bit; add routers, gates or vision layers to "
            "spec.quantization.ignore yourself if the model has them",))
    added = tuple(r for r in rules if r.pattern not in user)
    return EffectiveIgnore(tuple(user) + tuple(r.pattern for r in added), added)


def matches(entry: str, name: str) -> bool:
    """Whether ignore ``entry`` covers module ``name``, the way compressed-tensors matches it
    (``re:`` = ``re.match`` from the start; otherwise the exact name or a trailing ``.name``
    component). A pattern that is not a valid regular expression matches nothing."""
    if entry.startswith("re:"):
        try:
            return re.match(entry[3:], name) is not None
        except re.error:
            return False
    return name == entry or name.endswith("." + entry)


def first_bad_regex(entries: Iterable[str]) -> tuple[str, str] | None:
    """(entry, error) for the first ``re:`` entry that does not compile."""
    for e in entries:
        if e.startswith("re:"):
            try:
                re.compile(e[3:])
            except re.error as err:
                return e, str(err)
    return None
