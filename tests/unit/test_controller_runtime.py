"""The controller runtime without kopf: which watch events enqueue which models (runner.py), the
caches' read-your-writes rule (informer.py, kube.py) and the liveness endpoint. No cluster."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from unittest import mock

from kubernetes.client.exceptions import ApiException

from fewerbits_operator.informer import (GONE, Informer, WatchCache, any_change, model_relevant, rv_at_least,
                                         selector_matches, without_managed_fields)
from fewerbits_operator.kube import Kube, plain_names
from fewerbits_operator.runner import Operator, serve_health
from fewerbits_operator.settings import OperatorSettings


def qm(ns: str, name: str, rv: str, *, gen: int = 1, ready: bool = False, **md) -> dict:
    return {"metadata": {"namespace": ns, "name": name, "resourceVersion": rv, "generation": gen, **md},
            "status": {"observedGeneration": gen,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def child(ns: str, name: str, rv: str, owners: list[str]) -> dict:
    return {"metadata": {"namespace": ns, "name": name, "resourceVersion": rv,
                         "labels": {"app.kubernetes.io/managed-by": "fewerbits", "fewerbits.io/model": owners[0]},
                         "ownerReferences": [{"kind": "QuantizedModel", "name": o} for o in owners]
                         + [{"kind": "ReplicaSet", "name": "not-a-model"}]}}


def ready_keys(op: Operator) -> list:
    out = []
    while (k := op.queue.get(timeout=0)) is not None:
        out.append(k)
        op.queue.done(k)
    return sorted(out)


def wired() -> tuple[Operator, WatchCache, WatchCache]:
    """An operator whose model and Deployment caches report to it, as start() wires them."""
    op = Operator()
    op.settings = OperatorSettings(resync_seconds=30)
    models = WatchCache("quantizedmodels", mock.MagicMock(), relevant=model_relevant,
                        on_change=op._model_changed, on_list=op._models_listed)
    deps = WatchCache("deployments", mock.MagicMock(), relevant=any_change, on_change=op._child_changed)
    return op, models, deps


# ------------------------------------------------------------------ what enqueues what


def test_every_list_enqueues_every_model_once_and_learns_which_are_steady():
    op, models, _ = wired()
    models.replace([qm("a", "m1", "5", ready=True), qm("b", "m2", "6")], "10")
    assert ready_keys(op) == [("a", "m1"), ("b", "m2")]
    assert op._steady == {("a", "m1"): True, ("b", "m2"): False}
    models.replace([qm("a", "m1", "5", ready=True), qm("b", "m2", "6")], "20")  # a re-list after a broken watch
    assert ready_keys(op) == [("a", "m1"), ("b", "m2")]


def test_spec_deletion_and_metadata_changes_enqueue_status_writes_do_not():
    op, models, _ = wired()
    models.replace([qm("a", "m", "5", ready=True)], "5")
    ready_keys(op)
    assert not models.apply("MODIFIED", qm("a", "m", "6", ready=False))  # a status write (ours, the autoscaler's)
    assert ready_keys(op) == []
    assert models.apply("MODIFIED", qm("a", "m", "7", gen=2))
    assert ready_keys(op) == [("a", "m")] and op._steady[("a", "m")] is False
    assert models.apply("MODIFIED", qm("a", "m", "8", gen=2, deletionTimestamp="2026-11-23T12:00:00Z"))
    assert models.apply("MODIFIED", qm("a", "m", "9", gen=2, deletionTimestamp="2026-11-23T12:00:00Z",
                                       labels={"team": "x"}))
    assert ready_keys(op) == [("a", "m")]  # two events, one reconcile
    assert models.apply("ADDED", qm("a", "new", "10"))
    assert models.apply("DELETED", qm("a", "m", "11", gen=2))
    assert ready_keys(op) == [("a", "m"), ("a", "new")]
    assert ("a", "m") not in op._steady  # gone: its last reconcile schedules no resync


def test_child_events_enqueue_their_model_owners():
    op, _, deps = wired()
    deps.replace([], "1")
    deps.apply("ADDED", child("a", "m-h100", "2", ["m"]))
    deps.apply("MODIFIED", child("a", "m-h100", "2", ["m"]))  # same version: no change
    assert ready_keys(op) == [("a", "m")]
    deps.apply("MODIFIED", child("a", "job-x", "3", ["m", "other"]))  # a Job two models share
    assert ready_keys(op) == [("a", "m"), ("a", "other")]
    deps.apply("DELETED", child("a", "m-h100", "4", ["m"]))
    assert ready_keys(op) == [("a", "m")]


def test_a_cluster_wide_cache_keeps_only_watched_namespaces():
    from fewerbits_operator.kube import namespace_watched

    cache = WatchCache("quantizedmodels", mock.MagicMock(), relevant=model_relevant,
                       accept=lambda o: namespace_watched(o["metadata"]["namespace"], ["t-*", "!t-skip"]))
    cache.replace([qm("t-a", "m", "1"), qm("demo", "m", "1"), qm("t-skip", "m", "1")], "1")
    assert not cache.apply("ADDED", qm("other", "x", "2"))
    assert [o["metadata"]["namespace"] for o in cache.items()] == ["t-a"]


def test_namespace_names_are_watched_one_by_one_and_patterns_cluster_wide():
    assert plain_names(["ml-a", "ml-b"])
    assert not plain_names([]) and not plain_names(["t-*"]) and not plain_names(["a", "!b"])
    k = Kube(api=mock.MagicMock())
    k.core, k.custom, k.batch, k.apps = (mock.MagicMock() for _ in range(4))
    stop = threading.Event()
    stop.set()  # the loops return at once: only their layout is checked
    k.start_caches(stop, namespaces=["ml-a", "ml-b"], wait_seconds=0)
    assert sorted(k.models.caches) == sorted(k.jobs.caches) == sorted(k.deployments.caches) == ["ml-a", "ml-b"]
    k.start_caches(stop, namespaces=["t-*"], wait_seconds=0)
    assert list(k.models.caches) == [None]


# ------------------------------------------------------------------ read your writes


def test_resource_versions_compare_as_integers_and_otherwise_only_when_equal():
    assert rv_at_least("10", "9") and rv_at_least("10", "10") and not rv_at_least("9", "10")
    assert rv_at_least("abc", "abc") and not rv_at_least("abd", "abc") and not rv_at_least(None, "1")


def test_a_key_is_served_from_the_cache_only_once_it_holds_our_write():
    now = [0.0]
    cache = WatchCache("quantizedmodels", mock.MagicMock(), relevant=model_relevant, clock=lambda: now[0])
    assert not cache.fresh("a/m")  # not synced
    cache.replace([qm("a", "m", "5")], "5")
    assert cache.fresh("a/m")
    cache.note("a/m", "7")  # we wrote version 7
    assert not cache.fresh("a/m")
    cache.apply("MODIFIED", qm("a", "m", "6"))
    assert not cache.fresh("a/m")
    cache.apply("MODIFIED", qm("a", "m", "8"))  # ours, then someone else's
    assert cache.fresh("a/m")
    cache.note("a/m", "3")  # a live read older than what the cache holds: nothing to wait for
    assert cache.fresh("a/m")
    cache.invalidate("a/m")  # a conflict: the next read goes live ...
    assert not cache.fresh("a/m")
    cache.note("a/m", "8")  # ... and what it read is what the cache holds
    assert cache.fresh("a/m")
    cache.note("a/m", GONE)  # we deleted it
    assert not cache.fresh("a/m")
    cache.apply("DELETED", qm("a", "m", "9"))
    assert cache.fresh("a/m")
    cache.note("a/x", "weird-version")
    assert not cache.fresh("a/x")
    now[0] = 31  # a floor never reached expires
    assert cache.fresh("a/x")


def fake_kube() -> Kube:
    k = Kube(api=mock.MagicMock())
    k.core, k.custom, k.batch, k.apps = (mock.MagicMock() for _ in range(4))
    k.api.sanitize_for_serialization.side_effect = lambda o: o
    k.namespaces = []
    k.models = Informer({None: WatchCache("quantizedmodels", mock.MagicMock(), relevant=model_relevant)})
    k.jobs = Informer({None: WatchCache("jobs", mock.MagicMock(), relevant=any_change)})
    k.deployments = Informer({None: WatchCache("deployments", mock.MagicMock(), relevant=any_change)})
    return k


def test_get_model_reads_the_cache_falls_back_after_a_conflict_and_returns_to_it():
    """The reconcile's retry (reconcile.py: get_model, compute, conditional patch; 3 tries) converges
    when the cache is behind: the conflict sends the next read to the API server."""
    k = fake_kube()
    cache = k.models.caches[None]
    cache.replace([qm("a", "m", "5")], "5")
    assert k.get_model("a", "m")["metadata"]["resourceVersion"] == "5"
    assert not k.custom.get_namespaced_custom_object.called
    k.custom.patch_namespaced_custom_object_status.side_effect = ApiException(status=409)
    assert k.patch_model_status("a", "m", {"x": 1}, "5") is False
    k.custom.get_namespaced_custom_object.return_value = qm("a", "m", "6")
    assert k.get_model("a", "m")["metadata"]["resourceVersion"] == "6"  # live
    k.custom.patch_namespaced_custom_object_status.side_effect = None
    k.custom.patch_namespaced_custom_object_status.return_value = qm("a", "m", "7")
    assert k.patch_model_status("a", "m", {"x": 1}, "6") is True
    assert k.custom.get_namespaced_custom_object.call_count == 1
    k.get_model("a", "m")  # the cache holds 5, we wrote 7: live
    assert k.custom.get_namespaced_custom_object.call_count == 2
    cache.apply("MODIFIED", qm("a", "m", "7"))
    assert k.get_model("a", "m")["metadata"]["resourceVersion"] == "7"
    assert k.custom.get_namespaced_custom_object.call_count == 2  # the cache again


def test_jobs_and_deployments_we_created_are_read_live_until_the_watch_brings_them():
    k = fake_kube()
    k.jobs.caches[None].replace([], "1")
    k.deployments.caches[None].replace([child("a", "m-old", "1", ["m"])], "1")
    assert k.get_job("a", "j") is None and not k.batch.read_namespaced_job.called
    k.batch.create_namespaced_job.return_value = child("a", "j", "2", ["m"])
    k.create({"kind": "Job", "metadata": {"namespace": "a", "name": "j"}})
    k.batch.read_namespaced_job.return_value = child("a", "j", "2", ["m"])
    assert k.get_job("a", "j")["metadata"]["name"] == "j" and k.batch.read_namespaced_job.call_count == 1
    k.jobs.caches[None].apply("ADDED", child("a", "j", "2", ["m"]))
    assert k.get_job("a", "j") is not None and k.batch.read_namespaced_job.call_count == 1

    assert [d["metadata"]["name"] for d in k.list_deployments("a", "fewerbits.io/model=m")] == ["m-old"]
    assert k.list_deployments("b", "fewerbits.io/model=m") == [] and not k.apps.list_namespaced_deployment.called
    k.delete_deployment("a", "m-old")
    k.apps.list_namespaced_deployment.return_value = mock.MagicMock(items=[])
    assert k.list_deployments("a", "fewerbits.io/model=m") == []
    assert k.apps.list_namespaced_deployment.call_count == 1  # live: the cache still holds the deleted one
    k.deployments.caches[None].apply("DELETED", child("a", "m-old", "3", ["m"]))
    k.list_deployments("a", "fewerbits.io/model=m")
    assert k.apps.list_namespaced_deployment.call_count == 1
    k.list_deployments("a", "fewerbits.io/model in (m)")  # a selector the cache does not read: live
    assert k.apps.list_namespaced_deployment.call_count == 2


def test_list_models_comes_from_the_cache_for_the_operators_own_namespaces():
    k = fake_kube()
    k.models.caches[None].replace([qm("a", "m", "1")], "1")
    assert [o["metadata"]["name"] for o in k.list_models([])] == ["m"]
    assert not k.custom.list_cluster_custom_object.called
    k.custom.list_namespaced_custom_object.return_value = {"items": []}
    assert k.list_models(["other"]) == []  # not what the cache covers: live


def test_selectors_and_slimming():
    assert selector_matches("a=b,c!=d", {"a": "b", "c": "e"}) is True
    assert selector_matches("a==b", {"a": "c"}) is False and selector_matches("c!=d", {"c": "d"}) is False
    assert selector_matches("a in (b)", {}) is None and selector_matches("a", {}) is None
    obj = {"metadata": {"name": "x", "managedFields": [{"manager": "kubectl"}]}, "spec": {}}
    assert without_managed_fields(obj) == {"metadata": {"name": "x"}, "spec": {}} and "managedFields" in obj["metadata"]


# ------------------------------------------------------------------ liveness


def test_healthz_answers_200_while_every_thread_runs_and_503_when_one_stopped():
    op = Operator()
    gate = threading.Event()
    op._spawn(gate.wait, "fewerbits-worker-0")
    server = serve_health(0, op.healthy)
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            assert r.status == 200 and r.read() == b"ok"
        gate.set()
        op._threads[0].join(5)
        try:
            urllib.request.urlopen(url, timeout=5)
            raise AssertionError("a stopped worker must fail the probe")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and b"fewerbits-worker-0" in e.read()
    finally:
        server.shutdown()


def test_the_process_needs_no_kopf():
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.startswith("kopf")]
    sources = (root / "operator" / "fewerbits_operator").rglob("*.py")
    assert not [p for p in sources if "import kopf" in p.read_text()]
    assert json.loads('["ml-a"]') == OperatorSettings(namespaces=["ml-a"]).namespaces
