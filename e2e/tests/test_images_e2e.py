"""The demo flow with the operator, the quantization Job and the serving pod's fetcher all running
from their images pulled from a registry by digest, as a kubelet would (podman, the pod runner's
image mode); vLLM is still the simulator.

Needs the images pushed to the harness's registry and their digests in images/digests.json:
`scripts/release-check.sh` does all of it (build the registry and the images, push, this test) and
is how this test is run; by hand, with the images pushed:

    FEWERBITS_E2E_REGISTRY=127.0.0.1:PORT scripts/test.sh -m images e2e/tests/test_images_e2e.py

(without FEWERBITS_E2E_REGISTRY the test starts the registry on the cache's blobs, e2e/registry.py).
Marked `images` and deselected by default (pyproject.toml). A missing image fails, never skips.

The chart is installed as the README tells a user with their own registry: each image's
`repository` and `digest` set. The runner's podman storage starts empty (a node's), so every
container of the project's images runs from what was pulled from the registry by that digest.
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
from e2e import demo, images, registry, versions

pytestmark = pytest.mark.images

NAMES = ("operator", "quantjob", "runtime")
CHART_KEYS = {"operator": "image", "quantjob": "quantjobImage", "runtime": "runtimeImage"}
ENTRYPOINTS = {"operator": "fewerbits_operator", "quantjob": "fewerbits_quantjob", "runtime": "fewerbits_runtime"}
DIGESTS = images.REPO / "images" / "digests.json"


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((images.REPO / "pyproject.toml").read_text())


VERSION = _pyproject()["project"]["version"]


IMPORTS = images.load_check(images.REPO / "images" / "check" / "imports.py")
REQUIREMENTS = images.load_check(images.REPO / "images" / "steps" / "requirements.py")


@pytest.fixture(scope="module")
def pushed():
    """{name: REGISTRY/fewerbits-<name>@sha256:...} of the images in the registry, and the registry."""
    assert DIGESTS.is_file(), f"{DIGESTS} missing: scripts/release-check.sh pushes the images and writes it"
    doc = json.loads(DIGESTS.read_text())
    assert doc["version"] == VERSION, f"{DIGESTS} is of version {doc['version']}, the project is {VERSION}"
    reg = None
    address = os.environ.get("FEWERBITS_E2E_REGISTRY")
    if not address:
        reg = registry.Registry().start()
        address = reg.address
    refs = {}
    for n in NAMES:
        entry = doc["images"].get(f"fewerbits-{n}")
        assert entry, f"fewerbits-{n} not in {DIGESTS}: scripts/release-check.sh"
        refs[n] = f"{address}/fewerbits-{n}@{entry['digest']}"
    try:
        yield refs, doc
    finally:
        if reg is not None:
            reg.stop()


SHARED_STORE = os.environ.get("FEWERBITS_E2E_NODE_STORE") == "shared"


@pytest.fixture(scope="module")
def node_store(pushed):
    """The runner's podman storage, none of the pushed references in it. By default an empty storage
    of its own (a node's), removed afterwards. With FEWERBITS_E2E_NODE_STORE=shared (when the disk
    cannot hold a second copy of the 5.7 GB quantjob image): scripts/images.sh's storage, the built
    images' local tags removed first, so each image is still pulled from the registry by digest, its
    layers already there reused as a node that has them reuses them."""
    refs, _ = pushed
    if SHARED_STORE:
        podman = images.Podman()
        local = os.environ.get("FEWERBITS_IMAGE_REGISTRY", "ghcr.io/fewerbits")
        for n, ref in refs.items():
            podman.run("untag", f"{local}/fewerbits-{n}:{VERSION}", check=False)
            if podman.image_user(ref) is not None:  # pulled by an earlier run through this address
                podman.run("rmi", "--force", ref, check=False)
    else:
        podman = images.Podman(versions.cache_dir() / "images" / f"node-{os.getpid()}")
    assert not set(refs.values()) & podman.digests(), "the pushed images must not be in the storage before"
    try:
        yield podman
    finally:
        if not SHARED_STORE:
            podman.remove_store()


def read_only_violations(pods_dir: Path) -> dict[str, list[str]]:
    """{log file: paths a container could not write because its root filesystem is read-only}."""
    out = {}
    for log in sorted(pods_dir.glob("*/*.log")):
        paths = images.read_only_violations(log.read_text(errors="replace"))
        if paths:
            out[str(log.relative_to(pods_dir))] = paths
    return out


@pytest.fixture(scope="module")
def image_cluster(pushed, node_store):
    import yaml

    chart = yaml.safe_load((images.REPO / "charts" / "fewerbits" / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION, "the chart's appVersion and the images' tag must agree"
    state = Path(tempfile.mkdtemp(prefix="fewerbits-e2e-images-"))
    # The pod runner reads both when the cluster starts it: image mode, on the empty node storage.
    runner_env = {"FEWERBITS_E2E_RUN_MODE": "image", images.STORE_ENV: str(node_store.store or "")}
    old = {k: os.environ.get(k) for k in runner_env}
    os.environ.update(runner_env)
    try:
        c = cluster_mod.Cluster(state, with_s3=True)
        c.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
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


def chart_sets(refs: dict[str, str]) -> list[str]:
    """What the README tells a user with their own registry: each image's repository and digest."""
    sets = []
    for n, ref in refs.items():
        repo, _, digest = ref.partition("@")
        sets += ["--set", f"{CHART_KEYS[n]}.repository={repo}", "--set", f"{CHART_KEYS[n]}.digest={digest}"]
    return sets


def test_demo_flow_from_images_pulled_by_digest_goes_ready(image_cluster, pushed, node_store):
    c = image_cluster
    refs, _ = pushed
    t0 = time.monotonic()
    c.add_gpu_pool("h100", "NVIDIA-H100-80GB-HBM3")
    c.add_gpu_pool("l4", "NVIDIA-L4")
    c.add_cpu_node("cpu-0")
    demo.create_namespace_with_secret(c, "demo", "s3-credentials")
    # The chart as a user installs it: restricted Pod Security on the operator's namespace, the
    # operator's Deployment, the Job and the fetcher named by the registry's digests.
    demo.install_chart(c, "fewerbits-system", ["demo"], extra=chart_sets(refs))
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
    print(f"Ready in {elapsed:.0f}s from images pulled by digest")

    # Every container of the project's images ran from its image by digest with podman, none as a
    # process, and the node's storage holds exactly what was pulled: the three digests.
    ids = {**_container_ids(c, "fewerbits-system"), **_container_ids(c, "demo")}
    ours = {k: v for k, v in ids.items() if "fewerbits-" in k.split("(", 1)[1]}
    for n, ref in refs.items():
        assert any(k.endswith(f"({ref})") for k in ours), f"no container of {ref} ran: {json.dumps(ids, indent=1)}"
    assert all(v.startswith("podman://") for v in ours.values()), json.dumps(ours, indent=1)
    pulled = node_store.digests()
    assert pulled >= set(refs.values()) and (SHARED_STORE or pulled == set(refs.values())), pulled

    q = obj["status"]["artifacts"][0]["quality"]
    assert q["perplexity"] > 0 and q["increasePercent"] <= q["maxIncreasePercent"]
    _, answer = demo.completion(c, "demo", "tiny-llama")
    assert answer["choices"], answer

    # Nothing tried to write outside its writable mounts (the containers run with a read-only root).
    assert read_only_violations(c.state_dir / "pods") == {}


@pytest.mark.parametrize("name", NAMES)
def test_each_images_sbom_lists_what_its_code_imports(name, pushed, node_store):
    """The image pulled by digest, asked from inside what its entrypoint's code imports (and which
    distribution provides each): every one, and every pin the image declares, is in its committed
    SBOM, which is the one written for this digest."""
    refs, doc = pushed
    ref, entry = refs[name], doc["images"][f"fewerbits-{name}"]
    sbom_path = images.REPO / entry["sbom"]
    import hashlib

    assert hashlib.sha256(sbom_path.read_bytes()).hexdigest() == entry["sbom_sha256"], \
        f"{sbom_path} is not the SBOM written for {ref}: scripts/release-check.sh"
    if node_store.image_user(ref) is None:
        assert node_store.pull(ref) == ""
    r = node_store.run("run", "--rm", "--network", "none", "--read-only", "--cap-drop", "ALL",
                       "-v", f"{images.REPO / 'images' / 'check'}:/check:ro", "--entrypoint", "python",
                       ref, "-I", "/check/imports.py", ENTRYPOINTS[name], check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    scanned = json.loads(r.stdout)
    declared = REQUIREMENTS.requirements(name, _pyproject())
    assert IMPORTS.sbom_problems(scanned, json.loads(sbom_path.read_text()), declared) == []
    # Not vacuous: the imports the issue named are found, with the distribution that provides them.
    expected = {"operator": {"kopf": ["kopf"]}, "quantjob": {"lm_eval": ["lm-eval"], "torch": ["torch"]},
                "runtime": {"boto3": ["boto3"]}}[name]
    got = {k: [IMPORTS.normalize(d) for d in scanned["imports"].get(k, {}).get("distributions", [])] for k in expected}
    assert got == expected, scanned["imports"]


def test_a_write_outside_the_mounts_fails_with_the_path(image_cluster, pushed):
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
                "name": "writer", "image": pushed[0]["runtime"],
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
