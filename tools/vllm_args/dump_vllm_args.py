"""Dump every option of vLLM's own ``vllm serve`` argument parser to JSON.

Run it in a throwaway virtual environment that has the vLLM release installed (never in the
project's environment, never in CI — CI uses the checked-in JSON):

    python3.11 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install vllm==0.33.0
    VLLM_TARGET_DEVICE=cpu /tmp/vllm-venv/bin/python tools/vllm_args/dump_vllm_args.py \
        > operator/fewerbits_operator/planner/vllm_args_v0.33.0.json

``VLLM_TARGET_DEVICE=cpu`` is needed on a machine without a GPU: building the parser
instantiates vLLM's DeviceConfig, which fails to infer a device otherwise. The option strings,
types, choices and nargs do not depend on the platform (a few defaults do; they are not dumped).
See NOTES.md beside this file.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys


def _type_name(t) -> str | None:
    """The converter's name; vLLM's wrappers are unwrapped: ``optional_type(int)`` gives
    ``optional:int`` (it also takes "" and "None"), ``parse_type(json.loads)`` gives ``loads``."""
    if t is None:
        return None
    if isinstance(t, functools.partial):
        return _type_name(t.func)
    name = getattr(t, "__name__", None) or type(t).__name__
    inner = [c.cell_contents for c in (getattr(t, "__closure__", None) or ()) if callable(c.cell_contents)]
    if name == "_optional_type" and inner:
        return "optional:" + (_type_name(inner[0]) or "str")
    if name == "_parse_type" and inner:
        return _type_name(inner[0])
    return name


def _choices(action: argparse.Action) -> list | None:
    if action.choices is None:
        return None
    try:
        return sorted({str(c) for c in action.choices})
    except TypeError:
        return None


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "boolean_optional"
    if action.nargs == 0:
        return "flag"  # store_true/store_false/store_const/count/help/version
    return "value"


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    options: dict[str, dict] = {}
    positionals: list[dict] = []
    for action in parser._actions:
        entry = {
            "dest": action.dest,
            "kind": _kind(action),
            "type": _type_name(action.type),
            "nargs": action.nargs if action.nargs is None or isinstance(action.nargs, (int, str)) else str(action.nargs),
            "choices": _choices(action),
            "action": type(action).__name__,
        }
        if not action.option_strings:
            positionals.append(entry)
            continue
        for opt in action.option_strings:
            options[opt] = entry
    # Options whose values vLLM checks after parsing rather than with argparse choices.
    from vllm.config.cache import KV_CACHE_DTYPES
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    for opt, values, source in (
        ("--kv-cache-dtype", KV_CACHE_DTYPES, "vllm.config.cache.KV_CACHE_DTYPES (CacheConfig validates it)"),
        ("--quantization", QUANTIZATION_METHODS, "vllm.model_executor.layers.quantization.QUANTIZATION_METHODS"),
    ):
        for o in [k for k, v in options.items() if v is options.get(opt)]:
            options[o] = dict(options[o], choices=sorted(set(values)), choices_source=source)
    out = {
        "vllm_version": vllm.__version__,
        "parser": "vllm.entrypoints.common.cli_args.make_arg_parser(FlexibleArgumentParser()) (vllm serve)",
        "positionals": positionals,
        "options": dict(sorted(options.items())),
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
