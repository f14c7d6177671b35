"""The node-local artifact cache and the streamed load, against a real S3 server (MinIO built from
its Go module, fixture `s3`): the fetcher run as the init container runs it (a process, its exit
code, its termination message), and one serving pod pair on the real control plane that shares
one verified copy on a node.

Simulator: the serving container of the pod pair is the operator's default vLLM image, played by
llm-d-inference-sim: the verdict is the fetch init container (real) and the one verified copy it
shares on the node, not what vLLM answers (vLLM loads a local folder either way, as it does in
the real-vLLM tests, test_canary.py)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from e2e.addons.lws import fail_worker
from fewerbits_runtime.errors import EXIT_DISK_FULL, EXIT_STORAGE, DiskFull
from fewerbits_runtime.fetch import DEST_MANIFEST_NAME, MARKER_NAME, STAGING_DIR, FetchOptions
from fewerbits_runtime.nodecache import NodeCache
from fewerbits_runtime.testing import publish_bytes

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parents[2]
KiB, MiB = 1024, 1024 * 1024


def _files(seed: bytes, big: int = 2 * MiB + 4321) -> dict[str, bytes]:
    block = hashlib.sha512(seed).digest() * (64 * KiB // 64)
    def blob(n: int, salt: int) -> bytes:
        return ((block[salt % 64:] + block[: salt % 64]) * (n // len(block) + 1))[:n]
    return {
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
        "model-00001-of-00002.safetensors": blob(big, 1),
        "model-00002-of-00002.safetensors": blob(big // 2, 2),
        "tokenizer/tokenizer.json": b'{"model": {}}' * 40,
    }


def _env(s3, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FEWERBITS_"))}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO / "crds"), str(REPO / "runtime")]),
                "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
                "AWS_REGION": s3.region, "FEWERBITS_TERMINATION_LOG": str(tmp_path / "termination-log")})
    env.update(extra)
    return env


def _fetch(s3, bucket: str, key: str, root: Path, tmp_path: Path, *more: str) -> tuple[subprocess.CompletedProcess, dict]:
    stats = tmp_path / f"stats-{time.monotonic_ns()}.json"
    r = subprocess.run([sys.executable, "-m", "fewerbits_runtime", "fetch", "--storage-uri", f"s3://{bucket}/artifacts",
                        "--key", key, "--node-cache", str(root), "--endpoint", s3.endpoint,
                        "--part-size", "1Mi", "--stats-file", str(stats), *more],
                       env=_env(s3, tmp_path), capture_output=True, text=True, timeout=120)
    return r, (json.loads(stats.read_text()) if stats.exists() else {})


def _termination(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "termination-log").read_text())


def _assert_served(entry: Path, files: dict[str, bytes]) -> None:
    assert (entry / MARKER_NAME).exists() and not (entry / STAGING_DIR).exists()
    for path, data in files.items():
        assert hashlib.sha256((entry / path).read_bytes()).digest() == hashlib.sha256(data).digest(), path


def _publish(s3, bucket: str, files: dict[str, bytes], name: str):
    return publish_bytes(s3.client(), f"s3://{bucket}/artifacts", files, name=name)


def test_verified_once_per_node_then_hits_without_reading_files(s3, s3_bucket, tmp_path):
    files = _files(b"once")
    m = _publish(s3, s3_bucket, files, "nc-once")
    root = tmp_path / "node"
    r, st = _fetch(s3, s3_bucket, m.key, root, tmp_path)
    assert r.returncode == 0, r.stderr
    entry = root / "artifacts" / m.key
    _assert_served(entry, files)
    assert st["bytesDownloaded"] == m.totalBytes and not st["cacheHit"]
    # Sealed: read-only files, fingerprint recorded outside the entry the pods mount.
    assert all(stat.S_IMODE((entry / p).stat().st_mode) == 0o444 for p in files)
    state = json.loads((root / "state" / f"{m.key}.json").read_text())
    assert set(state["files"]) == set(files) | {DEST_MANIFEST_NAME}
    # The next pod on this node: no file GET, well under a second.
    r, st = _fetch(s3, s3_bucket, m.key, root, tmp_path)
    assert r.returncode == 0, r.stderr
    assert st["cacheHit"] and st["fileGets"] == 0 and st["bytesDownloaded"] == 0
    assert st["seconds"] < 1.0, st
    assert _termination(tmp_path)["reason"] == "CacheHit"


def test_a_changed_file_in_the_cache_is_refetched_never_served(s3, s3_bucket, tmp_path):
    files = _files(b"damage")
    m = _publish(s3, s3_bucket, files, "nc-damage")
    root = tmp_path / "node"
    assert _fetch(s3, s3_bucket, m.key, root, tmp_path)[0].returncode == 0
    entry = root / "artifacts" / m.key
    flipped, truncated = entry / "model-00001-of-00002.safetensors", entry / "model-00002-of-00002.safetensors"
    for f in (flipped, truncated):
        f.chmod(0o644)
    st0 = flipped.stat()  # same size, mtime put back: only the ctime (and the digest) can tell
    with open(flipped, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(flipped, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    os.truncate(truncated, 12345)
    r, st = _fetch(s3, s3_bucket, m.key, root, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "changed since it was verified" in r.stderr and flipped.name in r.stderr and truncated.name in r.stderr
    assert not st["cacheHit"] and st["bytesDownloaded"] == len(files[flipped.name]) + len(files[truncated.name])
    _assert_served(entry, files)
    assert _termination(tmp_path)["reason"] == "Fetched"


def test_a_file_that_fails_verification_is_never_marked_served(s3, s3_bucket, tmp_path):
    files = _files(b"bad-object")
    m = _publish(s3, s3_bucket, files, "nc-bad-object")
    bucket, prefix = s3_bucket, f"artifacts/{m.key}/"
    bad = bytearray(files["model-00002-of-00002.safetensors"])
    bad[7] ^= 0xFF
    s3.client().put_object(Bucket=bucket, Key=f"{prefix}files/model-00002-of-00002.safetensors", Body=bytes(bad))
    root = tmp_path / "node"
    r, _ = _fetch(s3, s3_bucket, m.key, root, tmp_path)
    assert r.returncode == 12 and _termination(tmp_path)["reason"] == "DigestMismatch"
    entry = root / "artifacts" / m.key
    assert not (entry / MARKER_NAME).exists() and not (entry / "model-00002-of-00002.safetensors").exists()


def _cache_fetch(s3, bucket, key, cache: NodeCache):
    # The key in the environment for this fetch only: left set, it outlived the test and broke a later
    # one in the same worker (boto3's env provider with a key and no secret: PartialCredentialsError).
    with mock.patch.dict(os.environ, {"AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", s3.access_key)}):
        return cache.fetch(FetchOptions(storage_uri=f"s3://{bucket}/artifacts", key=key, dest=Path("/nonexistent"),
                                        endpoint=s3.endpoint, part_size=1 * MiB), client=s3.client())


def test_eviction_by_budget_and_references_never_under_a_running_pod(s3, s3_bucket, tmp_path):
    arts = {n: _publish(s3, s3_bucket, _files(n.encode(), big=MiB), f"nc-evict-{n}") for n in "abcd"}
    size = arts["a"].totalBytes
    root = tmp_path / "node"
    # Budget for three artifacts. a is referenced by a QuantizedModel, b is in use by a running pod.
    refs = [arts["a"].key]
    for n in "abc":
        _cache_fetch(s3, s3_bucket, arts[n].key, NodeCache(root, budget_bytes=int(3.5 * size), referenced=refs))
        time.sleep(0.02)  # distinct last-use times: a oldest
    from fewerbits_runtime.launch import hold_in_use

    fd = hold_in_use(str(root / "artifacts" / arts["b"].key))
    assert fd is not None
    try:
        _cache_fetch(s3, s3_bucket, arts["d"].key, NodeCache(root, budget_bytes=int(3.5 * size), referenced=refs))
        have = {p.name for p in (root / "artifacts").iterdir()}
        # c: unreferenced and not in use, so it goes first, though a is older.
        assert have == {arts["a"].key, arts["b"].key, arts["d"].key}
        assert not (root / "state" / f"{arts['c'].key}.json").exists()
    finally:
        os.close(fd)


def test_a_full_disk_evicts_then_fails_with_the_reason(s3, s3_bucket, tmp_path, monkeypatch):
    import fewerbits_runtime.fetch as fetch_mod
    import fewerbits_runtime.nodecache as nc_mod

    arts = {n: _publish(s3, s3_bucket, _files(n.encode(), big=MiB), f"nc-full-{n}") for n in "xy"}
    root = tmp_path / "node"
    _cache_fetch(s3, s3_bucket, arts["x"].key, NodeCache(root))
    size = arts["x"].totalBytes

    # A disk with room for one artifact: what the cache holds counts against it.
    def free(_path):
        used = sum(e.bytes for e in NodeCache(root).entries())
        return max(0, int(1.5 * size) - used)
    monkeypatch.setattr(nc_mod, "free_bytes", free)
    monkeypatch.setattr(fetch_mod, "free_bytes", free)
    _cache_fetch(s3, s3_bucket, arts["y"].key, NodeCache(root, referenced=[arts["x"].key]))
    assert {p.name for p in (root / "artifacts").iterdir()} == {arts["y"].key}  # x evicted: the disk needed it

    # In use and a disk too small: the fetch fails with both figures; nothing is marked served.
    fd = os.open(root / "artifacts" / arts["y"].key / MARKER_NAME, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        with pytest.raises(DiskFull) as e:
            _cache_fetch(s3, s3_bucket, arts["x"].key, NodeCache(root))
        assert "not enough space" in e.value.message and e.value.details["neededBytes"] > 0
        assert not (root / "artifacts" / arts["x"].key / MARKER_NAME).exists()
    finally:
        os.close(fd)


def test_budget_smaller_than_the_artifact_fails_the_pod_with_the_reason(s3, s3_bucket, tmp_path):
    m = _publish(s3, s3_bucket, _files(b"huge"), "nc-huge")
    r, _ = _fetch(s3, s3_bucket, m.key, tmp_path / "node", tmp_path, "--node-cache-budget", "1Mi")
    assert r.returncode == EXIT_DISK_FULL, r.stderr
    term = _termination(tmp_path)
    assert term["reason"] == "DiskFull" and "larger than the node cache's budget" in term["message"]
    assert not (tmp_path / "node" / "artifacts" / m.key / MARKER_NAME).exists()


def test_streamed_load_checks_the_manifest_and_fails_on_unreachable_storage(s3, s3_bucket, tmp_path):
    m = _publish(s3, s3_bucket, _files(b"stream"), "nc-stream")
    dest = tmp_path / "models" / m.key
    r = subprocess.run([sys.executable, "-m", "fewerbits_runtime", "fetch", "--storage-uri", f"s3://{s3_bucket}/artifacts",
                        "--key", m.key, "--dest", str(dest), "--endpoint", s3.endpoint, "--manifest-only"],
                       env=_env(s3, tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _termination(tmp_path)["reason"] == "ManifestChecked"
    assert (dest / DEST_MANIFEST_NAME).exists() and not (dest / "config.json").exists()  # nothing downloaded

    # vLLM would stream from an endpoint nothing listens on: the launcher fails the pod first.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    model = f"s3://{s3_bucket}/artifacts/{m.key}/files/"
    # -S: the launcher needs the standard library only (as in the vLLM image), and no torch probe.
    r = subprocess.run([sys.executable, "-S", "-m", "fewerbits_runtime", "launch", "--manifest", str(dest / DEST_MANIFEST_NAME),
                        "--node-cc", "9.0", "--", "true", "serve", model, "--load-format", "runai_streamer"],
                       env=_env(s3, tmp_path, AWS_ENDPOINT_URL=f"http://127.0.0.1:{dead}"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_STORAGE, r.stderr
    term = _termination(tmp_path)
    assert term["component"] == "launch" and term["reason"] == "StorageError"
    assert f"127.0.0.1:{dead}" in term["message"] and model in term["message"]
    assert s3.secret_key not in r.stderr + json.dumps(term)


# ----------------------------------------------------------------------------------- on the cluster


def _node_cache_deployment(cluster, namespace: str, key: str, total: int, node_label: str, replicas: int,
                           budget: str | None = None) -> dict:
    from fewerbits_api.quantizedmodel import PlanVariant, QuantizedModelSpec
    from fewerbits_operator.serving.render import Owner, render_deployment
    from fewerbits_operator.base.settings import OperatorSettings

    spec = QuantizedModelSpec.model_validate({
        "source": {"uri": "hf://fewerbits-test/node-cache", "revision": "0" * 40},
        "storage": {"uri": "s3://nc-artifacts/artifacts", "endpoint": cluster.s3.endpoint,
                    "credentialsSecret": "s3-credentials"},
        "serving": {"artifactCache": "Node"},
    })
    variant = PlanVariant(pool="nc", gpuProduct="NVIDIA-H100-80GB-HBM3", format="fp8-dynamic", kvCacheDtype="fp8",
                          dtype="bfloat16", tensorParallelSize=1, maxModelLen=1024, weightsGiB=0.01,
                          kvCacheTokens=10000, decodeTokensPerSecond=100.0)
    d = render_deployment(Owner("nc", namespace, "00000000-0000-4000-8000-0000000000aa"), spec, variant,
                          {"kubernetes.io/hostname": node_label}, "9.0", key, total, replicas,
                          OperatorSettings(node_cache_budget=budget))
    d["metadata"].pop("ownerReferences")
    return d


def test_pods_on_one_node_share_one_verified_copy(cluster, namespace, s3_secret, gpu_pool):
    """Two replicas on one node: one fetches, the other finds the verified copy (CacheHit, no file
    GET); the restricted Pod Security level refuses the hostPath, as docs/cache.md says."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    s3c = cluster.s3.client()
    with __import__("contextlib").suppress(Exception):
        s3c.create_bucket(Bucket="nc-artifacts")
    files = _files(b"on-cluster")
    m = publish_bytes(s3c, "s3://nc-artifacts/artifacts", files, name=f"nc-cluster-{namespace}")
    (node,) = gpu_pool(f"nc{namespace[-6:]}", "h100", nodes=1)  # removed afterwards: later tests plan on the pools there are
    d = _node_cache_deployment(cluster, namespace, m.key, m.totalBytes, node, replicas=2)
    core = client.CoreV1Api(cluster.api_client())

    # Pod Security: a restricted namespace refuses the pod (hostPath), with the reason.
    restricted = f"{namespace}-r"
    core.create_namespace({"metadata": {"name": restricted, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
    try:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"}, "spec": d["spec"]["template"]["spec"]}
        with pytest.raises(ApiException) as e:
            core.create_namespaced_pod(restricted, pod, dry_run="All")
        assert e.value.status == 403 and "hostPath" in e.value.body
    finally:
        core.delete_namespace(restricted)

    cluster.apply(d)
    deadline = time.monotonic() + 120
    while True:
        pods = core.list_namespaced_pod(namespace, label_selector="fewerbits.io/model=nc").items
        ready = [p for p in pods if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
        if len(ready) == 2:
            break
        for p in pods:
            for ic in p.status.init_container_statuses or []:
                t = ic.state.terminated or (ic.last_state and ic.last_state.terminated)
                assert not t or t.exit_code == 0, t.message
        assert time.monotonic() < deadline, [p.status.init_container_statuses for p in pods]
        time.sleep(0.3)
    reasons = sorted(json.loads(p.status.init_container_statuses[0].state.terminated.message)["reason"] for p in ready)
    assert reasons == ["CacheHit", "Fetched"]
    assert {p.spec.node_name for p in ready} == {node}
    entry = cluster.state_dir / "pods" / "nodes" / node / "var/lib/fewerbits/cache/artifacts" / m.key
    _assert_served(entry, files)
    client.AppsV1Api(cluster.api_client()).delete_namespaced_deployment(d["metadata"]["name"], namespace)


def test_referenced_artifacts_are_evicted_last_through_the_operators_configmap(cluster, crds_installed, gpu_pool):
    """The whole feed on the real control plane: QuantizedModels' status keys -> the operator's
    sync (Operator.references_sync, one pass of its loop: observe, decide, execute) -> the ConfigMap -> mounted into
    the fetch init container -> its eviction: the referenced artifact stays though it is the least
    recently used; a second sync writes nothing; a model leaving the node cache removes it."""
    import uuid

    from kubernetes import client

    from e2e import demo
    from fewerbits_api.base import GROUP, VERSION
    from fewerbits_operator.base.kube import Kube
    from fewerbits_operator.core.nodecache import REFERENCES_CONFIGMAP
    from fewerbits_operator.runtime.reconcile import Reconciler
    from fewerbits_operator.runtime.runner import Operator
    from fewerbits_operator.base.settings import OperatorSettings
    from fewerbits_operator.base.storage import ObjectStore
    from tests.unit.test_nodecache_eviction import _entry

    api = cluster.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns = f"ncref-{uuid.uuid4().hex[:6]}"  # no operator of the session watches it: this test is the operator
    demo.create_namespace_with_secret(cluster, ns, "s3-credentials")
    try:
        s3c = cluster.s3.client()
        with __import__("contextlib").suppress(Exception):
            s3c.create_bucket(Bucket="nc-artifacts")
        files = _files(b"refs", big=MiB)
        m = publish_bytes(s3c, "s3://nc-artifacts/artifacts", files, name=f"nc-refs-{ns}")
        referenced, unreferenced = "1" * 64, "2" * 64

        def model(name: str, cache: str) -> None:
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, "quantizedmodels", {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "QuantizedModel", "metadata": {"name": name},
                "spec": {"source": {"uri": "hf://fewerbits-test/node-cache", "revision": "0" * 40},
                         "storage": {"uri": "s3://nc-artifacts/artifacts", "endpoint": cluster.s3.endpoint,
                                     "credentialsSecret": "s3-credentials"},
                         "serving": {"artifactCache": cache}}})
        model("cached", "Node")
        model("podlocal", "Pod")
        for name, key in (("cached", referenced), ("podlocal", unreferenced)):
            custom.patch_namespaced_custom_object_status(GROUP, VERSION, ns, "quantizedmodels", name, {"status": {
                "serving": [{"variant": "nc", "deployment": f"{name}-nc", "artifactKey": key}]}})

        kube = Kube(api)
        runner = Operator()  # its references loop's one pass, with no loop or workers started
        runner.settings = OperatorSettings(namespaces=[ns])
        runner.reconciler = Reconciler(kube, ObjectStore(), runner.settings)
        sync = runner.references_sync
        assert sync() == 1
        cm = core.read_namespaced_config_map(REFERENCES_CONFIGMAP, ns)
        assert referenced in cm.data["keys"] and unreferenced not in cm.data["keys"]  # Pod-cached: not on nodes
        assert [o.name for o in cm.metadata.owner_references] == ["cached"]
        assert sync() == 0  # no writes at rest

        # A node whose cache holds both keys (the referenced one least recently used) and room for
        # one more artifact only: the fetch must evict one, and it is the unreferenced one.
        (node,) = gpu_pool(f"ncr{ns[-6:]}", "h100", nodes=1)
        root = cluster.state_dir / "pods" / "nodes" / node / "var/lib/fewerbits/cache"
        now = time.time()
        _entry(root, referenced, now - 60, size=256 * KiB)
        _entry(root, unreferenced, now - 30, size=256 * KiB)
        one = NodeCache(root).entries()[0].bytes
        d = _node_cache_deployment(cluster, ns, m.key, m.totalBytes, node, replicas=1,
                                   budget=f"{(m.totalBytes + one * 3 // 2) // KiB}Ki")
        cluster.apply(d)
        deadline = time.monotonic() + 60
        while True:
            pods = core.list_namespaced_pod(ns, label_selector="fewerbits.io/model=nc").items
            statuses = [s for p in pods for s in p.status.init_container_statuses or []]
            done = [s.state.terminated for s in statuses if s.state.terminated]
            if done:
                break
            assert time.monotonic() < deadline, statuses
            time.sleep(0.3)
        assert done[0].exit_code == 0, done[0].message
        assert {p.name for p in (root / "artifacts").iterdir()} == {referenced, m.key}

        # The model leaves the node cache: its namespace loses the ConfigMap at the next sync.
        custom.patch_namespaced_custom_object(GROUP, VERSION, ns, "quantizedmodels", "cached",
                                              {"spec": {"serving": {"artifactCache": "Pod"}}})
        assert sync() == 1
        assert kube.get_configmap(ns, REFERENCES_CONFIGMAP) is None
    finally:
        core.delete_namespace(ns)


def test_which_node_cache_volumes_the_restricted_level_admits(cluster):
    """docs/cache.md's Pod Security table, asked of the API server (dry run, a `restricted`
    namespace): the hostPath the node cache uses today is refused; the volume types a
    restricted-compatible cache would use (a CSI inline volume from a node driver, a claim, an OCI
    image volume) pass the Pod Security check."""
    import uuid

    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(cluster.api_client())
    ns = f"ncpss-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
    container = {"name": "c", "image": "busybox", "securityContext": {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
        "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}]}
    volumes = {
        "hostPath": {"hostPath": {"path": "/var/lib/fewerbits/cache", "type": "DirectoryOrCreate"}},
        "csi": {"csi": {"driver": "cache.fewerbits.io", "readOnly": True,
                        "volumeAttributes": {"key": "k" * 64, "storageUri": "s3://b/p"},
                        "nodePublishSecretRef": {"name": "s3-credentials"}}},
        "persistentVolumeClaim": {"persistentVolumeClaim": {"claimName": "cache", "readOnly": True}},
        "image": {"image": {"reference": "registry.example/artifacts/llama-fp8@sha256:" + "0" * 64,
                            "pullPolicy": "IfNotPresent"}},
    }
    admitted = {}
    try:
        for kind, vol in volumes.items():
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"probe-{kind.lower()}"},
                   "spec": {"containers": [container], "volumes": [{"name": "models", **vol}]}}
            try:
                core.create_namespaced_pod(ns, pod, dry_run="All")
                admitted[kind] = "admitted"
            except ApiException as e:
                admitted[kind] = f"{e.status}: {json.loads(e.body).get('message')}"
    finally:
        core.delete_namespace(ns)
    assert admitted.pop("hostPath").startswith('403: pods "probe-hostpath" is forbidden: violates PodSecurity')
    # Every one of them created for real (not a dry run) would wait for its driver, claim or image.
    assert admitted == {"csi": "admitted", "persistentVolumeClaim": "admitted", "image": "admitted"}, admitted


def test_a_leaderworkerset_group_uses_the_cache_of_each_pods_node(cluster, lws, gpu_pool, namespace, s3_secret):
    """A multi-node variant with artifactCache: Node under the real LeaderWorkerSet controller: the
    leader and the worker land on two nodes and each verifies its own node's copy; the group
    recreated after a pod loss finds both copies (CacheHit on both nodes, nothing downloaded)."""
    from kubernetes import client

    from fewerbits_api.quantizedmodel import PlanVariant, QuantizedModelSpec
    from fewerbits_operator.serving.lws import render_lws
    from fewerbits_operator.serving.render import Owner
    from fewerbits_operator.base.settings import OperatorSettings

    s3c = cluster.s3.client()
    with __import__("contextlib").suppress(Exception):
        s3c.create_bucket(Bucket="nc-artifacts")
    files = _files(b"lws-group", big=MiB)
    m = publish_bytes(s3c, "s3://nc-artifacts/artifacts", files, name=f"nc-lws-{namespace}")
    nodes = gpu_pool(f"ncl{namespace[-6:]}", "NVIDIA-H100-80GB-HBM3", nodes=2, gpus_per_node=8)
    spec = QuantizedModelSpec.model_validate({
        "source": {"uri": "hf://fewerbits-test/node-cache", "revision": "0" * 40},
        "storage": {"uri": "s3://nc-artifacts/artifacts", "endpoint": cluster.s3.endpoint,
                    "credentialsSecret": "s3-credentials"},
        "serving": {"artifactCache": "Node"}})
    variant = PlanVariant(pool="ncl", gpuProduct="NVIDIA-H100-80GB-HBM3", format="fp8-dynamic", kvCacheDtype="fp8",
                          dtype="bfloat16", tensorParallelSize=8, maxModelLen=1024, weightsGiB=0.01,
                          kvCacheTokens=10000, decodeTokensPerSecond=100.0, nodesPerReplica=2)
    obj = render_lws(Owner("ncl", namespace, "00000000-0000-4000-8000-0000000000bb"), spec, variant,
                     {"kubernetes.io/hostname": nodes[0]}, "9.0", m.key, m.totalBytes, 1, OperatorSettings())
    obj["metadata"].pop("ownerReferences")
    for role in ("leaderTemplate", "workerTemplate"):  # the pool's two nodes, one pod on each
        obj["spec"]["leaderWorkerTemplate"][role]["spec"]["nodeSelector"] = {}
        obj["spec"]["leaderWorkerTemplate"][role]["spec"]["affinity"] = {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}]}}}
    core = client.CoreV1Api(cluster.api_client())
    client.CustomObjectsApi(cluster.api_client()).create_namespaced_custom_object(
        "leaderworkerset.x-k8s.io", "v1", namespace, "leaderworkersets", obj)

    def fetched(exclude: set[str]) -> dict[str, str]:
        """node -> the fetch container's reason, once both pods of the group (not in ``exclude``) fetched."""
        deadline = time.monotonic() + 120
        while True:
            out = {}
            for p in core.list_namespaced_pod(namespace, label_selector="fewerbits.io/model=ncl").items:
                if p.metadata.uid in exclude or p.metadata.deletion_timestamp:
                    continue
                for s in p.status.init_container_statuses or []:
                    if s.state.terminated:
                        assert s.state.terminated.exit_code == 0, s.state.terminated.message
                        out[p.spec.node_name] = json.loads(s.state.terminated.message)["reason"]
            if len(out) == 2:
                return out
            assert time.monotonic() < deadline, out
            time.sleep(0.3)

    first = fetched(set())
    assert sorted(first) == sorted(nodes) and set(first.values()) == {"Fetched"}  # one copy per node
    for node in nodes:
        _assert_served(cluster.state_dir / "pods" / "nodes" / node / "var/lib/fewerbits/cache/artifacts" / m.key,
                       files)
    # A pod lost: LeaderWorkerSet recreates the whole group; both nodes already hold the copy.
    old = {p.metadata.uid for p in core.list_namespaced_pod(namespace, label_selector="fewerbits.io/model=ncl").items}
    worker = next(p for p in core.list_namespaced_pod(namespace, label_selector="fewerbits.io/model=ncl").items
                  if p.metadata.labels.get("app.kubernetes.io/component") == "server-worker")
    # Terminating until LWS reacts, as a kubelet keeps it (a bare grace-0 delete loses LWS v0.7.0's
    # race, kubernetes-sigs/lws#998: the group then never comes back; see fail_worker).
    fail_worker(core, namespace, worker.metadata.name)
    again = fetched(old)
    assert sorted(again) == sorted(nodes) and set(again.values()) == {"CacheHit"}, again
