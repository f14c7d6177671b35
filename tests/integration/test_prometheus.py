"""The Prometheus Operator (built from its Go module, e2e/addons/prometheus_operator.py) on the
control plane, configuring a real Prometheus from the chart's ServiceMonitor (the operator's
metrics Service) and PodMonitor (the serving pods, simulators run by the pod runner).

0. Each monitor's scrape job, named as the operator generated it, has its targets up: in
   Prometheus's targets API and in its ``up`` series.
1. The autoscaler's ``prometheus`` metrics source against it makes the same decisions as the
   ``pods`` source on the same load, phase by phase (scale up on KV, up on queue depth, hold,
   hold inside the scale-down delay, down after it).
2. Every panel query of the Grafana dashboard, and each of its variables, returns data from it.

One model serves two replicas (min = max = 2, so the session operator keeps exactly two pods). The
two autoscalers under test read the same pods and see the model with wider bounds (1-6); their
writes are recorded, never sent, so the two runs see the same cluster.

Simulator: the two serving pods are llm-d-inference-sim (the operator's default vLLM image),
because the autoscaler's two metric sources are compared phase by phase on loads held at chosen
values (`POST /admin/config`), which real requests cannot hold; it exposes vLLM's metric names,
and real vLLM's own metrics drive the autoscaler in test_autoscaling_vllm.py.
"""

from __future__ import annotations

import copy
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry

from e2e import demo
from e2e.addons import prometheus_operator as po
from fewerbits_operator.autoscaler import Autoscaler, DirectScrapeSource, PrometheusSource
from fewerbits_operator.base.kube import Kube
from tests.integration.test_autoscaling import set_load

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "fewerbits.json"
DELAY = 20
MODEL = "observed"


class RecordingIO:
    """Reads through the real API; records the writes instead of sending them, and shows the
    autoscaler the model with the bounds under test."""

    def __init__(self, kube: Kube, lo: int, hi: int):
        self.kube, self.lo, self.hi = kube, lo, hi
        self.scales: list[tuple[str, int]] = []

    def list_models(self, namespaces):
        out = []
        for m in self.kube.list_models(namespaces):
            m = copy.deepcopy(m)
            auto = (m.get("status") or {}).get("autoscaling")
            if isinstance(auto, dict):
                auto.update(minReplicas=self.lo, maxReplicas=self.hi, policyMaxReplicas=None)
            out.append(m)
        return out

    def list_deployments(self, namespace, selector):
        return self.kube.list_deployments(namespace, selector)

    def list_pods(self, namespace, selector):
        return self.kube.list_pods(namespace, selector)

    def read_scale(self, namespace, name):
        return self.kube.read_scale(namespace, name)

    def patch_scale(self, namespace, name, replicas):
        self.scales.append((name, replicas))

    def patch_serving_status(self, namespace, name, updates):
        pass

    def post_event(self, obj, type_, reason, message):
        pass


@pytest.fixture(scope="module")
def observed(request, cluster, gpu_pool_module, models, test_model_uri, operator):
    """A namespace with the model serving two ready replicas; the operator listed in the chart's
    metrics Service, which the chart's ServiceMonitor selects. The Prometheus Operator's stack
    starts while the model is quantized and rolled out (the two wait on different things)."""
    ns = f"t-prom-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(cluster.api_client())
    core.create_namespace({"metadata": {"name": ns}})
    demo.create_s3_secret(cluster, ns, "s3-credentials")
    spec = demo.test_model_spec(cluster.s3.endpoint, test_model_uri, "s3-credentials", ns,
                                quantization={"format": "fp8-dynamic"},
                                autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 2,
                                              "targetKVCacheUsage": 0.7, "maxWaitingRequests": 5,
                                              "scaleDownDelaySeconds": DELAY})
    models.apply(ns, MODEL, spec)
    request.getfixturevalue("prometheus_operator")
    po.publish_operator_metrics(cluster, operator.metrics_port)
    models.wait_condition(ns, MODEL, "Ready", timeout=600)
    models.wait("two ready serving pods", lambda: len(ready_pods(core, ns)) == 2, timeout=120, namespace=ns)
    try:
        yield ns
    finally:
        models.delete(ns, MODEL)
        core.delete_namespace(ns)


@pytest.fixture(scope="module")
def gpu_pool_module(cluster):
    cluster.add_gpu_pool("prom-h100", "NVIDIA-H100-80GB-HBM3")
    yield
    cluster.remove_pool("prom-h100")


def ready_pods(core, ns) -> list:
    pods = core.list_namespaced_pod(ns, label_selector=f"fewerbits.io/model={MODEL}").items
    return [p for p in pods if p.status.pod_ip and not p.metadata.deletion_timestamp
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]


def up_targets(prometheus, job: str) -> list[dict[str, Any]]:
    """The active targets of scrape job ``job`` (Prometheus's ``scrapePool``) that are up."""
    return [t for t in prometheus.targets() if t["scrapePool"] == job and t["health"] == "up"]


def test_the_operator_generated_jobs_scrape_both_monitors(cluster, observed, operator, prometheus_operator,
                                                          prometheus):
    ns, jobs = observed, prometheus_operator.jobs
    # The jobs are the operator's: read back from the Secret it wrote, not from this harness.
    assert set(jobs.values()) <= set(po.scrape_jobs(po.generated_config(cluster))), jobs
    assert set(jobs) == {po.OPERATOR_MONITOR, po.VLLM_MONITOR, po.ACTIVATOR_MONITOR}
    core = client.CoreV1Api(cluster.api_client())
    names = sorted(p.metadata.name for p in ready_pods(core, ns))
    (op,) = prometheus.wait("the ServiceMonitor's job to scrape the operator", lambda: [
        t for t in up_targets(prometheus, jobs[po.OPERATOR_MONITOR]) if t["labels"].get("service") == po.METRICS_SERVICE])
    assert op["scrapeUrl"].endswith(f":{operator.metrics_port}/metrics"), op

    def pod_targets() -> list[dict[str, Any]] | None:
        ts = [t for t in up_targets(prometheus, jobs[po.VLLM_MONITOR]) if t["labels"].get("namespace") == ns]
        return ts if sorted(t["labels"]["pod"] for t in ts) == names else None
    pods = prometheus.wait("the PodMonitor's job to scrape both serving pods", pod_targets)
    # The same targets in Prometheus's own `up` series (a target's labels are its series' labels).
    for t in [op, *pods]:
        sel = ",".join(f'{k}="{t["labels"][k]}"' for k in ("job", "instance"))
        prometheus.wait(f"up{{{sel}}} == 1", lambda: [
            r for r in prometheus.query(f"up{{{sel}}}") if r["value"][1] == "1"])
    assert all(t["labels"]["model"] == MODEL for t in pods)


def test_prometheus_source_decides_as_the_pods_source(cluster, observed, prometheus):
    ns = observed
    core = client.CoreV1Api(cluster.api_client())
    pods = ready_pods(core, ns)
    names = sorted(p.metadata.name for p in pods)
    # Service discovery found both pods (and labelled them as the chart's PodMonitor says).
    prometheus.wait("both serving pods scraped", lambda: sorted(
        t["labels"]["pod"] for t in prometheus.targets()
        if t["labels"].get("namespace") == ns and t["health"] == "up" and t["labels"].get("model") == MODEL) == names)

    kube = Kube(cluster.api_client())
    ios = {"pods": RecordingIO(kube, 1, 6), "prometheus": RecordingIO(kube, 1, 6)}
    scalers = {
        "pods": Autoscaler(ios["pods"], DirectScrapeSource(timeout=3), [ns], registry=CollectorRegistry()),
        "prometheus": Autoscaler(ios["prometheus"], PrometheusSource(prometheus.url, timeout=5), [ns],
                                 registry=CollectorRegistry()),
    }
    t0 = time.time()
    phases = [  # (seconds after t0, (KV, waiting, running) on every pod, expected direction)
        (0, (0.95, 0, 8), "up"),        # KV 0.95 vs 0.7: ceil(2 x 0.95 / 0.7) = 3
        (2, (0.3, 20, 4), "up"),        # queue rule: 20 waiting per pod with KV at 0.3
        (4, (0.7, 0, 4), None),         # at the target
        (6, (0.1, 0, 1), None),         # lower demand: held for scaleDownDelaySeconds (20 s)...
        (12, (0.1, 0, 1), None),
        (18, (0.1, 0, 1), None),
        (24, (0.1, 0, 1), None),        # (the 6 replicas wanted at 2 s left the window at 22 s; 2 at 4 s)
        (30, (0.1, 0, 1), "down"),      # ...then down: the window holds only lower demand
    ]
    seen = []
    for offset, load, direction in phases:
        assert set_load(core, ns, MODEL, *load) == 2
        kv, waiting, _ = load
        sel = f'{{namespace="{ns}",model="{MODEL}"}}'
        prometheus.wait(f"Prometheus to hold the load {load}", lambda: (
            len(r1 := prometheus.query(f"vllm:kv_cache_usage_perc{sel}")) == 2
            and all(abs(float(r["value"][1]) - kv) < 1e-6 for r in r1)
            and all(abs(float(r["value"][1]) - waiting) < 1e-6
                    for r in prometheus.query(f"vllm:num_requests_waiting{sel}"))))
        now = t0 + offset
        out = {k: s.run_once(now) for k, s in scalers.items()}
        row = {}
        for k, outcomes in out.items():
            (o,) = outcomes
            d = o.decision
            row[k] = (d.desired, d.direction, d.kv_wants, d.queue_wants, round(d.avg_kv, 6), round(d.avg_waiting, 6),
                      d.reason)
        seen.append((load, row))
        assert row["prometheus"] == row["pods"], f"{load}: the sources decided differently:\n{row}"
        assert row["pods"][1] == direction, f"{load}: expected {direction}: {row['pods'][6]}"
    # The writes each would have made are the same too.
    assert ios["pods"].scales == ios["prometheus"].scales and len(ios["pods"].scales) == 3, seen


def _substitute(expr: str, ns: str) -> str:
    expr = expr.replace("${model:regex}", MODEL).replace("$namespace", ns).replace("$model", MODEL)
    return expr.replace("$__rate_interval", "30s")


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def test_every_dashboard_panel_returns_data(cluster, observed, prometheus_operator, prometheus):
    ns = observed
    dash = json.loads(DASHBOARD.read_text())
    # The operator (a host process listed in the chart's metrics Service) is scraped by the
    # ServiceMonitor's job.
    prometheus.wait("the operator scraped", lambda: up_targets(prometheus, prometheus_operator.jobs[po.OPERATOR_MONITOR]))
    core = client.CoreV1Api(cluster.api_client())
    set_load(core, ns, MODEL, 0.5, 1, 2)

    # Variables: label_values(metric, label) is Grafana's call of /api/v1/label/<label>/values.
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
        assert m, var["query"]["query"]
        match, label = _substitute(m.group(1), ns), m.group(2)
        want = ns if label == "namespace" else MODEL
        prometheus.wait(f"variable {var['name']} to offer {want}",
                        lambda: want in prometheus.api(f"label/{label}/values", **{"match[]": match}), timeout=90)

    queries = {f"{p['title']} [{t.get('legendFormat', '')}]": _substitute(t["expr"], ns)
               for p in _panels(dash) for t in p.get("targets", [])}
    assert len(queries) >= 15, queries

    def empty() -> dict[str, str]:
        return {k: q for k, q in queries.items()
                if not [r for r in prometheus.query(q) if r["value"][1] not in ("NaN", "+Inf", "-Inf")]}

    missing = empty()
    deadline = time.monotonic() + 90
    while missing and time.monotonic() < deadline:
        time.sleep(1)
        missing = empty()
    assert not missing, "panels nothing feeds:\n" + "\n".join(f"{k}: {q}" for k, q in missing.items())
