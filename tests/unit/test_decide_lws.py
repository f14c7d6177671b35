"""Multi-node variants in reconcile's decisions: a LeaderWorkerSet where the API exists, a refusal
that names it where it does not (single-node variants unaffected), status read from its groups."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from fewerbits_api import conditions as C
from fewerbits_operator.core.decide import CreateDeployment, DeleteDeployment, decide
from fewerbits_operator.planner import pool_from_product, shape_from_config
from tests.unit.test_decide import NS, SETTINGS, World

CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"
LLAMA405 = shape_from_config(json.loads((CONFIGS / "llama-3.1-405b.json").read_text()), where="test")
H100X8X2 = pool_from_product("NVIDIA-H100-80GB-HBM3", 8, 2)
H200X8 = pool_from_product("NVIDIA-H200", 8)


def world(pools) -> World:
    w = World(shape=LLAMA405, pools=list(pools))
    w.spec["quantization"] = {**w.spec["quantization"], "format": "none"}
    w.publish()
    return w


def created(outcome):
    return {a.deployment["metadata"]["name"]: a.deployment for a in outcome.actions if isinstance(a, CreateDeployment)}


def cond(outcome, type_):
    return next(c for c in outcome.status.conditions if c.type == type_)


def test_multinode_variant_is_a_leaderworkerset_next_to_a_single_node_deployment():
    w = world([H100X8X2, H200X8])
    out = decide(dataclasses.replace(w.observed(), lws_available=True), SETTINGS)
    objs = created(out)
    assert {n: o["kind"] for n, o in objs.items()} == {"m-h100-80gb-hbm3-x8": "LeaderWorkerSet",
                                                      "m-h200-x8": "Deployment"}
    assert objs["m-h100-80gb-hbm3-x8"]["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert {s.variant: s.nodesPerReplica for s in out.status.serving} == {"h100-80gb-hbm3-x8": 2, "h200-x8": 1}
    assert {v.pool: v.nodesPerReplica for v in out.status.plan.variants} == {"h100-80gb-hbm3-x8": 2, "h200-x8": 1}


def test_without_leaderworkerset_the_multinode_variant_is_refused_and_nothing_else_changes():
    w = world([H100X8X2, H200X8])
    with_lws = decide(dataclasses.replace(w.observed(), lws_available=True), SETTINGS)
    out = decide(dataclasses.replace(w.observed(), lws_available=False), SETTINGS)
    assert set(created(out)) == {"m-h200-x8"}
    assert created(out)["m-h200-x8"] == created(with_lws)["m-h200-x8"]
    deployed = cond(out, C.DEPLOYED)
    assert deployed.status == "False" and "install LeaderWorkerSet" in deployed.message
    assert "h100-80gb-hbm3-x8" in deployed.message
    # The plan still shows the variant and its node count: the user sees what it would take.
    assert [v.nodesPerReplica for v in out.status.plan.variants if v.pool == "h100-80gb-hbm3-x8"] == [2]


def test_kind_change_replaces_the_object():
    w = world([H100X8X2])
    first = created(decide(dataclasses.replace(w.observed(), lws_available=True), SETTINGS))
    (lws,) = first.values()
    # The same name held a Deployment (an older plan on one node): it is deleted, the LWS created.
    stale = {**json.loads(json.dumps(lws)), "kind": "Deployment"}
    stale["metadata"].update(resourceVersion="5", generation=1)
    w.deployments = {lws["metadata"]["name"]: stale}
    out = decide(dataclasses.replace(w.observed(), lws_available=True), SETTINGS)
    deletes = [a for a in out.actions if isinstance(a, DeleteDeployment)]
    assert deletes == [DeleteDeployment(NS, lws["metadata"]["name"], kind="Deployment")]
    assert [o["kind"] for o in created(out).values()] == ["LeaderWorkerSet"]


def test_ready_from_the_groups():
    w = world([H100X8X2])
    (lws,) = created(decide(dataclasses.replace(w.observed(), lws_available=True), SETTINGS)).values()
    lws["metadata"].update(resourceVersion="5", generation=1)
    lws["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                     "conditions": [{"type": "Available", "status": "True"}]}
    w.deployments = {lws["metadata"]["name"]: lws}
    w.service = None
    out = decide(dataclasses.replace(w.observed(), lws_available=True), SETTINGS)
    assert cond(out, C.DEPLOYED).status == "True"
    assert cond(out, C.READY).status == "True"
    assert out.status.replicas == "1/1"


def test_kube_reads_the_lws_api_from_discovery():
    """Kube.lws_available asks API discovery (GET /apis/leaderworkerset.x-k8s.io/v1) and remembers
    the answer; a group the server does not serve (404) is no LeaderWorkerSet."""
    from unittest import mock

    from kubernetes import client as k
    from kubernetes.client.rest import ApiException

    from fewerbits_operator.base.kube import Kube

    served = k.V1APIResourceList(group_version="leaderworkerset.x-k8s.io/v1", resources=[k.V1APIResource(
        kind="LeaderWorkerSet", name="leaderworkersets", namespaced=True, singular_name="leaderworkerset",
        verbs=["get", "list"])])
    kube = Kube(api=k.ApiClient(k.Configuration()))
    with mock.patch.object(k.CustomObjectsApi, "get_api_resources", return_value=served) as m:
        assert kube.lws_available() and kube.lws_available()
        assert m.call_count == 1  # remembered
        assert m.call_args.args == ("leaderworkerset.x-k8s.io", "v1")
    kube = Kube(api=k.ApiClient(k.Configuration()))
    with mock.patch.object(k.CustomObjectsApi, "get_api_resources", side_effect=ApiException(status=404)):
        assert not kube.lws_available()
