"""The chart's Prometheus Operator monitors: the PodMonitor for vLLM serving pods (off by default,
schema-checked), its selection of the pods the operator renders, and the labels the dashboard's
variables and the autoscaler's `prometheus` source join on."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from e2e.addons import prometheus_operator as po
from tests.unit.test_chart import MODES, by_kind, helm, operator_deployment, render, run_helm  # noqa: F401 (fixture)
from tests.unit.test_render import deployment

PM = ["metrics.podMonitor.enabled=true"]


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True


def test_off_by_default(helm: list[str]):
    for mode in ("defaults", "everything", "service-monitor"):
        assert by_kind(render(helm, MODES[mode]), "PodMonitor") == [], mode


def test_selects_the_serving_pods_the_operator_renders(helm: list[str]):
    (pm,) = by_kind(render(helm, PM), "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    pod = deployment()["spec"]["template"]
    assert _matches(pm["spec"]["selector"], pod["metadata"]["labels"])
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert ep["port"] in ports and ep["path"] == "/metrics"
    # The operator's own pod is not a serving pod.
    op_pod = operator_deployment(render(helm, PM))["spec"]["template"]
    assert not _matches(pm["spec"]["selector"], op_pod["metadata"]["labels"])
    # model and variant become target labels: the dashboard's $model filter and the replica panel use them.
    targets = {r["targetLabel"]: r["sourceLabels"] for r in ep["relabelings"]}
    assert targets == {"model": ["__meta_kubernetes_pod_label_fewerbits_io_model"],
                       "variant": ["__meta_kubernetes_pod_label_fewerbits_io_variant"]}


@pytest.mark.parametrize("values, expected", [
    ([], {"matchNames": ["fewerbits-system"]}),
    (["watchNamespaces={ml-a,ml-b}"], {"matchNames": ["ml-a", "ml-b"]}),
    (["rbac.scope=cluster"], {"any": True}),
])
def test_namespaces_follow_what_the_operator_watches(helm: list[str], values: list[str], expected: dict):
    (pm,) = by_kind(render(helm, PM + values), "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == expected
    assert pm["metadata"]["namespace"] == "fewerbits-system"


def test_labels_interval_and_lint(helm: list[str]):
    (pm,) = by_kind(render(helm, PM + ["metrics.podMonitor.labels.release=kube-prometheus",
                                       "metrics.podMonitor.interval=5s"]), "PodMonitor")
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus"
    assert pm["spec"]["podMetricsEndpoints"][0]["interval"] == "5s"
    from tests.unit.test_chart import CHART, KUBE_VERSION
    run_helm(helm, "lint", str(CHART), "--kube-version", KUBE_VERSION, "--set", PM[0])


@pytest.mark.parametrize("value, complaint", [
    ("metrics.podMonitor.interval=often", "interval"),
    ("metrics.podMonitor.scrapeTimeout=10", "scrapeTimeout"),
    ("metrics.podMonitor.extra=1", "extra"),
    ("metrics.podMonitor.enabled=maybe", "enabled"),
])
def test_schema_rejects(helm: list[str], value: str, complaint: str):
    from tests.unit.test_chart import CHART, KUBE_VERSION
    out = run_helm(helm, "template", "fb", str(CHART), "--kube-version", KUBE_VERSION, "--set", value, check=False)
    assert out.returncode != 0 and complaint in (out.stderr + out.stdout), out.stderr


def test_the_e2e_prometheus_selects_the_chart_monitors_and_they_reach_the_operator(helm: list[str]):
    """The e2e stack (e2e/addons/prometheus_operator.py): its Prometheus resource selects the chart's
    two monitors, the ServiceMonitor selects the metrics Service, whose port leads to the operator
    pod's metrics port; the jobs it waits for are named as the Prometheus Operator names them."""
    objs = po.chart_objects()
    sm, activator = sorted(by_kind(objs, "ServiceMonitor"), key=lambda m: m["metadata"]["name"] != po.OPERATOR_MONITOR)
    (pm,) = by_kind(objs, "PodMonitor")
    (svc,) = by_kind(objs, "Service")
    spec = po.prometheus_resource(SimpleNamespace(server="https://127.0.0.1:6443", state_dir=Path("/s")),
                                  "v3.0.0")["spec"]
    assert _matches(spec["serviceMonitorSelector"], sm["metadata"]["labels"])
    assert _matches(spec["podMonitorSelector"], pm["metadata"]["labels"])
    assert spec["serviceDiscoveryRole"] == "EndpointSlice" and spec["replicas"] == 0
    assert spec["apiserverConfig"] == {"host": "https://127.0.0.1:6443", "tlsConfig": {
        "caFile": "/s/pki/ca.crt", "certFile": "/s/pki/admin.crt", "keyFile": "/s/pki/admin.key"}}
    assert _matches(sm["spec"]["selector"], svc["metadata"]["labels"])
    (ep,) = sm["spec"]["endpoints"]
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == ep["port"]]
    assert svc["metadata"]["name"] == po.METRICS_SERVICE and ep["honorLabels"] is True
    # The Service's selector and target port lead to the operator's pod and its metrics port.
    dep = operator_deployment(render(helm, []))
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert port["targetPort"] in {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert (sm["metadata"]["name"], pm["metadata"]["name"], activator["metadata"]["name"]) == (
        po.OPERATOR_MONITOR, po.VLLM_MONITOR, po.ACTIVATOR_MONITOR)
    assert _matches(spec["serviceMonitorSelector"], activator["metadata"]["labels"])
    assert po.expected_jobs(objs) == {
        po.OPERATOR_MONITOR: f"serviceMonitor/fewerbits-system/{po.OPERATOR_MONITOR}/0",
        po.VLLM_MONITOR: f"podMonitor/fewerbits-system/{po.VLLM_MONITOR}/0",
        po.ACTIVATOR_MONITOR: f"serviceMonitor/fewerbits-system/{po.ACTIVATOR_MONITOR}/0"}
    # Every monitor scrapes at the e2e interval, within it.
    assert {e["interval"] for e in sm["spec"]["endpoints"] + pm["spec"]["podMetricsEndpoints"]} == {po.SCRAPE_INTERVAL}
