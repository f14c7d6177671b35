"""Quantization formats and the facts about them that the planner, the quantjob and the serving
pod's launcher use: format -> llm-compressor recipe -> the compute capabilities with a native or
a fallback vLLM kernel, and :func:`cc_verdict`, the one reading of those facts for a GPU.

Standard library only: the launch wrapper copies this module into the vLLM image.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal


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
    """Extra fraction of weight bytes spent on scales (group-128 int4: one 16-bit scale and zero point per 128 weights, ~3%)."""
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


CC = tuple[int, int]


def fmt_cc(cc: CC) -> str:
    """(9, 0) -> '9.0'."""
    return f"{cc[0]}.{cc[1]}"


@dataclass(frozen=True)
class CCVerdict:
    """Whether vLLM runs a format on a compute capability."""

    kind: Literal["native", "fallback", "refused"]
    why: str
    """native: empty; fallback: what the fallback kernel means (the format's note); refused: why,
    starting with the format's name and without the GPU (callers name the GPU their way)."""

    @property
    def runs(self) -> bool:
        return self.kind != "refused"


def cc_verdict(fmt: QuantFormat, cc: CC) -> CCVerdict:
    """The verdict of ``FORMAT_FACTS`` for ``fmt`` on compute capability ``cc``, compared as numbers
    (10.0 > 9.0). The planner and the serving pod's launcher both decide with this."""
    facts = FORMAT_FACTS[fmt]
    native_min, fallback_min, native_max = facts.native_min_cc, facts.fallback_min_cc, facts.native_max_cc
    if native_max is not None and (cc > native_max or (cc < native_min and fallback_min is None)):
        where = (f"{fmt_cc(native_min)} exactly" if native_min == native_max
                 else f"{fmt_cc(native_min)} to {fmt_cc(native_max)}")
        return CCVerdict("refused", f"{fmt.value} has a vLLM kernel only on compute capability {where}")
    if cc >= native_min:
        return CCVerdict("native", "")
    if fallback_min is not None and cc >= fallback_min:
        return CCVerdict("fallback", facts.fallback_note or "runs through a fallback kernel")
    if fallback_min is not None:
        return CCVerdict("refused", f"{fmt.value} needs compute capability {fmt_cc(fallback_min)} or newer "
                                    f"(native from {fmt_cc(native_min)})")
    return CCVerdict("refused", f"{fmt.value} needs compute capability {fmt_cc(native_min)} or newer")
