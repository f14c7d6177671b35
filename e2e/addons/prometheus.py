"""A real Prometheus server (built from github.com/prometheus/prometheus by e2e/build.sh) on the e2e
control plane, finding its targets with Kubernetes service discovery against the local apiserver.

Its scrape configuration is what the Prometheus Operator generates from the chart's monitors:

- ``fewerbits-vllm``: the chart's PodMonitor for serving pods (rendered by Helm and translated by
  ``podmonitor_scrape_config``): pod role, pods labelled ``fewerbits.io/model`` and
  ``fewerbits.io/variant``, container port ``http``, target labels ``namespace``, ``pod``,
  ``container``, ``model``, ``variant``. The pod runner gives pods loopback IPs and forwards
  ``<pod IP>:<port>`` to the simulator, so Prometheus scrapes the address the apiserver reports.
- ``fewerbits-operator``: the chart's ServiceMonitor selects the operator's metrics Service; here
  the same selection is made on the pod role (the chart's selector labels, port ``metrics``,
  ``honor_labels``), because the control plane refuses EndpointSlices with loopback addresses.
  The session operator is a host process, so ``register_host_process`` publishes it as what it
  is: a ``hostNetwork`` pod on a kwok node (kwok reports the node IP 127.0.0.1 as its pod IP) with
  the chart's labels and a ``metrics`` port. It is a stand-in for the chart's operator Pod, whose
  process runs outside the cluster; nothing runs its container.

Start it once per session through the ``prometheus`` fixture (e2e/pytest_plugin.py): the rest of
the suite never pays for it. It scrapes every second so tests wait seconds, not minutes.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

import yaml

from e2e import procs, versions

SCRAPE_INTERVAL = "1s"
OPERATOR_LABELS = {"app.kubernetes.io/name": "fewerbits", "app.kubernetes.io/component": "operator"}
HOST_NODE = "host-processes"
STANDIN_IMAGE = "stand-in.invalid/host-process:none"
"""An image no rule of the pod runner maps, so kwok (not the runner) reports the pod Running."""


class PrometheusError(RuntimeError):
    pass


def _label_meta(key: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in key)


def podmonitor_scrape_config(pm: dict[str, Any], kubeconfig: Path, interval: str = SCRAPE_INTERVAL) -> list[dict]:
    """Scrape configs for a PodMonitor, as the Prometheus Operator builds them (the subset of its
    fields the chart uses: selector, namespaceSelector, port, path, honorLabels, relabelings)."""
    md, spec = pm["metadata"], pm["spec"]
    ns_sel = spec.get("namespaceSelector") or {}
    sd: dict[str, Any] = {"role": "pod", "kubeconfig_file": str(kubeconfig)}
    if not ns_sel.get("any"):
        sd["namespaces"] = {"names": ns_sel.get("matchNames") or [md.get("namespace", "default")]}
    keep: list[dict] = []
    for k, v in (spec.get("selector", {}).get("matchLabels") or {}).items():
        keep.append({"source_labels": [f"__meta_kubernetes_pod_label_{_label_meta(k)}"], "regex": v, "action": "keep"})
    for e in spec.get("selector", {}).get("matchExpressions") or []:
        present = f"__meta_kubernetes_pod_labelpresent_{_label_meta(e['key'])}"
        if e["operator"] == "Exists":
            keep.append({"source_labels": [present], "regex": "true", "action": "keep"})
        elif e["operator"] == "DoesNotExist":
            keep.append({"source_labels": [present], "regex": "true", "action": "drop"})
        else:
            raise PrometheusError(f"PodMonitor selector operator {e['operator']} not translated here")
    out = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        relabel = list(keep) + [
            {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"},
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": ep["port"], "action": "keep"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"target_label": "job", "replacement": f"{md.get('namespace', 'default')}/{md['name']}"},
        ]
        for r in ep.get("relabelings") or []:
            relabel.append({"source_labels": r["sourceLabels"], "target_label": r["targetLabel"],
                            **({"regex": r["regex"]} if "regex" in r else {})})
        out.append({
            "job_name": f"podMonitor/{md.get('namespace', 'default')}/{md['name']}/{i}",
            "scrape_interval": interval, "scrape_timeout": interval,
            "metrics_path": ep.get("path", "/metrics"), "honor_labels": bool(ep.get("honorLabels")),
            "kubernetes_sd_configs": [sd], "relabel_configs": relabel,
        })
    return out


def operator_scrape_config(kubeconfig: Path, namespace: str, interval: str = SCRAPE_INTERVAL) -> dict:
    """The chart's ServiceMonitor's selection (the operator's selector labels, port ``metrics``,
    ``honorLabels``: the operator's series carry the namespace of the model they describe) on the
    pod role."""
    keep = [{"source_labels": [f"__meta_kubernetes_pod_label_{_label_meta(k)}"], "regex": v, "action": "keep"}
            for k, v in OPERATOR_LABELS.items()]
    return {
        "job_name": "fewerbits-operator", "scrape_interval": interval, "scrape_timeout": interval,
        "honor_labels": True,
        "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig),
                                   "namespaces": {"names": [namespace]}}],
        "relabel_configs": keep + [
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "instance"},
        ],
    }


class Prometheus:
    """One Prometheus process; ``url`` is its HTTP API."""

    def __init__(self, cluster, state_dir: Path, pod_monitors: list[dict[str, Any]],
                 operator_namespace: str = "fewerbits-system"):
        self.cluster = cluster
        self.state_dir = state_dir
        self.pod_monitors = pod_monitors
        self.operator_namespace = operator_namespace
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        kc = Path(self.cluster.kubeconfig)
        jobs = [c for pm in self.pod_monitors for c in podmonitor_scrape_config(pm, kc)]
        jobs.append(operator_scrape_config(kc, self.operator_namespace))
        return {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
                "scrape_configs": jobs}

    def start(self, timeout: float = 60) -> "Prometheus":
        versions.ensure_built("prometheus")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.state_dir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.port = procs.free_port()
        log = self.state_dir / "prometheus.log"
        self.proc = procs.spawn([
            str(versions.binary("prometheus")), f"--config.file={cfg}",
            f"--storage.tsdb.path={self.state_dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=2h", "--web.enable-lifecycle", "--log.level=warn",
        ], log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready after {timeout}s:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop_group(self.proc.pid, 10, self.proc)
            self.proc = None

    # ------------------------------------------------------------------ API

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params, doseq=True) if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        return self.api("query", query=promql)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
        """Poll ``check`` (every 0.25 s) until it returns something truthy."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = check()
            except (PrometheusError, urllib.error.URLError, OSError) as e:
                last = e
            if last and not isinstance(last, Exception):
                return last
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def register_host_process(cluster, namespace: str, name: str, port: int, labels: dict[str, str]) -> None:
    """Publish a process running on this host as a ``hostNetwork`` pod with a ``metrics`` port (see
    the module docstring): kwok reports it Running at the node IP 127.0.0.1."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(cluster.api_client())
    try:
        core.create_namespace({"metadata": {"name": namespace}})
    except ApiException as e:
        if e.status != 409:
            raise
    cluster.add_cpu_node(HOST_NODE)
    pod = {
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": HOST_NODE, "hostNetwork": True,
                 "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": "operator", "image": STANDIN_IMAGE,
                                 "ports": [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]}]},
    }
    deadline = time.monotonic() + 30
    while True:  # a new namespace has no default ServiceAccount for a moment: admission refuses pods
        try:
            core.create_namespaced_pod(namespace, pod)
            break
        except ApiException as e:
            if e.status == 409:
                break
            if e.status != 403 or "serviceaccount" not in str(e.body).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        p = core.read_namespaced_pod(name, namespace)
        if p.status.phase == "Running" and p.status.pod_ip:
            return
        time.sleep(0.25)
    raise PrometheusError(f"stand-in pod {namespace}/{name} not Running after 60s")


def chart_pod_monitors() -> list[dict[str, Any]]:
    """The chart's PodMonitor(s), rendered by Helm with ``metrics.podMonitor.enabled=true``
    (cluster scope: every namespace, as the session operator watches)."""
    versions.ensure_built("helm")
    root = Path(__file__).resolve().parents[2]
    args = [str(versions.binary("helm")), "template", "fb", str(root / "charts" / "fewerbits"),
            "--namespace", "fewerbits-system", "--kube-version", versions.version("kubernetes"),
            "--set", "metrics.podMonitor.enabled=true", "--set", "rbac.scope=cluster"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d and d.get("kind") == "PodMonitor"]
