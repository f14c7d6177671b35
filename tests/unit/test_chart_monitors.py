"""The chart's Prometheus Operator monitors: the PodMonitor for vLLM serving pods (off by default,
schema-checked), its selection of the pods the operator renders, and the labels the dashboard's
variables and the autoscaler's `prometheus` source join on."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.addons.prometheus import OPERATOR_LABELS, operator_scrape_config, podmonitor_scrape_config
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


def test_scrape_config_as_the_prometheus_operator_builds_it(helm: list[str]):
    (pm,) = by_kind(render(helm, PM + ["rbac.scope=cluster"]), "PodMonitor")
    (cfg,) = podmonitor_scrape_config(pm, Path("/kubeconfig"), "15s")
    sd = cfg["kubernetes_sd_configs"][0]
    assert sd["role"] == "pod" and "namespaces" not in sd  # any namespace
    keeps = [r for r in cfg["relabel_configs"] if r.get("action") == "keep"]
    assert {"source_labels": ["__meta_kubernetes_pod_labelpresent_fewerbits_io_model"], "regex": "true",
            "action": "keep"} in keeps
    assert {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "http", "action": "keep"} in keeps
    targets = {r.get("target_label") for r in cfg["relabel_configs"]}
    assert {"namespace", "pod", "model", "variant", "job"} <= targets
    # The e2e operator job selects on the chart's own selector labels.
    dep = operator_deployment(render(helm, []))
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert OPERATOR_LABELS.items() <= pod_labels.items()
    ports = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    assert "metrics" in ports and operator_scrape_config(Path("/k"), "ns")["honor_labels"] is True
