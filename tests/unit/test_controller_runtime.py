"""The runtime on kopf, without a cluster: which events enqueue which models (runner.py through the
relevance filter), kopf's real indexes read through the read-your-writes guard (indexes.py,
freshness.py, kube.py), the scope mapping (scope.py), kopf's settings (nothing persisted, scanning
off) and the liveness probe. kopf's own ``OperatorIndexer`` holds the objects, filled with what the
registered index function returns, as kopf's ``index_resource`` does; the API server is a
MagicMock only where a test checks that it is *not* called."""

from __future__ import annotations

import asyncio
import json
import re
import tomllib
from pathlib import Path
from unittest import mock

import kopf
import pytest
from typing import Any
from kopf._core.engines.indexing import OperatorIndexer
from kubernetes.client.exceptions import ApiException

from fewerbits_operator.base.freshness import GONE, rv_at_least
from fewerbits_operator.runtime.handlers import INDEXED, KINDS, register
from fewerbits_operator.base.indexes import (IndexView, compact, index_entry, node_entry, selector_matches,
                                             without_managed_fields)
from fewerbits_operator.base.kube import Kube
from fewerbits_operator.runtime.runner import Operator, configure_kopf
from fewerbits_operator.base.scope import kopf_scope, namespace_watched, plain_names
from fewerbits_operator.base.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]


def qm(ns: str, name: str, rv: str, *, gen: int = 1, ready: bool = False, **md) -> dict:
    return {"metadata": {"namespace": ns, "name": name, "uid": f"u-{ns}-{name}", "resourceVersion": rv,
                         "generation": gen, **md},
            "status": {"observedGeneration": gen,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def child(ns: str, name: str, rv: str, owners: list[str], **labels) -> dict:
    return {"metadata": {"namespace": ns, "name": name, "uid": f"u-{ns}-{name}", "resourceVersion": rv,
                         "labels": {"app.kubernetes.io/managed-by": "fewerbits", "fewerbits.io/model": owners[0],
                                    **labels},
                         "ownerReferences": [{"kind": "QuantizedModel", "name": o} for o in owners]
                         + [{"kind": "ReplicaSet", "name": "not-a-model"}]}}


class Fed:
    """kopf's event path for one object, as processing.py runs it: index the body (``index_entry``,
    what handlers.py registers), then call the event handler."""

    def __init__(self, op: Operator):
        self.op = op
        self.indexers = {name: OperatorIndexer() for name in op.views}
        for name, view in op.views.items():
            view.attach(self.indexers[name].index)

    def __call__(self, kind: str, event_type: str | None, body: dict) -> None:
        md = body["metadata"]
        key = (md.get("namespace"), md["name"], md.get("uid"))
        if event_type == "DELETED":
            self.indexers[kind].discard(key)
        else:
            self.indexers[kind].replace(key, (node_entry if kind == "nodes" else index_entry)(body))
        self.op.on_event(kind, event_type, body)


def ready_keys(op: Operator) -> list:
    out = []
    while (k := op.queue.get(timeout=0)) is not None:
        out.append(k)
        op.queue.done(k)
    return sorted(out)


def wired() -> tuple[Operator, Fed]:
    op = Operator()
    op.settings = OperatorSettings(resync_seconds=30)
    return op, Fed(op)


# ------------------------------------------------------------------ what enqueues what


def test_every_listing_enqueues_every_model_once_and_learns_which_are_steady():
    op, feed = wired()
    feed("models", None, qm("a", "m1", "5", ready=True))
    feed("models", None, qm("b", "m2", "6"))
    assert ready_keys(op) == [("a", "m1"), ("b", "m2")]
    assert op._steady == {("a", "m1"): True, ("b", "m2"): False}
    feed("models", None, qm("a", "m1", "5", ready=True))  # kopf's re-list after a broken watch
    feed("models", None, qm("b", "m2", "6"))
    assert ready_keys(op) == [("a", "m1"), ("b", "m2")]


def test_spec_deletion_and_metadata_changes_enqueue_status_writes_do_not():
    op, feed = wired()
    feed("models", None, qm("a", "m", "5", ready=True))
    ready_keys(op)
    feed("models", "MODIFIED", qm("a", "m", "6", ready=False))  # a status write (ours, the autoscaler's)
    assert ready_keys(op) == []
    feed("models", "MODIFIED", qm("a", "m", "7", gen=2))
    assert ready_keys(op) == [("a", "m")] and op._steady[("a", "m")] is False
    feed("models", "MODIFIED", qm("a", "m", "8", gen=2, deletionTimestamp="2026-11-23T12:00:00Z"))
    feed("models", "MODIFIED", qm("a", "m", "9", gen=2, deletionTimestamp="2026-11-23T12:00:00Z",
                                  labels={"team": "x"}))
    assert ready_keys(op) == [("a", "m")]  # two events, one reconcile
    feed("models", "ADDED", qm("a", "new", "10"))
    feed("models", "DELETED", qm("a", "m", "11", gen=2))
    assert ready_keys(op) == [("a", "m"), ("a", "new")]
    assert ("a", "m") not in op._steady  # gone: its last reconcile schedules no resync


def test_child_events_enqueue_their_model_owners():
    op, feed = wired()
    feed("deployments", "ADDED", child("a", "m-h100", "2", ["m"]))
    feed("deployments", "MODIFIED", child("a", "m-h100", "2", ["m"]))  # same version: no change
    assert ready_keys(op) == [("a", "m")]
    feed("jobs", "MODIFIED", child("a", "job-x", "3", ["m", "other"]))  # a Job two models share
    feed("leaderworkersets", "ADDED", child("a", "m-lws", "4", ["third"]))
    assert ready_keys(op) == [("a", "m"), ("a", "other"), ("a", "third")]
    feed("deployments", "DELETED", child("a", "m-h100", "5", ["m"]))
    assert ready_keys(op) == [("a", "m")]


def test_nodes_change_only_by_their_gpu_facts_and_policies_by_their_spec():
    op, feed = wired()
    node = {"metadata": {"name": "n", "uid": "n", "resourceVersion": "1", "labels": {"nvidia.com/gpu.count": "8"}},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}, "conditions": [{"lastHeartbeatTime": "t0"}]}}
    feed("nodes", None, node)
    op._all_due = None
    feed("nodes", "MODIFIED", {**node, "metadata": {**node["metadata"], "resourceVersion": "2"},
                               "status": {**node["status"], "conditions": [{"lastHeartbeatTime": "t1"}]}})
    assert op._all_due is None  # a heartbeat
    feed("nodes", "MODIFIED", {**node, "status": {"allocatable": {"nvidia.com/gpu": "4"}}})
    assert op._all_due is not None
    # the index keeps only the planner's facts
    held = op.views["nodes"].items()[0]
    assert set(held["status"]) == {"allocatable"} and "conditions" not in held["status"]
    op._all_due = None
    pol = {"metadata": {"name": "p", "uid": "p", "resourceVersion": "1"}, "spec": {"priority": 1}}
    op.elector = mock.MagicMock()
    op.elector.leading.is_set.return_value = False  # a standby writes no policy status
    feed("policies", None, pol)
    op._all_due = None
    feed("policies", "MODIFIED", {**pol, "metadata": {**pol["metadata"], "annotations": {"x": "y"}}})
    assert op._all_due is None
    feed("policies", "MODIFIED", {**pol, "spec": {"priority": 2}})
    assert op._all_due is not None


def test_a_job_that_frees_a_slot_wakes_the_queued_models():
    op, feed = wired()
    op.kube = mock.MagicMock()
    queued = qm("a", "waiting", "1")
    queued["status"]["artifacts"] = [{"job": "j2", "queue": {"reason": "OperatorCap", "since": "t"}}]
    feed("models", None, queued)
    op.kube.list_models_where.side_effect = lambda ns, where: [m for m in op.views["models"].items() if where(m)]
    ready_keys(op)
    running = child("a", "j1", "2", ["m"])
    running["status"] = {"active": 1}
    feed("jobs", "ADDED", running)
    assert ready_keys(op) == [("a", "m"), ("a", "waiting")]
    feed("jobs", "MODIFIED", {**running, "metadata": {**running["metadata"], "resourceVersion": "3"}})
    assert ready_keys(op) == [("a", "m")]  # still running: the queue did not move
    done = {**running, "metadata": {**running["metadata"], "resourceVersion": "4"},
            "status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}}
    feed("jobs", "MODIFIED", done)
    assert ready_keys(op) == [("a", "m"), ("a", "waiting")]


# ------------------------------------------------------------------ the scope


def test_watch_namespaces_map_onto_kopfs_scope():
    assert kopf_scope([]).clusterwide and not kopf_scope([]).patterns
    names = kopf_scope(["ml-a", "ml-b", "ml-a"])
    assert not names.clusterwide and names.namespaces == ("ml-a", "ml-b") and names.serves("anything")
    globs = kopf_scope(["t-*", "!t-skip"])
    assert globs.clusterwide and globs.namespaces == ()
    assert globs.serves("t-a") and not globs.serves("t-skip") and not globs.serves("demo")
    assert globs.serves(None)  # cluster-scoped kinds: Nodes, policies
    assert plain_names(["ml-a"]) and not plain_names([]) and not plain_names(["a", "!b"])
    assert namespace_watched("prod", ["!dev"]) and not namespace_watched("dev", ["!dev"])


def test_registration_indexes_and_watches_each_kind_and_persists_nothing():
    registry = kopf.OperatorRegistry()
    register(Operator(), kopf_scope(["t-*"]), registry)
    indexing = registry._indexing.get_all_handlers()
    watching = registry._watching.get_all_handlers()
    assert sorted(h.id for h in indexing) == sorted(f"{k}_index" for k in (*KINDS, *INDEXED))
    # The models' pods and activator slices are indexed only: a change of theirs enqueues nothing.
    assert sorted(h.id for h in watching) == sorted(f"{k}_event" for k in KINDS)
    assert {h.id: h.labels for h in indexing if h.id in ("pods_index", "endpointslices_index")} == {
        "pods_index": {"fewerbits.io/model": kopf.PRESENT},
        "endpointslices_index": {"endpointslice.kubernetes.io/managed-by": "activator.fewerbits.io"}}
    # No high-level handler, timer or daemon: nothing kopf would persist or guard with a finalizer.
    assert not registry._changing.get_all_handlers() and not registry._spawning.get_all_handlers()
    assert all(h.when is not None for h in [*indexing, *watching])  # the glob filter
    jobs = next(h for h in watching if h.id == "jobs_event")
    assert jobs.labels == {"app.kubernetes.io/managed-by": "fewerbits"}
    assert all(asyncio.iscoroutinefunction(h.fn) for h in [*indexing, *watching])  # no executor hop per event


def test_kopf_settings_store_nothing_and_scan_nothing():
    k = kopf.OperatorSettings()
    configure_kopf(k, OperatorSettings(watch_timeout_seconds=120))
    assert k.scanning.disabled and not k.posting.enabled
    assert k.watching.server_timeout == 120 and k.watching.client_timeout == 150
    # Jobs, Deployments and LeaderWorkerSets are selected by label on the API server, the rest not.
    selected = {r.plural: list(k.watching.label_selectors.collect(r)) for r in (
        kopf.Resource("batch", "v1", "jobs"), kopf.Resource("apps", "v1", "deployments"),
        kopf.Resource("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
        kopf.Resource("fewerbits.io", "v1alpha1", "quantizedmodels"), kopf.Resource("", "v1", "nodes"),
        kopf.Resource("", "v1", "pods"), kopf.Resource("discovery.k8s.io", "v1", "endpointslices"))}
    managed = ["app.kubernetes.io/managed-by=fewerbits"]
    assert selected == {"jobs": managed, "deployments": managed, "leaderworkersets": managed,
                        "quantizedmodels": [], "nodes": [], "pods": ["fewerbits.io/model"],
                        "endpointslices": ["endpointslice.kubernetes.io/managed-by=activator.fewerbits.io"]}
    body = kopf.Body({"metadata": {"name": "m", "annotations": {}}, "spec": {"x": 1}})
    patch = kopf.Patch()
    k.persistence.progress_storage.store(body=body, patch=patch, key=kopf.HandlerId("h"), record={"started": "t"})
    k.persistence.progress_storage.touch(body=body, patch=patch, value="x")
    k.persistence.diffbase_storage.store(body=body, patch=patch, essence={"spec": {"x": 1}})
    assert not patch  # nothing to write
    assert k.persistence.diffbase_storage.fetch(body=body) is None


# ------------------------------------------------------------------ read your writes, over kopf's index


def test_resource_versions_compare_as_integers_and_otherwise_only_when_equal():
    assert rv_at_least("10", "9") and rv_at_least("10", "10") and not rv_at_least("9", "10")
    assert rv_at_least("abc", "abc") and not rv_at_least("abd", "abc") and not rv_at_least(None, "1")


def test_a_key_is_served_from_the_index_only_once_it_holds_our_write():
    now = [0.0]
    view = IndexView("quantizedmodels", clock=lambda: now[0])
    indexer = OperatorIndexer()
    view.attach(indexer.index)
    put = lambda o: indexer.replace(("a", o["metadata"]["name"], "u"), index_entry(o))  # noqa: E731
    put(qm("a", "m", "5"))
    assert not view.fresh("a", "m")  # kopf has not called a handler yet: not synced
    view.mark_synced()
    assert view.fresh("a", "m")
    view.note("a", "m", "7")  # we wrote version 7
    assert not view.fresh("a", "m")
    put(qm("a", "m", "6"))
    assert not view.fresh("a", "m")
    put(qm("a", "m", "8"))  # ours, then someone else's
    assert view.fresh("a", "m") and view.get("a", "m")["metadata"]["resourceVersion"] == "8"
    view.invalidate("a", "m")  # a conflict: the next read goes live ...
    assert not view.fresh("a", "m")
    view.note("a", "m", "8")  # ... and what it read is what the index holds
    assert view.fresh("a", "m")
    view.note("a", "m", GONE)  # we deleted it
    assert not view.fresh("a", "m")
    indexer.discard(("a", "m", "u"))
    assert view.fresh("a", "m") and view.get("a", "m") is None
    view.note("a", "x", "weird-version")
    assert not view.fresh("a", "x")
    now[0] = 31  # a floor never reached expires
    assert view.fresh("a", "x")


def fake_kube(op: Operator) -> Kube:
    k = Kube(api=mock.MagicMock())
    k.core, k.custom, k.batch, k.apps = (mock.MagicMock() for _ in range(4))
    k.api.sanitize_for_serialization.side_effect = lambda o: o
    k.custom.get_api_resources.side_effect = ApiException(status=404)
    k.use_views([], op.views)
    return k


def test_get_model_reads_the_index_falls_back_after_a_conflict_and_returns_to_it():
    """The reconcile's retry (reconcile.py: get_model, compute, conditional patch; 3 tries) converges
    when the index is behind: the conflict sends the next read to the API server."""
    op, feed = wired()
    k = fake_kube(op)
    feed("models", None, qm("a", "m", "5"))
    assert k.get_model("a", "m")["metadata"]["resourceVersion"] == "5"
    assert not k.custom.get_namespaced_custom_object.called
    k.custom.patch_namespaced_custom_object_status.side_effect = ApiException(status=409)
    assert k.patch_model_status("a", "m", {"x": 1}, "5") is False
    k.custom.get_namespaced_custom_object.return_value = qm("a", "m", "6")
    assert k.get_model("a", "m")["metadata"]["resourceVersion"] == "6"  # live
    k.custom.patch_namespaced_custom_object_status.side_effect = None
    k.custom.patch_namespaced_custom_object_status.return_value = qm("a", "m", "7")
    assert k.patch_model_status("a", "m", {"x": 1}, "6") is True
    k.get_model("a", "m")  # the index holds 5, we wrote 7: live
    assert k.custom.get_namespaced_custom_object.call_count == 2
    feed("models", "MODIFIED", qm("a", "m", "7"))
    assert k.get_model("a", "m")["metadata"]["resourceVersion"] == "7"
    assert k.custom.get_namespaced_custom_object.call_count == 2  # the index again


def test_jobs_and_deployments_we_created_are_read_live_until_kopf_brings_them():
    op, feed = wired()
    k = fake_kube(op)
    feed("deployments", None, child("a", "m-old", "1", ["m"]))
    assert k.get_job("a", "j") is None and not k.batch.read_namespaced_job.called
    k.batch.create_namespaced_job.return_value = child("a", "j", "2", ["m"])
    k.create({"kind": "Job", "metadata": {"namespace": "a", "name": "j"}})
    k.batch.read_namespaced_job.return_value = child("a", "j", "2", ["m"])
    assert k.get_job("a", "j")["metadata"]["name"] == "j" and k.batch.read_namespaced_job.call_count == 1
    feed("jobs", "ADDED", child("a", "j", "2", ["m"]))
    assert k.get_job("a", "j") is not None and k.batch.read_namespaced_job.call_count == 1

    assert [d["metadata"]["name"] for d in k.list_deployments("a", "fewerbits.io/model=m")] == ["m-old"]
    assert k.list_deployments("b", "fewerbits.io/model=m") == [] and not k.apps.list_namespaced_deployment.called
    k.delete_deployment("a", "m-old")
    k.apps.list_namespaced_deployment.return_value = mock.MagicMock(items=[])
    assert k.list_deployments("a", "fewerbits.io/model=m") == []
    assert k.apps.list_namespaced_deployment.call_count == 1  # live: the index still holds the deleted one
    feed("deployments", "DELETED", child("a", "m-old", "3", ["m"]))
    k.list_deployments("a", "fewerbits.io/model=m")
    assert k.apps.list_namespaced_deployment.call_count == 1
    k.list_deployments("a", "fewerbits.io/model in (m)")  # a selector the view does not read: live
    assert k.apps.list_namespaced_deployment.call_count == 2


def test_a_models_service_comes_from_the_index_and_a_missing_or_foreign_one_is_read_live():
    """Each resync reads the model's Service (observe._exposure): from the index of the Services
    the operator labels as its own, once it holds our last write; one it does not hold (not created
    yet, or a Service of that name the operator does not manage) is read by name."""
    op, feed = wired()
    k = fake_kube(op)
    feed("models", None, qm("a", "m", "1"))  # kopf has listed: the indexes are synced
    svc = child("a", "m", "4", ["m"])
    feed.indexers["services"].replace(("a", "m", "u-a-m"), index_entry(svc))
    assert k.get_service("a", "m")["metadata"]["resourceVersion"] == "4"
    assert not k.core.read_namespaced_service.called
    k.core.read_namespaced_service.return_value = {"metadata": {"name": "x", "resourceVersion": "9"}}
    assert k.get_service("a", "x")["metadata"]["resourceVersion"] == "9"  # not held: live
    k.core.patch_namespaced_service.return_value = child("a", "m", "5", ["m"])
    k.patch_service("a", "m", {"spec": {}})
    k.core.read_namespaced_service.return_value = child("a", "m", "5", ["m"])
    assert k.get_service("a", "m")["metadata"]["resourceVersion"] == "5"  # the index holds 4: live
    assert k.core.read_namespaced_service.call_count == 2
    feed.indexers["services"].replace(("a", "m", "u-a-m"), index_entry(child("a", "m", "5", ["m"])))
    k.get_service("a", "m")
    assert k.core.read_namespaced_service.call_count == 2  # the index again


def test_lists_come_from_the_indexes_for_the_operators_own_scope_once_synced():
    op, _ = wired()
    k = fake_kube(op)
    k.core.list_node.return_value = mock.MagicMock(items=[{"metadata": {"name": "live"}}])
    k.custom.list_cluster_custom_object.return_value = {"items": []}
    assert [n["metadata"]["name"] for n in k.list_nodes()] == ["live"]  # kopf has not listed yet
    feed = Fed(op)
    feed("nodes", None, {"metadata": {"name": "cached", "uid": "n", "resourceVersion": "1"}})
    feed("models", None, qm("a", "m", "1"))
    k.core.list_node.reset_mock()
    k.custom.list_cluster_custom_object.reset_mock()
    assert [n["metadata"]["name"] for n in k.list_nodes()] == ["cached"] and k.list_policies() == []
    assert [o["metadata"]["name"] for o in k.list_models([])] == ["m"]
    assert not k.core.list_node.called and not k.custom.list_cluster_custom_object.called
    k.custom.list_namespaced_custom_object.return_value = {"items": []}
    assert k.list_models(["other"]) == []  # not what the indexes cover: live


def test_selectors_slimming_and_copies():
    assert selector_matches("a=b,c!=d", {"a": "b", "c": "e"}) is True
    assert selector_matches("a==b", {"a": "c"}) is False and selector_matches("c!=d", {"c": "d"}) is False
    assert selector_matches("a in (b)", {}) is None and selector_matches("a", {}) is None
    obj = {"metadata": {"name": "x", "managedFields": [{"manager": "kubectl"}]}, "spec": {}}
    assert without_managed_fields(obj) == {"metadata": {"name": "x"}, "spec": {}} and "managedFields" in obj["metadata"]
    op, feed = wired()
    feed("models", None, qm("a", "m", "1", labels={"x": "y"}))
    op.views["models"].items()[0]["metadata"]["labels"].clear()
    assert op.views["models"].get("a", "m")["metadata"]["labels"] == {"x": "y"}


def test_compact_shares_keys_and_short_strings_across_objects():
    """Two watch events are two json.loads: equal keys and values are distinct objects until compacted."""
    text = json.dumps({"metadata": {"namespace": "team-a", "annotations": {"note": "n" * 100}},
                       "spec": {"containers": [{"imagePullPolicy": "IfNotPresent", "ports": [8000]}]}})
    a, b = json.loads(text), json.loads(text)
    ka, kb = (next(k for k in o["metadata"] if k == "namespace") for o in (a, b))
    assert ka is not kb and a["metadata"]["namespace"] is not b["metadata"]["namespace"]
    ca, cb = compact(a), compact(b)
    assert ca == a and ca is not a and ca["spec"]["containers"] is not a["spec"]["containers"]  # a deep copy
    key = lambda o: next(k for k in o["metadata"] if k == "namespace")  # noqa: E731
    assert key(ca) is key(cb) and ca["metadata"]["namespace"] is cb["metadata"]["namespace"]
    pull = [o["spec"]["containers"][0]["imagePullPolicy"] for o in (ca, cb)]
    assert pull[0] is pull[1]
    long_a, long_b = (o["metadata"]["annotations"]["note"] for o in (ca, cb))
    assert long_a == long_b and long_a is not long_b  # longer than SHARED_STR_MAX: kept as parsed


# ------------------------------------------------------------------ liveness and packaging


def test_the_probe_passes_while_every_thread_runs_and_fails_naming_the_one_that_stopped():
    import threading

    op = Operator()
    gate = threading.Event()
    op._spawn(gate.wait, "fewerbits-worker-0")
    assert op.probe() == "ok"
    gate.set()
    op._threads[0].join(5)
    with pytest.raises(RuntimeError, match="fewerbits-worker-0"):
        op.probe()


async def test_a_start_up_the_api_server_does_not_answer_is_tried_again_in_seconds_without_a_traceback():
    """kopf retries a failed on.startup a minute later and logs its traceback; the API server
    restarting while a replica starts is a temporary error, tried again in 2 s (bench/soak.py found it)."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    from fewerbits_operator.runtime.handlers import STARTUP_RETRY_SECONDS, api_unavailable

    refused = urllib3.exceptions.MaxRetryError(None, "/apis/leaderworkerset.x-k8s.io/v1",
                                               urllib3.exceptions.NewConnectionError(None, "Connection refused"))
    failures = [refused, ApiException(status=503), ApiException(status=429), ConnectionResetError()]
    assert all(api_unavailable(e) for e in failures)
    assert not any(api_unavailable(e) for e in (ApiException(status=403), ValueError("a bug"), KeyError("x")))

    class Starting(Operator):
        def __init__(self, error: BaseException):
            super().__init__()
            self.error = error

        def on_startup(self, *args: Any, **kwargs: Any) -> None:
            raise self.error

    for error, expected in ((refused, kopf.TemporaryError), (ValueError("a bug"), ValueError)):
        registry = kopf.OperatorRegistry()
        register(Starting(error), kopf_scope([]), registry)
        handler = next(h for h in registry._activities.get_all_handlers() if h.fn.__name__ == "startup")
        with pytest.raises(expected) as info:
            await handler.fn(settings=kopf.OperatorSettings(), **{f"{k}_index": {} for k in (*KINDS, *INDEXED)})
        if expected is kopf.TemporaryError:
            assert info.value.delay == STARTUP_RETRY_SECONDS and "did not answer at start" in str(info.value)


async def liveness(op: Operator) -> tuple[int, str]:
    """One GET of kopf's own health server (what the chart's livenessProbe asks) with handlers.py's
    probe, a fresh server each time (kopf keeps a passing answer for 10 s)."""
    import socket

    import aiohttp
    from kopf._core.engines.indexing import OperatorIndexers
    from kopf._core.engines.probing import health_reporter

    registry = kopf.OperatorRegistry()
    register(op, kopf_scope([]), registry)
    indexers = OperatorIndexers()
    indexers.ensure(registry._indexing.get_all_handlers())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = asyncio.Event()
    server = asyncio.create_task(health_reporter(f"http://127.0.0.1:{port}/healthz", memo=kopf.Memo(),
                                                 indices=indexers.indices, registry=registry,
                                                 settings=kopf.OperatorSettings(), ready_flag=ready))
    try:
        await ready.wait()
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as r:
            return r.status, await r.text()
    finally:
        server.cancel()


async def test_kopfs_liveness_endpoint_answers_with_the_runtime_probe():
    import threading

    op = Operator()
    gate = threading.Event()
    op._spawn(gate.wait, "fewerbits-worker-0")
    status, body = await liveness(op)
    assert status == 200 and json.loads(body) == {"runtime": "ok"}
    gate.set()
    op._threads[0].join(5)
    status, _ = await liveness(op)
    assert status == 500  # at once: the probe is not retried inside the request


def test_the_process_is_kopf_and_no_watch_code_of_its_own_remains():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "kopf==1.45.2" in deps
    sources = {p.name: p.read_text() for p in (ROOT / "operator" / "fewerbits_operator").rglob("*.py")}
    assert "informer.py" not in sources
    watchers = [n for n, text in sources.items() if "watch=True" in text or "iter_resp_lines" in text]
    # One exception, outside this process: Kube.watch_raw feeds the activator's caches
    # (activator_cache.py), which run in the activator's own process (activator_main.py, its own
    # Deployment, no kopf there); the operator's process never starts them.
    assert watchers == ["kube.py"]
    users = sorted(n for n, text in sources.items() if "watch_raw" in text and n != "kube.py")
    assert users == ["activator_cache.py"]
    importers = {n for n, text in sources.items() if re.search(r"runtime\.activator_cache import", text)}
    assert importers <= {"activator.py", "activator_main.py"}
    assert not [n for n in ("runner.py", "handlers.py", "__main__.py")
                if re.search(r"runtime\.activator|runtime import activator", sources[n])]
    assert "kopf.run(" in sources["__main__.py"]


def test_a_secret_found_is_read_once_per_ttl_and_a_missing_one_every_time():
    """At rest every model's pass reads its storage Secret (observe.py): one GET per Secret and
    resync period serves the namespace's models; a Secret not found is not kept, so one created
    after its model is seen by the next pass."""
    op, _ = wired()
    k = fake_kube(op)
    k.use_views([], op.views, read_ttl_seconds=30)  # runner.py: the resync period
    now = [0.0]
    assert k._secrets.ttl == 30
    k._secrets._clock = lambda: now[0]
    k.core.read_namespaced_secret.side_effect = ApiException(status=404)
    assert k.secret_data("a", "s3") is None and k.secret_data("a", "s3") is None
    assert k.core.read_namespaced_secret.call_count == 2
    k.core.read_namespaced_secret.side_effect = None
    k.core.read_namespaced_secret.return_value = mock.MagicMock(data={"AWS_ACCESS_KEY_ID": "a2V5"})
    for _ in range(3):
        assert k.secret_data("a", "s3") == {"AWS_ACCESS_KEY_ID": "key"}
    assert k.core.read_namespaced_secret.call_count == 3
    k.secret_data("b", "s3")  # another namespace's Secret of the same name: its own GET
    assert k.core.read_namespaced_secret.call_count == 4
    now[0] = 31  # a rotation reaches the models within the TTL
    k.core.read_namespaced_secret.return_value = mock.MagicMock(data={"AWS_ACCESS_KEY_ID": "bmV3"})
    assert k.secret_data("a", "s3") == {"AWS_ACCESS_KEY_ID": "new"}
    assert k.core.read_namespaced_secret.call_count == 5
