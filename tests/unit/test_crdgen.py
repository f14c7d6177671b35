"""The CRD generator: committed YAML equals the models, and the CRDs carry what the API needs."""

from __future__ import annotations

import pytest
import yaml

from fewerbits_api import crdgen


@pytest.fixture(scope="module")
def crds() -> dict[str, dict]:
    return {yaml.safe_load(t)["spec"]["names"]["kind"]: yaml.safe_load(t) for t in crdgen.render_all().values()}


def walk(schema: dict, path: str = ""):
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def test_committed_crds_do_not_drift_from_the_models(capsys):
    rc = crdgen.main(["--check"])
    out = capsys.readouterr()
    assert rc == 0, f"committed CRDs differ from the models; run `python -m fewerbits_api.crdgen`\n{out.out}"


def test_check_detects_drift(tmp_path, capsys):
    crdgen.main(["--out", str(tmp_path), "--no-chart"])
    target = next(tmp_path.glob("*quantizedmodels.yaml"))
    target.write_text(target.read_text().replace("maxReplicas", "maxReplica"))
    assert crdgen.main(["--out", str(tmp_path), "--check", "--no-chart"]) == 1
    assert "maxReplica" in capsys.readouterr().out


def test_schema_is_structural(crds):
    for kind, crd in crds.items():
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in walk(schema):
            for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "default", "const", "propertyNames"):
                assert banned not in node, f"{kind} {path} has {banned}"
            if path and path != "metadata":
                assert "type" in node, f"{kind} {path} has no type"
            if "exclusiveMinimum" in node:
                assert node["exclusiveMinimum"] is True and "minimum" in node


def test_every_spec_field_has_a_description(crds):
    for kind, crd in crds.items():
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in walk(schema["properties"]["spec"], "spec"):
            if path.endswith("[]") or path.endswith("{}"):
                continue
            assert node.get("description"), f"{kind} {path} has no description"


def test_quantizedmodel_crd_shape(crds):
    crd = crds["QuantizedModel"]
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["shortNames"] == ["qm"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Formats"] == ".status.formats"
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Replicas"] == ".status.replicas"
    assert columns["Age"] == ".metadata.creationTimestamp"
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "x-kubernetes-validations" in version["schema"]["openAPIV3Schema"]
    assert spec["quantization"]["properties"]["format"]["enum"][:2] == ["auto", "none"]
    kv = spec["autoscaling"]["properties"]["targetKVCacheUsage"]
    assert kv["minimum"] == 0 and kv["exclusiveMinimum"] is True and kv["maximum"] == 1
    rules = [r["rule"] for r in spec["autoscaling"]["x-kubernetes-validations"]]
    assert any("minReplicas <= self.maxReplicas" in r for r in rules)
    assert spec["source"]["properties"]["uri"]["pattern"].startswith("^(hf://")
    target_rules = spec["serving"]["properties"]["targets"]["items"]["x-kubernetes-validations"]
    assert "size() == 1" in target_rules[0]["rule"]
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"


def test_defaults_are_described_not_emitted(crds):
    spec = crds["QuantizedModel"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    desc = spec["properties"]["autoscaling"]["properties"]["scaleDownDelaySeconds"]["description"]
    assert desc.endswith("Default: 300.")


def test_policy_crd_is_cluster_scoped(crds):
    crd = crds["QuantizationPolicy"]
    assert crd["spec"]["scope"] == "Cluster"
    assert crd["spec"]["names"]["shortNames"] == ["qp"]
    node_selector = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "rules"]["properties"]["quantizationJob"]["properties"]["nodeSelector"]
    assert node_selector["additionalProperties"]["type"] == "string"
    assert any("k.matches(" in r["rule"] for r in node_selector["x-kubernetes-validations"])


def test_chart_copy_is_the_same_crd_behind_crds_enabled():
    for name, text in crdgen.render_chart().items():
        assert text.splitlines()[1] == "{{- if .Values.crds.enabled }}" and text.endswith("{{- end }}\n")
        assert "helm.sh/resource-policy: keep" in text
        plain = "\n".join(ln for ln in text.splitlines() if "{{" not in ln and "resource-policy" not in ln
                          and ln != "  annotations:")
        assert yaml.safe_load(plain) == yaml.safe_load(crdgen.render_all()[name])


def _numbers(node, path: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _numbers(v, f"{path}.{k}" if path else k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path, node


def test_every_number_in_the_crds_reads_back_as_written(crds):
    """The API server keeps a schema's numbers (minimum, maximum, ...) as float64 and writes them back
    in their shortest form, so 2**62 comes back as 4611686018427388000. Argo CD compares the live CRD
    with git's text and shows such a CRD OutOfSync for ever (seen in e2e/tests/test_gitops_argocd.py
    with a bound of 2**62): every number must survive float64 and its shortest decimal form."""
    from decimal import Decimal

    for kind, crd in crds.items():
        for path, n in _numbers(crd):
            written = Decimal(n) if isinstance(n, int) else Decimal(repr(n))
            assert Decimal(repr(float(n))) == written, f"{kind} {path}: {n} reads back as {repr(float(n))}"
