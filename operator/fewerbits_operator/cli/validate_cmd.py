"""``fewerbits validate FILE...``: check QuantizedModel and QuantizationPolicy manifests offline,
with the same rules the operator applies, and print each error with the field it names."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from fewerbits_api.errors import format_validation_error
from fewerbits_api.policy import QuantizationPolicy
from fewerbits_api.quantizedmodel import QuantizedModel

KINDS = {"QuantizedModel": QuantizedModel, "QuantizationPolicy": QuantizationPolicy}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="validate QuantizedModel / QuantizationPolicy YAML files offline")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        except (OSError, yaml.YAMLError) as e:
            print(f"{path}: cannot read: {e}", file=sys.stderr)
            failed += 1
            continue
        for doc in docs:
            kind = doc.get("kind") if isinstance(doc, dict) else None
            name = (doc.get("metadata") or {}).get("name", "?") if isinstance(doc, dict) else "?"
            model = KINDS.get(kind)
            if model is None:
                print(f"{path}: {kind or 'document'}/{name}: not a fewerbits kind, skipped")
                continue
            try:
                model.model_validate(doc)
            except ValidationError as e:
                failed += 1
                print(f"{path}: {kind}/{name}: invalid", file=sys.stderr)
                for line in format_validation_error(e):
                    print(f"  {line}", file=sys.stderr)
            else:
                print(f"{path}: {kind}/{name}: valid")
    return 1 if failed else 0
