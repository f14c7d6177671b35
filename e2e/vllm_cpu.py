"""The `vllm` executable of the test image `fewerbits-test/vllm-cpu`: vLLM's CPU build standing in
for vLLM on a GPU node.

The pod runner (e2e/podrunner.py, rule kind `vllm-cpu`) runs the serving container's real command
line: the real launcher (`python3 -m fewerbits_runtime launch ... -- vllm serve DIR ...`, from the
copy the fetch init container installed) with this environment's interpreter as the image's
`python3`, and a `vllm` on PATH that is this file. So the launcher's checks (the artifact's format
against the node's compute capability) run exactly as in the real image, and what it execs arrives
here with the argv the operator rendered. This file changes only what a CPU cannot honour, all of it
listed in `CPU_STAND_IN` below, and execs vLLM's OpenAI server from the CPU build.

It runs under the vLLM environment's interpreter (e2e/build.sh component `vllm`), standard library
only, by path (not as a package module): nothing of the project is importable there.
"""

from __future__ import annotations

import os
import sys

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""`vllm serve` fails in the CPU build (its distribution is named `vllm-cpu`, so the CLI's
`importlib.metadata.version("vllm")` raises PackageNotFoundError); the server module is the same
server under its module entry point."""

DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024
"""A GPU sizes its KV cache from --gpu-memory-utilization; a CPU takes an explicit size. 64 MiB holds
65,536 tokens of the tiny test model at 16 bits (131,072 with an FP8 KV cache)."""

CPU_STAND_IN: dict[str, str] = {
    "serve MODEL": "--model MODEL: the CPU build's module entry point (see SERVER_MODULE)",
    "--host": "the pod's IP: every pod shares this machine's network, its loopback IP is its own",
    "--tensor-parallel-size": "dropped: one CPU process, no GPUs to shard across",
    "--gpu-memory-utilization": f"dropped; the KV cache gets --kv-cache-memory-bytes {DEFAULT_KV_CACHE_BYTES} "
                                "unless the command or VLLM_CPU_KVCACHE_SPACE sizes it",
    "--enforce-eager": "added when absent: vLLM's torch.compile of the model is an optimisation of the GPU "
                       "node's kernels; on this CPU it costs 2+ minutes per start under load (measured: "
                       "init engine 129.7 s without it) and every pod compiles again",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CACHE_ROOT": "the pod's own folder (compile caches are not shared between pods)",
}
"""Everything this stand-in changes between the operator's command line and the server it starts.
Every other flag (dtype, --kv-cache-dtype, --max-model-len, --max-num-seqs, --enforce-eager,
--served-model-name, --port, ...) reaches vLLM as rendered."""

DROPPED_FLAGS = ("--tensor-parallel-size", "--gpu-memory-utilization")


def cpu_argv(argv: list[str], pod_ip: str, env: dict[str, str]) -> list[str]:
    """The server's arguments for a `vllm` command line (`serve MODEL ...` or `--model MODEL ...`),
    translated as CPU_STAND_IN says. Pure: the caller supplies the pod IP and the environment."""
    args = list(argv)
    if args and args[0] == "serve":
        args = args[1:]
        if args and not args[0].startswith("-"):
            args = ["--model", args[0], *args[1:]]
    out: list[str] = []
    i = 0
    while i < len(args):
        key, eq, _ = args[i].partition("=")
        if key in DROPPED_FLAGS or key == "--host":  # each takes one value
            i += 1 if eq else 2
            continue
        out.append(args[i])
        i += 1
    out += ["--host", pod_ip]
    if "--enforce-eager" not in out:
        out.append("--enforce-eager")
    sized = any(a.partition("=")[0] == "--kv-cache-memory-bytes" for a in out) or env.get("VLLM_CPU_KVCACHE_SPACE")
    if not sized:
        out += ["--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES)]
    return out


def cpu_env(env: dict[str, str], pod_dir: str) -> dict[str, str]:
    """The server's environment: the container's, plus what CPU_STAND_IN names."""
    return {**env, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": os.path.join(pod_dir, "vllm-cache")}


def main(argv: list[str]) -> None:
    env = dict(os.environ)
    pod_ip = env.get("POD_IP") or "127.0.0.1"
    pod_dir = env.get("FEWERBITS_E2E_POD_DIR") or os.getcwd()
    server = [sys.executable, "-m", SERVER_MODULE, *cpu_argv(argv, pod_ip, env)]
    print("fewerbits e2e: vLLM's CPU build for `vllm " + " ".join(argv) + "`: " + " ".join(server[1:]),
          file=sys.stderr, flush=True)
    os.execve(sys.executable, server, cpu_env(env, pod_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
