"""LeaderWorkerSet on the local control plane: its CRD, its controller manager and its admission
webhooks, started on demand (``ensure(cluster)``; the ``lws`` session fixture calls it), so tests
that do not need it pay nothing.

All of it comes from ``sigs.k8s.io/lws`` at the version pinned in e2e/versions.env (built by
e2e/build.sh into ``lws-<version>/``: ``lws-manager`` and ``crd/``). The manager runs as a local
process with the admin kubeconfig; its webhook server listens on 127.0.0.1 with a certificate from
the cluster's CA (e2e/pki.py), and the webhook configurations reach it by URL ``clientConfig``
instead of the in-cluster Service the upstream manifests name. The webhook rules below are
upstream's ``config/webhook/manifests.yaml`` with its kustomize patches applied (the pod webhooks
see only pods labelled ``leaderworkerset.sigs.k8s.io/name``, so other tests' pods never wait on it).
Leader election and the internal cert rotation are off (one process, certificates made here).
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from e2e import pki, procs, versions

LWS_GROUP = "leaderworkerset.x-k8s.io"
LABEL_NAME = "leaderworkerset.sigs.k8s.io/name"
_LOCK = threading.Lock()


def _webhook(name: str, path: str, resources: str, group: str, ops: list[str], url: str, ca: str,
             pods: bool) -> dict:
    hook = {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "clientConfig": {"url": f"{url}{path}", "caBundle": ca},
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": ops, "resources": [resources]}],
    }
    if pods:
        hook["objectSelector"] = {"matchExpressions": [{"key": LABEL_NAME, "operator": "Exists"}]}
    return hook


def webhook_configurations(url: str, ca_pem: bytes) -> list[dict]:
    import base64

    ca = base64.b64encode(ca_pem).decode()
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
         "metadata": {"name": "lws-mutating-webhook-configuration"},
         "webhooks": [
             _webhook("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
                      "leaderworkersets", LWS_GROUP, ["CREATE", "UPDATE"], url, ca, False),
             _webhook("mpod.kb.io", "/mutate--v1-pod", "pods", "", ["CREATE", "UPDATE"], url, ca, True)]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
         "metadata": {"name": "lws-validating-webhook-configuration"},
         "webhooks": [
             _webhook("vleaderworkerset.kb.io", "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
                      "leaderworkersets", LWS_GROUP, ["CREATE", "UPDATE"], url, ca, False),
             _webhook("vpod.kb.io", "/validate--v1-pod", "pods", "", ["CREATE", "UPDATE"], url, ca, True)]},
    ]


class LWS:
    """The running add-on: ``timings`` says where its start-up went."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.timings: dict[str, float] = {}
        self.webhook_url = ""

    def start(self) -> "LWS":
        c = self.cluster
        t = time.monotonic()
        versions.ensure_built("lws")
        bin_dir = versions.bin_dir("lws")
        self.timings["build-check"] = time.monotonic() - t
        t = time.monotonic()
        # CRD first: the manager's informers need the kind.
        for crd in sorted((bin_dir / "crd").glob("*.yaml")):
            c.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        from kubernetes import client

        ext = client.ApiextensionsV1Api(c.api_client())
        # `kubectl wait` errors while the CRD has no conditions yet: poll the API instead.
        _wait("LeaderWorkerSet CRD established", lambda: any(
            x.type == "Established" and x.status == "True"
            for x in ext.read_custom_resource_definition(f"leaderworkersets.{LWS_GROUP}").status.conditions or []),
            60, None, None)
        self.timings["crd"] = time.monotonic() - t
        t = time.monotonic()

        d = c.state_dir / "lws"
        certs = d / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        crt, key = pki.serving_cert(c.state_dir / "pki", "lws-webhook", "IP:127.0.0.1,DNS:localhost")
        (certs / "tls.crt").write_bytes(crt.read_bytes())
        (certs / "tls.key").write_bytes(key.read_bytes())
        port, health = procs.free_port(), procs.free_port()
        cfg = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        }
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
        c._spawn("lws-manager", [str(bin_dir / "lws-manager"), f"--config={d / 'config.yaml'}",
                                 "--zap-log-level=info"],
                 env={"PATH": "/usr/bin:/bin", "HOME": str(d), "KUBECONFIG": str(c.kubeconfig)})
        proc, log = c._procs["lws-manager"], c.state_dir / "logs" / "lws-manager.log"
        ctx = ssl.create_default_context(cafile=str(c.state_dir / "pki" / "ca.crt"))
        self.webhook_url = f"https://127.0.0.1:{port}"

        def serving() -> bool:
            # The webhook server answers TLS (any HTTP status) and the manager reports ready.
            try:
                urllib.request.urlopen(f"{self.webhook_url}/", context=ctx, timeout=2)
            except urllib.error.HTTPError:
                pass
            with urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=2) as r:
                return r.status == 200

        _wait("lws-manager", serving, 60, proc, log)
        self.timings["manager"] = time.monotonic() - t
        t = time.monotonic()
        ca_pem = (c.state_dir / "pki" / "ca.crt").read_bytes()
        c.apply(webhook_configurations(self.webhook_url, ca_pem))
        # The webhooks are in the API server's admission chain once a dry-run create is defaulted
        # by the mutating webhook (it fills in the rollout strategy).
        probe = {"apiVersion": f"{LWS_GROUP}/v1", "kind": "LeaderWorkerSet",
                 "metadata": {"name": "lws-webhook-probe", "namespace": "default"},
                 "spec": {"leaderWorkerTemplate": {"size": 1, "workerTemplate": {
                     "spec": {"containers": [{"name": "c", "image": "registry.example/app:1"}]}}}}}

        def defaulted() -> bool:
            out = c.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(probe),
                            check=False)
            return out.returncode == 0 and "rolloutStrategy" in json.loads(out.stdout).get("spec", {})

        _wait("LeaderWorkerSet webhooks in the admission chain", defaulted, 60, proc, log)
        self.timings["webhooks"] = time.monotonic() - t
        return self


def _wait(what, check, timeout, proc, log):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}; last lines of {log}:\n{procs.tail(log)}")
        try:
            if check():
                return
        except Exception as e:  # noqa: BLE001 — retried until the deadline, then reported
            last = e
        time.sleep(0.2)
    tail = procs.tail(log) if log else ""
    raise RuntimeError(f"{what} not ready after {timeout}s (last error: {last}); last lines of {log}:\n{tail}")


_started: dict[int, LWS] = {}


def ensure(cluster) -> LWS:
    """LeaderWorkerSet on ``cluster``, started on first use (once per cluster)."""
    with _LOCK:
        key = id(cluster)
        if key not in _started:
            _started[key] = LWS(cluster).start()
        return _started[key]


def crd_path() -> Path:
    return versions.bin_dir("lws") / "crd"


HOLD_FINALIZER = "fewerbits.io/e2e-hold-terminating"


def fail_worker(core, namespace: str, worker: str, timeout: float = 60.0) -> None:
    """Delete a worker pod of a ``RecreateGroupOnPodRestart`` group and return once LWS has started
    recreating the group (its leader is terminating or replaced).

    LWS v0.7.0 recreates a group only when its pod reconciler *reads* the worker with a
    deletionTimestamp (or a restarted container). A kubelet keeps a deleted pod Terminating while
    its containers stop, so the reconciler sees it. Here nothing does: a grace-0 delete (or kwok's
    pod-delete stage) removes the pod one etcd write after marking it, the worker StatefulSet
    recreates a pod with the same name at once, and the reconciler, keyed by name only, then reads
    the replacement and skips the group for good (upstream kubernetes-sigs/lws#998, fixed after
    v0.7.0). Under CPU load that race is lost often enough to fail a test run in three. A finalizer
    stands in for the kubelet's terminating window; it is removed as soon as LWS has reacted (the
    leader's foreground deletion waits for this pod, so it must not be held longer).
    """
    from kubernetes import client

    leader_name = worker.rsplit("-", 1)[0]  # <lws>-<group>-<index> -> <lws>-<group>
    leader_uid = core.read_namespaced_pod(leader_name, namespace).metadata.uid
    core.patch_namespaced_pod(worker, namespace, [
        {"op": "add", "path": "/metadata/finalizers", "value": [HOLD_FINALIZER]}])
    try:
        core.delete_namespaced_pod(worker, namespace, grace_period_seconds=0)
        deadline = time.monotonic() + timeout
        while True:
            try:
                leader = core.read_namespaced_pod(leader_name, namespace)
                if leader.metadata.uid != leader_uid or leader.metadata.deletion_timestamp:
                    return
            except client.exceptions.ApiException as e:
                if e.status != 404:
                    raise
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"LWS did not delete leader {leader_name} within {timeout}s "
                                     f"of worker {worker} terminating")
            time.sleep(0.1)
    finally:
        _release(core, namespace, worker)


def _release(core, namespace: str, name: str) -> None:
    from kubernetes import client

    try:
        finalizers = core.read_namespaced_pod(name, namespace).metadata.finalizers or []
        if HOLD_FINALIZER in finalizers:
            i = finalizers.index(HOLD_FINALIZER)
            core.patch_namespaced_pod(name, namespace, [
                {"op": "test", "path": f"/metadata/finalizers/{i}", "value": HOLD_FINALIZER},
                {"op": "remove", "path": f"/metadata/finalizers/{i}"}])
    except client.exceptions.ApiException as e:
        if e.status != 404:
            raise
