"""``fewerbits explain``: the effective spec with the source of each value, from a fake cluster."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fewerbits_operator.cli import explain_cmd

MODEL = {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
         "metadata": {"name": "m", "namespace": "team-a"},
         "spec": {"source": {"uri": "hf://meta-llama/Llama-3.2-1B", "revision": "main"},
                  "storage": {"uri": "s3://bkt/q"}, "serving": {"maxModelLen": 4096}}}


def qp(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizationPolicy", "metadata": {"name": name},
            "spec": spec}


class FakeCluster:
    def __init__(self, policies: list[dict[str, Any]], model: dict[str, Any] | None = MODEL) -> None:
        self.policies, self.model = policies, model

    def get_model(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.model if self.model and (namespace, name) == ("team-a", "m") else None

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": namespace, "team": "a"}

    def list_policies(self) -> list[dict[str, Any]]:
        return self.policies


POLICIES = [
    qp("platform", {"priority": 0, "defaults": {"serving": {"replicas": 1, "maxModelLen": 8192}},
                    "rules": {"maxReplicas": 8, "maxPerplexityIncreasePercent": 2}}),
    qp("team", {"priority": 10, "namespaceSelector": {"matchLabels": {"team": "a"}},
                "defaults": {"serving": {"replicas": 2}}, "rules": {"maxReplicas": 20}}),
    qp("other-team", {"namespaceSelector": {"matchLabels": {"team": "b"}}, "rules": {"maxReplicas": 1}}),
]


def run(policies, *argv: str, capsys) -> tuple[int, str, str]:
    args = argparse.Namespace(name=argv[0], namespace=argv[1], context=None, output=argv[2] if len(argv) > 2 else "table")
    rc = explain_cmd.run(args, FakeCluster(policies))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_explain_prints_each_value_with_its_source(capsys):
    rc, out, _ = run(POLICIES, "m", "team-a", capsys=capsys)
    assert rc == 0
    assert "Policies (highest priority first): team, platform" in out and "Accepted: yes" in out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines()[5:] if line.strip()}
    assert lines["spec.serving.replicas"] == ["2", "policy", "team"]
    assert lines["spec.serving.maxModelLen"] == ["4096", "model"]  # the model's own value wins
    assert lines["spec.source.uri"][-1] == "model"
    assert lines["spec.autoscaling.targetKVCacheUsage"][-2:] == ["built-in", "default"]
    assert lines["spec.quantization.qualityGate.maxPerplexityIncreasePercent"] == ["2.0", "policy", "platform",
                                                                                 "(ceiling)"]
    assert lines["rules.maxReplicas"] == ["8", "policy", "platform"]


def test_explain_json_and_refusal_names_the_policies(capsys):
    policies = POLICIES + [qp("narrow", {"priority": 5, "rules": {"allowedSources": ["s3://*"]}})]
    rc, out, _ = run(policies, "m", "team-a", "json", capsys=capsys)
    ex = json.loads(out)
    assert rc == 0 and not ex["accepted"] and ex["policies"] == ["team", "narrow", "platform"]
    assert ex["violations"] == ["policy narrow rule allowedSources: spec.source.uri hf://meta-llama/Llama-3.2-1B "
                                "matches none of s3://*"]


def test_explain_unknown_model(capsys):
    rc, _, err = run(POLICIES, "nope", "team-a", capsys=capsys)
    assert rc == 1 and "QuantizedModel team-a/nope not found" in err


def test_cli_lists_explain():
    from fewerbits_operator.cli.main import build_parser

    args = build_parser().parse_args(["explain", "m", "-n", "team-a"])
    assert (args.name, args.namespace, args.func) == ("m", "team-a", explain_cmd.run)
