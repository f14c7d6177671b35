"""``fewerbits explain NAME -n NS``: a QuantizedModel's effective spec, each value with where it
came from (the model's own spec, a QuantizationPolicy, or the built-in default), and the rules that
bind it with the policy that set each.

It reads the model, the namespace's labels and every QuantizationPolicy from the cluster (the
kubeconfig, or in-cluster credentials) and recomputes with the operator's own pure functions
(``combine_policies``, ``effective_spec``, ``effective_values``), so what it prints is what the next
reconcile decides, even before the operator has written ``status.effective``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Protocol

from fewerbits_operator.artifacts.effective import Effective, combine_policies, effective_spec, effective_values, matching_policies
from fewerbits_operator.core.observe import read_policies


class ClusterReader(Protocol):
    def get_model(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def namespace_labels(self, namespace: str) -> dict[str, str]: ...
    def list_policies(self) -> list[dict[str, Any]]: ...


class KubeReader:
    """The cluster, read with the caller's own credentials (the kubeconfig's current context)."""

    def __init__(self, context: str | None = None, kubeconfig: str | None = None) -> None:
        from kubernetes import client, config

        try:
            config.load_kube_config(config_file=kubeconfig, context=context)
        except config.ConfigException:
            config.load_incluster_config()
        self.custom = client.CustomObjectsApi()
        self.core = client.CoreV1Api()

    def get_model(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        from fewerbits_api.base import GROUP, VERSION
        from fewerbits_api.quantizedmodel import PLURAL

        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        return dict(self.core.read_namespace(namespace).metadata.labels or {})

    def list_policies(self) -> list[dict[str, Any]]:
        from fewerbits_api.base import GROUP, VERSION
        from fewerbits_api.policy import PLURAL

        return list(self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL).get("items", []))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="show a QuantizedModel's effective spec and the policy behind each value")
    p.add_argument("name", metavar="NAME", help="the QuantizedModel")
    p.add_argument("-n", "--namespace", default="default", help="its namespace (default: default)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.set_defaults(func=run)


def _leaves(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, dict) and tree:
        return [leaf for k, v in tree.items() for leaf in _leaves(v, prefix + (k,))]
    return [(prefix, tree)]


def _set_in(tree: Any, path: tuple[str, ...]) -> bool:
    for part in path:
        if not isinstance(tree, dict) or tree.get(part) is None:
            return False
        tree = tree[part]
        if not isinstance(tree, dict):
            return True
    return True


def explanation(eff: Effective, broken: list[str]) -> dict[str, Any]:
    """The effective spec's values with their sources, the binding rules, and the verdict (JSON)."""
    pol = eff.policy
    spec_values = []
    if eff.spec is not None:
        wire = eff.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
        for path, value in _leaves(wire):
            if _set_in(eff.raw_spec, path):
                source = "model"
            elif setter := next((n for p, n in pol.default_sources.items() if path[:len(p)] == p), None):
                source = f"policy {setter}"  # the leaf, or a list or object above it, came from a policy
            else:
                source = "built-in default"
            spec_values.append({"path": "spec." + ".".join(path), "value": value, "source": source})
    status = effective_values(eff)
    rules = [v.to_wire() for v in (status.values if status else []) if not v.path.startswith("spec.")]
    derived = [v.to_wire() for v in (status.values if status else [])
               if v.path == "spec.quantization.qualityGate.maxPerplexityIncreasePercent"]
    for d in derived:  # the gate a model without one gets: the default lowered to the ceiling
        spec_values.append({"path": d["path"], "value": float(d["value"]), "source": f"policy {d['source']} (ceiling)"})
    return {"policies": list(pol.names), "accepted": eff.accepted and not broken,
            "errors": eff.errors, "violations": broken + eff.violations, "spec": spec_values, "rules": rules}


def explain(reader: ClusterReader, namespace: str, name: str) -> dict[str, Any] | None:
    model = reader.get_model(namespace, name)
    if model is None:
        return None
    labels = reader.namespace_labels(namespace)
    policies, broken = read_policies(reader.list_policies(), labels)
    broken_lines = [f"QuantizationPolicy {b.name} applies to namespace {namespace} but is invalid ({b.error})"
                    for b in broken if b.may_select]
    combined = combine_policies(matching_policies(list(policies), labels))
    eff = effective_spec(dict(model.get("spec") or {}), combined)
    out = explanation(eff, broken_lines)
    out["model"] = f"{namespace}/{name}"
    out["statusEffective"] = (model.get("status") or {}).get("effective")
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def table(ex: dict[str, Any]) -> str:
    out = [f"QuantizedModel {ex['model']}",
           "Policies (highest priority first): " + (", ".join(ex["policies"]) or "none match this namespace"),
           "Accepted: " + ("yes" if ex["accepted"] else "no")]
    out += [f"  {line}" for line in ex["errors"] + ex["violations"]]
    rows = [(v["path"], _text(v["value"]), v["source"]) for v in ex["spec"]]
    rows += [(v["path"], v["value"], f"policy {v['source']}") for v in ex["rules"]]
    if rows:
        w1 = max(len(r[0]) for r in rows)
        w2 = min(max(len(r[1]) for r in rows), 60)
        out += ["", f"{'PATH':<{w1}}  {'VALUE':<{w2}}  SOURCE"]
        out += [f"{p:<{w1}}  {v:<{w2}}  {s}" for p, v, s in rows]
    if ex["statusEffective"] is None and ex["policies"]:
        out += ["", "(the operator has not written status.effective for this model yet)"]
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace, reader: ClusterReader | None = None) -> int:
    try:
        reader = reader or KubeReader(args.context, getattr(args, "kubeconfig", None))
        ex = explain(reader, args.namespace, args.name)
    except Exception as e:  # noqa: BLE001 - a CLI: the API server's answer, not a traceback
        print(f"fewerbits explain: cannot read the cluster: {e}", file=sys.stderr)
        return 2
    if ex is None:
        print(f"fewerbits explain: QuantizedModel {args.namespace}/{args.name} not found", file=sys.stderr)
        return 1
    sys.stdout.write(json.dumps(ex, indent=2) + "\n" if args.output == "json" else table(ex))
    return 0
