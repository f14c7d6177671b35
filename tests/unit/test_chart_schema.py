"""The chart's values.schema.json checks `defaultPolicy.spec` against the QuantizationPolicy CRD's own
schema, converted to JSON Schema draft-07 (what Helm validates values with).

The CRD is generated from the pydantic models (crds/bases/); this test keeps the chart's copy equal
to it. After changing the policy model and regenerating the CRDs, refresh the copy with

    .venv/bin/python tests/unit/test_chart_schema.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "bases" / "fewerbits.io_quantizationpolicies.yaml"
SCHEMA = ROOT / "charts" / "fewerbits" / "values.schema.json"


def _to_draft07(node: Any) -> Any:
    """OpenAPI v3 (structural, as in a CRD) → draft-07 with `additionalProperties: false` on every
    object that lists its properties (the API server prunes unknown fields silently; the chart
    refuses them). Kubernetes extensions are dropped: CEL rules are the API server's to check."""
    if isinstance(node, list):
        return [_to_draft07(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_draft07(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    # OpenAPI v3.0 / draft-04 booleans: {minimum: m, exclusiveMinimum: true} is draft-07's
    # {exclusiveMinimum: m}.
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(flag) is True:
            out[flag] = out.pop(bound)
        elif out.get(flag) is False:
            del out[flag]
    if out.get("nullable") is True and "type" in out:
        out["type"] = [out["type"], "null"]
    out.pop("nullable", None)
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def policy_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return _to_draft07(spec)


def test_default_policy_schema_is_the_crd_schema():
    schema = json.loads(SCHEMA.read_text())
    got = schema["properties"]["defaultPolicy"]["properties"]["spec"]
    assert got == policy_spec_schema(), (
        "values.schema.json's defaultPolicy.spec differs from the QuantizationPolicy CRD; run "
        "`.venv/bin/python tests/unit/test_chart_schema.py` to refresh it")


def test_every_object_in_the_schema_is_closed():
    """cert-manager's rule: an unknown key anywhere in the values is an error, not ignored."""
    schema = json.loads(SCHEMA.read_text())
    open_objects: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and node.get("additionalProperties") is not False:
                open_objects.append(path)
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(schema, "#")
    assert schema["additionalProperties"] is False
    assert open_objects == []


def test_no_draft04_booleans_left():
    """Helm validates with a draft-07 validator: a boolean exclusiveMinimum is an invalid schema there."""
    text = SCHEMA.read_text()
    assert '"exclusiveMinimum": true' not in text and '"exclusiveMaximum": true' not in text


if __name__ == "__main__":
    schema = json.loads(SCHEMA.read_text())
    schema["properties"]["defaultPolicy"]["properties"]["spec"] = policy_spec_schema()
    SCHEMA.write_text(json.dumps(schema, indent=2) + "\n")
    print(f"wrote {SCHEMA.relative_to(ROOT)}", file=sys.stderr)
