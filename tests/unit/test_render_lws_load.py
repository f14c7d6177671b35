"""Multi-node variants (LeaderWorkerSet) load their weights exactly as single-node ones do:
`spec.serving.artifactCache: Node` gives every pod of a group the node cache of the node it runs on,
`loadFormat: stream` lets the leader and every worker stream their layers with the Run:ai streamer.

There is one builder of the vLLM pod: ``render_lws`` starts from ``render_deployment``'s pod template
and changes only what a group needs (rendezvous, ranks, shared memory, the workers' probes and port,
the startup budget). The comparison below pins that: anything a future change adds to the
Deployment's pod reaches both LeaderWorkerSet templates, or this test names the difference.
"""

from __future__ import annotations

import copy

import pytest

from fewerbits_operator.serving.lws import COMPONENT_WORKER, SHM_SIZE, render_lws
from fewerbits_operator.core.nodecache import NODE_CACHE_MOUNT
from fewerbits_operator.planner import check_vllm_args
from fewerbits_operator.serving.render import render_deployment

from tests.unit.test_render_lws import OWNER, SELECTOR, SETTINGS, SPEC, VARIANT

KEY = "k" * 64
ROLES = ("leaderTemplate", "workerTemplate")
LOADS = {"pod": {}, "node": {"artifactCache": "Node"}, "stream": {"loadFormat": "stream"}}


def _spec(**serving):
    return SPEC.model_copy(update={"serving": SPEC.serving.model_copy(update=serving)})


def _render(**serving):
    spec = _spec(**serving)
    lws = render_lws(OWNER, spec, VARIANT, SELECTOR, "9.0", KEY, 673_000_000_000, 1, SETTINGS)
    dep = render_deployment(OWNER, spec, VARIANT, SELECTOR, "9.0", KEY, 673_000_000_000, 1, SETTINGS)
    return lws, dep["spec"]["template"]


def _args(pod):
    cmd = pod["containers"][0]["command"]
    return cmd[cmd.index("serve") + 1:]


@pytest.mark.parametrize("load", sorted(LOADS))
@pytest.mark.parametrize("role", ROLES)
def test_group_pods_are_the_deployments_pod_plus_the_groups_needs(load, role):
    lws, dep = _render(**LOADS[load])
    tpl = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"][role])
    pod, base = tpl["spec"], copy.deepcopy(dep["spec"])
    # What a group changes, and nothing else.
    assert pod.pop("terminationGracePeriodSeconds") == 120
    base.pop("terminationGracePeriodSeconds")
    vllm, bvllm = pod["containers"][0], base["containers"][0]
    assert vllm["command"][:len(bvllm["command"])] == bvllm["command"]  # the same argv, then rank flags
    vllm.pop("command"), bvllm.pop("command")
    vllm["env"] = [e for e in vllm["env"] if e not in bvllm["env"]]
    assert {e["name"] for e in vllm.pop("env")} == {"VLLM_HOST_IP", "NCCL_DEBUG", "VLLM_RPC_TIMEOUT"}
    bvllm.pop("env")
    for c in (vllm, bvllm):
        c.pop("ports")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            c.pop(probe, None)
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["sizeLimit"] == SHM_SIZE
    shm["emptyDir"] = next(v for v in base["volumes"] if v["name"] == "shm")["emptyDir"]
    assert pod == base
    assert tpl["metadata"]["annotations"] == dep["metadata"]["annotations"]


@pytest.mark.parametrize("role", ROLES)
def test_node_cache_in_every_pod_of_the_group(role):
    """Each pod of a group runs on its own node and fetches into (or hits) that node's cache; vLLM
    mounts its entry read-only."""
    lws, _ = _render(artifactCache="Node")
    pod = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["hostPath"]["path"] == SETTINGS.node_cache_root
    (init,) = pod["initContainers"]
    assert init["args"][init["args"].index("--node-cache") + 1] == NODE_CACHE_MOUNT and "--dest" not in init["args"]
    assert {"name": "models", "mountPath": NODE_CACHE_MOUNT} in init["volumeMounts"]
    assert {"name": "models", "mountPath": f"/models/{KEY}", "subPath": f"artifacts/{KEY}", "readOnly": True} \
        in pod["containers"][0]["volumeMounts"]
    assert _args(pod)[0] == f"/models/{KEY}"


@pytest.mark.parametrize("role", ROLES)
def test_stream_in_every_pod_of_the_group(role):
    """The leader and every headless worker stream their own pipeline stage's layers from S3 with
    the Run:ai streamer; credentials from the Secret only; the init container checks the manifest."""
    lws, _ = _render(loadFormat="stream")
    tpl = lws["spec"]["leaderWorkerTemplate"][role]
    pod = tpl["spec"]
    args = _args(pod)
    assert args[0] == f"s3://bkt/q/{KEY}/files/"
    assert args[args.index("--load-format") + 1] == "runai_streamer"
    rest = [a.replace("$(LWS_LEADER_ADDRESS)", "dsv3-0.dsv3").replace("$(LWS_WORKER_INDEX)", "1") for a in args[1:]]
    assert check_vllm_args(rest) == []
    assert ("--headless" in rest) == (role == "workerTemplate")
    assert (tpl["metadata"]["labels"]["app.kubernetes.io/component"] == COMPONENT_WORKER) == (role == "workerTemplate")
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
    assert "--manifest-only" in pod["initContainers"][0]["args"]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models == {"name": "models", "emptyDir": {"sizeLimit": "64Mi"}}  # the manifest only, not 673 GB
