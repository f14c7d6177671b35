"""The CPU-dependent rules of the vLLM stand-in (e2e/vllm_cpu.py), pure: which level vLLM's CPU build
acts on, what is translated at each level, and what is refused before vLLM starts. No cluster, no vLLM
(the emulation's effect on torch is checked in a subprocess of the project's interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from e2e import vllm_cpu as v

AVX2_ONLY = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx fma avx2 bmi2\nprocessor\t: 1\n"
AVX512 = AVX2_ONLY.replace("avx2 bmi2", "avx2 bmi2 avx512f avx512dq avx512bw avx512vl avx512_bf16")
AMX = AVX512.replace("avx512_bf16", "avx512_bf16 amx_tile amx_bf16")
W4A16 = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
    "weights": {"num_bits": 4, "type": "int", "strategy": "group"}, "input_activations": None}}}}
W8A8_INT8 = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
    "weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}}}}
REPO = Path(__file__).resolve().parents[2]
FP8_DYNAMIC = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
    "weights": {"num_bits": 8, "type": "float"}, "input_activations": {"num_bits": 8, "type": "float",
                                                                        "dynamic": True}}}}}


@pytest.mark.parametrize("cpuinfo, level", [(AVX2_ONLY, "AVX2"), (AVX512, "AVX512"), (AMX, "AMX"),
                                            ("flags\t: fpu sse2 neon\n", None), ("", None)])
def test_the_level_is_what_torch_cpu_would_report(cpuinfo, level):
    assert v.detect_level(v.cpu_flags(cpuinfo)) == level


def test_amx_without_avx512_flags_is_not_amx():
    # Levels are cumulative: a flag of a higher level counts only on top of the lower ones.
    assert v.detect_level(v.cpu_flags(AVX2_ONLY.replace("avx2 bmi2", "avx2 bmi2 amx_tile"))) == "AVX2"


@pytest.mark.parametrize("requested, detected, level, forced", [
    (None, "AVX512", "AVX512", False), ("", "AVX2", "AVX2", False), ("auto", "AMX", "AMX", False),
    ("AVX2", "AVX512", "AVX2", True), ("avx2", "AMX", "AVX2", True), ("avx-512", "AMX", "AVX512", True),
    ("AVX512", "AVX512", "AVX512", False), (None, None, None, False)])
def test_the_level_can_be_forced_downwards(requested, detected, level, forced):
    cpu = v.resolve(requested, detected)
    assert (cpu.level, cpu.forced) == (level, forced)


@pytest.mark.parametrize("requested, detected, words", [
    ("AVX512", "AVX2", "this CPU has only AVX2"), ("AMX", "AVX512", "never upwards"),
    ("AVX2", None, "no AVX2"), ("SSE4", "AVX512", "expected auto or one of AVX2, AVX512, AMX")])
def test_a_level_this_cpu_cannot_be_is_refused_naming_the_setting(requested, detected, words):
    with pytest.raises(v.CapabilityError, match=v.CAPABILITY_ENV) as e:
        v.resolve(requested, detected)
    assert words in str(e.value)


def test_this_cpu_reads_proc_cpuinfo_and_the_setting(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(AVX512)
    assert v.this_cpu({}, str(info)) == v.Cpu("AVX512", "AVX512")
    assert v.this_cpu({v.CAPABILITY_ENV: "AVX2"}, str(info)).describe() == \
        f"AVX2 (forced by {v.CAPABILITY_ENV}; this CPU: AVX512)"
    assert v.this_cpu({}, str(tmp_path / "missing")).level is None


SERVE = ["serve", "/m", "--kv-cache-dtype", "fp8", "--max-model-len", "256"]


@pytest.mark.parametrize("level", ["AVX2", None])
def test_an_fp8_kv_cache_becomes_the_16_bit_cache_without_avx512_or_amx(level):
    out, notes = v.for_cpu(SERVE, v.Cpu("AVX512" if level else None, level))
    assert out == ["serve", "/m", "--kv-cache-dtype", "auto", "--max-model-len", "256"]
    assert len(notes) == 1 and notes[0].startswith("--kv-cache-dtype fp8 served as auto (16-bit)")
    assert "AVX-512 or AMX" in notes[0]
    eq, notes = v.for_cpu(["serve", "/m", "--kv-cache-dtype=fp8_e5m2"], v.Cpu("AVX2", "AVX2"))
    assert eq == ["serve", "/m", "--kv-cache-dtype=auto"] and "fp8_e5m2" in notes[0]


@pytest.mark.parametrize("level", ["AVX512", "AMX"])
def test_an_fp8_kv_cache_is_kept_where_the_cpu_has_the_kernel(level):
    assert v.for_cpu(SERVE, v.Cpu(level, level)) == (SERVE, [])


def test_a_16_bit_or_absent_kv_dtype_is_never_translated():
    for args in (["serve", "/m", "--kv-cache-dtype", "auto"], ["serve", "/m", "--kv-cache-dtype", "bfloat16"],
                 ["serve", "/m"]):
        assert v.for_cpu(args, v.Cpu("AVX2", "AVX2")) == (args, [])


@pytest.mark.parametrize("config, level, refused", [
    (W4A16, "AVX2", True), (W4A16, "AVX512", False), (W4A16, "AMX", False), (W4A16, None, False),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "AVX2", True),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "AVX2", True),
    (W8A8_INT8, "AVX2", False), (FP8_DYNAMIC, "AVX2", False), ({}, "AVX2", False)])
def test_weight_only_integer_formats_are_refused_before_vllm_without_avx512(config, level, refused):
    why = v.unservable(config, v.Cpu(level and "AMX", level))
    assert bool(why) is refused
    if refused:
        assert "cpu_gemm_wna16" in why and "AVX2" in why and "fail every request" in why


def test_the_model_config_is_read_from_the_served_folder(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(W4A16))
    assert v.model_config(["serve", str(tmp_path), "--port", "1"]) == W4A16
    assert v.model_config(["serve", str(tmp_path / "none")]) == {}
    assert v.model_config(["serve", "s3://bucket/model"]) == {}


def test_the_servers_environment_carries_the_level_and_keeps_torch_at_a_forced_one():
    env = v.cpu_env({"A": "1"}, "/pods/p", v.Cpu("AVX512", "AVX2"))
    assert env[v.CAPABILITY_ENV] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    native = v.cpu_env({}, "/pods/p", v.Cpu("AVX512", "AVX512"))
    assert native[v.CAPABILITY_ENV] == "AVX512" and "ATEN_CPU_CAPABILITY" not in native
    assert set(env) - {"A"} <= set(v.CPU_STAND_IN)  # every change is listed


def test_every_cpu_dependent_rule_is_listed_with_its_reason():
    for key in ("--kv-cache-dtype", "weight-only integer formats", v.CAPABILITY_ENV):
        assert len(v.CPU_STAND_IN[key]) > 80, key


def test_emulating_avx2_makes_torch_report_no_avx512_or_amx():
    # What vLLM asks (platforms/cpu.py, cpu_attn.py): under the emulation every check above AVX2 says no.
    code = ("import torch.cpu as c; from e2e import vllm_cpu as v; v.emulate('AVX2'); "
            "print(sorted(n for n in dir(c) if n.startswith('_is_') and 'arm' not in n and getattr(c, n)()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=REPO)
    assert out.stdout.split("\n")[-2] == "['_is_avx2_supported']", out.stdout
