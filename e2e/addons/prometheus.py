"""A real Prometheus server (built from github.com/prometheus/prometheus by e2e/build.sh) and its
HTTP API, run with the configuration the Prometheus Operator generated for it: the operator, the
chart's monitors and the harness's stand-in for the kubelet that would run Prometheus's pod are in
``e2e/addons/prometheus_operator.py``; nothing here writes a scrape configuration.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

from e2e import procs, versions


class PrometheusError(RuntimeError):
    pass


class Prometheus:
    """One Prometheus process on ``config_file``; ``url`` is its HTTP API."""

    def __init__(self, state_dir: Path, config_file: Path):
        self.state_dir = state_dir
        self.config_file = config_file
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> "Prometheus":
        versions.ensure_built("prometheus")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.port = procs.free_port()
        log = self.state_dir / "prometheus.log"
        self.proc = procs.spawn([
            str(versions.binary("prometheus")), f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.state_dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=2h", "--web.enable-lifecycle", "--log.level=warn",
        ], log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready after {timeout}s:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop_group(self.proc.pid, 10, self.proc)
            self.proc = None

    # ------------------------------------------------------------------ API

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params, doseq=True) if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        return self.api("query", query=promql)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
        """Poll ``check`` (every 0.25 s) until it returns something truthy."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = check()
            except (PrometheusError, urllib.error.URLError, OSError) as e:
                last = e
            if last and not isinstance(last, Exception):
                return last
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
