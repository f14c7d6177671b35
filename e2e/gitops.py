"""fewerbits driven from git by Argo CD: the repository a platform team keeps, and what Argo CD says
of it. Shared by the GitOps e2e (``e2e/tests/test_gitops_argocd.py``) and ``scripts/demo.sh --gitops``.

The repository (a local git repository Argo CD reads over ``file://``) holds, as ``docs/gitops.md``
recommends:

    apps/fewerbits.yaml     Application of the chart, sync wave -2 (CRDs, RBAC, the operator)
    apps/models.yaml        Application of models/, sync wave 0
    charts/fewerbits/       the chart, with its values in the Application
    models/policy.yaml      a QuantizationPolicy (sync wave -1 inside its Application)
    models/<name>.yaml      one QuantizedModel each

and one root Application (``root``, app of apps) points at ``apps/``. Nothing under test is applied
with kubectl: the test applies the root Application, the models' namespace and its S3 Secret (a
secret manager's job, never git's).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from e2e import demo
from e2e.addons import argocd

REPO = Path(__file__).resolve().parents[1]
ROOT_APP, CHART_APP, MODELS_APP = "root", "fewerbits", "models"
POLICY = "gitops-defaults"
AUTOSCALER_PERIOD_SECONDS = 2


class GitRepo:
    """A local git repository: write files, commit, revert. Commits by a fixed author."""

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "main")

    @property
    def url(self) -> str:
        return f"file://{self.path}"

    def git(self, *args: str) -> str:
        out = subprocess.run(["git", "-C", str(self.path), "-c", "user.name=platform-team",
                              "-c", "user.email=platform@example.com", *args],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    def write(self, rel: str, docs: dict[str, Any] | list[dict[str, Any]]) -> None:
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(yaml.safe_dump_all(docs if isinstance(docs, list) else [docs], sort_keys=False))

    def remove(self, rel: str) -> None:
        self.git("rm", "-q", rel)

    def commit(self, message: str) -> str:
        """Commit everything; the new HEAD's sha."""
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.head()

    def revert(self, sha: str) -> str:
        self.git("revert", "--no-edit", sha)
        return self.head()

    def head(self) -> str:
        return self.git("rev-parse", "HEAD")


def _wave(obj: dict[str, Any], wave: int) -> dict[str, Any]:
    obj["metadata"].setdefault("annotations", {})["argocd.argoproj.io/sync-wave"] = str(wave)
    return obj


def chart_app(repo: GitRepo, model_ns: str, system_ns: str) -> dict[str, Any]:
    """The chart's Application: CRDs and the operator, restricted Pod Security on its namespace,
    server-side apply (the CRDs are too large for the last-applied annotation). The autoscaler
    passes every few seconds, so a test sees it scale within a minute."""
    values = demo.chart_values([model_ns], crds_enabled=True)
    values["config"]["autoscaler"] = {"periodSeconds": AUTOSCALER_PERIOD_SECONDS}
    app = argocd.application(CHART_APP, repo.url, "charts/fewerbits", system_ns, helm_values=values,
                             sync_options=["CreateNamespace=true", "ServerSideApply=true"])
    app["spec"]["source"]["helm"]["releaseName"] = "fewerbits"
    app["spec"]["syncPolicy"]["managedNamespaceMetadata"] = {
        "labels": {"pod-security.kubernetes.io/enforce": "restricted"}}
    return _wave(app, -2)


def models_app(repo: GitRepo, model_ns: str) -> dict[str, Any]:
    return _wave(argocd.application(MODELS_APP, repo.url, "models", model_ns), 0)


def policy(model_ns: str, storage: dict[str, Any]) -> dict[str, Any]:
    """The platform's defaults for the models' namespace: where artifacts go. The models do not name
    their storage, so a model admitted before its policy would be refused (the reason for wave -1)."""
    return _wave({"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizationPolicy",
                  "metadata": {"name": POLICY},
                  "spec": {"priority": 100,
                           "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": model_ns}},
                           "defaults": {"storage": storage}}}, -1)


def model(c, name: str, source_uri: str, secret: str, **overrides: Any) -> dict[str, Any]:
    """A QuantizedModel for the tiny test model, served by the simulator, its storage left to the
    policy (``demo.test_model_spec`` without ``storage``)."""
    spec = demo.test_model_spec(c.s3.endpoint, source_uri, secret, "unused", **overrides)
    del spec["storage"]
    return {"apiVersion": f"{demo.GROUP}/{demo.VERSION}", "kind": "QuantizedModel",
            "metadata": {"name": name}, "spec": spec}


def storage(c, secret: str) -> dict[str, Any]:
    return {"uri": f"s3://{demo.ARTIFACT_BUCKET}/gitops", "endpoint": c.s3.endpoint, "credentialsSecret": secret}


def write_layout(c, repo: GitRepo, model_ns: str, system_ns: str, models: list[dict[str, Any]], secret: str) -> str:
    """The whole repository; returns the first commit."""
    shutil.copytree(REPO / "charts" / "fewerbits", repo.path / "charts" / "fewerbits")
    repo.write("apps/fewerbits.yaml", chart_app(repo, model_ns, system_ns))
    repo.write("apps/models.yaml", models_app(repo, model_ns))
    repo.write("models/policy.yaml", policy(model_ns, storage(c, secret)))
    for m in models:
        repo.write(f"models/{m['metadata']['name']}.yaml", m)
    return repo.commit("fewerbits, its policy and two models")


def root_app(repo: GitRepo) -> dict[str, Any]:
    """The app of apps: the Applications under ``apps/``, in their sync waves."""
    return argocd.application(ROOT_APP, repo.url, "apps", argocd.NAMESPACE)


@dataclass
class Watch:
    """Polls Applications and reports each change of sync, health or operation phase."""

    cluster: Any
    out: Callable[[str], None] = demo.say

    def __post_init__(self) -> None:
        self.last: dict[str, str] = {}
        self.history: dict[str, list[argocd.AppState]] = {}

    def state(self, name: str) -> argocd.AppState:
        st = argocd.AppState.of(argocd.get_app(self.cluster, name))
        self.history.setdefault(name, []).append(st)
        line = st.line()
        if self.last.get(name) != line:
            self.last[name] = line
            self.out(f"  Application {name:<10} {line}")
        return st

    def until(self, name: str, ok: Callable[[argocd.AppState], bool], what: str, timeout: float,
              refresh: bool = False) -> argocd.AppState:
        """The first state of ``name`` for which ``ok`` holds; with ``refresh``, Argo CD is asked to
        compare with git now (as ``argocd app get --refresh``) instead of at its next resync."""
        if refresh:
            argocd.refresh(self.cluster, name)
        deadline = time.monotonic() + timeout
        while True:
            st = self.state(name)
            if ok(st):
                return st
            if time.monotonic() > deadline:
                odd = [f"{r.get('kind')}/{r.get('name')}: {r.get('status')}, {(r.get('health') or {}).get('status', '-')}"
                       for r in st.resources if r.get("status") != "Synced" or
                       (r.get("health") or {}).get("status", "Healthy") != "Healthy"]
                raise TimeoutError(f"Application {name}: not {what} after {timeout:.0f}s (last: {st.line()}; "
                                   f"{st.operation_message[:300]}; resources not Synced or not Healthy: {odd})")
            time.sleep(1)


def synced_at(revision: str) -> Callable[[argocd.AppState], bool]:
    return lambda st: st.sync == "Synced" and st.revision == revision
