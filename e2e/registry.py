"""A local OCI registry (CNCF Distribution's `registry`, built from its Go module: e2e/build.sh
registry) on loopback, plain HTTP: what podman calls an insecure registry (`--tls-verify=false`).

scripts/release-check.sh pushes the three images to it and the image-mode e2e pulls them from it by
digest. Its blobs live in a folder that outlives the process (default
`$FEWERBITS_CACHE/registry/data`), so a registry started again on another port serves the same
digests, and a second push of unchanged images uploads nothing.

    python -m e2e.registry serve [--data DIR] [--port N] [--address-file F]
        # runs until SIGTERM/SIGINT; writes HOST:PORT to F once /v2/ answers
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from e2e import procs, versions

MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")


class RegistryError(RuntimeError):
    pass


def default_data_dir() -> Path:
    return versions.cache_dir() / "registry" / "data"


def config(data_dir: Path, port: int) -> dict:
    """The registry's configuration (it reads YAML, of which JSON is a subset)."""
    return {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(data_dir)}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": os.urandom(16).hex()},
        "health": {"storagedriver": {"enabled": False}},
    }


class Registry:
    def __init__(self, data_dir: Path | None = None, port: int = 0):
        self.data_dir = data_dir or default_data_dir()
        self.port = port
        self.proc = None

    @property
    def address(self) -> str:
        """HOST:PORT, the registry part of an image reference."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> "Registry":
        versions.ensure_built("registry")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or procs.free_port()
        run_dir = self.data_dir.parent
        cfg = run_dir / f"config-{self.port}.json"
        cfg.write_text(json.dumps(config(self.data_dir, self.port)))
        log = run_dir / f"registry-{self.port}.log"
        # No trace exporter: its default is OTLP to a collector that is not there.
        env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
        self.proc = procs.spawn([str(versions.binary("registry")), "serve", str(cfg)], log, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RegistryError(f"registry exited {self.proc.returncode}:\n{procs.tail(log)}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        self.stop()
        raise RegistryError(f"registry not answering /v2/ after {timeout}s:\n{procs.tail(log)}")

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop_group(self.proc.pid, 10, self.proc)
            self.proc = None

    def manifest(self, repository: str, reference: str) -> dict:
        """The manifest of repository:reference (a tag or a digest), as a kubelet's runtime reads it."""
        req = urllib.request.Request(f"http://{self.address}/v2/{repository}/manifests/{reference}",
                                     headers={"Accept": ", ".join(MANIFEST_TYPES)})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RegistryError(f"{repository}@{reference}: HTTP {e.code} {e.read()[:300]!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.registry")
    sub = ap.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run a registry until SIGTERM/SIGINT")
    serve.add_argument("--data", type=Path, default=None, help="blob folder (default: the cache's)")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--address-file", type=Path, help="written with HOST:PORT once it answers")
    a = ap.parse_args(argv)
    reg = Registry(a.data, a.port).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if a.address_file:
        a.address_file.write_text(reg.address + "\n")
    print(f"registry at {reg.address}, blobs in {reg.data_dir}", flush=True)
    try:
        while not stop.is_set() and reg.proc is not None and reg.proc.poll() is None:
            stop.wait(1.0)
    finally:
        reg.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
