"""The LeaderWorkerSet of a multi-node variant: a golden file plus the properties that matter
(leaders alone behind the Service, the launcher and fetch in every pod, GPUs per pod, ranks,
shared memory, restricted pod security, startup budgets that grow with size)."""

from __future__ import annotations

import pytest

from fewerbits_api.quantizedmodel import PlanVariant, QuantizedModelSpec
from fewerbits_operator.serving.lws import (
    COMPONENT_WORKER,
    LWS_API_VERSION,
    leader_selector,
    lws_status,
    render_lws,
    startup_budget_multinode,
)
from fewerbits_operator.planner import check_vllm_args
from fewerbits_operator.serving.render import POD_SECURITY, Owner, render_deployment, render_service, startup_budget_seconds
from fewerbits_operator.base.settings import OperatorSettings

from tests.unit.test_render import golden

OWNER = Owner("dsv3", "ml", "0b1c2d3e-0000-4000-8000-000000000009")
SETTINGS = OperatorSettings(quantjob_image="ghcr.io/fewerbits/fewerbits-quantjob:0.1.0",
                            runtime_image="ghcr.io/fewerbits/fewerbits-runtime:0.1.0")
SPEC = QuantizedModelSpec.model_validate({
    "source": {"uri": "hf://deepseek-ai/DeepSeek-V3", "revision": "abc"},
    "storage": {"uri": "s3://bkt/q", "endpoint": "http://minio.storage:9000", "credentialsSecret": "s3"},
})
VARIANT = PlanVariant(pool="h100-80gb-hbm3-x8", gpuProduct="NVIDIA-H100-80GB-HBM3", family="hopper",
                      format="fp8-block", kvCacheDtype="fp8", dtype="bfloat16", tensorParallelSize=8,
                      maxModelLen=163840, weightsGiB=626.8, kvCacheTokens=1645970, decodeTokensPerSecond=701.0,
                      servedAsIs=True, nodesPerReplica=2)
SELECTOR = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8"}


def lws(replicas=1, variant=VARIANT):
    return render_lws(OWNER, SPEC, variant, SELECTOR, "9.0", "k" * 64, 673_000_000_000, replicas, SETTINGS)


def test_golden():
    golden("leaderworkerset.yaml", lws())


def test_shape_and_service_selects_leaders_only():
    obj = lws(replicas=3)
    assert obj["apiVersion"] == LWS_API_VERSION and obj["kind"] == "LeaderWorkerSet"
    assert obj["metadata"]["name"] == "dsv3-h100-80gb-hbm3-x8"
    assert obj["spec"]["replicas"] == 3
    tpl = obj["spec"]["leaderWorkerTemplate"]
    assert tpl["size"] == 2 and tpl["restartPolicy"] == "RecreateGroupOnPodRestart"
    selector = render_service(OWNER)["spec"]["selector"]
    leader_labels, worker_labels = tpl["leaderTemplate"]["metadata"]["labels"], tpl["workerTemplate"]["metadata"]["labels"]
    assert all(leader_labels.get(k) == v for k, v in selector.items())
    assert not all(worker_labels.get(k) == v for k, v in selector.items())
    assert worker_labels["app.kubernetes.io/component"] == COMPONENT_WORKER
    assert set(leader_selector("dsv3", VARIANT.pool).items()) - {("leaderworkerset.sigs.k8s.io/worker-index", "0")} \
        <= set(leader_labels.items())


@pytest.mark.parametrize("role", ["leaderTemplate", "workerTemplate"])
def test_every_pod_fetches_launches_checks_its_gpu_and_is_restricted(role):
    pod = lws()["spec"]["leaderWorkerTemplate"][role]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["fetch"]
    (vllm,) = pod["containers"]
    cmd = vllm["command"]
    assert cmd[:4] == ["python3", "-m", "fewerbits_runtime", "launch"] and "--node-cc" in cmd
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "8" == vllm["resources"]["requests"]["nvidia.com/gpu"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in vllm["volumeMounts"]
    assert any(e["name"] == "NCCL_DEBUG" for e in vllm["env"])
    # restricted Pod Security Standard
    assert pod["securityContext"] == POD_SECURITY
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["automountServiceAccountToken"] is False
    # vLLM's own parser accepts each role's arguments (the LWS variables stand for a host and a rank).
    args = cmd[cmd.index("serve") + 2:]
    args = [a.replace("$(LWS_LEADER_ADDRESS)", "dsv3-0.dsv3").replace("$(LWS_WORKER_INDEX)", "1") for a in args]
    assert check_vllm_args(args) == []
    assert args[args.index("--pipeline-parallel-size") + 1] == "2" and args[args.index("--nnodes") + 1] == "2"
    if role == "workerTemplate":
        assert args[-1] == "--headless" and "readinessProbe" not in vllm
        assert args[args.index("--node-rank") + 1] == "1"
    else:
        assert "--headless" not in args and args[args.index("--node-rank") + 1] == "0"
        assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"


def test_startup_budget_grows_with_size():
    assert startup_budget_multinode(626.8, 2) > startup_budget_seconds(626.8)
    assert startup_budget_multinode(626.8, 4) > startup_budget_multinode(626.8, 2)
    probe = lws()["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= startup_budget_multinode(626.8, 2)


def test_spec_hash_ignores_replicas_and_follows_the_artifact():
    a, b = lws(1), lws(2)
    h = "fewerbits.io/spec-hash"
    assert a["metadata"]["annotations"][h] == b["metadata"]["annotations"][h]
    other = render_lws(OWNER, SPEC, VARIANT, SELECTOR, "9.0", "j" * 64, None, 1, SETTINGS)
    assert other["metadata"]["annotations"][h] != a["metadata"]["annotations"][h]


def test_single_node_variants_stay_deployments():
    single = VARIANT.model_copy(update={"nodesPerReplica": 1})
    with pytest.raises(AssertionError):
        lws(variant=single)
    assert render_deployment(OWNER, SPEC, single, SELECTOR, "9.0", "k" * 64, None, 1, SETTINGS)["kind"] == "Deployment"


def test_status_reading():
    obj = {"metadata": {"generation": 2}, "spec": {"replicas": 2},
           "status": {"readyReplicas": 1, "updatedReplicas": 2,
                      "conditions": [{"type": "Available", "status": "True", "observedGeneration": 2}]}}
    assert lws_status(obj) == (2, 1, 2, True)
