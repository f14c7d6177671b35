"""Which pods the harness really runs, and how: a map from image repository to a local command.

A pod any of whose container images contains a rule's `match` string is owned by the pod runner
(e2e/podrunner.py); kwok's pod stages are given a selector that skips exactly those pods. Everything
else is left to kwok's normal stages. The operator under test needs no test-only code: it renders
ordinary pods, and this table decides what a "container" of that image means on this machine.

Kinds of rule:
  module  — the image's entrypoint is `python -m <module>`: run it with this interpreter and the
            container's args (a container `command` replaces the entrypoint, Docker-style).
  command — run the container's own command + args (`python`/`python3` mean this interpreter).
  vllm    — a vLLM OpenAI server: run llm-d-inference-sim with the served model name, port and
            max-num-seqs taken from the vLLM arguments.
  vllm-cpu — a vLLM container run for real: its own command line (the launcher, then `vllm serve`
            with the operator's argv) under vLLM's CPU build, the stand-in for a GPU node; what a
            CPU cannot honour is translated in one place, e2e/vllm_cpu.py (CPU_STAND_IN). For
            tests that judge what vLLM does (the canary, real metrics, start failures); the
            simulator's text is random.
  noop    — a container that "runs" (init: succeeds at once; main: stays running) without a process.
  epp     — the Gateway API Inference Extension's endpoint picker: run the `epp` binary e2e/build.sh
            built from its Go module (the image's entrypoint) with the container's args; its ports
            (it listens on every interface) are moved to free local ports, forwarded from the pod IP.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ImageRule:
    match: str            # substring of the image reference, e.g. "fewerbits-quantjob"
    kind: str             # module | command | vllm | vllm-cpu | epp | noop
    module: str = ""      # for kind=module

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "ImageRule":
        return ImageRule(**d)


# The harness config. The `fewerbits-test/` entry is for tests of the harness itself (e.g. image
# `fewerbits-test/python` with `command: [python, -c, ...]`); no operator code refers to it.
DEFAULT_RULES = (
    # The chart's operator Deployment (command: python -m fewerbits_operator); it gets a kubeconfig
    # holding its ServiceAccount's token, so the chart's RBAC is what it runs with.
    ImageRule("fewerbits-operator", "module", "fewerbits_operator"),
    ImageRule("fewerbits-quantjob", "module", "fewerbits_quantjob"),
    ImageRule("fewerbits-runtime", "module", "fewerbits_runtime"),
    ImageRule("vllm/vllm-openai", "vllm"),
    # The real server for tests whose verdict depends on what vLLM does: vLLM's CPU build behind the
    # real launcher (before the generic `fewerbits-test/` rule, which would run the command as is).
    ImageRule("fewerbits-test/vllm-cpu", "vllm-cpu"),
    # The endpoint picker the operator deploys for an InferencePool (picker.py, FEWERBITS_EPP_IMAGE).
    ImageRule("gateway-api-inference-extension/epp", "epp"),
    ImageRule("fewerbits-test/", "command"),
)


def default_rules() -> list[ImageRule]:
    return list(DEFAULT_RULES)


def rule_for(image: str, rules: list[ImageRule]) -> ImageRule | None:
    for r in rules:
        if r.match in image:
            return r
    return None


def kwok_exclusion(rules: list[ImageRule]) -> dict | None:
    """A kwok Stage matchExpression (gojq query) that is true only for pods the runner does NOT own."""
    if not rules:
        return None
    regex = "|".join(_regex_escape(r.match) for r in rules)
    # The regex sits in a jq string literal: its backslashes and quotes need escaping again.
    regex = regex.replace("\\", "\\\\").replace('"', '\\"')
    query = f'[(.spec.containers // [])[].image, (.spec.initContainers // [])[].image] | any(test("{regex}"))'
    return {"key": query, "operator": "In", "values": ["false"]}


def _regex_escape(s: str) -> str:
    return "".join("\\" + ch if ch in ".^$*+?()[]{}|\\" else ch for ch in s)


def _python(argv: list[str]) -> list[str]:
    if argv and argv[0] in ("python", "python3", "python3.11"):
        return [sys.executable, *argv[1:]]
    return argv


def local_argv(rule: ImageRule, command: list[str] | None, args: list[str] | None) -> list[str]:
    """The local argv for a container of a module/command rule (Docker ENTRYPOINT/CMD semantics)."""
    command, args = list(command or []), list(args or [])
    if rule.kind == "module":
        return _python(command + args) if command else [sys.executable, "-m", rule.module, *args]
    if rule.kind == "command":
        if not command and not args:
            raise ValueError("a `command` image needs a container command or args")
        return _python(command + args)
    raise ValueError(f"rule kind {rule.kind} has no local argv")


@dataclass
class VLLMArgs:
    served_model_names: list[str]
    port: int
    max_num_seqs: int | None
    max_model_len: int | None
    model: str | None = None
    """The model directory (or name) vLLM loads: `vllm serve MODEL` or `--model MODEL`."""


def parse_vllm_args(argv: list[str]) -> VLLMArgs:
    """Pick out of a vLLM command line what the simulator needs; ignore the rest (dtype, TP, ...)."""
    served: list[str] = []
    model = None
    port = 8000
    max_num_seqs = max_model_len = None
    i = 0
    # `vllm serve MODEL ...` gives the model positionally.
    if "serve" in argv:
        j = argv.index("serve") + 1
        if j < len(argv) and not argv[j].startswith("-"):
            model = argv[j]
    while i < len(argv):
        a = argv[i]
        key, eq, val = a.partition("=")
        takes = (lambda: val) if eq else (lambda: argv[i + 1] if i + 1 < len(argv) else "")
        if key == "--served-model-name":
            if eq:
                served.append(val)
            else:
                k = i + 1
                while k < len(argv) and not argv[k].startswith("-"):
                    served.append(argv[k])
                    k += 1
                i = k - 1
        elif key == "--model":
            model = takes()
        elif key == "--port":
            port = int(takes())
        elif key == "--max-num-seqs":
            max_num_seqs = int(takes())
        elif key == "--max-model-len":
            max_model_len = int(takes())
        i += 1
    if not served:
        served = [model or "model"]
    return VLLMArgs(served, port, max_num_seqs, max_model_len, model)


# llm-d-inference-sim v0.10.2 accepts `POST /admin/config {"fake-metrics": ...}` only when it was
# started with --fake-metrics ("the simulator is reporting real metrics; fake metrics cannot be
# updated" otherwise). Tests drive autoscaling through that call, so by default sims start at zero
# load in fake-metrics mode; `real` keeps the simulator's own request accounting instead.
ZERO_FAKE_METRICS = '{"kv-cache-usage":0,"running-requests":0,"waiting-requests":0}'


def sim_argv(sim_binary: str, v: VLLMArgs, listen_port: int, metrics: str = "fake") -> list[str]:
    # The simulator's --model must not be a real hub model and needs the dummy tokenizer, or it
    # reaches for the internet (e2e/README.md). The served names are what clients see.
    argv = [sim_binary, "--port", str(listen_port), "--model", v.served_model_names[0],
            "--served-model-name", *v.served_model_names, "--force-dummy-tokenizer"]
    if v.max_num_seqs:
        argv += ["--max-num-seqs", str(v.max_num_seqs)]
    if v.max_model_len:
        argv += ["--max-model-len", str(v.max_model_len)]
    if metrics == "fake":
        argv += ["--fake-metrics", ZERO_FAKE_METRICS]
    return argv


def vllm_cpu_argv(command: list[str], args: list[str], vllm_python: str) -> list[str]:
    """A `vllm-cpu` container's own command line, as the image would run it: `python3` is the image's
    interpreter (the vLLM environment's, where the launcher copy runs with the torch vLLM brings) and
    `vllm` is found on PATH (e2e/vllm_cpu.py, put there by the runner). Nothing is translated here:
    the launcher sees the argv the operator rendered."""
    argv = list(command) + list(args)
    if not argv:
        raise ValueError("a vLLM container needs a command (the launcher, or vllm serve)")
    if argv[0] in ("python", "python3", "python3.11"):
        argv[0] = vllm_python
    return argv


EPP_PORT_FLAGS = {"--grpc-port": 9002, "--grpc-health-port": 9003, "--metrics-port": 9090}
"""The picker's listening ports and their defaults (cmd/epp/runner, v1.1.0)."""


def epp_argv(binary: str, args: list[str], free_port) -> tuple[list[str], dict[int, int]]:
    """The picker's argv with each listening port moved to a free local one, and {container port:
    local port} for the forwarders (pod IP:container port -> 127.0.0.1:local port)."""
    out: list[str] = []
    ports: dict[int, int] = {}
    seen: set[str] = set()
    i = 0
    while i < len(args):
        key, eq, val = args[i].partition("=")
        if key in EPP_PORT_FLAGS:
            value = val if eq else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if eq else 2
            seen.add(key)
            ports[int(value)] = local = free_port()
            out += [key, str(local)]
            continue
        out.append(args[i])
        i += 1
    for key, default in EPP_PORT_FLAGS.items():
        if key not in seen:
            ports[default] = local = free_port()
            out += [key, str(local)]
    return [binary, *out], ports
