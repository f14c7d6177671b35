"""pytest fixtures for the local control plane. Enable with `pytest_plugins = ["e2e.pytest_plugin"]`.

Fixtures:
  cluster   (session) — one real control plane + MinIO + pod runner for the whole session.
  s3        (session) — an S3 server: the cluster's MinIO if a cluster fixture is already up,
                        otherwise a MinIO started alone (tests that need only storage).
  s3_bucket (function) — a fresh, empty bucket name on `s3`.
  gpu_pool  (function) — factory: gpu_pool("h100", "NVIDIA-H100-80GB-HBM3", nodes=1) adds a pool and
                        removes its nodes after the test.
  namespace (function) — a fresh namespace, deleted after the test.

Missing binaries are BUILT (e2e/build.sh), never skipped. Mark tests `cluster` or `s3`.
Environment: FEWERBITS_CACHE (binary cache), FEWERBITS_E2E_KEEP=1 keeps the state dir for debugging.
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


def _state_root(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"fewerbits-e2e-{name}-"))


def _cleanup(d: Path) -> None:
    if os.environ.get("FEWERBITS_E2E_KEEP") != "1":
        shutil.rmtree(d, ignore_errors=True)


_session_cluster: cluster_mod.Cluster | None = None


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
    c = cluster_mod.Cluster(d)
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
def inference_gateway(cluster):
    """The Gateway API Inference Extension add-on (e2e/addons/epp.py): its CRDs on the shared cluster,
    and `.picker(namespace, pool, config)` starting an endpoint picker for an InferencePool with a
    gateway in front of it. Built and started on first use only; stopped at the end of the session."""
    from e2e.addons import epp

    d = _state_root("epp")
    gw = epp.InferenceGateway(cluster, d)
    try:
        yield gw
    finally:
        gw.stop()
        _cleanup(d)
