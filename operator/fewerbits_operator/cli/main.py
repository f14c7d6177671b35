"""The ``fewerbits`` command.

Each subcommand lives in its own module with a ``register(subparsers)`` function that adds its
parser and sets ``func``; this module only wires them together.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version

from fewerbits_operator.cli import explain_cmd

from fewerbits_operator.cli import plan_cmd

from fewerbits_operator.cli import quality_cmd

from fewerbits_operator.cli import validate_cmd

# Subcommand modules, in the order `fewerbits --help` lists them.
SUBCOMMANDS = [validate_cmd, plan_cmd, explain_cmd, quality_cmd]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fewerbits",
        description="fewerbits: plan, quantize, gate, serve and autoscale quantized LLMs on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"fewerbits {version('fewerbits')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    crds = sub.add_parser("crds", help="print the CustomResourceDefinitions (YAML) generated from the API models")
    crds.set_defaults(func=_print_crds)
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def _print_crds(args: argparse.Namespace) -> int:
    from fewerbits_api.crdgen import render_all

    sys.stdout.write("---\n".join(render_all().values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
