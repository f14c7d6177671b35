"""A LeaderWorkerSet CRD installed after the operator started (kube.py ``lws_available``): kopf
resolves what it watches once at start-up (``settings.scanning.disabled``: no CRD watch, so no
CRD list/watch RBAC), so that CRD is not watched until the next restart. Meanwhile the operator
still serves multi-node variants: ``lws_available`` says the API is served (observe and decide see
it at once), and ``list_lws`` reads the API server instead of the never-filled index. Served at
start-up, the index is read. API discovery is a stand-in the test switches; no cluster."""

from __future__ import annotations

from unittest import mock

from kopf._core.engines.indexing import OperatorIndexer
from kubernetes import client as k
from kubernetes.client.rest import ApiException

from fewerbits_operator.base.indexes import index_entry
from fewerbits_operator.base.kube import Kube
from fewerbits_operator.serving.lws import LWS_GROUP, LWS_PLURAL, LWS_VERSION
from fewerbits_operator.runtime.runner import Operator
from fewerbits_operator.base.ttlcache import TTLCache

MANAGED = {"app.kubernetes.io/managed-by": "fewerbits", "fewerbits.io/model": "m"}
LWS = {"metadata": {"namespace": "t-a", "name": "m-h100x8", "uid": "u", "resourceVersion": "2", "labels": MANAGED,
                    "ownerReferences": [{"kind": "QuantizedModel", "name": "m"}]}}


def kube_with_discovery(served: list[bool]) -> tuple[Kube, Operator]:
    """A Kube whose API discovery serves LeaderWorkerSets while ``served[0]`` (not remembered),
    reading through an operator's views as runner.on_startup wires them."""
    kube = Kube(api=k.ApiClient(k.Configuration()))
    kube.core, kube.custom, kube.batch, kube.apps = (mock.MagicMock() for _ in range(4))
    kube._served = TTLCache(0)

    def discovery(group, version):
        if not served[0] or (group, version) != (LWS_GROUP, LWS_VERSION):
            raise ApiException(status=404)
        return k.V1APIResourceList(group_version=f"{group}/{version}", resources=[k.V1APIResource(
            kind="LeaderWorkerSet", name=LWS_PLURAL, namespaced=True, singular_name="leaderworkerset", verbs=["list"])])
    kube.custom.get_api_resources.side_effect = discovery
    op = Operator()
    for view in op.views.values():
        view.attach(OperatorIndexer().index)
        view.mark_synced()
    kube.use_views(["t-*"], op.views)
    return kube, op


def test_a_crd_installed_after_start_is_served_by_live_reads_until_a_restart() -> None:
    served = [False]
    kube, _ = kube_with_discovery(served)
    assert not kube.lws_available()
    served[0] = True  # the CRD is installed
    assert kube.lws_available()
    kube.custom.list_namespaced_custom_object.return_value = {"items": [LWS]}
    assert [o["metadata"]["name"] for o in kube.list_lws("t-a", "fewerbits.io/model=m")] == ["m-h100x8"]
    kube.custom.list_namespaced_custom_object.assert_called_once()  # live: kopf does not watch it


def test_served_at_start_up_it_is_read_from_kopfs_index() -> None:
    kube, op = kube_with_discovery([True])
    indexer = OperatorIndexer()
    op.views["leaderworkersets"].attach(indexer.index)
    indexer.replace(("t-a", "m-h100x8", "u"), index_entry(LWS))
    assert kube.lws_available()
    assert [o["metadata"]["name"] for o in kube.list_lws("t-a", "fewerbits.io/model=m")] == ["m-h100x8"]
    kube.custom.list_namespaced_custom_object.assert_not_called()
    op.on_event("leaderworkersets", "ADDED", LWS)  # its events reach the owning model
    assert op.queue.get(timeout=0) == ("t-a", "m")
