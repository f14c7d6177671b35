"""Check vLLM command-line arguments against vLLM's own argument rules, without vLLM.

``vllm_args_v0.33.0.json`` beside this file is a dump of every option of the ``vllm serve``
parser of vLLM 0.33.0 (option strings, value type, choices, nargs), made by
``tools/vllm_args/dump_vllm_args.py`` from the real parser. This module reads it and applies the
same preprocessing vLLM's FlexibleArgumentParser does (``--a_b`` means ``--a-b``; ``--x=v``;
``--json-arg.key v`` for dict-valued options; ``-O3``) so that the planner's arguments are tested
and the operator can refuse a bad ``serving.extraArgs`` before a pod crash-loops on it.
"""

from __future__ import annotations

import difflib
import json
import re
from functools import lru_cache
from importlib import resources
from types import SimpleNamespace
from typing import Any, Sequence

VLLM_VERSION = "0.33.0"
"""The vLLM release the argument dump comes from (the serving image should match it)."""

_HUMAN_INT = re.compile(r"\d+(\.\d+)?[kKmMgGtT]?")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_DICT_TYPES = {"parse_dataclass", "loads", "union_dict_and_str"}


@lru_cache(maxsize=4)
def vllm_arg_spec(version: str = VLLM_VERSION) -> dict[str, Any]:
    """The dumped parser of a vLLM release: ``{"vllm_version", "options": {flag: {...}}, ...}``."""
    name = f"vllm_args_v{version}.json"
    try:
        text = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"no vLLM argument dump for version {version} ({name})") from None
    return json.loads(text)


def _looks_like_value(arg: str) -> bool:
    """A token that is a value, not a flag (negative numbers such as ``-1`` are values)."""
    return not arg.startswith("-") or bool(_NUMBER.fullmatch(arg))


def _check_value(flag: str, value: str, entry: dict[str, Any]) -> str | None:
    type_name = entry.get("type") or "str"
    if type_name.startswith("optional:"):
        if value in ("", "None"):
            return None
        type_name = type_name.removeprefix("optional:")
    choices = entry.get("choices")
    if choices is not None and value not in choices:
        shown = ", ".join(choices[:24]) + (", ..." if len(choices) > 24 else "")
        return f"{flag} {value!r}: not one of vLLM's choices ({shown})"
    try:
        if type_name == "int":
            int(value)
        elif type_name == "float":
            float(value)
        elif type_name == "human_readable_int":
            if not _HUMAN_INT.fullmatch(value.strip()):
                raise ValueError
        elif type_name == "human_readable_int_or_auto":
            if value.strip() not in ("auto", "-1") and not _HUMAN_INT.fullmatch(value.strip()):
                raise ValueError
        elif type_name in ("loads", "parse_dataclass"):
            json.loads(value)
        elif type_name == "union_dict_and_str":
            if re.match(r"(?s)^\s*{.*}\s*$", value):
                json.loads(value)
    except ValueError:
        readable = {
            "int": "an integer",
            "float": "a number",
            "human_readable_int": "an integer (suffixes k/K/m/M/g/G allowed)",
            "human_readable_int_or_auto": "an integer (k/M suffixes allowed), -1 or auto",
            "loads": "JSON",
            "parse_dataclass": "a JSON object",
            "union_dict_and_str": "a string or a JSON object",
        }.get(type_name, type_name)
        return f"{flag} {value!r}: must be {readable}"
    return None


def _suggest(flag: str, options: dict[str, Any]) -> str:
    close = difflib.get_close_matches(flag, [o for o in options if o.startswith("--")], n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def _optimization_level(arg: str, args: Sequence[str], i: int, errors: list[str]) -> int:
    """-O3, -O=3, -Odecode, or -O 3: the optimization level; the index after it."""
    level = arg[3:] if arg[2:3] == "=" else arg[2:]
    if level:
        return i
    if i < len(args) and args[i] in {"0", "1", "2", "3"}:
        return i + 1
    errors.append("-O: needs an optimization level")
    return i


def _values_after(args: Sequence[str], i: int, nargs: Any) -> tuple[list[str], int]:
    """The values an option takes from ``args[i:]`` (all that look like values for ``+``/``*``,
    else at most one), and the index after them."""
    if nargs in ("+", "*"):
        values = []
        while i < len(args) and _looks_like_value(args[i]):
            values.append(args[i])
            i += 1
        return values, i
    values = [args[i]] if i < len(args) and _looks_like_value(args[i]) else []
    return values, i + len(values)


def check_vllm_args(args: Sequence[str], version: str = VLLM_VERSION) -> list[str]:
    """Errors in a vLLM argument list (``[]`` when ``vllm serve MODEL *args`` would parse it).

    Checks that each flag exists in that vLLM release, that flags taking no value get none,
    that values are present and of the option's type (int, float, JSON, human-readable int) and
    among its choices (argparse choices, and the KV-cache dtypes and quantization methods vLLM
    validates after parsing). A bare value with no flag before it is an error: the operator
    places the model path itself.
    """
    spec = vllm_arg_spec(version)
    options: dict[str, dict[str, Any]] = spec["options"]
    errors: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or _NUMBER.fullmatch(arg):
            errors.append(f"{arg!r}: a value with no option before it (the model path is set by the operator)")
            continue
        if arg.startswith("-O") and not arg.startswith("--"):
            i = _optimization_level(arg, args, i, errors)
            continue
        name, has_eq, inline = arg.partition("=")
        if name.startswith("--"):
            base, dot, _ = name[2:].partition(".")
            flag = "--" + base.replace("_", "-")
        else:
            base, dot, flag = name[1:], "", name
        entry = options.get(flag)
        if entry is None:
            errors.append(f"{flag}: not an option of vLLM {spec.get('vllm_version', version)}{_suggest(flag, options)}")
            if not has_eq and i < len(args) and _looks_like_value(args[i]):
                i += 1  # skip its value, so it is not reported again
            continue
        if dot:
            # --compilation-config.level 3: a key of a dict-valued option, any JSON-ish value.
            type_name = (entry.get("type") or "").removeprefix("optional:")
            if type_name not in _DICT_TYPES:
                errors.append(f"{name}: {flag} does not take dotted keys")
            if not has_eq:
                if i < len(args):
                    i += 1
                else:
                    errors.append(f"{name}: needs a value")
            continue
        if entry["kind"] in ("flag", "boolean_optional"):
            if has_eq:
                errors.append(f"{flag}: takes no value (got {inline!r})")
            continue
        nargs = entry.get("nargs")
        values, i = ([inline], i) if has_eq else _values_after(args, i, nargs)
        if not values and nargs not in ("?", "*"):
            errors.append(f"{flag}: needs a value")
            continue
        for value in values:
            problem = _check_value(flag, value, entry)
            if problem:
                errors.append(problem)
    return errors


def served_model_name(spec: Any, model: str) -> str:
    """The name vLLM serves the model under: ``spec.serving.servedModelName``, else the model's own
    name. The one place that resolves it (the serving pod, the canary's contract and hash)."""
    return spec.serving.servedModelName or model


def plan_args(variant: Any, served_model_name: str | None) -> list[str]:
    """The vLLM arguments a planned variant implies, rendered from its typed fields (a
    ``PlanVariant``): the one place that spells them. The serving pod's command and the plan's
    display (``status.plan.variants[].vllmArgs``, ``fewerbits plan``) both come from here.
    compressed-tensors checkpoints carry their quantization config: no ``--quantization`` flag."""
    args: list[str] = []
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    return args + [
        "--dtype", variant.dtype,
        "--kv-cache-dtype", variant.kvCacheDtype,
        "--tensor-parallel-size", str(variant.tensorParallelSize),
        "--max-model-len", str(variant.maxModelLen),
        "--gpu-memory-utilization", f"{variant.gpuMemoryUtilization:g}",
    ] + multinode_args(variant)


def lora_args(lora: Any) -> list[str]:
    """The flags that size a variant's LoRA adapters (a ``LoraPlan``; none without adapters), shown
    by ``fewerbits plan``. Not in ``plan_args``: a pool's pods carry them (render.adapter_args)
    only while some adapter passed its gate there, so no pod pays for LoRA buffers it does not use."""
    if lora is None:
        return []
    return ["--enable-lora", "--max-loras", str(lora.maxLoras), "--max-lora-rank", str(lora.maxLoraRank),
            "--max-cpu-loras", str(lora.maxCpuLoras)]


def multinode_args(variant: Any) -> list[str]:
    """Arguments every pod of a multi-node replica shares: one pipeline stage per node, vLLM's
    multiprocessing executor across ``--nnodes`` (planner/multinode.py says why not Ray). The
    per-pod ones (``--node-rank``, ``--master-addr``, ``--headless``) are the renderer's."""
    nodes = getattr(variant, "nodesPerReplica", 1) or 1
    if nodes < 2:
        return []
    return ["--pipeline-parallel-size", str(nodes), "--nnodes", str(nodes)]


RENDERER_FLAGS = frozenset({
    "--model", "--host", "--port", "--load-format", "--quantization", "--revision", "--tokenizer",
    "--node-rank", "--master-addr", "--master-port", "--headless",
})
"""vLLM flags the renderers set or that the artifact decides: the model path, ``--host``/``--port``
(render.py), ``--load-format`` (streaming), each pod's rendezvous in a multi-node group (lws.py);
the artifact's checkpoint carries its quantization, revision and tokenizer."""


def _every_plan_flag() -> frozenset[str]:
    """Every flag ``plan_args`` emits: asked of a variant that takes every branch (a served name,
    several nodes per replica)."""
    probe = SimpleNamespace(dtype="bfloat16", kvCacheDtype="auto", tensorParallelSize=8, maxModelLen=4096,
                            gpuMemoryUtilization=0.9, nodesPerReplica=2)
    return frozenset(a for a in plan_args(probe, "served") if a.startswith("--"))


PLAN_OWNED_FLAGS = _every_plan_flag() | RENDERER_FLAGS
"""The flags ``serving.extraArgs`` may not override (unless a policy allows them): what the plan
sets, derived from ``plan_args`` so a flag it starts emitting is owned at once, and the renderers'."""
