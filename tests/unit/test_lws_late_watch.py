"""The LeaderWorkerSet cache starts when the API appears (kube.py): at start-up when the CRD is
installed, else at the first ``lws_available`` that finds it served, with no operator restart.
API discovery is a stand-in the test switches; no cluster."""

from __future__ import annotations

import threading
from unittest import mock

from kubernetes import client as k
from kubernetes.client.rest import ApiException

from fewerbits_operator.informer import TTLCache
from fewerbits_operator.kube import Kube
from fewerbits_operator.lws import LWS_GROUP, LWS_PLURAL, LWS_VERSION
from fewerbits_operator.runner import Operator

MANAGED = {"app.kubernetes.io/managed-by": "fewerbits", "fewerbits.io/model": "m"}


def kube_with_discovery(served: list[bool]) -> Kube:
    """A Kube whose API discovery serves LeaderWorkerSets while ``served[0]`` (not remembered)."""
    kube = Kube(api=k.ApiClient(k.Configuration()))
    kube.core, kube.custom, kube.batch, kube.apps = (mock.MagicMock() for _ in range(4))
    kube._served = TTLCache(0)

    def discovery(group, version):
        if not served[0] or (group, version) != (LWS_GROUP, LWS_VERSION):
            raise ApiException(status=404)
        return k.V1APIResourceList(group_version=f"{group}/{version}", resources=[k.V1APIResource(
            kind="LeaderWorkerSet", name=LWS_PLURAL, namespaced=True, singular_name="leaderworkerset", verbs=["list"])])
    kube.custom.get_api_resources.side_effect = discovery
    return kube


def stopped() -> threading.Event:
    stop = threading.Event()
    stop.set()  # the loops return at once: which caches exist and whom they tell is checked
    return stop


def test_a_crd_installed_after_start_is_watched_without_a_restart() -> None:
    served, changes = [False], []
    kube = kube_with_discovery(served)
    kube.start_caches(stopped(), namespaces=["t-*"], on_child_change=lambda old, new: changes.append(new),
                      wait_seconds=0)
    assert kube.lws is None and not kube.lws_available() and kube.lws is None
    served[0] = True  # the CRD is installed
    assert kube.lws_available()
    assert kube.lws is not None and [t.name for t in kube.late_threads] == ["fewerbits-cache-leaderworkersets"]
    first = kube.lws
    assert kube.lws_available() and kube.lws is first and len(kube.late_threads) == 1  # started once
    # Wired as at start-up: a LeaderWorkerSet's change reaches the runner, and lists read the cache.
    cache = kube.lws.caches[None]
    cache.replace([], "1")
    lws = {"metadata": {"namespace": "t-a", "name": "m-h100x8", "resourceVersion": "2", "labels": MANAGED}}
    assert cache.apply("ADDED", lws) and changes == [lws]
    kube.custom.list_namespaced_custom_object.reset_mock()
    assert [o["metadata"]["name"] for o in kube.list_lws("t-a", "fewerbits.io/model=m")] == ["m-h100x8"]
    kube.custom.list_namespaced_custom_object.assert_not_called()


def test_served_at_start_up_it_starts_with_the_other_caches() -> None:
    kube = kube_with_discovery([True])
    threads = kube.start_caches(stopped(), namespaces=["ml-a", "ml-b"], wait_seconds=0)
    assert kube.lws is not None and sorted(kube.lws.caches) == ["ml-a", "ml-b"]
    assert sum(t.name.startswith("fewerbits-cache-leaderworkersets") for t in threads) == 2
    assert kube.lws_available() and kube.late_threads == []


def test_a_cache_started_later_counts_for_liveness() -> None:
    op = Operator()
    dead = threading.Thread(target=lambda: None, name="fewerbits-cache-leaderworkersets")
    dead.start()
    dead.join()
    op.reconciler = mock.MagicMock()
    op.reconciler.kube.late_threads = []
    assert op.healthy() == (True, "ok")
    op.reconciler.kube.late_threads = [dead]
    assert op.healthy() == (False, "stopped: fewerbits-cache-leaderworkersets")
