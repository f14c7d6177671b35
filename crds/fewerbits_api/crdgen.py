"""Generate the CustomResourceDefinitions in ``crds/bases/`` from the pydantic models.

    python -m fewerbits_api.crdgen [--out crds/bases] [--check]

The models are the single source of truth; this turns their JSON Schema into a *structural*
OpenAPI v3 schema as the API server requires: ``$ref`` inlined, optionals unwrapped, JSON Schema
2020 bounds rewritten to OpenAPI 3.0 form, titles dropped, docstrings kept as descriptions (what
``kubectl explain`` prints), CEL rules (``x-kubernetes-validations``) carried from the models.

Defaults are deliberately *not* emitted: the API server would fill them in, and a policy
default could then never apply (see ``quantizedmodel``). The description says the default.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from . import policy, quantizedmodel
from .base import GROUP, VERSION

_DROP = {"title", "default", "examples"}
_STATUS_CONDITION_LIST = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
            extra = {k: v for k, v in node.items() if k != "$ref"}
            target.update(extra)
            return _resolve(target, defs)
        return {k: _resolve(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    return node


def _describe_default(description: str, default: Any) -> str:
    if default is None or default == [] or default == {} or isinstance(default, dict):
        return description
    shown = json.dumps(default) if not isinstance(default, str) else default
    return f"{description.rstrip()} Default: {shown}."


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one resolved JSON Schema node into a structural OpenAPI v3 schema node."""
    node = dict(node)
    default = node.get("default")
    # Optional[X]: anyOf [X, null] -> X (absent means unset; the operator never writes null).
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express a union of {len(options)} types structurally: {options}")
        inner = options[0]
        outer_desc = node.get("description")
        node = {**inner, **{k: v for k, v in node.items() if k not in ("anyOf",)}}
        if outer_desc:
            node["description"] = outer_desc
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "description" in node:
        node["description"] = _describe_default(" ".join(node["description"].split()), default)
    for key in _DROP:
        node.pop(key, None)
    # JSON Schema 2020 exclusive bounds are numbers; OpenAPI 3.0 uses a boolean beside min/max.
    if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"] = node.pop("exclusiveMinimum")
        node["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node and not isinstance(node["exclusiveMaximum"], bool):
        node["maximum"] = node.pop("exclusiveMaximum")
        node["exclusiveMaximum"] = True
    if node.get("type") == "object":
        props = node.get("properties")
        if props:
            node["properties"] = {k: _structural(v) for k, v in props.items()}
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            node["additionalProperties"] = _structural(extra)
        elif extra is False:
            node.pop("additionalProperties")  # structural schemas prune unknown fields anyway
        names = node.pop("propertyNames", None) or {}
        patterned = node.pop("patternProperties", None)
        if patterned:
            # dict[ConstrainedKey, V]: pydantic emits patternProperties, which structural schemas
            # lack. The value schema becomes additionalProperties; the key pattern a CEL rule.
            (key_pattern, value_schema), = patterned.items()
            node["additionalProperties"] = _structural(value_schema)
            names = {**names, "pattern": key_pattern}
        if "pattern" in names or "enum" in names:
            # Structural schemas have no propertyNames: check the keys with CEL instead (a key
            # the schema let through would make the models refuse the whole object later).
            rules = node.setdefault("x-kubernetes-validations", [])
            max_props = node.get("maxProperties")
            if "pattern" in names:
                rules.append({
                    "rule": f"self.all(k, k.matches({json.dumps(names['pattern'])}))",
                    "message": "keys must be valid label keys",
                })
            else:
                allowed = list(names["enum"])
                rules.append({
                    "rule": f"self.all(k, k in {json.dumps(allowed)})",
                    "message": f"keys must be one of: {', '.join(allowed)}",
                })
            if max_props is None:
                node["maxProperties"] = 64
    if node.get("type") == "array" and "items" in node:
        node["items"] = _structural(node["items"])
    if node.get("type") == "string" and "enum" in node:
        node["enum"] = list(node["enum"])
    return node


def _schema_of(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(_resolve(raw, defs))


def _root_schema(kind_model: type, spec_model: type, status_model: type | None,
                 extra_rules: list[dict[str, str]]) -> dict[str, Any]:
    props: dict[str, Any] = {
        "apiVersion": {"type": "string", "description": "API version of this object."},
        "kind": {"type": "string", "description": "Kind of this object."},
        "metadata": {"type": "object"},
        "spec": _schema_of(spec_model),
    }
    if status_model is not None:
        status = _schema_of(status_model)
        conditions = status["properties"].get("conditions")
        if conditions:
            conditions.update(_STATUS_CONDITION_LIST)
        props["status"] = status
    root = {
        "type": "object",
        "description": " ".join((kind_model.__doc__ or "").split()),
        "properties": props,
        "required": ["spec"] if "source" in props["spec"].get("properties", {}) else [],
    }
    if not root["required"]:
        root.pop("required")
    if extra_rules:
        root["x-kubernetes-validations"] = extra_rules
    return root


def quantizedmodel_crd() -> dict[str, Any]:
    schema = _root_schema(
        quantizedmodel.QuantizedModel, quantizedmodel.QuantizedModelSpec, quantizedmodel.QuantizedModelStatus,
        [{
            # The name becomes Deployment/Service/Job names with pool and hash suffixes.
            "rule": "self.metadata.name.size() <= 40",
            "message": "metadata.name must be at most 40 characters (it prefixes Deployment and Job names)",
        }],
    )
    return _crd(
        plural=quantizedmodel.PLURAL, kind=quantizedmodel.KIND, short_names=quantizedmodel.SHORT_NAMES,
        scope="Namespaced", schema=schema,
        columns=[
            {"name": "Formats", "type": "string", "jsonPath": ".status.formats",
             "description": "Quantization formats in the plan"},
            {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
             "description": "Whether every variant serves"},
            {"name": "Replicas", "type": "string", "jsonPath": ".status.replicas",
             "description": "Ready/desired replicas over all variants"},
            {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
             "description": "Why the model is or is not ready"},
            {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1,
             "description": "OpenAI-compatible endpoint"},
            {"name": "Recovery", "type": "string", "jsonPath": ".status.worstRecovery", "priority": 1,
             "description": "Lowest quality recovery (quantized / base) over the gate's metrics"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    )


def quantizationpolicy_crd() -> dict[str, Any]:
    schema = _root_schema(policy.QuantizationPolicy, policy.QuantizationPolicySpec, policy.QuantizationPolicyStatus, [])
    return _crd(
        plural=policy.PLURAL, kind=policy.KIND, short_names=policy.SHORT_NAMES, scope="Cluster",
        schema=schema,
        columns=[
            {"name": "Priority", "type": "integer", "jsonPath": ".spec.priority",
             "description": "Layering order among matching policies (docs/policies.md)"},
            {"name": "Formats", "type": "string", "jsonPath": ".spec.rules.allowedFormats",
             "description": "Allowed formats (empty: all)"},
            {"name": "Valid", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Valid")].status',
             "description": "Whether the policy parses and combines with the others"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    )


def _crd(*, plural: str, kind: str, short_names: list[str], scope: str, schema: dict[str, Any],
         columns: list[dict[str, Any]]) -> dict[str, Any]:
    version: dict[str, Any] = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "additionalPrinterColumns": columns,
    }
    if "status" in schema["properties"]:
        version["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "fewerbits", "app.kubernetes.io/part-of": "fewerbits"},
        },
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short_names,
                "categories": ["fewerbits"],
            },
            "versions": [version],
        },
    }


HEADER = "# Generated by `python -m fewerbits_api.crdgen` from the pydantic models. Do not edit.\n"


def render_all() -> dict[str, str]:
    """File name -> YAML text for every CRD."""
    out = {}
    for crd in (quantizedmodel_crd(), quantizationpolicy_crd()):
        name = f"{crd['spec']['group']}_{crd['spec']['names']['plural']}.yaml"
        out[name] = HEADER + yaml.safe_dump(crd, sort_keys=False, width=100, allow_unicode=False)
    return out


def default_out_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "bases"


def chart_crd_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "charts" / "fewerbits" / "templates" / "crds"


CHART_HEADER = (
    "{{- /* Generated by `python -m fewerbits_api.crdgen` from the pydantic models. Do not edit. */ -}}\n"
    "{{- if .Values.crds.enabled }}\n"
)


def render_chart() -> dict[str, str]:
    """The same CRDs as Helm templates: behind `crds.enabled`, kept on uninstall when `crds.keep`."""
    out = {}
    for crd in (quantizedmodel_crd(), quantizationpolicy_crd()):
        crd = copy.deepcopy(crd)
        name = f"{crd['spec']['group']}_{crd['spec']['names']['plural']}.yaml"
        body = yaml.safe_dump(crd, sort_keys=False, width=100, allow_unicode=False)
        # Helm keeps the CRDs (and so every QuantizedModel) when the release is uninstalled.
        body = body.replace("  labels:\n", "  annotations:\n"
                            "    {{- if .Values.crds.keep }}\n"
                            "    helm.sh/resource-policy: keep\n"
                            "    {{- end }}\n"
                            "  labels:\n", 1)
        out[name] = CHART_HEADER + body + "{{- end }}\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fewerbits_api.crdgen", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out_dir(), help="directory for the CRD YAML")
    parser.add_argument("--check", action="store_true", help="fail if the files on disk differ from the models")
    parser.add_argument("--no-chart", dest="chart", action="store_false",
                        help="skip the Helm chart's copy (charts/fewerbits/templates/crds)")
    args = parser.parse_args(argv)
    targets = [(args.out / name, text) for name, text in render_all().items()]
    if args.chart:
        targets += [(chart_crd_dir() / name, text) for name, text in render_chart().items()]
    drift = False
    for path, text in targets:
        current = path.read_text() if path.exists() else ""
        if args.check:
            if current != text:
                drift = True
                sys.stdout.writelines(difflib.unified_diff(
                    current.splitlines(True), text.splitlines(True), f"{path} (on disk)", f"{path} (from models)"))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if current != text:
            path.write_text(text)
            print(f"wrote {path}")
    if drift:
        print("CRDs drifted from the models: run `python -m fewerbits_api.crdgen`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
