"""Load: N QuantizedModels on the real control plane, then the operator at rest.

    .venv/bin/python bench/load_models.py [--models 300] [--namespaces 10] [--window-seconds 180]
                                          [--json-out load.json] [--operator-env KEY=VALUE ...] [--keep]
                                          [--compare-ref GIT_REF]

1. starts its own control plane (`e2e.cluster.Cluster(audit=True)`: every API request is a JSON
   line in the audit log) and installs the CRDs;
2. adds GPU pools of kwok nodes (H100, H200, L40S: all plan fp8-dynamic for the test model, so
   every model asks for the same artifact) with room for every model's one replica;
3. runs the operator as its own process (`python -m fewerbits_operator`) under a ServiceAccount
   bound to the chart's ClusterRole (rendered with `helm template charts/fewerbits`), with a
   TokenRequest token in a kubeconfig of its own: the audit lines of
   `system:serviceaccount:<ns>:<sa>` are the operator's and nobody else's;
4. quantizes for real once: a seed model's Job runs llm-compressor on the CPU (pod runner) and
   publishes the artifact; then the other N-1 models are applied at once over the namespaces and
   are cache hits. Serving pods use an image the pod runner does not own, so kwok fakes them
   (Running, Ready) and N simulators need not run on two cores;
5. waits until every model is Ready=True (create→Ready per model, polled every second);
6. measures the operator at rest for a window: RSS (VmRSS sampled each second; VmHWM = peak since
   start), API requests per minute by verb (audit log, the operator's identity), writes per minute
   (create/update/patch/delete: must be 0), reconcile durations (the operator's
   `fewerbits_reconcile_duration_seconds` histogram, whole run and window), and the load average;
7. prints a table, writes JSON (--json-out) and tears everything down. Exit 1 when the operator
   wrote anything at rest, 2 when the models did not get Ready in time.

The functions are shared with tests/integration/test_load_small.py (the CI-sized run).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "operator", REPO / "crds"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from e2e import cluster as cluster_mod  # noqa: E402
from e2e import demo  # noqa: E402

GROUP, VERSION, PLURAL = "fewerbits.io", "v1alpha1", "quantizedmodels"
OPERATOR_NS, RELEASE = "fewerbits-system", "load"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
# (pool name, e2e/gpu.py catalog key): Hopper and Ada all plan fp8-dynamic for the test model.
POOLS = [("h100", "h100"), ("h200", "h200"), ("l40s", "l40s")]
# Images the pod runner has no rule for: kwok plays their pods (e2e/workloads.py DEFAULT_RULES).
FAKE_VLLM_IMAGE = "example.invalid/vllm:load"
FAKE_RUNTIME_IMAGE = "example.invalid/runtime:load"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


# ------------------------------------------------------------------ cluster set-up


def install_crds(c: cluster_mod.Cluster, timeout: float = 60) -> None:
    from kubernetes import client

    c.kubectl("apply", "-f", str(REPO / "crds" / "bases"))
    ext = client.ApiextensionsV1Api(c.api_client())
    deadline = time.monotonic() + timeout
    for crd in ("quantizedmodels.fewerbits.io", "quantizationpolicies.fewerbits.io"):
        while not any(x.type == "Established" and x.status == "True"
                      for x in ext.read_custom_resource_definition(crd).status.conditions or []):
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {crd} not Established after {timeout:.0f}s")
            time.sleep(0.2)


def add_pools(c: cluster_mod.Cluster, models: int, spare_gpus: int = 8) -> dict[str, str]:
    """Enough kwok GPU nodes for each pool's share of the models (one GPU each) plus spare GPUs
    (the seed's quantization Job takes one). Returns pool name → GPU product."""
    from e2e import gpu

    per_pool = -(-models // len(POOLS))
    products = {}
    for name, key in POOLS:
        model = gpu.lookup(key)
        nodes = -(-(per_pool + spare_gpus) // model.count)
        c.add_gpu_pool(name, key, nodes=nodes, wait=False)
        products[name] = model.product
    names = [n.metadata.name for n in c.core().list_node().items]
    c.wait_nodes_ready(names, timeout=180)
    return products


def operator_identity(c: cluster_mod.Cluster, workdir: Path) -> tuple[Path, str]:
    """A ServiceAccount bound to the chart's own RBAC (cluster scope), and a kubeconfig with a
    TokenRequest token for it. Returns (kubeconfig, audit username)."""
    import yaml
    from kubernetes import client

    version = client.VersionApi(c.api_client()).get_code().git_version
    rendered = c.helm("template", RELEASE, str(REPO / "charts" / "fewerbits"), "-n", OPERATOR_NS,
                      "--kube-version", version,
                      "--set", "rbac.scope=cluster", "--set", "crds.enabled=false").stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    # The ClusterRole, and the leader election's Role in the operator's namespace (a Lease per replica set).
    rbac = [d for d in docs if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
    # The operator's ServiceAccount (the activator's, its own Deployment, has its own).
    (sa,) = [d for d in rbac if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == f"{RELEASE}-fewerbits"]
    for d in rbac:
        d.setdefault("metadata", {})
        if d["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            d["metadata"]["namespace"] = OPERATOR_NS
    core = client.CoreV1Api(c.api_client())
    core.create_namespace({"metadata": {"name": OPERATOR_NS}})
    c.apply(rbac)
    sa_name = sa["metadata"]["name"]
    tr = core.create_namespaced_service_account_token(sa_name, OPERATOR_NS, {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 24 * 3600}})
    kubeconfig = token_kubeconfig(c, workdir / "operator.kubeconfig", tr.status.token)
    return kubeconfig, f"system:serviceaccount:{OPERATOR_NS}:{sa_name}"


def token_kubeconfig(c: cluster_mod.Cluster, path: Path, token: str) -> Path:
    """A kubeconfig for the cluster with a bearer token."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "e2e", "cluster": {"server": c.server,
                                                 "certificate-authority": str(c.state_dir / "pki" / "ca.crt")}}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "e2e", "user": "operator"}}],
    }, indent=1))
    return path


def second_identity(c: cluster_mod.Cluster, workdir: Path, name: str) -> tuple[Path, str]:
    """Another ServiceAccount, bound wherever the first operator's is (the chart's RBAC), with a
    token and kubeconfig of its own (a second replica: tests/integration/test_two_writers.py,
    bench/soak.py)."""
    from kubernetes import client

    api = c.api_client()
    rbac, core = client.RbacAuthorizationV1Api(api), client.CoreV1Api(api)
    core.create_namespaced_service_account(OPERATOR_NS, {"metadata": {"name": name}})
    first = f"{RELEASE}-fewerbits"
    added = {"kind": "ServiceAccount", "name": name, "namespace": OPERATOR_NS}
    bindings = [(b, rbac.patch_cluster_role_binding) for b in rbac.list_cluster_role_binding().items] + [
        (b, lambda n, body: rbac.patch_namespaced_role_binding(n, OPERATOR_NS, body))
        for b in rbac.list_namespaced_role_binding(OPERATOR_NS).items]
    for binding, patch in bindings:
        subjects = [api.sanitize_for_serialization(s) for s in binding.subjects or []]
        if any(s.get("kind") == "ServiceAccount" and s.get("name") == first for s in subjects):
            patch(binding.metadata.name, {"subjects": [*subjects, added]})
    token = core.create_namespaced_service_account_token(name, OPERATOR_NS, {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 24 * 3600}}).status.token
    return token_kubeconfig(c, workdir / f"{name}.kubeconfig", token), f"system:serviceaccount:{OPERATOR_NS}:{name}"


def create_namespaces(c: cluster_mod.Cluster, names: list[str], secret: str) -> None:
    for ns in names:
        demo.create_namespace_with_secret(c, ns, secret)


def model_body(c: cluster_mod.Cluster, namespace: str, name: str, source_uri: str, secret: str,
               storage_prefix: str, product: str) -> dict[str, Any]:
    # Autoscaling stays off (the spec's default here): it scrapes pods, and kwok's fake pods have
    # no /metrics (see bench/README.md).
    spec = demo.test_model_spec(c.s3.endpoint, source_uri, secret, storage_prefix,
                                serving={"targets": [{"product": product}]})
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "QuantizedModel",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


# ------------------------------------------------------------------ waiting and measuring


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {x["type"]: x for x in (obj.get("status") or {}).get("conditions") or []}


@dataclass
class ReadyWatch:
    """Polls every model once a second (one LIST) and records when each is first seen Ready."""

    api: Any
    created: dict[tuple[str, str], float] = field(default_factory=dict)
    ready: dict[tuple[str, str], float] = field(default_factory=dict)
    last: list[dict[str, Any]] = field(default_factory=list)

    def poll(self) -> None:
        from kubernetes import client

        items = client.CustomObjectsApi(self.api).list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
        now = time.monotonic()
        self.last = items
        for o in items:
            key = (o["metadata"]["namespace"], o["metadata"]["name"])
            if key not in self.ready and conditions(o).get("Ready", {}).get("status") == "True":
                self.ready[key] = now

    def wait_all(self, timeout: float, what: str, keys: set[tuple[str, str]] | None = None,
                 progress: Callable[[str], None] = say) -> None:
        keys = keys if keys is not None else set(self.created)
        deadline = time.monotonic() + timeout
        last_report = 0.0
        while True:
            self.poll()
            missing = keys - set(self.ready)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {len(missing)} of {len(keys)} models not Ready after {timeout:.0f}s; "
                                   f"their conditions: {self.summary(missing)}")
            if time.monotonic() - last_report > 15:
                last_report = time.monotonic()
                progress(f"  {len(keys) - len(missing)}/{len(keys)} Ready ({self.summary(missing)})")
            time.sleep(1)

    def summary(self, keys: set[tuple[str, str]]) -> str:
        """Counts of the first condition that is not True, by type and reason."""
        counts: Counter = Counter()
        seen = set()
        for o in self.last:
            key = (o["metadata"]["namespace"], o["metadata"]["name"])
            if key not in keys:
                continue
            seen.add(key)
            first = next((x for x in (o.get("status") or {}).get("conditions") or [] if x["status"] != "True"), None)
            counts[f"{first['type']}={first['status']}({first['reason']})" if first else "no status yet"] += 1
        counts["not listed"] += len(keys - seen)
        return ", ".join(f"{k}: {v}" for k, v in counts.most_common() if v) or "none"

    def create_to_ready(self) -> list[float]:
        return sorted(self.ready[k] - self.created[k] for k in self.created if k in self.ready)


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[i]


def histogram(metrics_text: str, name: str, labels: str = "") -> dict[str, Any]:
    """Cumulative buckets, count and sum of a Prometheus histogram, unlabelled or of one label set
    (``labels`` as exposed, e.g. ``generation="2"``)."""
    buckets: list[tuple[float, float]] = []
    count = total = 0.0
    sel = re.escape(f"{{{labels}}}") if labels else ""
    for line in metrics_text.splitlines():
        if m := re.match(rf'{name}_bucket\{{{re.escape(labels + ",") if labels else ""}le="([^"]+)"\}} (\S+)', line):
            buckets.append((float(m.group(1)), float(m.group(2))))
        elif m := re.match(rf"{name}_count{sel} (\S+)", line):
            count = float(m.group(1))
        elif m := re.match(rf"{name}_sum{sel} (\S+)", line):
            total = float(m.group(1))
    return {"buckets": sorted(buckets), "count": count, "sum": total}


def histogram_diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    b = dict(before["buckets"])
    return {"buckets": [(le, n - b.get(le, 0.0)) for le, n in after["buckets"]],
            "count": after["count"] - before["count"], "sum": after["sum"] - before["sum"]}


def histogram_quantile(h: dict[str, Any], q: float) -> float | None:
    """As Prometheus's histogram_quantile: linear within the bucket that holds the quantile."""
    if not h["count"]:
        return None
    rank = q * h["count"]
    prev_le, prev_n = 0.0, 0.0
    for le, n in h["buckets"]:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 0)
        prev_le, prev_n = le, n
    return prev_le


def gc_pauses(before: str, after: str) -> dict[str, Any]:
    """The operator's full (generation-2) collections between two scrapes (gcpause.py): how many,
    their total and how many stopped it longer than 50 ms, each a reconcile it met is slower by."""
    name, labels = "fewerbits_gc_pause_seconds", 'generation="2"'
    if name not in after:
        return {}  # an operator without gcpause.py (the comparison's other column)
    h = histogram_diff(histogram(after, name, labels), histogram(before, name, labels))
    within = dict(h["buckets"]).get(0.05, 0.0)
    return {"count": h["count"], "sum_seconds": round(h["sum"], 3), "over_50ms": h["count"] - within}


def gauge(metrics_text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", metrics_text, re.M)
    return float(m.group(1)) if m else None


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0])
    return out


class RSSSampler:
    def __init__(self, pid: int, every: float = 1.0):
        self.pid, self.every = pid, every
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(proc_status(self.pid)["VmRSS"])
            except (OSError, KeyError):
                return
            self._stop.wait(self.every)

    def __enter__(self) -> "RSSSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def audit_requests(audit_log: Path, offset: int, user: str) -> tuple[Counter, Counter, int]:
    """Requests by ``user`` logged after ``offset``: (by verb, by verb+resource, new offset). One
    request is one auditID (a watch logs ResponseStarted and ResponseComplete)."""
    by_verb: Counter = Counter()
    by_resource: Counter = Counter()
    seen: set[str] = set()
    with open(audit_log, "rb") as f:
        f.seek(offset)
        for raw in f:
            if user.encode() not in raw:
                continue
            try:
                e = json.loads(raw)
            except ValueError:
                continue
            if (e.get("user") or {}).get("username") != user or e.get("auditID") in seen:
                continue
            seen.add(e.get("auditID"))
            ref = e.get("objectRef") or {}
            resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            by_verb[e.get("verb", "?")] += 1
            by_resource[f"{e.get('verb', '?')} {resource}"] += 1
        end = f.tell()
    return by_verb, by_resource, end


# ------------------------------------------------------------------ the run


@dataclass
class LoadResult:
    models: int
    namespaces: int
    window_seconds: float
    settle_seconds: float = 0
    ready_all: bool = False
    seed_quantized_seconds: float | None = None
    apply_seconds: float | None = None
    all_ready_seconds: float | None = None
    create_to_ready: dict[str, float | None] = field(default_factory=dict)
    rss_mib: dict[str, float | None] = field(default_factory=dict)
    requests_per_minute: dict[str, float] = field(default_factory=dict)
    requests_per_minute_by_resource: dict[str, float] = field(default_factory=dict)
    writes_per_minute: float = 0.0
    reconciles_per_minute: float = 0.0
    reads_per_reconcile: float | None = None
    """API reads per reconcile at rest (without the resync's and autoscaler's own LISTs)."""
    writes_in_window: dict[str, int] = field(default_factory=dict)
    """Writes at rest, the leader election's Lease renewals apart (``lease_requests_per_minute``)."""
    lease_requests_per_minute: dict[str, float] = field(default_factory=dict)
    spec_change_writes: dict[str, int] = field(default_factory=dict)
    """Every write of the operator between a spec change of one model (a field no child depends on)
    and the status at its new generation, plus 5 s."""
    start_seconds: float | None = None
    """A restart with every model in place: from the process start to every model reconciled once."""
    runtime: str = ""
    reconcile_seconds_run: dict[str, float | None] = field(default_factory=dict)
    reconcile_seconds_window: dict[str, float | None] = field(default_factory=dict)
    gc_pauses_window: dict[str, Any] = field(default_factory=dict)
    loadavg_start: list[float] = field(default_factory=list)
    loadavg_window: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    operator_env: dict[str, str] = field(default_factory=dict)
    operator_identity: str = ""


def _quantiles(h: dict[str, Any]) -> dict[str, float | None]:
    return {"count": h["count"], "p50": histogram_quantile(h, 0.5), "p90": histogram_quantile(h, 0.9),
            "p99": histogram_quantile(h, 0.99),
            "mean": (h["sum"] / h["count"]) if h["count"] else None}


def spec_change_writes(c: cluster_mod.Cluster, custom: Any, namespace: str, name: str, identity: str,
                       progress: Callable[[str], None]) -> dict[str, int]:
    """Change one model's spec where no child depends on it (the autoscaler's bounds, autoscaling
    off), wait for its status at the new generation, and count every write of the operator meanwhile
    (and 5 s after): status only, and no bookkeeping of the runtime's own."""
    offset = c.audit_log.stat().st_size
    obj = custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                {"spec": {"autoscaling": {"maxReplicas": 7}}})
    generation = obj["metadata"]["generation"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        if (got.get("status") or {}).get("observedGeneration") == generation:
            break
        time.sleep(0.5)
    time.sleep(5)
    _, by_resource, _ = audit_requests(c.audit_log, offset, identity)
    writes = {k: n for k, n in by_resource.items() if k.split()[0] in WRITE_VERBS and not k.endswith(" leases")}
    progress(f"a spec change of {namespace}/{name}: writes {writes}")
    return writes


def restart_seconds(op: Any, models: int, progress: Callable[[str], None], timeout: float = 600) -> float | None:
    """Restart the operator with every model in place: seconds from the process start to every
    model reconciled once (its reconcile counter; a standby would wait for the Lease: the old
    holder is stopped cleanly, and hands it over)."""
    op.stop()
    t = time.monotonic()
    op.start()
    while time.monotonic() - t < timeout:
        try:
            h = histogram(op.metrics(), "fewerbits_reconcile_duration_seconds")
        except OSError:
            h = {"count": 0}
        if h["count"] >= models:
            took = round(time.monotonic() - t, 1)
            progress(f"restarted: every model reconciled once {took}s after the process started")
            return took
        time.sleep(0.5)
    return None


def run_load(*, models: int, namespaces: int, window_seconds: float, settle_seconds: float = 0,
             ready_timeout: float = 1200,
             seed_timeout: float = 900, operator_env: dict[str, str] | None = None, keep: bool = False,
             state_dir: Path | None = None, progress: Callable[[str], None] = say,
             runtime: str = "kopf", source_tree: Path | None = None) -> LoadResult:
    """One load run. ``source_tree``: run the operator from another checkout (its ``operator`` and
    ``crds`` folders first on PYTHONPATH), e.g. the previous runtime for a comparison."""
    from kubernetes import client

    from tests.integration.operator_harness import OperatorProcess

    t_start = time.monotonic()
    result = LoadResult(models=models, namespaces=namespaces, window_seconds=window_seconds,
                        settle_seconds=settle_seconds, runtime=runtime)
    result.loadavg_start = loadavg()
    workdir = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="fewerbits-load-"))
    c = cluster_mod.Cluster(workdir / "cluster", audit=True)
    op: OperatorProcess | None = None
    try:
        progress(f"starting the control plane in {workdir} (audit log on)")
        c.start()
        install_crds(c)
        products = add_pools(c, models)
        progress(f"pools: {', '.join(f'{k} ({v})' for k, v in products.items())}; "
                 f"{len(c.core().list_node().items)} kwok nodes Ready")
        source = demo.upload_test_model(c)
        kubeconfig, identity = operator_identity(c, workdir)
        result.operator_identity = identity
        env = {
            "FEWERBITS_NAMESPACES": "[]",
            "FEWERBITS_VLLM_IMAGE": FAKE_VLLM_IMAGE, "FEWERBITS_RUNTIME_IMAGE": FAKE_RUNTIME_IMAGE,
            "FEWERBITS_VLLM_CPU_REQUEST": "100m", "FEWERBITS_VLLM_MEMORY_REQUEST": "128Mi",
            # The harness's test-speed settings back to the operator's defaults: a real deployment.
            "FEWERBITS_RESYNC_SECONDS": "30", "FEWERBITS_AUTOSCALER_PERIOD_SECONDS": "15",
            "FEWERBITS_AUTOSCALER_STATUS_INTERVAL_SECONDS": "60",
            # As the chart runs it: elected on its Lease (a runtime without election ignores these).
            "FEWERBITS_LEADER_ELECTION": "true", "FEWERBITS_LEADER_ELECTION_NAMESPACE": OPERATOR_NS,
            "FEWERBITS_LEADER_ELECTION_LEASE": f"{RELEASE}-fewerbits",
            **({"PYTHONPATH": f"{source_tree / 'operator'}:{source_tree / 'crds'}"} if source_tree else {}),
            **(operator_env or {}),
        }
        result.operator_env = env
        op = OperatorProcess(kubeconfig, workdir / "operator.log", env_extra=env).start()
        progress(f"operator pid {op.proc.pid} as {identity}")

        ns_names = [f"load-{i:02d}" for i in range(namespaces)]
        secret = "s3-credentials"
        create_namespaces(c, ns_names, secret)
        custom = client.CustomObjectsApi(c.api_client())
        watch = ReadyWatch(c.api_client())
        prefix = f"load-{int(time.time())}"
        pool_names = list(products)

        def apply(i: int) -> None:
            ns, name = ns_names[i % namespaces], f"m{i:04d}"
            body = model_body(c, ns, name, source, secret, prefix, products[pool_names[i % len(pool_names)]])
            watch.created[(ns, name)] = time.monotonic()
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)

        # One real quantization: the seed model's Job publishes the artifact every model shares.
        progress("seed model: one real quantization Job (llm-compressor on the CPU)")
        t = time.monotonic()
        apply(0)
        watch.wait_all(seed_timeout, "seed model", progress=progress)
        result.seed_quantized_seconds = round(time.monotonic() - t, 1)
        progress(f"seed Ready in {result.seed_quantized_seconds}s; applying {models - 1} more models")

        t = time.monotonic()
        for i in range(1, models):
            apply(i)
        result.apply_seconds = round(time.monotonic() - t, 1)
        try:
            watch.wait_all(ready_timeout, "all models", progress=progress)
        except TimeoutError as e:
            progress(str(e))
            progress("operator log tail:\n" + op.log_tail(40))
            raise
        result.ready_all = True
        result.all_ready_seconds = round(time.monotonic() - t, 1)
        # The seed's time is its quantization's: the figures are the N-1 applied at once.
        seed = next(iter(watch.created))
        c2r = sorted(watch.ready[k] - watch.created[k] for k in watch.created
                     if k != seed and k in watch.ready) or watch.create_to_ready()
        result.create_to_ready = {"p50": percentile(c2r, 0.5), "p90": percentile(c2r, 0.9),
                                  "p99": percentile(c2r, 0.99), "max": c2r[-1] if c2r else None}
        progress(f"all {models} Ready {result.all_ready_seconds}s after the apply began; settling "
                 f"{settle_seconds:.0f}s, then at rest for {window_seconds:.0f}s")
        # Each model's last reconcile before Ready scheduled a resync on the short period: let
        # those pass, so the window sees the steady schedule.
        time.sleep(settle_seconds)

        # At rest ------------------------------------------------------------------------------
        metrics_before = op.metrics()
        h_before = histogram(metrics_before, "fewerbits_reconcile_duration_seconds")
        offset = c.audit_log.stat().st_size
        with RSSSampler(op.proc.pid) as rss:
            time.sleep(window_seconds)
        result.loadavg_window = loadavg()
        metrics_after = op.metrics()
        by_verb, by_resource, _ = audit_requests(c.audit_log, offset, identity)
        per_min = 60.0 / window_seconds
        result.requests_per_minute = {v: round(n * per_min, 1) for v, n in by_verb.most_common()}
        result.requests_per_minute["total"] = round(sum(by_verb.values()) * per_min, 1)
        result.requests_per_minute_by_resource = {k: round(n * per_min, 1) for k, n in by_resource.most_common()}
        result.lease_requests_per_minute = {k: round(n * per_min, 1) for k, n in by_resource.items()
                                            if k.endswith(" leases")}
        writes = {k: n for k, n in by_resource.items() if k.split()[0] in WRITE_VERBS and not k.endswith(" leases")}
        result.writes_in_window = writes
        result.writes_per_minute = round(sum(writes.values()) * per_min, 2)
        status = proc_status(op.proc.pid)
        result.rss_mib = {"peak": round(status["VmHWM"] / 1024, 1),
                          "rest_mean": round(sum(rss.samples) / len(rss.samples) / 1024, 1) if rss.samples else None,
                          "rest_max": round(max(rss.samples) / 1024, 1) if rss.samples else None}
        h_after = histogram(metrics_after, "fewerbits_reconcile_duration_seconds")
        longest = gauge(metrics_after, "fewerbits_reconcile_duration_max_seconds")
        run_q = _quantiles(h_after)
        for k in ("p50", "p90", "p99"):  # interpolation inside a bucket can pass the true maximum
            if run_q[k] is not None and longest is not None:
                run_q[k] = min(run_q[k], longest)
        result.reconcile_seconds_run = {**run_q, "max": longest}
        result.reconcile_seconds_window = _quantiles(histogram_diff(h_after, h_before))
        result.gc_pauses_window = gc_pauses(metrics_before, metrics_after)
        n = result.reconcile_seconds_window["count"]
        result.reconciles_per_minute = round(n * per_min, 1)
        per_model = sum(v for k, v in by_resource.items() if k.split()[0] in ("get", "list")
                        and k not in ("list quantizedmodels", "get namespaces"))
        result.reads_per_reconcile = round(per_model / n, 2) if n else None
        result.spec_change_writes = spec_change_writes(c, custom, ns_names[0], "m0000", identity, progress)
        result.start_seconds = restart_seconds(op, models, progress)
        return result
    finally:
        result.wall_seconds = round(time.monotonic() - t_start, 1)
        if op is not None:
            op.stop()
        c.stop()
        if keep:
            progress(f"kept {workdir} (logs, audit log)")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def table(r: LoadResult) -> str:
    def f(x: float | None, unit: str = "") -> str:
        return "-" if x is None else (f"{x:.3f}{unit}" if isinstance(x, float) and x < 10 else f"{x:.1f}{unit}")

    rows = [
        ("models / namespaces", f"{r.models} / {r.namespaces}"),
        ("all Ready", f"{r.ready_all} ({f(r.all_ready_seconds, ' s')} after applying; seed quantized and Ready "
                      f"in {f(r.seed_quantized_seconds, ' s')})"),
        ("create→Ready p50/p90/p99/max", " / ".join(f(r.create_to_ready.get(k), " s") for k in ("p50", "p90", "p99", "max"))),
        ("operator RSS peak / at rest (mean, max)",
         f"{f(r.rss_mib.get('peak'))} / {f(r.rss_mib.get('rest_mean'))}, {f(r.rss_mib.get('rest_max'))} MiB"),
        (f"API requests/min at rest ({r.window_seconds:.0f} s)",
         ", ".join(f"{k} {v:g}" for k, v in r.requests_per_minute.items()) or "0"),
        ("reconciles/min at rest, API reads per reconcile", f"{r.reconciles_per_minute:g}, {r.reads_per_reconcile}"),
        ("writes/min at rest (Lease apart)", f"{r.writes_per_minute:g}" + (f" {r.writes_in_window}" if r.writes_in_window else "")),
        ("Lease requests/min at rest", ", ".join(f"{k} {v:g}" for k, v in r.lease_requests_per_minute.items()) or "0"),
        ("writes for one spec change", ", ".join(f"{k} {v}" for k, v in r.spec_change_writes.items()) or "0"),
        ("restart: every model reconciled once", f(r.start_seconds, " s")),
        ("reconcile s, whole run p50/p90/p99/max (n)",
         " / ".join(f(r.reconcile_seconds_run.get(k)) for k in ("p50", "p90", "p99", "max"))
         + f" ({r.reconcile_seconds_run.get('count', 0):.0f})"),
        ("reconcile s, at rest p50/p90/p99 (n)",
         " / ".join(f(r.reconcile_seconds_window.get(k)) for k in ("p50", "p90", "p99"))
         + f" ({r.reconcile_seconds_window.get('count', 0):.0f})"),
        ("full GC pauses at rest: n / total / over 50 ms", _gc_text(r.gc_pauses_window)),
        ("load average at start / end of window", f"{r.loadavg_start} / {r.loadavg_window}"),
        ("wall time", f(r.wall_seconds, " s")),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("requests/min by verb and resource: " + ", ".join(
        f"{k} {v:g}" for k, v in r.requests_per_minute_by_resource.items()))
    return "\n".join(lines)


def _gc_text(g: dict[str, Any]) -> str:
    return f"{g['count']:g} / {g['sum_seconds']:g} s / {g['over_50ms']:g}" if g else "- (not measured)"


def compare_markdown(results: dict[str, dict[str, Any]]) -> str:
    """The figures of several runs (``asdict(LoadResult)`` each, as the JSON holds them) as one
    markdown table, a column per run: what docs/architecture.md shows."""
    def num(x: Any, unit: str = "") -> str:
        return "-" if x is None else f"{x:g}{unit}"

    rows = [
        ("writes/min at rest (Lease apart)", lambda r: num(r["writes_per_minute"])),
        ("Lease requests/min at rest", lambda r: ", ".join(f"{k} {v:g}" for k, v in r.get("lease_requests_per_minute", {}).items()) or "0"),
        ("writes for one spec change", lambda r: ", ".join(f"{k} {v}" for k, v in r.get("spec_change_writes", {}).items()) or "-"),
        ("API requests/min at rest", lambda r: num(r["requests_per_minute"].get("total"))),
        ("reconcile p99 at rest", lambda r: num(r["reconcile_seconds_window"].get("p99") and round(r["reconcile_seconds_window"]["p99"], 3), " s")),
        ("reconcile p99, whole run", lambda r: num(r["reconcile_seconds_run"].get("p99") and round(r["reconcile_seconds_run"]["p99"], 3), " s")),
        ("full GC pauses at rest: n / total / over 50 ms", lambda r: _gc_text(r.get("gc_pauses_window") or {})),
        ("RSS peak / at rest", lambda r: f"{num(r['rss_mib'].get('peak'))} / {num(r['rss_mib'].get('rest_mean'))} MiB"),
        ("all Ready after the apply", lambda r: num(r["all_ready_seconds"], " s")),
        ("restart: every model reconciled once", lambda r: num(r.get("start_seconds"), " s")),
        ("load average at start / end of window", lambda r: f"{r['loadavg_start'][0]:g} / {r['loadavg_window'][0]:g}"),
    ]
    names = list(results)
    lines = ["| at 300 models, 10 namespaces | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, get in rows:
        lines.append(f"| {label} | " + " | ".join(get(results[n]) for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/load_models.py", description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=300)
    ap.add_argument("--namespaces", type=int, default=10)
    ap.add_argument("--window-seconds", type=float, default=180)
    ap.add_argument("--settle-seconds", type=float, default=60,
                    help="wait after all are Ready before the window (post-Ready resyncs pass)")
    ap.add_argument("--ready-timeout", type=float, default=1200, help="seconds for all models to get Ready")
    ap.add_argument("--seed-timeout", type=float, default=900, help="seconds for the seed's quantization")
    ap.add_argument("--operator-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra operator settings, e.g. FEWERBITS_STEADY_RESYNC_SECONDS=30")
    ap.add_argument("--compare-ref", metavar="GIT_REF",
                    help="also run the operator of this git ref (a temporary worktree) first, in the same "
                         "invocation: two columns, e.g. the previous runtime")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--markdown-from", type=Path, metavar="JSON",
                    help="print the table of a run's JSON (one column, or one per run of a --compare-ref run) and exit")
    ap.add_argument("--keep", action="store_true", help="keep the state dir (logs, audit log)")
    args = ap.parse_args(argv)
    if args.markdown_from:
        runs = json.loads(args.markdown_from.read_text())
        print(compare_markdown({"kopf": runs} if "models" in runs else runs))  # one run, or a --compare-ref run's
        return 0
    if args.models < 1 or args.namespaces < 1:
        ap.error("--models and --namespaces must be at least 1")
    env = dict(kv.split("=", 1) for kv in args.operator_env)
    runs: list[tuple[str, Path | None]] = [("kopf", None)]
    tree = None
    if args.compare_ref:
        tree = Path(tempfile.mkdtemp(prefix="fewerbits-ref-")) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.compare_ref],
                       check=True, capture_output=True)
        runs.insert(0, (args.compare_ref, tree))
    results: dict[str, LoadResult] = {}
    try:
        for label, source_tree in runs:
            say(f"=== {label} ===")
            results[label] = run_load(models=args.models, namespaces=args.namespaces,
                                      window_seconds=args.window_seconds, settle_seconds=args.settle_seconds,
                                      ready_timeout=args.ready_timeout, seed_timeout=args.seed_timeout,
                                      operator_env=env, keep=args.keep, runtime=label, source_tree=source_tree)
    except TimeoutError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 2
    finally:
        if tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    for label, r in results.items():
        print(f"\n{label}:")
        print(table(r))
    if len(results) > 1:
        print("\n" + compare_markdown({k: asdict(v) for k, v in results.items()}))
    if args.json_out:
        out = {k: asdict(v) for k, v in results.items()} if len(results) > 1 else asdict(results["kopf"])
        args.json_out.write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.json_out}")
    wrote = {k: r.writes_in_window for k, r in results.items() if r.writes_per_minute > 0}
    if wrote:
        print(f"\nFAILED: the operator wrote at rest: {wrote}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
