"""The pod runner: a kubelet for the pods whose images e2e/workloads.py maps to local commands.

It watches pods bound to (kwok) nodes; for each pod it owns it does what a kubelet would: resolve the
environment through the API (secretKeyRef, configMapKeyRef, fieldRef, envFrom), materialise volumes
as local folders (paths in env and args are rewritten to them), run init containers in order and
then the containers as local process groups, probe readiness, apply the restart policy, and report
everything through pod status — phase, conditions, container states, exit codes and the termination
message. On deletion it stops the processes (SIGTERM, grace, SIGKILL) and finishes the delete.

Pod IPs come from a loopback CIDR, so a process can bind its pod IP. The simulator listens on ":port"
(all addresses), so it gets a free port and the runner forwards <pod IP>:<container port> to it.

Container output goes to <state-dir>/<ns>_<pod>_<uid8>/<container>.log (there is no `kubectl logs`).
The termination-message file is given to the process as $FEWERBITS_TERMINATION_LOG.
Processes of `module`/`command` rules get $KUBECONFIG pointing at a kubeconfig that holds a token of
the pod's ServiceAccount (TokenRequest bound to the pod), so they run with that account's RBAC.

Two modes (`--mode`, default from $FEWERBITS_E2E_RUN_MODE, else `process`):
  process — the fast default: the project's images are this interpreter running their module;
  image   — containers of the project's images (fewerbits-operator, -quantjob, -runtime) run from
            the images scripts/images.sh built, with podman: the pod's env, volumes and security
            context as a kubelet gives them (e2e/images.py). vLLM stays the simulator.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import datetime as dt
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

from e2e import images, procs, workloads

log = logging.getLogger("podrunner")

TERMINATION_LOG_ENV = "FEWERBITS_TERMINATION_LOG"
ENV_OVERRIDES = "env-overrides.json"
"""In the runner's state dir: {image substring: {NAME: value}}, extra env for matching containers."""
PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH", "TZ")
PASS_ENV_PREFIXES = ("HF_", "TRANSFORMERS_", "TORCH", "OMP_", "MKL_")
MAX_TERMINATION_MESSAGE = 4096  # what a kubelet keeps


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ConfigError(Exception):
    """The container cannot be created yet (missing Secret/ConfigMap key): CreateContainerConfigError."""

    reason = "CreateContainerConfigError"


class ImageNotPresent(ConfigError):
    """Image mode: the image is not in the local storage and is never pulled."""

    reason = "ErrImageNeverPull"


# ---------------------------------------------------------------------------------------- TCP forward


class Forwarder:
    """Accept on (ip, port) and copy bytes both ways to 127.0.0.1:target."""

    def __init__(self, ip: str, port: int, target: int):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, port))
        self.sock.listen(64)
        self.target = target
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            up.settimeout(None)
        except OSError:
            conn.close()
            return

        def pump(a: socket.socket, b: socket.socket) -> None:
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    b.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=pump, args=(up, conn), daemon=True)
        t.start()
        pump(conn, up)
        t.join()
        conn.close()
        up.close()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


# ---------------------------------------------------------------------------------------- containers


class Container:
    def __init__(self, spec: dict, rule: workloads.ImageRule | None, init: bool):
        self.spec = spec
        self.name = spec["name"]
        self.image = spec.get("image", "")
        self.rule = rule
        self.init = init
        self.proc = None
        self.forwarders: list[Forwarder] = []
        self.restart_count = 0
        self.state: dict = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict = {}
        self.ready = False
        self.started = False
        self.backoff_until = 0.0
        self.sim_port: int | None = None
        self.vllm: workloads.VLLMArgs | None = None
        self.podman_name = ""
        """Image mode: the podman container now running for this container ("" otherwise)."""
        self.image_id = ""

    def status(self) -> dict:
        s = {"name": self.name, "image": self.image, "imageID": self.image_id, "ready": self.ready,
             "restartCount": self.restart_count, "started": self.started, "state": self.state}
        if self.last_state:
            s["lastState"] = self.last_state
        if self.podman_name:
            s["containerID"] = f"podman://{self.podman_name}"
        elif self.proc is not None:
            s["containerID"] = f"fewerbits-e2e://{self.proc.pid}"
        return s


class PodRun(threading.Thread):
    def __init__(self, runner: "Runner", pod: dict, ip: str):
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.runner = runner
        self.api = runner.api
        self.pod = pod
        md = pod["metadata"]
        self.ns, self.name, self.uid = md["namespace"], md["name"], md["uid"]
        self.ip = ip
        self.dir = runner.state_dir / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        spec = pod["spec"]
        self.restart_policy = spec.get("restartPolicy", "Always")
        rules = runner.rules
        self.inits = [Container(c, workloads.rule_for(c.get("image", ""), rules), True)
                      for c in spec.get("initContainers") or []]
        self.mains = [Container(c, workloads.rule_for(c.get("image", ""), rules), False)
                      for c in spec.get("containers") or []]
        self.deleting = threading.Event()
        self.gone = threading.Event()
        self.phase = "Pending"
        self.start_time = now()
        self.conds: dict[str, dict] = {}
        self._last_sent: dict | None = None
        self.mounts: list[tuple[str, Path]] = []

    # ---------------------------------------------------------------- status

    def _cond(self, type_: str, status: bool, reason: str = "", message: str = "") -> None:
        val = "True" if status else "False"
        old = self.conds.get(type_)
        if old and old["status"] == val and old.get("reason", "") == reason:
            return
        c = {"type": type_, "status": val, "lastProbeTime": None, "lastTransitionTime": now()}
        if reason:
            c["reason"] = reason
        if message:
            c["message"] = message
        self.conds[type_] = c

    def _push(self) -> None:
        ready = self.phase == "Running" and all(c.ready for c in self.mains)
        self._cond("ContainersReady", ready, "" if ready else "ContainersNotReady")
        self._cond("Ready", ready, "" if ready else "ContainersNotReady")
        conds = [{"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                  "lastTransitionTime": self.pod["metadata"].get("creationTimestamp") or now()}]
        conds += list(self.conds.values())
        status = {
            "phase": self.phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip, "podIPs": [{"ip": self.ip}], "startTime": self.start_time,
            "conditions": conds,
            "containerStatuses": [c.status() for c in self.mains],
        }
        if self.inits:
            status["initContainerStatuses"] = [c.status() for c in self.inits]
        if status == self._last_sent or self.gone.is_set():
            return
        try:
            # A JSON merge patch replaces lists wholesale: we always send them complete.
            self.api.patch_namespaced_pod_status(self.name, self.ns, {"status": status},
                                                 _content_type="application/merge-patch+json")
            self._last_sent = copy.deepcopy(status)
        except Exception as e:  # noqa: BLE001 — pod may be gone; the watch tells us
            if getattr(e, "status", None) == 404:
                self.gone.set()
            else:
                log.warning("status update of %s/%s failed: %s", self.ns, self.name, e)

    # ---------------------------------------------------------------- environment and volumes

    def _get(self, kind: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            fn = self.api.read_namespaced_secret if kind == "Secret" else self.api.read_namespaced_config_map
            obj = fn(name, self.ns, _preload_content=False)
            return json.loads(obj.data)
        except ApiException as e:
            if e.status == 404:
                return None
            if e.status >= 500:  # the API server restarting: retried, as a kubelet does
                raise ConfigError(f"{kind.lower()} {name}: {e.reason}") from e
            raise
        except HTTPError as e:  # unreachable (restarting): retried, as a kubelet does
            raise ConfigError(f"{kind.lower()} {name}: API server unreachable ({type(e).__name__})") from e

    def _key(self, kind: str, ref: dict) -> str | None:
        obj = self._get(kind, ref["name"])
        optional = ref.get("optional", False)
        if obj is None:
            if optional:
                return None
            raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
        data = obj.get("data") or {}
        if ref["key"] in data:
            v = data[ref["key"]]
            return base64.b64decode(v).decode() if kind == "Secret" else v
        if kind == "ConfigMap" and ref["key"] in (obj.get("binaryData") or {}):
            return base64.b64decode(obj["binaryData"][ref["key"]]).decode(errors="replace")
        if optional:
            return None
        raise ConfigError(f'couldn\'t find key {ref["key"]} in {kind} {self.ns}/{ref["name"]}')

    def _field(self, path: str) -> str:
        md, spec = self.pod["metadata"], self.pod["spec"]
        simple = {"metadata.name": md["name"], "metadata.namespace": self.ns, "metadata.uid": self.uid,
                  "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                  "status.podIP": self.ip, "status.podIPs": self.ip, "status.hostIP": "127.0.0.1",
                  "status.hostIPs": "127.0.0.1"}
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (md.get(m.group(1)) or {}).get(m.group(2), "")
        raise ConfigError(f"unsupported fieldRef {path}")

    def _resource(self, c: Container, ref: dict) -> str:
        kind, _, res = ref["resource"].partition(".")
        val = ((c.spec.get("resources") or {}).get(kind) or {}).get(res)
        return str(val) if val is not None else "0"

    def _env(self, c: Container) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in c.spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in src:
                    obj = self._get(kind, src[key]["name"])
                    if obj is None:
                        if src[key].get("optional"):
                            continue
                        raise ConfigError(f'{kind.lower()} "{src[key]["name"]}" not found')
                    for k, v in (obj.get("data") or {}).items():
                        env[prefix + k] = base64.b64decode(v).decode() if kind == "Secret" else v
        for e in c.spec.get("env") or []:
            if "valueFrom" in e:
                vf = e["valueFrom"]
                if "secretKeyRef" in vf:
                    v = self._key("Secret", vf["secretKeyRef"])
                elif "configMapKeyRef" in vf:
                    v = self._key("ConfigMap", vf["configMapKeyRef"])
                elif "fieldRef" in vf:
                    v = self._field(vf["fieldRef"]["fieldPath"])
                elif "resourceFieldRef" in vf:
                    v = self._resource(c, vf["resourceFieldRef"])
                else:
                    raise ConfigError(f"unsupported valueFrom in env {e['name']}")
                if v is None:
                    continue
            else:
                v = _expand(e.get("value", ""), env)
            env[e["name"]] = v
        return env

    def _prepare_volumes(self) -> dict[str, Path]:
        vols: dict[str, Path] = {}
        root = self.dir / "volumes"
        for v in self.pod["spec"].get("volumes") or []:
            name = v["name"]
            if "hostPath" in v:
                # One folder per (fake) node and host path, for the cluster's lifetime: the stand-in
                # for a node's disk, so pods on the same node share it and pods elsewhere do not.
                node = self.pod["spec"].get("nodeName") or "_unbound"
                p = self.runner.state_dir / "nodes" / node / v["hostPath"]["path"].lstrip("/")
                p.mkdir(parents=True, exist_ok=True)
                vols[name] = p
                continue
            if "persistentVolumeClaim" in v:
                # Claims outlive pods: one folder per claim for the cluster's lifetime.
                p = self.runner.state_dir / "pvc" / f"{self.ns}_{v['persistentVolumeClaim']['claimName']}"
            else:
                p = root / name
            p.mkdir(parents=True, exist_ok=True)
            if self.runner.mode == "image" and ("emptyDir" in v or "persistentVolumeClaim" in v):
                p.chmod(0o777)  # as a kubelet makes an emptyDir: the container's non-root user writes it
            if "projected" in v:
                self._project(v["projected"], p)
            for kind, key in (("Secret", "secret"), ("ConfigMap", "configMap")):
                if key in v:
                    ref = v[key]
                    obj = self._get(kind, ref.get("secretName") or ref.get("name"))
                    if obj is None:
                        if ref.get("optional"):
                            continue
                        raise ConfigError(f"{kind.lower()} {ref.get('secretName') or ref.get('name')} not found")
                    data = obj.get("data") or {}
                    items = ref.get("items") or [{"key": k, "path": k} for k in data]
                    for it in items:
                        if it["key"] not in data:
                            continue
                        raw = data[it["key"]]
                        f = p / it["path"]
                        f.parent.mkdir(parents=True, exist_ok=True)
                        f.write_bytes(base64.b64decode(raw) if kind == "Secret" else raw.encode())
            vols[name] = p
        return vols

    def _project(self, projected: dict, into: Path) -> None:
        """Materialise a projected volume (what the ServiceAccount admission plugin adds as
        kube-api-access-*): a bound service-account token, the root CA ConfigMap, downward API."""
        for src in projected.get("sources") or []:
            if "serviceAccountToken" in src:
                t = src["serviceAccountToken"]
                token = self._token(t.get("expirationSeconds", 3607), t.get("audience"))
                (into / t["path"]).write_text(token)
            elif "configMap" in src or "secret" in src:
                kind, ref = ("ConfigMap", src["configMap"]) if "configMap" in src else ("Secret", src["secret"])
                obj = self._get(kind, ref["name"])
                if obj is None:
                    if ref.get("optional"):
                        continue
                    raise ConfigError(f"{kind.lower()} {ref['name']} not found")
                data = obj.get("data") or {}
                for it in ref.get("items") or [{"key": k, "path": k} for k in data]:
                    if it["key"] in data:
                        raw = data[it["key"]]
                        f = into / it["path"]
                        f.parent.mkdir(parents=True, exist_ok=True)
                        f.write_bytes(base64.b64decode(raw) if kind == "Secret" else raw.encode())
            elif "downwardAPI" in src:
                for it in src["downwardAPI"].get("items") or []:
                    if "fieldRef" in it:
                        (into / it["path"]).write_text(self._field(it["fieldRef"]["fieldPath"]))

    def _token(self, seconds: int = 86400, audience: str | None = None) -> str:
        """A token for the pod's ServiceAccount, bound to this pod (TokenRequest, as a kubelet does)."""
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec = {"expirationSeconds": max(int(seconds), 86400),
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid}}
        if audience:
            spec["audiences"] = [audience]
        return self.api.create_namespaced_service_account_token(sa, self.ns, {"spec": spec}).status.token

    def _service_account_kubeconfig(self, embed_ca: bool = False) -> Path | None:
        """A kubeconfig with the pod's ServiceAccount token, so a local process talks to the API server
        as that ServiceAccount (its RBAC applies). In-cluster config reads fixed paths under
        /var/run/secrets, which a local process cannot have; KUBECONFIG is the standard fallback."""
        spec = self.pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        path = self.dir / ("serviceaccount.image.kubeconfig" if embed_ca else "serviceaccount.kubeconfig")
        if not path.exists():
            r = self.runner
            # A container cannot read the host's CA file: its kubeconfig carries the CA itself.
            ca = ({"certificate-authority-data": base64.b64encode(Path(r.ca_file).read_bytes()).decode()}
                  if embed_ca else {"certificate-authority": r.ca_file})
            cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "sa",
                   "clusters": [{"name": "e2e", "cluster": {"server": r.server, **ca}}],
                   "users": [{"name": "sa", "user": {"token": self._token()}}],
                   "contexts": [{"name": "sa", "context": {"cluster": "e2e", "user": "sa", "namespace": self.ns}}]}
            path.write_text(json.dumps(cfg, indent=1))
            if embed_ca:
                path.chmod(0o644)  # the container's user reads it (the pod's own token, as a kubelet mounts it)
        return path

    def _mounts(self, c: Container, vols: dict[str, Path]) -> list[tuple[str, Path]]:
        out = []
        for m in c.spec.get("volumeMounts") or []:
            if m["name"] not in vols:
                continue
            local = vols[m["name"]] / m["subPath"] if m.get("subPath") else vols[m["name"]]
            local.mkdir(parents=True, exist_ok=True)
            out.append((m["mountPath"].rstrip("/") or "/", local))
        return sorted(out, key=lambda t: -len(t[0]))

    @staticmethod
    def _rewrite(s: str, mounts: list[tuple[str, Path]]) -> str:
        # One pass over all mounts (longest first): a local path that replaced one mount path
        # (e.g. under /tmp) is never rewritten again by another mount (e.g. /tmp).
        table = {mount: str(local) for mount, local in mounts if mount != "/"}
        if not table:
            return s
        alts = "|".join(re.escape(m) for m in sorted(table, key=len, reverse=True))
        return re.sub(rf"(?<![\w./-])({alts})(?=/|$|[^\w.-])", lambda m: table[m.group(1)], s)

    # ---------------------------------------------------------------- processes

    def _env_overrides(self, c: Container) -> dict[str, str]:
        """Extra environment a test asked for, for containers of one image (`Cluster.set_container_env`):
        debug hooks such as the quantjob's upload pause. Read at each container start, so a test
        can set and clear it while the cluster runs; the operator's objects are never changed."""
        try:
            table = json.loads((self.runner.state_dir / ENV_OVERRIDES).read_text())
        except (FileNotFoundError, ValueError):
            return {}
        image = c.spec.get("image") or ""
        out: dict[str, str] = {}
        for match, extra in table.items():
            if match in image:
                out.update({str(k): str(v) for k, v in extra.items()})
        return out

    def _start(self, c: Container, vols: dict[str, Path]) -> None:
        env_pod = self._env(c)
        mounts = self._mounts(c, vols)
        env = {k: v for k, v in os.environ.items() if k in PASS_ENV or k.startswith(PASS_ENV_PREFIXES)}
        for k in filter(None, os.environ.get("FEWERBITS_E2E_PASS_ENV", "").split(",")):
            if k in os.environ:
                env[k] = os.environ[k]
        env.update({k: self._rewrite(v, mounts) for k, v in env_pod.items()})
        env.update(self._env_overrides(c))
        term = self.dir / f"{c.name}.termination-log"
        with contextlib.suppress(FileNotFoundError):
            term.unlink()
        env.update({TERMINATION_LOG_ENV: str(term), "POD_IP": self.ip, "POD_NAME": self.name,
                    "POD_NAMESPACE": self.ns, "HOSTNAME": self.name})
        if "KUBECONFIG" not in env_pod and c.rule is not None and c.rule.kind in ("module", "command"):
            kubeconfig = self._service_account_kubeconfig()
            if kubeconfig:
                env["KUBECONFIG"] = str(kubeconfig)
        command = [_expand(x, env_pod) for x in c.spec.get("command") or []]
        args = [_expand(x, env_pod) for x in c.spec.get("args") or []]
        logf = self.dir / f"{c.name}.log"
        if self.runner.mode == "image" and c.rule is not None and c.rule.kind == "module" \
                and images.is_image_workload(c.image):
            self._start_image(c, env_pod, vols, command, args, logf, term)
            c.term_file = term
            c.state = {"running": {"startedAt": now()}}
            c.started = True
            c.ready = False
            return
        if c.rule is None or c.rule.kind == "noop":
            c.proc = None
        elif c.rule.kind == "vllm":
            c.vllm = workloads.parse_vllm_args(command + args)
            c.sim_port = procs.free_port()
            argv = workloads.sim_argv(self.runner.sim, c.vllm, c.sim_port, self.runner.sim_metrics)
            c.proc = procs.spawn(argv, logf, env=env, cwd=self.dir)
            ports = {p["containerPort"] for p in c.spec.get("ports") or [] if p.get("protocol", "TCP") == "TCP"}
            ports.add(c.vllm.port)
            for port in sorted(ports):
                c.forwarders.append(Forwarder(self.ip, port, c.sim_port))
        elif c.rule.kind == "transformers":
            c.vllm = workloads.parse_vllm_args(command + args)
            if not c.vllm.model:
                raise ConfigError(f"container {c.name}: no model in the vLLM arguments (vllm serve MODEL or --model)")
            # The served model name, in the process's working directory, links to the model folder.
            served = self.dir / f"{c.name}-transformers"
            link = served / c.vllm.served_model_names[0]
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(Path(self._rewrite(c.vllm.model, mounts)), target_is_directory=True)
            # /v1/models scans the hub cache folder and answers 500 when it does not exist.
            env.setdefault("HF_HOME", str(served / "hf"))
            Path(env.get("HF_HUB_CACHE") or Path(env["HF_HOME"]) / "hub").mkdir(parents=True, exist_ok=True)
            env["HF_HUB_OFFLINE"] = "1"
            c.proc = procs.spawn(workloads.transformers_argv(c.vllm, self.ip), logf, env=env, cwd=served)
        else:
            # Mount paths are rewritten in what the container supplies, never in the local
            # interpreter path the rule adds: a volume mounted at /work or /tmp must not redirect
            # a checkout that lives there.
            argv = workloads.local_argv(c.rule, [self._rewrite(a, mounts) for a in command],
                                        [self._rewrite(a, mounts) for a in args])
            c.proc = procs.spawn(argv, logf, env=env, cwd=self.dir)
        c.term_file = term
        c.state = {"running": {"startedAt": now()}}
        c.started = True
        c.ready = False

    def _start_image(self, c: Container, env_pod: dict[str, str], vols: dict[str, Path], command: list[str],
                     args: list[str], logf: Path, term: Path) -> None:
        """Image mode: `podman run` of the container's image (e2e/images.py decides the command line)."""
        podman = self.runner.podman
        user = podman.image_user(c.image)
        if user is None:
            raise ImageNotPresent(f'container image "{c.image}" is not present with pull policy of Never '
                                  f"(scripts/images.sh builds it)")
        spec = self.pod["spec"]
        try:
            security = images.security_args(spec.get("securityContext"), c.spec.get("securityContext"), user)
        except images.SecurityError as e:
            raise ConfigError(str(e)) from None
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            if m["name"] in vols:
                host = vols[m["name"]] / m["subPath"] if m.get("subPath") else vols[m["name"]]
                host.mkdir(parents=True, exist_ok=True)
                mounts.append(images.Mount(host, m["mountPath"], bool(m.get("readOnly"))))
        term.write_text("")
        term.chmod(0o666)
        term_path = c.spec.get("terminationMessagePath") or "/dev/termination-log"
        mounts.append(images.Mount(term, term_path))
        env = {**env_pod, **self._env_overrides(c), TERMINATION_LOG_ENV: term_path, "POD_IP": self.ip,
               "POD_NAME": self.name, "POD_NAMESPACE": self.ns}
        if "KUBECONFIG" not in env_pod:
            kubeconfig = self._service_account_kubeconfig(embed_ca=True)
            if kubeconfig:
                mounts.append(images.Mount(kubeconfig, "/var/run/fewerbits/kubeconfig", read_only=True))
                env["KUBECONFIG"] = "/var/run/fewerbits/kubeconfig"
        c.podman_name = images.container_name(self.ns, self.name, c.name, self.uid, c.restart_count)
        c.image_id = podman.image_id(c.image)
        argv = images.run_argv(podman.argv, name=c.podman_name, image=c.image, hostname=self.name[:63],
                               security=security, mounts=mounts, env_names=sorted(env), command=command,
                               args=args, labels={images.LABEL: str(os.getpid())})
        c.proc = procs.spawn(argv, logf, env={**podman.env, **env}, cwd=self.dir)

    def _stop_container(self, c: Container, grace: float) -> None:
        for f in c.forwarders:
            f.close()
        c.forwarders.clear()
        if c.podman_name and c.proc is not None and c.proc.poll() is None:
            self.runner.podman.stop(c.podman_name, grace)
        if c.proc is not None and c.proc.poll() is None:
            procs.stop_group(c.proc.pid, grace, c.proc)

    def _finished(self, c: Container) -> dict | None:
        """The terminated state if c's process has exited, else None."""
        if c.proc is None:
            return None
        rc = c.proc.poll()
        if rc is None:
            return None
        for f in c.forwarders:
            f.close()
        c.forwarders.clear()
        msg = ""
        with contextlib.suppress(OSError):
            msg = c.term_file.read_text(errors="replace")[:MAX_TERMINATION_MESSAGE]
        if not msg and rc != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            lines = (self.dir / f"{c.name}.log").read_text(errors="replace").splitlines()[-80:]
            msg = "\n".join(lines)[-2048:]
        exit_code = rc if rc >= 0 else 128 - rc  # killed by signal N -> 128+N, as a runtime reports
        t = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
             "startedAt": c.state.get("running", {}).get("startedAt", now()), "finishedAt": now()}
        if msg:
            t["message"] = msg
        return {"terminated": t}

    def _ready(self, c: Container) -> bool:
        if c.proc is None:
            return "running" in c.state
        if c.proc.poll() is not None:
            return False
        probe = c.spec.get("readinessProbe") or {}
        try:
            if c.rule and c.rule.kind in ("vllm", "transformers"):
                return _http_ok(f"http://{self.ip}:{c.vllm.port}/health")
            if "httpGet" in probe:
                h = probe["httpGet"]
                port = _port(h.get("port"), c.spec)
                return _http_ok(f"http://{self.ip}:{port}{h.get('path', '/')}")
            if "tcpSocket" in probe:
                with socket.create_connection((self.ip, _port(probe["tcpSocket"]["port"], c.spec)), timeout=1):
                    return True
        except (OSError, ValueError):
            return False
        return True

    def _run_to_completion(self, c: Container, vols) -> int:
        """Run an init container; returns its exit code (None means the pod is being deleted)."""
        self._start(c, vols)
        self._push()
        while not self.deleting.is_set():
            t = self._finished(c)
            if t:
                c.state = t
                c.ready = t["terminated"]["exitCode"] == 0
                self._push()
                return t["terminated"]["exitCode"]
            if c.proc is None:  # noop init container: succeeds at once
                c.state = {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now(), "finishedAt": now()}}
                c.ready = True
                self._push()
                return 0
            time.sleep(0.1)
        return -1

    def _with_config_retry(self, c: Container, fn) -> bool:
        """Call fn, retrying while the container config cannot be resolved. False if deleted meanwhile."""
        while not self.deleting.is_set():
            try:
                fn()
                return True
            except ConfigError as e:
                c.state = {"waiting": {"reason": e.reason, "message": str(e)}}
                self._push()
                self.deleting.wait(1.0)
        return False

    def run(self) -> None:
        try:
            self._run()
        except Exception:  # noqa: BLE001
            log.exception("pod %s/%s: runner error", self.ns, self.name)
        finally:
            if self.deleting.is_set():
                self._finish_delete()
            self.runner.done(self.uid)

    def _run(self) -> None:
        self._cond("PodReadyToStartContainers", True)
        self._cond("Initialized", not self.inits, "" if not self.inits else "ContainersNotInitialized")
        self._push()
        vols: dict[str, Path] = {}
        if not self._with_config_retry(self.mains[0] if self.mains else None, lambda: vols.update(self._prepare_volumes())):
            return
        for c in self.inits:
            while True:
                rc = None

                def go(c=c):
                    nonlocal rc
                    rc = self._run_to_completion(c, vols)

                if not self._with_config_retry(c, go) or self.deleting.is_set():
                    return
                if rc == 0:
                    break
                if self.restart_policy == "Never":
                    self.phase = "Failed"
                    self._cond("Initialized", False, "ContainersNotInitialized")
                    for m in self.mains:
                        m.state = {"waiting": {"reason": "PodInitializing"}}
                    self._push()
                    return
                c.last_state, c.restart_count = c.state, c.restart_count + 1
                c.state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off restarting {c.name}"}}
                self._push()
                if self.deleting.wait(min(10, 2 ** c.restart_count)):
                    return
        self._cond("Initialized", True)
        for c in self.mains:
            c.state = {"waiting": {"reason": "ContainerCreating"}}
            if not self._with_config_retry(c, lambda c=c: self._start(c, vols)):
                return
        self.phase = "Running"
        self._push()
        while not self.deleting.is_set():
            for c in self.mains:
                if c.backoff_until and time.monotonic() >= c.backoff_until:
                    c.backoff_until = 0
                    c.restart_count += 1
                    if not self._with_config_retry(c, lambda c=c: self._start(c, vols)):
                        return
                    continue
                if "running" not in c.state:
                    continue
                t = self._finished(c)
                if t:
                    code = t["terminated"]["exitCode"]
                    restart = self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and code != 0)
                    c.ready = False
                    if restart:
                        c.last_state = t
                        c.state = {"waiting": {"reason": "CrashLoopBackOff",
                                               "message": f"back-off restarting failed container {c.name}"}}
                        c.backoff_until = time.monotonic() + min(10, 2 ** c.restart_count)
                    else:
                        c.state = t
                        c.started = False
                else:
                    c.ready = self._ready(c)
            if all("terminated" in c.state for c in self.mains):
                codes = [c.state["terminated"]["exitCode"] for c in self.mains]
                self.phase = "Succeeded" if all(x == 0 for x in codes) else "Failed"
                self._push()
                return
            self._push()
            self.deleting.wait(0.5)

    def _finish_delete(self) -> None:
        grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        for c in self.mains + self.inits:
            self._stop_container(c, min(grace, 10.0))
        self.runner.force_delete(self.ns, self.name, self.uid)

    def request_delete(self) -> None:
        self.deleting.set()


def _port(port, spec: dict) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in spec.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"unknown port {port}")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return 200 <= r.status < 400
    except OSError:
        return False


def _expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined variables are replaced, $$ escapes, others stay."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, s)


# ---------------------------------------------------------------------------------------- runner


class Runner:
    def __init__(self, kubeconfig: str, state_dir: Path, rules: list[workloads.ImageRule], cidr: str, sim: str,
                 sim_metrics: str = "fake", mode: str = "process"):
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        self.api = client.CoreV1Api(client.ApiClient(cfg))
        self.server = cfg.host
        self.ca_file = cfg.ssl_ca_cert
        self.state_dir = state_dir
        self.rules = rules
        self.sim = sim
        self.sim_metrics = sim_metrics
        self.mode = mode
        self.podman = images.Podman() if mode == "image" else None
        if self.podman is not None:
            self.podman.remove_stale()
        self._hosts = ipaddress.ip_network(cidr).hosts()
        self.runs: dict[str, PodRun] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def owns(self, pod: dict) -> bool:
        spec = pod.get("spec") or {}
        images = [c.get("image", "") for c in (spec.get("containers") or []) + (spec.get("initContainers") or [])]
        return any(workloads.rule_for(i, self.rules) for i in images)

    def on_pod(self, pod: dict, deleted: bool = False) -> None:
        if not self.owns(pod) or not pod["spec"].get("nodeName"):
            return
        uid = pod["metadata"]["uid"]
        with self.lock:
            run = self.runs.get(uid)
            if deleted:
                if run:
                    run.gone.set()
                    run.request_delete()
                return
            if pod["metadata"].get("deletionTimestamp"):
                if run and run.is_alive():
                    run.request_delete()
                else:  # never ran here, or already finished: only the delete is left to do
                    threading.Thread(target=self.force_delete, daemon=True,
                                     args=(pod["metadata"]["namespace"], pod["metadata"]["name"], uid)).start()
                return
            if run or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return
            run = PodRun(self, pod, str(next(self._hosts)))
            self.runs[uid] = run
        log.info("running pod %s/%s at %s", run.ns, run.name, run.ip)
        run.start()

    def done(self, uid: str) -> None:
        # Keep finished runs so a later event for the same uid does not start them again.
        pass

    def force_delete(self, ns: str, name: str, uid: str) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            self.api.delete_namespaced_pod(name, ns, body=client.V1DeleteOptions(
                grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)))
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning("delete of %s/%s failed: %s", ns, name, e)

    def loop(self, ready_file: Path) -> None:
        from kubernetes import watch

        while not self.stopping.is_set():
            try:
                resp = self.api.list_pod_for_all_namespaces(_preload_content=False)
                listing = json.loads(resp.data)
                for pod in listing["items"]:
                    self.on_pod(pod)
                ready_file.touch()
                rv = listing["metadata"]["resourceVersion"]
                w = watch.Watch()
                for ev in w.stream(self.api.list_pod_for_all_namespaces, resource_version=rv,
                                   timeout_seconds=60, allow_watch_bookmarks=False):
                    if self.stopping.is_set():
                        w.stop()
                        break
                    if ev["type"] == "ERROR":
                        break
                    self.on_pod(ev["raw_object"], deleted=ev["type"] == "DELETED")
            except Exception as e:  # noqa: BLE001 — API restarts, 410 Gone: list again
                if not self.stopping.is_set():
                    log.warning("watch restarted: %s", e)
                    time.sleep(0.5)

    def shutdown(self) -> None:
        self.stopping.set()
        with self.lock:
            runs = list(self.runs.values())
        for r in runs:
            for c in r.mains + r.inits:
                r._stop_container(c, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.podrunner")
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--state-dir", type=Path, required=True)
    ap.add_argument("--images", type=Path, required=True, help="JSON list of image rules")
    ap.add_argument("--cidr", required=True)
    ap.add_argument("--sim", required=True, help="llm-d-inference-sim binary")
    ap.add_argument("--sim-metrics", choices=["fake", "real"], default="fake",
                    help="fake: start sims with zero fake metrics so POST /admin/config can change them")
    ap.add_argument("--mode", choices=["process", "image"], default=os.environ.get("FEWERBITS_E2E_RUN_MODE") or "process",
                    help="image: run the project's containers from their built images with podman")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    a.state_dir.mkdir(parents=True, exist_ok=True)
    rules = [workloads.ImageRule.from_json(r) for r in json.loads(a.images.read_text())]
    runner = Runner(a.kubeconfig, a.state_dir, rules, a.cidr, a.sim, a.sim_metrics, a.mode)
    log.info("pod runner in %s mode", a.mode)

    def stop(*_):
        runner.shutdown()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    runner.loop(a.state_dir / "ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
