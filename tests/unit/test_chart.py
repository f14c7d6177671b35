"""The Helm chart, rendered by a real Helm (v3, built from its Go module by e2e/build.sh, never
skipped: a missing binary is built first).

Helm built from its Go module without the release Makefile's ldflags believes the cluster is
Kubernetes v1.20, which our `kubeVersion: >=1.30.0-0` refuses; every lint and template here passes
`--kube-version` with the version the e2e control plane runs (e2e/versions.env).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import versions
from fewerbits_api.policy import QuantizationPolicy
from fewerbits_operator.base.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "fewerbits"
CRD_BASES = ROOT / "crds" / "bases"
DASHBOARD = ROOT / "dashboards" / "fewerbits.json"
RELEASE, NAMESPACE = "fb", "fewerbits-system"
LEASE_ROLE = f"{RELEASE}-fewerbits-leader-election"
ACTIVATOR = f"{RELEASE}-fewerbits-activator"
"""The activator's Deployment, Service, ServiceAccount, PodDisruptionBudget, Role(s) and binding(s)."""
KUBE_VERSION = versions.version("kubernetes")
DIGEST = "sha256:" + "ab" * 32

MODES: dict[str, list[str]] = {
    "defaults": [],
    "cluster": ["rbac.scope=cluster"],
    "no-crds": ["crds.enabled=false"],
    "default-policy": ["defaultPolicy.enabled=true"],
    "service-monitor": ["metrics.serviceMonitor.enabled=true"],
    "dashboards": ["dashboards.enabled=true"],
    "two-namespaces": ["watchNamespaces={ml-a,ml-b}"],
    "everything": ["rbac.scope=cluster", "crds.enabled=false", "defaultPolicy.enabled=true",
                   "metrics.serviceMonitor.enabled=true", "dashboards.enabled=true", f"image.digest={DIGEST}",
                   "config.defaultStorage.uri=s3://ml-artifacts/quantized",
                   "config.defaultStorage.endpoint=https://minio.example:9000",
                   "config.defaultStorage.region=eu-central-1", "config.defaultStorage.credentialsSecret=artifact-store",
                   "config.autoscaler.metricsSource=prometheus",
                   "config.autoscaler.prometheusUrl=http://prometheus.monitoring:9090",
                   "quantjobImage.tools.llmcompressor=0.15.0",
                   "config.quantizationJob.ephemeralStorageRequest=50Gi",
                   "config.quantizationJob.storageClassName=fast-nvme",

                   "config.nodeCache.budget=500Gi"],
}


# ------------------------------------------------------------------ helm


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    versions.ensure_built("helm")  # builds it (minutes, once per cache) when missing; never a skip
    binary = versions.binary("helm")
    assert binary.is_file(), f"e2e/build.sh helm did not produce {binary}"
    home = tmp_path_factory.mktemp("helm-home")
    os.environ.update({"HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                       "HELM_DATA_HOME": str(home / "data")})
    return [str(binary)]


def _sets(values: list[str]) -> list[str]:
    return [arg for v in values for arg in ("--set", v)]


def run_helm(helm: list[str], *args: str, chart: Path = CHART, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [*helm, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def template_text(helm: list[str], values: list[str], chart: Path = CHART, extra: tuple[str, ...] = ()) -> str:
    return run_helm(helm, "template", RELEASE, str(chart), "--namespace", NAMESPACE,
                    "--kube-version", KUBE_VERSION, *extra, *_sets(values)).stdout


def render(helm: list[str], values: list[str]) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(template_text(helm, values)) if d]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def operator_deployment(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [d for d in by_kind(objs, "Deployment") if d["metadata"]["name"] == f"{RELEASE}-fewerbits"]
    return dep


def activator_deployment(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [d for d in by_kind(objs, "Deployment") if d["metadata"]["name"] == ACTIVATOR]
    return dep


def env_of(dep: dict[str, Any]) -> dict[str, str]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}  # not POD_NAME (downward API)


# ------------------------------------------------------------------ lint and render


@pytest.mark.parametrize("mode", sorted(MODES))
def test_lint(helm: list[str], mode: str):
    run_helm(helm, "lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART), *_sets(MODES[mode]))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_template_renders_objects_that_parse(helm: list[str], mode: str):
    objs = render(helm, MODES[mode])
    seen = set()
    for o in objs:
        assert {"apiVersion", "kind", "metadata"} <= set(o), o
        key = (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        assert key not in seen, f"rendered twice: {key}"
        seen.add(key)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds
    assert ("CustomResourceDefinition" in kinds) == ("crds.enabled=false" not in MODES[mode])
    assert ("QuantizationPolicy" in kinds) == ("defaultPolicy.enabled=true" in MODES[mode])
    assert ("ServiceMonitor" in kinds) == ("metrics.serviceMonitor.enabled=true" in MODES[mode])
    assert ("ConfigMap" in kinds) == ("dashboards.enabled=true" in MODES[mode])


def test_notes_render(helm: list[str], tmp_path: Path):
    """`helm template` leaves NOTES.txt out; a copy of the chart renders it with `tpl` into a ConfigMap."""
    chart = tmp_path / "fewerbits"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "files" / "notes.txt")
    (chart / "templates" / "notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
        'data: {notes: {{ tpl (.Files.Get "files/notes.txt") . | toJson }}}\n')
    for values in ([], ["rbac.scope=cluster", "crds.enabled=false"]):
        out = template_text(helm, values, chart=chart, extra=("--show-only", "templates/notes.yaml"))
        text = yaml.safe_load(out)["data"]["notes"]
        assert "kubectl wait --for=condition=Ready qm/NAME" in text
        assert "kubectl get qm" in text
        assert f"deployment/{RELEASE}-fewerbits" in text
        assert ("every namespace" in text) == ("rbac.scope=cluster" in values)


# ------------------------------------------------------------------ values schema


@pytest.mark.parametrize("values, complaint", [
    (["rbac.scope=everything"], "scope"),
    (["unknownKey=1"], "unknownKey"),
    (["image.unknown=x"], "unknown"),
    (["rbac.scope=cluster", "watchNamespaces={ml-a}"], "watchNamespaces"),
    (["watchNamespaces={Not_A_Namespace}"], "watchNamespaces"),
    (["config.resyncSeconds=0"], "resyncSeconds"),
    (["metrics.port=70000"], "port"),
    (["image.digest=latest"], "digest"),
    (["defaultPolicy.enabled=true", "defaultPolicy.spec.rules.allowedFormats={fp9}"], "allowedFormats"),
    (["defaultPolicy.spec.rules.noSuchRule=true"], "noSuchRule"),
])
def test_schema_rejects(helm: list[str], values: list[str], complaint: str):
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *_sets(values), check=False)
    assert proc.returncode != 0, f"{values} was accepted"
    assert "schema" in proc.stderr.lower() and complaint in proc.stderr, proc.stderr


# ------------------------------------------------------------------ RBAC

# What the operator does, from operator/fewerbits_operator/base/kube.py (the autoscaler uses it too; the
# watched caches list and watch through it) (see templates/_rbac.tpl for the why of each line). Changing RBAC means changing this table.
NAMESPACED_RULES = {
    ("fewerbits.io", "quantizedmodels"): {"get", "list", "watch"},
    ("fewerbits.io", "quantizedmodels/status"): {"patch"},
    ("fewerbits.io", "quantizedmodels/finalizers"): {"update"},
    ("", "secrets"): {"get"},
    ("batch", "jobs"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "pods"): {"list", "watch"},  # watch: the models' pods cache (handlers.INDEXED)
    ("apps", "deployments"): {"list", "watch", "create", "update", "delete"},
    ("apps", "deployments/scale"): {"get", "patch"},  # the wake (update) is the activator's
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"list", "watch", "create", "update", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets/scale"): {"get", "patch"},
    ("", "services"): {"get", "list", "watch", "create", "patch"},
    ("inference.networking.k8s.io", "inferencepools"): {"get", "create", "patch"},
    ("gateway.networking.k8s.io", "httproutes"): {"get", "create", "update"},  # spec.serving.gateway (atzero.py)
    ("", "events"): {"create"},
    ("", "configmaps[fewerbits-node-cache-references]"): {"get", "update", "delete"},  # resourceNames
    ("", "serviceaccounts"): {"get", "create"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "create", "patch"},
    ("rbac.authorization.k8s.io", f"clusterroles[{RELEASE}-fewerbits-epp]"): {"bind"},
    ("discovery.k8s.io", "endpointslices"): {"list", "watch", "create", "update", "delete"},
}
ACTIVATOR_RULES = {  # namespaced scope: the activator Service's own slices, in the release namespace (slicewatch.py)
    ("discovery.k8s.io", "endpointslices"): {"list", "watch"},
}
ACTIVATOR_ROLE = f"{RELEASE}-fewerbits-activator-endpoints"
ACTIVATOR_SA_RULES = {  # the activator's own ServiceAccount, per watched namespace (activator.py): one request's needs
    ("fewerbits.io", "quantizedmodels"): {"get", "list", "watch"},  # list, watch: its caches (activator_cache.py)
    ("", "pods"): {"list", "watch"},
    ("apps", "deployments"): {"list", "watch"},
    ("apps", "deployments/scale"): {"get", "update"},
    ("", "events"): {"create"},
    ("gateway.networking.k8s.io", "httproutes"): {"get"},  # a model header is checked against the model's route
}
EPP_RULES = {  # the ClusterRole the operator binds for each model's endpoint picker (upstream's Role)
    ("", "pods"): {"get", "list", "watch"},
    ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"},
    ("inference.networking.x-k8s.io", "inferenceobjectives"): {"get", "list", "watch"},
}
CLUSTER_RULES = {
    ("fewerbits.io", "quantizationpolicies"): {"list", "watch"},
    ("fewerbits.io", "quantizationpolicies/status"): {"patch"},
    ("", "nodes"): {"list", "watch"},
    ("", "namespaces"): {"get"},
}


def _grants(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs", "resourceNames"}, f"unexpected rule fields (nonResourceURLs?): {rule}"
        names = rule.get("resourceNames")
        if names is not None:  # a grant on named objects only: "<resource>[<name>]" in the tables
            assert names and "create" not in rule["verbs"] and "list" not in rule["verbs"], rule
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                for key in ([f"{r}[{n}]" for n in names] if names is not None else [r]):
                    out.setdefault((g, key), set()).update(rule["verbs"])
    return out


@pytest.mark.parametrize("mode", sorted(MODES))
def test_rbac_has_no_wildcards_and_never_lists_secrets(helm: list[str], mode: str):
    for role in by_kind(render(helm, MODES[mode]), "ClusterRole") + by_kind(render(helm, MODES[mode]), "Role"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], f"{role['metadata']['name']}: wildcard in {field}: {rule}"
        grants = _grants(role)
        assert grants.get(("", "secrets"), {"get"}) == {"get"}, "secrets: get only (no list/watch)"


def test_every_rule_says_why(helm: list[str]):
    """Each rule in the rendered manifest (what `helm get manifest` shows) follows a comment."""
    for mode in ("defaults", "cluster"):
        lines = template_text(helm, MODES[mode]).splitlines()
        rules = [i for i, ln in enumerate(lines) if ln.startswith("- apiGroups:")]
        assert len(rules) == len(NAMESPACED_RULES) + len(CLUSTER_RULES) + len(EPP_RULES) + len(ACTIVATOR_SA_RULES) \
            + (len(ACTIVATOR_RULES) if mode == "defaults" else 0)
        for i in rules:
            assert lines[i - 1].lstrip().startswith("#"), f"{mode}: rule without a comment: {lines[i]} {lines[i + 1]}"


def test_rbac_namespaced_scope(helm: list[str]):
    objs = render(helm, MODES["two-namespaces"])
    sa = f"{RELEASE}-fewerbits"
    (cluster_role,) = [r for r in by_kind(objs, "ClusterRole") if not r["metadata"]["name"].endswith("-epp")]
    assert _grants(cluster_role) == CLUSTER_RULES
    roles = [r for r in by_kind(objs, "Role") if r["metadata"]["name"] not in (ACTIVATOR_ROLE, LEASE_ROLE, ACTIVATOR)]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml-a", "ml-b"]
    for role in roles:
        assert _grants(role) == NAMESPACED_RULES
    (activator,) = [r for r in by_kind(objs, "Role") if r["metadata"]["name"] == ACTIVATOR_ROLE]
    assert activator["metadata"]["namespace"] == NAMESPACE and _grants(activator) == ACTIVATOR_RULES
    bindings = by_kind(objs, "RoleBinding") + by_kind(objs, "ClusterRoleBinding")
    operators = [b for b in bindings if b["metadata"]["name"] != ACTIVATOR]
    assert len(operators) == 5  # the two namespaces', the cluster reads', the activator endpoints', the Lease's
    for b in operators:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    # The activator's own ServiceAccount: its least-privilege Role in each watched namespace, nothing else.
    a_roles = [r for r in by_kind(objs, "Role") if r["metadata"]["name"] == ACTIVATOR]
    assert sorted(r["metadata"]["namespace"] for r in a_roles) == ["ml-a", "ml-b"]
    assert all(_grants(r) == ACTIVATOR_SA_RULES for r in a_roles)
    a_bindings = [b for b in bindings if b["metadata"]["name"] == ACTIVATOR]
    assert sorted((b["kind"], b["metadata"]["namespace"]) for b in a_bindings) == [
        ("RoleBinding", "ml-a"), ("RoleBinding", "ml-b")]
    for b in a_bindings:
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ACTIVATOR}
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": ACTIVATOR, "namespace": NAMESPACE}]
    assert env_of(operator_deployment(objs))["FEWERBITS_NAMESPACES"] == '["ml-a","ml-b"]'


def test_the_pickers_cluster_role_reads_pods_and_pools_only_and_is_bound_by_nothing_in_the_chart(helm: list[str]):
    for mode in ("defaults", "cluster"):
        objs = render(helm, MODES[mode])
        (role,) = [r for r in by_kind(objs, "ClusterRole") if r["metadata"]["name"] == f"{RELEASE}-fewerbits-epp"]
        assert _grants(role) == EPP_RULES
        # The operator binds it per model (picker.py); the chart binds it to no one.
        assert not [b for b in by_kind(objs, "RoleBinding") + by_kind(objs, "ClusterRoleBinding")
                    if b["roleRef"]["name"] == role["metadata"]["name"]]
    assert env_of(operator_deployment(objs))["FEWERBITS_EPP_CLUSTER_ROLE"] == role["metadata"]["name"]


def test_rbac_namespaced_scope_defaults_to_the_release_namespace(helm: list[str]):
    objs = render(helm, [])
    assert sorted((r["metadata"]["name"], r["metadata"]["namespace"]) for r in by_kind(objs, "Role")
                  if r["metadata"]["name"] != LEASE_ROLE) == [(f"{RELEASE}-fewerbits", NAMESPACE),
                                                              (ACTIVATOR, NAMESPACE), (ACTIVATOR_ROLE, NAMESPACE)]
    assert json.loads(env_of(operator_deployment(objs))["FEWERBITS_NAMESPACES"]) == [NAMESPACE]


def test_rbac_cluster_scope(helm: list[str]):
    objs = render(helm, MODES["cluster"])
    assert [r["metadata"]["name"] for r in by_kind(objs, "Role")] == [LEASE_ROLE]
    assert [b["metadata"]["name"] for b in by_kind(objs, "RoleBinding")] == [LEASE_ROLE]
    (cluster_role,) = [r for r in by_kind(objs, "ClusterRole") if r["metadata"]["name"] == f"{RELEASE}-fewerbits"]
    assert _grants(cluster_role) == NAMESPACED_RULES | CLUSTER_RULES
    (activator,) = [r for r in by_kind(objs, "ClusterRole") if r["metadata"]["name"] == ACTIVATOR]
    assert _grants(activator) == ACTIVATOR_SA_RULES
    binding, a_binding = sorted(by_kind(objs, "ClusterRoleBinding"), key=lambda b: b["metadata"]["name"])
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert a_binding["roleRef"]["name"] == ACTIVATOR
    assert a_binding["subjects"] == [{"kind": "ServiceAccount", "name": ACTIVATOR, "namespace": NAMESPACE}]
    assert env_of(operator_deployment(objs))["FEWERBITS_NAMESPACES"] == "[]"


# ------------------------------------------------------------------ the operator pod


@pytest.mark.parametrize("deployment", [operator_deployment, activator_deployment])
def test_operator_pod_meets_the_restricted_pod_security_standard(helm: list[str], deployment):
    """The fields the `restricted` Pod Security Standard checks (kubernetes.io/docs/concepts/security/pod-security-standards)."""
    objs = render(helm, [])
    pod = deployment(objs)["spec"]["template"]["spec"]
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(host)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for v in pod["volumes"]:
        assert set(v) - {"name"} <= {"emptyDir", "configMap", "secret", "projected", "downwardAPI",
                                     "persistentVolumeClaim", "ephemeral", "csi"}, v
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True and sc.get("runAsUser", 65532) != 0
        assert sc["readOnlyRootFilesystem"] is True
        assert sc.get("privileged") in (None, False)
        assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        assert all("hostPort" not in p for p in c.get("ports", []))
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == mounts["/tmp"])


def test_operator_deployment(helm: list[str]):
    objs = render(helm, [])
    dep = operator_deployment(objs)
    assert dep["metadata"]["namespace"] == NAMESPACE
    assert dep["spec"]["replicas"] == 2, "two replicas, one active (the Lease holder)"
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    pod = dep["spec"]["template"]["spec"]
    assert env_of(dep)["FEWERBITS_LEADER_ELECTION"] == "true"
    assert env_of(dep)["FEWERBITS_LEADER_ELECTION_LEASE"] == f"{RELEASE}-fewerbits"
    assert env_of(dep)["FEWERBITS_LEADER_ELECTION_NAMESPACE"] == NAMESPACE
    (anti,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    (pdb,) = [p for p in by_kind(objs, "PodDisruptionBudget") if p["metadata"]["name"] == f"{RELEASE}-fewerbits"]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": dep["spec"]["selector"]}
    assert pod["automountServiceAccountToken"] is True
    (sa,) = [a for a in by_kind(objs, "ServiceAccount") if a["metadata"]["name"] == f"{RELEASE}-fewerbits"]
    assert sa["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/fewerbits/fewerbits-operator:0.1.0"
    assert c["command"] == ["python", "-m", "fewerbits_operator"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}  # the activator is its own Deployment
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_the_lease_role_is_the_one_lease_in_the_release_namespace(helm: list[str]):
    """get and update on the Lease by name; create cannot be limited to a name. Off with election off."""
    objs = render(helm, [])
    (role,) = [r for r in by_kind(objs, "Role") if r["metadata"]["name"] == LEASE_ROLE]
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [f"{RELEASE}-fewerbits"],
         "verbs": ["get", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}]
    (binding,) = [b for b in by_kind(objs, "RoleBinding") if b["metadata"]["name"] == LEASE_ROLE]
    assert binding["roleRef"]["name"] == LEASE_ROLE and binding["metadata"]["namespace"] == NAMESPACE
    one = render(helm, ["replicas=1", "leaderElection.enabled=false"])
    assert not [r for r in by_kind(one, "Role") if r["metadata"]["name"] == LEASE_ROLE]
    assert [p["metadata"]["name"] for p in by_kind(one, "PodDisruptionBudget")] == [ACTIVATOR]  # the operator's: none
    assert env_of(operator_deployment(one))["FEWERBITS_LEADER_ELECTION"] == "false"


def test_two_replicas_without_election_do_not_render(helm: list[str]):
    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                   "--set", "leaderElection.enabled=false", check=False)
    assert out.returncode != 0 and "replicas > 1 needs leaderElection.enabled" in out.stderr


def test_image_by_digest(helm: list[str]):
    (c,) = operator_deployment(render(helm, [f"image.digest={DIGEST}"]))["spec"]["template"]["spec"]["containers"]
    assert c["image"] == f"ghcr.io/fewerbits/fewerbits-operator@{DIGEST}"


def test_env_names_are_the_operator_settings(helm: list[str], monkeypatch: pytest.MonkeyPatch):
    """Every FEWERBITS_* variable the chart sets is a field of OperatorSettings, every field can be
    set, and the values parse into the settings the operator will run with."""
    objs = render(helm, MODES["everything"])
    env, activator_env = env_of(operator_deployment(objs)), env_of(activator_deployment(objs))
    fields = {f"FEWERBITS_{name.upper()}" for name in OperatorSettings.model_fields}
    # The activator's port, queue and wait are set on its own Deployment, the rest on the operator's.
    assert set(activator_env) == {"FEWERBITS_ACTIVATOR_PORT", "FEWERBITS_ACTIVATOR_QUEUE",
                                  "FEWERBITS_ACTIVATOR_TIMEOUT_SECONDS", "FEWERBITS_METRICS_PORT",
                                  "FEWERBITS_ACTIVATOR_TENANT_PORTS"}
    assert set(env) | set(activator_env) == fields
    for k in list(os.environ):
        if k.startswith("FEWERBITS_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = OperatorSettings()
    assert s.namespaces == []
    assert s.quantjob_image == "ghcr.io/fewerbits/fewerbits-quantjob:0.1.0"
    assert s.runtime_image == "ghcr.io/fewerbits/fewerbits-runtime:0.1.0"
    assert s.default_storage_uri == "s3://ml-artifacts/quantized"
    assert s.default_storage_credentials_secret == "artifact-store"
    assert (s.resync_seconds, s.job_ttl_seconds, s.metrics_port, s.health_port) == (30, 86400, 8080, 8081)
    assert (s.autoscaler_metrics_source, s.autoscaler_prometheus_url) == ("prometheus", "http://prometheus.monitoring:9090")


def test_defaults_match_the_operator_defaults(helm: list[str]):
    """With default values the chart tells the operator what it would assume anyway (one truth)."""
    objs = render(helm, [])
    env = {**env_of(activator_deployment(objs)), **env_of(operator_deployment(objs))}
    for name, field in OperatorSettings.model_fields.items():
        key = f"FEWERBITS_{name.upper()}"
        default = field.get_default(call_default_factory=True)
        if key in ("FEWERBITS_NAMESPACES", "FEWERBITS_QUANTJOB_IMAGE", "FEWERBITS_RUNTIME_IMAGE",
                   "FEWERBITS_QUANTJOB_TOOLS", "FEWERBITS_EPP_CLUSTER_ROLE", "FEWERBITS_ACTIVATOR_SERVICE",
                   "FEWERBITS_LEADER_ELECTION", "FEWERBITS_LEADER_ELECTION_NAMESPACE", "FEWERBITS_LEADER_ELECTION_LEASE",
                   "FEWERBITS_ACTIVATOR_TENANT_PORTS"):
            # release namespace (and name); image tags (and the image's tools) follow the chart's appVersion; the
            # chart elects (it runs 2 replicas) on a Lease named after the release, a process run by hand does not;
            # the chart keeps tenants apart (an activator port per watched namespace), a process run by hand does not
            continue
        if default is None:
            assert key not in env, f"{key}: unset means None"
            continue
        if isinstance(default, bool):  # pydantic-settings reads "true"/"false"; bool("false") would be True
            parsed = {"true": True, "false": False}[env[key]]
        else:
            parsed = type(default)(json.loads(env[key]) if isinstance(default, list) else env[key])
        assert parsed == default, f"{key}: chart {env[key]!r}, operator {default!r}"


def test_metrics_off(helm: list[str]):
    objs = render(helm, ["metrics.enabled=false"])
    assert [s["metadata"]["name"] for s in by_kind(objs, "Service")] == [ACTIVATOR]
    assert env_of(operator_deployment(objs))["FEWERBITS_METRICS_PORT"] == "0"


def test_metrics_service_and_service_monitor_select_the_operator(helm: list[str]):
    objs = render(helm, MODES["service-monitor"])
    dep = operator_deployment(objs)
    (svc,) = [s for s in by_kind(objs, "Service") if s["metadata"]["name"].endswith("-metrics")]
    (sm,) = [m for m in by_kind(objs, "ServiceMonitor") if m["metadata"]["name"] == f"{RELEASE}-fewerbits"]
    (asm,) = [m for m in by_kind(objs, "ServiceMonitor") if m["metadata"]["name"] == ACTIVATOR]
    (asvc,) = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] == ACTIVATOR]
    assert asm["spec"]["selector"]["matchLabels"].items() <= asvc["metadata"]["labels"].items()  # its metrics too
    assert not sm["spec"]["selector"]["matchLabels"].items() <= asvc["metadata"]["labels"].items()
    assert [e["port"] for e in asm["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in {p["name"] for p in asvc["spec"]["ports"]}
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "metrics" and ep["honorLabels"] is True


# ------------------------------------------------------------------ CRDs, policy, dashboards


def test_crds_are_the_generated_ones(helm: list[str]):
    objs = render(helm, [])
    rendered = {o["metadata"]["name"]: o for o in by_kind(objs, "CustomResourceDefinition")}
    bases = {}
    for path in sorted(CRD_BASES.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        bases[crd["metadata"]["name"]] = crd
    assert set(rendered) == set(bases) == {"quantizedmodels.fewerbits.io", "quantizationpolicies.fewerbits.io"}
    for name, crd in rendered.items():
        assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        stripped = json.loads(json.dumps(crd))
        del stripped["metadata"]["annotations"]
        base = json.loads(json.dumps(bases[name]))
        base["metadata"].pop("annotations", None)
        assert stripped == base, f"{name}: the chart's CRD differs from crds/bases (run python -m fewerbits_api.crdgen)"


def test_crds_without_keep(helm: list[str]):
    for crd in by_kind(render(helm, ["crds.keep=false"]), "CustomResourceDefinition"):
        assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})


def test_no_crds_when_disabled(helm: list[str]):
    assert by_kind(render(helm, ["crds.enabled=false"]), "CustomResourceDefinition") == []


def test_default_policy_is_a_valid_policy(helm: list[str]):
    objs = render(helm, MODES["default-policy"])
    (qp,) = by_kind(objs, "QuantizationPolicy")
    assert "namespace" not in qp["metadata"], "QuantizationPolicy is cluster-scoped"
    policy = QuantizationPolicy.model_validate(qp)
    assert policy.metadata.name == "fewerbits-default"
    assert policy.spec.rules.maxPerplexityIncreasePercent == 10.0


def test_dashboard_configmap(helm: list[str]):
    objs = render(helm, ["dashboards.enabled=true", "dashboards.namespace=monitoring"])
    (cm,) = by_kind(objs, "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["fewerbits.json"]) == json.loads(DASHBOARD.read_text())


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["version"], chart["appVersion"]) == ("v2", "0.1.0", "0.1.0")
    assert chart["kubeVersion"] == ">=1.30.0-0"
    import fewerbits_operator
    assert chart["appVersion"] == fewerbits_operator.__version__
    assert re.fullmatch(r"v1\.(\d+)\.\d+", KUBE_VERSION) and int(KUBE_VERSION.split(".")[1]) >= 30


def test_gpu_cost_weights_and_the_pickers_role_reach_the_operator(helm: list[str]):
    text = template_text(helm, [], extra=("--set-json", 'config.autoscaler.gpuCostWeights={"NVIDIA-L4": 0.27, '
                                                         '"NVIDIA-A100-SXM4-80GB": 0.6}'))
    env = env_of(operator_deployment([d for d in yaml.safe_load_all(text) if d]))
    from fewerbits_operator.base.settings import parse_cost_weights
    assert parse_cost_weights(env["FEWERBITS_GPU_COST_WEIGHTS"]) == {"NVIDIA-L4": 0.27, "NVIDIA-A100-SXM4-80GB": 0.6}
    assert env["FEWERBITS_EPP_CLUSTER_ROLE"] == "fb-fewerbits-epp"


def test_the_activator_is_its_own_deployment_with_two_replicas_and_a_pdb(helm: list[str]):
    """Out of the operator's failure domain (a killed operator replica loses no held request): its
    own Deployment, ServiceAccount and PodDisruptionBudget, the operator's image with another
    entrypoint, a Service selecting only its pods, probes on /healthz, and a grace period covering
    the requests it holds (activator_main.py drains them on SIGTERM)."""
    objs = render(helm, ["activator.timeoutSeconds=120"])
    dep, op = activator_deployment(objs), operator_deployment(objs)
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == operator_deployment(objs)["spec"]["template"]["spec"]["containers"][0]["image"]
    assert c["command"] == ["python", "-m", "fewerbits_operator.runtime.activator_main"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8082, "metrics": 8080}
    assert c["readinessProbe"]["httpGet"] == c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert pod["terminationGracePeriodSeconds"] == 130
    assert op["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 30
    assert env_of(dep)["FEWERBITS_ACTIVATOR_TIMEOUT_SECONDS"] == "120"
    (sa,) = [a for a in by_kind(objs, "ServiceAccount") if a["metadata"]["name"] == ACTIVATOR]
    assert pod["serviceAccountName"] == ACTIVATOR and sa["automountServiceAccountToken"] is False
    assert pod["automountServiceAccountToken"] is True
    sel = dep["spec"]["selector"]["matchLabels"]
    (pdb,) = [p for p in by_kind(objs, "PodDisruptionBudget") if p["metadata"]["name"] == ACTIVATOR]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": sel}}
    (svc,) = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] == ACTIVATOR]
    assert svc["spec"]["selector"] == sel and svc["spec"]["ports"][0]["name"] == "http"
    # Neither Deployment's selector matches the other's pods.
    op_sel = op["spec"]["selector"]["matchLabels"]
    assert not op_sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert not sel.items() <= op["spec"]["template"]["metadata"]["labels"].items()
    assert env_of(op)["FEWERBITS_ACTIVATOR_SERVICE"] == f"{NAMESPACE}/{ACTIVATOR}"
    (anti,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == sel
    one = render(helm, ["activator.replicas=1"])
    assert not [p for p in by_kind(one, "PodDisruptionBudget") if p["metadata"]["name"] == ACTIVATOR]
    off = render(helm, ["activator.enabled=false"])
    assert not [o for o in off if o["metadata"]["name"] == ACTIVATOR]
    assert "FEWERBITS_ACTIVATOR_SERVICE" not in env_of(operator_deployment(off))
