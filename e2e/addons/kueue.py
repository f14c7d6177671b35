"""Kueue on the local control plane: its CRDs, its controller-manager as a local process, its
webhooks served by that process over TLS.

Built from its Go module like the other components (``e2e/build.sh kueue``, pinned in
``e2e/versions.env``); the CRDs and webhook configurations come from the same module version
(copied next to the binary by the build). Started only by the tests that need it
(``kueue`` fixture in ``e2e/pytest_plugin.py``), once per session, on the session's cluster.

What differs from Kueue's own install (config/default), and why:

* The webhooks and the CRD conversion webhooks point at the local process by URL
  (``https://127.0.0.1:<port>/<path>``) with the session CA's bundle: there is no Service or pod
  network here. The serving certificate is signed by the cluster's CA (``e2e/pki.py``), for
  IP 127.0.0.1; Kueue's own certificate manager is off.
* Only the webhooks of the kinds it manages here are installed: Kueue's own (``kueue.x-k8s.io``)
  and ``batch/v1`` Jobs. The Job webhooks get an objectSelector on the queue-name label, so the
  session's other Jobs (every other test's) never wait on this process; Kueue ignores Jobs
  without that label anyway (``manageJobsWithoutQueueName: false``).
* Kueue v0.15.0 loads a metrics serving certificate from the fixed path
  ``/etc/kueue/metrics/certs`` whenever its own certificate manager is off, even with metrics off
  (cmd/kueue/main.go): the add-on puts the webhook's certificate there when nothing is there yet
  (the only write outside the session's state folder).
* It runs with the admin kubeconfig (its ClusterRole is not installed) and without leader
  election, metrics or the visibility API server.
"""

from __future__ import annotations

import base64
import copy
import json
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e import pki, procs, versions

CONVERTED_CRDS = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
"""Kueue's CRDs whose v1beta1 (storage) ↔ v1beta2 conversion its webhook serves (its
config/components/crd kustomization patches these five)."""
GROUP = "kueue.x-k8s.io"
WEBHOOK_CONFIGS = ("fewerbits-e2e-kueue-mutating", "fewerbits-e2e-kueue-validating")


@dataclass
class Kueue:
    """A running Kueue: its process, its log, the port its webhooks are served on."""

    proc: subprocess.Popen
    log: Path
    webhook_port: int
    health_port: int
    startup_seconds: float

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        return procs.tail(self.log, n)


def serving_cert(pki_dir: Path, out: Path) -> Path:
    """A serving certificate for 127.0.0.1 signed by the cluster's CA, as controller-runtime's
    webhook server reads it (``tls.crt``, ``tls.key`` in a folder)."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tls.crt").exists():
        stem = "kueue-webhook"
        # The CA's own folder: the signing helper resolves ca.crt / ca.key relative to it.
        pki._signed(pki_dir, stem, "/CN=kueue-webhook",
                    "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                    "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        (out / "tls.crt").write_bytes((pki_dir / f"{stem}.crt").read_bytes())
        (out / "tls.key").write_bytes((pki_dir / f"{stem}.key").read_bytes())
    return out


METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")


def metrics_cert(cert_dir: Path) -> None:
    """Kueue exits at start without a certificate at ``METRICS_CERT_DIR`` (see the module)."""
    if (METRICS_CERT_DIR / "tls.crt").exists() and (METRICS_CERT_DIR / "tls.key").exists():
        return
    try:
        METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
        for f in ("tls.crt", "tls.key"):
            (METRICS_CERT_DIR / f).write_bytes((cert_dir / f).read_bytes())
    except OSError as e:
        raise RuntimeError(f"Kueue v0.15.0 needs a certificate in {METRICS_CERT_DIR} (its metrics server reads "
                           f"it even when off) and this user cannot write there: {e}") from e


def config(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"]},
    }


def _url_client(port: int, path: str, ca_bundle: str) -> dict[str, Any]:
    return {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}


def crds(bin_dir: Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    out = []
    for f in sorted((bin_dir / "crd").glob("*.yaml")):
        crd = yaml.safe_load(f.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED_CRDS:
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "clientConfig": _url_client(port, "/convert", ca_bundle), "conversionReviewVersions": ["v1"]}}
        out.append(crd)
    return out


def webhook_configurations(bin_dir: Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((bin_dir / "webhook" / "manifests.yaml").read_text()) if d]
    out = []
    for doc, name in zip(docs, WEBHOOK_CONFIGS):
        doc = copy.deepcopy(doc)
        doc["metadata"] = {"name": name}
        kept = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            if "kueue-x-k8s-io" not in path and "batch-v1-job" not in path:
                continue
            hook["clientConfig"] = _url_client(port, path, ca_bundle)
            if "batch-v1-job" in path:
                hook["objectSelector"] = {"matchExpressions": [
                    {"key": "kueue.x-k8s.io/queue-name", "operator": "Exists"}]}
            kept.append(hook)
        doc["webhooks"] = kept
        out.append(doc)
    return out


def _ready(health_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _webhook_answers(port: int, ca: Path) -> bool:
    """A TLS handshake with the webhook server, verified against the session CA."""
    ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            with ctx.wrap_socket(sock, server_hostname="127.0.0.1"):
                return True
    except OSError:
        return False


def start(cluster, timeout: float = 120) -> Kueue:
    """Install Kueue's CRDs and webhooks on ``cluster`` and start its controller-manager."""
    t0 = time.monotonic()
    versions.ensure_built("kueue")
    bin_dir = versions.bin_dir("kueue")
    d = cluster.state_dir / "kueue"
    d.mkdir(parents=True, exist_ok=True)
    pki_dir = cluster.state_dir / "pki"
    cert_dir = serving_cert(pki_dir, d / "certs")
    metrics_cert(cert_dir)
    ca_bundle = base64.b64encode((pki_dir / "ca.crt").read_bytes()).decode()
    webhook_port, health_port = procs.free_port(), procs.free_port()

    cluster.apply(crds(bin_dir, webhook_port, ca_bundle))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    *[f"crd/{c['metadata']['name']}" for c in crds(bin_dir, webhook_port, ca_bundle)])
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kueue-system"}})
    (d / "config.yaml").write_text(yaml.safe_dump(config(webhook_port, health_port, cert_dir)))
    log = cluster.state_dir / "logs" / "kueue.log"
    proc = procs.spawn([str(bin_dir / "kueue"), f"--config={d / 'config.yaml'}",
                        f"--kubeconfig={cluster.kubeconfig}", "--feature-gates=VisibilityOnDemand=false",
                        "--zap-log-level=info"], log)
    deadline = time.monotonic() + timeout
    while not (_ready(health_port) and _webhook_answers(webhook_port, pki_dir / "ca.crt")):
        if proc.poll() is not None:
            raise RuntimeError(f"kueue exited ({proc.returncode}):\n{procs.tail(log, 40)}")
        if time.monotonic() > deadline:
            procs.stop_group(proc.pid, 5, proc)
            raise RuntimeError(f"kueue not ready after {timeout}s:\n{procs.tail(log, 40)}")
        time.sleep(0.2)
    # Webhooks last: until the process serves them, a Job create would fail on them.
    cluster.apply(webhook_configurations(bin_dir, webhook_port, ca_bundle))
    return Kueue(proc, log, webhook_port, health_port, time.monotonic() - t0)


def stop(cluster, kueue: Kueue) -> None:
    """Webhooks first (nothing may call a stopped process), then the process."""
    for kind, name in zip(("mutatingwebhookconfiguration", "validatingwebhookconfiguration"), WEBHOOK_CONFIGS):
        cluster.kubectl("delete", kind, name, "--ignore-not-found", check=False)
    procs.stop_group(kueue.proc.pid, 10, kueue.proc)


def gpu_queue(name: str, namespace: str, gpus: int, *, cpu: str = "64", memory: str = "512Gi") -> list[dict[str, Any]]:
    """A ResourceFlavor, a ClusterQueue with a quota of ``gpus`` nvidia.com/gpu (CPU, memory and
    disk generous, so GPUs decide) and a LocalQueue named ``name`` in ``namespace`` pointing at it."""
    flavor = {"apiVersion": f"{GROUP}/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": f"{name}-{namespace}"}}
    cq = {"apiVersion": f"{GROUP}/v1beta2", "kind": "ClusterQueue", "metadata": {"name": f"{name}-{namespace}"},
          "spec": {"namespaceSelector": {}, "resourceGroups": [{
              "coveredResources": ["cpu", "memory", "ephemeral-storage", "nvidia.com/gpu"],
              "flavors": [{"name": f"{name}-{namespace}", "resources": [
                  {"name": "cpu", "nominalQuota": cpu}, {"name": "memory", "nominalQuota": memory},
                  {"name": "ephemeral-storage", "nominalQuota": "100Ti"},
                  {"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]}]}}
    lq = {"apiVersion": f"{GROUP}/v1beta2", "kind": "LocalQueue", "metadata": {"name": name, "namespace": namespace},
          "spec": {"clusterQueue": f"{name}-{namespace}"}}
    return [flavor, cq, lq]


def workloads(cluster, namespace: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", f"workloads.{GROUP}", "-n", namespace, "-o", "json")
    return json.loads(out.stdout)["items"]
