"""LeaderWorkerSet for variants whose replica spans nodes (``nodesPerReplica`` > 1): rendering and
the facts reconcile reads from it. Pure: no I/O.

One LeaderWorkerSet per multi-node variant, named like the Deployment a single-node variant gets
(``<model>-<pool>``). Each of its replicas is a group of ``nodesPerReplica`` pods, one per node
(each pod asks for all ``tensorParallelSize`` GPUs of its node): the leader (node rank 0) runs
vLLM's API server and is the only pod the model's Service selects; the workers run
``vllm serve --headless`` with their node rank. Every pod fetches the artifact (each pipeline
stage loads its own layers from a local copy) and starts through the runtime's launcher, which
checks that pod's GPU before vLLM starts.

vLLM's processes find each other through ``--master-addr`` = the leader's stable DNS name, which
LeaderWorkerSet's pod webhook puts into every container as ``LWS_LEADER_ADDRESS`` (and the node rank
as ``LWS_WORKER_INDEX``); Kubernetes expands ``$(VAR)`` in a container's command from its env.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from fewerbits_api.quantizedmodel import PlanVariant, QuantizedModelSpec

from fewerbits_operator.serving.render import (
    ANNOTATION_ARTIFACT_KEY,
    ANNOTATION_SPEC_HASH,
    LABEL_COMPONENT,
    LABEL_MODEL,
    LABEL_VARIANT,
    Owner,
    _fresh,
    deployment_name,
    render_deployment,
    spec_hash,
    startup_budget_seconds,
)
from fewerbits_operator.base.apis import LWS_API_VERSION, LWS_CRD, LWS_GROUP, LWS_KIND, LWS_PLURAL, LWS_VERSION  # noqa: F401  (re-exported)
from fewerbits_operator.base.settings import OperatorSettings

INSTALL_LWS = (
    "install LeaderWorkerSet (https://lws.sigs.k8s.io, CRD leaderworkersets.leaderworkerset.x-k8s.io): this "
    "variant's replica spans {nodes} nodes; single-node variants are served as usual")

COMPONENT_WORKER = "server-worker"
"""Workers carry this component label, not ``server``: the Service selects leaders only."""
MASTER_PORT = 29501
"""vLLM's default ``--master-port`` for its multiprocessing executor across nodes."""
RENDEZVOUS_SECONDS_PER_NODE = 120
"""Added to the startup budget per node beyond the first: the group starts together (the leader
waits for every worker's processes to join), and the slowest node's fetch sets the pace."""
SHM_SIZE = "16Gi"
"""/dev/shm (memory-backed): NCCL's intra-node transport and vLLM's message queues between a
node's workers; pipeline stages hand activations through it too."""

NCCL_ENV = (
    # Which process answers and where: vLLM and torch.distributed bind to the pod's IP.
    {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    # Enough to diagnose a hang across nodes without flooding the log.
    {"name": "NCCL_DEBUG", "value": "WARN"},
    # A stage that waits for its peer longer than this is a lost node: fail, and LeaderWorkerSet
    # recreates the group (the default waits ten minutes).
    {"name": "VLLM_RPC_TIMEOUT", "value": "300000"},
)


def lws_name(model: str, pool: str) -> str:
    return deployment_name(model, pool)


def startup_budget_multinode(weights_gib: float, nodes: int) -> int:
    """The single-node budget for the whole artifact (each pod fetches and checks all of it) plus
    a rendezvous allowance per extra node."""
    return startup_budget_seconds(weights_gib) + RENDEZVOUS_SECONDS_PER_NODE * max(0, nodes - 1)


def leader_args() -> list[str]:
    """What the leader adds to the shared command line: rank 0 and the rendezvous (the leader's own
    stable name, which LeaderWorkerSet puts in LWS_LEADER_ADDRESS; the kubelet expands it)."""
    return ["--node-rank", "0", "--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", str(MASTER_PORT)]


def worker_args() -> list[str]:
    """What a worker adds: its rank (LWS_WORKER_INDEX), the leader's rendezvous, and no API server."""
    return ["--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)",
            "--master-port", str(MASTER_PORT), "--headless"]


def _split_command(command: list[str]) -> tuple[list[str], list[str]]:
    i = command.index("serve")
    return command[: i + 1], command[i + 1:]


def _worker_template(template: dict[str, Any], command: list[str]) -> dict[str, Any]:
    """A worker's pod: the leader's, headless. It serves no HTTP: its health is the group's (the
    leader's probes, and LeaderWorkerSet recreating the group when any pod fails)."""
    worker = _fresh(template)
    worker["metadata"]["labels"][LABEL_COMPONENT] = COMPONENT_WORKER
    wc = worker["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        wc.pop(probe, None)
    wc["ports"] = [p for p in wc["ports"] if p["name"] != "http"]
    wc["command"] = command
    return worker


def render_lws(
    owner: Owner,
    spec: QuantizedModelSpec,
    variant: PlanVariant,
    node_selector: dict[str, str],
    compute_capability: str,
    artifact_key: str,
    artifact_bytes: int | None,
    replicas: int,
    settings: OperatorSettings,
    adapters: tuple = (),
) -> dict[str, Any]:
    """The LeaderWorkerSet of a multi-node variant (``replicas`` = groups)."""
    nodes = variant.nodesPerReplica
    assert nodes > 1, "single-node variants are Deployments"
    # The single-node pod is the base: same fetch init container, launcher, security, volumes.
    base = render_deployment(owner, spec, variant, node_selector, compute_capability, artifact_key,
                             artifact_bytes, replicas, settings, adapters)
    template = base["spec"]["template"]
    budget = startup_budget_multinode(variant.weightsGiB, nodes)
    pod = template["spec"]
    pod["terminationGracePeriodSeconds"] = 120
    for v in pod["volumes"]:
        if v["name"] == "shm":
            v["emptyDir"] = {"medium": "Memory", "sizeLimit": SHM_SIZE}
    vllm = pod["containers"][0]
    vllm["env"] += [dict(e) for e in NCCL_ENV]
    vllm["ports"].append({"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"})
    head, rest = _split_command(vllm["command"])
    probe_fail = math.ceil(budget / 10)
    vllm["startupProbe"]["failureThreshold"] = probe_fail

    leader = _fresh(template)
    leader["spec"]["containers"][0]["command"] = head + rest + leader_args()
    worker = _worker_template(template, head + rest + worker_args())
    lws_spec = _lws_spec(nodes, leader, worker)
    labels = dict(base["metadata"]["labels"])
    return _fresh({
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": {
            "name": lws_name(owner.name, variant.pool),
            "namespace": owner.namespace,
            "labels": labels,
            "annotations": {ANNOTATION_SPEC_HASH: spec_hash(lws_spec), ANNOTATION_ARTIFACT_KEY: artifact_key},
            "ownerReferences": [owner.reference()],
        },
        "spec": {**lws_spec, "replicas": replicas},
    })


def _lws_spec(nodes: int, leader: dict[str, Any], worker: dict[str, Any]) -> dict[str, Any]:
    """The LeaderWorkerSet's spec but its replicas (what its spec hash covers)."""
    return {
        "leaderWorkerTemplate": {
            "size": nodes,
            # A failed or deleted pod takes its group down and back up: vLLM's stages cannot
            # re-join a running group one by one.
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": leader,
            "workerTemplate": worker,
        },
        # Workers start with the leader (it is Ready only once they joined: LeaderReady would wait forever).
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {"type": "RollingUpdate",
                            "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
        "networkConfig": {"subdomainPolicy": "Shared"},
    }


def lws_status(obj: Mapping[str, Any]) -> tuple[int, int, int, bool]:
    """(groups wanted, groups ready, groups updated, whether the controller saw this generation)
    of a LeaderWorkerSet as the API server returns it."""
    st = obj.get("status") or {}
    replicas = int((obj.get("spec") or {}).get("replicas") or 0)
    ready = int(st.get("readyReplicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    seen = all(int(c.get("observedGeneration") or 0) >= int((obj.get("metadata") or {}).get("generation") or 0)
               for c in conds.values() if "observedGeneration" in c)
    return replicas, ready, updated, seen


def leader_selector(model: str, pool: str) -> dict[str, str]:
    """Labels of a variant's leader pods (metrics are read from these: each serves one group)."""
    return {LABEL_MODEL: model, LABEL_VARIANT: pool, LABEL_COMPONENT: "server",
            "leaderworkerset.sigs.k8s.io/worker-index": "0"}
