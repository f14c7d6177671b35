"""Quantization formats and the facts about them that both the planner and the quantjob use.

Facts from DESIGN.md "Planner facts" (format -> llm-compressor recipe -> minimum compute
capability for a native vLLM kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class QuantFormat(str, Enum):
    """A quantization format: what the weights (and activations) are stored and computed in."""

    AUTO = "auto"
    NONE = "none"
    FP8_DYNAMIC = "fp8-dynamic"
    FP8_BLOCK = "fp8-block"
    W4A16_AWQ = "w4a16-awq"
    W4A16_GPTQ = "w4a16-gptq"
    W8A8_INT8 = "w8a8-int8"
    W4AFP8 = "w4afp8"
    NVFP4 = "nvfp4"
    NVFP4A16 = "nvfp4a16"


class KVCacheSetting(str, Enum):
    """What the user asks for the KV cache: let the planner pick, FP8, or the model dtype."""

    AUTO = "auto"
    FP8 = "fp8"
    NONE = "none"


@dataclass(frozen=True)
class FormatFacts:
    """What a concrete format means for memory, calibration and hardware."""

    format: QuantFormat
    weight_bits: float
    """Bits per weight as stored (NVFP4 is 4 bits plus an FP8 scale per 16 values)."""
    scale_overhead: float
    """Extra fraction of weight bytes spent on scales (group-128 int4 ~3%, DESIGN.md)."""
    needs_calibration_data: bool
    native_min_cc: tuple[int, int]
    """Lowest compute capability with a native vLLM kernel."""
    fallback_min_cc: tuple[int, int] | None
    """Lowest compute capability that still runs, via a fallback kernel (None: refused below native)."""
    fallback_note: str
    native_max_cc: tuple[int, int] | None = None
    """Highest compute capability with the native kernel (w4afp8 is Hopper-only)."""
    llmcompressor_scheme: str = ""
    """The preset scheme name in llm-compressor / compressed-tensors."""
    compressed_tensors_format: str = ""
    """The ``quantization_config.format`` value a checkpoint of this format carries."""


FORMAT_FACTS: dict[QuantFormat, FormatFacts] = {
    f.format: f
    for f in (
        FormatFacts(QuantFormat.NONE, 16, 0.0, False, (7, 0), None, "", llmcompressor_scheme="",
                    compressed_tensors_format=""),
        FormatFacts(QuantFormat.FP8_DYNAMIC, 8, 0.0, False, (8, 9), (8, 0),
                    "runs weight-only through the FP8 Marlin kernel: memory savings, no compute gain",
                    llmcompressor_scheme="FP8_DYNAMIC", compressed_tensors_format="float-quantized"),
        FormatFacts(QuantFormat.FP8_BLOCK, 8, 0.0, False, (9, 0), None, "",
                    llmcompressor_scheme="FP8_BLOCK", compressed_tensors_format="float-quantized"),
        FormatFacts(QuantFormat.W4A16_AWQ, 4, 0.03, True, (8, 0), (7, 5),
                    "needs a recent vLLM for the Marlin kernel below CC 8.0",
                    llmcompressor_scheme="W4A16_ASYM", compressed_tensors_format="pack-quantized"),
        FormatFacts(QuantFormat.W4A16_GPTQ, 4, 0.03, True, (8, 0), (7, 5),
                    "needs a recent vLLM for the Marlin kernel below CC 8.0",
                    llmcompressor_scheme="W4A16", compressed_tensors_format="pack-quantized"),
        FormatFacts(QuantFormat.W8A8_INT8, 8, 0.0, True, (7, 5), None, "",
                    llmcompressor_scheme="W8A8", compressed_tensors_format="int-quantized"),
        FormatFacts(QuantFormat.W4AFP8, 4, 0.03, False, (9, 0), None, "", native_max_cc=(9, 0),
                    llmcompressor_scheme="W4AFP8", compressed_tensors_format="int-quantized"),
        FormatFacts(QuantFormat.NVFP4, 4.5, 0.0, True, (10, 0), (8, 0),
                    "runs weight-only through the FP4 Marlin fallback kernel: memory savings, no FP4 compute",
                    llmcompressor_scheme="NVFP4", compressed_tensors_format="nvfp4-pack-quantized"),
        FormatFacts(QuantFormat.NVFP4A16, 4.5, 0.0, False, (10, 0), (8, 0),
                    "runs through the FP4 Marlin fallback kernel",
                    llmcompressor_scheme="NVFP4A16", compressed_tensors_format="nvfp4-pack-quantized"),
    )
}

CONCRETE_FORMATS: tuple[QuantFormat, ...] = tuple(f for f in QuantFormat if f is not QuantFormat.AUTO)
QUANTIZED_FORMATS: tuple[QuantFormat, ...] = tuple(
    f for f in QuantFormat if f not in (QuantFormat.AUTO, QuantFormat.NONE)
)
