"""A real Kubernetes control plane as local processes: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kwok (fake kubelets for GPU nodes), the pod runner (runs selected pods' workloads as
local processes) and MinIO. All on loopback, with generated PKI, RBAC and the default admission
plugins (PodSecurity included).

    with Cluster() as c:                 # context manager: everything stops on exit
        c.add_gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
        c.kubectl("get", "nodes")

    python -m e2e.cluster up|down|env|status   # CLI: `up` leaves it running, `down` stops it
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from e2e import gpu, pki, procs, versions, workloads

E2E_DIR = Path(__file__).resolve().parent
SERVICE_CIDR = "10.96.0.0/16"
# Pod IPs are loopback addresses so a local process can bind them (Linux routes all of 127/8 to lo).
# kwok allocates from KWOK_POD_CIDR for pods it simulates; the pod runner from RUNNER_POD_CIDR.
# Both can be moved (env) to a range made local with `ip route add local <cidr> dev lo` (root), which
# EndpointSlices accept; loopback pod IPs are refused there (see README, "Known limits").
KWOK_POD_CIDR = os.environ.get("FEWERBITS_E2E_KWOK_CIDR", "127.100.0.0/16")
RUNNER_POD_CIDR = os.environ.get("FEWERBITS_E2E_POD_CIDR", "127.101.0.0/16")
S3_ACCESS_KEY = "fewerbits"
S3_SECRET_KEY = "fewerbits-e2e-secret"


class ClusterError(RuntimeError):
    pass


def default_state_dir() -> Path:
    return Path(os.environ.get("FEWERBITS_E2E_STATE") or versions.cache_dir() / "cluster")


@dataclass
class Component:
    name: str
    pid: int
    log: str


@dataclass
class S3Server:
    """A MinIO server on loopback. Usable alone (see `start_s3`) or as part of a Cluster."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    data_dir: str = ""

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}),
        )

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_REGION": self.region}


def _wait(what: str, check, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None,
          interval: float = 0.1):
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ClusterError(f"{what} exited with code {proc.returncode} while starting; last lines of {log}:\n"
                               f"{procs.tail(log) if log else ''}")
        try:
            result = check()
            if result:
                return result
        except Exception as e:  # noqa: BLE001 — retried until the deadline, then reported
            last = e
        time.sleep(interval)
    raise ClusterError(f"{what} not ready after {timeout:.0f}s (last error: {last}); last lines of {log}:\n"
                       f"{procs.tail(log) if log else ''}")


def _http_ok(url: str, ctx: ssl.SSLContext | None = None, expect: str | None = None) -> bool:
    with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
        body = r.read().decode(errors="replace")
        return r.status == 200 and (expect is None or expect in body)


def start_s3(state_dir: Path, *, detach: bool = False, port: int | None = None) -> tuple[S3Server, subprocess.Popen]:
    """Start MinIO alone (builds it first if needed). Returns the server and its process."""
    server, proc = spawn_s3(state_dir, detach=detach, port=port)
    wait_s3(server, proc, state_dir)
    return server, proc


def wait_s3(server: S3Server, proc: subprocess.Popen, state_dir: Path) -> None:
    try:
        _wait("MinIO", lambda: _http_ok(f"{server.endpoint}/minio/health/ready"), 60, proc,
              state_dir / "logs" / "minio.log")
    except Exception:
        procs.stop_group(proc.pid, 2, proc)
        raise


def spawn_s3(state_dir: Path, *, detach: bool = False, port: int | None = None) -> tuple[S3Server, subprocess.Popen]:
    versions.ensure_built("minio")
    port = port or procs.free_port()
    if procs.port_in_use(port):
        raise ClusterError(f"MinIO: port 127.0.0.1:{port} is already in use")
    console = procs.free_port()
    data = state_dir / "minio-data"
    data.mkdir(parents=True, exist_ok=True)
    log = state_dir / "logs" / "minio.log"
    env = {**_base_env(), "MINIO_ROOT_USER": S3_ACCESS_KEY, "MINIO_ROOT_PASSWORD": S3_SECRET_KEY,
           "MINIO_BROWSER": "off", "MINIO_UPDATE": "off", "MINIO_CI_CD": "1", "HOME": str(state_dir)}
    proc = procs.spawn([str(versions.binary("minio")), "server", str(data), "--quiet",
                        "--address", f"127.0.0.1:{port}", "--console-address", f"127.0.0.1:{console}"],
                       log, env=env, detach=detach)
    return S3Server(f"http://127.0.0.1:{port}", S3_ACCESS_KEY, S3_SECRET_KEY, data_dir=str(data)), proc


def _base_env() -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TMPDIR", "TZ")
    return {k: v for k, v in os.environ.items() if k in keep}


class Cluster:
    """The local control plane. Use as a context manager, or `start()`/`stop()`.

    Attributes once started: `kubeconfig` (Path), `server` (https URL), `s3` (S3Server or None),
    `state_dir` (Path: logs/, pki/, pods/).
    """

    def __init__(self, state_dir: Path | None = None, *, with_s3: bool = True, with_sim: bool = True, detach: bool = False,
                 images: list[workloads.ImageRule] | None = None, sim_metrics: str | None = None,
                 audit: bool | None = None, kwok_cidr: str | None = None, pod_cidr: str | None = None):
        self.state_dir = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="fewerbits-e2e-"))
        self.with_s3 = with_s3
        # with_sim: the pod runner plays vLLM images with llm-d-inference-sim; without it (the demo,
        # which serves with vLLM's CPU build) such a pod waits with a message naming the missing simulator.
        self.with_sim = with_sim
        self.detach = detach
        self.images = images if images is not None else workloads.default_rules()
        # fake (default): simulators start at zero load and take POST /admin/config; real: their own counts.
        self.sim_metrics = sim_metrics or os.environ.get("FEWERBITS_E2E_SIM_METRICS", "fake")
        # audit: the API server writes one JSON line per request to logs/audit.log (who, verb,
        # resource, code), for tests and the load command that count one client's requests.
        self.audit = audit if audit is not None else os.environ.get("FEWERBITS_E2E_AUDIT") == "1"
        # Pod IP ranges: two clusters on one machine (pytest-xdist workers) need disjoint ones, since the
        # pod runner binds its pods' IPs on loopback.
        self.kwok_cidr = kwok_cidr or KWOK_POD_CIDR
        self.pod_cidr = pod_cidr or RUNNER_POD_CIDR
        self.components: list[Component] = []
        self._procs: dict[str, subprocess.Popen] = {}
        self._argv: dict[str, tuple[list[str], dict | None, Path | None]] = {}
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.server = ""
        self.s3: S3Server | None = None
        self.timings: dict[str, float] = {}

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Cluster":
        t0 = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - t0
        return self

    def _step(self, name: str, t0: float) -> float:
        now = time.monotonic()
        self.timings[name] = now - t0
        return now

    def _start(self) -> None:
        t = time.monotonic()
        versions.ensure_built("kubernetes", "etcd", "kwok", *(["sim"] if self.with_sim else []),
                              *(["minio"] if self.with_s3 else []))
        t = self._step("build-check", t)
        d = self.state_dir
        (d / "logs").mkdir(parents=True, exist_ok=True)
        pki_dir = pki.generate(d / "pki")
        t = self._step("pki", t)
        # MinIO needs nothing from the control plane: start it now, check it at the end.
        if self.with_s3:
            self.s3, proc = spawn_s3(d, detach=self.detach)
            self._procs["minio"] = proc
            self.components.append(Component("minio", proc.pid, str(d / "logs" / "minio.log")))

        # etcd ---------------------------------------------------------------------------------
        etcd_port, peer_port = procs.free_port(), procs.free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn("etcd", [
            str(versions.binary("etcd")), "--name", "e2e", "--data-dir", str(d / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"e2e=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync", "--log-level", "warn", "--quota-backend-bytes", str(2 * 1024**3),
        ])
        _wait("etcd", lambda: _http_ok(f"{etcd_url}/health", expect='"health":"true"'), 30,
              self._procs["etcd"], d / "logs" / "etcd.log")
        t = self._step("etcd", t)

        # kube-apiserver ------------------------------------------------------------------------
        api_port = procs.free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        p = pki_dir
        self._spawn("kube-apiserver", [
            str(versions.binary("kube-apiserver")),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={p / 'sa.pub'}",
            f"--service-account-signing-key-file={p / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC",
            # Default admission plugins stay on (PodSecurity, ServiceAccount, ResourceQuota, ...);
            # privileged containers are allowed by the server so that PodSecurity is what refuses them.
            "--allow-privileged=true",
            f"--cert-dir={d / 'apiserver-certs'}",
            "--profiling=false", "--v=1",
            *self._audit_args(),
        ])
        self._wait_apiserver()
        t = self._step("kube-apiserver", t)

        self._write_kubeconfig(self.kubeconfig, "admin")
        for who in ("controller-manager", "scheduler"):
            self._write_kubeconfig(d / f"{who}.kubeconfig", who)

        # controllers and scheduler ----------------------------------------------------------------
        self._spawn("kube-controller-manager", [
            str(versions.binary("kube-controller-manager")),
            f"--kubeconfig={d / 'controller-manager.kubeconfig'}",
            # No serving port: nothing scrapes it here, and its delegated authentication would wait
            # for kube-system/extension-apiserver-authentication before controllers start.
            "--leader-elect=false", "--secure-port=0",
            f"--root-ca-file={p / 'ca.crt'}", f"--service-account-private-key-file={p / 'sa.key'}",
            f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
            "--use-service-account-credentials=true", f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--controllers=*", f"--cert-dir={d / 'kcm-certs'}", "--v=1",
        ])
        self._spawn("kube-scheduler", [
            str(versions.binary("kube-scheduler")),
            f"--kubeconfig={d / 'scheduler.kubeconfig'}",
            "--leader-elect=false", "--secure-port=0",
            f"--cert-dir={d / 'scheduler-certs'}", "--v=1",
        ])

        # kwok: fake kubelets. Its pod stages skip pods whose images the pod runner owns. ------------
        stage_files = self._write_kwok_stages(d / "kwok")
        kwok_args = [str(versions.binary("kwok")), f"--kubeconfig={self.kubeconfig}",
                     "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                     f"--cidr={self.kwok_cidr}", "--node-ip=127.0.0.1",
                     "--node-lease-duration-seconds=40"]
        for f in stage_files:
            kwok_args.append(f"--config={f}")
        self._spawn("kwok", kwok_args, env={**_base_env(), "HOME": str(d / "kwok")})

        # pod runner -----------------------------------------------------------------------------
        (d / "runner-images.json").write_text(json.dumps([r.to_json() for r in self.images], indent=1))
        self._spawn("pod-runner", [
            sys.executable, "-m", "e2e.podrunner", "--kubeconfig", str(self.kubeconfig),
            "--state-dir", str(d / "pods"), "--images", str(d / "runner-images.json"),
            "--cidr", self.pod_cidr,
            *(["--sim", str(versions.binary("llm-d-inference-sim"))] if self.with_sim else []),
            "--sim-metrics", self.sim_metrics,
        ], env={**os.environ, "PYTHONPATH": _pythonpath()}, cwd=E2E_DIR.parent)

        # MinIO --------------------------------------------------------------------------------------
        self._save_state()

        # Ready means: controllers made the default ServiceAccount (pods can be admitted), kwok and
        # the runner are up, and the scheduler answers.
        api = self.core()
        _wait("default ServiceAccount (kube-controller-manager)",
              lambda: api.read_namespaced_service_account("default", "default"), 60,
              self._procs["kube-controller-manager"], d / "logs" / "kube-controller-manager.log")
        _wait("pod runner", lambda: (d / "pods" / "ready").exists(), 60, self._procs["pod-runner"],
              d / "logs" / "pod-runner.log")
        for name in ("kube-scheduler", "kwok"):
            if self._procs[name].poll() is not None:
                raise ClusterError(f"{name} exited: {procs.tail(d / 'logs' / f'{name}.log')}")
        t = self._step("controllers", t)
        if self.s3:
            wait_s3(self.s3, self._procs["minio"], d)
            self._step("minio", t)

    def stop(self) -> None:
        """Stop every component (reverse order), then remove nothing but processes."""
        for c in reversed(self.components):
            procs.stop_group(c.pid, 10, self._procs.get(c.name))
        self.components.clear()
        self._procs.clear()
        state = self.state_dir / "state.json"
        with contextlib.suppress(FileNotFoundError):
            state.unlink()

    def _spawn(self, name: str, argv: list[str], env: dict | None = None, cwd: Path | None = None) -> None:
        log = self.state_dir / "logs" / f"{name}.log"
        proc = procs.spawn(argv, log, env=env if env is not None else _base_env(), cwd=cwd, detach=self.detach)
        self._procs[name] = proc
        self._argv[name] = (argv, env, cwd)
        self._record(Component(name, proc.pid, str(log)))

    def _record(self, comp: Component) -> None:
        """Add a component, or replace a restarted one in place (stop order stays the start order)."""
        for i, c in enumerate(self.components):
            if c.name == comp.name:
                self.components[i] = comp
                return
        self.components.append(comp)

    def _audit_args(self) -> list[str]:
        if not self.audit:
            return []
        policy = self.state_dir / "audit-policy.yaml"
        # Metadata level, one line per request when its response completes: who, verb, resource, code.
        policy.write_text("apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\n"
                          "rules:\n- level: Metadata\n")
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json", "--audit-log-mode=blocking", "--audit-log-maxsize=0"]

    @property
    def audit_log(self) -> Path:
        return self.state_dir / "logs" / "audit.log"

    def _wait_apiserver(self, timeout: float = 120) -> None:
        p = self.state_dir / "pki"
        ca_ctx = ssl.create_default_context(cafile=str(p / "ca.crt"))
        ca_ctx.load_cert_chain(str(p / "admin.crt"), str(p / "admin.key"))
        _wait("kube-apiserver", lambda: _http_ok(f"{self.server}/readyz", ca_ctx), timeout,
              self._procs["kube-apiserver"], self.state_dir / "logs" / "kube-apiserver.log")

    # ---------------------------------------------------------------- faults

    def set_container_env(self, image_match: str, env: dict[str, str] | None) -> None:
        """Give containers whose image contains `image_match` extra environment from their next
        start on (None: clear). For debug hooks of the workloads (e.g. the quantjob's upload pause);
        the pod runner applies it, the API objects are unchanged."""
        from e2e.podrunner import ENV_OVERRIDES

        f = self.state_dir / "pods" / ENV_OVERRIDES
        try:
            table = json.loads(f.read_text())
        except (FileNotFoundError, ValueError):
            table = {}
        if env:
            table[image_match] = env
        else:
            table.pop(image_match, None)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(table))
        tmp.replace(f)

    def stop_component(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Stop one component (`kube-apiserver`, `minio`, `kwok`, ...) and leave it stopped.
        SIGKILL stops it as a crash would."""
        proc = self._procs.get(name)
        if proc is None:
            raise ClusterError(f"no component {name!r} (have: {', '.join(self._procs)})")
        if sig == signal.SIGKILL:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        else:
            procs.stop_group(proc.pid, 10, proc)

    def start_component(self, name: str) -> None:
        """Start a stopped component again with its own arguments, state and port; waits for it."""
        if name == "minio":
            assert self.s3 is not None
            port = int(self.s3.endpoint.rsplit(":", 1)[1])
            _wait("MinIO port free", lambda: not procs.port_in_use(port), 30)
            self.s3, proc = spawn_s3(self.state_dir, detach=self.detach, port=port)
            self._procs["minio"] = proc
            self._record(Component("minio", proc.pid, str(self.state_dir / "logs" / "minio.log")))
            wait_s3(self.s3, proc, self.state_dir)
        else:
            argv, env, cwd = self._argv[name]
            if name == "kube-apiserver":
                port = int(self.server.rsplit(":", 1)[1])
                _wait("kube-apiserver port free", lambda: not procs.port_in_use(port), 30)
            self._spawn(name, argv, env, cwd)
            if name == "kube-apiserver":
                self._wait_apiserver()
        self._save_state()

    def restart_component(self, name: str, sig: int = signal.SIGTERM) -> None:
        self.stop_component(name, sig)
        self.start_component(name)

    def _save_state(self) -> None:
        state = {
            "kubeconfig": str(self.kubeconfig), "server": self.server,
            "components": [c.__dict__ for c in self.components],
            "s3": self.s3.__dict__ if self.s3 else None,
        }
        (self.state_dir / "state.json").write_text(json.dumps(state, indent=1))

    def _write_kubeconfig(self, path: Path, who: str) -> None:
        p = self.state_dir / "pki"
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fewerbits-e2e",
            "clusters": [{"name": "fewerbits-e2e", "cluster": {
                "server": self.server, "certificate-authority": str(p / "ca.crt")}}],
            "users": [{"name": who, "user": {
                "client-certificate": str(p / f"{who}.crt"), "client-key": str(p / f"{who}.key")}}],
            "contexts": [{"name": "fewerbits-e2e", "context": {"cluster": "fewerbits-e2e", "user": who}}],
        }
        path.write_text(json.dumps(cfg, indent=1))

    def _write_kwok_stages(self, out: Path) -> list[Path]:
        import yaml

        out.mkdir(parents=True, exist_ok=True)
        exclude = workloads.kwok_exclusion(self.images)
        files = []
        for name in ("node-initialize", "node-heartbeat-with-lease", "pod-ready", "pod-complete", "pod-delete"):
            doc = yaml.safe_load((E2E_DIR / "kwok" / f"{name}.yaml").read_text())
            if name.startswith("pod-") and exclude:
                doc["spec"]["selector"]["matchExpressions"].append(exclude)
            f = out / f"{name}.yaml"
            f.write_text(yaml.safe_dump(doc, sort_keys=False))
            files.append(f)
        return files

    # ---------------------------------------------------------------- client helpers

    def api_client(self, kubeconfig: Path | str | None = None):
        """A new kubernetes.client.ApiClient for the admin (or the given kubeconfig)."""
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig or self.kubeconfig), client_configuration=cfg)
        return client.ApiClient(cfg)

    def api_client_for_token(self, token: str):
        """An ApiClient that authenticates with a bearer token (e.g. from TokenRequest)."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.server
        cfg.ssl_ca_cert = str(self.state_dir / "pki" / "ca.crt")
        cfg.api_key = {"authorization": f"Bearer {token}"}
        return client.ApiClient(cfg)

    def core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api_client())

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run the built kubectl against this cluster; raises with stderr on failure when check."""
        proc = subprocess.run([str(versions.binary("kubectl")), f"--kubeconfig={self.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run the built Helm (built on first use) against this cluster, with its own cache/config dirs."""
        versions.ensure_built("helm")
        home = self.state_dir / "helm"
        env = {**_base_env(), "KUBECONFIG": str(self.kubeconfig), "HELM_CACHE_HOME": str(home / "cache"),
               "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data"), "HOME": str(home)}
        proc = subprocess.run([str(versions.binary("helm")), *args], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"helm {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def apply(self, manifest: dict | list | str) -> None:
        """`kubectl apply -f -` with a dict, list of dicts or YAML text (server-side apply)."""
        import yaml

        text = manifest if isinstance(manifest, str) else yaml.safe_dump_all(
            manifest if isinstance(manifest, list) else [manifest])
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text)

    def wait_crds_established(self, names: list[str], timeout: float = 60) -> None:
        """Until every named CustomResourceDefinition is Established (``kubectl wait`` right after a
        create can fail: the CRD has no conditions yet)."""
        from kubernetes import client

        ext = client.ApiextensionsV1Api(self.api_client())

        def established() -> bool:
            return all(any(c.type == "Established" and c.status == "True"
                           for c in ext.read_custom_resource_definition(n).status.conditions or []) for n in names)

        _wait(f"CRDs {names} established", established, timeout, None, self.state_dir / "logs" / "kube-apiserver.log")

    def add_gpu_pool(self, name: str, product: str | None = None, nodes: int = 1, gpus_per_node: int | None = None,
                     wait: bool = True) -> list[str]:
        """Create `nodes` kwok Nodes named `<name>-<i>` for a GPU from the catalog (e2e/gpu.py).

        `product` is a catalog key (`h100`) or GFD product (`NVIDIA-H100-80GB-HBM3`); default `name`.
        Returns the node names; with wait, returns once kwok has marked them Ready.
        """
        model = gpu.lookup(product or name)
        names = [f"{name}-{i}" for i in range(nodes)]
        api = self.core()
        from kubernetes.client.exceptions import ApiException

        for n in names:
            try:
                api.create_node(gpu.node_manifest(n, model, gpus_per_node))
            except ApiException as e:
                if e.status != 409:
                    raise
        if wait:
            self.wait_nodes_ready(names)
        return names

    def add_cpu_node(self, name: str = "cpu-0", wait: bool = True) -> str:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core().create_node(gpu.cpu_node_manifest(name))
        except ApiException as e:
            if e.status != 409:
                raise
        if wait:
            self.wait_nodes_ready([name])
        return name

    def remove_pool(self, name: str) -> None:
        api = self.core()
        for node in api.list_node().items:
            if re.fullmatch(rf"{re.escape(name)}-\d+", node.metadata.name):
                api.delete_node(node.metadata.name)

    def wait_nodes_ready(self, names: list[str], timeout: float = 60) -> None:
        api = self.core()

        def ready():
            for n in names:
                conds = api.read_node(n).status.conditions or []
                if not any(c.type == "Ready" and c.status == "True" for c in conds):
                    return False
            return True

        _wait(f"nodes {names} Ready (kwok)", ready, timeout, self._procs.get("kwok"),
              self.state_dir / "logs" / "kwok.log")

    def container_argv(self, namespace: str, pod: str, container: str = "vllm") -> list[str] | None:
        """A container's command and args as the pod runner started it, $(VAR) expanded as a kubelet
        expands them; None before it started."""
        for folder in (self.state_dir / "pods").glob(f"{namespace}_{pod}_*"):
            path = folder / f"{container}.argv.json"
            if path.exists():
                return json.loads(path.read_text())
        return None

    def pod_logs(self, namespace: str, pod: str, container: str | None = None) -> str:
        """Output of a container the pod runner ran (there is no kubelet to serve `kubectl logs`)."""
        base = self.state_dir / "pods"
        for d in sorted(base.glob(f"{namespace}_{pod}_*")):
            files = sorted(d.glob(f"{container or '*'}.log"))
            return "".join(f.read_text(errors="replace") for f in files)
        return ""

    def env(self) -> dict[str, str]:
        """Environment a shell or test process can use to reach the cluster and S3."""
        e = {"KUBECONFIG": str(self.kubeconfig)}
        if self.s3:
            e.update(self.s3.env())
        return e


def _pythonpath() -> str:
    parts = [str(E2E_DIR.parent)]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


# ------------------------------------------------------------------------------------- CLI


def _load_state(d: Path) -> dict | None:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        return json.loads((d / "state.json").read_text())
    return None


def _cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "env", "status"])
    ap.add_argument("--state-dir", type=Path, default=default_state_dir(),
                    help="where PKI, logs, kubeconfig and state.json live (env FEWERBITS_E2E_STATE)")
    ap.add_argument("--gpu-pool", action="append", default=[], metavar="NAME[:PRODUCT[:NODES]]",
                    help="with up: add a GPU pool, e.g. h100 or l4:NVIDIA-L4:2 (repeatable)")
    ap.add_argument("--no-s3", action="store_true", help="with up: do not start MinIO")
    a = ap.parse_args(argv)
    d: Path = a.state_dir
    state = _load_state(d)

    if a.command == "up":
        if state and any(procs.pid_alive(c["pid"]) for c in state["components"]):
            print(f"already running (state {d}); `down` first", file=sys.stderr)
            return 1
        if d.exists():
            shutil.rmtree(d)
        c = Cluster(d, with_s3=not a.no_s3, detach=True)
        c.start()
        for spec in a.gpu_pool:
            name, product, nodes = (spec.split(":") + [None, None])[:3]
            c.add_gpu_pool(name, product, int(nodes or 1))
        print(f"cluster up in {c.timings['total']:.1f}s: " +
              ", ".join(f"{k} {v:.1f}s" for k, v in c.timings.items() if k != "total"))
        print(f"export KUBECONFIG={c.kubeconfig}")
        return 0
    if a.command == "down":
        if not state:
            print(f"no cluster state in {d}")
            return 0
        for comp in reversed(state["components"]):
            if procs.pid_alive(comp["pid"]):
                procs.stop_group(comp["pid"], 10)
        (d / "state.json").unlink()
        print("cluster stopped")
        return 0
    if not state:
        print(f"no cluster state in {d}", file=sys.stderr)
        return 1
    if a.command == "env":
        print(f"export KUBECONFIG={state['kubeconfig']}")
        if state.get("s3"):
            s3 = S3Server(**state["s3"])
            for k, v in s3.env().items():
                print(f"export {k}={v}")
        return 0
    # status
    bad = 0
    for comp in state["components"]:
        alive = procs.pid_alive(comp["pid"])
        bad += not alive
        print(f"{comp['name']:<24} pid {comp['pid']:<8} {'running' if alive else 'STOPPED'}   log {comp['log']}")
    print(f"server {state['server']}  kubeconfig {state['kubeconfig']}")
    return 1 if bad else 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(_cli())
