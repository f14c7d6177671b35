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

import os
import sys

DISTRIBUTION = "vllm-cpu"
"""The CPU build's distribution name. vLLM's CLI (`vllm serve`) asks `importlib.metadata` for the
version of `vllm`, which raises PackageNotFoundError here; the stand-in answers it with this
distribution's version and runs the CLI itself, so `vllm serve` (and `--headless`, which only the
CLI honours) behaves as in the real image."""

CLI_MARK = "--fewerbits-run-vllm-cli"
"""First argument of the re-exec that runs vLLM's CLI in the server's environment."""

DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024
"""A GPU sizes its KV cache from --gpu-memory-utilization; a CPU takes an explicit size. 64 MiB holds
65,536 tokens of the tiny test model at 16 bits (131,072 with an FP8 KV cache)."""

EAGER_TRACE = '{"mode":1,"backend":"eager"}'
"""torch.compile (vLLM compilation mode 1) with the eager backend: a warm-up, no code generation."""

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


def cpu_env(env: dict[str, str], pod_dir: str) -> dict[str, str]:
    """The server's environment: the container's, plus what CPU_STAND_IN names."""
    return {**env, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": os.path.join(pod_dir, "vllm-cache")}


def main(argv: list[str]) -> None:
    env = dict(os.environ)
    pod_ip = env.get("POD_IP") or "127.0.0.1"
    pod_dir = env.get("FEWERBITS_E2E_POD_DIR") or os.getcwd()
    server = [sys.executable, os.path.abspath(__file__), CLI_MARK, *cpu_argv(argv, pod_ip, env)]
    print("fewerbits e2e: vLLM's CPU build for `vllm " + " ".join(argv) + "`: vllm " + " ".join(server[3:]),
          file=sys.stderr, flush=True)
    os.execve(sys.executable, server, cpu_env(env, pod_dir))


def run_cli(args: list[str]) -> None:
    """`vllm ARGS` through vLLM's own CLI, its version lookup answered from DISTRIBUTION."""
    import importlib.metadata as metadata

    real = metadata.version
    metadata.version = lambda name: real(DISTRIBUTION) if name == "vllm" else real(name)
    from vllm.entrypoints.cli.main import main as vllm_cli

    sys.argv = ["vllm", *args]
    vllm_cli()


if __name__ == "__main__":  # vLLM's spawned processes import this file again: nothing runs then
    if sys.argv[1:2] == [CLI_MARK]:
        run_cli(sys.argv[2:])
    else:
        main(sys.argv[1:])
