"""The pod runner: a kubelet for the pods whose images e2e/workloads.py maps to local commands.

It watches pods bound to (kwok) nodes; for each pod it owns it does what a kubelet would: run init
containers in order and then the containers as local process groups, probe readiness, apply the
restart policy, and report everything through pod status — phase, conditions, container states,
exit codes and the termination message. On deletion it stops the processes (SIGTERM, grace,
SIGKILL) and finishes the delete. This module is the process lifecycle; what is materialised before
a process starts (environment through the API, volumes as local folders, mount paths rewritten in
env and args) is e2e/podenv.py, and the loopback forwarding e2e/forward.py.

Pod IPs come from a loopback CIDR, so a process can bind its pod IP. The simulator listens on ":port"
(all addresses), so it gets a free port and the runner forwards <pod IP>:<container port> to it.

Container output goes to <state-dir>/<ns>_<pod>_<uid8>/<container>.log (there is no `kubectl logs`).
The termination-message file is given to the process as $FEWERBITS_TERMINATION_LOG.
Processes of `module`/`command` rules get $KUBECONFIG pointing at a kubeconfig that holds a token of
the pod's ServiceAccount (TokenRequest bound to the pod), so they run with that account's RBAC.

Two modes (`--mode`, default from $FEWERBITS_E2E_RUN_MODE, else `process`):
  process — the fast default: the project's images are this interpreter running their module;
  image   — containers of the project's images (fewerbits-operator, -quantjob, -runtime) run from
            the images scripts/images.sh built, or pulled from a registry as their pull policy
            says, with podman: the pod's env, volumes and security context as a kubelet gives them
            (e2e/images.py). vLLM stays the simulator.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from e2e import images, procs, versions, workloads
from e2e.forward import Forwarder
from e2e.podenv import (ENV_OVERRIDES, TERMINATION_LOG_ENV, ConfigError, ImageNotPresent, ImagePullFailed, PodEnvironment,
                        expand)

__all__ = ["ENV_OVERRIDES", "ConfigError", "PodRun", "Runner", "main"]

log = logging.getLogger("podrunner")

MAX_TERMINATION_MESSAGE = 4096  # what a kubelet keeps


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epp_binary() -> Path:
    """The endpoint picker e2e/build.sh built (`epp`, GIE_VERSION); a missing build fails the container."""
    out = subprocess.run(["bash", str(Path(__file__).resolve().parent / "build.sh"), "--print-bin-dir", "epp"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()) / "epp"


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
        self.probe_failures = 0
        """Readiness probe failures in a row since the container was last seen ready."""
        self.next_probe = 0.0
        self.backoff_until = 0.0
        self.sim_port: int | None = None
        self.local_ports: dict[int, int] = {}
        """epp: container port -> the local port the picker listens on."""
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
        self.env = PodEnvironment(self.api, pod, ip, self.dir, runner.state_dir, runner.mode, runner.server,
                                  runner.ca_file)

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

    def _start(self, c: Container, vols: dict[str, Path]) -> None:
        env_pod = self.env.env(c.spec)
        mounts = self.env.mounts(c.spec, vols)
        term = self.dir / f"{c.name}.termination-log"
        with contextlib.suppress(FileNotFoundError):
            term.unlink()
        env = self.env.process_env(c.spec, env_pod, mounts, term)
        if "KUBECONFIG" not in env_pod and c.rule is not None and c.rule.kind in ("module", "command", "epp"):
            kubeconfig = self.env.service_account_kubeconfig()
            if kubeconfig:
                env["KUBECONFIG"] = str(kubeconfig)
        command = [expand(x, env_pod) for x in c.spec.get("command") or []]
        args = [expand(x, env_pod) for x in c.spec.get("args") or []]
        # What a kubelet hands the container runtime, $(VAR) expanded, before any rule maps it to a
        # local process (the simulator runs in place of vLLM): tests read it (`container_argv`).
        (self.dir / f"{c.name}.argv.json").write_text(json.dumps(command + args))
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
            if self.runner.sim is None:
                raise ConfigError(f"image {c.image} is played by llm-d-inference-sim, and this cluster was started "
                                  "without it (Cluster(with_sim=False)); serve it with fewerbits-test/vllm-cpu")
            c.vllm = workloads.parse_vllm_args(command + args)
            c.sim_port = procs.free_port()
            argv = workloads.sim_argv(self.runner.sim, c.vllm, c.sim_port, self.runner.sim_metrics)
            c.proc = procs.spawn(argv, logf, env=env, cwd=self.dir)
            ports = {p["containerPort"] for p in c.spec.get("ports") or [] if p.get("protocol", "TCP") == "TCP"}
            ports.add(c.vllm.port)
            for port in sorted(ports):
                c.forwarders.append(Forwarder(self.ip, port, c.sim_port))
        elif c.rule.kind == "vllm-cpu":
            c.vllm = workloads.parse_vllm_args(command + args)
            argv = workloads.vllm_cpu_argv([self.env.rewrite(a, mounts) for a in command],
                                           [self.env.rewrite(a, mounts) for a in args], str(versions.vllm_python()))
            versions.ensure_built("vllm")  # minutes, once per cache; the container waits in ContainerCreating
            env.update({"PATH": f"{self.runner.vllm_cpu_bin()}:{env.get('PATH', os.defpath)}",
                        "FEWERBITS_E2E_POD_DIR": str(self.dir)})
            c.proc = procs.spawn(argv, logf, env=env, cwd=self.dir)
        elif c.rule.kind == "epp":
            # The picker binary built from its module (e2e/build.sh epp), with the pod's args.
            argv, ports = workloads.epp_argv(str(_epp_binary()), [self.env.rewrite(a, mounts) for a in command[1:] + args],
                                             procs.free_port)
            c.proc = procs.spawn(argv, logf, env={**env, "HOME": str(self.dir)}, cwd=self.dir)
            c.local_ports = ports
            for port, local in sorted(ports.items()):
                c.forwarders.append(Forwarder(self.ip, port, local))
        else:
            # Mount paths are rewritten in what the container supplies, never in the local
            # interpreter path the rule adds: a volume mounted at /work or /tmp must not redirect
            # a checkout that lives there.
            argv = workloads.local_argv(c.rule, [self.env.rewrite(a, mounts) for a in command],
                                        [self.env.rewrite(a, mounts) for a in args])
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
        policy = c.spec.get("imagePullPolicy")
        if user is None and images.pull_policy(c.image, policy) == "Never":
            raise ImageNotPresent(f'container image "{c.image}" is not present with pull policy of Never '
                                  f"(scripts/images.sh builds it)")
        if images.pull_needed(c.image, policy, present=user is not None):
            error = podman.pull(c.image)  # the container waits in ContainerCreating meanwhile
            if error:
                raise ImagePullFailed(f'failed to pull image "{c.image}": {error}')
            user = podman.image_user(c.image)
        if user is None:
            raise ImagePullFailed(f'image "{c.image}" is not in the storage after its pull')
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
        env = {**env_pod, **self.env.env_overrides(c.spec), TERMINATION_LOG_ENV: term_path, "POD_IP": self.ip,
               "POD_NAME": self.name, "POD_NAMESPACE": self.ns}
        if "KUBECONFIG" not in env_pod:
            kubeconfig = self.env.service_account_kubeconfig(embed_ca=True)
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

    def _readiness(self, c: Container) -> bool:
        """Readiness as the kubelet keeps it once a container is ready: probed every
        `periodSeconds` (default 10), each probe within `timeoutSeconds` (default 1), and unready only
        after `failureThreshold` (default 3) failures in a row. So a server slow to answer one probe
        on a loaded machine stays ready, as it would on a node. Until it is first ready it is probed
        every pass of the pod loop (0.5 s), sooner than the period: that only makes tests quicker."""
        probe = c.spec.get("readinessProbe") or {}
        now_ = time.monotonic()
        if c.proc is None or c.proc.poll() is not None or not c.ready:
            ok = self._ready(c)
            c.probe_failures, c.next_probe = 0, now_ + float(probe.get("periodSeconds", 10))
            return ok
        if now_ < c.next_probe:
            return True
        c.next_probe = now_ + float(probe.get("periodSeconds", 10))
        if self._ready(c):
            c.probe_failures = 0
            return True
        c.probe_failures += 1
        log.warning("pod %s/%s: %s failed its readiness probe (%d in a row)", self.ns, self.name, c.name,
                    c.probe_failures)
        return c.probe_failures < int(probe.get("failureThreshold", 3))

    def _ready(self, c: Container) -> bool:
        """One readiness probe now."""
        if c.proc is None:
            return "running" in c.state
        if c.proc.poll() is not None:
            return False
        probe = c.spec.get("readinessProbe") or {}
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if c.rule and c.rule.kind in ("vllm", "vllm-cpu"):
                return _http_ok(f"http://{self.ip}:{c.vllm.port}/health", timeout)
            if c.rule and c.rule.kind == "epp":
                # Every port the picker listens on, itself (a forwarder always accepts): its gRPC
                # health port opens before its ext-proc port does.
                for local in c.local_ports.values():
                    socket.create_connection(("127.0.0.1", local), timeout=1).close()
                return bool(c.local_ports)
            if "httpGet" in probe:
                h = probe["httpGet"]
                port = _port(h.get("port"), c.spec)
                return _http_ok(f"http://{self.ip}:{port}{h.get('path', '/')}", timeout)
            if "tcpSocket" in probe:
                with socket.create_connection((self.ip, _port(probe["tcpSocket"]["port"], c.spec)), timeout=timeout):
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
        if not self._with_config_retry(self.mains[0] if self.mains else None, lambda: vols.update(self.env.volumes())):
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
                    c.ready = self._readiness(c)
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


def _http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 400
    except OSError:
        return False
# ---------------------------------------------------------------------------------------- runner


class Runner:
    def __init__(self, kubeconfig: str, state_dir: Path, rules: list[workloads.ImageRule], cidr: str, sim: str | None,
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
        self.podman = images.Podman.for_runner() if mode == "image" else None
        if self.podman is not None:
            self.podman.remove_stale()
        self._hosts = ipaddress.ip_network(cidr).hosts()
        self.runs: dict[str, PodRun] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def vllm_cpu_bin(self) -> Path:
        """A folder holding `vllm`: e2e/vllm_cpu.py under the vLLM environment's interpreter, put first
        on PATH of `vllm-cpu` containers, so the launcher's `vllm serve ...` starts vLLM's CPU
        build with the rendered argv."""
        folder = self.state_dir / "vllm-cpu-bin"
        exe = folder / "vllm"
        if not exe.exists():
            folder.mkdir(parents=True, exist_ok=True)
            shim = Path(__file__).resolve().parent / "vllm_cpu.py"
            tmp = folder / f".vllm.{os.getpid()}.{threading.get_ident()}"
            tmp.write_text(f'#!/bin/sh\nexec "{versions.vllm_python()}" "{shim}" "$@"\n')
            tmp.chmod(0o755)
            tmp.rename(exe)
        return folder

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
    ap.add_argument("--sim", help="llm-d-inference-sim binary (without it, pods of simulated vLLM images wait "
                                   "with a message saying so)")
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
