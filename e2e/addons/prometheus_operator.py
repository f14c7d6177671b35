"""The Prometheus Operator (``github.com/prometheus-operator/prometheus-operator``, built by
``e2e/build.sh prometheus-operator`` with its config reloader and CRDs) on the e2e control plane,
scraping the chart's ServiceMonitor and PodMonitor through a Prometheus it configures.

What runs as it would on a cluster:

- its CRDs (``monitoring.coreos.com``, from the same module version; those its Prometheus
  controller watches, ``CRDS``), applied server-side (they are larger than the annotation
  client-side apply would write);
- the operator, as a host process with its out-of-cluster flags (``--apiserver``, ``--ca-file``,
  ``--cert-file``, ``--key-file``: the admin client certificate of ``e2e/pki.py``);
- the chart's ServiceMonitor, PodMonitor and metrics Service, rendered by Helm
  (``CHART_VALUES``) and applied in the chart's namespace;
- a ``Prometheus`` resource (``prometheus_resource``) selecting them by the release's label, with
  ``serviceDiscoveryRole: EndpointSlice`` and ``apiserverConfig``, the operator's own field for a
  Prometheus that runs outside the cluster: the ``kubernetes_sd_configs`` it generates carry the
  API server's URL and the certificate files, so the generated configuration is used unchanged.

The operator writes that configuration into the Secret ``prometheus-<name>``
(``prometheus.yaml.gz``) and a StatefulSet to run Prometheus with it. No kubelet here runs a
StatefulSet's pod (kwok's are fake; the StatefulSet is asked for zero replicas so none claims to
run), so ``KubeletStandIn`` does for that pod what the kubelet would, and nothing more.

Two host processes stand in for pods, each published as the chart publishes it on a cluster:
serving pods get loopback IPs from the pod runner (the PodMonitor's pod role finds them as they
are); the session operator is published behind the chart's metrics Service by an EndpointSlice on
this machine's global address (``publish_operator_metrics``), since the API server refuses loopback
addresses in EndpointSlices.
"""

from __future__ import annotations

import base64
import gzip
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e import procs, versions
from e2e.addons.prometheus import Prometheus, PrometheusError
from e2e.serviceproxy import host_address

NAMESPACE = "monitoring"
"""Where the ``Prometheus`` resource, its generated Secret and its StatefulSet live."""
NAME = "fewerbits-e2e"
RELEASE = "fb"
CHART_NAMESPACE = "fewerbits-system"
METRICS_SERVICE = f"{RELEASE}-fewerbits-metrics"
OPERATOR_MONITOR = f"{RELEASE}-fewerbits"
"""The chart's ServiceMonitor of the operator (its metrics Service)."""
VLLM_MONITOR = f"{RELEASE}-fewerbits-vllm"
"""The chart's PodMonitor of the serving pods."""
ACTIVATOR_MONITOR = f"{RELEASE}-fewerbits-activator"
"""The chart's ServiceMonitor of the activator's Deployment (the e2e runs the activator as a host
process, so its job has no target here; the Prometheus Operator still turns it into a job)."""
SCRAPE_INTERVAL = "1s"
"""Every monitor and the Prometheus scrape every second, so tests wait seconds, not minutes."""
CHART_VALUES = [
    "metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true", "rbac.scope=cluster",
    *(f"metrics.{m}.{k}={SCRAPE_INTERVAL}" for m in ("serviceMonitor", "podMonitor")
      for k in ("interval", "scrapeTimeout")),
]
HARNESS_SLICE_MANAGER = "fewerbits-e2e"
"""``endpointslice.kubernetes.io/managed-by`` of the slice the harness writes, so the EndpointSlice
controller (which manages only its own) leaves it alone."""


CRDS = ("prometheuses", "servicemonitors", "podmonitors", "probes", "prometheusrules")
"""The CRDs the operator's Prometheus controller watches (1.1 of their 4.5 MB). The operator turns
off what needs an absent CRD (Alertmanager, PrometheusAgent, ThanosRuler, ScrapeConfig: its
``checkPrerequisites``, cmd/operator/main.go), and nothing here uses those; the API server takes
seconds per MB of CRD under load."""


def crd_files() -> list[Path]:
    return [versions.bin_dir("prometheus-operator") / "crd" / f"monitoring.coreos.com_{c}.yaml" for c in CRDS]


def crd_name(f: Path) -> str:
    """``monitoring.coreos.com_podmonitors.yaml`` holds ``podmonitors.monitoring.coreos.com``."""
    group, plural = f.stem.split("_", 1)
    return f"{plural}.{group}"


def chart_objects() -> list[dict[str, Any]]:
    """The chart's ServiceMonitors (operator, activator), PodMonitor and the metrics Service the
    operator's ServiceMonitor selects (cluster scope: the PodMonitor looks in every namespace, as the
    session operator watches)."""
    versions.ensure_built("helm")
    root = Path(__file__).resolve().parents[2]
    args = [str(versions.binary("helm")), "template", RELEASE, str(root / "charts" / "fewerbits"),
            "--namespace", CHART_NAMESPACE, "--kube-version", versions.version("kubernetes")]
    for v in CHART_VALUES:
        args += ["--set", v]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    return [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")
            or (d["kind"] == "Service" and d["metadata"]["name"] == METRICS_SERVICE)]


def prometheus_resource(cluster, version: str) -> dict[str, Any]:
    """The ``Prometheus`` the operator configures: the release's monitors in any namespace."""
    pki = cluster.state_dir / "pki"
    release = {"matchLabels": {"app.kubernetes.io/instance": RELEASE}}
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "replicas": 0, "version": version, "serviceDiscoveryRole": "EndpointSlice",
            "scrapeInterval": SCRAPE_INTERVAL, "evaluationInterval": SCRAPE_INTERVAL,
            "serviceMonitorSelector": release, "serviceMonitorNamespaceSelector": {},
            "podMonitorSelector": release, "podMonitorNamespaceSelector": {},
            "apiserverConfig": {"host": cluster.server, "tlsConfig": {
                "caFile": str(pki / "ca.crt"), "certFile": str(pki / "admin.crt"),
                "keyFile": str(pki / "admin.key")}},
        },
    }


def prometheus_version() -> str:
    """The server's release for the module version (module v0.3MM.P is Prometheus 3.MM.P)."""
    minor, patch = versions.version("prometheus").removeprefix("v0.3").split(".")
    return f"v3.{int(minor)}.{patch}"


def expected_jobs(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The scrape job each monitor's first endpoint becomes, by monitor name (the operator's naming:
    ``serviceMonitor/<namespace>/<name>/0``, ``podMonitor/<namespace>/<name>/0``)."""
    return {o["metadata"]["name"]: f"{o['kind'][0].lower()}{o['kind'][1:]}/{o['metadata']['namespace']}/"
                                   f"{o['metadata']['name']}/0"
            for o in objects if o["kind"] in ("ServiceMonitor", "PodMonitor")}


def generated_config(cluster) -> bytes | None:
    """``prometheus.yaml.gz`` of the Secret the operator writes, or None before it has."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        s = client.CoreV1Api(cluster.api_client()).read_namespaced_secret(f"prometheus-{NAME}", NAMESPACE)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    data = (s.data or {}).get("prometheus.yaml.gz")
    return base64.b64decode(data) if data else None


def scrape_jobs(gz: bytes) -> list[str]:
    return [c["job_name"] for c in yaml.safe_load(gzip.decompress(gz)).get("scrape_configs") or []]


@dataclass
class KubeletStandIn:
    """What the kubelet does for the pod of the operator's Prometheus StatefulSet, on this host:

    1. mounts the Secret ``prometheus-<name>``: its ``prometheus.yaml.gz`` is written, byte for byte,
       to ``<pod>/config/``;
    2. runs the pod's init container, the operator's config reloader with ``--watch-interval=0``
       and the environment the StatefulSet gives it (``POD_NAME``, ``SHARD=0``): it unzips the file
       and substitutes ``$(POD_NAME)`` and ``$(SHARD)`` into ``<pod>/config_out/prometheus.env.yaml``;
    3. runs the ``prometheus`` container's server (the harness's build, on a loopback port) on it.

    The configuration is the operator's, unchanged: nothing is rewritten. The pod's config-reloader
    sidecar, which would follow later changes of the Secret, is not run: the monitors are applied
    once, before Prometheus starts.
    """

    pod_dir: Path
    prometheus: Prometheus | None = field(default=None)

    @property
    def pod_name(self) -> str:
        return f"prometheus-{NAME}-0"

    def run(self, gz: bytes) -> Prometheus:
        (self.pod_dir / "config").mkdir(parents=True, exist_ok=True)
        (self.pod_dir / "config_out").mkdir(parents=True, exist_ok=True)
        (self.pod_dir / "config" / "prometheus.yaml.gz").write_bytes(gz)
        out = self.pod_dir / "config_out" / "prometheus.env.yaml"
        env = {**os.environ, "POD_NAME": self.pod_name, "SHARD": "0"}
        init = subprocess.run([
            str(versions.binary("prometheus-config-reloader")), "--watch-interval=0",
            f"--config-file={self.pod_dir / 'config' / 'prometheus.yaml.gz'}", f"--config-envsubst-file={out}",
        ], env=env, capture_output=True, text=True, timeout=60)
        if init.returncode != 0 or not out.exists():
            raise PrometheusError(f"init-config-reloader failed ({init.returncode}): {init.stdout}{init.stderr}")
        self.prometheus = Prometheus(self.pod_dir / "prometheus", out).start()
        return self.prometheus

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()


def _wait(what: str, check, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll ``check`` until it returns something truthy; fail at once if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise PrometheusError(f"{what}: prometheus-operator exited ({proc.returncode}):\n{procs.tail(log, 40)}")
        if time.monotonic() > deadline:
            raise PrometheusError(f"{what}: not after {timeout}s" + (f":\n{procs.tail(log, 40)}" if log else ""))
        time.sleep(0.25)


def install_crds(cluster, timeout: float = 60) -> None:
    """Applied as text: PyYAML's safe loader refuses a bare ``=`` their enums hold."""
    from kubernetes import client

    files = crd_files()
    cluster.apply("\n---\n".join(f.read_text() for f in files))
    ext = client.ApiextensionsV1Api(cluster.api_client())

    def established() -> bool:
        return all(any(c.type == "Established" and c.status == "True" for c in
                       ext.read_custom_resource_definition(crd_name(f)).status.conditions or [])
                   for f in files)
    _wait("monitoring.coreos.com CRDs established", established, timeout)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_operator(cluster, log: Path, timeout: float = 60) -> subprocess.Popen:
    """The operator out of cluster: the API server by URL, the admin client certificate."""
    pki = cluster.state_dir / "pki"
    port = procs.free_port()
    proc = procs.spawn([
        str(versions.binary("prometheus-operator")), f"--apiserver={cluster.server}",
        f"--ca-file={pki / 'ca.crt'}", f"--cert-file={pki / 'admin.crt'}", f"--key-file={pki / 'admin.key'}",
        f"--web.listen-address=127.0.0.1:{port}", f"--prometheus-instance-namespaces={NAMESPACE}",
        f"--alertmanager-instance-namespaces={NAMESPACE}", f"--thanos-ruler-instance-namespaces={NAMESPACE}",
        "--log-level=info",
    ], log)
    _wait("prometheus-operator /healthz", lambda: _healthy(port), timeout, proc, log)
    return proc


def publish_operator_metrics(cluster, port: int) -> str:
    """The session operator is a host process, not the chart's pod: list it in the chart's metrics
    Service as the EndpointSlice controller lists the operator's pod (port ``metrics``), on this
    machine's global address (the API server refuses loopback ones). Returns that address."""
    ip = host_address()
    cluster.apply({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{METRICS_SERVICE}-host", "namespace": CHART_NAMESPACE, "labels": {
            "kubernetes.io/service-name": METRICS_SERVICE,
            "endpointslice.kubernetes.io/managed-by": HARNESS_SLICE_MANAGER}},
        "addressType": "IPv4", "ports": [{"name": "metrics", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
    })
    return ip


@dataclass
class Monitoring:
    """The running stack: the operator, the kubelet stand-in's Prometheus, the generated jobs."""

    operator: subprocess.Popen
    operator_log: Path
    kubelet: KubeletStandIn
    jobs: dict[str, str]
    """Monitor kind -> the scrape job the operator generated for it."""
    startup_seconds: float

    @property
    def prometheus(self) -> Prometheus:
        assert self.kubelet.prometheus is not None
        return self.kubelet.prometheus

    def stop(self) -> None:
        self.kubelet.stop()
        procs.stop_group(self.operator.pid, 10, self.operator)


def start(cluster, state_dir: Path, timeout: float = 120) -> Monitoring:
    """CRDs, operator, the chart's monitors and a Prometheus resource; then, once the generated
    configuration holds a job for each monitor, Prometheus run on it by the kubelet stand-in."""
    t0 = time.monotonic()
    versions.ensure_built("prometheus", "prometheus-operator")
    install_crds(cluster)
    log = state_dir / "prometheus-operator.log"
    operator = start_operator(cluster, log)
    try:
        objects = chart_objects()
        cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
                       for ns in (NAMESPACE, CHART_NAMESPACE)])
        cluster.apply(objects)
        cluster.apply(prometheus_resource(cluster, prometheus_version()))
        jobs = expected_jobs(objects)

        def config_with_every_job() -> bytes | None:
            gz = generated_config(cluster)
            return gz if gz and set(jobs.values()) <= set(scrape_jobs(gz)) else None
        gz = _wait(f"Secret {NAMESPACE}/prometheus-{NAME} with the jobs {sorted(jobs.values())}",
                   config_with_every_job, timeout, operator, log)
        kubelet = KubeletStandIn(state_dir / "pod")
        kubelet.run(gz)
    except BaseException:
        procs.stop_group(operator.pid, 10, operator)
        raise
    return Monitoring(operator, log, kubelet, jobs, time.monotonic() - t0)
