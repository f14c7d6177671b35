"""spec.adapters: what the models refuse (naming the field) and what the CRD makes the API server
refuse (its CEL rules and schema; the hostile corpus checks them on a real API server)."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from fewerbits_api import crdgen
from fewerbits_api.adapters import MAX_ADAPTERS
from fewerbits_api.errors import format_validation_error
from fewerbits_api.quantizedmodel import QuantizedModelSpec

SOURCE = {"uri": "hf://meta-llama/Llama-3.1-8B"}


def adapter(name: str, uri: str = "s3://adapters/plays", **more) -> dict:
    return {"name": name, "source": {"uri": uri, **more.pop("source", {})}, **more}


def errors(**spec) -> list[str]:
    with pytest.raises(ValidationError) as e:
        QuantizedModelSpec.model_validate({"source": SOURCE, **spec})
    return format_validation_error(e.value, prefix="spec")


def test_adapters_with_their_gates_default_to_the_models():
    spec = QuantizedModelSpec.model_validate({"source": SOURCE, "adapters": [
        adapter("plays", source={"revision": "v1", "endpoint": "http://minio:9000", "credentialsSecret": "s3"}),
        adapter("chat.v2", "hf://org/chat-lora", gate={"maxPerplexityIncreasePercent": 5, "evalSamples": 16})]})
    plays, chat = spec.adapters
    assert plays.gate.maxPerplexityIncreasePercent is None and plays.gate.evalDataset is None
    assert (chat.source.scheme, chat.gate.maxPerplexityIncreasePercent) == ("hf", 5)


@pytest.mark.parametrize("adapters, words", [
    ([adapter("plays"), adapter("plays")], "adapters[0] and adapters[1] are both named 'plays'"),
    ([adapter("org/plays")], "spec.adapters[0].name"),
    ([adapter("-plays")], "spec.adapters[0].name"),
    ([adapter("plays", "pvc://claim/plays")], "spec.adapters[0].source.uri"),
    ([adapter("plays", "s3://adapters/a/../b")], "'..'"),
    ([adapter("plays", gate={"maxPerplexityIncreasePercent": 0})], "spec.adapters[0].gate.maxPerplexityIncreasePercent"),
    ([adapter("plays", gate={"evalDataset": "s3://data/../x.jsonl"})], "'..'"),
    ([adapter("plays", rank=8)], "spec.adapters[0].rank"),
    ([adapter(f"a{i}") for i in range(MAX_ADAPTERS + 1)], "spec.adapters: "),
])
def test_bad_adapters_are_refused_naming_the_field(adapters, words):
    assert any(words in line for line in errors(adapters=adapters)), errors(adapters=adapters)


def test_an_adapter_may_not_take_the_served_name():
    lines = errors(serving={"servedModelName": "chat"}, adapters=[adapter("chat")])
    assert any("adapters[0].name 'chat' is serving.servedModelName" in line for line in lines)


def test_the_crd_carries_the_same_rules_for_the_api_server():
    crd = yaml.safe_load(crdgen.render_all()["fewerbits.io_quantizedmodels.yaml"])
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    adapters = spec["properties"]["adapters"]
    assert adapters["maxItems"] == MAX_ADAPTERS
    assert "self.all(a, self.exists_one(b, b.name == a.name))" in adapters["x-kubernetes-validations"][0]["rule"]
    item = adapters["items"]["properties"]
    assert item["name"]["pattern"] == "^[A-Za-z0-9][A-Za-z0-9._-]*$"
    assert item["source"]["properties"]["uri"]["pattern"].startswith("^(hf://")
    assert "pvc" not in item["source"]["properties"]["uri"]["pattern"]
    assert any("servedModelName" in r["rule"] for r in spec["x-kubernetes-validations"])
    assert "16-bit base" in item["gate"]["properties"]["maxPerplexityIncreasePercent"]["description"]  # kubectl explain
