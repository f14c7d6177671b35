"""Argo CD on the local control plane: its repo server and application controller as local
processes, Redis from miniredis, Applications synced from a ``file://`` git repository.

Built from its Go module like the other components (``e2e/build.sh argocd``, pinned in
``e2e/versions.env``): one binary, ``argocd``, whose role comes from ``ARGOCD_BINARY_NAME``. Its
Application and AppProject CRDs come from the same module version (copied next to the binary by the
build). Started only by the tests that need it (``argocd`` fixture in ``e2e/pytest_plugin.py``).

What differs from Argo CD's own install (manifests/install.yaml), and why:

* No argocd-server, Dex, ApplicationSet or notifications controller: the e2e drives Argo CD through
  its API objects (Applications, their ``refresh`` annotation and ``operation`` field), as
  ``kubectl`` users of Argo CD do. argocd-server is what creates the ``default`` AppProject, so the
  add-on creates it.
* The controller reaches the API server through the admin kubeconfig with
  ``ARGOCD_FAKE_IN_CLUSTER=true``: its in-cluster destination (``https://kubernetes.default.svc``)
  then uses ``KUBECONFIG`` instead of a pod's service-account files.
* The repo server speaks plaintext gRPC on loopback (``--disable-tls``, the controller
  ``--repo-server-plaintext``) and renders Helm charts with the harness's own ``helm`` build; GnuPG
  verification is off (no ``gpg`` here).
* The controller keeps each resource's health in the Application's ``status.resources`` too
  (``--persist-resource-health``, Argo CD 2's default): v3 keeps it only in the resource tree in
  Redis, which argocd-server serves; here the test reads it from the Application. The health is
  computed the same way either way.
* Redis is miniredis (``e2e/argocd/miniredis.go``), the in-memory Redis of Argo CD's own tests.
* ``argocd-cm`` is the shipped ``docs/argocd/argocd-cm-patch.yaml`` (the fewerbits health checks,
  as a user installs them) plus the Application health check an app of apps needs. The controller
  compares each Application with git every ``RECONCILIATION_SECONDS`` (``--app-resync``, what
  install.yaml feeds from ``timeout.reconciliation``), so a commit is noticed in seconds rather
  than Argo CD's default two to three minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e import procs, versions

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "argocd"
GROUP, VERSION = "argoproj.io", "v1alpha1"
CM_PATCH = REPO / "docs" / "argocd" / "argocd-cm-patch.yaml"
RECONCILIATION_SECONDS = 5
"""``--app-resync``: how often the controller compares each Application with git."""


@dataclass
class ArgoCD:
    """A running Argo CD: its processes and their logs."""

    procs: dict[str, subprocess.Popen]
    logs: dict[str, Path]
    repo_server: str
    startup_seconds: float
    ports: dict[str, int] = field(default_factory=dict)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(f"--- {k}\n{procs.tail(v, n)}" for k, v in self.logs.items())


APPLICATION_HEALTH = """hs = {}
hs.status = "Progressing"
hs.message = ""
if obj.status ~= nil then
  if obj.status.health ~= nil then
    hs.status = obj.status.health.status
    if obj.status.health.message ~= nil then
      hs.message = obj.status.health.message
    end
  end
end
return hs
"""
"""Argo CD's documented health check for Applications (docs: operator-manual/health.md, "Argo CD App"):
without it an app of apps does not wait for each wave's Applications to be healthy."""


def argocd_cm() -> dict[str, Any]:
    """``argocd-cm``: the shipped patch (the health checks a user installs), the Application health
    check an app of apps needs (docs/gitops.md)."""
    cm = yaml.safe_load(CM_PATCH.read_text())
    cm["metadata"]["namespace"] = NAMESPACE
    cm["data"]["resource.customizations.health.argoproj.io_Application"] = APPLICATION_HEALTH
    return cm


def base_objects() -> list[dict[str, Any]]:
    """The namespace, settings and the ``default`` AppProject argocd-server would create."""
    labels = {"app.kubernetes.io/part-of": "argocd"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        argocd_cm(),
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "argocd-secret", "namespace": NAMESPACE,
                                                             "labels": {**labels, "app.kubernetes.io/name": "argocd-secret"}}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "argocd-rbac-cm", "namespace": NAMESPACE,
                                                                "labels": {**labels, "app.kubernetes.io/name": "argocd-rbac-cm"}}},
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "AppProject", "metadata": {"name": "default", "namespace": NAMESPACE},
         "spec": {"sourceRepos": ["*"], "destinations": [{"server": "*", "namespace": "*"}],
                  "clusterResourceWhitelist": [{"group": "*", "kind": "*"}]}},
    ]


def _healthz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _wait(check, what: str, proc: subprocess.Popen, log: Path, deadline: float) -> None:
    while not check():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{procs.tail(log, 40)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready:\n{procs.tail(log, 40)}")
        time.sleep(0.2)


def _env(cluster, role: str, tmp: Path) -> dict[str, str]:
    helm_dir = versions.bin_dir("helm")
    return {**os.environ, "ARGOCD_BINARY_NAME": role, "ARGOCD_GPG_ENABLED": "false",
            "ARGOCD_FAKE_IN_CLUSTER": "true", "KUBECONFIG": str(cluster.kubeconfig), "TMPDIR": str(tmp),
            "PATH": f"{helm_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HOME": str(tmp)}


def start(cluster, timeout: float = 120) -> ArgoCD:
    """Install Argo CD's CRDs and settings on ``cluster`` and start Redis, the repo server and the
    application controller."""
    t0 = time.monotonic()
    versions.ensure_built("argocd", "helm")
    bin_dir = versions.bin_dir("argocd")
    d = cluster.state_dir / "argocd"
    tmp = d / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    crds = [yaml.safe_load(f.read_text()) for f in sorted((bin_dir / "crd").glob("*.yaml"))]
    cluster.apply(crds)
    cluster.wait_crds_established([c["metadata"]["name"] for c in crds])
    cluster.apply(base_objects())
    ports = {k: procs.free_port() for k in ("redis", "repo", "repo-metrics", "controller-metrics")}
    logs = {k: cluster.state_dir / "logs" / f"argocd-{k}.log" for k in ("redis", "repo-server", "controller")}
    deadline = time.monotonic() + timeout
    running: dict[str, subprocess.Popen] = {}
    try:
        running["redis"] = procs.spawn([str(bin_dir / "fewerbits-miniredis"), f"--addr=127.0.0.1:{ports['redis']}"],
                                       logs["redis"])
        _wait(lambda: procs.port_in_use(ports["redis"]), "miniredis", running["redis"], logs["redis"], deadline)
        redis = f"127.0.0.1:{ports['redis']}"
        common = ["--redis", redis, "--loglevel", "info", "--logformat", "text"]
        running["repo-server"] = procs.spawn(
            [str(bin_dir / "argocd"), "--disable-tls", "--address", "127.0.0.1", "--port", str(ports["repo"]),
             "--metrics-address", "127.0.0.1", "--metrics-port", str(ports["repo-metrics"]), *common],
            logs["repo-server"], env=_env(cluster, "argocd-repo-server", tmp))
        _wait(lambda: _healthz(ports["repo-metrics"]), "argocd-repo-server", running["repo-server"],
              logs["repo-server"], deadline)
        repo_server = f"127.0.0.1:{ports['repo']}"
        running["controller"] = procs.spawn(
            [str(bin_dir / "argocd"), "--kubeconfig", str(cluster.kubeconfig), "--namespace", NAMESPACE,
             "--repo-server", repo_server, "--repo-server-plaintext", "--metrics-port", str(ports["controller-metrics"]),
             "--app-resync", str(RECONCILIATION_SECONDS), "--app-resync-jitter", "1",
             "--self-heal-timeout-seconds", "2", "--persist-resource-health", *common],
            logs["controller"], env=_env(cluster, "argocd-application-controller", tmp))
        _wait(lambda: _healthz(ports["controller-metrics"]), "argocd-application-controller",
              running["controller"], logs["controller"], deadline)
    except BaseException:
        for p in running.values():
            procs.stop_group(p.pid, 5, p)
        raise
    return ArgoCD(running, logs, repo_server, time.monotonic() - t0, ports)


def stop(argo: ArgoCD) -> None:
    """The controller first (nothing syncs after this), then the repo server, then Redis."""
    for name in ("controller", "repo-server", "redis"):
        p = argo.procs[name]
        procs.stop_group(p.pid, 10, p)


# --------------------------------------------------------------------------------- Applications


def application(name: str, repo_url: str, path: str, namespace: str, *, helm_values: dict[str, Any] | None = None,
                automated: bool = True, sync_options: list[str] | None = None,
                extra_spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """An Application of the ``default`` project syncing ``path`` of ``repo_url`` (HEAD) into
    ``namespace`` on the in-cluster destination; automated with prune and self-heal unless asked not."""
    source: dict[str, Any] = {"repoURL": repo_url, "targetRevision": "HEAD", "path": path}
    if helm_values is not None:
        source["helm"] = {"releaseName": name, "valuesObject": helm_values}
    spec: dict[str, Any] = {"project": "default", "source": source,
                            "destination": {"server": "https://kubernetes.default.svc", "namespace": namespace},
                            "syncPolicy": {"syncOptions": sync_options or []}}
    if automated:
        spec["syncPolicy"]["automated"] = {"prune": True, "selfHeal": True}
    spec.update(extra_spec or {})
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Application",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "finalizers": ["resources-finalizer.argocd.argoproj.io"]},
            "spec": spec}


def get_app(cluster, name: str) -> dict[str, Any]:
    """The Application ``name``; ``{}`` while it does not exist."""
    out = cluster.kubectl("get", f"applications.{GROUP}", name, "-n", NAMESPACE, "-o", "json",
                          "--ignore-not-found")
    return json.loads(out.stdout) if out.stdout.strip() else {}


def refresh(cluster, name: str) -> None:
    """Ask the controller to compare ``name`` with git now (the annotation ``argocd app get
    --refresh`` sets)."""
    cluster.kubectl("annotate", f"applications.{GROUP}", name, "-n", NAMESPACE, "--overwrite",
                    "argocd.argoproj.io/refresh=normal")


def terminate_operation(cluster, name: str) -> None:
    """Stop the Application's running operation (its retries included), as ``argocd app
    terminate-op`` does: the operation's phase set to Terminating, which the controller honours."""
    app = get_app(cluster, name)
    if ((app.get("status") or {}).get("operationState") or {}).get("phase") == "Running":
        cluster.kubectl("patch", f"applications.{GROUP}", name, "-n", NAMESPACE, "--type=merge", "-p",
                        json.dumps({"status": {"operationState": {"phase": "Terminating"}}}), check=False)


@dataclass(frozen=True)
class AppState:
    """What Argo CD says of an Application: the fields a platform team reads in its UI."""

    sync: str
    health: str
    revision: str
    operation_phase: str
    operation_message: str
    resources: tuple[dict[str, Any], ...]

    @staticmethod
    def of(app: dict[str, Any]) -> "AppState":
        st = app.get("status") or {}
        op = st.get("operationState") or {}
        return AppState(sync=(st.get("sync") or {}).get("status", ""),
                        health=(st.get("health") or {}).get("status", ""),
                        revision=(st.get("sync") or {}).get("revision", ""),
                        operation_phase=op.get("phase", ""), operation_message=op.get("message", ""),
                        resources=tuple(st.get("resources") or ()))

    def resource(self, kind: str, name: str) -> dict[str, Any]:
        for r in self.resources:
            if r.get("kind") == kind and r.get("name") == name:
                return r
        return {}

    def line(self) -> str:
        return f"sync={self.sync or '-'} health={self.health or '-'} revision={self.revision[:8] or '-'} " \
               f"operation={self.operation_phase or '-'}"
