"""The chart's tenant ports and NetworkPolicies (docs/routing.md, "Tenants kept apart"), rendered by a
real Helm: one activator port per tenant namespace, named as the operator looks it up
(atzero.tenant_port_name) and given to the activator as FEWERBITS_ACTIVATOR_TENANT_PORTS; the
activator's policy lets each namespace reach only its own port (the gateway every port, Prometheus
the metrics port); each tenant namespace's serving pods accept their own namespace, and on vLLM's
port the activator, the operator, the gateway and Prometheus only. Off by default; a missing peer
that would cut off what the release itself turned on is refused at render time."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.runtime.atzero import tenant_port_name
from fewerbits_operator.serving.render import VLLM_PORT
from tests.unit.test_chart import (  # noqa: F401 (fixture)
    ACTIVATOR,
    CHART,
    KUBE_VERSION,
    MODES,
    NAMESPACE,
    RELEASE,
    activator_deployment,
    by_kind,
    env_of,
    helm,
    operator_deployment,
    render,
    run_helm,
    template_text,
)
from tests.unit.test_chart_monitors import _matches
from tests.unit.test_render import deployment

ON = ["networkPolicy.enabled=true"]
TWO = ["watchNamespaces={ml-a,ml-b}"]
GATEWAY = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}}}]
PROMETHEUS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
              {"ipBlock": {"cidr": "10.9.0.0/16"}}]


def render_json(helm: list[str], values: list[str], **json_values: Any) -> list[dict[str, Any]]:
    extra = tuple(a for k, v in json_values.items() for a in ("--set-json", f"networkPolicy.{k}={json.dumps(v)}"))
    return [d for d in yaml.safe_load_all(template_text(helm, values, extra=extra)) if d]


def policies(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in by_kind(objs, "NetworkPolicy")}


def tenant_ports(objs: list[dict[str, Any]]) -> dict[str, int]:
    return json.loads(env_of(activator_deployment(objs))["FEWERBITS_ACTIVATOR_TENANT_PORTS"])


def ns_peer(ns: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}


def rule_for_port(policy: dict[str, Any], port: int) -> list[dict[str, Any]]:
    return [r for r in policy["spec"]["ingress"] if [p["port"] for p in r.get("ports", [])] == [port]]


def test_off_by_default(helm: list[str]):
    for mode in sorted(MODES):
        assert by_kind(render(helm, MODES[mode]), "NetworkPolicy") == [], mode


def test_one_tenant_port_per_watched_namespace_named_as_the_operator_looks_it_up(helm: list[str], monkeypatch):
    objs = render(helm, TWO)
    assert tenant_ports(objs) == {"ml-a": 8100, "ml-b": 8101}
    (svc,) = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] == ACTIVATOR]
    named = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
    assert named[tenant_port_name("ml-a")] == (8100, 8100) and named[tenant_port_name("ml-b")] == (8101, 8101)
    assert svc["spec"]["ports"][0]["name"] == "http"
    # What the activator's process makes of it.
    for k in [k for k in __import__("os").environ if k.startswith("FEWERBITS_")]:
        monkeypatch.delenv(k)
    for k, v in env_of(activator_deployment(objs)).items():
        monkeypatch.setenv(k, v)
    assert OperatorSettings().activator_tenant_ports == {"ml-a": 8100, "ml-b": 8101}
    # The release namespace when none is named; none under rbac.scope cluster unless listed.
    assert tenant_ports(render(helm, [])) == {NAMESPACE: 8100}
    assert tenant_ports(render(helm, ["rbac.scope=cluster"])) == {}
    listed = render(helm, ["rbac.scope=cluster", "activator.tenantPorts.namespaces={team-x,team-y}",
                           "activator.tenantPorts.base=9000"])
    assert tenant_ports(listed) == {"team-x": 9000, "team-y": 9001}
    # Off: the activator keeps no tenants apart (the variable unset) and its Service has no tenant port.
    off = render(helm, TWO + ["activator.tenantPorts.enabled=false"])
    assert "FEWERBITS_ACTIVATOR_TENANT_PORTS" not in env_of(activator_deployment(off))
    (svc,) = [s for s in by_kind(off, "Service") if s["metadata"]["name"] == ACTIVATOR]
    assert [p["name"] for p in svc["spec"]["ports"]] == ["http", "metrics"]


def test_the_activator_admits_each_namespace_on_its_own_port_only(helm: list[str]):
    objs = render_json(helm, ON + TWO, gatewayFrom=GATEWAY, metricsFrom=PROMETHEUS)
    pols = policies(objs)
    act = pols[(NAMESPACE, f"{RELEASE}-fewerbits-activator")]
    pod_labels = activator_deployment(objs)["spec"]["template"]["metadata"]["labels"]
    assert _matches(act["spec"]["podSelector"], pod_labels)
    assert not _matches(act["spec"]["podSelector"], operator_deployment(objs)["spec"]["template"]["metadata"]["labels"])
    assert act["spec"]["policyTypes"] == ["Ingress"]
    for ns, port in tenant_ports(objs).items():
        (rule,) = rule_for_port(act, port)
        assert rule["from"] == [ns_peer(ns), *GATEWAY]  # that namespace and the gateway, no other namespace
    (main,) = rule_for_port(act, 8082)
    assert main["from"] == GATEWAY  # the main port serves route tokens only: the gateway's
    (metrics,) = rule_for_port(act, 8080)
    assert metrics["from"] == PROMETHEUS
    assert len(act["spec"]["ingress"]) == 4
    # No gateway, no Prometheus: the namespaces' own ports only.
    bare = policies(render(helm, ON + TWO))[(NAMESPACE, f"{RELEASE}-fewerbits-activator")]
    assert [r["from"] for r in bare["spec"]["ingress"]] == [[ns_peer("ml-a")], [ns_peer("ml-b")]]


def test_the_serving_pods_admit_their_namespace_and_on_vllms_port_the_release_gateway_and_prometheus(helm: list[str]):
    objs = render_json(helm, ON + TWO, gatewayFrom=GATEWAY, metricsFrom=PROMETHEUS)
    pols = policies(objs)
    serving = {ns: pols[(ns, f"{RELEASE}-fewerbits-serving")] for ns in ("ml-a", "ml-b")}
    assert set(pols) == {(NAMESPACE, f"{RELEASE}-fewerbits-activator")} | {(ns, f"{RELEASE}-fewerbits-serving")
                                                                          for ns in serving}
    pod = deployment()["spec"]["template"]  # a serving pod as the operator renders it
    act_pod = activator_deployment(objs)["spec"]["template"]["metadata"]["labels"]
    op_pod = operator_deployment(objs)["spec"]["template"]["metadata"]["labels"]
    for ns, p in serving.items():
        assert _matches(p["spec"]["podSelector"], pod["metadata"]["labels"])
        picker = {**pod["metadata"]["labels"], "app.kubernetes.io/component": "epp"}
        assert not _matches(p["spec"]["podSelector"], picker)
        own, others = p["spec"]["ingress"]
        assert own == {"from": [{"podSelector": {}}]}  # its own namespace, every port (multi-node peers too)
        assert others["ports"] == [{"port": VLLM_PORT, "protocol": "TCP"}]
        release = ns_peer(NAMESPACE)["namespaceSelector"]
        act_peer, op_peer, *rest = others["from"]
        assert act_peer["namespaceSelector"] == op_peer["namespaceSelector"] == release
        assert _matches(act_peer["podSelector"], act_pod) and not _matches(act_peer["podSelector"], op_pod)
        assert _matches(op_peer["podSelector"], op_pod) and not _matches(op_peer["podSelector"], act_pod)
        assert rest == [*GATEWAY, *PROMETHEUS]


def test_without_tenant_ports_the_tenant_namespaces_share_the_main_port(helm: list[str]):
    act = policies(render(helm, ON + TWO + ["activator.tenantPorts.enabled=false"]))[
        (NAMESPACE, f"{RELEASE}-fewerbits-activator")]
    (rule,) = act["spec"]["ingress"]
    assert rule == {"from": [ns_peer("ml-a"), ns_peer("ml-b")], "ports": [{"port": 8082, "protocol": "TCP"}]}


def test_cluster_scope_keeps_the_listed_namespaces_apart_and_admits_nothing_else(helm: list[str]):
    pols = policies(render(helm, ON + ["rbac.scope=cluster"]))
    assert list(pols) == [(NAMESPACE, f"{RELEASE}-fewerbits-activator")]
    assert pols[(NAMESPACE, f"{RELEASE}-fewerbits-activator")]["spec"]["ingress"] == []  # no namespace, no gateway
    listed = policies(render(helm, ON + ["rbac.scope=cluster", "activator.tenantPorts.namespaces={team-x}"]))
    assert sorted(listed) == [(NAMESPACE, f"{RELEASE}-fewerbits-activator"), ("team-x", f"{RELEASE}-fewerbits-serving")]


def test_the_serving_pods_policy_stands_without_the_activator(helm: list[str]):
    pols = policies(render(helm, ON + ["activator.enabled=false"]))
    assert list(pols) == [(NAMESPACE, f"{RELEASE}-fewerbits-serving")]


@pytest.mark.parametrize("values, complaint", [
    (ON + ["metrics.serviceMonitor.enabled=true"], "networkPolicy.metricsFrom"),
    (ON + ["metrics.podMonitor.enabled=true"], "networkPolicy.metricsFrom"),
    (["activator.tenantPorts.base=8082"], "activator.tenantPorts"),  # the activator's own port
    (["activator.tenantPorts.base=65535"] + TWO, "activator.tenantPorts"),  # past the last port
    (["activator.tenantPorts.namespaces={Not_A_Namespace}"], "namespaces"),
    (["networkPolicy.gatewayFrom[0].namespace=gw"], "gatewayFrom"),
    (["networkPolicy.extra=1"], "extra"),
])
def test_refused_at_render_time(helm: list[str], values: list[str], complaint: str):
    out = run_helm(helm, "template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION,
                   *[a for v in values for a in ("--set", v)], check=False)
    assert out.returncode != 0 and complaint in out.stderr, out.stderr


def test_lint_with_the_policies_on(helm: list[str]):
    run_helm(helm, "lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART),
             *[a for v in ON + TWO + ["metrics.serviceMonitor.enabled=true"] for a in ("--set", v)],
             "--set-json", f"networkPolicy.metricsFrom={json.dumps(PROMETHEUS)}")
