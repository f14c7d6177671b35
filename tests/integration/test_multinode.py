"""Multi-node serving end to end: a model whose plan needs 2 nodes per replica on an H100 x8 pool of
4 nodes is served by a LeaderWorkerSet (e2e/addons/lws.py runs the real controller and webhooks),
goes Ready, scales from 1 to 2 groups on KV pressure read from the leaders, and survives the
deletion of a worker pod.

The source is a stand-in for Llama-3.1-405B: the repository's 405B config.json (so the operator
plans exactly what it would for the real model: 756 GiB at 16 bits, 2 nodes of 8 H100s) next to the
tiny test model's weights (format none publishes the weights unchanged, without loading them, and
llm-d-inference-sim plays vLLM in every pod), because 756 GiB of weights and 16 GPUs cannot run here.

Simulator: every pod of the groups runs the operator's default vLLM image, played by
llm-d-inference-sim, because the 405B config.json next to the tiny weights is no model a real vLLM
could load, the scale-up and worker-loss steps start a pod per node, and the scale-up needs KV
pressure held on the leaders (`POST /admin/config`). The leader and worker command lines themselves
run on real vLLM, one pipeline stage per pod, in e2e/tests/test_vllm_cpu_serve.py.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from e2e import demo
from e2e.addons.lws import fail_worker
from tests.integration.operator_harness import Models, OperatorProcess
from tests.integration.test_autoscaling import set_load

pytestmark = [pytest.mark.cluster, pytest.mark.quantize]

REPO = Path(__file__).resolve().parents[2]
LLAMA405_CONFIG = REPO / "tests" / "unit" / "fixtures" / "model_configs" / "llama-3.1-405b.json"
GROUP, VERSION, PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
PREFIX = "fewerbits-test/llama-405b-standin"


def upload_standin(cluster) -> str:
    """The tiny model's files under a new prefix, with the 405B config.json."""
    from tests.testmodel import build_test_model

    demo.upload_test_model(cluster)  # buckets
    local = Path(build_test_model())
    s3 = cluster.s3.client()
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        key = f"{PREFIX}/{path.relative_to(local)}"
        if path.name == "config.json" and path.parent == local:
            s3.put_object(Bucket=demo.MODEL_BUCKET, Key=key, Body=LLAMA405_CONFIG.read_bytes())
        else:
            s3.upload_file(str(path), demo.MODEL_BUCKET, key)
    return f"s3://{demo.MODEL_BUCKET}/{PREFIX}"


def container_argv(cluster, namespace: str, pod: str, container: str = "vllm") -> list[str]:
    """The container's command and args as the pod runner started it, $(VAR) expanded."""
    argv = cluster.container_argv(namespace, pod, container)
    assert argv is not None, f"{namespace}/{pod} {container} has not started"
    return argv


@pytest.fixture
def namespace(cluster):
    """An `mn-` namespace, watched by this module's own operator only (the session's watches `t-*`)."""
    name = f"mn-{uuid.uuid4().hex[:8]}"
    api = client.CoreV1Api(cluster.api_client())
    api.create_namespace({"metadata": {"name": name}})
    yield name
    api.delete_namespace(name)


@pytest.fixture
def models(cluster, crds_installed, lws, tmp_path):
    """This module's own operator, started after LeaderWorkerSet is served. The stand-in's copy Job
    is sized for 405B (about 1.6 TB of work disk: source and output); this harness has no volume
    provisioner for the generic ephemeral volume such a Job gets, so here its work directory stays
    an emptyDir (the threshold raised), which the GPU nodes' ephemeral storage holds."""
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", env_extra={
        "FEWERBITS_NAMESPACES": '["mn-*"]', "FEWERBITS_JOB_VOLUME_THRESHOLD_GIB": "100000"}).start()
    try:
        yield Models(cluster.api_client(), op)
    finally:
        op.stop()


def test_model_spanning_two_nodes_ready_scales_and_survives_a_worker_loss(cluster, lws, gpu_pool, namespace,
                                                                         models, model_spec):
    gpu_pool("mnh100", "NVIDIA-H100-80GB-HBM3", nodes=4, gpus_per_node=8)
    source = upload_standin(cluster)
    spec = model_spec(quantization={"format": "none"},
                      autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetKVCacheUsage": 0.7,
                                   "scaleDownDelaySeconds": 600})
    spec["source"] = {**spec["source"], "uri": source}
    models.apply(namespace, "big", spec)
    models.wait_condition(namespace, "big", "Ready", timeout=600)

    api = cluster.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    status = models.get(namespace, "big")["status"]
    (variant,) = status["plan"]["variants"]
    assert (variant["nodesPerReplica"], variant["tensorParallelSize"], variant["format"]) == (2, 8, "none")
    assert status["serving"][0]["nodesPerReplica"] == 2
    assert models.deployments(namespace, "big") == []  # no Deployment: a LeaderWorkerSet
    name = status["serving"][0]["deployment"]
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    assert obj["spec"]["leaderWorkerTemplate"]["size"] == 2 and obj["spec"]["replicas"] == 1

    def pods(component=None):
        sel = "fewerbits.io/model=big" + (f",app.kubernetes.io/component={component}" if component else "")
        return [p for p in core.list_namespaced_pod(namespace, label_selector=sel).items
                if p.status.pod_ip and not p.metadata.deletion_timestamp]

    group = pods()
    assert len(group) == 2 and len({p.spec.node_name for p in group}) == 2  # one pod per node
    for p in group:
        assert p.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8"
        assert [c.name for c in p.spec.init_containers] == ["fetch"]
    # The live pods' command lines with LWS's variables expanded (what the runner handed the
    # "runtime"; the simulator then plays vLLM): rank from LWS_WORKER_INDEX, the leader's address.
    ranks = []
    for p in group:
        argv = container_argv(cluster, namespace, p.metadata.name)
        env = {e.name: e.value for e in p.spec.containers[0].env or []}
        assert not [a for a in argv if "$(" in a], argv
        assert env["LWS_LEADER_ADDRESS"] and argv[argv.index("--master-addr") + 1] == env["LWS_LEADER_ADDRESS"], argv
        ranks.append(argv[argv.index("--node-rank") + 1])
        assert ranks[-1] == env["LWS_WORKER_INDEX"], (argv, env)
    assert sorted(ranks) == ["0", "1"], ranks
    # The Service answers through the leader.
    url, answer = demo.completion(cluster, namespace, "big")
    assert answer["choices"]

    # KV pressure on the leader: 1 -> 2 groups through the LeaderWorkerSet's scale subresource.
    def groups():
        return custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, name)["spec"]["replicas"]

    deadline = time.monotonic() + 60
    while groups() < 2:
        assert time.monotonic() < deadline, f"no scale-up on KV 0.95\n{models.operator.log_tail()}"
        set_load(core, namespace, "big", 0.95, 0, 4)  # every simulator; the autoscaler reads the leaders
        time.sleep(0.5)
    try:
        models.wait("2 groups ready", lambda: (custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name).get("status") or {}).get("readyReplicas") == 2, timeout=300,
            namespace=namespace, name="big")
    except AssertionError as e:
        seen = [(p.metadata.name, p.spec.node_name, p.status.phase,
                 [(c.type, c.status) for c in p.status.conditions or []])
                for p in core.list_namespaced_pod(namespace, label_selector="fewerbits.io/model=big").items]
        raise AssertionError(f"pods: {seen}") from e
    assert len(pods()) == 4
    set_load(core, namespace, "big", 0.7, 0, 4)  # at the target: the count stays
    events = [e for e in models.events(namespace, "big") if e.reason == "ScaledUp"]
    assert events and name in events[0].message

    # A worker pod lost: its group is recreated, the model is Ready again with 2 groups.
    worker = next(p for p in pods("server-worker"))
    leader_name = worker.metadata.name.rsplit("-", 1)[0]  # <lws>-<group>-<index> -> <lws>-<group>
    leader_uid = core.read_namespaced_pod(leader_name, namespace).metadata.uid
    fail_worker(core, namespace, worker.metadata.name)  # Terminating until LWS reacts, as with a kubelet

    def recovered():
        try:
            leader = core.read_namespaced_pod(leader_name, namespace)
        except client.exceptions.ApiException:
            return False
        st = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name).get("status") or {}
        return leader.metadata.uid != leader_uid and st.get("readyReplicas") == 2

    models.wait("the group recreated and ready", recovered, timeout=180, namespace=namespace, name="big")
    # The model's status follows the groups (the operator re-reads them on its resync).
    models.wait("status.replicas 2/2 and Ready", lambda: (st := models.get(namespace, "big")["status"])["replicas"]
                == "2/2" and any(c["type"] == "Ready" and c["status"] == "True" for c in st["conditions"]),
                timeout=60, namespace=namespace, name="big")
