"""Running the real operator against the local control plane, and waiting on what it does.

The operator runs as its own process (`python -m fewerbits_operator`), exactly as in its image,
with the cluster's kubeconfig, and so does the scale-from-zero activator (its own Deployment in the
chart: `python -m fewerbits_operator.runtime.activator_main`, ``OperatorProcess.activator``); the harness's pod runner plays the kubelet for the Jobs and vLLM
pods it creates (real quantjob, llm-d-inference-sim as vLLM).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kubernetes import client

from e2e import failfast
from e2e.procs import free_port
from e2e.addons.epp import PICKER_ROLE

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "fewerbits.io", "v1alpha1", "quantizedmodels"


@dataclass
class OperatorProcess:
    kubeconfig: Path
    log_path: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    metrics_port: int = 0
    activator_port: int = 0
    module: str = "fewerbits_operator"
    """The process's entrypoint: the operator, or the activator (``OperatorProcess.activator``)."""

    @classmethod
    def activator(cls, kubeconfig: Path, log_path: Path, port: int = 0,
                  env_extra: dict[str, str] | None = None) -> "OperatorProcess":
        """The activator's own process, as the chart's activator Deployment runs it."""
        return cls(kubeconfig, log_path, dict(env_extra or {}), activator_port=port,
                   module="fewerbits_operator.runtime.activator_main")

    def wait_serving(self, timeout: float = 30) -> None:
        """Until the activator answers its /healthz (the kubelet's readiness probe in the chart)."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.activator_port}/healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert self.proc is not None and self.proc.poll() is None, f"{self.module} exited:\n{self.log_tail()}"
            assert time.monotonic() < deadline, f"{self.module} not serving after {timeout}s:\n{self.log_tail()}"
            time.sleep(0.2)

    def start(self) -> "OperatorProcess":
        self.metrics_port = free_port()
        self.activator_port = self.activator_port or free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("FEWERBITS_")},
            "KUBECONFIG": str(self.kubeconfig),
            # Only the test namespaces (the `namespace` fixture's t-*): a chart-installed operator
            # may be tested beside this one in its own namespaces.
            "FEWERBITS_NAMESPACES": '["t-*"]',
            "FEWERBITS_RESYNC_SECONDS": "3",
            # Read again after a resync period, as before the ETag was remembered: the calibration
            # tests check each read against the object (the reuse is counted in unit tests).
            "FEWERBITS_CALIBRATION_ETAG_SECONDS": "3",
            "FEWERBITS_EPP_CLUSTER_ROLE": PICKER_ROLE,
            "FEWERBITS_RETENTION_SWEEP_SECONDS": "1",
            "FEWERBITS_AUTOSCALER_PERIOD_SECONDS": "2",
            "FEWERBITS_AUTOSCALER_STATUS_INTERVAL_SECONDS": "2",
            "FEWERBITS_METRICS_PORT": str(self.metrics_port),
            "FEWERBITS_HEALTH_PORT": str(free_port()),
            "FEWERBITS_ACTIVATOR_PORT": str(self.activator_port),
            "FEWERBITS_JOB_CPU_REQUEST": "1",
            "FEWERBITS_JOB_MEMORY_REQUEST": "1Gi",
            "PYTHONUNBUFFERED": "1",
            **self.env_extra,
        }
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module], env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> None:
        self.kill()
        self.start()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()


class Models:
    """QuantizedModel verbs and waits for tests."""

    def __init__(self, api: client.ApiClient, operator: OperatorProcess):
        self.api = api
        self.custom = client.CustomObjectsApi(api)
        self.apps = client.AppsV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.core = client.CoreV1Api(api)
        self.operator = operator

    def apply(self, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "QuantizedModel",
                "metadata": {"name": name, "namespace": namespace}, "spec": spec}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    def patch_spec(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": patch})

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    def delete(self, namespace: str, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    def condition(self, namespace: str, name: str, type_: str) -> dict[str, Any] | None:
        status = self.get(namespace, name).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 180, namespace: str | None = None,
             name: str | None = None) -> Any:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(0.5)
        state = ""
        if namespace and name:
            try:
                state = json.dumps(self.get(namespace, name).get("status"), indent=1)[:6000]
            except Exception as e:  # noqa: BLE001 — best effort for the failure message
                state = repr(e)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\nstatus: {state}\n"
                             f"operator log:\n{self.operator.log_tail()}")

    def wait_condition(self, namespace: str, name: str, type_: str, status: str = "True",
                       reason: str | None = None, timeout: float = 240) -> dict[str, Any]:
        """The condition once it has ``status`` (and ``reason``). A wait for Ready=True stops as soon
        as the model has shown a failure that does not pass by itself for a minute (e2e/failfast.py)."""
        stop = failfast.FailFast() if (type_, status) == ("Ready", "True") else None

        def check():
            conditions = (self.get(namespace, name).get("status") or {}).get("conditions") or []
            c = next((x for x in conditions if x["type"] == type_), None)
            if c and c["status"] == status and (reason is None or c["reason"] == reason):
                return c
            if stop is not None and (why := stop.check(conditions, time.monotonic())):
                raise failfast.ModelFailed(f"waiting for Ready=True on {namespace}/{name}: {why}\n"
                                           f"operator log:\n{self.operator.log_tail()}")
            return None
        return self.wait(f"{type_}={status}{f' ({reason})' if reason else ''} on {namespace}/{name}", check,
                         timeout, namespace, name)

    def jobs(self, namespace: str) -> list[Any]:
        return self.batch.list_namespaced_job(namespace, label_selector="app.kubernetes.io/managed-by=fewerbits").items

    def deployments(self, namespace: str, model: str) -> list[Any]:
        return self.apps.list_namespaced_deployment(namespace, label_selector=f"fewerbits.io/model={model}").items

    def events(self, namespace: str, name: str) -> list[Any]:
        return [e for e in self.core.list_namespaced_event(namespace).items if e.involved_object.name == name]

    def wait_events(self, namespace: str, name: str, reasons: set[str], timeout: float = 30) -> set[str]:
        """Every reason in ``reasons`` among the object's events; returns all its reasons. The operator
        posts a pass's events after that pass's status write (execute.py), so a test that has just
        seen the status waits for them rather than reading once."""
        return self.wait(f"events {sorted(reasons)} on {namespace}/{name}", lambda: (
            got := {e.reason for e in self.events(namespace, name)}) >= reasons and got, timeout, namespace, name)
