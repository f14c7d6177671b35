"""The Gateway API Inference Extension on the shared e2e cluster: its CRDs (and Gateway API's HTTPRoute
CRD, for the operator's route at spec.serving.gateway; e2e/routeproxy.py resolves it), the ClusterRole the
chart ships for the operator's endpoint pickers (EPP), and a gateway in front of a picker that
speaks Envoy's ext_proc protocol to it.

All built from Go modules by e2e/build.sh (`epp`, `gateway`), pinned by GIE_VERSION in
e2e/versions.env. Started only for the tests that ask (the `inference_gateway` session fixture in
e2e/pytest_plugin.py), so the rest of the suite pays nothing.

The EPP is the operator's: its Deployment's pod is run by the pod runner (e2e/workloads.py, rule
`epp`) as the binary built here, with its ServiceAccount's token, so it reads the pool and pods
with the chart's role: it watches the InferencePool and its pods, scrapes each pod's vLLM /metrics
at <pod IP>:<target port> (the pod runner gives pods loopback IPs), and answers ext_proc streams.
`fewerbits-extproc-gateway` (e2e/gateway/main.go) stands in for Envoy, which cannot be fetched here:
it sends each HTTP request's headers and body to the EPP, forwards to the endpoint the EPP names, and
echoes it in the `X-Fewerbits-Endpoint` response header.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from e2e import procs, versions

BUILD = versions.E2E_DIR / "build.sh"
GROUP = "inference.networking.k8s.io"


def _bin_dir(component: str) -> Path:
    out = subprocess.run(["bash", str(BUILD), "--print-bin-dir", component], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def ensure_built() -> tuple[Path, Path]:
    """The EPP and gateway binaries, built when missing (minutes, once per cache); never a skip."""
    missing = [c for c in ("epp", "gateway") if not _bin_dir(c).is_dir()]
    if missing:
        proc = subprocess.run(["bash", str(BUILD), *missing], capture_output=True, text=True)
        if proc.returncode != 0:
            raise versions.BuildError(f"e2e/build.sh {' '.join(missing)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return _bin_dir("epp") / "epp", _bin_dir("gateway") / "fewerbits-extproc-gateway"


def module_dir(module: str = "sigs.k8s.io/gateway-api-inference-extension", version_key: str = "GIE_VERSION") -> Path:
    """A module in the Go module cache (build.sh downloaded GIE's; Gateway API's is fetched here)."""
    v = versions.VERSIONS[version_key]
    out = subprocess.run(["go", "mod", "download", "-json", f"{module}@{v}"],
                         capture_output=True, text=True, check=True, env={**__import__("os").environ, "GOFLAGS": "-mod=mod"})
    return Path(json.loads(out.stdout)["Dir"])


def crd_files() -> list[Path]:
    """The InferencePool (v1) CRD, the InferenceObjective CRD the EPP also watches, and Gateway API's
    standard-channel HTTPRoute CRD (the operator's route for spec.serving.gateway)."""
    bases = module_dir() / "config" / "crd" / "bases"
    standard = module_dir("sigs.k8s.io/gateway-api", "GATEWAY_API_VERSION") / "config" / "crd" / "standard"
    return [bases / "inference.networking.k8s.io_inferencepools.yaml",
            bases / "inference.networking.x-k8s.io_inferenceobjectives.yaml",
            standard / "gateway.networking.k8s.io_httproutes.yaml"]


def install_crds(cluster) -> None:
    for f in crd_files():
        cluster.kubectl("apply", "--server-side", "-f", str(f))
    from kubernetes import client
    ext = client.ApiextensionsV1Api(cluster.api_client())
    for name in ("inferencepools.inference.networking.k8s.io", "inferenceobjectives.inference.networking.x-k8s.io",
                 "httproutes.gateway.networking.k8s.io"):
        deadline = time.monotonic() + 60
        while not any(c.type == "Established" and c.status == "True"
                      for c in ext.read_custom_resource_definition(name).status.conditions or []):
            assert time.monotonic() < deadline, f"CRD {name} not established after 60s"
            time.sleep(0.2)


@dataclass
class Picker:
    """The e2e gateway in front of one endpoint picker (the picker is the operator's pod)."""

    namespace: str
    pool: str
    log_dir: Path
    gateway_url: str = ""
    metrics_url: str = ""
    _procs: list[subprocess.Popen] = field(default_factory=list)

    def log_text(self) -> str:
        """The gateway's log (the picker's is its pod's, in the pod runner's state)."""
        logs = sorted(self.log_dir.glob(f"gateway-{self.namespace}-*.log"))
        return "".join(f.read_text(errors="replace") for f in logs)

    def queue_sizes(self) -> dict[str, int]:
        """The EPP's own view: `inference_pool_per_pod_queue_size` by pod name (what it scraped)."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line.startswith("inference_pool_per_pod_queue_size{"):
                labels, value = line.rsplit(" ", 1)
                pod = labels.split('model_server_pod="', 1)[1].split('"', 1)[0]
                out[pod.removesuffix("-rank-0")] = int(float(value))
        return out

    def chat(self, model: str, content: str = "hi", timeout: float = 30) -> tuple[int, str, dict]:
        """One OpenAI chat completion through the gateway: (status, endpoint it went to, body)."""
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                           "max_tokens": 4}).encode()
        req = urllib.request.Request(f"{self.gateway_url}/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.headers.get("X-Fewerbits-Endpoint", ""), json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("X-Fewerbits-Endpoint", ""), {"error": e.read().decode(errors="replace")}

    def stop(self) -> None:
        for p in reversed(self._procs):
            procs.stop_group(p.pid, 5, p)
        self._procs.clear()


PICKER_RELEASE = "fewerbits-e2e"
PICKER_ROLE = f"{PICKER_RELEASE}-epp"
"""The pickers' ClusterRole as the chart names it for release `fewerbits-e2e`. Not the chart's default
release name: a chart install test on the same cluster creates its own `fewerbits-epp` under Helm's
ownership, and Helm refuses to adopt an object it did not create. The operator harness sets
FEWERBITS_EPP_CLUSTER_ROLE to this name."""


def install_picker_role(cluster) -> None:
    """The ClusterRole the chart ships for the operator's pickers (templates/epp-rbac.yaml), rendered
    by Helm for release ``PICKER_RELEASE``. The operator under test binds it per model."""
    chart = versions.E2E_DIR.parent / "charts" / "fewerbits"
    text = cluster.helm("template", PICKER_RELEASE, str(chart), "--show-only", "templates/epp-rbac.yaml",
                        "--kube-version", versions.VERSIONS["KUBERNETES_VERSION"]).stdout
    cluster.apply(text)


class InferenceGateway:
    """The session's add-on: CRDs and the pickers' ClusterRole installed once, a gateway in front of
    an operator-deployed picker on demand (``front``)."""

    def __init__(self, cluster, log_dir: Path):
        self.cluster = cluster
        self.log_dir = log_dir
        self.epp, self.gateway = ensure_built()
        install_crds(cluster)
        install_picker_role(cluster)
        self.pickers: list[Picker] = []

    def front(self, namespace: str, picker_pod_ip: str, tls: bool = True) -> "Picker":
        """A gateway in front of a picker the operator deployed (its pod, run by the pod runner from
        the picker's image rule): ext-proc to <pod IP>:9002, over TLS as the picker serves by default.
        The Service the InferencePool names has no kube-proxy here, so the pod IP stands in for it."""
        http = procs.free_port()
        p = Picker(namespace, f"front-{picker_pod_ip}", self.log_dir)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.log_dir)}
        p._procs.append(procs.spawn([str(self.gateway), "--listen", f"127.0.0.1:{http}", "--picker",
                                     f"{picker_pod_ip}:9002", *(["--picker-tls"] if tls else [])],
                                    self.log_dir / f"gateway-{namespace}-{picker_pod_ip}.log", env=env))
        p.gateway_url = f"http://127.0.0.1:{http}"
        p.metrics_url = f"http://{picker_pod_ip}:9090/metrics"
        self.pickers.append(p)
        deadline = time.monotonic() + 30
        while True:  # the gateway listening (it dials the picker lazily, per request)
            try:
                socket.create_connection(("127.0.0.1", http), timeout=1).close()
                return p
            except OSError:
                if time.monotonic() > deadline or p._procs[0].poll() is not None:
                    raise RuntimeError(f"the e2e gateway did not listen on {http}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        for p in self.pickers:
            p.stop()
