"""pytest fixtures for the local control plane. Enable with `pytest_plugins = ["e2e.pytest_plugin"]`.

Fixtures:
  cluster   (session) — one real control plane + MinIO + pod runner for the whole session.
  s3        (session) — an S3 server: the cluster's MinIO if a cluster fixture is already up,
                        otherwise a MinIO started alone (tests that need only storage).
  s3_bucket (function) — a fresh, empty bucket name on `s3`.
  gpu_pool  (function) — factory: gpu_pool("h100", "NVIDIA-H100-80GB-HBM3", nodes=1) adds a pool and
                        removes its nodes after the test.
  namespace (function) — a fresh namespace, deleted after the test.
  lws       (session) — LeaderWorkerSet (CRD, controller, webhooks) on `cluster`, started on first use
                        (e2e/addons/lws.py): only the tests that ask for it pay for it.
  prometheus_operator (session) — the Prometheus Operator, the chart's ServiceMonitor and
                        PodMonitor, and the Prometheus it configures, run by the harness's kubelet
                        stand-in (e2e/addons/prometheus_operator.py); started on first use only.
  prometheus (session) — that Prometheus's HTTP API (e2e/addons/prometheus.py).

Missing binaries are BUILT (e2e/build.sh), never skipped. Mark tests `cluster` or `s3`.
Environment: FEWERBITS_CACHE (binary cache), FEWERBITS_E2E_KEEP=1 keeps the state dir for debugging,
FEWERBITS_CPU_CAPABILITY=AVX2 serves with vLLM's CPU build as on a CPU without AVX-512 (e2e/vllm_cpu.py;
the session's header names the level every vLLM pod acts on).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from e2e import cluster as cluster_mod
from e2e import procs


def pytest_configure(config) -> None:
    """An impossible FEWERBITS_CPU_CAPABILITY stops the session here, before any test, naming it."""
    _vllm_cpu_level()


def pytest_report_header(config) -> str:
    return f"vLLM CPU level: {_vllm_cpu_level()}"


def _vllm_cpu_level() -> str:
    """The CPU level vLLM's CPU build acts on in this session (e2e/vllm_cpu.py)."""
    from e2e import vllm_cpu

    try:
        return vllm_cpu.this_cpu(dict(os.environ)).describe()
    except vllm_cpu.CapabilityError as e:
        raise pytest.UsageError(str(e)) from None


def _state_root(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"fewerbits-e2e-{name}-"))


def _cleanup(d: Path) -> None:
    if os.environ.get("FEWERBITS_E2E_KEEP") != "1":
        shutil.rmtree(d, ignore_errors=True)


_session_cluster: cluster_mod.Cluster | None = None


def _worker_cidrs() -> dict[str, str]:
    """Disjoint loopback pod ranges per pytest-xdist worker (gw0, gw1, ...): each worker runs its own
    control plane and pod runner, and pod IPs are bound on this host. Without xdist, or when the
    ranges are set in the environment, the cluster's defaults apply."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or "FEWERBITS_E2E_POD_CIDR" in os.environ:
        return {}
    n = int(worker[2:])
    if n > 60:
        raise RuntimeError(f"too many xdist workers for disjoint loopback pod ranges: {worker}")
    return {"kwok_cidr": f"127.{100 + 2 * n}.0.0/16", "pod_cidr": f"127.{101 + 2 * n}.0.0/16"}


@pytest.fixture(scope="session")
def cluster():
    """The session's control plane: a started `e2e.cluster.Cluster`.

    Useful members: kubeconfig (Path), server (URL), api_client(), api_client_for_token(token),
    core(), kubectl(*args, input=None, check=True), apply(manifest), add_gpu_pool(name, product=None,
    nodes=1, gpus_per_node=None), add_cpu_node(name), remove_pool(name), pod_logs(ns, pod, container),
    s3 (S3Server: endpoint, access_key, secret_key, region, client(), env()), env(), state_dir.
    """
    global _session_cluster
    d = _state_root("cluster")
    c = cluster_mod.Cluster(d, **_worker_cidrs())
    c.start()
    _session_cluster = c
    try:
        yield c
    finally:
        _session_cluster = None
        c.stop()
        _cleanup(d)


@pytest.fixture(scope="session")
def s3(request):
    """An S3 server (MinIO). Reuses the cluster's when the session already started one."""
    if _session_cluster is not None and _session_cluster.s3 is not None:
        yield _session_cluster.s3
        return
    d = _state_root("s3")
    server, proc = cluster_mod.start_s3(d)
    try:
        yield server
    finally:
        procs.stop_group(proc.pid, 10, proc)
        _cleanup(d)


@pytest.fixture
def s3_bucket(s3):
    name = f"t-{uuid.uuid4().hex[:12]}"
    client = s3.client()
    client.create_bucket(Bucket=name)
    yield name
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=name):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=name, Key=obj["Key"])
    client.delete_bucket(Bucket=name)


@pytest.fixture
def gpu_pool(cluster):
    """Factory adding GPU pools for one test; their nodes are deleted afterwards."""
    added: list[str] = []

    def add(name: str, product: str | None = None, nodes: int = 1, gpus_per_node: int | None = None) -> list[str]:
        added.append(name)
        return cluster.add_gpu_pool(name, product, nodes, gpus_per_node)

    yield add
    for name in added:
        cluster.remove_pool(name)


@pytest.fixture
def namespace(cluster):
    from kubernetes import client

    name = f"t-{uuid.uuid4().hex[:8]}"
    api = client.CoreV1Api(cluster.api_client())
    api.create_namespace({"metadata": {"name": name}})
    yield name
    api.delete_namespace(name)


@pytest.fixture(scope="session")
def kueue(cluster):
    """Kueue (controller-manager, CRDs, webhooks) on the session's cluster, started on first use
    (e2e/addons/kueue.py): only the sessions that run a test asking for it pay for it."""
    from e2e.addons import kueue as kueue_addon

    k = kueue_addon.start(cluster)
    try:
        yield k
    finally:
        kueue_addon.stop(cluster, k)


@pytest.fixture(scope="session")
def argocd(cluster):
    """Argo CD's repo server and application controller on the session's cluster (e2e/addons/argocd.py),
    started on first use."""
    from e2e.addons import argocd as argocd_addon

    a = argocd_addon.start(cluster)
    try:
        yield a
    finally:
        argocd_addon.stop(a)


@pytest.fixture(scope="session")
def lws(cluster):
    """LeaderWorkerSet on the session's cluster (e2e/addons/lws.py), started once, on first use."""
    from e2e.addons import lws as lws_addon

    return lws_addon.ensure(cluster)


@pytest.fixture(scope="session")
def prometheus_operator(cluster):
    """The Prometheus Operator on the session's cluster, scraping the chart's ServiceMonitor and
    PodMonitor through the Prometheus it configures (e2e/addons/prometheus_operator.py); started
    once, on first use."""
    from e2e.addons import prometheus_operator as po

    d = _state_root("prometheus")
    m = po.start(cluster, d)
    print(f"prometheus_operator: up in {m.startup_seconds:.1f} s, jobs {sorted(m.jobs.values())}")
    try:
        yield m
    finally:
        m.stop()
        _cleanup(d)


@pytest.fixture(scope="session")
def prometheus(prometheus_operator):
    """That Prometheus (e2e/addons/prometheus.py): its HTTP API."""
    return prometheus_operator.prometheus


@pytest.fixture(scope="session")
def inference_gateway(cluster):
    """The Gateway API Inference Extension add-on (e2e/addons/epp.py): its CRDs and the pickers'
    ClusterRole on the shared cluster, and `.front(namespace, picker_pod_ip)` starting a gateway in
    front of an endpoint picker the operator deployed. Built and started on first use only; stopped at the end of the session."""
    from e2e.addons import epp

    d = _state_root("epp")
    gw = epp.InferenceGateway(cluster, d)
    try:
        yield gw
    finally:
        gw.stop()
        _cleanup(d)
