"""Format -> llm-compressor recipe: the only place that knows llm-compressor's modifiers.

Format -> recipe:

| format      | modifiers                                               | calibration data |
|-------------|---------------------------------------------------------|------------------|
| fp8-dynamic | QuantizationModifier(scheme=FP8_DYNAMIC)                | no               |
| fp8-block   | QuantizationModifier(scheme=FP8_BLOCK)                  | no               |
| w4a16-awq   | AWQModifier, then QuantizationModifier(scheme=W4A16_ASYM) | yes            |
| w4a16-gptq  | GPTQModifier(scheme=W4A16)                              | yes              |
| w8a8-int8   | SmoothQuantModifier, then GPTQModifier(scheme=W8A8)     | yes              |
| w4afp8      | QuantizationModifier(scheme=W4AFP8)                     | no               |
| nvfp4       | QuantizationModifier(scheme=NVFP4)                      | yes              |
| nvfp4a16    | QuantizationModifier(scheme=NVFP4A16)                   | no               |
| none        | (no recipe: the base weights are published)             | no               |

``ignore`` goes to every modifier that takes one. llm-compressor 0.14's AWQModifier takes none: it
is a transform that only smooths mappings whose layers carry a quantization scheme, which the
QuantizationModifier after it assigns, so its ``ignore`` governs AWQ too.

The format alone names the recipe: ``keyInputs.recipe`` stays empty (the contract refuses
anything else), so no modifier argument beyond ``ignore`` can be set from outside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fewerbits_api.architectures import effective_ignore
from fewerbits_api.formats import FORMAT_FACTS, QuantFormat

from . import errors
from .errors import JobError

TARGETS = ["Linear"]


@dataclass(frozen=True)
class ModifierSpec:
    """One modifier as data: its llm-compressor class name and keyword arguments."""

    kind: str
    """``QuantizationModifier``, ``GPTQModifier``, ``AWQModifier`` or ``SmoothQuantModifier``."""
    kwargs: dict[str, Any]


_LM = r"re:.*language_model.*"
AWQ_LANGUAGE_MODEL_MAPPINGS: dict[str, list[dict[str, Any]]] = {
    # llm-compressor 0.14 resolves AWQ's mappings over the whole model; Gemma-3's SigLIP tower has
    # v_proj but no o_proj (out_proj), so its default mapping `v_proj -> o_proj` matched three smooth
    # layers at once ("AWQ needs to match a single smoothlayer", scripts/vllm-check.sh). The same
    # mappings as llm-compressor's _gemma3_mappings, anchored to the language model (the vision
    # tower stays 16-bit anyway: fewerbits_api.architectures' ignore list).
    "gemma3": [
        {"smooth_layer": _LM + "v_proj$", "balance_layers": [_LM + "o_proj$"]},
        {"smooth_layer": _LM + "pre_feedforward_layernorm$", "balance_layers": [_LM + "gate_proj$", _LM + "up_proj$"]},
        {"smooth_layer": _LM + "up_proj$", "balance_layers": [_LM + "down_proj$"]},
    ],
}
"""AWQ mappings by ``model_type`` where llm-compressor's own do not resolve on the multimodal model."""

SMOOTHQUANT_LANGUAGE_MODEL_MAPPINGS: dict[str, list[list[Any]]] = {
    # The same failure for SmoothQuant (w8a8-int8): its default `q/k/v_proj <- input_layernorm` also
    # matched SigLIP's q/k/v_proj, whose scope has no input_layernorm ("Error resolving mappings").
    # Anchored to the language model; Gemma's MLP is fed by pre_feedforward_layernorm, not by
    # post_attention_layernorm as in the default mappings.
    "gemma3": [
        [[_LM + "q_proj$", _LM + "k_proj$", _LM + "v_proj$"], _LM + "input_layernorm$"],
        [[_LM + "gate_proj$", _LM + "up_proj$"], _LM + "pre_feedforward_layernorm$"],
    ],
}
"""SmoothQuant mappings ``[balance layers, smooth layer]`` by ``model_type``, likewise."""


def for_model(specs: list[ModifierSpec], model_type: str | None) -> list[ModifierSpec]:
    """``specs`` with the AWQ and SmoothQuant mappings the loaded model's ``model_type`` needs (pure): where the
    table has none, or a spec already names its mappings, unchanged."""
    tables = {"AWQModifier": AWQ_LANGUAGE_MODEL_MAPPINGS, "SmoothQuantModifier": SMOOTHQUANT_LANGUAGE_MODEL_MAPPINGS}

    def with_mappings(s: ModifierSpec) -> ModifierSpec:
        mappings = tables.get(s.kind, {}).get(model_type or "")
        return ModifierSpec(s.kind, {"mappings": mappings, **s.kwargs}) if mappings and "mappings" not in s.kwargs else s

    return [with_mappings(s) for s in specs]


def build_recipe_spec(fmt: QuantFormat, ignore: list[str],
                      model_config: Mapping[str, Any] | None = None) -> list[ModifierSpec]:
    """The modifiers for ``fmt`` as data (pure: no llm-compressor import, unit-testable).

    With ``model_config`` (the source's parsed config.json) the ignore list is the effective one:
    ``ignore`` plus what the architecture requires (fewerbits_api.architectures, the table the
    planner sizes with). Applying it to a list that already is effective changes nothing."""
    if model_config is not None:
        ignore = list(effective_ignore(model_config, ignore).entries)
    if fmt in (QuantFormat.AUTO,):
        raise JobError(errors.RECIPE_INVALID, "format 'auto' is resolved by the operator, never by the Job", permanent=True)
    if fmt is QuantFormat.NONE:
        return []
    scheme = FORMAT_FACTS[fmt].llmcompressor_scheme
    ignore = list(ignore)
    quant = {"targets": list(TARGETS), "scheme": scheme, "ignore": ignore}
    if fmt is QuantFormat.W4A16_AWQ:
        specs = [ModifierSpec("AWQModifier", {}), ModifierSpec("QuantizationModifier", quant)]
    elif fmt is QuantFormat.W4A16_GPTQ:
        specs = [ModifierSpec("GPTQModifier", quant)]
    elif fmt is QuantFormat.W8A8_INT8:
        specs = [ModifierSpec("SmoothQuantModifier", {"smoothing_strength": 0.8, "ignore": ignore}),
                 ModifierSpec("GPTQModifier", quant)]
    else:  # fp8-dynamic, fp8-block, w4afp8, nvfp4, nvfp4a16: one QuantizationModifier
        specs = [ModifierSpec("QuantizationModifier", quant)]

    return specs


def instantiate(specs: list[ModifierSpec]) -> list[Any]:
    """The llm-compressor modifier objects for ``specs`` (imports llm-compressor)."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    classes = {"QuantizationModifier": QuantizationModifier, "GPTQModifier": GPTQModifier,
               "AWQModifier": AWQModifier, "SmoothQuantModifier": SmoothQuantModifier}
    return [classes[s.kind](**s.kwargs) for s in specs]


def needs_calibration_data(fmt: QuantFormat) -> bool:
    return FORMAT_FACTS[fmt].needs_calibration_data
