"""The `vllm` executable of the test image `fewerbits-test/vllm-cpu`: vLLM's CPU build standing in
for vLLM on a GPU node.

The pod runner (e2e/podrunner.py, rule kind `vllm-cpu`) runs the serving container's real command
line: the real launcher (`python3 -m fewerbits_runtime launch ... -- vllm serve DIR ...`, from the
copy the fetch init container installed) with this environment's interpreter as the image's
`python3`, and a `vllm` on PATH that is this file. So the launcher's checks (the artifact's format
against the node's compute capability) run exactly as in the real image, and what it starts arrives
here with the argv the operator rendered. This file changes only what a CPU cannot honour, all of it
listed in `CPU_STAND_IN` below, and runs `vllm` through vLLM's own CLI from the CPU build.

It runs under the vLLM environment's interpreter (e2e/build.sh component `vllm`), standard library
only, by path (not as a package module): nothing of the project is importable there.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

DISTRIBUTION = "vllm-cpu"
"""The CPU build's distribution name. vLLM's CLI (`vllm serve`) asks `importlib.metadata` for the
version of `vllm`, which raises PackageNotFoundError here; the stand-in answers it with this
distribution's version and runs the CLI itself, so `vllm serve` (and `--headless`, which only the
CLI honours) behaves as in the real image."""

MARK = "fewerbits e2e:"
"""How every line this stand-in writes to the container's log starts."""

CLI_MARK = "--fewerbits-run-vllm-cli"
"""First argument of the re-exec that runs vLLM's CLI in the server's environment."""

DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024
"""A GPU sizes its KV cache from --gpu-memory-utilization; a CPU takes an explicit size. 64 MiB holds
65,536 tokens of the tiny test model at 16 bits (131,072 with an FP8 KV cache)."""

EAGER_TRACE = '{"mode":1,"backend":"eager"}'
"""torch.compile (vLLM compilation mode 1) with the eager backend: a warm-up, no code generation."""

CAPABILITY_ENV = "FEWERBITS_CPU_CAPABILITY"
"""Which CPU the harness's vLLM behaves as: ``AVX2``, ``AVX512`` or ``AMX`` (unset or ``auto``: this
CPU's own). Lower than this CPU's, vLLM's CPU build sees only that level's features (EMULATED), so
the path of a machine without AVX-512 runs on one that has it; higher than this CPU's is refused."""

PRECHECK_ENV = "FEWERBITS_E2E_CPU_PRECHECK"
"""``0`` in a pod's environment starts vLLM even for a format (or a format with LoRA) this CPU cannot
serve (`unservable`), so a test can watch what vLLM itself does then; anything else (the default)
refuses before vLLM starts."""

LEVELS = ("AVX2", "AVX512", "AMX")
"""The CPU levels vLLM's CPU build tells apart on x86, lowest first. Each level's torch.cpu checks
(what vLLM asks: platforms/cpu.py picks `_C_AVX2`, `_C_AVX512` or `_C` by them, cpu_attn.py refuses
an FP8 KV cache below AVX512, the AMX attention kernel needs `amx_tile`) hold on every higher level."""

LEVEL_FLAGS = {
    "AVX2": ("avx2", "fma"),
    "AVX512": ("avx512f", "avx512vl", "avx512bw", "avx512dq"),
    "AMX": ("amx_tile",),
}
"""/proc/cpuinfo flags each level needs on top of the one below: torch's `_is_avx512_supported` is
cpuinfo's AVX-512 VL+BW+DQ, `_is_amx_tile_supported` its AMX-TILE."""

TORCH_CHECKS = {
    "AVX2": ("_is_avx2_supported",),
    "AVX512": ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported"),
    "AMX": ("_is_amx_tile_supported", "_is_amx_fp16_supported"),
}
"""torch.cpu's feature checks by the level that brings them: below a level, its checks answer False
in vLLM's processes (EMULATED)."""

FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
"""`--kv-cache-dtype` values that store the cache in one byte: vLLM's CPU attention needs AVX512 or AMX."""

CPU_STAND_IN: dict[str, str] = {
    "vllm": "vLLM's own CLI, with importlib.metadata's version of `vllm` answered from the `vllm-cpu` "
            "distribution (see DISTRIBUTION)",
    "--host": "the pod's IP: every pod shares this machine's network, its loopback IP is its own",
    "--tensor-parallel-size": "dropped: one CPU process, no GPUs to shard across",
    "--gpu-memory-utilization": f"dropped; the KV cache gets --kv-cache-memory-bytes {DEFAULT_KV_CACHE_BYTES} "
                                "unless the command or VLLM_CPU_KVCACHE_SPACE sizes it",
    "--enforce-eager": "added when absent: vLLM's torch.compile of the model is an optimisation of the GPU "
                       "node's kernels; on this CPU it costs 2+ minutes per start under load (measured: "
                       "init engine 129.7 s without it) and every pod compiles again",
    "--compilation-config": f"{EAGER_TRACE} instead of --enforce-eager when --pipeline-parallel-size > 1: "
                            "the CPU model runner allocates a later stage's input buffers only in its compile "
                            "warm-up, which --enforce-eager skips (the first request then fails `assert "
                            "self.intermediate_tensors is not None`); torch.compile with the eager backend runs "
                            "that warm-up in about a second and the same eager kernels",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CACHE_ROOT": "the pod's own folder (compile caches are not shared between pods)",
    "--kv-cache-dtype": "fp8 (any one-byte cache) becomes auto, the 16-bit cache, where the CPU (or the level "
                        f"{CAPABILITY_ENV} forces) has neither AVX-512 nor AMX: vLLM's CPU attention has no FP8 "
                        "KV kernel there and refuses at start (NotImplementedError: FP8 KV cache on CPU requires "
                        "x86 with AVX-512 or AMX). A GPU node keeps its FP8 cache; only the cache's size differs",
    "weight-only integer formats": "w4a16 (GPTQ, AWQ; compressed-tensors weights of int type without "
                                   "activation quantization) is refused before vLLM starts below AVX512: vLLM's "
                                   "AVX2 kernels (_C_AVX2) lack cpu_gemm_wna16, so vLLM would start, answer "
                                   "/health and die on the first request. Not translatable: the pod fails with "
                                   f"the reason, as a GPU node of the wrong compute capability does ({PRECHECK_ENV}"
                                   "=0 lets vLLM start anyway)",
    "LoRA on int8 activation formats": (
        "--enable-lora on a w8a8-int8 artifact (compressed-tensors int weights with int input activations) is "
        "refused before vLLM starts unless the level is AMX and the activations are symmetric: vLLM's CPU int8 "
        "kernel (CPUInt8ScaledMMLinearKernel, oneDNN path) prepacks the weight and sets layer.weight to None, and "
        "vLLM's LoRA layers read their device from it (lora/layers/utils.py _get_lora_device), so the engine dies "
        "at start (measured on 0.32.0, AVX512: AttributeError: 'NoneType' object has no attribute 'device'). Only "
        "the AMX path (symmetric activations) keeps a packed weight. Not translatable: a GPU's int8 kernels keep "
        f"the weight and serve the LoRA, so the pod fails with the reason ({PRECHECK_ENV}=0 lets vLLM start anyway)"),
    CAPABILITY_ENV: "a level below this CPU's makes vLLM's processes see only that level: torch.cpu's checks "
                    "above it answer False, so vLLM loads the same kernel library (_C_AVX2) and takes the same "
                    "paths as on such a CPU (set for the server: the level it acts on)",
    "ATEN_CPU_CAPABILITY": "the emulated level, when one is forced: torch's own kernels stay at it too",
}
"""Everything this stand-in changes between the operator's command line and the server it starts.
Every other flag (dtype, --kv-cache-dtype, --max-model-len, --max-num-seqs, --enforce-eager,
--served-model-name, --port, ...) reaches vLLM as rendered."""

DROPPED_FLAGS = ("--tensor-parallel-size", "--gpu-memory-utilization")


def cpu_argv(argv: list[str], pod_ip: str, env: dict[str, str]) -> list[str]:
    """The CLI's arguments for a `vllm` command line (`serve MODEL ...` or `--model MODEL ...`),
    as `serve MODEL ...`, translated as CPU_STAND_IN says. Pure: the caller supplies the pod IP and
    the environment."""
    args = list(argv)
    if args and args[0] == "serve":
        args = args[1:]
    if args[:1] == ["--model"]:
        args = args[1:]
    out: list[str] = ["serve"]
    i = 0
    while i < len(args):
        key, eq, _ = args[i].partition("=")
        if key in DROPPED_FLAGS or key == "--host":  # each takes one value
            i += 1 if eq else 2
            continue
        out.append(args[i])
        i += 1
    out += ["--host", pod_ip]
    compiled = "--enforce-eager" in out or any(a.partition("=")[0] == "--compilation-config" for a in out)
    if not compiled:
        out += ["--enforce-eager"] if _stages(out) < 2 else ["--compilation-config", EAGER_TRACE]
    sized = any(a.partition("=")[0] == "--kv-cache-memory-bytes" for a in out) or env.get("VLLM_CPU_KVCACHE_SPACE")
    if not sized:
        out += ["--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES)]
    return out


def _stages(args: list[str]) -> int:
    """--pipeline-parallel-size, 1 when absent."""
    for i, a in enumerate(args):
        key, eq, value = a.partition("=")
        if key == "--pipeline-parallel-size":
            return int(value if eq else args[i + 1])
    return 1


def cpu_env(env: dict[str, str], pod_dir: str, cpu: "Cpu | None" = None) -> dict[str, str]:
    """The server's environment: the container's, plus what CPU_STAND_IN names (with ``cpu``, the
    level vLLM's processes see, and torch's own kernels kept at it when it is emulated)."""
    out = {**env, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": os.path.join(pod_dir, "vllm-cache")}
    if cpu is not None and cpu.level is not None:
        out[CAPABILITY_ENV] = cpu.level
        if cpu.forced:
            out["ATEN_CPU_CAPABILITY"] = cpu.level.lower() if cpu.level != "AMX" else "avx512"
    return out


# ------------------------------------------------------------------ the CPU this stand-in runs on


class CapabilityError(ValueError):
    """FEWERBITS_CPU_CAPABILITY names no level, or one above this CPU's."""


@dataclass(frozen=True)
class Cpu:
    """The CPU level vLLM's CPU build acts on (``level``) and this machine's own (``detected``);
    None on a CPU that is not x86 (vLLM's own checks then decide, nothing is emulated)."""

    detected: str | None
    level: str | None

    @property
    def forced(self) -> bool:
        return self.level != self.detected

    @property
    def fp8_kv_cache(self) -> bool:
        """vLLM's CPU attention stores a one-byte KV cache only with AVX-512 or AMX."""
        return self.level in ("AVX512", "AMX")

    @property
    def wna16(self) -> bool:
        """vLLM's weight-only integer kernel (cpu_gemm_wna16) exists on x86 only from AVX512 on."""
        return self.level != "AVX2"

    def describe(self) -> str:
        if self.level is None:
            return "not x86 (vLLM's own checks decide)"
        if self.forced:
            return f"{self.level} (forced by {CAPABILITY_ENV}; this CPU: {self.detected})"
        return f"{self.level} (this CPU)"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's feature flags in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def detect_level(flags: frozenset[str]) -> str | None:
    """The highest level of LEVELS whose flags, and every lower level's, this CPU has; None when it
    lacks even AVX2's (not x86, or an x86 vLLM's CPU build does not support)."""
    level = None
    for name in LEVELS:
        if not set(LEVEL_FLAGS[name]) <= flags:
            break
        level = name
    return level


def resolve(requested: str | None, detected: str | None) -> Cpu:
    """The level vLLM acts on: ``requested`` (FEWERBITS_CPU_CAPABILITY; unset, empty or ``auto``:
    this CPU's), never above what this CPU has."""
    wanted = (requested or "auto").strip().upper().replace("-", "")
    if wanted == "AUTO":
        return Cpu(detected, detected)
    if wanted not in LEVELS:
        raise CapabilityError(f"{CAPABILITY_ENV}={requested!r}: expected auto or one of {', '.join(LEVELS)}")
    if detected is None or LEVELS.index(wanted) > LEVELS.index(detected):
        raise CapabilityError(f"{CAPABILITY_ENV}={requested!r}: this CPU has only {detected or 'no AVX2'}; a level "
                              "can be emulated downwards, never upwards")
    return Cpu(detected, wanted)


def this_cpu(env: dict[str, str], cpuinfo_path: str = "/proc/cpuinfo") -> Cpu:
    """This machine's CPU as vLLM is to see it (FEWERBITS_CPU_CAPABILITY from ``env``)."""
    try:
        with open(cpuinfo_path, encoding="utf-8") as f:
            detected = detect_level(cpu_flags(f.read()))
    except OSError:
        detected = None
    return resolve(env.get(CAPABILITY_ENV), detected)


def for_cpu(args: list[str], cpu: Cpu) -> tuple[list[str], list[str]]:
    """``args`` with what this CPU's vLLM cannot honour translated (CPU_STAND_IN's CPU-dependent
    rows), and one line per translation saying what changed and why. Pure."""
    out, notes = list(args), []
    for i, a in enumerate(out):
        key, eq, value = a.partition("=")
        if key != "--kv-cache-dtype":
            continue
        value = value if eq else (out[i + 1] if i + 1 < len(out) else "")
        if value in FP8_KV_DTYPES and not cpu.fp8_kv_cache:
            if eq:
                out[i] = "--kv-cache-dtype=auto"
            else:
                out[i + 1] = "auto"
            notes.append(f"--kv-cache-dtype {value} served as auto (16-bit): vLLM's CPU build has no FP8 KV "
                         f"cache kernel on {cpu.describe()}, it needs AVX-512 or AMX")
    return out, notes


def unservable(config: dict, cpu: Cpu, args: list[str] | tuple[str, ...] = ()) -> str | None:
    """Why vLLM's CPU build at ``cpu``'s level cannot serve the checkpoint whose config.json is
    ``config`` with the command line ``args`` (None: it can, as far as this stand-in knows). Pure."""
    qcfg = config.get("quantization_config") or {}
    if not cpu.wna16 and weight_only_int(qcfg):
        return (f"this checkpoint's weight-only integer quantization (w4a16: GPTQ/AWQ) needs vLLM's "
                f"cpu_gemm_wna16 kernel, which vLLM's CPU build has only with AVX-512; CPU: {cpu.describe()}. "
                "vLLM would start, answer /health and fail every request")
    if lora_enabled(args) and int8_activations(qcfg) and not (cpu.level == "AMX" and int8_symmetric(qcfg)):
        return ("LoRA (--enable-lora) on this checkpoint's int8 weights with int8 activations (w8a8-int8) fails at "
                "start in vLLM's CPU build: its oneDNN int8 kernel (CPUInt8ScaledMMLinearKernel) prepacks the weight "
                "and sets layer.weight to None, and vLLM's LoRA layers take their device from layer.weight "
                "(lora/layers/utils.py _get_lora_device: AttributeError: 'NoneType' object has no attribute "
                f"'device'); only AMX with symmetric activations keeps the weight; CPU: {cpu.describe()}. A GPU's "
                "int8 kernels keep the weight and serve the adapters")
    return None


def lora_enabled(args: list[str] | tuple[str, ...]) -> bool:
    """``--enable-lora`` (or ``--enable-lora=true``) in a vLLM command line."""
    for a in args:
        key, eq, value = a.partition("=")
        if key == "--enable-lora":
            return not eq or value.strip().lower() in ("1", "true", "yes", "on")
    return False


def _int8_activation_groups(qcfg: dict) -> list[dict]:
    """compressed-tensors groups with int weights and int input activations (w8a8-int8)."""
    if qcfg.get("quant_method") != "compressed-tensors":
        return []
    return [g for g in (qcfg.get("config_groups") or {}).values()
            if (g.get("weights") or {}).get("type") == "int"
            and (g.get("input_activations") or {}).get("type") == "int"]


def int8_activations(qcfg: dict) -> bool:
    """A quantization_config whose linear layers run on vLLM's int8 scaled-mm kernels (w8a8-int8)."""
    return bool(_int8_activation_groups(qcfg))


def int8_symmetric(qcfg: dict) -> bool:
    """Every int8-activation group quantizes its activations symmetrically (compressed-tensors' default)."""
    return all((g.get("input_activations") or {}).get("symmetric", True) for g in _int8_activation_groups(qcfg))


def weight_only_int(qcfg: dict) -> bool:
    """A quantization_config whose linear layers run on vLLM's mixed-precision (WNA16) kernels:
    GPTQ/AWQ checkpoints, or compressed-tensors groups with int weights and no input activations."""
    if qcfg.get("quant_method") in ("gptq", "awq"):
        return True
    groups = (qcfg.get("config_groups") or {}).values() if qcfg.get("quant_method") == "compressed-tensors" else ()
    return any((g.get("weights") or {}).get("type") == "int" and not g.get("input_activations") for g in groups)


def model_config(args: list[str]) -> dict:
    """config.json of the model `serve MODEL ...` names ({} when it is not a local folder with one)."""
    model = args[1] if len(args) > 1 and args[0] == "serve" else ""
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def emulate(level: str | None) -> None:
    """In a vLLM process: torch.cpu's feature checks above ``level`` answer False (TORCH_CHECKS), so
    vLLM picks its kernels as on a CPU of that level."""
    if level is None:
        return
    import torch.cpu

    for name in LEVELS[LEVELS.index(level) + 1:]:
        for check in TORCH_CHECKS[name]:
            if hasattr(torch.cpu, check):
                setattr(torch.cpu, check, lambda: False)


def main(argv: list[str]) -> None:
    env = dict(os.environ)
    pod_ip = env.get("POD_IP") or "127.0.0.1"
    pod_dir = env.get("FEWERBITS_E2E_POD_DIR") or os.getcwd()
    try:
        cpu = this_cpu(env)
    except CapabilityError as e:
        sys.exit(f"fewerbits e2e: CapabilityError: {e}")
    args, notes = for_cpu(cpu_argv(argv, pod_ip, env), cpu)
    say(f"CPU level {cpu.describe()}")
    for note in notes:
        say(f"translated for this CPU: {note}")
    if env.get(PRECHECK_ENV) != "0" and (why := unservable(model_config(args), cpu, args)):
        print(f"CPUIncompatibleError: {why}", file=sys.stderr, flush=True)
        sys.exit(1)
    say("vLLM's CPU build for `vllm " + " ".join(argv) + "`: vllm " + " ".join(args))
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), CLI_MARK, *args], cpu_env(env, pod_dir, cpu))


def say(line: str) -> None:
    """One line of the stand-in's own in the container's log (every one starts with MARK)."""
    print(f"{MARK} {line}", file=sys.stderr, flush=True)


def run_cli(args: list[str]) -> None:
    """`vllm ARGS` through vLLM's own CLI, its version lookup answered from DISTRIBUTION."""
    import importlib.metadata as metadata

    real = metadata.version
    metadata.version = lambda name: real(DISTRIBUTION) if name == "vllm" else real(name)
    from vllm.entrypoints.cli.main import main as vllm_cli

    sys.argv = ["vllm", *args]
    vllm_cli()


if __name__ == "__main__":
    if sys.argv[1:2] == [CLI_MARK]:
        emulate(os.environ.get(CAPABILITY_ENV) or None)
        run_cli(sys.argv[2:])
    else:
        main(sys.argv[1:])
elif __name__ == "__mp_main__":  # a process vLLM spawned imports this file again: it sees the same CPU
    emulate(os.environ.get(CAPABILITY_ENV) or None)
