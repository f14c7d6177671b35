"""The demo flow with the operator, the quantization Job and the serving pod's fetcher all running
from their built images (podman, the pod runner's image mode); vLLM is still the simulator.

Needs the images: `scripts/images.sh` builds them (docs/images.md). Marked `images` and deselected
by default (pyproject.toml); run with

    scripts/images.sh && scripts/test.sh -m images

A missing image fails the test with that command, never skips it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from e2e import cluster as cluster_mod
from e2e import demo, images

pytestmark = pytest.mark.images



def _pyproject_version() -> str:
    import tomllib

    return tomllib.loads((images.REPO / "pyproject.toml").read_text())["project"]["version"]


# What scripts/images.sh tags and the chart's defaults name (its appVersion is this version).
VERSION = _pyproject_version()
IMAGES = {n: f"ghcr.io/fewerbits/fewerbits-{n}:{VERSION}" for n in ("operator", "quantjob", "runtime")}


def read_only_violations(pods_dir: Path) -> dict[str, list[str]]:
    """{log file: paths a container could not write because its root filesystem is read-only}."""
    out = {}
    for log in sorted(pods_dir.glob("*/*.log")):
        paths = images.read_only_violations(log.read_text(errors="replace"))
        if paths:
            out[str(log.relative_to(pods_dir))] = paths
    return out


@pytest.fixture(scope="module")
def image_cluster():
    import yaml

    chart = yaml.safe_load((images.REPO / "charts" / "fewerbits" / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION, "the chart's appVersion and the images' tag must agree"
    podman = images.Podman()
    missing = [ref for ref in IMAGES.values() if podman.image_user(ref) is None]
    assert not missing, f"images not built: {missing}; run scripts/images.sh"
    state = Path(tempfile.mkdtemp(prefix="fewerbits-e2e-images-"))
    old = os.environ.get("FEWERBITS_E2E_RUN_MODE")
    os.environ["FEWERBITS_E2E_RUN_MODE"] = "image"  # the pod runner reads it when the cluster starts it
    try:
        c = cluster_mod.Cluster(state, with_s3=True)
        c.start()
    finally:
        if old is None:
            os.environ.pop("FEWERBITS_E2E_RUN_MODE", None)
        else:
            os.environ["FEWERBITS_E2E_RUN_MODE"] = old
    try:
        yield c
    finally:
        c.stop()
        if os.environ.get("FEWERBITS_E2E_KEEP") != "1":
            shutil.rmtree(state, ignore_errors=True)


def _container_ids(c: cluster_mod.Cluster, namespace: str) -> dict[str, str]:
    """{pod/container: containerID} of the pods of a namespace (init containers too)."""
    out = {}
    for pod in c.core().list_namespaced_pod(namespace).items:
        for st in (pod.status.init_container_statuses or []) + (pod.status.container_statuses or []):
            out[f"{pod.metadata.name}/{st.name} ({st.image})"] = st.container_id or ""
    return out


def test_demo_flow_from_images_goes_ready(image_cluster):
    c = image_cluster
    t0 = time.monotonic()
    c.add_gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    c.add_gpu_pool("l4", "NVIDIA-L4")
    c.add_cpu_node("cpu-0")
    demo.create_namespace_with_secret(c, "demo", "s3-credentials")
    # The chart as a user installs it: restricted Pod Security on the operator's namespace, the
    # operator's Deployment run from ghcr.io/fewerbits/fewerbits-operator:<appVersion>.
    demo.install_chart(c, "fewerbits-system", ["demo"])
    source = demo.upload_test_model(c)
    c.apply(demo.model_manifest(c, "demo", "tiny-llama", source, "s3-credentials"))
    lines: list[str] = []
    try:
        obj = demo.wait_ready(c, "demo", "tiny-llama", timeout=1200, out=lines.append)
    except TimeoutError:
        pods = c.state_dir / "pods"
        logs = "\n".join(f"--- {p.relative_to(pods)}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(pods.glob("*/*.log")))
        raise AssertionError("not Ready:\n" + "\n".join(lines) + "\n" + logs) from None
    elapsed = time.monotonic() - t0
    print(f"Ready in {elapsed:.0f}s from images")

    # Every container of the project's images ran from its image with podman, none as a process.
    ids = {**_container_ids(c, "fewerbits-system"), **_container_ids(c, "demo")}
    ours = {k: v for k, v in ids.items() if "ghcr.io/fewerbits/" in k}
    for name in ("fewerbits-operator", "fewerbits-quantjob", "fewerbits-runtime"):
        assert any(name in k for k in ours), f"no container of {name} ran: {json.dumps(ids, indent=1)}"
    assert all(v.startswith("podman://") for v in ours.values()), json.dumps(ours, indent=1)

    q = obj["status"]["artifacts"][0]["quality"]
    assert q["perplexity"] > 0 and q["increasePercent"] <= q["maxIncreasePercent"]
    _, answer = demo.completion(c, "demo", "tiny-llama")
    assert answer["choices"], answer

    # Nothing tried to write outside its writable mounts (the containers run with a read-only root).
    assert read_only_violations(c.state_dir / "pods") == {}


def test_a_write_outside_the_mounts_fails_with_the_path(image_cluster):
    """A container of the runtime image, with the chart's security context, writing to its root
    filesystem: the pod fails, and the check the demo test makes names the path."""
    c = image_cluster
    c.core().create_namespace({"metadata": {"name": "ro-check"}})
    c.add_cpu_node("cpu-ro")
    c.core().create_namespaced_pod("ro-check", {
        "metadata": {"name": "writer"},
        "spec": {
            "restartPolicy": "Never", "nodeName": "cpu-ro", "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532},
            "volumes": [{"name": "tmp", "emptyDir": {}}],
            "containers": [{
                "name": "writer", "image": IMAGES["runtime"],
                "command": ["python", "-c",
                            "import os; open('/tmp/ok', 'w').write('x'); print('uid', os.getuid()); "
                            "open('/opt/fewerbits-app/stray.txt', 'w')"],
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    })
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pod = c.core().read_namespaced_pod("writer", "ro-check")
        if pod.status.phase in ("Succeeded", "Failed"):
            break
        time.sleep(0.5)
    assert pod.status.phase == "Failed", pod.status
    (st,) = pod.status.container_statuses
    assert st.state.terminated.exit_code == 1 and st.container_id.startswith("podman://")
    log = c.pod_logs("ro-check", "writer")
    assert "uid 65532" in log  # the write to the emptyDir at /tmp worked, as the non-root user
    violations = read_only_violations(c.state_dir / "pods")
    assert list(violations.values()) == [["/opt/fewerbits-app/stray.txt"]], violations
