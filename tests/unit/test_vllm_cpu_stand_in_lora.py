"""The vLLM stand-in (e2e/vllm_cpu.py) and LoRA: vLLM's CPU build cannot start with --enable-lora over a
w8a8-int8 artifact (its oneDNN int8 kernel drops layer.weight, which vLLM's LoRA layers read their
device from), a GPU can, so the stand-in refuses before vLLM starts and says why. Pure, plus one run
of the stand-in's entry point that stops at the refusal (no vLLM needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e import vllm_cpu as v

REPO = Path(__file__).resolve().parents[2]
LORA = ["serve", "/m", "--enable-lora", "--lora-modules", "a=/adapters/a", "--max-lora-rank", "8"]
W8A8_INT8 = {"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                     "config_groups": {"group_0": {
                                         "targets": ["Linear"],
                                         "weights": {"num_bits": 8, "type": "int", "strategy": "channel",
                                                     "symmetric": True, "dynamic": False},
                                         "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                                               "symmetric": True, "dynamic": True}}},
                                     "ignore": ["lm_head"]}}
"""As llm-compressor writes the w8a8-int8 test artifact's config.json (trimmed)."""
W8A8_INT8_ASYM = json.loads(json.dumps(W8A8_INT8))
W8A8_INT8_ASYM["quantization_config"]["config_groups"]["group_0"]["input_activations"]["symmetric"] = False
W4A16 = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
    "weights": {"num_bits": 4, "type": "int", "strategy": "group"}, "input_activations": None}}}}
FP8_DYNAMIC = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
    "weights": {"num_bits": 8, "type": "float"}, "input_activations": {"num_bits": 8, "type": "float",
                                                                        "dynamic": True}}}}}


def cpu(level):
    return v.Cpu("AMX" if level else None, level)


@pytest.mark.parametrize("level", ["AVX2", "AVX512", None])
def test_lora_on_w8a8_int8_is_refused_below_amx_naming_the_cause(level):
    why = v.unservable(W8A8_INT8, cpu(level), LORA)
    assert why is not None
    for words in ("--enable-lora", "w8a8-int8", "layer.weight", "_get_lora_device",
                  "'NoneType' object has no attribute 'device'", "GPU", cpu(level).describe()):
        assert words in why, words


def test_lora_on_w8a8_int8_starts_on_amx_with_symmetric_activations_only():
    # vLLM's AMX int8 path (check_cpu_sgl_kernel) keeps a packed layer.weight; oneDNN's (asymmetric) does not.
    assert v.unservable(W8A8_INT8, cpu("AMX"), LORA) is None
    assert "w8a8-int8" in v.unservable(W8A8_INT8_ASYM, cpu("AMX"), LORA)


@pytest.mark.parametrize("level", ["AVX2", "AVX512", "AMX", None])
def test_w8a8_int8_without_lora_is_served(level):
    assert v.unservable(W8A8_INT8, cpu(level), ["serve", "/m", "--max-model-len", "256"]) is None
    assert v.unservable(W8A8_INT8, cpu(level)) is None  # the command line is optional


@pytest.mark.parametrize("config", [FP8_DYNAMIC, W4A16, {}], ids=["fp8-dynamic", "w4a16", "bf16"])
def test_lora_on_other_formats_is_not_refused_for_lora(config):
    assert v.unservable(config, cpu("AVX512"), LORA) is None


def test_below_avx512_a_w4a16_artifact_gives_its_own_reason_with_or_without_lora():
    assert "cpu_gemm_wna16" in v.unservable(W4A16, cpu("AVX2"), LORA)


@pytest.mark.parametrize("args, on", [
    (["serve", "/m", "--enable-lora"], True), (["serve", "/m", "--enable-lora=true"], True),
    (["serve", "/m", "--enable-lora=True"], True), (["serve", "/m", "--enable-lora=false"], False),
    (["serve", "/m", "--lora-modules", "a=/a"], False), (["serve", "/m", "--enable-lora-bias"], False),
    (["serve", "/m"], False)])
def test_lora_is_enabled_only_by_the_flag(args, on):
    assert v.lora_enabled(args) is on


def test_int8_activation_formats_are_told_from_others():
    assert v.int8_activations(W8A8_INT8["quantization_config"])
    assert v.int8_symmetric(W8A8_INT8["quantization_config"])
    assert not v.int8_symmetric(W8A8_INT8_ASYM["quantization_config"])
    for other in (W4A16, FP8_DYNAMIC, {}, {"quantization_config": {"quant_method": "gptq", "bits": 8}}):
        assert not v.int8_activations(other.get("quantization_config") or {})


def test_the_rule_is_listed_with_its_reason_and_the_switch():
    row = v.CPU_STAND_IN["LoRA on int8 activation formats"]
    assert len(row) > 80 and v.PRECHECK_ENV in row and "_get_lora_device" in row and "GPU" in row


def test_the_stand_in_refuses_before_vllm_starts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(W8A8_INT8))
    env = {k: val for k, val in os.environ.items() if k not in (v.CAPABILITY_ENV, v.PRECHECK_ENV)}
    if v.this_cpu({}).level is not None:  # an x86 CPU: act as one without AMX whatever this one has
        env[v.CAPABILITY_ENV] = "AVX2"
    out = subprocess.run([sys.executable, str(REPO / "e2e" / "vllm_cpu.py"), "serve", str(tmp_path),
                          "--port", "1", "--enable-lora", "--lora-modules", "a=/adapters/a"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "CPUIncompatibleError: LoRA (--enable-lora)" in out.stderr
    assert "vLLM's CPU build for" not in out.stderr  # the line written just before vLLM is started
